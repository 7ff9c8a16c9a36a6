//! A job: sources, one query (SQL or a DataFrame), a sink, a trigger — built in Rust or from a
//! job file.
//!
//! [`JobBuilder`] is the Rust API; the `sluice` binary builds the same [`Job`] from a TOML job
//! file. Either way the job runs with [`Job::run`] (see [`crate::driver`]).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use url::Url;

use crate::error::{Error, Result};
use crate::event_time::EventTimeConfig;
use crate::expectations::Expectation;
use crate::progress::{JobDescription, Progress};
use crate::query::{Functions, Query};
use crate::sink::{OutputMode, Sink};
use crate::source::Source;
use crate::static_table::{StaticTable, TableSpec};
use crate::storage::StorageOptions;

/// When batches run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// One batch (capped by the per-batch limits), then exit.
    Once,
    /// Fix every partition's latest offset at start, process up to it in capped batches, exit.
    AvailableNow,
    /// A batch per interval until SIGINT/SIGTERM.
    Interval(Duration),
}

impl FromStr for Trigger {
    type Err = Error;

    /// Parses `once`, `available-now` or `interval:<duration>` (`interval:5s`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "once" => Ok(Trigger::Once),
            "available-now" => Ok(Trigger::AvailableNow),
            _ => match s.strip_prefix("interval:") {
                Some(d) => Ok(Trigger::Interval(parse_duration("trigger interval", d)?)),
                None => Err(Error::InvalidJob(format!(
                    "trigger '{s}' is not one of once, available-now, interval:<duration>"
                ))),
            },
        }
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Trigger::Once => write!(f, "once"),
            Trigger::AvailableNow => write!(f, "available-now"),
            Trigger::Interval(d) => write!(f, "interval:{}", humantime::format_duration(*d)),
        }
    }
}

/// Parses a human duration (`10s`, `1m 30s`, `250ms`), naming the setting if it is wrong.
pub fn parse_duration(setting: &str, text: &str) -> Result<Duration> {
    humantime::parse_duration(text.trim())
        .map_err(|e| Error::InvalidJob(format!("{setting} '{text}' is not a duration: {e}")))
}

/// One source of a job: its SQL table name, the source and its event-time settings.
pub struct SourceSpec {
    /// The SQL table name.
    pub name: String,
    /// The source.
    pub source: Box<dyn Source>,
    /// Event-time column and watermark settings, if the source has event time.
    pub event_time: Option<EventTimeConfig>,
}

/// A complete job definition.
pub struct Job {
    /// The job id: the Delta txn app id; one running instance per id.
    pub id: String,
    /// The sources, each a SQL table.
    pub sources: Vec<SourceSpec>,
    /// Tables the query joins whole, read at the version each batch's intent records.
    pub tables: Vec<TableSpec>,
    /// The query.
    pub query: Query,
    /// Functions the query may call besides DataFusion's own.
    pub functions: Functions,
    /// Where results go.
    pub sink: Box<dyn Sink>,
    /// Checkpoint location; `None` for `<sink location>/_sluice/<job id>`.
    pub checkpoint: Option<Url>,
    /// How the checkpoint's store is configured, and how long it may stay unreachable; `None`
    /// for the sink's ([`Sink::storage_options`]).
    pub checkpoint_storage: Option<StorageOptions>,
    /// When batches run.
    pub trigger: Trigger,
    /// Whether output rows carry `_source_partition` and `_source_offset`.
    pub lineage: bool,
    /// How many committed batch folders to keep in the checkpoint.
    pub keep_batches: u32,
    /// Windowed queries: how long after its end a window still accepts rows.
    pub allowed_lateness: Duration,
    /// Append rows, or upsert them on a key.
    pub output_mode: OutputMode,
    /// Update mode: the upsert key (default: the query's group columns).
    pub key: Option<Vec<String>>,
    /// Running (non-windowed) aggregates: how long after its newest event (in watermark time) a
    /// group's state is kept.
    pub state_ttl: Option<Duration>,
    /// Data-quality checks on the output rows.
    pub expectations: Vec<Expectation>,
    /// A batch whose dead letters exceed this share of the records it read (and number more
    /// than [`DEAD_LETTER_BREAKER_MIN`]) fails instead of committing.
    pub max_dead_letter_fraction: f64,
    /// Where the running job reports its progress (read it from another task: the `sluice`
    /// binary serves it as metrics and a status page).
    pub progress: Arc<Progress>,
}

