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

pub mod cli;
pub mod job_file;
pub mod progress_display;
pub mod registry;
pub mod status_server;

pub use registry::Registry;

pub use sluice_connectors as connectors;
pub use sluice_engine as engine;
pub use sluice_sinks as sinks;
