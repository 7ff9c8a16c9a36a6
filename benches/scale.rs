//! Scale benchmarks: costs that must not grow with how long a job has run.
//!
//! ```text
//! cargo bench --bench scale -- files-planning [--files 1000,10000,100000]
//! cargo bench --bench scale -- backfill-memory [--events-per-hour 1000000]
//! cargo bench --bench scale -- state-size [--state-rows 10000,100000,1000000] [--batch-events 10000]
//! ```
//!
//! - `files-planning`: the files source's planning step (`available()`: list the directory,
//!   record new files) with 1k, 10k and 100k files already recorded, one new file per batch —
//!   p50 per batch, next to a full listing of the directory (what every batch cost when the whole
//!   directory was listed and the whole file log rewritten). Goal: flat.
//! - `backfill-memory`: a 24-hour history (`--hours`) of click events (JSON files) committed by
//!   the live job, then a backfill of one hour of it — stateless and windowed — by the binary;
//!   prints the peak RSS of resolving the hour to offsets (a scan of the whole history) and of
//!   the backfill, split into anonymous memory (what holds data) and file-backed memory (the
//!   binary's resident code, and the input files mapped while read), next to that hour's data
//!   as Arrow. Goal: the anonymous memory a run holds beyond the opened
//!   job ≤ 2× the hour, and the same figures for a longer history.
//! - `state-size`: one batch of a stateful query (its rows aggregated and merged into the state,
//!   emitted, its state delta written) with 10k, 100k and 1M groups already open — per-user
//!   hourly windows (append), a running per-user aggregate (update) and a deduplication by
//!   user (N keys remembered) — p50 per batch side by side. Goal: within 2× of each other (a batch costs what it touches, not what is held).
//!
//! All append their figures as JSON lines (with the git commit) to `benches/results/scale.jsonl`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{MEMORY_POLL, MemoryPeaks, git_commit, repo_root};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema};
use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::event_time::event_time_type;
use sluice::engine::operators::state_store::StateLog;
use sluice::engine::query::{BatchWatermark, QuerySettings, StreamingQuery};
use sluice::engine::source::{SOURCE_OFFSET, SOURCE_PARTITION};
use sluice::engine::{BatchId, OutputMode, Source, SourceContext};

fn results() -> PathBuf {
    repo_root().join("benches/results/scale.jsonl")
}

fn record(line: serde_json::Value) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(results())
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

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
    match what.as_str() {
        "files-planning" => {
            let counts: Vec<usize> = option("--files")
                .unwrap_or_else(|| "1000,10000,100000".into())
                .split(',')
                .map(|n| n.replace('_', "").parse().unwrap())
                .collect();
            files_planning(&counts);
        }
        "backfill-memory" => {
            let per_hour = option("--events-per-hour")
                .map_or(1_000_000, |n| n.replace('_', "").parse().unwrap());
            let hours = option("--hours").map_or(24, |n| n.parse().unwrap());
            backfill_memory(per_hour, hours);
        }
        "state-size" => {
            let sizes: Vec<usize> = option("--state-rows")
                .unwrap_or_else(|| "10000,100000,1000000".into())
                .split(',')
                .map(|n| n.replace('_', "").parse().unwrap())
                .collect();
            let batch =
                option("--batch-events").map_or(10_000, |n| n.replace('_', "").parse().unwrap());
            state_size(&sizes, batch);
        }
        other => panic!(
            "unknown benchmark '{other}': files-planning [--files N,N] | backfill-memory \
             [--events-per-hour N] [--hours N] | state-size [--state-rows N,N] [--batch-events N]"
        ),
    }
}

