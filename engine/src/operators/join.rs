//! Stream-stream join: two streams joined on a key within a bound of event time, each side's
//! rows buffered in state until no row of the other side can match them any more.
//!
//! Attribution (a click within an hour of its impression), enrichment by another stream (a bid
//! with its auction) and Nexmark q3/q20 are joins of two streams. The output of such a join is
//! every matching pair, and a pair's two rows may arrive batches apart, so both sides are kept.
//! (An aggregate or window function above the join keyed by one side's join key runs per key
//! instead, once that side's row has left: Nexmark q9, see `operators/closing.rs`.)
//!
//! ```sql
//! SELECT … FROM impressions i JOIN clicks c
//!   ON i.ad = c.ad AND c.ts BETWEEN i.ts AND i.ts + INTERVAL '1' HOUR   -- an interval join
//!
//! SELECT … FROM bid b JOIN auction a ON b.auction = a.id               -- with state_ttl = "1h":
//!                                                                        -- |b.ts − a.ts| ≤ 1h
//! ```
//!
//! **Bounds.** Every conjunct of the ON clause of the form `X.ts ≤ Y.c [± interval]` (also `<`,
//! `>=`, `>`, `BETWEEN`), where `X.ts` is one side's event time and `Y.c` a timestamp column of
//! the other side (its event time, or another, as Nexmark's `B.date_time BETWEEN A.date_time
//! AND A.expires`), says that no row of `X` newer than `Y.c + interval` matches a row of `Y`: so
//! a row of `Y` leaves the state once the watermark passes that (`Y.c + interval <` watermark −
//! allowed lateness). This is the side-specific rule Spark once got wrong (SPARK-46350): a side
//! is purged by the *other* side's progress against the bound *it* gives. A side no conjunct
//! bounds waits forever; the join is refused unless `state_ttl` is set, which then adds the
//! bound `X.ts ≤ Y.ts + state_ttl` to the join's condition (so rows more than `state_ttl` apart
//! never join, and the docs say so).
//!
//! **Late rows.** A row whose event time is below the watermark in force (minus the allowed
//! lateness) could match rows already purged, so it is late: it goes to the late table, never
//! into the join. Every other pair is found exactly once, in the batch the second of its rows
//! arrives: the batch's new rows of the left side probe the right side's state and new rows, and
//! the right side's new rows probe the left side's state (never the new × new pairs twice). A
//! row purged before its partner arrived would need `partner.ts > row.c + interval ≥` the
//! partner's bound — not a match — or a partner below the watermark — late. So the streamed
//! output is the SQL join of every row that was not late, whatever the batches were, which is
//! what reconcile recomputes.
//!
//! The watermark used is the job's (the minimum over every partition of both sources), which
//! keeps state at least as long as per-source watermarks would, never shorter.
//!
//! ```text
//!  upper   Projection / Filter / join with a static table   runs over the joined pairs
//!          (or an aggregate / window keyed by one side's key: over the pairs of closed keys)
//!  ──────────────────────────────────────────────────────────────────────────────────────
//!  join    new left ⋈ (right state + new right)  ∪  left state ⋈ new right     (DataFusion)
//!  ──────────────────────────────────────────────────────────────────────────────────────
//!  lower   each side's plan over its source's rows (not late), buffered in the state
//! ```
//!
//! **Failures.** A row its side's plan fails on — its filters, its columns, its join keys
//! (computed in the side's plan for this) — is a dead letter, as in a stateless query (once in
//! a self-join), and is not kept. A pair the SQL over the join fails on (a division by zero, a
//! failing cast) is found by halving the batch's pairs and is one dead letter: both rows'
//! columns, at the left row's position (each side carries its source rows' lineage), the right
//! row's in the error; both rows stay kept, and the pair counts as a match. A condition over
//! both sides that fails on values fails the batch, saying to move it into one side.
//!
//! **State** is the buffered rows of both sides (the columns the join and the SQL above it need,
//! the lineage, a row id), for a side an outer join preserves, which rows have matched, and
//! with per-key closing the pairs held until their key closes.
//! Each batch writes its new rows still kept after its purge and its new matches as a delta
//! (one file, a kind column telling them apart); a purge needs no write, since a restart drops
//! what the restored watermark has let go (a new row that batch's purge let go is not written
//! at all: the restart would drop it). Kept rows stay in the batches the side's plan made them
//! in, small ones merged once there are many (`operators::merge_small_batches`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, BooleanArray, RecordBatch, UInt8Array, UInt64Array};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{
    DataType, Field, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType, UInt8Type, UInt64Type,
};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, ScalarValue};
use datafusion::datasource::provider_as_source;
use datafusion::error::DataFusionError;
use datafusion::logical_expr::utils::split_conjunction;
use datafusion::logical_expr::{
    BinaryExpr, Expr, Join, JoinType, LogicalPlan, LogicalPlanBuilder, Operator, lit,
};
use datafusion::prelude::SessionContext;
use futures::StreamExt;

use super::aggregate::StateSize;
use super::closing::{ClosedPairs, FirstRows, HeldPairs, TopPerKey, closing_key, top_per_key};
use super::state_store::{StateLog, StateWrite};
use super::{
    FailedRow, QueryOutput, is_data_error, merge_small_batches, reads_stream, single_source,
    stateful_node,
};
use crate::error::{Error, Result};
use crate::event_time::event_time_type;
use crate::offsets::BatchId;
use crate::query::{BatchWatermark, SourceInputs};
use crate::sink::OutputMode;

/// The table the upper part reads the joined pairs from.
const JOINED_TABLE: &str = "__sluice_joined";
/// With first rows per key, the pairs kept as they came are ranked again (letting go of those
/// outranked since) once as many have been kept since the last time as were kept then, and at
/// least this many: outranked pairs add up only where later pairs keep ranking higher.
const RANK_AGAIN_AFTER: usize = 65_536;
/// The state's column telling its rows apart: 0 a left row, 1 a right row, 2 and 3 a left or
/// right row that matched, [`HELD`] a pair held until its key closes.
const SIDE: &str = "__sluice_side";
/// The kind of a held pair's state row (see `operators/closing.rs`).
const HELD: u8 = 4;

/// How [`plan_stream_join`] plans the operator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JoinSettings<'a> {
    /// Each source's event-time column.
    pub(crate) event_time: &'a BTreeMap<String, String>,
    /// Append or update.
    pub(crate) mode: OutputMode,
    /// The bound for a side the join's condition leaves unbounded, µs.
    pub(crate) state_ttl: Option<i64>,
    /// How far below the watermark a row is still on time, µs.
    pub(crate) allowed_lateness: i64,
    /// The static tables (every other table is a stream).
    pub(crate) statics: &'a BTreeSet<String>,
}

