//! The bundled clicks job, defined in Rust with the builder API instead of a job file.
//!
//! Run with `cargo run --example builder [OUTPUT]`; it writes `examples/out/clicks_builder`, or
//! the table at OUTPUT (a path or a URL such as `s3://bucket/clicks`).

use std::time::Duration;

use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::engine::{EventTimeConfig, EventTimeFormat, Job, Trigger};
use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig, table_row_count};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let examples = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("examples");
    let input = examples.join("data/clicks");
    let output = match std::env::args().nth(1) {
        Some(location) => location,
        None => examples
            .join("out/clicks_builder")
            .to_string_lossy()
            .into_owned(),
    };

    let source = FilesSource::new(FilesSourceConfig {
        schema: Some("id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP".into()),
        max_files_per_batch: 2,
        ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
    })?;
    let event_time = EventTimeConfig {
        max_out_of_orderness: Duration::from_secs(10),
        ..EventTimeConfig::new("ts", EventTimeFormat::Rfc3339)
    };
    let sink = DeltaSink::new(DeltaSinkConfig::new(output.clone()))?;

    let job = Job::builder("clicks_builder")
        .with_source("clicks", Box::new(source), Some(event_time))
        .with_sql(
            "SELECT id, user_id, upper(page) AS page, amount, ts \
             FROM clicks WHERE amount > 10",
        )
        .with_sink(Box::new(sink))
        .with_trigger(Trigger::AvailableNow)
        .build()?;
    let summary = job.run().await?;

    let location = summary
        .location
        .ok_or_else(|| anyhow::anyhow!("the job reported no output location"))?;
    println!(
        "{} batch(es) committed; table {} holds {} rows",
        summary.batches_committed,
        output,
        table_row_count(&location, &Default::default()).await?
    );
    Ok(())
}