fn files_planning(counts: &[usize]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!("files source, planning one batch (available()) with N files recorded:");
    println!(
        "{:>10} {:>16} {:>18} {:>20}",
        "files", "p50 per batch", "full listing", "first listing"
    );
    for &n in counts {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("input");
        std::fs::create_dir_all(&input).unwrap();
        for i in 0..n {
            std::fs::write(input.join(format!("f-{i:08}.json")), "{\"id\":1}\n").unwrap();
        }
        let checkpoint = CheckpointStore::open(
            &url::Url::from_directory_path(dir.path().join("checkpoint")).unwrap(),
        )
        .unwrap();
        let (first, per_batch, full) = rt.block_on(async {
            let mut source = FilesSource::new(FilesSourceConfig {
                schema: Some("id BIGINT".into()),
                ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
            })
            .unwrap();
            source
                .open(SourceContext {
                    name: "files".into(),
                    checkpoint,
                    validating: false,
                })
                .await
                .unwrap();
            let t = Instant::now();
            let available = source.available().await.unwrap();
            let first = t.elapsed();
            assert_eq!(available["0"].latest, n as i64);
            let mut per_batch = Vec::new();
            for i in 0..30 {
                std::fs::write(input.join(format!("f-{:08}.json", n + i)), "{\"id\":1}\n").unwrap();
                let t = Instant::now();
                let available = source.available().await.unwrap();
                per_batch.push(t.elapsed());
                assert_eq!(available["0"].latest, (n + i + 1) as i64);
            }
            // What a batch paid before: the whole directory listed, every entry looked at.
            let t = Instant::now();
            let listed = std::fs::read_dir(&input)
                .unwrap()
                .filter_map(|e| e.ok()?.metadata().ok())
                .count();
            assert!(listed > n);
            (first, p50(per_batch), t.elapsed())
        });
        println!(
            "{n:>10} {:>13.2} ms {:>15.2} ms {:>17.2} ms",
            per_batch.as_secs_f64() * 1e3,
            full.as_secs_f64() * 1e3,
            first.as_secs_f64() * 1e3
        );
        record(serde_json::json!({
            "bench": "files-planning", "commit": git_commit(), "files": n,
            "p50_ms_per_batch": per_batch.as_secs_f64() * 1e3,
            "full_listing_ms": full.as_secs_f64() * 1e3,
            "first_listing_ms": first.as_secs_f64() * 1e3,
        }));
    }
}

/// Writes `hours` hours of click events from midnight, `per_hour` an hour, 10 files an hour.
fn write_history(input: &Path, per_hour: u64, hours: u64) {
    std::fs::create_dir_all(input).unwrap();
    let per_file = per_hour / 10;
    let mut id = 0u64;
    for hour in 0..hours {
        for part in 0..10u64 {
            let file =
                std::fs::File::create(input.join(format!("h{hour:03}-{part:02}.json"))).unwrap();
            let mut w = std::io::BufWriter::new(file);
            for i in 0..per_file {
                let micros = (hour * 3600 + part * 360) * 1_000_000 + i * 360_000_000 / per_file;
                let (s, us) = (micros / 1_000_000, micros % 1_000_000);
                writeln!(
                    w,
                    r#"{{"id":{id},"user_id":{},"page":"/p/{}","amount":{}.5,"ts":"2026-11-{:02}T{:02}:{:02}:{:02}.{us:06}Z"}}"#,
                    id % 1000,
                    id % 50,
                    id % 100,
                    1 + s / 86_400,
                    (s / 3600) % 24,
                    (s / 60) % 60,
                    s % 60
                )
                .unwrap();
                id += 1;
            }
        }
    }
}

fn job_file(dir: &Path, name: &str, input: &Path, sql: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[job]
id = "{name}"

[sources.clicks]
kind = "files"
path = "{input}"
format = "json"
schema = "id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP"
event_time = "ts"
max_out_of_orderness = "10s"
max_files_per_batch = 2

[sink]
kind = "delta"
path = "{out}"

[query]
sql = """{sql}"""
"#,
            input = input.display(),
            out = dir.join(name).display(),
        ),
    )
    .unwrap();
    path
}

