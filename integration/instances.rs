//! Two instances of one job: a cron overlap, a zombie after a restart, a paused machine. A
//! second `sluice run` of a live job is refused; a killed run's lease is taken over; a run
//! paused past its lease that wakes up after another took over stops without writing anything
//! the other needs; and under random kills and pauses of two instances the output stays exact.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;

/// How long a lease lives unrenewed in these tests (10 s by default).
const LEASE_TIMEOUT_MS: &str = "1000";

/// The ways a run of a job may legitimately stop because of another instance.
const TWIN_EXITS: [&str; 3] = [
    "is already running",
    "another instance committed batch",
    "lost its lease",
];

fn interval_job(path: &Path, job_id: &str, input: &Path, out: &Path, sql: &str) -> String {
    let job = write_job_with(path, job_id, input, out, 2, sql, "");
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "mode = \"available-now\"",
        "mode = \"interval\"\ninterval = \"100ms\"",
    );
    std::fs::write(&job, text).unwrap();
    job.to_str().unwrap().to_string()
}

/// The same job run once, uninterrupted, into its own table.
async fn reference(ws: &Path, input: &Path, sql: &str) -> (Vec<String>, Vec<String>) {
    let out = ws.join("reference");
    let job = write_job_with(
        &ws.join("reference.toml"),
        "reference",
        input,
        &out,
        2,
        sql,
        "",
    );
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    (table_rows(&out).await, dead_letter_rows(&out).await)
}

async fn dead_letter_rows(out: &Path) -> Vec<String> {
    table_values(&dead_letter_table(out), &["batch_id"])
        .await
        .into_iter()
        .map(|r| serde_json::Value::Object(r).to_string())
        .collect()
}

/// The table equals the reference's (floats within 1e-9), dead letters too, and its txn
/// versions are 0, 1, 2, … — one commit per batch.
async fn assert_exact(out: &Path, job_id: &str, want: &(Vec<String>, Vec<String>)) {
    assert_rows_close(&table_rows(out).await, &want.0);
    assert_eq!(dead_letter_rows(out).await, want.1, "dead letters differ");
    let versions = txn_versions(out, job_id);
    let expected: Vec<i64> = (0..versions.len() as i64).collect();
    assert_eq!(versions, expected, "txn versions are not contiguous");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_run_of_a_live_job_is_refused_and_a_killed_runs_lease_is_taken_over() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 30, 5);
    let out = ws.path().join("out");
    let job = interval_job(
        &ws.path().join("job.toml"),
        "twice",
        &input,
        &out,
        STATELESS_SQL,
    );
    let env = [("SLUICE_LEASE_TIMEOUT_MS", LEASE_TIMEOUT_MS)];
    let mut first = Background::start(&["run", &job], &env, &ws.path().join("first.log"));
    first.wait_for_log("batch committed", 60);

    // A second run while the first is alive: refused at once, naming the holder.
    let started = Instant::now();
    let second = run_sluice(&["run", &job], &env);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(
        stderr.contains("job 'twice' is already running"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {}", first.child.id())),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));

    // Killed, the first run stops renewing; the next run waits for the lease and takes over.
    first.signal("KILL");
    let (status, _) = first.finish();
    assert_eq!(status.signal(), Some(9));
    let third = run_sluice(&["run", &job, "--trigger", "available-now"], &env);
    assert_ok(&third);
    let stderr = String::from_utf8_lossy(&third.stderr);
    assert!(stderr.contains("taking over the lease"), "{stderr}");
    let ids: Vec<i64> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), events.output_ids().len(), "rows lost or doubled");
}

/// A run paused inside its output commit (a VM frozen mid-batch) past its lease: another run
/// takes over and finishes the job; when the first wakes up, it finds the batch committed by
/// the other, and stops — without collecting the other's state files as garbage.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_twin_that_lost_the_race_stops_without_touching_the_new_runs_state() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 40, 5);
    let want = reference(ws.path(), &input, WINDOWED_SQL).await;
    let out = ws.path().join("out");
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "paused",
        &input,
        &out,
        2,
        WINDOWED_SQL,
        "",
    );
    let job = job.to_str().unwrap();
    let mut paused = Background::start(
        &["run", job],
        &[
            ("SLUICE_LEASE_TIMEOUT_MS", LEASE_TIMEOUT_MS),
            ("SLUICE_PAUSE_AT", "before_output_commit:3:3000"),
        ],
        &ws.path().join("paused.log"),
    );
    paused.wait_for_log("pause point reached", 60);
    paused.signal("STOP");

    let takeover = run_sluice(
        &["run", job],
        &[("SLUICE_LEASE_TIMEOUT_MS", LEASE_TIMEOUT_MS)],
    );
    assert_ok(&takeover);

    paused.signal("CONT");
    let (status, log) = paused.finish();
    assert!(!status.success(), "the paused run went on: {log}");
    assert!(
        log.contains("another instance committed batch") || log.contains("lost its lease"),
        "{log}"
    );
    // The job restarts cleanly from the other run's state, and the output is exact.
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_exact(&out, "paused", &want).await;
}

