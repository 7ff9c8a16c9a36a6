//! The files source end to end beyond plain JSON: gzipped CSV and Parquet with inferred schemas
//! that stay fixed, and the `interval` trigger picking up files that arrive while it runs and
//! stopping cleanly on SIGTERM.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use flate2::Compression;
use flate2::write::GzEncoder;

use crate::support::*;

fn job(
    dir: &std::path::Path,
    id: &str,
    format: &str,
    extra: &str,
    sql: &str,
) -> std::path::PathBuf {
    let text = format!(
        r#"
[job]
id = "{id}"

[sources.input]
kind = "files"
path = "input"
format = "{format}"
max_files_per_batch = 1
{extra}

[sink]
kind = "delta"
path = "out"

[query]
sql = "{sql}"
"#
    );
    let path = dir.join("job.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn gzipped_csv_with_an_inferred_schema_that_stays_fixed() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let gz = |name: &str, text: &str| {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(text.as_bytes()).unwrap();
        std::fs::write(input.join(name), enc.finish().unwrap()).unwrap();
    };
    gz("a.csv.gz", "id,name,price\n1,apple,1.5\n3,plum,2.25\n");
    let job = job(
        ws.path(),
        "csv_job",
        "csv",
        "",
        "SELECT id, upper(name) AS name, price FROM input",
    );
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    // A later file with an extra column: the schema fixed at the first run is kept. A line with
    // a column beyond it, or a value that does not fit it, is dead-lettered, not lost.
    gz(
        "b.csv.gz",
        "id,name,price,colour\n4,fig,3.0,purple\n2,pear,oops\n",
    );
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    // Files of another producer: a header naming the columns in another order (and case) is
    // read by name — by position, `kiwi` would be the price — even after a blank line. One
    // that lacks a column and names the others out of place places its fields neither way:
    // its lines are dead letters saying so.
    gz("c.csv.gz", "\n\u{feff}price,NAME,id\n5.5,kiwi,5\n");
    gz("d.csv.gz", "name,id\nlime,6\n");
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));

    let out = ws.path().join("out");
    let rows = table_values(&out, &["_source_partition"]).await;
    let mut got: Vec<(i64, String, Option<f64>, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["name"].as_str().unwrap().to_string(),
                r.get("price").and_then(serde_json::Value::as_f64),
                r["_source_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    got.sort_by_key(|r| r.0);
    assert_eq!(
        got,
        vec![
            (1, "APPLE".into(), Some(1.5), 0),
            (3, "PLUM".into(), Some(2.25), 0),
            (5, "KIWI".into(), Some(5.5), 2),
        ]
    );
    let dead = table_values(&dead_letter_table(&out), &[]).await;
    let positions: Vec<&str> = dead
        .iter()
        .map(|d| d["_source_position"].as_str().unwrap())
        .collect();
    assert_eq!(positions, vec!["b.csv.gz:2", "b.csv.gz:3", "d.csv.gz:2"]);
    let misplaced = dead[2]["error"].as_str().unwrap();
    assert!(
        misplaced.contains("neither by name nor by position"),
        "{misplaced}"
    );
    // The column the inferred schema lacks is named: the lines are kept whole, not cut.
    for d in &dead[..2] {
        assert_eq!(d["_source_offset"], 1);
        assert!(d["error"].as_str().unwrap().contains("\"colour\""), "{d:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn parquet_files_are_read_and_conformed_by_column_name() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let write = |name: &str, batch: RecordBatch| {
        let file = std::fs::File::create(input.join(name)).unwrap();
        let mut w =
            deltalake::parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    let first = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("city", DataType::Utf8, true),
            Field::new("temp", DataType::Float64, true),
        ])),
        vec![
            Arc::new(Int64Array::from(vec![1, 2])),
            Arc::new(StringArray::from(vec!["Oslo", "Lima"])),
            Arc::new(Float64Array::from(vec![-3.5, 19.0])),
        ],
    )
    .unwrap();
    write("part-0.parquet", first);
    // Columns in another order, one missing: conformed by name, the missing one null.
    let second = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("city", DataType::Utf8, true),
            Field::new("id", DataType::Int64, false),
        ])),
        vec![
            Arc::new(StringArray::from(vec!["Pune"])),
            Arc::new(Int64Array::from(vec![3])),
        ],
    )
    .unwrap();
    write("part-1.parquet", second);
    std::fs::write(input.join("part-2.parquet"), b"not parquet at all").unwrap();
    let job = job(
        ws.path(),
        "parquet_job",
        "parquet",
        "",
        "SELECT id, city, temp FROM input",
    );
    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    assert_ok(&run);
    let rows = table_values(
        &ws.path().join("out"),
        &["_source_partition", "_source_offset"],
    )
    .await;
    let mut got: Vec<(i64, String, Option<f64>)> = rows
        .iter()
        .map(|r| {
            (
                r["id"].as_i64().unwrap(),
                r["city"].as_str().unwrap().to_string(),
                r.get("temp").and_then(|t| t.as_f64()),
            )
        })
        .collect();
    got.sort_by_key(|r| r.0);
    assert_eq!(
        got,
        vec![
            (1, "Oslo".to_string(), Some(-3.5)),
            (2, "Lima".to_string(), Some(19.0)),
            (3, "Pune".to_string(), None),
        ]
    );
    let dead = table_values(&dead_letter_table(&ws.path().join("out")), &[]).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["_source_position"], "part-2.parquet");
    assert!(dead[0]["error"].as_str().unwrap().contains("whole file"));
}

