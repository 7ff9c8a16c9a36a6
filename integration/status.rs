//! Operating a running job: `sluice run --metrics-addr` serves exact Prometheus metrics, the
//! progress records, a health check that notices a stalled driver, and a status page whose
//! charts a real headless Chromium draws.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;

/// The value of the sample `series` (name and labels exactly as exported) in `metrics`.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in\n{metrics}"))
        .parse()
        .unwrap()
}

/// Polls until `done` holds (panics after `secs`).
fn wait_until(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The address a `sluice run` logged it serves on.
fn served_address(job: &mut Background) -> String {
    job.wait_for_log("serving metrics on http://", 60);
    served_address_in(&job.log_text()).unwrap()
}

fn interval_job(dir: &Path, input: &Path, out: &Path) -> String {
    let job = write_job(&dir.join("job.toml"), "watched", input, out, 2);
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "mode = \"available-now\"",
        "mode = \"interval\"\ninterval = \"200ms\"",
    );
    std::fs::write(&job, text).unwrap();
    job.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_are_exact_and_health_notices_a_stalled_driver() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let out = ws.path().join("out");
    let events = Events::write(&input, 0, 6, 40);
    let job = interval_job(ws.path(), &input, &out);
    // Batch 3's planning waits 4 s at every pass: the driver stalls there until it commits.
    let mut run = Background::start(
        &["run", &job, "--metrics-addr", "127.0.0.1:0"],
        &[("SLUICE_PAUSE_AT", "before_plan:3:4000")],
        &ws.path().join("run.log"),
    );
    let addr = served_address(&mut run);

    // Every family from the first scrape.
    let (status, metrics) = http_get(&addr, "/metrics");
    assert_eq!(status, 200);
    for family in [
        "sluice_batches_committed_total",
        "sluice_rows_in_total",
        "sluice_rows_out_total",
        "sluice_rows_dead_lettered_total",
        "sluice_rows_late_total",
        "sluice_rows_duplicate_total",
        "sluice_batch_duration_seconds",
        "sluice_batch_phase_seconds",
        "sluice_watermark_lag_seconds",
        "sluice_source_lag",
        "sluice_last_committed_batch",
        "sluice_state_rows",
        "sluice_state_bytes",
        "sluice_table_version",
        "sluice_commit_conflicts_total",
    ] {
        assert!(
            metrics.contains(&format!("# TYPE {family} ")),
            "{family} missing from the first scrape:\n{metrics}"
        );
    }

    // Three batches of two files each.
    wait_until(60, "batch 2 committed", || {
        sample(
            &http_get(&addr, "/metrics").1,
            "sluice_last_committed_batch{job=\"watched\"}",
        ) == 2.0
    });
    let metrics = http_get(&addr, "/metrics").1;
    let output_rows = table_rows(&out).await.len() as f64;
    let dead_letters = dead_letter_rows(&out).len() as f64;
    assert_eq!(dead_letters, events.bad_count() as f64);
    // Rows read: every line that decoded with an event time (poison lines decode, then fail
    // the query and are dead-lettered there).
    let decoded = events
        .lines
        .iter()
        .filter(|(_, _, k)| matches!(k, LineKind::Good | LineKind::Poison))
        .count() as f64;
    for (series, want) in [
        ("sluice_batches_committed_total{job=\"watched\"}", 3.0),
        (
            "sluice_rows_in_total{job=\"watched\",source=\"events\"}",
            decoded,
        ),
        ("sluice_rows_out_total{job=\"watched\"}", output_rows),
        (
            "sluice_rows_dead_lettered_total{job=\"watched\"}",
            dead_letters,
        ),
        ("sluice_rows_late_total{job=\"watched\"}", 0.0),
        ("sluice_batch_duration_seconds_count{job=\"watched\"}", 3.0),
        (
            "sluice_batch_phase_seconds_count{job=\"watched\",phase=\"commit\"}",
            3.0,
        ),
        ("sluice_commit_conflicts_total{job=\"watched\"}", 0.0),
        (
            "sluice_source_lag{job=\"watched\",source=\"events\",partition=\"0\"}",
            0.0,
        ),
    ] {
        assert_eq!(sample(&metrics, series), want, "{series}\n{metrics}");
    }
    let version = sample(&metrics, "sluice_table_version{job=\"watched\"}");
    assert!(version >= 3.0, "table version {version}");

    let (status, body) = http_get(&addr, "/api/progress");
    assert_eq!(status, 200);
    let batches: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
    assert_eq!(
        batches
            .iter()
            .map(|b| b["batch_id"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let out_sum: u64 = batches
        .iter()
        .map(|b| b["rows_out"].as_u64().unwrap())
        .sum();
    assert_eq!(out_sum as f64, output_rows);
    for key in [
        "started_at",
        "committed_at",
        "duration_ms",
        "phase_ms",
        "input_rows_per_second",
        "processed_rows_per_second",
        "watermark",
        "watermark_lag_seconds",
        "lag",
        "state_rows",
        "state_bytes",
        "table_version",
    ] {
        assert!(
            batches[2].get(key).is_some(),
            "{key} missing: {}",
            batches[2]
        );
    }

    // The driver now waits at batch 3's planning: no plan or commit for longer than three
    // intervals makes /healthz say so.
    wait_until(20, "/healthz 503 while the driver is stalled", || {
        http_get(&addr, "/healthz").0 == 503
    });
    let (_, reason) = http_get(&addr, "/healthz");
    assert!(reason.contains("no batch planned or committed"), "{reason}");
    // New files: batch 3 commits after the pause, and the driver moves on.
    Events::write(&input, 6, 2, 40);
    wait_until(30, "batch 3 committed and /healthz 200 again", || {
        sample(
            &http_get(&addr, "/metrics").1,
            "sluice_last_committed_batch{job=\"watched\"}",
        ) == 3.0
            && http_get(&addr, "/healthz").0 == 200
    });

    run.signal("TERM");
    let (status, log) = run.finish();
    assert!(status.success(), "{log}");

    // The same facts for scripts, from the table alone.
    let status = run_sluice(&["status", out.to_str().unwrap(), "--json"], &[]);
    assert_ok(&status);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["rows"], table_rows(&out).await.len());
    assert_eq!(status["jobs"][0]["job_id"], "watched");
    assert_eq!(status["jobs"][0]["last_batch"], 3);
    assert_eq!(
        status["jobs"][0]["manifest"]["end_offsets"]["events"]["0"],
        8
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_status_page_draws_its_charts_in_headless_chromium() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let out = ws.path().join("out");
    Events::write(&input, 0, 8, 40);
    let job = interval_job(ws.path(), &input, &out);
    let mut run = Background::start(
        &["run", &job, "--metrics-addr", "127.0.0.1:0"],
        &[],
        &ws.path().join("run.log"),
    );
    let addr = served_address(&mut run);
    wait_until(60, "batch 3 committed", || {
        http_get(&addr, "/api/progress")
            .1
            .contains("\"batch_id\":3")
    });

    let browse = |extra: &[&str]| {
        let profile = ws.path().join(format!("chromium-profile-{}", extra.len()));
        let out = std::process::Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=5000",
                "--window-size=1280,1300",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(extra)
            .arg(format!("http://{addr}/"))
            .output()
            .unwrap_or_else(|e| panic!("cannot start {chromium} (./test installs it): {e}"));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (dom, console) = browse(&["--dump-dom"]);
    // Every chart drew its series from /api/progress.
    for series in [
        "input rows/s",
        "processed rows/s",
        "read",
        "execute",
        "state",
        "commit",
        "wall clock − watermark",
        "events/0",
        "state rows",
        "dead-lettered",
        "late",
    ] {
        assert!(
            dom.contains(&format!("data-series=\"{series}\"")),
            "no line for '{series}' in the page:\n{dom}"
        );
    }
    assert!(dom.contains("<polyline"), "{dom}");
    assert!(dom.contains("Sluice job watched"), "{dom}");
    assert!(dom.contains(">healthy<"), "{dom}");
    let errors: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .filter(|l| !l.contains("favicon"))
        .collect();
    assert!(errors.is_empty(), "console errors: {errors:?}");

    let shot = ws.path().join("status.png");
    browse(&[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    if let Ok(keep) = std::env::var("SLUICE_STATUS_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }

    run.signal("TERM");
    let (status, log) = run.finish();
    assert!(status.success(), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn bounded_runs_report_offsets_read_of_their_target() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let out = ws.path().join("out");
    Events::write(&input, 0, 6, 40);
    let job = write_job(&ws.path().join("job.toml"), "bounded", &input, &out, 1);
    let job = job.to_str().unwrap();
    // Without a terminal: a line per period; batch 3's planning waits so one comes mid-run.
    let env = [
        ("SLUICE_PROGRESS_EVERY", "300ms"),
        ("SLUICE_PAUSE_AT", "before_plan:3:1500"),
    ];
    let run = run_sluice(&["run", job], &env);
    assert_ok(&run);
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(
        log.contains("available-now run: 3 of 6 offsets read"),
        "no progress line at the pause:\n{log}"
    );
    let backfill = run_sluice(
        &["backfill", job, "--from", "0:0", "--to", "0:6"],
        &[
            ("SLUICE_PROGRESS_EVERY", "300ms"),
            ("SLUICE_PAUSE_AT", "before_replacement:1500"),
        ],
    );
    assert_ok(&backfill);
    let log = String::from_utf8_lossy(&backfill.stderr);
    assert!(
        log.contains("backfill: 0 of 6 offsets read"),
        "no progress line before the backfill reads:\n{log}"
    );
    assert!(
        log.contains("backfill: 6 of 6 offsets read"),
        "no closing progress line:\n{log}"
    );
}
