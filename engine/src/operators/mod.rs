//! The stateful operators of a query: the parts that keep state between batches.
//!
//! A streaming query is planned into a stateless part (expressions, filters, unions: each
//! batch's output depends on its rows only; see [`crate::query`]) and the operators here, each
//! of which holds state that the next batch needs. Every operator's state lives in immutable
//! Parquet files under the checkpoint ([`state_store`]), listed in the batch manifest and made
//! live by the same Delta commit as the batch's output and offsets, and is bounded by its own
//! purge rule (the watermark passing a window's end plus the allowed lateness, or `state_ttl`).
//!
//! - [`aggregate`] — `StatefulAggregate`: a windowed (`tumble`, `hop`, `session`) or running
//!   aggregate; how a query is split at it, what it emits in append and update mode.
//! - [`aggregate_state`] — `AggregateState`: DataFusion's own accumulator states as the
//!   aggregate's state (partial → merge → final), so any aggregate, a UDAF included, restores.
//! - [`deduplicate`] — `Deduplication`: the first row per key to arrive (`ROW_NUMBER() … = 1`,
//!   `SELECT DISTINCT`), each key remembered for `state_ttl` of event time.
//! - [`join`] — `StreamJoin`: two streams joined on a key within a bound of event time, both
//!   sides buffered until the watermark shows no match can come.
//! - `chain` — `JoinAggregate`: a join of two streams whose output feeds a running aggregate
//!   (Nexmark q4), two operators in one job.
//! - `closing` — `HeldPairs`: the SQL above a join that groups or partitions by one side's key,
//!   run over the pairs of that side's rows once they have left the join's state (Nexmark q9).
//! - [`window_join`] — `WindowJoin`: two windowed aggregates joined on their windows, each
//!   window pair joined in the batch that closes both (no state of its own).
//! - `panes` — `Panes`: an aggregate over hopping windows computed per row's newest window,
//!   each partial row then given to every window of its pane.
//! - `group_table` — `GroupTable`: the aggregate's state in memory, one row per live group.
//! - [`state_store`] — `StateLog`: state files (a base snapshot plus per-batch deltas),
//!   compacted and garbage-collected up to the committed batch.
//!
//! This module depends on nothing of the query planner: the types an operator's execution
//! yields ([`QueryOutput`], [`FailedRow`]) are defined here and used by [`crate::query`].

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, DFSchema, ScalarValue};
use datafusion::datasource::provider_as_source;
use datafusion::error::DataFusionError;
use datafusion::logical_expr::{
    BinaryExpr, Expr, JoinType, LogicalPlan, LogicalPlanBuilder, Operator, Projection,
};
use datafusion::prelude::SessionContext;

use crate::error::Error;
use crate::offsets::BatchId;
use crate::window::WindowUse;
use aggregate::{StateSize, StatefulAggregate, StatefulSettings, plan_stateful};
pub(crate) use chain::{JOINED_TABLE, JoinAggregate};
use deduplicate::{DedupSettings, Deduplication, plan_deduplication};
use join::{JoinSettings, StreamJoin, plan_stream_join};
use state_store::{StateLog, StateWrite};
use window_join::{WindowJoin, plan_window_join};

pub mod aggregate;
pub mod aggregate_state;
mod chain;
mod closing;
pub mod deduplicate;
mod group_table;
pub mod join;
mod panes;
pub mod state_store;
pub mod window_join;

/// The query's stateful operators: one per job, the two aggregates of a window join, or a join
/// of two streams feeding an aggregate.
#[derive(Debug)]
pub(crate) enum StatefulOperator {
    /// A windowed or running aggregate.
    Aggregate(Box<StatefulAggregate>),
    /// The first row per key.
    Deduplication(Box<Deduplication>),
    /// A join of two streams.
    Join(Box<StreamJoin>),
    /// Two windowed aggregates joined on their windows.
    WindowJoin(Box<WindowJoin>),
    /// A join of two streams, then an aggregate over its output.
    JoinAggregate(Box<JoinAggregate>),
}

