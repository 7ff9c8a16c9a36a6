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
//!    copies, the window columns moved back a `slide` at a time), leaving out closed windows,
//!    and merge each window's copies: one partial row per (window, group), as the copies gave;
//! 3. merge those into the state as before.
//!
//! The first phase then reads each row once; only the (far fewer, on skewed keys) partial rows
//! are copied. Used only where the two are the same aggregate ([`Panes::plan`]): nothing
//! between the `hop` view and the aggregate reads the window columns but to pass them on
//! (no filter, expression, subquery or aggregate argument over them, no other expression named
//! after them), every node there works row by row and gives each copy of a row the same fate
//! (projections, filters, aliases; no volatile function), the window columns are plain group
//! columns, and there are no grouping sets. Anything else aggregates the `hop` view's copies
//! as before.

use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch, TimestampMicrosecondArray, UInt32Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{SchemaRef, TimestampMicrosecondType};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan};
use datafusion::prelude::SessionContext;

use super::aggregate_state::{AggregateState, same_columns};
use crate::error::{Error, Result};
use crate::window::{WINDOW_END, WINDOW_START, WindowKind, WindowUse, newest_hop_window};

/// How an aggregate over a `hop` view runs by panes.
#[derive(Debug)]
pub(crate) struct Panes {
    /// The aggregate over each row's newest window: the first phase each batch runs.
    pub(crate) aggregate: LogicalPlan,
    slide: i64,
    /// Windows per row: `size / slide`.
    count: i64,
    /// The state columns holding a window bound (the GROUP BY's `window_start`,
    /// `window_end`), by index.
    window_columns: Vec<usize>,
}

impl Panes {
    /// Panes for `aggregate` (over `window`, with state schema `state_schema`) where they give
    /// the same partial rows as the `hop` view's copies (see the module doc); `None` elsewhere,
    /// and where DataFusion cannot plan the rewritten aggregate (panes only make it faster).
    pub(crate) async fn plan(
        ctx: &SessionContext,
        aggregate: &LogicalPlan,
        window: &WindowUse,
        state_schema: &SchemaRef,
    ) -> Option<Panes> {
        Self::try_plan(ctx, aggregate, window, state_schema)
            .await
            .ok()
            .flatten()
    }

