//! Aggregation across batches: the stateful part of a streaming query.
//!
//! A query such as
//!
//! ```sql
//! SELECT window_start, user_id, count(*) AS clicks
//! FROM tumble(clicks, ts, INTERVAL '1' MINUTE)
//! GROUP BY window_start, window_end, user_id
//! ```
//!
//! is split at its **aggregate** (the one whose input needs no state) into three parts:
//!
//! ```text
//!  upper      Projection / Filter / outer aggregate by window …   runs over the groups emitted
//!  ─────────────────────────────────────────────────────────────────────────────────────────────────
//!  aggregate  GROUP BY window, keys: partial states, merged into the keyed state (AggregateState)
//!  ─────────────────────────────────────────────────────────────────────────────────────────────────
//!  lower      tumble/hop view, WHERE, expressions                runs over each batch's rows
//! ```
//!
//! Each batch, the rows of windows still open under the watermark in force are aggregated into
//! partial states (DataFusion's own, see [`super::aggregate_state`]) and merged into the state:
//! one row per (window, group). Rows of windows already closed are late (see [`crate::late`])
//! and left out. What is emitted depends on the output mode:
//!
//! - **append**: under the batch's new watermark, every window whose end plus the allowed
//!   lateness has passed is finished, removed from the state and fed to the upper part — each
//!   window is written exactly once, with every on-time row in it;
//! - **update**: every group the batch changed is finished and emitted (the sink upserts it),
//!   so the table always holds the latest value; closed windows then leave the state.
//!
//! A **running aggregate** (`GROUP BY user_id`, no window; update mode only) keeps one row per
//! group, and drops a group once the watermark is `state_ttl` past its newest event — tracked
//! by a hidden `max(event time)` aggregate carried in the state. So state is bounded either way.
//!
//! In append mode the upper part sees only whole windows, and only those closing in this batch,
//! so it must work per window: an outer aggregate must group by the window and a window function
//! must partition by it (Nexmark q5, q7). In update mode it sees only the changed groups, so it
//! may only project. Planning checks both.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{AsArray, BooleanArray, RecordBatch, TimestampMicrosecondArray, UInt32Array};
use arrow::compute::filter_record_batch;
use arrow::compute::kernels::cmp;
use arrow::datatypes::{SchemaRef, TimestampMicrosecondType};
use arrow::row::{RowConverter, SortField};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, ScalarValue};
use datafusion::functions_aggregate::expr_fn::max;
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan, LogicalPlanBuilder, lit};
use datafusion::prelude::SessionContext;

use super::aggregate_state::AggregateState;
use super::group_table::GroupTable;
use super::panes::Panes;
use super::state_store::{StateLog, StateWrite};
use super::{FailedRow, QueryOutput, is_data_error};
use crate::error::{Error, Result};
use crate::late::Lateness;
use crate::offsets::BatchId;
use crate::sink::OutputMode;
use crate::window::{WINDOW_END, WINDOW_START, WindowKind, WindowUse};

/// The table the upper part reads the finished groups from.
const FINISHED_TABLE: &str = "__sluice_finished_groups";
/// The hidden aggregate a running aggregate's state carries: each group's newest event time.
const NEWEST_EVENT: &str = "__sluice_newest_event";

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

/// What the aggregate groups by, which decides when a group leaves the state.
#[derive(Debug, Clone)]
enum Grouping {
    /// A window (and keys): a group leaves when the watermark closes its window.
    Window {
        window: WindowUse,
        lateness: Lateness,
        column: WindowColumn,
    },
    /// Keys only: a group leaves once the watermark is `ttl` µs past its newest event.
    Running { ttl: i64 },
}

impl Grouping {
    /// Whether the groups are session windows.
    fn is_session(&self) -> bool {
        matches!(
            self,
            Grouping::Window { window, .. } if matches!(window.kind, WindowKind::Session { .. })
        )
    }
}

/// State rows and bytes, reported per batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateSize {
    /// Rows: one per live (window, group).
    pub rows: u64,
    /// Bytes the rows take in memory (Arrow buffers).
    pub bytes: u64,
}

/// How [`plan_stateful`] plans the aggregate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatefulSettings<'a> {
    /// Each source's event-time column.
    pub(crate) event_time: &'a BTreeMap<String, String>,
    /// How long after its end a window accepts rows, µs.
    pub(crate) allowed_lateness: i64,
    /// Append or update.
    pub(crate) mode: OutputMode,
    /// Running aggregates: how long a group outlives its newest event, µs.
    pub(crate) state_ttl: Option<i64>,
    /// The static tables (joined whole; every other table is a stream).
    pub(crate) statics: &'a BTreeSet<String>,
}

/// A query's stateful aggregate, its state, and what runs above it.
pub(crate) struct StatefulAggregate {
    grouping: Grouping,
    /// The source the aggregate reads (the window's, or the running aggregate's), for the dead
    /// letters of groups whose output fails.
    source: String,
    mode: OutputMode,
    /// The aggregate as run each batch (a running aggregate's carries [`NEWEST_EVENT`]).
    aggregate: LogicalPlan,
    /// A hopping window's aggregate computed by panes (see [`super::panes`]): its first phase
    /// runs over each row's newest window instead of `aggregate`'s.
    panes: Option<Panes>,
    operator: AggregateState,
    /// How many leading state columns are group columns.
    group_count: usize,
    /// The state column whose value decides when a row leaves: the window column, or the
    /// newest event time.
    purge_index: usize,
    /// The group columns that are plain columns, by name: the default upsert key.
    group_columns: Vec<String>,
    /// The state: one row per live (window, group), as partial aggregate states, by group.
    groups: GroupTable,
    /// This batch's partial rows: the state delta to write.
    changes: Vec<RecordBatch>,
    /// The watermark the state was last purged under (by [`StatefulAggregate::emit`] or a
    /// restore).
    purged_under: Option<i64>,
    /// `purged_under` when this batch's partial rows were merged in: written with the delta,
    /// so a restore purges the files before it as the state was before merging it.
    changes_purged_under: Option<i64>,
    /// The merged state rows of the groups this batch changed (not for sessions): what update
    /// mode emits.
    changed: Vec<RecordBatch>,
    upper: LogicalPlan,
    finished: Arc<MemTable>,
    finished_schema: SchemaRef,
    log: Option<StateLog>,
}

impl std::fmt::Debug for StatefulAggregate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatefulAggregate")
            .field("grouping", &self.grouping)
            .field("mode", &self.mode)
            .field("aggregate", &self.aggregate.display().to_string())
            .finish()
    }
}

impl StatefulAggregate {
    /// The aggregate as the `position`-th operator of the query's chain.
    pub(crate) fn describe(&self, position: usize) -> super::OperatorDescription {
        let micros = |us: i64| {
            humantime::format_duration(std::time::Duration::from_micros(us.max(0) as u64))
                .to_string()
        };
        let state_key = self
            .operator
            .state_schema()
            .fields()
            .iter()
            .take(self.group_count)
            .map(|f| f.name().clone())
            .collect();
        let (what, purge) = match &self.grouping {
            Grouping::Window {
                window, lateness, ..
            } => {
                let end = if matches!(window.kind, WindowKind::Session { .. }) {
                    "its end (its last event + the gap)"
                } else {
                    "its end"
                };
                // By panes: each row aggregated once, in its newest window (see super::panes).
                let panes = match (&self.panes, window.kind) {
                    (Some(_), WindowKind::Hop { slide, .. }) => {
                        format!(", by {} panes", micros(slide))
                    }
                    _ => String::new(),
                };
                (
                    format!("windowed aggregate over {}{panes}", window_call(window)),
                    format!(
                        "a window leaves when the watermark reaches {end} + allowed lateness ({})",
                        micros(lateness.allowed_lateness)
                    ),
                )
            }
            Grouping::Running { ttl } => (
                format!("running aggregate over {}", self.source),
                format!(
                    "a group leaves when the watermark is state_ttl ({}) past its newest event",
                    micros(*ttl)
                ),
            ),
        };
        let emits = match (self.mode, &self.grouping) {
            (OutputMode::Append, _) => "each window once, when it closes".to_string(),
            (OutputMode::Update, Grouping::Window { .. }) => {
                "every window and group a batch changed (upserted)".to_string()
            }
            (OutputMode::Update, Grouping::Running { .. }) => {
                "every group a batch changed (upserted)".to_string()
            }
        };
        super::OperatorDescription {
            id: Self::id(position),
            what,
            state_key,
            purge,
            emits,
        }
    }
}

impl StatefulAggregate {
    /// The id of the aggregate as the `position`-th operator of the query's chain.
    pub(crate) fn id(position: usize) -> String {
        format!("{position}-aggregate")
    }

