//! Storage benchmarks: the same jobs into a table on a real S3-compatible server and on local
//! disk, and what a long run of one-file batches leaves in a table with and without compaction
//! and Delta checkpoints.
//!
//! ```text
//! cargo bench --bench storage -- s3-vs-local [--events 2000000] [--clicks 1000000] [--tiny-batches 60]
//! cargo bench --bench storage -- small-files [--batches 1000] [--store local|s3]
//! ```
//!
//! - `s3-vs-local`: Nexmark q0 (`examples/nexmark/q0.toml`, `--events` events), the clicks job
//!   (`examples/clicks.toml` over `--clicks` generated JSON click events, 20 files, 2 a batch)
//!   and the windowed clicks job (`examples/clicks_per_minute.toml`) over `--tiny-batches`
//!   one-file batches of 20 events — each with its table and checkpoint on local disk, then on
//!   the S3 server (the clicks input too: files landed in a bucket). Prints events/s and the
//!   per-batch p50 side by side; the tiny batches' p50 is the per-batch overhead.
//! - `small-files`: `--batches` one-file batches (20 events each) into a table partitioned three
//!   ways, once with compaction and checkpoints as Sluice sets them by default
//!   (`compaction.min_files = 16`, `checkpoint_interval = 10`), once with both off. Prints, for
//!   each: the per-batch p50 of the first and last 100 batches, the most active files in one
//!   partition against the bound `2 × ⌈partition bytes / target_file_size⌉ + min_files` (checked:
//!   the bench fails above it), the objects under `_delta_log/`, and the latest snapshot's load
//!   time (median of five).
//!
//! The S3 server is moto (`python3 -m moto.server`, installed by `./test` from PyPI): a Python
//! server on 127.0.0.1 holding everything in memory. Its figures are Sluice's request pattern
//! against a slow server with no network between, not a forecast of AWS S3, where each request
//! costs a round trip of some 10-30 ms more.
//!
//! Both append their figures as JSON lines (with the git commit) to
//! `benches/results/storage.jsonl`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../integration/http.rs"]
mod http;
#[path = "../integration/s3_server.rs"]
mod s3_server;

mod common;

use common::{git_commit, repo_root};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use s3_server::S3Server;
use sluice::engine::Trigger;
use sluice::engine::driver::RunSummary;

const BUCKET: &str = "bench";

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let what = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    let option = |name: &str| {
        rest.iter()
            .position(|a| a == name)
            .and_then(|i| rest.get(i + 1))
            .cloned()
    };
    let number = |name: &str, default: u64| {
        option(name).map_or(default, |n| n.replace('_', "").parse().unwrap())
    };
    match what.as_str() {
        "s3-vs-local" => s3_vs_local(
            number("--events", 2_000_000),
            number("--clicks", 1_000_000),
            number("--tiny-batches", 60),
        ),
        "small-files" => {
            let store = option("--store").unwrap_or_else(|| "local".into());
            assert!(
                store == "local" || store == "s3",
                "--store local|s3, not {store}"
            );
            small_files(number("--batches", 1000), store == "s3");
        }
        other => panic!(
            "unknown benchmark '{other}': s3-vs-local [--events N] [--clicks N] \
             [--tiny-batches N] | small-files [--batches N] [--store local|s3]"
        ),
    }
}

/// Where one run's input and table live.
struct Place<'a> {
    /// `None`: local disk under the run's folder.
    s3: Option<&'a S3Server>,
    dir: &'a Path,
}

impl Place<'_> {
    /// The location of `name`: a folder under the run's, or a prefix in the bucket.
    fn location(&self, name: &str) -> String {
        match self.s3 {
            Some(_) => format!("s3://{BUCKET}/{}/{name}", self.tag()),
            None => self.dir.join(name).display().to_string(),
        }
    }

    /// The `storage_options` tables a job on this place needs (nothing on local disk).
    fn options(&self, source: Option<&str>) -> String {
        let Some(server) = self.s3 else {
            return String::new();
        };
        let options = server.storage_options();
        let mut text = format!("\n[sink.storage_options]\n{options}");
        if let Some(source) = source {
            text.push_str(&format!("\n[sources.{source}.storage_options]\n{options}"));
        }
        text
    }

    fn tag(&self) -> String {
        self.dir.file_name().unwrap().to_string_lossy().into_owned()
    }

    fn name(&self) -> &'static str {
        if self.s3.is_some() { "s3" } else { "local" }
    }

    /// Puts the local folder `files` where the job reads its input: uploaded to the bucket, or
    /// read in place.
    async fn input(&self, files: &Path, name: &str) -> String {
        match self.s3 {
            Some(server) => {
                let prefix = format!("{}/{name}", self.tag());
                server.upload(files, BUCKET, &prefix).await;
                format!("s3://{BUCKET}/{prefix}")
            }
            None => files.display().to_string(),
        }
    }
}