    async fn try_plan(
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
        let is_window = |name: &str| name == WINDOW_START || name == WINDOW_END;
        let reads_window = |e: &Expr| e.column_refs().iter().any(|c| is_window(&c.name));
        let named_window = |e: &Expr| match e {
            Expr::Column(c) => is_window(&c.name),
            Expr::Alias(a) => is_window(&a.name),
            _ => false,
        };
        // A window column as it is, under its own name.
        let window_itself = |e: &Expr| matches!(e, Expr::Column(c) if is_window(&c.name));
        // Passes the window columns on as they are, names nothing else after them, and gives
        // each copy of a row the same value (no volatile function).
        let passes_on = |e: &Expr| {
            (!(reads_window(e) || named_window(e)) || window_itself(e)) && !e.is_volatile()
        };
        // A subquery may read a window column as an outer reference, which `column_refs` does
        // not see.
        let has_subquery = |node: &LogicalPlan| {
            let mut found = false;
            node.apply_subqueries(|_| {
                found = true;
                Ok(TreeNodeRecursion::Stop)
            })
            .map_or(true, |_| found)
        };
        let mut window_columns = Vec::new();
        for (index, e) in agg.group_expr.iter().enumerate() {
            if matches!(e, Expr::GroupingSet(_)) || !passes_on(e) {
                return Ok(None);
            }
            if window_itself(e) {
                window_columns.push(index);
            }
        }
        // The state's group columns come first, in the GROUP BY's order: each window column
        // found there is event time under its own name.
        let columns_fit = window_columns.iter().all(|&index| {
            state_schema.fields().get(index).is_some_and(|f| {
                is_window(f.name()) && *f.data_type() == crate::event_time::event_time_type()
            })
        });
        let aggregates_fit = agg
            .aggr_expr
            .iter()
            .all(|e| !reads_window(e) && !e.is_volatile());
        if count < 2
            || window_columns.is_empty()
            || !columns_fit
            || !aggregates_fit
            || has_subquery(aggregate)
        {
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
            fits &= !has_subquery(node)
                && match node {
                    LogicalPlan::Projection(p) => p.expr.iter().all(passes_on),
                    LogicalPlan::Filter(f) => {
                        !reads_window(&f.predicate) && !f.predicate.is_volatile()
                    }
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
        if !same_columns(&newest_state, state_schema) {
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
            let bound = window_bounds(&batch, purge_index)?;
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
                let bounds = window_bounds(&copies, index)?;
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

/// A window column of partial rows, as microseconds.
fn window_bounds(batch: &RecordBatch, index: usize) -> Result<&TimestampMicrosecondArray> {
    batch
        .column(index)
        .as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| {
            Error::UnsupportedQuery(format!(
                "the aggregate's state column {} is {}, not a window bound",
                batch.schema().field(index).name(),
                batch.column(index).data_type()
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_time::event_time_type;
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::catalog::{MemTable, TableProvider};
    use datafusion::functions_aggregate::expr_fn::count;
    use datafusion::prelude::{DataFrame, col, lit};
    use std::collections::BTreeMap;

    /// A session with source `t` (ts, k, v) and the window functions, as the query planner
    /// sets it up.
    fn session() -> (SessionContext, crate::window::WindowUses) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("ts", event_time_type(), true),
            Field::new("k", DataType::Utf8, true),
            Field::new("v", DataType::Int64, true),
        ]));
        let ctx = SessionContext::new();
        let table: Arc<dyn TableProvider> =
            Arc::new(MemTable::try_new(schema, vec![vec![]]).unwrap());
        ctx.register_table("t", Arc::clone(&table)).unwrap();
        let uses = crate::window::register(&ctx, &BTreeMap::from([("t".to_string(), table)]));
        (ctx, uses)
    }

    /// Whether the deepest aggregate of `df` over the recorded hop runs by panes.
    async fn by_panes(
        ctx: &SessionContext,
        uses: &crate::window::WindowUses,
        df: DataFrame,
    ) -> bool {
        let mut aggregate = None;
        df.logical_plan()
            .apply(|node| {
                if matches!(node, LogicalPlan::Aggregate(_)) {
                    aggregate = Some(node.clone());
                }
                Ok(TreeNodeRecursion::Continue)
            })
            .unwrap();
        let aggregate = aggregate.unwrap();
        let window = uses.lock().unwrap()[0].clone();
        let state = AggregateState::plan(&ctx.state(), &aggregate)
            .await
            .unwrap()
            .state_schema();
        Panes::plan(ctx, &aggregate, &window, &state)
            .await
            .is_some()
    }

    #[tokio::test]
    async fn panes_need_the_windows_grouped_as_they_are_and_nothing_else_reading_them() {
        let hop = "hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)";
        let grouped = "GROUP BY window_start, window_end, k";
        let sql = |sql: String| async move {
            let (ctx, uses) = session();
            let df = ctx.sql(&sql).await.unwrap();
            by_panes(&ctx, &uses, df).await
        };
        assert!(
            sql(format!(
                "SELECT window_start, k, count(*) AS c FROM {hop} {grouped}"
            ))
            .await
        );
        for refused in [
            // A correlated subquery reads the window as an outer reference.
            format!(
                "SELECT window_start, k, count(*) AS c FROM {hop} WHERE EXISTS \
                 (SELECT 1 FROM (VALUES (1)) AS one(x) WHERE window_start IS NOT NULL) {grouped}"
            ),
            // Each copy of a row draws its own random number.
            format!(
                "SELECT window_start, k, count(*) AS c FROM {hop} WHERE random() < 0.5 {grouped}"
            ),
            format!(
                "SELECT window_start, k, sum(r) AS s FROM (SELECT *, random() AS r FROM {hop}) \
                 {grouped}"
            ),
        ] {
            assert!(!sql(refused.clone()).await, "{refused}");
        }

        // A group key merely named like a window (possible with the DataFrame API) is not one.
        let (ctx, uses) = session();
        let df = ctx
            .sql(&format!("SELECT * FROM {hop}"))
            .await
            .unwrap()
            .aggregate(
                vec![col("window_start"), col("k").alias("window_end")],
                vec![count(lit(1))],
            )
            .unwrap();
        assert!(!by_panes(&ctx, &uses, df).await);
        let df = ctx
            .sql(&format!("SELECT * FROM {hop}"))
            .await
            .unwrap()
            .aggregate(vec![col("window_start"), col("k")], vec![count(lit(1))])
            .unwrap();
        assert!(by_panes(&ctx, &uses, df).await);
    }
}
