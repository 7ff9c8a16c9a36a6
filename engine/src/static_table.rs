//! Static tables: tables a streaming query joins whole (a dimension table — users, products,
//! campaigns), read rather than streamed.
//!
//! A static table is read **at a version**: the batch intent records each table's version (the
//! newest at planning), so a rerun of the batch after a crash joins exactly the rows the first
//! attempt joined, and the manifest repeats it. A newer version is picked up by the next batch
//! that is planned; nothing waits for it. The rows of a version are read once and kept in
//! memory until a batch asks for another version.
//!
//! The join itself is DataFusion's (a hash join inside the batch's plan, see
//! `operators::stateful_node` for which joins a stream may take part in): a stream row
//! meets the table as it was at the batch's version, so the join needs no state across batches,
//! and its output for a row depends only on that row and the version — what lets the engine
//! isolate a failing row, and a rerun repeat the batch.
//!
//! The engine knows no concrete table: a Delta table is `sluice_sinks::DeltaTableSource`
//! (`[tables.NAME] kind = "delta"` in a job file); [`StaticTable`] is the trait to implement
//! for another.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, RecordBatch, UInt32Array};
use arrow::datatypes::{DataType, Int64Type, Schema, SchemaRef};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::checkpoint::CheckpointStore;
use crate::error::{BoxError, Error, Result};
use crate::offsets::{BatchId, SourceOffsets};
use crate::operators::QueryOutput;
use crate::query::{BatchWatermark, StreamingQuery};
use crate::schema::same_but_layout;
use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};

/// A table read whole at a version the batch intent records.
#[async_trait]
pub trait StaticTable: Send + Sync + std::fmt::Debug {
    /// Opens the table and returns its schema: the query is planned against it. Called once,
    /// before the query is planned.
    async fn open(&mut self) -> std::result::Result<SchemaRef, BoxError>;

    /// The newest version, as text that [`StaticTable::read`] reads back: recorded in the
    /// intent of the batch being planned (a Delta table's version number, e.g. `"7"`).
    async fn latest_version(&self) -> std::result::Result<String, BoxError>;

    /// Every row of the table at `version`, in the schema [`StaticTable::open`] returned.
    /// Reading the same version again must give the same rows: a rerun relies on it. A version
    /// that can no longer be read (removed by a vacuum) is an error, never another version's
    /// rows.
    async fn read(&self, version: &str) -> std::result::Result<Vec<RecordBatch>, BoxError>;

    /// Whether [`StaticTable::read`] can read an older version (a Delta table can, by time
    /// travel). A table without history (plain files) is snapshotted: the first time a version
    /// is read, its rows are written to the checkpoint (`table_snapshots/<name>/<version>.parquet`)
    /// and every later read of that version — a rerun, a backfill, a reconcile — reads the
    /// snapshot.
    fn has_history(&self) -> bool {
        true
    }

    /// Where the table is, for messages and `sluice validate`.
    fn location(&self) -> String;
}

/// A static table of a job, under the name its query uses.
#[derive(Debug)]
pub struct TableSpec {
    /// The SQL table name.
    pub name: String,
    /// The table.
    pub table: Box<dyn StaticTable>,
}

/// How many times a table without history is listed again when its files change while its
/// newest version is snapshotted.
const SNAPSHOT_ATTEMPTS: usize = 3;

/// A job's static tables, opened.
#[derive(Debug, Default)]
pub struct StaticTables {
    tables: Vec<TableSpec>,
    schemas: BTreeMap<String, SchemaRef>,
    /// Where versions of tables without history are snapshotted (`None`: validating, nothing
    /// is written).
    snapshots: Option<CheckpointStore>,
    /// Per table without history, the newest version known to be snapshotted.
    snapshotted: std::sync::Mutex<BTreeMap<String, String>>,
}

