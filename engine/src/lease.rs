//! The job lease: at most one running instance of a job at a time, without a lock service.
//!
//! A job's commits are fenced by the output table (delta-rs rejects a second commit of a batch),
//! but a second instance — a cron overlap, a supervisor restarting a job that is still alive —
//! should not even start: it would race every batch and one of the two would stop. So `sluice
//! run` first takes the job's lease, a record in the checkpoint:
//!
//! ```text
//! <checkpoint>/lease/00000000000000000007.json   epoch 7: holder (host, pid), renewed_at, beat
//! ```
//!
//! - **Taking it.** Epoch `e + 1` is created with a put-if-absent (`PutMode::Create`), so of two
//!   instances taking over the same epoch exactly one wins. Epoch numbers are never reused.
//! - **Holding it.** The holder rewrites its own epoch's file every [`LeaseSettings::renew_every`]
//!   (2 s) with a new `beat` — only the holder of an epoch writes that file, so a plain write
//!   suffices (local disks offer no conditional update) — and checks that no newer epoch exists.
//! - **A live holder** (its beat moves while a newcomer watches) makes the newcomer stop with
//!   [`Error::LeaseHeld`] naming host, pid and epoch.
//! - **A dead holder** (SIGKILLed, its machine gone) stops renewing: a newcomer that sees no
//!   renewal for [`LeaseSettings::timeout`] (10 s, by its own clock) takes epoch `e + 1` — it
//!   waits, it never fails because of a dead holder. A lease last written three timeouts ago by
//!   the store's clock is taken at once (three, so a clock a little ahead of the store's cannot
//!   take a live lease), and so is one its holder marked released when it stopped cleanly.
//! - **A store that is down.** On an object store, a renewal waits for a store that does not
//!   answer (see [`crate::storage`]) rather than fail: no newcomer can take a lease over a store
//!   nobody reaches, and once the store answers again the renewal's first look finds any newer
//!   epoch. A newcomer that still reaches the store while this holder does not (a partition)
//!   takes over after the timeout; the two then race as twins do (below), and the output table
//!   admits one commit per batch.
//! - **Losing it.** A holder that finds a newer epoch, or whose renewal failed for most of the
//!   timeout (an error, not a store that is slow to answer), counts the lease as lost: the driver
//!   looks in the store before planning each batch and at the renewal's last look before each
//!   commit, and stops with [`Error::LeaseLost`]. Renewal runs on a thread of its own, so a busy
//!   batch cannot starve it.
//!
//! The lease is a guard, not the proof of correctness: a paused process can resume and write
//! before its next check. Every checkpoint write is therefore also safe against a twin on its
//! own (intents, manifests, state files and the files source's log are put-if-absent or named
//! per epoch; garbage collection follows the committed manifest), and the output table rejects
//! a batch committed twice — see ARCHITECTURE.md, "Two instances".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::checkpoint::CheckpointStore;
use crate::error::{Error, Result};

/// The folder of the checkpoint holding the lease files.
const LEASE_FOLDER: &str = "lease";

/// The folder of the job's *rewrite lease*: held by whoever rewrites files the job's batches
/// wrote — the running job while it compacts (between batches), a backfill while it replaces
/// rows — so the two never overlap: delta-rs's conflict checker would let a compaction and a
/// replacement that read the same files both commit, resurrecting or doubling rows.
pub const REWRITE_LEASE_FOLDER: &str = "rewrite";

/// Test hook: `SLUICE_LEASE_TIMEOUT_MS` shortens the lease timeout (the renewal interval is a
/// fifth of it), so tests of takeovers need not wait 10 s each.
pub const LEASE_TIMEOUT_ENV: &str = "SLUICE_LEASE_TIMEOUT_MS";

/// How long a lease lives without renewal, and how often it is renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// A lease not renewed for this long is taken over (default 10 s).
    pub timeout: Duration,
    /// How often the holder renews it (default 2 s).
    pub renew_every: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        let timeout = std::env::var(LEASE_TIMEOUT_ENV)
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map_or(Duration::from_secs(10), Duration::from_millis);
        LeaseSettings {
            timeout,
            renew_every: timeout / 5,
        }
    }
}

