//! `PagedHttpSource`: a source of your own, reading the paged results of an HTTP endpoint with
//! page numbers as offsets. Used by `examples/custom_source.rs` (a job built in Rust) and
//! `examples/my_sluice.rs` (a binary whose job files name it: `kind = "paged_http"`).
//!
//! What makes it a Sluice source (see the `Source` trait's contract):
//! - **offsets that replay**: a page number names the same records forever, so a batch that
//!   crashed reads the same rows again. Only complete pages are offered (`available`), since a
//!   page still filling would read differently on a rerun;
//! - **nothing dropped**: a record that does not decode comes back as a `DeadLetter` with its
//!   raw bytes, position and reason, and lands in the dead-letter table;
//! - **CPU work off the async threads**: decoding runs in `cpu_bound`;
//! - **lineage**: every row carries its partition and offset (and a finer position), which is
//!   what backfill and the dead-letter table use.
//!
//! An HTTP error stops the job with the URL in the message; a restart continues exactly. (A
//! production source would retry transient errors with backoff before giving up.)

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;
use sluice::engine::arrow::array::{RecordBatch, StringArray};
use sluice::engine::arrow::compute::concat_batches;
use sluice::engine::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use sluice::engine::arrow::json::ReaderBuilder;
use sluice::engine::source::{attach_lineage, with_lineage_fields};
use sluice::engine::{
    AvailableRange, DeadLetter, Error, OffsetRange, PartitionId, Result, Source, SourceContext,
    SourceRead, cpu_bound,
};

/// The `[sources.NAME]` keys of `kind = "paged_http"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PagedHttpConfig {
    /// The endpoint: `GET {url}/pages`, `GET {url}/clicks/{page}`.
    pub url: String,
    /// Pages one batch reads at most (default 3).
    #[serde(default = "default_pages_per_batch")]
    pub pages_per_batch: u64,
}

fn default_pages_per_batch() -> u64 {
    3
}

/// The one partition: the endpoint is a single sequence of pages.
const PARTITION: &str = "0";

/// Reads `GET {base}/pages` (how many pages are complete) and `GET {base}/clicks/{page}`.
pub struct PagedHttpSource {
    base: String,
    client: reqwest::Client,
    pages_per_batch: u64,
    /// The records' columns; `ts` stays text and Sluice parses it as event time.
    data: SchemaRef,
    name: String,
}

impl PagedHttpSource {
    /// A source reading `config.url`.
    pub fn new(config: PagedHttpConfig) -> Self {
        let (base, pages_per_batch) = (config.url, config.pages_per_batch);
        PagedHttpSource {
            base: base.trim_end_matches('/').to_string(),
            client: reqwest::Client::new(),
            pages_per_batch,
            data: Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, true),
                Field::new("user_id", DataType::Int64, true),
                Field::new("page", DataType::Utf8, true),
                Field::new("amount", DataType::Float64, true),
                Field::new("ts", DataType::Utf8, true),
            ])),
            name: String::new(),
        }
    }

    /// GETs `path` and parses the body as JSON; errors name the source and the URL.
    async fn get(&self, path: &str) -> Result<serde_json::Value> {
        let url = format!("{}{path}", self.base);
        let fail =
            |e: &dyn std::fmt::Display| Error::in_source(&self.name, format!("GET {url}: {e}"));
        let response = self.client.get(&url).send().await.map_err(|e| fail(&e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(fail(&status));
        }
        let body = response.bytes().await.map_err(|e| fail(&e))?;
        serde_json::from_slice(&body).map_err(|e| fail(&e))
    }
}

#[async_trait]
impl Source for PagedHttpSource {
    async fn open(&mut self, ctx: SourceContext) -> Result<SchemaRef> {
        self.name = ctx.name;
        // Fail at start (and at `validate`) on an endpoint that does not answer.
        self.available().await?;
        Ok(with_lineage_fields(&self.data, true))
    }

    async fn available(&self) -> Result<BTreeMap<PartitionId, AvailableRange>> {
        let pages = self.get("/pages").await?;
        let latest = pages["pages"].as_i64().ok_or_else(|| {
            Error::in_source(
                &self.name,
                format!("/pages answered {pages}, not {{\"pages\": N}}"),
            )
        })?;
        let range = AvailableRange { initial: 0, latest };
        Ok(BTreeMap::from([(PARTITION.to_string(), range)]))
    }

    async fn read(&self, partition: &PartitionId, range: OffsetRange) -> Result<SourceRead> {
        let mut read = SourceRead::default();
        for page in range.start..range.end {
            let records = match self.get(&format!("/clicks/{page}")).await? {
                serde_json::Value::Array(records) => records,
                other => {
                    return Err(Error::in_source(
                        &self.name,
                        format!("page {page} is not a JSON array: {other}"),
                    ));
                }
            };
            let data = Arc::clone(&self.data);
            let partition = partition.clone();
            let (rows, dead) =
                cpu_bound(move || decode_page(&data, &partition, page, records)).await?;
            read.batches.extend(rows);
            read.dead_letters.extend(dead);
        }
        Ok(read)
    }

    fn max_per_batch(&self) -> Option<u64> {
        Some(self.pages_per_batch)
    }

    // Its schema is fixed: the driver may read the next pages while a batch commits.
    fn reads_may_grow_schema(&self) -> bool {
        false
    }
}

/// One page's records as rows of `data` (plus lineage), each record that does not decode as a
/// dead letter with the decoder's reason.
fn decode_page(
    data: &SchemaRef,
    partition: &str,
    page: i64,
    records: Vec<serde_json::Value>,
) -> Result<(Option<RecordBatch>, Vec<DeadLetter>)> {
    let mut good = Vec::new();
    let mut positions = Vec::new();
    let mut dead = Vec::new();
    for (i, record) in records.iter().enumerate() {
        let raw = record.to_string();
        let position = format!("page {page} #{i}");
        let mut decoder = ReaderBuilder::new(Arc::clone(data))
            .with_strict_mode(true)
            .build_decoder()?;
        let decoded = decoder.decode(raw.as_bytes()).and_then(|_| decoder.flush());
        match decoded {
            Ok(Some(row)) => {
                good.push(row);
                positions.push(position);
            }
            Ok(None) => dead.push(DeadLetter {
                partition: partition.to_string(),
                offset: page,
                position,
                raw: raw.into_bytes(),
                error: "the record decoded to no row".into(),
            }),
            Err(e) => dead.push(DeadLetter {
                partition: partition.to_string(),
                offset: page,
                position,
                raw: raw.into_bytes(),
                error: e.to_string(),
            }),
        }
    }
    if good.is_empty() {
        return Ok((None, dead));
    }
    let rows = concat_batches(data, &good)?;
    Ok((
        Some(attach_lineage(
            rows,
            partition,
            page,
            Some(StringArray::from(positions)),
        )?),
        dead,
    ))
}
