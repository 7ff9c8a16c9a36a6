//! The job's query, planned once and executed once per batch with DataFusion.
//!
//! A query is SQL text or a DataFusion `DataFrame` built in Rust ([`Query`]); either way it
//! becomes one logical plan over the sources' tables, with the job's own functions
//! ([`Functions`]) registered beside DataFusion's, and everything below sees only that plan.
//!
//! Each source is registered as an in-memory table loaded with a batch's rows for its run and
//! emptied once the plan has run, so the logical plan is built (and validated) once and a
//! batch's input is not held while the next is read. Execution is vectorised and
//! parallel: a batch's rows are split across DataFusion's target partitions.
//!
//! A query is either **stateless** (expressions, WHERE, UNION ALL, UNNEST, joins with static
//! tables: each batch's output depends on its rows only) or **stateful**: one operator whose
//! state is carried between batches — an aggregate over a `tumble`/`hop`/`session` window or a
//! running aggregate in update mode (see [`crate::operators::aggregate`]), or a deduplication
//! (see [`crate::operators::deduplicate`]).
//!
//! A query-time error caused by some rows (a failing `CAST`) must not stall the job. Stateless
//! output is row-local and partial aggregate states merge, so [`StreamingQuery::execute_isolating`]
//! splits the input in halves until the failing rows are found; they become dead letters and the
//! rest proceeds. An error that occurs with no input at all is not about data and stops the job.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::catalog::MemTable;
use datafusion::common::alias::AliasGenerator;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::logical_expr::{AggregateUDF, LogicalPlan, ScalarUDF, WindowUDF};
use datafusion::prelude::{DataFrame, SessionConfig, SessionContext};
use futures::future::BoxFuture;

use crate::checkpoint::{BatchManifest, OperatorCheckpoint};
use crate::error::{Error, Result};
use crate::offsets::BatchId;
use crate::operators::aggregate::{StateSize, StatefulAggregate, StatefulSettings};
use crate::operators::aggregate_state::AggregateState;
use crate::operators::deduplicate::Deduplication;
use crate::operators::is_data_error;
use crate::operators::join::StreamJoin;
use crate::operators::state_store::StateLog;
use crate::operators::window_join::WindowJoin;
pub use crate::operators::{FailedRow, QueryOutput};
use crate::operators::{
    JOINED_TABLE, JoinAggregate, StatefulOperator, carry_columns, plan_operator,
};
use crate::sink::{OutputMode, OutputTables};
use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};

/// How the query is planned, besides its SQL and source schemas.
#[derive(Debug, Clone, Default)]
pub struct QuerySettings {
    /// Stateless queries: the output carries the lineage columns `_source_partition` and
    /// `_source_offset` even when the SELECT list does not name them.
    pub lineage: bool,
    /// Windowed queries: how long after its end a window still accepts rows.
    pub allowed_lateness: Duration,
    /// Each source's event-time column (sources without event time are absent).
    pub event_time: BTreeMap<String, String>,
    /// Append rows, or upsert them on a key.
    pub output_mode: OutputMode,
    /// Update mode: the upsert key (default: the aggregate's group columns).
    pub key: Option<Vec<String>>,
    /// Running aggregates: how long a group outlives its newest event.
    pub state_ttl: Option<Duration>,
    /// Functions the query may call besides DataFusion's own.
    pub functions: Functions,
    /// Static tables the query joins whole, by name, with their schemas (their rows are loaded
    /// per version with [`StreamingQuery::load_table`]).
    pub static_tables: BTreeMap<String, SchemaRef>,
}

/// What a job computes: SQL over its sources, or a plan built with DataFusion's DataFrame API.
///
/// Both are planned once, against the same session: every source is a table named after it,
/// the window table functions (`tumble`, `hop`, `session`) and the job's [`Functions`] are
/// registered. The live run, a backfill and a reconcile plan the same query the same way.
#[derive(Clone)]
pub enum Query {
    /// SQL text.
    Sql(String),
    /// A function that builds the plan from the session (`ctx.table("clicks").await?…`); it is
    /// called again when the query is planned again (a source's schema grew, a backfill, a
    /// reconcile), so it must build the same plan from the same tables.
    DataFrame(BuildDataFrame),
}

/// Builds a query's plan from the session its sources are registered in (see [`Query`]).
pub type BuildDataFrame = Arc<
    dyn Fn(SessionContext) -> BoxFuture<'static, datafusion::error::Result<DataFrame>>
        + Send
        + Sync,
>;

impl Query {
    /// A query built with DataFusion's DataFrame API by `build`, which gets the session with the
    /// sources registered as tables.
    pub fn data_frame<F, Fut>(build: F) -> Self
    where
        F: Fn(SessionContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = datafusion::error::Result<DataFrame>> + Send + 'static,
    {
        Query::DataFrame(Arc::new(move |ctx| Box::pin(build(ctx))))
    }

    /// The SQL text, if the query is SQL.
    pub fn sql(&self) -> Option<&str> {
        match self {
            Query::Sql(sql) => Some(sql),
            Query::DataFrame(_) => None,
        }
    }

    /// Whether there is nothing to run: empty SQL.
    pub fn is_empty(&self) -> bool {
        self.sql().is_some_and(|sql| sql.trim().is_empty())
    }

    /// The query's logical plan in `ctx`, where the sources and functions are registered.
    async fn logical_plan(&self, ctx: &SessionContext) -> Result<LogicalPlan> {
        Ok(match self {
            Query::Sql(sql) => ctx.state().create_logical_plan(sql).await?,
            Query::DataFrame(build) => build(ctx.clone()).await?.into_unoptimized_plan(),
        })
    }
}

impl fmt::Debug for Query {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Query {
    /// The SQL, or `<DataFrame built in Rust>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Query::Sql(sql) => f.write_str(sql),
            Query::DataFrame(_) => f.write_str("<DataFrame built in Rust>"),
        }
    }
}

impl From<&str> for Query {
    fn from(sql: &str) -> Self {
        Query::Sql(sql.to_string())
    }
}

impl From<&String> for Query {
    fn from(sql: &String) -> Self {
        Query::Sql(sql.clone())
    }
}

impl From<String> for Query {
    fn from(sql: String) -> Self {
        Query::Sql(sql)
    }
}

/// Functions a job's query may call besides DataFusion's own, registered wherever the query is
/// planned (run, backfill, reconcile).
///
/// An aggregate function in a stateful query keeps its partial state between batches like a
/// built-in one: the state is its accumulator's `state()` columns, written to the state files
/// and merged with `merge_batch`, so it must be mergeable (as DataFusion's two-phase
/// aggregation already requires) and restores after a crash.
#[derive(Debug, Clone, Default)]
pub struct Functions {
    /// Scalar functions (`ScalarUDF`).
    pub scalar: Vec<ScalarUDF>,
    /// Aggregate functions (`AggregateUDF`).
    pub aggregate: Vec<AggregateUDF>,
    /// Window functions (`WindowUDF`, `… OVER (…)`): usable where the query may have a window
    /// function, over the rows a windowed aggregate emits.
    pub window: Vec<WindowUDF>,
}

impl Functions {
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.scalar.is_empty() && self.aggregate.is_empty() && self.window.is_empty()
    }

    /// Every function's name, for messages.
    pub fn names(&self) -> Vec<String> {
        let scalar = self.scalar.iter().map(|f| f.name().to_string());
        let aggregate = self.aggregate.iter().map(|f| f.name().to_string());
        let window = self.window.iter().map(|f| f.name().to_string());
        scalar.chain(aggregate).chain(window).collect()
    }

    /// Adds `other`'s functions (a function of the same name replaces the earlier one when
    /// registered).
    pub fn extend(&mut self, other: &Functions) {
        self.scalar.extend(other.scalar.iter().cloned());
        self.aggregate.extend(other.aggregate.iter().cloned());
        self.window.extend(other.window.iter().cloned());
    }

    pub(crate) fn register(&self, ctx: &SessionContext) {
        for f in &self.scalar {
            ctx.register_udf(f.clone());
        }
        for f in &self.aggregate {
            ctx.register_udaf(f.clone());
        }
        for f in &self.window {
            ctx.register_udwf(f.clone());
        }
    }
}

/// The watermark a batch runs under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchWatermark {
    /// The watermark in force when the batch's rows arrive: rows of windows it has closed are
    /// late.
    pub before: Option<i64>,
    /// The watermark after the batch: windows it closes are emitted. `Some(i64::MAX)` flushes
    /// every window (the end of a bounded run).
    pub after: Option<i64>,
}

/// The job's query, planned against the source schemas.
pub struct StreamingQuery {
    tables: SourceTables,
    plan: LogicalPlan,
    stateful: Option<StatefulOperator>,
    /// Update mode: the columns output rows are upserted on.
    merge_key: Option<Vec<String>>,
    /// The whole schemas of the sources the query was planned over only some columns of
    /// ([`StreamingQuery::with_whole_sources`]).
    whole_sources: BTreeMap<String, SchemaRef>,
}

