//! Sluice as a library: the examples that build jobs in Rust (`examples/udf.rs`,
//! `examples/dataframe.rs`) and the user's own `sluice` binary (`examples/my_sluice.rs`), run as
//! the programs a user builds.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use arrow::array::{Float64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use serde_json::Value;

use crate::support::{assert_fails_saying, assert_ok, run_sluice, sluice_bin, table_rows};

/// The functions of the UDF examples (`page_section`, `amount_range`), for jobs built here.
#[path = "../examples/shared/functions.rs"]
mod functions;

/// An example program, built by `cargo test` next to the `sluice` binary. (`cargo test --test
/// integration` alone does not rebuild examples: run `cargo build --examples` first.)
fn example_bin(name: &str) -> PathBuf {
    let bin = Path::new(sluice_bin())
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} is not built: run the suite with `cargo test` (which builds the examples), or \
         `cargo build --examples` first",
        bin.display()
    );
    bin
}

fn run_example(name: &str, args: &[&Path], env: &[(&str, &str)]) -> Output {
    Command::new(example_bin(name))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

const PAGES: [&str; 6] = [
    "/",
    "/blog",
    "/blog/rust",
    "/shop/cart",
    "/shop",
    "/about/team",
];

/// One click: id, page, amount, event time (µs).
struct Click {
    id: i64,
    page: &'static str,
    amount: f64,
    ts: i64,
}

/// `files` JSON files of 60 clicks each, two seconds apart with up to 8 s of disorder (inside
/// the job's 10 s out-of-orderness, so no click is late), over several minutes.
fn write_clicks(dir: &Path, files: usize) -> Vec<Click> {
    std::fs::create_dir_all(dir).unwrap();
    let base = 1_793_523_600_000_000i64; // 2026-11-01T09:00:00Z
    let mut clicks = Vec::new();
    let mut seed = 7u64;
    let mut next = || {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        seed >> 33
    };
    for f in 0..files {
        let mut text = String::new();
        for i in 0..60 {
            let n = (f * 60 + i) as i64;
            let click = Click {
                id: n,
                page: PAGES[(next() % 6) as usize],
                amount: (next() % 10_000) as f64 / 100.0,
                ts: base + n * 2_000_000 + (next() % 8_000_000) as i64,
            };
            let time = chrono::DateTime::from_timestamp_micros(click.ts).unwrap();
            text.push_str(&format!(
                "{{\"id\": {}, \"user_id\": {}, \"page\": \"{}\", \"amount\": {}, \"ts\": \"{}\"}}\n",
                click.id,
                n % 17,
                click.page,
                click.amount,
                time.to_rfc3339()
            ));
            clicks.push(click);
        }
        std::fs::write(dir.join(format!("clicks-{f:03}.json")), text).unwrap();
    }
    clicks
}

/// The windowed query of `examples/udf.rs` over all clicks at once, with built-in functions
/// in place of the user's: `page_section` as string functions, `amount_range` as max − min.
/// Only windows the final watermark (newest event − 10 s) has closed.
async fn recompute_by_section(clicks: &[Click]) -> Vec<String> {
    recompute(clicks, false).await
}

/// [`recompute_by_section`], with `positioned`: each row's `position` among its window's rows
/// by clicks (descending), then section.
async fn recompute(clicks: &[Click], positioned: bool) -> Vec<String> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("page", DataType::Utf8, false),
        Field::new("amount", DataType::Float64, false),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from_iter_values(clicks.iter().map(|c| c.page))),
            Arc::new(Float64Array::from_iter_values(
                clicks.iter().map(|c| c.amount),
            )),
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(clicks.iter().map(|c| c.ts))
                    .with_timezone("UTC"),
            ),
        ],
    )
    .unwrap();
    let ctx = SessionContext::new();
    let table = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
    ctx.register_table("clicks", Arc::new(table)).unwrap();
    let watermark = clicks.iter().map(|c| c.ts).max().unwrap() - 10_000_000;
    let sql = format!(
        "SELECT window_start, window_end, section, count(*) AS clicks, \
                max(amount) - min(amount) AS amount_range \
         FROM (SELECT amount, date_bin(INTERVAL '1 minute', ts) AS window_start, \
                      date_bin(INTERVAL '1 minute', ts) + INTERVAL '1 minute' AS window_end, \
                      CASE WHEN split_part(page, '/', 2) = '' THEN 'home' \
                           ELSE split_part(page, '/', 2) END AS section \
               FROM clicks) \
         WHERE to_unixtime(window_end) * 1000000 <= {watermark} \
         GROUP BY window_start, window_end, section"
    );
    let sql = if positioned {
        format!(
            "SELECT *, row_number() OVER (PARTITION BY window_start ORDER BY clicks DESC, \
             section) AS position FROM ({sql})"
        )
    } else {
        sql
    };
    let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    crate::support::rows_as_json(&batches)
}

