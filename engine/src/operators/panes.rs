//! An aggregate over hopping windows, computed by panes: each row aggregated once, not once per
//! window it falls into.
//!
//! `hop(t, ts, slide, size)` gives each row once per window that holds it — `size / slide`
//! copies — so an aggregate over it hashes every row that many times (five in Nexmark q5, where
//! that was most of the query's time). But a row's windows are fixed by its newest one: they
//! start at its start, one `slide` earlier, … (`size / slide` starts). So the rows of a window
//! are exactly the rows whose newest window is that window or one of the `size / slide − 1`
//! after it, and since partial aggregate states merge (the state already merges them across
//! batches), the aggregate may:
//!
//! 1. aggregate each row once, in its newest window (the `hop` view swapped for
//!    [`crate::window::newest_hop_window`]'s): one partial row per (newest window, group);
//! 2. give each partial row to every window of its rows ([`Panes::to_windows`]: `size / slide`
//!    copies, the window columns moved back a `slide` at a time), leaving out closed windows;
//! 3. merge those into the state as before, where a window's copies meet.
//!
//! The first phase then reads each row once; only the (far fewer, on skewed keys) partial rows
//! are copied. Used only where the two are the same aggregate ([`Panes::plan`]): nothing
//! between the `hop` view and the aggregate reads the window columns but to pass them on
//! (no filter, expression or aggregate argument over them), every node there works row by row
//! (projections, filters, aliases: each copy of a row meets the same fate), the window columns
//! are plain group columns, and there are no grouping sets. Anything else aggregates the
//! `hop` view's copies as before.

use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch, TimestampMicrosecondArray, UInt32Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{SchemaRef, TimestampMicrosecondType};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan};
use datafusion::prelude::SessionContext;

use super::aggregate_state::AggregateState;
use crate::error::Result;
use crate::window::{WINDOW_END, WINDOW_START, WindowKind, WindowUse, newest_hop_window};

/// How an aggregate over a `hop` view runs by panes.
#[derive(Debug)]
pub(crate) struct Panes {
    /// The aggregate over each row's newest window: the first phase each batch runs.
    pub(crate) aggregate: LogicalPlan,
    slide: i64,
    /// Windows per row: `size / slide`.
    count: i64,
    /// The state columns holding a window bound (`window_start`, `window_end`), by index.
    window_columns: Vec<usize>,
}

