//! Deduplication of at-least-once input: `ROW_NUMBER() … = 1` over redelivered events, killed
//! at every crash point of the commit protocol, against a batch recomputation of the same rows
//! in plain DataFusion.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use datafusion::prelude::SessionContext;
use serde_json::Value;

use crate::support::*;

/// The first delivery of each event id, by arrival.
const DEDUP: &str = "SELECT id, user_id, code, ts FROM (SELECT *, ROW_NUMBER() OVER \
    (PARTITION BY id ORDER BY ts) AS rn FROM events) WHERE rn = 1";

/// One delivery of an event: (event id, user, which delivery, event time in seconds after
/// 09:00:00).
type Delivery = (i64, i64, u32, u32);

/// Files of deliveries in arrival order: every event id once, and about a third of them
/// delivered again — in the same file or up to three files later, with the same event time
/// (a producer retry, a consumer replay).
fn deliveries(files: usize, per_file: usize) -> Vec<Vec<Delivery>> {
    let mut rng = Rng(7);
    let mut out: Vec<Vec<Delivery>> = vec![Vec::new(); files];
    let mut next_id = 0;
    for (f, file) in out.iter_mut().enumerate() {
        for i in 0..per_file {
            let id = next_id;
            next_id += 1;
            let time = (f * 60 + i * 60 / per_file) as u32;
            file.push((id, id % 7, 1, time));
        }
    }
    let mut again: Vec<(usize, Delivery)> = Vec::new();
    for (f, file) in out.iter().enumerate() {
        for &(id, user, _, time) in file {
            if rng.next().is_multiple_of(3) {
                let later = (f + (rng.next() % 4) as usize).min(files - 1);
                again.push((later, (id, user, 2, time)));
            }
        }
    }
    for (f, delivery) in again {
        // Into the later file at a pseudo-random place after the first delivery.
        let file = &mut out[f];
        let first = file
            .iter()
            .position(|d| d.0 == delivery.0)
            .map_or(0, |p| p + 1);
        let at = first + (rng.next() as usize) % (file.len() - first + 1);
        file.insert(at, delivery);
    }
    out
}

fn write_deliveries(dir: &Path, files: &[Vec<Delivery>]) {
    std::fs::create_dir_all(dir).unwrap();
    for (f, file) in files.iter().enumerate() {
        let text: String = file
            .iter()
            .map(|(id, user, delivery, time)| {
                format!(
                    r#"{{"id":{id},"user_id":{user},"code":"d{delivery}","amount":1.0,"ts":"2026-11-01T09:{:02}:{:02}Z"}}"#,
                    time / 60,
                    time % 60
                ) + "\n"
            })
            .collect();
        std::fs::write(dir.join(format!("{f:03}.json")), text).unwrap();
    }
}

/// The same query over every delivery at once, in plain DataFusion: the first row per id by
/// arrival order (a column the test knows, since it wrote the files).
async fn recomputed(files: &[Vec<Delivery>]) -> Vec<String> {
    let rows: Vec<(i64, Delivery)> = files
        .iter()
        .flatten()
        .enumerate()
        .map(|(arrival, d)| (arrival as i64, *d))
        .collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("arrival", DataType::Int64, false),
        Field::new("id", DataType::Int64, false),
        Field::new("user_id", DataType::Int64, false),
        Field::new("code", DataType::Utf8, false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1.0))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1.1))),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| format!("d{}", r.1.2)),
            )),
        ],
    )
    .unwrap();
    let ctx = SessionContext::new();
    ctx.register_batch("deliveries", batch).unwrap();
    let df = ctx
        .sql(
            "SELECT id, user_id, code FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY id \
             ORDER BY arrival) AS rn FROM deliveries) WHERE rn = 1",
        )
        .await
        .unwrap();
    let mut out = rows_as_json(&df.collect().await.unwrap());
    out.sort();
    out
}

