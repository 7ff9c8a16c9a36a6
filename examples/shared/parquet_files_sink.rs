//! `ParquetFilesSink`: a sink of your own, Parquet files in a folder (local or any object store),
//! exactly-once. Used by `examples/custom_sink.rs` (a job built in Rust) and
//! `examples/my_sluice.rs` (a binary whose job files name it: `kind = "parquet_files"`).
//!
//! What makes it a Sluice sink (see the `Sink` trait's contract):
//! - **one atomic commit per batch that records the batch id**: the batch's files are written
//!   first, under names no other attempt uses (a crashed attempt's files stay unlisted and are
//!   never read), then a commit marker `_commits/<job>/<batch>.json` listing them is created
//!   with a conditional put (`PutMode::Create`). The marker is the commit: readers read only
//!   files a marker lists, so a committed batch's files never change, and a second attempt at
//!   a committed batch (a rerun, a paused twin) loses the put and writes nothing visible;
//! - **the sink is the record of progress**: `committed_batch` is the newest marker, so a
//!   restart continues after it;
//! - **side tables**: dead letters and late rows go to `dead_letters/` and `late/` the same way,
//!   listed by the same marker (one marker makes all of a batch visible at once);
//! - **reads without `open`**: reconcile and backfill read the output and dead letters of a sink
//!   they never opened, so the read methods work from the location alone (every marker in
//!   `_commits/`, whichever job wrote it: the folder is the table);
//! - **what it cannot do, it refuses**: update mode (no MERGE over Parquet files) when the job
//!   starts; it cannot replace rows (`can_replace` is false), so a backfill of its job is refused
//!   before it reads anything.

// Each program including this file uses a part of it.
#![allow(dead_code)]

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sluice::engine::arrow::array::RecordBatch;
use sluice::engine::arrow::datatypes::SchemaRef;
use sluice::engine::datafusion::datasource::MemTable;
use sluice::engine::datafusion::parquet::arrow::ArrowWriter;
use sluice::engine::datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice::engine::datafusion::prelude::SessionContext;
use sluice::engine::object_store::path::Path;
use sluice::engine::object_store::{ObjectStore, ObjectStoreExt, PutMode, PutPayload};
use sluice::engine::storage::{StorageOptions, open_store};
use sluice::engine::{
    BatchCommit, BatchId, CommitOutcome, Error, OutputTables, Result, Sink, TableScan,
};
use url::Url;

/// The `[sink]` keys of `kind = "parquet_files"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParquetFilesConfig {
    /// The folder (a local path, relative to the job file, or a URL).
    pub path: String,
    /// How its store is configured (keys as object_store spells them).
    #[serde(default)]
    pub storage_options: StorageOptions,
}

/// What one batch's commit marker lists.
#[derive(Debug, Serialize, Deserialize)]
struct CommitMarker {
    batch_id: i64,
    output: Vec<String>,
    dead_letters: Vec<String>,
    late: Vec<String>,
    rows: u64,
}

/// Parquet files in a folder, one commit marker per batch.
pub struct ParquetFilesSink {
    url: Url,
    options: StorageOptions,
    store: Arc<dyn ObjectStore>,
    root: Path,
    job_id: String,
}

impl ParquetFilesSink {
    /// A sink writing into the folder `url`.
    pub fn new(url: Url, options: StorageOptions) -> Result<Self> {
        let (store, root) = open_store(&url, &options)?;
        Ok(ParquetFilesSink {
            url,
            options,
            store,
            root,
            job_id: String::new(),
        })
    }

    fn path(&self, rel: &str) -> Path {
        rel.split('/')
            .fold(self.root.clone(), |path, part| path.join(part))
    }

    fn marker(&self, job_id: &str, batch: BatchId) -> String {
        format!("_commits/{job_id}/{:020}.json", batch.0)
    }

    /// Writes `batches` as one Parquet file at `rel` (nothing if they hold no row); returns its
    /// name and size.
    async fn write_file(
        &self,
        rel: String,
        batches: &[RecordBatch],
    ) -> Result<Option<(String, u64)>> {
        let Some(first) = batches.iter().find(|b| b.num_rows() > 0) else {
            return Ok(None);
        };
        let mut bytes = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut bytes, first.schema(), None)?;
        for batch in batches.iter().filter(|b| b.num_rows() > 0) {
            writer.write(batch)?;
        }
        writer.close()?;
        let size = bytes.len() as u64;
        self.store
            .put(&self.path(&rel), PutPayload::from(bytes))
            .await?;
        Ok(Some((rel, size)))
    }

    /// Every commit marker in the folder (of every job writing it), in job and batch order.
    async fn markers(&self) -> Result<Vec<CommitMarker>> {
        let folder = self.path("_commits");
        let mut names: Vec<Path> = Vec::new();
        let mut listing = self.store.list(Some(&folder));
        while let Some(meta) = futures::StreamExt::next(&mut listing).await {
            names.push(meta?.location);
        }
        names.sort();
        let mut markers = Vec::with_capacity(names.len());
        for name in names {
            let bytes = self.store.get(&name).await?.bytes().await?;
            let marker = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Sink(format!("commit marker {name}: {e}").into()))?;
            markers.push(marker);
        }
        Ok(markers)
    }

    /// The rows of the committed files `pick` chooses from each marker.
    async fn read_committed(
        &self,
        pick: fn(&CommitMarker) -> &Vec<String>,
    ) -> Result<Vec<RecordBatch>> {
        let mut rows = Vec::new();
        for marker in self.markers().await? {
            for file in pick(&marker) {
                let bytes = self.store.get(&self.path(file)).await?.bytes().await?;
                let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)?.build()?;
                for batch in reader {
                    rows.push(batch?);
                }
            }
        }
        Ok(rows)
    }
}

