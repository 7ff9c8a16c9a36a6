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
    /// The engine failed (checkpoint access).
    #[error(transparent)]
    Engine(#[from] sluice_engine::Error),
}

/// The connectors' result type.
pub type Result<T, E = ConnectorError> = std::result::Result<T, E>;
