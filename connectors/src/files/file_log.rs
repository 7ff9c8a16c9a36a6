//! The files source's recorded file order: which file is at which offset, kept in the checkpoint
//! as append-only segments.
//!
//! ```text
//! sources/<name>/files/segment-00000000000000000120.json   files first seen by one listing,
//!                                                          offsets 120, 121, …
//! sources/<name>/files/snapshot-00000000000000004096.json  every file at offsets 0..4096
//! ```
//!
//! A segment is written put-if-absent under the offset it starts at, so two runs of the job (a
//! stale twin and the current one) can never record different files at the same offset: the
//! one that loses reloads what the other recorded and appends after it. Nothing is rewritten,
//! so recording a file costs the size of the listing that found it, not of the whole log; every
//! [`SEGMENTS_PER_SNAPSHOT`] segments are consolidated into a snapshot, so opening the log
//! reads a few objects however many files the job has seen. (Checkpoints written before
//! segments existed hold one `files.json`; it is read as the start of the log.)

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use sluice_engine::checkpoint::CheckpointStore;

use crate::error::{ConnectorError, Result};

/// Segments written before they are consolidated into a snapshot.
pub(crate) const SEGMENTS_PER_SNAPSHOT: usize = 64;

const FOLDER: &str = "files";
const LEGACY_FILE_LOG: &str = "files.json";

/// A file as first seen: its name, and what it looked like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordedFile {
    /// Path relative to the source directory.
    pub(crate) name: String,
    pub(crate) size: u64,
    pub(crate) modified_micros: i64,
}

/// What a segment or snapshot object holds: the files at offsets `first..first + files.len()`.
#[derive(Debug, Serialize, Deserialize)]
struct Segment {
    first: u64,
    files: Vec<RecordedFile>,
}

/// The legacy single-object log.
#[derive(Debug, Default, Deserialize)]
struct LegacyLog {
    files: Vec<RecordedFile>,
}

fn segment_name(first: usize) -> String {
    format!("segment-{first:020}.json")
}

fn snapshot_name(end: usize) -> String {
    format!("snapshot-{end:020}.json")
}