    /// What the state means, as text: the window (or running grouping) over its source and
    /// time column, the group and aggregate expressions (columns without their table or alias
    /// qualifier, so renaming an alias is no change) and the type of every state column.
    /// Recorded in the manifest; a restart whose query gives another fingerprint is refused
    /// rather than merging into state another query wrote.
    ///
    /// Not checked: what runs below the aggregate (filters, projections, joins — a column
    /// redefined under the same name keeps the fingerprint), allowed lateness, `state_ttl`, the
    /// output mode. The text follows DataFusion's display of expressions, so an upgrade that
    /// changes it refuses restoring state written before.
    pub(crate) fn fingerprint(&self) -> String {
        let grouping = match &self.grouping {
            Grouping::Window { window, .. } => window_call(window),
            Grouping::Running { .. } => format!("running over {}", self.source),
        };
        let unqualified = |e: &Expr| -> String {
            e.clone()
                .transform(|e| match e {
                    Expr::Column(c) => Ok(Transformed::yes(Expr::Column(Column::new_unqualified(
                        c.name,
                    )))),
                    other => Ok(Transformed::no(other)),
                })
                .map(|t| t.data.to_string())
                .unwrap_or_default()
        };
        let (groups, aggregates) = match &self.aggregate {
            LogicalPlan::Aggregate(a) => (
                a.group_expr.iter().map(unqualified).collect::<Vec<_>>(),
                a.aggr_expr.iter().map(unqualified).collect::<Vec<_>>(),
            ),
            _ => (Vec::new(), Vec::new()),
        };
        let types: Vec<String> = self
            .operator
            .state_schema()
            .fields()
            .iter()
            .map(|f| f.data_type().to_string())
            .collect();
        format!(
            "aggregate over {grouping} by [{}] of [{}]; state types [{}]",
            groups.join(", "),
            aggregates.join(", "),
            types.join(", ")
        )
    }
}

/// A window as `sluice validate` and the operator's fingerprint name it: `tumble(1m, clicks.ts)`.
fn window_call(window: &WindowUse) -> String {
    let d =
        |us: i64| humantime::format_duration(std::time::Duration::from_micros(us.max(0) as u64));
    let call = match window.kind {
        WindowKind::Tumble { size } => format!("tumble({}", d(size)),
        WindowKind::Hop { slide, size } => format!("hop({} every {}", d(size), d(slide)),
        WindowKind::Session { gap } => format!("session(gap {}", d(gap)),
    };
    format!("{call}, {}.{})", window.source, window.time_column)
}

/// The rows `rows` of `batch`.
fn take_rows(batch: &RecordBatch, rows: &[u32]) -> Result<RecordBatch> {
    Ok(arrow::compute::take_record_batch(
        batch,
        &UInt32Array::from(rows.to_vec()),
    )?)
}

impl std::ops::Add for StateSize {
    type Output = StateSize;

    fn add(self, other: StateSize) -> StateSize {
        StateSize {
            rows: self.rows + other.rows,
            bytes: self.bytes + other.bytes,
        }
    }
}

