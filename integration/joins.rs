//! Stream-static joins: a stream joined with a Delta dimension table (`[tables.NAME]`), each
//! batch at the table version its intent recorded — across SIGKILLs, a rerun joins the version
//! its first attempt recorded even after the table changed, and backfill and reconcile join each
//! row with its batch's version — and the golden cases under `integration/golden/`, each run
//! straight through and again with a crash at a named point.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use deltalake::protocol::SaveMode;
use serde_json::Value;

use crate::support::*;

/// Writes `users` (user_id → country) as the whole Delta table at `path` (a new version).
async fn write_users(path: &Path, users: &[(i64, &str)]) {
    std::fs::create_dir_all(path).unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("user_id", DataType::Int64, false),
        Field::new("country", DataType::Utf8, true),
    ]));
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(users.iter().map(|u| u.0))),
            Arc::new(StringArray::from_iter_values(users.iter().map(|u| u.1))),
        ],
    )
    .unwrap();
    let url = url::Url::from_directory_path(path).unwrap();
    deltalake::DeltaTable::try_from_url(url)
        .await
        .unwrap()
        .write(vec![batch])
        .with_save_mode(SaveMode::Overwrite)
        .await
        .unwrap();
}

/// One JSON file of events `(id, user_id)`, ten seconds apart from `09:MM:00`.
fn write_events(dir: &Path, name: &str, minute: u32, events: &[(i64, i64)]) {
    std::fs::create_dir_all(dir).unwrap();
    let text: String = events
        .iter()
        .enumerate()
        .map(|(i, (id, user))| {
            format!(
                r#"{{"id":{id},"user_id":{user},"code":"c{id}","amount":{id}.5,"ts":"2026-11-01T09:{minute:02}:{:02}Z"}}"#,
                i * 10 % 60
            ) + "\n"
        })
        .collect();
    std::fs::write(dir.join(name), text).unwrap();
}

/// A job file over `input` and the Delta table `users`, writing to `out`.
fn write_join_job(ws: &Path, job_id: &str, input: &Path, users: &Path, out: &Path, sql: &str) {
    let job = write_job_with(&ws.join("job.toml"), job_id, input, out, 1, sql, "");
    let mut text = std::fs::read_to_string(&job).unwrap();
    text.push_str(&format!(
        "\n[tables.users]\nkind = \"delta\"\npath = \"{}\"\n",
        users.display()
    ));
    std::fs::write(&job, text).unwrap();
}

/// `sluice reconcile` of `job` over `[from, to)`.
fn reconcile(job: &str, from: &str, to: &str) -> std::process::Output {
    run_sluice(
        &["reconcile", job, "--from-time", from, "--to-time", to],
        &[],
    )
}

const LEFT_JOIN: &str = "SELECT e.id, e.user_id, u.country, e.ts FROM events e \
    LEFT JOIN users u ON e.user_id = u.user_id";

