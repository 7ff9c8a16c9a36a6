//! Object storage: jobs whose input, tables and checkpoint live on a real S3-compatible server
//! ([`S3Server`], one per test).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::s3_server::{S3Server, SECRET};
use crate::support::*;

/// `env` as the `(&str, &str)` pairs `run_sluice` takes.
pub fn pairs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A job file reading `input` and writing `out` (paths or URLs), with `extra` appended to the
/// `[job]` table and `sink_options`/`source_options` as the storage options tables.
fn write_s3_job(path: &Path, input: &str, out: &str, job_extra: &str, options: &str) {
    let text = format!(
        r#"
[job]
id = "s3_job"
{job_extra}

[sources.events]
kind = "files"
path = "{input}"
format = "json"
schema = "id BIGINT, user_id BIGINT, code VARCHAR, amount DOUBLE, ts TIMESTAMP"
event_time = "ts"
max_out_of_orderness = "2s"
max_files_per_batch = 2

[sources.events.storage_options]
{options}

[sink]
kind = "delta"
path = "{out}"

[sink.storage_options]
{options}

[query]
sql = """{STATELESS_SQL}"""
"#
    );
    std::fs::write(path, text).unwrap();
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Input, output table, side tables and checkpoint all on S3: the job's output equals a local
/// run's over the same files, the Python `deltalake` reader reads it from the server, storage
/// options override the environment per location, and the secret key appears nowhere — not in
/// `validate`'s or `run`'s output (at debug level), nor in any object the job wrote.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_on_s3_equals_a_local_run_and_never_shows_its_secret() {
    let server = S3Server::start(&["landing", "lake"]);
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 16, 5);
    server.upload(&input, "landing", "events").await;

    // The environment points at a closed port; the options of each location override it.
    let mut env = server.env();
    env[0].1 = "http://127.0.0.1:9".into();
    let options = format!(
        "aws_endpoint = \"{}\"\naws_secret_access_key = \"{SECRET}\"",
        server.endpoint
    );
    let job = ws.path().join("s3.toml");
    write_s3_job(
        &job,
        "s3://landing/events",
        "s3://lake/out",
        "store_unavailable_timeout = \"20s\"",
        &options,
    );
    let job = job.to_str().unwrap();
    let mut debug_env = pairs(&env);
    debug_env.push(("RUST_LOG", "debug"));

    let validated = run_sluice(&["validate", job], &debug_env);
    assert_ok(&validated);
    let run = run_sluice(&["run", job], &debug_env);
    assert_ok(&run);
    for (what, bytes) in [
        ("validate stdout", &validated.stdout),
        ("validate stderr", &validated.stderr),
        ("run stdout", &run.stdout),
        ("run stderr", &run.stderr),
    ] {
        assert!(
            !String::from_utf8_lossy(bytes).contains(SECRET),
            "the secret key is shown in {what}"
        );
    }

    // What the job wrote: tables, side tables, checkpoint (manifests, intents, state, lease).
    let lake = ws.path().join("lake");
    server.download("lake", "", &lake).await;
    let written = files_under(&lake);
    assert!(
        written
            .iter()
            .any(|p| p.to_string_lossy().contains("_sluice")),
        "no checkpoint on S3: {written:?}"
    );
    for file in &written {
        let bytes = std::fs::read(file).unwrap();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "the secret key is written in {}",
            file.display()
        );
    }

    // The same rows and dead letters as a local run over the same files.
    let reference = ws.path().join("reference");
    let ref_job = write_job(&ws.path().join("ref.toml"), "s3_job", &input, &reference, 2);
    assert_ok(&run_sluice(&["run", ref_job.to_str().unwrap()], &[]));
    let got = table_rows(&lake.join("out")).await;
    assert_eq!(got, table_rows(&reference).await);
    assert_eq!(got.len(), events.output_ids().len());
    assert_eq!(
        table_values(&dead_letter_table(&lake.join("out")), &["batch_id"]).await,
        table_values(&dead_letter_table(&reference), &["batch_id"]).await
    );

    // An independent reader, straight from the server.
    let read = read_from_s3(&server, "read_delta.py", "s3://lake/out");
    assert_eq!(read["rows"].as_array().unwrap().len(), got.len());

    // A second run finds everything committed and reads nothing again.
    let again = run_sluice(&["run", job], &pairs(&env));
    assert_ok(&again);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 batch(es) committed"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
}

/// An empty prefix with no schema to infer from, and a local folder that does not exist, are
/// errors at `validate` and at `run` naming the location.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_input_is_an_error_naming_it() {
    let server = S3Server::start(&["landing", "lake"]);
    let ws = tempfile::tempdir().unwrap();
    let env = server.env();
    let job = ws.path().join("empty.toml");
    let text = r#"
