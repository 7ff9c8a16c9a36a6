//! Criterion benchmarks of the per-batch hot paths: generating Nexmark events, decoding JSON
//! files, decoding JSON and CSV files clean and with 1 % and 10 % bad lines side by side,
//! running a stateless query and a window aggregation step over a batch, and committing a batch
//! to Delta. Run with `cargo bench --bench hot_paths`; the figures (rows/s) are printed by
//! criterion.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{git_commit, repo_root};
use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use criterion::{Criterion, Throughput, criterion_group};
use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::connectors::nexmark::{NexmarkSource, NexmarkSourceConfig, NexmarkTable};
use sluice::engine::Trigger;
use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::operators::state_store::StateLog;
use sluice::engine::query::{BatchWatermark, QuerySettings, StreamingQuery};
use sluice::engine::source::{SOURCE_OFFSET, SOURCE_PARTITION};
use sluice::engine::{
    BatchCommit, BatchId, OffsetRange, OutputTables, Sink, Source, SourceContext,
};
use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig};

const ROWS: usize = 100_000;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Runtime::new().unwrap()
}

/// `rows` click events as JSON (or CSV) lines in `files` files under `dir/input`, every
/// `bad_every`-th line bad (0: none) in one of the ways real feeds go bad: cut off, not a
/// record, a value of the wrong type, a timestamp that is not one, a fraction in an integer
/// column.
fn write_click_files(
    dir: &std::path::Path,
    format: FileFormat,
    bad_every: usize,
    (rows, files): (usize, usize),
) -> std::path::PathBuf {
    let input = dir.join("input");
    std::fs::create_dir_all(&input).unwrap();
    for f in 0..files {
        let mut text = String::new();
        for i in 0..rows / files {
            let line = f * (rows / files) + i;
            let (user, page, amount, second) = (i % 1000, i % 7, i % 100, i % 60);
            let fields = |user: &str, amount: &str, ts: &str| match format {
                FileFormat::Csv => format!("{i},{user},/p/{page},{amount},{ts}"),
                _ => format!(
                    "{{\"id\":{i},\"user_id\":{user},\"page\":\"/p/{page}\",\"amount\":{amount},\"ts\":\"{ts}\"}}"
                ),
            };
            let (user, amount) = (user.to_string(), format!("{amount}.25"));
            let ts = format!("2026-11-01T10:00:{second:02}Z");
            let good = fields(&user, &amount, &ts);
            let bad = bad_every > 0 && line % bad_every == bad_every / 2;
            let text_line = match (bad, (line / bad_every.max(1)) % 5) {
                (false, _) => good,
                // Cut off: JSON halfway, CSV inside its last field's date (no longer a time).
                (true, 0) => match format {
                    FileFormat::Csv => good[..good.len() - 12].to_string(),
                    _ => good[..good.len() / 2].to_string(),
                },
                (true, 1) => format!("not a record at all: line {line}"),
                (true, 2) => fields(&user, "\"n/a\"", &ts),
                (true, 3) => fields(&user, &amount, "yesterday at noon"),
                (true, _) => fields("12.5", &amount, &ts),
            };
            text.push_str(&text_line);
            text.push('\n');
        }
        let extension = if format == FileFormat::Csv {
            "csv"
        } else {
            "json"
        };
        std::fs::write(input.join(format!("f{f:03}.{extension}")), text).unwrap();
    }
    input
}

/// A files source over `input`, opened, with its files listed.
fn opened_source(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    input: &std::path::Path,
    format: FileFormat,
) -> FilesSource {
    let mut source = FilesSource::new(FilesSourceConfig {
        schema: Some("id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP".into()),
        header: false,
        ..FilesSourceConfig::new(input.to_string_lossy(), format)
    })
    .unwrap();
    let checkpoint =
        CheckpointStore::open(&url::Url::from_directory_path(dir.join("ckpt")).unwrap()).unwrap();
    rt.block_on(async {
        source
            .open(SourceContext {
                name: "clicks".into(),
                checkpoint,
                validating: false,
            })
            .await
            .unwrap();
        source.available().await.unwrap();
    });
    source
}

