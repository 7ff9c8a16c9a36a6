//! Backfill: rerun an offset range of a job as one bounded batch that replaces what it covers.
//!
//! The same job definition as the stream — same sources, same SQL, same sink — run over
//! `[from, to)` per partition. The rows are read and processed in chunks of the source's
//! per-batch budget (so each chunk behaves exactly like a streamed batch) while the sink writes
//! them, and the sink replaces every row those offsets produced with them, **in one commit per
//! table** (output, then dead letters),
//! each carrying `txn(<job_id>/backfill/<n>, 0)`. Rerunning a range therefore leaves the tables
//! as they were; a backfill that crashed is simply run again. The live job may run meanwhile:
//! its appends and the replacement resolve through Delta's conflict checker, and the sink retries
//! a replacement that lost the race.
//!
//! Reading streams: the source is read in chunks of its per-batch budget, and nothing is held
//! beyond what the result needs — a stateless backfill streams its recomputed rows into the
//! sink's writer chunk by chunk (the sink runs the recomputation again if its commit loses a
//! race, see [`RecomputedRows`]), so it holds one chunk and the range's dead letters; a windowed
//! one holds
//! the state of the windows it recomputes, reading every committed offset but keeping only the
//! rows of those windows; resolving an event-time range keeps nothing but offsets; of the side
//! tables only the columns and rows needed are read. Memory is independent of how much data the
//! job has read over its life.
//!
//! Which rows a range "produced" is told by lineage for a stateless job: output rows by
//! `_source_partition` / `_source_offset` (so the job must keep `lineage = true`), dead letters
//! by source name, partition and offset. A **windowed** job's range produced whole windows: every
//! window its events fall into (plus the windows its late rows missed alongside) is recomputed
//! in one bounded run over every committed event those windows hold — the read widened to whole
//! windows — with the watermark at +∞ at the end, and replaced by window in the output and the
//! late table: the late rows of those windows *among the offsets read* are counted again and
//! leave the late table; late rows the live job commits meanwhile (past the offsets read) stay.
//! Windows the live job has not closed are its to write: a range touching one is refused.
//!
//! Event times too far ahead of the clock (see [`crate::event_time`]) are judged as the live
//! job judged them: the rows its dead-letter table lists as too far ahead are dead letters
//! again, whatever the clock says now.
//!
//! A backfill never goes past the offsets the live job has committed (`latest` means the live
//! job's committed end when it has run): later offsets are the live job's to write, and a
//! backfill that wrote them would be duplicated when the live job reaches them. A job that never
//! committed can be backfilled up to the source's latest offsets — its bounded, batch-job run;
//! the report says so, because a later `sluice run` of that job would start at its starting
//! offsets and write those rows again.
//!
//! Each backfill gets a number `n` and a folder `<checkpoint>/backfill/<n>/` holding its resolved
//! ranges (`spec.json`), written before anything else, for the record.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::checkpoint::CheckpointStore;
use crate::dead_letter::{dead_letter_batch, dead_letter_from_row};
use crate::driver::{OpenedJob, open_job};
use crate::error::{Error, Result};
use crate::event_time::rows_in_period;
use crate::expectations::Expectations;
use crate::fault::pause_point;
use crate::input::{FutureTimes, OpenSource, read_source_as_opened, table_column};
use crate::job::Job;
use crate::late::{Lateness, WINDOWS_MISSED};
use crate::lease::{Lease, LeaseSettings, REWRITE_LEASE_FOLDER};
use crate::offsets::{BatchId, Offset, OffsetRange, PartitionId, plan_ranges};
use crate::progress::Progress;
use crate::query::BatchWatermark;
use crate::query::StreamingQuery;
use crate::sink::{CommitOutcome, RecomputedRows, ReplacedWindows, Replacement, Sink, TableScan};
use crate::source::{DeadLetter, SOURCE_OFFSET, SOURCE_PARTITION};
use crate::static_table::TablesAtVersions;
use crate::watermark::display_watermark;
use crate::window::{WINDOW_END, WINDOW_START, WindowKind, WindowUse};
use tracing::{info, warn};

/// One end of a backfill range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// `earliest`: where each partition starts (its starting offset).
    Earliest,
    /// `latest`: the latest offsets available when the backfill starts.
    Latest,
    /// `0:120,1:95`: explicit offsets; partitions not named are not backfilled.
    Offsets(BTreeMap<PartitionId, Offset>),
}

impl std::str::FromStr for Bound {
    type Err = Error;

    /// `earliest`, `latest`, or `partition:offset` pairs separated by commas (the offset is after
    /// the last `:`, so Kafka partition ids like `topic:0` work: `topic:0:42`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "earliest" => return Ok(Bound::Earliest),
            "latest" => return Ok(Bound::Latest),
            _ => {}
        }
        let mut offsets = BTreeMap::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let parsed = pair
                .rsplit_once(':')
                .and_then(|(p, o)| Some((p.to_string(), o.parse::<Offset>().ok()?)))
                .filter(|(p, o)| !p.is_empty() && *o >= 0);
            let Some((partition, offset)) = parsed else {
                return Err(Error::InvalidJob(format!(
                    "'{pair}' is not partition:offset (in '{s}'; e.g. 0:120,1:95, or earliest / latest)"
                )));
            };
            offsets.insert(partition, offset);
        }
        if offsets.is_empty() {
            return Err(Error::InvalidJob(format!(
                "'{s}' names no partition:offset pair"
            )));
        }
        Ok(Bound::Offsets(offsets))
    }
}

