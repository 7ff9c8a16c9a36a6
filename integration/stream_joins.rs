//! A join of two streams: clicks joined to the impression they followed within 90 seconds,
//! killed at every crash point of the commit protocol, against a batch recomputation of the
//! same rows in plain DataFusion; the late rows of both sources in one late table; reconcile;
//! backfill refused; a restart with another condition refusing the state.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::prelude::SessionContext;
use serde_json::Value;

use crate::support::*;

const JOIN: &str = "SELECT i.imp_id, c.click_id, i.ad_id, i.ts AS imp_ts, c.ts \
    FROM impressions i JOIN clicks c \
    ON i.ad_id = c.ad_id AND c.ts BETWEEN i.ts AND i.ts + INTERVAL '90' SECOND";

/// One event: (id, ad, event time in seconds after 09:00:00).
type Event = (String, i64, i64);

const OUT_OF_ORDERNESS: i64 = 2;

/// `files` files per source: file `f` covers minute `f`; every 7th row of a later file is
/// three minutes old (late for the watermark, which trails by 2 s).
fn events(prefix: &str, files: usize, per_file: usize, seed: u64) -> Vec<Vec<Event>> {
    let mut rng = Rng(seed);
    (0..files)
        .map(|f| {
            (0..per_file)
                .map(|i| {
                    let mut time = (f * 60) as i64 + (rng.next() % 60) as i64;
                    if f >= 2 && i % 7 == 3 {
                        time -= 180;
                    }
                    (format!("{prefix}{f}-{i}"), (rng.next() % 6) as i64, time)
                })
                .collect()
        })
        .collect()
}

fn write_events(dir: &Path, files: &[Vec<Event>], id: &str) {
    std::fs::create_dir_all(dir).unwrap();
    for (f, file) in files.iter().enumerate() {
        let text: String = file
            .iter()
            .map(|(name, ad, time)| {
                let (m, s) = (time.div_euclid(60), time.rem_euclid(60));
                let (h, m) = (9 + m.div_euclid(60), m.rem_euclid(60));
                format!(
                    r#"{{"ad_id":{ad},"{id}":"{name}","ts":"2026-11-01T{h:02}:{m:02}:{s:02}Z"}}"#
                ) + "\n"
            })
            .collect();
        std::fs::write(dir.join(format!("{f:03}.json")), text).unwrap();
    }
}

fn write_join_job(path: &Path, ws: &Path, sql: &str) {
    let source = |name: &str, id: &str| {
        format!(
            r#"
[sources.{name}]
kind = "files"
path = "{}"
format = "json"
schema = "ad_id BIGINT, {id} VARCHAR, ts TIMESTAMP"
event_time = "ts"
max_out_of_orderness = "{OUT_OF_ORDERNESS}s"
max_files_per_batch = 1
"#,
            ws.join(name).display()
        )
    };
    let text = format!(
        r#"
[job]
id = "attribution"
keep_batches = 100
{}{}
[sink]
kind = "delta"
path = "{}"

[trigger]
mode = "available-now"

[query]
sql = """{sql}"""
"#,
        source("impressions", "imp_id"),
        source("clicks", "click_id"),
        ws.join("out").display()
    );
    std::fs::write(path, text).unwrap();
}

/// The rows the rules make late: batch `b` reads file `b` of each source, and a row below the
/// watermark in force (the smaller of the sources' newest event times before the batch, minus
/// the out-of-orderness) is late. The on-time rows of each source, and the late ids.
fn split_late(sources: [&[Vec<Event>]; 2]) -> ([Vec<Event>; 2], Vec<String>) {
    let mut on_time: [Vec<Event>; 2] = [Vec::new(), Vec::new()];
    let mut late = Vec::new();
    let mut newest = [i64::MIN; 2];
    let mut watermark: Option<i64> = None;
    for files in sources[0].iter().zip(sources[1]) {
        for (s, file) in [files.0, files.1].into_iter().enumerate() {
            for e in file {
                if watermark.is_some_and(|w| e.2 < w) {
                    late.push(e.0.clone());
                } else {
                    on_time[s].push(e.clone());
                }
                newest[s] = newest[s].max(e.2);
            }
        }
        let now = newest[0].min(newest[1]) - OUT_OF_ORDERNESS;
        watermark = Some(watermark.map_or(now, |w| w.max(now)));
    }
    (on_time, late)
}

fn batch_of(events: &[Event], id: &str) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("ad_id", DataType::Int64, false),
        Field::new(id, DataType::Utf8, false),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
    ]));
    let base = 1_793_523_600_000_000i64; // 2026-11-01T09:00:00Z
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.1))),
            Arc::new(StringArray::from_iter_values(events.iter().map(|e| &e.0))),
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(
                    events.iter().map(|e| base + e.2 * 1_000_000),
                )
                .with_timezone("UTC"),
            ),
        ],
    )
    .unwrap()
}

/// The same SQL over every on-time row at once, in plain DataFusion.
async fn recomputed(on_time: &[Vec<Event>; 2]) -> Vec<String> {
    let ctx = SessionContext::new();
    ctx.register_batch("impressions", batch_of(&on_time[0], "imp_id"))
        .unwrap();
    ctx.register_batch("clicks", batch_of(&on_time[1], "click_id"))
        .unwrap();
    let rows = ctx.sql(JOIN).await.unwrap().collect().await.unwrap();
    let mut out: Vec<String> = rows_as_json(&rows)
        .iter()
        .map(|r| canonical_json(r))
        .collect();
    out.sort();
    out
}