/// A query that uses a few of a Parquet source's columns has only those decoded; the rows
/// that go to the dead-letter and late tables are read again whole, so those tables hold every
/// column of the record, as they do when every column is read.
#[tokio::test(flavor = "multi_thread")]
async fn parquet_reads_only_the_columns_used_and_side_tables_keep_whole_records() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let minute = 60_000_000_i64;
    let write = |name: &str, rows: &[NoteRow]| write_notes(&input.join(name), rows);
    // One file a batch. The first: a row whose amount fails the query (division by zero), one
    // without event time; the watermark ends at 00:02:10.
    write(
        "part-0.parquet",
        &[
            (1, Some(10_000_000), "first", 5),
            (2, Some(minute + 30_000_000), "zero amount", 0),
            (3, None, "no time", 1),
            (4, Some(2 * minute + 10_000_000), "fourth", 2),
        ],
    );
    // The second: a row of the first minute, closed by then: late.
    write(
        "part-1.parquet",
        &[
            (5, Some(20_000_000), "late one", 1),
            (6, Some(3 * minute), "sixth", 4),
        ],
    );
    let windowed = notes_job(ws.path());
    // The second file is read while the first batch commits (the first commits far less than
    // 8 MiB): everything below holds for a batch read ahead.
    let log = ("RUST_LOG", "info,sluice_engine::input=debug");
    let run = run_sluice(&["run", windowed.to_str().unwrap()], &[log]);
    assert_ok(&run);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("reading only the columns the query uses")
            && stderr.contains("columns=ts, amount"),
        "{stderr}"
    );
    assert!(stderr.contains("taken from the read ahead"), "{stderr}");
    let out = ws.path().join("out");
    let mut windows: Vec<(String, i64, i64)> = table_values(&out, &[])
        .await
        .iter()
        .map(|r| {
            (
                r["window_start"].as_str().unwrap().to_string(),
                r["n"].as_i64().unwrap(),
                r["s"].as_i64().unwrap(),
            )
        })
        .collect();
    windows.sort();
    // The late row still counts in no closed window; 00:03 is still open.
    assert_eq!(windows.len(), 2, "{windows:?}");
    assert_eq!((windows[0].1, windows[0].2), (1, 20));
    assert_eq!((windows[1].1, windows[1].2), (1, 50));
    let mut dead = table_values(&dead_letter_table(&out), &[]).await;
    dead.sort_by_key(|d| d["_source_position"].as_str().unwrap().to_string());
    let dead: Vec<(String, serde_json::Value, String)> = dead
        .iter()
        .map(|d| {
            (
                d["_source_position"].as_str().unwrap().to_string(),
                // Binary, read as hex.
                serde_json::from_slice(&hex_bytes(d["raw"].as_str().unwrap())).unwrap(),
                d["error"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0].0, "part-0.parquet:2");
    assert_eq!(dead[0].1["note"], "zero amount", "{dead:?}");
    assert_eq!(dead[0].1["id"], 2, "{dead:?}");
    assert!(dead[0].2.contains("Divide by zero"), "{dead:?}");
    assert_eq!(dead[1].0, "part-0.parquet:3");
    assert_eq!(dead[1].1["note"], "no time", "{dead:?}");
    assert_eq!(dead[1].1["amount"], 1, "{dead:?}");
    let late = table_values(&late_table(&out), &[]).await;
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0]["id"], 5);
    assert_eq!(late[0]["note"], "late one");
    assert_eq!(late[0]["_source_position"], "part-1.parquet:1");

    // The job runs again over a new file: its tables are as it left them, late table included.
    write("part-2.parquet", &[(7, Some(30_000_000), "late again", 1)]);
    let again = run_sluice(&["run", windowed.to_str().unwrap()], &[]);
    assert_ok(&again);
    let late = table_values(&late_table(&out), &[]).await;
    let mut notes: Vec<&str> = late.iter().map(|r| r["note"].as_str().unwrap()).collect();
    notes.sort();
    assert_eq!(notes, ["late again", "late one"]);

    // A query that names a column its plan does not read (the optimizer drops the inner
    // `note`): planned over every column, as before.
    let plain = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(plain.path().join("input")).unwrap();
    std::fs::copy(
        input.join("part-0.parquet"),
        plain.path().join("input/part-0.parquet"),
    )
    .unwrap();
    let names_more = job(
        plain.path(),
        "names_more",
        "parquet",
        "",
        "SELECT id FROM (SELECT id, note FROM input) WHERE id > 1",
    );
    let run = run_sluice(&["run", names_more.to_str().unwrap()], &[]);
    assert_ok(&run);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("every column of its sources is read"),
        "{stderr}"
    );
    let ids = sorted_ids(&plain.path().join("out")).await;
    assert_eq!(ids, [2, 3, 4]);
}

