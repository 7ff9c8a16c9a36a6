//! `sluice backfill`: rerunning an offset range replaces exactly what it covers, in one commit
//! per table, idempotently, also while the live job runs.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;

/// Runs the same job file uninterrupted into a fresh table: the reference result.
async fn reference(ws: &std::path::Path, input: &std::path::Path) -> (Vec<String>, Vec<String>) {
    let out = ws.join("reference");
    let job = write_job(&ws.join("reference.toml"), "reference", input, &out, 3);
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    (
        table_rows(&out).await,
        dead_letters_without_batch(&out).await,
    )
}

async fn dead_letters_without_batch(out: &std::path::Path) -> Vec<String> {
    table_values(&dead_letter_table(out), &["batch_id"])
        .await
        .into_iter()
        .map(|r| serde_json::Value::Object(r).to_string())
        .collect()
}

/// Waits until the live job has committed `files` files (its end offset of partition 0).
async fn wait_for_committed(
    out: &std::path::Path,
    files: u64,
    live: &mut std::process::Child,
    log: &std::path::Path,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        // Not `status_of`: the table may not exist yet while the live job starts.
        let status = run_sluice(&["status", out.to_str().unwrap()], &[]);
        let text = String::from_utf8_lossy(&status.stdout).to_string();
        let committed = status_field(&text, "end offsets")
            .and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .and_then(|v| v["events"]["0"].as_u64());
        if committed.is_some_and(|c| c >= files) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline && live.try_wait().unwrap().is_none(),
            "the live job did not reach {files} files:\n{text}\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn backfill(job: &str, args: &[&str]) -> String {
    let mut all = vec!["backfill", job];
    all.extend_from_slice(args);
    let out = run_sluice(&all, &[]);
    assert_ok(&out);
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn backfilling_a_corrupted_range_restores_it_and_a_second_backfill_changes_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    // Range A = files 0..10, committed by a first run; range B = files 10..20, by a second.
    Events::write(&input, 0, 10, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "live", &input, &out, 3);
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));
    Events::write(&input, 10, 10, 5);
    assert_ok(&run_sluice(&["run", job], &[]));
    let (want_rows, want_letters) = reference(ws.path(), &input).await;
    assert_eq!(table_rows(&out).await, want_rows);

    // Damage range A by hand: change some rows, lose one, lose a dead letter.
    let url = |p: &std::path::Path| url::Url::from_directory_path(p).unwrap();
    let table = deltalake::open_table(url(&out)).await.unwrap();
    let (table, _) = table
        .update()
        .with_predicate("id <= 20")
        .with_update("double_amount", "double_amount + 1")
        .await
        .unwrap();
    table.delete().with_predicate("id = 30").await.unwrap();
    let letters = deltalake::open_table(url(&dead_letter_table(&out)))
        .await
        .unwrap();
    letters
        .delete()
        .with_predicate("_source_offset < 3")
        .await
        .unwrap();
    assert_ne!(table_rows(&out).await, want_rows);

    // The dry run says what it would do and writes nothing.
    let before = table_rows(&out).await;
    let dry = backfill(job, &["--from", "0:0", "--to", "0:10", "--dry-run"]);
    assert!(dry.contains("offsets 0:[0, 10) (10 offsets)"), "{dry}");
    assert_eq!(table_rows(&out).await, before);

    let done = backfill(job, &["--from", "0:0", "--to", "0:10"]);
    assert!(done.contains("backfill live/backfill/0"), "{done}");
    assert_eq!(table_rows(&out).await, want_rows, "range A not restored");
    assert_eq!(dead_letters_without_batch(&out).await, want_letters);

    // Again: the same tables (rows and dead letters, no duplicates).
    backfill(job, &["--from", "0:0", "--to", "0:10"]);
    assert_eq!(table_rows(&out).await, want_rows);
    assert_eq!(dead_letters_without_batch(&out).await, want_letters);

    // The live job carries on where it was.
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_eq!(table_rows(&out).await, want_rows);
}

