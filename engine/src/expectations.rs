//! Expectations: data-quality checks declared with the job, evaluated on every output row
//! before the batch commits.
//!
//! ```toml
//! [[expectations]]
//! name = "positive_amount"
//! check = "amount > 0"          # a SQL predicate over the output row
//! on_failure = "quarantine"     # warn | drop | quarantine | fail
//! ```
//!
//! Every predicate is evaluated on every output row of the batch, independently of the others,
//! so each expectation's count of failing rows is exact whatever the order they are declared in.
//! A row fails an expectation when its predicate is false; a NULL result passes, as in a SQL
//! `CHECK` constraint (write `amount IS NOT NULL AND amount > 0` to refuse nulls). Then:
//!
//! - `warn`: the row is kept and counted;
//! - `drop`: the row is left out of the output and counted;
//! - `quarantine`: the row goes to the dead-letter table in the batch's commit instead of the
//!   output — its `error` column names the expectations it failed, `raw` is the output row as
//!   JSON, and the lineage columns say where it came from;
//! - `fail`: the batch is not committed and the job stops, naming the first failing row and its
//!   source position.
//!
//! A row failing both a `drop` and a `quarantine` expectation is quarantined (nothing that can
//! be kept is lost). The counts per expectation go into the batch's manifest (`sluice status`)
//! and its log line. Rows dropped or quarantined by an expectation are the job's own rule, so
//! they do not count toward the dead-letter circuit breaker.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;

use arrow::array::{Array, AsArray, BooleanArray, RecordBatch};
use arrow::compute::{filter_record_batch, not, or};
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::DFSchema;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::prelude::SessionContext;

use crate::dead_letter::dead_letter_from_row;
use crate::error::{Error, Result};
use crate::query::Functions;
use crate::source::DeadLetter;

/// The `_source_name` of rows quarantined by a job of several sources (a job of one names it).
pub(crate) const QUARANTINE_SOURCE: &str = "(output)";

/// What happens to a row that fails an expectation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Keep the row; count it.
    Warn,
    /// Leave the row out of the output; count it.
    Drop,
    /// Write the row to the dead-letter table instead of the output; count it.
    Quarantine,
    /// Fail the batch and stop the job.
    Fail,
}

impl OnFailure {
    /// The action as a job file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            OnFailure::Warn => "warn",
            OnFailure::Drop => "drop",
            OnFailure::Quarantine => "quarantine",
            OnFailure::Fail => "fail",
        }
    }
}

impl FromStr for OnFailure {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "warn" => Ok(OnFailure::Warn),
            "drop" => Ok(OnFailure::Drop),
            "quarantine" => Ok(OnFailure::Quarantine),
            "fail" => Ok(OnFailure::Fail),
            other => Err(Error::InvalidJob(format!(
                "on_failure = \"{other}\" is not one of warn, drop, quarantine, fail"
            ))),
        }
    }
}

/// One expectation of a job. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectation {
    /// Its name: the key of its count, and the `error` of the rows it quarantines.
    pub name: String,
    /// A SQL predicate over the output row (`amount > 0`).
    pub check: String,
    /// What a failing row gets.
    pub on_failure: OnFailure,
}

/// The job's expectations, planned against the output schema.
pub(crate) struct CheckedOutput {
    /// The rows to commit.
    pub(crate) kept: Vec<RecordBatch>,
    /// Rows quarantined, as dead letters (their output row as JSON).
    pub(crate) quarantined: Vec<DeadLetter>,
    /// Rows left out by `drop` expectations (and not quarantined).
    pub(crate) dropped: u64,
    /// Failing rows per expectation.
    pub(crate) failures: BTreeMap<String, u64>,
}

/// Expectations planned once against the output schema, evaluated on every batch.
pub(crate) struct Expectations {
    planned: Vec<(Expectation, Arc<dyn PhysicalExpr>)>,
    /// The job's functions, which a check may call like the query.
    functions: Functions,
}

