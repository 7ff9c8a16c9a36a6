//! Per-key closing: the SQL above a join of two streams that groups (`GROUP BY`) or partitions
//! (`PARTITION BY`) by one side's join key runs over a key's pairs once that key *closes*.
//!
//! Nexmark q9 (the highest bid of each auction, among the bids between its start and its
//! expiry) and the inner part of q4 (`MAX(price)` per auction) are a join followed by a
//! computation per auction, whose result is final only when no more bid can join the auction:
//!
//! ```sql
//! SELECT … FROM (
//!   SELECT A.*, B.*, ROW_NUMBER() OVER (PARTITION BY A.id ORDER BY B.price DESC, B.date_time)
//!     AS rownum
//!   FROM auction A JOIN bid B
//!     ON A.id = B.auction AND B.date_time BETWEEN A.date_time AND A.expires)
//! WHERE rownum <= 1
//! ```
//!
//! **The rule.** The join keeps a row of the *closing side* (here the auction, the side whose key
//! columns the SQL above groups by) until the watermark shows nothing can match it any more (its
//! purge rule; here `A.expires`). Every pair holds one row of that side, so once that row has
//! left the state its pairs are complete: they are run through the SQL above then, together
//! with the pairs of every other closing-side row that left in the same batch, by key. With a
//! key unique on the closing side (an auction's id) that is the key's one, final result. A
//! second row of that side with the same key closes its own pairs when it leaves: a second
//! result for the key, unless both left in one batch. ARCHITECTURE.md states this.
//!
//! **Execution.** Each batch's pairs (and the closing side's unmatched rows, in an outer join
//! that keeps them) are held, with the id of their closing-side row, in the join's state; after
//! the batch's purge, the held pairs whose row is no longer kept are taken out and run through
//! the SQL above in one DataFusion plan. Only if it fails on their values are they sorted by key
//! and halved over whole keys, down to the keys it fails on, whose pairs are dead letters. A
//! join that keeps the *other* side's unmatched rows is refused: they have no closing-side row,
//! so their NULL key would make a group of its own in every batch. Ties in a window function's
//! ORDER BY are broken as DataFusion meets the rows, which may differ between runs, as in batch
//! SQL: a unique last sort key makes the result replay identically.
//!
//! **Restart.** The held pairs are state rows of the join (a batch's delta holds its new pairs
//! still held at its end: those whose row already left run at once and are never written); a
//! restart drops the pairs whose closing-side row the restored watermark let go: the committed
//! batch ran them. Nothing is written when pairs close: the purge decides it again.
//!
//! A stateful node above the join that does not group or partition by every key column of one
//! side is not run here: an aggregate over the per-key results not keyed by the key (the
//! average per category of Nexmark q4) is a second operator, a running aggregate over the
//! join's output ([`super::chain`]); a sort or limit over all keys is refused, naming it.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::compute::{SortColumn, concat_batches, filter_record_batch, lexsort_to_indices};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt64Type};
use arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::logical_expr::{Expr, Join, JoinType, LogicalPlan};

use crate::error::Result;

/// How a join's upper part closes: which side's key decides, and where the key columns are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClosingKey {
    /// The side (0 left, 1 right) whose kept rows hold their key open.
    pub(crate) side: usize,
    /// The key columns in the joined rows (indices into the join's output).
    pub(crate) joined: Vec<usize>,
    /// The same columns in that side's rows (indices into the side's plan's output).
    pub(crate) in_side: Vec<usize>,
}