fn backfill_memory(per_hour: u64, hours: u64) {
    assert!(hours > 12, "the backfilled hour is 12:00-13:00");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    let t = Instant::now();
    write_history(&input, per_hour, hours);
    println!(
        "{hours} hours of click events, {per_hour} an hour, written in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let jobs = [
        (
            "stateless",
            "SELECT id, user_id, upper(page) AS page, amount, ts FROM clicks",
        ),
        (
            "windowed",
            "SELECT window_start, window_end, user_id % 10 AS bucket, count(*) AS clicks, \
             sum(amount) AS amount FROM tumble(clicks, ts, INTERVAL '1' MINUTE) \
             GROUP BY window_start, window_end, user_id % 10",
        ),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (name, sql) in jobs {
        let job = job_file(dir.path(), name, &input, sql);
        // The live job commits the whole history, in its own process.
        let t = Instant::now();
        let live = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", job.to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            live.status.success(),
            "{}",
            String::from_utf8_lossy(&live.stderr)
        );
        let live_secs = t.elapsed().as_secs_f64();
        // Then one hour of it is backfilled by the binary, measured from outside: the peak of
        // a run that only opens everything (an empty range, dry), of resolving the hour to
        // offsets (a scan of the whole history, dry), and of the backfill of those offsets.
        let job = job.to_str().unwrap();
        let opened = peak_of(&["backfill", job, "--from", "0:0", "--to", "0:0", "--dry-run"]);
        let scan = peak_of(&[
            "backfill",
            job,
            "--from-time",
            "2026-11-01T12:00:00Z",
            "--to-time",
            "2026-11-01T13:00:00Z",
            "--dry-run",
        ]);
        assert!(
            scan.stdout.contains("offsets 0:[120, 130)"),
            "{}",
            scan.stdout
        );
        let t = Instant::now();
        let backfill = peak_of(&["backfill", job, "--from", "0:120", "--to", "0:130"]);
        let secs = t.elapsed().as_secs_f64();
        let report = backfill
            .stdout
            .lines()
            .find(|l| l.contains("rows in"))
            .unwrap_or_default()
            .trim()
            .to_string();
        let hour = rt.block_on(hour_as_arrow(&input));
        let hour_json: u64 = (0..10)
            .map(|part| {
                std::fs::metadata(input.join(format!("h012-{part:02}.json")))
                    .unwrap()
                    .len()
            })
            .sum();
        // What a run holds beyond the opened job, in the hour's Arrow size: its anonymous
        // memory (heap, stacks), which holds the data. The resident code of the binary
        // (file-backed, shared, the same for an hour of 20 K events as for one of 1 M) is
        // printed beside it but not counted as data held; so are the JSON files mapped while
        // they are decoded (page cache, since 7cac174: before it their copies were anonymous,
        // so records before and after it do not compare).
        let ratio =
            |run: &Peak| run.memory.anon.saturating_sub(opened.memory.anon) as f64 / hour as f64;
        println!(
            "{name}: live job over {hours} h {live_secs:.1} s; backfill of 12:00–13:00 in \
             {secs:.1} s ({report})\n  the hour as Arrow: {:.0} MiB (as JSON: {:.0} MiB)\n  \
             opening:   {}\n  resolving the hour to its offsets (scans {hours} h): {} = +{:.2}× \
             the hour\n  backfilling those offsets: {} = +{:.2}× the hour",
            mib(hour),
            mib(hour_json),
            opened.memory.describe(),
            scan.memory.describe(),
            ratio(&scan),
            backfill.memory.describe(),
            ratio(&backfill),
        );
        record(serde_json::json!({
            "bench": "backfill-memory", "commit": git_commit(), "job": name,
            "events_per_hour": per_hour, "hours": hours, "backfill_secs": secs,
            "opening_peak_rss_bytes": opened.memory.rss, "resolving_peak_rss_bytes": scan.memory.rss,
            "backfill_peak_rss_bytes": backfill.memory.rss,
            "opening_peak_anon_bytes": opened.memory.anon, "resolving_peak_anon_bytes": scan.memory.anon,
            "backfill_peak_anon_bytes": backfill.memory.anon, "backfill_peak_file_bytes": backfill.memory.file,
            "hour_arrow_bytes": hour, "hour_json_bytes": hour_json,
            "backfill_ratio_to_hour": ratio(&backfill), "resolving_ratio_to_hour": ratio(&scan),
        }));
    }
}

