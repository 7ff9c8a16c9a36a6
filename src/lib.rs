//! # Sluice
//!
//! A micro-batch stream processing engine on Arrow columnar batches. Once per trigger, the driver
//! takes a bounded offset range from every source partition, runs the job's SQL over it with
//! DataFusion, and commits the output, the offsets and the state to a Delta table in one atomic
//! commit — so a job is exactly-once across crashes, and the same job file runs as a stream
//! (`sluice run`) or over a bounded range.
//!
//! This crate is the façade: it re-exports the [`engine`], the [`connectors`] and the [`sinks`],
//! and turns a TOML job file into a [`engine::Job`] ([`job_file`]). The `sluice` binary is a thin
//! command line over it.

pub mod job_file;
pub mod progress_display;
pub mod status_server;

pub use sluice_connectors as connectors;
pub use sluice_engine as engine;
pub use sluice_sinks as sinks;
