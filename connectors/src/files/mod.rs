//! The files source: a directory of newline-delimited JSON, CSV or Parquet files.
//!
//! ## Offsets
//! One partition, `"0"`. Offset `n` is the `n`-th file in the order the source first saw files
//! (new files are appended, sorted by name, each time the directory is listed). That order is
//! recorded in the checkpoint (`file_log`: append-only segments, put-if-absent) before any
//! batch can name those offsets, so a batch re-reads exactly the files it read before. A
//! recorded file that changes (size or modification time) or vanishes is an error naming it,
//! never a silent difference. Files whose names start with `.` or `_` are not data (temporary
//! files, markers) and are skipped: write a file under such a name and rename it when complete.
//!
//! ## Listing
//! Planning a batch lists only the names after the greatest name recorded (S3 and friends list
//! from a start key natively; a local directory skips the rest without reading metadata), so its
//! cost follows the new files, not the thousands already recorded. Files are expected to arrive
//! with growing names (timestamps, sequence numbers); one that appears under a smaller name is
//! found by the full listing made at start and every [`FULL_LISTING_EVERY`], and then recorded
//! after the others — late, never lost.
//!
//! ## Decoding
//! JSON and CSV files hold one record per line (`.gz` files are decompressed). A file is decoded
//! in runs of lines (see `decode`: lines checked first, the good ones decoded together); each bad
//! line becomes a dead letter (`file.json:17`, the raw line, the reason) while every good line is
//! kept. A batch's files are fetched in groups of a few megabytes (one large file
//! alone), the group's files and each file's runs decoded in parallel with rayon, and the
//! group's bytes released before the next is fetched. Parquet files are decoded and
//! conformed to the schema by column name; a file that cannot be read is one dead letter.
//!
//! ## Schema
//! Declared in the job file (`schema = "id BIGINT, ts TIMESTAMP"`) or inferred from the first
//! files (10,000 records, across as many files as that takes) by the majority rule of
//! `infer` module — a few bad values cannot make a numeric column text; their records become
//! dead letters — and then fixed in the checkpoint (`schema.json`, with the inference report in
//! `inference.json`), so a later file with an extra field does not change the table.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{RecordBatch, RecordBatchOptions, new_null_array};
use arrow::compute::kernels::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sluice_engine::checkpoint::CheckpointStore;
use sluice_engine::source::{PositionForm, attach_numbered_lineage, with_lineage_fields};
use sluice_engine::storage::{StorageOptions, read_immutable_body};
use sluice_engine::{
    AvailableRange, DeadLetter, InferredColumn, Offset, OffsetRange, PartitionId, SchemaInference,
    Source, SourceContext, SourceRead, cpu_bound,
};
use tokio::sync::Mutex;
use url::Url;

use crate::decode::{data_lines, decode_csv_file, decode_json_lines, kept_columns};
use crate::error::{ConnectorError, Result};
use crate::evolve::{NewFields, SchemaEvolution, fields_to_add, rescue_lines};
use crate::infer::{INFER_RECORDS, infer_csv, infer_json};
use crate::schema_log::SchemaLog;

pub(crate) mod file_log;

use file_log::{FileLog, RecordedFile};

/// How often the directory is listed whole, to find files named below the greatest name seen.
pub const FULL_LISTING_EVERY: Duration = Duration::from_secs(60);

/// The only partition of a files source.
pub const PARTITION: &str = "0";

/// File format of a files source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileFormat {
    /// Newline-delimited JSON objects (`.gz` allowed).
    Json,
    /// CSV, one record per line (`.gz` allowed).
    Csv,
    /// Parquet.
    Parquet,
}

/// The `[sources.<name>]` settings of `kind = "files"` (besides the engine's event-time keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesSourceConfig {
    /// The directory (local path or `file://` URL).
    pub path: String,
    /// File format.
    pub format: FileFormat,
    /// Column definitions, e.g. `"id BIGINT, ts TIMESTAMP"`; inferred when absent.
    #[serde(default)]
    pub schema: Option<String>,
    /// At most this many files per batch (default 100).
    #[serde(default = "default_max_files")]
    pub max_files_per_batch: u64,
    /// CSV: whether each file starts with a header line (default true).
    #[serde(default = "default_true")]
    pub header: bool,
    /// CSV: the field delimiter, one character (default `,`).
    #[serde(default = "default_delimiter")]
    pub delimiter: String,
    /// JSON: what a field the schema lacks does (default `add_columns` when the schema is
    /// inferred, `none` when declared); see [`crate::evolve`].
    #[serde(default)]
    pub schema_evolution: Option<SchemaEvolution>,
    /// How the folder's object store is configured, over the environment (`[sources.NAME.
    /// storage_options]`; see [`sluice_engine::storage`]).
    #[serde(default)]
    pub storage_options: StorageOptions,
}

impl FilesSourceConfig {
    /// Settings for `path` in `format`, everything else at its default (schema inferred, 100
    /// files per batch, CSV with a header and `,`).
    pub fn new(path: impl Into<String>, format: FileFormat) -> Self {
        FilesSourceConfig {
            path: path.into(),
            format,
            schema: None,
            max_files_per_batch: default_max_files(),
            header: true,
            delimiter: default_delimiter(),
            schema_evolution: None,
            storage_options: StorageOptions::default(),
        }
    }
}