/// A left join of the stream with a Delta table that changes while the job runs, killed after
/// batch 1's manifest: the rerun of batch 1 joins version 0 (what its intent recorded), not the
/// newer version 1 written meanwhile; batch 2 joins version 1. Every event is in the output
/// once, users missing from the table with a null country. Reconcile and backfill agree.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_joins_a_delta_table_at_the_version_each_batch_recorded() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let users = ws.path().join("users");
    let out = ws.path().join("out");
    write_users(&users, &[(0, "fr"), (1, "de"), (2, "us")]).await;
    // User 3 is in no version of the table.
    let files: [Vec<(i64, i64)>; 3] = [
        (1..=6).map(|id| (id, id % 4)).collect(),
        (7..=12).map(|id| (id, id % 4)).collect(),
        (13..=18).map(|id| (id, id % 4)).collect(),
    ];
    for (i, events) in files.iter().enumerate() {
        write_events(
            &input,
            &format!("{}.json", (b'a' + i as u8) as char),
            i as u32,
            events,
        );
    }
    write_join_job(ws.path(), "enrich", &input, &users, &out, LEFT_JOIN);
    let job = ws.path().join("job.toml");
    let job = job.to_str().unwrap();

    let validated = run_sluice(&["validate", job], &[]);
    assert_ok(&validated);
    let text = String::from_utf8_lossy(&validated.stdout);
    assert!(text.contains("table users (static"), "{text}");
    assert!(text.contains("state: none"), "{text}");

    // Batch 0 commits; batch 1 is killed after its manifest (its intent recorded version 0).
    let killed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", "after_manifest:1")]);
    assert_eq!(killed.status.signal(), Some(9), "{killed:?}");
    // The table changes: user 2 moves, user 0 leaves.
    write_users(&users, &[(1, "de"), (2, "es")]).await;
    assert_ok(&run_sluice(&["run", job], &[]));

    let version = |v: u32| {
        let path = out.join(format!("_sluice/enrich/batches/{v}/manifest.json"));
        let manifest: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        manifest["table_versions"]["users"].clone()
    };
    assert_eq!([version(0), version(1), version(2)], ["0", "0", "1"]);

    let v0: BTreeMap<i64, &str> = [(0, "fr"), (1, "de"), (2, "us")].into();
    let v1: BTreeMap<i64, &str> = [(1, "de"), (2, "es")].into();
    let mut expected: Vec<(i64, Option<String>)> = Vec::new();
    for (batch, events) in files.iter().enumerate() {
        let table = if batch < 2 { &v0 } else { &v1 };
        for (id, user) in events {
            expected.push((*id, table.get(user).map(|c| c.to_string())));
        }
    }
    let mut got: Vec<(i64, Option<String>)> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r.get("country").and_then(Value::as_str).map(String::from),
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, expected);
    // The lineage columns came through the join.
    let rows = table_values(&out, &[]).await;
    assert!(
        rows.iter()
            .all(|r| r.get("_source_offset").is_some_and(Value::is_i64)),
        "{rows:?}"
    );

    // Reconcile joins each raw event with the version its batch joined (the version log):
    // joining the newest version instead would differ on users 0 and 2 of batches 0 and 1.
    let (from, to) = ("2026-11-01T09:00:00Z", "2026-11-01T09:03:00Z");
    let reconciled = reconcile(job, from, to);
    assert_ok(&reconciled);
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(
        text.contains("matching 18, missing 0, extra 0, different 0"),
        "{text}"
    );
    // A backfill of batch 1's file recomputes its rows at version 0 and of batch 2's at
    // version 1: the table is unchanged.
    let before = table_rows(&out).await;
    for (from, to) in [("0:1", "0:2"), ("0:2", "0:3")] {
        let done = run_sluice(&["backfill", job, "--from", from, "--to", to], &[]);
        assert_ok(&done);
    }
    assert_eq!(table_rows(&out).await, before);
    // A wrong country in the table is caught.
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    table
        .update()
        .with_predicate("id = 14")
        .with_update("country", "'us'")
        .await
        .unwrap();
    let reconciled = reconcile(job, from, to);
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(!reconciled.status.success(), "{text}");
    assert!(text.contains("different 1"), "{text}");

    // The log records a run's first load and each change: batch 0 (first run), 1 (the rerun
    // after the kill), 2 (version 1). Without it, the versions are unknown: refused, not
    // guessed.
    let log = out.join("_sluice/enrich/tables/users");
    let mut entries: Vec<String> = std::fs::read_dir(&log)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries.len(), 3, "{entries:?}");
    std::fs::remove_dir_all(&log).unwrap();
    let refused = reconcile(job, from, to);
    assert_fails_saying(&refused, &["so the version it joined is unknown"]);
}

