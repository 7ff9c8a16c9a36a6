//! What a job refuses to write into: a side table (dead letters, late rows) that holds later
//! batches of the job than its output — left by an earlier run whose output was deleted — and
//! a table whose txns expire (`delta.setTransactionRetentionDuration`). Both would lose rows
//! silently; both stop the job with a message naming the table and what to do.

use deltalake::TableProperty;
use deltalake::kernel::{DataType, PrimitiveType};

use crate::support::*;

/// A user reprocesses by deleting the output folder (and with it the checkpoint) but not the
/// sibling dead-letter table: the rerun's batch ids start again at 0, which the old dead-letter
/// table already holds, and skipping "already committed" batches there would lose this run's
/// dead letters. The run stops instead, naming the table; once it is deleted too, everything
/// lands once.
#[tokio::test(flavor = "multi_thread")]
async fn a_side_table_left_by_an_earlier_run_stops_the_job_instead_of_swallowing_its_rows() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let first = Events::write(&input, 0, 10, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "again", &input, &out, 2);
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));
    let dead = dead_letter_table(&out);
    assert_eq!(table_values(&dead, &[]).await.len(), first.bad_count());

    // Reprocess: the output folder goes, the dead-letter table stays; new files arrive.
    std::fs::remove_dir_all(&out).unwrap();
    let second = Events::write(&input, 10, 10, 5);
    let rerun = run_sluice(&["run", job], &[]);
    let stderr = String::from_utf8_lossy(&rerun.stderr);
    assert!(!rerun.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the dead-letter table {} already holds batch",
            url::Url::from_directory_path(&dead).unwrap()
        )),
        "{stderr}"
    );
    assert!(stderr.contains("Delete it as well"), "{stderr}");
    assert_eq!(
        table_values(&dead, &[]).await.len(),
        first.bad_count(),
        "nothing may be written"
    );

    // As the message says: delete it too, and every dead letter of both sets of files lands.
    std::fs::remove_dir_all(&dead).unwrap();
    std::fs::remove_dir_all(&out).ok();
    assert_ok(&run_sluice(&["run", job], &[]));
    assert_eq!(
        table_values(&dead, &[]).await.len(),
        first.bad_count() + second.bad_count()
    );
}

/// An output table whose txns expire would make the job replay everything once the txn of its
/// last batch is gone: refused at start.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_with_expiring_txns_is_refused() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 2, 5);
    let out = ws.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let url = url::Url::from_directory_path(&out).unwrap();
    deltalake::DeltaTable::try_from_url(url)
        .await
        .unwrap()
        .create()
        .with_column("id", DataType::Primitive(PrimitiveType::Long), true, None)
        .with_configuration_property(
            TableProperty::SetTransactionRetentionDuration,
            Some("interval 7 days"),
        )
        .await
        .unwrap();
    let job = write_job(&ws.path().join("job.toml"), "expiring", &input, &out, 2);
    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        stderr.contains("sets delta.setTransactionRetentionDuration"),
        "{stderr}"
    );
    assert!(stderr.contains("unset the property"), "{stderr}");
}
