//! The Delta sink: every batch is one atomic Delta commit carrying `txn(job_id, batch_id)`.
//!
//! ## Tables
//! - the **output** table at `path`;
//! - the **dead-letter** table at `dead_letter_path` (default `<path>_dead_letter`);
//! - windowed jobs: the **late** table at `late_path` (default `<path>_late`).
//!
//! They are created on first run (the output with the query's schema), so they can be queried
//! before any row arrives.
//!
//! ## Commit protocol (one batch)
//! 1. Side tables (dead letters, late rows), if the batch has rows for them: each skipped if it
//!    already holds `txn(job_id, batch_id)`, else one append carrying that txn.
//! 2. Output: the table's txn version for the job must be `batch_id - 1` (or absent for batch 0).
//!    If it is `batch_id` already, the batch was committed before a crash: nothing is written.
//!    Otherwise one append carrying the txn — or, when the batch produced no rows, a bare commit
//!    with only the txn, so the offsets still advance. delta-rs rejects a commit if another
//!    commit with the same app id landed since the snapshot it was built on
//!    (`ConcurrentTransaction`), which closes the check-then-commit race.
//!
//! `delta.setTransactionRetentionDuration` must stay unset: an expired txn would make the job
//! replay from scratch.
//!
//! ## Columns added
//! A batch whose rows carry columns the table lacks (a source's schema evolved, a nested struct
//! gained a field) is written with `SchemaMode::Merge`: the new columns join the table's schema
//! in that batch's own commit, with its rows and its txn — never before, never after. Earlier
//! rows read them as null. A batch without rows commits the schema change in its bare txn
//! commit. The table's columns keep their order; new ones come last. A job may open a table
//! whose columns are a subset of its own, by name (the batch that adds the rest crashed before
//! its commit, or the query now selects more columns: its first batch adds them); a table with
//! a column the job does not write is refused.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use async_trait::async_trait;
use bytes::Bytes;
use deltalake::TableProperty;
use deltalake::datafusion::catalog::streaming::StreamingTable;
use deltalake::datafusion::datasource::provider_as_source;
use deltalake::datafusion::error::DataFusionError;
use deltalake::datafusion::execution::{SendableRecordBatchStream, TaskContext};
use deltalake::datafusion::logical_expr::{LogicalPlan, LogicalPlanBuilder};
use deltalake::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use deltalake::datafusion::physical_plan::streaming::PartitionStream;
use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake::kernel::{Action, MetadataExt, StructType, Transaction};
use deltalake::logstore::{CommitOrBytes, LogStore, LogStoreConfig, LogStoreRef};
use deltalake::operations::write::SchemaMode;
use deltalake::protocol::{DeltaOperation, SaveMode};
use deltalake::table::config::TablePropertiesExt;
use deltalake::{DeltaTable, DeltaTableError, FilterLiteral, FilterOp, FilterValue};
use futures::TryStreamExt;
use serde::Deserialize;
use sluice_engine::dead_letter::{SOURCE_NAME, dead_letter_schema};
use sluice_engine::fault::{crash_point, pause_point};
use sluice_engine::late::WINDOWS_MISSED;
use sluice_engine::source::{SOURCE_OFFSET, SOURCE_PARTITION};
use sluice_engine::storage::{
    START_UNAVAILABLE_TIMEOUT, StorageOptions, check_conditional_put, open_store,
};
use sluice_engine::{
    BatchCommit, BatchId, CommitOutcome, Compaction, OffsetRange, OutputTables, PartitionId,
    RecomputedRows, Replacement, SideTableBatch, Sink, TableScan,
};
use tokio::sync::Mutex;
use tracing::{info, warn};
use url::Url;

use crate::compaction::{compact_by_copy, is_small, partition_of};
use crate::error::{Result, SinkError};
use crate::parquet_write::{
    casts_losslessly, encode_parallel, plain_for_append, writer_properties, writers_for,
};

/// The `[sink]` settings of `kind = "delta"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeltaSinkConfig {
    /// The output table: local path or URL.
    pub path: String,
    /// The dead-letter table (default `<path>_dead_letter`).
    #[serde(default)]
    pub dead_letter_path: Option<String>,
    /// The late-rows table (default `<path>_late`).
    #[serde(default)]
    pub late_path: Option<String>,
    /// Target size of data files, written and compacted, e.g. `"128MB"` (default: the table's
    /// `delta.targetFileSize`, which Sluice sets to 128 MiB on the tables it creates).
    #[serde(default)]
    pub target_file_size: Option<String>,
    /// Columns of the query's output the output table is partitioned by (`["day"]`); the side
    /// tables are partitioned the same way when they have those columns, else not at all.
    #[serde(default)]
    pub partition_by: Vec<String>,
    /// Compaction in the stream (`[sink.compaction]`).
    #[serde(default)]
    pub compaction: CompactionConfig,
    /// A Delta checkpoint every this many commits (`delta.checkpointInterval`, default 10).
    #[serde(default)]
    pub checkpoint_interval: Option<u64>,
    /// How long commit files are kept before log cleanup removes them, e.g. `"30d"`
    /// (`delta.logRetentionDuration`; default Delta's, 30 days).
    #[serde(default)]
    pub log_retention: Option<String>,
    /// How the tables' object store is configured, over the environment (`[sink.
    /// storage_options]`, see [`sluice_engine::storage`]); the side tables and the checkpoint
    /// use the same.
    #[serde(default)]
    pub storage_options: StorageOptions,
}

impl DeltaSinkConfig {
    /// Settings for an append-only table at `path`, everything else at its default.
    pub fn new(path: impl Into<String>) -> Self {
        DeltaSinkConfig {
            path: path.into(),
            dead_letter_path: None,
            late_path: None,
            target_file_size: None,
            partition_by: Vec::new(),
            compaction: CompactionConfig::default(),
            checkpoint_interval: None,
            log_retention: None,
            storage_options: StorageOptions::default(),
        }
    }
}

/// The `[sink.compaction]` settings: once a partition of a table holds `min_files` files smaller
/// than half of `target_file_size`, they are rewritten into `target_file_size` files between
/// batches.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactionConfig {
    /// Whether the running job compacts its tables (default true).
    #[serde(default = "compaction_enabled")]
    pub enabled: bool,
    /// Small files a partition must hold before they are rewritten (default 16, at least 2).
    #[serde(default = "compaction_min_files")]
    pub min_files: usize,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            enabled: compaction_enabled(),
            min_files: compaction_min_files(),
        }
    }
}

fn compaction_enabled() -> bool {
    true
}

fn compaction_min_files() -> usize {
    16
}

/// The size of data files written and compacted to when `target_file_size` is not set: 128 MiB
/// (set as `delta.targetFileSize` on the tables Sluice creates).
const DEFAULT_TARGET_FILE_SIZE: u64 = 128 * 1024 * 1024;

/// The commitInfo key of a compaction's commit (not [`COMMIT_METADATA_KEY`]: a compaction is no
/// batch of the job, and `sluice status` reads a job's last batch from that key).
const COMPACTION_METADATA_KEY: &str = "sluice_compaction";

/// A Delta table as a [`Sink`]. See the module docs.
#[derive(Debug)]
pub struct DeltaSink {
    output: TableHandle,
    dead_letters: TableHandle,
    late: TableHandle,
    target_file_size: Option<NonZeroU64>,
    job_id: String,
    /// Update mode: the columns output rows are merged on.
    merge_key: Option<Vec<String>>,
    compaction: CompactionConfig,
    /// Commits retried after a conflict, over the three tables.
    conflicts: Arc<AtomicU64>,
}

/// One Delta table: what it is for, where it is, and its state as of its last load or commit.
#[derive(Debug)]
struct TableHandle {
    /// "output", "dead-letter" or "late", for messages.
    role: &'static str,
    url: Url,
    /// How its store is configured.
    options: StorageOptions,
    /// How a table Sluice creates is laid out and its log kept.
    layout: TableLayout,
    table: Mutex<Option<DeltaTable>>,
    /// Commits retried after a conflict, over the sink's tables.
    conflicts: Arc<AtomicU64>,
    /// Per app id, its txn version as of a table version (see [`TableHandle::txn_version`]).
    txns: std::sync::Mutex<BTreeMap<String, KnownTxn>>,
}

/// How the sink's tables are laid out and their logs kept (`[sink]` settings applied when Sluice
/// creates a table).
#[derive(Debug, Clone, PartialEq, Eq)]
struct TableLayout {
    /// The output's partition columns (side tables: the same where they have them).
    partition_by: Vec<String>,
    /// `delta.checkpointInterval`.
    checkpoint_interval: u64,
    /// `delta.logRetentionDuration`, as Delta spells it (`interval 30 days`), if set.
    log_retention: Option<String>,
    /// `delta.targetFileSize`: `target_file_size`, else [`DEFAULT_TARGET_FILE_SIZE`].
    target_file_size: u64,
}

/// An app id's txn version (`None`: it has none) as of table version `as_of`.
#[derive(Debug, Clone, Copy)]
struct KnownTxn {
    as_of: u64,
    txn: Option<i64>,
}