/// What a lease file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LeaseRecord {
    job_id: String,
    epoch: u64,
    host: String,
    pid: u32,
    /// When the holder took the lease (RFC 3339, the holder's clock; for messages).
    acquired_at: String,
    /// Renewal counter: a holder that is alive moves it every `renew_every`.
    beat: u64,
    /// The holder stopped cleanly: the next run need not wait.
    #[serde(default)]
    released: bool,
}

impl LeaseRecord {
    fn holder(&self) -> String {
        format!("host {} pid {} (epoch {})", self.host, self.pid, self.epoch)
    }
}

/// The lease of one running job; renewed in the background until released or dropped.
///
/// The renewal runs on a thread of its own (with its own small runtime), so a batch keeping the
/// job's runtime busy — decoding, encoding Parquet — cannot delay it past the timeout and let
/// another instance take over a live job.
#[derive(Debug)]
pub struct Lease {
    store: CheckpointStore,
    record: LeaseRecord,
    lost: Arc<AtomicBool>,
    /// Set (and `wake` notified) to stop the renewal thread.
    stop: Arc<AtomicBool>,
    wake: Arc<Notify>,
    renewal: Option<RenewalThread>,
    /// The lease timeout: how long [`Lease::release`] waits for the store.
    timeout: Duration,
}

/// The thread renewing a lease, and what tells that its loop has ended.
#[derive(Debug)]
struct RenewalThread {
    thread: std::thread::JoinHandle<()>,
    /// Closed when the loop ends: its sender is dropped with the thread's closure, on return
    /// or panic. [`Lease::release`] waits on it, so it goes on as soon as the loop stops
    /// (polling the thread every 20 ms added that much to every run's end).
    ended: tokio::sync::oneshot::Receiver<()>,
}

fn lease_file(epoch: u64) -> String {
    format!("{epoch:020}.json")
}

/// This machine's host name, for records that say who wrote them.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

impl Lease {
    /// Takes the lease of `job_id` in `checkpoint`: at once if nobody holds it, after waiting for
    /// a dead holder's lease to time out, or not at all if another instance is alive.
    ///
    /// # Errors
    /// [`Error::LeaseHeld`] if another instance of the job is running; store errors.
    pub async fn acquire(
        checkpoint: &CheckpointStore,
        job_id: &str,
        settings: LeaseSettings,
    ) -> Result<Lease> {
        Self::acquire_in(checkpoint, LEASE_FOLDER, job_id, settings).await
    }

    /// [`Lease::acquire`] for the lease kept in the checkpoint's folder `folder`.
    ///
    /// # Errors
    /// As [`Lease::acquire`].
    pub async fn acquire_in(
        checkpoint: &CheckpointStore,
        folder: &str,
        job_id: &str,
        settings: LeaseSettings,
    ) -> Result<Lease> {
        let store = checkpoint.child(folder);
        // The newest epoch we are watching, its beat, and since when (our clock) it is unchanged.
        let mut watching: Option<(u64, u64, Instant)> = None;
        let mut waiting_logged = false;
        loop {
            let newest = newest_epoch(&store).await?;
            let next = match newest {
                None => 0,
                Some(epoch) => {
                    let Some((record, age)) = read_record(&store, epoch).await? else {
                        // Deleted between listing and reading (an operator cleaning up): look again.
                        continue;
                    };
                    let unchanged_since = match watching {
                        Some((e, beat, since)) if e == epoch && beat == record.beat => since,
                        Some((e, _, _)) if e == epoch => {
                            // It renewed while we watched: the holder is alive.
                            return Err(Error::LeaseHeld {
                                job_id: job_id.to_string(),
                                holder: record.holder(),
                                location: store.url().to_string(),
                                timeout: settings.timeout,
                            });
                        }
                        _ => Instant::now(),
                    };
                    watching = Some((epoch, record.beat, unchanged_since));
                    // Not renewed while watched for the timeout (our clock), or written long
                    // ago by the store's clock — three timeouts, so a clock a little ahead of
                    // the store's cannot take a live lease.
                    let stale = record.released
                        || unchanged_since.elapsed() >= settings.timeout
                        || age.is_some_and(|a| a >= settings.timeout * 3);
                    if !stale {
                        if !waiting_logged {
                            info!(job_id, holder = %record.holder(), timeout_ms = settings.timeout.as_millis() as u64,
                                "the job's lease is held; waiting to see whether its holder is alive (a lease not renewed for the timeout is taken over)");
                            waiting_logged = true;
                        }
                        tokio::time::sleep(settings.renew_every.min(Duration::from_millis(500)))
                            .await;
                        continue;
                    }
                    if !record.released {
                        warn!(job_id, holder = %record.holder(), "taking over the lease of a run that stopped renewing it (killed, or its machine is gone)");
                    }
                    epoch + 1
                }
            };
            if let Some(lease) = Self::take(&store, job_id, next, settings).await? {
                return Ok(lease);
            }
            // Another instance took this epoch first: look again.
            watching = None;
        }
    }