impl StaticTables {
    /// Opens every table; the schemas are what the query is planned against.
    ///
    /// # Errors
    /// [`Error::StaticTable`] naming the table that could not be opened.
    pub async fn open(specs: Vec<TableSpec>) -> Result<StaticTables> {
        let mut tables = StaticTables::default();
        for mut spec in specs {
            let schema = spec
                .table
                .open()
                .await
                .map_err(|e| Error::in_table(&spec.name, e))?;
            // A table written by a Sluice job carries lineage columns: they would clash with the
            // stream's, and say nothing about the join.
            let fields: Vec<_> = schema
                .fields()
                .iter()
                .filter(|f| !crate::source::is_lineage(f.name()))
                .cloned()
                .collect();
            let schema = Arc::new(Schema::new(fields));
            tables.schemas.insert(spec.name.clone(), schema);
            tables.tables.push(spec);
        }
        Ok(tables)
    }

    /// Snapshots the versions of tables without history under `checkpoint`'s
    /// `table_snapshots/` folder (see [`StaticTable::has_history`]).
    pub fn with_snapshots(mut self, checkpoint: &CheckpointStore) -> Self {
        self.snapshots = Some(checkpoint.child("table_snapshots"));
        self
    }

    /// Each table's schema, by name.
    pub fn schemas(&self) -> &BTreeMap<String, SchemaRef> {
        &self.schemas
    }

    /// Whether the job has no static table.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// The tables' names.
    pub fn names(&self) -> Vec<String> {
        self.tables.iter().map(|t| t.name.clone()).collect()
    }

    /// Each table's newest version: what the intent of the batch being planned records.
    ///
    /// # Errors
    /// [`Error::StaticTable`] naming the table whose version could not be found.
    pub async fn latest_versions(&self) -> Result<BTreeMap<String, String>> {
        let mut versions = BTreeMap::new();
        for spec in &self.tables {
            // A table without history is snapshotted at the version now, before an intent
            // can record it; files changing meanwhile make a new version: listed again.
            let mut attempts = 0;
            let version = loop {
                let version = spec
                    .table
                    .latest_version()
                    .await
                    .map_err(|e| Error::in_table(&spec.name, e))?;
                match self.ensure_snapshot(spec, &version).await {
                    Ok(()) => break version,
                    Err(_) if attempts < SNAPSHOT_ATTEMPTS => attempts += 1,
                    Err(e) => return Err(e),
                }
            };
            versions.insert(spec.name.clone(), version);
        }
        Ok(versions)
    }

    /// Makes `query` join table `name` at `version`, reading it only if the query holds
    /// another version (or none); the rows read, if it did.
    ///
    /// # Errors
    /// As [`StaticTables::read`].
    pub(crate) async fn load_into(
        &self,
        query: &mut StreamingQuery,
        name: &str,
        version: &str,
    ) -> Result<Option<usize>> {
        if query.table_version(name) == Some(version) {
            return Ok(None);
        }
        let rows = self.read(name, version).await?;
        let count = rows.iter().map(RecordBatch::num_rows).sum();
        query.load_table(name, version, rows).await?;
        Ok(Some(count))
    }