/// The session and the in-memory tables the sources' rows are loaded into.
struct SourceTables {
    ctx: SessionContext,
    tables: BTreeMap<String, (SchemaRef, Arc<MemTable>)>,
    /// Static tables by name, with the version whose rows they hold.
    statics: BTreeMap<String, (Arc<MemTable>, Option<String>)>,
    partitions: usize,
}

impl std::fmt::Debug for StreamingQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingQuery")
            .field("plan", &self.plan.display_indent().to_string())
            .field("stateful", &self.stateful)
            .finish()
    }
}

impl StreamingQuery {
    /// Plans `query` (SQL text or a [`Query`]) over tables named after the sources, with the
    /// given batch schemas.
    ///
    /// # Errors
    /// If the SQL does not parse or plan (unknown table or column, type error), or needs state
    /// the engine cannot carry across batches (joins, ORDER BY, LIMIT, DISTINCT, aggregates
    /// without a window), naming the part at fault.
    pub async fn plan(
        query: impl Into<Query>,
        sources: &[(String, SchemaRef)],
        settings: &QuerySettings,
    ) -> Result<Self> {
        let config = SessionConfig::new().with_information_schema(false);
        let partitions = config.target_partitions().max(1);
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .build();
        // This rule rewrites `count(DISTINCT x)` into two stacked aggregates; the window
        // aggregate must stay one aggregate for its partial states to be carried.
        let rules = state
            .optimizers()
            .iter()
            .filter(|r| r.name() != "single_distinct_aggregation_to_group_by")
            .cloned()
            .collect();
        let state = SessionStateBuilder::new_from_existing(state)
            .with_optimizer_rules(rules)
            .build();
        let ctx = SessionContext::new_with_state(state);
        settings.functions.register(&ctx);
        let mut tables = BTreeMap::new();
        for (name, schema) in sources {
            let empty = (0..partitions).map(|_| Vec::new()).collect();
            let table = Arc::new(MemTable::try_new(Arc::clone(schema), empty)?);
            ctx.register_table(name.as_str(), Arc::clone(&table) as _)?;
            tables.insert(name.clone(), (Arc::clone(schema), table));
        }
        let mut statics = BTreeMap::new();
        for (name, schema) in &settings.static_tables {
            let table = Arc::new(MemTable::try_new(Arc::clone(schema), vec![Vec::new()])?);
            ctx.register_table(name.as_str(), Arc::clone(&table) as _)?;
            statics.insert(name.clone(), (table, None));
        }
        let providers = tables
            .iter()
            .map(|(name, (_, table))| (name.clone(), Arc::clone(table) as _))
            .collect();
        let uses = crate::window::register(&ctx, &providers);
        let plan = query.into().logical_plan(&ctx).await?;
        let uses = uses.lock().map(|u| u.clone()).unwrap_or_default();
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        // Table names as the catalog holds them (an unquoted name is lowercased).
        let static_names: BTreeSet<String> = settings
            .static_tables
            .keys()
            .map(|name| name.to_lowercase())
            .collect();
        if !crate::operators::reads_stream(&plan, &static_names) {
            return Err(Error::UnsupportedQuery(
                "the query reads no source: a streaming job's output comes from its sources' \
                 rows (tables are joined to them)"
                    .into(),
            ));
        }
        let stateful_settings = StatefulSettings {
            event_time: &settings.event_time,
            allowed_lateness: micros(settings.allowed_lateness),
            mode: settings.output_mode,
            state_ttl: settings.state_ttl.map(micros),
            statics: &static_names,
        };
        let stateful =
            plan_operator(&ctx, &plan, &uses, stateful_settings, settings.lineage).await?;
        // A chain's aggregate reads the join's output from a table filled like a source's.
        if let Some(StatefulOperator::JoinAggregate(chain)) = &stateful {
            tables.insert(JOINED_TABLE.to_string(), chain.joined_table());
        }
        // A join of streams runs the plan with its bounds (state_ttl's included): shown as such.
        let plan = match stateful.as_ref().and_then(StatefulOperator::join) {
            Some(join) => join.plan().clone(),
            None => plan,
        };
        let plan = if settings.lineage && stateful.is_none() {
            let plan = carry_columns(plan, &[SOURCE_PARTITION, SOURCE_OFFSET])?;
            let schema = plan.schema();
            for col in [SOURCE_PARTITION, SOURCE_OFFSET] {
                if !schema.fields().iter().any(|f| f.name() == col) {
                    return Err(Error::UnsupportedQuery(format!(
                        "lineage is on, but the query's output cannot carry the column {col}; \
                         set lineage = false in [sink] to write without lineage"
                    )));
                }
            }
            plan
        } else {
            plan
        };
        let merge_key = match settings.output_mode {
            OutputMode::Append => None,
            OutputMode::Update => Some(merge_key(
                &plan,
                stateful.as_ref().and_then(StatefulOperator::aggregate),
                settings,
            )?),
        };
        let keyed_by_ttl = match &stateful {
            Some(StatefulOperator::Aggregate(a)) => a.window().is_none(),
            Some(StatefulOperator::Deduplication(_)) => true,
            // Planning refused state_ttl where neither side needs it.
            Some(StatefulOperator::Join(_) | StatefulOperator::JoinAggregate(_)) => true,
            Some(StatefulOperator::WindowJoin(_)) | None => false,
        };
        if settings.state_ttl.is_some() && !keyed_by_ttl {
            return Err(Error::InvalidJob(
                "state_ttl bounds the state of running aggregates (GROUP BY without a window), \
                 of deduplication and of joins of two streams; this query has none — windows leave the state when \
                 the watermark closes them"
                    .into(),
            ));
        }
        let query = StreamingQuery {
            tables: SourceTables {
                ctx,
                tables,
                statics,
                partitions,
            },
            plan,
            stateful,
            merge_key,
            whole_sources: BTreeMap::new(),
        };
        // The late table of a join of streams holds both sources' columns: refused now if
        // they cannot share it, not at the first late row.
        if let Some(sources) = query.joined_sources() {
            query.late_schema_of_streams(&sources)?;
        }
        Ok(query)
    }

    /// The tables the job writes: output (with its upsert key in update mode) and, for a
    /// windowed query, the late table.
    pub fn output_tables(&self) -> OutputTables {
        OutputTables {
            output: self.output_schema(),
            late: self.late_schema(),
            merge_key: self.merge_key.clone(),
        }
    }

    /// The schema of the rows the query produces.
    pub fn output_schema(&self) -> SchemaRef {
        match self.stateful.as_ref() {
            // The upper part's: it carries the kept rows' lineage.
            Some(StatefulOperator::Deduplication(dedup)) => dedup.output_schema(),
            Some(StatefulOperator::Join(join)) => join.output_schema(),
            _ => Arc::new(self.plan.schema().as_arrow().clone()),
        }
    }

    /// The version of static table `name` whose rows the query holds, if any.
    pub fn table_version(&self, name: &str) -> Option<&str> {
        self.tables.statics.get(name)?.1.as_deref()
    }

    /// Makes `rows` (static table `name` at `version`) what the query joins from now on.
    ///
    /// # Errors
    /// If the query has no static table `name`.
    pub async fn load_table(
        &mut self,
        name: &str,
        version: &str,
        rows: Vec<RecordBatch>,
    ) -> Result<()> {
        let (table, loaded) =
            self.tables.statics.get_mut(name).ok_or_else(|| {
                Error::InvalidJob(format!("the query has no static table '{name}'"))
            })?;
        *table.batches[0].write().await = rows;
        *loaded = Some(version.to_string());
        Ok(())
    }

    /// The plan each batch runs over the sources' rows, as DataFusion optimizes it (projection
    /// pushdown included), for a stateless query or an aggregate (its state holds partial
    /// results, not rows); `None` for deduplication and joins, whose state keeps source rows.
    ///
    /// `state` optimizes it (and fixes the time `now()` stands for).
    fn optimized_batch_plan(&self, state: &SessionState) -> Result<Option<LogicalPlan>> {
        let plan = match &self.stateful {
            None => self.plan.clone(),
            // A watermark adds a filter on the window column.
            Some(StatefulOperator::Aggregate(a)) => a.partial_plan(Some(0))?,
            Some(_) => return Ok(None),
        };
        Ok(Some(state.optimize(&plan)?))
    }