    /// Takes the lease in the checkpoint's folder `folder` only if nobody may be holding it —
    /// never taken, released, or last written three timeouts ago by the store's clock (its
    /// holder died) — without waiting; `None` otherwise.
    ///
    /// # Errors
    /// Store errors.
    pub async fn try_acquire_in(
        checkpoint: &CheckpointStore,
        folder: &str,
        job_id: &str,
        settings: LeaseSettings,
    ) -> Result<Option<Lease>> {
        let store = checkpoint.child(folder);
        let next = match newest_epoch(&store).await? {
            None => 0,
            Some(epoch) => match read_record(&store, epoch).await? {
                Some((record, age))
                    if !record.released && age.is_none_or(|a| a < settings.timeout * 3) =>
                {
                    return Ok(None);
                }
                _ => epoch + 1,
            },
        };
        Self::take(&store, job_id, next, settings).await
    }

    /// Marks released the lease in the checkpoint's folder `folder` if `holder` holds it and
    /// does not renew it for one timeout (watched, as [`Lease::acquire`] watches): a run of the
    /// job that took the job's lease calls it for the rewrite lease, which an earlier run
    /// killed while compacting left behind, so compaction need not wait three timeouts for it.
    /// A holder that renews (a paused twin that woke up) keeps it.
    ///
    /// # Errors
    /// Store errors.
    pub async fn release_abandoned_in(
        checkpoint: &CheckpointStore,
        folder: &str,
        holder: &str,
        settings: LeaseSettings,
    ) -> Result<()> {
        let store = checkpoint.child(folder);
        let Some(epoch) = newest_epoch(&store).await? else {
            return Ok(());
        };
        let Some((first, _)) = read_record(&store, epoch).await? else {
            return Ok(());
        };
        if first.job_id != holder || first.released {
            return Ok(());
        }
        tokio::time::sleep(settings.timeout).await;
        if newest_epoch(&store).await? != Some(epoch) {
            return Ok(());
        }
        if let Some((record, _)) = read_record(&store, epoch).await?
            && record.beat == first.beat
            && !record.released
        {
            let rel = lease_file(epoch);
            let record = LeaseRecord {
                released: true,
                ..record
            };
            store.put(&rel, store.to_json(&rel, &record)?).await?;
        }
        Ok(())
    }

    /// Creates epoch `epoch` put-if-absent and starts renewing it; `None` if another instance
    /// created it first.
    async fn take(
        store: &CheckpointStore,
        job_id: &str,
        epoch: u64,
        settings: LeaseSettings,
    ) -> Result<Option<Lease>> {
        let record = LeaseRecord {
            job_id: job_id.to_string(),
            epoch,
            host: host_name(),
            pid: std::process::id(),
            acquired_at: chrono::Utc::now().to_rfc3339(),
            beat: 0,
            released: false,
        };
        let rel = lease_file(epoch);
        if !store
            .put_if_absent(&rel, store.to_json(&rel, &record)?)
            .await?
        {
            return Ok(None);
        }
        let mut lease = Lease {
            store: store.clone(),
            record,
            lost: Arc::new(AtomicBool::new(false)),
            stop: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(Notify::new()),
            renewal: None,
            timeout: settings.timeout,
        };
        lease.renewal = Some(spawn_renewal(&lease, settings)?);
        // Epochs two or more behind can never be current again (best effort).
        if let Ok(files) = lease.store.list_files("").await {
            for old in files {
                if parse_epoch(&old).is_some_and(|e| e + 1 < epoch) {
                    let _ = lease.store.delete(&old).await;
                }
            }
        }
        Ok(Some(lease))
    }