/// The memory peaks of one run of the binary, read from `/proc/<pid>/status`.
struct Peak {
    memory: MemoryPeaks,
    stdout: String,
}

/// Runs `sluice args` and returns its memory peaks (`/proc` polled every [`MEMORY_POLL`]) and
/// its stdout.
fn peak_of(args: &[&str]) -> Peak {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = PathBuf::from(format!("/proc/{}/status", child.id()));
    let mut memory = MemoryPeaks::default();
    while child.try_wait().unwrap().is_none() {
        memory.observe(&status);
        std::thread::sleep(MEMORY_POLL);
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "sluice {args:?} failed");
    Peak {
        memory,
        stdout: String::from_utf8_lossy(&out.stdout).to_string(),
    }
}

/// The 12:00 hour's events decoded into Arrow, in bytes (decoded after the measurements, so
/// they do not count it).
async fn hour_as_arrow(input: &Path) -> u64 {
    let schema = sluice::engine::schema::parse_schema(
        "id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP",
    )
    .await
    .unwrap();
    let mut bytes = 0;
    for part in 0..10 {
        let file = std::fs::File::open(input.join(format!("h012-{part:02}.json"))).unwrap();
        let reader = arrow::json::ReaderBuilder::new(schema.clone())
            .build(std::io::BufReader::new(file))
            .unwrap();
        for batch in reader {
            bytes += batch.unwrap().get_array_memory_size() as u64;
        }
    }
    bytes
}

/// Click events `users` (user ids, in that order) at `at` µs, as a source batch.
fn clicks(users: &[i64], at: &[i64], first_offset: i64) -> RecordBatch {
    let n = users.len();
    let schema = Arc::new(Schema::new(vec![
        Field::new("user_id", DataType::Utf8, false),
        Field::new("amount", DataType::Float64, false),
        Field::new("ts", event_time_type(), false),
        Field::new(SOURCE_PARTITION, DataType::Utf8, false),
        Field::new(SOURCE_OFFSET, DataType::Int64, false),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(
                users.iter().map(|u| format!("user-{u:08}")),
            )),
            Arc::new(Float64Array::from_iter_values(
                users.iter().map(|u| (u % 100) as f64 + 0.5),
            )),
            Arc::new(TimestampMicrosecondArray::from(at.to_vec()).with_timezone("UTC")),
            Arc::new(StringArray::from(vec!["0"; n])),
            Arc::new(Int64Array::from_iter_values(
                first_offset..first_offset + n as i64,
            )),
        ],
    )
    .unwrap()
}

