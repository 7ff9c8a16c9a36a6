//! Table maintenance: the Delta log's checkpoints and retention as the `[sink]` sets them, and
//! `sluice vacuum`, which deletes only what no snapshot within the retention needs and never
//! the job's checkpoint.

use std::time::{Duration, SystemTime};

use crate::support::*;

/// Every file under `dir`, relative, sorted.
fn tree(dir: &std::path::Path) -> Vec<String> {
    fn walk(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn log_settings_apply_and_vacuum_keeps_the_live_table_and_the_checkpoint() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 16, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "maint", &input, &out, 2);
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "[sink]\nkind = \"delta\"\n",
        "[sink]\nkind = \"delta\"\ncheckpoint_interval = 3\nlog_retention = \"2days\"\n",
    );
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));

    // A Delta checkpoint every 3 commits (versions 2, 5, 8: delta-rs counts commits, not
    // versions), and the retention in the table's configuration.
    let log: Vec<String> = tree(&out.join("_delta_log"));
    for version in [2, 5, 8] {
        let name = format!("{version:020}.checkpoint.parquet");
        assert!(log.contains(&name), "no {name} in {log:?}");
    }
    let metadata = delta_commits(&out)[0]
        .iter()
        .find_map(|a| a.get("metaData").cloned())
        .unwrap();
    assert_eq!(metadata["configuration"]["delta.checkpointInterval"], "3");
    assert_eq!(
        metadata["configuration"]["delta.logRetentionDuration"],
        "interval 172800 seconds"
    );

    // A data file no commit references (a batch that crashed before committing), written three
    // days ago, and one written now.
    let old_orphan = out.join("part-00000-crashed-old.snappy.parquet");
    let new_orphan = out.join("part-00000-crashed-new.snappy.parquet");
    for orphan in [&old_orphan, &new_orphan] {
        std::fs::write(orphan, b"not referenced").unwrap();
    }
    std::fs::File::options()
        .write(true)
        .open(&old_orphan)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(3 * 86_400))
        .unwrap();
    let rows = table_rows(&out).await;
    let checkpoint = tree(&out.join("_sluice"));
    assert!(!checkpoint.is_empty());

    let dry = run_sluice(
        &[
            "vacuum",
            out.to_str().unwrap(),
            "--retention",
            "2d",
            "--dry-run",
        ],
        &[],
    );
    assert_ok(&dry);
    let said = String::from_utf8_lossy(&dry.stdout).to_string();
    assert!(said.contains("would delete 1 file(s)"), "{said}");
    assert!(said.contains("crashed-old"), "{said}");
    assert!(old_orphan.exists(), "a dry run deleted");

    let vacuumed = run_sluice(&["vacuum", out.to_str().unwrap(), "--retention", "2d"], &[]);
    assert_ok(&vacuumed);
    assert!(
        !old_orphan.exists(),
        "the old unreferenced file is still there"
    );
    assert!(
        new_orphan.exists(),
        "a file younger than the retention was deleted"
    );
    assert_eq!(
        tree(&out.join("_sluice")),
        checkpoint,
        "vacuum touched the checkpoint"
    );
    assert_eq!(table_rows(&out).await, rows);
    assert_eq!(
        python_read(&out)["rows"].as_array().unwrap().len(),
        rows.len()
    );

    // Even a zero retention keeps what the latest snapshot references, and the job resumes.
    assert_ok(&run_sluice(
        &["vacuum", out.to_str().unwrap(), "--retention", "0s"],
        &[],
    ));
    assert!(!new_orphan.exists());
    assert_eq!(table_rows(&out).await, rows);
    let again = run_sluice(&["run", job], &[]);
    assert_ok(&again);
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 batch(es) committed"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
    let bad = run_sluice(
        &["vacuum", out.to_str().unwrap(), "--retention", "soon"],
        &[],
    );
    assert_fails_saying(&bad, &["'soon' is not a duration"]);
}
