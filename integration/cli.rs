//! The command line as a user meets it: the bundled example, `validate`, and clear errors for
//! bad job files.

use std::path::Path;

use crate::support::*;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_bundled_example_runs_and_reports_its_table() {
    let ws = tempfile::tempdir().unwrap();
    let examples = repo_root().join("examples");
    copy_dir(&examples.join("data"), &ws.path().join("data"));
    std::fs::copy(examples.join("clicks.toml"), ws.path().join("clicks.toml")).unwrap();
    let out = run_sluice(
        &["run", ws.path().join("clicks.toml").to_str().unwrap()],
        &[],
    );
    assert_ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let table = ws.path().join("out/clicks_clean");
    let rows = table_rows(&table).await.len();
    assert!(rows > 0);
    assert!(
        stdout.contains(&format!("table {}/ holds {rows} rows", table.display())),
        "{stdout}"
    );
    // `sluice status` reads the job's progress back from the table.
    let status = status_of(&table);
    assert!(status.contains(&format!("{rows} rows")), "{status}");
    assert!(
        status.contains("job clicks_clean: last committed batch 2"),
        "{status}"
    );
    assert!(
        status.contains(r#"end offsets: {"clicks":{"0":6}}"#),
        "{status}"
    );

    // The deduplicating example: one row per (user, page) of the same clicks.
    std::fs::copy(
        examples.join("pages_per_user.toml"),
        ws.path().join("pages_per_user.toml"),
    )
    .unwrap();
    let dedup = run_sluice(
        &[
            "run",
            ws.path().join("pages_per_user.toml").to_str().unwrap(),
        ],
        &[],
    );
    assert_ok(&dedup);
    let pairs = table_values(&ws.path().join("out/pages_per_user"), &[]).await;
    let distinct: std::collections::BTreeSet<String> = table_values(&table, &[])
        .await
        .iter()
        .map(|r| format!("{}{}", r["user_id"], r["page"]))
        .collect();
    let kept: std::collections::BTreeSet<String> = pairs
        .iter()
        .map(|r| format!("{}{}", r["user_id"], r["page"]))
        .collect();
    assert_eq!(kept.len(), pairs.len(), "each pair once");
    // clicks_clean leaves out /signup; otherwise the same clicks.
    let kept_but_signup: std::collections::BTreeSet<String> = kept
        .into_iter()
        .filter(|k| !k.ends_with("\"/signup\""))
        .collect();
    assert_eq!(kept_but_signup, distinct);

    // Every batch logs one structured line.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let batch_lines = stderr
        .lines()
        .filter(|l| l.contains("batch committed"))
        .count();
    assert!(batch_lines >= 3, "{stderr}");
    for field in [
        "batch_id=",
        "ranges=",
        "rows_in=",
        "rows_out=",
        "rows_dead_lettered=",
        "commit_ms=",
    ] {
        assert!(stderr.contains(field), "missing {field} in:\n{stderr}");
    }
}

#[test]
fn validate_prints_the_plan_and_writes_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 2, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "validate_me", &input, &out, 5);
    let run = run_sluice(&["validate", job.to_str().unwrap()], &[]);
    assert_ok(&run);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("job validate_me is valid"), "{stdout}");
    assert!(stdout.contains("Projection"), "{stdout}");
    assert!(stdout.contains("_source_offset"), "{stdout}");
    assert!(stdout.contains("state: none (stateless"), "{stdout}");
    assert!(!out.exists(), "validate must not write");

    // A windowed job: its operator, state key and purge rule.
    let windowed = crate::support::repo_root().join("examples/clicks_per_minute.toml");
    let run = run_sluice(&["validate", windowed.to_str().unwrap()], &[]);
    assert_ok(&run);
    let stdout = String::from_utf8_lossy(&run.stdout);
    for line in [
        "0-aggregate  windowed aggregate over tumble(1m, clicks.ts)",
        "state key: window_start, window_end, page",
        "purge: a window leaves when the watermark reaches its end + allowed lateness (30s)",
        "emits: each window once, when it closes",
    ] {
        assert!(stdout.contains(line), "missing `{line}` in:\n{stdout}");
    }
}