/// A run paused before planning a batch, resuming after another run took over and went far
/// ahead (the batch's folder long purged), must not plan that batch again: it would write an
/// intent, state files and a manifest for a batch the other run committed differently.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_run_resuming_after_a_takeover_plans_and_writes_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 60, 5);
    let want = reference(ws.path(), &input, WINDOWED_SQL).await;
    let out = ws.path().join("out");
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "resumed",
        &input,
        &out,
        2,
        WINDOWED_SQL,
        "",
    );
    let job = job.to_str().unwrap();
    let mut paused = Background::start(
        &["run", job],
        &[
            ("SLUICE_LEASE_TIMEOUT_MS", LEASE_TIMEOUT_MS),
            ("SLUICE_PAUSE_AT", "before_plan:3:3000"),
        ],
        &ws.path().join("paused.log"),
    );
    paused.wait_for_log("pause point reached", 60);
    paused.signal("STOP");
    let takeover = run_sluice(
        &["run", job],
        &[("SLUICE_LEASE_TIMEOUT_MS", LEASE_TIMEOUT_MS)],
    );
    assert_ok(&takeover);
    let batch_3 = out.join("_sluice/resumed/batches/3/intent.json");
    assert!(
        !batch_3.exists(),
        "batch 3's intent should be purged by now: {}\n{}",
        String::from_utf8_lossy(&takeover.stderr),
        paused.log_text()
    );

    paused.signal("CONT");
    let (status, log) = paused.finish();
    assert!(!status.success(), "the paused run went on: {log}");
    assert!(log.contains("lost its lease"), "{log}");
    assert!(
        !batch_3.exists(),
        "the resumed run planned batch 3 again: {log}"
    );
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_exact(&out, "resumed", &want).await;
}

/// Two processes of one windowed job on an interval trigger, one of them SIGKILLed at random
/// every ~0.5 s (and now and then one frozen past its lease, then woken) for 40 s, files
/// arriving meanwhile; then a final run. Every closed window is exact and written once, dead
/// letters once, and the job restarts cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn two_instances_killed_and_paused_at_random_leave_every_window_exact_and_once() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 150, 5);
    let out = ws.path().join("out");
    let job = interval_job(
        &ws.path().join("job.toml"),
        "chaos",
        &input,
        &out,
        WINDOWED_SQL,
    );
    let env = [("SLUICE_LEASE_TIMEOUT_MS", "1500")];
    let seed = std::env::var("SLUICE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7e1e_c0de_u64);
    let mut rng = Rng(seed);
    let mut slots: [Option<Background>; 2] = [None, None];
    let mut spawned = 0;
    let (mut kills, mut pauses, mut twin_exits) = (0, 0, 0);
    let mut frozen: Option<(usize, Instant)> = None;
    let mut more_files = false;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(40) {
        // Restart whatever is not running; a run that stopped by itself must have stopped
        // because of its twin, never because of a corrupt checkpoint.
        for slot in slots.iter_mut() {
            let ended = slot
                .as_mut()
                .is_some_and(|b| b.child.try_wait().unwrap().is_some());
            if ended {
                let (status, log) = slot.take().unwrap().finish();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                assert!(
                    TWIN_EXITS.iter().any(|m| log.contains(m)),
                    "a run stopped by itself ({status}, seed {seed}): {last}\n{log}"
                );
                twin_exits += 1;
            }
            if slot.is_none() {
                spawned += 1;
                let log = ws.path().join(format!("run-{spawned}.log"));
                *slot = Some(Background::start(&["run", &job], &env, &log));
            }
        }
        std::thread::sleep(Duration::from_millis(400 + rng.next() % 200));
        if let Some((i, since)) = frozen
            && since.elapsed() > Duration::from_secs(2)
        {
            if let Some(b) = &slots[i] {
                b.signal("CONT");
            }
            frozen = None;
        }
        let i = (rng.next() % 2) as usize;
        if frozen.is_none() && rng.next().is_multiple_of(10) {
            // Freeze a run past its lease, as a paused VM: the other takes over meanwhile.
            if let Some(b) = &slots[i] {
                b.signal("STOP");
                frozen = Some((i, Instant::now()));
                pauses += 1;
            }
        } else if frozen.is_none_or(|(f, _)| f != i)
            && let Some(b) = slots[i].take()
        {
            b.signal("KILL");
            b.finish();
            kills += 1;
        }
        if !more_files && started.elapsed() > Duration::from_secs(20) {
            Events::write(&input, 150, 30, 5);
            more_files = true;
        }
    }
    for b in slots.into_iter().flatten() {
        b.signal("CONT");
        b.signal("KILL");
        b.finish();
    }
    // The job restarts cleanly and finishes what is left.
    assert_ok(&run_sluice(
        &["run", &job, "--trigger", "available-now"],
        &env,
    ));
    let want = reference(ws.path(), &input, WINDOWED_SQL).await;
    assert_exact(&out, "chaos", &want).await;
    eprintln!(
        "two instances: {kills} kills, {pauses} pauses, {twin_exits} runs stopped by their twin, \
         {spawned} runs, {} batches (seed {seed})",
        txn_versions(&out, "chaos").len()
    );
}
