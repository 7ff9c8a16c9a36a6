//! Hostile input: lines built to break a decoder (invalid UTF-8, NUL bytes, 100,000-deep
//! nesting, a 4 MB line, a number that overflows its column, a truncated `.json.gz`) and event
//! times from the end of time. Each becomes a dead letter with its position and reason; the job
//! never crashes; every good line of the same files lands once; the watermark stays sane.

use std::io::{Read, Write};
use std::path::Path;

use crate::support::*;

fn good(id: i64) -> Vec<u8> {
    format!(
        r#"{{"id":{id},"user_id":1,"code":"{id}","amount":1.5,"ts":"2026-11-01T10:00:{:02}Z"}}"#,
        id % 60
    )
    .into_bytes()
}

fn write_lines(path: &Path, lines: &[Vec<u8>]) {
    let mut bytes = Vec::new();
    for l in lines {
        bytes.extend_from_slice(l);
        bytes.push(b'\n');
    }
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_lines_are_dead_letters_and_every_good_line_lands_once() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let mut invalid_utf8 = br#"{"id":2,"user_id":1,"code":""#.to_vec();
    invalid_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    invalid_utf8.extend_from_slice(br#"","amount":1.5,"ts":"2026-11-01T10:00:02Z"}"#);
    let nul = b"{\"id\":4,\"user_id\":1,\"code\":\"a\0b\",\"amount\":1.5,\"ts\":\"2026-11-01T10:00:04Z\"}\0"
        .to_vec();
    let deep = format!(
        r#"{{"id":5,"user_id":{}{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    )
    .into_bytes();
    let huge = format!(r#"{{"id":7,"code":"{}"#, "x".repeat(4 << 20)).into_bytes();
    let overflow =
        br#"{"id":99999999999999999999999,"user_id":1,"code":"8","amount":1.5,"ts":"2026-11-01T10:00:08Z"}"#
            .to_vec();
    write_lines(
        &input.join("a-hostile.json"),
        &[
            good(1),
            invalid_utf8,
            good(3),
            nul,
            deep,
            good(6),
            huge,
            overflow,
            good(9),
        ],
    );

    // A gzip file cut short: the lines decompressed before the cut land, the rest is one dead
    // letter naming the line where the file breaks off.
    let lines: Vec<Vec<u8>> = (100..400).map(good).collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    for l in &lines {
        gz.write_all(l).unwrap();
        gz.write_all(b"\n").unwrap();
    }
    let compressed = gz.finish().unwrap();
    let truncated = &compressed[..compressed.len() * 2 / 3];
    std::fs::write(input.join("b-truncated.json.gz"), truncated).unwrap();
    let mut readable = Vec::new();
    let _ = flate2::read::MultiGzDecoder::new(truncated).read_to_end(&mut readable);
    let whole_lines = readable.iter().filter(|b| **b == b'\n').count();
    assert!(whole_lines > 10 && whole_lines < 300, "{whole_lines}");

    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "hostile", &input, &out, 10);
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));

    let ids = sorted_ids(&out).await;
    let mut want: Vec<i64> = vec![1, 3, 6, 9];
    want.extend(100..100 + whole_lines as i64);
    assert_eq!(ids, want, "good lines lost or doubled");

    let letters = table_values(&dead_letter_table(&out), &[]).await;
    let mut positions: Vec<String> = letters
        .iter()
        .map(|r| r["_source_position"].as_str().unwrap().to_string())
        .collect();
    positions.sort();
    let mut expected: Vec<String> = [2, 4, 5, 7, 8]
        .iter()
        .map(|n| format!("a-hostile.json:{n}"))
        .collect();
    expected.push(format!("b-truncated.json.gz:{}", whole_lines + 1));
    assert_eq!(positions, expected);
    let cut = letters
        .iter()
        .find(|r| r["_source_position"].as_str().unwrap().starts_with("b-"))
        .unwrap();
    assert!(
        cut["error"]
            .as_str()
            .unwrap()
            .contains("the file ends early"),
        "{cut:?}"
    );
}

/// An event from the far future (a broken producer clock, an epoch value in the wrong unit)
/// must not push the watermark, which never moves back, to the end of time: it is a dead letter,
/// the windows close as before, and reconcile and backfill judge it as the live job did. (The
/// year 2200 here: a declared `TIMESTAMP` column holds nanoseconds, which end in 2262, so a
/// later date is already refused while decoding.)
#[tokio::test(flavor = "multi_thread")]
async fn an_event_time_far_in_the_future_is_a_dead_letter_and_the_watermark_stays_sane() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    Events::write(&input, 0, 20, 5);
    let reference_out = ws.path().join("reference");
    let reference_job = write_job_with(
        &ws.path().join("reference.toml"),
        "reference",
        &input,
        &reference_out,
        3,
        WINDOWED_SQL,
        "",
    );
    assert_ok(&run_sluice(&["run", reference_job.to_str().unwrap()], &[]));

    // Between the same events, a file whose only event is dated 2200.
    write_lines(
        &input.join("events-00005-future.json"),
        &[
            br#"{"id":7777,"user_id":1,"code":"1","amount":1.5,"ts":"2200-01-01T00:00:00Z"}"#
                .to_vec(),
        ],
    );
    let out = ws.path().join("out");
    let job = write_job_with(
        &ws.path().join("job.toml"),
        "future",
        &input,
        &out,
        3,
        WINDOWED_SQL,
        "",
    );
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["run", job], &[]));

    let status = status_of(&out);
    let watermark = status_field(&status, "watermark").unwrap_or_default();
    assert!(watermark.starts_with("2026-11-01T10:01"), "{status}");
    let want = table_rows(&reference_out).await;
    assert_rows_close(&table_rows(&out).await, &want);
    let letters = table_values(&dead_letter_table(&out), &["batch_id"]).await;
    let future: Vec<_> = letters
        .iter()
        .filter(|r| {
            r["error"]
                .as_str()
                .unwrap()
                .starts_with("event time too far ahead")
        })
        .collect();
    assert_eq!(future.len(), 1, "{letters:?}");
    assert!(
        future[0]["_source_position"]
            .as_str()
            .unwrap()
            .starts_with("events-00005-future.json"),
        "{future:?}"
    );

    // Reconcile and backfill see the row as the live job did.
    let rec = run_sluice(
        &[
            "reconcile",
            job,
            "--from-time",
            "2026-11-01T10:00:00Z",
            "--to-time",
            "2026-11-01T10:01:00Z",
        ],
        &[],
    );
    assert_ok(&rec);
    assert_ok(&run_sluice(
        &["backfill", job, "--from", "0:4", "--to", "0:8"],
        &[],
    ));
    assert_eq!(
        table_values(&dead_letter_table(&out), &["batch_id"]).await,
        letters
    );
    assert_rows_close(&table_rows(&out).await, &want);
}
