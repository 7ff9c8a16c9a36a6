//! The sinks' error type; it converts into the engine's error.

/// What can go wrong in a sink.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The sink's configuration is wrong; the message names the setting.
    #[error("invalid sink configuration: {0}")]
    Config(String),
    /// Delta Lake failed; the message names the table.
    #[error("delta table {table}: {source}")]
    Delta {
        /// The table's location.
        table: String,
        /// What delta-rs said.
        source: deltalake::DeltaTableError,
    },
    /// The table's schema does not match the query's output.
    #[error(
        "delta table {table} has columns ({existing}) but the job writes ({wanted}); write to a new table or restore the old query"
    )]
    SchemaMismatch {
        /// The table.
        table: String,
        /// Its columns.
        existing: String,
        /// The job's columns.
        wanted: String,
    },
    /// Another writer committed batches of the same job.
    #[error(
        "delta table {table}: expected the last batch of job '{job_id}' to be {expected:?}, found {found:?}; only one instance of a job may run at a time"
    )]
    ConcurrentWriter {
        /// The table.
        table: String,
        /// The job.
        job_id: String,
        /// What this run expected.
        expected: Option<i64>,
        /// What the table holds.
        found: Option<i64>,
    },
    /// Local I/O failed.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The engine refused an input (a location).
    #[error("{0}")]
    Engine(#[from] sluice_engine::Error),
}

impl From<SinkError> for sluice_engine::Error {
    fn from(e: SinkError) -> Self {
        match e {
            SinkError::Engine(inner) => inner,
            other => sluice_engine::Error::Sink(Box::new(other)),
        }
    }
}

/// The sinks' result type.
pub type Result<T, E = SinkError> = std::result::Result<T, E>;