#[async_trait]
impl Sink for ParquetFilesSink {
    fn location(&self) -> &Url {
        &self.url
    }

    fn storage_options(&self) -> StorageOptions {
        self.options.clone()
    }

    async fn open(&mut self, job_id: &str, tables: OutputTables) -> Result<()> {
        if tables.merge_key.is_some() {
            return Err(Error::InvalidJob(
                "the parquet_files sink appends only: update mode needs a sink that can MERGE \
                 (delta)"
                    .into(),
            ));
        }
        self.job_id = job_id.to_string();
        Ok(())
    }

    async fn commit(&self, batch: BatchCommit) -> Result<CommitOutcome> {
        let marker = self.marker(&self.job_id, batch.batch_id);
        match self.store.head(&self.path(&marker)).await {
            Ok(_) => return Ok(CommitOutcome::AlreadyCommitted),
            Err(sluice::engine::object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        // This attempt's own file names: a concurrent or crashed attempt at the same batch
        // never overwrites files a marker lists.
        let attempt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.as_nanos());
        let name = |folder: &str| {
            format!(
                "{folder}/{}-{:020}-{attempt}-{}.parquet",
                self.job_id,
                batch.batch_id.0,
                std::process::id()
            )
        };
        let output = self.write_file(name("data"), &batch.output).await?;
        let dead_letters = self
            .write_file(name("dead_letters"), &batch.dead_letters)
            .await?;
        let late = self.write_file(name("late"), &batch.late).await?;
        let bytes_written = output.as_ref().map_or(0, |(_, size)| *size);
        let names = |file: Option<(String, u64)>| file.into_iter().map(|(name, _)| name).collect();
        let rows: usize = batch.output.iter().map(RecordBatch::num_rows).sum();
        let record = CommitMarker {
            batch_id: batch.batch_id.0,
            output: names(output),
            dead_letters: names(dead_letters),
            late: names(late),
            rows: rows as u64,
        };
        // The test hook the engine's crash tests use (`SLUICE_CRASH_AT=after_files:<batch>`):
        // a kill here leaves files no marker lists, which readers ignore and a rerun rewrites.
        sluice::engine::fault::crash_point("after_files", batch.batch_id);
        let bytes = serde_json::to_vec_pretty(&record)
            .map_err(|e| Error::Sink(format!("commit marker: {e}").into()))?;
        // The commit: created only if absent, so two writers can never both commit a batch.
        let created = self
            .store
            .put_opts(
                &self.path(&marker),
                PutPayload::from(bytes),
                PutMode::Create.into(),
            )
            .await;
        match created {
            Ok(_) => Ok(CommitOutcome::Committed {
                rows: rows as u64,
                files: record.output.len() as u64,
                bytes: bytes_written,
                version: None,
            }),
            Err(sluice::engine::object_store::Error::AlreadyExists { .. }) => {
                Ok(CommitOutcome::AlreadyCommitted)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn can_replace(&self) -> bool {
        // No replacement of rows over Parquet files and markers: a backfill is refused.
        false
    }

    async fn committed_batch(&self, job_id: &str) -> Result<Option<BatchId>> {
        let folder = self.path(&format!("_commits/{job_id}"));
        let mut newest = None;
        let mut listing = self.store.list(Some(&folder));
        while let Some(meta) = futures::StreamExt::next(&mut listing).await {
            let meta = meta?;
            let batch = meta
                .location
                .filename()
                .and_then(|f| f.strip_suffix(".json"))
                .and_then(|n| n.parse::<i64>().ok());
            newest = newest.max(batch);
        }
        Ok(newest.map(BatchId))
    }

    async fn read_output(&self) -> Result<Vec<RecordBatch>> {
        self.read_committed(|m| &m.output).await
    }

    async fn read_late(&self, scan: &TableScan) -> Result<Vec<RecordBatch>> {
        scanned(self.read_committed(|m| &m.late).await?, scan).await
    }

    async fn read_dead_letters(&self, scan: &TableScan) -> Result<Vec<RecordBatch>> {
        scanned(self.read_committed(|m| &m.dead_letters).await?, scan).await
    }
}

/// The columns and rows of `rows` that `scan` asks for.
async fn scanned(rows: Vec<RecordBatch>, scan: &TableScan) -> Result<Vec<RecordBatch>> {
    let Some(first) = rows.first() else {
        return Ok(rows);
    };
    let schema: SchemaRef = first.schema();
    let ctx = SessionContext::new();
    ctx.register_table("t", Arc::new(MemTable::try_new(schema, vec![rows])?))?;
    let columns = match &scan.columns {
        Some(columns) => columns
            .iter()
            .map(|c| format!("\"{c}\""))
            .collect::<Vec<_>>()
            .join(", "),
        None => "*".into(),
    };
    let filter = scan
        .filter
        .as_ref()
        .map(|f| format!(" WHERE {f}"))
        .unwrap_or_default();
    let sql = format!("SELECT {columns} FROM t{filter}");
    Ok(ctx.sql(&sql).await?.collect().await?)
}
