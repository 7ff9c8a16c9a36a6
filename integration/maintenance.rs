//! Table maintenance: the Delta log's checkpoints and retention as the `[sink]` sets them, and
//! `sluice vacuum`, which deletes only what no snapshot within the retention needs and never
//! the job's checkpoint.

use std::time::{Duration, SystemTime};

use crate::object_storage::pairs;
use crate::s3_server::S3Server;
use crate::support::*;

/// Every file under `dir`, relative, sorted.
fn tree(dir: &std::path::Path) -> Vec<String> {
    fn walk(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn log_settings_apply_expired_commits_are_cleaned_up_and_vacuum_keeps_the_live_table() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 16, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "maint", &input, &out, 2);
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "[sink]\nkind = \"delta\"\n",
        "[sink]\nkind = \"delta\"\ncheckpoint_interval = 3\nlog_retention = \"2days\"\n",
    );
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));

    // A Delta checkpoint every 3 commits (versions 2, 5, 8: delta-rs counts commits, not
    // versions), and the retention in the table's configuration.
    let log: Vec<String> = tree(&out.join("_delta_log"));
    for version in [2, 5, 8] {
        let name = format!("{version:020}.checkpoint.parquet");
        assert!(log.contains(&name), "no {name} in {log:?}");
    }
    let metadata = delta_commits(&out)[0]
        .iter()
        .find_map(|a| a.get("metaData").cloned())
        .unwrap();
    assert_eq!(metadata["configuration"]["delta.checkpointInterval"], "3");
    assert_eq!(
        metadata["configuration"]["delta.logRetentionDuration"],
        "interval 172800 seconds"
    );

    // A data file no commit references (a batch that crashed before committing), written three
    // days ago, and one written now.
    let old_orphan = out.join("part-00000-crashed-old.snappy.parquet");
    let new_orphan = out.join("part-00000-crashed-new.snappy.parquet");
    for orphan in [&old_orphan, &new_orphan] {
        std::fs::write(orphan, b"not referenced").unwrap();
    }
    std::fs::File::options()
        .write(true)
        .open(&old_orphan)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(3 * 86_400))
        .unwrap();
    let rows = table_rows(&out).await;
    let checkpoint = tree(&out.join("_sluice"));
    assert!(!checkpoint.is_empty());

    let dry = run_sluice(
        &[
            "vacuum",
            out.to_str().unwrap(),
            "--retention",
            "2d",
            "--dry-run",
        ],
        &[],
    );
    assert_ok(&dry);
    let said = String::from_utf8_lossy(&dry.stdout).to_string();
    assert!(said.contains("would delete 1 file(s)"), "{said}");
    assert!(said.contains("crashed-old"), "{said}");
    assert!(old_orphan.exists(), "a dry run deleted");

    let vacuumed = run_sluice(&["vacuum", out.to_str().unwrap(), "--retention", "2d"], &[]);
    assert_ok(&vacuumed);
    assert!(
        !old_orphan.exists(),
        "the old unreferenced file is still there"
    );
    assert!(
        new_orphan.exists(),
        "a file younger than the retention was deleted"
    );
    assert_eq!(
        tree(&out.join("_sluice")),
        checkpoint,
        "vacuum touched the checkpoint"
    );
    assert_eq!(table_rows(&out).await, rows);
    assert_eq!(
        python_read(&out)["rows"].as_array().unwrap().len(),
        rows.len()
    );

    // Below an hour it takes --force (a running batch's files are not in the log yet); even a
    // zero retention keeps what the latest snapshot references and the checkpoint, and the
    // job resumes.
    let refused = run_sluice(&["vacuum", out.to_str().unwrap(), "--retention", "0s"], &[]);
    assert_fails_saying(&refused, &["below one hour", "--force"]);
    assert!(new_orphan.exists());
    assert_ok(&run_sluice(
        &[
            "vacuum",
            out.to_str().unwrap(),
            "--retention",
            "0s",
            "--force",
        ],
        &[],
    ));
    assert!(!new_orphan.exists());
    assert_eq!(
        tree(&out.join("_sluice")),
        checkpoint,
        "vacuum touched the checkpoint"
    );
    assert_eq!(table_rows(&out).await, rows);
    let again = run_sluice(&["run", job], &[]);
    assert_ok(&again);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 batch(es) committed"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );

    // Log cleanup: after the next Delta checkpoint, commit files older than `log_retention`
    // and older than a checkpoint are deleted. Every commit file so far is aged by three
    // days; the job then commits batches one at a time until one writes a checkpoint.
    let log_dir = out.join("_delta_log");
    let version_of = |name: &str| name[..20].parse::<u64>().unwrap();
    let mut aged: Vec<String> = tree(&log_dir)
        .into_iter()
        .filter(|name| name.ends_with(".json"))
        .collect();
    aged.sort();
    for name in &aged {
        std::fs::File::options()
            .write(true)
            .open(log_dir.join(name))
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(3 * 86_400))
            .unwrap();
    }
    // One batch per run (2 files): the cleanup runs only on the commit that writes a
    // checkpoint (version + 1 a multiple of 3); a batch before it leaves the expired files.
    let latest_version = |log: &[String]| {
        log.iter()
            .filter(|name| name.ends_with(".json"))
            .map(|name| version_of(name))
            .max()
            .unwrap()
    };
    let mut before_checkpoint = 0;
    for run in 0..3 {
        let version = latest_version(&tree(&log_dir)) + 1;
        Events::write(&input, 16 + 2 * run, 2, 5);
        let more = run_sluice(&["run", job], &[]);
        assert_ok(&more);
        let log = tree(&log_dir);
        assert_eq!(latest_version(&log), version, "one commit a run");
        let first_kept = log.contains(&aged[0]);
        if (version + 1) % 3 != 0 {
            assert!(
                first_kept,
                "commit {version} (no checkpoint) cleaned up the log"
            );
            before_checkpoint += 1;
        } else {
            assert!(
                !first_kept,
                "commit {version} (a checkpoint) left {}",
                aged[0]
            );
            break;
        }
    }
    assert!(
        before_checkpoint > 0,
        "no batch before the checkpoint commit: the test no longer tells when cleanup runs"
    );
    let log = tree(&log_dir);
    assert_eq!(version_of(&aged[0]), 0);
    // What is kept reads whole: a checkpoint and every commit from it on.
    let oldest_kept = log
        .iter()
        .filter(|name| name.ends_with(".json"))
        .map(|name| version_of(name))
        .min()
        .unwrap();
    assert!(
        log.contains(&format!("{oldest_kept:020}.checkpoint.parquet")),
        "the oldest commit kept, {oldest_kept}, has no checkpoint: {log:?}"
    );
    let grown = table_rows(&out).await;
    assert!(grown.len() > rows.len());
    assert!(rows.iter().all(|row| grown.contains(row)));
    assert_eq!(
        python_read(&out)["rows"].as_array().unwrap().len(),
        grown.len()
    );
    // The job's txn lives in the checkpoint: a restart commits nothing twice.
    let again = run_sluice(&["run", job], &[]);
    assert_ok(&again);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 batch(es) committed"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );

    let bad = run_sluice(
        &["vacuum", out.to_str().unwrap(), "--retention", "soon"],
        &[],
    );
    assert_fails_saying(&bad, &["'soon' is not a duration"]);
}

