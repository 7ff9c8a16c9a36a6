//! Operator state on storage: immutable Parquet files under `<checkpoint>/state/`.
//!
//! State must become live with the same Delta commit as the output it produced, so it is never
//! updated in place: each batch writes new files, named after the batch, and lists the files
//! that hold the state after it in its manifest (written before the commit). A restart reads
//! exactly the files the committed manifest lists; files of a batch that never committed are
//! overwritten by its rerun or deleted as garbage.
//!
//! Writing the whole state every batch would cost O(state) per batch, however little changed.
//! So the files are a **base** snapshot plus **deltas**: a delta holds only the batch's partial
//! aggregate rows (its changes), and since partial states merge associatively, the state is
//! `merge(base, delta₁, …, deltaₙ)` — minus the windows the watermark has closed since. When the
//! deltas together hold as many rows as the base, the next batch writes a fresh base instead
//! (compaction), so a restart reads at most about twice the live state.
//!
//! ```text
//! state/00000000000000000007-base.parquet    full state after batch 7
//! state/00000000000000000008-delta.parquet   batch 8's changes
//! state/00000000000000000009-delta.parquet   batch 9's changes     manifest 9: [7-base, 8-delta, 9-delta]
//! ```

use std::collections::BTreeSet;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};
use crate::offsets::BatchId;

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

/// The live state files of one job: a base snapshot and the deltas written since.
#[derive(Debug)]
pub struct StateLog {
    store: CheckpointStore,
    base: Option<StateFile>,
    deltas: Vec<StateFile>,
}

impl StateLog {
    /// The state folder of the checkpoint, with no live files (a job's first batch).
    pub fn new(checkpoint: &CheckpointStore) -> StateLog {
        StateLog {
            store: checkpoint.child("state"),
            base: None,
            deltas: Vec::new(),
        }
    }

    /// Reads the files a committed manifest lists, oldest first. The rows are partial states to
    /// be merged by the caller.
    ///
    /// # Errors
    /// If a listed file is missing or unreadable — the committed state is gone, which must not
    /// be papered over.
    pub async fn restore(&mut self, names: &[String]) -> Result<Vec<RecordBatch>> {
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
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)?.build()?;
            let batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
            let file = StateFile {
                name: name.clone(),
                rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
            };
            if name.ends_with("-base.parquet") {
                self.base = Some(file);
            } else {
                self.deltas.push(file);
            }
            all.extend(batches);
        }
        Ok(all)
    }

    /// Records batch `batch_id`'s state: its `changes` as a delta, or — when the deltas would
    /// hold as many rows as the base — the `full` state as a new base.
    ///
    /// # Errors
    /// If a file cannot be written.
    pub async fn write(
        &mut self,
        batch_id: BatchId,
        schema: &SchemaRef,
        changes: &[RecordBatch],
        full: &[RecordBatch],
    ) -> Result<StateWrite> {
        let rows = |b: &[RecordBatch]| b.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        let change_rows = rows(changes);
        let delta_rows: u64 = self.deltas.iter().map(|d| d.rows).sum::<u64>() + change_rows;
        let base_rows = self.base.as_ref().map_or(0, |b| b.rows);
        let mut write = StateWrite::default();
        if change_rows > 0 && delta_rows > base_rows {
            let name = format!("{:020}-base.parquet", batch_id.0);
            write.bytes_written = self.put(&name, schema, full).await?;
            write.compacted = true;
            self.base = Some(StateFile {
                name,
                rows: rows(full),
            });
            self.deltas.clear();
        } else if change_rows > 0 {
            let name = format!("{:020}-delta.parquet", batch_id.0);
            write.bytes_written = self.put(&name, schema, changes).await?;
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

    /// Deletes the state files that are not live (superseded by a newer base, or left by an
    /// attempt that never committed). Call after the commit that made the live files live.
    ///
    /// # Errors
    /// If listing or deleting fails.
    pub async fn collect_garbage(&self) -> Result<usize> {
        let live: BTreeSet<String> = self.live_files().into_iter().collect();
        let mut deleted = 0;
        for name in self.store.list_files("").await? {
            if !live.contains(&name) {
                self.store.delete(&name).await?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    async fn put(&self, name: &str, schema: &SchemaRef, batches: &[RecordBatch]) -> Result<u64> {
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .build();
        let mut writer = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props))?;
        for b in batches {
            writer.write(b)?;
        }
        let bytes = writer.into_inner()?;
        let len = bytes.len() as u64;
        self.store.put(name, bytes).await?;
        Ok(len)
    }
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

    #[tokio::test]
    async fn deltas_accumulate_until_they_outweigh_the_base_then_a_base_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let schema = rows(&[]).schema();
        let mut log = StateLog::new(&checkpoint);
        let full = [rows(&[1, 2, 3, 4])];
        // First batch: no base yet, so the full state is written.
        let w = log
            .write(BatchId(0), &schema, &[rows(&[1])], &full)
            .await
            .unwrap();
        assert!(w.compacted);
        // Small changes go to deltas while they hold fewer rows than the base.
        for b in 1..=3 {
            let w = log
                .write(BatchId(b), &schema, &[rows(&[9])], &full)
                .await
                .unwrap();
            assert!(!w.compacted, "batch {b}");
        }
        assert_eq!(log.live_files().len(), 4);
        // Nothing changed: nothing written.
        let w = log.write(BatchId(4), &schema, &[], &full).await.unwrap();
        assert_eq!(w.bytes_written, 0);
        // 3 + 2 delta rows > 4 base rows: compaction.
        let w = log
            .write(BatchId(5), &schema, &[rows(&[7, 8])], &full)
            .await
            .unwrap();
        assert!(w.compacted);
        assert_eq!(w.live_files, vec![format!("{:020}-base.parquet", 5)]);
        assert_eq!(log.collect_garbage().await.unwrap(), 4);

        let mut restored = StateLog::new(&checkpoint);
        let batches = restored.restore(&w.live_files).await.unwrap();
        assert_eq!(batches, full.to_vec());
        let missing = restored
            .restore(&["00000000000000000001-delta.parquet".to_string()])
            .await
            .unwrap_err()
            .to_string();
        assert!(missing.contains("is missing"), "{missing}");
    }
}