#[test]
fn bad_job_files_get_errors_naming_the_problem() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 1, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "bad", &input, &out, 5);
    let good = std::fs::read_to_string(&job).unwrap();
    let cases = [
        (
            good.replace("max_files_per_batch", "max_file_per_batch"),
            "max_file_per_batch",
        ),
        (good.replace("kind = \"files\"", "kind = \"ftp\""), "ftp"),
        (
            good.replace("CAST(code AS INT)", "CAST(nope AS INT)"),
            "nope",
        ),
        (
            good.replace("SELECT id,", "SELECT DISTINCT id,"),
            "SELECT DISTINCT id, user_id, code",
        ),
        (
            good.replace("SELECT id,", "SELECT DISTINCT id,"),
            "set state_ttl",
        ),
        (
            // A self-join of the stream with no time bound and no state_ttl.
            good.replace(
                "FROM events\nWHERE user_id <> 3",
                "FROM events JOIN events e2 USING (id)\nWHERE events.user_id <> 3",
            )
            .replace("SELECT id, user_id,", "SELECT id, events.user_id,")
            .replace("amount * 2", "events.amount * 2")
            .replace("CAST(code AS INT)", "CAST(events.code AS INT)")
            .replace("date_trunc('minute', ts) AS minute, ts", "e2.ts"),
            "set state_ttl in [query]",
        ),
        (
            good.replace("event_time = \"ts\"", "event_time = \"when\""),
            "'when'",
        ),
        (
            good.replace("mode = \"available-now\"", "mode = \"sometimes\""),
            "sometimes",
        ),
        (
            good.replace(&input.display().to_string(), "/no/such/dir"),
            "/no/such/dir",
        ),
        (
            good.replace("[job]", "[job]\nidd = 1"),
            "unknown field `idd`",
        ),
        (
            good.replace("max_files_per_batch = 5", "max_files_per_batch = -1"),
            "max_files_per_batch",
        ),
        (
            good.replace("max_files_per_batch = 5", "max_files_per_batch = 0"),
            "max_files_per_batch = 0",
        ),
        (
            good.replace(
                "max_out_of_orderness = \"2s\"",
                "max_out_of_orderness = \"soon\"",
            ),
            "max_out_of_orderness 'soon'",
        ),
        (
            good.replace(
                "max_out_of_orderness = \"2s\"",
                "max_out_of_orderness = \"2s\"\nmax_event_time_skew = \"a fortnight\"",
            ),
            "max_event_time_skew",
        ),
        (
            good.replace(
                "mode = \"available-now\"",
                "mode = \"interval\"\ninterval = \"-5s\"",
            ),
            "interval '-5s'",
        ),
        (
            good.replace("[query]", "[query]\nallowed_lateness = 3"),
            "allowed_lateness",
        ),
        (good.replace("path = ", "pathh = "), "pathh"),
        (good.replace("id = \"bad\"", "id = \"bad"), "line 3"),
        (good.replace("[query]", "[queries]"), "queries"),
        (
            good.replace("kind = \"delta\"", "kind = \"delta\"\nmode = \"upsert\""),
            "'upsert'",
        ),
    ];
    for (text, needle) in cases {
        std::fs::write(&job, &text).unwrap();
        for command in ["validate", "run"] {
            let run = run_sluice(&[command, job.to_str().unwrap()], &[]);
            assert!(!run.status.success(), "expected failure for {needle}");
            let stderr = String::from_utf8_lossy(&run.stderr);
            assert!(
                stderr.contains(needle),
                "error for {needle} does not name it:\n{stderr}"
            );
            // One line, the error, no panic.
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            assert!(
                lines.len() == 1 && lines[0].starts_with("error: "),
                "{command} for {needle} should print one error line:\n{stderr}"
            );
        }
    }
}

/// `validate` checks a Kafka source by asking the broker; an unreachable one fails within
/// seconds, naming it (a running job would wait for it, as a broker restart is normal).
#[test]
fn validate_fails_fast_on_an_unreachable_broker() {
    let ws = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let job = ws.path().join("kafka.toml");
    std::fs::write(
        &job,
        format!(
            r#"
[job]
id = "unreachable"

[sources.clicks]
kind = "kafka"
bootstrap_servers = "127.0.0.1:{port}"
topic = "clicks"
schema = "id BIGINT"

[sink]
kind = "delta"
path = "out"

[query]
sql = "SELECT id FROM clicks"
"#
        ),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let run = run_sluice(&["validate", job.to_str().unwrap()], &[]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "validate waited {:?}",
        started.elapsed()
    );
    let last = stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: ") && last.contains(&format!("127.0.0.1:{port}")),
        "{stderr}"
    );
}