/// Finds the query's stateful aggregate; `None` if the query needs no state.
pub(crate) async fn plan_stateful(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    uses: &[WindowUse],
    settings: StatefulSettings<'_>,
) -> Result<Option<StatefulAggregate>> {
    let statics = settings.statics;
    if super::stateful_node(plan, statics).is_none() {
        return Ok(None);
    }
    // The aggregates whose input needs no state: the candidates.
    let mut aggregates: Vec<LogicalPlan> = Vec::new();
    let _ = plan.apply(|node| {
        if let LogicalPlan::Aggregate(a) = node
            && super::reads_stream(&a.input, statics)
            && super::stateful_node(&a.input, statics).is_none()
            && !aggregates.contains(node)
        {
            aggregates.push(node.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let original = match aggregates.as_slice() {
        [] => {
            // Name what keeps the deepest aggregate from running (a join below it, say), not
            // the aggregate above it.
            let mut found = super::stateful_node(plan, statics).unwrap_or_default();
            let _ = plan.apply(|node| {
                if let LogicalPlan::Aggregate(a) = node
                    && let Some(inner) = super::stateful_node(&a.input, statics)
                {
                    found = inner;
                }
                Ok(TreeNodeRecursion::Continue)
            });
            let (node, reason) = found;
            let reason = if reason.is_empty() {
                String::new()
            } else {
                format!(" ({reason})")
            };
            return Err(Error::UnsupportedQuery(format!(
                "`{node}` needs state across batches{reason}; streaming jobs run SELECT with \
                 expressions, WHERE, UNION ALL, UNNEST, joins of a stream with a static table \
                 ([tables.NAME] in a job file) that keep no unmatched table rows, and one \
                 stateful operator: an aggregate (over tumble/hop/session windows, or a running \
                 aggregate in update mode) or a deduplication (ROW_NUMBER() OVER (PARTITION BY \
                 key ORDER BY event time) = 1, SELECT DISTINCT; with state_ttl) — no join of \
                 two streams, no ORDER BY or LIMIT over the stream"
            )));
        }
        [one] => one.clone(),
        _ => {
            return Err(Error::UnsupportedQuery(
                "the query has several different aggregates over its sources; a streaming job \
                 has one (an outer aggregate over its result is fine)"
                    .into(),
            ));
        }
    };
    let LogicalPlan::Aggregate(agg) = &original else {
        unreachable!("collected aggregates only")
    };
    let grouped_by = |name: &str| {
        agg.group_expr
            .iter()
            .any(|e| matches!(e, Expr::Column(c) if c.name == name))
    };
    let window_column = if grouped_by(WINDOW_START) {
        Some(WindowColumn::Start)
    } else if grouped_by(WINDOW_END) {
        Some(WindowColumn::End)
    } else {
        None
    };
    let (grouping, aggregate, source) = match window_column {
        Some(column) => {
            let window = the_window(uses, settings.event_time)?;
            // A session is identified by both its bounds, and leaves the state by its end.
            let column = match window.kind {
                WindowKind::Session { .. } => {
                    if !(grouped_by(WINDOW_START) && grouped_by(WINDOW_END)) {
                        return Err(Error::UnsupportedQuery(
                            "an aggregate over session(…) must GROUP BY window_start, \
                             window_end and its keys"
                                .into(),
                        ));
                    }
                    if settings.mode == OutputMode::Update {
                        return Err(Error::UnsupportedQuery(
                            "sessions run in append mode: a session's bounds change as it grows, \
                             so an upserted row would be left behind under its old bounds"
                                .into(),
                        ));
                    }
                    WindowColumn::End
                }
                _ => column,
            };
            let lateness = Lateness {
                kind: window.kind,
                allowed_lateness: settings.allowed_lateness,
            };
            let source = window.source.clone();
            let grouping = Grouping::Window {
                window,
                lateness,
                column,
            };
            (grouping, original.clone(), source)
        }
        None => running_aggregate(&original, settings)?,
    };

    let operator = AggregateState::plan(&ctx.state(), &aggregate).await?;
    let state_schema = operator.state_schema();
    let panes = match &grouping {
        Grouping::Window { window, .. } => {
            Panes::plan(ctx, &aggregate, window, &state_schema).await
        }
        Grouping::Running { .. } => None,
    };
    // Every group column of the state: a grouping set's expressions and its grouping id too.
    let group_count = agg.group_expr_len()?;
    let purge_column = match &grouping {
        Grouping::Window { column, .. } => column.name().to_string(),
        // A max's partial state is one column, named after the aggregate; the last one.
        Grouping::Running { .. } => state_schema
            .fields()
            .last()
            .map(|f| f.name().clone())
            .unwrap_or_default(),
    };
    let purge_index = state_schema.index_of(&purge_column).map_err(|_| {
        Error::UnsupportedQuery(format!(
            "the aggregate's state has no column {purge_column} (its columns: {state_schema})"
        ))
    })?;
    let group_columns = agg
        .group_expr
        .iter()
        .filter_map(|e| match e {
            Expr::Column(c) => Some(c.name.clone()),
            _ => None,
        })
        .collect();

    // The upper part reads the finished groups from a table with the aggregate's schema.
    let (finished, finished_schema, replacement) =
        super::stand_in(FINISHED_TABLE, original.schema())?;
    let upper = super::replace_node(plan, &original, &replacement)?;
    check_upper(&upper, settings.mode, &[FINISHED_TABLE])?;

    let session = grouping.is_session();
    Ok(Some(StatefulAggregate {
        grouping,
        source,
        mode: settings.mode,
        aggregate,
        panes,
        operator,
        group_count,
        purge_index,
        group_columns,
        groups: if session || group_count == 0 {
            GroupTable::unkeyed(purge_index)
        } else {
            GroupTable::keyed(Arc::clone(&state_schema), group_count, purge_index)?
        },
        changes: Vec::new(),
        purged_under: None,
        changes_purged_under: None,
        changed: Vec::new(),
        upper,
        finished,
        finished_schema,
        log: None,
    }))
}

/// The one window function call a windowed aggregate reads, over an event-time column.
fn the_window(uses: &[WindowUse], event_time: &BTreeMap<String, String>) -> Result<WindowUse> {
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
        Some(column) if *column == window.time_column => Ok(window),
        Some(column) => Err(Error::UnsupportedQuery(format!(
            "the window is over {}.{}, but the source's event time is '{column}': windows \
             close on the event-time watermark, so they must be over the event_time column",
            window.source, window.time_column
        ))),
        None => Err(Error::UnsupportedQuery(format!(
            "the window is over source '{}', which has no event_time: set event_time in \
             [sources.{}] so windows can close on its watermark",
            window.source, window.source
        ))),
    }
}

/// A running aggregate (no window): allowed in update mode with `state_ttl`; planned with a
/// hidden `max(event time)` so each group's newest event is in its state.
fn running_aggregate(
    original: &LogicalPlan,
    settings: StatefulSettings<'_>,
) -> Result<(Grouping, LogicalPlan, String)> {
    let LogicalPlan::Aggregate(agg) = original else {
        unreachable!("an aggregate")
    };
    if settings.mode != OutputMode::Update {
        return Err(Error::UnsupportedQuery(format!(
            "`{}` groups by neither window_start nor window_end: in append mode an aggregate over \
             a stream needs a window (FROM tumble(…) or hop(…), GROUP BY window_start, …) so each \
             row is written once; a running aggregate needs mode = \"update\" in [sink] (and \
             state_ttl)",
            original.display()
        )));
    }
    let Some(ttl) = settings.state_ttl else {
        return Err(Error::UnsupportedQuery(
            "a running aggregate (GROUP BY without a window) keeps a row per key for ever \
             unless state_ttl is set in [query] (for example state_ttl = \"24h\"): set it to \
             bound the state"
                .into(),
        ));
    };
    let mut sources = BTreeSet::new();
    let _ = agg.input.apply(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && !settings
                .statics
                .contains(&scan.table_name.table().to_lowercase())
        {
            sources.insert(scan.table_name.table().to_string());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let [source] = sources.iter().collect::<Vec<_>>()[..] else {
        return Err(Error::UnsupportedQuery(format!(
            "a running aggregate reads one source; this one reads {}",
            sources.into_iter().collect::<Vec<_>>().join(", ")
        )));
    };
    let time = settings.event_time.get(source).ok_or_else(|| {
        Error::UnsupportedQuery(format!(
            "state_ttl counts in event time, and source '{source}' has no event_time"
        ))
    })?;
    let (qualifier, _) = agg
        .input
        .schema()
        .qualified_field_with_unqualified_name(time)
        .map_err(|_| {
            Error::UnsupportedQuery(format!(
                "state_ttl needs the event-time column '{time}' below the aggregate; keep it in \
                 the subquery's SELECT list"
            ))
        })?;
    let newest = max(Expr::Column(Column::new(qualifier.cloned(), time))).alias(NEWEST_EVENT);
    let mut aggr_expr = agg.aggr_expr.clone();
    aggr_expr.push(newest);
    let aggregate = LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::clone(&agg.input),
        agg.group_expr.clone(),
        aggr_expr,
    )?);
    Ok((Grouping::Running { ttl }, aggregate, source.clone()))
}

/// Checks what runs above the aggregate (reading it from the `own` tables): it reads no source
/// directly and does not LIMIT; in append mode its aggregates group by (its window functions
/// partition by) a window column or a rename of one; in update mode it only projects.
pub(super) fn check_upper(upper: &LogicalPlan, mode: OutputMode, own: &[&str]) -> Result<()> {
    // Names that carry the window, bottom up: window_start, window_end and their aliases.
    let mut window_names: BTreeSet<String> = [WINDOW_START, WINDOW_END]
        .into_iter()
        .map(String::from)
        .collect();
    let mut problem: Option<String> = None;
    let is_window = |e: &Expr, names: &BTreeSet<String>| matches!(e, Expr::Column(c) if names.contains(&c.name));
    let partitioned_by_window = |e: &Expr, names: &BTreeSet<String>| {
        let f = match e {
            Expr::WindowFunction(f) => f,
            Expr::Alias(a) => match a.expr.as_ref() {
                Expr::WindowFunction(f) => f,
                _ => return false,
            },
            _ => return false,
        };
        f.params.partition_by.iter().any(|p| is_window(p, names))
    };
    let _ = upper.apply(|node| {
        if let LogicalPlan::Projection(p) = node {
            for e in &p.expr {
                if let Expr::Alias(a) = e
                    && matches!(a.expr.as_ref(), Expr::Column(c) if window_names.contains(&c.name))
                {
                    window_names.insert(a.name.clone());
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    // A table read above the aggregate (subqueries included), named before any other rule
    // trips over the subquery's own nodes.
    let _ = upper.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && !own.contains(&scan.table_name.table())
        {
            problem = Some(format!(
                "`{}` reads a table beside the aggregate's output: join a static table below \
                 the aggregate (its rows, before the window), and a stream only in the \
                 aggregate's FROM",
                node.display()
            ));
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if let Some(problem) = problem.take() {
        return Err(Error::UnsupportedQuery(problem));
    }
    let _ = upper.apply(|node| {
        let bad = match node {
            LogicalPlan::Limit(_) => Some(format!(
                "`{}` above the aggregate would cut each batch's groups, not the stream",
                node.display()
            )),
            LogicalPlan::Aggregate(_) | LogicalPlan::Window(_) | LogicalPlan::Filter(_)
                if mode == OutputMode::Update =>
            {
                Some(format!(
                    "`{}` above the aggregate: in update mode each batch emits only the groups \
                     it changed, so what runs above the aggregate may only compute columns \
                     (no outer aggregate, window function or HAVING)",
                    node.display()
                ))
            }
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
                if !w
                    .window_expr
                    .iter()
                    .all(|e| partitioned_by_window(e, &window_names)) =>
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
    });
    match problem {
        None => Ok(()),
        Some(p) => Err(Error::UnsupportedQuery(p)),
    }
}

impl StatefulAggregate {
    /// The window function call the rows come from, and when its windows close (`None` for a
    /// running aggregate).
    pub(crate) fn window(&self) -> Option<(&WindowUse, Lateness)> {
        match &self.grouping {
            Grouping::Window {
                window, lateness, ..
            } => Some((window, *lateness)),
            Grouping::Running { .. } => None,
        }
    }

    /// The group columns that are plain columns: the default upsert key.
    pub(crate) fn group_columns(&self) -> &[String] {
        &self.group_columns
    }

    /// The aggregate over the rows of windows still open under `watermark` (all rows if none,
    /// or for a running aggregate): what each batch runs; its first phase gives the batch's
    /// partial states, for [`StatefulAggregate::accumulate`] under the same watermark. By
    /// panes, the rows are each row's newest window, kept if that is open.
    pub(crate) fn partial_plan(&self, watermark: Option<i64>) -> Result<LogicalPlan> {
        let aggregate = self
            .panes
            .as_ref()
            .map_or(&self.aggregate, |p| &p.aggregate);
        let LogicalPlan::Aggregate(agg) = aggregate else {
            unreachable!("planned from an aggregate")
        };
        let (Some(watermark), Grouping::Window { column, .. }) = (watermark, &self.grouping) else {
            return Ok(aggregate.clone());
        };
        let (qualifier, _) = agg
            .input
            .schema()
            .qualified_field_with_unqualified_name(column.name())?;
        let window = Expr::Column(Column::new(qualifier.cloned(), column.name()));
        let open = window.gt_eq(lit(ScalarValue::TimestampMicrosecond(
            Some(self.purge_bound(watermark)),
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

    /// State rows whose purge column is below this leave the state under `watermark`: windows
    /// closed, or groups whose newest event is `state_ttl` behind.
    fn purge_bound(&self, watermark: i64) -> i64 {
        match &self.grouping {
            Grouping::Window {
                lateness, column, ..
            } => {
                let first_open = lateness.first_open_start(watermark);
                match column {
                    WindowColumn::Start => first_open,
                    WindowColumn::End => first_open.saturating_add(lateness.kind.size()),
                }
            }
            Grouping::Running { ttl } => watermark.saturating_sub(*ttl).saturating_add(1),
        }
    }

    /// The aggregate's three phases.
    pub(crate) fn operator(&self) -> &AggregateState {
        &self.operator
    }

    /// Merges a batch's partial states into the state: only the groups the batch touches are
    /// taken out, merged with their partial rows and put back (see [`super::group_table`]) —
    /// unless the batch has at least as many partial rows as the state has groups, when the
    /// whole state is merged with them (a lookup per group would cost more).
    /// Sessions merge with every overlapping session of their key, so they are merged with the
    /// whole state (O(state) a batch), as is an aggregate without group columns (one row).
    ///
    /// `partials` come from [`StatefulAggregate::partial_plan`] under `watermark`; by panes,
    /// each is first given to every open window of its pane, and each window's copies merged.
    pub(crate) async fn accumulate(
        &mut self,
        partials: Vec<RecordBatch>,
        watermark: Option<i64>,
    ) -> Result<()> {
        let partials = match &self.panes {
            Some(panes) => {
                let copies = panes.to_windows(
                    partials,
                    self.purge_index,
                    watermark.map(|w| self.purge_bound(w)),
                )?;
                // A window's copies merged first: the delta written and the rows merged into
                // the state hold one row per window and group, as without panes.
                self.operator.merge(copies).await?
            }
            None => partials,
        };
        self.changes_purged_under = self.purged_under;
        self.merge_partials(&partials, self.mode == OutputMode::Update)
            .await?;
        self.changes = partials;
        Ok(())
    }

    /// Merges partial rows into the state (see [`StatefulAggregate::accumulate`]); with
    /// `track_changed`, keeps the merged rows of the groups they changed in `changed`: what
    /// update mode emits.
    async fn merge_partials(
        &mut self,
        partials: &[RecordBatch],
        track_changed: bool,
    ) -> Result<()> {
        self.changed.clear();
        if partials.iter().all(|b| b.num_rows() == 0) {
            return Ok(());
        }
        if !self.groups.is_keyed() {
            let mut all = self.groups.take_all()?;
            all.extend(partials.iter().cloned());
            let merged = self.operator.merge(all).await?;
            let merged = self.merge_sessions(merged).await?;
            if track_changed {
                self.changed.clone_from(&merged);
            }
            self.groups.reset(merged)?;
        } else {
            // A batch with at least as many partial rows as the state has groups merges with
            // the whole state: as cheap as looking the groups up, then, and no dead rows left.
            let partial_rows: usize = partials.iter().map(RecordBatch::num_rows).sum();
            let whole_state = self.groups.live_rows() <= partial_rows;
            let mut pending = partials.to_vec();
            let mut rounds = 0;
            while pending.iter().any(|b| b.num_rows() > 0) {
                let mut touched = if rounds == 0 && whole_state {
                    self.groups.take_all()?
                } else {
                    self.groups.take(&pending)?
                };
                touched.append(&mut pending);
                let merged = self.operator.merge(touched).await?;
                if track_changed {
                    self.changed.clone_from(&merged);
                }
                // A group DataFusion emitted twice comes back, to be merged with its first row.
                pending = self.groups.insert(merged)?;
                rounds += 1;
            }
            if track_changed && (rounds > 1 || whole_state) {
                // A group merged again has its final row in the table, not in one round's rows;
                // a whole-state merge's rows hold groups the batch did not change.
                self.changed = self.groups.lookup(partials)?;
            }
        }
        Ok(())
    }

    fn is_session(&self) -> bool {
        self.grouping.is_session()
    }

    /// Sessions: merges the overlapping sessions of each key into one (bounds widened, partial
    /// states merged). Other groupings: unchanged.
    async fn merge_sessions(&self, state: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        if !self.is_session() || state.is_empty() {
            return Ok(state);
        }
        let schema = self.operator.state_schema();
        let all = arrow::compute::concat_batches(&schema, &state)?;
        let (start_index, end_index) =
            (schema.index_of(WINDOW_START)?, schema.index_of(WINDOW_END)?);
        let starts = all
            .column(start_index)
            .as_primitive::<TimestampMicrosecondType>();
        let ends = all
            .column(end_index)
            .as_primitive::<TimestampMicrosecondType>();
        let key_columns: Vec<usize> = (0..self.group_count)
            .filter(|i| *i != start_index && *i != end_index)
            .collect();
        let converter = RowConverter::new(
            key_columns
                .iter()
                .map(|i| SortField::new(schema.field(*i).data_type().clone()))
                .collect(),
        )?;
        let key_arrays: Vec<_> = key_columns
            .iter()
            .map(|i| Arc::clone(all.column(*i)))
            .collect();
        let keys = converter.convert_columns(&key_arrays)?;
        let mut order: Vec<usize> = (0..all.num_rows()).collect();
        order.sort_by(|a, b| {
            keys.row(*a)
                .cmp(&keys.row(*b))
                .then(starts.value(*a).cmp(&starts.value(*b)))
        });
        let mut new_starts = starts.values().to_vec();
        let mut new_ends = ends.values().to_vec();
        let mut merged_any = false;
        let mut run: Vec<usize> = Vec::new();
        let (mut run_start, mut run_end) = (0, 0);
        let mut close_run = |run: &mut Vec<usize>, start: i64, end: i64| {
            for r in run.drain(..) {
                new_starts[r] = start;
                new_ends[r] = end;
            }
        };
        for (position, &row) in order.iter().enumerate() {
            let same_key = position > 0 && keys.row(order[position - 1]) == keys.row(row);
            if same_key && starts.value(row) < run_end {
                run_end = run_end.max(ends.value(row));
                merged_any = true;
            } else {
                close_run(&mut run, run_start, run_end);
                (run_start, run_end) = (starts.value(row), ends.value(row));
            }
            run.push(row);
        }
        close_run(&mut run, run_start, run_end);
        if !merged_any {
            return Ok(vec![all]);
        }
        let mut columns = all.columns().to_vec();
        let timestamps = |values: Vec<i64>| {
            Arc::new(
                TimestampMicrosecondArray::from(values)
                    .with_data_type(arrow::array::Array::data_type(starts).clone()),
            ) as arrow::array::ArrayRef
        };
        columns[start_index] = timestamps(new_starts);
        columns[end_index] = timestamps(new_ends);
        let widened = RecordBatch::try_new(Arc::clone(&schema), columns)?;
        self.operator.merge(vec![widened]).await
    }

    /// Emits what the output mode says (append: every window closed under `watermark`; update:
    /// every group this batch changed), drops what the watermark has closed or expired from the
    /// state, and runs the upper part over the emitted groups. `i64::MAX` closes everything (the
    /// end of a bounded run). Groups whose output fails are dead letters (see
    /// [`StatefulAggregate::finish_isolating`]).
    pub(crate) async fn emit(
        &mut self,
        ctx: &SessionContext,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        let emitted = match self.mode {
            OutputMode::Append => {
                let Some(watermark) = watermark else {
                    return Ok(QueryOutput::default());
                };
                self.purge(watermark)?
            }
            OutputMode::Update => {
                let changed = std::mem::take(&mut self.changed);
                if let Some(watermark) = watermark {
                    self.purge(watermark)?;
                }
                changed
            }
        };
        // The delta to write: a window's partial rows leave with their window, so rows of
        // windows this watermark closed are not written. Not so for sessions (a closed one-row
        // session may be part of a merged session still open) nor running groups (a partial
        // row's newest event is not its group's: an old event merged into a group that lives
        // on stays counted), whose rows all stay — but for a running aggregate's rows of no
        // event (an aggregate without group columns over no rows).
        let changes = std::mem::take(&mut self.changes);
        self.changes = match (&self.grouping, watermark) {
            (Grouping::Running { .. }, _) => self.with_events(changes)?,
            (Grouping::Window { .. }, Some(watermark)) if !self.is_session() => {
                self.split_purged(changes, watermark)?.1
            }
            _ => changes,
        };
        if emitted.iter().all(|b| b.num_rows() == 0) {
            return Ok(QueryOutput::default());
        }
        self.finish_isolating(ctx, emitted).await
    }

    /// Removes the groups `watermark` closes or expires from the state, and returns them.
    fn purge(&mut self, watermark: i64) -> Result<Vec<RecordBatch>> {
        self.purged_under = self.purged_under.max(Some(watermark));
        self.groups.remove_below(self.purge_bound(watermark))
    }

    /// The end of a bounded run: every group in the state is finished and emitted, whatever
    /// the output mode, and the state is left empty.
    pub(crate) async fn emit_all(&mut self, ctx: &SessionContext) -> Result<QueryOutput> {
        self.changes.clear();
        self.changed.clear();
        let all = self.groups.take_all()?;
        if all.iter().all(|b| b.num_rows() == 0) {
            return Ok(QueryOutput::default());
        }
        self.finish_isolating(ctx, all).await
    }

    /// Finishes `groups` (state rows) and runs the upper part over them.
    async fn finish_groups(
        &self,
        ctx: &SessionContext,
        groups: Vec<RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        let width = self.finished_schema.fields().len();
        // A keyed state table holds each group once, and every caller passes rows of it (a
        // purge's, a merge round's or a lookup's, all of the table, or a subset of those): they
        // need no grouping to finish. An unkeyed table's rows go through the `Final` phase.
        let finished = if self.groups.is_keyed() {
            self.operator.finish_unique(groups).await?
        } else {
            self.operator.finish(groups).await?
        };
        let finished = finished
            .into_iter()
            .map(|b| {
                // A running aggregate's hidden newest-event column is last: not the query's.
                let columns = b.columns()[..width].to_vec();
                Ok(RecordBatch::try_new(
                    Arc::clone(&self.finished_schema),
                    columns,
                )?)
            })
            .collect::<Result<Vec<_>>>()?;
        {
            let mut slot = self.finished.batches[0].write().await;
            *slot = finished;
        }
        let out = match ctx.execute_logical_plan(self.upper.clone()).await {
            Ok(df) => df.collect().await,
            Err(e) => Err(e),
        };
        self.finished.batches[0].write().await.clear();
        Ok(out?.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// Finishes the emitted groups; if that fails on their values (a division by zero or a
    /// failing CAST in the SELECT over the aggregate), finds the failing groups by splitting
    /// and makes them dead letters, so one bad group cannot fail every batch from now on.
    ///
    /// What runs above the aggregate may work per window (an outer aggregate, a window
    /// function), so the emitted groups are split by whole windows first, and only within a
    /// failing window into groups: a group that fails alone is a dead letter and the window is
    /// finished without it; if the window still fails, all its groups are (the failure needs
    /// them together). Errors not caused by the values stop the batch.
    async fn finish_isolating(
        &self,
        ctx: &SessionContext,
        emitted: Vec<RecordBatch>,
    ) -> Result<QueryOutput> {
        match self.finish_groups(ctx, emitted.clone()).await {
            Ok(batches) => {
                return Ok(QueryOutput {
                    batches,
                    failed: Vec::new(),
                });
            }
            Err(e) if !is_data_error(&e) => return Err(e),
            Err(_) => {}
        }
        let all = arrow::compute::concat_batches(&self.operator.state_schema(), &emitted)?;
        let units = self.whole_units(&all)?;
        let mut out = QueryOutput::default();
        let mut pending = vec![(0, units.len())];
        while let Some((from, to)) = pending.pop() {
            if from == to {
                continue;
            }
            let rows: Vec<u32> = units[from..to].concat();
            match self.finish_groups(ctx, vec![take_rows(&all, &rows)?]).await {
                Ok(batches) => out.batches.extend(batches),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(_) if to - from == 1 => {
                    self.isolate_in_unit(ctx, &all, &units[from], &mut out)
                        .await?
                }
                Err(_) => {
                    let mid = from + (to - from) / 2;
                    pending.push((mid, to));
                    pending.push((from, mid));
                }
            }
        }
        Ok(out)
    }

    /// Row indices of `all` grouped into what the upper part must see whole: in append mode
    /// over windows, each window's groups; otherwise (update mode, a running aggregate: the
    /// upper part only computes columns) each group alone.
    fn whole_units(&self, all: &RecordBatch) -> Result<Vec<Vec<u32>>> {
        let n = all.num_rows() as u32;
        if self.mode == OutputMode::Update || self.window().is_none() {
            return Ok((0..n).map(|i| vec![i]).collect());
        }
        let windows = all
            .column(self.purge_index)
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                Error::UnsupportedQuery("the window column is not a timestamp".into())
            })?;
        let mut units: BTreeMap<i64, Vec<u32>> = BTreeMap::new();
        for i in 0..n {
            units.entry(windows.value(i as usize)).or_default().push(i);
        }
        Ok(units.into_values().collect())
    }

    /// Within one failing window: the groups that fail alone become dead letters, and the
    /// window is finished without them; if it still fails, every group of it is a dead letter.
    async fn isolate_in_unit(
        &self,
        ctx: &SessionContext,
        all: &RecordBatch,
        unit: &[u32],
        out: &mut QueryOutput,
    ) -> Result<()> {
        let mut bad: Vec<(u32, String)> = Vec::new();
        let mut pending = vec![unit.to_vec()];
        while let Some(rows) = pending.pop() {
            match self.finish_groups(ctx, vec![take_rows(all, &rows)?]).await {
                Ok(_) => {}
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(e) if rows.len() == 1 => bad.push((rows[0], e.to_string())),
                Err(_) => {
                    let (left, right) = rows.split_at(rows.len() / 2);
                    pending.push(right.to_vec());
                    pending.push(left.to_vec());
                }
            }
        }
        let good: Vec<u32> = unit
            .iter()
            .copied()
            .filter(|r| !bad.iter().any(|(b, _)| b == r))
            .collect();
        if !good.is_empty() {
            match self.finish_groups(ctx, vec![take_rows(all, &good)?]).await {
                Ok(batches) => out.batches.extend(batches),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(e) => bad.extend(good.iter().map(|r| (*r, e.to_string()))),
            }
        }
        bad.sort_by_key(|(r, _)| *r);
        for (row, error) in bad {
            out.failed.push(self.failed_group(all, row, &error)?);
        }
        Ok(())
    }

    /// The dead letter of one emitted group: its group columns as the row, its window and
    /// keys as the position, no source offset (`-1`: it is no single input row).
    fn failed_group(&self, all: &RecordBatch, row: u32, error: &str) -> Result<FailedRow> {
        let group = take_rows(all, &[row])?;
        let keys: Vec<usize> = (0..self.group_count).collect();
        let keys = group.project(&keys)?;
        let position = keys
            .schema()
            .fields()
            .iter()
            .zip(keys.columns())
            .map(|(f, c)| {
                let value = arrow::util::display::array_value_to_string(c, 0)
                    .unwrap_or_else(|_| "?".into());
                format!("{}={value}", f.name())
            })
            .collect::<Vec<_>>()
            .join(", ");
        Ok(FailedRow {
            source: self.source.clone(),
            row: super::without_source_row(&keys, &format!("group {position}"))?,
            error: format!("computing the output of this group failed: {error}"),
        })
    }

    /// Splits state rows into those that leave the state under `watermark` and the rest.
    fn split_purged(
        &self,
        rows: Vec<RecordBatch>,
        watermark: i64,
    ) -> Result<(Vec<RecordBatch>, Vec<RecordBatch>)> {
        let (mut gone, mut kept) = (Vec::new(), Vec::new());
        for b in rows {
            let mask = self.purge_mask(&b, watermark)?;
            let g = filter_record_batch(&b, &mask)?;
            let k = filter_record_batch(&b, &arrow::compute::not(&mask)?)?;
            if g.num_rows() > 0 {
                gone.push(g);
            }
            if k.num_rows() > 0 {
                kept.push(k);
            }
        }
        Ok((gone, kept))
    }

    /// The rows of a running aggregate's partial `rows` that hold an event (a newest event
    /// time).
    fn with_events(&self, rows: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let mut kept = Vec::new();
        for b in rows {
            let column = b.column(self.purge_index);
            let b = if column.null_count() > 0 {
                filter_record_batch(&b, &arrow::compute::is_not_null(column)?)?
            } else {
                b
            };
            if b.num_rows() > 0 {
                kept.push(b);
            }
        }
        Ok(kept)
    }

    fn purge_mask(&self, batch: &RecordBatch, watermark: i64) -> Result<BooleanArray> {
        let column = batch
            .column(self.purge_index)
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| {
                Error::UnsupportedQuery(format!(
                    "the state's column {} is not a timestamp",
                    batch.schema().field(self.purge_index).name()
                ))
            })?;
        let bound = TimestampMicrosecondArray::from(vec![self.purge_bound(watermark)])
            .with_data_type(arrow::array::Array::data_type(column).clone());
        Ok(cmp::lt(column, &arrow::array::Scalar::new(bound))?)
    }

    /// Rows and in-memory bytes of the state.
    pub(crate) fn state_size(&self) -> StateSize {
        StateSize {
            rows: self.groups.live_rows() as u64,
            bytes: self.groups.memory_bytes() as u64,
        }
    }

    /// Restores the state from the files a committed manifest lists, replayed as they were
    /// written: each delta merged into the state the files before it hold, purged under the
    /// watermark the state had then ([`RestoredFile::purged_under`]); at the end, without
    /// what the restored `watermark` has closed or expired.
    ///
    /// Merging every file at once would be the same for tumbling and hopping windows, which
    /// never reopen once closed, but not for a running aggregate's key (expired by `state_ttl`
    /// and back later, its rows from before it left, still in an older file, would be counted
    /// again) nor a session's (closed, and a new session of the key begun before its end: the
    /// two would be merged into one).
    ///
    /// Where a purge between files may remove something, the files after it are merged into the
    /// state as a batch's partial rows are: keyed lookups for windows and running aggregates,
    /// but sessions (and an aggregate without group columns) merge with the whole state —
    /// at most [`super::state_store::MAX_DELTA_FILES`] + 1 merges of it at a restart.
    ///
    /// [`RestoredFile::purged_under`]: super::state_store::RestoredFile::purged_under
    pub(crate) async fn restore(
        &mut self,
        mut log: StateLog,
        files: &[String],
        watermark: Option<i64>,
    ) -> Result<()> {
        self.groups.reset(Vec::new())?;
        self.purged_under = None;
        // Files are merged in runs: the purge before a file is replayed only if it may remove
        // something — a group in the state or a row not merged yet below its bound (merging
        // raises a group's purge value, never lowers it) — so a replay where no row is below
        // any file's bound merges once, as a merge of every file at once would.
        let mut unmerged: Vec<RecordBatch> = Vec::new();
        for file in log.restore(files, &self.operator.state_schema()).await? {
            if let Some(purged_under) = file.purged_under {
                let bound = self.purge_bound(purged_under);
                if self.groups.may_have_below(bound)
                    || self.groups.any_row_below(&unmerged, bound)?
                {
                    self.merge_partials(&std::mem::take(&mut unmerged), false)
                        .await?;
                    self.purge(purged_under)?;
                }
            }
            unmerged.extend(file.rows);
        }
        self.merge_partials(&unmerged, false).await?;
        if let Some(watermark) = watermark {
            self.purge(watermark)?;
        }
        self.changes.clear();
        self.changed.clear();
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
        let groups = &self.groups;
        log.write(
            batch_id,
            &self.operator.state_schema(),
            &self.changes,
            self.changes_purged_under,
            groups.live_rows() as u64,
            || groups.rows(),
        )
        .await
    }

    /// The state files, once restored.
    pub(crate) fn log(&self) -> Option<&StateLog> {
        self.log.as_ref()
    }

    /// The state files, once restored, to adopt another attempt's.
    pub(crate) fn log_mut(&mut self) -> Option<&mut StateLog> {
        self.log.as_mut()
    }

    /// The state files, once restored, to restore the state again from another attempt's.
    pub(crate) fn take_log(&mut self) -> Option<StateLog> {
        self.log.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{BatchManifest, CheckpointStore};
    use crate::event_time::event_time_type;
    use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
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

    /// Every aggregate per window and key over the windowed rows `from`.
    fn per_key(from: &str) -> String {
        format!(
            "SELECT window_start, window_end, k, {AGGREGATES} FROM {from} \
             GROUP BY window_start, window_end, k"
        )
    }

    /// Grouped by the window's end only, a window function over each window above: the rank
    /// of each key by its total.
    fn ranked(from: &str) -> String {
        format!(
            "SELECT window_end, k, total, rank() OVER (PARTITION BY window_end ORDER BY total DESC, k) AS r \
             FROM (SELECT window_end, k, sum(n) AS total FROM {from} GROUP BY window_end, k)"
        )
    }

    /// A streamed query and the same query in plain DataFusion SQL over all rows, with the
    /// windows spelled out by hand.
    fn queries() -> Vec<(String, String)> {
        let tumble_rows = "(SELECT *, date_bin(INTERVAL '1 minute', ts) AS window_start, \
             date_bin(INTERVAL '1 minute', ts) + INTERVAL '1 minute' AS window_end FROM t)";
        let hop_rows = "(SELECT *, s AS window_start, s + INTERVAL '1 minute' AS window_end FROM \
             (SELECT *, unnest(make_array(date_bin(INTERVAL '20 seconds', ts), \
             date_bin(INTERVAL '20 seconds', ts) - INTERVAL '20 seconds', \
             date_bin(INTERVAL '20 seconds', ts) - INTERVAL '40 seconds')) AS s FROM t))";
        // An outer aggregate over the window (Nexmark q5-style: the busiest key per window).
        let outer = |from: &str| {
            format!(
                "SELECT window_start, max(c) AS busiest, count(*) AS keys FROM \
                 (SELECT window_start, k, count(*) AS c FROM {from} GROUP BY window_start, k) \
                 GROUP BY window_start"
            )
        };
        let tumble = "tumble(t, ts, INTERVAL '1' MINUTE)";
        let hop = "hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)";
        // Sessions with a 5 s gap: a key's session ends after 5 s without an event of it.
        let order = "PARTITION BY k ORDER BY ts, _source_offset";
        let session_rows = format!(
            "(SELECT *, min(ts) OVER (PARTITION BY k, sid) AS window_start, \
             max(ts) OVER (PARTITION BY k, sid) + INTERVAL '5 seconds' AS window_end FROM \
             (SELECT *, sum(new_session) OVER ({order} ROWS UNBOUNDED PRECEDING) AS sid FROM \
             (SELECT *, CASE WHEN lag(ts) OVER ({order}) IS NULL OR \
             CAST(ts AS BIGINT) - CAST(lag(ts) OVER ({order}) AS BIGINT) >= 5000000 \
             THEN 1 ELSE 0 END AS new_session FROM t)))"
        );
        let session = "session(t, ts, INTERVAL '5' SECOND)";
        vec![
            (per_key(session), per_key(&session_rows)),
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
            ..QuerySettings::default()
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
        let run = streamed_with(sql, chunks, restart_after, &settings(Duration::ZERO)).await;
        (displayed(&run.outputs.concat()), run.late)
    }

    /// What a streamed run produced.
    struct StreamedRun {
        /// Each batch's output, the final flush last.
        outputs: Vec<Vec<RecordBatch>>,
        late: u64,
        /// State rows after each batch.
        state_rows: Vec<u64>,
    }

    async fn streamed_with(
        sql: &str,
        chunks: &[Vec<Event>],
        restart_after: usize,
        settings: &QuerySettings,
    ) -> StreamedRun {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let sources = [("t".to_string(), schema())];
        let plan = || StreamingQuery::plan(sql, &sources, settings);
        let mut query = plan().await.unwrap();
        query
            .restore_state(StateLog::new(&checkpoint, 0), None, None)
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut state_rows = Vec::new();
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
            out.push(result.batches);
            state_rows.push(query.state_size().unwrap().rows);
            watermark = after;
            let (operators, _) = query.write_state(BatchId(i as i64)).await.unwrap();
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
        // The end of a bounded run: every window.
        let step = BatchWatermark {
            before: watermark,
            after: Some(i64::MAX),
        };
        let result = query
            .execute_isolating(&BTreeMap::new(), step)
            .await
            .unwrap();
        out.push(result.batches);
        StreamedRun {
            outputs: out,
            late,
            state_rows,
        }
    }

    /// Applies each batch's rows as upserts keyed by their first `key` columns, like the Delta
    /// MERGE of update mode: the final table.
    fn upserted(outputs: &[Vec<RecordBatch>], key: usize) -> Vec<Vec<String>> {
        let mut table: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
        for batch_rows in outputs {
            let rows = displayed(batch_rows);
            let keys: std::collections::BTreeSet<&[String]> =
                rows.iter().map(|r| &r[..key]).collect();
            assert_eq!(keys.len(), rows.len(), "a batch emits a key once");
            for row in rows {
                table.insert(row[..key].to_vec(), row);
            }
        }
        table.into_values().collect()
    }

    fn assert_rows_close(got: &[Vec<String>], want: &[Vec<String>], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: {got:?}\nvs\n{want:?}");
        for (g, w) in got.iter().zip(want) {
            for (a, b) in g.iter().zip(w) {
                assert!(close(a, b), "{what}: {g:?} vs {w:?}");
            }
        }
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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(8))]
        /// Update mode: each batch emits the groups it changed; upserting them as the sink's
        /// MERGE does leaves the batch result — for windows and for a running aggregate.
        #[test]
        fn update_mode_upserts_end_at_the_batch_recomputation(
            events in proptest::collection::vec((0..OUT_OF_ORDERNESS, 0..3u8, -40..40i64), 1..200),
            cuts in proptest::collection::vec(0..200usize, 0..6),
            restart_after in 0..6usize,
        ) {
            let (all, chunks) = arrange(&events, &cuts);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let update = QuerySettings {
                output_mode: OutputMode::Update,
                state_ttl: None,
                ..settings(Duration::ZERO)
            };
            let (windowed, windowed_batch) = queries().swap_remove(1);
            let run = rt.block_on(streamed_with(&windowed, &chunks, restart_after, &update));
            let want = rt.block_on(batch_result(&windowed_batch, &all));
            assert_rows_close(&upserted(&run.outputs, 3), &want, &windowed);

            let running = format!("SELECT k, {AGGREGATES} FROM t GROUP BY k");
            let with_ttl = QuerySettings {
                state_ttl: Some(Duration::from_secs(86_400)),
                ..update
            };
            let run = rt.block_on(streamed_with(&running, &chunks, restart_after, &with_ttl));
            let want = rt.block_on(batch_result(&running, &all));
            assert_rows_close(&upserted(&run.outputs, 1), &want, &running);
        }
    }

    /// A hopping-window query aggregated by panes, and the same query with a filter on the
    /// window (always true) that rules panes out, so it aggregates the `hop` view's copies.
    fn by_panes_and_by_copies() -> Vec<(String, String)> {
        let hop = "hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)";
        let copies = format!("{hop} WHERE window_end > window_start");
        vec![
            (per_key(hop), per_key(&copies)),
            (ranked(hop), ranked(&copies)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10))]
        /// Panes change nothing a batch emits, in append and update mode, with late rows (up
        /// to three times the out-of-orderness behind, so that some rows' older windows have
        /// closed while their newer ones are open), allowed lateness and a restart anywhere.
        #[test]
        fn hop_windows_by_panes_emit_what_the_copies_do_batch_by_batch(
            events in proptest::collection::vec((0..3 * OUT_OF_ORDERNESS, 0..3u8, -40..40i64), 1..200),
            cuts in proptest::collection::vec(0..200usize, 0..8),
            restart_after in 0..8usize,
            update in any::<bool>(),
        ) {
            let (_, chunks) = arrange(&events, &cuts);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let settings = QuerySettings {
                output_mode: if update { OutputMode::Update } else { OutputMode::Append },
                ..settings(Duration::from_secs(10))
            };
            for (panes, copies) in by_panes_and_by_copies() {
                if update && panes.contains("rank()") {
                    continue; // update mode only projects above the aggregate
                }
                let by_panes = rt.block_on(streamed_with(&panes, &chunks, restart_after, &settings));
                let by_copies = rt.block_on(streamed_with(&copies, &chunks, restart_after, &settings));
                prop_assert_eq!(by_panes.late, by_copies.late);
                prop_assert_eq!(&by_panes.state_rows, &by_copies.state_rows);
                prop_assert_eq!(by_panes.outputs.len(), by_copies.outputs.len());
                for (p, c) in by_panes.outputs.iter().zip(&by_copies.outputs) {
                    assert_rows_close(&displayed(p), &displayed(c), &panes);
                }
            }
        }
    }

    /// Panes are planned for an aggregate over `hop` whose window columns are only passed on
    /// and grouped by; not where anything else reads or names them, nor for other windows.
    #[tokio::test]
    async fn panes_only_where_the_windows_are_only_grouped_by() {
        let sources = [("t".to_string(), schema())];
        let hop = "hop(t, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)";
        let what = |sql: String| {
            let sources = &sources;
            async move {
                let query = StreamingQuery::plan(&sql, sources, &settings(Duration::ZERO))
                    .await
                    .unwrap();
                let [op] = query.operators().try_into().unwrap();
                op.what.ends_with(", by 20s panes")
            }
        };
        let grouped = "GROUP BY window_start, window_end, k";
        assert!(
            what(format!(
                "SELECT window_start, k, count(*) AS c FROM {hop} {grouped}"
            ))
            .await
        );
        assert!(
            what(format!(
                "SELECT window_end, k, max(v) AS m FROM (SELECT k, v, window_end FROM {hop} AS h \
                 WHERE v > 0) GROUP BY window_end, k"
            ))
            .await
        );
        // A filter, an aggregate argument or an expression named like a window reads the windows.
        for sql in [
            format!(
                "SELECT window_start, k, count(*) AS c FROM {hop} WHERE window_start > \
                 TIMESTAMP '2000-01-01T00:00:00Z' {grouped}"
            ),
            format!("SELECT window_start, k, max(window_end) AS m FROM {hop} {grouped}"),
            format!(
                "SELECT window_start, k, count(*) AS c FROM (SELECT k, window_end, \
                 window_start + INTERVAL '1' SECOND AS window_start FROM {hop}) {grouped}"
            ),
            format!(
                "SELECT window_start, k, count(*) AS c FROM tumble(t, ts, INTERVAL '1' MINUTE) \
                 {grouped}"
            ),
            format!(
                "SELECT window_start, k, count(*) AS c FROM hop(t, ts, INTERVAL '1' MINUTE, \
                 INTERVAL '1' MINUTE) {grouped}"
            ),
        ] {
            assert!(!what(sql.clone()).await, "{sql}");
        }
    }

    /// A key's session closed, then a new session of the key begun before the closed one's end
    /// (not late: its own end is past the watermark): a restart after that keeps the two apart,
    /// as the run without one does, rather than merge them from the state files.
    #[tokio::test]
    async fn a_restart_keeps_a_closed_session_apart_from_the_next_one() {
        let at = |seconds: i64, key: u8| (BASE + seconds * SECOND, key, 1);
        let chunks: Vec<Vec<Event>> = vec![
            // Keys 2 to 5 stay open, so that the state files stay a base and deltas.
            (2..6).map(|key| at(110, key)).collect(),
            vec![at(94, 0), at(120, 1)], // watermark 100 s: k0's session [94 s, 99 s) closes
            vec![at(96, 0)],             // k0's next session [96 s, 101 s)
            vec![at(121, 1)],
        ];
        let sql = "SELECT window_start, window_end, k, count(*) AS n \
                   FROM session(t, ts, INTERVAL '5' SECOND) GROUP BY window_start, window_end, k";
        let unbroken = streamed_with(sql, &chunks, usize::MAX, &settings(Duration::ZERO)).await;
        let emitted = |run: &StreamedRun| -> Vec<Vec<String>> {
            run.outputs
                .iter()
                .flat_map(|b| displayed(b))
                .filter(|row| row[2] == "k0")
                .map(|row| vec![row[0][11..19].to_string(), row[3].clone()])
                .collect()
        };
        let session = |start: &str, n: &str| vec![start.to_string(), n.to_string()];
        assert_eq!(
            emitted(&unbroken),
            [session("00:01:34", "1"), session("00:01:36", "1")]
        );
        for restart_after in 0..chunks.len() {
            let run = streamed_with(sql, &chunks, restart_after, &settings(Duration::ZERO)).await;
            assert_eq!(
                emitted(&run),
                emitted(&unbroken),
                "restarted after batch {restart_after}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// A running aggregate whose keys expire and come back (a TTL far shorter than the gaps
        /// between a key's events, events up to 20 s out of order): a restart after any batch
        /// emits, batch by batch, what the run without one does.
        #[test]
        fn a_running_aggregate_with_a_short_ttl_restarts_where_it_was(
            events in proptest::collection::vec((0..OUT_OF_ORDERNESS, 0..16u8, -40..40i64), 1..150),
            cuts in proptest::collection::vec(0..150usize, 0..8),
            restart_after in 0..8usize,
        ) {
            let (_, chunks) = arrange(&events, &cuts);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let settings = QuerySettings {
                output_mode: OutputMode::Update,
                state_ttl: Some(Duration::from_secs(1)),
                ..settings(Duration::ZERO)
            };
            let sql = "SELECT k, count(*) AS n, sum(n) AS total FROM t GROUP BY k";
            let unbroken = rt.block_on(streamed_with(sql, &chunks, usize::MAX, &settings));
            let restarted = rt.block_on(streamed_with(sql, &chunks, restart_after, &settings));
            let emitted = |run: &StreamedRun| -> Vec<Vec<Vec<String>>> {
                run.outputs.iter().map(|b| displayed(b)).collect()
            };
            prop_assert_eq!(emitted(&restarted), emitted(&unbroken));
            prop_assert_eq!(restarted.state_rows, unbroken.state_rows);
        }
    }

    #[tokio::test]
    async fn a_running_aggregate_forgets_a_key_state_ttl_after_its_newest_event() {
        // Key 0 speaks at 0 s and 10 s, key 1 from 0 s to 200 s; a 60 s TTL.
        let mut events: Vec<Event> = vec![(BASE, 0, 1), (BASE + 10 * SECOND, 0, 2)];
        events.extend((0..=20).map(|i| (BASE + i * 10 * SECOND, 1, i)));
        events.sort();
        let chunks: Vec<Vec<Event>> = events.chunks(4).map(<[Event]>::to_vec).collect();
        let settings = QuerySettings {
            output_mode: OutputMode::Update,
            state_ttl: Some(Duration::from_secs(60)),
            ..settings(Duration::ZERO)
        };
        let sql = "SELECT k, count(*) AS n FROM t GROUP BY k";
        let run = streamed_with(sql, &chunks, 99, &settings).await;
        // Two keys while key 0 is fresh; once the watermark is 60 s past 00:00:10, one.
        assert_eq!(run.state_rows.first(), Some(&2));
        assert_eq!(run.state_rows.last(), Some(&1));
        // Every batch emitted key 1 (it changed); key 0 only while it had events.
        let emitted: Vec<Vec<Vec<String>>> = run.outputs.iter().map(|b| displayed(b)).collect();
        assert!(
            emitted[..emitted.len() - 1]
                .iter()
                .all(|rows| rows.iter().any(|r| r[0] == "k1"))
        );
        assert_eq!(
            emitted.iter().flatten().filter(|r| r[0] == "k0").count(),
            1,
            "{emitted:?}"
        );
        let refused = StreamingQuery::plan(
            sql,
            &[("t".to_string(), schema())],
            &QuerySettings {
                state_ttl: None,
                ..settings.clone()
            },
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(refused.contains("unless state_ttl is set"), "{refused}");
    }

    /// A restart after any batch leaves a running aggregate with `state_ttl` where it was: a
    /// key that expired and came back counts from its return (its rows from before, still in
    /// an older state file, stay gone), and an old event merged into a live key stays counted
    /// (its partial row is older than the TTL allows, the key it joined is not).
    #[tokio::test]
    async fn a_restart_anywhere_keeps_a_running_aggregate_with_state_ttl_as_it_was() {
        let at = |seconds: i64, key: u8| (BASE + seconds * SECOND, key, 1);
        // A 60 s TTL; the watermark trails the newest event by 20 s.
        let chunks: Vec<Vec<Event>> = vec![
            vec![at(0, 0), at(0, 1)],
            vec![at(100, 1)], // watermark 80 s: k0 (newest 0 s) expires
            vec![at(110, 0)], // k0 is back: 1
            vec![at(125, 1)],
            vec![at(50, 1), at(130, 0), at(200, 2)], // watermark 180 s: k1 lives on (125 s)
            vec![at(190, 0), at(190, 1)],
        ];
        let settings = QuerySettings {
            output_mode: OutputMode::Update,
            state_ttl: Some(Duration::from_secs(60)),
            ..settings(Duration::ZERO)
        };
        let sql = "SELECT k, count(*) AS n FROM t GROUP BY k";
        let unbroken = streamed_with(sql, &chunks, usize::MAX, &settings).await;
        let counts = |run: &StreamedRun| -> Vec<Vec<Vec<String>>> {
            run.outputs.iter().map(|b| displayed(b)).collect()
        };
        let k = |key: &str, n: &str| vec![key.to_string(), n.to_string()];
        assert_eq!(
            counts(&unbroken),
            [
                vec![k("k0", "1"), k("k1", "1")],
                vec![k("k1", "2")],
                vec![k("k0", "1")],
                vec![k("k1", "3")],
                vec![k("k0", "2"), k("k1", "4"), k("k2", "1")],
                vec![k("k0", "3"), k("k1", "5")],
                vec![],
            ]
        );
        for restart_after in 0..chunks.len() {
            let run = streamed_with(sql, &chunks, restart_after, &settings).await;
            assert_eq!(
                counts(&run),
                counts(&unbroken),
                "restarted after batch {restart_after}"
            );
            assert_eq!(run.state_rows, unbroken.state_rows);
        }
    }

    #[tokio::test]
    async fn late_rows_are_left_out_of_closed_windows_and_counted() {
        let sql = &queries()[1].0;
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

    /// A restart restores state only into the operator that wrote it: another window size or
    /// aggregate is refused; a filter, the lateness or a renamed alias is not a change.
    #[tokio::test]
    async fn a_restore_refuses_state_written_by_other_windows_or_aggregates() {
        let sources = [("t".to_string(), schema())];
        let sql = |window: &str, agg: &str, filter: &str| {
            format!(
                "SELECT window_start, k, {agg}(v) AS x FROM tumble(t, ts, INTERVAL '{window}') \
                 {filter} GROUP BY window_start, window_end, k"
            )
        };
        let plan = |sql: String, lateness: u64| {
            let sources = sources.clone();
            async move {
                StreamingQuery::plan(sql, &sources, &settings(Duration::from_secs(lateness)))
                    .await
                    .unwrap()
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let mut first = plan(sql("1 minute", "sum", ""), 0).await;
        first
            .restore_state(StateLog::new(&checkpoint, 0), None, None)
            .await
            .unwrap();
        let step = BatchWatermark {
            before: None,
            after: Some(BASE),
        };
        let inputs = BTreeMap::from([("t".to_string(), batch(&[(BASE, 1, 7)]))]);
        first.execute_isolating(&inputs, step).await.unwrap();
        let (operators, _) = first.write_state(BatchId(0)).await.unwrap();
        let manifest = BatchManifest {
            operators: Some(operators),
            ..BatchManifest::default()
        };
        let restore = |sql: String, lateness: u64| {
            let (manifest, checkpoint) = (&manifest, &checkpoint);
            async move {
                let mut query = plan(sql, lateness).await;
                query
                    .restore_state(StateLog::new(checkpoint, 1), Some(manifest), None)
                    .await
                    .map(|()| query.state_size().unwrap().rows)
            }
        };
        // What does not change the state's meaning restores it: a filter, the lateness.
        assert_eq!(restore(sql("1 minute", "sum", ""), 0).await.unwrap(), 1);
        assert_eq!(
            restore(sql("1 minute", "sum", "WHERE v > 0"), 30)
                .await
                .unwrap(),
            1
        );
        // An alias is no change either.
        let aliased = "SELECT c.window_start, c.k, sum(c.v) AS x FROM tumble(t, ts, \
                       INTERVAL '1 minute') AS c GROUP BY c.window_start, c.window_end, c.k";
        assert_eq!(restore(aliased.into(), 0).await.unwrap(), 1);
        // Another window size or aggregate (the same state types) is refused, naming both.
        for (other, planned) in [
            (sql("2 minutes", "sum", ""), "tumble(2m, t.ts)"),
            (sql("1 minute", "max", ""), "max(v)"),
        ] {
            let err = restore(other, 0).await.unwrap_err();
            assert!(matches!(err, Error::StateOfAnotherQuery { .. }), "{err}");
            let text = err.to_string();
            assert!(text.contains("operator 0-aggregate"), "{text}");
            assert!(text.contains("tumble(1m, t.ts)"), "{text}");
            assert!(text.contains(planned), "{text}");
        }
        // A stateless query over the checkpoint: the operator is gone.
        let err = restore("SELECT k FROM t".into(), 0).await.unwrap_err();
        assert!(err.to_string().contains("no such operator"), "{err}");
    }

    /// `sluice validate`'s view of the operator: its state key, purge rule and emissions, for a
    /// windowed aggregate in append mode and a running aggregate in update mode.
    #[tokio::test]
    async fn the_operator_describes_its_state_key_and_purge_rule() {
        let sources = [("t".to_string(), schema())];
        let windowed = StreamingQuery::plan(
            "SELECT window_start, k, count(*) AS c FROM hop(t, ts, INTERVAL '10' SECOND, \
             INTERVAL '1' MINUTE) GROUP BY window_start, window_end, k",
            &sources,
            &settings(Duration::from_secs(30)),
        )
        .await
        .unwrap();
        let [op] = windowed.operators().try_into().unwrap();
        assert_eq!(op.id, "0-aggregate");
        assert_eq!(
            op.what,
            "windowed aggregate over hop(1m every 10s, t.ts), by 10s panes"
        );
        assert_eq!(op.state_key, ["window_start", "window_end", "k"]);
        assert_eq!(
            op.purge,
            "a window leaves when the watermark reaches its end + allowed lateness (30s)"
        );
        assert_eq!(op.emits, "each window once, when it closes");

        let running = StreamingQuery::plan(
            "SELECT k, sum(n) AS total FROM t GROUP BY k",
            &sources,
            &QuerySettings {
                output_mode: OutputMode::Update,
                state_ttl: Some(Duration::from_secs(3600)),
                ..settings(Duration::ZERO)
            },
        )
        .await
        .unwrap();
        let [op] = running.operators().try_into().unwrap();
        assert_eq!(op.what, "running aggregate over t");
        assert_eq!(op.state_key, ["k"]);
        assert_eq!(
            op.purge,
            "a group leaves when the watermark is state_ttl (1h) past its newest event"
        );
        assert_eq!(op.emits, "every group a batch changed (upserted)");

        let sessions = StreamingQuery::plan(
            "SELECT window_start, k, count(*) AS c FROM session(t, ts, INTERVAL '10' SECOND) \
             GROUP BY window_start, window_end, k",
            &sources,
            &settings(Duration::ZERO),
        )
        .await
        .unwrap();
        let [op] = sessions.operators().try_into().unwrap();
        assert_eq!(op.what, "windowed aggregate over session(gap 10s, t.ts)");
        assert_eq!(
            op.purge,
            "a window leaves when the watermark reaches its end (its last event + the gap) + \
             allowed lateness (0s)"
        );

        let upserted = StreamingQuery::plan(
            "SELECT window_start, window_end, k, count(*) AS c FROM tumble(t, ts, INTERVAL '1' MINUTE) \
             GROUP BY window_start, window_end, k",
            &sources,
            &QuerySettings {
                output_mode: OutputMode::Update,
                ..settings(Duration::ZERO)
            },
        )
        .await
        .unwrap();
        let [op] = upserted.operators().try_into().unwrap();
        assert_eq!(
            op.emits,
            "every window and group a batch changed (upserted)"
        );

        let stateless =
            StreamingQuery::plan("SELECT k FROM t", &sources, &settings(Duration::ZERO))
                .await
                .unwrap();
        assert!(stateless.operators().is_empty());
    }

    /// Runs `sql` over `events` as one batch whose watermark closes every window before the
    /// last event's; returns the output rows and the failed rows' positions and errors.
    async fn one_batch(sql: &str, events: &[Event]) -> (Vec<Vec<String>>, Vec<(String, String)>) {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let mut query = StreamingQuery::plan(
            sql,
            &[("t".to_string(), schema())],
            &settings(Duration::ZERO),
        )
        .await
        .unwrap();
        query
            .restore_state(StateLog::new(&checkpoint, 0), None, None)
            .await
            .unwrap();
        let after = events.iter().map(|e| e.0 - OUT_OF_ORDERNESS).max();
        let step = BatchWatermark {
            before: None,
            after,
        };
        let inputs = BTreeMap::from([("t".to_string(), batch(events))]);
        let out = query.execute_isolating(&inputs, step).await.unwrap();
        let failed = out
            .failed
            .iter()
            .map(|f| {
                let letter = crate::dead_letter::dead_letter_from_row(&f.row, &f.error).unwrap();
                (letter.position, letter.error)
            })
            .collect();
        (displayed(&out.batches), failed)
    }

    /// A division by zero in the SELECT over the aggregate fails only the groups it happens
    /// in: they are dead letters with the reason, every other group is emitted — also when the
    /// failing part is an outer aggregate over whole windows.
    #[tokio::test]
    async fn a_group_whose_output_fails_is_a_dead_letter_and_the_rest_is_emitted() {
        let events: Vec<Event> = vec![
            (BASE + SECOND, 0, 1),
            (BASE + 2 * SECOND, 0, 2),
            (BASE + 3 * SECOND, 1, 3),
            (BASE + 61 * SECOND, 0, 4),
            (BASE + 62 * SECOND, 1, 5),
            (BASE + 63 * SECOND, 1, 6),
            (BASE + 200 * SECOND, 2, 7),
        ];
        let per_key = "SELECT window_start, k, sum(n) / (count(*) - 1) AS per \
             FROM tumble(t, ts, INTERVAL '1' MINUTE) GROUP BY window_start, window_end, k";
        let (rows, failed) = one_batch(per_key, &events).await;
        let kept: Vec<(String, String, String)> = rows
            .iter()
            .map(|r| (r[0].clone(), r[1].clone(), r[2].clone()))
            .collect();
        assert_eq!(
            kept,
            vec![
                ("2024-05-01T00:00:00Z".into(), "k0".into(), "3".into()),
                ("2024-05-01T00:01:00Z".into(), "k1".into(), "11".into()),
            ]
        );
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(
            failed[0].0.contains("k1") && failed[1].0.contains("k0"),
            "{failed:?}"
        );
        assert!(failed[0].1.contains("Divide by zero"), "{failed:?}");

        // An outer aggregate over each window: the window with one key fails as a whole.
        let outer = "SELECT window_start, sum(c) / (count(*) - 1) AS x FROM \
             (SELECT window_start, k, count(*) AS c FROM tumble(t, ts, INTERVAL '1' MINUTE) \
             GROUP BY window_start, k) GROUP BY window_start";
        let mut events = events;
        events.retain(|e| !(e.0 < BASE + 60 * SECOND && e.1 == 1));
        let (rows, failed) = one_batch(outer, &events).await;
        assert_eq!(
            rows,
            vec![vec!["2024-05-01T00:01:00Z".to_string(), "3".into()]]
        );
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].0.contains("00:00:00"), "{failed:?}");
    }

    #[tokio::test]
    async fn queries_the_engine_cannot_stream_are_refused_by_name() {
        let sources = [("t".to_string(), schema())];
        for (sql, wanted) in [
            (
                "SELECT k, count(*) FROM t GROUP BY k",
                "needs mode = \"update\"",
            ),
            (
                "SELECT window_start, count(*) FROM tumble(t, ts, INTERVAL '1' MINUTE) \
                 GROUP BY window_start ORDER BY window_start LIMIT 3",
                "would cut each batch's groups",
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
                "over different windows",
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
        let e = StreamingQuery::plan(&queries()[1].0, &sources, &no_event_time)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no event_time"), "{e}");
    }
}
