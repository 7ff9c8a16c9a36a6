//! # Sluice
//!
//! A micro-batch stream processing engine on Arrow columnar batches. Once per trigger, the driver
//! takes a bounded offset range from every source partition, runs the job's SQL over it with
//! DataFusion, and commits the output, the offsets and the state to a Delta table in one atomic
//! commit — so a job is exactly-once across crashes, and the same job file runs as a stream
//! (`sluice run`) or over a bounded range.
//!
//! This crate is the façade: it re-exports the [`engine`], the [`connectors`] and the [`sinks`],
//! turns a TOML job file into a [`engine::Job`] ([`job_file`]), and holds the command line
//! ([`cli`]). The `sluice` binary is `cli::run(Registry::new())`; a program of your own with
//! its functions and kinds of source and sink in a [`Registry`] gets the same command line.
//!
//! ## A job in a few lines
//!
//! Two JSON records in, a Delta table out (this example runs as a test):
//!
//! ```
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
//! use sluice::engine::Job;
//! use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig, table_row_count};
//!
//! let dir = tempfile::tempdir()?;
//! let input = dir.path().join("clicks");
//! std::fs::create_dir(&input)?;
//! std::fs::write(
//!     input.join("a.json"),
//!     "{\"id\": 1, \"page\": \"/\"}\n{\"id\": 2, \"page\": \"/blog\"}\n",
//! )?;
//! let source = FilesSource::new(FilesSourceConfig {
//!     schema: Some("id BIGINT, page VARCHAR".into()),
//!     ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
//! })?;
//! let sink = DeltaSink::new(DeltaSinkConfig::new(dir.path().join("out").to_string_lossy()))?;
//! let job = Job::builder("pages")
//!     .with_source("clicks", Box::new(source), None)
//!     .with_sql("SELECT id, upper(page) AS page FROM clicks")
//!     .with_sink(Box::new(sink))
//!     .build()?;
//! let summary = job.run().await?;
//! assert_eq!(summary.rows_out, 2);
//! let table = summary.location.expect("a Delta table");
//! assert_eq!(table_row_count(&table, &Default::default()).await?, 2);
//! # Ok(()) }
//! ```

#[cfg(feature = "cli")]
pub mod cli;
pub mod error;
pub mod job_file;
#[cfg(feature = "cli")]
pub mod progress_display;
pub mod registry;
#[cfg(feature = "cli")]
pub mod status_server;

pub use error::{Error, Result};
pub use registry::Registry;

pub use sluice_connectors as connectors;
pub use sluice_engine as engine;
pub use sluice_sinks as sinks;