/// A file whose column the query does not read is corrupt: its rows are read (only the
/// columns the query uses are decoded), and its rows bound for a side table, which cannot be
/// read again whole, keep the columns read — a late row goes to the dead letters, as the late
/// table's columns may be NOT NULL — with the reason saying so.
#[tokio::test(flavor = "multi_thread")]
async fn rows_of_a_file_that_cannot_be_read_whole_keep_the_columns_read() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let minute = 60_000_000_i64;
    write_notes(
        &input.join("part-0.parquet"),
        &[(1, Some(2 * minute), "first", 5)],
    );
    let note = write_notes(
        &input.join("part-1.parquet"),
        &[
            (2, Some(10_000_000), "late", 1),
            (3, Some(2 * minute + 1), "zero", 0),
            (4, Some(3 * minute), "fourth", 4),
        ],
    );
    // The page header of the `note` chunk overwritten.
    let path = input.join("part-1.parquet");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[note.start as usize..note.start as usize + 8].fill(0xFF);
    std::fs::write(&path, bytes).unwrap();
    let run = run_sluice(&["run", notes_job(ws.path()).to_str().unwrap()], &[]);
    assert_ok(&run);
    let out = ws.path().join("out");
    let dead = dead_letters(&out).await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0].0, "part-1.parquet:1");
    // The columns read: the event time and the amount.
    assert!(
        dead[0].1.contains("\"amount\":1") && !dead[0].1.contains("note"),
        "{dead:?}"
    );
    assert!(
        dead[0].2.starts_with("late:") && dead[0].2.contains("read again whole"),
        "{dead:?}"
    );
    assert_eq!(dead[1].0, "part-1.parquet:2");
    assert!(
        dead[1].1.contains("\"amount\":0") && !dead[1].1.contains("note"),
        "{dead:?}"
    );
    assert!(dead[1].2.contains("Divide by zero"), "{dead:?}");
    assert!(dead[1].2.contains("read again whole"), "{dead:?}");
    assert!(table_values(&late_table(&out), &[]).await.is_empty());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("could not be read again whole"), "{stderr}");
}

