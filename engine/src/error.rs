//! The engine's error type.
//!
//! One enum for the crate, with `#[from]` conversions for the libraries underneath and messages
//! that name the input at fault (source, partition, offset, file, column), so a user reading a
//! log line knows what to fix without reading code.

use crate::offsets::BatchId;

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
    /// A source failed; the message names the source and what it was reading.
    #[error("source '{source_name}': {message}")]
    Source {
        /// The source's name in the job (its SQL table name).
        source_name: String,
        /// What went wrong, naming partition/offset/file where known.
        message: String,
    },
    /// The sink failed to commit.
    #[error("sink: {0}")]
    Sink(String),
    /// Any other I/O failure.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A source error, naming the source.
    pub fn source(source_name: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Error::Source {
            source_name: source_name.into(),
            message: message.to_string(),
        }
    }
}