fn decode_json_files(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let input = write_click_files(dir.path(), FileFormat::Json, 0, (ROWS, 10));
    let source = opened_source(&rt, dir.path(), &input, FileFormat::Json);
    let mut group = c.benchmark_group("files_source");
    group.throughput(Throughput::Elements(ROWS as u64));
    group.bench_function("read_json_100k_rows_10_files", |b| {
        b.iter(|| {
            rt.block_on(source.read(&"0".to_string(), OffsetRange::new(0, 10)))
                .unwrap()
        })
    });
    group.finish();
}

/// The same 100 K click lines clean, with 1 % and with 10 % bad lines, read side by side, as
/// JSON and as CSV: a bad line should cost about what a line costs, not a re-decode of its
/// neighbours.
fn decode_bad_lines(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("files_source_bad_lines");
    group.throughput(Throughput::Elements(ROWS as u64));
    for format in [FileFormat::Json, FileFormat::Csv] {
        for (bad, bad_every) in [("clean", 0), ("1pct_bad", 100), ("10pct_bad", 10)] {
            let name = format!(
                "{}_{bad}",
                if format == FileFormat::Csv {
                    "csv"
                } else {
                    "json"
                }
            );
            let dir = tempfile::tempdir().unwrap();
            let input = write_click_files(dir.path(), format, bad_every, (ROWS, 10));
            let source = opened_source(&rt, dir.path(), &input, format);
            let read = rt
                .block_on(source.read(&"0".to_string(), OffsetRange::new(0, 10)))
                .unwrap();
            let rows: usize = read.batches.iter().map(RecordBatch::num_rows).sum();
            assert_eq!(
                rows + read.dead_letters.len(),
                ROWS,
                "{name}: a line got lost"
            );
            let expected_bad = ROWS.checked_div(bad_every).unwrap_or(0);
            assert_eq!(
                read.dead_letters.len(),
                expected_bad,
                "{name}: dead letters"
            );
            group.bench_function(name, |b| {
                b.iter(|| {
                    rt.block_on(source.read(&"0".to_string(), OffsetRange::new(0, 10)))
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

fn input_batch() -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("page", DataType::Utf8, false),
        Field::new("amount", DataType::Float64, false),
        Field::new(SOURCE_PARTITION, DataType::Utf8, false),
        Field::new(SOURCE_OFFSET, DataType::Int64, false),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(0..ROWS as i64)),
            Arc::new(StringArray::from_iter_values(
                (0..ROWS).map(|i| format!("/p/{}", i % 7)),
            )),
            Arc::new(Float64Array::from_iter_values(
                (0..ROWS).map(|i| i as f64 * 0.5),
            )),
            Arc::new(StringArray::from(vec!["0"; ROWS])),
            Arc::new(Int64Array::from(vec![0; ROWS])),
        ],
    )
    .unwrap()
}

fn execute_query(c: &mut Criterion) {
    let rt = runtime();
    let batch = input_batch();
    let settings = QuerySettings {
        lineage: true,
        ..QuerySettings::default()
    };
    let mut query = rt
        .block_on(StreamingQuery::plan(
            "SELECT id, upper(page) AS page, amount * 2 AS amount2 FROM t WHERE amount > 10",
            &[("t".into(), batch.schema())],
            &settings,
        ))
        .unwrap();
    let inputs = BTreeMap::from([("t".to_string(), batch)]);
    let mut group = c.benchmark_group("query");
    group.throughput(Throughput::Elements(ROWS as u64));
    group.bench_function("stateless_projection_filter_100k_rows", |b| {
        b.iter(|| {
            rt.block_on(query.execute_isolating(&inputs, BatchWatermark::default()))
                .unwrap()
        })
    });
    group.finish();
}

fn delta_commit(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let batch = input_batch();
    let mut sink =
        DeltaSink::new(DeltaSinkConfig::new(dir.path().join("t").to_string_lossy())).unwrap();
    rt.block_on(sink.open("bench", OutputTables::append(batch.schema())))
        .unwrap();
    let mut next = 0;
    let mut group = c.benchmark_group("delta_sink");
    group.sample_size(10);
    group.throughput(Throughput::Elements(ROWS as u64));
    group.bench_function("commit_100k_rows", |b| {
        b.iter(|| {
            let commit = BatchCommit {
                batch_id: BatchId(next),
                output: vec![batch.clone()],
                dead_letters: vec![],
                late: vec![],
                manifest: serde_json::json!({}),
            };
            next += 1;
            rt.block_on(sink.commit(commit)).unwrap()
        })
    });
    group.finish();
}

/// JSON files into a Delta table, stateless: how close a job comes to the work it cannot avoid.
/// The same 1 M click rows (20 files, 85 MB of JSON) are decoded by the files source, committed
/// to Delta by the sink (Parquet encode and one commit), and run end to end as a job (`sluice
/// run` of `SELECT …` over the files: plan, intent, read, query, manifest, commit) into a
/// fresh table each time. Prints the three side by side with the job's time against decode +
/// encode (goal: within 2×) and, under `cargo bench`, appends them to
/// `benches/results/hot_paths.jsonl`. The encode runs commit to one table that grows by a batch
/// each run, as a streaming job's batches do; the job writes its one batch into a fresh table.
fn json_to_delta(c: &mut Criterion) {
    const ROWS_IN_FILES: usize = 1_000_000;
    const FILES: usize = 20;
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let input = write_click_files(dir.path(), FileFormat::Json, 0, (ROWS_IN_FILES, FILES));
    let source = opened_source(&rt, dir.path(), &input, FileFormat::Json);
    let all_files = OffsetRange::new(0, FILES as i64);
    let read = rt
        .block_on(source.read(&"0".to_string(), all_files))
        .unwrap();
    // The rows the job writes: the declared columns (no lineage).
    let columns = ["id", "user_id", "page", "amount", "ts"];
    let rows: Vec<RecordBatch> = read
        .batches
        .iter()
        .map(|b| {
            let indices: Vec<usize> = columns
                .iter()
                .map(|c| b.schema().index_of(c).unwrap())
                .collect();
            b.project(&indices).unwrap()
        })
        .collect();
    assert_eq!(
        rows.iter().map(RecordBatch::num_rows).sum::<usize>(),
        ROWS_IN_FILES
    );
    let mut sink =
        DeltaSink::new(DeltaSinkConfig::new(dir.path().join("t").to_string_lossy())).unwrap();
    rt.block_on(sink.open("bench", OutputTables::append(rows[0].schema())))
        .unwrap();
    let mut next = 0;
    let mut runs = 0;
    let times: std::cell::RefCell<BTreeMap<&str, Vec<f64>>> = Default::default();
    let timed = |name: &'static str, iters: u64, mut once: Box<dyn FnMut() + '_>| {
        let mut total = std::time::Duration::ZERO;
        for _ in 0..iters {
            let t = std::time::Instant::now();
            once();
            let took = t.elapsed();
            times
                .borrow_mut()
                .entry(name)
                .or_default()
                .push(took.as_secs_f64());
            total += took;
        }
        total
    };
    let mut group = c.benchmark_group("json_to_delta");
    group.sample_size(10);
    group.throughput(Throughput::Elements(ROWS_IN_FILES as u64));
    group.bench_function("decode_1m_rows", |b| {
        b.iter_custom(|iters| {
            timed(
                "decode",
                iters,
                Box::new(|| {
                    rt.block_on(source.read(&"0".to_string(), all_files))
                        .unwrap();
                }),
            )
        })
    });
    group.bench_function("encode_commit_1m_rows", |b| {
        b.iter_custom(|iters| {
            timed(
                "encode",
                iters,
                Box::new(|| {
                    let commit = BatchCommit {
                        batch_id: BatchId(next),
                        output: rows.clone(),
                        dead_letters: vec![],
                        late: vec![],
                        manifest: serde_json::json!({}),
                    };
                    next += 1;
                    rt.block_on(sink.commit(commit)).unwrap();
                }),
            )
        })
    });
    group.bench_function("job_1m_rows", |b| {
        b.iter_custom(|iters| {
            timed(
                "job",
                iters,
                Box::new(|| {
                    runs += 1;
                    let job = files_to_delta_job(dir.path(), &input, runs);
                    let summary = rt
                        .block_on(async {
                            let (job, _) = sluice::job_file::load(
                                &job,
                                Some(Trigger::AvailableNow),
                                &Default::default(),
                            )
                            .await?;
                            Ok::<_, sluice::Error>(job.run().await?)
                        })
                        .unwrap();
                    assert_eq!(summary.rows_out, ROWS_IN_FILES as u64);
                    assert_eq!(summary.batches.len(), 1, "the files are one batch");
                }),
            )
        })
    });
    group.finish();
    let median = |name: &str| {
        let mut t = times.borrow().get(name).cloned().unwrap_or_default();
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied()
    };
    let (Some(decode), Some(encode), Some(job)) =
        (median("decode"), median("encode"), median("job"))
    else {
        return; // a filter left one out
    };
    let per_sec = |s: f64| ROWS_IN_FILES as f64 / s / 1e6;
    let limit = decode + encode;
    println!(
        "JSON files → Delta, 1 M rows (median of every timed run, criterion's warm-up \
         included): decode {:.2} s ({:.2} M rows/s), \
         encode + commit {:.2} s ({:.2} M rows/s), decode + encode {:.2} s ({:.2} M rows/s); \
         the job {:.2} s ({:.2} M rows/s) = {:.2}× decode + encode (goal ≤ 2)",
        decode,
        per_sec(decode),
        encode,
        per_sec(encode),
        limit,
        per_sec(limit),
        job,
        per_sec(job),
        job / limit
    );
    let record = serde_json::json!({
        "commit": git_commit(),
        "at": chrono::Utc::now().to_rfc3339(),
        "allocator": common::allocator(),
        "suite": "json_to_delta",
        "rows": ROWS_IN_FILES,
        "files": FILES,
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "decode_seconds": decode,
        "encode_commit_seconds": encode,
        "job_seconds": job,
        "job_over_decode_plus_encode": job / limit,
    });
    // `cargo bench` passes `--bench`; `cargo test --benches` (or `-- --test`) runs each routine
    // once and `--profile-time` runs it for a profiler: checks, not measurements to keep.
    let args: Vec<String> = std::env::args().collect();
    let measured = args.iter().any(|a| a == "--bench")
        && !args.iter().any(|a| a == "--test" || a == "--profile-time");
    if !measured {
        return;
    }
    let results = repo_root().join("benches/results/hot_paths.jsonl");
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&results)
        .unwrap();
    writeln!(file, "{record}").unwrap();
    println!("appended to {}", results.display());
}

/// A job file for run `run` of [`json_to_delta`]: the files into a fresh Delta table, in one
/// batch, the declared columns without lineage.
fn files_to_delta_job(
    dir: &std::path::Path,
    input: &std::path::Path,
    run: usize,
) -> std::path::PathBuf {
    let path = dir.join(format!("job{run}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[job]
id = "json_to_delta"

[sources.clicks]
kind = "files"
path = "{input}"
format = "json"
schema = "id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP"
max_files_per_batch = 1000

[sink]
kind = "delta"
path = "{out}"
lineage = false

[query]
sql = "SELECT id, user_id, page, amount, ts FROM clicks"
"#,
            input = input.display(),
            out = dir.join(format!("out{run}")).display(),
        ),
    )
    .unwrap();
    path
}

/// 100 000 Nexmark events of one partition, generated into Arrow (92 % of them bids).
fn nexmark_generator(c: &mut Criterion) {
    let source = NexmarkSource::new(NexmarkSourceConfig::new(NexmarkTable::Bid)).unwrap();
    let mut group = c.benchmark_group("nexmark");
    group.throughput(Throughput::Elements(ROWS as u64));
    group.bench_function("generate_100k_events_bids", |b| {
        b.iter(|| {
            source
                .generate(0, OffsetRange::new(0, ROWS as i64))
                .unwrap()
        })
    });
    group.finish();
}

/// One window aggregation step: 100 000 bids' partial states (count, max, avg per auction and
/// 10 s window) merged into state holding the same groups.
fn window_aggregation_step(c: &mut Criterion) {
    let rt = runtime();
    let mut config = NexmarkSourceConfig::new(NexmarkTable::Bid);
    config.partitions = 1;
    let source = NexmarkSource::new(config).unwrap();
    let bids = source
        .generate(0, OffsetRange::new(0, ROWS as i64))
        .unwrap();
    let settings = QuerySettings {
        event_time: BTreeMap::from([("bid".to_string(), "date_time".to_string())]),
        ..QuerySettings::default()
    };
    let mut query = rt
        .block_on(StreamingQuery::plan(
            "SELECT window_start, auction, count(*) AS bids, max(price) AS top, avg(price) AS mean \
             FROM tumble(bid, date_time, INTERVAL '10' SECOND) \
             GROUP BY window_start, window_end, auction",
            &[("bid".into(), bids.schema())],
            &settings,
        ))
        .unwrap();
    let inputs = BTreeMap::from([("bid".to_string(), bids)]);
    let mut group = c.benchmark_group("query");
    group.throughput(Throughput::Elements(ROWS as u64));
    group.bench_function("window_aggregation_step_100k_events", |b| {
        b.iter(|| {
            rt.block_on(query.execute_isolating(&inputs, BatchWatermark::default()))
                .unwrap()
        })
    });
    group.finish();
}

/// Writing a base state file of 1 M groups (a user key, a window start, a count, a sum and a
/// max): what a batch that compacts a large state pays (columns encoded in parallel).
fn state_base_write(c: &mut Criterion) {
    const GROUPS: usize = 1_000_000;
    let rt = runtime();
    let schema = Arc::new(Schema::new(vec![
        Field::new("user_id", DataType::Utf8, false),
        Field::new("window_start", DataType::Int64, false),
        Field::new("count", DataType::Int64, false),
        Field::new("sum", DataType::Float64, true),
        Field::new("max", DataType::Float64, true),
    ]));
    let n = GROUPS as i64;
    let state = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("user-{:08}", (i * 7919) % n)),
            )),
            Arc::new(Int64Array::from_iter_values(
                (0..n).map(|i| 1_704_067_200_000_000 + (i % 60) * 60_000_000),
            )),
            Arc::new(Int64Array::from_iter_values((0..n).map(|i| i % 97 + 1))),
            Arc::new(Float64Array::from_iter_values(
                (0..n).map(|i| i as f64 * 0.25),
            )),
            Arc::new(Float64Array::from_iter_values(
                (0..n).map(|i| (i % 1000) as f64),
            )),
        ],
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let checkpoint =
        CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
    let mut next = 0;
    let mut group = c.benchmark_group("state");
    group.sample_size(10);
    group.throughput(Throughput::Elements(GROUPS as u64));
    group.bench_function("base_write_1m_groups", |b| {
        b.iter(|| {
            // A fresh log each time: its first write is always a base.
            let mut log = StateLog::new(&checkpoint, next);
            next += 1;
            let rows = std::slice::from_ref(&state);
            rt.block_on(
                log.write(BatchId(0), &schema, rows, None, GROUPS as u64, || {
                    Ok(rows.to_vec())
                }),
            )
            .unwrap()
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    state_base_write,
    nexmark_generator,
    decode_json_files,
    decode_bad_lines,
    json_to_delta,
    execute_query,
    window_aggregation_step,
    delta_commit
);

/// `criterion_main!` with the `sluice` binary's allocator setup first, so the figures are
/// those of the binary (see `sluice::cli::limit_malloc_arenas`).
fn main() {
    #[cfg(feature = "cli")]
    sluice::cli::limit_malloc_arenas();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