    /// The rows of table `name` at `version`.
    ///
    /// # Errors
    /// [`Error::StaticTable`] if the table cannot be read at that version or its rows do not
    /// have the schema the query was planned with.
    pub async fn read(&self, name: &str, version: &str) -> Result<Vec<RecordBatch>> {
        let spec =
            self.tables.iter().find(|t| t.name == name).ok_or_else(|| {
                Error::InvalidJob(format!("the job has no static table '{name}'"))
            })?;
        let planned = &self.schemas[name];
        let rows = match self.snapshot(spec, version).await? {
            Some(rows) => rows,
            None => {
                let rows = spec.table.read(version).await.map_err(|e| {
                    Error::in_table(name, format!("reading version {version}: {e}"))
                })?;
                // Another attempt's snapshot, if it was first, is what every read joins.
                self.save_snapshot(spec, version, &rows, planned)
                    .await?
                    .unwrap_or(rows)
            }
        };
        let mut conformed = Vec::with_capacity(rows.len());
        for batch in rows {
            // By name: a version with columns added since (or fewer, nullable ones) still reads.
            let mut columns = Vec::with_capacity(planned.fields().len());
            for field in planned.fields() {
                let column = match batch.column_by_name(field.name()) {
                    Some(c) if c.data_type() == field.data_type() => Arc::clone(c),
                    // Text or bytes in another layout: a snapshot taken while declared text
                    // columns were `Utf8View` (see `schema::same_but_layout`).
                    Some(c) if same_but_layout(c.data_type(), field.data_type()) => {
                        arrow::compute::cast(c, field.data_type()).map_err(|e| {
                            Error::in_table(
                                name,
                                format!(
                                    "version {version}: column {} as {} could not be read as {}: \
                                     {e}",
                                    field.name(),
                                    c.data_type(),
                                    field.data_type()
                                ),
                            )
                        })?
                    }
                    Some(c) => {
                        return Err(Error::in_table(
                            name,
                            format!(
                                "version {version} has column {} as {}, but the query was \
                                 planned with {} (the table's newest schema when the job \
                                 started)",
                                field.name(),
                                c.data_type(),
                                field.data_type()
                            ),
                        ));
                    }
                    None if field.is_nullable() => {
                        arrow::array::new_null_array(field.data_type(), batch.num_rows())
                    }
                    None => {
                        return Err(Error::in_table(
                            name,
                            format!(
                                "version {version} has no column {}, which the query was \
                                 planned with",
                                field.name()
                            ),
                        ));
                    }
                };
                columns.push(column);
            }
            let batch = RecordBatch::try_new(Arc::clone(planned), columns)
                .map_err(|e| Error::in_table(name, format!("version {version}: {e}")))?;
            conformed.push(batch);
        }
        Ok(conformed)
    }
}

impl StaticTables {
    /// Where the snapshot of `spec` at `version` lives, if the table has none of its own
    /// history and snapshots are kept.
    fn snapshot_path(&self, spec: &TableSpec, version: &str) -> Option<(&CheckpointStore, String)> {
        if spec.table.has_history() {
            return None;
        }
        let store = self.snapshots.as_ref()?;
        Some((store, format!("{}/{version}.parquet", spec.name)))
    }

    /// The rows of the snapshot of `spec` at `version`, if one was taken.
    async fn snapshot(&self, spec: &TableSpec, version: &str) -> Result<Option<Vec<RecordBatch>>> {
        let Some((store, rel)) = self.snapshot_path(spec, version) else {
            return Ok(None);
        };
        let Some(bytes) = store.get(&rel).await? else {
            return Ok(None);
        };
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .and_then(|b| b.build())
            .map_err(|e| Error::in_table(&spec.name, format!("snapshot {rel}: {e}")))?;
        let rows = reader
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::in_table(&spec.name, format!("snapshot {rel}: {e}")))?;
        Ok(Some(rows))
    }

    /// Takes the snapshot of `spec` at `version` unless it exists: called when a batch is
    /// planned, before its intent records the version, so a version an intent names can always
    /// be read again, whatever happens to the files after.
    async fn ensure_snapshot(&self, spec: &TableSpec, version: &str) -> Result<()> {
        let Some((store, _)) = self.snapshot_path(spec, version) else {
            return Ok(());
        };
        let known = self
            .snapshotted
            .lock()
            .map(|m| m.get(&spec.name).is_some_and(|v| v == version))
            .unwrap_or(false);
        if known {
            return Ok(());
        }
        let exists = store
            .list_files(&spec.name)
            .await?
            .contains(&format!("{version}.parquet"));
        if !exists {
            let rows = spec.table.read(version).await.map_err(|e| {
                Error::in_table(&spec.name, format!("reading version {version}: {e}"))
            })?;
            self.save_snapshot(spec, version, &rows, &self.schemas[&spec.name])
                .await?;
        }
        if let Ok(mut m) = self.snapshotted.lock() {
            m.insert(spec.name.clone(), version.to_string());
        }
        Ok(())
    }

    /// Writes `rows` as the snapshot of `spec` at `version`, put-if-absent; if another attempt
    /// wrote it first, its rows (what every later read of the version joins).
    async fn save_snapshot(
        &self,
        spec: &TableSpec,
        version: &str,
        rows: &[RecordBatch],
        planned: &SchemaRef,
    ) -> Result<Option<Vec<RecordBatch>>> {
        let Some((store, rel)) = self.snapshot_path(spec, version) else {
            return Ok(None);
        };
        let schema = rows
            .first()
            .map_or_else(|| Arc::clone(planned), RecordBatch::schema);
        let encode = || -> std::result::Result<Vec<u8>, parquet::errors::ParquetError> {
            let mut bytes = Vec::new();
            let mut writer = ArrowWriter::try_new(&mut bytes, schema, None)?;
            for batch in rows {
                writer.write(batch)?;
            }
            writer.close()?;
            Ok(bytes)
        };
        let bytes = encode().map_err(|e| {
            Error::in_table(
                &spec.name,
                format!("writing the snapshot of version {version}: {e}"),
            )
        })?;
        if store.put_if_absent(&rel, bytes).await? {
            return Ok(None);
        }
        self.snapshot(spec, version).await
    }
}

