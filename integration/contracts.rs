//! Ingestion contracts on messy input: schema inference that a few bad values cannot hijack,
//! plan errors that say a column was inferred, the dead-letter circuit breaker, and
//! expectations (warn, drop, quarantine, fail) with exact counts across crashes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

use crate::support::*;

/// Click files with no declared schema: `files` files of 100 lines; in the first file, line 1
/// holds a string id and line 2 a string amount; every 97th line is cut off. Returns the ids
/// that must reach the output and the positions (`file:line`) that must be dead letters.
fn messy_clicks(dir: &Path, files: usize) -> (BTreeSet<i64>, BTreeSet<String>) {
    std::fs::create_dir_all(dir).unwrap();
    let (mut good, mut bad) = (BTreeSet::new(), BTreeSet::new());
    for f in 0..files {
        let name = format!("clicks-{f:05}.json");
        let mut text = String::new();
        for l in 0..100 {
            let i = f * 100 + l;
            let id = i as i64;
            let ts = format!("2026-11-01T10:{:02}:{:02}Z", (i / 60) % 60, i % 60);
            let (line, ok) = match (f, l) {
                (0, 0) => (
                    format!(r#"{{"id":"x","user_id":1,"amount":2.5,"ts":"{ts}"}}"#),
                    false,
                ),
                (0, 1) => (
                    format!(r#"{{"id":{id},"user_id":1,"amount":"abc","ts":"{ts}"}}"#),
                    false,
                ),
                _ if i % 97 == 50 => (format!(r#"{{"id":{id},"user_id""#), false),
                _ => (
                    format!(
                        r#"{{"id":{id},"user_id":{},"amount":{}.25,"ts":"{ts}"}}"#,
                        i % 7,
                        i % 11
                    ),
                    true,
                ),
            };
            if ok {
                good.insert(id);
            } else {
                bad.insert(format!("{name}:{}", l + 1));
            }
            text.push_str(&line);
            text.push('\n');
        }
        std::fs::write(dir.join(name), text).unwrap();
    }
    (good, bad)
}

/// A job over click files with no `schema`; `sink_extra` goes into `[sink]`, `rest` after
/// `[query]`.
fn inferred_job(path: &Path, input: &Path, out: &Path, sql: &str, sink_extra: &str, rest: &str) {
    let text = format!(
        r#"
[job]
id = "contracts"

[sources.clicks]
kind = "files"
path = "{input}"
format = "json"
event_time = "ts"
max_files_per_batch = 5

[sink]
kind = "delta"
path = "{out}"
{sink_extra}

[query]
sql = """{sql}"""
{rest}
"#,
        input = input.display(),
        out = out.display(),
    );
    std::fs::write(path, text).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn inference_is_decided_by_the_majority_and_only_bad_records_are_dead_letters() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let (good, bad) = messy_clicks(&input, 20);
    let out = ws.path().join("out");
    let job = ws.path().join("job.toml");
    inferred_job(
        &job,
        &input,
        &out,
        "SELECT id, user_id, amount * 2 AS doubled, ts FROM clicks",
        "",
        "",
    );

    // `validate` prints the inferred types with the values that did not fit.
    let validated = run_sluice(&["validate", job.to_str().unwrap()], &[]);
    assert_ok(&validated);
    let report = String::from_utf8_lossy(&validated.stdout);
    // The cut-off lines are not records; every other line is sampled.
    let sampled = 2000 - (0..2000).filter(|i| i % 97 == 50).count();
    for wanted in [
        format!(
            "id Int64 (1 of {sampled} sampled values do not fit; the first at clicks-00000.json:1)"
        ),
        format!(
            "amount Float64 (1 of {sampled} sampled values do not fit; the first at clicks-00000.json:2)"
        ),
    ] {
        assert!(report.contains(&wanted), "missing {wanted:?} in: {report}");
    }

    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    assert_ok(&run);
    let table = python_read(&out);
    let types: BTreeMap<String, String> = table["schema"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f[0].as_str().unwrap().into(), f[1].as_str().unwrap().into()))
        .collect();
    assert_eq!(types["id"], "int64");
    assert_eq!(types["user_id"], "int64");
    assert_eq!(types["doubled"], "double");
    let rows = table["rows"].as_array().unwrap();
    let ids: BTreeSet<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(rows.len(), ids.len(), "duplicate rows");
    assert_eq!(
        ids, good,
        "every good record, and only those, in the output"
    );
    for r in rows {
        let i = r["id"].as_i64().unwrap();
        assert_eq!(
            r["doubled"].as_f64().unwrap(),
            ((i % 11) as f64 + 0.25) * 2.0
        );
    }
    let positions: BTreeSet<String> = dead_letter_rows(&out)
        .iter()
        .map(|r| r["_source_position"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(positions, bad, "exactly the bad records are dead letters");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_mix_is_text_and_the_plan_error_says_it_was_inferred() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    std::fs::create_dir_all(&input).unwrap();
    let mut text = String::new();
    for i in 0..200 {
        let amount = if i % 2 == 0 {
            format!("{i}")
        } else {
            format!("\"n{i}\"")
        };
        text.push_str(&format!(
            r#"{{"id":{i},"amount":{amount},"ts":"2026-11-01T10:00:00Z"}}"#
        ));
        text.push('\n');
    }
    std::fs::write(input.join("mixed.json"), text).unwrap();
    let job = ws.path().join("job.toml");
    inferred_job(
        &job,
        &input,
        &ws.path().join("out"),
        "SELECT id, amount * 2 AS doubled, ts FROM clicks",
        "",
        "",
    );
    let err = assert_fails_saying(
        &run_sluice(&["validate", job.to_str().unwrap()], &[]),
        &[
            "Column 'amount' of source 'clicks' was not declared",
            "inferred from mixed.json as: amount Utf8",
            "schema = \"amount DOUBLE",
            "CAST(amount AS DOUBLE)",
        ],
    );
    assert!(!err.contains("bug in DataFusion"), "{err}");
    assert!(
        !err.contains("'ts'"),
        "the event-time column is parsed, not at fault: {err}"
    );

    // The text column takes every value of the mix, numbers as their text.
    let out = ws.path().join("out");
    inferred_job(&job, &input, &out, "SELECT id, amount FROM clicks", "", "");
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    let rows = python_read(&out)["rows"].as_array().unwrap().clone();
    assert_eq!(rows.len(), 200, "no value of the mix is a dead letter");
    for r in &rows {
        let i = r["id"].as_i64().unwrap();
        let want = if i % 2 == 0 {
            format!("{i}")
        } else {
            format!("n{i}")
        };
        assert_eq!(r["amount"], want.as_str());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_mostly_dead_letters_trips_the_circuit_breaker() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    messy_clicks(&input, 1);
    let garbage: String = (0..500).map(|i| format!("garbage line {i}\n")).collect();
    std::fs::write(input.join("clicks-00001.json"), garbage).unwrap();
    let out = ws.path().join("out");
    let job = ws.path().join("job.toml");
    let sql = "SELECT id, amount FROM clicks";
    inferred_job(&job, &input, &out, sql, "", "");
    assert_fails_saying(
        &run_sluice(&["run", job.to_str().unwrap()], &[]),
        &[
            "batch 0 was not committed: 503 of the 600 records it read",
            "max_dead_letter_fraction = 0.1",
            "500 × \"Json error: Encountered unexpected 'g'",
        ],
    );
    assert!(
        txn_versions(&out, "contracts").is_empty(),
        "nothing committed"
    );

    // Raising the setting commits the batch, every dead letter kept.
    inferred_job(
        &job,
        &input,
        &out,
        sql,
        "max_dead_letter_fraction = 1.0",
        "",
    );
    assert_ok(&run_sluice(&["run", job.to_str().unwrap()], &[]));
    assert_eq!(dead_letter_rows(&out).len(), 503);
}

/// Sums `counters.<name>` (and the per-expectation counts) over the output table's commits
/// of the job, from the manifests the commits carry.
fn committed_counters(table: &Path) -> (BTreeMap<String, u64>, BTreeMap<String, u64>, Vec<i64>) {
    let (mut totals, mut expectations, mut batches) = (BTreeMap::new(), BTreeMap::new(), vec![]);
    for action in delta_commits(table).iter().flatten() {
        let Some(manifest) = action.pointer("/commitInfo/sluice/manifest") else {
            continue;
        };
        batches.push(manifest["batch_id"].as_i64().unwrap());
        let counters = &manifest["counters"];
        for key in ["rows_out", "rows_dropped", "rows_quarantined"] {
            *totals.entry(key.to_string()).or_default() += counters[key].as_u64().unwrap();
        }
        if let Some(map) = counters["expectations"].as_object() {
            for (name, n) in map {
                *expectations.entry(name.clone()).or_default() += n.as_u64().unwrap();
            }
        }
    }
    (totals, expectations, batches)
}

const EXPECTATIONS: &str = r#"
[[expectations]]
name = "even_id"
check = "id % 2 = 0"
on_failure = "warn"

[[expectations]]
name = "modest_amount"
check = "double_amount < 20"
on_failure = "drop"

[[expectations]]
name = "known_user"
check = "user_id <> 5"
on_failure = "quarantine"
"#;

#[tokio::test(flavor = "multi_thread")]
async fn expectations_count_exactly_and_quarantine_once_across_crashes() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 12, 20);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "expect", &input, &out, 2);
    let mut text = std::fs::read_to_string(&job).unwrap();
    text.push_str(EXPECTATIONS);
    std::fs::write(&job, text).unwrap();
    let job = job.to_str().unwrap();
    assert_ok(&run_sluice(&["validate", job], &[]));

    // Killed between the side-table and output commits of a batch that quarantines, and right
    // after another's commit; then run to the end.
    for at in ["after_side_tables:1", "after_commit:2", "after_manifest:3"] {
        let crashed = run_sluice(&["run", job], &[("SLUICE_CRASH_AT", at)]);
        assert!(!crashed.status.success(), "expected a crash at {at}");
    }
    assert_ok(&run_sluice(&["run", job], &[]));

    // What the query outputs (STATELESS_SQL): the good lines of users other than 3, with
    // user_id = i % 17 and double_amount = 2 * (i % 13) + 1 for line i (id i + 1).
    let output = events.output_ids();
    let user = |id: i64| (id - 1) % 17;
    let doubled = |id: i64| 2.0 * ((id - 1) % 13) as f64 + 1.0;
    let quarantined: BTreeSet<i64> = output.iter().copied().filter(|id| user(*id) == 5).collect();
    let too_big: BTreeSet<i64> = output
        .iter()
        .copied()
        .filter(|id| doubled(*id) >= 20.0)
        .collect();
    let odd = output.iter().filter(|id| **id % 2 != 0).count() as u64;
    let kept: BTreeSet<i64> = output
        .iter()
        .copied()
        .filter(|id| !quarantined.contains(id) && !too_big.contains(id))
        .collect();
    assert!(!quarantined.is_empty() && !too_big.is_empty() && odd > 0);

    let rows = python_read(&out)["rows"].as_array().unwrap().clone();
    let ids: Vec<i64> = rows.iter().map(|r| r["id"].as_i64().unwrap()).collect();
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        kept,
        "dropped and quarantined rows are left out, warned rows kept"
    );
    assert_eq!(ids.len(), kept.len(), "duplicate rows");

    // Quarantined rows: once each, named by the expectation, the output row as JSON in raw.
    let letters = dead_letter_rows(&out);
    let q: Vec<&Value> = letters
        .iter()
        .filter(|r| r["error"] == "known_user")
        .collect();
    let mut q_ids: Vec<i64> = q
        .iter()
        .map(|r| {
            let raw: Value = serde_json::from_str(r["raw"].as_str().unwrap()).unwrap();
            assert_eq!(raw["user_id"], 5);
            raw["id"].as_i64().unwrap()
        })
        .collect();
    q_ids.sort();
    assert_eq!(q_ids, quarantined.iter().copied().collect::<Vec<_>>());
    for r in &q {
        let id = serde_json::from_str::<Value>(r["raw"].as_str().unwrap()).unwrap()["id"]
            .as_i64()
            .unwrap();
        let file = (id - 1) / 20;
        assert_eq!(
            r["_source_offset"].as_i64().unwrap(),
            file,
            "lineage of {id}"
        );
    }

    // The counts the commits carry, summed over batches: exact, once per batch.
    let (totals, counts, batches) = committed_counters(&out);
    let distinct: BTreeSet<i64> = batches.iter().copied().collect();
    assert_eq!(distinct.len(), batches.len(), "a batch committed twice");
    assert_eq!(counts["even_id"], odd);
    assert_eq!(counts["modest_amount"], too_big.len() as u64);
    assert_eq!(counts["known_user"], quarantined.len() as u64);
    assert_eq!(totals["rows_quarantined"], quarantined.len() as u64);
    assert_eq!(
        totals["rows_dropped"],
        too_big.difference(&quarantined).count() as u64
    );
    assert_eq!(totals["rows_out"], kept.len() as u64);
    let status = status_of(&out);
    assert!(status.contains("\"known_user\":"), "{status}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_expectation_stops_the_job_naming_the_row_and_its_position() {
    let ws = tempfile::tempdir().unwrap();
    let input = ws.path().join("input");
    let events = Events::write(&input, 0, 4, 20);
    let out = ws.path().join("out");
    let job = write_job(&ws.path().join("job.toml"), "expect_fail", &input, &out, 1);
    let mut text = std::fs::read_to_string(&job).unwrap();
    text.push_str(
        r#"
[[expectations]]
name = "no_user_5"
check = "user_id <> 5"
on_failure = "fail"
"#,
    );
    std::fs::write(&job, text).unwrap();
    let run = run_sluice(&["run", job.to_str().unwrap()], &[]);
    // The failing rows: good output lines with user 5 (line i has user i % 17, id i + 1); the
    // batch of the first file holding one fails, naming one of that file's rows by its lineage
    // (partition 0, the file's offset).
    let failing: Vec<i64> = events
        .output_ids()
        .into_iter()
        .filter(|id| (id - 1) % 17 == 5)
        .collect();
    let file = (failing[0] - 1) / 20;
    let in_file = failing.iter().filter(|id| (*id - 1) / 20 == file).count();
    assert_fails_saying(
        &run,
        &[
            "expectation 'no_user_5' (check = \"user_id <> 5\") failed".to_string(),
            format!("failed on {in_file} row(s) of the batch; the first, from 0@{file}: "),
            "\"user_id\":5,".to_string(),
        ],
    );
    // Batches before it committed; the failing one did not.
    let committed = txn_versions(&out, "expect_fail");
    assert_eq!(committed, (0..file).collect::<Vec<_>>());

    // A predicate on a column the output lacks is refused by validate.
    let mut text = std::fs::read_to_string(&job).unwrap();
    text = text.replace("user_id <> 5", "usr <> 5");
    std::fs::write(&job, text).unwrap();
    assert_fails_saying(
        &run_sluice(&["validate", job.to_str().unwrap()], &[]),
        &["expectation 'no_user_5'", "usr"],
    );
}