impl Expectations {
    /// Plans each expectation's predicate against `output`; a check may call the job's
    /// `functions` as well as DataFusion's.
    ///
    /// # Errors
    /// If two expectations share a name, or a predicate does not parse, names an unknown
    /// column, or is not a boolean.
    pub(crate) fn plan(
        expectations: &[Expectation],
        output: &SchemaRef,
        functions: &Functions,
    ) -> Result<Expectations> {
        let ctx = SessionContext::new();
        functions.register(&ctx);
        let schema = DFSchema::try_from(output.as_ref().clone())?;
        let mut planned = Vec::with_capacity(expectations.len());
        for e in expectations {
            if planned
                .iter()
                .any(|(p, _): &(Expectation, _)| p.name == e.name)
            {
                return Err(Error::InvalidJob(format!(
                    "expectation '{}' is declared twice",
                    e.name
                )));
            }
            let refuse = |why: String| {
                let columns: Vec<&str> =
                    output.fields().iter().map(|f| f.name().as_str()).collect();
                Error::InvalidJob(format!(
                    "expectation '{}': check = \"{}\" {why} (the output columns are: {})",
                    e.name,
                    e.check,
                    columns.join(", ")
                ))
            };
            let expr = ctx
                .parse_sql_expr(&e.check, &schema)
                .map_err(|err| refuse(format!("does not parse: {}", first_line(&err))))?;
            let physical = ctx
                .create_physical_expr(expr, &schema)
                .map_err(|err| refuse(format!("does not plan: {}", first_line(&err))))?;
            let data_type = physical
                .data_type(output)
                .map_err(|err| refuse(format!("does not plan: {}", first_line(&err))))?;
            if data_type != DataType::Boolean {
                return Err(refuse(format!(
                    "is a {data_type}, not a true/false predicate"
                )));
            }
            planned.push((e.clone(), physical));
        }
        Ok(Expectations {
            planned,
            functions: functions.clone(),
        })
    }

    /// The same expectations planned against another output schema (the query was planned
    /// again: a column may have moved).
    ///
    /// # Errors
    /// As [`Expectations::plan`].
    pub(crate) fn replan(&self, output: &SchemaRef) -> Result<Expectations> {
        let specs: Vec<Expectation> = self.planned.iter().map(|(e, _)| e.clone()).collect();
        Expectations::plan(&specs, output, &self.functions)
    }

    /// Whether any expectation quarantines.
    pub(crate) fn quarantines(&self) -> bool {
        self.planned
            .iter()
            .any(|(e, _)| e.on_failure == OnFailure::Quarantine)
    }

    /// Whether there are none.
    pub(crate) fn is_empty(&self) -> bool {
        self.planned.is_empty()
    }

    /// Evaluates every expectation on `output` and applies their actions.
    ///
    /// # Errors
    /// [`Error::ExpectationFailed`] for the first row failing a `fail` expectation; an error
    /// if a predicate cannot be evaluated.
    pub(crate) fn apply(&self, output: Vec<RecordBatch>) -> Result<CheckedOutput> {
        // Per batch, per expectation: the rows failing it (false; true and NULL pass).
        let mut failing: Vec<Vec<BooleanArray>> = Vec::with_capacity(output.len());
        for batch in &output {
            let mut of_batch = Vec::with_capacity(self.planned.len());
            for (e, predicate) in &self.planned {
                let rows = batch.num_rows();
                let result = predicate.evaluate(batch)?.into_array(rows)?;
                let result = result.as_boolean_opt().ok_or_else(|| {
                    Error::InvalidJob(format!("expectation '{}' did not give booleans", e.name))
                })?;
                of_batch.push(
                    (0..rows)
                        .map(|i| Some(result.is_valid(i) && !result.value(i)))
                        .collect(),
                );
            }
            failing.push(of_batch);
        }
        self.stop_on_failure(&output, &failing)?;

        let mut checked = CheckedOutput {
            kept: Vec::with_capacity(output.len()),
            quarantined: Vec::new(),
            dropped: 0,
            failures: self
                .planned
                .iter()
                .map(|(e, _)| (e.name.clone(), 0))
                .collect(),
        };
        for (batch, failing) in output.into_iter().zip(failing) {
            let rows = batch.num_rows();
            let mut drop = BooleanArray::from(vec![false; rows]);
            let mut quarantine_reasons: Vec<Vec<&str>> = vec![Vec::new(); rows];
            for ((e, _), failing) in self.planned.iter().zip(&failing) {
                *checked.failures.entry(e.name.clone()).or_default() += failing.true_count() as u64;
                match e.on_failure {
                    OnFailure::Warn | OnFailure::Fail => {}
                    OnFailure::Drop => drop = or(&drop, failing)?,
                    OnFailure::Quarantine => {
                        for (i, reasons) in quarantine_reasons.iter_mut().enumerate() {
                            if failing.value(i) {
                                reasons.push(&e.name);
                            }
                        }
                    }
                }
            }
            let quarantined: BooleanArray = quarantine_reasons
                .iter()
                .map(|r| Some(!r.is_empty()))
                .collect();
            for (i, reasons) in quarantine_reasons.iter().enumerate() {
                if !reasons.is_empty() {
                    let letter = dead_letter_from_row(&batch.slice(i, 1), &reasons.join(", "))?;
                    checked.quarantined.push(letter);
                }
            }
            checked.dropped += (0..rows)
                .filter(|&i| drop.value(i) && !quarantined.value(i))
                .count() as u64;
            let leave_out = or(&drop, &quarantined)?;
            if leave_out.true_count() == 0 {
                checked.kept.push(batch);
            } else {
                checked
                    .kept
                    .push(filter_record_batch(&batch, &not(&leave_out)?)?);
            }
        }
        Ok(checked)
    }