/// The rows of a windowed output table without the columns Sluice adds, comparable with
/// [`recompute_by_section`] (timestamps written the same way, whichever the time zone).
async fn window_rows(table: &Path) -> Vec<String> {
    let mut rows: Vec<String> = table_rows(table)
        .await
        .iter()
        .map(|r| {
            let v: BTreeMap<String, Value> = serde_json::from_str(r).unwrap();
            let keep: BTreeMap<&String, &Value> = v
                .iter()
                .filter(|(k, _)| {
                    [
                        "window_start",
                        "window_end",
                        "section",
                        "clicks",
                        "amount_range",
                        "position",
                    ]
                    .contains(&k.as_str())
                })
                .collect();
            serde_json::to_string(&keep).unwrap()
        })
        .collect();
    rows.sort();
    rows
}

/// JSON rows with their keys in order and timestamps as written by Arrow, for comparing two
/// sources of the same rows.
fn normalized(rows: &[String]) -> Vec<String> {
    let mut out: Vec<String> = rows
        .iter()
        .map(|r| {
            let v: BTreeMap<String, Value> = serde_json::from_str(r).unwrap();
            let v: BTreeMap<String, Value> = v
                .into_iter()
                .map(|(k, v)| match v {
                    // "2026-11-01T09:00:00Z" and "2026-11-01T09:00:00" are the same instant.
                    Value::String(s) if k.starts_with("window_") => {
                        (k, Value::String(s.trim_end_matches('Z').to_string()))
                    }
                    other => (k, other),
                })
                .collect();
            serde_json::to_string(&v).unwrap()
        })
        .collect();
    out.sort();
    out
}

/// A windowed job calling a scalar UDF and a UDAF, killed at every named crash point of its
/// batches and restarted: the UDAF's state is restored each time, and the output equals the
/// same aggregation over all clicks at once with built-in functions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udaf_state_survives_sigkills_and_equals_a_batch_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("clicks");
    let out = dir.path().join("out");
    let clicks = write_clicks(&input, 10);
    // 10 files, 2 per batch: batches 0–4. Each run is killed at one point, the next resumes.
    for point in [
        "after_intent:0",
        "after_state:1",
        "after_manifest:2",
        "after_side_tables:2",
        "after_commit:3",
        "after_state:4",
    ] {
        let run = run_example("udf", &[&input, &out], &[("SLUICE_CRASH_AT", point)]);
        assert_eq!(
            run.status.signal(),
            Some(9),
            "the run armed at {point} was not killed there: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let last = run_example("udf", &[&input, &out], &[]);
    assert_ok(&last);
    let expected = recompute_by_section(&clicks).await;
    assert!(
        expected.len() > 20,
        "too few windows to mean anything: {expected:?}"
    );
    assert_eq!(normalized(&window_rows(&out).await), normalized(&expected));
}

/// A query built with the DataFrame API writes exactly what the same query in SQL writes,
/// lineage columns included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataframe_query_writes_what_the_same_sql_writes() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("clicks");
    let clicks = write_clicks(&input, 4);
    let from_frame = dir.path().join("frame");
    assert_ok(&run_example("dataframe", &[&input, &from_frame], &[]));

    let from_sql = dir.path().join("sql");
    let job = dir.path().join("sql.toml");
    std::fs::write(
        &job,
        format!(
            r#"[job]
id = "clicks_sql"
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
sql = "SELECT id, user_id, upper(page) AS page, amount, ts FROM clicks WHERE amount > 10"
"#,
            input = input.display(),
            out = from_sql.display()
        ),
    )
    .unwrap();
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    let frame_rows = table_rows(&from_frame).await;
    let wanted = clicks.iter().filter(|c| c.amount > 10.0).count();
    assert_eq!(frame_rows.len(), wanted);
    assert!(
        frame_rows[0].contains("_source_offset"),
        "{}",
        frame_rows[0]
    );
    assert_eq!(frame_rows, table_rows(&from_sql).await);
}