[job]
id = "empty"

[sources.events]
kind = "files"
path = "s3://landing/nothing/here"
format = "json"

[sink]
kind = "delta"
path = "s3://lake/out"

[query]
sql = "SELECT * FROM events"
"#;
    std::fs::write(&job, text).unwrap();
    for command in ["validate", "run"] {
        let out = run_sluice(&[command, job.to_str().unwrap()], &pairs(&env));
        assert_fails_saying(&out, &["s3://landing/nothing/here", "no files"]);
    }
    let missing = ws.path().join("no-such-folder");
    std::fs::write(
        &job,
        text.replace("s3://landing/nothing/here", missing.to_str().unwrap())
            .replace("s3://lake/out", ws.path().join("out").to_str().unwrap()),
    )
    .unwrap();
    for command in ["validate", "run"] {
        let out = run_sluice(&[command, job.to_str().unwrap()], &[]);
        assert_fails_saying(&out, &[missing.to_str().unwrap(), "does not exist"]);
    }
}

/// A store that cannot put-if-absent is refused when the job starts, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_without_conditional_put_is_refused_at_start() {
    let server = S3Server::start(&["landing", "lake"]);
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 2, 5);
    server.upload(&input, "landing", "events").await;
    let job = ws.path().join("no_cas.toml");
    write_s3_job(
        &job,
        "s3://landing/events",
        "s3://lake/out",
        "",
        "aws_conditional_put = \"disabled\"",
    );
    let out = run_sluice(&["run", job.to_str().unwrap()], &pairs(&server.env()));
    assert_fails_saying(&out, &["does not support conditional put", "s3://lake/out"]);
}

/// The server hangs for 10 s mid-run (SIGSTOP; moto keeps its data in memory, so it is paused,
/// not killed): the job logs that it is waiting, continues when the server answers again, and
/// its output equals a local run's. With `store_unavailable_timeout` shorter than the outage the
/// job stops with an error naming the store, and a restart continues exactly.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_down_for_a_while_is_waited_for_and_one_down_too_long_stops_the_job() {
    let server = S3Server::start(&["landing", "lake"]);
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 60, 5);
    server.upload(&input, "landing", "events").await;
    let reference = ws.path().join("reference");
    let ref_job = write_job(&ws.path().join("ref.toml"), "s3_job", &input, &reference, 2);
    assert_ok(&run_sluice(&["run", ref_job.to_str().unwrap()], &[]));
    let want = table_rows(&reference).await;
    assert_eq!(want.len(), events.output_ids().len());
    // Requests time out after 2 s, so the outage is seen (not just a slow answer).
    let options = "timeout = \"2s\"\nconnect_timeout = \"1s\"";
    let env = server.env();

    for (name, job_extra, outlasts_timeout) in [
        ("waits", "", false),
        ("stops", "store_unavailable_timeout = \"4s\"", true),
    ] {
        let job = ws.path().join(format!("{name}.toml"));
        let out = format!("s3://lake/{name}");
        write_s3_job(&job, "s3://landing/events", &out, job_extra, options);
        let job = job.to_str().unwrap();
        let log = ws.path().join(format!("{name}.log"));
        let mut running = Background::start(&["run", job], &pairs(&env), &log);
        running.wait_for_log("batch committed", 120);
        server.signal("STOP");
        std::thread::sleep(Duration::from_secs(10));
        server.signal("CONT");
        let (status, log) = running.finish();
        for line in log
            .lines()
            .filter(|l| l.contains("WARN") || l.starts_with("error"))
        {
            eprintln!("{name}: {line}");
        }
        // Retries are logged by object_store (a request's first few) and by Sluice (the wait).
        assert!(
            log.contains("backing off") || log.contains("object store unavailable; retrying"),
            "no retry logged:\n{log}"
        );
        if outlasts_timeout {
            assert!(!status.success(), "the job outlived the timeout:\n{log}");
            assert!(
                log.contains("past store_unavailable_timeout") && log.contains("s3://lake/stops"),
                "the error does not say what happened:\n{log}"
            );
            assert_ok(&run_sluice(&["run", job], &pairs(&env)));
        } else {
            assert!(status.success(), "the job failed:\n{log}");
        }
        let local = ws.path().join(name);
        server.download("lake", name, &local).await;
        assert_eq!(table_rows(&local).await, want, "{name}: rows differ");
        let versions = txn_versions(&local, "s3_job");
        let expected: Vec<i64> = (0..versions.len() as i64).collect();
        assert_eq!(
            versions, expected,
            "{name}: txn versions are not contiguous"
        );
    }
}

