//! Deduplication: the first row of each key to arrive is emitted once; later rows of the key
//! are duplicates, and are not.
//!
//! Log delivery is at-least-once, and producers retry: the same event often arrives twice. Two
//! queries ask for the first row per key, and both are planned into this operator:
//!
//! ```sql
//! SELECT * FROM (
//!   SELECT *, ROW_NUMBER() OVER (PARTITION BY event_id ORDER BY ts) AS rn FROM clicks
//! ) WHERE rn = 1                      -- or rn <= 1; the key is the PARTITION BY expressions
//!
//! SELECT DISTINCT user_id, page FROM clicks   -- the key is every selected column
//! ```
//!
//! In a stream "first" means **first to arrive**: source order (partition, then offset, then
//! position within the offset, as the batch reads them), which a replay of the same offsets
//! repeats. That is not what the SQL means over a finished table (the smallest event time), so
//! reconcile replays the batches, and the docs say so. The query is split as the aggregate's is:
//!
//! ```text
//!  upper   Projection / Filter / join with a static table   runs over the rows emitted
//!  ──────────────────────────────────────────────────────────────────────────────────────
//!  dedup   key → first event time (the state)               emits a key's first row once
//!  ──────────────────────────────────────────────────────────────────────────────────────
//!  lower   the ROW_NUMBER's (or DISTINCT's) input, with the key, event time and lineage
//! ```
//!
//! **State and purge.** The state holds one row per key: its key values and the event time of
//! the row emitted for it. `state_ttl` is required — it is the deduplication horizon: a key is
//! remembered until the watermark reaches its first event time + `state_ttl`, and then leaves.
//! A row whose own event time + `state_ttl` is at or below the watermark in force is **late**
//! (a duplicate of anything its key could still be matched against has been forgotten): it goes
//! to the late table, never to the output. A row of a forgotten key with a fresher event time is
//! a new first row and is emitted. Each batch writes only its new keys (a state delta; see
//! [`super::state_store`]); a restart takes, per key, the newest first event time the files
//! hold (an older one was purged before the key came back) and drops what the restored
//! watermark has purged.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, TimestampMicrosecondArray, UInt32Array};
use arrow::datatypes::{Field, Schema, SchemaRef, TimestampMicrosecondType};
use arrow::row::{RowConverter, SortField};
use datafusion::catalog::MemTable;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, ScalarValue};
use datafusion::datasource::provider_as_source;
use datafusion::logical_expr::utils::split_conjunction;
use datafusion::logical_expr::{Distinct, Expr, LogicalPlan, LogicalPlanBuilder, lit};
use datafusion::prelude::SessionContext;

use super::aggregate::StateSize;
use super::state_store::{StateLog, StateWrite};
use super::{FailedRow, QueryOutput, is_data_error};
use crate::error::{Error, Result};
use crate::event_time::event_time_type;
use crate::offsets::BatchId;
use crate::sink::OutputMode;
use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION};

/// The table the upper part reads the emitted rows from.
const FIRST_ROWS_TABLE: &str = "__sluice_first_rows";
/// The lower part's key columns: `__sluice_key_0`, …
const KEY_PREFIX: &str = "__sluice_key_";
/// The lower part's event-time column.
const EVENT_TIME: &str = "__sluice_event_time";
/// The state's column: the event time of the row emitted for the key.
const FIRST_EVENT: &str = "__sluice_first_event";

/// Which SQL asked for deduplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `ROW_NUMBER() OVER (PARTITION BY k ORDER BY ts) = 1`.
    RowNumber,
    /// `SELECT DISTINCT`.
    Distinct,
}

/// The node of a plan that deduplicates: the `Window` holding the `ROW_NUMBER()` (a filter
/// above keeps its first row per key), or a `Distinct`.
#[derive(Debug, Clone)]
pub(crate) struct DedupNode {
    node: LogicalPlan,
    form: Form,
}

impl DedupNode {
    /// The plan node, as text, for messages.
    pub(crate) fn display(&self) -> String {
        match &self.node {
            LogicalPlan::Distinct(Distinct::All(input)) => {
                let columns: Vec<&str> = input
                    .schema()
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect();
                format!("SELECT DISTINCT {}", columns.join(", "))
            }
            node => node.display().to_string(),
        }
    }
}

