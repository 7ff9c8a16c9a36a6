//! Windowed aggregation across batches: the stateful part of a streaming query.
//!
//! A query such as
//!
//! ```sql
//! SELECT window_start, user_id, count(*) AS clicks
//! FROM tumble(clicks, ts, INTERVAL '1' MINUTE)
//! GROUP BY window_start, window_end, user_id
//! ```
//!
//! is split at its **window aggregate** (the aggregate grouping by `window_start` or
//! `window_end` whose input needs no state) into three parts:
//!
//! ```text
//!  upper      Projection / Filter / outer aggregate by window …   runs over the windows that close
//!  ─────────────────────────────────────────────────────────────────────────────────────────────────
//!  aggregate  GROUP BY window, keys: partial states, merged into the keyed state (AggregateState)
//!  ─────────────────────────────────────────────────────────────────────────────────────────────────
//!  lower      tumble/hop view, WHERE, expressions                runs over each batch's rows
//! ```
//!
//! Each batch, rows of windows that are still open under the watermark in force are aggregated
//! into partial states (DataFusion's own, see [`crate::aggregate_state`]) and merged into the
//! state: one row per open (window, group). Rows of windows already closed are late (see
//! [`crate::late`]) and left out. Then, under the batch's new watermark, every window whose end
//! plus the allowed lateness has passed is finished, removed from the state, and fed to the upper
//! part, whose result is the batch's output. So each window is emitted exactly once (append
//! mode) with every on-time row in it, and the state holds only open windows.
//!
//! The upper part sees only whole windows, and only the windows closing in this batch, so it
//! must work per window: an outer aggregate must group by the window and a window function must
//! partition by it (Nexmark q5, q7). Planning checks this.

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::array::{AsArray, BooleanArray, RecordBatch, TimestampMicrosecondArray};
use arrow::compute::filter_record_batch;
use arrow::compute::kernels::cmp;
use arrow::datatypes::{Field, Schema, SchemaRef, TimestampMicrosecondType};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, ScalarValue};
use datafusion::datasource::provider_as_source;
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan, LogicalPlanBuilder, lit};
use datafusion::prelude::SessionContext;

use crate::aggregate_state::AggregateState;
use crate::error::{Error, Result};
use crate::late::Lateness;
use crate::offsets::BatchId;
use crate::state_store::{StateLog, StateWrite};
use crate::window::{WINDOW_END, WINDOW_START, WindowUse};

/// The table the upper part reads the finished windows from.
const FINISHED_TABLE: &str = "__sluice_finished_windows";

/// Which window column identifies a window in the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WindowColumn {
    Start,
    End,
}

impl WindowColumn {
    fn name(self) -> &'static str {
        match self {
            WindowColumn::Start => WINDOW_START,
            WindowColumn::End => WINDOW_END,
        }
    }
}

/// State rows and bytes, reported per batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateSize {
    /// Rows: one per open (window, group).
    pub rows: u64,
    /// Bytes the rows take in memory (Arrow buffers).
    pub bytes: u64,
}

/// A query's window aggregate, its state, and what runs above it.
pub(crate) struct WindowedAggregate {
    /// The window function call the aggregate's rows come from.
    pub(crate) window: WindowUse,
    /// When its windows close.
    pub(crate) lateness: Lateness,
    aggregate: LogicalPlan,
    operator: AggregateState,
    window_column: WindowColumn,
    /// Position of the window column among the state's columns.
    state_window_index: usize,
    /// One row per open (window, group): partial aggregate states.
    state: Vec<RecordBatch>,
    /// This batch's partial rows of still-open windows: the state delta to write.
    changes: Vec<RecordBatch>,
    upper: LogicalPlan,
    finished: Arc<MemTable>,
    finished_schema: SchemaRef,
    log: Option<StateLog>,
}

impl std::fmt::Debug for WindowedAggregate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowedAggregate")
            .field("window", &self.window)
            .field("aggregate", &self.aggregate.display().to_string())
            .finish()
    }
}