/// What to backfill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackfillRange {
    /// `[from, to)` in offsets.
    Offsets {
        /// Start (inclusive).
        from: Bound,
        /// End (exclusive).
        to: Bound,
    },
    /// The offsets holding events with event time in `[from, to)` (µs since the epoch), found by
    /// scanning each partition once.
    Time {
        /// Start (inclusive).
        from: i64,
        /// End (exclusive).
        to: i64,
    },
}

/// The ranges a backfill resolved to, recorded as `backfill/<n>/spec.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackfillSpec {
    /// `<job_id>/backfill/<n>`.
    pub app_id: String,
    /// The source backfilled.
    pub source: String,
    /// Per partition, the offsets replaced.
    pub ranges: BTreeMap<PartitionId, OffsetRange>,
    /// Who claimed the backfill's number (host, pid, clock): two identical backfills started
    /// at once write different claims, so exactly one gets the number.
    #[serde(default)]
    pub claimed_by: String,
}

/// What a backfill did (or, with `dry_run`, would do).
#[derive(Debug, Clone)]
pub struct BackfillReport {
    /// What was resolved.
    pub spec: BackfillSpec,
    /// Whether this was a dry run (nothing read or written beyond resolving the ranges).
    pub dry_run: bool,
    /// Offsets in the ranges (files for the files source, records for Kafka).
    pub offsets: u64,
    /// Rows decoded.
    pub rows_in: u64,
    /// Rows written to the output.
    pub rows_out: u64,
    /// Dead letters written.
    pub rows_dead_lettered: u64,
    /// Data files and bytes the output commit added.
    pub files_written: u64,
    /// Bytes of those files.
    pub bytes_written: u64,
    /// Whether the output table already held this backfill (a rerun after a crash).
    pub already_committed: bool,
    /// Whether the job had committed batches of its own (a live job); if not, a later `sluice
    /// run` of it would start at its starting offsets and write these rows again.
    pub live_job: bool,
    /// A windowed job: the windows replaced.
    pub windows: Option<ReplacedWindows>,
    /// A windowed job: rows of the late table that missed those windows; the recomputation
    /// counts them and the replacement removes them from the late table.
    pub late_rows_recounted: u64,
    /// A windowed job: the event-time span `[from, to)` read to recompute those windows (every
    /// committed event in it, beyond the range's own offsets).
    pub read_span: Option<(i64, i64)>,
    /// Wall time.
    pub elapsed: Duration,
}

