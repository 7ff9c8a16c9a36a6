//! Operator state on storage: immutable Parquet files under `<checkpoint>/state/`.
//!
//! State must become live with the same Delta commit as the output it produced, so it is never
//! updated in place: each batch writes new files, named after the batch and the run's lease
//! epoch, and lists the files that hold the state after it in its manifest (written before the
//! commit). A restart reads exactly the files the committed manifest lists.
//!
//! Writing the whole state every batch would cost O(state) per batch, however little changed.
//! So the files are a **base** snapshot plus **deltas**: a delta holds only the batch's partial
//! aggregate rows (its changes), and since partial states merge associatively, the state is
//! `merge(base, delta₁, …, deltaₙ)` — minus the windows the watermark has closed since. A group
//! that can leave and come back (a running aggregate's key expired by `state_ttl`, a key's
//! session closed before its next began) must not be merged with its rows from before it left,
//! which an older file still holds: so each delta records the watermark the state had been
//! purged under when its changes were merged in ([`RestoredFile::purged_under`], a Parquet
//! key-value entry), and a restore replays the files in order, purging under it before merging
//! each. When the deltas together hold more rows than the live state (so a restart would read
//! more than twice what is live), or there are [`MAX_DELTA_FILES`] of them, the batch writes a
//! fresh base instead (compaction): files per manifest stay bounded however the state grows or
//! shrinks.
//!
//! ```text
//! state/00000000000000000007-e3-base.parquet    full state after batch 7 (run with lease epoch 3)
//! state/00000000000000000008-e3-delta.parquet   batch 8's changes
//! state/00000000000000000009-e4-delta.parquet   batch 9's changes    manifest 9: [7-e3-base, 8-e3-delta, 9-e4-delta]
//! ```
//!
//! **Twins.** A file is never overwritten: names carry the writer's epoch and are written
//! put-if-absent, so a stale run redoing a batch cannot touch a file a committed manifest lists.
//! Garbage collection after the commit of batch `N` deletes only files of batches `≤ N` that
//! manifest `N` does not list — files of later batches belong to a batch in flight, possibly
//! another run's.

use std::collections::BTreeSet;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::arrow_writer::{ArrowLeafColumn, compute_leaves};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use rayon::prelude::*;

use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};
use crate::offsets::BatchId;
use crate::schema::in_layout_of;
use crate::sink::row_groups;
use crate::source::cpu_bound;

/// One state file and the rows it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StateFile {
    name: String,
    rows: u64,
}

/// What one batch wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateWrite {
    /// The files that hold the state after the batch, for its manifest.
    pub live_files: Vec<String>,
    /// Bytes written by this batch (0 if nothing changed).
    pub bytes_written: u64,
    /// Whether this batch wrote a new base snapshot.
    pub compacted: bool,
}

/// The Parquet key-value entry of a delta file holding [`RestoredFile::purged_under`].
const PURGED_UNDER: &str = "sluice.state.purged_under";

/// The rows of one state file, as a restore reads them.
#[derive(Debug)]
pub struct RestoredFile {
    /// Partial state rows, to be merged by the caller.
    pub rows: Vec<RecordBatch>,
    /// For a delta: the watermark the state had last been purged under when the delta's
    /// changes were merged into it. The state the delta applies to is the files before it
    /// purged under this. `None` for a base (the whole state as it was) and for a delta
    /// written before this was recorded.
    pub purged_under: Option<i64>,
}

/// At most this many delta files are live; the next batch with changes writes a base.
pub const MAX_DELTA_FILES: usize = 32;

/// The live state files of one job: a base snapshot and the deltas written since.
#[derive(Debug)]
pub struct StateLog {
    store: CheckpointStore,
    /// The writing run's lease epoch, part of every file name it writes.
    epoch: u64,
    base: Option<StateFile>,
    deltas: Vec<StateFile>,
}

/// The batch a state file was written for (its name starts with the zero-padded batch id).
fn batch_of(name: &str) -> Option<i64> {
    name.get(..20)?.parse().ok()
}

