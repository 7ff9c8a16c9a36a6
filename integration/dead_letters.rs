//! Bad input never stops a job and is never lost: malformed lines, values that do not fit the
//! schema, missing event time and rows on which the SQL fails all land in the dead-letter table
//! with a reason, and every good line lands in the output — as read by an independent reader
//! (the Python `deltalake` package). Also: deleting the table and checkpoint and rerunning gives
//! the same rows back.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::support::*;

#[tokio::test(flavor = "multi_thread")]
async fn bad_rows_go_to_dead_letters_and_every_good_row_to_the_output() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 12, 20);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "dead_letters", &input, &out, 5);
    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    assert_ok(&run);

    // The output, read by the Python deltalake package: schema and rows.
    let table = python_read(&out);
    let schema: Vec<(String, String)> = table["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f[0].as_str().unwrap().into(), f[1].as_str().unwrap().into()))
        .collect();
    let expected_schema = [
        ("id", "int64"),
        ("user_id", "int64"),
        ("code", "int32"),
        ("double_amount", "double"),
        ("minute", "timestamp[us, tz=UTC]"),
        ("ts", "timestamp[us, tz=UTC]"),
        ("_source_partition", "string"),
        ("_source_offset", "int64"),
    ]
    .map(|(n, t)| (n.to_string(), t.to_string()));
    assert_eq!(schema, expected_schema);
    let rows = table["rows"].as_array().unwrap();
    let ids: BTreeSet<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(rows.len(), ids.len(), "duplicate rows");
    assert_eq!(
        ids,
        events.output_ids(),
        "good rows missing or bad rows present"
    );
    for r in rows {
        let i = r["id"].as_i64().unwrap() - 1;
        assert_eq!(r["user_id"].as_i64().unwrap(), i % 17);
        assert_eq!(r["code"].as_i64().unwrap(), i % 100);
        assert_eq!(
            r["double_amount"].as_f64().unwrap(),
            ((i % 13) as f64 + 0.5) * 2.0
        );
        assert_eq!(
            r["_source_offset"].as_i64().unwrap(),
            i / 20,
            "lineage offset = file position"
        );
        assert_eq!(r["_source_partition"], "0");
    }

    // The dead letters, read by Python too: one per bad line, with the reason and position.
    let dead = python_read(&dead_letter_table(&out));
    let letters = dead["rows"].as_array().unwrap();
    assert_eq!(letters.len(), events.bad_count());
    let by_id = |id: i64| -> &Value {
        let (f, _, _) = events.lines[(id - 1) as usize];
        let line = (id - 1) as usize % 20 + 1;
        let position = format!("events-{f:05}.json:{line}");
        letters
            .iter()
            .find(|l| l["_source_position"] == position.as_str())
            .unwrap_or_else(|| panic!("no dead letter at {position}"))
    };
    for (file, id, kind) in &events.lines {
        if *kind == LineKind::Good {
            continue;
        }
        let letter = by_id(*id);
        assert_eq!(letter["_source_offset"].as_i64().unwrap(), *file as i64);
        assert_eq!(letter["_source_name"], "events");
        let error = letter["error"].as_str().unwrap();
        let raw = letter["raw"].as_str().unwrap();
        let reason_ok = match kind {
            LineKind::Malformed => error.contains("Json error"),
            LineKind::WrongType => error.contains("amount") || error.contains("lots"),
            LineKind::NoEventTime => error.contains("event time column 'ts' is missing"),
            LineKind::Poison => error.contains("Cannot cast") && raw.contains(&format!("x{id}")),
            LineKind::Good => unreachable!(),
        };
        assert!(
            reason_ok,
            "{kind:?} line {id}: error {error:?}, raw {raw:?}"
        );
        assert!(
            raw.contains(&format!("\"id\":{id}")),
            "raw keeps the input: {raw}"
        );
    }

    // The summary line counts them.
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains(&format!("dead-lettered {}", events.bad_count())),
        "{stdout}"
    );

    // Delete the table, its dead letters and the checkpoint (inside the table folder), rerun:
    // the same rows come back.
    let before = table_rows(&out).await;
    let before_dead = table_values(&dead_letter_table(&out), &[]).await;
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(dead_letter_table(&out)).unwrap();
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    assert_eq!(table_rows(&out).await, before);
    assert_eq!(
        table_values(&dead_letter_table(&out), &[]).await,
        before_dead
    );

    // Running again with no new input commits nothing and changes nothing.
    let versions = txn_versions(&out, "dead_letters");
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    assert_eq!(txn_versions(&out, "dead_letters"), versions);
    assert_eq!(table_rows(&out).await, before);
}
