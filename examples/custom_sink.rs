//! A sink of your own in a job built in Rust: Parquet files in a folder, exactly-once (the sink
//! is in `examples/shared/parquet_files_sink.rs`, which says what makes it a Sluice sink).
//!
//! Run with `cargo run --example custom_sink [INPUT_DIR OUTPUT_DIR]` (default: the bundled clicks
//! into `examples/out/custom_sink`).

#[path = "shared/parquet_files_sink.rs"]
mod parquet_files_sink;

use std::path::PathBuf;
use std::time::Duration;

use parquet_files_sink::ParquetFilesSink;
use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::engine::storage::StorageOptions;
use sluice::engine::{EventTimeConfig, EventTimeFormat, Job, Trigger};
use url::Url;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let input = args.next().unwrap_or_else(|| examples.join("data/clicks"));
    let output = args
        .next()
        .unwrap_or_else(|| examples.join("out/custom_sink"));
    std::fs::create_dir_all(&output)?;
    let url = Url::from_directory_path(std::fs::canonicalize(&output)?)
        .map_err(|()| anyhow::anyhow!("{} is not an absolute path", output.display()))?;

    let source = FilesSource::new(FilesSourceConfig {
        schema: Some("id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP".into()),
        max_files_per_batch: 2,
        ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
    })?;
    let event_time = EventTimeConfig {
        max_out_of_orderness: Duration::from_secs(10),
        ..EventTimeConfig::new("ts", EventTimeFormat::Rfc3339)
    };
    let job = Job::builder("clicks_to_parquet")
        .with_source("clicks", Box::new(source), Some(event_time))
        .with_sql("SELECT id, user_id, page, amount, ts FROM clicks")
        .with_sink(Box::new(ParquetFilesSink::new(
            url,
            StorageOptions::default(),
        )?))
        .with_trigger(Trigger::AvailableNow)
        .build()?;
    let summary = job.run().await?;
    println!(
        "{} batch(es) committed (rows out {}, dead-lettered {}) into {}",
        summary.batches_committed,
        summary.rows_out,
        summary.rows_dead_lettered,
        output.display(),
    );
    Ok(())
}