fn default_max_files() -> u64 {
    100
}
fn default_true() -> bool {
    true
}
fn default_delimiter() -> String {
    ",".into()
}

/// Schema evolutions one read may go through before it gives up (each adds columns).
const MAX_EVOLUTIONS_PER_READ: usize = 16;

/// The most files schema inference reads to find [`INFER_RECORDS`] records.
const INFER_FILES: usize = 1000;

/// A directory of files as a [`Source`]. See the module docs.
pub struct FilesSource {
    config: FilesSourceConfig,
    delimiter: u8,
    url: Url,
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    opened: Option<Opened>,
}

struct Opened {
    name: String,
    checkpoint: CheckpointStore,
    /// The schema as the checkpoint records it (an inferred one is fixed by the first
    /// `available()`), grown by schema evolution.
    schema_log: Mutex<SchemaLog>,
    evolution: SchemaEvolution,
    inference: Option<SchemaInference>,
    listing: Mutex<Listing>,
}

impl Opened {
    /// The data schema in force (with `_rescued_data` under `rescue`).
    async fn data_schema(&self) -> SchemaRef {
        self.evolution
            .data_schema(self.schema_log.lock().await.current())
    }
}

/// The recorded file order and when the directory was last listed whole.
struct Listing {
    log: FileLog,
    full_at: Option<Instant>,
}

impl std::fmt::Debug for FilesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesSource")
            .field("url", &self.url.as_str())
            .finish()
    }
}

impl FilesSource {
    /// A files source over `config.path`.
    ///
    /// # Errors
    /// If the path is not a usable location or the CSV delimiter is not one byte.
    pub fn new(config: FilesSourceConfig) -> Result<Self> {
        if config.max_files_per_batch == 0 {
            return Err(ConnectorError::Config(
                "max_files_per_batch = 0: a batch must read at least one file".into(),
            ));
        }
        let url = sluice_engine::location::directory_url(&config.path)?;
        if url.scheme() == "file" {
            let dir = url.to_file_path().map_err(|_| {
                ConnectorError::Config(format!("path '{}' is not a local directory", config.path))
            })?;
            if !dir.is_dir() {
                return Err(ConnectorError::Config(format!(
                    "source directory '{}' does not exist",
                    dir.display()
                )));
            }
        }
        let (store, prefix) = sluice_engine::storage::open_store(&url, &config.storage_options)?;
        let delimiter = match config.delimiter.as_bytes() {
            [b] if !matches!(b, b'"' | b'\r' | b'\n') => *b,
            _ => {
                return Err(ConnectorError::Config(format!(
                    "delimiter '{}' must be exactly one character, not a quote or a line break",
                    config.delimiter.escape_debug()
                )));
            }
        };
        Ok(FilesSource {
            config,
            delimiter,
            url,
            store,
            prefix,
            opened: None,
        })
    }

    fn opened(&self) -> Result<&Opened> {
        self.opened
            .as_ref()
            .ok_or_else(|| ConnectorError::Config("the files source was used before open()".into()))
    }

    /// Lists the data files of the directory, sorted by name: all of them, or only those named
    /// after `after`.
    async fn list(&self, after: Option<&str>) -> Result<Vec<RecordedFile>> {
        if self.url.scheme() == "file"
            && let Ok(root) = self.url.to_file_path()
        {
            let after = after.map(str::to_string);
            let mut files =
                tokio::task::spawn_blocking(move || list_local(&root, after.as_deref()))
                    .await
                    .map_err(|e| ConnectorError::Config(format!("listing failed: {e}")))??;
            files.sort_by(|a, b| a.name.cmp(&b.name));
            return Ok(files);
        }
        let listing = match after {
            None => self.store.list(Some(&self.prefix)),
            Some(name) => self
                .store
                .list_with_offset(Some(&self.prefix), &self.file_path(name)),
        };
        let mut files: Vec<RecordedFile> = listing
            .map_ok(|meta| {
                let name = relative_name(&self.prefix, &meta.location);
                RecordedFile {
                    name,
                    size: meta.size,
                    modified_micros: meta.last_modified.timestamp_micros(),
                }
            })
            .try_collect()
            .await?;
        files.retain(|f| is_data_file(&f.name));
        files.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(files)
    }

    fn file_path(&self, name: &str) -> Path {
        name.split('/').fold(self.prefix.clone(), |p, s| p.join(s))
    }

