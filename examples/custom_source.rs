//! A source of your own in a job built in Rust: the paged results of an HTTP endpoint, with page
//! numbers as offsets (the source is in `examples/shared/paged_http_source.rs`, which says what
//! makes it a Sluice source).
//!
//! Run with `cargo run --example custom_source [URL OUTPUT_DIR]`. Without a URL it starts a demo
//! service (`examples/shared/paged_clicks_server.rs`) serving 20 pages of 50 clicks and writes
//! `examples/out/custom_source`.

#[path = "shared/paged_clicks_server.rs"]
mod paged_clicks_server;
#[path = "shared/paged_http_source.rs"]
mod paged_http_source;

use std::path::PathBuf;
use std::time::Duration;

use paged_http_source::{PagedHttpConfig, PagedHttpSource};
use sluice::engine::{EventTimeConfig, EventTimeFormat, Job, Trigger};
use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig, table_row_count};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut args = std::env::args().skip(1);
    let url = match args.next() {
        Some(url) => url,
        None => {
            let demo = paged_clicks_server::PagedClicks {
                pages: 20,
                per_page: 50,
                bad_every: 97,
            };
            format!("http://{}", demo.serve().await?)
        }
    };
    let output = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| examples.join("out/custom_source"));

    let event_time = EventTimeConfig {
        max_out_of_orderness: Duration::from_secs(10),
        ..EventTimeConfig::new("ts", EventTimeFormat::Rfc3339)
    };
    let job = Job::builder("paged_clicks")
        .with_source(
            "clicks",
            Box::new(PagedHttpSource::new(PagedHttpConfig {
                url,
                pages_per_batch: 3,
            })),
            Some(event_time),
        )
        .with_sql("SELECT id, user_id, page, amount, ts FROM clicks")
        .with_sink(Box::new(DeltaSink::new(DeltaSinkConfig::new(
            output.to_string_lossy(),
        ))?))
        .with_trigger(Trigger::AvailableNow)
        .build()?;
    let summary = job.run().await?;
    let location = summary
        .location
        .ok_or_else(|| anyhow::anyhow!("the job reported no output location"))?;
    println!(
        "{} batch(es) committed (rows {}, dead-lettered {}); table {} holds {} rows",
        summary.batches_committed,
        summary.rows_out,
        summary.rows_dead_lettered,
        output.display(),
        table_row_count(&location, &Default::default()).await?
    );
    Ok(())
}
