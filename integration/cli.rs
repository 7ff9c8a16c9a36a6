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
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
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
    assert!(!out.exists(), "validate must not write");
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
            "needs state across batches",
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
    ];
    for (text, needle) in cases {
        std::fs::write(&job, &text).unwrap();
        let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
        assert!(!run.status.success(), "expected failure for {needle}");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            stderr.contains(needle),
            "error for {needle} does not name it:\n{stderr}"
        );
    }
}