    /// Fetches a recorded file, checking it is still the file that was recorded.
    async fn fetch(&self, file: &RecordedFile, offset: i64) -> Result<Bytes> {
        let changed = |detail: String| ConnectorError::FileChanged {
            file: format!("{}/{}", self.url.as_str().trim_end_matches('/'), file.name),
            offset,
            detail,
        };
        let got = match self.store.get(&self.file_path(&file.name)).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Err(changed("it is gone".into())),
            Err(e) => return Err(e.into()),
        };
        let (size, modified) = (got.meta.size, got.meta.last_modified.timestamp_micros());
        if size != file.size || modified != file.modified_micros {
            return Err(changed(format!(
                "recorded size {} modified {}µs, now size {size} modified {modified}µs",
                file.size, file.modified_micros
            )));
        }
        Ok(read_immutable_body(got).await?)
    }

    /// Infers the schema from the first files (as many as hold [`INFER_RECORDS`] records, at
    /// most [`INFER_FILES`]; one for Parquet, which declares its own).
    async fn infer_schema(&self) -> Result<(SchemaRef, SchemaInference)> {
        let files = self.list(None).await?;
        if files.is_empty() {
            return Err(ConnectorError::Schema(format!(
                "cannot infer the schema: no files in {} yet; add files or declare `schema`",
                self.url
            )));
        }
        let mut samples = Vec::new();
        let mut lines = 0;
        for (i, file) in files.iter().enumerate().take(INFER_FILES) {
            let (bytes, _) = decompress(&file.name, self.fetch(file, i as i64).await?);
            lines += bytes.iter().filter(|b| **b == b'\n').count();
            samples.push((file.name.clone(), bytes));
            if lines >= INFER_RECORDS || self.config.format == FileFormat::Parquet {
                break;
            }
        }
        let described = match samples.as_slice() {
            [(only, _)] => only.clone(),
            [(first, _), .., (last, _)] => {
                format!("{} files, {first} to {last}", samples.len())
            }
            [] => String::new(),
        };
        let (schema, inference) = match self.config.format {
            FileFormat::Json => infer_json(
                samples.iter().flat_map(|(name, bytes)| {
                    bytes
                        .split(|b| *b == b'\n')
                        .enumerate()
                        .map(move |(i, line)| (line, format!("{name}:{}", i + 1)))
                }),
                described,
            )?,
            FileFormat::Csv => {
                let texts: Vec<(String, &[u8])> = samples
                    .iter()
                    .map(|(name, bytes)| (name.clone(), bytes.as_ref()))
                    .collect();
                infer_csv(&texts, self.config.header, self.delimiter, described)?
            }
            FileFormat::Parquet => {
                let (name, bytes) = &samples[0];
                let builder =
                    parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                        bytes.clone(),
                    )
                    .map_err(|e| ConnectorError::Schema(format!("{name}: {e}")))?;
                let schema = Schema::new(builder.schema().fields().clone());
                let inference = SchemaInference {
                    sample: described,
                    records: builder.metadata().file_metadata().num_rows().max(0) as u64,
                    columns: schema
                        .fields()
                        .iter()
                        .map(|f| InferredColumn {
                            name: f.name().clone(),
                            data_type: f.data_type().to_string(),
                            ..InferredColumn::default()
                        })
                        .collect(),
                };
                (schema, inference)
            }
        };
        if schema.fields().is_empty() {
            return Err(ConnectorError::Schema(format!(
                "no columns could be inferred from the first files of {}; declare `schema`",
                self.url
            )));
        }
        Ok((Arc::new(schema), inference))
    }

    /// How this source's files are decoded.
    fn decoding(&self) -> Decoding {
        Decoding {
            format: self.config.format,
            header: self.config.header,
            delimiter: self.delimiter,
            declared: self.config.schema.is_some(),
        }
    }
}

#[async_trait]
impl Source for FilesSource {
    async fn open(&mut self, ctx: SourceContext) -> sluice_engine::Result<SchemaRef> {
        let name = ctx.name.clone();
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&name, e);
        let declared = match &self.config.schema {
            Some(ddl) => Some(sluice_engine::schema::parse_schema(ddl).await?),
            None => None,
        };
        let schema_log = SchemaLog::open(ctx.checkpoint.clone(), &name, declared, || {
            self.infer_schema()
        })
        .await
        .map_err(wrap)?;
        let evolution = SchemaEvolution::resolve(
            self.config.schema_evolution,
            self.config.schema.is_some(),
            self.config.format == FileFormat::Json,
            &format!("{:?}", self.config.format).to_lowercase(),
        )
        .map_err(wrap)?;
        let batch_schema = with_lineage_fields(&evolution.data_schema(schema_log.current()), true);
        let inference = schema_log.inference().cloned();
        let log = FileLog::load(&ctx.checkpoint).await.map_err(wrap)?;
        self.opened = Some(Opened {
            name: ctx.name,
            checkpoint: ctx.checkpoint,
            schema_log: Mutex::new(schema_log),
            evolution,
            inference,
            listing: Mutex::new(Listing { log, full_at: None }),
        });
        Ok(batch_schema)
    }

    async fn available(&self) -> sluice_engine::Result<BTreeMap<PartitionId, AvailableRange>> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("files", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        opened
            .schema_log
            .lock()
            .await
            .record_pending()
            .await
            .map_err(wrap)?;
        let mut listing = opened.listing.lock().await;
        let full = listing
            .full_at
            .is_none_or(|at| at.elapsed() >= FULL_LISTING_EVERY);
        let after = if full { None } else { listing.log.max_name() };
        let listed = self.list(after).await.map_err(wrap)?;
        if full {
            listing.full_at = Some(Instant::now());
        }
        let new: Vec<RecordedFile> = listed
            .into_iter()
            .filter(|f| !listing.log.contains(&f.name))
            .collect();
        listing
            .log
            .append(&opened.checkpoint, new)
            .await
            .map_err(wrap)?;
        Ok(BTreeMap::from([(
            PARTITION.to_string(),
            AvailableRange {
                initial: 0,
                latest: listing.log.files.len() as i64,
            },
        )]))
    }

    async fn read(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
    ) -> sluice_engine::Result<SourceRead> {
        self.read_files(partition, range, None, PositionForm::Text)
            .await
    }

    fn reads_columns(&self) -> bool {
        matches!(self.config.format, FileFormat::Parquet | FileFormat::Json)
    }

    async fn read_columns(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        columns: &[String],
        positions: PositionForm,
    ) -> sluice_engine::Result<SourceRead> {
        self.read_files(partition, range, Some(columns), positions)
            .await
    }

    /// Decoded once with the schema in force; declined where the records bring fields it
    /// lacks (under `add_columns`), for the batch's own read to add them.
    async fn read_ahead(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        columns: Option<&[String]>,
        positions: PositionForm,
    ) -> sluice_engine::Result<Option<SourceRead>> {
        let files = self.files_at(partition, range).await?;
        let (read, new) = self.decode_files(&files, columns, positions).await?;
        Ok(new.is_none().then_some(read))
    }

    fn numbers_positions(&self) -> bool {
        self.reads_columns()
    }

    async fn position_prefix(
        &self,
        partition: &PartitionId,
        offset: Offset,
    ) -> sluice_engine::Result<String> {
        let files = self
            .files_at(partition, OffsetRange::new(offset, offset + 1))
            .await?;
        Ok(files
            .first()
            .map(|(_, file)| format!("{}:", file.name))
            .unwrap_or_default())
    }

    async fn current_schema(&self) -> Option<SchemaRef> {
        let opened = self.opened.as_ref()?;
        Some(with_lineage_fields(
            opened.data_schema().await.as_ref(),
            true,
        ))
    }

    fn schema_inference(&self) -> Option<SchemaInference> {
        self.opened.as_ref()?.inference.clone()
    }

    fn max_per_batch(&self) -> Option<u64> {
        Some(self.config.max_files_per_batch.max(1))
    }

    fn reads_may_grow_schema(&self) -> bool {
        self.opened
            .as_ref()
            .is_none_or(|o| o.evolution == SchemaEvolution::AddColumns)
    }
}