/// One entry of a table's version log: from the batch `batch_id` on — from offsets `from` of
/// each source partition — rows were joined with `version`, until a later entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionEntry {
    /// The batch that loaded the version.
    pub batch_id: BatchId,
    /// The version.
    pub version: String,
    /// Where that batch's ranges start, per source and partition: a row at or past its
    /// partition's offset here (any row of a partition absent here) was joined with `version`,
    /// unless a later entry covers it.
    pub from: SourceOffsets,
}

/// Rows of the sources (by source) joined with one version of every table (by table).
pub type RowsAtVersions = (BTreeMap<String, String>, BTreeMap<String, RecordBatch>);

/// Which version of each static table every row of the stream was joined with.
///
/// Each batch joins the version its intent records; the intent is purged with its batch folder,
/// so the driver also writes an entry here (`<checkpoint>/tables/<name>/<batch_id>.json`,
/// put-if-absent) every time it loads a version — at its first batch and at each change. A
/// process loads the version of every batch it runs, so the entry with the greatest batch id at
/// or before a batch is the version that batch joined, and the entry's `from` offsets turn a
/// row's lineage (source, partition, offset) into its batch. Backfill and reconcile join each
/// row with its version this way, as the stream did. Entries are small and never purged (one
/// per process start and per table change).
#[derive(Debug, Clone, Default)]
pub struct VersionLog {
    /// Per table, entries by batch id.
    entries: BTreeMap<String, BTreeMap<BatchId, VersionEntry>>,
}

impl VersionLog {
    fn folder(table: &str) -> String {
        format!("tables/{table}")
    }

    /// Records that batch `batch_id`, whose ranges start at `from`, joins `table` at `version`.
    ///
    /// # Errors
    /// If the checkpoint store fails, or an earlier attempt at the batch recorded another
    /// entry (the log would lie about what the batch joined).
    pub async fn record(
        checkpoint: &CheckpointStore,
        table: &str,
        batch_id: BatchId,
        version: &str,
        from: SourceOffsets,
    ) -> Result<()> {
        let entry = VersionEntry {
            batch_id,
            version: version.to_string(),
            from,
        };
        // A rerun of the batch (same intent) finds the same entry.
        let recorded = Self::put_first(checkpoint, table, entry.clone()).await?;
        if recorded != entry {
            return Err(Error::in_table(
                table,
                format!(
                    "batch {} was recorded as joining version {} from other offsets or at another \
                     version than this run's ({version}); {} in the checkpoint says so",
                    batch_id.0,
                    recorded.version,
                    Self::entry_path(table, batch_id)
                ),
            ));
        }
        Ok(())
    }

    /// Records `version` for batch `batch_id` unless an earlier attempt recorded one first, and
    /// returns the version recorded: how a batch whose intent names no version for `table`
    /// settles on one, even when two attempts race.
    ///
    /// # Errors
    /// If the checkpoint store fails.
    pub async fn record_first(
        checkpoint: &CheckpointStore,
        table: &str,
        batch_id: BatchId,
        version: &str,
        from: SourceOffsets,
    ) -> Result<String> {
        let entry = VersionEntry {
            batch_id,
            version: version.to_string(),
            from,
        };
        Ok(Self::put_first(checkpoint, table, entry).await?.version)
    }

    /// Where the entry of `table` for `batch_id` lives in the checkpoint.
    fn entry_path(table: &str, batch_id: BatchId) -> String {
        format!("{}/{:020}.json", Self::folder(table), batch_id.0)
    }