impl Job {
    /// Reruns `range` of the job as one bounded batch and replaces what it covers; with
    /// `dry_run`, only resolves and reports the ranges.
    ///
    /// # Errors
    /// If the sink cannot replace rows ([`crate::Sink::can_replace`]), the job has several
    /// sources or no lineage columns, a bound names an unknown partition
    /// or lies outside what the source holds, `from > to`, or reading, the query or the commit
    /// fails.
    pub async fn backfill(mut self, range: BackfillRange, dry_run: bool) -> Result<BackfillReport> {
        let started = Instant::now();
        if !self.sink.can_replace() {
            return Err(Error::CannotReplace {
                location: self.sink.location().to_string(),
            });
        }
        let OpenedJob {
            checkpoint,
            settings,
            sources,
            tables,
            query,
        } = open_job(&mut self, false).await?;
        if self.output_mode == crate::sink::OutputMode::Update {
            return Err(Error::UnsupportedQuery(
                "backfill of update-mode jobs is not available yet; backfill replaces the rows \
                 of append-mode jobs"
                    .into(),
            ));
        }
        let window = query.window().map(|(w, l)| (w.clone(), l));
        if query.deduplicates() {
            return Err(Error::UnsupportedQuery(
                "backfill of a deduplicating job is not available: whether a row is its key's \
                 first depends on every row read before the range (and on the watermark each \
                 batch ran under), so a range cannot be recomputed alone; reconcile checks the \
                 job instead"
                    .into(),
            ));
        }
        if query.joins_streams() {
            return Err(Error::UnsupportedQuery(
                "backfill of a job joining two streams is not available: the pairs a range \
                 produced depend on rows of the other stream read before and after it (and on \
                 the watermark each batch ran under), so a range cannot be recomputed alone; \
                 reconcile checks the job instead"
                    .into(),
            ));
        }
        if query.joins_windows() {
            return Err(Error::UnsupportedQuery(
                "backfill of a window join is not available yet: it would replace the joined \
                 windows its range touched on both sources, and that rule is not built; \
                 reconcile checks the job instead"
                    .into(),
            ));
        }
        if query.is_stateful() && window.is_none() {
            return Err(Error::UnsupportedQuery(
                "a running aggregate (no window) has no range to replace: its groups span all \
                 time"
                    .into(),
            ));
        }
        if window
            .as_ref()
            .is_some_and(|(w, _)| matches!(w.kind, WindowKind::Session { .. }))
        {
            return Err(Error::UnsupportedQuery(
                "backfill of session windows is not available: a session's extent depends on \
                 events outside any range"
                    .into(),
            ));
        }
        let [source] = sources.as_slice() else {
            return Err(Error::InvalidJob(format!(
                "backfill handles jobs with one source for now; this one has {}",
                sources.len()
            )));
        };
        let output_schema = query.output_schema();
        let expectations =
            Expectations::plan(&self.expectations, &output_schema, &settings.functions)?;
        if window.is_some() && expectations.quarantines() {
            // Quarantined windows carry no lineage, so the dead-letter rows of the windows a
            // backfill replaces cannot be told apart from others: they would be doubled.
            return Err(Error::UnsupportedQuery(
                "backfill of a windowed job with a quarantine expectation is not available: its \
                 quarantined windows cannot be replaced by lineage (use drop or warn, or rerun \
                 the job from scratch)"
                    .into(),
            ));
        }
        for col in [SOURCE_PARTITION, SOURCE_OFFSET] {
            if window.is_none() && output_schema.index_of(col).is_err() {
                return Err(Error::InvalidJob(format!(
                    "backfill finds the rows a range produced by their lineage, and the output \
                     has no column {col}: keep lineage = true in [sink]"
                )));
            }
        }

        // Offsets the live job has not committed yet are its to write: a backfill stops at its
        // committed end offsets (or at the source's latest if the job never ran live). Event
        // times too far ahead are judged as the live job did, or by the clock for a batch run.
        let mut available = source.source.available().await?;
        let mut live_watermark = None;
        let live = match self.sink.committed_batch(&self.id).await? {
            None => false,
            Some(batch) => {
                let manifest = checkpoint.read_manifest(batch).await?.ok_or_else(|| {
                    Error::MissingManifest {
                        job_id: self.id.clone(),
                        batch_id: batch,
                        path: checkpoint.manifest_location(batch),
                    }
                })?;
                let ends = manifest.end_offsets.get(&source.name);
                for (p, a) in available.iter_mut() {
                    a.latest = ends.and_then(|e| e.get(p)).copied().unwrap_or(a.initial);
                }
                live_watermark = manifest.watermark_micros;
                true
            }
        };
        let future = if live {
            FutureTimes::as_recorded_by(self.sink.as_ref(), &source.name).await?
        } else {
            FutureTimes::Clock(chrono::Utc::now().timestamp_micros())
        };
        let ranges = match &range {
            BackfillRange::Offsets { from, to } => {
                resolve_offsets(&source.name, &available, live, from, to)?
            }
            BackfillRange::Time { from, to } => {
                let Some(time) = &source.event_time else {
                    return Err(Error::in_source(
                        &source.name,
                        "--from-time/--to-time need event_time on the source",
                    ));
                };
                let all = available
                    .iter()
                    .map(|(p, a)| (p.clone(), OffsetRange::new(a.initial, a.latest)))
                    .collect();
                offsets_in_period(
                    source,
                    &all,
                    &future,
                    &time.column,
                    *from,
                    *to,
                    &self.progress,
                )
                .await?
            }
        };
        let backfills = checkpoint.child("backfill");
        let number = backfills
            .list_folders("")
            .await?
            .iter()
            .filter_map(|n| n.parse::<u64>().ok())
            .max()
            .map_or(0, |n| n + 1);
        let spec = BackfillSpec {
            app_id: format!("{}/backfill/{number}", self.id),
            source: source.name.clone(),
            ranges,
            claimed_by: format!(
                "{} pid {} at {}",
                crate::lease::host_name(),
                std::process::id(),
                chrono::Utc::now().to_rfc3339()
            ),
        };
        let offsets = spec.ranges.values().map(OffsetRange::len).sum();
        self.progress.bounded_run(offsets as i64);
        // A windowed job replaces whole windows: those the range's events fall into (and those
        // its late rows missed alongside), recomputed from every committed event they hold.
        let windows = match &window {
            None => None,
            Some((window, lateness)) => Some(
                covered_windows(
                    source,
                    &spec.ranges,
                    &available,
                    &future,
                    window,
                    *lateness,
                    live.then_some(live_watermark),
                    &output_schema,
                    self.sink.as_ref(),
                    &self.progress,
                )
                .await?,
            ),
        };
        let mut report = BackfillReport {
            spec,
            dry_run,
            offsets,
            rows_in: 0,
            rows_out: 0,
            rows_dead_lettered: 0,
            files_written: 0,
            bytes_written: 0,
            already_committed: false,
            live_job: live,
            windows: windows.as_ref().map(|w| w.replaced.clone()),
            late_rows_recounted: windows.as_ref().map_or(0, |w| w.late_rows),
            read_span: windows.as_ref().map(|w| w.span),
            elapsed: Duration::ZERO,
        };
        // Each row joins the static tables at the version its streamed batch joined (the
        // newest, for a job that never streamed).
        let tables = TablesAtVersions::open(tables, &checkpoint, live).await?;
        if dry_run {
            report.elapsed = started.elapsed();
            return Ok(report);
        }
        let folder = backfills.child(&number.to_string());
        let bytes = folder.to_json("spec.json", &report.spec)?;
        if !folder.put_if_absent("spec.json", bytes).await? {
            return Err(Error::InvalidJob(format!(
                "another backfill of job '{}' took number {number} at the same time; run it again",
                self.id
            )));
        }

        let mut sink = self.sink;
        sink.open(&self.id, query.output_tables()).await?;
        let [source]: [OpenSource; 1] = sources
            .try_into()
            .map_err(|_| Error::InvalidJob("backfill handles jobs with one source".into()))?;
        if let Some(windows) = windows {
            let (report, replaced, rows) = recompute_windows(
                &source,
                query,
                &tables,
                report,
                windows,
                &future,
                &expectations,
                &self.progress,
            )
            .await?;
            return replace(
                &checkpoint,
                sink.as_ref(),
                report,
                Some(replaced),
                Arc::new(rows),
                started,
            )
            .await;
        }

        // Read and processed chunk by chunk while the sink writes the rows.
        let rows = Arc::new(StatelessRows {
            schema: output_schema,
            source,
            query: tokio::sync::Mutex::new(query),
            tables,
            expectations,
            ranges: report.spec.ranges.clone(),
            future,
            progress: Arc::clone(&self.progress),
            finished: std::sync::Mutex::new(None),
            failure: std::sync::Mutex::new(None),
        });
        let replaced = replace(
            &checkpoint,
            sink.as_ref(),
            report,
            None,
            Arc::clone(&rows) as Arc<dyn RecomputedRows>,
            started,
        )
        .await;
        // An error of the recomputation reaches the sink wrapped in its write: report it as is.
        let mut report = match replaced {
            Ok(report) => report,
            Err(e) => return Err(rows.take_failure().unwrap_or(e)),
        };
        if let Some((rows_in, rows_out, dead_lettered)) = rows.counts() {
            report.rows_in = rows_in;
            report.rows_out = rows_out;
            report.rows_dead_lettered = dead_lettered;
        }
        Ok(report)
    }
}

