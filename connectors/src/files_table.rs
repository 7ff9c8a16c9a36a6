//! A folder of plain files joined whole by a streaming query (`[tables.NAME] kind = "files"`):
//! an implementation of [`sluice_engine::StaticTable`] — a dimension table kept as JSON lines,
//! CSV or Parquet files rather than a Delta table.
//!
//! **Version.** Plain files have no history, so a version is a fingerprint of the folder's
//! listing: `<files>-<hash>`, the hash (FNV-1a, 64 bits) over every file's name, size and
//! e-tag (or modification time), sorted by name. The batch intent records the newest
//! fingerprint at planning; a file added, removed or rewritten gives a new one, picked up by the
//! next batch. Reading a version reads the folder again and checks the fingerprint: the files
//! must still be what the intent saw. The engine keeps a snapshot of each version it has read
//! in the checkpoint ([`StaticTable::has_history`] is false), so a rerun, a backfill or a
//! reconcile reads that rather than files that may have changed since.
//!
//! **Rows.** Every file is read whole: JSON lines and CSV (optionally gzipped, by a `.gz`
//! name) with the declared schema, Parquet with its own (or the declared one). A record that
//! does not decode fails the read, naming the file: a dimension table with a broken row is
//! not joined partly.

use std::io::Read;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice_engine::storage::{StorageOptions, open_store};
use sluice_engine::{BoxError, StaticTable};
use url::Url;

use crate::files::FileFormat;

/// A folder of files read whole at the listing each batch's intent records.
#[derive(Debug)]
pub struct FilesTable {
    url: Url,
    format: FileFormat,
    /// The declared schema, as SQL column definitions (`None`: Parquet's own).
    declared: Option<String>,
    /// CSV: whether each file starts with a header line.
    header: bool,
    /// CSV: the field delimiter.
    delimiter: u8,
    options: StorageOptions,
    store: Option<(Arc<dyn ObjectStore>, Path)>,
    schema: Option<SchemaRef>,
}

/// One listed file.
struct Listed {
    location: Path,
    size: u64,
    /// The e-tag, or the modification time when the store has none.
    identity: String,
}

impl FilesTable {
    /// The files under `url` in `format`; `schema` (SQL column definitions, `"id BIGINT,
    /// country VARCHAR"`) is required for JSON and CSV. CSV files have a header line and `,`
    /// between fields unless [`FilesTable::with_csv`] says otherwise.
    pub fn new(
        url: Url,
        format: FileFormat,
        schema: Option<String>,
        options: StorageOptions,
    ) -> Self {
        FilesTable {
            url,
            format,
            declared: schema,
            header: true,
            delimiter: b',',
            options,
            store: None,
            schema: None,
        }
    }

    /// CSV: whether files start with a header line, and the field delimiter.
    pub fn with_csv(mut self, header: bool, delimiter: u8) -> Self {
        self.header = header;
        self.delimiter = delimiter;
        self
    }

    fn store(&self) -> Result<&(Arc<dyn ObjectStore>, Path), BoxError> {
        self.store
            .as_ref()
            .ok_or_else(|| format!("table {} used before open()", self.url).into())
    }

    /// The folder's files, sorted by name (hidden files and folders left out).
    async fn list(&self) -> Result<Vec<Listed>, BoxError> {
        let (store, prefix) = self.store()?;
        let mut files: Vec<Listed> = store
            .list(Some(prefix))
            .map_ok(|meta| Listed {
                identity: meta
                    .e_tag
                    .clone()
                    .unwrap_or_else(|| meta.last_modified.timestamp_micros().to_string()),
                size: meta.size,
                location: meta.location,
            })
            .try_collect()
            .await?;
        files.retain(|f| {
            let name = f.location.filename().unwrap_or_default();
            !name.starts_with('.') && !name.starts_with('_')
        });
        files.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(files)
    }

