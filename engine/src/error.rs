//! The engine's error type.
//!
//! One enum for the crate, with `#[from]` conversions for the libraries underneath and messages
//! that name the input at fault (source, partition, offset, file, column), so a user reading a
//! log line knows what to fix without reading code.
//!
//! Errors are typed all the way down: a source's or a sink's own error type travels inside
//! [`Error::Source`] and [`Error::Sink`] as the error's source, so a caller finds it with
//! [`Error::find`] (e.g. the Kafka source's `ConnectorError::DataLoss`) instead of parsing text.
//! Every message includes its cause's, so the top error's `to_string()` says it all: print an
//! error with `{}`. (A reporter that also walks `source()` — anyhow's `{:#}` — repeats the
//! causes; the `sluice` command line prints the chain with each text once.)

use crate::offsets::BatchId;

/// Any error, boxed: what a source or a sink of another crate fails with, kept typed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An Arrow kernel failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// DataFusion failed to plan or execute the job's query.
    #[error("datafusion: {0}")]
    DataFusion(#[from] datafusion::error::DataFusionError),
    /// Reading or writing the checkpoint store failed.
    #[error("checkpoint store: {0}")]
    ObjectStore(#[from] object_store::Error),
    /// A state file could not be written or read as Parquet.
    #[error("state file: {0}")]
    StateFile(#[from] parquet::errors::ParquetError),
    /// A checkpoint file could not be (de)serialised.
    #[error("checkpoint file {path}: {source}")]
    CheckpointFormat {
        /// The checkpoint file.
        path: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// The job definition is invalid; the message names the offending setting.
    #[error("invalid job: {0}")]
    InvalidJob(String),
    /// The job's query does not plan over its sources' schemas; the message says why in the
    /// job's terms (an inferred column's type, and how to declare it).
    #[error("the query does not plan: {0}")]
    Query(String),
    /// The query uses something a streaming job cannot run (yet).
    #[error("unsupported query: {0}")]
    UnsupportedQuery(String),
    /// The output table says a batch was committed, but its manifest is gone.
    #[error(
        "the output table records batch {batch_id} of job '{job_id}' as committed, but its manifest \
         {path} is missing: the checkpoint was deleted or moved while the table was kept. Restore the \
         checkpoint, or delete the output table as well to start from scratch"
    )]
    MissingManifest {
        /// The job.
        job_id: String,
        /// The batch the table names.
        batch_id: BatchId,
        /// Where the manifest should be.
        path: String,
    },
    /// Another instance of the job holds its lease and is alive.
    #[error(
        "job '{job_id}' is already running: its lease in {location} is held by {holder}, which \
         keeps renewing it. Stop that run first (a run that was killed stops renewing, and its \
         lease is taken over after {}s without waiting for anyone)",
        timeout.as_secs_f64()
    )]
    LeaseHeld {
        /// The job.
        job_id: String,
        /// Who holds it: host, pid, epoch.
        holder: String,
        /// The lease folder.
        location: String,
        /// How long a lease lives without renewal.
        timeout: std::time::Duration,
    },
    /// This run lost the job's lease (another instance took over, or renewals failed).
    #[error(
        "job '{job_id}' lost its lease (epoch {epoch} in {location}): another instance took the \
         job over, or the lease could not be renewed in time (store down, process paused). This \
         run stopped without committing further; the batch in flight is the other instance's, \
         or is rerun on restart"
    )]
    LeaseLost {
        /// The job.
        job_id: String,
        /// This run's epoch.
        epoch: u64,
        /// The lease folder.
        location: String,
    },
    /// The output table holds a batch this run was about to commit: another instance ran it.
    #[error(
        "another instance committed batch {batch_id} of job '{job_id}' to {table} while this run \
         was processing it; this run stops without touching the checkpoint (restart it if the \
         other instance is gone — it continues after the last committed batch)"
    )]
    AnotherInstance {
        /// The job.
        job_id: String,
        /// The batch.
        batch_id: BatchId,
        /// The output table.
        table: String,
    },
    /// A side table (dead letters, late rows) holds a later batch of the job than it may: it was
    /// left by an earlier run whose output table or checkpoint was deleted since.
    #[error(
        "the {role} table {table} already holds batch {found} of job '{job_id}', ahead of \
         {expected}: it was written by an earlier run of this job whose output table or \
         checkpoint has been deleted since, and skipping it would lose this run's {role} rows. \
         Delete it as well to reprocess from scratch, or give the job another {role} table \
         path; nothing was committed"
    )]
    SideTableAhead {
        /// "dead-letter" or "late".
        role: String,
        /// The side table.
        table: String,
        /// The job.
        job_id: String,
        /// The batch it holds.
        found: BatchId,
        /// What it is ahead of, in words.
        expected: String,
    },
    /// The checkpoint's state was written by a query whose stateful operators differ from this
    /// one's (another window, other keys or aggregates, an operator added or removed):
    /// restoring it would mix two queries' results in one table.
    #[error(
        "the checkpoint {checkpoint} holds state of operator {operator} written by {recorded}, \
         but this query plans {planned}: the state means something else now, and merging it \
         would mix two queries' results. Restore the job's earlier query, or start it over \
         with a new checkpoint and output table (then `sluice backfill` the past); nothing was \
         read or committed"
    )]
    StateOfAnotherQuery {
        /// The operator id, e.g. `0-aggregate`.
        operator: String,
        /// The checkpoint folder.
        checkpoint: String,
        /// What wrote the state: the recorded fingerprint, or "a query without it".
        recorded: String,
        /// What this query plans for the operator: its fingerprint, or "no such operator".
        planned: String,
    },
    /// The checkpoint holds batches the output table does not know: the table was deleted or
    /// replaced while the checkpoint was kept.
    #[error(
        "the output table {table} holds no batch of job '{job_id}', but the job's checkpoint \
         {checkpoint} holds batches up to {newest}: the table was deleted or replaced while the \
         checkpoint was kept. Delete the checkpoint too to start over, or restore the table"
    )]
    StaleCheckpoint {
        /// The job.
        job_id: String,
        /// The output table.
        table: String,
        /// The checkpoint.
        checkpoint: String,
        /// The newest batch folder in it.
        newest: i64,
    },
    /// A row failed an expectation whose `on_failure` is `fail`.
    #[error(
        "expectation '{name}' (check = \"{check}\") failed on {failing} row(s) of the batch; the \
         first, from {position}: {row}. Nothing of the batch was committed: fix the input, or \
         change the expectation's on_failure (warn, drop, quarantine)"
    )]
    ExpectationFailed {
        /// The expectation.
        name: String,
        /// Its predicate.
        check: String,
        /// Rows of the batch failing it.
        failing: u64,
        /// The first failing output row, as JSON.
        row: String,
        /// Where it came from (`file.json:17`, `partition@offset`).
        position: String,
    },
    /// A batch's dead letters exceeded `[sink] max_dead_letter_fraction`.
    #[error(
        "batch {batch_id} was not committed: {dead} of the {read} records it read ({percent:.1}%) \
         are dead letters, above [sink] max_dead_letter_fraction = {fraction}. Most common \
         reasons: {reasons}. A job that dead-letters most of its input is misconfigured (wrong \
         format, schema or event-time settings); fix that, or raise max_dead_letter_fraction \
         (1.0 turns the check off) to commit such batches"
    )]
    TooManyDeadLetters {
        /// The batch.
        batch_id: BatchId,
        /// Its dead letters.
        dead: u64,
        /// Records it read, dead letters included.
        read: u64,
        /// `dead / read`, in percent.
        percent: f64,
        /// The setting.
        fraction: f64,
        /// The three most common reasons with their counts.
        reasons: String,
    },
    /// A backfill of a job whose sink cannot replace rows ([`crate::Sink::can_replace`]).
    #[error(
        "the sink writing to {location} cannot replace rows, so the job cannot be backfilled: \
         backfill replaces what its range covers in one commit, which needs a sink that can \
         (delta); nothing was read or written"
    )]
    CannotReplace {
        /// The sink's location.
        location: String,
    },
    /// A location on a store this build does not have (a cargo feature of the `sluice` crate).
    #[error(
        "location {location} is not supported: Sluice was built without its `{feature}` feature \
         (this build reads and writes local paths and {schemes} URLs)"
    )]
    StoreNotBuilt {
        /// The location.
        location: String,
        /// The feature that builds its store: `s3`, `gcs` or `azure`.
        feature: String,
        /// The URL schemes this build has, as `file://, s3://, …`.
        schemes: String,
    },
    /// A source failed; the message names the source and what it was reading.
    #[error("source '{source_name}': {source}")]
    Source {
        /// The source's name in the job (its SQL table name).
        source_name: String,
        /// What went wrong, naming partition/offset/file where known: the source's own error
        /// (e.g. `sluice_connectors::ConnectorError`), or a message.
        source: BoxError,
    },
    /// A static table (joined whole, see [`crate::static_table`]) failed to open or read.
    #[error("table '{table_name}': {source}")]
    StaticTable {
        /// The table's name in the job (its SQL table name).
        table_name: String,
        /// What went wrong: the table's own error, or a message.
        source: BoxError,
    },
    /// The sink failed to write or commit: the sink's own error (e.g.
    /// `sluice_sinks::SinkError`), or a message.
    #[error("sink: {0}")]
    Sink(#[source] BoxError),
    /// Any other I/O failure.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of the source named `source_name` (its SQL table name): `cause` is the
    /// source's own error, or a message (`&str`, `String`).
    pub fn in_source(source_name: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Error::Source {
            source_name: source_name.into(),
            source: cause.into(),
        }
    }

    /// An error of the static table named `table_name`: `cause` is the table's own error, or
    /// a message.
    pub fn in_table(table_name: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        Error::StaticTable {
            table_name: table_name.into(),
            source: cause.into(),
        }
    }

    /// The first error of type `E` in this error's chain (itself, its source, its source's
    /// source, …): how a caller matches a source's or a sink's own error.
    ///
    /// ```
    /// use sluice_engine::Error;
    /// let io = std::io::Error::new(std::io::ErrorKind::NotFound, "page 7");
    /// let error = Error::in_source("pages", io);
    /// let found = error.find::<std::io::Error>().map(|e| e.kind());
    /// assert_eq!(found, Some(std::io::ErrorKind::NotFound));
    /// ```
    pub fn find<E: std::error::Error + 'static>(&self) -> Option<&E> {
        find_in_chain(self)
    }
}

/// The first error of type `E` in `error`'s chain of sources, `error` included; an `E` in a
/// `Box<E>` counts (a large error is often boxed).
pub fn find_in_chain<'a, E: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a E> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        if let Some(found) = e.downcast_ref::<Box<E>>() {
            return Some(found);
        }
        next = e.source();
    }
    None
}