#[tokio::test(flavor = "multi_thread")]
async fn earliest_to_latest_on_a_fresh_table_is_the_complete_batch_result() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 12, 5);
    let (want_rows, want_letters) = reference(ws.path(), &input).await;

    let out = ws.path().join("batch");
    let job = write_job(&ws.path().join("batch.toml"), "batch", &input, &out, 3);
    let done = backfill(
        job.to_str().unwrap(),
        &["--from", "earliest", "--to", "latest"],
    );
    assert!(done.contains("offsets 0:[0, 12)"), "{done}");
    assert_eq!(table_rows(&out).await, want_rows);
    assert_eq!(dead_letters_without_batch(&out).await, want_letters);

    // An event-time period resolves to the files holding its events (lines 100..160 are in
    // files 20..32 of 5 lines; only files 0..12 exist, so 10:01:40 onwards is in 20.. — here
    // the period 10:00:20–10:00:40 is lines 20..40, files 4..8).
    let dry = backfill(
        job.to_str().unwrap(),
        &[
            "--from-time",
            "2026-11-01T10:00:20Z",
            "--to-time",
            "2026-11-01T10:00:40Z",
            "--dry-run",
        ],
    );
    assert!(dry.contains("offsets 0:[4, 8)"), "{dry}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backfill_concurrent_with_the_live_job_leaves_a_correct_table() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 30, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "busy", &input, &out, 1);
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "mode = \"available-now\"",
        "mode = \"interval\"\ninterval = \"50ms\"",
    );
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();

    let log = ws.path().join("live.log");
    let mut live = sluice_command()
        .args(["run", job])
        .env_remove("RUST_LOG")
        // Each live commit waits 300 ms between loading the table and committing, so the
        // backfills' commits land inside that window and the two writers do collide.
        .env("SLUICE_PAUSE_AT", "before_output_commit:300")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Offsets the live job has not committed yet are refused: it will write them itself.
    wait_for_committed(&out, 1, &mut live, &log).await;
    let early = run_sluice(&["backfill", job, "--from", "0:0", "--to", "0:30"], &[]);
    assert!(!early.status.success());
    assert!(
        String::from_utf8_lossy(&early.stderr).contains("beyond what the live job has committed"),
        "{}",
        String::from_utf8_lossy(&early.stderr)
    );
    // Once it has committed the first 8 files, backfill them while it keeps committing (more
    // files keep arriving).
    wait_for_committed(&out, 8, &mut live, &log).await;
    let mut conflicts_seen = 0;
    for round in 0..4 {
        Events::write(&input, 30 + round * 5, 5, 5);
        let out_text = run_sluice(&["backfill", job, "--from", "0:0", "--to", "0:8"], &[]);
        assert_ok(&out_text);
        if String::from_utf8_lossy(&out_text.stderr).contains("conflicted with a concurrent commit")
        {
            conflicts_seen += 1;
        }
    }
    // Wait for the live job to take every file, then stop it.
    wait_for_committed(&out, 50, &mut live, &log).await;
    Command::new("kill")
        .args(["-TERM", &live.id().to_string()])
        .status()
        .unwrap();
    assert!(
        live.wait().unwrap().success(),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    let live_retries = std::fs::read_to_string(&log)
        .unwrap()
        .matches("conflicted with a concurrent commit")
        .count();

    let (want_rows, want_letters) = reference(ws.path(), &input).await;
    let got_rows = table_rows(&out).await;
    if got_rows != want_rows {
        let count = |rows: &[String]| {
            let mut m = std::collections::BTreeMap::<String, i64>::new();
            for r in rows {
                *m.entry(r.clone()).or_default() += 1;
            }
            m
        };
        let (got, want) = (count(&got_rows), count(&want_rows));
        let diff: Vec<_> = got
            .keys()
            .chain(want.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|k| got.get(*k) != want.get(*k))
            .map(|k| {
                format!(
                    "{} in table, {} wanted: {k}",
                    got.get(k).unwrap_or(&0),
                    want.get(k).unwrap_or(&0)
                )
            })
            .collect();
        panic!("rows lost or duplicated:\n{}", diff.join("\n"));
    }
    assert_eq!(dead_letters_without_batch(&out).await, want_letters);
    println!("conflicts retried: {conflicts_seen} of 4 backfills, {live_retries} live commits");
    // The test is only worth something if the two writers did collide.
    assert!(
        conflicts_seen + live_retries > 0,
        "no commit conflicted; the test did not exercise concurrency"
    );
}

/// A windowed job file over `input` writing to `out` (hopping 30 s windows every 10 s).
fn windowed_job(
    ws: &std::path::Path,
    name: &str,
    input: &std::path::Path,
) -> (String, std::path::PathBuf) {
    let out = ws.join(name);
    let job = write_job_with(
        &ws.join(format!("{name}.toml")),
        name,
        input,
        &out,
        3,
        WINDOWED_SQL,
        "",
    );
    (job.to_str().unwrap().to_string(), out)
}

/// Rows of the output whose window starts at `hh:mm:ss` on 2026-11-01.
fn at(time: &str) -> String {
    format!("window_start = '2026-11-01T{time}Z'")
}

