//! The connectors' error type; it converts into the engine's error, naming the source.

/// What can go wrong in a connector.
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    /// The source's configuration is wrong; the message names the setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A recorded file changed or vanished, so its offsets could not be re-read exactly.
    #[error(
        "file {file} (offset {offset}) changed or vanished since it was recorded ({detail}); \
         files in a source directory must not be modified once written — put new data in new files"
    )]
    FileChanged {
        /// The file.
        file: String,
        /// Its offset.
        offset: i64,
        /// What differs.
        detail: String,
    },
    /// The Kafka broker refused a request in a way retrying cannot fix.
    #[error("kafka ({brokers}): {what}: {detail}")]
    Kafka {
        /// The bootstrap servers.
        brokers: String,
        /// What was being done.
        what: String,
        /// The broker's or client's error.
        detail: String,
    },
    /// Offsets the job still needs were deleted from a Kafka partition (retention, truncation).
    #[error(
        "data loss on {partition}: offset {wanted} is needed but the earliest offset the broker \
         still holds is {earliest} (retention or deletion removed records this job has not \
         read); set fail_on_data_loss = false to skip such gaps (they are counted and logged \
         as dead letters)"
    )]
    DataLoss {
        /// `topic` partition `n`.
        partition: String,
        /// The first offset that is gone.
        wanted: i64,
        /// The earliest offset still there.
        earliest: i64,
    },
    /// A Kafka partition now ends below the offsets the job committed.
    #[error(
        "data loss on {partition}: it now ends at offset {latest}, below the {committed_end} this \
         job has already read — the topic was deleted and recreated, or an unclean leader \
         election lost records. Its new records below {committed_end} would never be read. \
         Start the job afresh (new job id, or delete its output and checkpoint), or set \
         fail_on_data_loss = false to skip them with a dead letter naming the gap"
    )]
    OffsetsBehind {
        /// `topic` partition `n`.
        partition: String,
        /// The partition's latest offset now.
        latest: i64,
        /// Where the job's committed batches end.
        committed_end: i64,
    },
    /// An offset past what a Kafka partition holds.
    #[error(
        "{partition}: offset {wanted} is out of range: the broker holds offsets \
         {earliest}..{latest} ({detail})"
    )]
    OffsetOutOfRange {
        /// `topic` partition `n`.
        partition: String,
        /// The offset asked for.
        wanted: i64,
        /// The earliest offset held.
        earliest: i64,
        /// One past the last offset held.
        latest: i64,
        /// Why this offset was wanted.
        detail: String,
    },
    /// The schema could not be determined.
    #[error("schema: {0}")]
    Schema(String),
    /// Listing or reading the storage failed.
    #[error("storage: {0}")]
    ObjectStore(#[from] object_store::Error),
    /// Local I/O failed.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// Arrow failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// The engine failed (checkpoint access, a location refused).
    #[error("{0}")]
    Engine(#[from] sluice_engine::Error),
}

/// The connectors' result type.
pub type Result<T, E = ConnectorError> = std::result::Result<T, E>;
