//! Helpers shared by the end-to-end tests: input generation, running `sluice`, reading tables.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use arrow::array::RecordBatch;
use datafusion::prelude::SessionContext;
use serde_json::Value;

/// The `sluice` binary built for this test run.
pub fn sluice_bin() -> &'static str {
    env!("CARGO_BIN_EXE_sluice")
}

/// A command running `sluice`. Every batch of it commits with the next batch executing
/// meanwhile, as a batch of 1 MiB or more does by default (`SLUICE_OVERLAP_MIN_INPUT_BYTES`):
/// the suite's small batches then put that path through every scenario, crashes included.
pub fn sluice_command() -> Command {
    let mut cmd = Command::new(sluice_bin());
    cmd.env("SLUICE_OVERLAP_MIN_INPUT_BYTES", "0");
    cmd
}

/// Runs `sluice` with `args` to completion.
pub fn run_sluice(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = sluice_command();
    cmd.args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("sluice runs")
}

/// What `sluice status TABLE` prints, asserting it succeeded.
pub fn status_of(table: &Path) -> String {
    let out = run_sluice(&["status", table.to_str().unwrap()], &[]);
    assert_ok(&out);
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The value after `name: ` on the first line of `sluice status` output that has one.
pub fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    let prefix = format!("{name}: ");
    status
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
}

/// Asserts a run succeeded, showing its output if not.
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "sluice failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts a run failed and its stderr says each of `wanted`; returns the stderr.
pub fn assert_fails_saying<S: AsRef<str>>(out: &Output, wanted: &[S]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected a failure; stderr:\n{err}");
    for w in wanted {
        assert!(
            err.contains(w.as_ref()),
            "missing {:?} in: {err}",
            w.as_ref()
        );
    }
    err
}

/// One generated input line and what the job should make of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineKind {
    /// A good event: lands in the output (if the filter keeps it).
    Good,
    /// Not valid JSON: dead letter at decode.
    Malformed,
    /// A value that does not fit the schema: dead letter at decode.
    WrongType,
    /// No event time: dead letter at the time step.
    NoEventTime,
    /// `code` is not a number: the query's CAST fails, dead letter at execute.
    Poison,
}

/// Generated input: `files` JSON files of `lines_per_file` events, with bad lines mixed in.
#[derive(Debug)]
pub struct Events {
    /// Per global line index: (file index, id, kind).
    pub lines: Vec<(usize, i64, LineKind)>,
}

impl Events {
    /// The kind of line `i` (global index): a fixed mix of good and bad lines.
    pub fn kind(i: usize) -> LineKind {
        match i {
            _ if i % 37 == 5 => LineKind::Malformed,
            _ if i % 41 == 7 => LineKind::WrongType,
            _ if i % 43 == 9 => LineKind::NoEventTime,
            _ if i % 47 == 11 => LineKind::Poison,
            _ => LineKind::Good,
        }
    }