impl StateLog {
    /// The state folder of the checkpoint, with no live files (a job's first batch), for a run
    /// holding lease `epoch`.
    pub fn new(checkpoint: &CheckpointStore, epoch: u64) -> StateLog {
        StateLog {
            store: checkpoint.child("state"),
            epoch,
            base: None,
            deltas: Vec::new(),
        }
    }

    /// A log with no live files in the folder `name` under this one, for the same run: the
    /// state of a further operator of the query.
    pub fn child(&self, name: &str) -> StateLog {
        StateLog {
            store: self.store.child(name),
            epoch: self.epoch,
            base: None,
            deltas: Vec::new(),
        }
    }

    /// The state folder, for messages.
    pub fn location(&self) -> String {
        self.store.url().to_string()
    }

    /// Reads the files a committed manifest lists, oldest first: the base, then the deltas in
    /// the order they were written. Their rows come in `schema` (the operator's state schema)
    /// where they differ from it only in how text or bytes are laid out
    /// (`schema::in_layout_of`).
    ///
    /// # Errors
    /// If a listed file is missing or unreadable — the committed state is gone, which must not
    /// be papered over.
    pub async fn restore(
        &mut self,
        names: &[String],
        schema: &SchemaRef,
    ) -> Result<Vec<RestoredFile>> {
        self.base = None;
        self.deltas.clear();
        let mut all = Vec::new();
        for name in names {
            let bytes = self.store.get(name).await?.ok_or_else(|| {
                Error::InvalidJob(format!(
                    "state file {}/{name}, listed in the last committed manifest, is missing",
                    self.store.url()
                ))
            })?;
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)?;
            let purged_under = reader
                .metadata()
                .file_metadata()
                .key_value_metadata()
                .and_then(|entries| entries.iter().find(|e| e.key == PURGED_UNDER))
                .and_then(|e| e.value.as_deref())
                .map(|value| {
                    value.parse::<i64>().map_err(|_| {
                        Error::InvalidJob(format!(
                            "state file {}/{name}: {PURGED_UNDER} is not a timestamp: {value:?}",
                            self.store.url()
                        ))
                    })
                })
                .transpose()?;
            let batches = reader
                .build()?
                .map(|batch| in_layout_of(batch?, schema))
                .collect::<Result<Vec<_>>>()?;
            let file = StateFile {
                name: name.clone(),
                rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
            };
            if name.ends_with("-base.parquet") {
                self.base = Some(file);
            } else {
                self.deltas.push(file);
            }
            all.push(RestoredFile {
                rows: batches,
                purged_under,
            });
        }
        Ok(all)
    }

    /// Makes `names` the live files without reading their rows: a manifest written by another
    /// attempt at the same batch (same intent, so the same state) is adopted as it stands.
    ///
    /// # Errors
    /// If a file is missing or its footer unreadable.
    pub async fn adopt(&mut self, names: &[String]) -> Result<()> {
        self.base = None;
        self.deltas.clear();
        for name in names {
            let bytes = self.store.get(name).await?.ok_or_else(|| {
                Error::InvalidJob(format!(
                    "state file {}/{name}, listed in the batch's manifest, is missing",
                    self.store.url()
                ))
            })?;
            let rows = ParquetRecordBatchReaderBuilder::try_new(bytes)?
                .metadata()
                .file_metadata()
                .num_rows();
            let file = StateFile {
                name: name.clone(),
                rows: u64::try_from(rows).unwrap_or(0),
            };
            if name.ends_with("-base.parquet") {
                self.base = Some(file);
            } else {
                self.deltas.push(file);
            }
        }
        Ok(())
    }

    /// Records batch `batch_id`'s state: its `changes` as a delta (with the watermark the state
    /// had been `purged_under` when they were merged in, see [`RestoredFile::purged_under`]),
    /// or — when the deltas would outweigh the `live_rows` of the state, or
    /// [`MAX_DELTA_FILES`] are live — the `full` state as a new base (`full` is only called
    /// then: gathering the whole state is O(state)).
    ///
    /// # Errors
    /// If a file cannot be written, or `full` fails.
    pub async fn write(
        &mut self,
        batch_id: BatchId,
        schema: &SchemaRef,
        changes: &[RecordBatch],
        purged_under: Option<i64>,
        live_rows: u64,
        full: impl FnOnce() -> Result<Vec<RecordBatch>>,
    ) -> Result<StateWrite> {
        let change_rows = changes.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        let delta_rows: u64 = self.deltas.iter().map(|d| d.rows).sum::<u64>() + change_rows;
        let mut write = StateWrite::default();
        let compact =
            self.base.is_none() || delta_rows > live_rows || self.deltas.len() >= MAX_DELTA_FILES;
        if change_rows > 0 && compact {
            let name = format!("{:020}-e{}-base.parquet", batch_id.0, self.epoch);
            write.bytes_written = self.put(&name, schema, &full()?, None).await?;
            write.compacted = true;
            self.base = Some(StateFile {
                name,
                rows: live_rows,
            });
            self.deltas.clear();
        } else if change_rows > 0 {
            let name = format!("{:020}-e{}-delta.parquet", batch_id.0, self.epoch);
            write.bytes_written = self.put(&name, schema, changes, purged_under).await?;
            self.deltas.push(StateFile {
                name,
                rows: change_rows,
            });
        }
        write.live_files = self.live_files();
        Ok(write)
    }

    /// The files holding the state now, oldest first.
    pub fn live_files(&self) -> Vec<String> {
        self.base
            .iter()
            .chain(&self.deltas)
            .map(|f| f.name.clone())
            .collect()
    }

    /// Deletes the state files of batches up to `committed` that are not live (superseded by a
    /// newer base, or left by an attempt that never committed). Call after the commit of
    /// `committed` made the live files live; files of later batches are left alone (a batch in
    /// flight, possibly another run's).
    ///
    /// # Errors
    /// If listing or deleting fails.
    pub async fn collect_garbage(&self, committed: BatchId) -> Result<usize> {
        let live: BTreeSet<String> = self.live_files().into_iter().collect();
        let mut deleted = 0;
        for name in self.store.list_files("").await? {
            let done = batch_of(&name).is_some_and(|b| b <= committed.0);
            if done && !live.contains(&name) {
                self.store.delete(&name).await?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    async fn put(
        &self,
        name: &str,
        schema: &SchemaRef,
        batches: &[RecordBatch],
        purged_under: Option<i64>,
    ) -> Result<u64> {
        let (schema, batches) = (Arc::clone(schema), batches.to_vec());
        let metadata = purged_under.map(|w| KeyValue::new(PURGED_UNDER.into(), w.to_string()));
        let bytes =
            cpu_bound(move || encode(&schema, &batches, metadata, STATE_ROW_GROUP_ROWS)).await?;
        let len = bytes.len() as u64;
        if !self.store.put_if_absent(name, bytes).await? {
            return Err(Error::InvalidJob(format!(
                "state file {}/{name} exists already: two runs share lease epoch {}",
                self.store.url(),
                self.epoch
            )));
        }
        Ok(len)
    }
}

/// Rows per row group of a state file (Parquet's default): each group's columns are encoded in
/// parallel. Smaller groups were slower: every group builds its dictionaries afresh (measured:
/// 128 Ki-row groups made a 1 M-group base 20 % slower to write than one writer's 1 Mi-row
/// groups).
const STATE_ROW_GROUP_ROWS: usize = 1024 * 1024;

/// `batches` as one Parquet file (with `metadata` in its footer) in row groups of `group_rows` (zstd: state is read back only at restart, so it is
/// compressed harder than tables are), each row group's columns encoded in parallel on the
/// rayon pool — a state holds a few columns (keys, window, partial aggregates), so a base of a
/// large state is written in about the time of its largest column.
fn encode(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    metadata: Option<KeyValue>,
    group_rows: usize,
) -> Result<Vec<u8>> {
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_key_value_metadata(metadata.map(|entry| vec![entry]))
        .build();
    let writer = ArrowWriter::try_new(Vec::new(), Arc::clone(schema), Some(props))?;
    let (mut file, column_writers) = writer.into_serialized_writer()?;
    for (index, group) in row_groups(batches, group_rows).iter().enumerate() {
        let writers = column_writers.create_column_writers(index)?;
        // Each writer's leaves (a nested column has several), in the writers' order.
        let mut leaves: Vec<Vec<ArrowLeafColumn>> = writers.iter().map(|_| Vec::new()).collect();
        for batch in group {
            let mut slot = 0;
            for (field, column) in schema.fields().iter().zip(batch.columns()) {
                for leaf in compute_leaves(field, column)? {
                    leaves[slot].push(leaf);
                    slot += 1;
                }
            }
        }
        let chunks = writers
            .into_par_iter()
            .zip(leaves)
            .map(|(mut writer, leaves)| {
                for leaf in &leaves {
                    writer.write(leaf)?;
                }
                writer.close()
            })
            .collect::<parquet::errors::Result<Vec<_>>>()?;
        let mut row_group = file.next_row_group()?;
        for chunk in chunks {
            chunk.append_to_row_group(&mut row_group)?;
        }
        row_group.close()?;
    }
    Ok(file.into_inner()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    use url::Url;

    fn rows(values: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(values.to_vec()))]).unwrap()
    }

    fn checkpoint(dir: &tempfile::TempDir) -> CheckpointStore {
        CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap()
    }

    /// The column-parallel encoder writes what Arrow's own writer would: every row, in order,
    /// with the exact Arrow types (time zones, nested structs and lists), across row groups
    /// that end inside input batches.
    #[test]
    fn a_state_file_reads_back_as_written_across_row_groups_and_nested_columns() {
        use arrow::array::{ArrayRef, ListArray, StructArray, TimestampMicrosecondArray};
        use arrow::datatypes::{Int64Type, TimeUnit};
        let batch = |from: i64, n: i64| {
            let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(from..from + n));
            let ts: ArrayRef = Arc::new(
                TimestampMicrosecondArray::from_iter_values((from..from + n).map(|i| i * 1000))
                    .with_timezone("UTC"),
            );
            let sums: ArrayRef = Arc::new(Int64Array::from_iter(
                (from..from + n).map(|i| (i % 7 != 0).then_some(i * 2)),
            ));
            let partial: ArrayRef = Arc::new(StructArray::from(vec![(
                Arc::new(Field::new("sum", DataType::Int64, true)),
                sums,
            )]));
            let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
                (from..from + n).map(|i| (i % 5 != 0).then(|| vec![Some(i); (i % 3) as usize])),
            ));
            RecordBatch::try_from_iter(vec![
                ("id", ids),
                ("ts", ts),
                ("partial", partial),
                ("seen", lists),
            ])
            .unwrap()
        };
        let rows = 1000;
        let group = rows as i64;
        let input = vec![
            batch(0, group - 3),
            batch(group - 3, 10),
            batch(group + 7, group + 1),
        ];
        let schema = input[0].schema();
        let bytes = encode(&schema, &input, None, rows).unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes)).unwrap();
        assert_eq!(reader.metadata().num_row_groups(), 3);
        let read: Vec<RecordBatch> = reader.build().unwrap().map(|b| b.unwrap()).collect();
        assert_eq!(read[0].schema(), schema);
        assert!(matches!(
            schema.field(1).data_type(),
            DataType::Timestamp(TimeUnit::Microsecond, Some(_))
        ));
        let expected = arrow::compute::concat_batches(&schema, &input).unwrap();
        let got = arrow::compute::concat_batches(&schema, &read).unwrap();
        assert_eq!(got, expected);
        let sizes: Vec<usize> = row_groups(&input, rows)
            .iter()
            .map(|g| g.iter().map(RecordBatch::num_rows).sum())
            .collect();
        assert_eq!(sizes, [rows, rows, 8]);
    }

    #[tokio::test]
    async fn deltas_accumulate_until_they_outweigh_the_live_state_then_a_base_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = checkpoint(&dir);
        let schema = rows(&[]).schema();
        let mut log = StateLog::new(&checkpoint, 0);
        let full = [rows(&[1, 2, 3, 4])];
        // First batch: no base yet, so the full state is written.
        let w = log
            .write(BatchId(0), &schema, &[rows(&[1])], None, 4, || {
                Ok(full.to_vec())
            })
            .await
            .unwrap();
        assert!(w.compacted);
        // Small changes go to deltas while they hold no more rows than the live state.
        for b in 1..=3 {
            let w = log
                .write(BatchId(b), &schema, &[rows(&[9])], None, 4, || {
                    Ok(full.to_vec())
                })
                .await
                .unwrap();
            assert!(!w.compacted, "batch {b}");
        }
        assert_eq!(log.live_files().len(), 4);
        // Nothing changed: nothing written.
        let w = log
            .write(BatchId(4), &schema, &[], None, 4, || Ok(full.to_vec()))
            .await
            .unwrap();
        assert_eq!(w.bytes_written, 0);
        // 3 + 2 delta rows > 4 live rows: compaction.
        let w = log
            .write(BatchId(5), &schema, &[rows(&[7, 8])], None, 4, || {
                Ok(full.to_vec())
            })
            .await
            .unwrap();
        assert!(w.compacted);
        assert_eq!(w.live_files, vec![format!("{:020}-e0-base.parquet", 5)]);
        assert_eq!(log.collect_garbage(BatchId(5)).await.unwrap(), 4);

        let mut restored = StateLog::new(&checkpoint, 1);
        let files = restored.restore(&w.live_files, &schema).await.unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].rows, full.to_vec());
        let missing = restored
            .restore(
                &["00000000000000000001-e0-delta.parquet".to_string()],
                &schema,
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(missing.contains("is missing"), "{missing}");
    }

    /// State written with text and bytes as views (declared text columns before they became
    /// `Utf8`) is restored in the operator's current types, also inside lists and structs; a
    /// column of another type is left as it was written.
    #[tokio::test]
    async fn state_written_as_views_is_restored_in_the_current_layout() {
        use arrow::array::{
            Array, ArrayRef, BinaryViewArray, ListBuilder, StringArray, StringViewArray,
            StringViewBuilder,
        };
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = checkpoint(&dir);
        let mut items = ListBuilder::new(StringViewBuilder::new());
        items.append_value([Some("a long text of more than twelve bytes"), None]);
        items.append_null();
        let items = items.finish();
        let written = RecordBatch::try_from_iter(vec![
            (
                "k",
                Arc::new(StringViewArray::from(vec![Some("u1"), None])) as ArrayRef,
            ),
            (
                "b",
                Arc::new(BinaryViewArray::from(vec![b"x".as_slice(), b"yz"])) as ArrayRef,
            ),
            ("items", Arc::new(items) as ArrayRef),
            ("n", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef),
        ])
        .unwrap();
        let mut log = StateLog::new(&checkpoint, 0);
        let w = log
            .write(
                BatchId(0),
                &written.schema(),
                std::slice::from_ref(&written),
                None,
                2,
                || Ok(vec![written.clone()]),
            )
            .await
            .unwrap();
        let current = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("b", DataType::Binary, true),
            Field::new("items", DataType::new_list(DataType::Utf8, true), true),
            // Not a layout difference: left as written, for the operator to refuse.
            Field::new("n", DataType::Utf8, true),
        ]));
        let files = StateLog::new(&checkpoint, 1)
            .restore(&w.live_files, &current)
            .await
            .unwrap();
        let read = &files[0].rows[0];
        let types: Vec<DataType> = read
            .schema()
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        assert_eq!(
            types,
            [
                DataType::Utf8,
                DataType::Binary,
                DataType::new_list(DataType::Utf8, true),
                DataType::Int64,
            ]
        );
        let keys = read
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap();
        assert_eq!(keys.iter().collect::<Vec<_>>(), [Some("u1"), None]);
        let lists = read
            .column(2)
            .as_any()
            .downcast_ref::<arrow::array::ListArray>()
            .unwrap();
        let first = lists.value(0);
        let first = first.as_any().downcast_ref::<StringArray>().unwrap();
        assert_eq!(
            first.iter().collect::<Vec<_>>(),
            [Some("a long text of more than twelve bytes"), None]
        );
        assert!(lists.is_null(1));
        // Already in the current layout: read as written.
        let same = StateLog::new(&checkpoint, 2)
            .restore(&w.live_files, &written.schema())
            .await
            .unwrap();
        assert_eq!(same[0].rows, vec![written]);
    }

    /// A delta carries the watermark the state had been purged under when its changes were
    /// merged in; a base carries none (it is the whole state as it was).
    #[tokio::test]
    async fn a_delta_reads_back_with_the_watermark_its_changes_were_merged_under() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = checkpoint(&dir);
        let schema = rows(&[]).schema();
        let mut log = StateLog::new(&checkpoint, 0);
        let full = [rows(&[1, 2, 3, 4])];
        log.write(BatchId(0), &schema, &full, Some(7), 4, || Ok(full.to_vec()))
            .await
            .unwrap();
        let w = log
            .write(BatchId(1), &schema, &[rows(&[9])], Some(-42), 4, || {
                Ok(full.to_vec())
            })
            .await
            .unwrap();
        let files = StateLog::new(&checkpoint, 1)
            .restore(&w.live_files, &schema)
            .await
            .unwrap();
        let read: Vec<_> = files.iter().map(|f| (&f.rows, f.purged_under)).collect();
        assert_eq!(
            read,
            [(&full.to_vec(), None), (&vec![rows(&[9])], Some(-42))]
        );
    }

    /// A state that shrank (most windows closed) must not leave its old, large base deciding
    /// when to compact: files per manifest stay bounded over a long run, growing or shrinking.
    #[tokio::test]
    async fn files_per_manifest_stay_bounded_over_a_thousand_batches() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = checkpoint(&dir);
        let schema = rows(&[]).schema();
        let mut log = StateLog::new(&checkpoint, 0);
        let big: Vec<i64> = (0..5_000).collect();
        let mut most = 0;
        for b in 0..1_000i64 {
            // 5000 live rows for the first 10 batches, then 50: the big windows closed.
            let live = if b < 10 { &big[..] } else { &big[..50] };
            let w = log
                .write(
                    BatchId(b),
                    &schema,
                    &[rows(&[b])],
                    None,
                    live.len() as u64,
                    || Ok(vec![rows(live)]),
                )
                .await
                .unwrap();
            most = most.max(w.live_files.len());
            log.collect_garbage(BatchId(b)).await.unwrap();
        }
        assert!(
            most <= MAX_DELTA_FILES + 1,
            "{most} live state files in one manifest"
        );
        let on_disk = checkpoint.child("state").list_files("").await.unwrap();
        assert_eq!(on_disk.len(), log.live_files().len());
    }

    /// Two runs redoing the same batch never touch each other's files; a run that committed
    /// batch 7 and was paused before collecting spares the files a run that took over since
    /// wrote for batch 8.
    #[tokio::test]
    async fn twins_write_apart_and_collection_spares_later_batches() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = checkpoint(&dir);
        let schema = rows(&[]).schema();
        let full = [rows(&[1, 2])];
        let mut paused = StateLog::new(&checkpoint, 4);
        let mut twin = StateLog::new(&checkpoint, 3);
        let committed = paused
            .write(BatchId(7), &schema, &full, None, 2, || Ok(full.to_vec()))
            .await
            .unwrap();
        let lost = twin
            .write(BatchId(7), &schema, &full, None, 2, || Ok(full.to_vec()))
            .await
            .unwrap();
        assert_ne!(committed.live_files, lost.live_files);
        // Batch 7 commits with the paused run's manifest; the next run takes over from it.
        let mut next_run = StateLog::new(&checkpoint, 5);
        next_run
            .restore(&committed.live_files, &schema)
            .await
            .unwrap();
        let eight = next_run
            .write(BatchId(8), &schema, &[rows(&[3])], None, 2, || {
                Ok(full.to_vec())
            })
            .await
            .unwrap();
        // The paused run wakes up and collects after its commit of 7.
        assert_eq!(paused.collect_garbage(BatchId(7)).await.unwrap(), 1);
        let on_disk = checkpoint.child("state").list_files("").await.unwrap();
        for name in &eight.live_files {
            assert!(on_disk.contains(name), "{name} was collected");
        }
        // A manifest written by another attempt at a batch is adopted as it stands.
        twin.adopt(&eight.live_files).await.unwrap();
        assert_eq!(twin.live_files(), eight.live_files);
    }
}