/// Runs the reader `integration/<script>` on the table at `url` on `server`.
fn read_from_s3(server: &S3Server, script: &str, url: &str) -> serde_json::Value {
    let out = Command::new("python3")
        .arg(repo_root().join("integration").join(script))
        .arg(url)
        .env(
            "DELTA_STORAGE_OPTIONS",
            serde_json::json!({
                "AWS_ENDPOINT_URL": server.endpoint,
                "AWS_ACCESS_KEY_ID": "sluice-test",
                "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true",
            })
            .to_string(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} on {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The `id`s of a reader's rows, sorted, with the `bucket` each is in.
fn ids_and_buckets(read: &serde_json::Value) -> Vec<(i64, String)> {
    let mut rows: Vec<(i64, String)> = read["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let bucket = match &r["bucket"] {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (r["id"].as_i64().unwrap(), bucket)
        })
        .collect();
    rows.sort();
    rows
}

/// `partition_by = ["bucket"]`: the output's files are laid out in `bucket=…/` folders, the
/// dead-letter table (which has no `bucket` column) is not partitioned, the table is compacted
/// on the server as it is written, and delta-rs, Python `deltalake`, Polars and DuckDB read the
/// rows written from the server; a `partition_by` naming
/// a column the output lacks is refused, naming it.
#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_table_on_s3_reads_the_same_in_every_reader() {
    let server = S3Server::start(&["landing", "lake"]);
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 12, 5);
    server.upload(&input, "landing", "events").await;
    let sql = "SELECT id, user_id, amount, ts, CAST(user_id % 3 AS VARCHAR) AS bucket FROM events";
    let job = ws.path().join("partitioned.toml");
    let write = |partition_by: &str| {
        write_job_at(
            &job,
            "partitioned",
            "s3://landing/events",
            "s3://lake/out",
            2,
            sql,
            "",
        );
        let text = std::fs::read_to_string(&job).unwrap().replace(
            "[sink]\nkind = \"delta\"\n",
            &format!(
                "[sink]\nkind = \"delta\"\npartition_by = [{partition_by}]\n\
                 compaction = {{ min_files = 3 }}\n"
            ),
        );
        std::fs::write(&job, text).unwrap();
    };
    let env = server.env();

    write("\"day\"");
    let refused = run_sluice(&["run", job.to_str().unwrap()], &pairs(&env));
    assert_fails_saying(&refused, &["partition_by", "'day'", "bucket"]);

    write("\"bucket\"");
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &pairs(&env)));
    let local = ws.path().join("out");
    server.download("lake", "out", &local).await;
    let folders: Vec<String> = std::fs::read_dir(&local)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("bucket="))
        .collect();
    assert_eq!(folders.len(), 3, "{folders:?}");
    // The table was compacted on S3 as it was written (`min_files = 3`): the readers below see
    // the rows after compaction, which must be the rows written.
    let compactions = delta_commits(&local)
        .iter()
        .filter(|c| c.iter().any(|a| a["commitInfo"]["operation"] == "OPTIMIZE"))
        .count();
    assert!(compactions >= 3, "{compactions} compactions");
    let dead = dead_letter_table(&local);
    server.download("lake", "out_dead_letter", &dead).await;
    assert!(
        files_under(&dead)
            .iter()
            .all(|p| !p.to_string_lossy().contains("bucket=")),
        "the dead-letter table has no bucket column to be partitioned by"
    );
    assert_eq!(
        dead_letter_rows(&local).len(),
        events.bad_count()
            - events
                .lines
                .iter()
                .filter(|(_, _, k)| *k == LineKind::Poison)
                .count()
    );

    let rust: Vec<(i64, String)> = {
        let mut rows: Vec<(i64, String)> = table_values(&local, &[])
            .await
            .iter()
            .map(|r| {
                (
                    r["id"].as_i64().unwrap(),
                    r["bucket"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        rows.sort();
        rows
    };
    // Poison lines are good rows here (the query casts nothing); their user_id is 1.
    let want: Vec<(i64, String)> = events
        .lines
        .iter()
        .filter_map(|(_, id, kind)| match kind {
            LineKind::Good => Some((*id, ((id - 1) % 17 % 3).to_string())),
            LineKind::Poison => Some((*id, "1".to_string())),
            _ => None,
        })
        .collect();
    assert_eq!(rust, want);
    for script in ["read_delta.py", "read_polars.py", "read_duckdb.py"] {
        let read = read_from_s3(&server, script, "s3://lake/out");
        assert_eq!(ids_and_buckets(&read), rust, "{script} reads other rows");
    }
}
