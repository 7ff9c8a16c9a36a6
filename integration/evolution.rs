//! Schema evolution: a field that appears mid-stream becomes a column of the table in the commit
//! of the batch that first reads it (also under SIGKILL), earlier rows read null, a rerun and a
//! backfill across the boundary give identical tables, and two independent readers (Python
//! `deltalake`, Polars) read the result. `rescue` keeps every byte of what does not fit; `fail`
//! names the field and where it appeared.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::support::*;

const FILES: usize = 80;
/// Enough lines that inference's 10,000-record sample ends before [`NEW_FIELD_FROM`].
const LINES_PER_FILE: usize = 300;
/// The file from which records carry `plan` and `device.version`.
const NEW_FIELD_FROM: usize = 40;
const FILES_PER_BATCH: usize = 7;

/// Click files; from file [`NEW_FIELD_FROM`] on, records carry a new top-level field `plan`, a
/// new field `version` of the struct `device` and a new field `qty` of the structs in `items`.
fn write_clicks(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for f in 0..FILES {
        let mut text = String::new();
        for l in 0..LINES_PER_FILE {
            let i = f * LINES_PER_FILE + l;
            let ts = format!(
                "2026-11-01T{:02}:{:02}:{:02}Z",
                i / 3600,
                (i / 60) % 60,
                i % 60
            );
            let line = if f < NEW_FIELD_FROM {
                format!(
                    r#"{{"id":{i},"user_id":{},"device":{{"os":"linux"}},"items":[{{"sku":"a"}}],"ts":"{ts}"}}"#,
                    i % 17
                )
            } else {
                format!(
                    r#"{{"id":{i},"user_id":{},"device":{{"os":"linux","version":{}}},"items":[{{"sku":"a","qty":{}}}],"ts":"{ts}","plan":"p{}"}}"#,
                    i % 17,
                    i % 5,
                    i % 4,
                    i % 3
                )
            };
            text.push_str(&line);
            text.push('\n');
        }
        std::fs::write(dir.join(format!("clicks-{f:05}.json")), text).unwrap();
    }
}