/// Adds `lines` to the `[sink]` table of the job file at `job`.
fn add_to_sink(job: &std::path::Path, lines: &str) {
    let text = std::fs::read_to_string(job).unwrap().replace(
        "[sink]\nkind = \"delta\"\n",
        &format!("[sink]\nkind = \"delta\"\n{lines}\n"),
    );
    std::fs::write(job, text).unwrap();
}

/// The active data files of the table at `table` per partition folder (`""`: unpartitioned),
/// from its log.
fn active_files_per_partition(
    table: &std::path::Path,
) -> std::collections::BTreeMap<String, usize> {
    let mut active = std::collections::BTreeSet::new();
    for commit in delta_commits(table) {
        for action in commit {
            if let Some(path) = action["add"]["path"].as_str() {
                active.insert(path.to_string());
            }
            if let Some(path) = action["remove"]["path"].as_str() {
                active.remove(path);
            }
        }
    }
    let mut per = std::collections::BTreeMap::new();
    for path in active {
        let partition = path.rsplit_once('/').map_or("", |(dir, _)| dir).to_string();
        *per.entry(partition).or_default() += 1;
    }
    per
}

/// How long loading the table's latest snapshot takes (median of five).
async fn open_time(table: &std::path::Path) -> Duration {
    let url = url::Url::from_directory_path(table).unwrap();
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        deltalake::open_table(url.clone()).await.unwrap();
        times.push(t.elapsed());
    }
    times.sort();
    times[2]
}

