//! Sluice's end-to-end tests: one test binary that runs the real `sluice` binary against real
//! files, a real Kafka-protocol broker (`tansu`) and real Delta tables, and reads the tables back with delta-rs (Rust) and with the
//! Python `deltalake` package (an independent reader; installed by `./test`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod http;
mod s3_server;
mod support;

mod backfill;
mod cli;
mod contracts;
mod crash;
mod dead_letters;
mod deduplication;
mod evolution;
mod formats;
mod golden;
mod hostile;
mod instances;
mod joins;
mod kafka;
mod library;
mod maintenance;
mod nexmark;
mod object_storage;
mod reconcile;
mod side_tables;
mod status;
mod stream_joins;
mod windows;