/// Rewrites the example job at `example`: the first `path =` line (the source) to `input` (if
/// given), the `[sink]` path to `output`, `max_files_per_batch` to `files_per_batch`, and
/// appends `extra`.
fn job_text(
    example: &str,
    input: Option<&str>,
    output: &str,
    files_per_batch: u64,
    extra: &str,
) -> String {
    let path = repo_root().join(example);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{example}: {e}"));
    let mut in_sink = false;
    let mut source_done = input.is_none();
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.starts_with('[') {
            in_sink = line == "[sink]";
        }
        let line = if line.starts_with("path = ") && in_sink {
            format!("path = \"{output}\"")
        } else if line.starts_with("path = ") && !source_done {
            source_done = true;
            format!("path = \"{}\"", input.unwrap())
        } else if line.starts_with("max_files_per_batch = ") {
            format!("max_files_per_batch = {files_per_batch}")
        } else {
            line.to_string()
        };
        lines.push(line);
    }
    lines.join("\n") + "\n" + extra
}

/// Runs the job in `text` (written to `dir/name.toml`) to the end of its input, in this process.
async fn run_job(dir: &Path, name: &str, text: &str) -> (RunSummary, Duration) {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let (job, _) = sluice::job_file::load(&path, Some(Trigger::AvailableNow), &Default::default())
        .await
        .unwrap();
    let started = Instant::now();
    let summary = job.run().await.unwrap();
    (summary, started.elapsed())
}

/// `events` click events as JSON lines in `files` files named `clicks-NNNNN.json`, one event a
/// second from 2026-11-01T00:00:00Z on, in file order.
fn write_clicks(dir: &Path, files: u64, events: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let per_file = events / files;
    let mut id = 0u64;
    for f in 0..files {
        let file = std::fs::File::create(dir.join(format!("clicks-{f:05}.json"))).unwrap();
        let mut w = std::io::BufWriter::new(file);
        for _ in 0..per_file {
            let s = id;
            writeln!(
                w,
                r#"{{"id":{id},"user_id":{},"page":"/p/{}","amount":{}.5,"ts":"2026-11-{:02}T{:02}:{:02}:{:02}Z"}}"#,
                id % 1000,
                id % 50,
                id % 100,
                1 + (s / 86_400) % 28,
                (s / 3600) % 24,
                (s / 60) % 60,
                s % 60
            )
            .unwrap();
            id += 1;
        }
    }
}