/// A partitioned table fed one small file per batch for 240 batches: with compaction (and
/// `min_files = 8`) each partition's active files stay at most `2 × ⌈rows / rows per target
/// file⌉ + min_files` (here 2 + 8), in the output and the dead-letter table alike; the rows
/// equal a run without compaction and Delta checkpoints, for delta-rs and the Python
/// `deltalake` and Polars readers. Prints the latest snapshot's load time of both. (The same
/// over 1,000 batches, in a release build: `cargo bench --bench storage -- small-files`.)
#[tokio::test(flavor = "multi_thread")]
async fn compaction_keeps_each_partition_to_a_few_files_and_changes_no_row() {
    const MIN_FILES: usize = 8;
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 240, 3);
    let sql = "SELECT id, user_id, amount, ts, CAST(user_id % 3 AS VARCHAR) AS bucket FROM events";
    let mut runs = Vec::new();
    for (name, compaction) in [
        (
            "compacted",
            format!("compaction = {{ min_files = {MIN_FILES} }}"),
        ),
        (
            "plain",
            "compaction = { enabled = false }\ncheckpoint_interval = 1000000".to_string(),
        ),
    ] {
        let out = ws.path().join(name);
        let job = write_job_with(
            &ws.path().join(format!("{name}.toml")),
            name,
            &input,
            &out,
            1,
            sql,
            "",
        );
        add_to_sink(&job, &format!("partition_by = [\"bucket\"]\n{compaction}"));
        let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
        assert_ok(&run);
        runs.push((name, out, String::from_utf8_lossy(&run.stderr).to_string()));
    }
    let (_, compacted, log) = &runs[0];
    let (_, plain, _) = &runs[1];
    assert!(
        log.contains("delta: compacted"),
        "no compaction logged:\n{log}"
    );

    for table in [compacted.clone(), dead_letter_table(compacted)] {
        let per = active_files_per_partition(&table);
        assert!(!per.is_empty());
        for (partition, files) in &per {
            assert!(
                *files <= 2 + MIN_FILES,
                "{}: partition '{partition}' has {files} active files",
                table.display()
            );
        }
    }
    // Without compaction: a file per batch and partition.
    assert!(active_files_per_partition(plain).values().all(|n| *n > 60));

    let rows = table_rows(compacted).await;
    assert_eq!(rows, table_rows(plain).await);
    assert_eq!(
        table_values(&dead_letter_table(compacted), &["batch_id"]).await,
        table_values(&dead_letter_table(plain), &["batch_id"]).await
    );
    assert_eq!(
        rows.len(),
        events
            .lines
            .iter()
            .filter(|(_, _, k)| matches!(k, LineKind::Good | LineKind::Poison))
            .count()
    );
    assert_eq!(
        python_read(compacted)["rows"].as_array().unwrap().len(),
        rows.len()
    );
    assert_eq!(
        polars_read(compacted)["rows"].as_array().unwrap().len(),
        rows.len()
    );
    eprintln!(
        "latest snapshot load after 240 one-file batches: {:?} with compaction and \
         checkpoints, {:?} without",
        open_time(compacted).await,
        open_time(plain).await
    );
}