/// The deduplicating nodes of `plan` whose input needs no state: a `ROW_NUMBER()` window kept
/// to its first row by a filter above it (`rn = 1`, `rn <= 1`, `rn < 2`, alone or ANDed with
/// other conditions), and `SELECT DISTINCT`.
pub(crate) fn find(plan: &LogicalPlan, statics: &BTreeSet<String>) -> Vec<DedupNode> {
    let mut found: Vec<DedupNode> = Vec::new();
    let stateless_stream = |input: &LogicalPlan| {
        super::reads_stream(input, statics) && super::stateful_node(input, statics).is_none()
    };
    let _ = plan.apply(|node| {
        match node {
            LogicalPlan::Filter(filter) => {
                for conjunct in split_conjunction(&filter.predicate) {
                    if let Some((name, 1)) = super::rank_bound(conjunct)
                        && let Some(window) =
                            super::ranking_window(&filter.input, &name, &["row_number"])
                        && let LogicalPlan::Window(w) = &window
                        && stateless_stream(&w.input)
                        && !found.iter().any(|f| f.node == window)
                    {
                        found.push(DedupNode {
                            node: window,
                            form: Form::RowNumber,
                        });
                    }
                }
            }
            LogicalPlan::Distinct(Distinct::All(input)) if stateless_stream(input) => {
                found.push(DedupNode {
                    node: node.clone(),
                    form: Form::Distinct,
                });
            }
            _ => {}
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// How [`plan_deduplication`] plans the operator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DedupSettings<'a> {
    /// Each source's event-time column.
    pub(crate) event_time: &'a std::collections::BTreeMap<String, String>,
    /// Append or update.
    pub(crate) mode: OutputMode,
    /// How long a key is remembered after its first event, µs.
    pub(crate) state_ttl: Option<i64>,
    /// The static tables (every other table is a stream).
    pub(crate) statics: &'a BTreeSet<String>,
    /// Whether the output carries the lineage columns.
    pub(crate) lineage: bool,
}

/// A query's deduplication, its state, and what runs above it.
pub(crate) struct Deduplication {
    form: Form,
    /// The source whose rows are deduplicated.
    source: String,
    /// Its event-time column.
    time_column: String,
    /// The key expressions as written (unqualified), for `validate` and the fingerprint.
    key_names: Vec<String>,
    ttl: i64,
    /// The rows to deduplicate, in source order: the node's input plus keys, event time and
    /// lineage.
    lower: LogicalPlan,
    /// How many leading columns of the lower part are the node's input columns.
    input_columns: usize,
    /// The lower part's key columns and event-time column.
    key_indices: Vec<usize>,
    time_index: usize,
    /// The lower part's lineage columns (for dead letters of rows the upper part fails on).
    lineage_indices: Vec<usize>,
    upper: LogicalPlan,
    first_rows: Arc<MemTable>,
    first_rows_schema: SchemaRef,
    converter: RowConverter,
    state_schema: SchemaRef,
    /// Each remembered key (Arrow row format) and the event time of its emitted row.
    seen: HashMap<Box<[u8]>, i64>,
    /// Keys by first event time, earliest on top: what the next purge removes. An entry whose
    /// time no longer matches `seen` (the key left and came back) is skipped.
    expiry: BinaryHeap<Reverse<(i64, Box<[u8]>)>>,
    /// This batch's new keys: the state delta to write.
    changes: Vec<RecordBatch>,
    /// Rows the last batch dropped as duplicates.
    duplicates: u64,
    log: Option<StateLog>,
}

impl std::fmt::Debug for Deduplication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deduplication")
            .field("source", &self.source)
            .field("keys", &self.key_names)
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// Plans the deduplication `found` in `plan`: the lower part below it, the upper part above it
/// (reading the emitted rows), and the keyed state.
///
/// # Errors
/// If the deduplication cannot run as a stream operator: no `state_ttl`, update mode, more
/// than one source below it, an ORDER BY other than the source's event time, a second window
/// function beside the `ROW_NUMBER()`, or state needed above it.
pub(crate) fn plan_deduplication(
    plan: &LogicalPlan,
    found: &DedupNode,
    settings: DedupSettings<'_>,
) -> Result<Deduplication> {
    let refuse = |why: String| Error::UnsupportedQuery(format!("`{}`: {why}", found.display()));
    if settings.mode != OutputMode::Append {
        return Err(refuse(
            "deduplication emits each key's first row once (append); set mode = \"append\" in \
             [sink]"
                .into(),
        ));
    }
    let input = match &found.node {
        LogicalPlan::Window(w) => Arc::clone(&w.input),
        LogicalPlan::Distinct(Distinct::All(input)) => Arc::clone(input),
        _ => unreachable!("found deduplicating nodes only"),
    };
    // First to arrive is the input's order, which only row-by-row nodes keep (a join's hash
    // table or a union's branches would reorder the rows).
    let mut reorders: Option<String> = None;
    let _ = input.apply(|node| match node {
        LogicalPlan::Projection(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Unnest(_)
        | LogicalPlan::TableScan(_) => Ok(TreeNodeRecursion::Continue),
        other => {
            reorders = Some(other.display().to_string());
            Ok(TreeNodeRecursion::Stop)
        }
    });
    if let Some(node) = reorders {
        return Err(refuse(format!(
            "`{node}` below the deduplication would change the order rows arrive in, which \
             decides the first row of a key; deduplicate the stream itself (expressions, WHERE \
             and UNNEST are fine) and join tables over the deduplicated rows"
        )));
    }
    let mut occurrences = 0;
    let _ = plan.apply(|node| {
        occurrences += usize::from(*node == found.node);
        Ok(TreeNodeRecursion::Continue)
    });
    if occurrences > 1 {
        return Err(refuse(
            "the query uses this deduplication more than once (a WITH referenced twice); a \
             ROW_NUMBER() over the stream is kept to its first row once"
                .into(),
        ));
    }
    let mut sources = BTreeSet::new();
    let _ = input.apply(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && !settings
                .statics
                .contains(&scan.table_name.table().to_lowercase())
        {
            sources.insert(scan.table_name.table().to_string());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    let source = match sources.iter().collect::<Vec<_>>()[..] {
        [one] => one.clone(),
        _ => {
            return Err(refuse(format!(
                "deduplication reads one source; this one reads {}",
                sources.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
    };
    let time_column = settings.event_time.get(&source).cloned().ok_or_else(|| {
        refuse(format!(
            "deduplication forgets a key state_ttl after its first event, in event time, and \
             source '{source}' has no event_time: set event_time in [sources.{source}]"
        ))
    })?;
    let Some(ttl) = settings.state_ttl else {
        return Err(refuse(
            "deduplication remembers every key it has seen; set state_ttl in [query] (for \
             example state_ttl = \"24h\") to say how long — a row whose event time is older \
             than that under the watermark is late"
                .into(),
        ));
    };

    let (keys, window_names) = match &found.node {
        LogicalPlan::Window(w) => {
            let [only] = &w.window_expr[..] else {
                return Err(refuse(
                    "deduplication takes the ROW_NUMBER() alone; compute other window \
                     functions over its result"
                        .into(),
                ));
            };
            let function = match only {
                Expr::Alias(a) => a.expr.as_ref(),
                other => other,
            };
            let Expr::WindowFunction(f) = function else {
                unreachable!("a window expression")
            };
            if f.params.partition_by.is_empty() {
                return Err(refuse(
                    "deduplication needs a key: ROW_NUMBER() OVER (PARTITION BY <key> ORDER BY \
                     <event time>)"
                        .into(),
                ));
            }
            let ordered_by_time = matches!(
                &f.params.order_by[..],
                [sort] if sort.asc && matches!(&sort.expr, Expr::Column(c) if c.name == time_column)
            );
            if !ordered_by_time {
                return Err(refuse(format!(
                    "deduplication keeps the first row to arrive; ORDER BY the source's event \
                     time ({time_column}) ascending, as in ROW_NUMBER() OVER (PARTITION BY … \
                     ORDER BY {time_column})"
                )));
            }
            let inputs = w.input.schema().fields().len();
            let names: Vec<String> = w.schema.fields()[inputs..]
                .iter()
                .map(|f| f.name().clone())
                .collect();
            (f.params.partition_by.clone(), names)
        }
        _ => (Vec::new(), Vec::new()),
    };

    // The lower part: the input with the lineage and event-time columns carried up to it.
    // The lower part: the input with the source's own event time (under a name of ours: the
    // query may define a column of the same name) and the lineage carried up to it.
    let with_time = with_source_event_time(input.as_ref().clone(), &source, &time_column)?;
    let carried = super::carry_columns(
        with_time,
        &[SOURCE_PARTITION, SOURCE_OFFSET, SOURCE_POSITION, EVENT_TIME],
    )?;
    let input_schema = input.schema();
    let input_columns = input_schema.fields().len();
    let mut exprs: Vec<Expr> = input_schema
        .iter()
        .map(|(qualifier, field)| Expr::Column(Column::new(qualifier.cloned(), field.name())))
        .collect();
    let key_indices: Vec<usize> = match found.form {
        // Every selected column but the lineage, which tells every row apart.
        Form::Distinct => (0..input_columns)
            .filter(|&i| !crate::source::is_lineage(input_schema.field(i).name()))
            .collect(),
        Form::RowNumber => {
            for (i, key) in keys.iter().enumerate() {
                exprs.push(key.clone().alias(format!("{KEY_PREFIX}{i}")));
            }
            (input_columns..input_columns + keys.len()).collect()
        }
    };
    let column_of = |name: &str| -> Option<Expr> {
        carried
            .schema()
            .qualified_field_with_unqualified_name(name)
            .ok()
            .map(|(q, f)| Expr::Column(Column::new(q.cloned(), f.name())))
    };
    if key_indices.is_empty() {
        return Err(refuse(
            "SELECT DISTINCT of lineage columns only has no key to deduplicate on".into(),
        ));
    }
    let time = column_of(EVENT_TIME).ok_or_else(|| {
        refuse(format!(
            "the event-time column '{time_column}' of source '{source}' does not reach the \
             deduplication"
        ))
    })?;
    let time_index = exprs.len();
    exprs.push(time);
    let present: BTreeSet<&str> = input_schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    let mut lineage_indices = Vec::new();
    for name in crate::source::LINEAGE_COLUMNS {
        if let Some(i) = input_schema.fields().iter().position(|f| f.name() == name) {
            lineage_indices.push(i);
        } else if !present.contains(name)
            && let Some(column) = column_of(name)
        {
            lineage_indices.push(exprs.len());
            exprs.push(column);
        }
    }
    let lower = LogicalPlanBuilder::from(carried).project(exprs)?.build()?;
    let time_type = lower.schema().field(time_index).data_type().clone();
    if time_type != event_time_type() {
        return Err(refuse(format!(
            "the event-time column '{time_column}' reaches the deduplication as {time_type}, \
             not the source's event time"
        )));
    }

    // The upper part reads the emitted rows from a table with the lower part's columns.
    let lower_schema = lower.schema();
    let first_rows_schema = Arc::new(Schema::new(
        lower_schema
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| Field::new(format!("c{i}"), f.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let first_rows = Arc::new(MemTable::try_new(
        Arc::clone(&first_rows_schema),
        vec![vec![]],
    )?);
    let stored = |i: usize| Expr::Column(Column::new(Some(FIRST_ROWS_TABLE), format!("c{i}")));
    let mut renamed: Vec<Expr> = input_schema
        .iter()
        .enumerate()
        .map(|(i, (qualifier, field))| stored(i).alias_qualified(qualifier.cloned(), field.name()))
        .collect();
    for name in &window_names {
        renamed.push(lit(ScalarValue::UInt64(Some(1))).alias(name));
    }
    if settings.lineage {
        // The output's lineage, as a stateless query's: partition and offset.
        for &i in lineage_indices.iter().filter(|&&i| i >= input_columns) {
            let name = lower_schema.field(i).name();
            if name == SOURCE_PARTITION || name == SOURCE_OFFSET {
                renamed.push(stored(i).alias(name));
            }
        }
    }
    let replacement = LogicalPlanBuilder::scan(
        FIRST_ROWS_TABLE,
        provider_as_source(Arc::clone(&first_rows) as _),
        None,
    )?
    .project(renamed)?
    .build()?;
    let upper = super::replace_node(plan, &found.node, &replacement)?;
    if let Some(name) = super::other_stream(&upper, FIRST_ROWS_TABLE, settings.statics) {
        return Err(Error::UnsupportedQuery(format!(
            "the query reads '{name}' beside the deduplicated rows of '{source}'; a \
             deduplicating job reads its stream only below the deduplication (static tables may \
             be joined above it)"
        )));
    }
    if let Some((node, _)) = super::stateful_node(&upper, settings.statics) {
        return Err(Error::UnsupportedQuery(format!(
            "`{node}` over the deduplicated rows needs state of its own; a job runs one stateful \
             operator for now (deduplication, or one aggregate) — chains of them are not built \
             yet"
        )));
    }
    let upper = if settings.lineage {
        super::carry_columns(upper, &[SOURCE_PARTITION, SOURCE_OFFSET])?
    } else {
        upper
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
    let key_names = match found.form {
        Form::RowNumber => keys.iter().map(unqualified).collect(),
        Form::Distinct => key_indices
            .iter()
            .map(|&i| input_schema.field(i).name().clone())
            .collect(),
    };
    let mut state_fields: Vec<Field> = key_indices
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            Field::new(
                format!("k{k}"),
                lower_schema.field(i).data_type().clone(),
                true,
            )
        })
        .collect();
    state_fields.push(Field::new(FIRST_EVENT, event_time_type(), false));
    let state_schema = Arc::new(Schema::new(state_fields));
    let converter = RowConverter::new(
        key_indices
            .iter()
            .map(|&i| SortField::new(lower_schema.field(i).data_type().clone()))
            .collect(),
    )?;
    Ok(Deduplication {
        form: found.form,
        source,
        time_column,
        key_names,
        ttl,
        lower,
        input_columns,
        key_indices,
        time_index,
        lineage_indices,
        upper,
        first_rows,
        first_rows_schema,
        converter,
        state_schema,
        seen: HashMap::new(),
        expiry: BinaryHeap::new(),
        changes: Vec::new(),
        duplicates: 0,
        log: None,
    })
}

/// `plan` with every scan of `source` wrapped in a projection that adds its `time_column` as
/// [`EVENT_TIME`]: the source's own event time, whatever the query calls its columns.
fn with_source_event_time(
    plan: LogicalPlan,
    source: &str,
    time_column: &str,
) -> Result<LogicalPlan> {
    let wrapped = plan.transform_up(|node| {
        let LogicalPlan::TableScan(scan) = &node else {
            return Ok(Transformed::no(node));
        };
        if scan.table_name.table() != source {
            return Ok(Transformed::no(node));
        }
        let mut exprs: Vec<Expr> = node
            .schema()
            .iter()
            .map(|(qualifier, field)| Expr::Column(Column::new(qualifier.cloned(), field.name())))
            .collect();
        exprs.push(
            Expr::Column(Column::new(Some(scan.table_name.clone()), time_column)).alias(EVENT_TIME),
        );
        let projection = LogicalPlanBuilder::from(node).project(exprs)?.build()?;
        Ok(Transformed::yes(projection))
    })?;
    Ok(wrapped.data)
}

impl Deduplication {
    /// The operator's id as the `position`-th operator of the query's chain.
    pub(crate) fn id(position: usize) -> String {
        format!("{position}-deduplication")
    }

    /// The source whose rows are deduplicated, and its event-time column.
    pub(crate) fn source(&self) -> (&str, &str) {
        (&self.source, &self.time_column)
    }

    /// The schema of the rows the query emits (the upper part's, lineage included).
    pub(crate) fn output_schema(&self) -> SchemaRef {
        Arc::new(self.upper.schema().as_arrow().clone())
    }

    /// How long a key is remembered after its first event, µs.
    pub(crate) fn ttl(&self) -> i64 {
        self.ttl
    }

    /// The operator as `sluice validate` shows it.
    pub(crate) fn describe(&self, position: usize) -> super::OperatorDescription {
        let ttl =
            humantime::format_duration(std::time::Duration::from_micros(self.ttl.max(0) as u64));
        let what = match self.form {
            Form::RowNumber => format!(
                "deduplication over {}: ROW_NUMBER() OVER (PARTITION BY key ORDER BY {}) = 1 — \
                 the first row of each key to arrive (source order)",
                self.source, self.time_column
            ),
            Form::Distinct => format!(
                "deduplication over {}: SELECT DISTINCT — the first row of each set of values \
                 to arrive (source order)",
                self.source
            ),
        };
        super::OperatorDescription {
            id: Self::id(position),
            what,
            state_key: self.key_names.clone(),
            purge: format!(
                "a key leaves when the watermark reaches its first row's event time + \
                 state_ttl ({ttl}); a row that old is late"
            ),
            emits: "each key's first row once, in the batch it arrives (append)".into(),
        }
    }

    /// What the state means: the source, the key expressions (unqualified) and the state's
    /// column types. A restart whose query gives another one refuses the state.
    pub(crate) fn fingerprint(&self) -> String {
        let types: Vec<String> = self
            .state_schema
            .fields()
            .iter()
            .map(|f| f.data_type().to_string())
            .collect();
        format!(
            "deduplication over {} by [{}] in arrival order; state types [{}]",
            self.source,
            self.key_names.join(", "),
            types.join(", ")
        )
    }

    /// The rows to deduplicate: the node's input with its keys, event time and lineage, minus
    /// the rows late under `watermark` (they go to the late table). Must run in source order.
    pub(crate) fn lower_plan(&self, watermark: Option<i64>) -> Result<LogicalPlan> {
        let Some(watermark) = watermark else {
            return Ok(self.lower.clone());
        };
        let time = Expr::Column(Column::new_unqualified(
            self.lower.schema().field(self.time_index).name(),
        ));
        let open = time.gt(lit(ScalarValue::TimestampMicrosecond(
            Some(watermark.saturating_sub(self.ttl)),
            Some("UTC".into()),
        )));
        Ok(LogicalPlanBuilder::from(self.lower.clone())
            .filter(open)?
            .build()?)
    }

    /// Forgets the keys whose first event time + `state_ttl` is at or below `watermark`.
    fn purge(&mut self, watermark: i64) {
        while let Some(Reverse((first, _))) = self.expiry.peek() {
            if first.saturating_add(self.ttl) > watermark {
                break;
            }
            let Some(Reverse((first, key))) = self.expiry.pop() else {
                break;
            };
            if self.seen.get(&key) == Some(&first) {
                self.seen.remove(&key);
            }
        }
    }

    /// One batch: forgets the keys the watermark in force has expired, keeps each key's first
    /// row of `rows` (the lower part's output, in source order) that the state does not hold,
    /// remembers its key, and runs the upper part over the rows kept. Rows on which the upper
    /// part fails are returned as failed.
    ///
    /// # Errors
    /// If the upper part fails other than on the rows' values.
    pub(crate) async fn deduplicate(
        &mut self,
        ctx: &SessionContext,
        rows: Vec<RecordBatch>,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        if let Some(watermark) = watermark {
            self.purge(watermark);
        }
        self.changes.clear();
        self.duplicates = 0;
        let all = arrow::compute::concat_batches(
            &Arc::new(self.lower.schema().as_arrow().clone()),
            &rows,
        )?;
        if all.num_rows() == 0 {
            return Ok(QueryOutput::default());
        }
        let key_arrays: Vec<ArrayRef> = self
            .key_indices
            .iter()
            .map(|&i| Arc::clone(all.column(i)))
            .collect();
        let keys = self.converter.convert_columns(&key_arrays)?;
        let times = all
            .column(self.time_index)
            .as_primitive_opt::<TimestampMicrosecondType>()
            .ok_or_else(|| Error::UnsupportedQuery("the event time is not a timestamp".into()))?;
        let mut kept: Vec<u32> = Vec::new();
        for i in 0..all.num_rows() {
            if times.is_null(i) {
                continue;
            }
            let time = times.value(i);
            if watermark.is_some_and(|w| time.saturating_add(self.ttl) <= w) {
                continue;
            }
            let key = keys.row(i);
            if self.seen.contains_key(key.as_ref()) {
                self.duplicates += 1;
                continue;
            }
            let key: Box<[u8]> = key.as_ref().into();
            self.seen.insert(key.clone(), time);
            self.expiry.push(Reverse((time, key)));
            kept.push(i as u32);
        }
        if kept.is_empty() {
            return Ok(QueryOutput::default());
        }
        let kept = arrow::compute::take_record_batch(&all, &UInt32Array::from(kept))?;
        let mut state_columns: Vec<ArrayRef> = self
            .key_indices
            .iter()
            .map(|&i| Arc::clone(kept.column(i)))
            .collect();
        state_columns.push(Arc::clone(kept.column(self.time_index)));
        self.changes = vec![RecordBatch::try_new(
            Arc::clone(&self.state_schema),
            state_columns,
        )?];
        self.upper_isolating(ctx, kept).await
    }

    /// Rows the last batch dropped as duplicates.
    pub(crate) fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Runs the upper part over `kept`; rows it fails on (their values) are found by halving
    /// and returned as failed, with the row's input columns and lineage.
    async fn upper_isolating(
        &self,
        ctx: &SessionContext,
        kept: RecordBatch,
    ) -> Result<QueryOutput> {
        let mut out = QueryOutput::default();
        let mut pending = vec![(0, kept.num_rows())];
        while let Some((offset, len)) = pending.pop() {
            if len == 0 {
                continue;
            }
            match self.run_upper(ctx, kept.slice(offset, len)).await {
                Ok(batches) => out.batches.extend(batches),
                Err(e) if !is_data_error(&e) => return Err(e),
                Err(e) if len == 1 => out.failed.push(FailedRow {
                    source: self.source.clone(),
                    row: self.failed_row(&kept.slice(offset, 1))?,
                    error: e.to_string(),
                }),
                Err(_) => {
                    let half = len / 2;
                    pending.push((offset + half, len - half));
                    pending.push((offset, half));
                }
            }
        }
        Ok(out)
    }

    async fn run_upper(&self, ctx: &SessionContext, rows: RecordBatch) -> Result<Vec<RecordBatch>> {
        let rows =
            RecordBatch::try_new(Arc::clone(&self.first_rows_schema), rows.columns().to_vec())?;
        *self.first_rows.batches[0].write().await = vec![rows];
        let out = match ctx.execute_logical_plan(self.upper.clone()).await {
            Ok(df) => df.collect().await,
            Err(e) => Err(e),
        };
        self.first_rows.batches[0].write().await.clear();
        Ok(out?.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    /// A kept row as a dead letter's row: the node's input columns and the lineage.
    fn failed_row(&self, row: &RecordBatch) -> Result<RecordBatch> {
        let mut columns: Vec<usize> = (0..self.input_columns).collect();
        columns.extend(
            self.lineage_indices
                .iter()
                .filter(|&&i| i >= self.input_columns),
        );
        Ok(row.project(&columns)?)
    }

    /// Rows and in-memory bytes of the state (keys in row format, their times, the expiry
    /// queue).
    pub(crate) fn state_size(&self) -> StateSize {
        let per_entry = std::mem::size_of::<(Box<[u8]>, i64)>() * 2;
        let bytes: usize = self.seen.keys().map(|k| 2 * k.len() + per_entry).sum();
        StateSize {
            rows: self.seen.len() as u64,
            bytes: bytes as u64,
        }
    }

    /// Restores the keys from the files a committed manifest lists (per key the newest first
    /// event time: an older one was purged before the key came back), without those the
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
        self.seen.clear();
        self.expiry.clear();
        for batch in log
            .restore(files, &self.state_schema)
            .await?
            .into_iter()
            .flat_map(|f| f.rows)
        {
            let keys: Vec<ArrayRef> = batch.columns()[..self.key_indices.len()].to_vec();
            let rows = self.converter.convert_columns(&keys)?;
            let times = batch
                .column_by_name(FIRST_EVENT)
                .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>())
                .ok_or_else(|| {
                    Error::InvalidJob(format!(
                        "a state file of the deduplication has no {FIRST_EVENT} column"
                    ))
                })?;
            for i in 0..batch.num_rows() {
                let time = times.value(i);
                let key: Box<[u8]> = rows.row(i).as_ref().into();
                let first = self.seen.entry(key).or_insert(time);
                *first = (*first).max(time);
            }
        }
        self.expiry = self
            .seen
            .iter()
            .map(|(key, time)| Reverse((*time, key.clone())))
            .collect();
        if let Some(watermark) = watermark {
            self.purge(watermark);
        }
        self.changes.clear();
        self.log = Some(log);
        Ok(())
    }

    /// Writes this batch's new keys (a delta, or a new base) and returns the live files.
    pub(crate) async fn write_state(&mut self, batch_id: BatchId) -> Result<StateWrite> {
        let Deduplication {
            log,
            seen,
            converter,
            state_schema,
            changes,
            ..
        } = self;
        let log = log
            .as_mut()
            .ok_or_else(|| Error::InvalidJob("state written before it was restored".into()))?;
        let live = seen.len() as u64;
        // A key's rows are not merged: a restore keeps its newest first event time (see
        // `restore`), so no purge is replayed between files.
        log.write(batch_id, state_schema, changes, None, live, || {
            state_rows(seen, converter, state_schema)
        })
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
}

/// Every remembered key with its first event time, as state rows (a new base).
fn state_rows(
    seen: &HashMap<Box<[u8]>, i64>,
    converter: &RowConverter,
    schema: &SchemaRef,
) -> Result<Vec<RecordBatch>> {
    if seen.is_empty() {
        return Ok(Vec::new());
    }
    let parser = converter.parser();
    let rows: Vec<_> = seen.keys().map(|k| parser.parse(k)).collect();
    let mut columns = converter.convert_rows(rows)?;
    let times: Vec<i64> = seen.values().copied().collect();
    columns.push(Arc::new(
        TimestampMicrosecondArray::from(times).with_data_type(event_time_type()),
    ));
    Ok(vec![RecordBatch::try_new(Arc::clone(schema), columns)?])
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::DataType;
    use proptest::prelude::*;

    use super::*;
    use crate::checkpoint::{BatchManifest, CheckpointStore};
    use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};

    const SECOND: i64 = 1_000_000;
    const TTL: i64 = 30 * SECOND;
    const OUT_OF_ORDERNESS: i64 = 10 * SECOND;

    /// One event: (event time in seconds, key).
    type Event = (i64, u8);

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("ts", event_time_type(), false),
            Field::new("k", DataType::Utf8, false),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]))
    }

    /// The events from offset `first` on.
    fn batch(events: &[Event], first: i64) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        events.iter().map(|e| e.0 * SECOND),
                    )
                    .with_timezone("UTC"),
                ),
                Arc::new(StringArray::from_iter_values(
                    events.iter().map(|e| format!("k{}", e.1)),
                )),
                Arc::new(StringArray::from(vec!["0"; events.len()])),
                Arc::new(Int64Array::from_iter_values(
                    first..first + events.len() as i64,
                )),
            ],
        )
        .unwrap()
    }

    fn settings() -> QuerySettings {
        QuerySettings {
            lineage: true,
            event_time: BTreeMap::from([("t".to_string(), "ts".to_string())]),
            state_ttl: Some(Duration::from_micros(TTL as u64)),
            ..QuerySettings::default()
        }
    }

    /// What the rules say, row by row: per batch, keys whose first event + TTL is at or below
    /// the watermark in force are forgotten, rows that old are late, and a row of a key not
    /// remembered is emitted. The offsets emitted and the late count.
    fn model(chunks: &[Vec<Event>]) -> (Vec<i64>, usize) {
        let mut seen: HashMap<u8, i64> = HashMap::new();
        let (mut emitted, mut late) = (Vec::new(), 0);
        let mut watermark: Option<i64> = None;
        let mut offset = 0;
        for chunk in chunks {
            if let Some(w) = watermark {
                seen.retain(|_, first| *first + TTL > w);
            }
            for &(t, k) in chunk {
                let t = t * SECOND;
                if watermark.is_some_and(|w| t + TTL <= w) {
                    late += 1;
                } else if let std::collections::hash_map::Entry::Vacant(e) = seen.entry(k) {
                    e.insert(t);
                    emitted.push(offset);
                }
                offset += 1;
            }
            watermark = chunk
                .iter()
                .map(|e| e.0 * SECOND - OUT_OF_ORDERNESS)
                .chain(watermark)
                .max();
        }
        (emitted, late)
    }

    /// The query streamed over `chunks`, restarted from its state files after batch
    /// `restart_after`: the offsets it emitted, in order, and the late rows.
    async fn streamed(sql: &str, chunks: &[Vec<Event>], restart_after: usize) -> (Vec<i64>, usize) {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&url::Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let sources = [("t".to_string(), schema())];
        let settings = settings();
        let plan = || StreamingQuery::plan(sql, &sources, &settings);
        let mut query = plan().await.unwrap();
        query
            .restore_state(StateLog::new(&checkpoint, 0), None, None)
            .await
            .unwrap();
        let (mut emitted, mut late) = (Vec::new(), 0);
        let mut watermark: Option<i64> = None;
        let mut offset = 0;
        for (i, chunk) in chunks.iter().enumerate() {
            let rows = batch(chunk, offset);
            offset += chunk.len() as i64;
            late += query
                .late_rows("t", &rows, watermark, BatchId(i as i64))
                .unwrap()
                .map_or(0, |b| b.num_rows());
            let after = chunk
                .iter()
                .map(|e| e.0 * SECOND - OUT_OF_ORDERNESS)
                .chain(watermark)
                .max();
            let step = BatchWatermark {
                before: watermark,
                after,
            };
            let inputs = BTreeMap::from([("t".to_string(), rows)]);
            let out = query.execute_isolating(&inputs, step).await.unwrap();
            assert!(out.failed.is_empty());
            for b in &out.batches {
                let offsets = b
                    .column_by_name(SOURCE_OFFSET)
                    .unwrap()
                    .as_primitive::<arrow::datatypes::Int64Type>();
                emitted.extend(offsets.values().iter().copied());
            }
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
        (emitted, late)
    }

    const ROW_NUMBER: &str = "SELECT ts, k, _source_offset FROM (SELECT *, ROW_NUMBER() OVER \
        (PARTITION BY k ORDER BY ts) AS rn FROM t) WHERE rn = 1";
    const DISTINCT: &str = "SELECT DISTINCT k FROM t";
    /// The query's `ts` is a day later than the source's: keys are still remembered, and rows
    /// judged late, by the source's event time.
    const REDEFINED_TIME: &str = "SELECT k, _source_offset FROM (SELECT *, ROW_NUMBER() OVER \
        (PARTITION BY k ORDER BY ts) AS rn FROM (SELECT k, _source_partition, _source_offset, \
        ts + INTERVAL '1' DAY AS ts FROM t)) WHERE rn = 1";

    fn events() -> impl Strategy<Value = Vec<Vec<Event>>> {
        prop::collection::vec(prop::collection::vec((0i64..120, 0u8..6), 0..12), 1..8)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Both forms keep what the rules say, straight through and across a restart from the
        /// state files at any batch.
        #[test]
        fn the_first_row_per_key_is_kept_as_the_rules_say(chunks in events(), restart in 0usize..8) {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            let (expected, late) = model(&chunks);
            for sql in [ROW_NUMBER, DISTINCT, REDEFINED_TIME] {
                let (emitted, streamed_late) =
                    runtime.block_on(streamed(sql, &chunks, restart));
                prop_assert_eq!(&emitted, &expected, "{}", sql);
                prop_assert_eq!(streamed_late, late);
            }
        }
    }

    #[tokio::test]
    async fn deduplication_is_described_and_refused_where_it_cannot_hold() {
        let sources = [("t".to_string(), schema())];
        let query = StreamingQuery::plan(ROW_NUMBER, &sources, &settings())
            .await
            .unwrap();
        let [operator] = &query.operators()[..] else {
            panic!("one operator")
        };
        assert_eq!(operator.id, "0-deduplication");
        assert_eq!(operator.state_key, vec!["k".to_string()]);
        assert!(operator.purge.contains("30s"), "{}", operator.purge);
        let refused = |sql: &'static str, settings: QuerySettings| {
            let sources = sources.clone();
            async move {
                StreamingQuery::plan(sql, &sources, &settings)
                    .await
                    .unwrap_err()
                    .to_string()
            }
        };
        let no_ttl = QuerySettings {
            state_ttl: None,
            ..settings()
        };
        assert!(refused(ROW_NUMBER, no_ttl).await.contains("set state_ttl"));
        let by_key = "SELECT * FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY k ORDER BY \
            _source_offset) AS rn FROM t) WHERE rn = 1";
        assert!(
            refused(by_key, settings())
                .await
                .contains("ORDER BY the source's event time")
        );
        let counted = "SELECT count(*) FROM (SELECT DISTINCT k FROM t)";
        assert!(
            refused(counted, settings())
                .await
                .contains("one stateful operator")
        );
        let update = QuerySettings {
            output_mode: OutputMode::Update,
            key: Some(vec!["k".into()]),
            ..settings()
        };
        assert!(refused(DISTINCT, update).await.contains("append"));
        let two_streams = "SELECT DISTINCT k FROM t UNION ALL SELECT k FROM t";
        assert!(
            refused(two_streams, settings())
                .await
                .contains("beside the deduplicated rows")
        );
        let with_table = QuerySettings {
            static_tables: BTreeMap::from([(
                "d".to_string(),
                Arc::new(Schema::new(vec![
                    Field::new("k", DataType::Utf8, true),
                    Field::new("name", DataType::Utf8, true),
                ])),
            )]),
            ..settings()
        };
        let joined = "SELECT DISTINCT t.k, d.name FROM t JOIN d ON t.k = d.k";
        let error = refused(joined, with_table.clone()).await;
        assert!(error.contains("order rows arrive in"), "{error}");
        // Joined above the deduplication, the table is fine.
        let above = "SELECT f.k, d.name FROM (SELECT DISTINCT k FROM t) f JOIN d ON f.k = d.k";
        StreamingQuery::plan(above, &sources, &with_table)
            .await
            .unwrap();
        let twice = "WITH w AS (SELECT *, ROW_NUMBER() OVER (PARTITION BY k ORDER BY ts) AS rn \
            FROM t) SELECT k FROM w WHERE rn = 1 UNION ALL SELECT k FROM w WHERE rn > 1";
        assert!(refused(twice, settings()).await.contains("more than once"));
        // SELECT DISTINCT * keys on the data columns, not on the lineage.
        let query = StreamingQuery::plan("SELECT DISTINCT * FROM t", &sources, &settings())
            .await
            .unwrap();
        assert_eq!(query.operators()[0].state_key, vec!["ts", "k"]);
    }
}
