//! Golden cases as data: each `integration/golden/<case>/` is a job, its input and the
//! hand-checked output. Reconcile shares the engine's window, join and deduplication code, so
//! it cannot catch a bug both share; these cases can.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use serde_json::Value;

use crate::support::*;

/// A golden case: `integration/golden/<case>/` holds `job.toml` (paths relative to a work
/// folder: `input/`, `tables/<name>`, `out`), `input/` (the stream's files; a folder per
/// source for a job with several), `tables/<name>.jsonl`
/// (a Delta table's rows, written as a Delta table before the run) or `tables/<name>/` (a
/// table of plain files, copied), `expected.jsonl` (the
/// hand-checked output rows, lineage columns left out), optionally `expected_late.jsonl` (the
/// late table's rows, lineage and null columns left out) and `crash` (named crash points, one per
/// line, e.g. `after_commit:1`). The case runs straight through, and again from scratch killed
/// at each crash point and restarted; every output must equal the expected rows.
async fn run_golden_case(case: &Path) {
    let expected = expected_rows(&case.join("expected.jsonl")).expect("expected.jsonl");
    let expected_late = expected_rows(&case.join("expected_late.jsonl"));
    let crash = std::fs::read_to_string(case.join("crash")).unwrap();
    let points = crash.lines().map(str::trim).filter(|l| !l.is_empty());
    for crash_at in std::iter::once(None).chain(points.map(Some)) {
        let ws = tempfile::tempdir().unwrap();
        copy_dir(&case.join("input"), &ws.path().join("input"));
        std::fs::copy(case.join("job.toml"), ws.path().join("job.toml")).unwrap();
        for entry in std::fs::read_dir(case.join("tables")).into_iter().flatten() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_str().unwrap().to_string();
            let table = ws.path().join("tables").join(name);
            if path.is_dir() {
                // A table of plain files (`kind = "files"`), as it stands.
                copy_dir(&path, &table);
            } else {
                write_jsonl_as_delta(&path, &table).await;
            }
        }
        let job = ws.path().join("job.toml");
        let job = job.to_str().unwrap();
        if let Some(point) = crash_at {
            let killed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", point)]);
            assert_eq!(
                killed.status.signal(),
                Some(9),
                "{}: expected a SIGKILL at {point}: {}",
                case.display(),
                String::from_utf8_lossy(&killed.stderr)
            );
        }
        assert_ok(&run_sluice(&["run", job], &[]));
        let mut got: Vec<String> = table_values(
            &ws.path().join("out"),
            &["_source_partition", "_source_offset"],
        )
        .await
        .into_iter()
        .map(|r| canonical(&Value::Object(r)))
        .collect();
        got.sort();
        assert_eq!(
            got,
            expected,
            "golden case {} (crash at {crash_at:?})",
            case.display()
        );
        if let Some(expected_late) = &expected_late {
            let lineage = ["_source_partition", "_source_offset", "_source_position"];
            let mut got: Vec<String> = table_values(&late_table(&ws.path().join("out")), &lineage)
                .await
                .into_iter()
                .map(|r| canonical(&Value::Object(r)))
                .collect();
            got.sort();
            assert_eq!(
                &got,
                expected_late,
                "golden case {} late table (crash at {crash_at:?})",
                case.display()
            );
        }
    }
}

/// The rows of a JSON-lines file as sorted JSON text (`None` if there is no such file).
fn expected_rows(path: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut rows: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| canonical(&serde_json::from_str::<Value>(l).unwrap()))
        .collect();
    rows.sort();
    Some(rows)
}

/// A JSON row as text with its keys sorted, so rows compare whatever their column order.
fn canonical(row: &Value) -> String {
    let sorted: std::collections::BTreeMap<&String, &Value> =
        row.as_object().into_iter().flatten().collect();
    serde_json::to_string(&sorted).unwrap()
}

/// Writes a JSON-lines file as a new Delta table (schema inferred from the rows).
async fn write_jsonl_as_delta(jsonl: &Path, table: &Path) {
    let file = std::fs::File::open(jsonl).unwrap();
    let (schema, _) =
        arrow::json::reader::infer_json_schema(std::io::BufReader::new(&file), None).unwrap();
    let file = std::fs::File::open(jsonl).unwrap();
    let reader = arrow::json::ReaderBuilder::new(Arc::new(schema))
        .build(std::io::BufReader::new(file))
        .unwrap();
    let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
    std::fs::create_dir_all(table).unwrap();
    let url = url::Url::from_directory_path(table).unwrap();
    deltalake::DeltaTable::try_from_url(url)
        .await
        .unwrap()
        .write(batches)
        .await
        .unwrap();
}

/// Copies the folder `from` (and its folders: one per source of a job with several) to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, target).unwrap();
        }
    }
}

/// Every case under `integration/golden/`.
#[tokio::test(flavor = "multi_thread")]
async fn golden_cases_give_their_expected_output_straight_and_after_a_crash() {
    let root: PathBuf = repo_root().join("integration/golden");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    assert!(!cases.is_empty(), "no golden case in {}", root.display());
    for case in cases {
        run_golden_case(&case).await;
    }
}