/// Batches large enough that compaction copies their files' row groups (see
/// `sinks/src/compaction.rs`): the partitions (their values with a space and a comma) are
/// compacted by copy, on local disk and on an S3 server, and the table's rows equal a run
/// without compaction, for delta-rs and the Python `deltalake` and Polars readers.
#[tokio::test(flavor = "multi_thread")]
async fn compaction_by_copy_changes_no_row_for_any_reader() {
    let server = S3Server::start(&["lake"]);
    let s3_env = server.env();
    let ws = tempfile::tempdir().unwrap();
    let local = |name: &str| ws.path().join(name).display().to_string();
    let mut logs = Vec::new();
    for (name, out, compaction) in [
        ("copied", local("copied"), "compaction = { min_files = 3 }"),
        (
            "on_s3",
            "s3://lake/copied".to_string(),
            "compaction = { min_files = 3 }",
        ),
        ("plain", local("plain"), "compaction = { enabled = false }"),
    ] {
        let job = ws.path().join(format!("{name}.toml"));
        std::fs::write(
            &job,
            format!(
                r#"
[job]
id = "{name}"

[sources.bid]
kind = "nexmark"
table = "bid"
total_events = 320000
max_records_per_batch = 100000
event_time = "date_time"
max_out_of_orderness = "0s"

[sink]
kind = "delta"
path = "{out}"
partition_by = ["half"]
{compaction}

[trigger]
mode = "available-now"

[query]
sql = """SELECT auction, price, date_time,
  CASE WHEN price % 2 = 0 THEN 'even half' ELSE 'odd,half' END AS half FROM bid"""
"#
            ),
        )
        .unwrap();
        let mut env = pairs(&s3_env);
        env.push(("RUST_LOG", "info"));
        let run = run_sluice(&["run", job.to_str().unwrap()], &env);
        assert_ok(&run);
        logs.push(String::from_utf8_lossy(&run.stderr).to_string());
    }
    let on_s3 = ws.path().join("on_s3");
    server.download("lake", "copied", &on_s3).await;
    let plain = ws.path().join("plain");
    let plain_rows = table_rows(&plain).await;
    assert_eq!(plain_rows.len(), 294_400);
    for (copied, log) in [(ws.path().join("copied"), &logs[0]), (on_s3, &logs[1])] {
        let by_copy = log
            .lines()
            .filter(|l| l.contains("delta: compacted") && l.contains("by_copy=true"))
            .count();
        assert_eq!(by_copy, 2, "not both partitions compacted by copy:\n{log}");
        // Three batches' files per partition became one; the last, small batch's stayed apart.
        let per = active_files_per_partition(&copied);
        assert_eq!(per.len(), 2, "{per:?}");
        assert!(per.values().all(|n| *n == 2), "{per:?}");

        assert_eq!(table_rows(&copied).await, plain_rows);
        // Reads that skip files on their statistics find what a scan of the plain table finds
        // (a merged bound narrower than its file's values would lose rows here).
        for filter in [
            "price BETWEEN 1000 AND 1100",
            "date_time < TIMESTAMP '2024-01-01 00:00:20'",
            "date_time >= TIMESTAMP '2024-01-01 00:00:25' AND half = 'odd,half'",
        ] {
            let found = filtered_count(&copied, filter).await;
            assert_eq!(found, filtered_count(&plain, filter).await, "{filter}");
            assert!(
                found > 0,
                "{filter} matches nothing: the check would be vacuous"
            );
        }
        let count = |read: serde_json::Value| read["rows"].as_array().unwrap().len();
        assert_eq!(count(python_read(&copied)), plain_rows.len());
        assert_eq!(count(polars_read(&copied)), plain_rows.len());
    }
}

/// Rows of the table at `table` that `filter` (SQL) keeps, read by delta-rs through DataFusion,
/// which skips files on their statistics.
async fn filtered_count(table: &std::path::Path, filter: &str) -> i64 {
    use deltalake::datafusion::prelude::SessionContext;
    let url = url::Url::from_directory_path(table).unwrap();
    let table = deltalake::open_table(url).await.unwrap();
    let ctx = SessionContext::new();
    ctx.register_table("t", table.table_provider().await.unwrap())
        .unwrap();
    let batches = ctx
        .sql(&format!("SELECT count(*) AS n FROM t WHERE {filter}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    use arrow::array::AsArray;
    batches[0]
        .column(0)
        .as_primitive::<arrow::datatypes::Int64Type>()
        .value(0)
}

/// The running job and a backfill never rewrite the same files at once: while a backfill holds
/// the job's rewrite lease (paused just before its replacement) the job's compaction waits;
/// once the backfill is done the job compacts again, and the table holds every row once.
#[tokio::test(flavor = "multi_thread")]
async fn compaction_waits_while_a_backfill_replaces_rows() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 12, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "live", &input, &out, 1);
    add_to_sink(&job, "compaction = { min_files = 2 }");
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));

    let mut backfill = Background::start(
        &["backfill", job, "--from", "0:2", "--to", "0:6"],
        &[("SLUICE_PAUSE_AT", "before_replacement:6000")],
        &ws.path().join("backfill.log"),
    );
    backfill.wait_for_log("pause point reached", 60);
    Events::write(&input, 12, 4, 5);
    let live = run_sluice(&["run", job], &[]);
    assert_ok(&live);
    let log = String::from_utf8_lossy(&live.stderr);
    assert!(
        log.contains("compaction waits: a backfill holds the job's rewrite lease"),
        "{log}"
    );
    assert!(
        !log.contains("delta: compacted"),
        "compacted during a backfill:\n{log}"
    );
    let (status, log) = backfill.finish();
    assert!(status.success(), "{log}");

    Events::write(&input, 16, 2, 5);
    let after = run_sluice(&["run", job], &[]);
    assert_ok(&after);
    let log = String::from_utf8_lossy(&after.stderr);
    assert!(
        log.contains("delta: compacted"),
        "no compaction after the backfill:\n{log}"
    );

    let ids = sorted_ids(&out).await;
    let mut events = events;
    events.lines.extend(Events::write(&input, 12, 6, 5).lines);
    let want: Vec<i64> = events.output_ids().into_iter().collect();
    assert_eq!(ids, want, "rows lost or doubled");
}