fn canonical_json(text: &str) -> String {
    let row: BTreeMap<String, Value> = serde_json::from_str(text).unwrap();
    serde_json::to_string(&row).unwrap()
}

/// Clicks within 90 s of their impression through SIGKILLs at every step of the commit
/// protocol: the output is exactly the SQL join of every row that was not late — what
/// DataFusion computes over those rows at once — each pair once; the late rows of both sources
/// are in the late table with their source; the state stays bounded; reconcile agrees and
/// catches an edited row; backfill is refused; a restart with another condition refuses the
/// state.
#[tokio::test(flavor = "multi_thread")]
async fn clicks_join_their_impressions_through_sigkills_as_a_batch_recomputation_says() {
    let ws = tempfile::tempdir().unwrap();
    let impressions = events("i", 8, 30, 11);
    let clicks = events("c", 8, 30, 23);
    write_events(&ws.path().join("impressions"), &impressions, "imp_id");
    write_events(&ws.path().join("clicks"), &clicks, "click_id");
    let job_path = ws.path().join("job.toml");
    write_join_job(&job_path, ws.path(), JOIN);
    let job = job_path.to_str().unwrap();
    let out = ws.path().join("out");

    let validated = run_sluice(&["validate", job], &[]);
    assert_ok(&validated);
    let text = String::from_utf8_lossy(&validated.stdout);
    assert!(text.contains("0-join"), "{text}");
    assert!(
        text.contains("a row of impressions (left) leaves when ts + 1m 30s"),
        "{text}"
    );
    assert!(
        text.contains("a row of clicks (right) leaves when ts < watermark"),
        "{text}"
    );

    for point in [
        "after_intent:1",
        "after_state:2",
        "after_manifest:3",
        "after_commit:4",
        "after_state:6",
    ] {
        let killed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", point)]);
        assert_eq!(
            killed.status.signal(),
            Some(9),
            "expected a SIGKILL at {point}: {}",
            String::from_utf8_lossy(&killed.stderr)
        );
    }
    assert_ok(&run_sluice(&["run", job], &[]));

    let (on_time, late_ids) = split_late([&impressions, &clicks]);
    let expected = recomputed(&on_time).await;
    assert!(expected.len() > 50, "the input joins: {}", expected.len());
    assert!(late_ids.len() > 10, "the input has late rows");
    let mut got: Vec<String> = table_values(&out, &[])
        .await
        .into_iter()
        .map(|r| serde_json::to_string(&r.into_iter().collect::<BTreeMap<_, _>>()).unwrap())
        .collect();
    got.sort();
    assert_eq!(got.len(), expected.len(), "each pair once");
    assert_eq!(got, expected);

    // The late rows of both sources, each once, with the source it came from.
    let late = table_values(&late_table(&out), &[]).await;
    let mut late_got: Vec<String> = late
        .iter()
        .map(|r| {
            let source = r["_source"].as_str().unwrap();
            let id = if source == "impressions" {
                "imp_id"
            } else {
                "click_id"
            };
            assert!(r.get(id).is_some(), "{r:?}");
            r[id].as_str().unwrap().to_string()
        })
        .collect();
    late_got.sort();
    let mut late_ids = late_ids;
    late_ids.sort();
    assert_eq!(late_got, late_ids);

    // The state holds the rows that can still match, not everything read.
    let mut state_rows = Vec::new();
    for batch in 0..8 {
        let path = out.join(format!("_sluice/attribution/batches/{batch}/manifest.json"));
        let manifest: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        state_rows.push(manifest["counters"]["state_rows"].as_u64().unwrap());
        assert!(
            manifest["operators"]["0-join"]["files"]
                .as_array()
                .is_some_and(|f| !f.is_empty()),
            "{manifest}"
        );
    }
    let max = *state_rows.iter().max().unwrap();
    assert!(
        max < 200,
        "state rows per batch: {state_rows:?} of 480 read"
    );

    let reconcile = || {
        run_sluice(
            &[
                "reconcile",
                job,
                "--from-time",
                "2026-11-01T08:00:00Z",
                "--to-time",
                "2026-11-01T10:00:00Z",
            ],
            &[],
        )
    };
    let reconciled = reconcile();
    assert_ok(&reconciled);
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(
        text.contains(&format!(
            "matching {}, missing 0, extra 0, different 0",
            expected.len()
        )),
        "{text}"
    );
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    table
        .delete()
        .with_predicate(format!("click_id = '{}'", expected_click(&expected)))
        .await
        .unwrap();
    let reconciled = reconcile();
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(!reconciled.status.success(), "{text}");
    assert!(text.contains("missing 1"), "{text}");

    let refused = run_sluice(&["backfill", job, "--from", "0:1", "--to", "0:2"], &[]);
    assert_fails_saying(&refused, &["backfill of a job joining two streams"]);

    // Another bound: the state kept under the old one is refused, not reused.
    write_join_job(
        &job_path,
        ws.path(),
        &JOIN.replace("'90' SECOND", "'5' MINUTE"),
    );
    std::fs::write(
        ws.path().join("clicks/100.json"),
        r#"{"ad_id":1,"click_id":"late","ts":"2026-11-01T09:09:00Z"}"#,
    )
    .unwrap();
    let refused = run_sluice(&["run", job], &[]);
    assert_fails_saying(&refused, &["0-join"]);
}

/// A click id of an expected pair whose click joined exactly one impression.
fn expected_click(expected: &[String]) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for row in expected {
        let row: Value = serde_json::from_str(row).unwrap();
        *counts
            .entry(row["click_id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    counts
        .into_iter()
        .find(|(_, n)| *n == 1)
        .map(|(c, _)| c)
        .unwrap()
}
