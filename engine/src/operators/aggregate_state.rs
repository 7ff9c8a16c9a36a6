//! Aggregate state carried between batches, as DataFusion's own partial aggregate states.
//!
//! A windowed aggregate cannot be computed batch by batch from scratch: a window's rows arrive
//! over many batches. Instead of re-implementing aggregates, Sluice keeps what DataFusion's
//! two-phase aggregation already exchanges between its phases — the accumulators' **partial
//! state** (for `avg`: sum and count; for `count(DISTINCT x)`: the set; for `approx_distinct`:
//! the HyperLogLog registers) — one row per group, as Arrow:
//!
//! ```text
//!  batch rows ──Partial──► new partial rows ─┐
//!                                            ├─PartialReduce──► state' (one row per group)
//!  state (previous batches) ─────────────────┘
//!  state' rows of closed windows ──Final──► output rows
//! ```
//!
//! So any DataFusion aggregate works, with DataFusion's exact semantics, and the state is a
//! plain Arrow table that can be written as a file and restored. Rows that hold each group
//! once (a keyed state's) are finished without the `Final` phase's hashing: each aggregate's
//! accumulators merge one row per group and are evaluated
//! ([`AggregateState::finish_unique`]). [`AggregateState`] is built from
//! a planned `Aggregate` node and runs the three phases.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::execution::SessionState;
use datafusion::logical_expr::LogicalPlan;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::GroupsAccumulatorAdapter;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr, collect};

use crate::error::{Error, Result};

/// The three phases of one aggregate, over in-memory batches.
#[derive(Debug)]
pub struct AggregateState {
    state: SessionState,
    group_by: Arc<PhysicalGroupBy>,
    aggregates: Vec<Arc<AggregateFunctionExpr>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// The rows the aggregate consumes.
    input_schema: SchemaRef,
    /// Group columns followed by the accumulators' state columns.
    state_schema: SchemaRef,
    /// Group columns followed by the aggregate values.
    output_schema: SchemaRef,
}

impl AggregateState {
    /// The phases of `aggregate` (a `LogicalPlan::Aggregate`), planned in `state`.
    ///
    /// # Errors
    /// If the node is not an aggregate or DataFusion cannot plan it.
    pub async fn plan(state: &SessionState, aggregate: &LogicalPlan) -> Result<Self> {
        if !matches!(aggregate, LogicalPlan::Aggregate(_)) {
            return Err(Error::UnsupportedQuery(format!(
                "expected an aggregate, found `{}`",
                aggregate.display()
            )));
        }
        let physical = state.create_physical_plan(aggregate).await?;
        let exec = find_aggregate(&physical).ok_or_else(|| {
            Error::UnsupportedQuery(format!(
                "DataFusion planned `{}` without a hash aggregate",
                aggregate.display()
            ))
        })?;
        // The first phase's view: group and aggregate expressions over the input rows.
        let group_by = Arc::new(exec.group_expr().clone());
        let aggregates = exec.aggr_expr().to_vec();
        let filters = exec.filter_expr().to_vec();
        let input_schema = exec.input_schema();
        let partial = partial_exec(
            &group_by,
            &aggregates,
            &filters,
            &input_schema,
            vec![],
            &input_schema,
        )?;
        let state_schema = partial.schema();
        let final_exec = AggregateExec::try_new(
            AggregateMode::Final,
            Arc::new(group_by.as_final()),
            aggregates.clone(),
            filters.clone(),
            memory(vec![], &state_schema)?,
            Arc::clone(&input_schema),
        )?;
        Ok(AggregateState {
            state: state.clone(),
            group_by,
            aggregates,
            filters,
            input_schema,
            state_schema,
            output_schema: final_exec.schema(),
        })
    }

    /// The schema of state rows: group columns, then accumulator states.
    pub fn state_schema(&self) -> SchemaRef {
        Arc::clone(&self.state_schema)
    }

    /// The schema of the rows the aggregate consumes.
    pub fn input_schema(&self) -> SchemaRef {
        Arc::clone(&self.input_schema)
    }

