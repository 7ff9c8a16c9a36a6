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
//! **The first rows per key.** Where the SQL above keeps each key's first `n` rows by a ranking
//! window function — `WHERE rn <= n` over `ROW_NUMBER()` (also `RANK()`, `DENSE_RANK()`, `rn < n`,
//! `rn = n`), q9's shape — a held pair ranked after `n` can never be written, whatever pairs come
//! later: a later pair only ranks it lower. So each batch's pairs are pruned as the join yields
//! them, and the held pairs with them: per closing-side row and partition, every pair with `n` or
//! more distinct better orderings is let go (ties with the `n`-th are kept, so any tie-break the
//! SQL makes is still open to it). State then holds about `n` pairs per open key rather than every
//! pair, and no batch holds all its pairs at once. Pruned is only a plan where nothing else can
//! see the let-go pairs or fail on them: the filter is that one condition, the window holds that
//! one function, ordered (an unordered one lets nothing go) and partitioned by plain columns,
//! and between the filter and the joined rows there are only renames. What the SQL writes is
//! unchanged; a key it fails on (above the filter, on a row it keeps) is dead-lettered with the
//! pairs it still held, not with the pairs let go before. Pruning again after a restart (which
//! restores pairs let go after they were written) lets go of the same pairs: the first `n`
//! orderings of a key's pairs are among the pairs kept.
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
use arrow::buffer::BooleanBuffer;
use arrow::compute::{
    SortColumn, SortOptions, concat_batches, filter_record_batch, lexsort_to_indices,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt64Type};
use arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
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

/// The first rows per key the SQL above keeps (see the module doc): a pair ranked after
/// `limit` in its closing-side row and partition is let go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopPerKey {
    /// The last rank a pair can have and be written.
    limit: usize,
    /// The joined columns the window partitions by.
    partition_by: Vec<usize>,
    /// The joined columns it orders by, each with its order.
    order_by: Vec<(usize, SortOptions)>,
}

impl TopPerKey {
    /// The joined columns the ranking reads (partition, then order columns), each once.
    pub(crate) fn columns(&self) -> Vec<usize> {
        let mut columns = Vec::new();
        for i in self
            .partition_by
            .iter()
            .chain(self.order_by.iter().map(|(i, _)| i))
        {
            if !columns.contains(i) {
                columns.push(*i);
            }
        }
        columns
    }

    /// The same ranking over rows holding only [`TopPerKey::columns`], in that order (`None`
    /// only if a column it ranks by were not among them).
    pub(crate) fn over_its_columns(&self) -> Option<TopPerKey> {
        let columns = self.columns();
        let at = |i: &usize| columns.iter().position(|c| c == i);
        Some(TopPerKey {
            limit: self.limit,
            partition_by: self.partition_by.iter().map(at).collect::<Option<_>>()?,
            order_by: self
                .order_by
                .iter()
                .map(|(i, o)| Some((at(i)?, *o)))
                .collect::<Option<_>>()?,
        })
    }
}