    /// The epoch: unique to this run among all runs of the job, used to name what it writes.
    pub fn epoch(&self) -> u64 {
        self.record.epoch
    }

    /// Fails with [`Error::LeaseLost`] if the lease was lost (another instance took over, or
    /// it could not be renewed in time); the caller must stop writing.
    pub fn check(&self) -> Result<()> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(Error::LeaseLost {
                job_id: self.record.job_id.clone(),
                epoch: self.record.epoch,
                location: self.store.url().to_string(),
            });
        }
        Ok(())
    }

    /// Like [`Lease::check`], and also looks at the store: fails if a newer epoch exists now.
    /// One listing; the driver calls it before planning each batch, so a process that was
    /// paused past the timeout finds out before it writes anything.
    ///
    /// # Errors
    /// [`Error::LeaseLost`]; store errors.
    pub async fn verify(&self) -> Result<()> {
        self.check()?;
        if newest_epoch(&self.store)
            .await?
            .is_some_and(|e| e > self.record.epoch)
        {
            self.lost.store(true, Ordering::SeqCst);
        }
        self.check()
    }

    /// Stops renewing and marks the lease released, so the next run starts at once. Gives up
    /// after the lease timeout (a store that does not answer): the lease then expires as a
    /// killed run's would.
    pub async fn release(mut self) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        // The renewal must be over before the record is marked released, or a last beat could
        // overwrite the mark.
        if let Some(RenewalThread { thread, ended }) = self.renewal.take() {
            // `Err` (the sender dropped) is the end; the timeout, a store that does not answer.
            if tokio::time::timeout(self.timeout, ended).await.is_err() {
                warn!(job_id = %self.record.job_id, "the lease's renewal did not stop in time (the store does not answer); the lease expires instead");
                return Ok(());
            }
            let _ = thread.join();
        }
        if self.lost.load(Ordering::SeqCst) {
            return Ok(());
        }
        let record = LeaseRecord {
            released: true,
            ..self.record.clone()
        };
        let rel = lease_file(record.epoch);
        let bytes = self.store.to_json(&rel, &record)?;
        tokio::time::timeout(self.timeout, self.store.put(&rel, bytes))
            .await
            .unwrap_or(Ok(()))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }
}

/// Starts the renewal loop of `lease` on a thread of its own.
fn spawn_renewal(lease: &Lease, settings: LeaseSettings) -> Result<RenewalThread> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let renewal = Renewal {
        store: lease.store.clone(),
        record: lease.record.clone(),
        settings,
        lost: Arc::clone(&lease.lost),
        stop: Arc::clone(&lease.stop),
        wake: Arc::clone(&lease.wake),
    };
    let (ending, ended) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("sluice-lease".into())
        .spawn(move || {
            let _ending = ending;
            runtime.block_on(renewal.run());
            // Shut down before `ending` goes: `release` waits for the end (within the lease
            // timeout) and then joins the thread, which must then have nothing left to do.
            drop(runtime);
        })?;
    Ok(RenewalThread { thread, ended })
}

/// What the renewal loop needs.
struct Renewal {
    store: CheckpointStore,
    record: LeaseRecord,
    settings: LeaseSettings,
    lost: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    wake: Arc<Notify>,
}