/// `position(x) OVER (…)`: a window function numbering the rows of each partition in order
/// (1, 2, …), as `row_number()` does.
fn position() -> datafusion::logical_expr::WindowUDF {
    use arrow::array::{ArrayRef, Int64Array};
    use datafusion::logical_expr::{PartitionEvaluator, Volatility, create_udwf};

    #[derive(Debug)]
    struct Numbering;
    impl PartitionEvaluator for Numbering {
        fn evaluate_all(
            &mut self,
            _values: &[ArrayRef],
            num_rows: usize,
        ) -> datafusion::common::Result<ArrayRef> {
            Ok(Arc::new(Int64Array::from_iter_values(1..=num_rows as i64)))
        }
    }
    create_udwf(
        "position",
        DataType::Int64,
        Arc::new(DataType::Int64),
        Volatility::Immutable,
        Arc::new(|| Ok(Box::new(Numbering))),
    )
}

/// The windowed job of `examples/udf.rs` built with the DataFrame API, plus a window function
/// of the user's ranking each window's sections: clicks per section of each 1-minute window,
/// their amount range, and the section's position in its window.
fn positioned_sections_job(input: &Path, out: &Path) -> sluice::engine::Job {
    use datafusion::catalog::TableFunctionArgs;
    use datafusion::common::ScalarValue;
    use datafusion::execution::FunctionRegistry;
    use datafusion::functions_aggregate::expr_fn::count;
    use datafusion::logical_expr::ExprFunctionExt;
    use datafusion::prelude::{col, lit};
    use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
    use sluice::engine::{EventTimeConfig, EventTimeFormat, Job};
    use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig};

    let source = FilesSource::new(FilesSourceConfig {
        schema: Some("id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP".into()),
        max_files_per_batch: 2,
        ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
    })
    .unwrap();
    let event_time = EventTimeConfig {
        max_out_of_orderness: std::time::Duration::from_secs(10),
        ..EventTimeConfig::new("ts", EventTimeFormat::Rfc3339)
    };
    let sink = DeltaSink::new(DeltaSinkConfig::new(out.to_string_lossy())).unwrap();
    Job::builder("positioned_sections")
        .with_source("clicks", Box::new(source), Some(event_time))
        .with_udf(functions::page_section())
        .with_udaf(functions::amount_range())
        .with_udwf(position())
        .with_query(|ctx| async move {
            let minute = lit(ScalarValue::new_interval_mdn(0, 0, 60_000_000_000));
            let state = ctx.state();
            let args = [col("clicks"), col("ts"), minute];
            let windows = ctx
                .table_function("tumble")?
                .create_table_provider_with_args(TableFunctionArgs::new(&args, &state))?;
            ctx.read_table(windows)?
                .aggregate(
                    vec![
                        col("window_start"),
                        col("window_end"),
                        ctx.udf("page_section")?
                            .call(vec![col("page")])
                            .alias("section"),
                    ],
                    vec![
                        count(lit(1)).alias("clicks"),
                        ctx.udaf("amount_range")?
                            .call(vec![col("amount")])
                            .alias("amount_range"),
                    ],
                )?
                .window(vec![
                    ctx.udwf("position")?
                        .call(vec![col("clicks")])
                        .partition_by(vec![col("window_start")])
                        .order_by(vec![
                            col("clicks").sort(false, true),
                            col("section").sort(true, true),
                        ])
                        .build()?
                        .alias("position"),
                ])
        })
        .with_sink(Box::new(sink))
        .build()
        .unwrap()
}

