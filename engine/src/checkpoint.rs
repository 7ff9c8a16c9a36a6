//! The checkpoint store: intents, manifests and per-source files under `<checkpoint>/`.
//!
//! ```text
//! <checkpoint>/
//!   batches/<batch_id>/intent.json     ranges + idle set, written put-if-absent before reading
//!   batches/<batch_id>/manifest.json   end offsets, watermark, state files, counters;
//!                                      written before the commit, live once the commit lands
//!   sources/<source>/...               what a source must remember (e.g. the recorded file order)
//! ```
//!
//! Nothing here is trusted on its own: the output table's `txn` version says which manifest is
//! live (see [`crate::driver`]).
//!
//! Nothing here is overwritten either, so a stale twin of the job (a paused process that lost
//! its lease, see [`crate::lease`]) cannot change what a committed batch points to: intents and
//! manifests are written put-if-absent, and a run finding one already written for its batch
//! adopts it (the same intent gives the same batch). Files of a batch that never committed are
//! garbage-collected after a later commit.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use url::Url;

use crate::error::{Error, Result};
use crate::offsets::{BatchId, PartitionId, SourceOffsets, SourceRanges};
use crate::storage::StorageOptions;

/// A folder in an object store (a local directory, S3, GCS, Azure) where the job keeps its checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    url: Url,
    options: StorageOptions,
}

impl CheckpointStore {
    /// Opens the checkpoint at a local `url` (`file:///…` or `memory:///`), or at an object
    /// store URL configured from the environment alone.
    ///
    /// # Errors
    /// As [`CheckpointStore::open_with`].
    pub fn open(url: &Url) -> Result<Self> {
        Self::open_with(url, &StorageOptions::default())
    }

    /// Opens the checkpoint at `url` (a local folder, `s3://…`, `gs://…`, `az://…`), its store
    /// configured by `options` over the environment (see [`crate::storage`]).
    ///
    /// # Errors
    /// If the URL's scheme is not supported by this build or an option is unknown, naming the
    /// URL. Opening writes nothing; folders are created as files are written.
    pub fn open_with(url: &Url, options: &StorageOptions) -> Result<Self> {
        let (store, prefix) = crate::storage::open_store(url, options)?;
        Ok(CheckpointStore {
            store,
            prefix,
            url: url.clone(),
            options: options.clone(),
        })
    }

    /// The same folder through a store that waits at most `timeout` for an unreachable store.
    ///
    /// # Errors
    /// As [`CheckpointStore::open_with`].
    pub fn with_unavailable_timeout(&self, timeout: std::time::Duration) -> Result<Self> {
        Self::open_with(
            &self.url,
            &self.options.clone().with_unavailable_timeout(timeout),
        )
    }

    /// Fails unless the checkpoint's store refuses to overwrite a put-if-absent (see
    /// [`crate::storage::check_conditional_put`]); a store unreachable for
    /// [`crate::storage::START_UNAVAILABLE_TIMEOUT`] fails it too.
    ///
    /// # Errors
    /// [`Error::InvalidJob`] saying the store lacks conditional put; store errors.
    pub async fn check_conditional_put(&self) -> Result<()> {
        let probe = self.with_unavailable_timeout(
            crate::storage::START_UNAVAILABLE_TIMEOUT.min(self.options.unavailable_timeout()),
        )?;
        crate::storage::check_conditional_put(probe.store.as_ref(), &probe.prefix, &probe.url).await
    }

    /// Where this store lives, for messages.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// The sub-folder `name` of this store.
    pub fn child(&self, name: &str) -> CheckpointStore {
        let mut url = self.url.clone();
        if let Ok(mut segments) = url.path_segments_mut() {
            segments.pop_if_empty().push(name);
        }
        CheckpointStore {
            store: Arc::clone(&self.store),
            prefix: self.prefix.clone().join(name),
            url,
            options: self.options.clone(),
        }
    }

    fn path(&self, rel: &str) -> Path {
        rel.split('/')
            .filter(|s| !s.is_empty())
            .fold(self.prefix.clone(), |p, s| p.join(s))
    }

    fn display(&self, rel: &str) -> String {
        format!("{}/{}", self.url.as_str().trim_end_matches('/'), rel)
    }

