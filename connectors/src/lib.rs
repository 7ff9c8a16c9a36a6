//! # sluice-connectors
//!
//! Sources for Sluice: implementations of [`sluice_engine::Source`]. The engine knows none of
//! them; the `sluice` binary maps a job file's `kind = "…"` to one of these.
//!
//! - [`files::FilesSource`] (`kind = "files"`): a directory of newline-delimited JSON, CSV or
//!   Parquet files (JSON and CSV may be gzipped); one partition `"0"` whose offsets are positions
//!   in the recorded order in which files were first seen.
//! - [`kafka::KafkaSource`] (`kind = "kafka"`): topics of a Kafka-protocol broker; Kafka
//!   partitions and offsets are the source's partitions and offsets.
//! - [`files_table::FilesTable`] (`[tables.NAME] kind = "files"`): a folder of JSON lines, CSV
//!   or Parquet files joined whole as a static table, its version the fingerprint of its listing.
//! - [`nexmark::NexmarkSource`] (`kind = "nexmark"`): the Nexmark benchmark's generator; every
//!   event a pure function of `(seed, event number)`.
//!
//! Both decode text records through the shared `decode` module (bad records found per line, at
//! about the cost of a good one), infer a missing schema with `infer` (types a few bad values cannot decide) and
//! fix it in their checkpoint with `schema_log`.

pub mod files;
pub mod files_table;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod nexmark;

mod decode;
mod error;
pub mod evolve;
mod flat_json;
mod infer;
mod schema_log;
pub use error::{ConnectorError, Result};