impl FilesSource {
    /// The recorded files at offsets `range`, with their offsets.
    async fn files_at(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
    ) -> sluice_engine::Result<Vec<(i64, RecordedFile)>> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("files", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        if partition != PARTITION {
            return Err(wrap(ConnectorError::Config(format!(
                "a files source has only partition {PARTITION}, not '{partition}'"
            ))));
        }
        let mut listing = opened.listing.lock().await;
        if range.end as usize > listing.log.files.len() {
            // Recorded by another run since this one loaded the log (a batch it planned).
            listing.log = FileLog::load(&opened.checkpoint).await.map_err(wrap)?;
        }
        let log = &listing.log;
        if range.start < 0 || range.end as usize > log.files.len() {
            return Err(wrap(ConnectorError::Config(format!(
                "offsets {range} are outside the {} recorded files (was the file log in the \
                 checkpoint deleted?)",
                log.files.len()
            ))));
        }
        Ok((range.start..range.end)
            .map(|o| (o, log.files[o as usize].clone()))
            .collect())
    }

    /// The files at offsets `range`, with every column or (Parquet and JSON) the data `columns`
    /// named, their rows' positions in `positions`' form.
    async fn read_files(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        columns: Option<&[String]>,
        positions: PositionForm,
    ) -> sluice_engine::Result<SourceRead> {
        let files = self.files_at(partition, range).await?;
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("files", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        // Decoded with the schema in force; under `add_columns`, fields it lacks grow it (the
        // growth recorded first) and the files are read again with the grown schema.
        for _ in 0..MAX_EVOLUTIONS_PER_READ {
            let (read, new) = self.decode_files(&files, columns, positions).await?;
            let Some(new) = new else {
                return Ok(read);
            };
            opened
                .schema_log
                .lock()
                .await
                .evolve(new.columns, new.first_seen, |_| Ok(()))
                .await
                .map_err(wrap)?;
        }
        Err(wrap(ConnectorError::Schema(format!(
            "offsets {range} kept bringing new fields after {MAX_EVOLUTIONS_PER_READ} schema \
             evolutions in one read"
        ))))
    }

    /// `files` decoded with the schema in force, a group of files at a time (the next group
    /// fetched while one decodes), into rows and dead letters; and the fields their records
    /// bring that the schema lacks, under `add_columns` ([`fields_to_add`]; `None`: nothing
    /// new).
    async fn decode_files(
        &self,
        files: &[(i64, RecordedFile)],
        columns: Option<&[String]>,
        positions: PositionForm,
    ) -> sluice_engine::Result<(SourceRead, Option<NewFields>)> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("files", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        let schema = &opened.data_schema().await;
        let mut read = SourceRead::default();
        let groups = &read_groups(files);
        // The bytes of group `i`'s files, in order (none past the last group).
        let fetch_group = |i: usize| {
            let group = groups.get(i).copied().unwrap_or_default();
            futures::future::try_join_all(
                group.iter().map(|(offset, file)| self.fetch(file, *offset)),
            )
        };
        let mut fetched = fetch_group(0).await.map_err(wrap)?;
        for (i, group) in groups.iter().enumerate() {
            let (decoding, evolution) = (self.decoding(), opened.evolution);
            let schema = Arc::clone(schema);
            let columns = columns.map(<[String]>::to_vec);
            let files: Vec<((i64, RecordedFile), Bytes)> = group
                .iter()
                .cloned()
                .zip(std::mem::take(&mut fetched))
                .collect();
            let decode = cpu_bound(move || -> Vec<Result<SourceRead>> {
                files
                    .into_par_iter()
                    .map(|((offset, file), bytes)| {
                        let columns = columns.as_deref();
                        let read = (columns, positions);
                        decoding.decode(&schema, read, evolution, &file, offset, bytes)
                    })
                    .collect()
            });
            // The next group is fetched while this one decodes: reading a file is work too
            // (mapping it, or the kernel's copy where it cannot be mapped), which would
            // otherwise leave the other core idle.
            let (decoded, next) = futures::join!(decode, fetch_group(i + 1));
            for part in decoded {
                let part = part.map_err(wrap)?;
                read.batches.extend(part.batches);
                read.dead_letters.extend(part.dead_letters);
            }
            fetched = next.map_err(wrap)?;
        }
        let new = fields_to_add(opened.evolution, schema, &read.dead_letters, &[]);
        Ok((read, new.map_err(wrap)?))
    }
}

/// What decoding a file needs of the source's settings: a copy, so the decode runs on the
/// rayon pool (`cpu_bound`) while the source stays with the driver.
#[derive(Debug, Clone, Copy)]
struct Decoding {
    format: FileFormat,
    header: bool,
    delimiter: u8,
    /// Whether the job declared the schema (else it was inferred).
    declared: bool,
}

impl Decoding {
    /// Decodes one file into rows with lineage, and dead letters. `columns`: the data columns
    /// to keep (Parquet and JSON; `None` for all, and for CSV); `positions`: their form.
    fn decode(
        &self,
        schema: &SchemaRef,
        (columns, positions): (Option<&[String]>, PositionForm),
        evolution: SchemaEvolution,
        file: &RecordedFile,
        offset: i64,
        bytes: Bytes,
    ) -> Result<SourceRead> {
        // A truncated or corrupt `.gz`: its complete lines are kept, the cut-off rest is one
        // dead letter.
        let (bytes, cut_off) = match decompress(&file.name, bytes) {
            (bytes, None) => (bytes, None),
            (bytes, Some(error)) => match bytes.iter().rposition(|b| *b == b'\n') {
                Some(end) => {
                    let line = bytes[..=end].iter().filter(|b| **b == b'\n').count() + 1;
                    let rest = bytes.slice(end + 1..).to_vec();
                    (bytes.slice(..=end), Some((line, rest, error)))
                }
                None => return Ok(whole_file_dead_letter(file, offset, error)),
            },
        };
        let (decoded, bad) = match self.format {
            FileFormat::Json => {
                let lines = data_lines(&bytes, false);
                let strict = evolution.strict();
                let (good, bad) = decode_json_lines(schema, columns, &bytes, &lines, strict);
                if evolution == SchemaEvolution::Rescue {
                    let (rescued, bad) = rescue_lines(schema, bad);
                    let rescued = match kept_columns(schema, columns) {
                        None => rescued,
                        Some(kept) => {
                            let mut projected = Vec::with_capacity(rescued.len());
                            for (batch, numbers) in rescued {
                                projected.push((batch.project(&kept)?, numbers));
                            }
                            projected
                        }
                    };
                    (good.into_iter().chain(rescued).collect(), bad)
                } else {
                    (good, bad)
                }
            }
            FileFormat::Csv => {
                let declared = self.declared;
                decode_csv_file(schema, self.delimiter, &bytes, self.header, declared)
            }
            FileFormat::Parquet => match decode_parquet(schema, columns, bytes) {
                Ok(batches) => {
                    let mut row = 0;
                    let mut out = Vec::new();
                    for b in batches {
                        let numbers: Vec<usize> = (row + 1..=row + b.num_rows()).collect();
                        row += b.num_rows();
                        out.push((b, numbers));
                    }
                    (out, Vec::new())
                }
                Err(e) => return Ok(whole_file_dead_letter(file, offset, e)),
            },
        };
        let mut read = SourceRead::default();
        for (batch, numbers) in decoded {
            read.batches.push(attach_numbered_lineage(
                batch, PARTITION, offset, &file.name, &numbers, positions,
            )?);
        }
        let cut_off = cut_off.map(|(line, raw, error)| {
            let error = format!(
                "the file ends early ({error}): line {line} and whatever followed it are lost; \
                 the lines before it are read"
            );
            (line, raw, error)
        });
        for (line, raw, error) in bad.into_iter().chain(cut_off) {
            read.dead_letters.push(DeadLetter {
                partition: PARTITION.into(),
                offset,
                position: format!("{}:{line}", file.name),
                raw,
                error,
            });
        }
        Ok(read)
    }
}

/// File bytes a read decodes at once: a read's files are fetched and decoded in groups of at
/// most this many bytes of text (a larger file alone), each group's bytes released once it is
/// decoded, the next group fetched meanwhile — so a batch of large files holds about two
/// files' text beside its rows, while small files are still fetched together and decoded in
/// parallel.
const READ_GROUP_BYTES: u64 = 8 * 1024 * 1024;

/// How many bytes of text a compressed file is taken to hold, per byte, when grouping a read
/// (JSON and CSV compress about this well with gzip).
const GZIP_TEXT_PER_BYTE: u64 = 8;

/// `files` in order, cut into consecutive groups of at most [`READ_GROUP_BYTES`] of text (a
/// file larger than that alone).
fn read_groups(files: &[(i64, RecordedFile)]) -> Vec<&[(i64, RecordedFile)]> {
    let text_bytes = |file: &RecordedFile| {
        if file.name.ends_with(".gz") {
            file.size.saturating_mul(GZIP_TEXT_PER_BYTE)
        } else {
            file.size
        }
    };
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, (_, file)) in files.iter().enumerate() {
        let size = text_bytes(file);
        if i > start && bytes.saturating_add(size) > READ_GROUP_BYTES {
            groups.push(&files[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(size);
    }
    if start < files.len() {
        groups.push(&files[start..]);
    }
    groups
}

/// Lists a local directory tree's data files, looking only at the names after `after` (the
/// rest are skipped by name, without reading their metadata — object_store's local listing
/// reads every entry's), so planning costs little more than reading the directory.
fn list_local(root: &std::path::Path, after: Option<&str>) -> Result<Vec<RecordedFile>> {
    let mut files = Vec::new();
    let mut dirs = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                tracing::warn!(file = %entry.path().display(), "a file name that is not UTF-8 is skipped; rename it to read it");
                continue;
            };
            if !is_data_file(&name) {
                continue;
            }
            let rel_name = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let kind = entry.file_type()?;
            let is_dir = kind.is_dir()
                || (kind.is_symlink() && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()));
            if is_dir {
                dirs.push((entry.path(), rel_name));
                continue;
            }
            if after.is_some_and(|a| rel_name.as_str() <= a) {
                continue;
            }
            let meta = std::fs::metadata(entry.path())?;
            files.push(RecordedFile {
                name: rel_name,
                size: meta.len(),
                modified_micros: chrono::DateTime::<chrono::Utc>::from(meta.modified()?)
                    .timestamp_micros(),
            });
        }
    }
    Ok(files)
}

