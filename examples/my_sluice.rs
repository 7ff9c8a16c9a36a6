//! Your own `sluice` binary: the whole command line (run, validate, backfill, reconcile,
//! status, vacuum) with your functions and your kind of source registered, so your job files can
//! use them.
//!
//! `cargo run --example my_sluice -- run examples/udf_job.toml` runs a job file whose SQL calls
//! `page_section` and `amount_range` (defined in `examples/shared/functions.rs`); the stock
//! `sluice` binary refuses that file, naming the function it does not know. A job file may also
//! read `[sources.NAME] kind = "paged_http"` with `url = "http://…"` (and `pages_per_batch`):
//! the source of `examples/shared/paged_http_source.rs`; and write `[sink] kind =
//! "parquet_files"` with `path` (and `storage_options`): the sink of
//! `examples/shared/parquet_files_sink.rs`.

#[path = "shared/functions.rs"]
mod functions;
#[path = "shared/paged_http_source.rs"]
mod paged_http_source;
#[path = "shared/parquet_files_sink.rs"]
mod parquet_files_sink;

use std::process::ExitCode;

use paged_http_source::{PagedHttpConfig, PagedHttpSource};
use parquet_files_sink::{ParquetFilesConfig, ParquetFilesSink};
use sluice::Registry;
use sluice::engine::location::directory_url;

fn main() -> ExitCode {
    let registry = Registry::new()
        .with_udf(functions::page_section())
        .with_udaf(functions::amount_range())
        .with_source("paged_http", |section| {
            let config: PagedHttpConfig = section.parse()?;
            Ok(Box::new(PagedHttpSource::new(config)))
        })
        .with_sink("parquet_files", |section| {
            let config: ParquetFilesConfig = section.parse()?;
            let url = directory_url(&section.resolve(&config.path))?;
            let options = config
                .storage_options
                .with_unavailable_timeout(section.store_unavailable_timeout);
            Ok(Box::new(ParquetFilesSink::new(url, options)?))
        });
    sluice::cli::run(registry)
}