/// Hands the recomputation to the sink, which replaces what the backfill covers with its rows,
/// and completes the report. The replacement runs under the job's rewrite lease, so the live
/// job does not compact the tables meanwhile (it waits for a compaction in progress).
async fn replace(
    checkpoint: &CheckpointStore,
    sink: &dyn Sink,
    mut report: BackfillReport,
    windows: Option<ReplacedWindows>,
    rows: Arc<dyn RecomputedRows>,
    started: Instant,
) -> Result<BackfillReport> {
    let lease = rewrite_lease(checkpoint, &report.spec.app_id).await?;
    pause_point("before_replacement", BatchId(0)).await;
    let outcome = sink
        .replace(Replacement {
            app_id: report.spec.app_id.clone(),
            source: report.spec.source.clone(),
            ranges: report.spec.ranges.clone(),
            windows,
            rows,
            summary: serde_json::to_value(&report.spec).unwrap_or_default(),
        })
        .await;
    if let Err(error) = lease.release().await {
        warn!(%error, "could not release the rewrite lease; the live job compacts again once it expires");
    }
    match outcome? {
        CommitOutcome::Committed { files, bytes, .. } => {
            report.files_written = files;
            report.bytes_written = bytes;
        }
        CommitOutcome::AlreadyCommitted => report.already_committed = true,
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// A stateless backfill's rows: its range read chunk by chunk (the source's per-batch budget),
/// each chunk run through the query and the expectations as a streamed batch is, and handed to
/// the sink's writer before the next is read — one chunk (and the dead letters so far) is in
/// memory, however long the range.
struct StatelessRows {
    schema: SchemaRef,
    source: OpenSource,
    query: tokio::sync::Mutex<StreamingQuery>,
    /// The static tables, each row joined at its streamed batch's version.
    tables: TablesAtVersions,
    expectations: Expectations,
    ranges: BTreeMap<PartitionId, OffsetRange>,
    future: FutureTimes,
    progress: Arc<Progress>,
    /// What the last run read to its end counted and dead-lettered.
    finished: std::sync::Mutex<Option<Tally>>,
    /// The error that ended the last run that failed (the sink sees it only as text).
    failure: std::sync::Mutex<Option<Error>>,
}

/// What one run of a [`StatelessRows`] read and produced.
#[derive(Default)]
struct Tally {
    rows_in: u64,
    rows_out: u64,
    dead_letters: Vec<DeadLetter>,
}

impl StatelessRows {
    /// Reads, runs and checks the next chunk: the rows to write (`None` once the range is read).
    async fn next_chunk(
        &self,
        chunks: &mut ChunkedRead,
        tally: &mut Tally,
    ) -> Result<Option<Vec<RecordBatch>>> {
        let Some((rows, letters)) = chunks.next(&self.source, &self.future).await? else {
            return Ok(None);
        };
        tally.rows_in += rows.num_rows() as u64;
        tally.dead_letters.extend(letters);
        let inputs = BTreeMap::from([(self.source.name.clone(), rows)]);
        let result = self
            .tables
            .execute_isolating(
                &mut *self.query.lock().await,
                &inputs,
                BatchWatermark::default(),
            )
            .await?;
        for failed in &result.failed {
            tally
                .dead_letters
                .push(dead_letter_from_row(&failed.row, &failed.error)?);
        }
        let checked = self.expectations.apply(result.batches)?;
        tally.dead_letters.extend(checked.quarantined);
        tally.rows_out += checked
            .kept
            .iter()
            .map(|b| b.num_rows() as u64)
            .sum::<u64>();
        // In the schema the stream declares: a difference is this error, not the writer's.
        let kept = checked
            .kept
            .into_iter()
            .map(|b| RecordBatch::try_new(Arc::clone(&self.schema), b.columns().to_vec()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Some(kept))
    }

    /// Rows read, rows written and dead letters of the last run read to its end.
    fn counts(&self) -> Option<(u64, u64, u64)> {
        let finished = self.finished.lock().ok()?;
        let tally = finished.as_ref()?;
        Some((
            tally.rows_in,
            tally.rows_out,
            tally.dead_letters.len() as u64,
        ))
    }

    fn take_failure(&self) -> Option<Error> {
        self.failure.lock().ok().and_then(|mut f| f.take())
    }
}

#[async_trait]
impl RecomputedRows for StatelessRows {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn output(self: Arc<Self>) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        let chunks = ChunkedRead::new(&self.ranges, &self.progress);
        let state = (self, chunks, Tally::default());
        let batches =
            futures::stream::try_unfold(state, |(this, mut chunks, mut tally)| async move {
                match this.next_chunk(&mut chunks, &mut tally).await {
                    Ok(Some(batches)) => Ok(Some((batches, (this, chunks, tally)))),
                    Ok(None) => {
                        if let Ok(mut finished) = this.finished.lock() {
                            *finished = Some(tally);
                        }
                        Ok(None)
                    }
                    Err(e) => {
                        let message = e.to_string();
                        if let Ok(mut failure) = this.failure.lock() {
                            *failure = Some(e);
                        }
                        Err(DataFusionError::Execution(message))
                    }
                }
            })
            .map_ok(|batches| futures::stream::iter(sliced_for_writer(batches).map(Ok)))
            .try_flatten();
        Box::pin(RecordBatchStreamAdapter::new(schema, batches))
    }

    async fn dead_letters(self: Arc<Self>) -> Result<Vec<RecordBatch>> {
        if self.counts().is_none() {
            // The output table already held the replacement: run once more for the letters.
            let mut output = Arc::clone(&self).output();
            while let Some(batch) = output.next().await {
                if let Err(e) = batch {
                    return Err(self.take_failure().unwrap_or(e.into()));
                }
            }
        }
        let finished = self
            .finished
            .lock()
            .map_err(|_| Error::InvalidJob("backfill: a recomputation panicked".into()))?;
        match finished.as_ref() {
            Some(tally) if !tally.dead_letters.is_empty() => Ok(vec![dead_letter_batch(
                &self.source.name,
                BatchId(0),
                &tally.dead_letters,
            )?]),
            _ => Ok(Vec::new()),
        }
    }
}

/// Rows handed to the sink's writer per batch: a chunk's rows go in slices of this many.
///
/// The writer reads a few batches ahead of what it has encoded (delta-rs queues up to ten
/// between its reader and its Parquet writer): in whole chunks that queue could hold most of a
/// backfill's range; in slices, the chunk being encoded and the one being read. (A slice is a
/// view, so it keeps its whole chunk's buffers until the last slice is encoded.)
const WRITE_SLICE_ROWS: usize = 8192;

/// `batches` cut into slices of at most [`WRITE_SLICE_ROWS`] rows (views, nothing copied).
fn sliced_for_writer(batches: Vec<RecordBatch>) -> impl Iterator<Item = RecordBatch> {
    batches
        .into_iter()
        .flat_map(|batch| crate::memory::slices(&batch, WRITE_SLICE_ROWS))
}

/// Takes the job's rewrite lease for a backfill, waiting while the live job compacts.
async fn rewrite_lease(checkpoint: &CheckpointStore, app_id: &str) -> Result<Lease> {
    let mut logged = false;
    loop {
        match Lease::acquire_in(
            checkpoint,
            REWRITE_LEASE_FOLDER,
            app_id,
            LeaseSettings::default(),
        )
        .await
        {
            Err(Error::LeaseHeld { holder, .. }) => {
                if !logged {
                    info!(%holder, "waiting for the running job to finish compacting (it holds the rewrite lease)");
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            other => return other,
        }
    }
}

/// Rows recomputed before the replacement (a windowed backfill's windows, emitted at the end
/// from their state), handed to the sink from memory.
struct ComputedRows {
    schema: SchemaRef,
    output: Vec<RecordBatch>,
    dead_letters: Vec<RecordBatch>,
}

#[async_trait]
impl RecomputedRows for ComputedRows {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    fn output(self: Arc<Self>) -> SendableRecordBatchStream {
        let batches = self.output.clone().into_iter().map(Ok);
        Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            futures::stream::iter(batches),
        ))
    }

    async fn dead_letters(self: Arc<Self>) -> Result<Vec<RecordBatch>> {
        Ok(self.dead_letters.clone())
    }
}

/// A range of one source read chunk by chunk, each chunk at most the source's per-batch budget
/// (as the stream reads it), so a long range never sits in memory at once.
/// Each read reports its pass's progress (offsets read of the pass's total) to the job's
/// [`Progress`], for the progress bar.
struct ChunkedRead {
    next: BTreeMap<PartitionId, Offset>,
    ends: BTreeMap<PartitionId, Offset>,
    progress: Arc<Progress>,
}

impl ChunkedRead {
    fn new(ranges: &BTreeMap<PartitionId, OffsetRange>, progress: &Arc<Progress>) -> Self {
        progress.bounded_run(ranges.values().map(|r| r.len() as i64).sum());
        ChunkedRead {
            next: ranges.iter().map(|(p, r)| (p.clone(), r.start)).collect(),
            ends: ranges.iter().map(|(p, r)| (p.clone(), r.end)).collect(),
            progress: Arc::clone(progress),
        }
    }

    /// The next chunk's rows and dead letters; `None` once the ranges are read.
    async fn next(
        &mut self,
        source: &OpenSource,
        future: &FutureTimes,
    ) -> Result<Option<(RecordBatch, Vec<DeadLetter>)>> {
        let chunk = plan_ranges(&self.next, &self.ends, source.source.max_per_batch());
        if chunk.values().all(OffsetRange::is_empty) {
            return Ok(None);
        }
        // What the last chunk's reading and processing freed goes back before the next read.
        crate::memory::release_free_memory();
        let read = read_source_as_opened(source, &chunk, future).await?;
        self.progress
            .advanced(chunk.values().map(|r| r.len() as i64).sum());
        for (p, r) in chunk {
            self.next.insert(p, r.end);
        }
        Ok(Some(read))
    }
}

/// The windows a windowed backfill replaces, and what it reads to recompute them.
struct CoveredWindows {
    replaced: ReplacedWindows,
    /// Late rows that missed one of the windows.
    late_rows: u64,
    /// Event-time span of the events those windows hold.
    span: (i64, i64),
    /// Every committed offset (the read is filtered to `span`).
    committed: BTreeMap<PartitionId, OffsetRange>,
}

/// The windows the range's events fall into, widened by the windows its late rows missed
/// alongside (so a late row is either counted by the recomputation everywhere, or nowhere);
/// with a live job, every one of them must be closed under its watermark — an open window is
/// the live job's to write.
#[allow(clippy::too_many_arguments)]
async fn covered_windows(
    source: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
    available: &BTreeMap<PartitionId, crate::source::AvailableRange>,
    future: &FutureTimes,
    window: &WindowUse,
    lateness: Lateness,
    live_watermark: Option<Option<i64>>,
    output_schema: &arrow::datatypes::SchemaRef,
    sink: &dyn Sink,
    progress: &Arc<Progress>,
) -> Result<CoveredWindows> {
    let column = [WINDOW_START, WINDOW_END]
        .into_iter()
        .find(|c| output_schema.index_of(c).is_ok())
        .ok_or_else(|| {
            Error::InvalidJob(
                "backfill replaces a windowed job's windows by window_start or window_end, and \
                 the output has neither; select one of them"
                    .into(),
            )
        })?;
    let mut starts: BTreeSet<i64> = BTreeSet::new();
    let mut chunks = ChunkedRead::new(ranges, progress);
    while let Some((rows, _)) = chunks.next(source, future).await? {
        let times = event_times(&rows, &window.time_column)?;
        starts.extend(times.iter().flat_map(|t| window.kind.starts(*t)));
    }
    // Every committed offset is read to recompute the windows; late rows past them (the live
    // job committed them since) are not counted by the recomputation and stay late.
    let committed: BTreeMap<PartitionId, OffsetRange> = available
        .iter()
        .map(|(p, a)| (p.clone(), OffsetRange::new(a.initial, a.latest)))
        .collect();
    // Late rows that missed a window in the set: all their missed windows join it.
    let mut missed_sets: Vec<Vec<i64>> = Vec::new();
    // Only the columns needed: the late table grows for as long as the job runs.
    let scan = TableScan {
        columns: Some(
            [WINDOWS_MISSED, SOURCE_PARTITION, SOURCE_OFFSET]
                .map(String::from)
                .to_vec(),
        ),
        filter: None,
    };
    for b in sink.read_late(&scan).await? {
        let Some(lists) = b
            .column_by_name(WINDOWS_MISSED)
            .and_then(|c| c.as_list_opt::<i32>())
        else {
            continue;
        };
        let partitions = table_column(&b, SOURCE_PARTITION, &DataType::Utf8, "late")?;
        let partitions = partitions.as_string::<i32>();
        let offsets = table_column(&b, SOURCE_OFFSET, &DataType::Int64, "late")?;
        let offsets = offsets.as_primitive::<Int64Type>();
        for i in 0..lists.len() {
            let read = committed
                .get(partitions.value(i))
                .is_some_and(|r| r.start <= offsets.value(i) && offsets.value(i) < r.end);
            if !read {
                continue;
            }
            let list = lists.value(i);
            let list = arrow::compute::kernels::cast::cast(&list, &DataType::Int64)?;
            missed_sets.push(list.as_primitive::<Int64Type>().values().to_vec());
        }
    }
    loop {
        let before = starts.len();
        for set in &missed_sets {
            if set.iter().any(|s| starts.contains(s)) {
                starts.extend(set.iter().copied());
            }
        }
        if starts.len() == before {
            break;
        }
    }
    if let Some(watermark) = live_watermark
        && let Some(open) = starts
            .iter()
            .find(|s| !watermark.is_some_and(|wm| lateness.is_closed(**s, wm)))
    {
        return Err(Error::InvalidJob(format!(
            "the range touches the window starting at {}, which the live job has not closed \
             yet (its watermark is {}): that window is the live job's to write; backfill an \
             earlier range, or wait",
            display_watermark(Some(*open)),
            display_watermark(watermark),
        )));
    }
    let late_rows = missed_sets
        .iter()
        .filter(|set| set.iter().any(|s| starts.contains(s)))
        .count() as u64;
    let size = window.kind.size();
    let span = match (starts.first(), starts.last()) {
        (Some(first), Some(last)) => (*first, last.saturating_add(size)),
        _ => (0, 0),
    };
    let values = starts
        .iter()
        .map(|s| if column == WINDOW_START { *s } else { s + size })
        .collect();
    Ok(CoveredWindows {
        replaced: ReplacedWindows {
            column: column.to_string(),
            values,
            starts: starts.into_iter().collect(),
            read: committed.clone(),
        },
        late_rows,
        span,
        committed,
    })
}

/// Event times (µs) of `rows`' column `column`.
fn event_times(rows: &RecordBatch, column: &str) -> Result<Vec<i64>> {
    let times = rows
        .column_by_name(column)
        .ok_or_else(|| Error::InvalidJob(format!("backfill: rows lack the column {column}")))?;
    let times = arrow::compute::kernels::cast::cast(times, &DataType::Int64)?;
    Ok(times.as_primitive::<Int64Type>().iter().flatten().collect())
}

/// Recomputes the covered windows in one bounded run over every committed event of their span
/// (watermark +∞ at the end: every window finished): their rows, checked against the
/// expectations, and the dead letters of the range's own offsets, for [`replace`]. The committed offsets are read chunk by chunk and only
/// the rows of the span are fed to the query, so memory holds the windows' state, not the
/// job's history.
#[allow(clippy::too_many_arguments)]
async fn recompute_windows(
    source: &OpenSource,
    mut query: StreamingQuery,
    tables: &TablesAtVersions,
    mut report: BackfillReport,
    windows: CoveredWindows,
    future: &FutureTimes,
    expectations: &Expectations,
    progress: &Arc<Progress>,
) -> Result<(BackfillReport, ReplacedWindows, ComputedRows)> {
    let in_range = |partition: &str, offset: i64| {
        report
            .spec
            .ranges
            .get(partition)
            .is_some_and(|r| r.start <= offset && offset < r.end)
    };
    let time = &source
        .event_time
        .as_ref()
        .ok_or_else(|| Error::in_source(&source.name, "a windowed job's source has event time"))?
        .column;
    let mut letters = Vec::new();
    let mut rows_in = 0;
    let mut chunks = ChunkedRead::new(&windows.committed, progress);
    while let Some((rows, chunk_letters)) = chunks.next(source, future).await? {
        letters.extend(
            chunk_letters
                .into_iter()
                .filter(|l| in_range(&l.partition, l.offset)),
        );
        let rows = rows_in_period(&rows, time, windows.span.0, windows.span.1)?;
        rows_in += rows.num_rows() as u64;
        let inputs = BTreeMap::from([(source.name.clone(), rows)]);
        let part = tables.feed_bounded(&mut query, &inputs, None).await?;
        for failed in &part.failed {
            let letter = dead_letter_from_row(&failed.row, &failed.error)?;
            if in_range(&letter.partition, letter.offset) {
                letters.push(letter);
            }
        }
    }
    report.rows_in = rows_in;
    let result = query.finish_bounded().await?;
    // Only the covered windows: a hopping window's rows also fall into neighbours.
    let wanted: BTreeSet<i64> = windows.replaced.values.iter().copied().collect();
    let mut output = Vec::new();
    for b in result.batches {
        let values = event_times(&b, &windows.replaced.column)?;
        let keep: arrow::array::BooleanArray =
            values.iter().map(|v| Some(wanted.contains(v))).collect();
        output.push(arrow::compute::filter_record_batch(&b, &keep)?);
    }
    let checked = expectations.apply(output)?;
    letters.extend(checked.quarantined);
    report.rows_out = checked.kept.iter().map(|b| b.num_rows() as u64).sum();
    report.rows_dead_lettered = letters.len() as u64;
    let dead_letters = if letters.is_empty() {
        vec![]
    } else {
        vec![dead_letter_batch(&source.name, BatchId(0), &letters)?]
    };
    let rows = ComputedRows {
        schema: query.output_schema(),
        output: checked.kept,
        dead_letters,
    };
    Ok((report, windows.replaced, rows))
}

/// `[from, to)` per partition from the two bounds, checked against what may be replaced:
/// `available[p].latest` is the live job's committed end (`live`) or the source's latest.
fn resolve_offsets(
    source: &str,
    available: &BTreeMap<PartitionId, crate::source::AvailableRange>,
    live: bool,
    from: &Bound,
    to: &Bound,
) -> Result<BTreeMap<PartitionId, OffsetRange>> {
    for bound in [from, to] {
        if let Bound::Offsets(named) = bound
            && let Some(unknown) = named.keys().find(|p| !available.contains_key(*p))
        {
            return Err(Error::in_source(
                source,
                format!(
                    "has no partition '{unknown}' (partitions: {})",
                    available.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
    // With only `earliest`/`latest`, every partition; otherwise the partitions named.
    let named = |b: &Bound, p: &PartitionId| match b {
        Bound::Offsets(m) => m.contains_key(p),
        _ => false,
    };
    let both_keywords = !matches!(from, Bound::Offsets(_)) && !matches!(to, Bound::Offsets(_));
    let mut ranges = BTreeMap::new();
    for (p, a) in available {
        if !(both_keywords || named(from, p) || named(to, p)) {
            continue;
        }
        let at = |b: &Bound, default: Offset| match b {
            Bound::Earliest => a.initial,
            Bound::Latest => a.latest,
            Bound::Offsets(m) => m.get(p).copied().unwrap_or(default),
        };
        let start = at(from, a.initial);
        let end = at(to, a.latest);
        if start > end {
            return Err(Error::in_source(
                source,
                format!("partition {p}: --from {start} is after --to {end}"),
            ));
        }
        if end > a.latest {
            let limit = if live {
                "what the live job has committed; it writes later offsets itself (backfill up \
                 to there, or wait for it)"
            } else {
                "the latest offset available"
            };
            return Err(Error::in_source(
                source,
                format!("partition {p}: --to {end} is beyond {limit}: {}", a.latest),
            ));
        }
        ranges.insert(p.clone(), OffsetRange::new(start, end));
    }
    Ok(ranges)
}

/// Per partition, the smallest range of offsets holding every row with event time in
/// `[from, to)`, found by reading `ranges` chunk by chunk (nothing is kept but the offsets).
async fn offsets_in_period(
    source: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
    future: &FutureTimes,
    column: &str,
    from: i64,
    to: i64,
    progress: &Arc<Progress>,
) -> Result<BTreeMap<PartitionId, OffsetRange>> {
    let missing = |c: &str| Error::InvalidJob(format!("backfill: rows lack the column {c}"));
    let mut found: BTreeMap<PartitionId, OffsetRange> = BTreeMap::new();
    let mut chunks = ChunkedRead::new(ranges, progress);
    while let Some((rows, _)) = chunks.next(source, future).await? {
        let rows = rows_in_period(&rows, column, from, to)?;
        let partitions = rows
            .column_by_name(SOURCE_PARTITION)
            .and_then(|c| c.as_string_opt::<i32>())
            .ok_or_else(|| missing(SOURCE_PARTITION))?;
        let offsets = rows
            .column_by_name(SOURCE_OFFSET)
            .and_then(|c| c.as_primitive_opt::<Int64Type>())
            .ok_or_else(|| missing(SOURCE_OFFSET))?;
        for (p, o) in partitions.iter().zip(offsets.iter()) {
            let (Some(p), Some(o)) = (p, o) else { continue };
            let r = found
                .entry(p.to_string())
                .or_insert(OffsetRange::new(o, o + 1));
            r.start = r.start.min(o);
            r.end = r.end.max(o + 1);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::AvailableRange;

    #[test]
    fn bounds_parse_and_name_bad_input() {
        assert_eq!("earliest".parse::<Bound>().unwrap(), Bound::Earliest);
        assert_eq!(
            "0:120, 1:95".parse::<Bound>().unwrap(),
            Bound::Offsets(BTreeMap::from([("0".into(), 120), ("1".into(), 95)]))
        );
        assert_eq!(
            "clicks:3:7".parse::<Bound>().unwrap(),
            Bound::Offsets(BTreeMap::from([("clicks:3".into(), 7)]))
        );
        let e = "0:x".parse::<Bound>().unwrap_err().to_string();
        assert!(e.contains("'0:x' is not partition:offset"), "{e}");
    }

    /// Every corpus line, and arbitrary text: parsed or refused with a message, never a panic;
    /// what parses names only non-negative offsets and prints back to the same bound.
    fn exercise(text: &str) {
        if let Ok(Bound::Offsets(offsets)) = text.parse::<Bound>() {
            assert!(offsets.values().all(|o| *o >= 0));
            let again: String = offsets
                .iter()
                .map(|(p, o)| format!("{p}:{o}"))
                .collect::<Vec<_>>()
                .join(",");
            assert_eq!(again.parse::<Bound>().unwrap(), Bound::Offsets(offsets));
        }
    }

    #[test]
    fn fuzz_corpus_offset_ranges_parse_without_panics() {
        let path = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("../fuzz/corpus/offset_ranges/ranges.txt");
        for line in std::fs::read_to_string(path).unwrap().lines() {
            exercise(line);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(512))]
        #[test]
        fn fuzz_arbitrary_offset_ranges_parse_without_panics(
            text in proptest::prelude::any::<String>(),
            pairs in "([a-z0-9:]{0,6}:-?[0-9]{0,22},?){0,5}",
        ) {
            exercise(&text);
            exercise(&pairs);
        }
    }

    #[test]
    fn ranges_resolve_against_what_the_source_holds() {
        let available = BTreeMap::from([
            (
                "0".to_string(),
                AvailableRange {
                    initial: 0,
                    latest: 100,
                },
            ),
            (
                "1".to_string(),
                AvailableRange {
                    initial: 5,
                    latest: 50,
                },
            ),
        ]);
        let all =
            resolve_offsets("s", &available, false, &Bound::Earliest, &Bound::Latest).unwrap();
        assert_eq!(all["0"], OffsetRange::new(0, 100));
        assert_eq!(all["1"], OffsetRange::new(5, 50));
        let from: Bound = "1:10".parse().unwrap();
        let one = resolve_offsets("s", &available, false, &from, &Bound::Latest).unwrap();
        assert_eq!(
            one,
            BTreeMap::from([("1".to_string(), OffsetRange::new(10, 50))])
        );
        let to: Bound = "0:200".parse().unwrap();
        let e = resolve_offsets("s", &available, false, &Bound::Earliest, &to)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--to 200 is beyond the latest offset available: 100"),
            "{e}"
        );
        let e = resolve_offsets("s", &available, true, &Bound::Earliest, &to)
            .unwrap_err()
            .to_string();
        assert!(e.contains("beyond what the live job has committed"), "{e}");
        let unknown: Bound = "7:0".parse().unwrap();
        assert!(resolve_offsets("s", &available, false, &unknown, &Bound::Latest).is_err());
    }
}