fn parse(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// The recorded file order, as loaded from and appended to the checkpoint.
#[derive(Debug, Default)]
pub(crate) struct FileLog {
    /// The file at each offset.
    pub(crate) files: Vec<RecordedFile>,
    names: HashSet<String>,
    /// The greatest recorded name.
    max_name: Option<String>,
    /// Segments written since the newest snapshot.
    segments_since_snapshot: usize,
}

impl FileLog {
    /// Loads the log from `checkpoint` (the source's folder).
    ///
    /// # Errors
    /// If an object is unreadable or the segments leave a gap.
    pub(crate) async fn load(checkpoint: &CheckpointStore) -> Result<FileLog> {
        // An object can vanish between listing and reading (a twin consolidating): list again.
        for _ in 0..10 {
            let mut log = FileLog::default();
            let names = checkpoint.child(FOLDER).list_files("").await?;
            let snapshot = names.iter().filter_map(|n| parse(n, "snapshot-")).max();
            let start = match snapshot {
                Some(end) => {
                    checkpoint
                        .get_json::<Segment>(&format!("{FOLDER}/{}", snapshot_name(end)))
                        .await?
                }
                None => checkpoint
                    .get_json::<LegacyLog>(LEGACY_FILE_LOG)
                    .await?
                    .map(|l| Segment {
                        first: 0,
                        files: l.files,
                    }),
            };
            if snapshot.is_some() && start.is_none() {
                continue;
            }
            if let Some(start) = start {
                log.push(start.files);
            }
            if log.read_segments_after(checkpoint, &names).await? {
                return Ok(log);
            }
        }
        Err(ConnectorError::Config(format!(
            "the file log in {}/{FOLDER} keeps changing while being read; is another run of \
             the job consolidating it?",
            checkpoint.url()
        )))
    }

    /// Reads the segments in `names` that start at or after the log's end, in order. `false`
    /// if one vanished meanwhile (the caller lists again).
    async fn read_segments_after(
        &mut self,
        checkpoint: &CheckpointStore,
        names: &std::collections::BTreeSet<String>,
    ) -> Result<bool> {
        let mut firsts: Vec<usize> = names
            .iter()
            .filter_map(|n| parse(n, "segment-"))
            .filter(|first| *first >= self.files.len())
            .collect();
        firsts.sort_unstable();
        for first in firsts {
            if first != self.files.len() {
                return Err(ConnectorError::Config(format!(
                    "the file log in {}/{FOLDER} has a gap: offsets {}..{first} are recorded \
                     nowhere (was part of the checkpoint deleted?)",
                    checkpoint.url(),
                    self.files.len()
                )));
            }
            let Some(segment) = checkpoint
                .get_json::<Segment>(&format!("{FOLDER}/{}", segment_name(first)))
                .await?
            else {
                return Ok(false);
            };
            self.push(segment.files);
            self.segments_since_snapshot += 1;
        }
        Ok(true)
    }

    fn push(&mut self, files: Vec<RecordedFile>) {
        for f in files {
            if self.max_name.as_ref().is_none_or(|m| *m < f.name) {
                self.max_name = Some(f.name.clone());
            }
            self.names.insert(f.name.clone());
            self.files.push(f);
        }
    }

    /// Whether `name` is recorded.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// The greatest recorded name: a listing may start after it.
    pub(crate) fn max_name(&self) -> Option<&str> {
        self.max_name.as_deref()
    }

    /// Records `new` (files not yet recorded, in the order to give them offsets) after the
    /// files already recorded. If another run recorded files at the same offsets first, its
    /// files are loaded and kept where they are, and only what is still new is appended.
    ///
    /// # Errors
    /// If the checkpoint cannot be read or written.
    pub(crate) async fn append(
        &mut self,
        checkpoint: &CheckpointStore,
        mut new: Vec<RecordedFile>,
    ) -> Result<()> {
        loop {
            new.retain(|f| !self.contains(&f.name));
            if new.is_empty() {
                return Ok(());
            }
            let first = self.files.len();
            let rel = format!("{FOLDER}/{}", segment_name(first));
            let segment = Segment {
                first: first as u64,
                files: new.clone(),
            };
            let written = checkpoint
                .put_if_absent(&rel, checkpoint.to_json(&rel, &segment)?)
                .await?;
            // The offsets are ours only if no snapshot covers them: a run that consolidated
            // meanwhile deleted the segments below its snapshot, so a stale run's write there
            // can succeed — and must be ignored (loads never read segments below a snapshot,
            // and the next consolidation deletes it).
            let names = checkpoint.child(FOLDER).list_files("").await?;
            let covered = names
                .iter()
                .filter_map(|n| parse(n, "snapshot-"))
                .any(|end| end > first);
            if written && !covered {
                self.push(new);
                self.segments_since_snapshot += 1;
                break;
            }
            // Another run recorded files at this offset first: take what it recorded.
            if covered || !self.read_segments_after(checkpoint, &names).await? {
                *self = FileLog::load(checkpoint).await?;
            }
        }
        if self.segments_since_snapshot >= SEGMENTS_PER_SNAPSHOT {
            self.consolidate(checkpoint).await?;
        }
        Ok(())
    }

    /// Writes a snapshot of every recorded file and deletes the segments and snapshots it
    /// covers.
    async fn consolidate(&mut self, checkpoint: &CheckpointStore) -> Result<()> {
        let end = self.files.len();
        let rel = format!("{FOLDER}/{}", snapshot_name(end));
        let snapshot = Segment {
            first: 0,
            files: self.files.clone(),
        };
        if !checkpoint
            .put_if_absent(&rel, checkpoint.to_json(&rel, &snapshot)?)
            .await?
        {
            // Another run consolidated the same log at the same point: its to clean up.
            self.segments_since_snapshot = 0;
            return Ok(());
        }
        let folder = checkpoint.child(FOLDER);
        for name in folder.list_files("").await? {
            let covered = parse(&name, "segment-").is_some_and(|first| first < end)
                || parse(&name, "snapshot-").is_some_and(|e| e < end);
            if covered {
                folder.delete(&name).await?;
            }
        }
        checkpoint.delete(LEGACY_FILE_LOG).await?;
        self.segments_since_snapshot = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use url::Url;

    fn file(name: &str) -> RecordedFile {
        RecordedFile {
            name: name.into(),
            size: 1,
            modified_micros: 1,
        }
    }

    fn names(log: &FileLog) -> Vec<&str> {
        log.files.iter().map(|f| f.name.as_str()).collect()
    }

    /// A stale run (a twin that kept an old copy of the log in memory) records what it lists
    /// after what the current run recorded meanwhile: no offset ever names another file.
    #[tokio::test]
    async fn a_stale_twin_never_moves_a_recorded_file() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let mut current = FileLog::load(&checkpoint).await.unwrap();
        current
            .append(&checkpoint, vec![file("a"), file("b")])
            .await
            .unwrap();
        let mut stale = FileLog::load(&checkpoint).await.unwrap();
        current.append(&checkpoint, vec![file("c")]).await.unwrap();
        current.append(&checkpoint, vec![file("e")]).await.unwrap();
        // The stale twin lists c, d and e; c and e have offsets already, d comes after them.
        let listed = ["c", "d", "e"].map(file).to_vec();
        stale.append(&checkpoint, listed).await.unwrap();
        assert_eq!(names(&stale), ["a", "b", "c", "e", "d"]);
        let reloaded = FileLog::load(&checkpoint).await.unwrap();
        assert_eq!(names(&reloaded), names(&stale));
        assert_eq!(reloaded.max_name(), Some("e"));
    }

    /// A stale run whose segment lands below a snapshot the current run wrote meanwhile (the
    /// consolidation deleted the segment it wrote over) does not take those offsets.
    #[tokio::test]
    async fn a_stale_twin_cannot_write_below_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let mut current = FileLog::load(&checkpoint).await.unwrap();
        current.append(&checkpoint, vec![file("a")]).await.unwrap();
        let mut stale = FileLog::load(&checkpoint).await.unwrap();
        let later: Vec<String> = (0..SEGMENTS_PER_SNAPSHOT + 3)
            .map(|i| format!("b{i:03}"))
            .collect();
        for name in &later {
            current.append(&checkpoint, vec![file(name)]).await.unwrap();
        }
        // The stale run lists a file with a small name and the current run's files in name
        // order: it must not number them its own way.
        let mut listed = vec![file("a0-late")];
        listed.extend(later.iter().map(|n| file(n)));
        stale.append(&checkpoint, listed).await.unwrap();
        let mut want = vec!["a"];
        want.extend(later.iter().map(String::as_str));
        want.push("a0-late");
        assert_eq!(names(&stale), want);
        assert_eq!(names(&FileLog::load(&checkpoint).await.unwrap()), want);
    }

    /// A long life of one-file listings leaves a handful of objects, not one per listing.
    #[tokio::test]
    async fn segments_are_consolidated() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint =
            CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap();
        let mut log = FileLog::load(&checkpoint).await.unwrap();
        let all: Vec<String> = (0..300).map(|i| format!("f{i:05}")).collect();
        for name in &all {
            log.append(&checkpoint, vec![file(name)]).await.unwrap();
        }
        let objects = checkpoint.child(FOLDER).list_files("").await.unwrap();
        assert!(
            objects.len() <= SEGMENTS_PER_SNAPSHOT + 1,
            "{} objects",
            objects.len()
        );
        let reloaded = FileLog::load(&checkpoint).await.unwrap();
        assert_eq!(names(&reloaded), all);
    }
}