/// A windowed count over the join, the table changing between a SIGKILL after batch 1's state
/// and the rerun: windows of batches 0–1 count countries at version 0, later ones at version 1,
/// and reconcile and a backfill of batch 1's file (recomputing its windows from the version
/// log) agree with the stream.
#[tokio::test(flavor = "multi_thread")]
async fn windows_over_a_join_reconcile_and_backfill_at_each_batch_version() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let users = ws.path().join("users");
    let out = ws.path().join("out");
    write_users(&users, &[(0, "fr"), (1, "de"), (2, "us"), (3, "us")]).await;
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let first = 1 + 6 * i as i64;
        let events: Vec<(i64, i64)> = (first..first + 6).map(|id| (id, id % 4)).collect();
        write_events(&input, &format!("{name}.json"), i as u32, &events);
    }
    let sql = "SELECT window_start, window_end, u.country, count(*) AS clicks \
        FROM tumble(events, ts, INTERVAL '1' MINUTE) e JOIN users u ON e.user_id = u.user_id \
        GROUP BY window_start, window_end, u.country";
    write_join_job(ws.path(), "by_country", &input, &users, &out, sql);
    let job = ws.path().join("job.toml");
    let job = job.to_str().unwrap();
    let killed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", "after_state:1")]);
    assert_eq!(killed.status.signal(), Some(9), "{killed:?}");
    write_users(&users, &[(1, "de"), (2, "es"), (3, "es")]).await;
    assert_ok(&run_sluice(&["run", job], &[]));

    // Windows 09:00 … 09:02 are closed (watermark 09:03:48).
    let mut counts: Vec<(String, String, i64)> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| {
            (
                r["window_start"].as_str().unwrap()[11..16].to_string(),
                r["country"].as_str().unwrap().to_string(),
                r["clicks"].as_i64().unwrap(),
            )
        })
        .collect();
    counts.sort();
    let row = |w: &str, c: &str, n: i64| (w.to_string(), c.to_string(), n);
    // 09:00: ids 1–6 → users 1,2,3,0,1,2 at v0; 09:01: ids 7–12 → 3,0,1,2,3,0 at v0 (the rerun
    // of batch 1 joins its intent's version); 09:02: ids 13–18 → 1,2,3,0,1,2 at v1 (no user 0).
    assert_eq!(
        counts,
        vec![
            row("09:00", "de", 2),
            row("09:00", "fr", 1),
            row("09:00", "us", 3),
            row("09:01", "de", 1),
            row("09:01", "fr", 2),
            row("09:01", "us", 3),
            row("09:02", "de", 2),
            row("09:02", "es", 3),
        ]
    );
    let (from, to) = ("2026-11-01T09:00:00Z", "2026-11-01T09:03:00Z");
    let reconciled = reconcile(job, from, to);
    assert_ok(&reconciled);
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(
        text.contains("matching 8, missing 0, extra 0, different 0"),
        "{text}"
    );
    let before = table_rows(&out).await;
    let done = run_sluice(&["backfill", job, "--from", "0:1", "--to", "0:2"], &[]);
    assert_ok(&done);
    let text = String::from_utf8_lossy(&done.stdout);
    assert!(text.contains("replaced 1 window(s)"), "{text}");
    assert_eq!(table_rows(&out).await, before);
}

/// The joins a stream may take part in without state: the stream inner- or left-joined with a
/// table, a semi join (`IN`) over the table, anything on the table's side. Each other shape is
/// refused naming the node at fault and why.
#[tokio::test(flavor = "multi_thread")]
async fn joins_that_would_need_state_are_refused_by_name() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let users = ws.path().join("users");
    let out = ws.path().join("out");
    write_users(&users, &[(0, "fr"), (1, "de")]).await;
    write_events(&input, "a.json", 0, &[(1, 0), (2, 1), (3, 2)]);
    let job = ws.path().join("job.toml");
    let job = job.to_str().unwrap();
    let unmatched = "would emit them again every batch";
    for (sql, wanted) in [
        (
            "SELECT e.id, u.country FROM users u LEFT JOIN events e ON e.user_id = u.user_id",
            ["Left Join", unmatched],
        ),
        (
            "SELECT e.id, u.country FROM events e FULL JOIN users u ON e.user_id = u.user_id",
            ["Full Join", unmatched],
        ),
        (
            "SELECT a.id, b.id AS other FROM events a JOIN events b ON a.user_id = b.user_id",
            // Two streams joined with nothing bounding how long a row waits.
            ["Inner Join", "set state_ttl"],
        ),
        (
            "SELECT window_start, count(*) AS n FROM tumble(events, ts, INTERVAL '1' MINUTE) e \
             FULL JOIN users u ON e.user_id = u.user_id GROUP BY window_start, window_end",
            ["Full Join", unmatched],
        ),
        (
            "SELECT id FROM events WHERE user_id IN (SELECT user_id FROM events WHERE id > 1)",
            [
                "Filter",
                "a subquery over a stream would see only the batch's rows",
            ],
        ),
        (
            "SELECT id, user_id FROM events UNION ALL SELECT user_id AS id, user_id FROM users",
            [
                "Union",
                "a UNION of the stream with a table or constant rows",
            ],
        ),
        (
            "SELECT user_id FROM users",
            ["reads no source", "tables are joined"],
        ),
        (
            "SELECT window_start, count(*) AS n FROM tumble(events, ts, INTERVAL '1' MINUTE) \
             GROUP BY window_start, window_end HAVING count(*) > (SELECT count(*) FROM users)",
            [
                "TableScan: users",
                "reads a table beside the aggregate's output",
            ],
        ),
    ] {
        write_join_job(ws.path(), "refused", &input, &users, &out, sql);
        assert_fails_saying(&run_sluice(&["validate", job], &[]), &wanted);
    }
    // A semi join over the table, and an aggregate on the table's side, run.
    let sql = "SELECT e.id, c.n FROM events e JOIN \
        (SELECT country, count(*) AS n FROM users GROUP BY country) c ON c.country = 'fr' \
        WHERE e.user_id IN (SELECT user_id FROM users WHERE country = 'de')";
    write_join_job(ws.path(), "table_side", &input, &users, &out, sql);
    assert_ok(&run_sluice(&["run", job], &[]));
    let rows = table_values(&out, &["_source_partition", "_source_offset"]).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0]["id"].as_i64(), rows[0]["n"].as_i64()),
        (Some(2), Some(1))
    );
}