    /// Writes `entry` put-if-absent and returns the entry the log holds for its batch: `entry`,
    /// or what an earlier attempt wrote first.
    async fn put_first(
        checkpoint: &CheckpointStore,
        table: &str,
        entry: VersionEntry,
    ) -> Result<VersionEntry> {
        let rel = Self::entry_path(table, entry.batch_id);
        let bytes = checkpoint.to_json(&rel, &entry)?;
        if checkpoint.put_if_absent(&rel, bytes).await? {
            return Ok(entry);
        }
        Ok(checkpoint
            .get_json::<VersionEntry>(&rel)
            .await?
            .unwrap_or(entry))
    }

    /// Reads the log of every table in `tables`.
    ///
    /// # Errors
    /// If the checkpoint store fails or an entry does not parse.
    pub async fn read(checkpoint: &CheckpointStore, tables: &[String]) -> Result<VersionLog> {
        let mut log = VersionLog::default();
        for table in tables {
            let folder = Self::folder(table);
            let mut entries = BTreeMap::new();
            for name in checkpoint.list_files(&folder).await? {
                let rel = format!("{folder}/{name}");
                if let Some(entry) = checkpoint.get_json::<VersionEntry>(&rel).await? {
                    entries.insert(entry.batch_id, entry);
                }
            }
            log.entries.insert(table.clone(), entries);
        }
        Ok(log)
    }

    /// The entry of `table` in force for the row at (`source`, `partition`, `offset`): the
    /// last one whose batch started at or before it.
    fn entry_of(
        &self,
        table: &str,
        source: &str,
        partition: &str,
        offset: i64,
    ) -> Option<&VersionEntry> {
        self.entries.get(table)?.values().rev().find(|e| {
            e.from
                .get(source)
                .and_then(|parts| parts.get(partition))
                .is_none_or(|from| *from <= offset)
        })
    }

    /// Splits rows of the sources (with their lineage columns) into parts, each joined with one
    /// version of every table: the versions, and the part's rows per source, in the order of
    /// the versions' first batches.
    ///
    /// # Errors
    /// [`Error::StaticTable`] if a row has no recorded version (the log was deleted, or the row
    /// was never read by a committed batch).
    pub fn split(&self, inputs: &BTreeMap<String, RecordBatch>) -> Result<Vec<RowsAtVersions>> {
        if self.entries.is_empty() {
            return Ok(vec![(BTreeMap::new(), inputs.clone())]);
        }
        // Per combination of entries (by their batches: the parts come in stream order), the
        // row indices of each source.
        let mut parts: BTreeMap<Vec<BatchId>, BTreeMap<String, Vec<u32>>> = BTreeMap::new();
        for (source, rows) in inputs {
            let column = |name: &str, to: &DataType| -> Result<ArrayRef> {
                let array = rows.column_by_name(name).ok_or_else(|| {
                    Error::in_source(source, format!("its rows lack the column {name}"))
                })?;
                Ok(arrow::compute::cast(array, to)?)
            };
            let partitions = column(SOURCE_PARTITION, &DataType::Utf8)?;
            let offsets = column(SOURCE_OFFSET, &DataType::Int64)?;
            let (partitions, offsets) = (
                partitions.as_string::<i32>(),
                offsets.as_primitive::<Int64Type>(),
            );
            for i in 0..rows.num_rows() {
                let (partition, offset) = (partitions.value(i), offsets.value(i));
                let mut batches = Vec::with_capacity(self.entries.len());
                for table in self.entries.keys() {
                    let entry =
                        self.entry_of(table, source, partition, offset)
                            .ok_or_else(|| {
                                Error::in_table(
                                    table,
                                    format!(
                                        "no recorded version for {source} partition {partition} \
                                     offset {offset}: it comes before the first version the \
                                     job recorded under tables/{table}/ in the checkpoint (it \
                                     was streamed before the table was joined, or before \
                                     versions were recorded), so the version it joined is \
                                     unknown"
                                    ),
                                )
                            })?;
                    batches.push(entry.batch_id);
                }
                parts
                    .entry(batches)
                    .or_default()
                    .entry(source.clone())
                    .or_default()
                    .push(i as u32);
            }
        }
        // One part per combination of versions (two entries may name one version), in the
        // order of their first batches.
        type RowsBySource = BTreeMap<String, Vec<u32>>;
        let mut merged: Vec<(BTreeMap<String, String>, RowsBySource)> = Vec::new();
        for (batches, rows) in parts {
            let versions: BTreeMap<String, String> = self
                .entries
                .iter()
                .zip(batches)
                .map(|((table, entries), batch)| (table.clone(), entries[&batch].version.clone()))
                .collect();
            match merged.iter_mut().find(|(v, _)| *v == versions) {
                Some((_, all)) => {
                    for (source, indices) in rows {
                        all.entry(source).or_default().extend(indices);
                    }
                }
                None => merged.push((versions, rows)),
            }
        }
        let mut out = Vec::with_capacity(merged.len());
        for (versions, mut rows) in merged {
            let mut part = BTreeMap::new();
            for (source, batch) in inputs {
                let mut indices = rows.remove(source).unwrap_or_default();
                indices.sort_unstable();
                let taken = arrow::compute::take_record_batch(batch, &UInt32Array::from(indices))?;
                part.insert(source.clone(), taken);
            }
            out.push((versions, part));
        }
        Ok(out)
    }
}