#[tokio::test(flavor = "multi_thread")]
async fn backfilling_a_windowed_range_replaces_exactly_its_windows() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    // 20 files × 5 lines: one event a second from 10:00:00 to 10:01:39, bad lines mixed in.
    Events::write(&input, 0, 20, 5);
    let (job, out) = windowed_job(ws.path(), "live", &input);
    assert_ok(&run_sluice(&["run", &job], &[]));
    let (reference_job, reference) = windowed_job(ws.path(), "reference", &input);
    assert_ok(&run_sluice(&["run", &reference_job], &[]));
    let want = table_rows(&reference).await;
    assert_eq!(table_rows(&out).await, want);

    // Damage two windows the range covers and one it does not.
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    let (table, _) = table
        .update()
        .with_predicate(at("10:00:20"))
        .with_update("n", "n + 100")
        .await
        .unwrap();
    let (table, _) = table.delete().with_predicate(at("10:00:10")).await.unwrap();
    table.delete().with_predicate(at("10:01:00")).await.unwrap();

    // Files 4–5 hold 10:00:20 … 10:00:29: windows starting 10:00:00, 10:00:10 and 10:00:20.
    let dry = backfill(&job, &["--from", "0:4", "--to", "0:6", "--dry-run"]);
    assert!(
        dry.contains(
            "3 window(s) starting 2026-11-01T10:00:00Z, 2026-11-01T10:00:10Z, 2026-11-01T10:00:20Z"
        ),
        "{dry}"
    );
    assert!(dry.contains("read widened to whole windows: every committed event with event time in [2026-11-01T10:00:00Z, 2026-11-01T10:00:50Z)"), "{dry}");
    let done = backfill(&job, &["--from", "0:4", "--to", "0:6"]);
    assert!(done.contains("replaced 3 window(s)"), "{done}");
    let after = table_rows(&out).await;
    let lost: Vec<&String> = want.iter().filter(|r| !after.contains(r)).collect();
    assert!(
        !lost.is_empty() && lost.iter().all(|r| r.contains("10:01:00")),
        "only the window outside the range stays damaged: {lost:?}"
    );
    assert_eq!(after.len() + lost.len(), want.len());
    // Twice: unchanged, dead letters included.
    let letters = table_rows(&dead_letter_table(&out)).await;
    backfill(&job, &["--from", "0:4", "--to", "0:6"]);
    assert_eq!(table_rows(&out).await, after);
    assert_eq!(table_rows(&dead_letter_table(&out)).await, letters);
    // Reconcile agrees on the repaired windows.
    let rec = run_sluice(
        &[
            "reconcile",
            &job,
            "--from-time",
            "2026-11-01T10:00:00Z",
            "--to-time",
            "2026-11-01T10:00:30Z",
        ],
        &[],
    );
    assert_ok(&rec);
    assert!(String::from_utf8_lossy(&rec.stdout).contains("missing 0, extra 0, different 0"));

    // A range touching windows the live job has not closed yet is refused by name.
    let refused = run_sluice(&["backfill", &job, "--from", "0:18", "--to", "0:20"], &[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("which the live job has not closed yet"),
        "{stderr}"
    );

    // On a fresh table, earliest → latest is the batch run: every window, closed or not.
    let (fresh_job, fresh) = windowed_job(ws.path(), "fresh", &input);
    let done = backfill(&fresh_job, &["--from", "earliest", "--to", "latest"]);
    assert!(done.contains("never committed a batch"), "{done}");
    let all = table_rows(&fresh).await;
    assert!(
        want.iter().all(|r| all.contains(r)),
        "every closed window is there"
    );
    let newest: Vec<&String> = all.iter().filter(|r| !want.contains(r)).collect();
    assert!(
        !newest.is_empty()
            && newest.iter().all(|r| ["10:01:10", "10:01:20", "10:01:30"]
                .iter()
                .any(|t| r.contains(t))),
        "the rest are the windows still open in the stream: {newest:?}"
    );
}

/// A late row the live job commits while a windowed backfill of its windows runs was not read
/// by the backfill (its offset is past what the backfill read), so the replacement must leave
/// it in the late table rather than delete it uncounted.
#[tokio::test(flavor = "multi_thread")]
async fn late_rows_committed_while_a_windowed_backfill_runs_stay_in_the_late_table() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 20, 5);
    let (job, out) = windowed_job(ws.path(), "live", &input);
    assert_ok(&run_sluice(&["run", &job], &[]));
    assert!(table_values(&late_table(&out), &[]).await.is_empty());

    // The backfill of files 4–5 (windows from 10:00:00 to 10:00:20) reads, then waits.
    let mut backfill = Background::start(
        &["backfill", &job, "--from", "0:4", "--to", "0:6"],
        &[("SLUICE_PAUSE_AT", "before_replacement:8000")],
        &ws.path().join("backfill.log"),
    );
    backfill.wait_for_log("pause point reached", 60);
    // Meanwhile an event of 10:00:05 arrives — late for the windows 09:59:40 … 10:00:00 — and
    // the live job commits it to the late table.
    std::fs::write(
        input.join("events-late.json"),
        r#"{"id":9001,"user_id":1,"code":"1","amount":1.5,"ts":"2026-11-01T10:00:05Z"}"#
            .to_string()
            + "\n",
    )
    .unwrap();
    assert_ok(&run_sluice(&["run", &job], &[]));
    let late_ids = |rows: Vec<serde_json::Map<String, serde_json::Value>>| -> Vec<i64> {
        rows.iter().map(|r| r["id"].as_i64().unwrap()).collect()
    };
    assert_eq!(
        late_ids(table_values(&late_table(&out), &[]).await),
        vec![9001]
    );

    let (status, log) = backfill.finish();
    assert!(status.success(), "{log}");
    assert_eq!(
        late_ids(table_values(&late_table(&out), &[]).await),
        vec![9001],
        "the backfill deleted a late row it never read"
    );
}