/// Plans the stateful operator of `plan`, if it needs one: a join of two windowed aggregates, a
/// join of two streams, a deduplication (`ROW_NUMBER() … = 1`, `SELECT DISTINCT` over the
/// stream) or an aggregate.
///
/// # Errors
/// If the plan needs state no operator keeps, naming the node and why.
pub(crate) async fn plan_operator(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    uses: &[WindowUse],
    settings: StatefulSettings<'_>,
    lineage: bool,
) -> Result<Option<StatefulOperator>, Error> {
    if stateful_node(plan, settings.statics).is_none() {
        return Ok(None);
    }
    let joins = join::find(plan, settings.statics);
    if let Some(found) = joins.first() {
        let dedups = deduplicate::find(plan, settings.statics);
        if joins.len() > 1 || !dedups.is_empty() {
            return Err(Error::UnsupportedQuery(format!(
                "the query joins streams {} times and deduplicates {} times; a job runs one \
                 stateful operator (or a join of two streams feeding an aggregate) for now — \
                 longer chains are not built yet",
                joins.len(),
                dedups.len()
            )));
        }
        if window_join::joins_aggregates(found, settings.statics) {
            return Ok(Some(StatefulOperator::WindowJoin(Box::new(
                plan_window_join(ctx, plan, found, uses, settings).await?,
            ))));
        }
        let join = JoinSettings {
            event_time: settings.event_time,
            mode: settings.mode,
            state_ttl: settings.state_ttl,
            allowed_lateness: settings.allowed_lateness,
            statics: settings.statics,
        };
        // A join the SQL above cannot run over may feed an aggregate: a chain of the two.
        return match plan_stream_join(ctx, plan, found, join) {
            Ok(join) => Ok(Some(StatefulOperator::Join(Box::new(join)))),
            Err(alone) => {
                let partitions = ctx.state().config().target_partitions();
                let chain =
                    chain::plan_join_aggregate(ctx, plan, found, settings, partitions, &alone);
                match chain.await? {
                    Some(chain) => Ok(Some(StatefulOperator::JoinAggregate(Box::new(chain)))),
                    None => Err(alone),
                }
            }
        };
    }
    match deduplicate::find(plan, settings.statics).as_slice() {
        [] => Ok(plan_stateful(ctx, plan, uses, settings)
            .await?
            .map(|a| StatefulOperator::Aggregate(Box::new(a)))),
        [one] => {
            let dedup = DedupSettings {
                event_time: settings.event_time,
                mode: settings.mode,
                state_ttl: settings.state_ttl,
                statics: settings.statics,
                lineage,
            };
            Ok(Some(StatefulOperator::Deduplication(Box::new(
                plan_deduplication(plan, one, dedup)?,
            ))))
        }
        several => Err(Error::UnsupportedQuery(format!(
            "the query deduplicates {} times ({}); a job runs one stateful operator for now",
            several.len(),
            several
                .iter()
                .map(|d| format!("`{}`", d.display()))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

impl StatefulOperator {
    /// Each operator that keeps state, in chain order: its id in the manifest (its position
    /// in the chain, and its kind) and what its state means (see
    /// [`StatefulAggregate::fingerprint`]), recorded in the manifest.
    pub(crate) fn fingerprints(&self) -> Vec<(String, String)> {
        match self {
            StatefulOperator::Aggregate(a) => vec![(StatefulAggregate::id(0), a.fingerprint())],
            StatefulOperator::Deduplication(d) => vec![(Deduplication::id(0), d.fingerprint())],
            StatefulOperator::Join(j) => vec![(StreamJoin::id(0), j.fingerprint())],
            StatefulOperator::JoinAggregate(c) => vec![
                (StreamJoin::id(0), c.join.fingerprint()),
                (StatefulAggregate::id(1), c.aggregate.fingerprint()),
            ],
            StatefulOperator::WindowJoin(w) => w
                .sides()
                .iter()
                .enumerate()
                .map(|(i, a)| (StatefulAggregate::id(i), a.fingerprint()))
                .collect(),
        }
    }

    /// The operators as `sluice validate` shows them, in chain order.
    pub(crate) fn describe(&self) -> Vec<OperatorDescription> {
        match self {
            StatefulOperator::Aggregate(a) => vec![a.describe(0)],
            StatefulOperator::Deduplication(d) => vec![d.describe(0)],
            StatefulOperator::Join(j) => vec![j.describe(0)],
            StatefulOperator::WindowJoin(w) => w.describe(),
            StatefulOperator::JoinAggregate(c) => c.describe(),
        }
    }

    /// The aggregate, if the operator is one or ends in one.
    pub(crate) fn aggregate(&self) -> Option<&StatefulAggregate> {
        match self {
            StatefulOperator::Aggregate(a) => Some(a),
            StatefulOperator::JoinAggregate(c) => Some(&c.aggregate),
            _ => None,
        }
    }

    /// The deduplication, if the operator is one.
    pub(crate) fn deduplication(&self) -> Option<&Deduplication> {
        match self {
            StatefulOperator::Deduplication(d) => Some(d),
            _ => None,
        }
    }

    /// The join of two streams, if the operator is one (alone: its plan is the query's).
    pub(crate) fn join(&self) -> Option<&StreamJoin> {
        match self {
            StatefulOperator::Join(j) => Some(j),
            _ => None,
        }
    }

    /// The join of two streams, alone or feeding an aggregate.
    pub(crate) fn stream_join(&self) -> Option<&StreamJoin> {
        match self {
            StatefulOperator::Join(j) => Some(j),
            StatefulOperator::JoinAggregate(c) => Some(&c.join),
            _ => None,
        }
    }

    /// The window join, if the operator is one.
    pub(crate) fn window_join(&self) -> Option<&WindowJoin> {
        match self {
            StatefulOperator::WindowJoin(w) => Some(w),
            _ => None,
        }
    }

    /// Restores the state from the files a committed manifest lists per operator id, minus
    /// what `watermark` has purged. `log` is the state folder of the first operator; each
    /// further one keeps its files in a folder of its own under it, named after its id.
    pub(crate) async fn restore(
        &mut self,
        log: StateLog,
        files: &BTreeMap<String, Vec<String>>,
        watermark: Option<i64>,
    ) -> Result<(), Error> {
        let files_of = |id: String| files.get(&id).cloned().unwrap_or_default();
        match self {
            StatefulOperator::Aggregate(a) => {
                a.restore(log, &files_of(StatefulAggregate::id(0)), watermark)
                    .await
            }
            StatefulOperator::Deduplication(d) => {
                d.restore(log, &files_of(Deduplication::id(0)), watermark)
                    .await
            }
            StatefulOperator::Join(j) => {
                j.restore(log, &files_of(StreamJoin::id(0)), watermark)
                    .await
            }
            StatefulOperator::WindowJoin(w) => {
                let right_log = log.child(&StatefulAggregate::id(1));
                let [left, right] = w.sides_mut();
                left.restore(log, &files_of(StatefulAggregate::id(0)), watermark)
                    .await?;
                right
                    .restore(right_log, &files_of(StatefulAggregate::id(1)), watermark)
                    .await
            }
            StatefulOperator::JoinAggregate(c) => {
                let aggregate_log = log.child(&StatefulAggregate::id(1));
                c.join
                    .restore(log, &files_of(StreamJoin::id(0)), watermark)
                    .await?;
                c.aggregate
                    .restore(
                        aggregate_log,
                        &files_of(StatefulAggregate::id(1)),
                        watermark,
                    )
                    .await
            }
        }
    }

    /// Writes the batch's state (a delta or a new base) per operator id: the live files for
    /// the manifest.
    pub(crate) async fn write_state(
        &mut self,
        batch_id: BatchId,
    ) -> Result<Vec<(String, StateWrite)>, Error> {
        Ok(match self {
            StatefulOperator::Aggregate(a) => {
                vec![(StatefulAggregate::id(0), a.write_state(batch_id).await?)]
            }
            StatefulOperator::Deduplication(d) => {
                vec![(Deduplication::id(0), d.write_state(batch_id).await?)]
            }
            StatefulOperator::Join(j) => vec![(StreamJoin::id(0), j.write_state(batch_id).await?)],
            StatefulOperator::WindowJoin(w) => {
                let mut written = Vec::new();
                for (i, side) in w.sides_mut().into_iter().enumerate() {
                    written.push((StatefulAggregate::id(i), side.write_state(batch_id).await?));
                }
                written
            }
            StatefulOperator::JoinAggregate(c) => vec![
                (StreamJoin::id(0), c.join.write_state(batch_id).await?),
                (
                    StatefulAggregate::id(1),
                    c.aggregate.write_state(batch_id).await?,
                ),
            ],
        })
    }

    /// The operators' state files, once restored.
    fn logs(&self) -> Vec<&StateLog> {
        match self {
            StatefulOperator::Aggregate(a) => a.log().into_iter().collect(),
            StatefulOperator::Deduplication(d) => d.log().into_iter().collect(),
            StatefulOperator::Join(j) => j.log().into_iter().collect(),
            StatefulOperator::WindowJoin(w) => w.sides().iter().filter_map(|a| a.log()).collect(),
            StatefulOperator::JoinAggregate(c) => {
                c.join.log().into_iter().chain(c.aggregate.log()).collect()
            }
        }
    }

    /// The state folder, once restored (for messages).
    pub(crate) fn state_location(&self) -> Option<String> {
        self.logs().first().map(|log| log.location())
    }

    /// Takes `files` (per operator id) as the live state: a manifest another attempt wrote
    /// first, recording `watermark`. A join of streams reloads its rows from them: another
    /// attempt numbered the rows it kept (and recorded their matches) in an order of its own.
    pub(crate) async fn adopt_state(
        &mut self,
        files: &BTreeMap<String, Vec<String>>,
        watermark: Option<i64>,
    ) -> Result<(), Error> {
        let unrestored = || Error::InvalidJob("state adopted before it was restored".into());
        let files_of = |id: String| files.get(&id).cloned().unwrap_or_default();
        match self {
            StatefulOperator::Aggregate(a) => {
                let log = a.log_mut().ok_or_else(unrestored)?;
                log.adopt(&files_of(StatefulAggregate::id(0))).await
            }
            StatefulOperator::Deduplication(d) => {
                let log = d.log_mut().ok_or_else(unrestored)?;
                log.adopt(&files_of(Deduplication::id(0))).await
            }
            StatefulOperator::Join(j) => {
                let log = j.take_log().ok_or_else(unrestored)?;
                j.restore(log, &files_of(StreamJoin::id(0)), watermark)
                    .await
            }
            StatefulOperator::WindowJoin(w) => {
                for (i, side) in w.sides_mut().into_iter().enumerate() {
                    let log = side.log_mut().ok_or_else(unrestored)?;
                    log.adopt(&files_of(StatefulAggregate::id(i))).await?;
                }
                Ok(())
            }
            // The aggregate is reloaded too: its groups are what the join fed it, and the
            // other attempt's join may have emitted other rows (ties in a per-key window
            // function broken otherwise).
            StatefulOperator::JoinAggregate(c) => {
                let log = c.join.take_log().ok_or_else(unrestored)?;
                c.join
                    .restore(log, &files_of(StreamJoin::id(0)), watermark)
                    .await?;
                let log = c.aggregate.take_log().ok_or_else(unrestored)?;
                c.aggregate
                    .restore(log, &files_of(StatefulAggregate::id(1)), watermark)
                    .await
            }
        }
    }

    /// Deletes state files of batches up to `committed` no longer live.
    pub(crate) async fn collect_garbage(&self, committed: BatchId) -> Result<usize, Error> {
        let mut deleted = 0;
        for log in self.logs() {
            deleted += log.collect_garbage(committed).await?;
        }
        Ok(deleted)
    }

    /// Rows and in-memory bytes of the state.
    pub(crate) fn state_size(&self) -> StateSize {
        match self {
            StatefulOperator::Aggregate(a) => a.state_size(),
            StatefulOperator::Deduplication(d) => d.state_size(),
            StatefulOperator::Join(j) => j.state_size(),
            StatefulOperator::WindowJoin(w) => {
                let [left, right] = w.sides();
                left.state_size() + right.state_size()
            }
            StatefulOperator::JoinAggregate(c) => c.join.state_size() + c.aggregate.state_size(),
        }
    }
}

/// `plan` with every occurrence of `node` replaced by `with` (the operator's part of a plan
/// replaced by the scan its upper part reads).
pub(crate) fn replace_node(
    plan: &LogicalPlan,
    node: &LogicalPlan,
    with: &LogicalPlan,
) -> Result<LogicalPlan, Error> {
    let replaced = plan.clone().transform_down(|n| {
        if n == *node {
            Ok(Transformed::new(
                with.clone(),
                true,
                TreeNodeRecursion::Jump,
            ))
        } else {
            Ok(Transformed::no(n))
        }
    })?;
    Ok(replaced.data)
}

/// `row` (one row an operator made, not read from a source) as a dead letter's row: with an
/// empty `_source_partition`, `_source_offset` -1 and `position` as `_source_position` (any
/// lineage columns it carried — a pair carries both rows' — left out).
pub(crate) fn without_source_row(row: &RecordBatch, position: &str) -> Result<RecordBatch, Error> {
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION};
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::DataType;

    let (mut fields, mut columns): (Vec<Field>, Vec<_>) = row
        .schema()
        .fields()
        .iter()
        .zip(row.columns())
        .filter(|(f, _)| !crate::source::is_lineage(f.name()))
        .map(|(f, c)| (f.as_ref().clone(), Arc::clone(c)))
        .unzip();
    fields.push(Field::new(SOURCE_PARTITION, DataType::Utf8, false));
    columns.push(Arc::new(StringArray::from(vec![""])));
    fields.push(Field::new(SOURCE_OFFSET, DataType::Int64, false));
    columns.push(Arc::new(Int64Array::from(vec![-1])));
    fields.push(Field::new(SOURCE_POSITION, DataType::Utf8, false));
    columns.push(Arc::new(StringArray::from(vec![position.to_string()])));
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// A stand-in for a part of a plan whose rows an operator supplies each batch: an in-memory
/// table `name` with columns `c0`, `c1`, … of `schema`'s types (nullable), its schema, and a
/// scan of it renamed to `schema`'s qualified columns, to replace the part in the plan above.
pub(crate) fn stand_in(
    name: &str,
    schema: &DFSchema,
) -> Result<(Arc<MemTable>, SchemaRef, LogicalPlan), Error> {
    stand_in_in_parts(name, schema, 1)
}

/// [`stand_in`] with a table of `partitions` parts (rows filled like a source's table).
pub(crate) fn stand_in_in_parts(
    name: &str,
    schema: &DFSchema,
    partitions: usize,
) -> Result<(Arc<MemTable>, SchemaRef, LogicalPlan), Error> {
    let stored = Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| Field::new(format!("c{i}"), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let parts = (0..partitions.max(1)).map(|_| Vec::new()).collect();
    let table = Arc::new(MemTable::try_new(Arc::clone(&stored), parts)?);
    let renamed = schema
        .iter()
        .enumerate()
        .map(|(i, (qualifier, field))| {
            Expr::Column(Column::new(Some(name), format!("c{i}")))
                .alias_qualified(qualifier.cloned(), field.name())
        })
        .collect::<Vec<_>>();
    let scan = LogicalPlanBuilder::scan(name, provider_as_source(Arc::clone(&table) as _), None)?
        .project(renamed)?
        .build()?;
    Ok((table, stored, scan))
}

/// A stream `upper` reads beside the operator's output table `own` (subqueries included), if
/// any: an operator's upper part may join static tables, never read another stream.
pub(crate) fn other_stream(
    upper: &LogicalPlan,
    own: &str,
    statics: &BTreeSet<String>,
) -> Option<String> {
    let mut found = None;
    // The visitor never fails.
    let _ = upper.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            let name = scan.table_name.table();
            if name != own && !statics.contains(&name.to_lowercase()) {
                found = Some(name.to_string());
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// Adds the columns `names` to every projection whose input has them and whose output lacks
/// them, bottom up, so a column of the source (lineage, event time) reaches the top of `plan`.
pub(crate) fn carry_columns(plan: LogicalPlan, names: &[&str]) -> Result<LogicalPlan, Error> {
    let rewritten = plan.transform_up(|node| {
        let node = node.recompute_schema()?;
        let LogicalPlan::Projection(projection) = node else {
            return Ok(Transformed::no(node));
        };
        let present: HashSet<&str> = projection
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let mut expr = projection.expr.clone();
        for name in names {
            if present.contains(name) {
                continue;
            }
            if let Ok((qualifier, _)) = projection
                .input
                .schema()
                .qualified_field_with_unqualified_name(name)
            {
                expr.push(Expr::Column(Column::new(qualifier.cloned(), *name)));
            }
        }
        if expr.len() == projection.expr.len() {
            return Ok(Transformed::no(LogicalPlan::Projection(projection)));
        }
        let projection = Projection::try_new(expr, Arc::clone(&projection.input))?;
        Ok(Transformed::yes(LogicalPlan::Projection(projection)))
    })?;
    Ok(rewritten.data)
}

/// A stateful operator as `sluice validate` shows it: what its state is keyed by, when a state
/// row leaves (its purge rule, which bounds the state) and what it emits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorDescription {
    /// Its id: position in the chain and kind, e.g. `0-aggregate`.
    pub id: String,
    /// What it computes, e.g. `windowed aggregate over tumble(1m, clicks.ts)`.
    pub what: String,
    /// The columns one state row is keyed by.
    pub state_key: Vec<String>,
    /// When a state row leaves the state.
    pub purge: String,
    /// What it emits, and when.
    pub emits: String,
}

/// A row on which the query failed, with the error.
#[derive(Debug)]
pub struct FailedRow {
    /// The source table the row came from.
    pub source: String,
    /// The row, as a one-row batch of that source's schema.
    pub row: RecordBatch,
    /// What DataFusion said.
    pub error: String,
}

/// Output of one execution, after isolating failing rows.
#[derive(Debug, Default)]
pub struct QueryOutput {
    /// Output rows.
    pub batches: Vec<RecordBatch>,
    /// Input rows on which the query failed.
    pub failed: Vec<FailedRow>,
}

impl QueryOutput {
    /// Adds `other`'s rows and failed rows after this output's.
    pub fn append(&mut self, other: QueryOutput) {
        self.batches.extend(other.batches);
        self.failed.extend(other.failed);
    }
}

/// Rows a kept batch of an operator's state holds at least, once [`merge_small_batches`] has
/// merged it with its neighbours.
const MERGED_ROWS: usize = 64 * 1024;

/// The number of kept batches above which [`merge_small_batches`] merges the small ones.
const MANY_BATCHES: usize = 64;

/// `batches` (rows an operator keeps, in order) with runs of small ones merged, when there are
/// more than [`MANY_BATCHES`] of them: every run of two or more batches of fewer than
/// [`MERGED_ROWS`] rows is copied into batches of about that many rows; larger batches, and a
/// small one alone between them, stay as they are (copying it would merge nothing).
///
/// Each batch a query reads costs a little, and a purge leaves many small ones behind. Merging
/// every kept batch into one instead would copy the whole state whenever a batch's rows cross
/// 64 batches (a join side's new rows alone often do), and hold it twice while doing so.
pub(crate) fn merge_small_batches(
    schema: &SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<Vec<RecordBatch>, Error> {
    if batches.len() <= MANY_BATCHES {
        return Ok(batches);
    }
    // A run of small batches, as one: copied only if it is more than one batch.
    let end_run = |run: &mut Vec<RecordBatch>, merged: &mut Vec<RecordBatch>| {
        match run.len() {
            0 => {}
            1 => merged.append(run),
            _ => merged.push(arrow::compute::concat_batches(
                schema,
                &std::mem::take(run),
            )?),
        }
        Ok::<_, ArrowError>(())
    };
    let mut merged = Vec::new();
    let mut run: Vec<RecordBatch> = Vec::new();
    let mut run_rows = 0;
    for batch in batches {
        if batch.num_rows() >= MERGED_ROWS {
            // The run before a large batch ends there: the rows keep their order.
            end_run(&mut run, &mut merged)?;
            run_rows = 0;
            merged.push(batch);
            continue;
        }
        run_rows += batch.num_rows();
        run.push(batch);
        if run_rows >= MERGED_ROWS {
            end_run(&mut run, &mut merged)?;
            run_rows = 0;
        }
    }
    end_run(&mut run, &mut merged)?;
    Ok(merged)
}

/// Whether `error` comes from the values of the rows — a failing CAST, a division by zero, an
/// overflow, an invalid argument — the only kind of error that may make a row a dead letter.
/// Running out of memory, I/O, planning and internal errors are not about a row: they fail the
/// batch, so that a rerun cannot isolate different rows than the first run did.
pub(crate) fn is_data_error(error: &Error) -> bool {
    match error {
        Error::DataFusion(e) => datafusion_data_error(e),
        Error::Arrow(e) => arrow_data_error(e),
        _ => false,
    }
}

fn datafusion_data_error(error: &DataFusionError) -> bool {
    match error {
        DataFusionError::ArrowError(e, _) => arrow_data_error(e),
        DataFusionError::Execution(_) => true,
        DataFusionError::Context(_, inner) | DataFusionError::Diagnostic(_, inner) => {
            datafusion_data_error(inner)
        }
        DataFusionError::Shared(inner) => datafusion_data_error(inner),
        DataFusionError::Collection(all) => {
            !all.is_empty() && all.iter().all(datafusion_data_error)
        }
        DataFusionError::External(e) => external_data_error(e.as_ref()),
        _ => false,
    }
}

fn arrow_data_error(error: &ArrowError) -> bool {
    match error {
        ArrowError::CastError(_)
        | ArrowError::ComputeError(_)
        | ArrowError::DivideByZero
        | ArrowError::ArithmeticOverflow(_)
        | ArrowError::InvalidArgumentError(_)
        | ArrowError::ParseError(_)
        | ArrowError::JsonError(_)
        | ArrowError::CsvError(_) => true,
        ArrowError::ExternalError(e) => external_data_error(e.as_ref()),
        _ => false,
    }
}

/// An error wrapped by DataFusion or Arrow as "external": about values if it is one of theirs
/// that is.
fn external_data_error(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    if let Some(inner) = error.downcast_ref::<DataFusionError>() {
        datafusion_data_error(inner)
    } else if let Some(inner) = error.downcast_ref::<ArrowError>() {
        arrow_data_error(inner)
    } else {
        false
    }
}

/// The ranking window functions: each numbers a partition's rows from 1 in the window's order.
pub(crate) const RANKINGS: [&str; 3] = ["row_number", "rank", "dense_rank"];

/// The column a filter conjunct compares with an integer, and the highest number it keeps:
/// `c = n` and `c <= n` keep up to `n`, `c < n` up to `n - 1` (either way round; `c` may be
/// cast). Over a ranking (see [`ranking_window`]) that is the last rank a row can have and stay.
pub(crate) fn rank_bound(conjunct: &Expr) -> Option<(String, i64)> {
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = conjunct else {
        return None;
    };
    let int = |e: &Expr| match e {
        Expr::Literal(v, _) => match v {
            ScalarValue::Int8(Some(n)) => Some(i64::from(*n)),
            ScalarValue::Int16(Some(n)) => Some(i64::from(*n)),
            ScalarValue::Int32(Some(n)) => Some(i64::from(*n)),
            ScalarValue::Int64(Some(n)) => Some(*n),
            ScalarValue::UInt8(Some(n)) => Some(i64::from(*n)),
            ScalarValue::UInt16(Some(n)) => Some(i64::from(*n)),
            ScalarValue::UInt32(Some(n)) => Some(i64::from(*n)),
            ScalarValue::UInt64(Some(n)) => i64::try_from(*n).ok(),
            _ => None,
        },
        _ => None,
    };
    let column = |e: &Expr| match e {
        Expr::Column(c) => Some(c.name.clone()),
        Expr::Cast(c) => match c.expr.as_ref() {
            Expr::Column(c) => Some(c.name.clone()),
            _ => None,
        },
        Expr::TryCast(c) => match c.expr.as_ref() {
            Expr::Column(c) => Some(c.name.clone()),
            _ => None,
        },
        _ => None,
    };
    let (name, op, n) = match (column(left), int(right), column(right), int(left)) {
        (Some(name), Some(n), _, _) => (name, *op, n),
        (_, _, Some(name), Some(n)) => (name, op.swap()?, n),
        _ => return None,
    };
    match op {
        Operator::Eq | Operator::LtEq => Some((name, n)),
        Operator::Lt => Some((name, n.checked_sub(1)?)),
        _ => None,
    }
}

/// The `Window` node below `plan` whose window function — one of `functions` (by name, e.g.
/// [`RANKINGS`]) — the column `name` carries, through projections (`… AS rn`) and subquery
/// aliases.
pub(crate) fn ranking_window(
    plan: &LogicalPlan,
    name: &str,
    functions: &[&str],
) -> Option<LogicalPlan> {
    match plan {
        LogicalPlan::SubqueryAlias(alias) => ranking_window(&alias.input, name, functions),
        LogicalPlan::Projection(p) => {
            let index = p.schema.fields().iter().position(|f| f.name() == name)?;
            let inner = match &p.expr[index] {
                Expr::Column(c) => c.name.clone(),
                Expr::Alias(a) => match a.expr.as_ref() {
                    Expr::Column(c) => c.name.clone(),
                    _ => return None,
                },
                _ => return None,
            };
            ranking_window(&p.input, &inner, functions)
        }
        LogicalPlan::Window(w) => {
            let inputs = w.input.schema().fields().len();
            let index = w.schema.fields().iter().position(|f| f.name() == name)?;
            let expr = w.window_expr.get(index.checked_sub(inputs)?)?;
            let is_ranking = match expr.clone().unalias_nested().data {
                Expr::WindowFunction(f) => functions.contains(&f.fun.name()),
                _ => false,
            };
            is_ranking.then(|| plan.clone())
        }
        _ => None,
    }
}

/// The first node that makes the plan's result depend on how the stream is split into batches
/// (an aggregate, join, sort, limit, distinct, window function over a stream), as text, and
/// why; `None` if there is none. `statics` names the static tables (lowercase), read whole at
/// the batch's version; every other scan is a stream (a source, or a window function over one).
///
/// A join of a stream with a static table needs no state when every output row comes from a
/// stream row of this batch: an inner join, a left (semi, anti) join with the stream on the
/// left, or the mirror image; the table's side may hold anything. Refused: a join that keeps
/// the table's unmatched rows (the table's side outer, a full join), which would emit them
/// again every batch; two streams joined, or a subquery over a stream (`IN`, `EXISTS`, a scalar
/// subquery), which would see only the batch's rows; a UNION of a stream with a table or with
/// constant rows, emitted again every batch.
pub(crate) fn stateful_node(
    plan: &LogicalPlan,
    statics: &BTreeSet<String>,
) -> Option<(String, &'static str)> {
    let mut over_stream = false;
    // The visitor never fails.
    let _ = plan.apply_subqueries(|subquery| {
        over_stream |= reads_stream(subquery, statics);
        Ok(TreeNodeRecursion::Continue)
    });
    if over_stream {
        let reason = "a subquery over a stream would see only the batch's rows";
        return Some((plan.display().to_string(), reason));
    }
    if !reads_stream(plan, statics) {
        // The table's side of a join (or a query reading no stream, refused by the planner).
        return None;
    }
    match plan {
        LogicalPlan::Projection(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::TableScan(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Unnest(_)
        | LogicalPlan::EmptyRelation(_)
        | LogicalPlan::Values(_) => plan
            .inputs()
            .into_iter()
            .find_map(|input| stateful_node(input, statics)),
        LogicalPlan::Union(union) => {
            if union.inputs.iter().any(|i| !reads_stream(i, statics)) {
                let reason = "a UNION of the stream with a table or constant rows would emit \
                              those rows again every batch";
                return Some((plan.display().to_string(), reason));
            }
            union
                .inputs
                .iter()
                .find_map(|input| stateful_node(input, statics))
        }
        LogicalPlan::Join(join) => {
            let left = reads_stream(&join.left, statics);
            let right = reads_stream(&join.right, statics);
            let stream_side = match (left, right, join.join_type) {
                (true, true, _) => {
                    let reason = "a join of two streams keeps both sides' rows as state";
                    return Some((plan.display().to_string(), reason));
                }
                (true, false, JoinType::Inner | JoinType::Left)
                | (true, false, JoinType::LeftSemi | JoinType::LeftAnti) => &join.left,
                (false, true, JoinType::Inner | JoinType::Right)
                | (false, true, JoinType::RightSemi | JoinType::RightAnti) => &join.right,
                _ => {
                    let reason = "a join that keeps the table's unmatched rows would emit them \
                                  again every batch; join with the stream on the preserved side";
                    return Some((plan.display().to_string(), reason));
                }
            };
            stateful_node(stream_side, statics)
        }
        _ => Some((plan.display().to_string(), "")),
    }
}

/// Whether `plan` (its subqueries included) scans a stream: any table but the `statics`.
pub(crate) fn reads_stream(plan: &LogicalPlan, statics: &BTreeSet<String>) -> bool {
    let mut found = false;
    // The visitor never fails.
    let _ = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && !statics.contains(&scan.table_name.table().to_lowercase())
        {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// The single stream `plan` reads, or an error naming what it reads.
pub(crate) fn single_source(
    plan: &LogicalPlan,
    statics: &BTreeSet<String>,
) -> std::result::Result<String, String> {
    let mut sources = BTreeSet::new();
    let _ = plan.apply(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && !statics.contains(&scan.table_name.table().to_lowercase())
        {
            sources.insert(scan.table_name.table().to_string());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    match sources.iter().collect::<Vec<_>>()[..] {
        [one] => Ok(one.clone()),
        _ => Err(sources.into_iter().collect::<Vec<_>>().join(", ")),
    }
}

/// What the operators' tests share: a query streamed batch by batch, as the driver runs it.
#[cfg(test)]
pub(crate) mod test_support {
    use std::collections::BTreeMap;

    use arrow::array::RecordBatch;
    use arrow::datatypes::SchemaRef;

    use super::state_store::StateLog;
    use crate::checkpoint::{BatchManifest, CheckpointStore};
    use crate::offsets::BatchId;
    use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};

    /// What streaming a query gave.
    pub(crate) struct Streamed {
        /// Every output batch, in order.
        pub(crate) outputs: Vec<RecordBatch>,
        /// The late-table rows, each with the source whose input they came from.
        pub(crate) late: Vec<(String, RecordBatch)>,
        /// The operator ids the last batch's state was written under.
        pub(crate) operator_ids: Vec<String>,
        /// The rows in state after the last batch.
        pub(crate) state_rows: u64,
    }

    /// Streams `batches` (each: every source's rows) through `sql` planned over `sources`, the
    /// watermark after batch `i` being `watermarks[i]`, restarting from the state files after
    /// batch `restart_after` as a restart from its manifest would. Asserts that no row failed
    /// and that late rows have the late table's schema.
    pub(crate) async fn stream(
        sql: &str,
        sources: &[(String, SchemaRef)],
        settings: &QuerySettings,
        batches: &[BTreeMap<String, RecordBatch>],
        watermarks: &[Option<i64>],
        restart_after: usize,
    ) -> Streamed {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let plan = || StreamingQuery::plan(sql, sources, settings);
        let mut query = plan().await.unwrap();
        query
            .restore_state(StateLog::new(&checkpoint, 0), None, None)
            .await
            .unwrap();
        let mut streamed = Streamed {
            outputs: Vec::new(),
            late: Vec::new(),
            operator_ids: Vec::new(),
            state_rows: 0,
        };
        let mut watermark = None;
        for (i, (inputs, &after)) in batches.iter().zip(watermarks).enumerate() {
            for (name, rows) in inputs {
                if let Some(late) = query
                    .late_rows(name, rows, watermark, BatchId(i as i64))
                    .unwrap()
                {
                    assert_eq!(late.schema(), query.late_schema().unwrap());
                    streamed.late.push((name.clone(), late));
                }
            }
            let step = BatchWatermark {
                before: watermark,
                after,
            };
            let out = query.execute_isolating(inputs, step).await.unwrap();
            assert!(out.failed.is_empty());
            streamed.outputs.extend(out.batches);
            watermark = after;
            let (operators, _) = query.write_state(BatchId(i as i64)).await.unwrap();
            streamed.operator_ids = operators.keys().cloned().collect();
            if i == restart_after {
                let manifest = BatchManifest {
                    operators: Some(operators),
                    ..BatchManifest::default()
                };
                query = plan().await.unwrap();
                query
                    .restore_state(StateLog::new(&checkpoint, 1), Some(&manifest), watermark)
                    .await
                    .unwrap();
            }
        }
        streamed.state_rows = query.state_size().map_or(0, |s| s.rows);
        streamed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{AsArray, Int64Array};
    use arrow::datatypes::{DataType, Int64Type};

    #[test]
    fn small_batches_are_merged_in_order_and_large_ones_kept() {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        let mut next = 0i64;
        let mut batch = |rows: usize| {
            let values = Int64Array::from_iter_values(next..next + rows as i64);
            next += rows as i64;
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(values)]).unwrap()
        };
        // Few batches: left as they are.
        let few: Vec<RecordBatch> = (0..64).map(|_| batch(10)).collect();
        assert_eq!(merge_small_batches(&schema, few.clone()).unwrap(), few);
        // Many: a large batch between runs of small ones.
        let large = batch(MERGED_ROWS);
        let mut many: Vec<RecordBatch> = (0..100).map(|_| batch(1000)).collect();
        many.insert(30, large.clone());
        // And a small one alone between two large ones.
        let lone = batch(5);
        many.extend([batch(MERGED_ROWS), lone.clone(), batch(MERGED_ROWS)]);
        let rows: usize = many.iter().map(RecordBatch::num_rows).sum();
        let merged = merge_small_batches(&schema, many.clone()).unwrap();
        let values = |batches: &[RecordBatch]| -> Vec<i64> {
            batches
                .iter()
                .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
                .collect()
        };
        assert!(values(&merged) == values(&many), "rows out of order");
        assert_eq!(
            merged.iter().map(RecordBatch::num_rows).sum::<usize>(),
            rows
        );
        // 30 small ones, the large one, 66 small ones (64 Ki rows or more), the next 4, then
        // large, lone, large.
        let sizes: Vec<usize> = merged.iter().map(RecordBatch::num_rows).collect();
        let large_rows = MERGED_ROWS;
        assert_eq!(
            sizes,
            [30_000, large_rows, 66_000, 4_000, large_rows, 5, large_rows]
        );
        // The large batch and the lone small one are not copied.
        let first_buffer = |b: &RecordBatch| b.column(0).to_data().buffers()[0].as_ptr();
        for kept in [&large, &lone] {
            assert!(merged.iter().any(|b| first_buffer(b) == first_buffer(kept)));
        }
    }
}