/// Finds how the stateful SQL over a join's pairs (`upper`, reading them from the table
/// `joined_table` whose column `c<i>` is the join's `i`-th column) closes per key: every
/// aggregate groups by, and every window function partitions by, all the join key columns of
/// one side. Where both sides' keys are covered, the first side whose other side the join does
/// not preserve (`preserved`) is taken. `Ok(None)` if `upper` needs no state; `Err` names the
/// node that cannot run per key.
pub(crate) fn closing_key(
    upper: &LogicalPlan,
    join: &Join,
    joined_table: &str,
    statics: &BTreeSet<String>,
    preserved: [bool; 2],
) -> std::result::Result<Option<ClosingKey>, String> {
    if super::stateful_node(upper, statics).is_none() {
        return Ok(None);
    }
    // Each side's key columns, where the key is a bare column.
    let left_width = join.left.schema().fields().len();
    let mut keys: [Option<(Vec<usize>, Vec<usize>)>; 2] =
        [Some(Default::default()), Some(Default::default())];
    for (l, r) in &join.on {
        for (s, expr) in [(0, l), (1, r)] {
            let input = if s == 0 { &join.left } else { &join.right };
            let found = match expr {
                Expr::Column(c) => input.schema().index_of_column(c).ok(),
                _ => None,
            };
            match (found, &mut keys[s]) {
                (Some(i), Some((joined, in_side))) => {
                    joined.push(if s == 0 { i } else { left_width + i });
                    in_side.push(i);
                }
                _ => keys[s] = None,
            }
        }
    }
    let mut covered = [true, true];
    let mut nodes = 0;
    per_key_nodes(upper, joined_table, statics, &mut |node, columns| {
        nodes += 1;
        for (s, key) in keys.iter().enumerate() {
            let covers = key.as_ref().is_some_and(|(joined, _)| {
                !joined.is_empty() && joined.iter().all(|k| columns.contains(k))
            });
            if !covers {
                covered[s] = false;
                if !covered[0] && !covered[1] {
                    return Err(format!("`{}`", node.display()));
                }
            }
        }
        Ok(())
    })?;
    if nodes == 0 {
        // Stateful for another reason (a sort, a limit, a subquery): named by the walk.
        return Err(super::stateful_node(upper, statics)
            .map(|(node, _)| format!("`{node}`"))
            .unwrap_or_default());
    }
    let side = (0..2)
        .find(|&s| covered[s] && !preserved[1 - s])
        .unwrap_or(if covered[0] { 0 } else { 1 });
    let (joined, in_side) = keys[side].clone().unwrap_or_default();
    Ok(Some(ClosingKey {
        side,
        joined,
        in_side,
    }))
}

/// Called with a grouping or partitioning node and the joined columns it is keyed by; an error
/// names a node that cannot run per key.
type KeyedNode<'a> =
    dyn FnMut(&LogicalPlan, &HashSet<usize>) -> std::result::Result<(), String> + 'a;