/// The first rows per key the SQL above a join keeps, where pruning the pairs to them changes
/// nothing it writes, and where it fails only which of a failing key's pairs are its dead
/// letters (see the module doc): `upper` reads the pairs from `joined_table`, once, through a
/// filter on a ranking window function over them.
pub(crate) fn top_per_key(upper: &LogicalPlan, joined_table: &str) -> Option<TopPerKey> {
    let mut scans = 0;
    let _ = upper.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && scan.table_name.table() == joined_table
        {
            scans += 1;
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if scans != 1 {
        return None;
    }
    let mut found = None;
    let _ = upper.apply(|node| {
        if let LogicalPlan::Filter(filter) = node {
            found = filter_top_per_key(&filter.predicate, &filter.input, joined_table);
            if found.is_some() {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// The filter `predicate` over `input` as first rows per key of the joined pairs: a rank bound
/// alone, on the one ranking function of a window reading the pairs through renames only.
fn filter_top_per_key(
    predicate: &Expr,
    input: &LogicalPlan,
    joined_table: &str,
) -> Option<TopPerKey> {
    let (name, limit) = super::rank_bound(predicate)?;
    // A cast of the rank that could fail on a let-go pair's rank (to a narrower type) is
    // evaluated on every pair: not pruned.
    if let Expr::BinaryExpr(comparison) = predicate
        && [&comparison.left, &comparison.right].iter().any(|side| {
            matches!(side.as_ref(), Expr::Cast(cast)
                if !matches!(cast.field.data_type(), DataType::Int64 | DataType::UInt64))
        })
    {
        return None;
    }
    let limit = usize::try_from(limit).ok().filter(|&n| n > 0)?;
    let window = super::ranking_window(input, &name, &super::RANKINGS)?;
    if *below_renames(input) != window {
        return None;
    }
    let LogicalPlan::Window(window) = window else {
        return None;
    };
    let [expr] = window.window_expr.as_slice() else {
        return None;
    };
    let Expr::WindowFunction(function) = expr.clone().unalias() else {
        return None;
    };
    match below_renames(&window.input) {
        LogicalPlan::TableScan(scan)
            if scan.table_name.table() == joined_table
                && scan.filters.is_empty()
                && scan.fetch.is_none() => {}
        _ => return None,
    }
    if !function.params.args.is_empty()
        || function.params.filter.is_some()
        || function.params.distinct
    {
        return None;
    }
    let joined = |expr: &Expr| match expr {
        Expr::Column(c) => {
            let index = window.input.schema().index_of_column(c).ok()?;
            joined_column(&window.input, index, joined_table)
        }
        _ => None,
    };
    let partition_by = function
        .params
        .partition_by
        .iter()
        .map(joined)
        .collect::<Option<Vec<usize>>>()?;
    let order_by = function
        .params
        .order_by
        .iter()
        .map(|sort| {
            let options = SortOptions {
                descending: !sort.asc,
                nulls_first: sort.nulls_first,
            };
            Some((joined(&sort.expr)?, options))
        })
        .collect::<Option<Vec<_>>>()?;
    // Unordered, every pair ranks first (`RANK()`) or is picked at random (`ROW_NUMBER()`):
    // nothing to let go.
    if order_by.is_empty() {
        return None;
    }
    Some(TopPerKey {
        limit,
        partition_by,
        order_by,
    })
}

/// The first node below `plan` that is not a subquery alias or a projection of bare columns
/// (renamed or not): what `plan`'s rows are, row for row, with nothing computed on the way.
fn below_renames(plan: &LogicalPlan) -> &LogicalPlan {
    match plan {
        LogicalPlan::SubqueryAlias(alias) => below_renames(&alias.input),
        LogicalPlan::Projection(p)
            if p.expr
                .iter()
                .all(|e| matches!(e.clone().unalias(), Expr::Column(_))) =>
        {
            below_renames(&p.input)
        }
        _ => plan,
    }
}

/// Pairs ranked against each other as they come (see [`TopPerKey`]): each group's (closing-side
/// row and partition) best `limit` distinct orderings seen so far. A pair kept when it came may
/// be outranked by a later one: [`FirstRows::filter`] under the final orderings lets it go.
pub(crate) struct FirstRows {
    limit: usize,
    /// The group columns (the closing-side row's id, then the partition's) and the order
    /// columns, in the pairs' batches.
    group_columns: Vec<usize>,
    order_columns: Vec<usize>,
    groups: RowConverter,
    orders: RowConverter,
    /// Per group (its row bytes), its best distinct orderings (row bytes, best first): at most
    /// `limit`.
    best: hashbrown::HashMap<Box<[u8]>, Vec<Box<[u8]>>>,
}

impl FirstRows {
    /// Ranks pairs of `schema` (the columns `top` ranks by where it says, the id of each
    /// pair's closing-side row in column `id`) by `top`.
    ///
    /// # Errors
    /// If the columns cannot be compared (not expected of columns a window ordered by).
    pub(crate) fn new(top: &TopPerKey, schema: &Schema, id: usize) -> Result<FirstRows> {
        let group_columns: Vec<usize> = std::iter::once(id)
            .chain(top.partition_by.iter().copied())
            .collect();
        let groups = RowConverter::new(
            group_columns
                .iter()
                .map(|&i| SortField::new(schema.field(i).data_type().clone()))
                .collect(),
        )?;
        let orders = RowConverter::new(
            top.order_by
                .iter()
                .map(|&(i, options)| {
                    SortField::new_with_options(schema.field(i).data_type().clone(), options)
                })
                .collect(),
        )?;
        Ok(FirstRows {
            limit: top.limit,
            group_columns,
            order_columns: top.order_by.iter().map(|&(i, _)| i).collect(),
            groups,
            orders,
            best: hashbrown::HashMap::new(),
        })
    }

    /// `batch`'s group and order rows.
    fn group_and_order_rows(
        &self,
        batch: &RecordBatch,
    ) -> Result<(arrow::row::Rows, arrow::row::Rows)> {
        let columns = |indices: &[usize]| -> Vec<ArrayRef> {
            indices
                .iter()
                .map(|&i| Arc::clone(batch.column(i)))
                .collect()
        };
        Ok((
            self.groups.convert_columns(&columns(&self.group_columns))?,
            self.orders.convert_columns(&columns(&self.order_columns))?,
        ))
    }

    /// Ranks pairs (their group and order rows) with those seen before.
    fn see(&mut self, groups: &arrow::row::Rows, orders: &arrow::row::Rows) {
        for (group, order) in groups.iter().zip(orders.iter()) {
            let (group, order) = (group.as_ref(), order.as_ref());
            let Some(list) = self.best.get_mut(group) else {
                self.best.insert(group.into(), vec![order.into()]);
                continue;
            };
            if let Err(at) = list.binary_search_by(|o| o.as_ref().cmp(order))
                && at < self.limit
            {
                list.insert(at, order.into());
                list.truncate(self.limit);
            }
        }
    }

    /// `batch` with only its pairs ranked among the first `limit` of their group so far; `None`
    /// if none is.
    fn kept(
        &self,
        batch: RecordBatch,
        groups: &arrow::row::Rows,
        orders: &arrow::row::Rows,
    ) -> Result<Option<RecordBatch>> {
        let keep: BooleanBuffer = groups
            .iter()
            .zip(orders.iter())
            .map(|(group, order)| {
                self.best.get(group.as_ref()).is_none_or(|list| {
                    list.len() < self.limit
                        || list
                            .last()
                            .is_none_or(|last| order.as_ref() <= last.as_ref())
                })
            })
            .collect();
        Ok(match keep.count_set_bits() {
            0 => None,
            n if n == batch.num_rows() => Some(batch),
            _ => Some(filter_record_batch(&batch, &BooleanArray::new(keep, None))?),
        })
    }

    /// Ranks `batch`'s pairs with those seen before, and returns those among the first
    /// `limit` so far (`None` if none is).
    ///
    /// # Errors
    /// If its columns cannot be compared, or filtered.
    pub(crate) fn push(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let (groups, orders) = self.group_and_order_rows(&batch)?;
        self.see(&groups, &orders);
        self.kept(batch, &groups, &orders)
    }

    /// `batch` (of pairs seen) with only those still among the first `limit` of their group;
    /// `None` if none is.
    ///
    /// # Errors
    /// If its columns cannot be compared, or filtered.
    pub(crate) fn filter(&self, batch: RecordBatch) -> Result<Option<RecordBatch>> {
        let (groups, orders) = self.group_and_order_rows(&batch)?;
        self.kept(batch, &groups, &orders)
    }

    /// `batches` (of pairs seen) with only those still among the first `limit` of their
    /// group, in order; a batch all of whose pairs are still among them is kept as it is.
    ///
    /// # Errors
    /// If their columns cannot be compared, or filtered.
    pub(crate) fn filter_each(&self, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let mut kept = Vec::with_capacity(batches.len());
        for batch in batches {
            kept.extend(self.filter(batch)?);
        }
        Ok(kept)
    }

    /// [`FirstRows::filter_each`], in one batch (none if no pair is kept): the SQL above runs
    /// its window function per batch and per key, which costs for every batch.
    ///
    /// # Errors
    /// If their columns cannot be compared, filtered or concatenated.
    pub(crate) fn filter_all(&self, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let Some(schema) = batches.first().map(RecordBatch::schema) else {
            return Ok(batches);
        };
        let kept = self.filter_each(batches)?;
        Ok(match kept.len() {
            0 | 1 => kept,
            _ => vec![concat_batches(&schema, &kept)?],
        })
    }
}

/// The pairs held until their closing-side row leaves.
pub(crate) struct HeldPairs {
    key: ClosingKey,
    /// Where the SQL above keeps only the first rows per key: the pairs that can still be
    /// written are all that is held.
    top: Option<TopPerKey>,
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
    /// Holds pairs closing by `key`, whose columns are those of `joined`; with `top`, only
    /// those that can still be written.
    pub(crate) fn new(
        key: ClosingKey,
        top: Option<TopPerKey>,
        joined: &SchemaRef,
    ) -> Result<HeldPairs> {
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
            top,
            converter,
            schema: Arc::new(Schema::new(fields)),
            rows: Vec::new(),
        })
    }

    /// Which side's rows close their pairs, and its key columns.
    pub(crate) fn key(&self) -> &ClosingKey {
        &self.key
    }

    /// The first rows per key the SQL above keeps, if that is all it keeps.
    pub(crate) fn top(&self) -> Option<&TopPerKey> {
        self.top.as_ref()
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

    /// This batch's `joined` pairs, `closing_rows` the ids of their closing-side rows, split:
    /// those whose row is not among `open` (the ids of that side's kept rows), closed, in the
    /// joined rows' schema; the rest as held pairs (joined columns, then the id), to be held
    /// with [`HeldPairs::hold_new`].
    pub(crate) fn split_new(
        &self,
        joined: &RecordBatch,
        closing_rows: ArrayRef,
        open: &HashSet<u64>,
    ) -> Result<(Option<RecordBatch>, Option<RecordBatch>)> {
        let mut columns = joined.columns().to_vec();
        columns.push(closing_rows);
        let pairs = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        let (closed, held) = self.split(pairs, open)?;
        Ok((closed.map(|c| self.joined_part(&c)).transpose()?, held))
    }

    /// Holds this batch's `new` pairs (from [`HeldPairs::split_new`]) and returns those held —
    /// the new state rows. With first rows per key, the pairs held before and the new ones are
    /// pruned together.
    pub(crate) fn hold_new(&mut self, new: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let Some(top) = self.top.as_ref().filter(|_| !new.is_empty()) else {
            self.rows.extend(new.iter().cloned());
            return Ok(new);
        };
        let mut ranked = FirstRows::new(top, &self.schema, self.schema.fields().len() - 1)?;
        // Each batch's rows converted once: all seen, then each batch filtered by the whole.
        let rows = self
            .rows
            .iter()
            .chain(&new)
            .map(|batch| ranked.group_and_order_rows(batch))
            .collect::<Result<Vec<_>>>()?;
        for (groups, orders) in &rows {
            ranked.see(groups, orders);
        }
        let old = self.rows.len();
        let mut held = Vec::new();
        let mut kept_new = Vec::new();
        for (n, (batch, (groups, orders))) in
            self.rows.iter().cloned().chain(new).zip(&rows).enumerate()
        {
            let Some(kept) = ranked.kept(batch, groups, orders)? else {
                continue;
            };
            if n >= old {
                kept_new.push(kept.clone());
            }
            held.push(kept);
        }
        self.rows = super::merge_small_batches(&self.schema, held)?;
        Ok(kept_new)
    }

    /// With first rows per key, lets go of the held pairs that can no longer be written (after
    /// a restore, which holds every pair the state files have).
    pub(crate) fn prune(&mut self) -> Result<()> {
        let rows = std::mem::take(&mut self.rows);
        self.hold_new(rows)?;
        Ok(())
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, RecordBatch, StringArray, UInt64Array};
    use arrow::compute::SortOptions;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::catalog::MemTable;
    use datafusion::prelude::SessionContext;

    use super::{FirstRows, TopPerKey, top_per_key};

    /// `top_per_key` of `sql`'s optimised plan over a table `j` of pairs (c0 key, c1 and c2
    /// numbers, c3 text).
    async fn found(sql: &str) -> Option<TopPerKey> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("c0", DataType::Utf8, true),
            Field::new("c1", DataType::Int64, true),
            Field::new("c2", DataType::Int64, true),
            Field::new("c3", DataType::Utf8, true),
        ]));
        let ctx = SessionContext::new();
        let table = MemTable::try_new(schema, vec![vec![]]).unwrap();
        ctx.register_table("j", Arc::new(table)).unwrap();
        let plan = ctx.sql(sql).await.unwrap().into_optimized_plan().unwrap();
        top_per_key(&plan, "j")
    }

    /// A rank bound alone over the window's one ranking function, partitioned and ordered by
    /// plain columns through renames, is first rows per key; anything that could see or fail
    /// on a pruned pair is not.
    #[tokio::test]
    async fn first_rows_per_key_are_found_only_where_pruning_changes_nothing() {
        let over = |function: &str, bound: &str| {
            format!(
                "SELECT k, v FROM (SELECT c0 AS k, c1 AS v, c3, {function} OVER (PARTITION BY c0 \
                 ORDER BY c1 DESC, c2) AS rn FROM j) WHERE {bound}"
            )
        };
        let descending = SortOptions {
            descending: true,
            nulls_first: true,
        };
        let ascending = SortOptions {
            descending: false,
            nulls_first: false,
        };
        for (function, bound, limit) in [
            ("ROW_NUMBER()", "rn <= 1", 1),
            ("ROW_NUMBER()", "rn < 4", 3),
            ("RANK()", "2 >= rn", 2),
            ("DENSE_RANK()", "rn = 5", 5),
        ] {
            let sql = over(function, bound);
            assert_eq!(
                found(&sql).await,
                Some(TopPerKey {
                    limit,
                    partition_by: vec![0],
                    order_by: vec![(1, descending), (2, ascending)],
                }),
                "{sql}"
            );
        }
        // A column computed beside the ranking is computed above the filter, on the rows it
        // keeps: pruning changes nothing there either.
        let computed = "SELECT k, x FROM (SELECT c0 AS k, 10 / c2 AS x, ROW_NUMBER() OVER \
                        (PARTITION BY c0 ORDER BY c1) AS rn FROM j) WHERE rn <= 1";
        assert!(found(computed).await.is_some());
        // A narrowing cast of the rank is unwrapped by DataFusion's optimiser (the plan that
        // runs compares the rank itself, `rn <= UInt64(1)`): nothing left to fail.
        let cast = over("ROW_NUMBER()", "CAST(rn AS TINYINT) <= 1");
        assert!(found(&cast).await.is_some());
        for sql in [
            // Not a ranking, or no bound, or one that keeps nothing.
            over("count(*)", "rn <= 1"),
            over("ROW_NUMBER()", "rn >= 2"),
            over("ROW_NUMBER()", "rn < 1"),
            // Another condition beside the bound (which could fail on a pruned pair).
            over("ROW_NUMBER()", "rn <= 1 AND c3 <> 'x'"),
            // Another window function over the same pairs sees them all.
            "SELECT k, n FROM (SELECT c0 AS k, count(*) OVER (PARTITION BY c0) AS n, \
             ROW_NUMBER() OVER (PARTITION BY c0 ORDER BY c1) AS rn FROM j) WHERE rn <= 1"
                .to_string(),
            // Unordered: every pair ranks first.
            "SELECT k FROM (SELECT c0 AS k, RANK() OVER (PARTITION BY c0) AS rn FROM j) \
             WHERE rn <= 1"
                .to_string(),
            // Ordered by a computation (which could fail on a pruned pair).
            "SELECT k FROM (SELECT c0 AS k, ROW_NUMBER() OVER (PARTITION BY c0 \
             ORDER BY c1 * 2) AS rn FROM j) WHERE rn <= 1"
                .to_string(),
            // A filter below the window: its pairs are not all of them.
            "SELECT k FROM (SELECT c0 AS k, ROW_NUMBER() OVER (PARTITION BY c0 \
             ORDER BY c1) AS rn FROM j WHERE c2 > 0) WHERE rn <= 1"
                .to_string(),
        ] {
            assert_eq!(found(&sql).await, None, "{sql}");
        }
    }

    /// Per closing-side row (column 2 here) and partition: the rows with fewer than `limit`
    /// distinct better orderings, ties kept, across batches; a batch kept whole is not copied.
    #[test]
    fn pairs_ranked_after_the_limit_are_let_go() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("c0", DataType::Utf8, true),
            Field::new("c1", DataType::Int64, true),
            Field::new("id", DataType::UInt64, true),
        ]));
        let batch = |keys: Vec<&str>, values: Vec<Option<i64>>, ids: Vec<u64>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(keys)),
                    Arc::new(Int64Array::from(values)),
                    Arc::new(UInt64Array::from(ids)),
                ],
            )
            .unwrap()
        };
        let top = TopPerKey {
            limit: 2,
            partition_by: vec![0],
            order_by: vec![(
                1,
                SortOptions {
                    descending: true,
                    nulls_first: false,
                },
            )],
        };
        let batches = vec![
            batch(
                vec!["a", "a", "b"],
                vec![Some(5), Some(9), Some(1)],
                vec![1, 1, 1],
            ),
            batch(
                vec!["a", "a", "a", "a", "a"],
                vec![Some(9), Some(7), None, Some(8), Some(3)],
                vec![1, 1, 1, 2, 2],
            ),
        ];
        // As they come: the second batch's 9 ties the first's; its 7 is then second (the
        // first batch's 5 is kept when it comes, let go by the final ranking).
        let mut ranked = FirstRows::new(&top, &schema, 2).unwrap();
        let mut kept = Vec::new();
        for b in &batches {
            kept.extend(ranked.push(b.clone()).unwrap());
        }
        let kept = ranked.filter_all(kept).unwrap();
        assert_eq!(kept.len(), 1);
        let rows: Vec<(String, Option<i64>, u64)> = kept
            .iter()
            .flat_map(|b| {
                let keys = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
                let values = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
                let ids = b.column(2).as_any().downcast_ref::<UInt64Array>().unwrap();
                (0..b.num_rows())
                    .map(|i| {
                        let value =
                            arrow::array::Array::is_valid(values, i).then(|| values.value(i));
                        (keys.value(i).to_string(), value, ids.value(i))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        // Row 1 key a: 9, 9 (tied first), 7 (second distinct); 5 and the null (last) go. Key b
        // alone; row 2's two pairs are their own group.
        assert_eq!(
            rows,
            [
                ("a".to_string(), Some(9), 1),
                ("b".to_string(), Some(1), 1),
                ("a".to_string(), Some(9), 1),
                ("a".to_string(), Some(7), 1),
                ("a".to_string(), Some(8), 2),
                ("a".to_string(), Some(3), 2),
            ]
        );
        // Nothing to let go: the batch itself, not a copy.
        let whole = ranked.filter(batches[0].slice(1, 2)).unwrap().unwrap();
        let data = |b: &RecordBatch| b.column(0).to_data().buffers()[1].as_ptr();
        assert_eq!(data(&whole), data(&batches[0]));
    }
}
