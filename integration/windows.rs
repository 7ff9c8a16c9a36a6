//! Windowed jobs end to end: windows emitted once when the watermark closes them, late rows in
//! the late table with the counter matching, rows within the allowed lateness counted, and
//! `sluice reconcile` agreeing with the output until a row is corrupted.

use std::path::Path;

use serde_json::Value;

use crate::support::*;

/// Writes one JSON file of `(id, user_id, amount, "HH:MM:SS")` events on 2026-11-01.
fn write_events(dir: &Path, name: &str, events: &[(i64, i64, f64, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    let text: String = events
        .iter()
        .map(|(id, user, amount, time)| {
            format!(
                r#"{{"id":{id},"user_id":{user},"code":"{id}","amount":{amount},"ts":"2026-11-01T{time}Z"}}"#
            ) + "\n"
        })
        .collect();
    std::fs::write(dir.join(name), text).unwrap();
}

/// `count` events 10 s apart from `start` (minutes, seconds after 09:00), ids from `first_id`.
fn every_10s(first_id: i64, start: (u32, u32), count: usize) -> Vec<(i64, i64, f64, String)> {
    (0..count)
        .map(|i| {
            let s = start.0 * 60 + start.1 + 10 * i as u32;
            let id = first_id + i as i64;
            (
                id,
                id % 3,
                id as f64 * 1.5,
                format!("09:{:02}:{:02}", s / 60, s % 60),
            )
        })
        .collect()
}

fn file(dir: &Path, name: &str, events: Vec<(i64, i64, f64, String)>) {
    let events: Vec<(i64, i64, f64, &str)> = events
        .iter()
        .map(|(a, b, c, d)| (*a, *b, *c, d.as_str()))
        .collect();
    write_events(dir, name, &events);
}

const SQL: &str = "
SELECT window_start, window_end, user_id,
       count(*) AS clicks, sum(amount) AS amount, min(amount) AS lo, max(amount) AS hi,
       avg(amount) AS mean, count(DISTINCT id) AS ids
FROM tumble(events, ts, INTERVAL '1' MINUTE)
GROUP BY window_start, window_end, user_id
";

fn reconcile(job: &str, from: &str, to: &str) -> (bool, String, String) {
    let out = run_sluice(
        &[
            "reconcile",
            job,
            "--from-time",
            &format!("2026-11-01T{from}Z"),
            "--to-time",
            &format!("2026-11-01T{to}Z"),
        ],
        &[],
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Total clicks per window start ("HH:MM") in the output.
async fn clicks_per_window(table: &Path) -> Vec<(String, i64)> {
    let mut totals: std::collections::BTreeMap<String, i64> = Default::default();
    for row in table_values(table, &[]).await {
        let start = row["window_start"].as_str().unwrap()[11..16].to_string();
        *totals.entry(start).or_default() += row["clicks"].as_i64().unwrap();
    }
    totals.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn late_rows_go_to_the_late_table_rows_within_the_lateness_count_and_reconcile_agrees() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    // Batch 0: 09:00:00 … 09:01:50 → watermark 09:01:48 (2 s out-of-orderness), which closes
    // [09:00, 09:01) (end + 30 s allowed lateness = 09:01:30).
    // Batch 1: a row of 09:00:40 (its window closed: late), a row of 09:01:05 (behind the
    // watermark, but its window is open: counted), then 09:02:00 … 09:03:00.
    // Batch 2: up to 09:05:00, closing [09:01, 09:02) … [09:03, 09:04).
    write_late_test_input(&input);

    let out = ws.path().join("out");
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "late_test",
        &input,
        &out,
        1,
        SQL,
        "allowed_lateness = \"30s\"",
    );
    let job = job.to_str().unwrap();
    let run = run_sluice(&["run", job], &[]);
    assert_ok(&run);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("3 batch(es) committed this run (rows in 33, out"),
        "{stdout}"
    );
    assert!(stdout.contains("late 1)"), "{stdout}");

    // Windows 09:00 … 09:03 are closed and written once; 09:04 is still open.
    assert_eq!(
        clicks_per_window(&out).await,
        vec![
            ("09:00".to_string(), 6), // ids 1–6; not the late id 100
            ("09:01".to_string(), 7), // ids 7–12 and the in-lateness id 101
            ("09:02".to_string(), 6),
            ("09:03".to_string(), 6),
        ]
    );

    // The late row: in the late table with the watermark it met and the window it missed.
    let late = table_values(&late_table(&out), &[]).await;
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0]["id"], 100);
    assert_eq!(late[0]["_watermark"], "2026-11-01T09:01:48Z");
    assert_eq!(
        late[0]["_windows_missed"],
        Value::Array(vec!["2026-11-01T09:00:00Z".into()])
    );
    assert_eq!(late[0]["batch_id"], 1);
    assert_eq!(late[0]["_source_offset"], 1);
    // The per-batch counter matches (batch 1's manifest), and the state holds the open window.
    let manifest = |batch: u32| -> Value {
        let path = out.join(format!("_sluice/late_test/batches/{batch}/manifest.json"));
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    };
    assert_eq!(manifest(1)["counters"]["rows_late"], 1);
    assert_eq!(manifest(2)["counters"]["rows_late"], 0);
    assert!(manifest(2)["counters"]["state_rows"].as_u64().unwrap() > 0);
    assert!(!manifest(2)["state_files"].as_array().unwrap().is_empty());

    // A real Delta reader sees the windows and the late row.
    let read = python_read(&late_table(&out));
    assert_eq!(read["rows"].as_array().unwrap().len(), 1, "{read}");
    let read = python_read(&out);
    assert_eq!(read["rows"].as_array().unwrap().len(), 12, "{read}");

    // A restart with nothing new writes nothing and keeps the state.
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_eq!(clicks_per_window(&out).await.len(), 4);

    // Reconcile: the period's windows equal a batch recomputation minus the late row.
    let (ok, stdout, stderr) = reconcile(job, "09:00:00", "09:04:00");
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("matching 12, missing 0, extra 0, different 0"),
        "{stdout}"
    );
    assert!(stdout.contains("late rows: 1"), "{stdout}");
    // An open window is refused by name.
    let (ok, _, stderr) = reconcile(job, "09:00:00", "09:05:00");
    assert!(!ok);
    assert!(stderr.contains("the period is not closed yet"), "{stderr}");

    // Corrupt one window's count, then lose another window's row: both caught (below, after a
    // backfill has folded the late row back in).
    // A backfill of file b (offset 1) recomputes the windows its rows fall into from every
    // event they hold: the late row now counts in 09:00, and leaves the late table.
    let done = run_sluice(&["backfill", job, "--from", "0:1", "--to", "0:2"], &[]);
    assert_ok(&done);
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(stdout.contains("replaced 4 window(s)"), "{stdout}");
    assert!(
        stdout.contains("late rows counted again (removed from the late table): 1"),
        "{stdout}"
    );
    assert_eq!(
        clicks_per_window(&out).await,
        vec![
            ("09:00".to_string(), 7),
            ("09:01".to_string(), 7),
            ("09:02".to_string(), 6),
            ("09:03".to_string(), 6),
        ]
    );
    assert!(table_values(&late_table(&out), &[]).await.is_empty());
    let (ok, stdout, stderr) = reconcile(job, "09:00:00", "09:04:00");
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("matching 12, missing 0, extra 0, different 0"),
        "{stdout}"
    );

    // Corrupt one window's count, then lose another window's row: both caught.
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    let (table, _) = table
        .update()
        .with_predicate("window_start = '2026-11-01T09:01:00Z' AND user_id = 0")
        .with_update("clicks", "clicks + 1")
        .await
        .unwrap();
    let (ok, stdout, stderr) = reconcile(job, "09:00:00", "09:04:00");
    assert!(!ok);
    assert!(
        stdout.contains("matching 11, missing 0, extra 0, different 1"),
        "{stdout}"
    );
    assert!(
        stderr.contains("does not reconcile: 1 difference(s)"),
        "{stderr}"
    );
    table
        .delete()
        .with_predicate("window_start = '2026-11-01T09:02:00Z' AND user_id = 1")
        .await
        .unwrap();
    let (ok, stdout, _) = reconcile(job, "09:00:00", "09:04:00");
    assert!(!ok);
    assert!(
        stdout.contains("missing 1, extra 0, different 1"),
        "{stdout}"
    );
}