/// Dead letters a batch may always hold, whatever their share: the circuit breaker is for a
/// misconfigured job, not a small batch with a few bad records.
pub const DEAD_LETTER_BREAKER_MIN: u64 = 100;

/// The default of `max_dead_letter_fraction`.
pub const DEFAULT_MAX_DEAD_LETTER_FRACTION: f64 = 0.1;

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field(
                "sources",
                &self.sources.iter().map(|s| &s.name).collect::<Vec<_>>(),
            )
            .field("query", &self.query)
            .field("trigger", &self.trigger)
            .finish()
    }
}

impl Job {
    /// Starts building a job with the given id.
    pub fn builder(id: impl Into<String>) -> JobBuilder {
        JobBuilder {
            id: id.into(),
            sources: Vec::new(),
            tables: Vec::new(),
            query: None,
            functions: Functions::default(),
            sink: None,
            checkpoint: None,
            checkpoint_storage: None,
            trigger: Trigger::AvailableNow,
            lineage: true,
            keep_batches: 10,
            allowed_lateness: Duration::ZERO,
            output_mode: OutputMode::Append,
            key: None,
            state_ttl: None,
            expectations: Vec::new(),
            max_dead_letter_fraction: DEFAULT_MAX_DEAD_LETTER_FRACTION,
        }
    }
}

/// Builds a [`Job`] in Rust.
///
/// ```no_run
/// # async fn example(source: Box<dyn sluice_engine::Source>, sink: Box<dyn sluice_engine::Sink>) -> sluice_engine::Result<()> {
/// use sluice_engine::{Job, Trigger};
/// let job = Job::builder("clicks_clean")
///     .with_source("clicks", source, None)
///     .with_sql("SELECT user_id, upper(page) AS page FROM clicks WHERE user_id IS NOT NULL")
///     .with_sink(sink)
///     .with_trigger(Trigger::AvailableNow)
///     .build()?;
/// let summary = job.run().await?;
/// println!("{} batches committed", summary.batches_committed);
/// # Ok(()) }
/// ```
pub struct JobBuilder {
    id: String,
    sources: Vec<SourceSpec>,
    tables: Vec<TableSpec>,
    query: Option<Query>,
    functions: Functions,
    sink: Option<Box<dyn Sink>>,
    checkpoint: Option<Url>,
    checkpoint_storage: Option<StorageOptions>,
    trigger: Trigger,
    lineage: bool,
    keep_batches: u32,
    allowed_lateness: Duration,
    output_mode: OutputMode,
    key: Option<Vec<String>>,
    state_ttl: Option<Duration>,
    expectations: Vec<Expectation>,
    max_dead_letter_fraction: f64,
}

impl JobBuilder {
    /// Adds a source, queried in SQL as `name`.
    pub fn with_source(
        mut self,
        name: impl Into<String>,
        source: Box<dyn Source>,
        event_time: Option<EventTimeConfig>,
    ) -> Self {
        self.sources.push(SourceSpec {
            name: name.into(),
            source,
            event_time,
        });
        self
    }

    /// Adds a static table: read whole (not streamed) at the version each batch's intent
    /// records, joined by the query under `name` — e.g. a Delta dimension table
    /// (`sluice_sinks::DeltaTableSource`). See [`crate::static_table`].
    pub fn with_table(mut self, name: impl Into<String>, table: Box<dyn StaticTable>) -> Self {
        self.tables.push(TableSpec {
            name: name.into(),
            table,
        });
        self
    }

    /// Sets the query: SQL over tables named after the sources.
    pub fn with_sql(mut self, sql: impl Into<String>) -> Self {
        self.query = Some(Query::Sql(sql.into()));
        self
    }

