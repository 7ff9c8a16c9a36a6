//! A chain of two stateful operators: a join of two streams whose output feeds an aggregate.
//!
//! Nexmark q4 is the example: the top bid per auction, once the auction has expired (a join of
//! auctions and bids, with the per-key closing of [`super::closing`] above it), then the
//! running average of those top bids per category:
//!
//! ```sql
//! SELECT Q.category, AVG(Q.final)
//! FROM (SELECT MAX(B.price) AS final, A.category
//!       FROM auction A, bid B
//!       WHERE A.id = B.auction AND B.date_time BETWEEN A.date_time AND A.expires
//!       GROUP BY A.id, A.category) Q
//! GROUP BY Q.category
//! ```
//!
//! The query is cut below the aggregate that the join cannot run (the outer one): the part
//! under the cut is planned as the join ([`super::join`]), operator `0-join`; the part above
//! reads the join's output from an in-memory table, like a source, and is planned as the
//! aggregate ([`super::aggregate`]), operator `1-aggregate`. Each batch the join runs first;
//! the rows it emits are that batch's input of the aggregate. Both keep their state files
//! (the aggregate's in a folder of its own), both listed in the manifest and made live by the
//! one Delta commit.
//!
//! What a join emits is final (each pair, each closed key, each unmatched row once), so any
//! aggregate over it may run. It runs as a **running aggregate** (update mode, `state_ttl`):
//! windows over the join's output are not built, as the join emits rows late by design (a key
//! closes after the watermark passed it). Its event time — what `state_ttl` counts from — is the
//! watermark under which the join emitted the row (a hidden column of the table it reads), so
//! a group is forgotten once the watermark is `state_ttl` past the last batch that fed it.
//! Rows the join emits before the job has a watermark (a partition has not delivered yet)
//! carry no such time: they count as the end of time, so their groups are kept for good —
//! never forgotten early, at the cost of state for those groups.
//!
//! A group's expiry thus depends on the watermarks of the batches that fed it (as a running
//! aggregate's over a source does on its rows' times and the batches' watermarks); reconcile
//! compares such a job only while no group can have expired.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, SchemaRef, TimeUnit};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{DFSchema, TableReference};
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;

use super::aggregate::{StatefulAggregate, StatefulSettings, plan_stateful};
use super::join::{JoinSettings, StreamJoin, plan_stream_join};
use super::{FailedRow, OperatorDescription, QueryOutput};
use crate::error::{Error, Result};
use crate::sink::OutputMode;

/// The table the aggregate reads the join's output from.
pub(crate) const JOINED_TABLE: &str = "__sluice_joined";
/// The hidden column of [`JOINED_TABLE`]: the watermark under which the join emitted the row,
/// the aggregate's event time.
const EMITTED_AT: &str = "__sluice_emitted_at";

/// A join of two streams and the aggregate over its output.
#[derive(Debug)]
pub(crate) struct JoinAggregate {
    pub(crate) join: StreamJoin,
    pub(crate) aggregate: StatefulAggregate,
    /// The table the aggregate reads: the join's output columns and [`EMITTED_AT`] as `c0`,
    /// `c1`, … (see [`super::stand_in`]).
    joined: Arc<MemTable>,
    joined_schema: SchemaRef,
    /// The join's output schema, with its column names (for dead letters).
    join_output: SchemaRef,
}