    /// The first `fail` expectation (in declared order) that a row fails stops the batch,
    /// naming how many rows fail it and the one read first (lowest partition and offset; the
    /// output order among rows of one offset).
    fn stop_on_failure(&self, output: &[RecordBatch], failing: &[Vec<BooleanArray>]) -> Result<()> {
        for (index, (e, _)) in self.planned.iter().enumerate() {
            if e.on_failure != OnFailure::Fail {
                continue;
            }
            let count: usize = failing.iter().map(|f| f[index].true_count()).sum();
            if count == 0 {
                continue;
            }
            let mut first: Option<DeadLetter> = None;
            for (batch, failing) in output.iter().zip(failing) {
                for i in (0..batch.num_rows()).filter(|&i| failing[index].value(i)) {
                    let letter = dead_letter_from_row(&batch.slice(i, 1), &e.name)?;
                    let earlier = first
                        .as_ref()
                        .is_none_or(|f| read_order(&letter) < read_order(f));
                    if earlier {
                        first = Some(letter);
                    }
                }
            }
            let Some(first) = first else { continue };
            return Err(Error::ExpectationFailed {
                name: e.name.clone(),
                check: e.check.clone(),
                failing: count as u64,
                row: String::from_utf8_lossy(&first.raw).into_owned(),
                position: first.position,
            });
        }
        Ok(())
    }
}

/// Where a row was read, in read order: partition (numerically when it is a number), offset.
fn read_order(letter: &DeadLetter) -> (Option<i64>, &str, i64) {
    (
        letter.partition.parse().ok(),
        letter.partition.as_str(),
        letter.offset,
    )
}

/// The first line of an error, without DataFusion's prefixes repeated.
fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};

    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};

    fn output() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("amount", DataType::Float64, true),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5])),
                Arc::new(Float64Array::from(vec![
                    Some(1.0),
                    Some(-1.0),
                    None,
                    Some(-2.0),
                    Some(3.0),
                ])),
                Arc::new(StringArray::from(vec!["0"; 5])),
                Arc::new(Int64Array::from(vec![10, 11, 12, 13, 14])),
            ],
        )
        .unwrap()
    }

    fn expect(name: &str, check: &str, on_failure: OnFailure) -> Expectation {
        Expectation {
            name: name.into(),
            check: check.into(),
            on_failure,
        }
    }

    fn ids(batches: &[RecordBatch]) -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            })
            .collect()
    }

    #[test]
    fn each_action_counts_exactly_and_null_passes() {
        let batch = output();
        let schema = batch.schema();
        let all = [
            expect("positive", "amount > 0", OnFailure::Quarantine),
            expect("small_id", "id < 5", OnFailure::Drop),
            expect("odd", "id % 2 = 1", OnFailure::Warn),
        ];
        let planned = Expectations::plan(&all, &schema, &Functions::default()).unwrap();
        let checked = planned.apply(vec![batch]).unwrap();
        // amount: 1, -1, NULL, -2, 3 → ids 2 and 4 fail `positive`; id 5 fails `small_id`;
        // ids 2 and 4 fail `odd`.
        assert_eq!(checked.failures["positive"], 2);
        assert_eq!(checked.failures["small_id"], 1);
        assert_eq!(checked.failures["odd"], 2);
        assert_eq!(ids(&checked.kept), vec![1, 3]);
        assert_eq!(checked.dropped, 1);
        let quarantined: Vec<(i64, &str)> = checked
            .quarantined
            .iter()
            .map(|l| (l.offset, l.error.as_str()))
            .collect();
        assert_eq!(quarantined, vec![(11, "positive"), (13, "positive")]);
        assert_eq!(
            String::from_utf8_lossy(&checked.quarantined[0].raw),
            r#"{"id":2,"amount":-1.0}"#
        );
    }

    #[test]
    fn fail_names_the_first_failing_row_and_where_it_came_from() {
        let batch = output();
        let schema = batch.schema();
        let planned = Expectations::plan(
            &[expect("positive", "amount > 0", OnFailure::Fail)],
            &schema,
            &Functions::default(),
        )
        .unwrap();
        let e = planned.apply(vec![batch]).err().unwrap().to_string();
        assert!(e.contains("'positive'") && e.contains("0@11"), "{e}");
        assert!(e.contains(r#"{"id":2,"amount":-1.0}"#), "{e}");
    }

    #[test]
    fn predicates_are_checked_against_the_output_schema() {
        let schema = output().schema();
        for (check, wanted) in [
            ("amout > 0", "amout"),
            ("amount + 1", "not a true/false predicate"),
            ("amount >", "does not parse"),
        ] {
            let e = Expectations::plan(
                &[expect("x", check, OnFailure::Warn)],
                &schema,
                &Functions::default(),
            )
            .err()
            .unwrap()
            .to_string();
            assert!(
                e.contains(wanted) && e.contains("output columns"),
                "{check}: {e}"
            );
        }
    }
}