    /// The schema of finished rows: group columns, then aggregate values.
    pub fn output_schema(&self) -> SchemaRef {
        Arc::clone(&self.output_schema)
    }

    /// Phase 1: the partial state of `rows` (which must have the input columns, by name; others
    /// are ignored), one row per group.
    pub async fn partial(&self, rows: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let rows = rows
            .iter()
            .map(|b| {
                let columns = self
                    .input_schema
                    .fields()
                    .iter()
                    .map(|f| {
                        b.column_by_name(f.name()).cloned().ok_or_else(|| {
                            Error::UnsupportedQuery(format!(
                                "the aggregate's input lacks the column {}",
                                f.name()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(RecordBatch::try_new(
                    Arc::clone(&self.input_schema),
                    columns,
                )?)
            })
            .collect::<Result<Vec<_>>>()?;
        let exec = partial_exec(
            &self.group_by,
            &self.aggregates,
            &self.filters,
            &self.input_schema,
            rows,
            &self.input_schema,
        )?;
        self.run(exec).await
    }

    /// Phase 1 over a physical plan of the same aggregate (planned over other input, e.g. with a
    /// filter below it): runs its first phase over its input rows, in parallel over the input's
    /// partitions, and returns the partial state in [`AggregateState::state_schema`].
    ///
    /// # Errors
    /// If the plan has no aggregate, its state differs from this aggregate's (a different
    /// aggregate), or execution fails.
    pub async fn partial_of(&self, physical: &Arc<dyn ExecutionPlan>) -> Result<Vec<RecordBatch>> {
        let exec = find_aggregate(physical).ok_or_else(|| {
            Error::UnsupportedQuery("the per-batch plan lost its aggregate".into())
        })?;
        let partial: Arc<dyn ExecutionPlan> = Arc::new(AggregateExec::try_new(
            AggregateMode::Partial,
            Arc::new(exec.group_expr().clone()),
            exec.aggr_expr().to_vec(),
            exec.filter_expr().to_vec(),
            Arc::clone(exec.input()),
            exec.input_schema(),
        )?);
        let schema = partial.schema();
        if !same_columns(&schema, &self.state_schema) {
            return Err(Error::UnsupportedQuery(format!(
                "the per-batch aggregate's state ({schema}) differs from the planned one ({})",
                self.state_schema
            )));
        }
        let batches = self.run(partial).await?;
        batches
            .into_iter()
            .map(|b| {
                Ok(RecordBatch::try_new(
                    Arc::clone(&self.state_schema),
                    b.columns().to_vec(),
                )?)
            })
            .collect()
    }

    /// Phase 2: merges state rows (from any number of batches) into one row per group.
    pub async fn merge(&self, states: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        self.over_state(AggregateMode::PartialReduce, states).await
    }

    /// Phase 3: the aggregate values of state rows.
    pub async fn finish(&self, states: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        self.over_state(AggregateMode::Final, states).await
    }

    /// Phase 3 of state rows that hold each group **at most once** (as a keyed state table
    /// does), in their order: each aggregate's state columns merged into accumulators of one
    /// group per row and evaluated — what the `Final` phase does, without hashing the groups
    /// to find rows that belong together (there are none; the hashing was a sixth of a
    /// windowed job's CPU). Rows that repeat a group would come out once each, not merged.
    /// Grouping sets and an aggregate without group columns (one row however many come in)
    /// go through [`AggregateState::finish`]. Batches of at most the session's batch size.
    ///
    /// # Errors
    /// If an accumulator cannot be made, merged or evaluated (e.g. a value overflows).
    pub async fn finish_unique(&self, states: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        if !self.group_by.is_single() || self.group_by.is_empty() {
            return self.finish(states).await;
        }
        let groups = self.group_by.expr().len();
        let finish = |states: &RecordBatch| -> Result<RecordBatch> {
            let rows = states.num_rows();
            let each_its_own: Vec<usize> = (0..rows).collect();
            let mut columns = (states.columns().get(..groups))
                .ok_or_else(|| {
                    Error::UnsupportedQuery(format!(
                        "state rows of {} columns lack the {groups} group columns",
                        states.num_columns()
                    ))
                })?
                .to_vec();
            let mut at = groups;
            for aggregate in &self.aggregates {
                let width = aggregate.state_fields()?.len();
                let mut accumulator: Box<dyn GroupsAccumulator> =
                    if aggregate.groups_accumulator_supported() {
                        aggregate.create_groups_accumulator()?
                    } else {
                        let aggregate = Arc::clone(aggregate);
                        Box::new(GroupsAccumulatorAdapter::new(move || {
                            aggregate.create_accumulator()
                        }))
                    };
                let state = states.columns().get(at..at + width).ok_or_else(|| {
                    Error::UnsupportedQuery(format!(
                        "state rows of {} columns lack {}'s state",
                        states.num_columns(),
                        aggregate.name()
                    ))
                })?;
                accumulator.merge_batch(state, &each_its_own, rows)?;
                columns.push(accumulator.evaluate(EmitTo::All)?);
                at += width;
            }
            Ok(RecordBatch::try_new(
                Arc::clone(&self.output_schema),
                columns,
            )?)
        };
        // As DataFusion hands out its output: the query above reads these in parallel.
        let batch_size = self.state.config().batch_size();
        let mut out = Vec::new();
        for states in states.iter().filter(|b| b.num_rows() > 0) {
            out.extend(crate::memory::slices(&finish(states)?, batch_size));
        }
        Ok(out)
    }

    async fn over_state(
        &self,
        mode: AggregateMode,
        states: Vec<RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        let exec = AggregateExec::try_new(
            mode,
            Arc::new(self.group_by.as_final()),
            self.aggregates.clone(),
            self.filters.clone(),
            memory(states, &self.state_schema)?,
            Arc::clone(&self.input_schema),
        )?;
        self.run(Arc::new(exec)).await
    }

    async fn run(&self, exec: Arc<dyn ExecutionPlan>) -> Result<Vec<RecordBatch>> {
        let batches = collect(exec, self.state.task_ctx()).await?;
        Ok(batches.into_iter().filter(|b| b.num_rows() > 0).collect())
    }
}

/// Whether two schemas have the same columns — names and types, in order; nullability aside
/// (partial states of the same aggregate over differently planned input may differ in it).
pub(crate) fn same_columns(a: &Schema, b: &Schema) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type())
}

fn partial_exec(
    group_by: &Arc<PhysicalGroupBy>,
    aggregates: &[Arc<AggregateFunctionExpr>],
    filters: &[Option<Arc<dyn PhysicalExpr>>],
    input_schema: &SchemaRef,
    rows: Vec<RecordBatch>,
    rows_schema: &SchemaRef,
) -> Result<Arc<dyn ExecutionPlan>> {
    Ok(Arc::new(AggregateExec::try_new(
        AggregateMode::Partial,
        Arc::clone(group_by),
        aggregates.to_vec(),
        filters.to_vec(),
        memory(rows, rows_schema)?,
        Arc::clone(input_schema),
    )?))
}

/// One partition of in-memory batches.
fn memory(batches: Vec<RecordBatch>, schema: &SchemaRef) -> Result<Arc<dyn ExecutionPlan>> {
    Ok(MemorySourceConfig::try_new_exec(
        &[batches],
        Arc::clone(schema),
        None,
    )?)
}

/// The aggregate closest to the root: the first phase's expressions are on every mode's node.
fn find_aggregate(plan: &Arc<dyn ExecutionPlan>) -> Option<&AggregateExec> {
    if let Some(exec) = plan.downcast_ref::<AggregateExec>() {
        // A Final node's input is the Partial node, whose input schema is the rows'.
        if matches!(
            exec.mode(),
            AggregateMode::Final | AggregateMode::FinalPartitioned
        ) {
            return exec.children().first().and_then(|c| find_aggregate(c));
        }
        return Some(exec);
    }
    plan.children().into_iter().find_map(find_aggregate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::tree_node::TreeNode;
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;
    use proptest::prelude::*;

    const SQL: &str = "SELECT w, k, count(*) AS n, sum(v) AS total, min(v) AS lo, max(v) AS hi, \
        avg(v) AS mean, count(DISTINCT v) AS distinct_v, approx_distinct(k) AS approx_k, \
        stddev(v) AS sd FROM t GROUP BY w, k";

    fn rows(values: &[(i64, u8, i64)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("w", DataType::Int64, false),
            Field::new("k", DataType::Utf8, false),
            Field::new("v", DataType::Float64, false),
            Field::new("unused", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(values.iter().map(|r| r.0))),
                Arc::new(StringArray::from_iter_values(
                    values.iter().map(|r| format!("k{}", r.1)),
                )),
                Arc::new(Float64Array::from_iter_values(
                    values.iter().map(|r| r.2 as f64 / 7.0),
                )),
                Arc::new(Int64Array::from_iter_values(values.iter().map(|_| 0))),
            ],
        )
        .unwrap()
    }

    /// Rows as displayed values in column order (`null` kept), sorted by the group columns.
    fn displayed(batches: &[RecordBatch]) -> Vec<Vec<String>> {
        let mut rows = Vec::new();
        for b in batches {
            for i in 0..b.num_rows() {
                rows.push(
                    b.columns()
                        .iter()
                        .map(|c| arrow::util::display::array_value_to_string(c, i).unwrap())
                        .collect::<Vec<_>>(),
                );
            }
        }
        rows.sort_by_key(|r| (r[0].parse::<i64>().ok(), r[1].clone()));
        rows
    }

    /// Equal, or floats within 1e-9 relative (absolute near zero, where a sum of values of
    /// magnitude ~1 cancels out and the summation order shows in the last bits).
    fn close(a: &str, b: &str) -> bool {
        match (a.parse::<f64>(), b.parse::<f64>()) {
            (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
            _ => a == b,
        }
    }

    /// Streams `chunks` through partial → merge and finishes every group at the end.
    async fn streamed(chunks: &[Vec<(i64, u8, i64)>]) -> Vec<Vec<String>> {
        let ctx = SessionContext::new();
        let all: Vec<(i64, u8, i64)> = chunks.concat();
        let table = MemTable::try_new(rows(&all).schema(), vec![vec![]]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
        let plan = ctx.state().create_logical_plan(SQL).await.unwrap();
        let mut aggregate = None;
        plan.apply(|node| {
            if matches!(node, LogicalPlan::Aggregate(_)) {
                aggregate = Some(node.clone());
            }
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        })
        .unwrap();
        let op = AggregateState::plan(&ctx.state(), &aggregate.unwrap())
            .await
            .unwrap();
        let mut state = Vec::new();
        for chunk in chunks {
            let mut input = op.partial(vec![rows(chunk)]).await.unwrap();
            input.extend(state);
            state = op.merge(input).await.unwrap();
        }
        let finished = displayed(&op.finish(state.clone()).await.unwrap());
        let unique = displayed(&op.finish_unique(state).await.unwrap());
        assert_eq!(
            unique, finished,
            "finished without grouping: as the Final phase"
        );
        finished
    }

    async fn at_once(all: &[(i64, u8, i64)]) -> Vec<Vec<String>> {
        let ctx = SessionContext::new();
        let table = MemTable::try_new(rows(all).schema(), vec![vec![rows(all)]]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
        displayed(&ctx.sql(SQL).await.unwrap().collect().await.unwrap())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// However the rows are split into batches, carrying partial states gives what one
        /// aggregation over all rows gives.
        #[test]
        fn any_batch_split_gives_the_one_batch_result(
            events in proptest::collection::vec((0..4i64, 0..3u8, -50..50i64), 1..120),
            cuts in proptest::collection::vec(0..120usize, 0..6),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % events.len()).collect();
            cuts.sort();
            let mut chunks = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([events.len()]) {
                chunks.push(events[from..c.max(from)].to_vec());
                from = c.max(from);
            }
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let got = rt.block_on(streamed(&chunks));
            let want = rt.block_on(at_once(&events));
            prop_assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                prop_assert_eq!(g.len(), w.len());
                for (a, b) in g.iter().zip(w) {
                    prop_assert!(close(a, b), "{:?} vs {:?}", g, w);
                }
            }
        }
    }
}