/// Walks `plan` (the SQL above the join) and calls `keyed` with every aggregate and window
/// node and the joined columns it groups or partitions by (those that are a joined column
/// unchanged). Errors name a node that cannot run per key: a sort, a limit, a distinct not
/// planned as an aggregate, a subquery over the stream, a join that keeps a table's rows.
fn per_key_nodes(
    plan: &LogicalPlan,
    joined_table: &str,
    statics: &BTreeSet<String>,
    keyed: &mut KeyedNode<'_>,
) -> std::result::Result<(), String> {
    let mut over_stream = false;
    let _ = plan.apply_subqueries(|subquery| {
        over_stream |= super::reads_stream(subquery, statics);
        Ok(TreeNodeRecursion::Continue)
    });
    if over_stream {
        return Err(format!("`{}`", plan.display()));
    }
    let traced = |input: &LogicalPlan, exprs: &[Expr]| -> HashSet<usize> {
        exprs
            .iter()
            .filter_map(|e| match e.clone().unalias() {
                Expr::Column(c) => input.schema().index_of_column(&c).ok(),
                _ => None,
            })
            .filter_map(|i| joined_column(input, i, joined_table))
            .collect()
    };
    match plan {
        LogicalPlan::Projection(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::TableScan(_)
        | LogicalPlan::Unnest(_)
        | LogicalPlan::EmptyRelation(_)
        | LogicalPlan::Values(_) => {}
        LogicalPlan::Aggregate(aggregate) => {
            keyed(plan, &traced(&aggregate.input, &aggregate.group_expr))?;
        }
        LogicalPlan::Window(window) => {
            for expr in &window.window_expr {
                let partition_by = match expr.clone().unalias() {
                    Expr::WindowFunction(f) => f.params.partition_by,
                    _ => Vec::new(),
                };
                keyed(plan, &traced(&window.input, &partition_by))?;
            }
        }
        LogicalPlan::Join(join) => {
            let left = super::reads_stream(&join.left, statics);
            let right = super::reads_stream(&join.right, statics);
            let with_table = matches!(
                (left, right, join.join_type),
                (
                    true,
                    false,
                    JoinType::Inner | JoinType::Left | JoinType::LeftSemi | JoinType::LeftAnti
                ) | (
                    false,
                    true,
                    JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
                )
            );
            if !with_table {
                return Err(format!("`{}`", plan.display()));
            }
        }
        _ => return Err(format!("`{}`", plan.display())),
    }
    for input in plan.inputs() {
        if super::reads_stream(input, statics) {
            per_key_nodes(input, joined_table, statics, keyed)?;
        }
    }
    Ok(())
}

/// The joined column (`c<i>` of `joined_table`) the `index`-th column of `plan` is, unchanged
/// (see [`super::join::source_column`]).
fn joined_column(plan: &LogicalPlan, index: usize, joined_table: &str) -> Option<usize> {
    let (table, column) = super::join::source_column(plan, index)?;
    if table != joined_table {
        return None;
    }
    column.strip_prefix('c')?.parse().ok()
}

/// The pairs held until their closing-side row leaves.
pub(crate) struct HeldPairs {
    key: ClosingKey,
    converter: RowConverter,
    /// The held pairs: the joined columns, then the id of the pair's closing-side row (a null
    /// id closes at once; none is null, as a join keeping the other side's unmatched rows is
    /// refused).
    schema: SchemaRef,
    rows: Vec<RecordBatch>,
}

impl std::fmt::Debug for HeldPairs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldPairs")
            .field("key", &self.key)
            .field("rows", &self.num_rows())
            .finish()
    }
}

/// Closed pairs: sorted by key, with where each key's pairs start.
pub(crate) struct ClosedPairs {
    /// The pairs, in the joined rows' schema.
    pub(crate) rows: RecordBatch,
    /// The first row of each key, then the number of rows.
    pub(crate) starts: Vec<usize>,
}

impl HeldPairs {
    /// Holds pairs closing by `key`, whose columns are those of `joined`.
    pub(crate) fn new(key: ClosingKey, joined: &SchemaRef) -> Result<HeldPairs> {
        let converter = RowConverter::new(
            key.joined
                .iter()
                .map(|&i| SortField::new(joined.field(i).data_type().clone()))
                .collect(),
        )?;
        let mut fields: Vec<Field> = joined.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields.push(Field::new("closing_row", DataType::UInt64, true));
        Ok(HeldPairs {
            key,
            converter,
            schema: Arc::new(Schema::new(fields)),
            rows: Vec::new(),
        })
    }

    /// Which side's rows close their pairs, and its key columns.
    pub(crate) fn key(&self) -> &ClosingKey {
        &self.key
    }

    /// The number of pairs held.
    pub(crate) fn num_rows(&self) -> usize {
        self.rows.iter().map(RecordBatch::num_rows).sum()
    }

    /// Holds nothing (before a restore).
    pub(crate) fn clear(&mut self) {
        self.rows.clear();
    }

    /// The held pairs: the joined columns, then the closing-side row's id.
    pub(crate) fn rows(&self) -> &[RecordBatch] {
        &self.rows
    }

    /// Holds `joined` pairs, `closing_rows` being the ids of their closing-side rows.
    pub(crate) fn hold(&mut self, joined: &RecordBatch, closing_rows: ArrayRef) -> Result<()> {
        if joined.num_rows() > 0 {
            let mut columns = joined.columns().to_vec();
            columns.push(closing_rows);
            self.rows
                .push(RecordBatch::try_new(Arc::clone(&self.schema), columns)?);
        }
        Ok(())
    }