fn write_job(path: &Path, input: &Path, out: &Path, source_extra: &str) -> PathBuf {
    let text = format!(
        r#"
[job]
id = "evolving"

[sources.clicks]
kind = "files"
path = "{input}"
format = "json"
event_time = "ts"
max_files_per_batch = {FILES_PER_BATCH}
{source_extra}

[sink]
kind = "delta"
path = "{out}"

[query]
sql = "SELECT * FROM clicks"
"#,
        input = input.display(),
        out = out.display(),
    );
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// Per commit of the table's log (in order): the txn version of `app_id` it carries, and the
/// columns of the schema it sets (a `metaData` action), if it sets one.
fn schema_changes(table: &Path, app_id: &str) -> Vec<(Option<i64>, Option<String>)> {
    delta_commits(table)
        .iter()
        .map(|actions| {
            let (mut txn, mut schema) = (None, None);
            for v in actions {
                if v["txn"]["appId"] == app_id {
                    txn = v["txn"]["version"].as_i64();
                }
                if let Some(s) = v["metaData"]["schemaString"].as_str() {
                    schema = Some(s.to_string());
                }
            }
            (txn, schema)
        })
        .collect()
}

/// The txn versions of the commits among `changes` ([`schema_changes`]) that set a schema
/// with the new field `plan`.
fn setting_plan(changes: &[(Option<i64>, Option<String>)]) -> Vec<Option<i64>> {
    changes
        .iter()
        .filter(|(_, schema)| schema.as_ref().is_some_and(|s| s.contains("\"plan\"")))
        .map(|(txn, _)| *txn)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_field_becomes_a_column_in_the_commit_of_the_batch_that_first_reads_it() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    write_clicks(&input);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), &input, &out, "");
    let job = job.to_str().unwrap();
    let first_batch = (NEW_FIELD_FROM / FILES_PER_BATCH) as i64;

    // SIGKILLs around the batch that first reads the new fields: in the commit of the batch
    // before it (which the next batch may run beside, reading only what was read ahead, which
    // never grows the schema), after its intent, after the evolution is recorded and the
    // manifest written, between the side tables and the output commit, and right after that
    // commit.
    for (point, batch) in [
        ("after_side_tables", first_batch - 1),
        ("after_intent", first_batch),
        ("after_manifest", first_batch),
        ("after_side_tables", first_batch),
        ("after_commit", first_batch),
    ] {
        let crashed = run_sluice(
            &["run", job],
            &[("SLUICE_CRASH_AT", &format!("{point}:{batch}"))],
        );
        assert!(
            !crashed.status.success(),
            "expected a crash at {point}: {}",
            String::from_utf8_lossy(&crashed.stderr)
        );
    }
    let run = run_sluice(&["run", job], &[]);
    assert_ok(&run);

    // The schema changes in the Delta log: created without the new fields; the commit of the
    // first batch reading them (and only it) sets a schema with both.
    let changes = schema_changes(&out, "evolving");
    let with_plan = setting_plan(&changes);
    assert_eq!(with_plan, vec![Some(first_batch)], "{changes:?}");
    let (_, schema) = changes
        .iter()
        .find(|(txn, _)| *txn == Some(first_batch))
        .unwrap();
    let schema = schema.as_ref().unwrap();
    assert!(
        schema.contains("\"version\"") && schema.contains("\"qty\""),
        "{schema}"
    );
    let batches: Vec<i64> = changes.iter().filter_map(|(txn, _)| *txn).collect();
    let distinct: BTreeSet<i64> = batches.iter().copied().collect();
    assert_eq!(distinct.len(), batches.len(), "a batch committed twice");

    // Rows before the boundary read null in the new columns; rows after carry them.
    let table = python_read(&out);
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), FILES * LINES_PER_FILE);
    let ids: BTreeSet<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(ids.len(), rows.len(), "duplicate rows");
    for r in rows {
        let i = r["id"].as_u64().unwrap() as usize;
        if i / LINES_PER_FILE < NEW_FIELD_FROM {
            assert!(r["plan"].is_null(), "{r}");
            assert!(r["device"]["version"].is_null(), "{r}");
            assert!(r["items"][0]["qty"].is_null(), "{r}");
        } else {
            assert_eq!(r["plan"], format!("p{}", i % 3), "{r}");
            assert_eq!(r["device"]["version"], (i % 5) as i64, "{r}");
            assert_eq!(r["items"][0]["qty"], (i % 4) as i64, "{r}");
        }
        assert_eq!(r["items"][0]["sku"], "a");
        assert_eq!(r["device"]["os"], "linux");
    }

    // Polars reads it too.
    let polars = polars_read(&out);
    let columns: Vec<&str> = polars["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c[0].as_str().unwrap())
        .collect();
    assert!(
        columns.contains(&"plan") && columns.contains(&"device"),
        "{columns:?}"
    );
    let polars_rows = polars["rows"].as_array().unwrap();
    assert_eq!(polars_rows.len(), rows.len());
    let with_version = polars_rows
        .iter()
        .filter(|r| !r["device"]["version"].is_null())
        .count();
    assert_eq!(with_version, (FILES - NEW_FIELD_FROM) * LINES_PER_FILE);

    // A rerun from scratch (no crashes) gives the identical table. Its batches are read ahead
    // while the one before commits, but a read ahead never grows the schema: the boundary
    // batch's is declined, and that batch reads its files itself and records the fields.
    let again = ws.path().join("again");
    let rerun = write_job(&ws.path().join("rerun.toml"), &input, &again, "");
    let log = (
        "RUST_LOG",
        "info,sluice_engine::input=debug,sluice_engine::driver=debug",
    );
    let rerun_run = run_sluice(&["run", rerun.to_str().unwrap()], &[log]);
    assert_ok(&rerun_run);
    let stderr = String::from_utf8_lossy(&rerun_run.stderr);
    // Batches 1 to 11 are read ahead, but the boundary batch's read is declined and the
    // batch after it is not read ahead (its source's schema grew in the batch before). Each
    // batch taken from the read ahead was executed while the one before it committed; the
    // boundary batch waited for that commit and read its range itself.
    let taken = stderr.matches("taken from the read ahead").count();
    let declined = stderr
        .matches("the source declined to read this range ahead")
        .count();
    let read_ahead = FILES.div_ceil(FILES_PER_BATCH) - 1;
    assert!(
        taken == read_ahead - 2 && declined == 1,
        "{taken} taken, {declined} declined: {stderr}"
    );
    let executed_ahead = stderr
        .matches("executed while the batch before it committed")
        .count();
    assert_eq!(executed_ahead, taken, "{stderr}");
    let again_changes = schema_changes(&again, "evolving");
    let again_with_plan = setting_plan(&again_changes);
    assert_eq!(
        again_with_plan,
        vec![Some(first_batch)],
        "{again_changes:?}"
    );
    let streamed = table_rows(&out).await;
    assert_eq!(table_rows(&again).await, streamed, "rerun differs");

    // A windowed job over the same files: its late table (no late rows here) gains the new
    // columns in the commit of the batch that first reads them, and the state carries on.
    let windowed_out = ws.path().join("windowed");
    let windowed = write_job(&ws.path().join("windowed.toml"), &input, &windowed_out, "");
    let text = std::fs::read_to_string(&windowed).unwrap().replace(
        "SELECT * FROM clicks",
        "SELECT window_start, count(*) AS n FROM tumble(clicks, ts, INTERVAL '1' MINUTE) \
         GROUP BY window_start",
    );
    std::fs::write(&windowed, text).unwrap();
    assert_ok(&run_sluice(&["run", windowed.to_str().unwrap()], &[]));
    let late_changes = schema_changes(&late_table(&windowed_out), "evolving");
    let late_with_plan = setting_plan(&late_changes);
    assert_eq!(late_with_plan, vec![Some(first_batch)], "{late_changes:?}");
    let counted: i64 = python_read(&windowed_out)["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["n"].as_i64().unwrap())
        .sum();
    // Every window but the last (still open, at most 60 rows) is emitted, each row once.
    let total = (FILES * LINES_PER_FILE) as i64;
    assert!(counted > 0 && total - counted <= 60, "{counted} of {total}");

    // A backfill across the boundary replaces those files' rows with identical ones.
    let from = format!("0:{}", NEW_FIELD_FROM - 3);
    let to = format!("0:{}", NEW_FIELD_FROM + 3);
    let backfilled = run_sluice(&["backfill", job, "--from", &from, "--to", &to], &[]);
    assert_ok(&backfilled);
    assert_eq!(table_rows(&out).await, streamed, "backfill changed rows");
}

/// Files with a declared schema: file 2's line 5 carries an unknown field `note` (nested
/// values with spacing and number formats a re-encoding would change), file 3's line 2 an
/// amount that is not a number.
fn write_misfits(dir: &Path) -> Vec<(i64, String)> {
    std::fs::create_dir_all(dir).unwrap();
    let mut unexpected = Vec::new();
    for f in 0..4 {
        let mut text = String::new();
        for l in 0..10 {
            let id = (f * 10 + l) as i64;
            let ts = format!("2026-11-01T10:00:{id:02}Z");
            let line = match (f, l) {
                (2, 4) => {
                    let note = r#"{"a": [1, 2.50, 1e3], "b" :"\u00e9"}"#;
                    unexpected.push((id, format!(r#"{{"note":{note}}}"#)));
                    format!(r#"{{"id":{id},"amount":1.5,"note":{note},"ts":"{ts}"}}"#)
                }
                (3, 1) => {
                    unexpected.push((id, r#"{"amount":"abc"}"#.to_string()));
                    format!(r#"{{"id":{id},"amount":"abc","ts":"{ts}"}}"#)
                }
                _ => format!(r#"{{"id":{id},"amount":{l}.5,"ts":"{ts}"}}"#),
            };
            text.push_str(&line);
            text.push('\n');
        }
        std::fs::write(dir.join(format!("events-{f:05}.json")), text).unwrap();
    }
    unexpected
}

fn write_declared_job(path: &Path, input: &Path, out: &Path, mode: &str, sql: &str) -> PathBuf {
    let text = format!(
        r#"
[job]
id = "misfits"

[sources.events]
kind = "files"
path = "{input}"
format = "json"
schema = "id BIGINT, amount DOUBLE, ts TIMESTAMP"
schema_evolution = "{mode}"
event_time = "ts"
max_files_per_batch = 1

[sink]
kind = "delta"
path = "{out}"

[query]
sql = "{sql}"
"#,
        input = input.display(),
        out = out.display(),
    );
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

#[tokio::test(flavor = "multi_thread")]
async fn rescue_keeps_every_byte_of_what_does_not_fit_and_fail_names_the_field() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let unexpected = write_misfits(&input);

    let out = ws.path().join("rescued");
    let all = "SELECT * FROM events";
    let job = write_declared_job(&ws.path().join("rescue.toml"), &input, &out, "rescue", all);
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    let rows = python_read(&out)["rows"].as_array().unwrap().clone();
    assert_eq!(rows.len(), 40, "no record is dead-lettered");
    let mut rescued: Vec<(i64, String)> = rows
        .iter()
        .filter(|r| !r["_rescued_data"].is_null())
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["_rescued_data"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    rescued.sort();
    assert_eq!(
        rescued, unexpected,
        "the rescued text is exactly what was written"
    );
    let kept = rows.iter().find(|r| r["id"] == 24).unwrap();
    assert_eq!(kept["amount"], 1.5, "what fits stays in its column");
    let misfit = rows.iter().find(|r| r["id"] == 31).unwrap();
    assert!(misfit["amount"].is_null());
    assert_eq!(
        dead_letter_rows(&out),
        Vec::<Value>::new(),
        "no dead letters"
    );

    // A query using some columns reads only those (its rescued rows projected too): the same
    // rows, the same rescued text.
    let narrow_out = ws.path().join("rescued-narrow");
    let narrow = "SELECT id, _rescued_data FROM events";
    let job = write_declared_job(
        &ws.path().join("narrow.toml"),
        &input,
        &narrow_out,
        "rescue",
        narrow,
    );
    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    assert_ok(&run);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("reading only the columns the query uses"),
        "{stderr}"
    );
    let narrow_rows = python_read(&narrow_out)["rows"].as_array().unwrap().clone();
    let pairs = |rows: &[Value]| {
        let mut pairs: Vec<(i64, Option<String>)> = rows
            .iter()
            .map(|r| {
                (
                    r["id"].as_i64().unwrap(),
                    r["_rescued_data"].as_str().map(String::from),
                )
            })
            .collect();
        pairs.sort();
        pairs
    };
    assert_eq!(pairs(&narrow_rows), pairs(&rows));
    assert_eq!(dead_letter_rows(&narrow_out), Vec::<Value>::new());

    // `fail` stops at the new field, naming it, where it first appeared, and the options.
    let failed_out = ws.path().join("failed");
    let job = write_declared_job(
        &ws.path().join("fail.toml"),
        &input,
        &failed_out,
        "fail",
        all,
    );
    assert_fails_saying(
        &run_sluice(&["run", job.to_str().unwrap()], &[]),
        &[
            "field 'note' first appears at events-00002.json:5 (offset 2)",
            "schema_evolution = \"add_columns\"",
            "\"rescue\"",
        ],
    );
    assert_eq!(txn_versions(&failed_out, "misfits"), vec![0, 1]);
}