    /// The columns of each source the query reads: what the scans of
    /// `optimized_batch_plan` keep. `None` where that is `None`, or for a
    /// plan that scans anything but sources and tables. A source the query does not scan is
    /// absent. Lineage and event-time columns are the caller's to add.
    ///
    /// # Errors
    /// If the plan does not optimize.
    pub fn columns_read(&self) -> Result<Option<BTreeMap<String, BTreeSet<String>>>> {
        let Some(optimized) = self.optimized_batch_plan(&self.tables.ctx.state())? else {
            return Ok(None);
        };
        let mut read: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut other_scan = false;
        optimized.apply_with_subqueries(|node| {
            let LogicalPlan::TableScan(scan) = node else {
                return Ok(TreeNodeRecursion::Continue);
            };
            let scanned = scan.table_name.table();
            let named = |name: &String| name.eq_ignore_ascii_case(scanned);
            let Some(source) = self.tables.tables.keys().find(|name| named(name)) else {
                other_scan |= !self.tables.statics.keys().any(named);
                return Ok(TreeNodeRecursion::Continue);
            };
            let schema = scan.source.schema();
            let columns = read.entry(source.clone()).or_default();
            match &scan.projection {
                Some(indices) => {
                    columns.extend(indices.iter().map(|&i| schema.field(i).name().clone()));
                }
                None => columns.extend(schema.fields().iter().map(|f| f.name().clone())),
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        Ok((!other_scan).then_some(read))
    }

    /// Whether `self` runs the same plan each batch as `other` does, node for node and column
    /// for column (both `optimized_batch_plan`s, as text, optimized by one
    /// session state so that `now()` is the same instant in both).
    ///
    /// # Errors
    /// If a plan does not optimize.
    pub fn runs_as(&self, other: &StreamingQuery) -> Result<bool> {
        let state = self.tables.ctx.state();
        let text = |q: &StreamingQuery| -> Result<Option<String>> {
            // Each optimization names the subexpressions it takes out from 1 again.
            let mut state = state.clone();
            state.execution_props_mut().alias_generator = Arc::new(AliasGenerator::new());
            Ok(q.optimized_batch_plan(&state)?
                .map(|p| p.display_indent_schema().to_string()))
        };
        Ok(text(self)?.is_some_and(|a| Some(a) == text(other).ok().flatten()))
    }

    /// Makes the late table hold `schemas`' columns (the sources' whole schemas) where the
    /// query was planned over only some of a source's columns: late rows are whole records.
    pub(crate) fn with_whole_sources(mut self, schemas: BTreeMap<String, SchemaRef>) -> Self {
        self.whole_sources = schemas;
        self
    }

    /// Whether the query carries state between batches (an aggregate).
    pub fn is_stateful(&self) -> bool {
        self.stateful.is_some()
    }

    /// Whether the query's stateful operator is a deduplication.
    pub fn deduplicates(&self) -> bool {
        self.stateful
            .as_ref()
            .is_some_and(|s| s.deduplication().is_some())
    }

    /// Whether the query joins two streams (alone, or feeding an aggregate).
    pub fn joins_streams(&self) -> bool {
        self.stateful
            .as_ref()
            .is_some_and(|s| s.stream_join().is_some())
    }

    /// Whether the query joins two streams and aggregates the join's output.
    pub fn aggregates_a_join(&self) -> bool {
        matches!(self.stateful, Some(StatefulOperator::JoinAggregate(_)))
    }

    /// Whether the query joins two windowed aggregates on their windows.
    pub fn joins_windows(&self) -> bool {
        self.stateful
            .as_ref()
            .is_some_and(|s| s.window_join().is_some())
    }

    /// The sources a join (of streams, or of windows) reads, which share the late table.
    fn joined_sources(&self) -> Option<Vec<&str>> {
        let stateful = self.stateful.as_ref()?;
        if let Some(w) = stateful.window_join() {
            return Some(w.sources());
        }
        let mut sources: Vec<&str> = Vec::new();
        for (source, _) in stateful.stream_join()?.sources() {
            if !sources.contains(&source) {
                sources.push(source);
            }
        }
        Some(sources)
    }

    /// Rows the last batch left out as duplicates (0 unless the query deduplicates).
    pub fn rows_duplicate(&self) -> u64 {
        self.stateful
            .as_ref()
            .and_then(StatefulOperator::deduplication)
            .map_or(0, Deduplication::duplicates)
    }

    /// The query's stateful operators in chain order (empty for a stateless query).
    pub fn operators(&self) -> Vec<crate::operators::OperatorDescription> {
        self.stateful
            .iter()
            .flat_map(StatefulOperator::describe)
            .collect()
    }

    /// The optimised logical plan, for `sluice validate`.
    pub fn display_plan(&self) -> Result<String> {
        let optimized = self.tables.ctx.state().optimize(&self.plan)?;
        Ok(optimized.display_indent_schema().to_string())
    }

    /// The late table's schema, for a windowed or deduplicating query (its source's columns)
    /// or a join of streams (both sources' columns and `_source`), plus the late columns (see
    /// [`crate::late`]).
    pub fn late_schema(&self) -> Option<SchemaRef> {
        if let Some(sources) = self.joined_sources() {
            return self.late_schema_of_streams(&sources).ok();
        }
        let source = self.late_source()?;
        let schema = match self.whole_sources.get(source) {
            Some(whole) => whole,
            None => &self.tables.tables.get(source)?.0,
        };
        Some(self.late_schema_of(schema))
    }

    /// The source whose late rows the late table holds: a windowed aggregate's or a
    /// deduplication's (`None`: no row of this query can be late, or a join's two sources
    /// share the late table: see [`StreamingQuery::late_schema`]).
    pub fn late_source(&self) -> Option<&str> {
        match self.stateful.as_ref()? {
            StatefulOperator::Aggregate(a) => a.window().map(|(w, _)| w.source.as_str()),
            StatefulOperator::Deduplication(d) => Some(d.source().0),
            StatefulOperator::Join(_)
            | StatefulOperator::WindowJoin(_)
            | StatefulOperator::JoinAggregate(_) => None,
        }
    }

    /// The late table of a join: its `sources`' columns and [`crate::late::SOURCE`].
    fn late_schema_of_streams(&self, sources: &[&str]) -> Result<SchemaRef> {
        let schemas: Vec<(&str, &SchemaRef)> = sources
            .iter()
            .filter_map(|s| Some((*s, &self.tables.tables.get(*s)?.0)))
            .collect();
        crate::late::late_schema_of_sources(&schemas)
    }

    /// The late table's schema for rows of the late source with columns `source`.
    pub fn late_schema_of(&self, source: &SchemaRef) -> SchemaRef {
        crate::late::late_schema(source, self.window().is_some())
    }

    /// The rows of `source` that are late under `watermark` — they missed a window closed
    /// under it, or a deduplication can no longer judge them — as late-table rows (`None` for
    /// a stateless query, another source, or no late row).
    ///
    /// # Errors
    /// If the rows lack the event-time column.
    pub fn late_rows(
        &self,
        source: &str,
        rows: &RecordBatch,
        watermark: Option<i64>,
        batch_id: BatchId,
    ) -> Result<Option<RecordBatch>> {
        match self.stateful.as_ref() {
            Some(StatefulOperator::Aggregate(a)) => match a.window() {
                Some((window, lateness)) if window.source == source => {
                    lateness.late_rows(rows, &window.time_column, watermark, batch_id)
                }
                _ => Ok(None),
            },
            Some(StatefulOperator::Deduplication(d)) if d.source().0 == source => {
                crate::late::expired_rows(rows, d.source().1, watermark, d.ttl(), batch_id)
            }
            Some(stateful @ (StatefulOperator::Join(_) | StatefulOperator::JoinAggregate(_))) => {
                let Some(j) = stateful.stream_join() else {
                    return Ok(None);
                };
                let (Some(watermark), Some(limit)) = (watermark, j.on_time_limit(watermark)) else {
                    return Ok(None);
                };
                let Some((_, time_column)) = j.sources().into_iter().find(|(s, _)| *s == source)
                else {
                    return Ok(None);
                };
                let schema =
                    self.late_schema_of_streams(&self.joined_sources().unwrap_or_default())?;
                crate::late::below_watermark(
                    rows,
                    source,
                    time_column,
                    (limit, watermark),
                    batch_id,
                    &schema,
                )
            }
            Some(StatefulOperator::WindowJoin(w)) => {
                let Some((window, lateness)) = w.window_of(source) else {
                    return Ok(None);
                };
                let Some(late) =
                    lateness.late_rows(rows, &window.time_column, watermark, batch_id)?
                else {
                    return Ok(None);
                };
                let schema = self.late_schema_of_streams(&w.sources())?;
                crate::late::of_source(&late, source, &schema).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Restores each stateful operator's state from the last committed manifest (`None`: the
    /// job's first batch), after checking that this query plans the same operators with the
    /// same fingerprints ([`OperatorCheckpoint`]). A manifest written before operators were
    /// recorded lists the one aggregate's files, restored unchecked.
    ///
    /// # Errors
    /// [`Error::StateOfAnotherQuery`] if the state was written by other operators; an error if
    /// a listed file is missing or unreadable.
    pub async fn restore_state(
        &mut self,
        log: StateLog,
        manifest: Option<&BatchManifest>,
        watermark: Option<i64>,
    ) -> Result<()> {
        let files = match manifest {
            None => BTreeMap::new(),
            Some(m) => self.recorded_state_files(m, &log.location())?,
        };
        match self.stateful.as_mut() {
            Some(stateful) => stateful.restore(log, &files, watermark).await,
            None => Ok(()),
        }
    }

    /// Writes this batch's state files and returns each operator's live state for the manifest
    /// (empty for a stateless query), with the bytes written.
    ///
    /// # Errors
    /// If a file cannot be written.
    pub async fn write_state(
        &mut self,
        batch_id: BatchId,
    ) -> Result<(BTreeMap<String, OperatorCheckpoint>, u64)> {
        let mut operators = BTreeMap::new();
        let mut bytes_written = 0;
        if let Some(stateful) = self.stateful.as_mut() {
            let written = stateful.write_state(batch_id).await?;
            let fingerprints: BTreeMap<String, String> =
                stateful.fingerprints().into_iter().collect();
            for (id, write) in written {
                bytes_written += write.bytes_written;
                let fingerprint = fingerprints.get(&id).cloned().unwrap_or_default();
                operators.insert(
                    id,
                    OperatorCheckpoint {
                        fingerprint,
                        files: write.live_files,
                    },
                );
            }
        }
        Ok((operators, bytes_written))
    }

    /// Takes the state `manifest` lists as the live state: the manifest another attempt at
    /// this batch wrote first (same intent, so the same state), checked as on restore.
    ///
    /// # Errors
    /// [`Error::StateOfAnotherQuery`], or a listed file is missing.
    pub async fn adopt_state(&mut self, manifest: &BatchManifest) -> Result<()> {
        let location = self
            .stateful
            .as_ref()
            .and_then(StatefulOperator::state_location)
            .unwrap_or_default();
        let files = self.recorded_state_files(manifest, &location)?;
        match self.stateful.as_mut() {
            Some(stateful) => {
                stateful
                    .adopt_state(&files, manifest.watermark_micros)
                    .await
            }
            None => Ok(()),
        }
    }

    /// The state files `manifest` records for this query's operators, refusing state written
    /// by other operators (another fingerprint, an operator added or removed). `checkpoint`
    /// names the state folder in the error.
    fn recorded_state_files(
        &self,
        manifest: &BatchManifest,
        checkpoint: &str,
    ) -> Result<BTreeMap<String, Vec<String>>> {
        let planned: BTreeMap<String, String> = self
            .stateful
            .iter()
            .flat_map(StatefulOperator::fingerprints)
            .collect();
        let Some(recorded) = &manifest.operators else {
            // The one aggregate's files, from before operators were recorded.
            if planned.len() > 1 {
                return Err(Error::StateOfAnotherQuery {
                    operator: planned.keys().cloned().collect::<Vec<_>>().join(", "),
                    checkpoint: checkpoint.to_string(),
                    recorded: "one aggregate's state (a manifest from before operators were \
                               recorded)"
                        .into(),
                    planned: format!("{} operators", planned.len()),
                });
            }
            return Ok(planned
                .keys()
                .take(1)
                .map(|id| (id.clone(), manifest.state_files.clone()))
                .collect());
        };
        let mismatch = |operator: &str, recorded: String, planned: String| {
            Err(Error::StateOfAnotherQuery {
                operator: operator.to_string(),
                checkpoint: checkpoint.to_string(),
                recorded,
                planned,
            })
        };
        for (id, state) in recorded {
            match planned.get(id) {
                Some(fingerprint) if same_state(&state.fingerprint, fingerprint) => {}
                Some(fingerprint) => {
                    return mismatch(
                        id,
                        format!("`{}`", state.fingerprint),
                        format!("`{fingerprint}`"),
                    );
                }
                None => {
                    return mismatch(
                        id,
                        format!("`{}`", state.fingerprint),
                        "no such operator".into(),
                    );
                }
            }
        }
        if let Some((id, fingerprint)) = planned.iter().find(|(id, _)| !recorded.contains_key(*id))
        {
            return mismatch(
                id,
                "a query without it (it would miss every row read before)".into(),
                format!("`{fingerprint}`"),
            );
        }
        Ok(recorded
            .iter()
            .map(|(id, state)| (id.clone(), state.files.clone()))
            .collect())
    }

    /// Deletes state files of batches up to `committed` that are no longer live.
    ///
    /// # Errors
    /// If listing or deleting fails.
    pub async fn collect_state_garbage(&self, committed: BatchId) -> Result<usize> {
        match &self.stateful {
            Some(stateful) => stateful.collect_garbage(committed).await,
            None => Ok(0),
        }
    }

    /// State rows and bytes after the last batch (`None` for a stateless query).
    pub fn state_size(&self) -> Option<StateSize> {
        self.stateful.as_ref().map(StatefulOperator::state_size)
    }

    /// The join of two streams the query runs, if it runs one.
    #[cfg(test)]
    pub(crate) fn stream_join(&self) -> Option<&crate::operators::join::StreamJoin> {
        self.stateful
            .as_ref()
            .and_then(StatefulOperator::stream_join)
    }

    /// The rows a join of streams keeps (both sides'), to check what they hold.
    #[cfg(test)]
    pub(crate) fn join_rows(&self) -> Vec<RecordBatch> {
        self.stateful
            .as_ref()
            .and_then(StatefulOperator::stream_join)
            .map(|join| join.kept_rows())
            .unwrap_or_default()
    }

    /// [`StreamingQuery::execute_read`] of a join of two streams, calling `before_side` with a
    /// side's source before its plan runs: to see what the join holds by then.
    #[cfg(test)]
    pub(crate) async fn join_observed(
        &mut self,
        inputs: SourceInputs,
        watermark: BatchWatermark,
        before_side: impl Fn(&str),
    ) -> Result<QueryOutput> {
        let Some(StatefulOperator::Join(join)) = self.stateful.as_mut() else {
            return Err(Error::InvalidJob("not a join of two streams".into()));
        };
        let tables = &self.tables;
        join.run(&tables.ctx, watermark, inputs, |plan, rows| {
            for source in rows.keys() {
                before_side(source);
            }
            async move { tables.isolate(&plan, &rows, Run::Collect).await }
        })
        .await
    }

    /// Runs the query over one batch of input per source (stateless queries).
    ///
    /// # Errors
    /// Any DataFusion error; see [`StreamingQuery::execute_isolating`] for the caller that keeps
    /// going past bad rows.
    pub async fn execute(
        &self,
        inputs: &BTreeMap<String, RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        self.tables
            .run(&self.plan, &one_batch_each(inputs), Run::Collect)
            .await
    }

    /// Runs one batch: a stateless query over the rows; a stateful one merges the rows of open
    /// windows (under `watermark.before`) into its state and emits what its output mode says
    /// under `watermark.after` (see [`crate::operators::aggregate`]). Rows on which the query fails are found by splitting the
    /// input, returned as failed, and the rest proceeds.
    ///
    /// # Errors
    /// If the query fails even with no input (not a data problem), or a windowed query's state
    /// or upper part fails.
    pub async fn execute_isolating(
        &mut self,
        inputs: &BTreeMap<String, RecordBatch>,
        watermark: BatchWatermark,
    ) -> Result<QueryOutput> {
        self.execute_read(one_batch_each(inputs), watermark).await
    }

    /// [`StreamingQuery::execute_isolating`] over each source's rows as its read produced them
    /// (several batches, in order): the live loop's input, never copied into one batch. The
    /// rows are taken, so that a join of two streams lets go of the columns its sides do not
    /// use once their plans have run, rather than hold the whole read through the join.
    ///
    /// # Errors
    /// As [`StreamingQuery::execute_isolating`].
    pub async fn execute_read(
        &mut self,
        inputs: SourceInputs,
        watermark: BatchWatermark,
    ) -> Result<QueryOutput> {
        let stateful = match self.stateful.as_mut() {
            None => return self.tables.isolate(&self.plan, &inputs, Run::Collect).await,
            Some(StatefulOperator::Deduplication(dedup)) => {
                return deduplicate(&self.tables, dedup, &inputs, watermark.before).await;
            }
            Some(StatefulOperator::Join(join)) => {
                return join_streams(&self.tables, join, inputs, watermark).await;
            }
            Some(StatefulOperator::JoinAggregate(chain)) => {
                let failed = join_then_aggregate(&self.tables, chain, inputs, watermark).await?;
                let mut out = chain.emit(&self.tables.ctx, watermark.after).await?;
                out.failed.splice(0..0, failed);
                return Ok(out);
            }
            Some(StatefulOperator::WindowJoin(join)) => {
                let failed =
                    accumulate_windows(&self.tables, join, &inputs, watermark.before).await?;
                let mut out = join.emit(&self.tables.ctx, watermark.after).await?;
                out.failed.splice(0..0, failed);
                return Ok(out);
            }
            Some(StatefulOperator::Aggregate(stateful)) => stateful,
        };
        let plan = stateful.partial_plan(watermark.before)?;
        let partials = self
            .tables
            .isolate(&plan, &inputs, Run::Partial(stateful.operator()))
            .await?;
        stateful
            .accumulate(partials.batches, watermark.before)
            .await?;
        let mut emitted = stateful.emit(&self.tables.ctx, watermark.after).await?;
        emitted.failed.splice(0..0, partials.failed);
        Ok(emitted)
    }
}

/// One batch of a deduplicating query: the lower part over the rows in source order (rows late
/// under `watermark` left out), then the operator, which runs the upper part over the first
/// rows it keeps.
async fn deduplicate(
    tables: &SourceTables,
    dedup: &mut Deduplication,
    inputs: &SourceInputs,
    watermark: Option<i64>,
) -> Result<QueryOutput> {
    let plan = dedup.lower_plan(watermark)?;
    let rows = tables.isolate(&plan, inputs, Run::InOrder).await?;
    let mut out = dedup
        .deduplicate(&tables.ctx, rows.batches, watermark)
        .await?;
    out.failed.splice(0..0, rows.failed);
    Ok(out)
}

/// One batch of a join feeding an aggregate: the join (see [`join_streams`]), then its output,
/// timed with the watermark it was emitted under, merged into the aggregate (rows it fails on
/// isolated). Returns the dead letters; the caller emits the aggregate's groups.
async fn join_then_aggregate(
    tables: &SourceTables,
    chain: &mut JoinAggregate,
    inputs: SourceInputs,
    watermark: BatchWatermark,
) -> Result<Vec<FailedRow>> {
    let joined = join_streams(tables, &mut chain.join, inputs, watermark).await?;
    let rows = chain.joined_rows(joined.batches, watermark.after)?;
    let input = BTreeMap::from([(JOINED_TABLE.to_string(), rows)]);
    let plan = chain.aggregate.partial_plan(watermark.before)?;
    let partials = tables
        .isolate(&plan, &input, Run::Partial(chain.aggregate.operator()))
        .await?;
    chain
        .aggregate
        .accumulate(partials.batches, watermark.before)
        .await?;
    let mut failed = joined.failed;
    for row in partials.failed {
        failed.push(chain.named_failure(row)?);
    }
    Ok(failed)
}

/// Merges a batch's rows into both aggregates of a window join: each side's aggregate over the
/// rows of its windows still open under `watermark`, rows it fails on isolated (returned).
async fn accumulate_windows(
    tables: &SourceTables,
    join: &mut WindowJoin,
    inputs: &SourceInputs,
    watermark: Option<i64>,
) -> Result<Vec<FailedRow>> {
    // In a self-join a row both sides fail on is one dead letter.
    let self_join = join.sources().len() == 1;
    let mut failed: Vec<FailedRow> = Vec::new();
    for (i, side) in join.sides_mut().into_iter().enumerate() {
        let plan = side.partial_plan(watermark)?;
        let partials = tables
            .isolate(&plan, inputs, Run::Partial(side.operator()))
            .await?;
        side.accumulate(partials.batches, watermark).await?;
        if i == 0 || !self_join {
            failed.extend(partials.failed);
            continue;
        }
        // Each of the left side's failed rows stands for at most one of the right side's.
        let mut taken = vec![false; failed.len()];
        for row in partials.failed {
            match (0..taken.len()).find(|&j| !taken[j] && failed[j].row == row.row) {
                Some(j) => taken[j] = true,
                None => failed.push(row),
            }
        }
    }
    Ok(failed)
}

/// One batch of a query joining two streams: each side's plan over its source's rows (late
/// rows under the watermark in force left out, rows it fails on isolated), then the join,
/// which runs the upper part over the pairs and lets go of what the new watermark says. The
/// read is let go once the sides' plans have run: the join holds only the columns they keep.
async fn join_streams(
    tables: &SourceTables,
    join: &mut StreamJoin,
    inputs: SourceInputs,
    watermark: BatchWatermark,
) -> Result<QueryOutput> {
    join.run(&tables.ctx, watermark, inputs, |plan, rows| async move {
        tables.isolate(&plan, &rows, Run::Collect).await
    })
    .await
}

impl StreamingQuery {
    /// One part of a bounded run: its rows under the watermark in force then (rows of windows
    /// it had closed left out; `None`: every row counts), so a long read can be fed chunk by
    /// chunk, and reconcile replays late rows under the watermark they met: a stateless query returns the part's rows; a stateful one merges
    /// the part into its state and returns only the rows that failed.
    ///
    /// # Errors
    /// As [`StreamingQuery::execute_isolating`].
    pub(crate) async fn feed_bounded(
        &mut self,
        inputs: &BTreeMap<String, RecordBatch>,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        let inputs = &one_batch_each(inputs);
        let stateful = match self.stateful.as_mut() {
            None => return self.tables.isolate(&self.plan, inputs, Run::Collect).await,
            Some(StatefulOperator::Deduplication(dedup)) => {
                return deduplicate(&self.tables, dedup, inputs, watermark).await;
            }
            Some(StatefulOperator::Join(join)) => {
                let watermark = BatchWatermark {
                    before: watermark,
                    after: watermark,
                };
                return join_streams(&self.tables, join, inputs.clone(), watermark).await;
            }
            Some(StatefulOperator::JoinAggregate(chain)) => {
                let watermark = BatchWatermark {
                    before: watermark,
                    after: watermark,
                };
                let failed =
                    join_then_aggregate(&self.tables, chain, inputs.clone(), watermark).await?;
                return Ok(QueryOutput {
                    batches: Vec::new(),
                    failed,
                });
            }
            Some(StatefulOperator::WindowJoin(join)) => {
                let failed = accumulate_windows(&self.tables, join, inputs, watermark).await?;
                return Ok(QueryOutput {
                    batches: Vec::new(),
                    failed,
                });
            }
            Some(StatefulOperator::Aggregate(stateful)) => stateful,
        };
        let plan = stateful.partial_plan(watermark)?;
        let part = self
            .tables
            .isolate(&plan, inputs, Run::Partial(stateful.operator()))
            .await?;
        stateful.accumulate(part.batches, watermark).await?;
        Ok(QueryOutput {
            batches: Vec::new(),
            failed: part.failed,
        })
    }

    /// The end of a bounded run: a stateful query finishes every window it holds.
    ///
    /// # Errors
    /// As [`StreamingQuery::execute_isolating`].
    pub(crate) async fn finish_bounded(&mut self) -> Result<QueryOutput> {
        match self.stateful.as_mut() {
            Some(StatefulOperator::Aggregate(stateful)) => {
                stateful.emit_all(&self.tables.ctx).await
            }
            Some(StatefulOperator::WindowJoin(join)) => join.emit_all(&self.tables.ctx).await,
            Some(StatefulOperator::JoinAggregate(chain)) => chain.emit_all(&self.tables.ctx).await,
            Some(StatefulOperator::Deduplication(_) | StatefulOperator::Join(_)) | None => {
                Ok(QueryOutput::default())
            }
        }
    }

    /// Output columns computed from an approximate aggregate whose result depends on how rows
    /// were split into batches (`approx_percentile_cont`, `approx_median`): reconcile compares
    /// them within [`crate::reconcile::APPROX_TOLERANCE`].
    pub(crate) fn approximate_columns(&self) -> std::collections::BTreeSet<String> {
        let mut approximate = std::collections::BTreeSet::new();
        let _ = self.plan.apply(|node| {
            if let LogicalPlan::Aggregate(agg) = node {
                for (e, field) in agg
                    .aggr_expr
                    .iter()
                    .zip(agg.schema.fields().iter().skip(agg.group_expr.len()))
                {
                    let text = e.to_string();
                    if text.contains("approx_percentile") || text.contains("approx_median") {
                        approximate.insert(field.name().clone());
                    }
                }
            }
            Ok(TreeNodeRecursion::Continue)
        });
        // Carried to the output by name, or under an alias.
        if let LogicalPlan::Projection(p) = &self.plan {
            for (e, field) in p.expr.iter().zip(p.schema.fields().iter()) {
                if e.column_refs()
                    .iter()
                    .any(|c| approximate.contains(&c.name))
                {
                    approximate.insert(field.name().clone());
                }
            }
        }
        approximate
    }

    /// The window a windowed query aggregates over, and when its windows close.
    pub(crate) fn window(&self) -> Option<(&crate::window::WindowUse, crate::late::Lateness)> {
        match self.stateful.as_ref()? {
            StatefulOperator::WindowJoin(join) => join.sides()[0].window(),
            other => other.aggregate()?.window(),
        }
    }

    /// The sources whose rows a windowed query aggregates, each with its window and lateness:
    /// one, or a window join's two (one if both sides read the same source).
    pub(crate) fn windowed_sources(
        &self,
    ) -> Vec<(&crate::window::WindowUse, crate::late::Lateness)> {
        match self.stateful.as_ref() {
            Some(StatefulOperator::WindowJoin(join)) => join
                .sources()
                .into_iter()
                .filter_map(|s| join.window_of(s))
                .collect(),
            _ => self.window().into_iter().collect(),
        }
    }
}

/// How [`SourceTables::run`] runs a plan.
#[derive(Clone, Copy)]
enum Run<'a> {
    /// The rows split across partitions, the output collected in any order.
    Collect,
    /// The rows in one partition, the output in their order (deduplication keeps the first
    /// row to arrive).
    InOrder,
    /// Only the first phase of the plan's aggregate, giving partial states.
    Partial(&'a AggregateState),
}

impl SourceTables {
    /// Loads `inputs` into the source tables and runs `plan` as `how` says.
    async fn run(
        &self,
        plan: &LogicalPlan,
        inputs: &SourceInputs,
        how: Run<'_>,
    ) -> Result<Vec<RecordBatch>> {
        let partitions = match how {
            Run::InOrder => 1,
            Run::Collect | Run::Partial(_) => self.partitions,
        };
        for (name, (_, table)) in &self.tables {
            let rows = inputs.get(name).map_or(&[][..], Vec::as_slice);
            let total = total_rows(rows);
            let share = total.div_ceil(partitions);
            for (i, slot) in table.batches.iter().enumerate() {
                let mut slot = slot.write().await;
                slot.clear();
                // Partition i holds rows [i × share, (i + 1) × share): contiguous, in order.
                let offset = i * share;
                if offset < total {
                    slot.extend(slice_rows(rows, offset, share.min(total - offset)));
                }
            }
        }
        let batches = self.execute(plan, how).await;
        // The tables let go of the rows now, not when the next batch replaces them: held
        // until then, one batch's input stayed in memory while the next was read.
        for (_, table) in self.tables.values() {
            for slot in &table.batches {
                slot.write().await.clear();
            }
        }
        Ok(batches?.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// Runs `plan` over the rows the tables hold, as `how` says.
    async fn execute(&self, plan: &LogicalPlan, how: Run<'_>) -> Result<Vec<RecordBatch>> {
        Ok(match how {
            Run::Collect => {
                let df = self.ctx.execute_logical_plan(plan.clone()).await?;
                df.collect().await?
            }
            Run::InOrder => {
                // Output partitions in order, each in its rows' order: only the first holds
                // rows, and no operator of a stateless plan reorders within a partition.
                let df = self.ctx.execute_logical_plan(plan.clone()).await?;
                df.collect_partitioned()
                    .await?
                    .into_iter()
                    .flatten()
                    .collect()
            }
            Run::Partial(operator) => {
                let physical = self.ctx.state().create_physical_plan(plan).await?;
                operator.partial_of(&physical).await?
            }
        })
    }

    /// Runs `plan`; if it fails on the rows' values, finds the failing rows by splitting the
    /// input and runs the rest. Valid because the results of parts combine: stateless rows are
    /// row-local, partial states merge. Any other error (resources, I/O, a bug) fails the
    /// batch: isolating rows on it would let a rerun differ from the first run.
    async fn isolate(
        &self,
        plan: &LogicalPlan,
        inputs: &SourceInputs,
        how: Run<'_>,
    ) -> Result<QueryOutput> {
        match self.run(plan, inputs, how).await {
            Ok(batches) => {
                return Ok(QueryOutput {
                    batches,
                    failed: vec![],
                });
            }
            Err(e) if !is_data_error(&e) => return Err(e),
            Err(e) => {
                if let Err(empty_error) = self.run(plan, &BTreeMap::new(), how).await {
                    return Err(Error::UnsupportedQuery(format!(
                        "the query fails even without input rows: {empty_error} (first seen as: {e})"
                    )));
                }
            }
        }
        // Run each source alone and bisect the failing ranges.
        let mut out = QueryOutput::default();
        for (name, rows) in inputs {
            let mut pending = vec![(0usize, total_rows(rows))];
            while let Some((offset, len)) = pending.pop() {
                if len == 0 {
                    continue;
                }
                let part = BTreeMap::from([(name.clone(), slice_rows(rows, offset, len))]);
                match self.run(plan, &part, how).await {
                    Ok(batches) => out.batches.extend(batches),
                    Err(e) if !is_data_error(&e) => return Err(e),
                    Err(e) if len == 1 => out.failed.push(FailedRow {
                        source: name.clone(),
                        row: row_copy(rows, offset)?,
                        error: e.to_string(),
                    }),
                    Err(_) => {
                        let half = len / 2;
                        pending.push((offset + half, len - half));
                        pending.push((offset, half));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Whether an operator's recorded fingerprint and the one this query plans describe the same
/// state: equal, or equal but for text or bytes held as views on one side (`Utf8View`,
/// `BinaryView`) and plain on the other. Declared text columns were `Utf8View` before they
/// became `Utf8` (`schema::parse_schema`); state so written is restored in the current layout
/// (`StateLog::restore`), so a job keeps its state across that change.
/// Only the type names are read so, not the same words inside quoted text (a literal).
fn same_state(recorded: &str, planned: &str) -> bool {
    recorded == planned || views_as_plain(recorded) == views_as_plain(planned)
}

/// `fingerprint` with the words `Utf8View` and `BinaryView` outside quotes (`'…'`, `"…"`) as
/// `Utf8` and `Binary`.
fn views_as_plain(fingerprint: &str) -> String {
    let mut out = String::with_capacity(fingerprint.len());
    let mut quote: Option<char> = None;
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(match word.as_str() {
            "Utf8View" => "Utf8",
            "BinaryView" => "Binary",
            w => w,
        });
        word.clear();
    };
    for c in fingerprint.chars() {
        match quote {
            Some(q) => {
                out.push(c);
                if c == q {
                    quote = None;
                }
            }
            None if c.is_alphanumeric() || c == '_' => word.push(c),
            None => {
                flush(&mut word, &mut out);
                if c == '\'' || c == '"' {
                    quote = Some(c);
                }
                out.push(c);
            }
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Each source's rows for one run of the query, by source name: the batches its read
/// produced, in order. The live loop never copies a source's rows into one batch: that copy
/// was a pass over the whole input on one thread, and its memory came on top of the read's.
pub type SourceInputs = BTreeMap<String, Vec<RecordBatch>>;

/// `inputs` (one batch per source) as [`SourceInputs`].
fn one_batch_each(inputs: &BTreeMap<String, RecordBatch>) -> SourceInputs {
    inputs
        .iter()
        .map(|(name, rows)| (name.clone(), vec![rows.clone()]))
        .collect()
}

/// Row `offset` of `batches` taken as one sequence, copied into a batch of its own: a failed
/// row held as a slice would hold its whole chunk of the read (every column) until the batch's
/// dead letters are written — through a join, after the read is let go.
fn row_copy(batches: &[RecordBatch], offset: usize) -> Result<RecordBatch> {
    let row = slice_rows(batches, offset, 1)
        .pop()
        .ok_or_else(|| Error::InvalidJob(format!("no row {offset} in the read")))?;
    Ok(arrow::compute::take_record_batch(
        &row,
        &arrow::array::UInt32Array::from(vec![0u32]),
    )?)
}

/// The rows of `batches`.
fn total_rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// Rows `[offset, offset + len)` of `batches` taken as one sequence: zero-copy slices of the
/// batches they fall in, in order.
fn slice_rows(batches: &[RecordBatch], mut offset: usize, mut len: usize) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    for batch in batches {
        if len == 0 {
            break;
        }
        let n = batch.num_rows();
        if offset >= n {
            offset -= n;
            continue;
        }
        let take = len.min(n - offset);
        out.push(batch.slice(offset, take));
        len -= take;
        offset = 0;
    }
    out
}

/// Update mode's upsert key: the configured `key`, else the aggregate's group columns; every key
/// column must be in the output.
fn merge_key(
    plan: &LogicalPlan,
    stateful: Option<&StatefulAggregate>,
    settings: &QuerySettings,
) -> Result<Vec<String>> {
    let key = match (&settings.key, stateful) {
        (Some(key), _) => key.clone(),
        (None, Some(s)) => s.group_columns().to_vec(),
        (None, None) => {
            return Err(Error::InvalidJob(
                "mode = \"update\" upserts rows on a key: set key = [\"…\"] in [sink] to the \
                 columns that identify a row"
                    .into(),
            ));
        }
    };
    let schema = plan.schema();
    for k in &key {
        if !schema.fields().iter().any(|f| f.name() == k) {
            return Err(Error::InvalidJob(format!(
                "update mode upserts on {}, but the query's output has no column '{k}' (its \
                 columns: {}); select it, or set key = [\"…\"] in [sink]",
                key.join(", "),
                schema
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    if key.is_empty() {
        return Err(Error::InvalidJob(
            "update mode needs a key; set key = [\"…\"] in [sink]".into(),
        ));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::error::DataFusionError;

    fn lineage() -> QuerySettings {
        QuerySettings {
            lineage: true,
            ..QuerySettings::default()
        }
    }

    #[test]
    fn state_held_as_views_is_the_same_state_held_plain() {
        let old = "aggregate over tumble(1m, clicks.ts) by [window_start, window_end, user_id] \
                   of [count(Int64(1))]; state types [Timestamp(µs, \"UTC\"), Utf8View, \
                   List(BinaryView), Int64]";
        let new = "aggregate over tumble(1m, clicks.ts) by [window_start, window_end, user_id] \
                   of [count(Int64(1))]; state types [Timestamp(µs, \"UTC\"), Utf8, \
                   List(Binary), Int64]";
        assert!(same_state(old, new));
        assert!(same_state(new, new));
        // Any other difference is another state.
        assert!(!same_state(old, &new.replace("Int64]", "Float64]")));
        assert!(!same_state(old, &new.replace("tumble(1m", "tumble(2m")));
        // The word inside a literal is the literal's text, not a type.
        let filter = |kind: &str| format!("join of l (l.k Utf8View; WHERE l.kind = '{kind}')");
        assert!(same_state(
            &filter("a"),
            &filter("a").replace("Utf8View", "Utf8")
        ));
        assert!(!same_state(&filter("Utf8View"), &filter("Utf8")));
        assert!(!same_state("k \"Utf8View\"", "k \"Utf8\""));
        assert!(!same_state("Utf8ViewX", "Utf8X"));
    }

    /// What a query reads of each source: the columns its scans keep after projection
    /// pushdown (a window's time column among them), for stateless queries and aggregates only.
    #[tokio::test]
    async fn columns_read_are_what_the_scans_keep() {
        let ts = DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into()));
        let schema = Arc::new(Schema::new(vec![
            Field::new("auction", DataType::Int64, false),
            Field::new("price", DataType::Int64, false),
            Field::new("url", DataType::Utf8, false),
            Field::new("ts", ts, false),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        let settings = QuerySettings {
            event_time: BTreeMap::from([("bid".to_string(), "ts".to_string())]),
            ..QuerySettings::default()
        };
        let read = async |sql: &str| {
            let query =
                StreamingQuery::plan(sql, &[("bid".into(), Arc::clone(&schema))], &settings)
                    .await
                    .unwrap();
            query.columns_read().unwrap().map(|r| {
                r.into_iter()
                    .map(|(source, columns)| (source, columns.into_iter().collect::<Vec<_>>()))
                    .collect::<Vec<_>>()
            })
        };
        let of = |columns: &[&str]| {
            Some(vec![(
                "bid".to_string(),
                columns.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            )])
        };
        assert_eq!(
            read("SELECT auction, price FROM bid WHERE auction % 3 = 0").await,
            of(&["auction", "price"])
        );
        assert_eq!(
            read(
                "SELECT auction, count(*) AS n, window_start FROM hop(bid, ts, INTERVAL '2' \
                 SECOND, INTERVAL '10' SECOND) GROUP BY auction, window_start, window_end"
            )
            .await,
            of(&["auction", "ts"])
        );
        assert_eq!(
            read("SELECT max(price) AS p FROM tumble(bid, ts, INTERVAL '1' MINUTE) GROUP BY window_start").await,
            of(&["price", "ts"])
        );
        let all = [
            "_source_offset",
            "_source_partition",
            "auction",
            "price",
            "ts",
            "url",
        ];
        assert_eq!(read("SELECT * FROM bid").await, of(&all));
        // The same query planned twice runs the same plan, whatever `now()` or the names of
        // subexpressions a window's columns share; another query does not.
        let plan = async |sql: &str| {
            StreamingQuery::plan(sql, &[("bid".into(), Arc::clone(&schema))], &settings)
                .await
                .unwrap()
        };
        for sql in [
            "SELECT auction FROM bid WHERE ts < now()",
            "SELECT max(price) AS p FROM tumble(bid, ts, INTERVAL '1' MINUTE) GROUP BY window_start",
            "SELECT auction, count(*) AS n FROM hop(bid, ts, INTERVAL '2' SECOND, \
             INTERVAL '10' SECOND) GROUP BY auction, window_start, window_end",
        ] {
            assert!(plan(sql).await.runs_as(&plan(sql).await).unwrap(), "{sql}");
        }
        let (a, b) = (
            plan("SELECT auction FROM bid").await,
            plan("SELECT price FROM bid").await,
        );
        assert!(!a.runs_as(&b).unwrap());
        // Deduplication keeps source rows in its state: no narrowing.
        let dedup = QuerySettings {
            state_ttl: Some(Duration::from_secs(3600)),
            ..settings.clone()
        };
        let query = StreamingQuery::plan(
            "SELECT DISTINCT auction, ts FROM bid",
            &[("bid".into(), Arc::clone(&schema))],
            &dedup,
        )
        .await
        .unwrap();
        assert_eq!(query.columns_read().unwrap(), None);
    }

    /// A source batch of `code` strings with lineage columns (partition "0", given offsets).
    fn code_batch(codes: Vec<String>, offsets: Vec<i64>) -> (SchemaRef, RecordBatch) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("code", DataType::Utf8, true),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        let n = codes.len();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(codes)),
                Arc::new(StringArray::from(vec!["0"; n])),
                Arc::new(Int64Array::from(offsets)),
            ],
        )
        .unwrap();
        (schema, batch)
    }

    fn source() -> (SchemaRef, RecordBatch) {
        let codes = ["1", "2", "x", "4", "y", "6"].map(String::from).to_vec();
        code_batch(codes, vec![0, 0, 1, 1, 2, 2])
    }

    /// A stream row joined with a static table: the table's rows are the loaded version's, a
    /// row failing on a value it joined is isolated like any other, and loading another
    /// version changes what the next run joins.
    #[tokio::test]
    async fn a_static_table_joins_at_the_loaded_version_and_failing_rows_are_isolated() {
        let (schema, batch) = code_batch(["1", "2", "3"].map(String::from).to_vec(), vec![0, 1, 2]);
        let table_schema = Arc::new(Schema::new(vec![
            Field::new("code", DataType::Utf8, false),
            Field::new("label", DataType::Utf8, false),
        ]));
        let version = |labels: [&str; 3]| {
            RecordBatch::try_new(
                Arc::clone(&table_schema),
                vec![
                    Arc::new(StringArray::from(vec!["1", "2", "3"])),
                    Arc::new(StringArray::from(labels.to_vec())),
                ],
            )
            .unwrap()
        };
        let settings = QuerySettings {
            static_tables: BTreeMap::from([("labels".to_string(), Arc::clone(&table_schema))]),
            ..lineage()
        };
        let mut query = StreamingQuery::plan(
            "SELECT t.code, CAST(l.label AS INT) AS n FROM t JOIN labels l ON t.code = l.code",
            &[("t".into(), schema)],
            &settings,
        )
        .await
        .unwrap();
        assert!(!query.is_stateful());
        let inputs = BTreeMap::from([("t".to_string(), batch)]);
        let mut run = async |version: &str, rows: RecordBatch| {
            query
                .load_table("labels", version, vec![rows])
                .await
                .unwrap();
            assert_eq!(query.table_version("labels"), Some(version));
            let out = query
                .execute_isolating(&inputs, BatchWatermark::default())
                .await
                .unwrap();
            let mut n: Vec<i64> = out
                .batches
                .iter()
                .flat_map(|b| {
                    let column = b.column_by_name("n").unwrap();
                    let cast = arrow::compute::cast(column, &DataType::Int64).unwrap();
                    cast.as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap()
                        .values()
                        .to_vec()
                })
                .collect();
            n.sort_unstable();
            (n, out.failed.len())
        };
        assert_eq!(
            run("0", version(["10", "x", "30"])).await,
            (vec![10, 30], 1)
        );
        assert_eq!(
            run("1", version(["11", "21", "31"])).await,
            (vec![11, 21, 31], 0)
        );
    }

    #[tokio::test]
    async fn failing_rows_are_isolated_and_the_rest_proceeds() {
        let (schema, batch) = source();
        let mut query = StreamingQuery::plan(
            "SELECT CAST(code AS INT) AS n FROM t",
            &[("t".into(), schema)],
            &lineage(),
        )
        .await
        .unwrap();
        let out_schema = query.output_schema();
        let names: Vec<&str> = out_schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, vec!["n", SOURCE_PARTITION, SOURCE_OFFSET]);
        let inputs = BTreeMap::from([("t".to_string(), batch)]);
        let out = query
            .execute_isolating(&inputs, BatchWatermark::default())
            .await
            .unwrap();
        let rows: usize = out.batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(rows, 4);
        let failed: Vec<String> = out
            .failed
            .iter()
            .map(|f| {
                f.row
                    .column(0)
                    .as_any()
                    .downcast_ref::<StringArray>()
                    .unwrap()
                    .value(0)
                    .to_string()
            })
            .collect();
        assert_eq!(failed, vec!["x", "y"]);
        assert!(
            out.failed[0].error.contains("Cannot cast"),
            "{}",
            out.failed[0].error
        );
    }

    fn rows_of(batches: &[RecordBatch]) -> Vec<String> {
        let mut rows = Vec::new();
        for b in batches {
            let formatted =
                arrow::util::pretty::pretty_format_batches(std::slice::from_ref(b)).unwrap();
            rows.extend(
                formatted
                    .to_string()
                    .lines()
                    .skip(3)
                    .filter(|l| !l.starts_with('+'))
                    .map(str::to_string),
            );
        }
        rows.sort();
        rows
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(32))]
        /// However the input is split into batches, the streamed output (the union of the
        /// batches' outputs) and the dead-lettered rows equal one run over all the input.
        #[test]
        fn any_batch_split_gives_the_batch_result(
            codes in proptest::collection::vec(prop_oneof![
                (0i32..1000).prop_map(|n| n.to_string()),
                "[a-z]{1,3}",
            ], 1..60),
            cuts in proptest::collection::vec(0usize..60, 0..6),
        ) {
            let n = codes.len();
            let (schema, all) = code_batch(codes, (0..n as i64).collect());
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let mut query = rt.block_on(StreamingQuery::plan(
                "SELECT CAST(code AS INT) * 2 AS doubled, upper(code) AS code FROM t WHERE length(code) < 4",
                &[("t".into(), schema)],
                &lineage(),
            )).unwrap();
            let mut run = |batch: RecordBatch| {
                let out = rt.block_on(query.execute_isolating(&BTreeMap::from([("t".to_string(), batch)]), BatchWatermark::default())).unwrap();
                let failed: Vec<i64> = out.failed.iter().map(|f| f.row.column(2).as_any().downcast_ref::<Int64Array>().unwrap().value(0)).collect();
                (out.batches, failed)
            };
            let (whole, mut whole_failed) = run(all.clone());
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(n)).chain([0, n]).collect();
            bounds.sort_unstable();
            bounds.dedup();
            let mut streamed = Vec::new();
            let mut streamed_failed = Vec::new();
            for w in bounds.windows(2) {
                let (out, failed) = run(all.slice(w[0], w[1] - w[0]));
                streamed.extend(out);
                streamed_failed.extend(failed);
            }
            whole_failed.sort_unstable();
            streamed_failed.sort_unstable();
            prop_assert_eq!(rows_of(&streamed), rows_of(&whole));
            prop_assert_eq!(streamed_failed, whole_failed);
        }
    }

    /// A test function: fails with a data error on "bad" and with a resource error on "boom".
    fn picky() -> ScalarUDF {
        use datafusion::logical_expr::{ColumnarValue, Volatility, create_udf};
        create_udf(
            "picky",
            vec![DataType::Utf8],
            DataType::Utf8,
            Volatility::Immutable,
            Arc::new(|args: &[ColumnarValue]| {
                let values = match &args[0] {
                    ColumnarValue::Array(a) => Arc::clone(a),
                    ColumnarValue::Scalar(s) => s.to_array()?,
                };
                let strings = values.as_any().downcast_ref::<StringArray>().unwrap();
                for v in strings.iter().flatten() {
                    match v {
                        "bad" => {
                            return Err(DataFusionError::Execution(format!("'{v}' is bad")));
                        }
                        "boom" => {
                            return Err(DataFusionError::ResourcesExhausted(
                                "out of memory".into(),
                            ));
                        }
                        _ => {}
                    }
                }
                Ok(ColumnarValue::Array(values))
            }),
        )
    }

    /// Only the rows' values may make a row a dead letter: a resource error met while
    /// isolating fails the batch instead of dead-lettering whatever row was being tried.
    /// The live loop's input — a source's rows as several batches (empty ones too) — gives
    /// what the same rows as one batch give: the same output rows, and failing rows isolated
    /// across the batches' boundaries as the same rows with the same errors.
    #[tokio::test]
    async fn rows_in_several_batches_run_as_the_same_rows_in_one() {
        let codes: Vec<String> = (0..40)
            .map(|i| match i % 7 {
                3 => format!("bad{i}"),
                _ => i.to_string(),
            })
            .collect();
        let (schema, batch) = code_batch(codes, (0..40).collect());
        let sources = [("t".to_string(), schema)];
        let settings = lineage();
        let plan =
            || StreamingQuery::plan("SELECT CAST(code AS INT) AS n FROM t", &sources, &settings);
        let offsets = |out: &QueryOutput| {
            let mut ok: Vec<i64> = out
                .batches
                .iter()
                .flat_map(|b| {
                    b.column_by_name(SOURCE_OFFSET)
                        .unwrap()
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .unwrap()
                        .values()
                        .to_vec()
                })
                .collect();
            ok.sort_unstable();
            let failed: Vec<(String, String)> = out
                .failed
                .iter()
                .map(|f| {
                    let code = f.row.column(0).as_any().downcast_ref::<StringArray>();
                    (code.unwrap().value(0).to_string(), f.error.clone())
                })
                .collect();
            (ok, failed)
        };
        let whole = plan()
            .await
            .unwrap()
            .execute_isolating(
                &BTreeMap::from([("t".to_string(), batch.clone())]),
                BatchWatermark::default(),
            )
            .await
            .unwrap();
        let (ok, failed) = offsets(&whole);
        assert_eq!(ok.len(), 34);
        assert_eq!(failed.len(), 6);
        for cuts in [
            vec![0, 1, 3, 3, 17, 39, 40],
            vec![0, 20, 40],
            vec![0, 1, 40],
        ] {
            let chunks: Vec<RecordBatch> = cuts
                .windows(2)
                .map(|w| batch.slice(w[0], w[1] - w[0]))
                .collect();
            let split = plan()
                .await
                .unwrap()
                .execute_read(
                    BTreeMap::from([("t".to_string(), chunks)]),
                    BatchWatermark::default(),
                )
                .await
                .unwrap();
            assert_eq!(
                offsets(&split),
                (ok.clone(), failed.clone()),
                "cut at {cuts:?}"
            );
        }
    }

    proptest::proptest! {
        /// Rows `[offset, offset + len)` of batches taken as one sequence are those rows of
        /// their concatenation, whatever the batches' sizes (empty ones included).
        #[test]
        fn slicing_batches_slices_their_concatenation(
            sizes in proptest::collection::vec(0usize..6, 0..6),
            offset in 0usize..30,
            len in 0usize..30,
        ) {
            let mut next = 0i64;
            let batches: Vec<RecordBatch> = sizes
                .iter()
                .map(|&n| {
                    let offsets: Vec<i64> = (next..next + n as i64).collect();
                    next += n as i64;
                    code_batch(vec![String::new(); n], offsets).1
                })
                .collect();
            let total = total_rows(&batches);
            let (offset, len) = (offset.min(total), len.min(total - offset.min(total)));
            let values = |batches: &[RecordBatch]| -> Vec<i64> {
                batches
                    .iter()
                    .flat_map(|b| b.column(2).as_any().downcast_ref::<Int64Array>().unwrap().values().to_vec())
                    .collect()
            };
            let sliced = slice_rows(&batches, offset, len);
            proptest::prop_assert!(sliced.iter().all(|b| b.num_rows() > 0));
            proptest::prop_assert_eq!(
                values(&sliced),
                (offset as i64..(offset + len) as i64).collect::<Vec<_>>()
            );
        }
    }

    #[tokio::test]
    async fn only_errors_about_the_values_isolate_rows() {
        let settings = QuerySettings {
            functions: Functions {
                scalar: vec![picky()],
                ..Functions::default()
            },
            ..lineage()
        };
        let codes = |c: &[&str]| {
            let n = c.len() as i64;
            code_batch(c.iter().map(|s| s.to_string()).collect(), (0..n).collect())
        };
        let (schema, batch) = codes(&["a", "bad", "c"]);
        let mut query = StreamingQuery::plan(
            "SELECT picky(code) AS p FROM t",
            &[("t".into(), schema)],
            &settings,
        )
        .await
        .unwrap();
        let run = |b: RecordBatch| BTreeMap::from([("t".to_string(), b)]);
        let out = query
            .execute_isolating(&run(batch), BatchWatermark::default())
            .await
            .unwrap();
        assert_eq!(out.failed.len(), 1);
        assert!(
            out.failed[0].error.contains("'bad' is bad"),
            "{}",
            out.failed[0].error
        );
        let (_, batch) = codes(&["a", "bad", "boom", "d"]);
        let err = query
            .execute_isolating(&run(batch), BatchWatermark::default())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("out of memory"), "{err}");
    }

    #[tokio::test]
    async fn stateful_queries_are_refused_with_a_reason() {
        let (schema, _) = source();
        let settings = QuerySettings::default();
        let sources = [("t".to_string(), schema)];
        let err = StreamingQuery::plan("SELECT count(*) FROM t", &sources, &settings)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs a window"), "{err}");
        let err = StreamingQuery::plan("SELECT * FROM t ORDER BY code", &sources, &settings)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs state across batches"), "{err}");
    }
}