    /// This batch's `joined` pairs, `closing_rows` the ids of their closing-side rows: those
    /// whose row is not among `open` (the ids of that side's kept rows) are returned closed, in
    /// the joined rows' schema; the rest are held, and returned as held (joined columns, then
    /// the id) — the new state rows.
    pub(crate) fn hold_new(
        &mut self,
        joined: &RecordBatch,
        closing_rows: ArrayRef,
        open: &HashSet<u64>,
    ) -> Result<(Option<RecordBatch>, Option<RecordBatch>)> {
        let mut columns = joined.columns().to_vec();
        columns.push(closing_rows);
        let pairs = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        let (closed, held) = self.split(pairs, open)?;
        if let Some(held) = &held {
            self.rows.push(held.clone());
        }
        Ok((closed.map(|c| self.joined_part(&c)).transpose()?, held))
    }

    /// Takes out the held pairs whose closing-side row is not among `open` (the ids of that
    /// side's kept rows), in the joined rows' schema (empty if there are none).
    pub(crate) fn take_closed(&mut self, open: &HashSet<u64>) -> Result<Vec<RecordBatch>> {
        let mut closed = Vec::new();
        let mut held = Vec::new();
        for batch in std::mem::take(&mut self.rows) {
            let (c, h) = self.split(batch, open)?;
            closed.extend(c);
            held.extend(h);
        }
        self.rows = super::merge_small_batches(&self.schema, held)?;
        closed.iter().map(|b| self.joined_part(b)).collect()
    }

    /// Held pairs split into those whose closing-side row is not among `open` (or null) and
    /// the rest; `None` for an empty part.
    fn split(
        &self,
        pairs: RecordBatch,
        open: &HashSet<u64>,
    ) -> Result<(Option<RecordBatch>, Option<RecordBatch>)> {
        let ids = pairs
            .column(self.schema.fields().len() - 1)
            .as_primitive::<UInt64Type>();
        let is_closed: BooleanArray = ids
            .iter()
            .map(|id| Some(id.is_none_or(|id| !open.contains(&id))))
            .collect();
        Ok(match is_closed.true_count() {
            _ if pairs.num_rows() == 0 => (None, None),
            0 => (None, Some(pairs)),
            n if n == pairs.num_rows() => (Some(pairs), None),
            _ => {
                let still = arrow::compute::not(&is_closed)?;
                (
                    Some(filter_record_batch(&pairs, &is_closed)?),
                    Some(filter_record_batch(&pairs, &still)?),
                )
            }
        })
    }

    /// Held pairs in the joined rows' schema (the closing-side id left out).
    fn joined_part(&self, held: &RecordBatch) -> Result<RecordBatch> {
        let joined: Vec<usize> = (0..self.schema.fields().len() - 1).collect();
        Ok(held.project(&joined)?)
    }

    /// `closed` pairs (in the joined rows' schema) in one batch sorted by key, with where each
    /// key's pairs start: to find the keys the SQL above fails on.
    pub(crate) fn by_key(&self, closed: &[RecordBatch]) -> Result<ClosedPairs> {
        let Some(first) = closed.first() else {
            let empty = RecordBatch::new_empty(Arc::new(Schema::new(
                self.schema.fields()[..self.schema.fields().len() - 1].to_vec(),
            )));
            return Ok(ClosedPairs {
                rows: empty,
                starts: vec![0],
            });
        };
        let closed = concat_batches(&first.schema(), closed)?;
        let sort: Vec<SortColumn> = self
            .key_columns(&closed)
            .into_iter()
            .map(|values| SortColumn {
                values,
                options: None,
            })
            .collect();
        let order = lexsort_to_indices(&sort, None)?;
        let rows = arrow::compute::take_record_batch(&closed, &order)?;
        let keys = self.converter.convert_columns(&self.key_columns(&rows))?;
        let mut starts = vec![0];
        for i in 1..rows.num_rows() {
            if keys.row(i) != keys.row(i - 1) {
                starts.push(i);
            }
        }
        starts.push(rows.num_rows());
        Ok(ClosedPairs { rows, starts })
    }

    fn key_columns(&self, batch: &RecordBatch) -> Vec<ArrayRef> {
        self.key
            .joined
            .iter()
            .map(|&i| Arc::clone(batch.column(i)))
            .collect()
    }
}