/// A DataFrame-built windowed query calling a UDF, a UDAF and a UDWF is planned again, the same
/// way, wherever the engine plans it: the run equals a batch recomputation with built-in
/// functions, a backfill of part of the period replaces it with the same rows, and a reconcile
/// finds no difference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataframe_query_with_user_functions_runs_backfills_and_reconciles() {
    use sluice::engine::backfill::BackfillRange;

    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("clicks");
    let out = dir.path().join("out");
    let clicks = write_clicks(&input, 6);
    let summary = positioned_sections_job(&input, &out).run().await.unwrap();
    assert_eq!(summary.batches_committed, 3);
    let expected = recompute(&clicks, true).await;
    assert!(expected.len() > 20, "too few windows: {expected:?}");
    assert_eq!(normalized(&window_rows(&out).await), normalized(&expected));

    let base = 1_793_523_600_000_000i64; // write_clicks' first event: 2026-11-01T09:00:00Z
    let minute = 60_000_000;
    let report = positioned_sections_job(&input, &out)
        .backfill(
            BackfillRange::Time {
                from: base + 2 * minute,
                to: base + 5 * minute,
            },
            false,
        )
        .await
        .unwrap();
    // It committed its own replacement: every window the events of the files holding the
    // period fall into, the period's three among them.
    assert!(
        !report.already_committed && report.files_written > 0,
        "{report:?}"
    );
    let replaced = report.windows.as_ref().expect("a windowed backfill");
    for m in 2..5 {
        assert!(
            replaced.values.contains(&(base + m * minute)),
            "{replaced:?}"
        );
    }
    assert!(report.rows_out > 0, "{report:?}");
    assert_eq!(normalized(&window_rows(&out).await), normalized(&expected));

    let reconciliation = positioned_sections_job(&input, &out)
        .reconcile(base, base + 10 * minute)
        .await
        .unwrap();
    assert_eq!(
        reconciliation.diff.differences(),
        0,
        "{:?}",
        reconciliation.diff
    );
    assert!(reconciliation.expected_rows > 20, "{reconciliation:?}");
}