/// A stateless query that does not read `_source_position` has its reads give each row's
/// number in place of its position's text; the rows bound for the dead-letter table get the
/// same positions and whole records as when the query reads the position as text. Over JSON
/// files (the second read ahead of its batch) whose line numbers are not the rows' ordinals (a
/// malformed line comes first); a query reading every column; a query naming the position
/// where the optimizer drops it (still narrowed, positions as text); and a Parquet file whose
/// rows cannot be read again whole (a column the query does not read is corrupt), whose
/// positions then come from the source's prefix and the number alone.
#[tokio::test(flavor = "multi_thread")]
async fn positions_read_as_numbers_give_side_tables_the_same_text() {
    let first = r#"{"id":0,"ts":"2024-01-01T00:00:05Z","note":"zeroth","amount":4}"#;
    let lines = [
        r#"{"id":1,"ts":"2024-01-01T00:00:10Z","note":"first","amount":5}"#,
        "not json",
        r#"{"id":3,"note":"no time","amount":1}"#,
        r#"{"id":4,"ts":"2024-01-01T00:02:10Z","note":"zero","amount":0}"#,
        r#"{"id":5,"ts":"2024-01-01T00:03:00Z","note":"fifth","amount":2}"#,
    ];
    let sql = "SELECT id, 100 / amount AS q FROM input";
    // (query, what the log says of its reads)
    let queries = [
        (
            "SELECT id, 100 / amount AS q, _source_position AS at FROM input",
            "positions=Text",
        ),
        (
            "SELECT id, 100 / amount AS q FROM input WHERE _source_position IS NOT NULL",
            "positions=Text",
        ),
        (sql, "positions=Numbers"),
        (
            "SELECT id, ts, note, 100 / amount AS q FROM input",
            "reading every column, the rows' positions as numbers",
        ),
    ];
    let mut dead_by_query = Vec::new();
    for (query, reads) in queries {
        let ws = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(ws.path().join("input")).unwrap();
        std::fs::write(ws.path().join("input/a.json"), format!("{first}\n")).unwrap();
        std::fs::write(ws.path().join("input/notes.json"), lines.join("\n") + "\n").unwrap();
        let declared = "schema = \"id BIGINT, ts TIMESTAMP, note VARCHAR, amount BIGINT\"\n\
                        event_time = \"ts\"";
        let path = job(ws.path(), "numbered", "json", declared, query);
        let run = run_sluice(&["run", path.to_str().unwrap()], &[("RUST_LOG", "info")]);
        assert_ok(&run);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(stderr.contains(reads), "{query}: {stderr}");
        assert!(
            !stderr.contains("every column of its sources is read"),
            "{query}: {stderr}"
        );
        let out = ws.path().join("out");
        let output = table_values(&out, &[]).await;
        assert!(
            output.iter().all(|r| !r.contains_key("_source_row")),
            "{output:?}"
        );
        let mut rows: Vec<(i64, Option<String>)> = output
            .iter()
            .map(|r| {
                (
                    r["id"].as_i64().unwrap(),
                    r.get("at").and_then(|at| at.as_str()).map(str::to_string),
                )
            })
            .collect();
        rows.sort();
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        assert_eq!(ids, [0, 1, 5], "{query}");
        if query.contains(" at ") {
            let at: Vec<Option<&str>> = rows.iter().map(|r| r.1.as_deref()).collect();
            let expected = ["a.json:1", "notes.json:1", "notes.json:5"];
            assert_eq!(at, expected.map(Some));
        }
        let dead = dead_letters(&out).await;
        dead_by_query.push(dead);
    }
    for dead in &dead_by_query[1..] {
        assert_eq!(*dead, dead_by_query[0]);
    }
    let dead = &dead_by_query[0];
    let positions: Vec<&str> = dead.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(positions, ["notes.json:2", "notes.json:3", "notes.json:4"]);
    assert_eq!(dead[0].1, "not json");
    // Whole records: the note, a column the query does not read, is there.
    assert!(dead[1].1.contains("no time"), "{dead:?}");
    assert!(dead[2].1.contains("\"zero\""), "{dead:?}");
    assert!(dead[2].2.contains("Divide by zero"), "{dead:?}");

    // A source with a column of the internal column's name keeps its positions as text, and
    // the column is data like any other.
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("input")).unwrap();
    let rows = [
        r#"{"id":1,"ts":"2024-01-01T00:00:10Z","_source_row":"x"}"#,
        r#"{"id":2,"_source_row":"y"}"#,
    ];
    std::fs::write(ws.path().join("input/rows.json"), rows.join("\n") + "\n").unwrap();
    let declared = "schema = \"id BIGINT, ts TIMESTAMP, _source_row VARCHAR\"\nevent_time = \"ts\"";
    let path = job(ws.path(), "named", "json", declared, "SELECT id FROM input");
    let run = run_sluice(&["run", path.to_str().unwrap()], &[("RUST_LOG", "info")]);
    assert_ok(&run);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("positions=Text"), "{stderr}");
    let named = dead_letters(&ws.path().join("out")).await;
    assert_eq!(named.len(), 1, "{named:?}");
    assert_eq!(named[0].0, "rows.json:2");
    assert!(named[0].1.contains(r#""_source_row":"y""#), "{named:?}");

    // Rows that cannot be read again whole keep the columns read, and their positions.
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let note = write_notes(
        &input.join("part-0.parquet"),
        &[
            (1, Some(10_000_000), "first", 5),
            (2, Some(20_000_000), "zero", 0),
            (3, None, "no time", 1),
        ],
    );
    let path = input.join("part-0.parquet");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[note.start as usize..note.start as usize + 8].fill(0xFF);
    std::fs::write(&path, bytes).unwrap();
    let job = job(ws.path(), "numbered", "parquet", "event_time = \"ts\"", sql);
    let run = run_sluice(&["run", job.to_str().unwrap()], &[("RUST_LOG", "info")]);
    assert_ok(&run);
    assert!(String::from_utf8_lossy(&run.stderr).contains("positions=Numbers"));
    let dead = dead_letters(&ws.path().join("out")).await;
    let positions: Vec<&str> = dead.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(
        positions,
        ["part-0.parquet:2", "part-0.parquet:3"],
        "{dead:?}"
    );
    for (_, raw, error) in &dead {
        assert!(
            raw.contains("\"amount\"") && !raw.contains("note"),
            "{dead:?}"
        );
        assert!(error.contains("read again whole"), "{dead:?}");
    }
    assert!(dead[0].2.contains("Divide by zero"), "{dead:?}");
}

/// A row of [`write_notes`]' files: id, event time, note, amount.
type NoteRow<'a> = (i64, Option<i64>, &'a str, i64);