impl DeltaSink {
    /// A Delta sink for `config`.
    ///
    /// # Errors
    /// If a path is not usable, `target_file_size` does not parse, or `mode = "update"` (which
    /// needs keyed state and is not available yet).
    pub fn new(config: DeltaSinkConfig) -> Result<Self> {
        let output = table_url(&config.path)?;
        let dead = match &config.dead_letter_path {
            Some(p) => table_url(p)?,
            None => table_url(&format!(
                "{}_dead_letter",
                config.path.trim_end_matches('/')
            ))?,
        };
        let late = match &config.late_path {
            Some(p) => table_url(p)?,
            None => table_url(&format!("{}_late", config.path.trim_end_matches('/')))?,
        };
        let target_file_size = match &config.target_file_size {
            None => None,
            Some(text) => Some(NonZeroU64::new(parse_size(text)?).ok_or_else(|| {
                SinkError::Config(format!("target_file_size '{text}' must be above zero"))
            })?),
        };
        let conflicts = Arc::new(AtomicU64::new(0));
        if config.compaction.min_files < 2 {
            return Err(SinkError::Config(format!(
                "[sink.compaction] min_files = {}: compaction rewrites at least 2 files",
                config.compaction.min_files
            )));
        }
        let checkpoint_interval = config.checkpoint_interval.unwrap_or(CHECKPOINT_INTERVAL);
        if checkpoint_interval == 0 {
            return Err(SinkError::Config(
                "checkpoint_interval = 0: a Delta checkpoint needs at least one commit".into(),
            ));
        }
        let log_retention = match &config.log_retention {
            None => None,
            Some(text) => {
                let d = sluice_engine::parse_duration("log_retention", text)?;
                Some(format!("interval {} seconds", d.as_secs()))
            }
        };
        let layout = TableLayout {
            partition_by: config.partition_by.clone(),
            checkpoint_interval,
            log_retention,
            target_file_size: target_file_size.map_or(DEFAULT_TARGET_FILE_SIZE, NonZeroU64::get),
        };
        let t =
            |role, url| TableHandle::new(role, url, &config.storage_options, &layout, &conflicts);
        Ok(DeltaSink {
            output: t("output", output),
            dead_letters: t("dead-letter", dead),
            late: t("late", late),
            conflicts,
            target_file_size,
            job_id: String::new(),
            merge_key: None,
            compaction: config.compaction.clone(),
        })
    }

    /// The dead-letter table's location.
    pub fn dead_letter_location(&self) -> &Url {
        &self.dead_letters.url
    }

    /// The late table's location.
    pub fn late_location(&self) -> &Url {
        &self.late.url
    }
}