/// A binary of one's own (`sluice::cli::run` with a registry) runs job files calling its
/// functions, through the same command line; the stock binary refuses them, naming the
/// function.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_of_ones_own_runs_job_files_calling_its_functions() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("clicks");
    let clicks = write_clicks(&input, 6);
    let out = dir.path().join("out");
    let text = std::fs::read_to_string(crate::support::repo_root().join("examples/udf_job.toml"))
        .unwrap()
        .replace(
            "path = \"data/clicks\"",
            &format!("path = \"{}\"", input.display()),
        )
        .replace(
            "path = \"out/udf_job\"",
            &format!("path = \"{}\"", out.display()),
        );
    let job = dir.path().join("udf_job.toml");
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();

    let stock = run_sluice(&["validate", job], &[]);
    assert_fails_saying(&stock, &["page_section"]);

    let own = |args: &[&str]| {
        Command::new(example_bin("my_sluice"))
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let validated = own(&["validate", job]);
    assert_ok(&validated);
    assert!(
        // The plan calls both functions (not only the column named after one).
        String::from_utf8_lossy(&validated.stdout).contains("amount_range(")
            && String::from_utf8_lossy(&validated.stdout).contains("page_section("),
        "{}",
        String::from_utf8_lossy(&validated.stdout)
    );
    let help = own(&["--help"]);
    assert_ok(&help);
    assert!(String::from_utf8_lossy(&help.stdout).contains("backfill"));
    assert_ok(&own(&["run", job]));
    assert_eq!(
        normalized(&window_rows(&out).await),
        normalized(&recompute_by_section(&clicks).await)
    );

    // A job file naming the binary's own kind of source, configured by its section.
    let pages = paged_clicks_server::PagedClicks {
        pages: 5,
        per_page: 10,
        bad_every: 0,
    };
    let url = format!("http://{}", pages.serve().await.unwrap());
    let paged_out = dir.path().join("paged");
    let paged_job = |extra: &str| {
        let path = dir.path().join("paged.toml");
        std::fs::write(
            &path,
            format!(
                "[job]\nid = \"paged\"\n[sources.clicks]\nkind = \"paged_http\"\nurl = \"{url}\"\n\
                 {extra}\nevent_time = \"ts\"\n[sink]\nkind = \"delta\"\npath = \"{}\"\n\
                 [query]\nsql = \"SELECT id, page_section(page) AS section FROM clicks\"\n",
                paged_out.display()
            ),
        )
        .unwrap();
        path.to_str().unwrap().to_string()
    };
    let misspelt = paged_job("pages_per_bach = 2");
    assert_fails_saying(
        &own(&["validate", &misspelt]),
        &["sources.clicks", "pages_per_bach"],
    );
    let stock = run_sluice(&["validate", &misspelt], &[]);
    assert_fails_saying(&stock, &["paged_http", "files, kafka, nexmark"]);
    let good = paged_job("pages_per_batch = 2");
    assert_ok(&own(&["run", &good]));
    assert_eq!(table_rows(&paged_out).await.len(), 50);

    // And the binary's own kind of sink: the same job into Parquet files, through the CLI.
    let files_out = dir.path().join("files");
    let text = std::fs::read_to_string(&good).unwrap().replace(
        &format!(
            "[sink]\nkind = \"delta\"\npath = \"{}\"",
            paged_out.display()
        ),
        &format!(
            "[sink]\nkind = \"parquet_files\"\npath = \"{}\"",
            files_out.display()
        ),
    );
    assert!(text.contains("parquet_files"), "{text}");
    let to_files = dir.path().join("to_files.toml");
    std::fs::write(&to_files, text).unwrap();
    let ran = own(&["run", to_files.to_str().unwrap()]);
    assert_ok(&ran);
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(stdout.contains("output: "), "{stdout}");
    let markers = std::fs::read_dir(files_out.join("_commits/paged")).unwrap();
    let rows: u64 = markers
        .map(|m| {
            let marker: Value =
                serde_json::from_slice(&std::fs::read(m.unwrap().path()).unwrap()).unwrap();
            marker["rows"].as_u64().unwrap()
        })
        .sum();
    assert_eq!(rows, 50);
    // A rerun finds everything committed in the sink's own markers and writes nothing.
    assert_ok(&own(&["run", to_files.to_str().unwrap()]));
    assert_eq!(
        std::fs::read_dir(files_out.join("_commits/paged"))
            .unwrap()
            .count(),
        3
    );
    // A sink that cannot replace rows cannot be backfilled: refused before anything is read
    // (the source's endpoint is a closed port here, so a read would fail differently).
    let unreachable = dir.path().join("unreachable.toml");
    let text = std::fs::read_to_string(&to_files)
        .unwrap()
        .replace(&url, "http://127.0.0.1:9/clicks");
    assert!(text.contains("127.0.0.1:9/"), "{text}");
    std::fs::write(&unreachable, text).unwrap();
    assert_fails_saying(
        &own(&[
            "backfill",
            unreachable.to_str().unwrap(),
            "--from",
            "earliest",
            "--to",
            "latest",
        ]),
        &[
            "cannot replace rows",
            "cannot be backfilled",
            "nothing was read",
        ],
    );
}

#[path = "../examples/shared/paged_clicks_server.rs"]
mod paged_clicks_server;

/// The crash points of a stateless job's batch, each armed on one run; the next run resumes.
const STATELESS_POINTS: [&str; 5] = [
    "after_intent:0",
    "after_manifest:1",
    "after_side_tables:2",
    "after_commit:3",
    "after_manifest:4",
];