/// The windowed job the narrowed-read tests run over [`write_notes`]' files: a count and a sum
/// of `100 / amount` (which fails on 0) per minute, with no lateness allowed.
fn notes_job(dir: &std::path::Path) -> std::path::PathBuf {
    job(
        dir,
        "narrow_parquet",
        "parquet",
        "event_time = \"ts\"\nmax_out_of_orderness = \"0s\"",
        "SELECT window_start, count(*) AS n, sum(100 / amount) AS s \
         FROM tumble(input, ts, INTERVAL '1' MINUTE) GROUP BY window_start, window_end",
    )
}

/// Writes `rows` as a Parquet file at `path`: `id` and `note` and `amount` NOT NULL, `ts` a
/// UTC timestamp; returns the byte range of the `note` column's chunk.
fn write_notes(path: &std::path::Path, rows: &[NoteRow]) -> std::ops::Range<u64> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new(
            "ts",
            DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        Field::new("note", DataType::Utf8, false),
        Field::new("amount", DataType::Int64, false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(
                arrow::array::TimestampMicrosecondArray::from_iter(rows.iter().map(|r| r.1))
                    .with_timezone("UTC"),
            ),
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.2))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.3))),
        ],
    )
    .unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = deltalake::parquet::arrow::ArrowWriter::try_new(file, schema, None).unwrap();
    w.write(&batch).unwrap();
    let metadata = w.close().unwrap();
    let (start, length) = metadata.row_group(0).column(2).byte_range();
    start..start + length
}