/// Plans `plan` as a join of streams (`found`) feeding an aggregate, cut below the highest
/// aggregate over the join whose input the join runs whole (with per-key closing). `None` if
/// there is no such aggregate: the query is not a chain of these two.
///
/// The join takes `state_ttl` only if its condition leaves a side unbounded; it bounds the
/// aggregate's groups either way. `partitions` is how many parts the table the aggregate
/// reads has (the source tables'); `alone` is why the join cannot run the whole query, told
/// where the chain is refused for its output mode.
///
/// # Errors
/// If the part above the cut is not an aggregate the engine runs over the join's output.
pub(crate) async fn plan_join_aggregate(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    found: &LogicalPlan,
    settings: StatefulSettings<'_>,
    partitions: usize,
    alone: &Error,
) -> Result<Option<JoinAggregate>> {
    // The aggregates with the join below them, the highest first.
    let mut above = Vec::new();
    let _ = plan.apply(|node| {
        if let LogicalPlan::Aggregate(a) = node
            && a.input.exists(|n| Ok(n == found)).unwrap_or(false)
        {
            above.push(Arc::clone(&a.input));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let join_settings = |state_ttl| JoinSettings {
        event_time: settings.event_time,
        mode: OutputMode::Append,
        state_ttl,
        allowed_lateness: settings.allowed_lateness,
        statics: settings.statics,
    };
    let mut cut = None;
    for input in above {
        let planned = match plan_stream_join(ctx, &input, found, join_settings(None)) {
            Ok(join) => Ok(join),
            Err(_) if settings.state_ttl.is_some() => {
                plan_stream_join(ctx, &input, found, join_settings(settings.state_ttl))
            }
            Err(e) => Err(e),
        };
        if let Ok(join) = planned {
            cut = Some((input, join));
            break;
        }
    }
    let Some((input, join)) = cut else {
        return Ok(None);
    };

    // The table the aggregate reads, renamed to the join's output columns (qualified as the
    // plan above the cut names them), and the hidden time.
    let join_output = join.output_schema();
    // The table is read by position: the join's output must be the cut's columns, in order.
    let cut_types: Vec<&DataType> = input
        .schema()
        .fields()
        .iter()
        .map(|f| f.data_type())
        .collect();
    let output_types: Vec<&DataType> = join_output.fields().iter().map(|f| f.data_type()).collect();
    if cut_types != output_types {
        return Err(Error::UnsupportedQuery(format!(
            "the join's output ({join_output}) does not have the columns of the query part it \
             runs ({}), so the aggregate above it cannot read them",
            input.schema()
        )));
    }
    let mut columns: Vec<(Option<TableReference>, Arc<Field>)> = input
        .schema()
        .iter()
        .map(|(qualifier, field)| (qualifier.cloned(), Arc::clone(field)))
        .collect();
    columns.push((
        None,
        Arc::new(Field::new(EMITTED_AT, emitted_at_type(), true)),
    ));
    let columns = DFSchema::new_with_metadata(columns, Default::default())?;
    let (joined, joined_schema, scan) =
        super::stand_in_in_parts(JOINED_TABLE, &columns, partitions)?;
    let upper = super::replace_node(plan, &input, &scan)?;

    let event_time = BTreeMap::from([(JOINED_TABLE.to_string(), EMITTED_AT.to_string())]);
    let aggregate_settings = StatefulSettings {
        event_time: &event_time,
        ..settings
    };
    let refuse = |why: &str| {
        Error::UnsupportedQuery(format!(
            "the query joins two streams, then aggregates the join's output: {why}"
        ))
    };
    if settings.mode != OutputMode::Update {
        // Why the join alone refused the query is news only in append mode: in update mode it
        // always refuses (it emits each pair once).
        return Err(refuse(&format!(
            "that aggregate runs as a running aggregate, which upserts each group as the join \
             feeds it: set mode = \"update\" in [sink] (and state_ttl in [query]); run by the \
             join alone, in append mode, the query is refused: {alone}"
        )));
    }
    let aggregate = match plan_stateful(ctx, &upper, &[], aggregate_settings).await {
        Ok(Some(aggregate)) if aggregate.window().is_none() => aggregate,
        Ok(_) => {
            return Err(refuse(
                "the aggregate over the join's output runs as a running aggregate (GROUP BY \
                 without a window; update mode and state_ttl); windows over a join's output \
                 are not built",
            ));
        }
        Err(Error::UnsupportedQuery(why)) => return Err(refuse(&why)),
        Err(e) => return Err(e),
    };
    Ok(Some(JoinAggregate {
        join,
        aggregate,
        joined,
        joined_schema,
        join_output,
    }))
}

/// The type of [`EMITTED_AT`]: a watermark, µs since the epoch in UTC.
fn emitted_at_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

impl JoinAggregate {
    /// The table the aggregate reads the join's output from, with its schema: filled each batch
    /// like a source's table.
    pub(crate) fn joined_table(&self) -> (SchemaRef, Arc<MemTable>) {
        (Arc::clone(&self.joined_schema), Arc::clone(&self.joined))
    }

    /// The join's output rows as the aggregate reads them: renamed, and each timed with
    /// `emitted_at` (the watermark under which the join emitted it; `None` before the job has
    /// one: never forgotten).
    pub(crate) fn joined_rows(
        &self,
        rows: Vec<RecordBatch>,
        emitted_at: Option<i64>,
    ) -> Result<Vec<RecordBatch>> {
        let time = emitted_at.unwrap_or(i64::MAX);
        rows.into_iter()
            .filter(|b| b.num_rows() > 0)
            .map(|b| {
                let mut columns: Vec<ArrayRef> = b.columns().to_vec();
                columns.push(Arc::new(
                    TimestampMicrosecondArray::from(vec![time; b.num_rows()])
                        .with_data_type(emitted_at_type()),
                ));
                Ok(RecordBatch::try_new(
                    Arc::clone(&self.joined_schema),
                    columns,
                )?)
            })
            .collect()
    }

    /// A dead letter of the aggregate, named after where it failed: a row of the join's output
    /// the aggregate's input failed on (its columns under their names) comes from `0-join`, a
    /// group whose output failed from `1-aggregate`.
    pub(crate) fn named_failure(&self, failed: FailedRow) -> Result<FailedRow> {
        if failed.source != JOINED_TABLE {
            return Ok(failed);
        }
        if failed.row.schema() != self.joined_schema {
            return Ok(FailedRow {
                source: StatefulAggregate::id(1),
                ..failed
            });
        }
        let width = self.join_output.fields().len();
        let row = RecordBatch::try_new(
            Arc::clone(&self.join_output),
            failed.row.columns()[..width].to_vec(),
        )?;
        Ok(FailedRow {
            source: StreamJoin::id(0),
            row: super::without_source_row(&row, &format!("output of {}", StreamJoin::id(0)))?,
            error: failed.error,
        })
    }

    /// The aggregate's groups to write: what its output mode emits under the batch's new
    /// watermark; dead letters named after their operator.
    ///
    /// # Errors
    /// If the part above the aggregate fails other than on values.
    pub(crate) async fn emit(
        &mut self,
        ctx: &SessionContext,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        let out = self.aggregate.emit(ctx, watermark).await?;
        self.named_failures(out)
    }

    /// The end of a bounded run: every group of the aggregate, as [`JoinAggregate::emit`].
    ///
    /// # Errors
    /// As [`JoinAggregate::emit`].
    pub(crate) async fn emit_all(&mut self, ctx: &SessionContext) -> Result<QueryOutput> {
        let out = self.aggregate.emit_all(ctx).await?;
        self.named_failures(out)
    }

    fn named_failures(&self, mut out: QueryOutput) -> Result<QueryOutput> {
        out.failed = std::mem::take(&mut out.failed)
            .into_iter()
            .map(|f| self.named_failure(f))
            .collect::<Result<_>>()?;
        Ok(out)
    }

    /// Both operators as `sluice validate` shows them.
    pub(crate) fn describe(&self) -> Vec<OperatorDescription> {
        let mut aggregate = self.aggregate.describe(1);
        aggregate.what = format!(
            "{} of the join's output ({})",
            aggregate.what.replace(&format!(" over {JOINED_TABLE}"), ""),
            StreamJoin::id(0)
        );
        aggregate.purge = aggregate.purge.replace(
            "past its newest event",
            "past the watermark of the batch that last fed it (never, once a batch without a \
             watermark fed it)",
        );
        vec![self.join.describe(0), aggregate]
    }
}