/// A job's static tables as backfill and reconcile join them: each row with the version its
/// streamed batch joined, from the [`VersionLog`].
#[derive(Debug)]
pub(crate) struct TablesAtVersions {
    tables: StaticTables,
    log: VersionLog,
}

impl TablesAtVersions {
    /// The tables, with their version log read from `checkpoint`; `streamed`: the job has
    /// committed a batch.
    ///
    /// # Errors
    /// If the log cannot be read.
    pub(crate) async fn open(
        tables: StaticTables,
        checkpoint: &CheckpointStore,
        streamed: bool,
    ) -> Result<TablesAtVersions> {
        let mut log = VersionLog::read(checkpoint, &tables.names()).await?;
        // A job that never streamed (a batch run): every row joins the newest version. A job
        // that streamed finds its rows' versions in the log, or fails naming the row.
        let latest = if streamed {
            BTreeMap::new()
        } else {
            tables.latest_versions().await?
        };
        for (table, entries) in &mut log.entries {
            if !streamed && let Some(version) = latest.get(table) {
                // (Entries of an attempt that never committed do not count.)
                entries.clear();
                let entry = VersionEntry {
                    batch_id: BatchId(0),
                    version: version.clone(),
                    from: SourceOffsets::new(),
                };
                entries.insert(entry.batch_id, entry);
            }
        }
        Ok(TablesAtVersions { tables, log })
    }

    /// [`StreamingQuery::feed_bounded`] over `inputs`, part by part, each part's rows joined
    /// with the versions their batch joined.
    ///
    /// # Errors
    /// As [`StreamingQuery::feed_bounded`], or a table version cannot be read.
    pub(crate) async fn feed_bounded(
        &self,
        query: &mut StreamingQuery,
        inputs: &BTreeMap<String, RecordBatch>,
        watermark: Option<i64>,
    ) -> Result<QueryOutput> {
        if inputs.values().all(|rows| rows.num_rows() == 0) {
            // No rows, only a watermark (a join lets go of rows): the tables as last loaded.
            return query.feed_bounded(inputs, watermark).await;
        }
        let mut out = QueryOutput::default();
        for (versions, part) in self.log.split(inputs)? {
            self.load(query, &versions).await?;
            out.append(query.feed_bounded(&part, watermark).await?);
        }
        Ok(out)
    }

    /// The query as one bounded run over `parts` (each part's rows under its own watermark in
    /// force, see [`StreamingQuery::feed_bounded`]), then — for a windowed query — every window
    /// finished.
    ///
    /// # Errors
    /// As [`StreamingQuery::feed_bounded`], or a table version cannot be read.
    pub(crate) async fn execute_bounded(
        &self,
        query: &mut StreamingQuery,
        parts: Vec<(BTreeMap<String, RecordBatch>, Option<i64>)>,
    ) -> Result<QueryOutput> {
        let mut out = QueryOutput::default();
        for (inputs, watermark) in parts {
            out.append(self.feed_bounded(query, &inputs, watermark).await?);
        }
        out.append(query.finish_bounded().await?);
        Ok(out)
    }

