//! The bundled clicks job with its query built by DataFusion's DataFrame API instead of SQL.
//!
//! The query is the same as `examples/builder.rs`'s SQL (`SELECT id, user_id, upper(page) AS
//! page, amount, ts FROM clicks WHERE amount > 10`): the closure gets the session with every
//! source registered as a table and returns the plan. It is planned once, like SQL, and the
//! lineage columns are carried through it the same way.
//!
//! Run with `cargo run --example dataframe [INPUT_DIR OUTPUT_DIR]` (default: the bundled clicks
//! into `examples/out/clicks_dataframe`).

use std::path::PathBuf;
use std::time::Duration;

use sluice::connectors::files::{FileFormat, FilesSource, FilesSourceConfig};
use sluice::engine::datafusion::prelude::{col, lit, upper};
use sluice::engine::{EventTimeConfig, EventTimeFormat, Job, Trigger};
use sluice::sinks::delta::{DeltaSink, DeltaSinkConfig, table_row_count};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let input = args.next().unwrap_or_else(|| examples.join("data/clicks"));
    let output = args
        .next()
        .unwrap_or_else(|| examples.join("out/clicks_dataframe"));

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

    let job = Job::builder("clicks_dataframe")
        .with_source("clicks", Box::new(source), Some(event_time))
        .with_query(|ctx| async move {
            ctx.table("clicks")
                .await?
                .filter(col("amount").gt(lit(10.0)))?
                .select(vec![
                    col("id"),
                    col("user_id"),
                    upper(col("page")).alias("page"),
                    col("amount"),
                    col("ts"),
                ])
        })
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