/// The dead letters of the sink at `out`: (position, raw record as text, reason), sorted.
async fn dead_letters(out: &std::path::Path) -> Vec<(String, String, String)> {
    let mut dead: Vec<(String, String, String)> = table_values(&dead_letter_table(out), &[])
        .await
        .iter()
        .map(|d| {
            (
                d["_source_position"].as_str().unwrap().to_string(),
                String::from_utf8(hex_bytes(d["raw"].as_str().unwrap())).unwrap(),
                d["error"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    dead.sort();
    dead
}

/// Positions as numbers on a source whose reads grow its schema (JSON, inferred, `add_columns`):
/// the batch that brings a new field is read again whole, in text, for the query planned again
/// over the grown schema, which reads numbers; its rows and side tables are those of a query
/// that reads the positions as text, and so are the batches before and after it.
#[tokio::test(flavor = "multi_thread")]
async fn positions_read_as_numbers_across_a_schema_that_grows() {
    let before = [
        r#"{"id":1,"ts":"2024-01-01T00:00:10Z","amount":5}"#,
        r#"{"id":2,"ts":"2024-01-01T00:00:20Z","amount":4}"#,
    ];
    let growing = [
        r#"{"id":3,"ts":"2024-01-01T00:00:30Z","amount":2,"note":"new"}"#,
        "not json",
        r#"{"id":5,"amount":1,"note":"no time"}"#,
        r#"{"id":6,"ts":"2024-01-01T00:00:40Z","amount":0,"note":"zero"}"#,
        r#"{"id":7,"ts":"2024-01-01T00:00:50Z","amount":1}"#,
    ];
    let after = [
        r#"{"id":8,"ts":"2024-01-01T00:01:00Z","amount":5,"note":"after"}"#,
        r#"{"id":9,"ts":"2024-01-01T00:01:10Z","amount":0}"#,
    ];
    // (query, how its reads give positions, how many plannings log it): the first reads
    // every column before the schema grows (not narrowed), the second reads numbers from the
    // start, and both read fewer columns once it has grown.
    let queries = [
        (
            "SELECT id, 100 / amount AS q, _source_position AS at FROM input",
            "positions=Text",
            1,
        ),
        (
            "SELECT id, 100 / amount AS q FROM input",
            "positions=Numbers",
            2,
        ),
    ];
    // A later file brings a field named like the internal column: positions are text from
    // then on, and the column is data like any other.
    let named = [
        r#"{"id":10,"ts":"2024-01-01T00:01:20Z","amount":1,"_source_row":"x"}"#,
        r#"{"id":11,"amount":1,"_source_row":"y"}"#,
    ];
    let mut results = Vec::new();
    for (query, reads, plannings) in queries {
        let ws = tempfile::tempdir().unwrap();
        let input = ws.path().join("input");
        std::fs::create_dir_all(&input).unwrap();
        std::fs::write(input.join("a.json"), before.join("\n") + "\n").unwrap();
        let path = job(ws.path(), "growing", "json", "event_time = \"ts\"", query);
        let path = path.to_str().unwrap();
        // The first run infers the schema without `note`.
        assert_ok(&run_sluice(&["run", path], &[]));
        std::fs::write(input.join("b.json"), growing.join("\n") + "\n").unwrap();
        std::fs::write(input.join("c.json"), after.join("\n") + "\n").unwrap();
        let run = run_sluice(&["run", path], &[("RUST_LOG", "info")]);
        assert_ok(&run);
        let stderr = String::from_utf8_lossy(&run.stderr);
        // Planned at the start and again over the grown schema, in the same form.
        assert!(
            stderr.matches(reads).count() == plannings && stderr.contains("source schema grew"),
            "{query}: {stderr}"
        );
        std::fs::write(input.join("d.json"), named.join("\n") + "\n").unwrap();
        let run = run_sluice(&["run", path], &[("RUST_LOG", "info")]);
        assert_ok(&run);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            stderr.contains("source schema grew") && stderr.contains("positions=Text"),
            "{query}: {stderr}"
        );
        let out = ws.path().join("out");
        let ids = sorted_ids(&out).await;
        assert_eq!(ids, [1, 2, 3, 7, 8, 10], "{query}");
        results.push(dead_letters(&out).await);
    }
    assert_eq!(results[0], results[1]);
    let dead = &results[0];
    let positions: Vec<&str> = dead.iter().map(|d| d.0.as_str()).collect();
    let expected = ["b.json:2", "b.json:3", "b.json:4", "c.json:2", "d.json:2"];
    assert_eq!(positions, expected);
    assert!(dead[1].1.contains("no time"), "{dead:?}");
    assert!(dead[2].1.contains("\"zero\""), "{dead:?}");
    assert!(dead[3].2.contains("Divide by zero"), "{dead:?}");
    assert!(dead[4].1.contains(r#""_source_row":"y""#), "{dead:?}");
}

/// The bytes a hex string spells.
fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn interval_trigger_picks_up_new_files_and_stops_cleanly_on_sigterm() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let mut events = Events::write(&input, 0, 3, 4);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "interval_job", &input, &out, 2);
    let child = sluice_command()
        .args(["run", job.to_str().unwrap(), "--trigger", "interval:200ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    events.lines.extend(Events::write(&input, 3, 3, 4).lines);
    // Wait until the new files are committed, then ask it to stop.
    let want = events.output_ids().len();
    let mut seen = 0;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(200));
        if out.join("_delta_log").exists() {
            seen = table_rows(&out).await.len();
            if seen == want {
                break;
            }
        }
    }
    assert_eq!(seen, want, "new files were not picked up");
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "SIGTERM should stop the job cleanly: {}",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(&format!("holds {want} rows")), "{stdout}");
}

/// The tables Sluice creates get a Delta checkpoint every ten commits (so loading one reads at
/// most ten commit files, however old the job) and Parquet row groups of at most 128 Ki rows (a
/// writer holds its open group in memory); independent readers read the checkpointed table
/// whole.
#[tokio::test(flavor = "multi_thread")]
async fn tables_checkpoint_every_ten_commits_and_row_groups_are_bounded() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    // One file large enough for two row groups, then eleven small ones: twelve batches.
    let big_rows: i64 = 140_000;
    let text: String = (0..big_rows)
        .map(|id| format!("{{\"id\":{id}}}\n"))
        .collect();
    std::fs::write(input.join("a-big.json"), text).unwrap();
    for f in 0..11 {
        let lines: String = (0..10)
            .map(|l| format!("{{\"id\":{}}}\n", big_rows + f * 10 + l))
            .collect();
        std::fs::write(input.join(format!("b-{f:02}.json")), lines).unwrap();
    }
    let job = job(
        ws.path(),
        "checkpointed",
        "json",
        "schema = \"id BIGINT\"",
        "SELECT id FROM input",
    );
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    let out = ws.path().join("out");

    let commits = delta_commits(&out);
    assert_eq!(commits.len(), 13, "the table's creation and twelve batches");
    let interval = commits[0]
        .iter()
        .find_map(|action| action.get("metaData"))
        .and_then(|m| m["configuration"]["delta.checkpointInterval"].as_str());
    assert_eq!(interval, Some("10"));
    // delta-rs checkpoints the commit that completes an interval: version 9 of 0..=12.
    let log = out.join("_delta_log");
    let checkpoints: Vec<String> = std::fs::read_dir(&log)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().to_string())
        .filter(|name| name.ends_with(".checkpoint.parquet"))
        .collect();
    assert_eq!(checkpoints, vec!["00000000000000000009.checkpoint.parquet"]);
    let last: serde_json::Value =
        serde_json::from_slice(&std::fs::read(log.join("_last_checkpoint")).unwrap()).unwrap();
    assert_eq!(last["version"], 9);

    // The row groups of every data file, by pyarrow: the big batch's file holds two.
    let groups = Command::new("python3")
        .args([
            "-c",
            "import glob, sys, pyarrow.parquet as pq\n\
             for f in sorted(glob.glob(sys.argv[1] + '/*.parquet')):\n\
             \x20   m = pq.ParquetFile(f).metadata\n\
             \x20   print(' '.join(str(m.row_group(i).num_rows) for i in range(m.num_row_groups)))",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        groups.status.success(),
        "{}",
        String::from_utf8_lossy(&groups.stderr)
    );
    let groups = String::from_utf8_lossy(&groups.stdout).to_string();
    let mut files: Vec<Vec<i64>> = groups
        .lines()
        .map(|l| l.split(' ').map(|n| n.parse().unwrap()).collect())
        .collect();
    files.sort();
    let mut expected = vec![vec![10]; 11];
    expected.push(vec![131_072, big_rows - 131_072]);
    assert_eq!(files, expected, "rows per row group, per file");

    let read = python_read(&out);
    assert_eq!(read["version"], 12);
    let ids: std::collections::BTreeSet<i64> = read["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, (0..big_rows + 110).collect());
}