    /// [`StreamingQuery::execute_isolating`] over `inputs` (a stateless query), part by part as
    /// [`TablesAtVersions::feed_bounded`].
    ///
    /// # Errors
    /// As [`StreamingQuery::execute_isolating`], or a table version cannot be read.
    pub(crate) async fn execute_isolating(
        &self,
        query: &mut StreamingQuery,
        inputs: &BTreeMap<String, RecordBatch>,
        watermark: BatchWatermark,
    ) -> Result<QueryOutput> {
        let mut out = QueryOutput::default();
        for (versions, part) in self.log.split(inputs)? {
            self.load(query, &versions).await?;
            out.append(query.execute_isolating(&part, watermark).await?);
        }
        Ok(out)
    }

    /// Loads each table at the version `versions` names, unless the query holds it already.
    async fn load(
        &self,
        query: &mut StreamingQuery,
        versions: &BTreeMap<String, String>,
    ) -> Result<()> {
        for (name, version) in versions {
            self.tables.load_into(query, name, version).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::Field;

    fn rows(lineage: &[(&str, i64)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(lineage.iter().map(|l| l.0))),
                Arc::new(Int64Array::from_iter_values(lineage.iter().map(|l| l.1))),
            ],
        )
        .unwrap()
    }

    fn entry(batch: i64, version: &str, from: &[(&str, i64)]) -> (BatchId, VersionEntry) {
        let from = from.iter().map(|(p, o)| (p.to_string(), *o)).collect();
        let entry = VersionEntry {
            batch_id: BatchId(batch),
            version: version.into(),
            from: BTreeMap::from([("s".to_string(), from)]),
        };
        (BatchId(batch), entry)
    }

    fn lineage_of(batch: &RecordBatch) -> Vec<(String, i64)> {
        let p = batch.column(0).as_string::<i32>();
        let o = batch.column(1).as_primitive::<Int64Type>();
        (0..batch.num_rows())
            .map(|i| (p.value(i).to_string(), o.value(i)))
            .collect()
    }

    /// Each row goes with the version of the last entry whose batch started at or before its
    /// offset in its partition; a partition an entry does not know (it appeared later) counts
    /// as started; a row before every entry has no version.
    #[test]
    fn rows_split_by_the_version_their_batch_joined() {
        let log = VersionLog {
            entries: BTreeMap::from([(
                "users".to_string(),
                BTreeMap::from([
                    entry(0, "3", &[("0", 0), ("1", 0)]),
                    entry(4, "3", &[("0", 10), ("1", 7)]),
                    entry(6, "5", &[("0", 20), ("1", 30)]),
                ]),
            )]),
        };
        let inputs = BTreeMap::from([(
            "s".to_string(),
            rows(&[
                ("0", 0),
                ("0", 19),
                ("0", 20),
                ("1", 6),
                ("1", 50),
                ("2", 1),
            ]),
        )]);
        let parts = log.split(&inputs).unwrap();
        let got: Vec<(String, Vec<(String, i64)>)> = parts
            .iter()
            .map(|(versions, part)| (versions["users"].clone(), lineage_of(&part["s"])))
            .collect();
        let owned = |v: &[(&str, i64)]| v.iter().map(|(p, o)| (p.to_string(), *o)).collect();
        assert_eq!(
            got,
            vec![
                ("3".to_string(), owned(&[("0", 0), ("0", 19), ("1", 6)])),
                ("5".to_string(), owned(&[("0", 20), ("1", 50), ("2", 1)])),
            ]
        );

        let log = VersionLog {
            entries: BTreeMap::from([(
                "users".to_string(),
                BTreeMap::from([entry(2, "1", &[("0", 5)])]),
            )]),
        };
        let err = log
            .split(&BTreeMap::from([("s".to_string(), rows(&[("0", 4)]))]))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("no recorded version for s partition 0 offset 4"),
            "{err}"
        );
    }
}