impl TableHandle {
    fn new(
        role: &'static str,
        url: Url,
        options: &StorageOptions,
        layout: &TableLayout,
        conflicts: &Arc<AtomicU64>,
    ) -> Self {
        register_cloud_stores();
        TableHandle {
            role,
            url,
            options: options.clone(),
            layout: layout.clone(),
            table: Mutex::new(None),
            conflicts: Arc::clone(conflicts),
            txns: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn err(&self, source: deltalake::DeltaTableError) -> SinkError {
        SinkError::Delta {
            table: self.url.to_string(),
            source,
        }
    }

    /// Opens the table, creating it with `schema` if it does not exist, and checks its columns.
    async fn open_or_create(&self, schema: &SchemaRef) -> Result<()> {
        if self.url.scheme() == "file"
            && let Ok(dir) = self.url.to_file_path()
        {
            std::fs::create_dir_all(dir)?;
        }
        // First, failing within START_UNAVAILABLE_TIMEOUT for a store that cannot be reached
        // (a wrong endpoint, no credentials) or cannot put-if-absent.
        let probe = self.options.clone().with_unavailable_timeout(
            START_UNAVAILABLE_TIMEOUT.min(self.options.unavailable_timeout()),
        );
        let (store, path) = open_store(&self.url, &probe)?;
        check_conditional_put(store.as_ref(), &path, &self.url).await?;
        let mut table =
            DeltaTable::try_from_url_with_storage_options(self.url.clone(), self.options.to_map())
                .await
                .map_err(|e| self.err(e))?;
        // The output must have every partition column; a side table is partitioned only if it
        // has them all.
        let has_all = self
            .layout
            .partition_by
            .iter()
            .all(|c| schema.field_with_name(c).is_ok());
        if !has_all && self.role == "output" {
            return Err(SinkError::Config(format!(
                "partition_by = [{}]: the query's output has no column {} (it has: {})",
                self.layout.partition_by.join(", "),
                self.layout
                    .partition_by
                    .iter()
                    .filter(|c| schema.field_with_name(c).is_err())
                    .map(|c| format!("'{c}'"))
                    .collect::<Vec<_>>()
                    .join(", "),
                schema
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let partition_by: &[String] = if has_all {
            &self.layout.partition_by
        } else {
            &[]
        };
        if table.version().is_none() {
            let normalized = deltalake::kernel::schema::cast::normalize_for_delta(schema);
            let delta_schema: StructType = normalized
                .as_ref()
                .try_into_kernel()
                .map_err(|e| self.err(e.into()))?;
            table = table
                .create()
                .with_columns(delta_schema.fields().cloned())
                .with_partition_columns(partition_by.iter().cloned())
                .with_configuration_property(
                    TableProperty::CheckpointInterval,
                    Some(self.layout.checkpoint_interval.to_string()),
                )
                .with_configuration_property(
                    TableProperty::LogRetentionDuration,
                    self.layout.log_retention.clone(),
                )
                .with_configuration_property(
                    TableProperty::TargetFileSize,
                    Some(self.layout.target_file_size.to_string()),
                )
                .with_save_mode(SaveMode::Ignore)
                .await
                .map_err(|e| self.err(e))?;
            table.load().await.map_err(|e| self.err(e))?;
        }
        let snapshot = table.snapshot().map_err(|e| self.err(e))?;
        if let Some(retention) = snapshot.table_config().set_transaction_retention_duration {
            return Err(SinkError::Config(format!(
                "the {} table {} sets delta.setTransactionRetentionDuration ({}): Sluice keeps \
                 each job's progress as a txn in its tables, and a txn that expires would make \
                 the job replay its input from the start; unset the property, or write to \
                 another table",
                self.role,
                self.url,
                format_args!("{} s", retention.as_secs())
            )));
        }
        let partitioned_by = snapshot.metadata().partition_columns();
        if !partition_by.is_empty() && partitioned_by.iter().ne(partition_by.iter()) {
            return Err(SinkError::Config(format!(
                "the {} table {} is partitioned by [{}], but partition_by = [{}]: a table's \
                 partitioning is fixed when it is created; write to a new table",
                self.role,
                self.url,
                partitioned_by.join(", "),
                partition_by.join(", ")
            )));
        }
        let existing = snapshot.schema();
        let existing: Vec<&str> = existing.fields().map(|f| f.name().as_str()).collect();
        let wanted: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        // The job may bring columns the table lacks yet: its first batch carrying them adds
        // them (see "Columns added").
        if !existing.iter().all(|c| wanted.contains(c)) {
            return Err(SinkError::SchemaMismatch {
                table: self.url.to_string(),
                existing: existing.join(", "),
                wanted: wanted.join(", "),
            });
        }
        *self.table.lock().await = Some(table);
        Ok(())
    }

    /// The table at its latest version without creating it: the handle `open` keeps, brought up
    /// to date, or (for backfill and reconcile, which do not open) loaded now; `None` if there is
    /// no table yet.
    async fn open_existing(&self) -> Result<Option<DeltaTable>> {
        if self.table.lock().await.is_some() {
            return self.latest().await.map(Some);
        }
        match deltalake::open_table_with_storage_options(self.url.clone(), self.options.to_map())
            .await
        {
            Ok(table) => Ok(Some(table)),
            Err(
                deltalake::DeltaTableError::NotATable(_)
                | deltalake::DeltaTableError::InvalidTableLocation(_),
            ) => Ok(None),
            Err(e) => Err(self.err(e)),
        }
    }

    /// The columns and rows `scan` asks for of the table at its latest version (none if there
    /// is no table).
    async fn read(&self, scan: &TableScan) -> Result<Vec<RecordBatch>> {
        let Some(table) = self.open_existing().await? else {
            return Ok(Vec::new());
        };
        let df_err = |e: deltalake::datafusion::error::DataFusionError| self.err(e.into());
        let mut df = table_frame(&table).await.map_err(|e| self.err(e))?;
        if let Some(filter) = &scan.filter {
            let predicate = df.parse_sql_expr(filter).map_err(df_err)?;
            df = df.filter(predicate).map_err(df_err)?;
        }
        if let Some(columns) = &scan.columns {
            let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
            df = df.select_columns(&columns).map_err(df_err)?;
        }
        df.collect().await.map_err(df_err)
    }

    /// Whether `batches` carry columns the table (as last loaded) lacks.
    async fn lacks_columns_of(&self, batches: &[RecordBatch]) -> bool {
        let Some(batch) = batches.first() else {
            return false;
        };
        let guard = self.table.lock().await;
        let Some(Ok(snapshot)) = guard.as_ref().map(DeltaTable::snapshot) else {
            return false;
        };
        grown_by(&snapshot.snapshot().arrow_schema(), &batch.schema()).is_some()
    }

    /// The table's schema at the version `table` holds.
    fn arrow_schema(&self, table: &DeltaTable) -> Result<SchemaRef> {
        Ok(table
            .snapshot()
            .map_err(|e| self.err(e))?
            .snapshot()
            .arrow_schema())
    }

    /// The table at its latest version.
    async fn latest(&self) -> Result<DeltaTable> {
        let mut guard = self.table.lock().await;
        let table = guard
            .as_mut()
            .ok_or_else(|| SinkError::Config(format!("table {} used before open()", self.url)))?;
        table.update_state().await.map_err(|e| self.err(e))?;
        Ok(table.clone())
    }

    /// The size files are written and compacted to: `setting`, else the table's
    /// `delta.targetFileSize`, and the partitions (their values) of the table as last loaded
    /// that hold at least `min_files` files smaller than half of it. None for a table not
    /// opened (a stateless job's late table).
    async fn partitions_due(
        &self,
        setting: Option<NonZeroU64>,
        min_files: usize,
    ) -> Result<(NonZeroU64, Vec<Vec<(String, Option<String>)>>)> {
        let guard = self.table.lock().await;
        let Some(Ok(snapshot)) = guard.as_ref().map(DeltaTable::snapshot) else {
            return Ok((NonZeroU64::MIN, Vec::new()));
        };
        let target = setting.unwrap_or_else(|| snapshot.table_config().target_file_size());
        let mut small: BTreeMap<Vec<(String, Option<String>)>, usize> = BTreeMap::new();
        for file in snapshot.log_data().iter() {
            if is_small(&file, target.get()) {
                *small.entry(partition_of(&file)).or_default() += 1;
            }
        }
        let due = small
            .into_iter()
            .filter(|(_, n)| *n >= min_files)
            .map(|(partition, _)| partition)
            .collect();
        Ok((target, due))
    }

    /// Rewrites the small files of each partition that is due (see
    /// [`TableHandle::partitions_due`]) into `target`-sized files, one commit per partition,
    /// `dataChange = false`: by copying their row groups (`compaction::compact_by_copy`), else
    /// through delta-rs's optimize. The commit can only land as the version right after the one the
    /// compaction read ([`VersionFence`]): a compaction that lost a race fails (see
    /// [`Sink::compact`]) — delta-rs's optimize would otherwise retry over the newer commit,
    /// and its conflict checker ignores `dataChange = false` removes.
    async fn compact(&self, setting: Option<NonZeroU64>, min_files: usize) -> Result<Compaction> {
        let (target, due) = self.partitions_due(setting, min_files).await?;
        let mut done = Compaction::default();
        for partition in due {
            let latest = self.latest().await?;
            let read = latest.version().ok_or_else(|| {
                SinkError::Config(format!("table {} has no version to compact", self.url))
            })?;
            let table = VersionFence::around(&latest, read + 1);
            let described: BTreeMap<&str, Option<&str>> = partition
                .iter()
                .map(|(c, v)| (c.as_str(), v.as_deref()))
                .collect();
            let properties = || {
                CommitProperties::default().with_metadata([(
                    COMPACTION_METADATA_KEY.to_string(),
                    serde_json::json!({ "partition": described }),
                )])
            };
            let copied = compact_by_copy(&table, &partition, target.get(), min_files, properties())
                .await
                .map_err(|e| self.err(e))?;
            let (removed, added) = match copied {
                Some(copied) => (copied.files_removed, copied.files_added),
                None => {
                    // `""` selects the null partition value (delta-rs reads it as IS NULL).
                    let filters: Vec<FilterLiteral<'_>> = partition
                        .iter()
                        .map(|(column, value)| {
                            (
                                column.as_str(),
                                FilterOp::Eq,
                                FilterValue::Scalar(value.as_deref().unwrap_or("")),
                            )
                        })
                        .collect();
                    let (_, metrics) = table
                        .optimize()
                        .with_filters(&filters)
                        .with_target_size(target)
                        .with_writer_properties(writer_properties())
                        .with_commit_properties(properties())
                        .await
                        .map_err(|e| self.err(e))?;
                    (metrics.num_files_removed, metrics.num_files_added)
                }
            };
            done.files_removed += removed;
            done.files_added += added;
            info!(table = %self.url, partition = ?described, files_removed = removed, files_added = added, by_copy = copied.is_some(), "compacted");
            // The handle keeps the table's own log store; it is brought up to date next time.
        }
        Ok(done)
    }

    /// The version of `app_id`'s latest txn in `table` (at the version it holds).
    ///
    /// Asked twice per batch, and delta-kernel answers by replaying the log since its last
    /// checkpoint. So the answer is kept with the table version it holds for, and a later
    /// version reads only the commits since (one small JSON file a batch: usually the job's own
    /// last commit). delta-kernel is asked again when that would read more commits than a
    /// checkpoint interval, when a commit file is already cleaned up, and when the table's
    /// version is below the kept one.
    async fn txn_version(&self, table: &DeltaTable, app_id: &str) -> Result<Option<i64>> {
        let version = table.version();
        let known = self.txns.lock().map_or(None, |k| k.get(app_id).copied());
        // Read commits one by one only while that is cheaper than delta-kernel's replay (a
        // checkpoint and at most `CHECKPOINT_INTERVAL` commits).
        let mut found = match (known, version) {
            (Some(known), Some(version))
                if known.as_of <= version && version - known.as_of <= CHECKPOINT_INTERVAL =>
            {
                Some(known.txn)
            }
            _ => None,
        };
        if let (Some(known), Some(version), Some(txn)) = (known, version, found.as_mut()) {
            for commit in known.as_of + 1..=version {
                let entry = table
                    .log_store()
                    .read_commit_entry(commit)
                    .await
                    .map_err(|e| self.err(e))?;
                let Some(entry) = entry else {
                    found = None;
                    break;
                };
                if let Some(v) = txn_in_commit(&entry, app_id) {
                    *txn = Some(v);
                }
            }
        }
        let txn = match found {
            Some(txn) => txn,
            None => table
                .snapshot()
                .map_err(|e| self.err(e))?
                .transaction_version(table.log_store().as_ref(), app_id)
                .await
                .map_err(|e| self.err(e))?,
        };
        if let (Ok(mut known), Some(as_of)) = (self.txns.lock(), version) {
            known.insert(app_id.to_string(), KnownTxn { as_of, txn });
        }
        Ok(txn)
    }

    /// Appends `batches` with `txn(job_id, batch_id)`, or commits the txn alone if there are no
    /// rows. Returns (rows, files, bytes) added.
    async fn append(
        &self,
        table: DeltaTable,
        batches: Vec<RecordBatch>,
        properties: CommitProperties,
        target_file_size: Option<NonZeroU64>,
    ) -> Result<(u64, u64, u64)> {
        let properties = log_cleanup_on_checkpoints(properties, &table);
        let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
        let table_schema = self.arrow_schema(&table)?;
        let added = batches
            .first()
            .and_then(|b| grown_by(&table_schema, &b.schema()));
        if let Some(merged) = &added {
            let columns = added_column_names(&table_schema, merged);
            info!(table = %self.url, columns = %columns.join(", "), "columns added to the table in this commit");
        }
        let writers = writers_for(&batches);
        if rows == 0 {
            let snapshot = table.snapshot().map_err(|e| self.err(e))?;
            let mut actions = vec![];
            if let Some(merged) = &added {
                let normalized = deltalake::kernel::schema::cast::normalize_for_delta(merged);
                let schema: StructType = normalized
                    .as_ref()
                    .try_into_kernel()
                    .map_err(|e| self.err(e.into()))?;
                let metadata = snapshot
                    .metadata()
                    .clone()
                    .with_schema(&schema)
                    .map_err(|e| self.err(e.into()))?;
                actions.push(Action::Metadata(metadata));
            }
            // No file added: nothing to read back from the commit.
            let table = self.commit_appended(table, actions, properties).await?;
            *self.table.lock().await = Some(table);
            return Ok((0, 0, 0));
        }
        if added.is_none()
            && plain_for_append(&table)
            && batches
                .iter()
                .all(|b| casts_losslessly(&b.schema(), &table_schema))
        {
            // Encoded by our own writers (several at once for a large batch), one commit: see
            // `parquet_write`.
            let adds = encode_parallel(&table, batches, writers, target_file_size)
                .await
                .map_err(|e| self.err(e))?;
            let (files, bytes) = (
                adds.len() as u64,
                adds.iter().map(|a| a.size.max(0) as u64).sum(),
            );
            let actions = adds.into_iter().map(Action::Add).collect();
            let table = self.commit_appended(table, actions, properties).await?;
            *self.table.lock().await = Some(table);
            return Ok((rows, files, bytes));
        }
        let mut write = table
            .write(batches.into_iter().filter(|b| b.num_rows() > 0))
            .with_save_mode(SaveMode::Append)
            .with_writer_properties(writer_properties())
            .with_commit_properties(properties);
        if target_file_size.is_some() {
            write = write.with_target_file_size(target_file_size);
        }
        if added.is_some() {
            write = write.with_schema_mode(SchemaMode::Merge);
        }
        let table = write.await.map_err(|e| self.err(e))?;
        let (files, bytes) = self.added_files(&table).await?;
        *self.table.lock().await = Some(table);
        Ok((rows, files, bytes))
    }

    /// Commits `actions` (added files, a schema change, or nothing but the txn) as an append to
    /// `table` with `properties`, and returns the table at the version committed.
    ///
    /// The table's state is the one delta-rs brought up to that version after the commit (its
    /// post-commit step reads the new commit into the snapshot it was given), as its own `write`
    /// operation returns it; loading it again cost every such commit another listing of the log
    /// (about 2 ms a batch on a local disk, more as the log grows).
    async fn commit_appended(
        &self,
        mut table: DeltaTable,
        actions: Vec<Action>,
        properties: CommitProperties,
    ) -> Result<DeltaTable> {
        let snapshot = table.snapshot().map_err(|e| self.err(e))?;
        // As delta-rs's `write` records it (`DESCRIBE HISTORY` shows it).
        let partitioned_by = snapshot.metadata().partition_columns();
        let operation = DeltaOperation::Write {
            mode: SaveMode::Append,
            partition_by: (!partitioned_by.is_empty()).then(|| partitioned_by.to_vec()),
            predicate: None,
        };
        let committed = CommitBuilder::from(properties)
            .with_actions(actions)
            .build(Some(snapshot), table.log_store(), operation)
            .await
            .map_err(|e| self.err(e))?;
        table.state = Some(committed.snapshot);
        Ok(table)
    }

    /// Upserts `batches` on the `key` columns (MERGE: matching rows updated, others inserted)
    /// in one commit with `properties`, or commits the txn alone if there are no rows. Returns
    /// (rows, files, bytes) added.
    async fn merge(
        &self,
        table: DeltaTable,
        batches: Vec<RecordBatch>,
        key: &[String],
        properties: CommitProperties,
    ) -> Result<(u64, u64, u64)> {
        let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
        let Some(schema) = batches
            .iter()
            .find(|b| b.num_rows() > 0)
            .map(|b| b.schema())
        else {
            return self.append(table, Vec::new(), properties, None).await;
        };
        let properties = log_cleanup_on_checkpoints(properties, &table);
        let ctx = deltalake::datafusion::prelude::SessionContext::new();
        let source = ctx
            .read_batches(batches.into_iter().filter(|b| b.num_rows() > 0))
            .map_err(|e| self.err(e.into()))?;
        let predicate = key
            .iter()
            .map(|k| format!("(target.{q} IS NOT DISTINCT FROM source.{q})", q = ident(k)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let adds_columns = grown_by(&self.arrow_schema(&table)?, &schema).is_some();
        let (table, _metrics) = table
            .merge(source, predicate)
            .with_source_alias("source")
            .with_target_alias("target")
            .with_merge_schema(adds_columns)
            .with_writer_properties(writer_properties())
            .with_commit_properties(properties)
            .when_matched_update(|update| {
                columns.iter().fold(update, |u, c| {
                    u.update(c.as_str(), format!("source.{}", ident(c)))
                })
            })
            .and_then(|m| {
                m.when_not_matched_insert(|insert| {
                    columns.iter().fold(insert, |i, c| {
                        i.set(c.as_str(), format!("source.{}", ident(c)))
                    })
                })
            })
            .map_err(|e| self.err(e))?
            .await
            .map_err(|e| self.err(e))?;
        let (files, bytes) = self.added_files(&table).await?;
        *self.table.lock().await = Some(table);
        Ok((rows, files, bytes))
    }

    /// Replaces the rows matching `predicate` with `rows` in one commit carrying
    /// `txn(app_id, 0)`, unless the table already holds that txn. A commit that conflicts with
    /// a concurrent writer is retried on the new table version, with backoff (a recomputation
    /// runs again for each attempt). That includes a compaction committed since the version the
    /// replacement read: delta-rs refuses it (`ConcurrentAppend`: the compacted file holds rows
    /// the predicate matches; pinned by a test).
    async fn replace_where(
        &self,
        app_id: &str,
        rows: NewRows<'_>,
        predicate: &str,
        properties: impl Fn() -> CommitProperties,
    ) -> Result<CommitOutcome> {
        let mut retry = ConflictRetry::new(self, format!("replacement {app_id}"));
        loop {
            let table = self.latest().await?;
            if self.txn_version(&table, app_id).await? == Some(0) {
                return Ok(CommitOutcome::AlreadyCommitted);
            }
            let table_schema = self.arrow_schema(&table)?;
            let letters;
            let rows = match &rows {
                NewRows::DeadLettersOf(recomputed) => {
                    let batches = Arc::clone(recomputed)
                        .dead_letters()
                        .await
                        .map_err(SinkError::Engine)?;
                    letters = NewRows::Batches(batches);
                    &letters
                }
                rows => rows,
            };
            let written = Arc::new(AtomicU64::new(0));
            let empty = match rows {
                NewRows::Batches(batches) => batches.iter().all(|b| b.num_rows() == 0),
                _ => false,
            };
            let result = if empty {
                // `write` refuses empty input: delete what the ranges produced, with the txn.
                table
                    .delete()
                    .with_writer_properties(writer_properties())
                    .with_predicate(predicate)
                    .with_commit_properties(properties())
                    .await
                    .map(|(table, _)| table)
            } else {
                let (write, schema) = match rows {
                    NewRows::Batches(batches) => {
                        written.store(batches.iter().map(|b| b.num_rows() as u64).sum(), SeqCst);
                        let rows = batches.iter().filter(|b| b.num_rows() > 0).cloned();
                        (table.write(rows), batches[0].schema())
                    }
                    NewRows::Recomputed(recomputed) => {
                        let counted = Arc::clone(&written);
                        let output = Arc::clone(recomputed).output();
                        let schema = output.schema();
                        let counting = output.inspect_ok(move |b| {
                            counted.fetch_add(b.num_rows() as u64, SeqCst);
                        });
                        let output =
                            Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&schema), counting));
                        let plan = plan_reading_once(output).map_err(|e| self.err(e))?;
                        (table.write(Vec::new()).with_input_plan(plan), schema)
                    }
                    NewRows::DeadLettersOf(_) => unreachable!("resolved above"),
                };
                let mut write = write
                    .with_save_mode(SaveMode::Overwrite)
                    .with_writer_properties(writer_properties())
                    .with_replace_where(predicate)
                    .with_commit_properties(properties());
                // Rows in columns the table lacks yet (a batch that added them crashed before
                // its commit) add them, as an append would.
                if grown_by(&table_schema, &schema).is_some() {
                    write = write.with_schema_mode(SchemaMode::Merge);
                }
                write.await
            };
            match result {
                Ok(mut table) => {
                    // Brought up to date first: a delete that matched nothing committed
                    // nothing, and its table is the version read above — the txn-only commit
                    // below is built on the latest, and another backfill's txn is seen.
                    table.update_state().await.map_err(|e| self.err(e))?;
                    if self.txn_version(&table, app_id).await? != Some(0) {
                        // Nothing matched and nothing was written: record the txn alone.
                        let snapshot = table.snapshot().map_err(|e| self.err(e))?;
                        let committed = CommitBuilder::from(properties())
                            .with_actions(vec![])
                            .build(
                                Some(snapshot),
                                table.log_store(),
                                DeltaOperation::Delete {
                                    predicate: Some(predicate.to_string()),
                                },
                            )
                            .await
                            .map_err(|e| self.err(e))?;
                        table.state = Some(committed.snapshot);
                    }
                    let (files, bytes) = self.added_files(&table).await?;
                    let rows = written.load(SeqCst);
                    let version = table.version().and_then(|v| i64::try_from(v).ok());
                    *self.table.lock().await = Some(table);
                    return Ok(CommitOutcome::Committed {
                        rows,
                        files,
                        bytes,
                        version,
                    });
                }
                Err(e) => {
                    if !retry.again(&e).await {
                        return Err(self.err(e));
                    }
                }
            }
        }
    }

    /// The error for a side table that holds a later batch of the job than this run expects.
    fn ahead(&self, job_id: &str, found: i64, batch: BatchId) -> SinkError {
        SinkError::Engine(sluice_engine::Error::SideTableAhead {
            role: self.role.to_string(),
            table: self.url.to_string(),
            job_id: job_id.to_string(),
            found: BatchId(found),
            expected: format!("the batch being committed ({batch})"),
        })
    }

    /// Appends one batch's rows with `txn(job_id, batch_id)` unless the table already holds that
    /// batch (`None`). A side table holding a later batch is an error (`SideTableAhead`:
    /// left by an earlier run whose output was deleted — skipping would lose this run's rows).
    /// With `in_sequence` (the output table), the table's txn version must be the previous batch;
    /// a later one means another instance committed ([`sluice_engine::Error::AnotherInstance`]).
    /// A commit that delta-rs rejects because a concurrent commit removed files (a backfill
    /// replacing rows) is retried on the new version: appended rows never depend on what other
    /// commits removed. `loaded`: the table as the caller brought it to its latest version
    /// before this call (the output table, loaded for the another-instance check before the
    /// side tables commit), for the first attempt; each retry loads it again. Should another
    /// writer commit meanwhile, delta-rs either puts this commit after it (no conflict: an
    /// append, a compaction) or refuses it as a conflict — a txn of the same job among them —
    /// and the retry sees that commit.
    #[allow(clippy::too_many_arguments)]
    async fn append_batch(
        &self,
        job_id: &str,
        batch_id: BatchId,
        batches: &[RecordBatch],
        properties: impl Fn() -> CommitProperties,
        write: BatchWrite<'_>,
        in_sequence: bool,
        mut loaded: Option<DeltaTable>,
    ) -> Result<Option<(u64, u64, u64)>> {
        let mut retry = ConflictRetry::new(self, format!("batch {}", batch_id.0));
        loop {
            let table = match loaded.take() {
                Some(table) => table,
                None => self.latest().await?,
            };
            let found = self.txn_version(&table, job_id).await?;
            match found {
                Some(v) if v == batch_id.0 => return Ok(None),
                Some(v) if v > batch_id.0 && in_sequence => {
                    return Err(SinkError::Engine(sluice_engine::Error::AnotherInstance {
                        job_id: job_id.to_string(),
                        batch_id: BatchId(v),
                        table: self.url.to_string(),
                    }));
                }
                Some(v) if v > batch_id.0 => {
                    return Err(self.ahead(job_id, v, batch_id));
                }
                _ => {}
            }
            let expected = (batch_id.0 > 0).then(|| batch_id.0 - 1);
            if in_sequence && found != expected {
                return Err(SinkError::ConcurrentWriter {
                    table: self.url.to_string(),
                    job_id: job_id.to_string(),
                    expected,
                    found,
                });
            }
            if in_sequence {
                pause_point("before_output_commit", batch_id).await;
            }
            let written = match write {
                BatchWrite::Append { target_file_size } => {
                    self.append(table, batches.to_vec(), properties(), target_file_size)
                        .await
                }
                BatchWrite::Merge { key } => {
                    self.merge(table, batches.to_vec(), key, properties()).await
                }
            };
            match written {
                Ok(added) => return Ok(Some(added)),
                Err(e) => {
                    let conflict = match &e {
                        SinkError::Delta { source, .. } => retry.again(source).await,
                        _ => false,
                    };
                    if !conflict {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Files and bytes added by the commit at the version `table` holds: on the append paths,
    /// this instance's own (a replace brings its table up to date first, so there it may be a
    /// later writer's).
    async fn added_files(&self, table: &DeltaTable) -> Result<(u64, u64)> {
        let Some(version) = table.version() else {
            return Ok((0, 0));
        };
        let Some(entry) = table
            .log_store()
            .read_commit_entry(version)
            .await
            .map_err(|e| self.err(e))?
        else {
            return Ok((0, 0));
        };
        let (mut files, mut bytes) = (0, 0);
        for add in actions(&entry).filter_map(|a| a.get("add").cloned()) {
            files += 1;
            bytes += add.get("size").and_then(|s| s.as_u64()).unwrap_or(0);
        }
        Ok((files, bytes))
    }
}

/// The actions of one commit file (a JSON object a line).
fn actions(commit: &[u8]) -> impl Iterator<Item = serde_json::Map<String, serde_json::Value>> {
    commit
        .split(|b| *b == b'\n')
        .filter_map(|line| match serde_json::from_slice(line) {
            Ok(serde_json::Value::Object(action)) => Some(action),
            _ => None,
        })
}

/// The version of the last txn action of `app_id` in one commit, if any.
fn txn_in_commit(commit: &[u8], app_id: &str) -> Option<i64> {
    let mut found = None;
    for action in actions(commit) {
        if let Some(txn) = action.get("txn")
            && txn.get("appId").and_then(|a| a.as_str()) == Some(app_id)
        {
            found = txn.get("version").and_then(serde_json::Value::as_i64);
        }
    }
    found
}

/// How many times a commit rejected because of a concurrent commit is tried in all.
const MAX_CONFLICT_TRIES: u32 = 20;

/// The backoff of a commit that delta-rs rejected because a concurrent commit conflicts with
/// it (the live job and a backfill racing): 100 ms doubling to 5 s, at most
/// [`MAX_CONFLICT_TRIES`] tries. Shared by appends and replacements; each retry is counted in
/// the sink's conflict counter.
struct ConflictRetry {
    table: String,
    what: String,
    attempt: u32,
    delay: std::time::Duration,
    conflicts: Arc<AtomicU64>,
}

impl ConflictRetry {
    fn new(table: &TableHandle, what: String) -> Self {
        ConflictRetry {
            table: table.url.to_string(),
            what,
            attempt: 0,
            delay: std::time::Duration::from_millis(100),
            conflicts: Arc::clone(&table.conflicts),
        }
    }

    /// Whether `error` is a conflict worth another try; if so, logs it and waits first.
    async fn again(&mut self, error: &deltalake::DeltaTableError) -> bool {
        self.attempt += 1;
        let conflict = matches!(
            error,
            deltalake::DeltaTableError::Transaction {
                source: deltalake::kernel::transaction::TransactionError::CommitConflict(_),
            }
        );
        if !conflict || self.attempt >= MAX_CONFLICT_TRIES {
            return false;
        }
        self.conflicts.fetch_add(1, SeqCst);
        warn!(table = %self.table, what = %self.what, attempt = self.attempt, retry_in_ms = self.delay.as_millis() as u64, %error, "commit conflicted with a concurrent commit; retrying on the new version");
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(std::time::Duration::from_secs(5));
        true
    }
}

/// A UTC timestamp (µs since the epoch) as a SQL literal of the event-time type, in the form
/// delta-rs itself writes predicates in (it records each commit's predicate as text).
fn timestamp(micros: i64) -> String {
    let text = chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.6f").to_string())
        .unwrap_or_default();
    format!("arrow_cast('{text}', 'Timestamp(Microsecond, Some(\"UTC\"))')")
}

/// The rows a replacement writes.
enum NewRows<'a> {
    /// Rows in memory.
    Batches(Vec<RecordBatch>),
    /// A backfill's output, recomputed and streamed for each commit attempt.
    Recomputed(&'a Arc<dyn RecomputedRows>),
    /// A backfill's dead letters, asked for once the table is known to need them.
    DeadLettersOf(&'a Arc<dyn RecomputedRows>),
}

/// A plan whose one scan reads `stream`: rows produced while they are written (a write runs its
/// input plan once).
fn plan_reading_once(
    stream: SendableRecordBatchStream,
) -> std::result::Result<LogicalPlan, DeltaTableError> {
    let schema = stream.schema();
    let table = StreamingTable::try_new(
        Arc::clone(&schema),
        vec![Arc::new(ReadOnce {
            schema,
            stream: std::sync::Mutex::new(Some(stream)),
        })],
    )?;
    Ok(
        LogicalPlanBuilder::scan("recomputed", provider_as_source(Arc::new(table)), None)?
            .build()?,
    )
}

/// The one partition of [`plan_reading_once`].
struct ReadOnce {
    schema: SchemaRef,
    stream: std::sync::Mutex<Option<SendableRecordBatchStream>>,
}

impl std::fmt::Debug for ReadOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadOnce").finish_non_exhaustive()
    }
}

impl PartitionStream for ReadOnce {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let stream = self.stream.lock().ok().and_then(|mut s| s.take());
        stream.unwrap_or_else(|| {
            let error = DataFusionError::Internal("a recomputation's rows were read twice".into());
            Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.schema),
                futures::stream::once(async move { Err(error) }),
            ))
        })
    }
}

/// `(_source_partition = '0' AND _source_offset >= 10 AND _source_offset < 20) OR …`; `false`
/// when every range is empty.
fn lineage_predicate(ranges: &BTreeMap<PartitionId, OffsetRange>) -> String {
    let parts: Vec<String> = ranges
        .iter()
        .filter(|(_, r)| !r.is_empty())
        .map(|(p, r)| {
            format!(
                "({SOURCE_PARTITION} = {} AND {SOURCE_OFFSET} >= {} AND {SOURCE_OFFSET} < {})",
                quote(p),
                r.start,
                r.end
            )
        })
        .collect();
    if parts.is_empty() {
        "false".into()
    } else {
        parts.join(" OR ")
    }
}

/// Commits between Delta checkpoints of the tables Sluice creates (`delta.checkpointInterval`;
/// a table created elsewhere keeps its own).
///
/// A streaming writer commits every batch, and loading a table reads every commit since its
/// last checkpoint, delta-rs holding a JSON decoder (~0.4 MB) per commit file while it does:
/// with delta-rs's default of 100, opening a table mid-interval cost up to ~45 MB, several
/// times over in a backfill (each table, each retry). At 10 (Delta Lake's own default) it is a
/// checkpoint file per ten batches and a few megabytes per load.
const CHECKPOINT_INTERVAL: u64 = 10;

/// A SQL string literal.
/// A column name as a quoted SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// How a batch's rows are written.
#[derive(Debug, Clone, Copy)]
enum BatchWrite<'a> {
    /// Appended, in files of about this size.
    Append {
        target_file_size: Option<NonZeroU64>,
    },
    /// Merged on these key columns.
    Merge { key: &'a [String] },
}

/// The table's schema grown by what `batch` adds (see [`with_added_columns`]), if it adds
/// anything.
fn grown_by(table: &SchemaRef, batch: &Schema) -> Option<SchemaRef> {
    let merged = with_added_columns(table, batch);
    (merged != *table).then_some(merged)
}

/// The table's schema with what `batch` adds: columns the table lacks at the end, and fields
/// a struct column lacks at the end of that struct (recursively, also the structs of lists). Columns the batch lacks are
/// kept (they read as null).
fn with_added_columns(table: &Schema, batch: &Schema) -> SchemaRef {
    fn merge_fields(table: &Fields, batch: &Fields) -> Fields {
        let mut fields: Vec<Field> = table
            .iter()
            .map(|t| match batch.find(t.name()) {
                Some((_, b)) => t
                    .as_ref()
                    .clone()
                    .with_data_type(merge_types(t.data_type(), b.data_type())),
                None => t.as_ref().clone(),
            })
            .collect();
        for b in batch {
            if table.find(b.name()).is_none() {
                fields.push(b.as_ref().clone().with_nullable(true));
            }
        }
        Fields::from(fields)
    }
    /// The table's type with the struct fields (in structs, in the structs of lists) the
    /// batch's adds.
    fn merge_types(table: &DataType, batch: &DataType) -> DataType {
        match (table, batch) {
            (DataType::Struct(t), DataType::Struct(b)) => DataType::Struct(merge_fields(t, b)),
            (DataType::List(t), DataType::List(b)) => DataType::List(Arc::new(
                t.as_ref()
                    .clone()
                    .with_data_type(merge_types(t.data_type(), b.data_type())),
            )),
            _ => table.clone(),
        }
    }
    Arc::new(Schema::new_with_metadata(
        merge_fields(table.fields(), batch.fields()),
        table.metadata().clone(),
    ))
}

/// The columns (`a`, or `a.b` for a struct's field) in `merged` that `table` lacks.
fn added_column_names(table: &Schema, merged: &Schema) -> Vec<String> {
    fn walk(prefix: &str, table: &Fields, merged: &Fields, out: &mut Vec<String>) {
        for m in merged {
            let name = format!("{prefix}{}", m.name());
            let Some((_, t)) = table.find(m.name()) else {
                out.push(name);
                continue;
            };
            let (mut t_type, mut m_type) = (t.data_type(), m.data_type());
            while let (DataType::List(ti), DataType::List(mi)) = (t_type, m_type) {
                (t_type, m_type) = (ti.data_type(), mi.data_type());
            }
            if let (DataType::Struct(table_inner), DataType::Struct(inner)) = (t_type, m_type) {
                walk(&format!("{name}."), table_inner, inner, out);
            }
        }
    }
    let mut out = Vec::new();
    walk("", table.fields(), merged.fields(), &mut out);
    out
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The commitInfo key under which each commit records its job id and batch manifest, for humans
/// and `sluice status` (restart never relies on it: checkpoints drop commitInfo).
pub const COMMIT_METADATA_KEY: &str = "sluice";

fn properties(job_id: &str, batch_id: BatchId, manifest: &serde_json::Value) -> CommitProperties {
    CommitProperties::default()
        .with_application_transaction(Transaction::new(job_id, batch_id.0))
        .with_metadata([(
            COMMIT_METADATA_KEY.to_string(),
            serde_json::json!({ "job_id": job_id, "manifest": manifest }),
        )])
}

/// Asks delta-rs to clean up expired commit files only on a commit that writes a Delta
/// checkpoint (every `delta.checkpointInterval` commits), as Delta Lake's own writer does.
/// delta-rs otherwise does it after every commit, and the cleanup lists the whole `_delta_log`:
/// for a job committing every few seconds that is a month of commits (`log_retention`) listed
/// per batch. On a checkpoint commit the table decides (`delta.enableExpiredLogCleanup`,
/// default true). The commit's version is taken as the one after `table`'s; a commit that
/// lands elsewhere (a concurrent writer) just cleans up, or not, one checkpoint later.
fn log_cleanup_on_checkpoints(
    properties: CommitProperties,
    table: &DeltaTable,
) -> CommitProperties {
    let writes_checkpoint = table.snapshot().is_ok_and(|snapshot| {
        let interval = snapshot.table_config().checkpoint_interval().get();
        (snapshot.version() + 2).is_multiple_of(interval)
    });
    if writes_checkpoint {
        properties
    } else {
        properties.with_cleanup_expired_logs(Some(false))
    }
}

#[async_trait]
impl Sink for DeltaSink {
    fn location(&self) -> &Url {
        &self.output.url
    }

    fn storage_options(&self) -> StorageOptions {
        self.output.options.clone()
    }

    async fn open(&mut self, job_id: &str, tables: OutputTables) -> sluice_engine::Result<()> {
        self.job_id = job_id.to_string();
        self.merge_key = tables.merge_key;
        self.output.open_or_create(&tables.output).await?;
        self.dead_letters
            .open_or_create(&dead_letter_schema())
            .await?;
        if let Some(late_schema) = tables.late {
            self.late.open_or_create(&late_schema).await?;
        }
        Ok(())
    }

    async fn compaction_due(&self) -> sluice_engine::Result<bool> {
        if !self.compaction.enabled {
            return Ok(false);
        }
        for table in [&self.output, &self.dead_letters, &self.late] {
            let (_, due) = table
                .partitions_due(self.target_file_size, self.compaction.min_files)
                .await?;
            if !due.is_empty() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn compact(&self) -> sluice_engine::Result<Compaction> {
        let mut done = Compaction::default();
        if !self.compaction.enabled {
            return Ok(done);
        }
        for table in [&self.output, &self.dead_letters, &self.late] {
            let c = table
                .compact(self.target_file_size, self.compaction.min_files)
                .await?;
            done.files_removed += c.files_removed;
            done.files_added += c.files_added;
        }
        Ok(done)
    }

    fn can_replace(&self) -> bool {
        true
    }

    async fn replace(&self, r: Replacement) -> sluice_engine::Result<CommitOutcome> {
        let lineage = lineage_predicate(&r.ranges);
        let props = || {
            CommitProperties::default()
                .with_application_transaction(Transaction::new(&r.app_id, 0))
                .with_metadata([(
                    COMMIT_METADATA_KEY.to_string(),
                    serde_json::json!({ "job_id": r.app_id, "backfill": r.summary }),
                )])
        };
        let output_predicate = match &r.windows {
            None => lineage.clone(),
            Some(w) if w.values.is_empty() => "false".to_string(),
            Some(w) => {
                let values: Vec<String> = w.values.iter().map(|v| timestamp(*v)).collect();
                format!("{} IN ({})", ident(&w.column), values.join(", "))
            }
        };
        // The output first: the recomputation runs while its rows are written, and its dead
        // letters are known once they all have been.
        let outcome = self
            .output
            .replace_where(
                &r.app_id,
                NewRows::Recomputed(&r.rows),
                &output_predicate,
                props,
            )
            .await?;
        let dead_letter_predicate = format!("{SOURCE_NAME} = {} AND ({lineage})", quote(&r.source));
        self.dead_letters
            .replace_where(
                &r.app_id,
                NewRows::DeadLettersOf(&r.rows),
                &dead_letter_predicate,
                props,
            )
            .await?;
        // A windowed job: the recomputation counted every row of its windows, so late rows
        // that missed one of them leave the late table — only those among the offsets it
        // read: those the live job committed since were not counted and stay late.
        if let Some(w) = &r.windows
            && self.late.open_existing().await?.is_some()
        {
            let missed = w
                .starts
                .iter()
                .map(|s| format!("array_has({WINDOWS_MISSED}, {})", timestamp(*s)))
                .collect::<Vec<_>>();
            let missed = if missed.is_empty() {
                "false".to_string()
            } else {
                format!(
                    "({}) AND ({})",
                    missed.join(" OR "),
                    lineage_predicate(&w.read)
                )
            };
            self.late
                .replace_where(&r.app_id, NewRows::Batches(Vec::new()), &missed, props)
                .await?;
        }
        Ok(outcome)
    }

    async fn committed_batch(&self, job_id: &str) -> sluice_engine::Result<Option<BatchId>> {
        let Some(table) = self.output.open_existing().await? else {
            return Ok(None);
        };
        Ok(self.output.txn_version(&table, job_id).await?.map(BatchId))
    }

    async fn side_table_batches(&self, job_id: &str) -> sluice_engine::Result<Vec<SideTableBatch>> {
        let mut out = Vec::new();
        for table in [&self.dead_letters, &self.late] {
            let last_batch = match table.open_existing().await? {
                Some(t) => table.txn_version(&t, job_id).await?.map(BatchId),
                None => None,
            };
            out.push(SideTableBatch {
                role: table.role.to_string(),
                location: table.url.to_string(),
                last_batch,
            });
        }
        Ok(out)
    }

    fn commit_conflicts(&self) -> u64 {
        self.conflicts.load(SeqCst)
    }

    async fn read_output(&self) -> sluice_engine::Result<Vec<RecordBatch>> {
        Ok(self.output.read(&TableScan::all()).await?)
    }

    async fn read_late(&self, scan: &TableScan) -> sluice_engine::Result<Vec<RecordBatch>> {
        Ok(self.late.read(scan).await?)
    }

    async fn read_dead_letters(&self, scan: &TableScan) -> sluice_engine::Result<Vec<RecordBatch>> {
        Ok(self.dead_letters.read(scan).await?)
    }

    async fn commit(&self, batch: BatchCommit) -> sluice_engine::Result<CommitOutcome> {
        let batch_id = batch.batch_id;
        let props = || properties(&self.job_id, batch_id, &batch.manifest);

        // 0. A batch the output table holds already was committed by another instance (a
        //    restart never reruns a committed batch): stop before touching the side tables,
        //    which would otherwise look "ahead" of this run.
        let output = self.output.latest().await?;
        if let Some(found) = self.output.txn_version(&output, &self.job_id).await?
            && found >= batch_id.0
        {
            return Err(sluice_engine::Error::AnotherInstance {
                job_id: self.job_id.clone(),
                batch_id: BatchId(found),
                table: self.output.url.to_string(),
            });
        }

        // 1. Side tables first, each skipped if it already holds this batch.
        for (table, rows) in [
            (&self.dead_letters, &batch.dead_letters),
            (&self.late, &batch.late),
        ] {
            // A batch without rows for a side table still commits there when its (empty)
            // batches bring columns the table lacks: the columns join in this batch's commit.
            if rows.iter().any(|b| b.num_rows() > 0) || table.lacks_columns_of(rows).await {
                let write = BatchWrite::Append {
                    target_file_size: self.target_file_size,
                };
                table
                    .append_batch(&self.job_id, batch_id, rows, props, write, false, None)
                    .await?;
            }
        }
        crash_point("after_side_tables", batch_id);

        // 2. The output commit, exactly once.
        let Some((rows, files, bytes)) = self
            .output
            .append_batch(
                &self.job_id,
                batch_id,
                &batch.output,
                props,
                match &self.merge_key {
                    Some(key) => BatchWrite::Merge { key },
                    None => BatchWrite::Append {
                        target_file_size: self.target_file_size,
                    },
                },
                true,
                Some(output),
            )
            .await?
        else {
            return Ok(CommitOutcome::AlreadyCommitted);
        };
        let version = self
            .output
            .table
            .lock()
            .await
            .as_ref()
            .and_then(|t| t.version())
            .and_then(|v| i64::try_from(v).ok());
        Ok(CommitOutcome::Committed {
            rows,
            files,
            bytes,
            version,
        })
    }
}

/// Every row of `table` at the version it holds, as a DataFusion frame to filter or collect.
///
/// # Errors
/// If the table's files cannot be listed or planned.
pub(crate) async fn table_frame(
    table: &DeltaTable,
) -> deltalake::DeltaResult<deltalake::datafusion::dataframe::DataFrame> {
    let ctx = deltalake::datafusion::prelude::SessionContext::new();
    table.update_datafusion_session(&ctx.state())?;
    let provider = table.table_provider().await?;
    Ok(ctx.read_table(provider)?)
}

/// Rows in the Delta table at `url` (from the file statistics; reads no data).
///
/// # Errors
/// If the table cannot be loaded.
pub async fn table_row_count(url: &Url, options: &StorageOptions) -> Result<u64> {
    register_cloud_stores();
    let table = deltalake::open_table_with_storage_options(url.clone(), options.to_map())
        .await
        .map_err(|source| SinkError::Delta {
            table: url.to_string(),
            source,
        })?;
    row_count(&table).map_err(|source| SinkError::Delta {
        table: url.to_string(),
        source,
    })
}

/// Rows of a loaded table, from its file statistics.
fn row_count(table: &DeltaTable) -> deltalake::DeltaResult<u64> {
    Ok(table
        .snapshot()?
        .log_data()
        .iter()
        .map(|f| f.num_records().unwrap_or(0) as u64)
        .sum())
}

/// Deletes the data files of the Delta table at `url` that its latest snapshot does not
/// reference and that were removed (or, never referenced, written) more than `retention` ago;
/// returns them (only lists them when `dry_run`). delta-rs's full vacuum: the log, and every
/// folder starting with `_` (the checkpoint `_sluice/`), are never touched.
///
/// # Errors
/// If the table cannot be loaded or a file cannot be deleted.
pub async fn vacuum(
    url: &Url,
    options: &StorageOptions,
    retention: std::time::Duration,
    dry_run: bool,
) -> Result<Vec<String>> {
    register_cloud_stores();
    let err = |source| SinkError::Delta {
        table: url.to_string(),
        source,
    };
    let table = deltalake::open_table_with_storage_options(url.clone(), options.to_map())
        .await
        .map_err(err)?;
    let retention = chrono::Duration::from_std(retention)
        .map_err(|e| SinkError::Config(format!("retention is too long: {e}")))?;
    let (_, metrics) = table
        .vacuum()
        .with_mode(deltalake::operations::vacuum::VacuumMode::Full)
        .with_retention_period(retention)
        // The user chose the retention; a shorter one than the table's
        // delta.deletedFileRetentionDuration is theirs to choose.
        .with_enforce_retention_duration(false)
        .with_dry_run(dry_run)
        .await
        .map_err(err)?;
    Ok(metrics.files_deleted)
}

/// What a table says about one job that writes it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobStatus {
    /// The job id (the txn app id).
    pub job_id: String,
    /// The last batch committed, from the table's txn version.
    pub last_batch: Option<i64>,
    /// The manifest recorded with the job's newest commit still in the log history.
    pub manifest: Option<serde_json::Value>,
}

/// What `sluice status` shows about a table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TableStatus {
    /// The table's Delta version.
    pub version: Option<u64>,
    /// Rows in the table (from file statistics).
    pub rows: u64,
    /// The Sluice jobs found in the table's recent history (newest commit first).
    pub jobs: Vec<JobStatus>,
}

/// Reads the status of the Delta table at `url`: version, rows, and for every Sluice job in its
/// last `history` commits, the committed batch (txn version) and that batch's manifest.
///
/// # Errors
/// If the table cannot be loaded.
pub async fn table_status(
    url: &Url,
    options: &StorageOptions,
    history: usize,
) -> Result<TableStatus> {
    use futures::TryStreamExt;
    register_cloud_stores();
    let err = |source| SinkError::Delta {
        table: url.to_string(),
        source,
    };
    let table = deltalake::open_table_with_storage_options(url.clone(), options.to_map())
        .await
        .map_err(err)?;
    let rows = row_count(&table).map_err(err)?;
    let infos: Vec<_> = table
        .history(Some(history))
        .try_collect()
        .await
        .map_err(err)?;
    let mut jobs: Vec<JobStatus> = Vec::new();
    for info in infos {
        let Some(meta) = info.info.get(COMMIT_METADATA_KEY) else {
            continue;
        };
        let Some(job_id) = meta.get("job_id").and_then(|j| j.as_str()) else {
            continue;
        };
        if jobs.iter().any(|j| j.job_id == job_id) {
            continue;
        }
        let last_batch = table
            .snapshot()
            .map_err(err)?
            .transaction_version(table.log_store().as_ref(), job_id)
            .await
            .map_err(err)?;
        jobs.push(JobStatus {
            job_id: job_id.to_string(),
            last_batch,
            manifest: meta.get("manifest").cloned(),
        });
    }
    Ok(TableStatus {
        version: table.version(),
        rows,
        jobs,
    })
}

/// A table's log store that writes one commit only: version `only`. Compaction commits through
/// it, so a compaction can never land over a commit it did not read: delta-rs's optimize
/// retries a lost race over the newer version, and its conflict checker ignores the
/// `dataChange = false` removes a compaction makes, so a compaction that read files a backfill
/// then replaced would commit and bring the replaced rows back. The rewrite lease keeps the two
/// apart; the fence makes a compaction that outlived its lease (paused past the lease timeout)
/// fail rather than commit. Every other call goes to the table's own log store.
#[derive(Debug)]
struct VersionFence {
    inner: LogStoreRef,
    only: u64,
}

impl VersionFence {
    /// `table` (its state as loaded) with its commits going through a fence admitting `only`.
    fn around(table: &DeltaTable, only: u64) -> DeltaTable {
        let mut fenced = DeltaTable::new(Arc::new(VersionFence {
            inner: table.log_store(),
            only,
        }));
        fenced.state = table.state.clone();
        fenced
    }
}

#[async_trait::async_trait]
impl LogStore for VersionFence {
    fn name(&self) -> String {
        self.inner.name()
    }

    async fn refresh(&self) -> deltalake::DeltaResult<()> {
        self.inner.refresh().await
    }

    async fn read_commit_entry(&self, version: u64) -> deltalake::DeltaResult<Option<Bytes>> {
        self.inner.read_commit_entry(version).await
    }

    async fn write_commit_entry(
        &self,
        version: u64,
        commit_or_bytes: CommitOrBytes,
        operation_id: uuid::Uuid,
    ) -> std::result::Result<(), TransactionError> {
        if version != self.only {
            return Err(TransactionError::VersionAlreadyExists(version));
        }
        self.inner
            .write_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn abort_commit_entry(
        &self,
        version: u64,
        commit_or_bytes: CommitOrBytes,
        operation_id: uuid::Uuid,
    ) -> std::result::Result<(), TransactionError> {
        self.inner
            .abort_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn get_latest_version(&self, start_version: u64) -> deltalake::DeltaResult<u64> {
        self.inner.get_latest_version(start_version).await
    }

    fn object_store(&self, operation_id: Option<uuid::Uuid>) -> Arc<dyn deltalake::ObjectStore> {
        self.inner.object_store(operation_id)
    }

    fn root_object_store(
        &self,
        operation_id: Option<uuid::Uuid>,
    ) -> Arc<dyn deltalake::ObjectStore> {
        self.inner.root_object_store(operation_id)
    }

    fn config(&self) -> &LogStoreConfig {
        self.inner.config()
    }
}

/// The URL schemes of the cloud stores, each opened by Sluice's own store factory.
const CLOUD_SCHEMES: [&str; 8] = ["s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "adl"];

/// delta-rs opens a table's store through factories registered per URL scheme. Sluice registers
/// its own for the cloud schemes, so a table's store is the one every other location gets
/// ([`sluice_engine::storage::open_store`]: configured from the environment and the
/// `storage_options`, patient with a store that is briefly down), and commits go through
/// delta-rs's default log store: a put-if-absent per version, no lock service.
pub fn register_cloud_stores() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        for scheme in CLOUD_SCHEMES {
            let Ok(url) = Url::parse(&format!("{scheme}://")) else {
                continue;
            };
            deltalake::logstore::object_store_factories()
                .insert(url.clone(), Arc::new(SluiceStores));
            deltalake::logstore::logstore_factories().insert(url, Arc::new(SluiceStores));
        }
    });
}

/// The store and log-store factory [`register_cloud_stores`] registers.
struct SluiceStores;

impl deltalake::logstore::ObjectStoreFactory for SluiceStores {
    fn parse_url_opts(
        &self,
        url: &Url,
        config: &deltalake::logstore::StorageConfig,
    ) -> deltalake::DeltaResult<(deltalake::logstore::ObjectStoreRef, deltalake::Path)> {
        open_store(url, &StorageOptions::from_map(&config.raw)).map_err(|e| {
            deltalake::DeltaTableError::GenericError {
                source: Box::new(e),
            }
        })
    }
}

impl deltalake::logstore::LogStoreFactory for SluiceStores {
    fn with_options(
        &self,
        prefixed_store: deltalake::logstore::ObjectStoreRef,
        root_store: deltalake::logstore::ObjectStoreRef,
        location: &Url,
        options: &deltalake::logstore::StorageConfig,
    ) -> deltalake::DeltaResult<Arc<dyn deltalake::logstore::LogStore>> {
        Ok(deltalake::logstore::default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

/// Turns a path or URL into a table URL (see [`sluice_engine::location::directory_url`]).
pub fn table_url(path: &str) -> sluice_engine::Result<Url> {
    sluice_engine::location::directory_url(path)
}

/// Parses a size such as `128MB`, `64MiB`, `1GB` or `1048576`.
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || {
        SinkError::Config(format!(
            "size '{text}' is not a number followed by B, KB, MB, GB, KiB, MiB or GiB"
        ))
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(scale).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array};
    use sluice_engine::Sink;

    /// `rows` rows of (`id` 0.., `v` = id × 3): 16 bytes of Arrow each.
    fn numbers(rows: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i * 3))),
            ],
        )
        .unwrap()
    }

    fn commit(batch_id: i64, output: Vec<RecordBatch>) -> BatchCommit {
        BatchCommit {
            batch_id: BatchId(batch_id),
            output,
            dead_letters: Vec::new(),
            late: Vec::new(),
            manifest: serde_json::json!({}),
        }
    }

    /// The txn version kept between batches follows commits of another writer: a second
    /// instance's commit is seen by the first (which then stops, not commits the batch again),
    /// and past a Delta checkpoint the kept answer equals delta-kernel's replay of a fresh handle.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_kept_txn_version_sees_another_writers_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let open = || async {
            let mut sink = DeltaSink::new(DeltaSinkConfig::new(path.to_str().unwrap())).unwrap();
            sink.open("job", OutputTables::append(numbers(1).schema()))
                .await
                .unwrap();
            sink
        };
        let first = open().await;
        for b in 0..2 {
            first.commit(commit(b, vec![numbers(3)])).await.unwrap();
        }
        let second = open().await;
        second.commit(commit(2, vec![numbers(3)])).await.unwrap();
        let err = first.commit(commit(2, vec![numbers(3)])).await.unwrap_err();
        assert!(
            matches!(
                err,
                sluice_engine::Error::AnotherInstance {
                    batch_id: BatchId(2),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            first.committed_batch("job").await.unwrap(),
            Some(BatchId(2))
        );
        // Each commit of the other writer read as it comes (through a Delta checkpoint) …
        for b in 3..3 + CHECKPOINT_INTERVAL as i64 {
            second.commit(commit(b, vec![numbers(1)])).await.unwrap();
            assert_eq!(
                first.committed_batch("job").await.unwrap(),
                Some(BatchId(b))
            );
        }
        // … and more commits than a checkpoint interval at once: delta-kernel's replay.
        let from = 3 + CHECKPOINT_INTERVAL as i64;
        for b in from..from + CHECKPOINT_INTERVAL as i64 + 2 {
            second.commit(commit(b, vec![numbers(1)])).await.unwrap();
        }
        let last = Some(BatchId(from + CHECKPOINT_INTERVAL as i64 + 1));
        assert_eq!(first.committed_batch("job").await.unwrap(), last);
        assert_eq!(open().await.committed_batch("job").await.unwrap(), last);
    }

    /// A commit leaves the handle with the table at the version it committed, taken from
    /// delta-rs's commit rather than loaded again: through batches with no rows (the txn
    /// alone), batches with rows and a Delta checkpoint, the table held is the log's latest
    /// version with the same files and the batch's txn, and each batch's files are counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_leaves_the_table_at_the_version_it_committed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut sink = DeltaSink::new(DeltaSinkConfig::new(path.to_str().unwrap())).unwrap();
        sink.open("job", OutputTables::append(numbers(1).schema()))
            .await
            .unwrap();
        let files = |table: &DeltaTable| {
            let mut paths: Vec<String> = table
                .snapshot()
                .unwrap()
                .log_data()
                .iter()
                .map(|f| f.path().to_string())
                .collect();
            paths.sort();
            paths
        };
        for b in 0..CHECKPOINT_INTERVAL as i64 + 3 {
            let output = match b % 3 {
                0 => vec![numbers(5)],
                _ => Vec::new(),
            };
            let expected = match output.is_empty() {
                true => (0, 0),
                false => (5, 1),
            };
            let outcome = sink.commit(commit(b, output)).await.unwrap();
            let CommitOutcome::Committed {
                rows,
                files: added,
                version,
                ..
            } = outcome
            else {
                panic!("batch {b}: {outcome:?}");
            };
            assert_eq!((rows, added), expected, "batch {b}");
            let held = sink.output.table.lock().await.clone().unwrap();
            let fresh = deltalake::open_table(sink.output.url.clone())
                .await
                .unwrap();
            assert_eq!(held.version(), fresh.version(), "batch {b}");
            assert_eq!(version, fresh.version().map(|v| v as i64), "batch {b}");
            assert_eq!(files(&held), files(&fresh), "batch {b}");
            let txn = held
                .snapshot()
                .unwrap()
                .transaction_version(held.log_store().as_ref(), "job")
                .await
                .unwrap();
            assert_eq!(txn, Some(b), "batch {b}");
        }
        assert!(
            path.join("_delta_log/_last_checkpoint").exists(),
            "the commits passed a Delta checkpoint"
        );
    }

    /// A batch of 70 MB of Arrow (above twice `MIN_ARROW_BYTES_PER_WRITER`): on two cores or
    /// more it is encoded by several writers into several files, all in the batch's one
    /// commit with its txn; every row is there once, and every file has Delta statistics.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_batch_is_encoded_by_several_writers_into_one_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut sink = DeltaSink::new(DeltaSinkConfig::new(path.to_str().unwrap())).unwrap();
        let rows: i64 = 4_400_000;
        let large = numbers(rows);
        let writers = crate::parquet_write::writers_for(std::slice::from_ref(&large));
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(
            writers,
            cores.min(2),
            "70 MB: two writers on two cores or more"
        );
        sink.open("job", OutputTables::append(large.schema()))
            .await
            .unwrap();
        // Sliced as a query's output arrives: several batches, cut anywhere.
        let output = vec![
            large.slice(0, 1_000_003),
            large.slice(1_000_003, 2_999_990),
            large.slice(3_999_993, (rows - 3_999_993) as usize),
        ];
        assert_eq!(crate::parquet_write::writers_for(&output), writers);
        let outcome = sink.commit(commit(0, output)).await.unwrap();
        let CommitOutcome::Committed { rows: n, files, .. } = outcome else {
            panic!("{outcome:?}");
        };
        assert_eq!(n, rows as u64);
        assert_eq!(files, writers as u64, "one file per writer");
        // A small batch after it stays one file.
        let outcome = sink.commit(commit(1, vec![numbers(10)])).await.unwrap();
        assert!(
            matches!(outcome, CommitOutcome::Committed { files: 1, .. }),
            "{outcome:?}"
        );
        assert_eq!(sink.committed_batch("job").await.unwrap(), Some(BatchId(1)));

        let mut ids = Vec::new();
        for b in sink.read_output().await.unwrap() {
            let id = b
                .column_by_name("id")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            let v = b
                .column_by_name("v")
                .unwrap()
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            for i in 0..id.len() {
                assert_eq!(v.value(i), id.value(i) * 3);
                ids.push(id.value(i));
            }
        }
        ids.sort_unstable();
        let mut expected: Vec<i64> = (0..rows).chain(0..10).collect();
        expected.sort_unstable();
        assert!(ids == expected, "every row once: {} rows read", ids.len());

        // Every add of the large commit carries statistics, and they cover the rows.
        let commit_file = path.join("_delta_log/00000000000000000001.json");
        let log = std::fs::read_to_string(&commit_file).unwrap();
        let mut records = 0;
        for line in log.lines() {
            let action: serde_json::Value = serde_json::from_str(line).unwrap();
            if let Some(add) = action.get("add") {
                let stats: serde_json::Value =
                    serde_json::from_str(add["stats"].as_str().unwrap()).unwrap();
                records += stats["numRecords"].as_i64().unwrap();
                assert!(stats["minValues"]["id"].is_i64(), "{stats}");
            }
        }
        assert_eq!(records, rows);
        assert!(log.contains(r#""appId":"job""#), "{log}");
    }

    /// delta-rs's optimize retries a lost race over the newer version (its commit ignores
    /// `max_retries`); through the [`VersionFence`] a compaction that read version v fails when
    /// another writer took v + 1 first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compaction_never_commits_over_a_version_it_did_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let url = Url::from_directory_path(dir.path()).unwrap();
        let schema: StructType = numbers(0).schema().as_ref().try_into_kernel().unwrap();
        let mut table = DeltaTable::try_from_url(url.clone())
            .await
            .unwrap()
            .create()
            .with_columns(schema.fields().cloned())
            .await
            .unwrap();
        // Row groups large enough to be copied (see `compaction`).
        for rows in 1..4 {
            table = table.write(vec![numbers(40_000 + rows)]).await.unwrap();
        }
        let read = table.version().unwrap();
        // Another writer commits read + 1.
        deltalake::open_table(url.clone())
            .await
            .unwrap()
            .write(vec![numbers(5)])
            .await
            .unwrap();

        let stale = VersionFence::around(&table, read + 1);
        let copied = compact_by_copy(&stale, &[], 1 << 30, 16, CommitProperties::default()).await;
        assert!(copied.is_err(), "compacted by copy over a newer version");
        assert!(
            stale.optimize().await.is_err(),
            "compacted over a newer version"
        );

        let unfenced = deltalake::open_table_with_version(url.clone(), read)
            .await
            .unwrap();
        assert!(
            unfenced.optimize().await.is_ok(),
            "delta-rs no longer retries optimize over a newer version: the fence may be moot"
        );
    }

    /// A backfill's replacement that read a version before a compaction (by copy, as on a
    /// plain table) of the files it replaces is refused by delta-rs (`ConcurrentAppend`: the
    /// compacted file holds rows its predicate matches), and so retried on the latest version
    /// — the other half of keeping compaction and replacement apart, which Sluice relies on
    /// rather than fences (see [`VersionFence`] for the compaction's half).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delta_rs_refuses_a_replacement_over_a_compaction_it_did_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let url = Url::from_directory_path(dir.path()).unwrap();
        let schema: StructType = numbers(0).schema().as_ref().try_into_kernel().unwrap();
        let mut table = DeltaTable::try_from_url(url.clone())
            .await
            .unwrap()
            .create()
            .with_columns(schema.fields().cloned())
            .await
            .unwrap();
        // Row groups large enough to be copied (see `compaction`).
        for _ in 0..3 {
            table = table.write(vec![numbers(40_000)]).await.unwrap();
        }
        // A compaction by another handle rewrites the three files into one.
        let other = deltalake::open_table(url.clone()).await.unwrap();
        let copied = compact_by_copy(&other, &[], 1 << 30, 16, CommitProperties::default())
            .await
            .unwrap();
        assert_eq!(copied.map(|c| c.files_removed), Some(3));
        // Replacing every row with 4 rows, from the version read before the compaction.
        let replace = |table: DeltaTable| {
            table
                .write(vec![numbers(4)])
                .with_save_mode(SaveMode::Overwrite)
                .with_replace_where("id >= 0")
        };
        let error = replace(table).await.unwrap_err();
        assert!(
            matches!(
                error,
                deltalake::DeltaTableError::Transaction {
                    source: TransactionError::CommitConflict(
                        deltalake::kernel::transaction::CommitConflictError::ConcurrentAppend
                    )
                }
            ),
            "delta-rs committed a replacement over a compaction it did not read ({error:?}): \
             replacements need a fence too"
        );
        let latest = deltalake::open_table(url.clone()).await.unwrap();
        assert_eq!(row_count(&latest).unwrap(), 120_000);
        // Retried on the latest version, it commits.
        let replaced = replace(latest).await.unwrap();
        assert_eq!(row_count(&replaced).unwrap(), 4);
    }

    /// A table with a CHECK constraint takes delta-rs's write, which enforces it, even for a
    /// batch large enough to be encoded in parallel.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_batch_into_a_constrained_table_keeps_the_constraint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        std::fs::create_dir_all(&path).unwrap();
        let url = Url::from_directory_path(&path).unwrap();
        let schema: StructType = numbers(0).schema().as_ref().try_into_kernel().unwrap();
        let table = DeltaTable::try_from_url(url.clone())
            .await
            .unwrap()
            .create()
            .with_columns(schema.fields().cloned())
            .await
            .unwrap();
        let table = table
            .add_constraint()
            .with_constraint("v_small", "v < 9000000")
            .await
            .unwrap();
        assert!(!crate::parquet_write::plain_for_append(&table));
        let mut sink = DeltaSink::new(DeltaSinkConfig::new(path.to_str().unwrap())).unwrap();
        sink.open("job", OutputTables::append(numbers(0).schema()))
            .await
            .unwrap();
        let error = sink
            .commit(commit(0, vec![numbers(4_400_000)]))
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("failed validation check"), "{error}");
        assert_eq!(sink.committed_batch("job").await.unwrap(), None);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("128MB").unwrap(), 128_000_000);
        assert_eq!(parse_size("64 MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("10").unwrap(), 10);
        assert!(
            parse_size("lots")
                .unwrap_err()
                .to_string()
                .contains("'lots'")
        );
    }
}