/// Redelivered events through SIGKILLs at every step of the commit protocol: each event id is
/// in the output exactly once, as the first delivery to arrive — what DataFusion computes over
/// all deliveries at once — and reconcile agrees; the duplicates are counted; a backfill is
/// refused with the reason; a restart whose key changed refuses the state.
#[tokio::test(flavor = "multi_thread")]
async fn redelivered_events_are_kept_once_through_sigkills_as_a_batch_recomputation_says() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let out = ws.path().join("out");
    let files = deliveries(8, 20);
    write_deliveries(&input, &files);
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "dedup",
        &input,
        &out,
        1,
        DEDUP,
        "state_ttl = \"1h\"",
    );
    let job = job.to_str().unwrap();

    let validated = run_sluice(&["validate", job], &[]);
    assert_ok(&validated);
    let text = String::from_utf8_lossy(&validated.stdout);
    assert!(text.contains("0-deduplication"), "{text}");
    assert!(text.contains("state key: id"), "{text}");
    assert!(text.contains("state_ttl (1h)"), "{text}");

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

    let mut got: Vec<String> = table_values(&out, &["_source_partition", "_source_offset", "ts"])
        .await
        .into_iter()
        .map(|r| {
            let row: BTreeMap<String, Value> = r.into_iter().collect();
            serde_json::to_string(&row).unwrap()
        })
        .collect();
    got.sort();
    let expected: Vec<String> = recomputed(&files)
        .await
        .iter()
        .map(|r| {
            let row: BTreeMap<String, Value> = serde_json::from_str(r).unwrap();
            serde_json::to_string(&row).unwrap()
        })
        .collect();
    let ids: BTreeSet<i64> = files.iter().flatten().map(|d| d.0).collect();
    let deliveries: usize = files.iter().map(Vec::len).sum();
    assert!(deliveries > ids.len() + 30, "the input redelivers events");
    assert_eq!(got.len(), ids.len(), "one row per event id");
    assert_eq!(got, expected);

    // Every delivery was read; the redeliveries were counted as duplicates (over the batches
    // that committed), none were late or dead letters.
    let mut duplicates = 0;
    let mut state_rows = 0;
    for batch in 0..8 {
        let path = out.join(format!("_sluice/dedup/batches/{batch}/manifest.json"));
        if let Ok(bytes) = std::fs::read(path) {
            let manifest: Value = serde_json::from_slice(&bytes).unwrap();
            let counters = &manifest["counters"];
            duplicates += counters["rows_duplicate"].as_u64().unwrap_or(0);
            state_rows = counters["state_rows"].as_u64().unwrap();
            assert_eq!(counters["rows_late"], 0, "{manifest}");
            assert!(
                manifest["operators"]["0-deduplication"]["files"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty()),
                "{manifest}"
            );
        }
    }
    assert_eq!(duplicates as usize, deliveries - ids.len());
    // No key is older than the 1 h state_ttl: each is remembered.
    assert_eq!(state_rows as usize, ids.len());

    // Reconcile replays the batches under their watermarks and finds the table right; a
    // duplicate slipped into the table is caught.
    let reconcile = || {
        run_sluice(
            &[
                "reconcile",
                job,
                "--from-time",
                "2026-11-01T09:00:00Z",
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
            ids.len()
        )),
        "{text}"
    );
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    table
        .update()
        .with_predicate("id = 5")
        .with_update("code", "'d2'")
        .await
        .unwrap();
    let reconciled = reconcile();
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(!reconciled.status.success(), "{text}");
    assert!(text.contains("different 1"), "{text}");

    let refused = run_sluice(&["backfill", job, "--from", "0:1", "--to", "0:2"], &[]);
    assert_fails_saying(
        &refused,
        &["backfill of a deduplicating job is not available"],
    );

    // Keyed by user instead of by event: the state of the old key is refused, not reused.
    let by_user = DEDUP.replace("PARTITION BY id", "PARTITION BY user_id");
    write_job_with(
        &ws.path().join("job.toml"),
        "dedup",
        &input,
        &out,
        1,
        &by_user,
        "state_ttl = \"1h\"",
    );
    std::fs::write(
        input.join("999.json"),
        r#"{"id":1000,"user_id":1,"code":"d1","amount":1.0,"ts":"2026-11-01T09:09:00Z"}"#,
    )
    .unwrap();
    let refused = run_sluice(&["run", job], &[]);
    assert_fails_saying(&refused, &["0-deduplication", "by [user_id]"]);
}