/// Per-batch time of a stateful query against how much state it holds: the state is filled
/// with `size` groups (one per user, all in one open hour), then batches of `batch` events of
/// users spread over all of them are run (aggregate, merge, emit, write the state's delta).
fn state_size(sizes: &[usize], batch: usize) {
    const HOUR: i64 = 3_600_000_000;
    const BATCHES: usize = 150;
    // 2024-05-01T00:00:00Z: every event falls in the hour after it.
    let start = 1_714_521_600_000_000i64;
    let jobs = [
        (
            "windowed (append)",
            "SELECT window_start, user_id, count(*) AS clicks, sum(amount) AS total \
             FROM tumble(clicks, ts, INTERVAL '1' HOUR) GROUP BY window_start, window_end, user_id",
            OutputMode::Append,
            None,
        ),
        (
            "running (update)",
            "SELECT user_id, count(*) AS clicks, sum(amount) AS total FROM clicks GROUP BY user_id",
            OutputMode::Update,
            Some(Duration::from_secs(86_400)),
        ),
        (
            "deduplication",
            "SELECT DISTINCT user_id FROM clicks",
            OutputMode::Append,
            Some(Duration::from_secs(86_400)),
        ),
    ];
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!(
        "one batch of {batch} events (aggregate, merge into state, emit, write state) with N groups open:"
    );
    print!("{:>20}", "state rows");
    for &n in sizes {
        print!(" {n:>18}");
    }
    println!("   (ms per batch: p50 / mean, the mean with the amortised merges and base files)");
    for (name, sql, mode, state_ttl) in jobs {
        print!("{name:>20}");
        for &n in sizes {
            let settings = QuerySettings {
                event_time: BTreeMap::from([("clicks".to_string(), "ts".to_string())]),
                output_mode: mode,
                state_ttl,
                ..QuerySettings::default()
            };
            let dir = tempfile::tempdir().unwrap();
            let checkpoint =
                CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
            let per_batch = rt.block_on(async {
                let schema = clicks(&[], &[], 0).schema();
                let mut query = StreamingQuery::plan(sql, &[("clicks".into(), schema)], &settings)
                    .await
                    .unwrap();
                query
                    .restore_state(StateLog::new(&checkpoint, 1), None, None)
                    .await
                    .unwrap();
                // A watermark inside the hour, 1 ms further each batch: purges are looked for,
                // but no window closes and no group expires.
                let watermark_at = |b: i64| start + HOUR / 2 + b * 1000;
                let watermark = BatchWatermark {
                    before: Some(watermark_at(0)),
                    after: Some(watermark_at(0)),
                };
                let (mut id, mut offset) = (0, 0);
                for from in (0..n).step_by(100_000) {
                    let users: Vec<i64> = (from as i64..(from + 100_000).min(n) as i64).collect();
                    let at: Vec<i64> = users.iter().map(|u| start + HOUR / 2 + u % 1000).collect();
                    let input =
                        BTreeMap::from([("clicks".to_string(), clicks(&users, &at, offset))]);
                    offset += users.len() as i64;
                    query.execute_isolating(&input, watermark).await.unwrap();
                    query.write_state(BatchId(id)).await.unwrap();
                    id += 1;
                }
                let mut per_batch = Vec::new();
                for b in 0..BATCHES as i64 {
                    // Users spread over all open groups (a multiplicative hash of the row).
                    let users: Vec<i64> = (0..batch as i64)
                        .map(|i| ((b * batch as i64 + i) * 2_654_435_761) % n as i64)
                        .collect();
                    let at: Vec<i64> = users.iter().map(|u| watermark_at(b) + u % 1000).collect();
                    let watermark = BatchWatermark {
                        before: Some(watermark_at(b)),
                        after: Some(watermark_at(b + 1)),
                    };
                    let input =
                        BTreeMap::from([("clicks".to_string(), clicks(&users, &at, offset))]);
                    offset += batch as i64;
                    let t = Instant::now();
                    query.execute_isolating(&input, watermark).await.unwrap();
                    query.write_state(BatchId(id)).await.unwrap();
                    per_batch.push(t.elapsed());
                    id += 1;
                }
                let mean = per_batch.iter().sum::<Duration>() / per_batch.len() as u32;
                (p50(per_batch), mean, query.state_size().unwrap().rows)
            });
            let (p50, mean, rows) = per_batch;
            assert_eq!(
                rows, n as u64,
                "every user one open group (or remembered key)"
            );
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            print!(" {:>8.2} / {:>7.2}", ms(p50), ms(mean));
            record(serde_json::json!({
                "bench": "state-size", "commit": git_commit(), "job": name,
                "state_rows": n, "batch_events": batch, "batches": BATCHES,
                "p50_ms_per_batch": ms(p50), "mean_ms_per_batch": ms(mean),
            }));
        }
        println!();
    }
}
