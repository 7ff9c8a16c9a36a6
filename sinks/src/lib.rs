//! # sluice-sinks
//!
//! Sinks for Sluice: implementations of [`sluice_engine::Sink`]. The engine knows none of them;
//! the `sluice` binary maps a job file's `[sink] kind = "…"` to one of these.
//!
//! - [`delta::DeltaSink`] (`kind = "delta"`): a Delta table (plus its dead-letter table), each
//!   batch one atomic commit carrying `txn(job_id, batch_id)`.
//! - [`delta_table::DeltaTableSource`] (`[tables.NAME] kind = "delta"`): a Delta table a query
//!   joins whole, read at the version each batch records (the one reader here: this crate links
//!   delta-rs).

pub mod delta;
pub mod delta_table;

mod compaction;
mod error;
mod parquet_write;

pub use error::{Result, SinkError};