/// A restart checks that the state it restores was written by the same windows and
/// aggregates: a changed window size is refused by operator name before anything is read. A
/// manifest written before operators were recorded (only `state_files`) still restores.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_refuses_state_another_query_wrote_and_restores_old_manifests() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let out = ws.path().join("out");
    let path = ws.path().join("job.toml");
    let sql = |minutes: u32| {
        format!(
            "SELECT window_start, user_id, count(*) AS clicks, sum(amount) AS amount \
             FROM tumble(events, ts, INTERVAL '{minutes}' MINUTE) GROUP BY window_start, user_id"
        )
    };
    let job = |minutes: u32| {
        let job = write_job_with(&path, "refit", &input, &out, 1, &sql(minutes), "");
        job.to_str().unwrap().to_string()
    };
    // Batch 0: 09:00:00 … 09:01:50; the watermark 09:01:48 closes 09:00, 09:01 stays in state.
    file(&input, "a.json", every_10s(1, (0, 0), 12));
    assert_ok(&run_sluice(&["run", &job(1)], &[]));
    let manifest_path = out.join("_sluice/refit/batches/0/manifest.json");
    let manifest: Value = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let fingerprint = manifest["operators"]["0-aggregate"]["fingerprint"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        fingerprint.starts_with("aggregate over tumble(1m, events.ts)"),
        "{fingerprint}"
    );
    assert_eq!(
        manifest["operators"]["0-aggregate"]["files"],
        manifest["state_files"]
    );
    let commits = delta_commits(&out).len();

    // Two-minute windows over the one-minute state: refused, naming the operator and both.
    file(&input, "b.json", every_10s(100, (2, 0), 12));
    let refused = run_sluice(&["run", &job(2)], &[]);
    assert_fails_saying(
        &refused,
        &[
            "holds state of operator 0-aggregate written by `aggregate over tumble(1m, events.ts)",
            "but this query plans `aggregate over tumble(2m, events.ts)",
            "nothing was read or committed",
        ],
    );
    assert_eq!(delta_commits(&out).len(), commits);

    // The manifest as a binary before the operators map wrote it: restored unchecked, so the
    // open 09:01 window keeps its six batch-0 rows.
    let mut old = manifest.clone();
    old.as_object_mut().unwrap().remove("operators");
    std::fs::write(&manifest_path, serde_json::to_vec(&old).unwrap()).unwrap();
    assert_ok(&run_sluice(&["run", &job(1)], &[]));
    assert_eq!(
        clicks_per_window(&out).await,
        vec![
            ("09:00".to_string(), 6),
            ("09:01".to_string(), 6),
            ("09:02".to_string(), 6),
        ]
    );
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(out.join("_sluice/refit/batches/1/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        manifest["operators"]["0-aggregate"]["fingerprint"],
        fingerprint.as_str()
    );
}