fn assert_killed(run: &Output, point: &str) {
    assert_eq!(
        run.status.signal(),
        Some(9),
        "the run armed at {point} was not killed there: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The user's source (`examples/custom_source.rs`: an HTTP endpoint's pages, page numbers as
/// offsets) through the crash test: every record once, the malformed ones exactly once in the
/// dead-letter table with their page and the decoder's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_source_survives_sigkills_with_nothing_lost_or_doubled() {
    let pages = paged_clicks_server::PagedClicks {
        pages: 17,
        per_page: 40,
        bad_every: 23,
    };
    let url = format!("http://{}", pages.serve().await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let url_arg = Path::new(&url);
    // 17 pages, 3 per batch: batches 0–5.
    for point in STATELESS_POINTS {
        let run = run_example(
            "custom_source",
            &[url_arg, &out],
            &[("SLUICE_CRASH_AT", point)],
        );
        assert_killed(&run, point);
    }
    assert_ok(&run_example("custom_source", &[url_arg, &out], &[]));

    let all = pages.pages * pages.per_page;
    let good: Vec<i64> = (0..all)
        .filter(|n| !pages.is_bad(*n))
        .map(|n| n as i64)
        .collect();
    let ids = crate::support::sorted_ids(&out).await;
    assert_eq!(ids, good, "each good record exactly once");

    let dead = table_rows(&crate::support::dead_letter_table(&out)).await;
    assert_eq!(dead.len() as u64, all - good.len() as u64, "{dead:?}");
    assert!(
        dead.iter()
            .any(|r| r.contains("page 0 #22") && r.contains("oops-22")),
        "{dead:?}"
    );
}

/// The user's sink (`examples/custom_sink.rs`: Parquet files with a conditional-put commit
/// marker per batch) through the crash test: the committed files hold every good row once and
/// every malformed line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_sink_survives_sigkills_with_nothing_lost_or_doubled() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("clicks");
    let clicks = write_clicks(&input, 11);
    // Two malformed lines in the third file.
    let third = input.join("clicks-002.json");
    let mut text = std::fs::read_to_string(&third).unwrap();
    text.push_str("{\"id\": \"not a number\"}\nnot json at all\n");
    std::fs::write(&third, text).unwrap();
    let out = dir.path().join("out");
    // 11 files, 2 per batch: batches 0–5.
    let points = [
        "after_intent:0",
        "after_manifest:1",
        "after_files:2",
        "after_commit:3",
        "after_files:4",
    ];
    for point in points {
        let run = run_example(
            "custom_sink",
            &[&input, &out],
            &[("SLUICE_CRASH_AT", point)],
        );
        assert_killed(&run, point);
    }
    assert_ok(&run_example("custom_sink", &[&input, &out], &[]));
    // A rerun commits nothing more.
    assert_ok(&run_example("custom_sink", &[&input, &out], &[]));

    // What a reader of the sink sees: the files the commit markers list.
    let ctx = SessionContext::new();
    let markers = out.join("_commits/clicks_to_parquet");
    let mut listed: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut batches = Vec::new();
    for entry in std::fs::read_dir(&markers).unwrap() {
        let marker: Value =
            serde_json::from_slice(&std::fs::read(entry.unwrap().path()).unwrap()).unwrap();
        batches.push(marker["batch_id"].as_i64().unwrap());
        for key in ["output", "dead_letters"] {
            for file in marker[key].as_array().unwrap() {
                let path = out.join(file.as_str().unwrap());
                listed
                    .entry(key)
                    .or_default()
                    .push(path.display().to_string());
            }
        }
    }
    batches.sort_unstable();
    assert_eq!(batches, (0..6).collect::<Vec<_>>());
    let count = |key: &str, column: &str| {
        let files = listed[key].clone();
        let ctx = ctx.clone();
        let column = column.to_string();
        async move {
            let frame = ctx
                .read_parquet(files, datafusion::prelude::ParquetReadOptions::default())
                .await
                .unwrap();
            let rows = frame
                .select_columns(&[&column])
                .unwrap()
                .collect()
                .await
                .unwrap();
            crate::support::rows_as_json(&rows)
        }
    };
    let mut ids: Vec<i64> = count("output", "id")
        .await
        .iter()
        .map(|r| {
            serde_json::from_str::<Value>(r).unwrap()["id"]
                .as_i64()
                .unwrap()
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, clicks.iter().map(|c| c.id).collect::<Vec<_>>());
    let dead = count("dead_letters", "_source_name").await;
    assert_eq!(dead.len(), 2, "{dead:?}");
}