impl Panes {
    /// Panes for `aggregate` (over `window`, with state schema `state_schema`) where they give
    /// the same partial rows as the `hop` view's copies (see the module doc); `None` elsewhere.
    ///
    /// # Errors
    /// If DataFusion cannot plan the rewritten aggregate.
    pub(crate) async fn plan(
        ctx: &SessionContext,
        aggregate: &LogicalPlan,
        window: &WindowUse,
        state_schema: &SchemaRef,
    ) -> Result<Option<Panes>> {
        let (LogicalPlan::Aggregate(agg), WindowKind::Hop { slide, size }) =
            (aggregate, window.kind)
        else {
            return Ok(None);
        };
        let count = size / slide;
        let reads_window = |e: &Expr| {
            e.column_refs()
                .iter()
                .any(|c| c.name == WINDOW_START || c.name == WINDOW_END)
        };
        let plain_column = |e: &Expr| matches!(e, Expr::Column(_));
        // A projection passes the window columns on as they are, and names no other
        // expression after them.
        let passes_on = |e: &Expr| {
            let named_window =
                matches!(e, Expr::Alias(a) if a.name == WINDOW_START || a.name == WINDOW_END);
            !(reads_window(e) || named_window) || plain_column(e)
        };
        let groups_fit = agg
            .group_expr
            .iter()
            .all(|e| !matches!(e, Expr::GroupingSet(_)) && (!reads_window(e) || plain_column(e)));
        if count < 2 || !groups_fit || agg.aggr_expr.iter().any(reads_window) {
            return Ok(None);
        }
        // Below the aggregate: row-by-row nodes that pass the window columns on untouched, over
        // the hop's rows and nothing else.
        let mut fits = true;
        let mut hops = 0;
        agg.input.apply(|node| {
            if newest_hop_window(node, window)?.is_some() {
                hops += 1;
                return Ok(TreeNodeRecursion::Jump);
            }
            fits &= match node {
                LogicalPlan::Projection(p) => p.expr.iter().all(passes_on),
                LogicalPlan::Filter(f) => !reads_window(&f.predicate),
                LogicalPlan::SubqueryAlias(_) => true,
                _ => false,
            };
            Ok(if fits {
                TreeNodeRecursion::Continue
            } else {
                TreeNodeRecursion::Stop
            })
        })?;
        if !fits || hops != 1 {
            return Ok(None);
        }
        // The hop's rows swapped for their newest windows; the nodes above take the new schema
        // (nullability may differ).
        let input = (*agg.input)
            .clone()
            .transform_down(|node| match newest_hop_window(&node, window)? {
                Some(newest) => Ok(Transformed::new(newest, true, TreeNodeRecursion::Jump)),
                None => Ok(Transformed::no(node)),
            })?
            .data
            .transform_up(|node| Ok(Transformed::yes(node.recompute_schema()?)))?
            .data;
        let aggregate = LogicalPlan::Aggregate(Aggregate::try_new(
            Arc::new(input),
            agg.group_expr.clone(),
            agg.aggr_expr.clone(),
        )?);
        // The same state columns, or no panes.
        let newest_state = AggregateState::plan(&ctx.state(), &aggregate)
            .await?
            .state_schema();
        let same_state = newest_state.fields().len() == state_schema.fields().len()
            && newest_state
                .fields()
                .iter()
                .zip(state_schema.fields())
                .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
        let window_columns: Vec<usize> = [WINDOW_START, WINDOW_END]
            .into_iter()
            .filter_map(|name| state_schema.index_of(name).ok())
            .collect();
        if !same_state || window_columns.is_empty() {
            return Ok(None);
        }
        Ok(Some(Panes {
            aggregate,
            slide,
            count,
            window_columns,
        }))
    }

    /// The partial rows of the windows `partials` (partial rows per newest window, as
    /// [`Panes::aggregate`] gives them, in the state's schema) add to: each row once per
    /// window of its pane — the window columns moved back 0, 1, … `count − 1` slides — except
    /// windows whose `purge_index` column is below `open_from` (closed; a null bound counts as
    /// closed, as SQL's filter has it). `open_from` is `None` when no window is closed yet.
    pub(crate) fn to_windows(
        &self,
        partials: Vec<RecordBatch>,
        purge_index: usize,
        open_from: Option<i64>,
    ) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::with_capacity(partials.len());
        for batch in partials {
            let bound = batch
                .column(purge_index)
                .as_primitive::<TimestampMicrosecondType>();
            let mut rows: Vec<u32> = Vec::with_capacity(batch.num_rows() * self.count as usize);
            let mut shifts: Vec<i64> = Vec::with_capacity(rows.capacity());
            for row in 0..batch.num_rows() {
                for back in 0..self.count {
                    let shift = back * self.slide;
                    let open = open_from.is_none_or(|first| {
                        bound.is_valid(row) && bound.value(row).wrapping_sub(shift) >= first
                    });
                    if open {
                        rows.push(row as u32);
                        shifts.push(shift);
                    }
                }
            }
            let copies = take_record_batch(&batch, &UInt32Array::from(rows))?;
            let mut columns = copies.columns().to_vec();
            for &index in &self.window_columns {
                let bounds = copies
                    .column(index)
                    .as_primitive::<TimestampMicrosecondType>();
                let moved: Vec<i64> = bounds
                    .values()
                    .iter()
                    .zip(&shifts)
                    .map(|(v, shift)| v.wrapping_sub(*shift))
                    .collect();
                columns[index] = Arc::new(
                    TimestampMicrosecondArray::new(moved.into(), bounds.nulls().cloned())
                        .with_data_type(bounds.data_type().clone()),
                );
            }
            out.push(RecordBatch::try_new(batch.schema(), columns)?);
        }
        Ok(out)
    }
}
