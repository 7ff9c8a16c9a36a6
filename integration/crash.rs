//! The crash test: SIGKILL at 28 moments (named crash points and random times), restart each
//! time, and the final table must equal an uninterrupted run's — no row lost, none duplicated,
//! txn versions contiguous.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use crate::object_storage::pairs;
use crate::s3_server::S3Server;
use crate::support::*;

const LINES_PER_FILE: usize = 5;
const FIRST_FILES: usize = 220;
const LATER_FILES: usize = 20;
const MAX_FILES_PER_BATCH: usize = 2;
/// SIGKILLs at random moments, on top of the eight at named crash points.
const RANDOM_KILLS: usize = 20;

/// Batches whose files hold at least one bad line (so their dead-letter commit is real).
fn batches_with_dead_letters(events: &Events) -> Vec<i64> {
    let mut batches: Vec<i64> = events
        .lines
        .iter()
        .filter(|(_, _, k)| *k != LineKind::Good)
        .map(|(file, _, _)| (*file / MAX_FILES_PER_BATCH) as i64)
        .collect();
    batches.dedup();
    batches
}

/// Runs the job until killed by the armed crash point; asserts it died by SIGKILL.
fn run_until_crash(job: &str, env: &[(&str, &str)], point: &str, batch: i64) {
    let crash_at = format!("{point}:{batch}");
    let mut env = env.to_vec();
    env.push(("SLUICE_CRASH_AT", &crash_at));
    let out = run_sluice(&["run", job], &env);
    assert_eq!(
        out.status.signal(),
        Some(SIGKILL),
        "expected a SIGKILL at {point}:{batch}, got {}; stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The signal number of SIGKILL on Linux.
const SIGKILL: i32 = 9;

/// Starts the job and SIGKILLs it after `delay`; returns whether it was killed (false if it
/// had already finished).
fn run_and_kill_after(job: &str, env: &[(&str, &str)], delay: Duration) -> bool {
    let mut child = sluice_command()
        .args(["run", job])
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let finished = child.try_wait().unwrap();
    if let Some(status) = finished {
        assert!(status.success(), "run failed on its own: {status}");
        return false;
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    status.signal() == Some(SIGKILL)
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_any_step_loses_and_duplicates_nothing() {
    crash_test(STATELESS_SQL, RANDOM_KILLS, Place::Local, true).await;
}

/// The same for a windowed job: its state files, watermark and emitted windows survive every
/// kill, so the windows equal an uninterrupted run's.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_any_step_of_a_windowed_job_gives_identical_windows() {
    crash_test(WINDOWED_SQL, RANDOM_KILLS, Place::Local, false).await;
}

/// Tumbling windows and sessions under fewer random kills (the named crash points are the same).
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_any_step_of_tumbling_and_session_jobs_gives_identical_output() {
    crash_test(TUMBLING_SQL, 6, Place::Local, false).await;
    crash_test(SESSION_SQL, 6, Place::Local, false).await;
}

/// The crash test with the input, the tables and the checkpoint on an S3 server (the stateless
/// and the windowed job; fewer random kills, each restart taking over the lease after 1 s).
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_at_any_step_with_everything_on_s3_loses_and_duplicates_nothing() {
    let server = S3Server::start(&["landing", "lake"]);
    crash_test(STATELESS_SQL, 8, Place::S3(&server), true).await;
    crash_test(WINDOWED_SQL, 4, Place::S3(&server), false).await;
}

/// Where the crash test's input, tables and checkpoint live.
enum Place<'a> {
    /// Local folders.
    Local,
    /// `s3://landing/<n>` and `s3://lake/<n>` on this server.
    S3(&'a S3Server),
}

/// Tumbling 20 s windows, several aggregates.
const TUMBLING_SQL: &str = "SELECT window_start, window_end, user_id % 4 AS bucket, count(*) AS n, \
     min(amount) AS lo, stddev(amount) AS sd, count(DISTINCT user_id) AS users \
     FROM tumble(events, ts, INTERVAL '20' SECOND) GROUP BY window_start, window_end, user_id % 4";

/// Sessions of 20 s per user (a user's events are 17 s apart, so they chain into long
/// sessions until a bad line breaks the rhythm).
const SESSION_SQL: &str = "SELECT window_start, window_end, user_id, count(*) AS n, sum(amount) AS total \
     FROM session(events, ts, INTERVAL '20' SECOND) GROUP BY window_start, window_end, user_id";

/// With `compact`, the job compacts after every batch (`min_files = 2`), and two more named
/// crash points fall before and after a compaction.
async fn crash_test(sql: &str, random_kills_wanted: usize, place: Place<'_>, compact: bool) {
    let windowed = sql != STATELESS_SQL;
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    // Fewer files on S3, where each request goes through moto.
    let (first_files, later_files) = match place {
        Place::Local => (FIRST_FILES, LATER_FILES),
        Place::S3(_) => (FIRST_FILES / 3, LATER_FILES / 2),
    };
    let mut events = Events::write(&input, 0, first_files, LINES_PER_FILE);
    let crashed = ws.path().join("crashed");
    // Each run's own folder in the buckets, so two runs on one server never meet.
    let run = ws.path().file_name().unwrap().to_string_lossy().to_string();
    let (input_at, crashed_at, env) = match place {
        Place::Local => (
            input.display().to_string(),
            crashed.display().to_string(),
            Vec::new(),
        ),
        Place::S3(server) => {
            server.upload(&input, "landing", &run).await;
            let mut env = server.env();
            env.push(("SLUICE_LEASE_TIMEOUT_MS", "1000".into()));
            (
                format!("s3://landing/{run}"),
                format!("s3://lake/{run}/crashed"),
                env,
            )
        }
    };
    let env = pairs(&env);
    let write = |toml: &str, input: &str, out: &str| {
        write_job_at(
            &ws.path().join(toml),
            "crash_test",
            input,
            out,
            MAX_FILES_PER_BATCH,
            sql,
            "",
        )
    };
    let job = write("crashed.toml", &input_at, &crashed_at);
    if compact {
        let text = std::fs::read_to_string(&job).unwrap().replace(
            "[sink]\nkind = \"delta\"\n",
            "[sink]\nkind = \"delta\"\ncompaction = { min_files = 2 }\n",
        );
        std::fs::write(&job, text).unwrap();
    }
    let job = job.to_str().unwrap();

    // 1. Named crash points, including between the side-table and output commits and right
    //    after the output commit, on batches that do write dead letters.
    let dl = batches_with_dead_letters(&events);
    let pick = |min: i64| *dl.iter().find(|b| **b >= min).unwrap();
    let b1 = pick(3);
    let b2 = pick(b1 + 2);
    let b3 = pick(b2 + 2);
    let points = [
        ("after_intent", 0),
        (
            if windowed {
                "after_state"
            } else {
                "after_intent"
            },
            1,
        ),
        ("after_manifest", 2),
        ("after_side_tables", b1),
        ("after_commit", b1 + 1),
        ("after_side_tables", b2),
        ("after_intent", b2 + 1),
        ("after_commit", b3),
        ("after_manifest", b3 + 1),
    ];
    let compaction_points = [("before_compaction", b3 + 3), ("after_compaction", b3 + 5)];
    let compaction_points = if compact { &compaction_points[..] } else { &[] };
    let mut kills = 0;
    for (point, batch) in points.into_iter().chain(compaction_points.iter().copied()) {
        run_until_crash(job, &env, point, batch);
        kills += 1;
    }

    // 2. New files arrive mid-run; they join later batches.
    events
        .lines
        .extend(Events::write(&input, first_files, later_files, LINES_PER_FILE).lines);
    if let Place::S3(server) = place {
        server.upload(&input, "landing", &run).await;
    }

    // 3. SIGKILL at random moments.
    let seed = std::env::var("SLUICE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1234_u64);
    let mut rng = Rng(seed);
    let mut random_kills = 0;
    for _ in 0..60 {
        if random_kills >= random_kills_wanted {
            break;
        }
        let delay = Duration::from_millis(150 + rng.next() % 450);
        if run_and_kill_after(job, &env, delay) {
            random_kills += 1;
        } else {
            break;
        }
    }
    kills += random_kills;
    assert!(
        random_kills >= random_kills_wanted,
        "only {random_kills} random kills landed (seed {seed}); the job finished too soon"
    );

    // 4. Restart to completion.
    assert_ok(&run_sluice(&["run", job], &env));
    if let Place::S3(server) = place {
        // Checked with the local readers, on a copy of what the job wrote to the store.
        server
            .download("lake", &format!("{run}/crashed"), &crashed)
            .await;
        server
            .download(
                "lake",
                &format!("{run}/crashed_dead_letter"),
                &dead_letter_table(&crashed),
            )
            .await;
    }

    // The same job, uninterrupted, over the same files.
    let reference = ws.path().join("reference");
    let ref_job = write(
        "ref.toml",
        &input.display().to_string(),
        &reference.display().to_string(),
    );
    assert_ok(&run_sluice(&["run", ref_job.to_str().unwrap()], &[]));

    // Same multiset of output rows, every expected row exactly once.
    let got = table_rows(&crashed).await;
    let want = table_rows(&reference).await;
    assert_eq!(got.len(), want.len(), "row counts differ (seed {seed})");
    // Floating-point aggregates (stddev) merged across different batch boundaries may differ
    // in the last bits: equal within 1e-9 relative, like reconcile.
    let differing: Vec<(&String, &String)> = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| !rows_close(g, w))
        .collect();
    assert!(
        differing.is_empty(),
        "crashed run differs from the uninterrupted run (seed {seed}): {differing:?}"
    );
    if sql == WINDOWED_SQL {
        // Every good line kept by the WHERE is counted once, in each of its 3 windows — except
        // the newest windows, still open when the input ends.
        let counted: i64 = table_values(&crashed, &[])
            .await
            .iter()
            .map(|r| r["n"].as_i64().unwrap())
            .sum();
        let poison = events
            .lines
            .iter()
            .filter(|(_, _, k)| *k == LineKind::Poison)
            .count();
        let kept = events.output_ids().len();
        assert!(
            counted <= 3 * kept as i64 && counted >= 3 * (kept as i64 - 40),
            "{counted} counted rows for {kept} kept lines ({poison} poison)"
        );
    }
    let mut ids: BTreeMap<i64, usize> = BTreeMap::new();
    let rows = if windowed {
        vec![]
    } else {
        table_values(&crashed, &[]).await
    };
    for row in rows {
        *ids.entry(row["id"].as_i64().unwrap()).or_default() += 1;
    }
    assert!(
        ids.values().all(|n| *n == 1),
        "duplicated ids: {:?}",
        ids.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
    );
    if !windowed {
        assert_eq!(
            ids.keys()
                .copied()
                .collect::<std::collections::BTreeSet<_>>(),
            events.output_ids(),
            "lost or unexpected ids"
        );
    }

    // Dead letters: the same, once each (batch ids aside, which depend on batch boundaries).
    let got_dl = table_values(&dead_letter_table(&crashed), &["batch_id"]).await;
    let want_dl = table_values(&dead_letter_table(&reference), &["batch_id"]).await;
    // Poison lines fail only in queries that CAST their code.
    let poison = events
        .lines
        .iter()
        .filter(|(_, _, k)| *k == LineKind::Poison)
        .count();
    let bad = if sql.contains("CAST(code") {
        events.bad_count()
    } else {
        events.bad_count() - poison
    };
    assert_eq!(got_dl.len(), bad, "dead letters lost or duplicated");
    assert_eq!(got_dl, want_dl);

    // The txn versions of the output table are exactly 0, 1, 2, … — one commit per batch.
    let versions = txn_versions(&crashed, "crash_test");
    let expected: Vec<i64> = (0..versions.len() as i64).collect();
    assert_eq!(versions, expected, "txn versions are not contiguous");
    let batches = (first_files + later_files).div_ceil(MAX_FILES_PER_BATCH);
    assert!(
        versions.len() >= batches,
        "{} commits for {batches} batches",
        versions.len()
    );
    eprintln!(
        "crash test: {kills} kills ({random_kills} random, seed {seed}), {} batches, {} rows",
        versions.len(),
        got.len()
    );
}