/// The joins of `plan` whose two sides both read a stream.
pub(crate) fn find(plan: &LogicalPlan, statics: &BTreeSet<String>) -> Vec<LogicalPlan> {
    let mut found = Vec::new();
    let _ = plan.apply(|node| {
        if let LogicalPlan::Join(join) = node
            && reads_stream(&join.left, statics)
            && reads_stream(&join.right, statics)
        {
            found.push(node.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// One side of the join: its plan, its source, its state and its purge rule.
struct Side {
    /// `left` or `right`, for messages.
    name: &'static str,
    /// The source it reads.
    source: String,
    /// That source's event-time column.
    time_column: String,
    /// The side's plan over its source's rows.
    lower: LogicalPlan,
    /// The side's rows as stored and joined: its columns renamed `c0`, `c1`, …, and last the
    /// row's id (unique among the side's rows), by which matches are recorded.
    schema: SchemaRef,
    /// The purge rule: a row leaves once `min(column + offset)` over these is below the
    /// watermark (minus the allowed lateness).
    expiry: Vec<(usize, i64)>,
    /// Whether the join keeps this side's unmatched rows (a left, right or full join): a row
    /// that leaves the state unmatched is emitted with the other side's columns null.
    preserved: bool,
    /// The rows kept (the state).
    rows: Vec<RecordBatch>,
    /// Of a preserved side: the ids of the kept rows that have matched.
    matched: HashSet<u64>,
    /// The id the next new row gets.
    next_id: u64,
    /// This batch's new rows, as the join reads them.
    new_rows: Arc<MemTable>,
    /// The rows the other side's new rows probe: for the left side its state; for the right
    /// side its state and its new rows.
    probed: Arc<MemTable>,
}

impl Side {
    fn num_rows(&self) -> usize {
        self.rows.iter().map(RecordBatch::num_rows).sum()
    }

    /// The index of the id column.
    fn id_index(&self) -> usize {
        self.schema.fields().len() - 1
    }

    /// The ids of the kept rows.
    fn ids(&self) -> HashSet<u64> {
        let id_index = self.id_index();
        self.rows
            .iter()
            .flat_map(|r| {
                r.column(id_index)
                    .as_primitive::<UInt64Type>()
                    .values()
                    .to_vec()
            })
            .collect()
    }

    /// Drops the rows that can no longer match a row of the other side at or above `limit`,
    /// and returns those of them that never matched.
    fn purge(&mut self, limit: i64) -> Result<Vec<RecordBatch>> {
        let mut kept = Vec::with_capacity(self.rows.len());
        let mut unmatched = Vec::new();
        let id_index = self.id_index();
        for rows in std::mem::take(&mut self.rows) {
            let mut expiry: Option<Vec<Option<i64>>> = None;
            for &(column, offset) in &self.expiry {
                let times = arrow::compute::cast(rows.column(column), &event_time_type())?;
                let times = times
                    .as_primitive_opt::<TimestampMicrosecondType>()
                    .ok_or_else(|| {
                        Error::UnsupportedQuery("a join bound is not a timestamp".into())
                    })?;
                let bound = times.iter().map(|t| t.map(|t| t.saturating_add(offset)));
                expiry = Some(match expiry {
                    None => bound.collect(),
                    Some(e) => e
                        .into_iter()
                        .zip(bound)
                        .map(|(a, b)| Some(a?.min(b?)))
                        .collect(),
                });
            }
            // A null bound never matches: the row leaves.
            let keep: BooleanArray = expiry
                .unwrap_or_default()
                .into_iter()
                .map(|e| Some(e.is_some_and(|e| e >= limit)))
                .collect();
            if keep.true_count() == rows.num_rows() {
                kept.push(rows);
                continue;
            }
            if self.preserved {
                let ids = rows.column(id_index).as_primitive::<UInt64Type>();
                let never: BooleanArray = keep
                    .iter()
                    .zip(ids.values())
                    .map(|(k, id)| {
                        let leaves = k == Some(false);
                        Some(leaves && !self.matched.remove(id))
                    })
                    .collect();
                let never = filter_record_batch(&rows, &never)?;
                if never.num_rows() > 0 {
                    unmatched.push(never);
                }
            }
            let rows = filter_record_batch(&rows, &keep)?;
            if rows.num_rows() > 0 {
                kept.push(rows);
            }
        }
        self.rows = merge_small_batches(&self.schema, kept)?;
        Ok(unmatched)
    }

    /// The kept rows whose ids are `first` or above: the rows added since `next_id` was
    /// `first`. They are the kept rows' tail (rows are added at the end, ids in order, and
    /// [`Side::purge`] keeps their order), so only the tail is looked at.
    fn kept_since(&self, first: u64) -> Vec<RecordBatch> {
        let id_index = self.id_index();
        let mut tail = Vec::new();
        for rows in self.rows.iter().rev() {
            let ids = rows.column(id_index).as_primitive::<UInt64Type>().values();
            let older = ids.partition_point(|&id| id < first);
            if older < rows.num_rows() {
                tail.push(rows.slice(older, rows.num_rows() - older));
            }
            if older > 0 {
                break;
            }
        }
        tail.reverse();
        tail
    }

    /// `batches` (the side's plan's output) in the stored schema, each row given an id.
    fn stored(&mut self, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::new();
        for b in batches.into_iter().filter(|b| b.num_rows() > 0) {
            let n = b.num_rows() as u64;
            let mut columns = b.columns().to_vec();
            columns.push(Arc::new(UInt64Array::from_iter_values(
                self.next_id..self.next_id + n,
            )));
            self.next_id += n;
            out.push(RecordBatch::try_new(Arc::clone(&self.schema), columns)?);
        }
        Ok(out)
    }
}

/// The rows of `side` among `batches` whose ids are `ids`, in that order, in one batch.
///
/// # Errors
/// If an id is not among the rows (not expected), or the rows cannot be gathered.
fn rows_by_id(batches: &[RecordBatch], side: &Side, ids: &[u64]) -> Result<RecordBatch> {
    if ids.is_empty() {
        return Ok(RecordBatch::new_empty(Arc::clone(&side.schema)));
    }
    // Where each id is: (batch, row); found in one pass over the ids column.
    let mut at: hashbrown::HashMap<u64, Option<(usize, usize)>> =
        ids.iter().map(|&id| (id, None)).collect();
    for (b, batch) in batches.iter().enumerate() {
        let column = batch.column(side.id_index()).as_primitive::<UInt64Type>();
        for (r, id) in column.values().iter().enumerate() {
            if let Some(slot) = at.get_mut(id) {
                *slot = Some((b, r));
            }
        }
    }
    // Only the batches the rows are in are gathered from: `interleave` reads (for dictionaries,
    // merges) every batch it is given.
    let mut used: Vec<usize> = Vec::new();
    // Each batch's place among those used, once used.
    let mut place: Vec<Option<usize>> = vec![None; batches.len()];
    let mut indices = Vec::with_capacity(ids.len());
    for id in ids {
        let (b, r) = at.get(id).copied().flatten().ok_or_else(|| {
            Error::InvalidJob(format!(
                "a pair's {} row (id {id}) is not among the join's rows",
                side.name
            ))
        })?;
        let u = *place[b].get_or_insert_with(|| {
            used.push(b);
            used.len() - 1
        });
        indices.push((u, r));
    }
    let batches: Vec<&RecordBatch> = used.iter().map(|&b| &batches[b]).collect();
    Ok(arrow::compute::interleave_record_batch(&batches, &indices)?)
}

/// A join of two streams, its state, and what runs above it.
pub(crate) struct StreamJoin {
    /// The join as written, for messages.
    display: String,
    /// The join's condition, for `validate` and the fingerprint.
    condition: String,
    sides: [Side; 2],
    /// The pairs of one batch, by the side whose new rows they are driven by: new left ⋈
    /// (right state + new right), and left state ⋈ new right — each pair in one of them.
    pairs: [LogicalPlan; 2],
    /// The plan above the join, reading the pairs from [`JOINED_TABLE`].
    upper: LogicalPlan,
    joined: Arc<MemTable>,
    joined_schema: SchemaRef,
    allowed_lateness: i64,
    state_schema: SchemaRef,
    /// This batch's delta, as state rows: its new rows still kept after its purge, its new
    /// matches and its new pairs still held; emptied once written.
    changes: Vec<RecordBatch>,
    /// Where the SQL above groups or partitions by one side's key: the pairs held until their
    /// row of that side leaves (see `operators/closing.rs`).
    closing: Option<HeldPairs>,
    /// Where that SQL keeps only the first rows per key: the pairs as they are ranked.
    ranked_pairs: Option<RankedPairs>,
    log: Option<StateLog>,
    /// The whole query as it runs: optimised, with the bounds `state_ttl` added.
    plan: LogicalPlan,
}

/// A join's pairs where the SQL above keeps only the first rows per key (Nexmark q9's highest
/// bid per auction): the pairs' plans yield only the columns the ranking reads and the two
/// rows' ids, and a pair's other columns are gathered from its two rows once it is among the
/// first. Yielded whole, every pair the join makes carried a copy of both rows' columns (q9:
/// an auction's text with each of its bids), and so did the join's build side.
struct RankedPairs {
    /// As [`StreamJoin::pairs`], narrowed.
    plans: [LogicalPlan; 2],
    /// The ranking over the narrowed pairs' columns.
    top: TopPerKey,
    /// The pairs widened: the join's columns, then the two rows' ids.
    wide: SchemaRef,
}

impl std::fmt::Debug for StreamJoin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamJoin")
            .field("join", &self.display)
            .field("condition", &self.condition)
            .finish()
    }
}

/// The table and column of the source `index`-th column of `plan`'s output is, unchanged
/// (through aliases, projections of a bare column, filters, a window node's input columns, an
/// aggregate's group columns that are bare columns, and joins with tables); `None` if it is
/// computed.
pub(super) fn source_column(plan: &LogicalPlan, index: usize) -> Option<(String, String)> {
    match plan {
        LogicalPlan::TableScan(scan) => Some((
            scan.table_name.table().to_string(),
            scan.projected_schema.field(index).name().clone(),
        )),
        LogicalPlan::Projection(p) => match p.expr.get(index)?.clone().unalias() {
            Expr::Column(c) => source_column(&p.input, p.input.schema().index_of_column(&c).ok()?),
            _ => None,
        },
        LogicalPlan::SubqueryAlias(a) => source_column(&a.input, index),
        LogicalPlan::Filter(f) => source_column(&f.input, index),
        LogicalPlan::Window(w) if index < w.input.schema().fields().len() => {
            source_column(&w.input, index)
        }
        LogicalPlan::Aggregate(a) if index < a.group_expr.len() => {
            match a.group_expr[index].clone().unalias() {
                Expr::Column(c) => {
                    source_column(&a.input, a.input.schema().index_of_column(&c).ok()?)
                }
                _ => None,
            }
        }
        LogicalPlan::Join(j)
            if matches!(
                j.join_type,
                JoinType::Inner | JoinType::Left | JoinType::Right | JoinType::Full
            ) =>
        {
            let left = j.left.schema().fields().len();
            if index < left {
                source_column(&j.left, index)
            } else {
                source_column(&j.right, index - left)
            }
        }
        _ => None,
    }
}

/// `expr` as `column + offset` (µs): a bare column, or a column plus or minus an interval.
fn column_plus(expr: &Expr) -> Option<(Column, i64)> {
    match expr {
        Expr::Column(c) => Some((c.clone(), 0)),
        // A cast that keeps every µs (a timestamp as fine or finer), never one that rounds.
        Expr::Cast(c)
            if matches!(
                c.field.data_type(),
                DataType::Timestamp(TimeUnit::Microsecond | TimeUnit::Nanosecond, _)
            ) =>
        {
            column_plus(&c.expr)
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
            let (column, offset) = column_plus(left)?;
            let Expr::Literal(value, _) = right.as_ref() else {
                return None;
            };
            let interval = interval_micros(value)?;
            match op {
                Operator::Plus => Some((column, offset.checked_add(interval)?)),
                Operator::Minus => Some((column, offset.checked_sub(interval)?)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A fixed interval in µs (months have no fixed length).
fn interval_micros(value: &ScalarValue) -> Option<i64> {
    const DAY: i64 = 86_400_000_000;
    match value {
        ScalarValue::IntervalMonthDayNano(Some(v)) if v.months == 0 => i64::from(v.days)
            .checked_mul(DAY)?
            .checked_add(v.nanoseconds / 1000),
        ScalarValue::IntervalDayTime(Some(v)) => i64::from(v.days)
            .checked_mul(DAY)?
            .checked_add(i64::from(v.milliseconds) * 1000),
        ScalarValue::DurationSecond(Some(s)) => s.checked_mul(1_000_000),
        ScalarValue::DurationMillisecond(Some(ms)) => ms.checked_mul(1000),
        ScalarValue::DurationMicrosecond(Some(us)) => Some(*us),
        ScalarValue::DurationNanosecond(Some(ns)) => Some(ns / 1000),
        _ => None,
    }
}

/// The comparisons `small ≤ big + offset` the join's condition (its equalities and filter)
/// makes between timestamp expressions.
fn ordered_pairs(join: &Join) -> Vec<((Column, i64), (Column, i64))> {
    let mut pairs = Vec::new();
    // An equality of two timestamps bounds both ways.
    for (l, r) in &join.on {
        if let (Some(l), Some(r)) = (column_plus(l), column_plus(r)) {
            pairs.push((l.clone(), r.clone()));
            pairs.push((r, l));
        }
    }
    let Some(filter) = &join.filter else {
        return pairs;
    };
    for conjunct in split_conjunction(filter) {
        match conjunct {
            Expr::Between(b) if !b.negated => {
                if let (Some(e), Some(low), Some(high)) = (
                    column_plus(&b.expr),
                    column_plus(&b.low),
                    column_plus(&b.high),
                ) {
                    pairs.push((low, e.clone()));
                    pairs.push((e, high));
                }
            }
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
                let (Some(l), Some(r)) = (column_plus(left), column_plus(right)) else {
                    continue;
                };
                match op {
                    Operator::Lt | Operator::LtEq => pairs.push((l, r)),
                    Operator::Gt | Operator::GtEq => pairs.push((r, l)),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    pairs
}

/// Which side of `join` (0 left, 1 right) outputs `column`, and at which index.
fn side_of(join: &Join, column: &Column) -> Option<(usize, usize)> {
    if let Ok(i) = join.left.schema().index_of_column(column) {
        return Some((0, i));
    }
    join.right
        .schema()
        .index_of_column(column)
        .ok()
        .map(|i| (1, i))
}

/// Each side's purge rule from `join`'s condition: for side `s`, the `(column, offset)` pairs
/// such that the other side's event time is at most `column + offset` in every match.
fn purge_rules(join: &Join, times: &[(String, String); 2]) -> [Vec<(usize, i64)>; 2] {
    let mut rules: [Vec<(usize, i64)>; 2] = [Vec::new(), Vec::new()];
    for (y, yi, offset) in bounds(join, times) {
        // Any timestamp: the purge reads it as the event time's type (µs, UTC; a time zone
        // never moves an instant, a time without one is read as UTC, as SQL compares them).
        if matches!(bound_type(join, y, yi), DataType::Timestamp(_, _)) {
            rules[y].push((yi, offset));
        }
    }
    rules
}

/// Every `(side y, its column, offset)` such that the other side's event time is at most
/// `column + offset` in every match, whatever the column's type (see [`purge_rules`]).
fn bounds(join: &Join, times: &[(String, String); 2]) -> Vec<(usize, usize, i64)> {
    let inputs = [join.left.as_ref(), join.right.as_ref()];
    let mut found = Vec::new();
    for ((small, small_offset), (big, big_offset)) in ordered_pairs(join) {
        let (Some((x, xi)), Some((y, yi))) = (side_of(join, &small), side_of(join, &big)) else {
            continue;
        };
        if x != y && source_column(inputs[x], xi).as_ref() == Some(&times[x]) {
            found.push((y, yi, big_offset - small_offset));
        }
    }
    found
}

/// The type of column `index` of side `side` of `join`.
fn bound_type(join: &Join, side: usize, index: usize) -> &DataType {
    [&join.left, &join.right][side]
        .schema()
        .field(index)
        .data_type()
}

/// Side `side`'s columns that bound the other side's event time in `join` but are not
/// timestamps (text holding times, say), as `name (type)`: why that side has no purge rule.
fn untyped_bounds(join: &Join, times: &[(String, String); 2], side: usize) -> Vec<String> {
    bounds(join, times)
        .into_iter()
        .filter(|&(y, yi, _)| {
            y == side && !matches!(bound_type(join, y, yi), DataType::Timestamp(_, _))
        })
        .map(|(y, yi, _)| {
            let (qualifier, field) = [&join.left, &join.right][y].schema().qualified_field(yi);
            let name = match qualifier {
                Some(q) => format!("{q}.{}", field.name()),
                None => field.name().clone(),
            };
            format!("{name} ({})", field.data_type())
        })
        .collect()
}

/// The index of the column of `plan`'s output that is the source's event time `time`.
fn event_time_index(plan: &LogicalPlan, time: &(String, String)) -> Option<usize> {
    (0..plan.schema().fields().len()).find(|&i| source_column(plan, i).as_ref() == Some(time))
}

/// Plans the join of two streams `found` in `plan`: each side's plan and purge rule, the
/// batch's join over new and kept rows, and the upper part over the pairs. `ctx` optimises the
/// query first, so filters over one side are applied before its rows are kept.
///
/// # Errors
/// If the join cannot run as a stream operator: a semi or anti join, update mode, a side reading
/// other than one source or needing state of its own, a source without event time, a side no
/// condition bounds without `state_ttl` (or `state_ttl` bounding nothing), or state needed
/// above the join.
pub(crate) fn plan_stream_join(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    found: &LogicalPlan,
    settings: JoinSettings<'_>,
) -> Result<StreamJoin> {
    let display = found.display().to_string();
    let refuse = |why: String| Error::UnsupportedQuery(format!("`{display}`: {why}"));
    let LogicalPlan::Join(join) = found else {
        unreachable!("found joins only")
    };
    if !matches!(
        join.join_type,
        JoinType::Inner | JoinType::Left | JoinType::Right | JoinType::Full
    ) {
        return Err(refuse(format!(
            "a {} join of two streams is not built yet; join two streams with an inner, left, \
             right or full join",
            join.join_type
        )));
    }
    if settings.mode != OutputMode::Append {
        return Err(refuse(
            "a join of two streams emits each pair once, as soon as both rows are present \
             (append); set mode = \"append\" in [sink]"
                .into(),
        ));
    }
    let mut times: Vec<(String, String)> = Vec::new();
    for (name, side) in [("left", &join.left), ("right", &join.right)] {
        let source = single_source(side, settings.statics).map_err(|read| {
            refuse(format!(
                "each side of a join of two streams reads one source; the {name} side reads {}",
                if read.is_empty() {
                    "none outside a subquery".to_string()
                } else {
                    read
                }
            ))
        })?;
        if let Some((node, _)) = stateful_node(side, settings.statics) {
            return Err(refuse(format!(
                "`{node}` on the {name} side of the join needs state of its own: two windowed \
                 aggregates joined on their windows run as a window join, but a join of an \
                 aggregate or of deduplicated rows with another stream's rows is a chain of \
                 stateful operators, not built yet"
            )));
        }
        let column = settings.event_time.get(&source).cloned().ok_or_else(|| {
            refuse(format!(
                "a join of two streams keeps rows until the watermark shows no match can come, \
                 and source '{source}' has no event_time: set event_time in [sources.{source}]"
            ))
        })?;
        times.push((source, column));
    }
    let times: [(String, String); 2] = [times[0].clone(), times[1].clone()];

    // Bound every side: a side no conjunct bounds — in the optimised plan, where conditions
    // written in WHERE have joined the ON clause — waits state_ttl, as an added conjunct.
    let optimized_joins = find(&ctx.state().optimize(plan)?, settings.statics);
    let bounded: [bool; 2] = match &optimized_joins[..] {
        [LogicalPlan::Join(optimized)] => {
            let rules = purge_rules(optimized, &times);
            [!rules[0].is_empty(), !rules[1].is_empty()]
        }
        _ => [false, false],
    };
    // A side bounded only by columns that are not timestamps: named in the refusal.
    let untyped = |s: usize| match &optimized_joins[..] {
        [LogicalPlan::Join(optimized)] => untyped_bounds(optimized, &times, s),
        _ => Vec::new(),
    };
    let mut added = Vec::new();
    let mut uses_ttl = false;
    for s in 0..2 {
        if bounded[s] {
            continue;
        }
        let inputs = [&join.left, &join.right];
        let Some(ttl) = settings.state_ttl else {
            let untyped = untyped(s);
            let not_times = if untyped.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} bounds it but is not a timestamp: declare it as TIMESTAMP in the \
                     source's schema, or CAST it in a subquery of that side)",
                    untyped.join(", ")
                )
            };
            return Err(refuse(format!(
                "nothing in the join's condition bounds how long a row of the {} side ({}) \
                 waits for its match{not_times}, so the state would grow without bound: bound \
                 the other side's event time by it (e.g. `{}.{} BETWEEN … AND … + INTERVAL '1' \
                 HOUR`) or set state_ttl in [query] to join rows at most that far apart in \
                 event time",
                ["left", "right"][s],
                times[s].0,
                times[1 - s].0,
                times[1 - s].1,
            )));
        };
        uses_ttl = true;
        let own = event_time_index(inputs[s], &times[s]);
        let other = event_time_index(inputs[1 - s], &times[1 - s]);
        let (Some(own), Some(other)) = (own, other) else {
            return Err(refuse(format!(
                "state_ttl bounds a join of two streams by their event times, and the {} side \
                 does not carry its source's event time ({}): select it in that side",
                if own.is_none() {
                    ["left", "right"][s]
                } else {
                    ["left", "right"][1 - s]
                },
                if own.is_none() {
                    &times[s].1
                } else {
                    &times[1 - s].1
                },
            )));
        };
        let column = |side: &LogicalPlan, i: usize| {
            let (q, f) = side.schema().qualified_field(i);
            Expr::Column(Column::new(q.cloned(), f.name()))
        };
        let interval = lit(ScalarValue::new_interval_mdn(
            0,
            0,
            ttl.saturating_mul(1000),
        ));
        added.push(column(inputs[1 - s], other).lt_eq(column(inputs[s], own) + interval));
    }
    if settings.state_ttl.is_some() && !uses_ttl {
        return Err(refuse(
            "state_ttl has no effect: the join's condition bounds both sides in event time, \
             and rows leave the state by it; remove state_ttl"
                .into(),
        ));
    }
    let filter = added
        .into_iter()
        .chain(join.filter.clone())
        .reduce(Expr::and);
    let plan = if !uses_ttl {
        plan.clone()
    } else {
        let bounded = Join::try_new(
            Arc::clone(&join.left),
            Arc::clone(&join.right),
            join.on.clone(),
            filter,
            join.join_type,
            join.join_constraint,
            join.null_equality,
            join.null_aware,
        )?;
        super::replace_node(plan, found, &LogicalPlan::Join(bounded))?
    };

    // The optimised query: filters and projections of one side below the join, so the state
    // keeps only the rows and columns the join needs.
    let optimized = ctx.state().optimize(&plan)?;
    let joins = find(&optimized, settings.statics);
    let [found] = &joins[..] else {
        return Err(refuse(format!(
            "the optimised query joins {} pairs of streams; a job runs one join of two streams \
             for now",
            joins.len()
        )));
    };
    let LogicalPlan::Join(optimized_join) = found else {
        unreachable!("found joins only")
    };
    // Each side carries its source rows' lineage, so a pair the SQL above fails on is
    // dead-lettered with its rows' positions; and computes its join keys, so a key expression
    // that fails on a row (a CAST) makes that row a dead letter, not the batch fail.
    let mut left = with_lineage(optimized_join.left.as_ref().clone(), &times[0].0)?;
    let mut right = with_lineage(optimized_join.right.as_ref().clone(), &times[1].0)?;
    let mut on = Vec::with_capacity(optimized_join.on.len());
    for (i, (l, r)) in optimized_join.on.iter().enumerate() {
        on.push((
            key_column(&mut left, l, &format!("__sluice_left_key_{i}"))?,
            key_column(&mut right, r, &format!("__sluice_right_key_{i}"))?,
        ));
    }
    let join = &Join::try_new(
        Arc::new(left),
        Arc::new(right),
        on,
        optimized_join.filter.clone(),
        optimized_join.join_type,
        optimized_join.join_constraint,
        optimized_join.null_equality,
        optimized_join.null_aware,
    )?;
    let rules = purge_rules(join, &times);
    let mut sides = Vec::new();
    for (s, input) in [&join.left, &join.right].into_iter().enumerate() {
        let name = ["left", "right"][s];
        event_time_index(input, &times[s]).ok_or_else(|| {
            refuse(format!(
                "the {name} side does not carry its source's event time ({}) to the join",
                times[s].1
            ))
        })?;
        if rules[s].is_empty() {
            return Err(refuse(format!(
                "the optimised join no longer bounds its {name} side; write its time bounds in \
                 the ON clause"
            )));
        }
        let mut fields: Vec<Field> = input
            .schema()
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| Field::new(format!("c{i}"), f.data_type().clone(), f.is_nullable()))
            .collect();
        fields.push(Field::new(
            format!("c{}", fields.len()),
            DataType::UInt64,
            false,
        ));
        let schema = Arc::new(Schema::new(fields));
        let empty = || MemTable::try_new(Arc::clone(&schema), vec![vec![]]).map(Arc::new);
        sides.push(Side {
            name,
            source: times[s].0.clone(),
            time_column: times[s].1.clone(),
            lower: input.as_ref().clone(),
            schema: Arc::clone(&schema),
            expiry: rules[s].clone(),
            preserved: match join.join_type {
                JoinType::Full => true,
                JoinType::Left => s == 0,
                JoinType::Right => s == 1,
                _ => false,
            },
            rows: Vec::new(),
            matched: HashSet::new(),
            next_id: 0,
            new_rows: empty()?,
            probed: empty()?,
        });
    }
    let [left, right]: [Side; 2] = sides.try_into().map_err(|_| refuse("two sides".into()))?;

    // The batch's pairs: the same join over stand-ins of the sides with the same columns.
    let stand_in = |side: &Side, table: &Arc<MemTable>, name: &str| -> Result<LogicalPlan> {
        let schema = side.lower.schema();
        let mut renamed: Vec<Expr> = schema
            .iter()
            .enumerate()
            .map(|(i, (qualifier, field))| {
                Expr::Column(Column::new(Some(name), format!("c{i}")))
                    .alias_qualified(qualifier.cloned(), field.name())
            })
            .collect();
        renamed.push(
            Expr::Column(Column::new(Some(name), format!("c{}", side.id_index())))
                .alias(format!("__sluice_{}_row", side.name)),
        );
        Ok(
            LogicalPlanBuilder::scan(name, provider_as_source(Arc::clone(table) as _), None)?
                .project(renamed)?
                .build()?,
        )
    };
    // Each pair: the join's columns, then the two rows' ids.
    let mut pair_columns: Vec<Expr> = join
        .schema
        .iter()
        .map(|(qualifier, field)| Expr::Column(Column::new(qualifier.cloned(), field.name())))
        .collect();
    for side in ["left", "right"] {
        pair_columns.push(Expr::Column(Column::new_unqualified(format!(
            "__sluice_{side}_row"
        ))));
    }
    let pairs_of = |columns: &[Expr], l: LogicalPlan, r: LogicalPlan| -> Result<LogicalPlan> {
        let inner = Join::try_new(
            Arc::new(l),
            Arc::new(r),
            join.on.clone(),
            join.filter.clone(),
            JoinType::Inner,
            join.join_constraint,
            join.null_equality,
            join.null_aware,
        )?;
        Ok(LogicalPlanBuilder::from(LogicalPlan::Join(inner))
            .project(columns.to_vec())?
            .build()?)
    };
    // New left ⋈ (right state + new right), left state ⋈ new right.
    let pairs = |columns: &[Expr]| -> Result<[LogicalPlan; 2]> {
        Ok([
            pairs_of(
                columns,
                stand_in(&left, &left.new_rows, "__sluice_left_new")?,
                stand_in(&right, &right.probed, "__sluice_right_all")?,
            )?,
            pairs_of(
                columns,
                stand_in(&left, &left.probed, "__sluice_left_state")?,
                stand_in(&right, &right.new_rows, "__sluice_right_new")?,
            )?,
        ])
    };

    // The upper part reads the pairs from a table with the join's columns.
    let joined_schema = Arc::new(Schema::new(
        join.schema
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| Field::new(format!("c{i}"), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let joined = Arc::new(MemTable::try_new(Arc::clone(&joined_schema), vec![vec![]])?);
    // Exactly the optimised join's columns (the lineage carried for dead letters left out).
    let renamed: Vec<Expr> = optimized_join
        .schema
        .iter()
        .map(|(qualifier, field)| {
            let column = Column::new(qualifier.cloned(), field.name());
            let i = join.schema.index_of_column(&column)?;
            Ok(
                Expr::Column(Column::new(Some(JOINED_TABLE), format!("c{i}")))
                    .alias_qualified(qualifier.cloned(), field.name()),
            )
        })
        .collect::<Result<_>>()?;
    let replacement = LogicalPlanBuilder::scan(
        JOINED_TABLE,
        provider_as_source(Arc::clone(&joined) as _),
        None,
    )?
    .project(renamed)?
    .build()?;
    let upper = super::replace_node(&optimized, found, &replacement)?;
    if let Some(name) = super::other_stream(&upper, JOINED_TABLE, settings.statics) {
        return Err(refuse(format!(
            "the query reads '{name}' beside the joined streams; a job with a join of two \
             streams reads its streams only below the join (static tables may be joined above \
             it)"
        )));
    }
    let preserved = [left.preserved, right.preserved];
    let closing = match closing_key(&upper, join, JOINED_TABLE, settings.statics, preserved) {
        Ok(None) => None,
        Ok(Some(key)) if [&left, &right][1 - key.side].preserved => {
            let (closing, other) = ([&left, &right][key.side], [&left, &right][1 - key.side]);
            return Err(Error::UnsupportedQuery(format!(
                "the SQL over the joined rows runs once per key of {} ({} side), but the join \
                 also writes the unmatched rows of {}: they have no {} row to close with, so \
                 their NULL key would make a group of its own in every batch. Join with an \
                 inner join, or an outer join keeping only {}'s unmatched rows",
                closing.source, closing.name, other.source, closing.source, closing.source
            )));
        }
        Ok(Some(key)) => Some(HeldPairs::new(
            key,
            top_per_key(&upper, JOINED_TABLE),
            &joined_schema,
        )?),
        Err(node) => {
            return Err(Error::UnsupportedQuery(format!(
                "{node} over the joined rows needs state of its own. Above a join of two \
                 streams, aggregates and window functions run once per key when each groups \
                 (GROUP BY) or partitions (PARTITION BY) by every join key column of one side, \
                 as the ON clause names them (e.g. `GROUP BY A.id` for `ON A.id = B.auction`): \
                 a key's pairs are final once that side's row has left the state. One \
                 aggregate over the join's output (or over those per-key results), not keyed \
                 so, runs as a running aggregate in update mode (with state_ttl); a sort or \
                 limit over all keys is a chain of stateful operators not built yet"
            )));
        }
    };

    // With first rows per key, the pairs' plans narrowed to the ranking's columns and the ids.
    let ranking = closing
        .as_ref()
        .and_then(HeldPairs::top)
        .and_then(|top| Some((top, top.over_its_columns()?)));
    let ranked_pairs = match ranking {
        None => None,
        Some((top, narrow_top)) => {
            let (join_columns, ids) = pair_columns.split_at(pair_columns.len() - 2);
            let columns: Vec<Expr> = top
                .columns()
                .iter()
                .map(|&i| join_columns[i].clone())
                .chain(ids.iter().cloned())
                .collect();
            let mut wide: Vec<Field> = joined_schema
                .fields()
                .iter()
                .map(|f| f.as_ref().clone())
                .collect();
            for side in ["left", "right"] {
                wide.push(Field::new(
                    format!("__sluice_{side}_row"),
                    DataType::UInt64,
                    true,
                ));
            }
            Some(RankedPairs {
                plans: pairs(&columns)?,
                top: narrow_top,
                wide: Arc::new(Schema::new(wide)),
            })
        }
    };

    let pairs = pairs(&pair_columns)?;
    let mut state_fields = vec![Field::new(SIDE, DataType::UInt8, false)];
    for (prefix, side) in [("l", &left), ("r", &right)] {
        for (i, f) in side.schema.fields().iter().enumerate() {
            state_fields.push(Field::new(
                format!("{prefix}{i}"),
                f.data_type().clone(),
                true,
            ));
        }
    }
    // The keys as written (not the sides' computed key columns): what the state means.
    let condition = optimized_join
        .on
        .iter()
        .map(|(l, r)| format!("{} = {}", readable(l), readable(r)))
        .chain(join.filter.iter().map(readable))
        .collect::<Vec<_>>()
        .join(" AND ");
    Ok(StreamJoin {
        display,
        condition,
        sides: [left, right],
        pairs,
        upper,
        joined,
        joined_schema,
        allowed_lateness: settings.allowed_lateness,
        state_schema: Arc::new(Schema::new(state_fields)),
        changes: Vec::new(),
        closing,
        ranked_pairs,
        log: None,
        plan: optimized,
    })
}

impl StreamJoin {
    /// The operator's id as the `position`-th operator of the query's chain.
    pub(crate) fn id(position: usize) -> String {
        format!("{position}-join")
    }

    /// The sources of the two sides (the same one twice for a self-join), with their
    /// event-time columns.
    pub(crate) fn sources(&self) -> [(&str, &str); 2] {
        [
            (&self.sides[0].source, &self.sides[0].time_column),
            (&self.sides[1].source, &self.sides[1].time_column),
        ]
    }

    /// The whole query as it runs (optimised, with the bounds `state_ttl` added).
    pub(crate) fn plan(&self) -> &LogicalPlan {
        &self.plan
    }

    /// The schema of the rows the upper part produces.
    pub(crate) fn output_schema(&self) -> SchemaRef {
        Arc::new(self.upper.schema().as_arrow().clone())
    }

    /// The operator as `sluice validate` shows it.
    pub(crate) fn describe(&self, position: usize) -> super::OperatorDescription {
        let rule = |side: &Side| -> String {
            let columns: Vec<String> = side
                .expiry
                .iter()
                .map(|&(i, offset)| {
                    let column = side.lower.schema().field(i).name().clone();
                    match offset {
                        0 => column,
                        o if o > 0 => format!("{column} + {}", duration(o)),
                        o => format!("{column} − {}", duration(-o)),
                    }
                })
                .collect();
            format!(
                "a row of {} ({}) leaves when {} < watermark{}",
                side.source,
                side.name,
                columns.join(" or "),
                if self.allowed_lateness > 0 {
                    format!(" − {}", duration(self.allowed_lateness))
                } else {
                    String::new()
                }
            )
        };
        super::OperatorDescription {
            id: Self::id(position),
            what: format!(
                "join of streams {} and {} on {}",
                self.sides[0].source, self.sides[1].source, self.condition
            ),
            state_key: self
                .sides
                .iter()
                .map(|s| format!("{} rows", s.source))
                .chain(
                    self.closing_side()
                        .map(|(side, _)| format!("pairs held per {} row", side.source)),
                )
                .collect(),
            purge: match self.closing_side() {
                None => format!("{}; {}", rule(&self.sides[0]), rule(&self.sides[1])),
                Some((side, _)) => format!(
                    "{}; {}; a held pair leaves with its {} row",
                    rule(&self.sides[0]),
                    rule(&self.sides[1]),
                    side.source
                ),
            },
            emits: {
                let mut emits = match self.closing_side() {
                    None => "each matching pair once, in the batch its second row arrives \
                             (append)"
                        .to_string(),
                    Some((side, key)) => format!(
                        "the SQL above the join once per key ({key}) of {}, over the pairs of \
                         its rows that left the state in the batch — final for a key unique \
                         in {} (append)",
                        side.source, side.source
                    ),
                };
                for side in self.sides.iter().filter(|s| s.preserved) {
                    emits.push_str(&format!(
                        "; an unmatched row of {} once it can no longer match, the other side \
                         null",
                        side.source
                    ));
                }
                emits.push_str("; a row below the watermark is late");
                emits
            },
        }
    }

    /// With per-key closing: the closing side and its key columns, as text.
    fn closing_side(&self) -> Option<(&Side, String)> {
        let key = self.closing.as_ref()?.key();
        let side = &self.sides[key.side];
        let schema = side.lower.schema();
        let columns: Vec<String> = key
            .in_side
            .iter()
            .map(|&i| {
                let (qualifier, field) = schema.qualified_field(i);
                match qualifier {
                    Some(q) => format!("{q}.{}", field.name()),
                    None => field.name().clone(),
                }
            })
            .collect();
        Some((side, columns.join(", ")))
    }

    /// What the state means: each side's source, its columns (qualified names and types) and
    /// filters — the rows it keeps — and the join's condition, which gives the purge rules.
    pub(crate) fn fingerprint(&self) -> String {
        let side = |s: &Side| {
            let columns: Vec<String> = s
                .lower
                .schema()
                .iter()
                .map(|(qualifier, f)| match qualifier {
                    Some(q) => format!("{q}.{} {}", f.name(), f.data_type()),
                    None => format!("{} {}", f.name(), f.data_type()),
                })
                .collect();
            let mut filters = Vec::new();
            let _ = s.lower.apply(|node| {
                match node {
                    LogicalPlan::Filter(f) => filters.push(readable(&f.predicate)),
                    LogicalPlan::TableScan(t) => filters.extend(t.filters.iter().map(readable)),
                    _ => {}
                }
                Ok(TreeNodeRecursion::Continue)
            });
            let filters = if filters.is_empty() {
                String::new()
            } else {
                format!(" where {}", filters.join(" AND "))
            };
            format!("{}({}){filters}", s.source, columns.join(", "))
        };
        // An outer join records matches an inner one does not, and the lateness decides what
        // a restart drops as already let go.
        let preserved: Vec<&str> = self
            .sides
            .iter()
            .filter(|s| s.preserved)
            .map(|s| s.name)
            .collect();
        let closing = match self.closing_side() {
            Some((side, key)) => format!(
                "; holding pairs until their {} row leaves, by {key}",
                side.name
            ),
            None => String::new(),
        };
        format!(
            "join {} with {} on {}; preserving [{}]; lateness {}{closing}",
            side(&self.sides[0]),
            side(&self.sides[1]),
            self.condition,
            preserved.join(", "),
            self.allowed_lateness
        )
    }

    /// The oldest event time still on time under `watermark`: rows below it are late.
    pub(crate) fn on_time_limit(&self, watermark: Option<i64>) -> Option<i64> {
        watermark.map(|w| w.saturating_sub(self.allowed_lateness))
    }

    /// One batch: runs each side's plan over its source's rows in `inputs` (rows late under
    /// the watermark in force left out: see [`crate::late::on_time_rows`]), joins the new rows
    /// with the kept ones and with each other, keeps the new rows, lets go of the rows the
    /// batch's new watermark says can no longer match (a preserved side's unmatched ones emitted
    /// with the other side null), and runs the upper part over the pairs. `side_rows` runs a
    /// side's plan over the rows given (isolating the rows it fails on).
    ///
    /// Letting go under the *new* watermark is letting go before the next batch under the
    /// watermark in force for it; done here, an unmatched row is emitted by the batch whose
    /// manifest records the watermark that let it go, so a restart (which drops what the
    /// restored watermark let go) never emits it twice.
    ///
    /// # Errors
    /// If a side's plan, the join or the upper part fails.
    pub(crate) async fn run<F, Fut>(
        &mut self,
        ctx: &SessionContext,
        watermark: BatchWatermark,
        inputs: SourceInputs,
        side_rows: F,
    ) -> Result<QueryOutput>
    where
        F: Fn(LogicalPlan, SourceInputs) -> Fut,
        Fut: Future<Output = Result<QueryOutput>>,
    {
        let limit = self.on_time_limit(watermark.before);
        let mut out = QueryOutput::default();
        let mut new_rows: [Vec<RecordBatch>; 2] = [Vec::new(), Vec::new()];
        let self_join = self.sides[0].source == self.sides[1].source;
        let mut failed_here = HashSet::new();
        let first_new_id = [self.sides[0].next_id, self.sides[1].next_id];
        // Late rows are taken out of each side's read before its plan, chunk by chunk, and a
        // chunk without one goes in as it is; a self-join's read once for both sides. (As a
        // filter in the plan they made the kept new rows copies held beside the read through
        // the batch: DataFusion's filter re-batches the rows it passes into copies once it has
        // met a short batch.)
        let on_time = |side: &Side| -> Result<SourceInputs> {
            let read = inputs.get(&side.source).map_or(&[][..], Vec::as_slice);
            let read = match limit {
                Some(limit) => crate::late::on_time_rows(read, &side.time_column, limit)?,
                None => read.to_vec(),
            };
            Ok(BTreeMap::from([(side.source.clone(), read)]))
        };
        let left = on_time(&self.sides[0])?;
        let right = if self_join {
            left.clone()
        } else {
            on_time(&self.sides[1])?
        };
        // The read is held from here on only by each side's rows for its plan: the columns a
        // side's plan leaves out (Nexmark q9's bid `url` and `channel`, 40 % of its bytes) are
        // let go once it has run, not held through the join.
        drop(inputs);
        for ((s, side), on_time) in self.sides.iter_mut().enumerate().zip([left, right]) {
            let rows = side_rows(side.lower.clone(), on_time).await?;
            for failed in rows.failed {
                // A self-join reads each row twice: one dead letter for it.
                if !self_join || failed_here.insert(lineage_of(&failed.row)) {
                    out.failed.push(failed);
                }
            }
            new_rows[s] = side.stored(rows.batches)?;
        }
        // Each pair once: the new left rows with the right side's kept and new rows, the kept
        // left rows with the new right rows.
        let [left, right] = &self.sides;
        *left.new_rows.batches[0].write().await = new_rows[0].clone();
        *left.probed.batches[0].write().await = left.rows.clone();
        *right.new_rows.batches[0].write().await = new_rows[1].clone();
        *right.probed.batches[0].write().await =
            right.rows.iter().chain(&new_rows[1]).cloned().collect();
        let width = self.joined_schema.fields().len();
        let closing_side = self.closing.as_ref().map(|h| h.key().side);
        let pairs = self.joined_pairs(ctx).await;
        for table in [&left.new_rows, &left.probed, &right.new_rows, &right.probed] {
            table.batches[0].write().await.clear();
        }
        let (pairs, matched_ids, failure) = pairs?;
        if let Some(error) = failure {
            let error = Error::from(error);
            if !is_data_error(&error) {
                return Err(error);
            }
            // Not a row's: the key expressions and (for an inner join) one side's conditions
            // run in the sides' plans, where a failing row is a dead letter; what fails here
            // is a condition over both sides, or on an outer join's preserved side.
            return Err(Error::UnsupportedQuery(format!(
                "the join's condition failed on the values of a pair: {error}; a condition \
                 that can fail on values (a division, a cast) belongs in one side's SQL (a \
                 subquery for an outer join's preserved side), where a failing row is a dead \
                 letter — changing the condition starts the job over (its state means another \
                 join)"
            )));
        }
        // Each joined batch, with the ids of its rows of the closing side, if any.
        let mut joined: Vec<(RecordBatch, Option<ArrayRef>)> = Vec::new();
        for pair in pairs {
            joined.push((
                RecordBatch::try_new(
                    Arc::clone(&self.joined_schema),
                    pair.columns()[..width].to_vec(),
                )?,
                closing_side.map(|c| Arc::clone(pair.column(width + c))),
            ));
        }
        let mut matched_now: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for (s, side) in self.sides.iter_mut().enumerate() {
            for &id in &matched_ids[s] {
                if side.matched.insert(id) {
                    matched_now[s].push(id);
                }
            }
        }
        for (side, rows) in self.sides.iter_mut().zip(new_rows) {
            side.rows.extend(rows);
        }
        if let Some(limit) = self.on_time_limit(watermark.after) {
            for s in 0..2 {
                for rows in self.sides[s].purge(limit)? {
                    let ids = closing_side.map(|c| -> ArrayRef {
                        if c == s {
                            Arc::clone(rows.column(self.sides[s].id_index()))
                        } else {
                            arrow::array::new_null_array(&DataType::UInt64, rows.num_rows())
                        }
                    });
                    joined.push((self.unmatched(s, &rows)?, ids));
                }
            }
        }
        // The delta: the new rows still kept after the purge (one the purge let go is dropped
        // again by a restart's purge under the same watermark: writing it would only cost),
        // and the new matches.
        self.changes.clear();
        for (s, side) in self.sides.iter().enumerate() {
            for rows in side.kept_since(first_new_id[s]) {
                self.changes
                    .push(state_rows(&self.sides, &self.state_schema, s, &rows)?);
            }
        }
        for (s, ids) in matched_now.iter().enumerate() {
            if !ids.is_empty() {
                self.changes
                    .push(matched_rows(&self.sides, &self.state_schema, s, ids)?);
            }
        }
        if let Some(held) = &mut self.closing {
            // Held until their row of the closing side leaves; those whose row left (held
            // before, or new), run. Only the new pairs still held go to the delta.
            let c = held.key().side;
            let open = self.sides[c].ids();
            let mut closed = held.take_closed(&open)?;
            let mut new_held = Vec::new();
            for (batch, ids) in joined {
                let ids = ids.ok_or_else(|| Error::InvalidJob("a pair without its row".into()))?;
                let (now_closed, still_held) = held.split_new(&batch, ids, &open)?;
                closed.extend(now_closed);
                new_held.extend(still_held);
            }
            for kept in held.hold_new(new_held)? {
                self.changes
                    .push(held_state_rows(&self.sides, &self.state_schema, c, &kept)?);
            }
            if !closed.is_empty() {
                let (batches, failed) = self.upper_by_key(ctx, closed).await?;
                out.batches.extend(batches);
                out.failed.extend(failed);
            }
        } else if !joined.is_empty() {
            // One run over the pairs as they are; only if it fails on values, the pairs in one
            // batch, halved down to those it fails on.
            let joined: Vec<RecordBatch> = joined.into_iter().map(|(b, _)| b).collect();
            match self.run_upper(ctx, joined.clone()).await {
                Ok(batches) => out.batches.extend(batches),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(_) => {
                    let all = arrow::compute::concat_batches(&self.joined_schema, &joined)?;
                    drop(joined);
                    let (batches, failed) = self.upper_isolating(ctx, all).await?;
                    out.batches.extend(batches);
                    out.failed.extend(failed);
                }
            }
        }
        Ok(out)
    }

    /// This batch's pairs from the join's plans (over the stand-in tables `run` fills): each
    /// pair's columns, then the ids of both its rows; the ids of the preserved sides' rows that
    /// matched, each once (a set would do, but a list keeps the state files' order the same
    /// between runs); and the error a plan failed with, if one did (then the pairs are
    /// incomplete — with first rows per key, not widened — and only the error is used). With
    /// first rows per key (see
    /// `operators/closing.rs`), the narrowed plans' pairs are ranked against those before them
    /// as they come and let go if outranked — their match still counts — and only those kept
    /// are widened to all the join's columns: no batch holds all its pairs, nor a copy of the
    /// rows' columns for each.
    ///
    /// # Errors
    /// If pairs cannot be ranked (their columns compared, filtered or concatenated), or
    /// widened.
    async fn joined_pairs(
        &self,
        ctx: &SessionContext,
    ) -> Result<(Vec<RecordBatch>, [Vec<u64>; 2], Option<DataFusionError>)> {
        // With first rows per key: the pairs ranked as they come, and their narrowed plans.
        let mut ranked = match (&self.ranked_pairs, &self.closing) {
            (Some(ranked_pairs), Some(held)) => Some((
                FirstRows::new(
                    &ranked_pairs.top,
                    ranked_pairs.plans[0].schema().as_arrow(),
                    ranked_pairs.top.columns().len() + held.key().side,
                )?,
                ranked_pairs,
            )),
            _ => None,
        };
        // The plans, and where each pair's two ids are.
        let (plans, ids_at) = match ranked.as_ref().map(|(_, ranked_pairs)| *ranked_pairs) {
            Some(ranked_pairs) => (&ranked_pairs.plans, ranked_pairs.top.columns().len()),
            None => (&self.pairs, self.joined_schema.fields().len()),
        };
        let mut pairs: Vec<RecordBatch> = Vec::new();
        // The pairs' rows after the last time all were ranked again, and since.
        let (mut kept_rows, mut since) = (0, 0);
        let mut matched_ids: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        let mut matched_seen: [HashSet<u64>; 2] = [HashSet::new(), HashSet::new()];
        for plan in plans {
            let stream = match ctx.execute_logical_plan(plan.clone()).await {
                Ok(df) => df.execute_stream().await,
                Err(e) => Err(e),
            };
            let mut stream = match stream {
                Ok(stream) => stream,
                Err(e) => return Ok((pairs, matched_ids, Some(e))),
            };
            while let Some(pair) = stream.next().await {
                let pair = match pair {
                    Ok(pair) => pair,
                    Err(e) => return Ok((pairs, matched_ids, Some(e))),
                };
                for (s, side) in self.sides.iter().enumerate() {
                    if side.preserved {
                        let ids = pair.column(ids_at + s).as_primitive::<UInt64Type>();
                        for &id in ids.values() {
                            if matched_seen[s].insert(id) {
                                matched_ids[s].push(id);
                            }
                        }
                    }
                }
                let Some((ranked, _)) = &mut ranked else {
                    if pair.num_rows() > 0 {
                        pairs.push(pair);
                    }
                    continue;
                };
                if let Some(kept) = ranked.push(pair)? {
                    since += kept.num_rows();
                    pairs.push(kept);
                }
                // Pairs kept as they came but outranked since: let go once they add up.
                if since >= kept_rows.max(RANK_AGAIN_AFTER) {
                    pairs = ranked.filter_each(pairs)?;
                    kept_rows = pairs.iter().map(RecordBatch::num_rows).sum();
                    since = 0;
                }
            }
        }
        if let Some((ranked, ranked_pairs)) = &ranked {
            let first = ranked.filter_all(pairs)?;
            pairs = Vec::with_capacity(first.len());
            for narrow in first {
                pairs.push(self.widen(&narrow, ids_at, &ranked_pairs.wide).await?);
            }
        }
        Ok((pairs, matched_ids, None))
    }

    /// Narrowed pairs (the ranking's columns, then the two rows' ids at `ids_at`) with all
    /// the join's columns, gathered from their two rows in the stand-in tables (still filled):
    /// the pairs the whole plans yield, in `wide`'s schema.
    ///
    /// # Errors
    /// If a pair's row is not among its side's rows (not expected), or the rows cannot be
    /// gathered.
    async fn widen(
        &self,
        narrow: &RecordBatch,
        ids_at: usize,
        wide: &SchemaRef,
    ) -> Result<RecordBatch> {
        let [left, right] = &self.sides;
        // Every left row is new or kept; the right side's probed table holds both.
        let mut left_rows = left.probed.batches[0].read().await.clone();
        left_rows.extend(left.new_rows.batches[0].read().await.iter().cloned());
        let right_rows = right.probed.batches[0].read().await.clone();
        let mut columns = Vec::with_capacity(wide.fields().len());
        for (s, (side, rows)) in [(left, &left_rows), (right, &right_rows)]
            .into_iter()
            .enumerate()
        {
            let ids = narrow.column(ids_at + s).as_primitive::<UInt64Type>();
            let gathered = rows_by_id(rows, side, ids.values())?;
            columns.extend_from_slice(&gathered.columns()[..side.id_index()]);
        }
        columns.push(Arc::clone(narrow.column(ids_at)));
        columns.push(Arc::clone(narrow.column(ids_at + 1)));
        Ok(RecordBatch::try_new(Arc::clone(wide), columns)?)
    }

    /// The upper part over closed pairs, one run for all keys; if it fails on values, the keys
    /// whose pairs it fails on are found by halving over whole keys (sorted by key), and their
    /// pairs dead-lettered.
    async fn upper_by_key(
        &self,
        ctx: &SessionContext,
        closed: Vec<RecordBatch>,
    ) -> Result<(Vec<RecordBatch>, Vec<FailedRow>)> {
        match self.run_upper(ctx, closed.clone()).await {
            Ok(out) => return Ok((out, Vec::new())),
            Err(e) if !is_data_error(&e) => return Err(e),
            Err(_) => {}
        }
        let held = self
            .closing
            .as_ref()
            .ok_or_else(|| Error::InvalidJob("per-key closing without its held pairs".into()))?;
        let ClosedPairs { rows, starts } = held.by_key(&closed)?;
        drop(closed);
        let (mut batches, mut failed) = (Vec::new(), Vec::new());
        let mut pending = vec![(0, starts.len() - 1)];
        while let Some((first, end)) = pending.pop() {
            if first == end {
                continue;
            }
            let (offset, len) = (starts[first], starts[end] - starts[first]);
            match self.run_upper(ctx, vec![rows.slice(offset, len)]).await {
                Ok(out) => batches.extend(out),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(e) if end - first == 1 => {
                    for i in offset..offset + len {
                        failed.push(self.failed_pair(&rows.slice(i, 1), &e)?);
                    }
                }
                Err(_) => {
                    let half = first + (end - first) / 2;
                    pending.push((half, end));
                    pending.push((first, half));
                }
            }
        }
        Ok((batches, failed))
    }

    /// The upper part over `joined` rows (pairs, and unmatched rows null-padded); rows it fails
    /// on (by their values) are found by halving and dead-lettered, a pair as one dead letter.
    async fn upper_isolating(
        &self,
        ctx: &SessionContext,
        joined: RecordBatch,
    ) -> Result<(Vec<RecordBatch>, Vec<FailedRow>)> {
        let (mut batches, mut failed) = (Vec::new(), Vec::new());
        let mut pending = vec![(0, joined.num_rows())];
        while let Some((offset, len)) = pending.pop() {
            if len == 0 {
                continue;
            }
            match self.run_upper(ctx, vec![joined.slice(offset, len)]).await {
                Ok(out) => batches.extend(out),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(e) if len == 1 => failed.push(self.failed_pair(&joined.slice(offset, 1), &e)?),
                Err(_) => {
                    let half = len / 2;
                    pending.push((offset + half, len - half));
                    pending.push((offset, half));
                }
            }
        }
        Ok((batches, failed))
    }

    /// The upper part over `joined` rows.
    async fn run_upper(
        &self,
        ctx: &SessionContext,
        joined: Vec<RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        *self.joined.batches[0].write().await = joined;
        let result = match ctx.execute_logical_plan(self.upper.clone()).await {
            Ok(df) => df.collect().await,
            Err(e) => Err(e),
        };
        self.joined.batches[0].write().await.clear();
        Ok(result?.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// A joined row the upper part fails on, as one dead letter: both sides' columns (named
    /// `<qualifier>.<column>`), at the position of its left row (of its right row, for a right
    /// row unmatched), the other row's position in the error.
    fn failed_pair(&self, row: &RecordBatch, error: &Error) -> Result<FailedRow> {
        let lineage = crate::source::LINEAGE_COLUMNS;
        let left_width = self.sides[0].id_index();
        let present = |s: usize| {
            let first = if s == 0 { 0 } else { left_width };
            let side = &self.sides[s];
            (0..side.id_index()).any(|i| !row.column(first + i).is_null(0))
        };
        let (at, other) = if present(0) { (0, 1) } else { (1, 0) };
        let mut fields = Vec::new();
        let mut columns = Vec::new();
        let mut positions = [String::new(), String::new()];
        for (s, side) in self.sides.iter().enumerate() {
            let first = if s == 0 { 0 } else { left_width };
            let schema = side.lower.schema();
            let position: Vec<String> = lineage
                .iter()
                .filter_map(|name| schema.fields().iter().position(|f| f.name() == name))
                .map(|i| row.column(first + i))
                .filter(|c| !c.is_null(0))
                .map(|c| arrow::util::display::array_value_to_string(c, 0))
                .collect::<std::result::Result<_, _>>()?;
            positions[s] = position.join("@");
            for (i, (qualifier, field)) in schema.iter().enumerate() {
                let column = Arc::clone(row.column(first + i));
                if lineage.contains(&field.name().as_str()) {
                    if s != at {
                        continue;
                    }
                    fields.push(Field::new(field.name(), field.data_type().clone(), true));
                } else {
                    let name = match qualifier {
                        Some(q) => format!("{q}.{}", field.name()),
                        None => field.name().clone(),
                    };
                    fields.push(Field::new(name, field.data_type().clone(), true));
                }
                columns.push(column);
            }
        }
        let error = if present(other) {
            format!(
                "{error} (joined with {} row {})",
                self.sides[other].source, positions[other]
            )
        } else {
            error.to_string()
        };
        Ok(FailedRow {
            source: self.sides[at].source.clone(),
            row: RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)?,
            error,
        })
    }

    /// Unmatched `rows` of side `s` as joined rows: the other side's columns null.
    fn unmatched(&self, s: usize, rows: &RecordBatch) -> Result<RecordBatch> {
        let n = rows.num_rows();
        let mut columns = Vec::with_capacity(self.joined_schema.fields().len());
        for (t, side) in self.sides.iter().enumerate() {
            for i in 0..side.id_index() {
                columns.push(if t == s {
                    Arc::clone(rows.column(i))
                } else {
                    arrow::array::new_null_array(side.schema.field(i).data_type(), n)
                });
            }
        }
        Ok(RecordBatch::try_new(
            Arc::clone(&self.joined_schema),
            columns,
        )?)
    }

    /// Both sides' kept rows, to check what they hold.
    #[cfg(test)]
    pub(crate) fn kept_rows(&self) -> Vec<RecordBatch> {
        self.sides.iter().flat_map(|s| s.rows.clone()).collect()
    }

    /// Rows and in-memory bytes of the state (both sides' kept rows).
    pub(crate) fn state_size(&self) -> StateSize {
        let held = self.closing.as_ref().map_or(&[][..], HeldPairs::rows);
        let rows: usize = self.sides.iter().map(Side::num_rows).sum::<usize>()
            + held.iter().map(RecordBatch::num_rows).sum::<usize>();
        // What the kept rows hold alive (slices of the batches they came from, null arrays
        // shared by columns), each allocation once.
        let bytes = crate::memory::held_bytes(self.sides.iter().flat_map(|s| &s.rows).chain(held));
        StateSize {
            rows: rows as u64,
            bytes: bytes as u64,
        }
    }

    /// Restores both sides' rows from the files a committed manifest lists, without those the
    /// restored `watermark` has purged.
    ///
    /// # Errors
    /// If a file is missing or unreadable, or its columns are not this operator's.
    pub(crate) async fn restore(
        &mut self,
        mut log: StateLog,
        files: &[String],
        watermark: Option<i64>,
    ) -> Result<()> {
        let mut matched: [HashSet<u64>; 2] = [HashSet::new(), HashSet::new()];
        for side in &mut self.sides {
            side.rows.clear();
            side.matched.clear();
            side.next_id = 0;
        }
        if let Some(held) = &mut self.closing {
            held.clear();
        }
        for batch in log
            .restore(files, &self.state_schema)
            .await?
            .into_iter()
            .flat_map(|f| f.rows)
        {
            if batch.num_columns() != self.state_schema.fields().len() {
                return Err(Error::InvalidJob(format!(
                    "a state file of the join has {} columns, not the {} its sides have",
                    batch.num_columns(),
                    self.state_schema.fields().len()
                )));
            }
            let kinds = batch
                .column(0)
                .as_primitive_opt::<UInt8Type>()
                .ok_or_else(|| {
                    Error::InvalidJob("a state file of the join has no side column".into())
                })?
                .clone();
            let mut first = 1;
            for (s, side) in self.sides.iter_mut().enumerate() {
                let width = side.schema.fields().len();
                let id_column = first + side.id_index();
                // Kind s: a row of side s; kind s + 2: a row of side s that matched.
                for (kind, is_row) in [(s as u8, true), (s as u8 + 2, false)] {
                    let mine: BooleanArray = kinds.iter().map(|v| Some(v == Some(kind))).collect();
                    let rows = filter_record_batch(&batch, &mine)?;
                    if rows.num_rows() == 0 {
                        continue;
                    }
                    let ids = rows.column(id_column).as_primitive::<UInt64Type>();
                    if is_row {
                        let columns = rows.columns()[first..first + width].to_vec();
                        side.rows
                            .push(RecordBatch::try_new(Arc::clone(&side.schema), columns)?);
                    } else {
                        matched[s].extend(ids.values().iter().copied());
                    }
                    // No id a file holds is handed out again.
                    let newest = ids.values().iter().max().map_or(0, |m| m + 1);
                    side.next_id = side.next_id.max(newest);
                }
                first += width;
            }
            if let Some(held) = &mut self.closing {
                let mine: BooleanArray = kinds.iter().map(|v| Some(v == Some(HELD))).collect();
                let rows = filter_record_batch(&batch, &mine)?;
                if rows.num_rows() > 0 {
                    let c = held.key().side;
                    let mut columns = Vec::new();
                    let mut first = 1;
                    let mut closing_rows = None;
                    for (t, side) in self.sides.iter().enumerate() {
                        let id_index = side.id_index();
                        columns.extend_from_slice(&rows.columns()[first..first + id_index]);
                        if t == c {
                            closing_rows = Some(Arc::clone(rows.column(first + id_index)));
                        }
                        first += id_index + 1;
                    }
                    let joined = RecordBatch::try_new(Arc::clone(&self.joined_schema), columns)?;
                    let ids = closing_rows.ok_or_else(|| Error::InvalidJob("no side".into()))?;
                    held.hold(&joined, ids)?;
                }
            }
        }
        for (side, matched) in self.sides.iter_mut().zip(matched) {
            let live = side.ids();
            side.matched = matched.intersection(&live).copied().collect();
        }
        // What the restored watermark let go was let go (and emitted) by the committed batch.
        if let Some(limit) = self.on_time_limit(watermark) {
            for side in &mut self.sides {
                side.purge(limit)?;
            }
        }
        // The held pairs whose row that watermark let go were run by the committed batch.
        if let Some(held) = &mut self.closing {
            held.take_closed(&self.sides[held.key().side].ids())?;
            held.prune()?;
        }
        self.changes.clear();
        self.log = Some(log);
        Ok(())
    }

    /// Writes this batch's new rows (a delta, or a new base) and returns the live files.
    pub(crate) async fn write_state(&mut self, batch_id: BatchId) -> Result<StateWrite> {
        let StreamJoin {
            log,
            sides,
            state_schema,
            changes,
            closing,
            ..
        } = self;
        let log = log
            .as_mut()
            .ok_or_else(|| Error::InvalidJob("state written before it was restored".into()))?;
        let held = closing.as_ref().map_or(0, HeldPairs::num_rows);
        let live = (sides.iter().map(Side::num_rows).sum::<usize>() + held) as u64;
        let written = log
            // Rows are not merged (each is its own), so no purge is replayed between files.
            .write(batch_id, state_schema, changes, None, live, || {
                let mut full = Vec::new();
                if let Some(held) = closing {
                    for rows in held.rows() {
                        full.push(held_state_rows(sides, state_schema, held.key().side, rows)?);
                    }
                }
                for (s, side) in sides.iter().enumerate() {
                    for rows in &side.rows {
                        full.push(state_rows(sides, state_schema, s, rows)?);
                    }
                    if !side.matched.is_empty() {
                        let ids: Vec<u64> = side.matched.iter().copied().collect();
                        full.push(matched_rows(sides, state_schema, s, &ids)?);
                    }
                }
                Ok(full)
            })
            .await;
        if written.is_ok() {
            // Written: the delta's rows (which may hold on to rows a later purge lets go) are
            // not needed any more.
            changes.clear();
        }
        written
    }

    /// The state files, once restored.
    pub(crate) fn log(&self) -> Option<&StateLog> {
        self.log.as_ref()
    }

    /// The state files, taken out to restore from another attempt's.
    pub(crate) fn take_log(&mut self) -> Option<StateLog> {
        self.log.take()
    }
}

/// `rows` of side `s` as state rows (the other side's columns null).
fn state_rows(
    sides: &[Side; 2],
    schema: &SchemaRef,
    s: usize,
    rows: &RecordBatch,
) -> Result<RecordBatch> {
    let n = rows.num_rows();
    let mut nulls = NullColumns::new(n);
    let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt8Array::from(vec![s as u8; n]))];
    for (t, side) in sides.iter().enumerate() {
        for (i, f) in side.schema.fields().iter().enumerate() {
            columns.push(if t == s {
                Arc::clone(rows.column(i))
            } else {
                nulls.of(f.data_type())
            });
        }
    }
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// All-null columns of one length, one array per data type, shared by every column of that
/// type: a state row's other side is nulls only, and an array per column held the same
/// zeroed buffers once per column (for a side of a million rows and a dozen columns, tens of
/// megabytes while its delta is written).
struct NullColumns {
    rows: usize,
    made: Vec<(DataType, ArrayRef)>,
}

impl NullColumns {
    fn new(rows: usize) -> Self {
        NullColumns {
            rows,
            made: Vec::new(),
        }
    }

    /// A null array of `data_type`, made once.
    fn of(&mut self, data_type: &DataType) -> ArrayRef {
        if let Some((_, array)) = self.made.iter().find(|(t, _)| t == data_type) {
            return Arc::clone(array);
        }
        let array = arrow::array::new_null_array(data_type, self.rows);
        self.made.push((data_type.clone(), Arc::clone(&array)));
        array
    }
}

/// `side` with its scans of `source` reading the lineage columns too, carried up to its output.
fn with_lineage(side: LogicalPlan, source: &str) -> Result<LogicalPlan> {
    let lineage = crate::source::LINEAGE_COLUMNS;
    let scanned = side
        .transform_up(|node| {
            let LogicalPlan::TableScan(scan) = &node else {
                return Ok(Transformed::no(node));
            };
            let Some(projection) = &scan.projection else {
                return Ok(Transformed::no(node));
            };
            if scan.table_name.table() != source {
                return Ok(Transformed::no(node));
            }
            let schema = scan.source.schema();
            let mut projection = projection.clone();
            for name in lineage {
                if let Ok(i) = schema.index_of(name)
                    && !projection.contains(&i)
                {
                    projection.push(i);
                }
            }
            let scan = datafusion::logical_expr::TableScanBuilder::from(scan.clone())
                .with_projection(Some(projection))
                .build()?;
            Ok(Transformed::yes(LogicalPlan::TableScan(scan)))
        })?
        .data;
    super::carry_columns(scanned, &lineage)
}

/// The join key `expr` of `side` as a column: itself if it is one, else computed by a
/// projection added to `side` under `name`.
fn key_column(side: &mut LogicalPlan, expr: &Expr, name: &str) -> Result<Expr> {
    // A column, or a time plus an interval (a bound, which cannot fail on a value).
    if column_plus(expr).is_some() {
        return Ok(expr.clone());
    }
    let mut exprs: Vec<Expr> = side
        .schema()
        .iter()
        .map(|(qualifier, field)| Expr::Column(Column::new(qualifier.cloned(), field.name())))
        .collect();
    exprs.push(expr.clone().alias(name));
    *side = LogicalPlanBuilder::from(side.clone())
        .project(exprs)?
        .build()?;
    Ok(Expr::Column(Column::new_unqualified(name)))
}

/// A source row's lineage (partition, offset, position) as text.
fn lineage_of(row: &RecordBatch) -> String {
    crate::source::LINEAGE_COLUMNS
        .iter()
        .filter_map(|name| row.column_by_name(name))
        .map(|c| arrow::util::display::array_value_to_string(c, 0).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("@")
}

/// State rows recording that the rows `ids` of side `s` matched (kind `s + 2`; only the id
/// column set).
fn matched_rows(
    sides: &[Side; 2],
    schema: &SchemaRef,
    s: usize,
    ids: &[u64],
) -> Result<RecordBatch> {
    let n = ids.len();
    let mut nulls = NullColumns::new(n);
    let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt8Array::from(vec![s as u8 + 2; n]))];
    for (t, side) in sides.iter().enumerate() {
        for (i, f) in side.schema.fields().iter().enumerate() {
            columns.push(if t == s && i == side.id_index() {
                Arc::new(UInt64Array::from(ids.to_vec()))
            } else {
                nulls.of(f.data_type())
            });
        }
    }
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// Held pairs (the joined columns, then the ids of their rows of side `closing`) as state rows
/// of kind 4: each side's columns, the id column set on the closing side only.
fn held_state_rows(
    sides: &[Side; 2],
    schema: &SchemaRef,
    closing: usize,
    held: &RecordBatch,
) -> Result<RecordBatch> {
    let n = held.num_rows();
    let closing_rows = held.column(held.num_columns() - 1);
    let mut columns: Vec<ArrayRef> = vec![Arc::new(UInt8Array::from(vec![HELD; n]))];
    let mut first = 0;
    for (t, side) in sides.iter().enumerate() {
        for i in 0..side.id_index() {
            columns.push(Arc::clone(held.column(first + i)));
        }
        columns.push(if t == closing {
            Arc::clone(closing_rows)
        } else {
            arrow::array::new_null_array(&DataType::UInt64, n)
        });
        first += side.id_index();
    }
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// `expr` as text, with fixed intervals written as durations (`INTERVAL '1m'`).
fn readable(expr: &Expr) -> String {
    expr.clone()
        .transform(|e| match &e {
            Expr::Literal(value, _) => match interval_micros(value) {
                Some(us) => Ok(Transformed::yes(Expr::Column(Column::new_unqualified(
                    format!("INTERVAL '{}'", duration(us)),
                )))),
                None => Ok(Transformed::no(e)),
            },
            _ => Ok(Transformed::no(e)),
        })
        .map(|t| t.data.to_string())
        .unwrap_or_else(|_| expr.to_string())
}

/// `micros` as a duration, for `validate` (negative with a minus sign).
fn duration(micros: i64) -> String {
    let magnitude =
        humantime::format_duration(std::time::Duration::from_micros(micros.unsigned_abs()));
    if micros < 0 {
        format!("-{magnitude}")
    } else {
        magnitude.to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use arrow::array::{Int64Array, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::Int64Type;
    use proptest::prelude::*;

    use super::*;
    use crate::operators::test_support::{Streamed, stream};
    use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};

    const SECOND: i64 = 1_000_000;
    const TTL: i64 = 30;
    const OUT_OF_ORDERNESS: i64 = 10;

    /// One event: (event time in seconds, key).
    type Event = (i64, u8);

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("ts", event_time_type(), false),
            Field::new("k", DataType::Utf8, false),
            Field::new("until", event_time_type(), false),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]))
    }

    /// `until` of an event: its time plus 7 s per key unit.
    fn until(e: Event) -> i64 {
        e.0 + 7 * i64::from(e.1)
    }

    fn batch(events: &[Event], first: i64) -> RecordBatch {
        let events: Vec<(i64, String, i64)> = events
            .iter()
            .map(|&e| (e.0, format!("k{}", e.1), until(e)))
            .collect();
        keyed_batch(&events, first)
    }

    fn settings(ttl: bool) -> QuerySettings {
        QuerySettings {
            lineage: true,
            event_time: BTreeMap::from([
                ("l".to_string(), "ts".to_string()),
                ("r".to_string(), "ts".to_string()),
            ]),
            state_ttl: ttl.then(|| Duration::from_secs(TTL as u64)),
            ..QuerySettings::default()
        }
    }

    /// A query, whether it needs state_ttl, the pairs it joins (`(left event, right event)`),
    /// and for each side it preserves (outer joins) when a row can no longer match (s).
    struct Case {
        sql: &'static str,
        ttl: bool,
        matches: fn(Event, Event) -> bool,
        preserved: [Option<Expiry>; 2],
    }

    /// When a preserved side's row can no longer match (s).
    type Expiry = fn(Event) -> i64;

    const CASES: [Case; 5] = [
        Case {
            sql: "SELECT l._source_offset AS lo, r._source_offset AS ro FROM l JOIN r \
                  ON l.k = r.k \
                  AND r.ts BETWEEN l.ts - INTERVAL '5' SECOND AND l.ts + INTERVAL '20' SECOND",
            ttl: false,
            matches: |l, r| l.1 == r.1 && l.0 - 5 <= r.0 && r.0 <= l.0 + 20,
            preserved: [None, None],
        },
        Case {
            sql: "SELECT l._source_offset AS lo, r._source_offset AS ro FROM l JOIN r \
                  ON l.k = r.k",
            ttl: true,
            matches: |l, r| l.1 == r.1 && (l.0 - r.0).abs() <= TTL,
            preserved: [None, None],
        },
        Case {
            sql: "SELECT lo, ro FROM (SELECT a._source_offset AS lo, b._source_offset AS ro, \
                  b.k FROM l a JOIN r b ON a.k = b.k AND b.ts >= a.ts AND b.ts <= a.until) \
                  WHERE k <> 'k5'",
            ttl: false,
            matches: |l, r| l.1 == r.1 && l.0 <= r.0 && r.0 <= until(l) && r.1 != 5,
            preserved: [None, None],
        },
        Case {
            sql: "SELECT l._source_offset AS lo, r._source_offset AS ro FROM l LEFT JOIN r \
                  ON l.k = r.k \
                  AND r.ts BETWEEN l.ts - INTERVAL '5' SECOND AND l.ts + INTERVAL '20' SECOND",
            ttl: false,
            matches: |l, r| l.1 == r.1 && l.0 - 5 <= r.0 && r.0 <= l.0 + 20,
            preserved: [Some(|l| l.0 + 20), None],
        },
        Case {
            sql: "SELECT l._source_offset AS lo, r._source_offset AS ro FROM l FULL JOIN r \
                  ON l.k = r.k",
            ttl: true,
            matches: |l, r| l.1 == r.1 && (l.0 - r.0).abs() <= TTL,
            preserved: [Some(|l| l.0 + TTL), Some(|r| r.0 + TTL)],
        },
    ];

    fn watermark_after(before: Option<i64>, chunks: [&Vec<Event>; 2]) -> Option<i64> {
        chunks
            .iter()
            .flat_map(|c| c.iter())
            .map(|e| (e.0 - OUT_OF_ORDERNESS) * SECOND)
            .chain(before)
            .max()
    }

    /// What the rules say: a row below the watermark in force is late; every pair of rows
    /// that were not late and satisfy the condition is emitted once; an on-time row of a
    /// preserved side that matched nothing is emitted alone (the other offset -1) once the
    /// final watermark passes the time it can no longer match. The sorted pairs of offsets and
    /// the late count.
    fn model(batches: &[[Vec<Event>; 2]], case: &Case) -> (Vec<(i64, i64)>, usize) {
        let mut on_time: [Vec<(i64, Event)>; 2] = [Vec::new(), Vec::new()];
        let mut offsets = [0i64; 2];
        let mut late = 0;
        let mut watermark = None;
        for chunks in batches {
            for s in 0..2 {
                for &e in &chunks[s] {
                    if watermark.is_some_and(|w| e.0 * SECOND < w) {
                        late += 1;
                    } else {
                        on_time[s].push((offsets[s], e));
                    }
                    offsets[s] += 1;
                }
            }
            watermark = watermark_after(watermark, [&chunks[0], &chunks[1]]);
        }
        let mut pairs = Vec::new();
        let mut matched = [BTreeSet::new(), BTreeSet::new()];
        for &(lo, l) in &on_time[0] {
            for &(ro, r) in &on_time[1] {
                if (case.matches)(l, r) {
                    pairs.push((lo, ro));
                    matched[0].insert(lo);
                    matched[1].insert(ro);
                }
            }
        }
        for s in 0..2 {
            let Some(expiry) = case.preserved[s] else {
                continue;
            };
            for &(offset, e) in &on_time[s] {
                let gone = watermark.is_some_and(|w| expiry(e) * SECOND < w);
                if gone && !matched[s].contains(&offset) {
                    pairs.push(if s == 0 { (offset, -1) } else { (-1, offset) });
                }
            }
        }
        pairs.sort_unstable();
        (pairs, late)
    }

    /// The query streamed over `batches`, restarted from its state files after batch
    /// `restart_after`: the sorted pairs of offsets it emitted (-1 for a null side), and the
    /// late rows.
    async fn streamed(
        sql: &str,
        ttl: bool,
        batches: &[[Vec<Event>; 2]],
        restart_after: usize,
    ) -> (Vec<(i64, i64)>, usize) {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut offsets = [0i64; 2];
        let mut inputs = Vec::new();
        let mut watermarks = Vec::new();
        let mut watermark = None;
        for chunks in batches {
            let mut rows = BTreeMap::new();
            for (s, name) in ["l", "r"].into_iter().enumerate() {
                rows.insert(name.to_string(), batch(&chunks[s], offsets[s]));
                offsets[s] += chunks[s].len() as i64;
            }
            inputs.push(rows);
            watermark = watermark_after(watermark, [&chunks[0], &chunks[1]]);
            watermarks.push(watermark);
        }
        let streamed = stream(
            sql,
            &sources,
            &settings(ttl),
            &inputs,
            &watermarks,
            restart_after,
        )
        .await;
        let mut pairs = Vec::new();
        for b in &streamed.outputs {
            let lo = b.column(0).as_primitive::<Int64Type>();
            let ro = b.column(1).as_primitive::<Int64Type>();
            pairs.extend(
                lo.iter()
                    .zip(ro.iter())
                    .map(|(l, r)| (l.unwrap_or(-1), r.unwrap_or(-1))),
            );
        }
        let late = streamed.late.iter().map(|(_, l)| l.num_rows()).sum();
        pairs.sort_unstable();
        (pairs, late)
    }

    fn events() -> impl Strategy<Value = Vec<[Vec<Event>; 2]>> {
        let side = || prop::collection::vec((0i64..150, 0u8..6), 0..10);
        prop::collection::vec((side(), side()).prop_map(|(l, r)| [l, r]), 1..8)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Every pair of rows that were not late is emitted exactly once, and an outer
        /// join's unmatched rows once they can no longer match, straight through and across
        /// a restart from the state files at any batch, for interval bounds, state_ttl, a
        /// bound given by another column, left and full joins.
        #[test]
        fn every_on_time_pair_is_joined_once(batches in events(), restart in 0usize..8) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            for case in &CASES {
                let (expected, late) = model(&batches, case);
                let (pairs, streamed_late) =
                    runtime.block_on(streamed(case.sql, case.ttl, &batches, restart));
                prop_assert_eq!(&pairs, &expected, "{}", case.sql);
                prop_assert_eq!(streamed_late, late);
            }
        }
    }

    fn sorted_pairs(out: &QueryOutput) -> Vec<(i64, i64)> {
        let mut pairs = Vec::new();
        for b in &out.batches {
            let lo = b.column(0).as_primitive::<Int64Type>();
            let ro = b.column(1).as_primitive::<Int64Type>();
            pairs.extend(lo.values().iter().copied().zip(ro.values().iter().copied()));
        }
        pairs.sort_unstable();
        pairs
    }

    /// A pair the SQL over the join fails on (by its values) is one dead letter, at its left
    /// row's position with the right row's in the error; both rows stay kept, and every
    /// other pair is written — in this batch and later ones.
    #[tokio::test]
    async fn a_pair_the_query_fails_on_is_a_dead_letter_and_the_rest_join() {
        let sql = "SELECT l._source_offset AS lo, r._source_offset AS ro, \
                   10 / (r._source_offset - 3) AS x FROM l JOIN r ON l.k = r.k";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(true))
            .await
            .unwrap();
        // Two left rows and five right rows of key k1: right row 3 fails with both.
        let inputs = BTreeMap::from([
            ("l".to_string(), batch(&[(10, 1), (11, 1)], 0)),
            ("r".to_string(), batch(&[(12, 1); 5], 0)),
        ]);
        let out = query
            .execute_isolating(&inputs, BatchWatermark::default())
            .await
            .unwrap();
        let expected: Vec<(i64, i64)> = [0, 1]
            .into_iter()
            .flat_map(|lo| [0, 1, 2, 4].map(|ro| (lo, ro)))
            .collect();
        assert_eq!(sorted_pairs(&out), expected);
        let mut offsets: Vec<i64> = out
            .failed
            .iter()
            .map(|f| {
                assert_eq!(f.source, "l");
                assert!(f.error.contains("Divide by zero"), "{}", f.error);
                assert!(f.error.contains("joined with r row 0@3"), "{}", f.error);
                let letter = crate::dead_letter::dead_letter_from_row(&f.row, &f.error).unwrap();
                letter.offset
            })
            .collect();
        offsets.sort_unstable();
        assert_eq!(offsets, vec![0, 1], "one dead letter per failing pair");
        // A later left row joins every kept right row; its pair with row 3 fails again.
        let inputs = BTreeMap::from([("l".to_string(), batch(&[(13, 1)], 2))]);
        let out = query
            .execute_isolating(&inputs, BatchWatermark::default())
            .await
            .unwrap();
        assert_eq!(sorted_pairs(&out), vec![(2, 0), (2, 1), (2, 2), (2, 4)]);
        assert_eq!(out.failed.len(), 1);
    }

    /// A condition on one side (or a join key computed from one side) runs in that side's
    /// plan: a row it fails on is a dead letter of that side, not kept, and the rest join.
    #[tokio::test]
    async fn a_side_condition_that_fails_on_a_row_dead_letters_that_row() {
        let sql = "SELECT l._source_offset AS lo, r._source_offset AS ro FROM l JOIN r \
                   ON upper(l.k) = upper(r.k) AND 10 / (r._source_offset - 3) <> 0";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(true))
            .await
            .unwrap();
        let inputs = BTreeMap::from([
            ("l".to_string(), batch(&[(10, 1), (11, 1)], 0)),
            ("r".to_string(), batch(&[(12, 1); 5], 0)),
        ]);
        let out = query
            .execute_isolating(&inputs, BatchWatermark::default())
            .await
            .unwrap();
        let [failed] = &out.failed[..] else {
            panic!("one dead letter: {:?}", out.failed)
        };
        assert_eq!(failed.source, "r");
        let letter = crate::dead_letter::dead_letter_from_row(&failed.row, &failed.error).unwrap();
        assert_eq!(letter.offset, 3);
        let expected: Vec<(i64, i64)> = [0, 1]
            .into_iter()
            .flat_map(|lo| [0, 1, 2, 4].map(|ro| (lo, ro)))
            .collect();
        assert_eq!(sorted_pairs(&out), expected);
        // Not kept: a later left row joins the four others.
        let inputs = BTreeMap::from([("l".to_string(), batch(&[(13, 1)], 2))]);
        let out = query
            .execute_isolating(&inputs, BatchWatermark::default())
            .await
            .unwrap();
        assert_eq!(sorted_pairs(&out), vec![(2, 0), (2, 1), (2, 2), (2, 4)]);
    }

    #[tokio::test]
    async fn a_join_of_streams_is_described_and_refused_where_it_cannot_hold() {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let query = StreamingQuery::plan(CASES[0].sql, &sources, &settings(false))
            .await
            .unwrap();
        let [operator] = &query.operators()[..] else {
            panic!("one operator")
        };
        assert_eq!(operator.id, "0-join");
        assert!(operator.purge.contains("ts + 20s"), "{}", operator.purge);
        assert!(operator.purge.contains("ts + 5s"), "{}", operator.purge);
        let late = query.late_schema().unwrap();
        assert_eq!(late.field(0).name(), crate::late::SOURCE);
        let outer = StreamingQuery::plan(CASES[3].sql, &sources, &settings(false))
            .await
            .unwrap();
        let emits = &outer.operators()[0].emits;
        assert!(emits.contains("unmatched row of l"), "{emits}");
        let refused = |sql: &'static str, settings: QuerySettings| {
            let sources = sources.clone();
            async move {
                StreamingQuery::plan(sql, &sources, &settings)
                    .await
                    .unwrap_err()
                    .to_string()
            }
        };
        let error = refused(CASES[1].sql, settings(false)).await;
        assert!(error.contains("set state_ttl"), "{error}");
        let error = refused(CASES[0].sql, settings(true)).await;
        assert!(error.contains("state_ttl has no effect"), "{error}");
        let one_bound = "SELECT * FROM l JOIN r ON l.k = r.k AND r.ts >= l.ts";
        let error = refused(one_bound, settings(false)).await;
        assert!(error.contains("left side (l)"), "{error}");
        // A bound by a column that is not a timestamp (text, as inferred) is named.
        let text_bound = "SELECT * FROM l JOIN r ON l.k = r.k \
                          AND r.ts BETWEEN l.ts AND CAST(l.k AS TIMESTAMP)";
        let error = refused(text_bound, settings(false)).await;
        assert!(
            error.contains("l.k (Utf8) bounds it but is not a timestamp"),
            "{error}"
        );
        // An equality of times (with an offset) bounds both sides: no state_ttl needed.
        let equal = "SELECT * FROM l JOIN r ON l.k = r.k AND l.ts = r.ts + INTERVAL '1' SECOND";
        StreamingQuery::plan(equal, &sources, &settings(false))
            .await
            .unwrap();
        // Keys computed in the sides still tell two queries' states apart.
        let fingerprint = |sql: &'static str| {
            let sources = sources.clone();
            async move {
                let query = StreamingQuery::plan(sql, &sources, &settings(true))
                    .await
                    .unwrap();
                query.operators()[0].what.clone()
            }
        };
        let upper = fingerprint("SELECT * FROM l JOIN r ON upper(l.k) = r.k").await;
        let lower = fingerprint("SELECT * FROM l JOIN r ON lower(l.k) = r.k").await;
        assert!(upper.contains("upper(l.k)"), "{upper}");
        assert_ne!(upper, lower);
        // An aggregate over the join's output is a second operator: a running aggregate.
        let counted = "SELECT count(*) FROM l JOIN r ON l.k = r.k";
        let error = refused(counted, settings(true)).await;
        assert!(
            error.contains("aggregates the join's output") && error.contains("mode = \"update\""),
            "{error}"
        );
        let update = QuerySettings {
            output_mode: OutputMode::Update,
            key: Some(vec!["lo".into()]),
            ..settings(false)
        };
        let error = refused(CASES[0].sql, update).await;
        assert!(error.contains("append"), "{error}");
    }

    /// Per-key closing: an event of `l` (event time, how long it stays open, both in
    /// seconds) has the unique key `k<offset>`; an event of `r` (event time, the `l` offset
    /// whose key it bids on).
    type Keyed = (Vec<(i64, i64)>, Vec<(i64, u8)>);

    /// Rows of the sources' schema from `(event time s, key, until s)`, offsets from `first`.
    fn keyed_batch(events: &[(i64, String, i64)], first: i64) -> RecordBatch {
        let times = |f: fn(&(i64, String, i64)) -> i64| {
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(events.iter().map(|e| f(e) * SECOND))
                    .with_timezone("UTC"),
            )
        };
        RecordBatch::try_new(
            schema(),
            vec![
                times(|e| e.0),
                Arc::new(StringArray::from_iter_values(events.iter().map(|e| &e.1))),
                times(|e| e.2),
                Arc::new(StringArray::from(vec!["0"; events.len()])),
                Arc::new(Int64Array::from_iter_values(
                    first..first + events.len() as i64,
                )),
            ],
        )
        .unwrap()
    }

    /// `sql` streamed over the sources' batches of `batches` with a restart after batch
    /// `restart_after`, and the keys the model closes (`inner`: those without a pair left
    /// out).
    async fn per_key_streamed(
        sql: &str,
        batches: &[Keyed],
        restart_after: usize,
        inner: bool,
    ) -> (Streamed, Vec<ClosedKey>) {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let (inputs, watermarks, closed) = per_key_model(batches, inner);
        let streamed = stream(
            sql,
            &sources,
            &settings(false),
            &inputs,
            &watermarks,
            restart_after,
        )
        .await;
        (streamed, closed)
    }

    /// Per key of `l` (its offset): the number of `r` rows joined and the largest `r` offset
    /// among them — from `sql`'s output streamed over `batches` with a restart after batch
    /// `restart_after`, and from the model: every `l` row that was on time and has left the
    /// state under the last watermark (its `until` below it), with the on-time `r` rows
    /// within `[ts, until]`. `inner`: `l` rows that joined nothing are left out.
    async fn closed_per_key(
        sql: &str,
        batches: &[Keyed],
        restart_after: usize,
        inner: bool,
    ) -> (Vec<(i64, i64, i64)>, Vec<(i64, i64, i64)>) {
        let (streamed, closed) = per_key_streamed(sql, batches, restart_after, inner).await;
        let expected = closed.into_iter().map(|(key, _, _)| key).collect();
        let mut out = Vec::new();
        for b in &streamed.outputs {
            let keys = b.column(0).as_string::<i32>();
            let n = b.column(1).as_primitive::<Int64Type>();
            let last = b.column(2).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                let lo: i64 = keys.value(i)[1..].parse().unwrap();
                let last = if arrow::array::Array::is_null(last, i) {
                    -1
                } else {
                    last.value(i)
                };
                out.push((lo, n.value(i), last));
            }
        }
        out.sort_unstable();
        (out, expected)
    }

    /// A key closed by the model: `(l offset, pairs, last r offset or -1)`, the batch that
    /// closes it, and its pairs' `r` rows (offset, event time s).
    type ClosedKey = ((i64, i64, i64), usize, Vec<(i64, i64)>);

    /// The sources' batches of `batches`, the watermark after each, and what per-key closing
    /// gives: `(l offset, pairs, last r offset or -1)` for each on-time `l` row the last
    /// watermark let go, with its on-time matches (`inner`: only those with a match), and the
    /// batch that closes it (the first, from its own, whose watermark passes its bound);
    /// sorted.
    #[allow(clippy::type_complexity)]
    fn per_key_model(
        batches: &[Keyed],
        inner: bool,
    ) -> (
        Vec<BTreeMap<String, RecordBatch>>,
        Vec<Option<i64>>,
        Vec<ClosedKey>,
    ) {
        let (mut inputs, mut watermarks) = (Vec::new(), Vec::new());
        let mut on_time_l: Vec<(i64, i64, i64, usize)> = Vec::new();
        let mut on_time_r: Vec<(i64, i64, i64)> = Vec::new();
        let (mut watermark, mut offsets) = (None::<i64>, [0i64; 2]);
        for (b, (l, r)) in batches.iter().enumerate() {
            // Each batch's events are 10 s later than the last's (some still late).
            let at = |ts: i64| ts + 10 * b as i64;
            let l: Vec<(i64, String, i64)> = l
                .iter()
                .enumerate()
                .map(|(i, &(ts, open))| {
                    let key = format!("k{}", offsets[0] + i as i64);
                    (at(ts), key, at(ts) + open)
                })
                .collect();
            let keys = r;
            let r: Vec<(i64, String, i64)> = r
                .iter()
                .map(|&(ts, k)| (at(ts), format!("k{k}"), at(ts)))
                .collect();
            let late = |ts: i64| watermark.is_some_and(|w| ts * SECOND < w);
            for (i, e) in l.iter().enumerate() {
                if !late(e.0) {
                    on_time_l.push((offsets[0] + i as i64, e.0, e.2, b));
                }
            }
            for (i, (e, &(_, k))) in r.iter().zip(keys).enumerate() {
                if !late(e.0) {
                    on_time_r.push((offsets[1] + i as i64, e.0, i64::from(k)));
                }
            }
            inputs.push(BTreeMap::from([
                ("l".to_string(), keyed_batch(&l, offsets[0])),
                ("r".to_string(), keyed_batch(&r, offsets[1])),
            ]));
            offsets[0] += l.len() as i64;
            offsets[1] += r.len() as i64;
            watermark = l
                .iter()
                .chain(&r)
                .map(|e| (e.0 - OUT_OF_ORDERNESS) * SECOND)
                .chain(watermark)
                .max();
            watermarks.push(watermark);
        }
        let mut expected = Vec::new();
        for &(lo, ts, until, arrived) in &on_time_l {
            let Some(closing) = (arrived..watermarks.len())
                .find(|&c| watermarks[c].is_some_and(|w| until * SECOND < w))
            else {
                continue;
            };
            let joined: Vec<(i64, i64)> = on_time_r
                .iter()
                .filter(|&&(_, rts, k)| k == lo && ts <= rts && rts <= until)
                .map(|r| (r.0, r.1))
                .collect();
            if inner && joined.is_empty() {
                continue;
            }
            let last = joined.iter().map(|j| j.0).max().unwrap_or(-1);
            expected.push(((lo, joined.len() as i64, last), closing, joined));
        }
        expected.sort_unstable();
        (inputs, watermarks, expected)
    }

    /// Per-key closing feeding a running aggregate (Nexmark q4's shape): each key's pair count
    /// `n` and last match, once closed, then per `n` the number of keys and the sum of their
    /// last matches, upserted; a group not fed for `ttl` seconds of watermark is forgotten.
    /// Returns the table the upserts leave, and the model's.
    async fn aggregated_per_key(
        batches: &[Keyed],
        restart_after: usize,
        ttl: i64,
    ) -> (BTreeMap<i64, (i64, i64)>, BTreeMap<i64, (i64, i64)>) {
        let sql = "SELECT n, count(*) AS keys, sum(last) AS total FROM (SELECT l.k, count(*) AS n, \
                   max(r._source_offset) AS last FROM l JOIN r ON l.k = r.k \
                   AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k) AS q GROUP BY n";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let (inputs, watermarks, closed) = per_key_model(batches, true);
        // Batch by batch: the keys it closes fed to their groups (timed with its watermark,
        // the end of time without one), the groups it changed upserted, then the groups
        // `ttl` behind its watermark forgotten.
        let mut groups: BTreeMap<i64, (i64, i64, i64)> = BTreeMap::new();
        let mut expected: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
        for (batch, watermark) in watermarks.iter().enumerate() {
            let time = watermark.unwrap_or(i64::MAX);
            for &((_, n, last), _, _) in closed.iter().filter(|(_, c, _)| *c == batch) {
                let group = groups.entry(n).or_insert((0, 0, i64::MIN));
                *group = (group.0 + 1, group.1 + last, group.2.max(time));
                expected.insert(n, (group.0, group.1));
            }
            if let Some(watermark) = watermark {
                groups.retain(|_, g| g.2 > watermark - ttl * SECOND);
            }
        }
        let running = QuerySettings {
            output_mode: OutputMode::Update,
            state_ttl: Some(Duration::from_secs(ttl as u64)),
            ..settings(false)
        };
        let streamed = stream(sql, &sources, &running, &inputs, &watermarks, restart_after).await;
        let mut table = BTreeMap::new();
        for b in &streamed.outputs {
            let column = |i: usize| b.column(i).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                table.insert(column(0).value(i), (column(1).value(i), column(2).value(i)));
            }
        }
        assert_eq!(streamed.operator_ids, ["0-join", "1-aggregate"]);
        (table, expected)
    }

    fn keyed_events() -> impl Strategy<Value = Vec<Keyed>> {
        let l = prop::collection::vec((0i64..20, 0i64..40), 0..4);
        let r = prop::collection::vec((0i64..25, 0u8..10), 0..12);
        prop::collection::vec((l, r), 1..8)
    }

    /// Above a join, an aggregate grouped by (and a window function partitioned by) the
    /// closing side's key runs once per key, over all of that key's pairs, once its row left
    /// the state — straight through and across a restart from the state files at any batch;
    /// an outer join's unmatched row closes alone; the closing side on either side; nested
    /// aggregates keyed by the key.
    const PER_KEY: [(&str, bool); 5] = [
        (
            "SELECT l.k, count(*) AS n, max(r._source_offset) AS last FROM l JOIN r \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k",
            true,
        ),
        (
            "SELECT l.k, count(r._source_offset) AS n, max(r._source_offset) AS last \
             FROM l LEFT JOIN r ON l.k = r.k AND r.ts >= l.ts AND r.ts <= l.until GROUP BY l.k",
            false,
        ),
        (
            "SELECT k, n, ro FROM (SELECT l.k, CAST(count(*) OVER (PARTITION BY l.k) AS BIGINT) \
             AS n, r._source_offset AS ro, ROW_NUMBER() OVER (PARTITION BY l.k \
             ORDER BY r._source_offset DESC) AS rn FROM r JOIN l \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until) WHERE rn <= 1",
            true,
        ),
        (
            "SELECT k, count(*) AS n, max(ro) AS last FROM (SELECT l.k, r._source_offset AS ro \
             FROM l JOIN r ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until \
             GROUP BY l.k, r._source_offset) GROUP BY k",
            true,
        ),
        (
            "SELECT l.k, count(r._source_offset) AS n, max(r._source_offset) AS last \
             FROM r RIGHT JOIN l ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k",
            false,
        ),
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn the_sql_above_runs_once_per_closed_key(
            batches in keyed_events(),
            restart in 0usize..8,
        ) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            for (sql, inner) in PER_KEY {
                let (out, expected) =
                    runtime.block_on(closed_per_key(sql, &batches, restart, inner));
                prop_assert_eq!(&out, &expected, "{}", sql);
            }
        }

        /// A running aggregate over per-key closing's results (a chain of the join and an
        /// aggregate) upserts what the model gives, groups expiring by state_ttl, straight
        /// through and across a restart from both operators' state files at any batch.
        #[test]
        fn an_aggregate_over_closed_keys_upserts_the_model(
            batches in keyed_events(),
            restart in 0usize..8,
        ) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            // A day (nothing expires), and 15 s (a group the join has not fed for 15 s of
            // watermark expires; batches are about 10 s of event time apart).
            for ttl in [86_400, 15] {
                let (table, expected) =
                    runtime.block_on(aggregated_per_key(&batches, restart, ttl));
                prop_assert_eq!(table, expected, "state_ttl {} s", ttl);
            }
        }
    }

    /// How the model picks a closed key's first rows from its pairs `(r offset, r event
    /// time)`: the `r` offsets kept.
    type ModelPick = fn(&[(i64, i64)]) -> Vec<i64>;

    /// The first rows per key, each query with how the model picks them (a LEFT JOIN's key
    /// without a pair writes its row alone: `r` offset -1).
    const TOP_PER_KEY: [(&str, ModelPick); 4] = [
        (
            "SELECT k, ro FROM (SELECT l.k, r._source_offset AS ro, ROW_NUMBER() OVER \
             (PARTITION BY l.k ORDER BY r._source_offset DESC) AS rn FROM l JOIN r \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until) WHERE rn <= 2",
            |pairs| {
                let mut offsets: Vec<i64> = pairs.iter().map(|p| p.0).collect();
                offsets.sort_unstable_by(|a, b| b.cmp(a));
                offsets.truncate(2);
                offsets
            },
        ),
        (
            "SELECT k, ro, lo FROM (SELECT l.k, r._source_offset AS ro, l._source_offset AS lo, \
             RANK() OVER (PARTITION BY l.k ORDER BY r.ts DESC) AS rn FROM r JOIN l \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until) WHERE rn < 3",
            |pairs| {
                let better = |ts: i64| pairs.iter().filter(|p| p.1 > ts).count();
                pairs
                    .iter()
                    .filter(|p| better(p.1) < 2)
                    .map(|p| p.0)
                    .collect()
            },
        ),
        (
            "SELECT k, ro FROM (SELECT l.k, r._source_offset AS ro, DENSE_RANK() OVER \
             (PARTITION BY l.k ORDER BY r.ts) AS rn FROM l JOIN r \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until) WHERE rn = 2",
            |pairs| {
                let earlier = |ts: i64| {
                    let times: BTreeSet<i64> =
                        pairs.iter().filter(|p| p.1 < ts).map(|p| p.1).collect();
                    times.len()
                };
                pairs
                    .iter()
                    .filter(|p| earlier(p.1) == 1)
                    .map(|p| p.0)
                    .collect()
            },
        ),
        (
            "SELECT k, ro FROM (SELECT l.k, r._source_offset AS ro, ROW_NUMBER() OVER \
             (PARTITION BY l.k ORDER BY r.ts DESC, r._source_offset) AS rn FROM l LEFT JOIN r \
             ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until) WHERE rn <= 1",
            |pairs| {
                let first = pairs.iter().max_by_key(|p| (p.1, std::cmp::Reverse(p.0)));
                vec![first.map_or(-1, |p| p.0)]
            },
        ),
    ];

    /// `sql` (one of [`TOP_PER_KEY`]) streamed over `batches` with a restart after batch
    /// `restart_after`, and the model: the sorted `(l offset, r offset)` rows written.
    async fn top_per_key_streamed(
        (sql, first_rows): (&str, ModelPick),
        batches: &[Keyed],
        restart_after: usize,
    ) -> (Vec<(i64, i64)>, Vec<(i64, i64)>) {
        let inner = !sql.contains("LEFT JOIN");
        let (streamed, closed) = per_key_streamed(sql, batches, restart_after, inner).await;
        let mut expected = Vec::new();
        for ((lo, _, _), _, pairs) in closed {
            expected.extend(first_rows(&pairs).into_iter().map(|ro| (lo, ro)));
        }
        expected.sort_unstable();
        let mut out = Vec::new();
        for b in &streamed.outputs {
            let keys = b.column(0).as_string::<i32>();
            let ro = b.column(1).as_primitive::<Int64Type>();
            // A left column the ranking does not read, where written: the key's own offset.
            let lo = (b.num_columns() > 2).then(|| b.column(2).as_primitive::<Int64Type>());
            for i in 0..b.num_rows() {
                let ro = if arrow::array::Array::is_valid(ro, i) {
                    ro.value(i)
                } else {
                    -1
                };
                let key: i64 = keys.value(i)[1..].parse().unwrap();
                if let Some(lo) = lo {
                    assert_eq!(lo.value(i), key, "{sql}");
                }
                out.push((key, ro));
            }
        }
        out.sort_unstable();
        (out, expected)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Above a join, the first rows per key by ROW_NUMBER, RANK and DENSE_RANK (pruned
        /// to as the pairs come, see `operators/closing.rs`) are what the model ranks from
        /// all of a closed key's pairs — ties included; a LEFT JOIN's key without a pair
        /// alone — straight through and across a restart from the state files at any batch.
        #[test]
        fn the_first_rows_per_key_are_those_of_all_its_pairs(
            batches in keyed_events(),
            restart in 0usize..8,
        ) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            for query in TOP_PER_KEY {
                let (out, expected) =
                    runtime.block_on(top_per_key_streamed(query, &batches, restart));
                prop_assert_eq!(&out, &expected, "{}", query.0);
            }
        }
    }

    /// A self-join keeping the first row per key: its pairs are widened from each side's own
    /// rows (a pair's two rows have ids of their own sides).
    #[tokio::test]
    async fn a_self_join_keeps_its_first_rows_per_key() {
        let sql = "SELECT ao, bo, au FROM (SELECT a._source_offset AS ao, b._source_offset AS bo, \
                   a.until AS au, ROW_NUMBER() OVER (PARTITION BY a.k ORDER BY b.ts DESC, \
                   a._source_offset) AS rn FROM l a JOIN l b \
                   ON a.k = b.k AND b.ts BETWEEN a.ts AND a.until) WHERE rn <= 1";
        let sources = [("l".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        assert!(query.stream_join().unwrap().ranked_pairs.is_some());
        // Pairs (0, 0), (0, 1), (1, 1), (2, 2); k0's rows both close in this batch: (0, 1)
        // ranks first (the latest b, then the first a); k1's one pair.
        let rows = [
            (10, "k0".to_string(), 30),
            (20, "k0".to_string(), 30),
            (15, "k1".to_string(), 35),
        ];
        let inputs = BTreeMap::from([("l".to_string(), keyed_batch(&rows, 0))]);
        let watermark = BatchWatermark {
            before: None,
            after: Some(40 * SECOND),
        };
        let out = query.execute_isolating(&inputs, watermark).await.unwrap();
        assert!(out.failed.is_empty());
        let mut written = Vec::new();
        for batch in &out.batches {
            let column = |i: usize| batch.column(i).as_primitive::<Int64Type>().clone();
            let (ao, bo) = (column(0), column(1));
            let au = batch.column(2).as_primitive::<TimestampMicrosecondType>();
            for i in 0..batch.num_rows() {
                written.push((ao.value(i), bo.value(i), au.value(i) / SECOND));
            }
        }
        written.sort_unstable();
        assert_eq!(written, [(0, 1, 30), (2, 2, 35)]);
    }

    /// A self-join leaves a late row out of both sides (its read is taken once for both),
    /// and pairs the on-time rows across batches.
    #[tokio::test]
    async fn a_self_join_leaves_a_late_row_out_of_both_sides() {
        let sql = "SELECT a._source_offset AS ao, b._source_offset AS bo FROM l a JOIN l b \
                   ON a.k = b.k AND b.ts BETWEEN a.ts AND a.until";
        let sources = [("l".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        let k0 = || "k0".to_string();
        // Batch 1: the row at 12 s is late under the watermark in force (15 s).
        let batches = [
            (vec![(10, k0(), 30), (20, k0(), 30)], None, 15),
            (vec![(12, k0(), 30), (25, k0(), 30)], Some(15), 26),
        ];
        let mut pairs = Vec::new();
        let mut first = 0;
        for (rows, before, after) in batches {
            let inputs = BTreeMap::from([("l".to_string(), keyed_batch(&rows, first))]);
            first += rows.len() as i64;
            let watermark = BatchWatermark {
                before: before.map(|s: i64| s * SECOND),
                after: Some(after * SECOND),
            };
            let out = query.execute_isolating(&inputs, watermark).await.unwrap();
            assert!(out.failed.is_empty());
            for batch in &out.batches {
                let (a, b) = (batch.column(0).as_primitive::<Int64Type>(), batch.column(1));
                let b = b.as_primitive::<Int64Type>();
                pairs.extend(a.values().iter().zip(b.values()).map(|(a, b)| (*a, *b)));
            }
        }
        pairs.sort_unstable();
        // Row 2 (late) in no pair; row 3 with rows 0 and 1 (whose [ts, until] hold 25 s) and
        // itself.
        assert_eq!(pairs, [(0, 0), (0, 1), (0, 3), (1, 1), (1, 3), (3, 3)]);
    }

    /// A side's new rows are kept as the read made them: what the join keeps of a batch shares
    /// the read's buffers, only the rows' ids are new, and a late row (left out) makes a copy
    /// of its chunk alone. (As a filter in the side's plan, the on-time test made copies:
    /// DataFusion's filter re-batches the rows it passes once it has met a short batch.)
    #[tokio::test]
    async fn new_rows_are_kept_uncopied_but_for_chunks_with_a_late_row() {
        let sql = "SELECT l.k, r.ts FROM l JOIN r ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        // Long keys, so that a copy of the rows shows beside their ids.
        let key = |i: i64| format!("{:0>100}", i % 7);
        // Right rows at 100..150 s in chunks of 3 000: shorter than half of DataFusion's
        // batch, which its filter would buffer and copy into batches of 8 192. The watermark
        // stays below them, so none leaves; a late row (at 1 s) is the first of a chunk.
        let chunk = |first: i64, late: bool| {
            let rows: Vec<(i64, String, i64)> = (0..3_000)
                .map(|i| {
                    let ts = if late && i == 0 { 1 } else { 100 + i % 50 };
                    (ts, key(i), ts)
                })
                .collect();
            keyed_batch(&rows, first)
        };
        let mut kept_rows = 0;
        // In batch 2, the first chunk holds a late row.
        for b in 0..3 {
            let read: Vec<RecordBatch> = (0..10)
                .map(|c| chunk((b * 10 + c) * 3_000, b == 2 && c == 0))
                .collect();
            let inputs = BTreeMap::from([
                (
                    "l".to_string(),
                    vec![keyed_batch(&[(100, key(0), 1000)], b)],
                ),
                ("r".to_string(), read.clone()),
            ]);
            let watermark = BatchWatermark {
                before: (b > 0).then_some(40 * SECOND),
                after: Some(50 * SECOND),
            };
            let before = query.join_rows();
            query.execute_read(inputs, watermark).await.unwrap();
            let kept = query.join_rows();
            // One left row and 30 000 right ones a batch, but the late one.
            kept_rows += if b == 2 { 30_000 } else { 30_001 };
            assert_eq!(
                kept.iter().map(RecordBatch::num_rows).sum::<usize>(),
                kept_rows
            );
            // What keeping this batch added beside its read and what was kept before it: the
            // rows' ids, and in batch 2 a copy of its first chunk.
            use crate::memory::held_bytes;
            let added =
                held_bytes(read.iter().chain(&kept)) - held_bytes(&read) - held_bytes(&before);
            let ids = 30_001 * size_of::<u64>();
            let copied = if b == 2 { held_bytes(&read[..1]) } else { 0 };
            assert!(
                added < 2 * ids + copied,
                "batch {b}: keeping its rows added {added} bytes (their ids: {ids}, copied: \
                 {copied})"
            );
        }
    }

    /// A side's read is let go once its plan has run: the columns the plan leaves out (here the
    /// left side's `until`) are not held through the rest of the batch (the other side's plan,
    /// the join), and the kept rows hold none of them.
    #[tokio::test]
    async fn a_sides_unused_columns_are_let_go_once_its_plan_has_run() {
        let sql = "SELECT l.ts, r.k FROM l JOIN r ON l.k = r.k AND l.ts BETWEEN r.ts AND r.until";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        let left = batch(&[(10, 1), (20, 2)], 0);
        let until = Arc::clone(left.column(2));
        let inputs = BTreeMap::from([
            ("l".to_string(), vec![left]),
            ("r".to_string(), vec![batch(&[(5, 1), (15, 2)], 0)]),
        ]);
        // Held by `until` alone when the right side's plan runs.
        let held_then = std::cell::Cell::new(None);
        let out = query
            .join_observed(inputs, BatchWatermark::default(), |source| {
                if source == "r" {
                    held_then.set(Some(Arc::strong_count(&until)));
                }
            })
            .await
            .unwrap();
        assert_eq!(
            out.batches.iter().map(RecordBatch::num_rows).sum::<usize>(),
            2
        );
        assert_eq!(
            held_then.get(),
            Some(1),
            "the left read's `until` is still held"
        );
        // The kept rows share no buffer with it.
        use crate::memory::held_bytes;
        let kept = query.join_rows();
        let until = [RecordBatch::try_from_iter([("until", until)]).unwrap()];
        assert_eq!(
            held_bytes(kept.iter().chain(&until)),
            held_bytes(&kept) + held_bytes(&until)
        );
    }

    /// A row a side's plan fails on is a dead letter holding only itself, not its chunk of the
    /// read (which the join has let go of).
    #[tokio::test]
    async fn a_sides_dead_letter_does_not_hold_its_chunk() {
        let sql = "SELECT l.ts, r.k FROM l JOIN r ON CAST(substr(l.k, 2) AS BIGINT) = \
                   CAST(substr(r.k, 2) AS BIGINT) AND l.ts BETWEEN r.ts AND r.until";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        // 2 000 left rows, one of whose keys does not cast.
        let left: Vec<(i64, String, i64)> = (0..2_000)
            .map(|i| {
                (
                    10,
                    if i == 700 {
                        "kx".into()
                    } else {
                        format!("k{i}")
                    },
                    20,
                )
            })
            .collect();
        let chunk = keyed_batch(&left, 0);
        let inputs = BTreeMap::from([
            ("l".to_string(), vec![chunk.clone()]),
            ("r".to_string(), vec![batch(&[(5, 1)], 0)]),
        ]);
        let out = query
            .execute_read(inputs, BatchWatermark::default())
            .await
            .unwrap();
        let [failed] = out.failed.as_slice() else {
            panic!("{:?}", out.failed);
        };
        use crate::memory::held_bytes;
        let (row, whole) = (held_bytes([&failed.row]), held_bytes([&chunk]));
        assert!(
            row * 20 < whole,
            "the dead letter holds {row} of its chunk's {whole} bytes"
        );
    }

    /// With first rows per key, a key's held pairs are its first rows only; the same ranking
    /// beside another window function over the pairs holds every pair.
    #[tokio::test]
    async fn first_rows_per_key_hold_only_those_pairs() {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        // One key open throughout (until 1000 s), bid on 50 times in each of three batches.
        let l = vec![(0, "k0".to_string(), 1000)];
        let mut inputs = Vec::new();
        let mut watermarks = Vec::new();
        for b in 0..3i64 {
            let r: Vec<(i64, String, i64)> = (0..50)
                .map(|i| (b * 50 + i + 1, "k0".to_string(), 0))
                .collect();
            let l = if b == 0 { l.clone() } else { Vec::new() };
            inputs.push(BTreeMap::from([
                ("l".to_string(), keyed_batch(&l, 0)),
                ("r".to_string(), keyed_batch(&r, b * 50)),
            ]));
            watermarks.push(Some((b * 50 + 50 - OUT_OF_ORDERNESS) * SECOND));
        }
        let first_rows = "SELECT k, ro{outer} FROM (SELECT l.k, r._source_offset AS ro, \
                          ROW_NUMBER() OVER (PARTITION BY l.k ORDER BY r._source_offset DESC) \
                          AS rn{inner} FROM l JOIN r ON l.k = r.k \
                          AND r.ts BETWEEN l.ts AND l.until) WHERE rn <= 2";
        let mut held = Vec::new();
        for (outer, inner) in [("", ""), (", n", ", count(*) OVER (PARTITION BY l.k) AS n")] {
            let sql = first_rows
                .replace("{outer}", outer)
                .replace("{inner}", inner);
            let streamed = stream(&sql, &sources, &settings(false), &inputs, &watermarks, 9).await;
            assert!(streamed.outputs.iter().all(|b| b.num_rows() == 0));
            held.push(streamed.state_rows);
        }
        // 150 pairs held without pruning, 2 with: the sides' rows are the same.
        assert_eq!(held[1] - held[0], 148, "{held:?}");
    }

    /// With first rows per key, the join yields only the columns the ranking reads and the
    /// two rows' ids (a pair's other columns are gathered once it is kept: the proptest above
    /// checks what is written); otherwise every column.
    #[tokio::test]
    async fn first_rows_pairs_are_yielded_with_the_ranking_columns_only() {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        // Partitioned by l.k, ordered by r.ts; `ro` is written but not ranked.
        let sql = TOP_PER_KEY[1].0;
        let query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        let join = query.stream_join().unwrap();
        let ranked = join.ranked_pairs.as_ref().unwrap();
        let width = join.joined_schema.fields().len();
        assert!(width > 4, "{width}");
        for plan in ranked.plans.iter() {
            let names: Vec<&str> = plan
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect();
            assert_eq!(
                names,
                ["k", "ts", "__sluice_left_row", "__sluice_right_row"]
            );
        }
        assert_eq!(ranked.wide.fields().len(), width + 2);
        // Every pair beside another window function: nothing ranked, every column.
        let all = "SELECT l.k, count(*) OVER (PARTITION BY l.k) AS n FROM l JOIN r \
                   ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until";
        let query = StreamingQuery::plan(all, &sources, &settings(false))
            .await
            .unwrap();
        let join = query.stream_join().unwrap();
        assert!(join.ranked_pairs.is_none());
        assert_eq!(
            join.pairs[0].schema().fields().len(),
            join.joined_schema.fields().len() + 2
        );
    }

    /// A key whose pairs the SQL above fails on (by their values) is found by halving over
    /// whole keys: its pairs are dead letters, every other key is written, whole.
    #[tokio::test]
    async fn a_key_the_per_key_sql_fails_on_is_dead_lettered_whole() {
        let sql = "SELECT l.k, count(*) AS n, sum(10 / (r._source_offset - 3)) AS x FROM l JOIN r \
                   ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k";
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let mut query = StreamingQuery::plan(sql, &sources, &settings(false))
            .await
            .unwrap();
        // Keys k0..k3 open from 10 s to 40 s; right rows 0..7 two per key (row 3: key k1).
        let l: Vec<(i64, String, i64)> = (0..4).map(|i| (10, format!("k{i}"), 40)).collect();
        let r: Vec<(i64, String, i64)> = (0..8).map(|i| (20, format!("k{}", i / 2), 20)).collect();
        let inputs = BTreeMap::from([
            ("l".to_string(), keyed_batch(&l, 0)),
            ("r".to_string(), keyed_batch(&r, 0)),
        ]);
        // Nothing closes while the keys are open; all close under a watermark past 40 s.
        let open = BatchWatermark {
            before: None,
            after: Some(30 * SECOND),
        };
        let out = query.execute_isolating(&inputs, open).await.unwrap();
        assert!(out.batches.iter().all(|b| b.num_rows() == 0) && out.failed.is_empty());
        let closing = BatchWatermark {
            before: Some(30 * SECOND),
            after: Some(50 * SECOND),
        };
        let out = query
            .execute_isolating(&BTreeMap::new(), closing)
            .await
            .unwrap();
        let mut keys: Vec<(String, i64)> = out
            .batches
            .iter()
            .flat_map(|b| {
                let k = b.column(0).as_string::<i32>();
                let n = b.column(1).as_primitive::<Int64Type>();
                (0..b.num_rows()).map(move |i| (k.value(i).to_string(), n.value(i)))
            })
            .collect();
        keys.sort();
        let expected: Vec<(String, i64)> = ["k0", "k2", "k3"].map(|k| (k.into(), 2)).into();
        assert_eq!(keys, expected);
        // Both of k1's pairs are dead letters, each at its left row, the right row named.
        let mut failed: Vec<String> = out.failed.iter().map(|f| f.error.clone()).collect();
        failed.sort();
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(
            failed.iter().all(|e| e.contains("Divide by zero")),
            "{failed:?}"
        );
        assert!(failed[0].contains("r row 0@2") && failed[1].contains("r row 0@3"));
    }

    /// What per-key closing says it does, and what it refuses.
    #[tokio::test]
    async fn per_key_closing_is_described_and_refused_off_key() {
        let sources = [("l".to_string(), schema()), ("r".to_string(), schema())];
        let query = StreamingQuery::plan(PER_KEY[0].0, &sources, &settings(false))
            .await
            .unwrap();
        let operator = &query.operators()[0];
        assert!(
            operator.emits.contains("once per key (l.k) of l"),
            "{}",
            operator.emits
        );
        assert!(
            operator.purge.contains("leaves with its l row"),
            "{}",
            operator.purge
        );
        // A join that writes the other side's unmatched rows: they have no row to close with.
        let full = "SELECT l.k, count(*) FROM l FULL JOIN r ON l.k = r.k \
                    AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k";
        let error = StreamingQuery::plan(full, &sources, &settings(false))
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("no l row to close with"), "{error}");
        // Keyed by both sides' keys: the side whose other side the join does not keep closes.
        let right = "SELECT l.k, r.k, count(*) FROM l RIGHT JOIN r ON l.k = r.k \
                     AND l.ts BETWEEN r.ts AND r.until GROUP BY l.k, r.k";
        let query = StreamingQuery::plan(right, &sources, &settings(false))
            .await
            .unwrap();
        let emits = &query.operators()[0].emits;
        assert!(emits.contains("once per key (r.k) of r"), "{emits}");
        // Grouped by the other side's non-key column, or a second aggregate over the per-key
        // results: a running aggregate over the join's output, in update mode only.
        let running = QuerySettings {
            output_mode: OutputMode::Update,
            state_ttl: Some(Duration::from_secs(3600)),
            ..settings(false)
        };
        for (sql, joined) in [
            (
                "SELECT r.until, count(*) AS n FROM l JOIN r ON l.k = r.k \
                 AND r.ts BETWEEN l.ts AND l.until GROUP BY r.until",
                "each matching pair once",
            ),
            (
                "SELECT n, count(*) AS keys FROM (SELECT l.k, count(*) AS n FROM l JOIN r \
                 ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until GROUP BY l.k) GROUP BY n",
                "once per key (l.k) of l",
            ),
        ] {
            let error = StreamingQuery::plan(sql, &sources, &settings(false))
                .await
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("aggregates the join's output")
                    && error.contains("mode = \"update\""),
                "{sql}: {error}"
            );
            let query = StreamingQuery::plan(sql, &sources, &running).await.unwrap();
            let [join, aggregate] = query.operators().try_into().unwrap();
            assert_eq!(
                (join.id.as_str(), aggregate.id.as_str()),
                ("0-join", "1-aggregate")
            );
            assert!(join.emits.contains(joined), "{sql}: {}", join.emits);
            assert!(
                aggregate.what == "running aggregate of the join's output (0-join)"
                    && aggregate
                        .purge
                        .contains("past the watermark of the batch that last fed it"),
                "{sql}: {aggregate:?}"
            );
        }
        let sorted = "SELECT l.k FROM l JOIN r ON l.k = r.k AND r.ts BETWEEN l.ts AND l.until \
                      ORDER BY l.k LIMIT 3";
        let error = StreamingQuery::plan(sorted, &sources, &settings(false))
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("chain of stateful operators"), "{error}");
    }
}