fn relative_name(prefix: &Path, location: &Path) -> String {
    let prefix = prefix.as_ref();
    let loc = location.as_ref();
    loc.strip_prefix(prefix)
        .unwrap_or(loc)
        .trim_start_matches('/')
        .to_string()
}

pub(crate) fn is_data_file(name: &str) -> bool {
    !name
        .split('/')
        .any(|part| part.starts_with('.') || part.starts_with('_'))
}

/// A file's bytes, decompressed if its name ends in `.gz`; for a truncated or corrupt gzip
/// stream, what could be decompressed before the error, and the error.
pub(crate) fn decompress(name: &str, bytes: Bytes) -> (Bytes, Option<String>) {
    if !name.ends_with(".gz") {
        return (bytes, None);
    }
    let mut out = Vec::new();
    let result = flate2::read::MultiGzDecoder::new(bytes.as_ref()).read_to_end(&mut out);
    let error = result
        .err()
        .map(|e| format!("{name} is not valid gzip: {e}"));
    (Bytes::from(out), error)
}

fn whole_file_dead_letter(file: &RecordedFile, offset: i64, error: String) -> SourceRead {
    SourceRead {
        batches: vec![],
        dead_letters: vec![DeadLetter {
            partition: PARTITION.into(),
            offset,
            position: file.name.clone(),
            raw: vec![],
            error: format!("the whole file could not be read: {error}"),
        }],
    }
}

