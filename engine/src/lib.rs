//! # sluice-engine
//!
//! The core of Sluice, a micro-batch stream processor on Arrow batches that commits exactly-once
//! to Delta tables. This crate owns the concepts; concrete sources live in `sluice-connectors`,
//! concrete sinks in `sluice-sinks`, and this crate knows none of them.
//!
//! ## Architecture
//!
//! ```text
//!   Source (partitions, offsets)        StreamingQuery (DataFusion)          Sink (Delta)
//!   ┌──────────────────────┐  ranges   ┌────────────────────────┐  rows    ┌──────────────────┐
//!   │ available() read()   │ ────────► │ plan once, run a batch │ ───────► │ commit(batch_id) │
//!   └──────────────────────┘           └────────────────────────┘          └──────────────────┘
//!              ▲                                                                    │
//!              │ intent.json / manifest.json (CheckpointStore)      txn(job_id, batch_id)
//!              └──────────────────────────── driver ◄───────────── committed_batch() ┘
//! ```
//!
//! The [`driver`] runs one batch at a time: plan offset ranges, record them as an intent, read,
//! parse event time, execute the query, write the manifest, commit, purge (the next batch's
//! reads may start during the commit; the next intent is still written after it). The output table's
//! `txn` version says which batch is committed, so a crash at any step is recovered by rerunning
//! the intent of the next batch — no row lost, none duplicated.
//!
//! Start reading at [`driver`]; the traits are [`Source`] and [`Sink`].

pub mod backfill;
pub mod checkpoint;
pub mod dead_letter;
pub mod driver;
pub mod error;
pub mod event_time;
pub mod expectations;
pub mod fault;
pub mod input;
pub mod job;
pub mod late;
pub mod lease;
pub mod location;
pub mod memory;
pub mod offsets;
pub mod operators;
pub mod progress;
pub mod query;
pub mod reconcile;
pub mod schema;
pub mod sink;
pub mod source;
pub mod static_table;
pub mod storage;
pub mod watermark;
pub mod window;

pub use checkpoint::{BatchCounters, BatchIntent, BatchManifest, CheckpointStore};
pub use driver::{BatchStats, RunSummary, Validation};
pub use error::{BoxError, Error, Result};
pub use event_time::{EventTimeConfig, EventTimeFormat};
pub use expectations::{Expectation, OnFailure};
pub use job::{Job, JobBuilder, SourceSpec, Trigger, parse_duration};
pub use offsets::{BatchId, Offset, OffsetRange, PartitionId};
pub use query::{Functions, Query};
pub use sink::{
    BatchCommit, CommitOutcome, Compaction, OutputMode, OutputTables, RecomputedRows,
    ReplacedWindows, Replacement, SideTableBatch, Sink, TableScan,
};
pub use source::{
    AvailableRange, DeadLetter, InferredColumn, PositionForm, SchemaInference, Source,
    SourceContext, SourceRead, cpu_bound,
};
pub use static_table::{StaticTable, TableSpec};

/// Re-exported so connectors and sinks use the engine's exact versions.
pub use arrow;
/// Re-exported so connectors and sinks use the engine's exact versions.
pub use datafusion;
/// Re-exported so connectors and sinks use the engine's exact versions.
pub use object_store;