/// The three files of the late-data test.
fn write_late_test_input(input: &Path) {
    file(input, "a.json", every_10s(1, (0, 0), 12));
    let mut b = vec![
        (100, 1, 10.0, "09:00:40".to_string()),
        (101, 2, 20.0, "09:01:05".to_string()),
    ];
    b.extend(every_10s(102, (2, 0), 7));
    file(input, "b.json", b);
    file(input, "c.json", every_10s(200, (3, 10), 12));
}

#[tokio::test(flavor = "multi_thread")]
async fn update_mode_upserts_windows_as_they_change_and_running_aggregates_with_state_ttl() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    write_late_test_input(&input);

    // Windows in update mode: every batch upserts the windows it changed (Delta MERGE on
    // window_start, window_end, user_id), so the open window 09:04 is there too, and 09:01
    // was written after batch 0 with 6 clicks, then updated to 7 by the in-lateness row.
    let out = ws.path().join("windows");
    let job = write_job_with(
        &ws.path().join("windows.toml"),
        "update_windows",
        &input,
        &out,
        1,
        SQL,
        "allowed_lateness = \"30s\"",
    );
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(
        &job,
        text.replace("kind = \"delta\"", "kind = \"delta\"\nmode = \"update\""),
    )
    .unwrap();
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_eq!(
        clicks_per_window(&out).await,
        vec![
            ("09:00".to_string(), 6),
            ("09:01".to_string(), 7),
            ("09:02".to_string(), 6),
            ("09:03".to_string(), 6),
            ("09:04".to_string(), 6), // still open: its latest value
            ("09:05".to_string(), 1),
        ]
    );
    assert_eq!(table_values(&out, &[]).await.len(), 16, "one row per key");
    assert_eq!(table_values(&late_table(&out), &[]).await.len(), 1);
    // After batch 0 (table version 1) the open window 09:01 showed its 6 clicks so far.
    let url = url::Url::from_directory_path(&out).unwrap();
    let first = deltalake::open_table_with_version(url, 1).await.unwrap();
    let ctx = datafusion::prelude::SessionContext::new();
    first.update_datafusion_session(&ctx.state()).unwrap();
    ctx.register_table("t", first.table_provider().await.unwrap())
        .unwrap();
    let early = ctx
        .sql("SELECT sum(clicks) AS c FROM t WHERE window_start = '2026-11-01T09:01:00Z'")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(rows_as_json(&early), vec![r#"{"c":6}"#.to_string()]);
    let commits = txn_versions(&out, "update_windows");
    assert_eq!(commits, vec![0, 1, 2]);
    let read = python_read(&out);
    assert_eq!(read["rows"].as_array().unwrap().len(), 16, "{read}");
    // Reconcile: the closed windows' latest values equal the batch recomputation.
    let (ok, stdout, stderr) = reconcile(job, "09:00:00", "09:04:00");
    assert!(ok, "{stdout}\n{stderr}");

    // A running aggregate: per user, over all time, each batch upserting the users it changed;
    // state_ttl bounds the state (every user here is fresh, so all three stay).
    let out = ws.path().join("running");
    let job = write_job_with(
        &ws.path().join("running.toml"),
        "running",
        &input,
        &out,
        1,
        "SELECT user_id, count(*) AS clicks, sum(amount) AS amount FROM events GROUP BY user_id",
        "state_ttl = \"1h\"",
    );
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(
        &job,
        text.replace("kind = \"delta\"", "kind = \"delta\"\nmode = \"update\""),
    )
    .unwrap();
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));
    let rows = table_values(&out, &[]).await;
    let clicks: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["user_id"].as_i64().unwrap(),
                r["clicks"].as_i64().unwrap(),
            )
        })
        .collect();
    // 33 events: ids 1–12, 100–108, 200–211 by id % 3 (ids 100 and 101 have users 1 and 2).
    let mut want = [0i64; 3];
    for id in (1..=12).chain(102..=108).chain(200..=211) {
        want[(id % 3) as usize] += 1;
    }
    want[1] += 1;
    want[2] += 1;
    assert_eq!(clicks, vec![(0, want[0]), (1, want[1]), (2, want[2])]);
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(out.join("_sluice/running/batches/2/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["counters"]["state_rows"], 3);

    // Without state_ttl a running aggregate is refused, naming the setting.
    let text = std::fs::read_to_string(job).unwrap();
    std::fs::write(job, text.replace("state_ttl = \"1h\"", "")).unwrap();
    let out = run_sluice(&["validate", job], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unless state_ttl is set"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_merge_across_batches_and_reconcile() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let ev = |id: i64, user: i64, time: &str| (id, user, 1.0, time.to_string());
    file(
        &input,
        "a.json",
        vec![
            ev(1, 1, "09:00:00"),
            ev(2, 2, "09:00:05"),
            ev(3, 1, "09:00:20"),
        ],
    );
    // 09:00:10 arrives after 09:00:20 (within the out-of-orderness) and joins user 1's session.
    file(
        &input,
        "b.json",
        vec![ev(4, 1, "09:00:10"), ev(5, 1, "09:01:30")],
    );
    file(
        &input,
        "c.json",
        vec![
            ev(6, 1, "09:01:35"),
            ev(7, 2, "09:02:00"),
            ev(8, 9, "09:05:00"),
        ],
    );
    let out = ws.path().join("out");
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "sessions",
        &input,
        &out,
        1,
        "SELECT window_start, window_end, user_id, count(*) AS clicks, min(id) AS first_id
         FROM session(events, ts, INTERVAL '30' SECOND)
         GROUP BY window_start, window_end, user_id",
        "",
    );
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));
    let mut sessions: Vec<(String, String, i64, i64)> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| {
            (
                r["window_start"].as_str().unwrap()[11..19].to_string(),
                r["window_end"].as_str().unwrap()[11..19].to_string(),
                r["user_id"].as_i64().unwrap(),
                r["clicks"].as_i64().unwrap(),
            )
        })
        .collect();
    sessions.sort();
    let s = |a: &str, b: &str, user: i64, n: i64| (a.to_string(), b.to_string(), user, n);
    assert_eq!(
        sessions,
        vec![
            s("09:00:00", "09:00:50", 1, 3),
            s("09:00:05", "09:00:35", 2, 1),
            s("09:01:30", "09:02:05", 1, 2),
            s("09:02:00", "09:02:30", 2, 1),
        ],
        "user 9's session is still open"
    );
    let (ok, stdout, stderr) = reconcile(job, "09:00:00", "09:06:00");
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("matching 4, missing 0, extra 0, different 0"),
        "{stdout}"
    );
}