/// Users as a folder of JSON-lines files (`kind = "files"`).
fn write_user_files(dir: &Path, users: &[(i64, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    let text: String = users
        .iter()
        .map(|(id, country)| format!("{{\"user_id\":{id},\"country\":\"{country}\"}}\n"))
        .collect();
    std::fs::write(dir.join("users.json"), text).unwrap();
}

/// The Delta test above with the table as plain files: a version is the fingerprint of the
/// folder's listing, and the job snapshots each version it records into the checkpoint, so the
/// rerun of batch 1 after a SIGKILL joins the files as its intent saw them although they were
/// rewritten meanwhile, batch 2 joins the new files, and reconcile agrees — even after the
/// files are gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_files_table_is_joined_at_the_listing_each_batch_recorded() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let users = ws.path().join("users");
    let out = ws.path().join("out");
    write_user_files(&users, &[(0, "fr"), (1, "de"), (2, "us")]);
    let files: [Vec<(i64, i64)>; 3] = [
        (1..=6).map(|id| (id, id % 4)).collect(),
        (7..=12).map(|id| (id, id % 4)).collect(),
        (13..=18).map(|id| (id, id % 4)).collect(),
    ];
    for (i, events) in files.iter().enumerate() {
        write_events(
            &input,
            &format!("{}.json", (b'a' + i as u8) as char),
            i as u32,
            events,
        );
    }
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "enrich",
        &input,
        &out,
        1,
        LEFT_JOIN,
        "",
    );
    let mut text = std::fs::read_to_string(&job).unwrap();
    text.push_str(&format!(
        "\n[tables.users]\nkind = \"files\"\npath = \"{}\"\nformat = \"json\"\n\
         schema = \"user_id BIGINT, country VARCHAR\"\n",
        users.display()
    ));
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();

    let killed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", "after_manifest:1")]);
    assert_eq!(killed.status.signal(), Some(9), "{killed:?}");
    write_user_files(&users, &[(1, "de"), (2, "es")]);
    assert_ok(&run_sluice(&["run", job], &[]));

    let version = |v: u32| {
        let path = out.join(format!("_sluice/enrich/batches/{v}/manifest.json"));
        let manifest: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        manifest["table_versions"]["users"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (v0, v1, v2) = (version(0), version(1), version(2));
    assert_eq!(v0, v1);
    assert_ne!(v1, v2);
    assert!(v0.starts_with("1-"), "one file: {v0}");
    let snapshots = out.join("_sluice/enrich/table_snapshots/users");
    for v in [&v0, &v2] {
        assert!(snapshots.join(format!("{v}.parquet")).is_file(), "{v}");
    }

    let old: BTreeMap<i64, &str> = [(0, "fr"), (1, "de"), (2, "us")].into();
    let new: BTreeMap<i64, &str> = [(1, "de"), (2, "es")].into();
    let mut expected: Vec<(i64, Option<String>)> = Vec::new();
    for (batch, events) in files.iter().enumerate() {
        let table = if batch < 2 { &old } else { &new };
        for (id, user) in events {
            expected.push((*id, table.get(user).map(|c| c.to_string())));
        }
    }
    let mut got: Vec<(i64, Option<String>)> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r.get("country").and_then(Value::as_str).map(String::from),
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, expected);

    // Reconcile joins each event with its batch's version — from the snapshots, which stay
    // readable when the files are gone.
    std::fs::remove_dir_all(&users).unwrap();
    std::fs::create_dir_all(&users).unwrap();
    let reconciled = reconcile(job, "2026-11-01T09:00:00Z", "2026-11-01T09:03:00Z");
    assert_ok(&reconciled);
    let text = String::from_utf8_lossy(&reconciled.stdout);
    assert!(
        text.contains("matching 18, missing 0, extra 0, different 0"),
        "{text}"
    );
}