    /// Sets the query, built with DataFusion's DataFrame API instead of SQL: `build` gets the
    /// session with every source registered as a table (and the window table functions and the
    /// job's functions), and returns the plan as a `DataFrame`. It is planned and validated once,
    /// like SQL, and called again wherever the query is planned again (see [`Query`]).
    ///
    /// ```no_run
    /// # fn example(builder: sluice_engine::JobBuilder) -> sluice_engine::JobBuilder {
    /// use sluice_engine::datafusion::prelude::{col, lit};
    /// builder.with_query(|ctx| async move {
    ///     ctx.table("clicks").await?.filter(col("amount").gt(lit(10.0)))?.select_columns(&["id", "page"])
    /// })
    /// # }
    /// ```
    pub fn with_query<F, Fut>(mut self, build: F) -> Self
    where
        F: Fn(datafusion::prelude::SessionContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = datafusion::error::Result<datafusion::prelude::DataFrame>>
            + Send
            + 'static,
    {
        self.query = Some(Query::data_frame(build));
        self
    }

    /// Registers a scalar function the query may call (`ScalarUDF`, e.g. from
    /// `datafusion::logical_expr::create_udf`).
    pub fn with_udf(mut self, function: datafusion::logical_expr::ScalarUDF) -> Self {
        self.functions.scalar.push(function);
        self
    }

    /// Registers an aggregate function the query may call (`AggregateUDF`). In a windowed or
    /// running aggregate its accumulator's state is carried between batches and restored after
    /// a crash like a built-in aggregate's (see [`Functions`]).
    pub fn with_udaf(mut self, function: datafusion::logical_expr::AggregateUDF) -> Self {
        self.functions.aggregate.push(function);
        self
    }

    /// Registers a window function (`WindowUDF`, called with `OVER (…)`); a streaming query
    /// may use window functions only over the rows a windowed aggregate emits.
    pub fn with_udwf(mut self, function: datafusion::logical_expr::WindowUDF) -> Self {
        self.functions.window.push(function);
        self
    }

    /// Registers every function of `functions` (see [`JobBuilder::with_udf`] and the others).
    pub fn with_functions(mut self, functions: &Functions) -> Self {
        self.functions.extend(functions);
        self
    }

    /// Sets the sink.
    pub fn with_sink(mut self, sink: Box<dyn Sink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Sets the checkpoint location (default: `<sink location>/_sluice/<job id>`).
    pub fn with_checkpoint(mut self, url: Url) -> Self {
        self.checkpoint = Some(url);
        self
    }

    /// Configures the checkpoint's object store (default: as the sink's store, see
    /// [`Sink::storage_options`] and [`crate::storage`]).
    pub fn with_checkpoint_storage(mut self, options: StorageOptions) -> Self {
        self.checkpoint_storage = Some(options);
        self
    }

    /// Sets the trigger (default: available-now).
    pub fn with_trigger(mut self, trigger: Trigger) -> Self {
        self.trigger = trigger;
        self
    }

    /// Whether output carries the lineage columns (default: true).
    pub fn with_lineage(mut self, lineage: bool) -> Self {
        self.lineage = lineage;
        self
    }

    /// How many committed batch folders the checkpoint keeps (default: 10, at least 1).
    pub fn with_keep_batches(mut self, keep: u32) -> Self {
        self.keep_batches = keep.max(1);
        self
    }

    /// Windowed queries: how long after its end a window still accepts rows (default: 0, a
    /// window closes as soon as the watermark passes its end).
    pub fn with_allowed_lateness(mut self, lateness: Duration) -> Self {
        self.allowed_lateness = lateness;
        self
    }

    /// Sets the output mode (default: append) and, for update mode, the upsert key (default:
    /// the query's group columns; required for a stateless query).
    pub fn with_output_mode(mut self, mode: OutputMode, key: Option<Vec<String>>) -> Self {
        self.output_mode = mode;
        self.key = key;
        self
    }

    /// Running (non-windowed) aggregates: drop a group's state once the watermark is `ttl` past
    /// its newest event.
    pub fn with_state_ttl(mut self, ttl: Duration) -> Self {
        self.state_ttl = Some(ttl);
        self
    }

    /// Adds a data-quality check on the output rows (see [`crate::expectations`]).
    pub fn with_expectation(mut self, expectation: Expectation) -> Self {
        self.expectations.push(expectation);
        self
    }

    /// The dead-letter circuit breaker: a batch whose dead letters exceed `fraction` of the
    /// records it read (and number more than [`DEAD_LETTER_BREAKER_MIN`]) fails instead of
    /// committing. Default [`DEFAULT_MAX_DEAD_LETTER_FRACTION`]; 1.0 turns it off.
    pub fn with_max_dead_letter_fraction(mut self, fraction: f64) -> Self {
        self.max_dead_letter_fraction = fraction;
        self
    }

    /// Checks and returns the job.
    ///
    /// # Errors
    /// If the id is empty or has characters other than letters, digits, `_`, `-`, `.`; if there
    /// is no source, no query or no sink; if two sources share a name; or if
    /// `max_dead_letter_fraction` is not between 0 and 1.
    pub fn build(self) -> Result<Job> {
        let id_ok = !self.id.is_empty()
            && self
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !id_ok {
            return Err(Error::InvalidJob(format!(
                "job id '{}' must be non-empty and use only letters, digits, '_', '-' and '.'",
                self.id
            )));
        }
        if self.sources.is_empty() {
            return Err(Error::InvalidJob(format!(
                "job '{}' has no source",
                self.id
            )));
        }
        if let Some(t) = self.tables.iter().find(|t| {
            let name = t.name.to_lowercase();
            ["tumble", "hop", "session"].contains(&name.as_str()) || name.contains('.')
        }) {
            return Err(Error::InvalidJob(format!(
                "table '{}': a table's name may not contain '.' nor be a window function's \
                 (tumble, hop, session)",
                t.name
            )));
        }
        // One SQL namespace, where an unquoted name is lowercase.
        let mut names: Vec<String> = self
            .sources
            .iter()
            .map(|s| s.name.to_lowercase())
            .chain(self.tables.iter().map(|t| t.name.to_lowercase()))
            .collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::InvalidJob(format!(
                "'{}' names two sources or tables (sources and tables share one SQL namespace, \
                 where case does not count)",
                w[0]
            )));
        }
        let query = self
            .query
            .filter(|q| !q.is_empty())
            .ok_or_else(|| Error::InvalidJob(format!("job '{}' has no query", self.id)))?;
        let sink = self
            .sink
            .ok_or_else(|| Error::InvalidJob(format!("job '{}' has no sink", self.id)))?;
        if !(0.0..=1.0).contains(&self.max_dead_letter_fraction) {
            return Err(Error::InvalidJob(format!(
                "max_dead_letter_fraction = {} must be between 0 and 1",
                self.max_dead_letter_fraction
            )));
        }
        let progress = Progress::new(JobDescription {
            job_id: self.id.clone(),
            sources: self.sources.iter().map(|s| s.name.clone()).collect(),
            sink: sink.location().to_string(),
            trigger: self.trigger.to_string(),
            interval: match self.trigger {
                Trigger::Interval(every) => Some(every),
                _ => None,
            },
            expectations: self
                .expectations
                .iter()
                .map(|e| (e.name.clone(), e.on_failure.as_str().to_string()))
                .collect(),
        });
        Ok(Job {
            id: self.id,
            sources: self.sources,
            tables: self.tables,
            query,
            functions: self.functions,
            sink,
            checkpoint: self.checkpoint,
            checkpoint_storage: self.checkpoint_storage,
            trigger: self.trigger,
            lineage: self.lineage,
            keep_batches: self.keep_batches,
            allowed_lateness: self.allowed_lateness,
            output_mode: self.output_mode,
            key: self.key,
            state_ttl: self.state_ttl,
            expectations: self.expectations,
            max_dead_letter_fraction: self.max_dead_letter_fraction,
            progress: Arc::new(progress),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triggers_parse() {
        assert_eq!("once".parse::<Trigger>().unwrap(), Trigger::Once);
        assert_eq!(
            "interval:1500ms".parse::<Trigger>().unwrap(),
            Trigger::Interval(Duration::from_millis(1500))
        );
        let err = "sometimes".parse::<Trigger>().unwrap_err().to_string();
        assert!(err.contains("'sometimes'"), "{err}");
    }
}