    /// The version of a listing: the number of files and a hash of names, sizes and
    /// identities.
    fn version_of(files: &[Listed]) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for f in files {
            let line = format!("{}\t{}\t{}\n", f.location, f.size, f.identity);
            for byte in line.bytes() {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{}-{hash:016x}", files.len())
    }

    /// The rows of one file.
    fn decode(
        &self,
        schema: &SchemaRef,
        name: &str,
        bytes: Bytes,
    ) -> Result<Vec<RecordBatch>, BoxError> {
        let fail = |e: &dyn std::fmt::Display| -> BoxError {
            format!("file {name} of table {} does not decode: {e}", self.url).into()
        };
        if self.format == FileFormat::Parquet {
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
                .map_err(|e| fail(&e))?
                .build()
                .map_err(|e| fail(&e))?;
            let batches = reader
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail(&e))?;
            return batches
                .into_iter()
                .map(|b| conform(&b, schema).map_err(|e| fail(&e)))
                .collect();
        }
        let text: Vec<u8> = if name.ends_with(".gz") {
            let mut out = Vec::new();
            flate2::read::MultiGzDecoder::new(bytes.as_ref())
                .read_to_end(&mut out)
                .map_err(|e| fail(&e))?;
            out
        } else {
            bytes.to_vec()
        };
        let batches: Result<Vec<RecordBatch>, _> = match self.format {
            FileFormat::Csv => arrow::csv::ReaderBuilder::new(Arc::clone(schema))
                .with_header(self.header)
                .with_delimiter(self.delimiter)
                .build(text.as_slice())
                .map_err(|e| fail(&e))?
                .collect(),
            _ => arrow::json::ReaderBuilder::new(Arc::clone(schema))
                .build(text.as_slice())
                .map_err(|e| fail(&e))?
                .collect(),
        };
        batches.map_err(|e| fail(&e))
    }
}

/// `batch`'s columns in `schema`'s order, by name (a column the file lacks is refused).
fn conform(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    let columns = schema
        .fields()
        .iter()
        .map(|f| {
            let column = batch
                .column_by_name(f.name())
                .ok_or_else(|| format!("it has no column {}", f.name()))?;
            if column.data_type() == f.data_type() {
                Ok(Arc::clone(column))
            } else {
                arrow::compute::cast(column, f.data_type()).map_err(|e| {
                    format!(
                        "its column {} is {}, not {}: {e}",
                        f.name(),
                        column.data_type(),
                        f.data_type()
                    )
                })
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(Arc::clone(schema), columns).map_err(|e| e.to_string())
}

#[async_trait]
impl StaticTable for FilesTable {
    async fn open(&mut self) -> Result<SchemaRef, BoxError> {
        self.store = Some(open_store(&self.url, &self.options)?);
        let schema = match (&self.declared, self.format) {
            (Some(ddl), _) => sluice_engine::schema::parse_schema(ddl).await?,
            (None, FileFormat::Parquet) => {
                let files = self.list().await?;
                let first = files.first().ok_or_else(|| {
                    format!(
                        "table {} has no files to take a Parquet schema from; declare schema",
                        self.url
                    )
                })?;
                let (store, _) = self.store()?;
                let bytes = store.get(&first.location).await?.bytes().await?;
                let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)
                    .map_err(|e| format!("file {} of table {}: {e}", first.location, self.url))?;
                Arc::clone(builder.schema())
            }
            (None, _) => {
                return Err(format!(
                    "a JSON or CSV table needs its columns declared: schema = \"id BIGINT, …\" (table {})",
                    self.url
                )
                .into());
            }
        };
        self.schema = Some(Arc::clone(&schema));
        Ok(schema)
    }

    async fn latest_version(&self) -> Result<String, BoxError> {
        Ok(Self::version_of(&self.list().await?))
    }

    async fn read(&self, version: &str) -> Result<Vec<RecordBatch>, BoxError> {
        let files = self.list().await?;
        let now = Self::version_of(&files);
        if now != version {
            return Err(format!(
                "the files of table {} changed since version {version} was recorded (they are \
                 version {now} now), and plain files keep no history: a version is readable only \
                 from the snapshot the job took when it first read it",
                self.url
            )
            .into());
        }
        let schema = self
            .schema
            .clone()
            .ok_or_else(|| format!("table {} used before open()", self.url))?;
        let (store, _) = self.store()?;
        let mut rows = Vec::new();
        for file in &files {
            let bytes = store.get(&file.location).await?.bytes().await?;
            rows.extend(self.decode(&schema, file.location.as_ref(), bytes)?);
        }
        Ok(rows.into_iter().filter(|b| b.num_rows() > 0).collect())
    }

    fn has_history(&self) -> bool {
        false
    }

    fn location(&self) -> String {
        self.url.to_string()
    }
}