/// Finds the query's window aggregate; `None` if the query needs no state.
///
/// `event_time` maps each source to its event-time column.
pub(crate) async fn plan_windowed(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    uses: &[WindowUse],
    event_time: &std::collections::BTreeMap<String, String>,
    allowed_lateness: i64,
) -> Result<Option<WindowedAggregate>> {
    if crate::query::stateful_node(plan).is_none() {
        return Ok(None);
    }
    // The aggregates whose input needs no state: the candidates for the window aggregate.
    let mut aggregates: Vec<LogicalPlan> = Vec::new();
    plan.apply(|node| {
        if let LogicalPlan::Aggregate(a) = node
            && crate::query::stateful_node(&a.input).is_none()
            && !aggregates.contains(node)
        {
            aggregates.push(node.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    let aggregate = match aggregates.as_slice() {
        [] => {
            let node = crate::query::stateful_node(plan).unwrap_or_default();
            return Err(Error::UnsupportedQuery(format!(
                "`{node}` needs state across batches; streaming jobs run SELECT with expressions, \
                 WHERE, UNION ALL, UNNEST, and aggregates over tumble/hop windows — no joins, \
                 ORDER BY, LIMIT or DISTINCT below a window aggregate"
            )));
        }
        [one] => one.clone(),
        _ => {
            return Err(Error::UnsupportedQuery(
                "the query has several different aggregates over its sources; a streaming job \
                 has one window aggregate (an outer aggregate over its result is fine)"
                    .into(),
            ));
        }
    };
    let LogicalPlan::Aggregate(agg) = &aggregate else {
        unreachable!("collected aggregates only")
    };
    let grouped_by = |name: &str| {
        agg.group_expr
            .iter()
            .any(|e| matches!(e, Expr::Column(c) if c.name == name))
    };
    let window_column = if grouped_by(WINDOW_START) {
        WindowColumn::Start
    } else if grouped_by(WINDOW_END) {
        WindowColumn::End
    } else {
        return Err(Error::UnsupportedQuery(format!(
            "`{}` groups by neither window_start nor window_end: an aggregate over a stream \
             needs a window (FROM tumble(…) or hop(…), GROUP BY window_start, …); running \
             aggregates without windows need update mode, which this version does not have yet",
            aggregate.display()
        )));
    };
    let mut distinct: Vec<&WindowUse> = Vec::new();
    for u in uses {
        if !distinct.contains(&u) {
            distinct.push(u);
        }
    }
    let window = match distinct.as_slice() {
        [one] => (*one).clone(),
        [] => {
            return Err(Error::UnsupportedQuery(
                "the aggregate groups by window_start/window_end but reads no tumble(…) or \
                 hop(…) window"
                    .into(),
            ));
        }
        _ => {
            return Err(Error::UnsupportedQuery(
                "the query uses different windows (or windows over different sources); a \
                 streaming job aggregates over one window definition"
                    .into(),
            ));
        }
    };
    match event_time.get(&window.source) {
        Some(column) if *column == window.time_column => {}
        Some(column) => {
            return Err(Error::UnsupportedQuery(format!(
                "the window is over {}.{}, but the source's event time is '{column}': windows \
                 close on the event-time watermark, so they must be over the event_time column",
                window.source, window.time_column
            )));
        }
        None => {
            return Err(Error::UnsupportedQuery(format!(
                "the window is over source '{}', which has no event_time: set event_time in \
                 [sources.{}] so windows can close on its watermark",
                window.source, window.source
            )));
        }
    }

    let operator = AggregateState::plan(&ctx.state(), &aggregate).await?;
    let state_window_index = operator
        .state_schema()
        .index_of(window_column.name())
        .map_err(|_| {
            Error::UnsupportedQuery(format!(
                "the aggregate's state has no column {} (its columns: {})",
                window_column.name(),
                operator.state_schema()
            ))
        })?;

    // The upper part reads the finished windows from a table with the aggregate's schema.
    let finished_schema = Arc::new(Schema::new(
        aggregate
            .schema()
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| Field::new(format!("c{i}"), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let finished = Arc::new(MemTable::try_new(
        Arc::clone(&finished_schema),
        vec![vec![]],
    )?);
    let renamed = aggregate
        .schema()
        .iter()
        .enumerate()
        .map(|(i, (qualifier, field))| {
            Expr::Column(Column::new(Some(FINISHED_TABLE), format!("c{i}")))
                .alias_qualified(qualifier.cloned(), field.name())
        })
        .collect::<Vec<_>>();
    let replacement = LogicalPlanBuilder::scan(
        FINISHED_TABLE,
        provider_as_source(Arc::clone(&finished) as _),
        None,
    )?
    .project(renamed)?
    .build()?;
    let upper = plan
        .clone()
        .transform_down(|node| {
            if node == aggregate {
                Ok(Transformed::new(
                    replacement.clone(),
                    true,
                    TreeNodeRecursion::Jump,
                ))
            } else {
                Ok(Transformed::no(node))
            }
        })?
        .data;
    check_upper(&upper)?;

    Ok(Some(WindowedAggregate {
        lateness: Lateness {
            kind: window.kind,
            allowed_lateness,
        },
        window,
        aggregate,
        operator,
        window_column,
        state_window_index,
        state: Vec::new(),
        changes: Vec::new(),
        upper,
        finished,
        finished_schema,
        log: None,
    }))
}

/// Checks that what runs above the window aggregate works per window: it reads no source
/// directly, does not LIMIT, and its aggregates group by (its window functions partition by) a
/// window column or a rename of one.
fn check_upper(upper: &LogicalPlan) -> Result<()> {
    // Names that carry the window, bottom up: window_start, window_end and their aliases.
    let mut window_names: BTreeSet<String> = [WINDOW_START, WINDOW_END]
        .into_iter()
        .map(String::from)
        .collect();
    let mut problem: Option<String> = None;
    let is_window = |e: &Expr, names: &BTreeSet<String>| matches!(e, Expr::Column(c) if names.contains(&c.name));
    upper.apply(|node| {
        if let LogicalPlan::Projection(p) = node {
            for e in &p.expr {
                if let Expr::Alias(a) = e
                    && matches!(a.expr.as_ref(), Expr::Column(c) if c.name == WINDOW_START || c.name == WINDOW_END)
                {
                    window_names.insert(a.name.clone());
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    upper.apply(|node| {
        let bad = match node {
            LogicalPlan::TableScan(scan) if scan.table_name.table() != FINISHED_TABLE => {
                Some(format!(
                    "`{}` reads a source beside the window aggregate (stream joins are not \
                     supported yet)",
                    node.display()
                ))
            }
            LogicalPlan::Limit(_) => Some(format!(
                "`{}` above a window aggregate would cut each batch's windows, not the stream",
                node.display()
            )),
            LogicalPlan::Aggregate(a)
                if !a.group_expr.iter().any(|e| is_window(e, &window_names)) =>
            {
                Some(format!(
                    "the outer aggregate `{}` must group by the window (window_start or \
                     window_end): it runs over the windows each batch closes",
                    node.display()
                ))
            }
            LogicalPlan::Window(w)
                if !w.window_expr.iter().all(|e| match e {
                    Expr::WindowFunction(f) => f
                        .params
                        .partition_by
                        .iter()
                        .any(|p| is_window(p, &window_names)),
                    Expr::Alias(a) => match a.expr.as_ref() {
                        Expr::WindowFunction(f) => f
                            .params
                            .partition_by
                            .iter()
                            .any(|p| is_window(p, &window_names)),
                        _ => false,
                    },
                    _ => false,
                }) =>
            {
                Some(format!(
                    "the window function in `{}` must PARTITION BY the window (window_start or \
                     window_end): it runs over the windows each batch closes",
                    node.display()
                ))
            }
            _ => None,
        };
        if let Some(bad) = bad {
            problem = Some(bad);
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    match problem {
        None => Ok(()),
        Some(p) => Err(Error::UnsupportedQuery(p)),
    }
}

impl WindowedAggregate {
    /// The aggregate over the rows of windows still open under `watermark` (all rows if none):
    /// what each batch runs; its first phase gives the batch's partial states.
    pub(crate) fn partial_plan(&self, watermark: Option<i64>) -> Result<LogicalPlan> {
        let LogicalPlan::Aggregate(agg) = &self.aggregate else {
            unreachable!("planned from an aggregate")
        };
        let Some(watermark) = watermark else {
            return Ok(self.aggregate.clone());
        };
        let first_open = self.lateness.first_open_start(watermark);
        let bound = match self.window_column {
            WindowColumn::Start => first_open,
            WindowColumn::End => first_open.saturating_add(self.lateness.kind.size()),
        };
        let (qualifier, _) = agg
            .input
            .schema()
            .qualified_field_with_unqualified_name(self.window_column.name())?;
        let column = Expr::Column(Column::new(qualifier.cloned(), self.window_column.name()));
        let open = column.gt_eq(lit(ScalarValue::TimestampMicrosecond(
            Some(bound),
            Some("UTC".into()),
        )));
        let input = LogicalPlanBuilder::from(Arc::clone(&agg.input))
            .filter(open)?
            .build()?;
        Ok(LogicalPlan::Aggregate(Aggregate::try_new(
            Arc::new(input),
            agg.group_expr.clone(),
            agg.aggr_expr.clone(),
        )?))
    }

    /// The aggregate's three phases.
    pub(crate) fn operator(&self) -> &AggregateState {
        &self.operator
    }

    /// Merges a batch's partial states into the state.
    pub(crate) async fn accumulate(&mut self, partials: Vec<RecordBatch>) -> Result<()> {
        if partials.iter().all(|b| b.num_rows() == 0) {
            self.changes.clear();
            return Ok(());
        }
        let mut all = std::mem::take(&mut self.state);
        all.extend(partials.iter().cloned());
        self.state = self.operator.merge(all).await?;
        self.changes = partials;
        Ok(())
    }

    /// Finishes every window closed under `watermark` (`i64::MAX`: every window, for the end of
    /// a bounded run), removes it from the state, and runs the upper part over it.
    pub(crate) async fn emit(
        &mut self,
        ctx: &SessionContext,
        watermark: Option<i64>,
    ) -> Result<Vec<RecordBatch>> {
        let Some(watermark) = watermark else {
            return Ok(Vec::new());
        };
        let state = std::mem::take(&mut self.state);
        let (closed, open) = self.split_closed(state, watermark)?;
        self.state = open;
        let changes = std::mem::take(&mut self.changes);
        self.changes = self.split_closed(changes, watermark)?.1;
        if closed.is_empty() {
            return Ok(Vec::new());
        }
        let finished = self.operator.finish(closed).await?;
        let finished = finished
            .into_iter()
            .map(|b| {
                Ok(RecordBatch::try_new(
                    Arc::clone(&self.finished_schema),
                    b.columns().to_vec(),
                )?)
            })
            .collect::<Result<Vec<_>>>()?;
        {
            let mut slot = self.finished.batches[0].write().await;
            *slot = finished;
        }
        let out = ctx
            .execute_logical_plan(self.upper.clone())
            .await?
            .collect()
            .await;
        self.finished.batches[0].write().await.clear();
        Ok(out?.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// Splits state rows into those of windows closed under `watermark` and the rest.
    fn split_closed(
        &self,
        rows: Vec<RecordBatch>,
        watermark: i64,
    ) -> Result<(Vec<RecordBatch>, Vec<RecordBatch>)> {
        let (mut closed, mut open) = (Vec::new(), Vec::new());
        for b in rows {
            let mask = self.closed_mask(&b, watermark)?;
            let c = filter_record_batch(&b, &mask)?;
            let o = filter_record_batch(&b, &arrow::compute::not(&mask)?)?;
            if c.num_rows() > 0 {
                closed.push(c);
            }
            if o.num_rows() > 0 {
                open.push(o);
            }
        }
        Ok((closed, open))
    }

    fn closed_mask(&self, batch: &RecordBatch, watermark: i64) -> Result<BooleanArray> {
        let windows = batch
            .column(self.state_window_index)
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                Error::UnsupportedQuery(format!(
                    "the state's {} column is not a timestamp",
                    self.window_column.name()
                ))
            })?;
        let first_open = self.lateness.first_open_start(watermark);
        let bound = match self.window_column {
            WindowColumn::Start => first_open,
            WindowColumn::End => first_open.saturating_add(self.lateness.kind.size()),
        };
        let bound = TimestampMicrosecondArray::from(vec![bound])
            .with_data_type(arrow::array::Array::data_type(windows).clone());
        Ok(cmp::lt(windows, &arrow::array::Scalar::new(bound))?)
    }

    /// Rows and in-memory bytes of the state.
    pub(crate) fn state_size(&self) -> StateSize {
        StateSize {
            rows: self.state.iter().map(|b| b.num_rows() as u64).sum(),
            bytes: self
                .state
                .iter()
                .map(|b| b.get_array_memory_size() as u64)
                .sum(),
        }
    }

    /// Restores the state from the files a committed manifest lists: merged, and without the
    /// windows closed under the restored `watermark`.
    pub(crate) async fn restore(
        &mut self,
        mut log: StateLog,
        files: &[String],
        watermark: Option<i64>,
    ) -> Result<()> {
        let rows = log.restore(files).await?;
        self.state = if rows.is_empty() {
            Vec::new()
        } else {
            self.operator.merge(rows).await?
        };
        if let Some(watermark) = watermark {
            let state = std::mem::take(&mut self.state);
            self.state = self.split_closed(state, watermark)?.1;
        }
        self.changes.clear();
        self.log = Some(log);
        Ok(())
    }

    /// Writes this batch's state (a delta, or a new base) and returns the live files for the
    /// manifest.
    pub(crate) async fn write_state(&mut self, batch_id: BatchId) -> Result<StateWrite> {
        let log = self
            .log
            .as_mut()
            .ok_or_else(|| Error::InvalidJob("state written before it was restored".into()))?;
        log.write(
            batch_id,
            &self.operator.state_schema(),
            &self.changes,
            &self.state,
        )
        .await
    }

    /// Deletes state files no longer live; call after the commit.
    pub(crate) async fn collect_garbage(&self) -> Result<usize> {
        match &self.log {
            Some(log) => log.collect_garbage().await,
            None => Ok(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointStore;
    use crate::event_time::event_time_type;
    use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::DataType;
    use datafusion::datasource::MemTable;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::time::Duration;

    const SECOND: i64 = 1_000_000;
    const OUT_OF_ORDERNESS: i64 = 20 * SECOND;
    /// 2024-05-01T00:00:00Z
    const BASE: i64 = 1_714_521_600 * SECOND;

    /// One event: (event time, key, value).
    type Event = (i64, u8, i64);

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("ts", event_time_type(), false),
            Field::new("k", DataType::Utf8, false),
            Field::new("v", DataType::Float64, false),
            Field::new("n", DataType::Int64, false),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]))
    }

    fn batch(events: &[Event]) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(events.iter().map(|e| e.0))
                        .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from_iter_values(
                    events.iter().map(|e| format!("k{}", e.1)),
                )),
                Arc::new(Float64Array::from_iter_values(
                    events.iter().map(|e| e.2 as f64 / 7.0),
                )),
                Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.2))),
                Arc::new(StringArray::from(vec!["0"; events.len()])),
                Arc::new(Int64Array::from_iter_values(0..events.len() as i64)),
            ],
        )
        .unwrap()
    }

    const AGGREGATES: &str = "count(*) AS n, sum(v) AS total, min(v) AS lo, max(n) AS hi, \
        avg(v) AS mean, count(DISTINCT n) AS distinct_n, stddev(v) AS sd, \
        approx_distinct(n) AS approx_n";

    /// A streamed query and the same query in plain DataFusion SQL over all rows, with the
    /// windows spelled out by hand.
    fn queries() -> Vec<(String, String)> {
        let tumble_rows = "(SELECT *, date_bin(INTERVAL '1 minute', ts) AS window_start, \
             date_bin(INTERVAL '1 minute', ts) + INTERVAL '1 minute' AS window_end FROM t)";
        let hop_rows = "(SELECT *, s AS window_start, s + INTERVAL '1 minute' AS window_end FROM \
             (SELECT *, unnest(make_array(date_bin(INTERVAL '20 seconds', ts), \
             date_bin(INTERVAL '20 seconds', ts) - INTERVAL '20 seconds', \
             date_bin(INTERVAL '20 seconds', ts) - INTERVAL '40 seconds')) AS s FROM t))";
        let per_key = |from: &str| {
            format!(
                "SELECT window_start, window_end, k, {AGGREGATES} FROM {from} \
                 GROUP BY window_start, window_end, k"
            )
        };
        // An outer aggregate over the window (Nexmark q5-style: the busiest key per window).
        let outer = |from: &str| {
            format!(
                "SELECT window_start, max(c) AS busiest, count(*) AS keys FROM \
                 (SELECT window_start, k, count(*) AS c FROM {from} GROUP BY window_start, k) \
                 GROUP BY window_start"
            )
        };
        // A window function over each window's rows (the rank of each key by its total).
        let ranked = |from: &str| {
            format!(
                "SELECT window_end, k, total, rank() OVER (PARTITION BY window_end ORDER BY total DESC, k) AS r \
                 FROM (SELECT window_end, k, sum(n) AS total FROM {from} GROUP BY window_end, k)"
            )
        };
        let tumble = "tumble(t, ts, INTERVAL '1' MINUTE)";
        let hop = "hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)";
        vec![
            (per_key(tumble), per_key(tumble_rows)),
            (per_key(hop), per_key(hop_rows)),
            (outer(hop), outer(hop_rows)),
            (ranked(tumble), ranked(tumble_rows)),
        ]
    }

    fn settings(lateness: Duration) -> QuerySettings {
        QuerySettings {
            lineage: true,
            allowed_lateness: lateness,
            event_time: BTreeMap::from([("t".to_string(), "ts".to_string())]),
        }
    }

    /// Rows as displayed values, sorted; approx_distinct and floats compared loosely later.
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
        rows.sort();
        rows
    }

    /// Equal, or floats within 1e-9 relative (absolute near zero).
    fn close(a: &str, b: &str) -> bool {
        match (a.parse::<f64>(), b.parse::<f64>()) {
            (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
            _ => a == b,
        }
    }

    async fn batch_result(sql: &str, events: &[Event]) -> Vec<Vec<String>> {
        let ctx = SessionContext::new();
        let table = MemTable::try_new(schema(), vec![vec![batch(events)]]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
        displayed(&ctx.sql(sql).await.unwrap().collect().await.unwrap())
    }

    /// Streams `chunks` as batches with the driver's watermark rule; at `restart_after`, the
    /// state is written, and a freshly planned query restores it and carries on.
    async fn streamed(
        sql: &str,
        chunks: &[Vec<Event>],
        restart_after: usize,
    ) -> (Vec<Vec<String>>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let sources = [("t".to_string(), schema())];
        let settings = settings(Duration::ZERO);
        let plan = || StreamingQuery::plan(sql, &sources, &settings);
        let mut query = plan().await.unwrap();
        query
            .windowed_mut()
            .unwrap()
            .restore(StateLog::new(&checkpoint), &[], None)
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut watermark: Option<i64> = None;
        let mut late = 0;
        for (i, chunk) in chunks.iter().enumerate() {
            let rows = batch(chunk);
            late += query
                .late_rows("t", &rows, watermark, BatchId(i as i64))
                .unwrap()
                .map_or(0, |b| b.num_rows() as u64);
            let after = chunk
                .iter()
                .map(|e| e.0 - OUT_OF_ORDERNESS)
                .chain(watermark)
                .max();
            let step = BatchWatermark {
                before: watermark,
                after,
            };
            let inputs = BTreeMap::from([("t".to_string(), rows)]);
            let result = query.execute_isolating(&inputs, step).await.unwrap();
            assert!(result.failed.is_empty());
            out.extend(result.batches);
            watermark = after;
            let written = query
                .windowed_mut()
                .unwrap()
                .write_state(BatchId(i as i64))
                .await
                .unwrap();
            if i == restart_after {
                query = plan().await.unwrap();
                query
                    .windowed_mut()
                    .unwrap()
                    .restore(StateLog::new(&checkpoint), &written.live_files, watermark)
                    .await
                    .unwrap();
            }
        }
        // The end of a bounded run: every window.
        let step = BatchWatermark {
            before: watermark,
            after: Some(i64::MAX),
        };
        let result = query
            .execute_isolating(&BTreeMap::new(), step)
            .await
            .unwrap();
        out.extend(result.batches);
        (displayed(&out), late)
    }

    /// Events one second apart from BASE, each up to the out-of-orderness bound earlier than
    /// its place, so none is late, cut into batches at `cuts`.
    fn arrange(events: &[(i64, u8, i64)], cuts: &[usize]) -> (Vec<Event>, Vec<Vec<Event>>) {
        let events: Vec<Event> = events
            .iter()
            .enumerate()
            .map(|(i, (jitter, k, v))| (BASE + i as i64 * SECOND - jitter, *k, *v))
            .collect();
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (events.len() + 1)).collect();
        cuts.sort_unstable();
        let mut chunks = Vec::new();
        let mut from = 0;
        for c in cuts.into_iter().chain([events.len()]) {
            chunks.push(events[from..c.max(from)].to_vec());
            from = c.max(from);
        }
        (events, chunks)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        /// Golden test: however out-of-order (within the bound) rows are batched, and wherever
        /// the job restarts from its state files, the streamed windows equal one batch
        /// computation over all rows, and no row is late.
        #[test]
        fn streamed_windows_equal_the_batch_recomputation(
            events in proptest::collection::vec((0..OUT_OF_ORDERNESS, 0..3u8, -40..40i64), 1..300),
            cuts in proptest::collection::vec(0..300usize, 0..8),
            restart_after in 0..8usize,
        ) {
            let (all, chunks) = arrange(&events, &cuts);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            for (streaming_sql, batch_sql) in queries() {
                let (got, late) = rt.block_on(streamed(&streaming_sql, &chunks, restart_after));
                let want = rt.block_on(batch_result(&batch_sql, &all));
                prop_assert_eq!(late, 0);
                prop_assert_eq!(got.len(), want.len(), "{}", streaming_sql);
                for (g, w) in got.iter().zip(&want) {
                    for (a, b) in g.iter().zip(w) {
                        prop_assert!(close(a, b), "{}: {:?} vs {:?}", streaming_sql, g, w);
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn late_rows_are_left_out_of_closed_windows_and_counted() {
        let sql = &queries()[0].0;
        // Batch 1 moves the watermark to 00:01:40 (closing [00:00, 00:01)); batch 2 brings an
        // event of 00:00:30 (late) and one of 00:01:30 (on time).
        let chunks = vec![
            vec![(BASE + 10 * SECOND, 0, 1), (BASE + 120 * SECOND, 0, 2)],
            vec![(BASE + 30 * SECOND, 0, 3), (BASE + 90 * SECOND, 1, 4)],
        ];
        let (rows, late) = streamed(sql, &chunks, 99).await;
        assert_eq!(late, 1);
        // [00:00, 00:01) holds only the first event; [00:01, 00:02) the on-time one.
        let counts: Vec<(String, String, String)> = rows
            .iter()
            .map(|r| (r[0].clone(), r[2].clone(), r[3].clone()))
            .collect();
        assert_eq!(
            counts,
            vec![
                ("2024-05-01T00:00:00Z".into(), "k0".into(), "1".into()),
                ("2024-05-01T00:01:00Z".into(), "k1".into(), "1".into()),
                ("2024-05-01T00:02:00Z".into(), "k0".into(), "1".into()),
            ]
        );
    }

    #[tokio::test]
    async fn queries_the_engine_cannot_stream_are_refused_by_name() {
        let sources = [("t".to_string(), schema())];
        for (sql, wanted) in [
            (
                "SELECT k, count(*) FROM t GROUP BY k",
                "groups by neither window_start nor window_end",
            ),
            (
                "SELECT window_start, count(*) FROM tumble(t, ts, INTERVAL '1' MINUTE) \
                 GROUP BY window_start ORDER BY window_start LIMIT 3",
                "would cut each batch's windows",
            ),
            (
                "SELECT max(c) FROM (SELECT window_start, k, count(*) AS c \
                 FROM tumble(t, ts, INTERVAL '1' MINUTE) GROUP BY window_start, k)",
                "must group by the window",
            ),
            (
                "SELECT a.window_start FROM (SELECT window_start, count(*) FROM tumble(t, ts, INTERVAL '1' MINUTE) GROUP BY window_start) a \
                 JOIN (SELECT window_start, count(*) FROM hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE) GROUP BY window_start) b \
                 ON a.window_start = b.window_start",
                "several different aggregates",
            ),
        ] {
            let e = StreamingQuery::plan(sql, &sources, &settings(Duration::ZERO))
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(wanted), "{sql}: {e}");
        }
        let no_event_time = QuerySettings {
            event_time: BTreeMap::new(),
            ..settings(Duration::ZERO)
        };
        let e = StreamingQuery::plan(&queries()[0].0, &sources, &no_event_time)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no event_time"), "{e}");
    }
}
