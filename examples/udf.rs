//! A windowed job that calls a scalar function and an aggregate function written in Rust.
//!
//! Clicks per site section (`page_section(page)`, a scalar UDF) per minute of event time, with
//! the spread of the amounts (`amount_range(amount)`, a UDAF whose min/max state is carried
//! between batches in Sluice's state files, so a crash and restart resume it exactly).
//!
//! Run with `cargo run --example udf [INPUT_DIR OUTPUT_DIR]` (default: the bundled clicks into
//! `examples/out/udf`). Rerunning continues after the last committed batch.

#[path = "shared/functions.rs"]
mod functions;

use std::path::PathBuf;
use std::time::Duration;

use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::engine::{EventTimeConfig, EventTimeFormat, Job, Trigger};
use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig, table_row_count};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let input = args.next().unwrap_or_else(|| examples.join("data/clicks"));
    let output = args.next().unwrap_or_else(|| examples.join("out/udf"));

    let source = FilesSource::new(FilesSourceConfig {
        schema: Some("id BIGINT, user_id BIGINT, page VARCHAR, amount DOUBLE, ts TIMESTAMP".into()),
        max_files_per_batch: 2,
        ..FilesSourceConfig::new(input.to_string_lossy(), FileFormat::Json)
    })?;
    let event_time = EventTimeConfig {
        max_out_of_orderness: Duration::from_secs(10),
        ..EventTimeConfig::new("ts", EventTimeFormat::Rfc3339)
    };
    let sink = DeltaSink::new(DeltaSinkConfig::new(output.to_string_lossy()))?;

    let job = Job::builder("clicks_by_section")
        .with_source("clicks", Box::new(source), Some(event_time))
        .with_udf(functions::page_section())
        .with_udaf(functions::amount_range())
        .with_sql(
            "SELECT window_start, window_end, page_section(page) AS section, \
                    count(*) AS clicks, amount_range(amount) AS amount_range \
             FROM tumble(clicks, ts, INTERVAL '1' MINUTE) \
             GROUP BY window_start, window_end, page_section(page)",
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
        output.display(),
        table_row_count(&location, &Default::default()).await?
    );
    Ok(())
}