    /// Reads `rel`, or `None` if it does not exist.
    pub async fn get(&self, rel: &str) -> Result<Option<bytes::Bytes>> {
        match self.store.get(&self.path(rel)).await {
            Ok(r) => Ok(Some(r.bytes().await?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads `rel` and when it was last written (the store's clock), or `None` if it does not
    /// exist.
    pub async fn get_with_modified(
        &self,
        rel: &str,
    ) -> Result<Option<(bytes::Bytes, chrono::DateTime<chrono::Utc>)>> {
        match self.store.get(&self.path(rel)).await {
            Ok(r) => {
                let modified = r.meta.last_modified;
                Ok(Some((r.bytes().await?, modified)))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes `rel`, replacing what was there (atomically: readers see old or new, never half).
    pub async fn put(&self, rel: &str, data: Vec<u8>) -> Result<()> {
        self.store
            .put(&self.path(rel), PutPayload::from(data))
            .await?;
        Ok(())
    }

    /// Writes `rel` only if it does not exist yet. Returns `false` if it already existed.
    pub async fn put_if_absent(&self, rel: &str, data: Vec<u8>) -> Result<bool> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .store
            .put_opts(&self.path(rel), PutPayload::from(data), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads and parses the JSON file `rel`, or `None` if it does not exist.
    pub async fn get_json<T: DeserializeOwned>(&self, rel: &str) -> Result<Option<T>> {
        match self.get(rel).await? {
            None => Ok(None),
            Some(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|source| Error::CheckpointFormat {
                        path: self.display(rel),
                        source,
                    })
            }
        }
    }

    /// Serialises `value` as pretty JSON.
    pub fn to_json<T: Serialize>(&self, rel: &str, value: &T) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(value).map_err(|source| Error::CheckpointFormat {
            path: self.display(rel),
            source,
        })
    }

    /// The names of the immediate sub-folders of `rel`.
    pub async fn list_folders(&self, rel: &str) -> Result<BTreeSet<String>> {
        let listing = self
            .store
            .list_with_delimiter(Some(&self.path(rel)))
            .await?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// The names of the files directly in folder `rel` (none if it does not exist).
    pub async fn list_files(&self, rel: &str) -> Result<BTreeSet<String>> {
        let listing = self
            .store
            .list_with_delimiter(Some(&self.path(rel)))
            .await?;
        Ok(listing
            .objects
            .iter()
            .filter_map(|o| o.location.filename().map(str::to_string))
            .collect())
    }

    /// Deletes the file `rel` (nothing if it does not exist).
    pub async fn delete(&self, rel: &str) -> Result<()> {
        match self.store.delete(&self.path(rel)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes everything under `rel` — on a local disk the emptied directories too, so a
    /// long-running job does not leave one empty directory per purged batch behind.
    pub async fn delete_folder(&self, rel: &str) -> Result<()> {
        let paths: Vec<Path> = self
            .store
            .list(Some(&self.path(rel)))
            .map_ok(|m| m.location)
            .try_collect()
            .await?;
        for p in paths {
            match self.store.delete(&p).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if self.url.scheme() == "file"
            && let Ok(root) = self.url.to_file_path()
        {
            let dir = rel
                .split('/')
                .filter(|s| !s.is_empty())
                .fold(root, |d, s| d.join(s));
            remove_empty_dirs(&dir);
        }
        Ok(())
    }
}

/// Removes `dir` and its subdirectories, deepest first, where they are empty (a directory a
/// twin wrote into meanwhile stays).
fn remove_empty_dirs(dir: &std::path::Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// What a batch will read, fixed before it reads anything, so a rerun reads exactly the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchIntent {
    /// The batch.
    pub batch_id: BatchId,
    /// The ranges it reads.
    pub ranges: SourceRanges,
    /// Partitions counted as idle for the watermark (decided at planning, from the wall clock).
    #[serde(default)]
    pub idle: BTreeSet<(String, PartitionId)>,
    /// The wall clock when the batch was planned (µs since the epoch): event times more than
    /// `max_event_time_skew` ahead of it are dead letters, the same on every rerun. `None` in
    /// intents written before it was recorded: judged by the clock of the rerun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_at_micros: Option<i64>,
    /// Partitions found behind the committed offsets at planning (their log went backwards),
    /// each becoming one dead letter of this batch; see [`crate::source::Source::offsets_behind`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedOffsets>,
    /// Each static table's version the batch joins (the newest at planning), so a rerun joins
    /// the same rows; see [`crate::static_table`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub table_versions: BTreeMap<String, String>,
}

/// Offsets of a partition that will never be read: its log went backwards below what the job
/// committed, and the source chose to skip rather than stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedOffsets {
    /// The source.
    pub source: String,
    /// The partition.
    pub partition: PartitionId,
    /// Its latest offset at planning.
    pub latest: i64,
    /// Where the job's committed batches end, and where reading resumes.
    pub committed_end: i64,
    /// The dead letter's reason, as the source words it.
    pub reason: String,
}

/// Everything a restart needs, written before the batch's commit and live once it lands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchManifest {
    /// The batch.
    pub batch_id: BatchId,
    /// Where each partition's next batch starts.
    pub end_offsets: SourceOffsets,
    /// The event-time watermark after this batch, in microseconds since the epoch, if any.
    #[serde(default)]
    pub watermark_micros: Option<i64>,
    /// Per source and partition, the newest event time read up to this batch (µs since the
    /// epoch): what the watermark is computed from, restored on restart.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub max_event_time: SourceOffsets,
    /// Each stateful operator's state after this batch, by operator id (`0-aggregate`); empty
    /// for a stateless query. `None` in manifests written before operators were recorded: their
    /// `state_files` are the one aggregate's, restored unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operators: Option<BTreeMap<String, OperatorCheckpoint>>,
    /// Every live state file, all operators together: what a manifest written before
    /// `operators` lists, still written so that an older binary restores the state rather than
    /// silently starting without it.
    #[serde(default)]
    pub state_files: Vec<String>,
    /// Per-batch counters (rows in, out, dead-lettered, …).
    pub counters: BatchCounters,
    /// Consumer lag after this batch: per source and partition, the offsets available when the
    /// batch was planned minus the batch's end offset. Empty for a batch rerun from its intent
    /// (the offsets available at planning time are not recorded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lag: SourceOffsets,
    /// The clock the batch judged event times by (its intent's), µs since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_at_micros: Option<i64>,
    /// Each static table's version the batch joined (its intent's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub table_versions: BTreeMap<String, String>,
    /// Partitions whose latest offset was below their committed end when this batch was
    /// planned, by the committed end (already dead-lettered: not reported again while it holds).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub behind: SourceOffsets,
}

/// One stateful operator's state as a manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorCheckpoint {
    /// What the state means: the operator's window or keys and the layout of its state rows,
    /// as text. A restart whose query plans this operator with another fingerprint refuses to
    /// restore the state (it would mix two queries' results).
    pub fingerprint: String,
    /// The files holding its state, oldest first.
    pub files: Vec<String>,
}

/// Row counts of one batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchCounters {
    /// Rows decoded from the sources (before the query).
    pub rows_in: u64,
    /// Rows the query produced.
    pub rows_out: u64,
    /// Rows written to the dead-letter table.
    pub rows_dead_lettered: u64,
    /// Rows written to the late table (they missed a closed window).
    #[serde(default)]
    pub rows_late: u64,
    /// Deduplicating queries: rows left out as a later row of a key already emitted.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rows_duplicate: u64,
    /// Windowed queries: rows of state after the batch (one per open window and group).
    #[serde(default)]
    pub state_rows: u64,
    /// Windowed queries: bytes the state takes in memory after the batch.
    #[serde(default)]
    pub state_bytes: u64,
    /// Windowed queries: bytes of state files the batch wrote.
    #[serde(default)]
    pub state_bytes_written: u64,
    /// Per expectation, the output rows that failed it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expectations: BTreeMap<String, u64>,
    /// Output rows expectations left out (`drop`).
    #[serde(default)]
    pub rows_dropped: u64,
    /// Output rows expectations sent to the dead-letter table (`quarantine`).
    #[serde(default)]
    pub rows_quarantined: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn batch_file(batch_id: BatchId, name: &str) -> String {
    format!("batches/{}/{name}", batch_id.0)
}

impl CheckpointStore {
    /// Reads the intent of `batch_id`, if one was written.
    pub async fn read_intent(&self, batch_id: BatchId) -> Result<Option<BatchIntent>> {
        self.get_json(&batch_file(batch_id, "intent.json")).await
    }

    /// Writes the intent of a batch unless one exists; returns the intent in force (the existing
    /// one if another run wrote it first).
    pub async fn write_intent(&self, intent: BatchIntent) -> Result<BatchIntent> {
        let rel = batch_file(intent.batch_id, "intent.json");
        let bytes = self.to_json(&rel, &intent)?;
        if self.put_if_absent(&rel, bytes).await? {
            return Ok(intent);
        }
        self.get_json(&rel).await?.ok_or_else(|| {
            Error::InvalidJob(format!(
                "intent {} vanished while being read",
                self.display(&rel)
            ))
        })
    }

    /// Reads the manifest of `batch_id`, if present.
    pub async fn read_manifest(&self, batch_id: BatchId) -> Result<Option<BatchManifest>> {
        self.get_json(&batch_file(batch_id, "manifest.json")).await
    }

    /// Writes the manifest of a batch unless one exists; returns the manifest in force — the
    /// existing one if an earlier attempt at the batch (a crashed run, or a twin) wrote it
    /// first. A manifest is never replaced: once its batch commits, it is what restart reads.
    pub async fn write_manifest(&self, manifest: BatchManifest) -> Result<BatchManifest> {
        let rel = batch_file(manifest.batch_id, "manifest.json");
        let bytes = self.to_json(&rel, &manifest)?;
        if self.put_if_absent(&rel, bytes).await? {
            return Ok(manifest);
        }
        self.get_json(&rel).await?.ok_or_else(|| {
            Error::InvalidJob(format!(
                "manifest {} vanished while being read",
                self.display(&rel)
            ))
        })
    }

    /// The newest batch folder in the checkpoint, if any.
    pub async fn newest_batch_folder(&self) -> Result<Option<BatchId>> {
        Ok(self
            .list_folders("batches")
            .await?
            .iter()
            .filter_map(|n| n.parse::<i64>().ok())
            .max()
            .map(BatchId))
    }

    /// Where the manifest of `batch_id` lives, for messages.
    pub fn manifest_location(&self, batch_id: BatchId) -> String {
        self.display(&batch_file(batch_id, "manifest.json"))
    }

    /// Deletes the folders of batches older than `keep_from`.
    pub async fn purge_batches_before(&self, keep_from: BatchId) -> Result<usize> {
        let mut purged = 0;
        for name in self.list_folders("batches").await? {
            if let Ok(id) = name.parse::<i64>()
                && id < keep_from.0
            {
                self.delete_folder(&format!("batches/{name}")).await?;
                purged += 1;
            }
        }
        Ok(purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, CheckpointStore) {
        let dir = tempfile::tempdir().unwrap();
        let url = Url::from_directory_path(dir.path()).unwrap();
        let store = CheckpointStore::open(&url).unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn intent_is_written_once() {
        let (_dir, store) = store();
        let first = BatchIntent {
            batch_id: BatchId(3),
            ranges: SourceRanges::new(),
            idle: BTreeSet::new(),
            planned_at_micros: Some(1),
            skipped: Vec::new(),
            table_versions: BTreeMap::from([("users".to_string(), "4".to_string())]),
        };
        let mut second = first.clone();
        second.idle.insert(("s".into(), "0".into()));
        assert_eq!(store.write_intent(first.clone()).await.unwrap(), first);
        // A second writer gets the first intent back, not its own.
        assert_eq!(store.write_intent(second).await.unwrap(), first);
        assert_eq!(store.read_intent(BatchId(3)).await.unwrap(), Some(first));
    }

    fn manifest(id: i64) -> BatchManifest {
        BatchManifest {
            batch_id: BatchId(id),
            operators: Some(BTreeMap::new()),
            ..BatchManifest::default()
        }
    }

    /// A manifest is never replaced: a second attempt at the batch gets the first one back.
    #[tokio::test]
    async fn a_manifest_is_written_once() {
        let (_dir, store) = store();
        let first = BatchManifest {
            state_files: vec!["a".into()],
            ..manifest(4)
        };
        let second = BatchManifest {
            state_files: vec!["b".into()],
            ..manifest(4)
        };
        assert_eq!(store.write_manifest(first.clone()).await.unwrap(), first);
        assert_eq!(store.write_manifest(second).await.unwrap(), first);
        assert_eq!(store.read_manifest(BatchId(4)).await.unwrap(), Some(first));
        assert_eq!(store.newest_batch_folder().await.unwrap(), Some(BatchId(4)));
    }

    /// A manifest written before operators were recorded reads with `operators: None` (its
    /// `state_files` are the one aggregate's); a new one round-trips its operators.
    #[test]
    fn manifests_from_before_the_operators_map_still_read() {
        let old = r#"{"batch_id":2,"end_offsets":{},"watermark_micros":5,
            "state_files":["x-base.parquet"],"counters":{"rows_in":1,"rows_out":1,
            "rows_dead_lettered":0}}"#;
        let read: BatchManifest = serde_json::from_str(old).unwrap();
        assert_eq!(read.operators, None);
        assert_eq!(read.state_files, ["x-base.parquet"]);
        let mut new = manifest(3);
        new.operators = Some(BTreeMap::from([(
            "0-aggregate".to_string(),
            OperatorCheckpoint {
                fingerprint: "aggregate: tumble(1m) over s.ts".into(),
                files: vec!["y-base.parquet".into()],
            },
        )]));
        let text = serde_json::to_string(&new).unwrap();
        assert_eq!(serde_json::from_str::<BatchManifest>(&text).unwrap(), new);
    }

    #[tokio::test]
    async fn old_batches_are_purged() {
        let (_dir, store) = store();
        for id in 0..5 {
            store.write_manifest(manifest(id)).await.unwrap();
        }
        assert_eq!(store.purge_batches_before(BatchId(3)).await.unwrap(), 3);
        assert!(store.read_manifest(BatchId(2)).await.unwrap().is_none());
        assert!(store.read_manifest(BatchId(3)).await.unwrap().is_some());
        // No empty directory is left behind: listing the batches stays proportional to the
        // batches kept.
        let left = store.list_folders("batches").await.unwrap();
        assert_eq!(left, ["3", "4"].map(String::from).into_iter().collect());
    }
}