    /// Writes files `first..first + count` into `dir`, named so they sort in index order.
    pub fn write(dir: &Path, first: usize, count: usize, lines_per_file: usize) -> Events {
        std::fs::create_dir_all(dir).unwrap();
        let mut lines = Vec::new();
        for f in first..first + count {
            let mut text = String::new();
            for l in 0..lines_per_file {
                let i = f * lines_per_file + l;
                let id = i as i64 + 1;
                let kind = Events::kind(i);
                let ts = format!("2026-11-01T10:{:02}:{:02}Z", (i / 60) % 60, i % 60);
                let line = match kind {
                    LineKind::Good => format!(
                        r#"{{"id":{id},"user_id":{},"code":"{}","amount":{}.5,"ts":"{ts}"}}"#,
                        i % 17,
                        i % 100,
                        i % 13
                    ),
                    LineKind::Malformed => format!(r#"{{"id":{id},"user_id":"#),
                    LineKind::WrongType => format!(
                        r#"{{"id":{id},"user_id":1,"code":"1","amount":"lots","ts":"{ts}"}}"#
                    ),
                    LineKind::NoEventTime => {
                        format!(r#"{{"id":{id},"user_id":1,"code":"1","amount":1.5}}"#)
                    }
                    LineKind::Poison => format!(
                        r#"{{"id":{id},"user_id":1,"code":"x{id}","amount":1.5,"ts":"{ts}"}}"#
                    ),
                };
                text.push_str(&line);
                text.push('\n');
                lines.push((f, id, kind));
            }
            std::fs::write(dir.join(format!("events-{f:05}.json")), text).unwrap();
        }
        Events { lines }
    }

    /// Ids of the lines that must reach the output.
    pub fn good_ids(&self) -> BTreeSet<i64> {
        self.lines
            .iter()
            .filter(|(_, _, k)| *k == LineKind::Good)
            .map(|(_, id, _)| *id)
            .collect()
    }

    /// Ids the test query keeps (`WHERE user_id <> 3`, `user_id = i % 17`).
    pub fn output_ids(&self) -> BTreeSet<i64> {
        self.good_ids()
            .into_iter()
            .filter(|id| (id - 1) % 17 != 3)
            .collect()
    }

    /// How many lines must become dead letters.
    pub fn bad_count(&self) -> usize {
        self.lines
            .iter()
            .filter(|(_, _, k)| *k != LineKind::Good)
            .count()
    }
}

/// The stateless test query.
pub const STATELESS_SQL: &str = "
SELECT id, user_id, CAST(code AS INT) AS code, amount * 2 AS double_amount,
       date_trunc('minute', ts) AS minute, ts
FROM events
WHERE user_id <> 3
";

/// The windowed test query: hopping 30 s windows every 10 s, several aggregates, a CAST that
/// fails on poison lines (so they are isolated into dead letters on the windowed path too).
pub const WINDOWED_SQL: &str = "
SELECT window_start, window_end, user_id % 3 AS bucket,
       count(*) AS n, sum(CAST(code AS INT)) AS codes, avg(amount) AS mean,
       max(amount) AS hi, count(DISTINCT user_id) AS users
FROM hop(events, ts, INTERVAL '10' SECOND, INTERVAL '30' SECOND)
WHERE user_id <> 3
GROUP BY window_start, window_end, user_id % 3
";

/// A job file over `input` writing to `out`, with the stateless test query.
pub fn write_job(path: &Path, job_id: &str, input: &Path, out: &Path, max_files: usize) -> PathBuf {
    write_job_with(path, job_id, input, out, max_files, STATELESS_SQL, "")
}

/// A job file over `input` writing to `out` with `sql`; `extra_query` goes into `[query]`
/// (e.g. `allowed_lateness = "30s"`).
pub fn write_job_with(
    path: &Path,
    job_id: &str,
    input: &Path,
    out: &Path,
    max_files: usize,
    sql: &str,
    extra_query: &str,
) -> PathBuf {
    write_job_at(
        path,
        job_id,
        &input.display().to_string(),
        &out.display().to_string(),
        max_files,
        sql,
        extra_query,
    )
}

/// [`write_job_with`] for locations given as text: local paths or URLs (`s3://bucket/x`).
pub fn write_job_at(
    path: &Path,
    job_id: &str,
    input: &str,
    out: &str,
    max_files: usize,
    sql: &str,
    extra_query: &str,
) -> PathBuf {
    let text = format!(
        r#"
[job]
id = "{job_id}"

[sources.events]
kind = "files"
path = "{input}"
format = "json"
schema = "id BIGINT, user_id BIGINT, code VARCHAR, amount DOUBLE, ts TIMESTAMP"
event_time = "ts"
max_out_of_orderness = "2s"
max_files_per_batch = {max_files}

[sink]
kind = "delta"
path = "{out}"

[trigger]
mode = "available-now"

[query]
{extra_query}
sql = """{sql}"""
"#
    );
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// Reads a Delta table with delta-rs + DataFusion.
pub async fn read_table(path: &Path) -> Vec<RecordBatch> {
    let url = url::Url::from_directory_path(path).unwrap();
    let table = deltalake::open_table(url).await.expect("table opens");
    let ctx = SessionContext::new();
    table.update_datafusion_session(&ctx.state()).unwrap();
    let provider = table.table_provider().await.unwrap();
    ctx.register_table("t", Arc::clone(&provider)).unwrap();
    ctx.sql("SELECT * FROM t")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap()
}

/// A table's rows as JSON objects, sorted, so two tables compare as multisets.
pub async fn table_rows(path: &Path) -> Vec<String> {
    rows_as_json(&read_table(path).await)
}

/// Rows as sorted JSON strings.
pub fn rows_as_json(batches: &[RecordBatch]) -> Vec<String> {
    let mut writer = arrow::json::ArrayWriter::new(Vec::new());
    for b in batches {
        writer.write(b).unwrap();
    }
    writer.finish().unwrap();
    let bytes = writer.into_inner();
    let values: Vec<Value> = if bytes.is_empty() {
        vec![]
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    let mut rows: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    rows.sort();
    rows
}

/// The rows of a table as JSON objects with `drop` removed from each, sorted.
pub async fn table_values(path: &Path, drop: &[&str]) -> Vec<serde_json::Map<String, Value>> {
    let mut rows: Vec<serde_json::Map<String, Value>> = table_rows(path)
        .await
        .iter()
        .map(|r| {
            let mut v: serde_json::Map<String, Value> = serde_json::from_str(r).unwrap();
            for d in drop {
                v.remove(*d);
            }
            v
        })
        .collect();
    rows.sort_by_key(|r| Value::Object(r.clone()).to_string());
    rows
}

/// The `id` of every row of the Delta table at `path`, sorted.
pub async fn sorted_ids(path: &Path) -> Vec<i64> {
    let mut ids: Vec<i64> = table_values(path, &[])
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    ids.sort_unstable();
    ids
}

/// `<table>_late`, the default late table of a sink at `table`.
pub fn late_table(table: &Path) -> PathBuf {
    let mut s = table.as_os_str().to_owned();
    s.push("_late");
    PathBuf::from(s)
}

/// `<table>_dead_letter`, the default dead-letter table of a sink at `table`.
pub fn dead_letter_table(table: &Path) -> PathBuf {
    let mut s = table.as_os_str().to_owned();
    s.push("_dead_letter");
    PathBuf::from(s)
}

/// The txn versions of `app_id` in the table's commits, in commit order.
pub fn txn_versions(table: &Path, app_id: &str) -> Vec<i64> {
    delta_commits(table)
        .iter()
        .flatten()
        .filter(|action| action["txn"]["appId"] == app_id)
        .map(|action| action["txn"]["version"].as_i64().unwrap())
        .collect()
}

/// The actions of each commit in the table's Delta log (`_delta_log/*.json`), in commit order.
pub fn delta_commits(table: &Path) -> Vec<Vec<Value>> {
    let mut commits: Vec<PathBuf> = std::fs::read_dir(table.join("_delta_log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    commits.sort();
    commits
        .iter()
        .map(|c| {
            std::fs::read_to_string(c)
                .unwrap()
                .lines()
                .map(|line| serde_json::from_str(line).unwrap())
                .collect()
        })
        .collect()
}

/// The repository's root folder.
pub fn repo_root() -> PathBuf {
    // At run time: a test binary cached from a clone at another path must not look there.
    PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
}

/// Runs the reader `integration/<script>` on `table` and parses the JSON it prints.
fn python_reader(script: &str, table: &Path) -> Value {
    let out = Command::new("python3")
        .arg(repo_root().join("integration").join(script))
        .arg(table)
        .output()
        .expect("python3 runs (./test installs the readers)");
    assert!(
        out.status.success(),
        "{script} failed on {}: {}",
        table.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Reads a table with the Python `deltalake` package: `{"schema": [[name, type]], "rows": [...]}`.
pub fn python_read(table: &Path) -> Value {
    python_reader("read_delta.py", table)
}

/// Reads a table with Polars (`polars.read_delta`): `{"schema": [[name, dtype]], "rows": [...]}`.
pub fn polars_read(table: &Path) -> Value {
    python_reader("read_polars.py", table)
}

/// The rows of the dead-letter table next to the output table `out` (none if it was never
/// created), read by the Python reader.
pub fn dead_letter_rows(out: &Path) -> Vec<Value> {
    let table = dead_letter_table(out);
    if !table.join("_delta_log").exists() {
        return Vec::new();
    }
    python_read(&table)["rows"].as_array().unwrap().clone()
}

/// Two JSON rows equal, numbers within 1e-9 relative.
pub fn rows_close(a: &str, b: &str) -> bool {
    let (a, b): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(a).unwrap(),
        serde_json::from_str(b).unwrap(),
    );
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return a == b;
    };
    a.len() == b.len()
        && a.iter().all(|(k, x)| {
            let y = &b[k];
            match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()),
                _ => x == y,
            }
        })
}

/// A small deterministic PRNG (xorshift), so a failing run can be replayed from its seed.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Two sorted row lists are equal, floats within 1e-9 relative.
pub fn assert_rows_close(got: &[String], want: &[String]) {
    assert_eq!(got.len(), want.len(), "row counts differ");
    let differing: Vec<_> = got
        .iter()
        .zip(want)
        .filter(|(g, w)| !rows_close(g, w))
        .collect();
    assert!(differing.is_empty(), "rows differ: {differing:?}");
}

/// A `sluice` process started in the background, its stderr in a file.
pub struct Background {
    pub child: std::process::Child,
    pub log: PathBuf,
}

impl Background {
    /// Starts `sluice args` with `env`, stderr to `log`.
    pub fn start(args: &[&str], env: &[(&str, &str)], log: &Path) -> Background {
        let mut cmd = sluice_command();
        cmd.args(args)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Background {
            child: cmd.spawn().unwrap(),
            log: log.to_path_buf(),
        }
    }

    /// What the process has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log holds `needle` (panics after `secs` seconds or if the process ends).
    pub fn wait_for_log(&mut self, needle: &str, secs: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while !self.log_text().contains(needle) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the process ended ({status}) before logging '{needle}':\n{}",
                    self.log_text()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no '{needle}' after {secs} s:\n{}",
                self.log_text()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`, `TERM`) to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for the process to end; its exit status and log.
    pub fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().unwrap();
        (status, self.log_text())
    }
}

pub use crate::http::http_request;

/// `GET path` on `addr`: the status code and the body.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_request(addr, "GET", path)
}

/// The address a `sluice run --metrics-addr` logged it serves on, once it has.
pub fn served_address_in(log: &str) -> Option<String> {
    let marker = "serving metrics on http://";
    let at = log.find(marker)? + marker.len();
    Some(log[at..].split('/').next()?.to_string())
}