/// Reads a Parquet file and conforms its batches to `schema` by column name, in batches of
/// [`crate::decode::DECODE_ROWS`] rows as the text formats are decoded (the reader's default
/// of 1 024 made a Nexmark batch of Parquet files 450 small batches, and each costs the
/// query a little: in the Spark comparison, q0's execute step went from 6.4 to 1.5 ms a batch).
///
/// `columns`: only these data columns are returned (in `schema`'s order), and only they are
/// decoded — except a column that could fail the file when every column is read, which is
/// checked whatever the query reads: one stored as another type than `schema` declares (unless
/// the cast cannot fail), and a NOT NULL column that is stored nullable or is missing. `None`:
/// every column.
pub(crate) fn decode_parquet(
    schema: &SchemaRef,
    columns: Option<&[String]>,
    bytes: Bytes,
) -> std::result::Result<Vec<RecordBatch>, String> {
    let builder = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)
        .map_err(|e| e.to_string())?;
    let wanted = |name: &str| columns.is_none_or(|c| c.iter().any(|w| w == name));
    let stored = Arc::clone(builder.schema());
    // The declared columns not asked for that must still be checked.
    let checked: Vec<&Field> = schema
        .fields()
        .iter()
        .filter(|f| !wanted(f.name()))
        .filter(|f| match stored.field_with_name(f.name()) {
            Ok(s) => {
                !cast_cannot_fail(s.data_type(), f.data_type())
                    || (!f.is_nullable() && s.is_nullable())
            }
            Err(_) => !f.is_nullable(),
        })
        .map(AsRef::as_ref)
        .collect();
    let builder = match columns {
        None => builder,
        Some(_) => {
            let roots =
                stored.fields().iter().enumerate().filter(|(_, f)| {
                    wanted(f.name()) || checked.iter().any(|c| c.name() == f.name())
                });
            let mask = parquet::arrow::ProjectionMask::roots(
                builder.parquet_schema(),
                roots.map(|(i, _)| i),
            );
            builder.with_projection(mask)
        }
    };
    let reader = builder
        .with_batch_size(crate::decode::DECODE_ROWS)
        .build()
        .map_err(|e| e.to_string())?;
    // What is decoded: the columns asked for and the ones checked, in `schema`'s order, cast and
    // checked as one batch so a file that fails fails with the error reading every column gives
    // (the first column in order that does not cast, then the first NOT NULL one holding nulls).
    let decoded: Vec<usize> = (0..schema.fields().len())
        .filter(|&i| {
            let name = schema.field(i).name();
            wanted(name) || checked.iter().any(|c| c.name() == name)
        })
        .collect();
    let decoded_schema = match columns {
        None => Arc::clone(schema),
        Some(_) => Arc::new(schema.project(&decoded).map_err(|e| e.to_string())?),
    };
    // Where the columns asked for sit among the decoded ones.
    let kept: Option<Vec<usize>> = columns.map(|_| {
        (0..decoded_schema.fields().len())
            .filter(|&i| wanted(decoded_schema.field(i).name()))
            .collect()
    });
    let cast_options = cast::CastOptions {
        safe: false,
        ..Default::default()
    };
    let conformed = |field: &Field, batch: &RecordBatch| match batch.column_by_name(field.name()) {
        Some(col) => cast::cast_with_options(col, field.data_type(), &cast_options)
            .map_err(|e| format!("column '{}': {e}", field.name())),
        None => Ok(new_null_array(field.data_type(), batch.num_rows())),
    };
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| e.to_string())?;
        let columns = decoded_schema
            .fields()
            .iter()
            .map(|field| conformed(field, &batch))
            .collect::<std::result::Result<Vec<_>, String>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        let decoded =
            RecordBatch::try_new_with_options(Arc::clone(&decoded_schema), columns, &options)
                .map_err(|e| e.to_string())?;
        out.push(match &kept {
            None => decoded,
            Some(kept) => decoded.project(kept).map_err(|e| e.to_string())?,
        });
    }
    Ok(out)
}