fn s3_vs_local(events: u64, clicks: u64, tiny_batches: u64) {
    let server = S3Server::start(&[BUCKET]);
    let ws = tempfile::tempdir().unwrap();
    let clicks_dir = ws.path().join("clicks-input");
    write_clicks(&clicks_dir, 20, clicks);
    let tiny_dir = ws.path().join("tiny-input");
    write_clicks(&tiny_dir, tiny_batches, tiny_batches * 20);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut rows: Vec<(String, BTreeMap<&'static str, Measured>)> = Vec::new();
    for (i, (job, count)) in [
        ("nexmark q0", events),
        ("clicks", clicks),
        ("clicks per minute, one-file batches", tiny_batches * 20),
    ]
    .into_iter()
    .enumerate()
    {
        let mut by_place = BTreeMap::new();
        for s3 in [None, Some(&server)] {
            let dir = ws.path().join(format!(
                "job{i}-{}",
                if s3.is_some() { "s3" } else { "local" }
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let place = Place { s3, dir: &dir };
            let (summary, elapsed) = rt.block_on(async {
                match job {
                    "nexmark q0" => {
                        let text = job_text(
                            "examples/nexmark/q0.toml",
                            None,
                            &place.location("q0"),
                            1,
                            &place.options(None),
                        )
                        .replace(
                            "total_events = 10_000_000",
                            &format!("total_events = {events}\nmax_records_per_batch = 500000"),
                        );
                        assert!(text.contains("max_records_per_batch"), "q0.toml changed");
                        run_job(&dir, "q0", &text).await
                    }
                    "clicks" => {
                        let input = place.input(&clicks_dir, "clicks-input").await;
                        let text = job_text(
                            "examples/clicks.toml",
                            Some(&input),
                            &place.location("clicks"),
                            2,
                            &place.options(Some("clicks")),
                        );
                        run_job(&dir, "clicks", &text).await
                    }
                    _ => {
                        let input = place.input(&tiny_dir, "tiny-input").await;
                        let text = job_text(
                            "examples/clicks_per_minute.toml",
                            Some(&input),
                            &place.location("per_minute"),
                            1,
                            &place.options(Some("clicks")),
                        );
                        run_job(&dir, "per_minute", &text).await
                    }
                }
            });
            let measured = Measured::of(&summary, elapsed, count);
            record(serde_json::json!({
                "bench": "s3-vs-local", "commit": git_commit(), "job": job,
                "store": place.name(), "events": count, "batches": summary.batches.len(),
                "seconds": measured.seconds, "events_per_sec": measured.events_per_sec,
                "batch_ms_p50": measured.p50_ms,
            }));
            by_place.insert(place.name(), measured);
        }
        rows.push((job.to_string(), by_place));
    }
    println!("the same job, table and checkpoint on local disk and on the S3 server (moto):");
    println!(
        "{:>38} {:>8} {:>14} {:>14} {:>12} {:>12}",
        "job", "batches", "local ev/s", "S3 ev/s", "local p50", "S3 p50"
    );
    for (job, by_place) in &rows {
        let (local, s3) = (&by_place["local"], &by_place["s3"]);
        println!(
            "{job:>38} {:>8} {:>14.0} {:>14.0} {:>9} ms {:>9} ms",
            local.batches, local.events_per_sec, s3.events_per_sec, local.p50_ms, s3.p50_ms
        );
    }
    println!(
        "per-batch overhead on S3 (p50 of a one-file windowed batch): {} ms (local disk: {} ms)",
        rows[2].1["s3"].p50_ms, rows[2].1["local"].p50_ms
    );
}

/// What one run of a job took.
struct Measured {
    batches: usize,
    seconds: f64,
    events_per_sec: f64,
    p50_ms: u64,
}

impl Measured {
    fn of(summary: &RunSummary, elapsed: Duration, events: u64) -> Measured {
        let millis: Vec<u64> = summary.batches.iter().map(|b| b.millis).collect();
        Measured {
            batches: millis.len(),
            seconds: elapsed.as_secs_f64(),
            events_per_sec: events as f64 / elapsed.as_secs_f64(),
            p50_ms: p50(millis),
        }
    }
}

fn small_files(batches: u64, on_s3: bool) {
    const MIN_FILES: u64 = 16;
    const TARGET_FILE_SIZE: u64 = 128 * 1024 * 1024;
    let server = on_s3.then(|| S3Server::start(&[BUCKET]));
    let ws = tempfile::tempdir().unwrap();
    let input_dir = ws.path().join("input");
    write_clicks(&input_dir, batches, batches * 20);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sql = "SELECT id, user_id, page, amount, ts, CAST(user_id % 3 AS VARCHAR) AS bucket \
               FROM clicks";
    println!(
        "{batches} one-file batches (20 events each) into a table partitioned three ways, on {}:",
        if on_s3 {
            "the S3 server (moto)"
        } else {
            "local disk"
        }
    );
    println!(
        "{:>36} {:>9} {:>16} {:>16} {:>18} {:>12} {:>14}",
        "", "run", "p50 first 100", "p50 last 100", "most files/part.", "log objects", "table open"
    );
    for (name, sink) in [
        (
            "compaction and checkpoints on",
            format!("partition_by = [\"bucket\"]\ncompaction = {{ min_files = {MIN_FILES} }}\ncheckpoint_interval = 10\n"),
        ),
        (
            "compaction and checkpoints off",
            "partition_by = [\"bucket\"]\ncompaction = { enabled = false }\ncheckpoint_interval = 1000000\n"
                .to_string(),
        ),
    ] {
        let dir = ws.path().join(name.replace(' ', "-"));
        std::fs::create_dir_all(&dir).unwrap();
        let place = Place {
            s3: server.as_ref(),
            dir: &dir,
        };
        let table = place.location("out");
        let (summary, elapsed, files, open, log_objects) = rt.block_on(async {
            let input = place.input(&input_dir, "input").await;
            let text = job_text("examples/clicks.toml", Some(&input), &table, 1, "")
                .replace("[sink]\n", &format!("[sink]\n{sink}"));
            let text = replace_query(&text, sql) + &place.options(Some("clicks"));
            let (summary, elapsed) = run_job(&dir, "small_files", &text).await;
            let options = storage_options(server.as_ref());
            let (files, open) = table_files_and_open_time(&table, &options).await;
            (summary, elapsed, files, open, log_objects(&table, &options).await)
        });
        assert_eq!(summary.batches.len() as u64, batches);
        let millis: Vec<u64> = summary.batches.iter().map(|b| b.millis).collect();
        let first = p50(millis[..100.min(millis.len())].to_vec());
        let last = p50(millis[millis.len().saturating_sub(100)..].to_vec());
        let (most, bound) = files
            .values()
            .map(|(n, bytes)| (*n, 2 * bytes.div_ceil(TARGET_FILE_SIZE).max(1) + MIN_FILES))
            .max()
            .unwrap();
        println!(
            "{name:>36} {:>7.1} s {:>13} ms {:>13} ms {:>9} (≤ {bound:>2}) {:>12} {:>11.1} ms",
            elapsed.as_secs_f64(),
            first,
            last,
            most,
            log_objects,
            open.as_secs_f64() * 1e3
        );
        record(serde_json::json!({
            "bench": "small-files", "commit": git_commit(), "run": name,
            "store": place.name(), "batches": batches, "seconds": elapsed.as_secs_f64(),
            "batch_ms_p50_first_100": first, "batch_ms_p50_last_100": last,
            "most_active_files_per_partition": most, "bound": bound,
            "log_objects": log_objects, "open_ms": open.as_secs_f64() * 1e3,
        }));
        if name.ends_with(" on") {
            for (partition, (n, bytes)) in &files {
                let bound = 2 * bytes.div_ceil(TARGET_FILE_SIZE).max(1) + MIN_FILES;
                assert!(
                    *n <= bound,
                    "partition {partition} holds {n} active files, above {bound}"
                );
            }
        }
    }
}

/// Replaces the job's `[query] sql` (the rest of the text after `sql = """`).
fn replace_query(text: &str, sql: &str) -> String {
    let at = text.find("sql = \"\"\"").unwrap();
    format!("{}sql = \"\"\"{sql}\"\"\"\n", &text[..at])
}

/// The storage options a bench process uses to reach the server, as a map.
fn storage_options(server: Option<&S3Server>) -> std::collections::HashMap<String, String> {
    server
        .map(|s| {
            s.storage_options()
                .lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once(" = ")?;
                    Some((k.to_string(), v.trim_matches('"').to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The active files of the table at `location` by partition (count, bytes), and how long
/// loading its latest snapshot takes (median of five loads).
async fn table_files_and_open_time(
    location: &str,
    options: &std::collections::HashMap<String, String>,
) -> (BTreeMap<String, (u64, u64)>, Duration) {
    sluice::sinks::delta::register_cloud_stores();
    let url = table_url(location);
    let mut times = Vec::new();
    let mut table = None;
    for _ in 0..5 {
        let t = Instant::now();
        let opened = deltalake::open_table_with_storage_options(url.clone(), options.clone())
            .await
            .unwrap();
        times.push(t.elapsed());
        table = Some(opened);
    }
    let table = table.unwrap();
    let mut files: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for file in table.snapshot().unwrap().log_data().iter() {
        let partition = format!("{:?}", file.partition_values_map());
        let entry = files.entry(partition).or_default();
        entry.0 += 1;
        entry.1 += u64::try_from(file.size()).unwrap_or(0);
    }
    times.sort();
    (files, times[2])
}

/// The objects under the table's `_delta_log/`.
async fn log_objects(location: &str, options: &std::collections::HashMap<String, String>) -> usize {
    use futures::TryStreamExt;
    let url = table_url(location);
    let (store, table) = sluice::engine::storage::open_store(
        &url,
        &sluice::engine::storage::StorageOptions::from_map(options),
    )
    .unwrap();
    let log = table.join("_delta_log");
    store
        .list(Some(&log))
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .len()
}

fn table_url(location: &str) -> url::Url {
    if location.starts_with("s3://") {
        url::Url::parse(&format!("{location}/")).unwrap()
    } else {
        url::Url::from_directory_path(location).unwrap()
    }
}

fn p50(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn record(line: serde_json::Value) {
    let path = repo_root().join("benches/results/storage.jsonl");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}
