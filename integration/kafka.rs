//! The Kafka source end to end against a real Kafka-protocol broker: `tansu` with its SQLite
//! storage engine, started by each test on a free port (`./test` installs the binary). Messages
//! are produced with the `rskafka` client, the same one the source uses to read.
//!
//! Exactly-once is checked by lineage: every good message's `(partition, offset)` appears in the
//! output exactly once, every malformed one in the dead-letter table exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rskafka::client::partition::{Compression, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;

use crate::support::*;

/// A `tansu` broker with SQLite storage in a temporary folder; killed when dropped.
struct Broker {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Broker {
    fn start() -> Broker {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut broker = Broker {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        broker.restart();
        broker
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn db(&self) -> PathBuf {
        self.dir.path().join("tansu.db")
    }

    /// Starts the broker process (again) on the same port and storage, and waits until it
    /// accepts connections.
    fn restart(&mut self) {
        assert!(self.child.is_none(), "the broker is already running");
        let bin = std::env::var("TANSU").unwrap_or_else(|_| "tansu".into());
        let url = format!("tcp://{}", self.addr());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("tansu.log"))
            .unwrap();
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .arg("--storage-engine")
            // tansu takes the part after `sqlite://` minus one `/` as the path.
            .arg(format!("sqlite:///{}", self.db().display()))
            .env("RUST_LOG", "warn")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start the Kafka broker '{bin}' ({e}); ./test installs it with \
                     `cargo install tansu --version 0.6.0 --locked --features libsql`"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(self.addr()).is_err() {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().unwrap());
            if exited.is_some() || Instant::now() > deadline {
                panic!(
                    "tansu did not start listening ({exited:?}):\n{}",
                    std::fs::read_to_string(self.dir.path().join("tansu.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    async fn client(&self) -> Client {
        ClientBuilder::new(vec![self.addr()]).build().await.unwrap()
    }

    /// Creates a topic whose records the broker deletes once older than `retention_ms`
    /// (checked when the broker starts, then every 10 minutes).
    fn create_topic_with_retention(&self, topic: &str, retention_ms: u64) {
        let bin = std::env::var("TANSU").unwrap_or_else(|_| "tansu".into());
        let status = Command::new(bin)
            .args(["topic", "create", "--partitions", "1", "--broker"])
            .arg(format!("tcp://{}", self.addr()))
            .args(["--config", "cleanup.policy=delete", "--config"])
            .arg(format!("retention.ms={retention_ms}"))
            .arg(topic)
            .status()
            .unwrap();
        assert!(status.success());
    }

    async fn earliest(&self, topic: &str, partition: i32) -> i64 {
        let client = self.client().await;
        let pc = client
            .partition_client(topic, partition, UnknownTopicHandling::Retry)
            .await
            .unwrap();
        pc.get_offset(rskafka::client::partition::OffsetAt::Earliest)
            .await
            .unwrap()
    }

    async fn create_topic(&self, topic: &str, partitions: i32) {
        let client = self.client().await;
        client
            .controller_client()
            .unwrap()
            .create_topic(topic, partitions, 1, 5_000)
            .await
            .unwrap();
    }

    /// Adds one partition to `topic`. tansu 0.6 does not implement the CreatePartitions API, so
    /// this does in its store what its own topic creation does for each partition, while the
    /// broker runs; the broker reads topic metadata from the store on every request.
    fn add_partition(&self, topic: &str) {
        let script = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=30)
with db:
    tid, n = db.execute("select id, partitions from topic where name = ?", (sys.argv[2],)).fetchone()
    db.execute("update topic set partitions = ? where id = ?", (n + 1, tid))
    cur = db.execute("insert into topition (topic, partition) values (?, ?)", (tid, n))
    db.execute("insert into watermark (topition, low, high) values (?, 0, 0)", (cur.lastrowid,))
"#;
        let status = Command::new("python3")
            .args(["-c", script])
            .arg(self.db())
            .arg(topic)
            .status()
            .unwrap();
        assert!(status.success(), "adding a partition failed");
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a produced message should become.
#[derive(Debug, Default)]
struct Produced {
    /// `(partition, offset)` of every good message, with its id.
    good: BTreeMap<(String, i64), i64>,
    /// `(partition, offset)` of every malformed message.
    bad: BTreeSet<(String, i64)>,
}

/// Produces `count` keyed JSON messages with ids `first..first + count`, round-robin over
/// `partitions`; every 23rd is malformed.
async fn produce(
    broker: &Broker,
    topic: &str,
    partitions: &[i32],
    first: i64,
    count: i64,
    produced: &mut Produced,
) {
    let now = chrono::Utc::now();
    produce_at(broker, topic, partitions, first, count, now, produced).await;
}

/// [`produce`] with a given broker timestamp on every message.
async fn produce_at(
    broker: &Broker,
    topic: &str,
    partitions: &[i32],
    first: i64,
    count: i64,
    timestamp: chrono::DateTime<chrono::Utc>,
    produced: &mut Produced,
) {
    let client = broker.client().await;
    let mut by_partition: BTreeMap<i32, Vec<(i64, Record)>> = BTreeMap::new();
    for id in first..first + count {
        let p = partitions[(id as usize) % partitions.len()];
        let value = if id % 23 == 5 {
            format!("{{\"id\": {id}, \"user\": ")
        } else {
            format!(
                "{{\"id\": {id}, \"user\": \"u{}\", \"amount\": {}.5, \"ts\": \"2026-11-29T10:{:02}:{:02}Z\"}}",
                id % 7,
                id % 100,
                (id / 60) % 60,
                id % 60
            )
        };
        let record = Record {
            key: Some(format!("u{}", id % 7).into_bytes()),
            value: Some(value.into_bytes()),
            headers: BTreeMap::from([("source".to_string(), b"test".to_vec())]),
            timestamp,
        };
        by_partition.entry(p).or_default().push((id, record));
    }
    for (p, records) in by_partition {
        let pc = client
            .partition_client(topic, p, UnknownTopicHandling::Retry)
            .await
            .unwrap();
        let (ids, records): (Vec<i64>, Vec<Record>) = records.into_iter().unzip();
        let offsets = pc
            .produce(records, Compression::NoCompression)
            .await
            .unwrap();
        for (id, offset) in ids.into_iter().zip(offsets) {
            let key = (p.to_string(), offset);
            if id % 23 == 5 {
                produced.bad.insert(key);
            } else {
                produced.good.insert(key, id);
            }
        }
    }
}

/// A job reading `topic` (40 records per batch unless `extra` says otherwise) into `out/`.
fn write_kafka_job(dir: &Path, broker: &Broker, topic: &str, extra: &str, trigger: &str) -> String {
    let budget = if extra.contains("max_records_per_batch") {
        ""
    } else {
        "max_records_per_batch = 40"
    };
    let text = format!(
        r#"
[job]
id = "kafka_{topic}"

[sources.clicks]
kind = "kafka"
bootstrap_servers = "{addr}"
topic = "{topic}"
{budget}
schema = "id BIGINT, user VARCHAR, amount DOUBLE, ts VARCHAR"
event_time = "ts"
{extra}

[sink]
kind = "delta"
path = "out"

[trigger]
{trigger}

[query]
sql = "SELECT id, user, amount, ts, _partition, _offset, CAST(_key AS VARCHAR) AS key FROM clicks"
"#,
        addr = broker.addr()
    );
    let path = dir.join(format!("{topic}.toml"));
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// Asserts the output holds every good message exactly once (by lineage and by id) and the
/// dead-letter table every malformed one exactly once.
async fn assert_exactly_once(out: &Path, produced: &Produced) {
    let mut seen: BTreeMap<(String, i64), Vec<i64>> = BTreeMap::new();
    for row in table_values(out, &[]).await {
        let partition = row["_source_partition"].as_str().unwrap().to_string();
        let offset = row["_source_offset"].as_i64().unwrap();
        assert_eq!(row["_partition"].to_string(), partition, "{row:?}");
        assert_eq!(row["_offset"].as_i64(), Some(offset), "{row:?}");
        seen.entry((partition, offset))
            .or_default()
            .push(row["id"].as_i64().unwrap());
    }
    let duplicated: Vec<_> = seen.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(duplicated.is_empty(), "duplicated messages: {duplicated:?}");
    let got: BTreeMap<(String, i64), i64> = seen.into_iter().map(|(k, v)| (k, v[0])).collect();
    let missing: Vec<_> = produced
        .good
        .keys()
        .filter(|k| !got.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "lost {} messages: {missing:?}",
        missing.len()
    );
    assert_eq!(got, produced.good, "output differs from what was produced");

    let letters: Vec<(String, i64)> = table_values(&dead_letter_table(out), &[])
        .await
        .iter()
        .map(|r| {
            (
                r["_source_partition"].as_str().unwrap().to_string(),
                r["_source_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    let unique: BTreeSet<(String, i64)> = letters.iter().cloned().collect();
    assert_eq!(letters.len(), unique.len(), "duplicated dead letters");
    assert_eq!(
        unique, produced.bad,
        "dead letters differ from the malformed messages"
    );
}

/// The trigger of the jobs that keep running while a test changes the broker.
const EVERY_200MS: &str = "mode = \"interval\"\ninterval = \"200ms\"";

/// A job reading `topic` every 200 ms, running in the background.
struct LiveJob {
    /// The job file.
    job: String,
    /// Its stderr.
    log: PathBuf,
    child: Child,
    /// Its output table.
    out: PathBuf,
}

impl LiveJob {
    /// Writes the job file into `dir` (see [`write_kafka_job`]) and starts `sluice run` on it.
    fn start(dir: &Path, broker: &Broker, topic: &str, extra: &str) -> LiveJob {
        let job = write_kafka_job(dir, broker, topic, extra, EVERY_200MS);
        LiveJob::spawn(dir, job)
    }

    /// [`LiveJob::start`] serving its metrics and `/healthz` on a free port (see
    /// `served_address_in`).
    fn start_watched(dir: &Path, broker: &Broker, topic: &str) -> LiveJob {
        let job = write_kafka_job(dir, broker, topic, "", EVERY_200MS);
        let text = std::fs::read_to_string(&job).unwrap().replacen(
            "\n\n[sources.clicks]",
            "\nmetrics_addr = \"127.0.0.1:0\"\n\n[sources.clicks]",
            1,
        );
        std::fs::write(&job, text).unwrap();
        LiveJob::spawn(dir, job)
    }

    /// Starts `sluice run` on the job file `job` written into `dir`.
    fn spawn(dir: &Path, job: String) -> LiveJob {
        let log = dir.join("job.log");
        let child = spawn_job(&job, &log);
        LiveJob {
            job,
            log,
            child,
            out: dir.join("out"),
        }
    }

    /// Waits until its output table holds `rows` rows.
    async fn wait_for_rows(&mut self, rows: usize) {
        wait_for_rows(&self.out, rows, &mut self.child, &self.log).await;
    }

    /// What it logged so far.
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A copy of its job file with trigger `available-now`, for a bounded run to the end.
    fn available_now_copy(&self) -> String {
        let copy = self.job.replace(".toml", "_now.toml");
        let text = std::fs::read_to_string(&self.job)
            .unwrap()
            .replace(EVERY_200MS, "mode = \"available-now\"");
        std::fs::write(&copy, text).unwrap();
        copy
    }
}

/// Spawns `sluice run JOB` with its log going to `log`.
fn spawn_job(job: &str, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    sluice_command()
        .args(["run", job])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// SIGTERM, then the exit status.
fn terminate(child: &mut Child) -> std::process::ExitStatus {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap()
}

/// Waits until the output table holds `rows` rows.
async fn wait_for_rows(out: &Path, rows: usize, child: &mut Child, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if out.join("_delta_log").exists()
            && read_table(out)
                .await
                .iter()
                .map(|b| b.num_rows())
                .sum::<usize>()
                >= rows
        {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the job exited ({status}) before writing {rows} rows:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {rows} rows:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_and_restart_while_producing_gives_every_message_exactly_once() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("orders", 4).await;
    let partitions = [0, 1, 2, 3];
    let mut produced = Produced::default();
    produce(&broker, "orders", &partitions, 0, 1200, &mut produced).await;
    let job = write_kafka_job(ws.path(), &broker, "orders", "", "mode = \"available-now\"");

    // Kills at named steps of the commit protocol.
    for (point, batch) in [
        ("after_intent", 1),
        ("after_manifest", 3),
        ("after_commit", 5),
    ] {
        let out = run_sluice(
            &["run", &job],
            &[("SLUICE_CRASH_AT", &format!("{point}:{batch}"))],
        );
        assert_eq!(
            out.status.signal(),
            Some(9),
            "expected a SIGKILL at {point}:{batch}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Kills at arbitrary moments, with more messages produced between runs.
    let mut kills = 0;
    for round in 0..6 {
        let mut child = sluice_command()
            .args(["run", &job])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700 + 250 * round)).await;
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        produce(
            &broker,
            "orders",
            &partitions,
            1200 + round as i64 * 100,
            100,
            &mut produced,
        )
        .await;
    }
    assert!(
        kills >= 3,
        "only {kills} random kills landed; the job finished too soon"
    );
    assert_ok(&run_sluice(&["run", &job], &[]));

    let out = ws.path().join("out");
    assert_exactly_once(&out, &produced).await;
    assert_eq!(produced.good.len() + produced.bad.len(), 1800);
    let versions = txn_versions(&out, "kafka_orders");
    assert_eq!(versions, (0..versions.len() as i64).collect::<Vec<_>>());

    // `status` shows the committed offsets and the consumer lag per partition.
    let text = status_of(&out);
    assert!(text.contains("consumer lag"), "{text}");
    assert!(text.contains("\"3\":450"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_outage_mid_run_is_waited_out_and_nothing_is_lost() {
    let mut broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("payments", 4).await;
    let partitions = [0, 1, 2, 3];
    let mut produced = Produced::default();
    produce(&broker, "payments", &partitions, 0, 600, &mut produced).await;
    let mut live = LiveJob::start_watched(ws.path(), &broker, "payments");
    live.wait_for_rows(40).await;
    let addr = served_address_in(&live.log_text()).expect("the job serves /healthz");
    assert_eq!(http_get(&addr, "/healthz").0, 200);

    broker.stop();
    // The driver waits for the broker: no batch is planned or committed, and /healthz says so
    // within three trigger intervals.
    let stopped = std::time::Instant::now();
    while http_get(&addr, "/healthz").0 != 503 {
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "/healthz still 200 with the broker down"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        live.child.try_wait().unwrap().is_none(),
        "the job gave up while the broker was down"
    );
    assert_eq!(http_get(&addr, "/healthz").0, 503);
    broker.restart();
    produce(&broker, "payments", &partitions, 600, 200, &mut produced).await;

    live.wait_for_rows(produced.good.len()).await;
    assert_eq!(
        http_get(&addr, "/healthz").0,
        200,
        "the job commits again: healthy"
    );
    let log_text = live.log_text();
    let status = terminate(&mut live.child);
    assert!(status.success(), "{status}:\n{log_text}");
    assert!(
        log_text.contains("kafka broker unavailable; retrying"),
        "no retry line in the log:\n{log_text}"
    );
    assert!(
        log_text.contains("kafka broker answers again"),
        "{log_text}"
    );
    for line in log_text.lines().filter(|l| l.contains("kafka broker")) {
        println!("{line}");
    }
    assert_exactly_once(&live.out, &produced).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partition_added_while_running_is_read_from_its_start() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("growing", 2).await;
    let mut produced = Produced::default();
    produce(&broker, "growing", &[0, 1], 0, 100, &mut produced).await;
    let mut live = LiveJob::start(ws.path(), &broker, "growing", "");
    live.wait_for_rows(produced.good.len()).await;

    broker.add_partition("growing");
    produce(&broker, "growing", &[2], 100, 60, &mut produced).await;
    produce(&broker, "growing", &[0, 1, 2], 160, 30, &mut produced).await;
    live.wait_for_rows(produced.good.len()).await;
    let log_text = live.log_text();
    assert!(terminate(&mut live.child).success());
    assert!(
        produced.good.keys().any(|(p, _)| p == "2"),
        "nothing was produced to the new partition"
    );
    assert_exactly_once(&live.out, &produced).await;
    assert!(log_text.contains("new partition"), "{log_text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_range_starting_offsets_and_missing_topics_are_clear_errors() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("small", 2).await;
    let mut produced = Produced::default();
    produce(&broker, "small", &[0, 1], 0, 20, &mut produced).await;

    let job = write_kafka_job(
        ws.path(),
        &broker,
        "small",
        "starting_offsets = { \"0\" = 1000 }",
        "mode = \"once\"",
    );
    let out = run_sluice(&["run", &job], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "topic small partition 0: offset 1000 is out of range: the broker holds offsets \
             0..10 (starting_offsets.\"0\" = 1000)"
        ),
        "{stderr}"
    );
    assert!(
        !ws.path().join("out").join("_delta_log").exists(),
        "nothing may be written"
    );

    let job = write_kafka_job(
        ws.path(),
        &broker,
        "small",
        "starting_offsets = { \"7\" = 0 }",
        "mode = \"once\"",
    );
    let stderr = String::from_utf8_lossy(&run_sluice(&["run", &job], &[]).stderr).to_string();
    assert!(
        stderr.contains("starting_offsets names partition '7', which the topic does not have"),
        "{stderr}"
    );

    let missing = write_kafka_job(ws.path(), &broker, "absent", "", "mode = \"once\"");
    let out = run_sluice(&["run", &missing], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("topic 'absent': no such topic"), "{stderr}");

    // Within range: a bounded run from offset 5 of partition 0 reads exactly 5..10 there.
    let job = write_kafka_job(
        ws.path(),
        &broker,
        "small",
        "starting_offsets = { \"0\" = 5 }",
        "mode = \"available-now\"",
    );
    assert_ok(&run_sluice(&["run", &job], &[]));
    let rows = table_values(&ws.path().join("out"), &[]).await;
    let offsets: BTreeSet<(String, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["_source_partition"].as_str().unwrap().to_string(),
                r["_source_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    let want: BTreeSet<(String, i64)> = produced
        .good
        .keys()
        .filter(|(p, o)| p == "1" || *o >= 5)
        .cloned()
        .collect();
    assert_eq!(offsets, want);
}

#[tokio::test(flavor = "multi_thread")]
async fn records_deleted_by_retention_before_they_were_read_stop_the_job_or_become_a_counted_gap() {
    let mut broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic_with_retention("retained", 3_600_000);
    let mut produced = Produced::default();
    let two_days_ago = chrono::Utc::now() - chrono::Duration::days(2);
    produce_at(
        &broker,
        "retained",
        &[0],
        0,
        20,
        two_days_ago,
        &mut produced,
    )
    .await;
    produce(&broker, "retained", &[0], 20, 10, &mut produced).await;

    // A starting time resolves to the first offset at or after it (broker timestamps).
    let by_time = tempfile::tempdir().unwrap();
    let since = (chrono::Utc::now() - chrono::Duration::days(1)).to_rfc3339();
    let job = write_kafka_job(
        by_time.path(),
        &broker,
        "retained",
        &format!("starting_offsets = \"{since}\""),
        "mode = \"available-now\"",
    );
    assert_ok(&run_sluice(&["run", &job], &[]));
    let offsets: BTreeSet<i64> = table_values(&by_time.path().join("out"), &[])
        .await
        .iter()
        .map(|r| r["_source_offset"].as_i64().unwrap())
        .collect();
    let recent: BTreeSet<i64> = produced
        .good
        .keys()
        .map(|(_, o)| *o)
        .filter(|o| *o >= 20)
        .collect();
    assert_eq!(offsets, recent);

    let job = write_kafka_job(
        ws.path(),
        &broker,
        "retained",
        "max_records_per_batch = 10",
        "mode = \"once\"",
    );
    assert_ok(&run_sluice(&["run", &job], &[]));

    // The broker restarts and its retention deletes the 20 old records; the job has read 0..10.
    broker.stop();
    broker.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    while broker.earliest("retained", 0).await != 20 {
        assert!(Instant::now() < deadline, "retention did not run");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = run_sluice(&["run", &job], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "data loss on topic retained partition 0: offset 10 is needed but the earliest \
             offset the broker still holds is 20"
        ),
        "{stderr}"
    );

    // With fail_on_data_loss = false the gap is skipped, counted as one dead letter per batch
    // that met it, and everything still held is read.
    let lenient = std::fs::read_to_string(&job)
        .unwrap()
        .replace("[sink]", "fail_on_data_loss = false\n\n[sink]");
    std::fs::write(&job, lenient).unwrap();
    let out = run_sluice(&["run", &job, "--trigger", "available-now"], &[]);
    assert_ok(&out);
    let rows = table_values(&ws.path().join("out"), &[]).await;
    let offsets: BTreeSet<i64> = rows
        .iter()
        .map(|r| r["_source_offset"].as_i64().unwrap())
        .collect();
    let want: BTreeSet<i64> = produced
        .good
        .keys()
        .map(|(_, o)| *o)
        .filter(|o| *o < 10 || *o >= 20)
        .collect();
    assert_eq!(offsets, want);
    let letters = table_values(&dead_letter_table(&ws.path().join("out")), &[]).await;
    let gaps: Vec<&str> = letters
        .iter()
        .filter_map(|r| r["error"].as_str())
        .filter(|e| e.starts_with("data loss"))
        .collect();
    assert_eq!(
        gaps,
        vec![
            "data loss: offsets 10..20 of topic retained partition 0 were deleted from the \
             broker before this job read them; skipped (fail_on_data_loss = false)"
        ]
    );
}

/// The watermark `sluice status` reports for the table at `out`.
fn status_watermark(out: &Path) -> String {
    let text = status_of(out);
    let watermark =
        status_field(&text, "watermark").unwrap_or_else(|| panic!("no watermark in:\n{text}"));
    // `2026-11-29T10:15:50Z (1795… µs since the epoch)`
    watermark.split(' ').next().unwrap().to_string()
}

/// Partition 0 of `topic` delivers events at 10:`minutes`, one every 300 ms, ids from
/// `first_id`.
async fn keep_partition_0_going(
    broker: &Broker,
    topic: &str,
    first_id: i64,
    minutes: std::ops::RangeInclusive<i64>,
) {
    let first_minute = *minutes.start();
    for minute in minutes {
        let ts = format!("2026-11-29T10:{minute:02}:00Z");
        produce_event(broker, topic, 0, first_id + minute - first_minute, &ts).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Produces one JSON event with event time `ts` to `partition`.
async fn produce_event(broker: &Broker, topic: &str, partition: i32, id: i64, ts: &str) {
    let client = broker.client().await;
    let pc = client
        .partition_client(topic, partition, UnknownTopicHandling::Retry)
        .await
        .unwrap();
    let value = format!("{{\"id\": {id}, \"user\": \"u\", \"amount\": 1.0, \"ts\": \"{ts}\"}}");
    pc.produce(
        vec![Record {
            key: None,
            value: Some(value.into_bytes()),
            headers: BTreeMap::new(),
            timestamp: chrono::Utc::now(),
        }],
        Compression::NoCompression,
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_silent_partition_holds_the_watermark_unless_idle_timeout_releases_it() {
    let broker = Broker::start();
    broker.create_topic("sparse", 2).await;
    // Partition 1 speaks once, early; partition 0 keeps going.
    produce_event(&broker, "sparse", 1, 0, "2026-11-29T10:00:00Z").await;
    for (i, minute) in (1..=10).enumerate() {
        let ts = format!("2026-11-29T10:{minute:02}:00Z");
        produce_event(&broker, "sparse", 0, i as i64 + 1, &ts).await;
    }

    // Without idle_timeout: the watermark stays at partition 1's event − 10 s while partition 0
    // moves on and partition 1 stays silent.
    let holds = tempfile::tempdir().unwrap();
    let mut live = LiveJob::start(
        holds.path(),
        &broker,
        "sparse",
        "max_out_of_orderness = \"10s\"",
    );
    live.wait_for_rows(11).await;
    keep_partition_0_going(&broker, "sparse", 11, 11..=15).await;
    live.wait_for_rows(16).await;
    assert!(terminate(&mut live.child).success());
    assert_eq!(status_watermark(&live.out), "2026-11-29T09:59:50Z");

    // With idle_timeout = 1s: once partition 1 has been silent that long, the watermark follows
    // partition 0 alone (10:16:00 − 10 s). (With every partition silent it would hold.)
    let released = tempfile::tempdir().unwrap();
    let mut live = LiveJob::start(
        released.path(),
        &broker,
        "sparse",
        "max_out_of_orderness = \"10s\"\nidle_timeout = \"1s\"",
    );
    live.wait_for_rows(16).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    produce_event(&broker, "sparse", 0, 16, "2026-11-29T10:16:00Z").await;
    live.wait_for_rows(17).await;
    let log_text = live.log_text();
    assert!(terminate(&mut live.child).success());
    assert_eq!(
        status_watermark(&live.out),
        "2026-11-29T10:15:50Z",
        "{log_text}"
    );
    assert!(log_text.contains("idle=1"), "{log_text}");

    // A restart keeps the watermark (it is in the manifest), and a late event on partition 1
    // does not move it backwards.
    produce_event(&broker, "sparse", 1, 99, "2026-11-29T09:00:00Z").await;
    assert_ok(&run_sluice(&["run", &live.available_now_copy()], &[]));
    assert_eq!(status_watermark(&live.out), "2026-11-29T10:15:50Z");
}

/// Windows per minute over the Kafka test schema (event time is the `ts` string).
const WINDOWED_KAFKA_SQL: &str = "sql = \"SELECT window_start, count(*) AS n, max(id) AS last_id \
     FROM tumble(clicks, ts, INTERVAL '1' MINUTE) GROUP BY window_start\"";

/// Waits until `sluice status` shows `wanted` in the end offsets.
async fn wait_for_offsets(wanted: &str, live: &mut LiveJob) {
    let out = live.out.clone();
    let out = out.as_path();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if out.join("_delta_log").exists() {
            let status = status_of(out);
            if status_field(&status, "end offsets").is_some_and(|o| o.contains(wanted)) {
                return;
            }
        }
        assert!(
            live.child.try_wait().unwrap().is_none(),
            "the job exited: {}",
            live.log_text()
        );
        assert!(Instant::now() < deadline, "{}", live.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn windows_close_past_a_silent_partition_only_with_idle_timeout() {
    let broker = Broker::start();
    broker.create_topic("idlewin", 2).await;
    // Partition 1 speaks once, at 10:00; partition 0 goes on to 10:10.
    produce_event(&broker, "idlewin", 1, 0, "2026-11-29T10:00:00Z").await;
    for minute in 1..=10 {
        let ts = format!("2026-11-29T10:{minute:02}:00Z");
        produce_event(&broker, "idlewin", 0, minute, &ts).await;
    }
    let start = |dir: &Path, extra: &str| {
        let job = write_kafka_job(dir, &broker, "idlewin", extra, EVERY_200MS);
        let text = std::fs::read_to_string(&job).unwrap();
        let sql_line = text.lines().find(|l| l.starts_with("sql = ")).unwrap();
        std::fs::write(&job, text.replace(sql_line, WINDOWED_KAFKA_SQL)).unwrap();
        let log = dir.join("job.log");
        let child = spawn_job(&job, &log);
        LiveJob {
            job,
            log,
            child,
            out: dir.join("out"),
        }
    };

    // Without idle_timeout the silent partition holds the watermark at 09:59:50 while partition
    // 0 moves on to 10:15: every event is read, no window closes, nothing is written
    // (documented: visible as watermark lag).
    let holds = tempfile::tempdir().unwrap();
    let mut live = start(holds.path(), "max_out_of_orderness = \"10s\"");
    keep_partition_0_going(&broker, "idlewin", 11, 11..=15).await;
    wait_for_offsets(r#""0":15,"1":1"#, &mut live).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(terminate(&mut live.child).success());
    assert_eq!(status_watermark(&live.out), "2026-11-29T09:59:50Z");
    assert!(table_values(&live.out, &[]).await.is_empty());

    // With idle_timeout = 1s, partition 1 stops counting once silent that long: the watermark
    // follows partition 0 (to 10:20 − 10 s) and the windows 10:00 … 10:18 close and are written.
    let released = tempfile::tempdir().unwrap();
    let mut live = start(
        released.path(),
        "max_out_of_orderness = \"10s\"\nidle_timeout = \"1s\"",
    );
    wait_for_offsets(r#""0":15,"1":1"#, &mut live).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    keep_partition_0_going(&broker, "idlewin", 16, 16..=20).await;
    live.wait_for_rows(19).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let log_text = live.log_text();
    assert!(terminate(&mut live.child).success());
    assert_eq!(status_watermark(&live.out), "2026-11-29T10:19:50Z");
    let rows = table_values(&live.out, &[]).await;
    let mut windows: Vec<(&str, i64)> = rows
        .iter()
        .map(|r| {
            (
                &r["window_start"].as_str().unwrap()[11..16],
                r["n"].as_i64().unwrap(),
            )
        })
        .collect();
    windows.sort();
    let expected: Vec<(String, i64)> = (0..=18).map(|m| (format!("10:{m:02}"), 1)).collect();
    let expected: Vec<(&str, i64)> = expected.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    assert_eq!(windows, expected, "{log_text}");
    assert!(log_text.contains("idle=1"), "{log_text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_waiting_for_a_down_broker_stops_on_a_second_signal_and_resumes_later() {
    let mut broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("stuck", 2).await;
    let mut produced = Produced::default();
    produce(&broker, "stuck", &[0, 1], 0, 100, &mut produced).await;
    let mut live = LiveJob::start(ws.path(), &broker, "stuck", "");
    live.wait_for_rows(40).await;

    broker.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let signal = |child: &Child| {
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap()
    };
    // The first signal asks for the batch in flight to finish — it cannot while the broker is
    // down; the second stops the job at once.
    signal(&live.child);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        live.child.try_wait().unwrap().is_none(),
        "stopped although a batch was in flight"
    );
    signal(&live.child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = live.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the second signal did not stop the job"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Some(130));
    let log_text = live.log_text();
    assert!(log_text.contains("second shutdown signal"), "{log_text}");

    // Nothing was lost: once the broker is back, a run completes the topic exactly once.
    broker.restart();
    assert_ok(&run_sluice(&["run", &live.available_now_copy()], &[]));
    assert_exactly_once(&live.out, &produced).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_pattern_reads_matching_topics_new_ones_too_up_to_ending_offsets() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("multi-a", 2).await;
    broker.create_topic("multi-b", 1).await;
    broker.create_topic("other", 1).await;
    let mut produced = Produced::default();
    for (topic, partitions) in [("multi-a", &[0, 1][..]), ("multi-b", &[0]), ("other", &[0])] {
        produce(&broker, topic, partitions, 0, 10, &mut produced).await;
    }
    let job = ws.path().join("multi.toml");
    std::fs::write(
        &job,
        format!(
            r#"
[job]
id = "multi"

[sources.clicks]
kind = "kafka"
bootstrap_servers = "{addr}"
topic_pattern = "multi-.*"
ending_offsets = {{ "multi-a:0" = 3 }}
schema = "id BIGINT, user VARCHAR, amount DOUBLE, ts VARCHAR"

[sink]
kind = "delta"
path = "out"

[query]
sql = "SELECT id, _topic, _partition, _offset FROM clicks"
"#,
            addr = broker.addr()
        ),
    )
    .unwrap();
    let job = job.to_str().unwrap();
    let read =
        |rows: Vec<serde_json::Map<String, serde_json::Value>>| -> BTreeSet<(String, String, i64)> {
            rows.iter()
                .map(|r| {
                    let lineage = r["_source_partition"].as_str().unwrap().to_string();
                    let id = format!("{}:{}", r["_topic"].as_str().unwrap(), r["_partition"]);
                    assert_eq!(lineage, id, "lineage names topic:partition");
                    (
                        lineage,
                        r["_topic"].as_str().unwrap().to_string(),
                        r["_offset"].as_i64().unwrap(),
                    )
                })
                .collect()
        };
    assert_ok(&run_sluice(&["run", job], &[]));
    let got = read(table_values(&ws.path().join("out"), &[]).await);
    // Only the matching topics; multi-a:0 (ids 0, 2, 4, … at offsets 0, 1, 2, …) stops at
    // offset 3; multi-b:0 holds ids 0..10 with id 5 malformed (a dead letter).
    let topics: BTreeSet<String> = got.iter().map(|(_, t, _)| t.clone()).collect();
    assert_eq!(
        topics,
        BTreeSet::from(["multi-a".to_string(), "multi-b".to_string()])
    );
    let offsets = |partition: &str| -> BTreeSet<i64> {
        got.iter()
            .filter(|(p, _, _)| p == partition)
            .map(|(_, _, o)| *o)
            .collect()
    };
    assert_eq!(offsets("multi-a:0"), BTreeSet::from([0, 1, 2]));
    assert_eq!(
        offsets("multi-a:1").len(),
        4,
        "ids 1, 3, 7, 9 (5 is malformed)"
    );
    assert_eq!(offsets("multi-b:0"), (0..10).filter(|o| *o != 5).collect());

    // A topic created later that matches the pattern is read from its start.
    broker.create_topic("multi-c", 1).await;
    let mut later = Produced::default();
    produce(&broker, "multi-c", &[0], 100, 5, &mut later).await;
    assert_ok(&run_sluice(&["run", job], &[]));
    let got = read(table_values(&ws.path().join("out"), &[]).await);
    let c: BTreeSet<i64> = got
        .iter()
        .filter(|(p, _, _)| p == "multi-c:0")
        .map(|(_, _, o)| *o)
        .collect();
    assert_eq!(c, later.good.keys().map(|(_, o)| *o).collect());
    assert_eq!(c.len(), 5);
}

/// A topic deleted and recreated (or a partition truncated by an unclean leader election) ends
/// below the offsets the job committed: the job stops, naming partition and offsets; with
/// `fail_on_data_loss = false` the skipped offsets become one dead letter, and reading goes on
/// from the committed end once the new log gets there.
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_recreated_below_the_committed_offsets_stops_the_job_or_becomes_one_counted_gap() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("recreated", 1).await;
    let mut produced = Produced::default();
    produce(&broker, "recreated", &[0], 0, 20, &mut produced).await;
    let job = write_kafka_job(
        ws.path(),
        &broker,
        "recreated",
        "",
        "mode = \"available-now\"",
    );
    assert_ok(&run_sluice(&["run", &job], &[]));

    let client = broker.client().await;
    client
        .controller_client()
        .unwrap()
        .delete_topic("recreated", 5_000)
        .await
        .unwrap();
    broker.create_topic("recreated", 1).await;
    let mut recreated = Produced::default();
    produce(&broker, "recreated", &[0], 100, 5, &mut recreated).await;

    let out = run_sluice(&["run", &job], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "data loss on topic recreated partition 0: it now ends at offset 5, below the 20 \
             this job has already read"
        ),
        "{stderr}"
    );

    let lenient = std::fs::read_to_string(&job)
        .unwrap()
        .replace("[sink]", "fail_on_data_loss = false\n\n[sink]");
    std::fs::write(&job, lenient).unwrap();
    assert_ok(&run_sluice(&["run", &job], &[]));
    assert_ok(&run_sluice(&["run", &job], &[]));
    produce(&broker, "recreated", &[0], 200, 20, &mut recreated).await;
    assert_ok(&run_sluice(&["run", &job], &[]));

    let table = ws.path().join("out");
    let gaps: Vec<String> = table_values(&dead_letter_table(&table), &[])
        .await
        .iter()
        .filter_map(|r| r["error"].as_str().map(str::to_string))
        .filter(|e| e.starts_with("data loss"))
        .collect();
    assert_eq!(gaps.len(), 1, "reported once: {gaps:?}");
    assert!(
        gaps[0].contains("topic recreated partition 0 now ends at offset 5, below the 20"),
        "{gaps:?}"
    );
    // Offsets 0..20 of the first topic, then 20..25 of the new one; its 0..20 are the gap.
    let ids: BTreeSet<i64> = table_values(&table, &[])
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    let want: BTreeSet<i64> = produced
        .good
        .values()
        .copied()
        .chain(
            recreated
                .good
                .iter()
                .filter(|((_, o), _)| *o >= 20)
                .map(|(_, id)| *id),
        )
        .collect();
    assert_eq!(ids, want);
}

/// `starting_offsets` is resolved when a run opens the source and recorded put-if-absent; a
/// run that finds another run recorded them first uses theirs ("latest" has moved since).
#[tokio::test(flavor = "multi_thread")]
async fn starting_offsets_recorded_by_another_run_are_the_ones_used() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("adopted", 1).await;
    let mut produced = Produced::default();
    produce(&broker, "adopted", &[0], 0, 10, &mut produced).await;
    let job = write_kafka_job(
        ws.path(),
        &broker,
        "adopted",
        "starting_offsets = \"latest\"",
        "mode = \"once\"",
    );
    // This run resolves "latest" = 10 when it opens, then waits before planning its batch.
    let mut run = Background::start(
        &["run", &job],
        &[("SLUICE_PAUSE_AT", "before_plan:0:3000")],
        &ws.path().join("run.log"),
    );
    run.wait_for_log("pause point reached", 60);
    // Meanwhile another run of the job recorded its starting offsets first.
    let folder = ws.path().join("out/_sluice/kafka_adopted/sources/clicks");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(
        folder.join("starting_offsets.json"),
        r#"{"partitions":{"0":4}}"#,
    )
    .unwrap();
    produce(&broker, "adopted", &[0], 10, 5, &mut produced).await;
    let (status, log) = run.finish();
    assert!(status.success(), "{log}");
    let offsets: BTreeSet<i64> = table_values(&ws.path().join("out"), &[])
        .await
        .iter()
        .map(|r| r["_source_offset"].as_i64().unwrap())
        .collect();
    let want: BTreeSet<i64> = produced
        .good
        .keys()
        .map(|(_, o)| *o)
        .filter(|o| *o >= 4)
        .collect();
    assert_eq!(offsets, want, "{log}");
}

/// Produces to `topic` with the Python transactional producer (see kafka_transactions.py).
fn produce_with_python(broker: &Broker, topic: &str, args: &[&str]) {
    let script = repo_root().join("integration/kafka_transactions.py");
    let out = Command::new("python3")
        .arg(script)
        .args([broker.addr().as_str(), topic])
        .args(args)
        .output()
        .expect("python3 runs (./test installs confluent-kafka)");
    assert!(
        out.status.success(),
        "kafka_transactions.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Read-committed: records of a transaction still open are not read (the job stops at the
/// last stable offset, plain records after it included), and once the transaction is aborted
/// (a producer fenced by its successor) its records are skipped and everything else is read —
/// also when batches end inside the transaction.
#[tokio::test(flavor = "multi_thread")]
async fn records_of_open_and_aborted_transactions_are_never_read() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("txns", 1).await;
    produce_with_python(&broker, "txns", &["plain", "0", "3"]);
    produce_with_python(&broker, "txns", &["open", "tx-1", "100", "3"]);
    produce_with_python(&broker, "txns", &["plain", "3", "3"]);
    let job = ws.path().join("txns.toml");
    std::fs::write(
        &job,
        format!(
            r#"
[job]
id = "txns"

[sources.clicks]
kind = "kafka"
bootstrap_servers = "{addr}"
topic = "txns"
schema = "id BIGINT"
max_records_per_batch = 2

[sink]
kind = "delta"
path = "out"

[query]
sql = "SELECT id, _offset FROM clicks"
"#,
            addr = broker.addr()
        ),
    )
    .unwrap();
    let job = job.to_str().unwrap();
    let out = ws.path().join("out");
    let ids = || sorted_ids(&out);
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_eq!(ids().await, vec![0, 1, 2], "read past an open transaction");

    produce_with_python(&broker, "txns", &["fence", "tx-1"]);
    produce_with_python(&broker, "txns", &["plain", "6", "3"]);
    let run = run_sluice(&["run", job], &[]);
    assert_ok(&run);
    assert_eq!(ids().await, (0..9).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("records of aborted transactions skipped"),
        "{stderr}"
    );
}

/// Produces JSON values to `partition`: ids `ids`, each with the fields of `extra` (`"k": v`).
async fn produce_values(
    broker: &Broker,
    topic: &str,
    partition: i32,
    ids: std::ops::Range<i64>,
    extra: &str,
) {
    let client = broker.client().await;
    let pc = client
        .partition_client(topic, partition, UnknownTopicHandling::Retry)
        .await
        .unwrap();
    let records = ids
        .map(|id| Record {
            key: None,
            value: Some(
                format!(
                    "{{\"id\": {id}, \"ts\": \"2026-11-29T10:00:{:02}Z\"{extra}}}",
                    id % 60
                )
                .into_bytes(),
            ),
            headers: BTreeMap::new(),
            timestamp: chrono::Utc::now(),
        })
        .collect();
    pc.produce(records, Compression::NoCompression)
        .await
        .unwrap();
}

/// Schema evolution on Kafka: a field that appears in every partition at once (a producer
/// deploy) is added once, by whichever partition's read records it first, and every record of
/// every partition carrying it lands with it — none dead-lettered, however the reads interleave.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_field_in_every_partition_at_once_becomes_one_column() {
    let broker = Broker::start();
    let ws = tempfile::tempdir().unwrap();
    broker.create_topic("evolving", 3).await;
    for p in 0..3 {
        let base = i64::from(p) * 1000;
        produce_values(&broker, "evolving", p, base..base + 20, "").await;
    }
    let text = format!(
        r#"
[job]
id = "kafka_evolving"

[sources.clicks]
kind = "kafka"
bootstrap_servers = "{addr}"
topic = "evolving"
max_records_per_batch = 30
event_time = "ts"

[sink]
kind = "delta"
path = "out"

[query]
sql = "SELECT * FROM clicks"
"#,
        addr = broker.addr()
    );
    let job = ws.path().join("job.toml");
    std::fs::write(&job, text).unwrap();
    // The first run infers the schema from the records without the new fields.
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    for p in 0..3 {
        let base = i64::from(p) * 1000;
        produce_values(&broker, "evolving", p, base + 20..base + 30, "").await;
        produce_values(
            &broker,
            "evolving",
            p,
            base + 30..base + 60,
            ", \"plan\": \"pro\", \"seats\": 3",
        )
        .await;
    }
    // Ten records of each partition a batch: the first reads the last records without the
    // fields, and its read ahead of the next (all with them) is declined, that batch reading
    // its records itself; the batches after it are read ahead again.
    let log = (
        "RUST_LOG",
        "info,sluice_engine::input=debug,sluice_engine::driver=debug",
    );
    let second = run_sluice(&["run", job.to_str().unwrap()], &[log]);
    assert_ok(&second);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("the source declined to read this range ahead")
            && stderr.contains("taken from the read ahead"),
        "{stderr}"
    );

    let out = ws.path().join("out");
    let rows = python_read(&out)["rows"].as_array().unwrap().clone();
    assert_eq!(rows.len(), 180, "every record lands");
    for r in &rows {
        let id = r["id"].as_i64().unwrap();
        if id % 1000 < 30 {
            assert!(r["plan"].is_null() && r["seats"].is_null(), "{r}");
        } else {
            assert_eq!(r["plan"], "pro", "{r}");
            assert_eq!(r["seats"], 3, "{r}");
        }
    }
    assert_eq!(
        dead_letter_rows(&out),
        Vec::<serde_json::Value>::new(),
        "no dead letters"
    );
    let evolutions = out.join("_sluice/kafka_evolving/sources/clicks/schemas");
    let recorded = std::fs::read_dir(&evolutions).unwrap().count();
    assert!(
        (1..=3).contains(&recorded),
        "one evolution per partition's read at most: {recorded}"
    );
}
