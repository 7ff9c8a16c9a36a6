//! # sluice-sinks
//!
//! Sinks for Sluice: implementations of [`sluice_engine::Sink`]. The engine knows none of them;
//! the `sluice` binary maps a job file's `[sink] kind = "…"` to one of these.
//!
//! - [`delta::DeltaSink`] (`kind = "delta"`): a Delta table (plus its dead-letter table), each
//!   batch one atomic commit carrying `txn(job_id, batch_id)`.

pub mod delta;

mod error;
mod parquet_write;

pub use error::{Result, SinkError};