/// Whether casting a column stored as `from` to `to` always succeeds: the same type, another
/// layout of text or bytes, a dictionary of such values, or a wider number.
fn cast_cannot_fail(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    let text = |t: &DataType| matches!(t, Utf8 | LargeUtf8 | Utf8View);
    let bytes = |t: &DataType| matches!(t, Binary | LargeBinary | BinaryView);
    from == to
        || text(from) && text(to)
        || bytes(from) && bytes(to)
        || matches!(from, Dictionary(_, values) if cast_cannot_fail(values, to))
        || matches!(
            (from, to),
            (Int8, Int16 | Int32 | Int64)
                | (Int16, Int32 | Int64)
                | (Int32, Int64)
                | (UInt8, Int16 | Int32 | Int64 | UInt16 | UInt32 | UInt64)
                | (UInt16, Int32 | Int64 | UInt32 | UInt64)
                | (UInt32, Int64 | UInt64)
                | (Float32, Float64)
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(sizes: &[(&str, u64)]) -> Vec<(i64, RecordedFile)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, (name, size))| {
                let file = RecordedFile {
                    name: (*name).into(),
                    size: *size,
                    modified_micros: 0,
                };
                (i as i64, file)
            })
            .collect()
    }

    fn group_sizes(files: &[(i64, RecordedFile)]) -> Vec<Vec<i64>> {
        read_groups(files)
            .iter()
            .map(|g| g.iter().map(|(offset, _)| *offset).collect())
            .collect()
    }

    /// Groups keep the files' order, never exceed the budget unless one file alone does, and
    /// count a compressed file at the text it holds.
    #[test]
    fn reads_are_grouped_in_order_by_text_size() {
        const MB: u64 = 1024 * 1024;
        assert!(group_sizes(&[]).is_empty());
        let small = files(&[("a", MB), ("b", 3 * MB), ("c", 4 * MB), ("d", MB)]);
        assert_eq!(group_sizes(&small), vec![vec![0, 1, 2], vec![3]]);
        // A large file is alone, whatever comes before or after it.
        let large = files(&[("a", MB), ("b", 20 * MB), ("c", MB), ("d", 9 * MB)]);
        assert_eq!(
            group_sizes(&large),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        // 1.5 MB of gzip is about 12 MB of text: alone.
        let gz = files(&[("a.json", MB), ("b.json.gz", 3 * MB / 2), ("c.json", MB)]);
        assert_eq!(group_sizes(&gz), vec![vec![0], vec![1], vec![2]]);
    }

    /// `batch` as the bytes of a Parquet file.
    fn parquet_file(batch: &RecordBatch) -> Bytes {
        let mut bytes = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut bytes, batch.schema(), None).unwrap();
        w.write(batch).unwrap();
        w.close().unwrap();
        Bytes::from(bytes)
    }

    /// Only the columns asked for are returned; a column stored as another type than declared
    /// is still cast, so a value that does not cast fails the file whatever is read.
    #[test]
    fn parquet_reads_only_the_columns_asked_for() {
        use arrow::array::{Array, AsArray, Int64Array, StringArray};
        use arrow::datatypes::{DataType, Field, Int64Type};
        let stored = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("code", DataType::Utf8, false),
            Field::new("note", DataType::Utf8, false),
        ]));
        let file = |codes: Vec<&str>| {
            let batch = RecordBatch::try_new(
                Arc::clone(&stored),
                vec![
                    Arc::new(Int64Array::from(vec![1, 2])),
                    Arc::new(StringArray::from(codes)),
                    Arc::new(StringArray::from(vec!["a", "b"])),
                ],
            )
            .unwrap();
            parquet_file(&batch)
        };
        // `code` is declared an integer; `missing` is in no file.
        let declared = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("code", DataType::Int64, false),
            Field::new("note", DataType::Utf8, false),
            Field::new("missing", DataType::Utf8, true),
        ]));
        let columns = ["id".to_string(), "missing".to_string()];
        let good = decode_parquet(&declared, Some(&columns), file(vec!["7", "8"])).unwrap();
        assert_eq!(good.len(), 1);
        let names: Vec<&str> = good[0]
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(names, ["id", "missing"]);
        assert_eq!(
            good[0].column(0).as_primitive::<Int64Type>().values(),
            &[1, 2]
        );
        assert_eq!(good[0].column(1).null_count(), 2);
        let all = decode_parquet(&declared, None, file(vec!["7", "8"])).unwrap();
        assert_eq!(all[0].num_columns(), 4);
        assert_eq!(
            all[0].column(1).as_primitive::<Int64Type>().values(),
            &[7, 8]
        );
        // `code` is not asked for, but `x` does not cast: the file fails as when all are read.
        let bad = decode_parquet(&declared, Some(&columns), file(vec!["7", "x"])).unwrap_err();
        assert!(bad.contains("column 'code'"), "{bad}");
        assert!(decode_parquet(&declared, None, file(vec!["7", "x"])).is_err());
        // No data column at all: the rows are still counted.
        let none = decode_parquet(&declared, Some(&[]), file(vec!["7", "8"])).unwrap();
        assert_eq!((none[0].num_columns(), none[0].num_rows()), (0, 2));
        // A NOT NULL column not asked for, holding a null or missing: the file fails too.
        let with_null = {
            let schema = Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("note", DataType::Utf8, true),
            ]));
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(vec![1, 2])),
                    Arc::new(StringArray::from(vec![Some("a"), None])),
                ],
            )
            .unwrap();
            parquet_file(&batch)
        };
        let not_null = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("note", DataType::Utf8, false),
        ]));
        let ids = ["id".to_string()];
        let failed = decode_parquet(&not_null, Some(&ids), with_null.clone()).unwrap_err();
        assert_eq!(
            failed,
            decode_parquet(&not_null, None, with_null.clone()).unwrap_err()
        );
        let absent = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("other", DataType::Utf8, false),
        ]));
        let failed = decode_parquet(&absent, Some(&ids), with_null.clone()).unwrap_err();
        assert_eq!(
            failed,
            decode_parquet(&absent, None, with_null).unwrap_err()
        );
        // Three faults: `code` and `last` do not cast, `note` is NOT NULL and holds a null.
        // Whichever are read, the error is the one reading every column gives: the first column
        // in order that does not cast (casts come before the NOT NULL check).
        let three_faults = {
            let schema = Arc::new(Schema::new(vec![
                Field::new("code", DataType::Utf8, false),
                Field::new("id", DataType::Int64, false),
                Field::new("note", DataType::Utf8, true),
                Field::new("last", DataType::Utf8, false),
            ]));
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(vec!["7", "x"])),
                    Arc::new(Int64Array::from(vec![1, 2])),
                    Arc::new(StringArray::from(vec![Some("a"), None])),
                    Arc::new(StringArray::from(vec!["x", "8"])),
                ],
            )
            .unwrap();
            parquet_file(&batch)
        };
        let declared = Arc::new(Schema::new(vec![
            Field::new("code", DataType::Int64, false),
            Field::new("id", DataType::Int64, false),
            Field::new("note", DataType::Utf8, false),
            Field::new("last", DataType::Int64, false),
        ]));
        let whole = decode_parquet(&declared, None, three_faults.clone()).unwrap_err();
        assert!(whole.contains("column 'code'"), "{whole}");
        for asked in [&["code"][..], &["id"], &["last"], &["note", "last"]] {
            let asked: Vec<String> = asked.iter().map(|c| c.to_string()).collect();
            let narrow = decode_parquet(&declared, Some(&asked), three_faults.clone()).unwrap_err();
            assert_eq!(narrow, whole, "asked for {asked:?}");
        }
        assert!(cast_cannot_fail(&DataType::Int32, &DataType::Int64));
        assert!(!cast_cannot_fail(&DataType::Int64, &DataType::Int32));
        assert!(!cast_cannot_fail(&DataType::Utf8, &DataType::Int64));
    }
}
