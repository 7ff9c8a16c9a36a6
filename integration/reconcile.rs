//! `sluice reconcile`: the streamed output of a period equals a batch recomputation of the same
//! events, and a corrupted or deleted output row is caught.

use crate::support::*;

const FROM: &str = "2026-11-01T10:00:30Z";
const TO: &str = "2026-11-01T10:01:10Z";

fn reconcile(job: &str) -> (bool, String, String) {
    let out = run_sluice(
        &["reconcile", job, "--from-time", FROM, "--to-time", TO],
        &[],
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_passes_on_the_streamed_output_and_catches_a_corrupted_or_lost_row() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    // 20 files × 5 lines: event times 10:00:00 … 10:01:39, bad lines of every kind mixed in.
    let events = Events::write(&input, 0, 20, 5);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "reconciled", &input, &out, 3);
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));

    // Lines 30..70 fall in the period; those the query keeps are in the output.
    let in_period = events
        .output_ids()
        .into_iter()
        .filter(|id| (31..=70).contains(id))
        .count();
    let (ok, stdout, stderr) = reconcile(job);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "matching {in_period}, missing 0, extra 0, different 0"
        )),
        "{stdout}"
    );
    assert!(stdout.contains("the output reconciles"), "{stdout}");

    // Corrupt one row of the period by hand (line 45, id 46).
    let table = deltalake::open_table(url::Url::from_directory_path(&out).unwrap())
        .await
        .unwrap();
    let (table, _) = table
        .update()
        .with_predicate("id = 46")
        .with_update("double_amount", "double_amount + 1")
        .await
        .unwrap();
    let (ok, stdout, stderr) = reconcile(job);
    assert!(!ok);
    assert!(
        stdout.contains(&format!(
            "matching {}, missing 0, extra 0, different 1",
            in_period - 1
        )),
        "{stdout}"
    );
    assert!(stdout.contains("\"id\":46"), "{stdout}");
    assert!(
        stderr.contains("does not reconcile: 1 difference(s)"),
        "{stderr}"
    );

    // Lose another one.
    table.delete().with_predicate("id = 50").await.unwrap();
    let (ok, stdout, _) = reconcile(job);
    assert!(!ok);
    assert!(
        stdout.contains("missing 1, extra 0, different 1"),
        "{stdout}"
    );
}