impl Renewal {
    /// Every `renew_every`: check that no newer epoch exists, then write a new beat. Sets
    /// `lost` when a newer epoch appears or renewals failed for most of the timeout; ends when
    /// `stop` is set.
    async fn run(mut self) {
        let rel = lease_file(self.record.epoch);
        let mut last_renewed = Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.settings.renew_every) => {}
                _ = self.wake.notified() => {}
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let newer = match newest_epoch(&self.store).await {
                Ok(newest) => newest.is_some_and(|e| e > self.record.epoch),
                Err(_) => false,
            };
            if newer {
                warn!(job_id = %self.record.job_id, epoch = self.record.epoch, "another instance took over the job's lease; this run stops before its next commit");
                self.lost.store(true, Ordering::SeqCst);
                return;
            }
            self.record.beat += 1;
            let written = match self.store.to_json(&rel, &self.record) {
                Ok(bytes) => self.store.put(&rel, bytes).await,
                Err(e) => Err(e),
            };
            match written {
                Ok(()) => last_renewed = Instant::now(),
                Err(error) => {
                    warn!(job_id = %self.record.job_id, %error, "could not renew the job's lease; retrying");
                    // Past most of the timeout another instance may take over: stop writing.
                    if last_renewed.elapsed() >= self.settings.timeout.mul_f32(0.8) {
                        self.lost.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            }
        }
    }
}

fn parse_epoch(name: &str) -> Option<u64> {
    name.strip_suffix(".json")?.parse().ok()
}

async fn newest_epoch(store: &CheckpointStore) -> Result<Option<u64>> {
    Ok(store
        .list_files("")
        .await?
        .iter()
        .filter_map(|n| parse_epoch(n))
        .max())
}

/// The record of `epoch` and how long ago (by this machine's clock) it was last written.
async fn read_record(
    store: &CheckpointStore,
    epoch: u64,
) -> Result<Option<(LeaseRecord, Option<Duration>)>> {
    let rel = lease_file(epoch);
    let Some((bytes, modified)) = store.get_with_modified(&rel).await? else {
        return Ok(None);
    };
    let record = serde_json::from_slice(&bytes).map_err(|source| Error::CheckpointFormat {
        path: format!("{}/{rel}", store.url().as_str().trim_end_matches('/')),
        source,
    })?;
    let age = (chrono::Utc::now() - modified).to_std().ok();
    Ok(Some((record, age)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use url::Url;

    fn settings(ms: u64) -> LeaseSettings {
        LeaseSettings {
            timeout: Duration::from_millis(ms),
            renew_every: Duration::from_millis(ms / 5),
        }
    }

    fn checkpoint(dir: &tempfile::TempDir) -> CheckpointStore {
        CheckpointStore::open(&Url::from_directory_path(dir.path()).unwrap()).unwrap()
    }

    #[tokio::test]
    async fn a_live_holder_is_refused_a_released_one_taken_over_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = checkpoint(&dir);
        let first = Lease::acquire(&store, "j", settings(1000)).await.unwrap();
        assert_eq!(first.epoch(), 0);
        let err = Lease::acquire(&store, "j", settings(1000))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("job 'j' is already running"), "{err}");
        first.check().unwrap();
        first.release().await.unwrap();
        let started = Instant::now();
        let second = Lease::acquire(&store, "j", settings(1000)).await.unwrap();
        assert_eq!(second.epoch(), 1);
        assert!(started.elapsed() < Duration::from_millis(500));
    }

    #[tokio::test]
    async fn a_dead_holder_is_waited_out_and_then_loses_the_lease() {
        let dir = tempfile::tempdir().unwrap();
        let store = checkpoint(&dir);
        let dead = Lease::acquire(&store, "j", settings(600)).await.unwrap();
        // A SIGKILLed holder: it stops renewing, nothing else happens.
        dead.stop.store(true, Ordering::SeqCst);
        dead.wake.notify_one();
        let started = Instant::now();
        let next = Lease::acquire(&store, "j", settings(600)).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(400));
        assert_eq!(next.epoch(), 1);
        // Had the "dead" holder only been paused, it finds out at its next renewal.
        let zombie = Renewal {
            store: store.child(LEASE_FOLDER),
            record: dead.record.clone(),
            settings: settings(600),
            lost: Arc::clone(&dead.lost),
            stop: Arc::new(AtomicBool::new(false)),
            wake: Arc::new(Notify::new()),
        };
        tokio::spawn(zombie.run());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let err = dead.check().unwrap_err().to_string();
        assert!(err.contains("lost its lease"), "{err}");
        next.check().unwrap();
    }
}
