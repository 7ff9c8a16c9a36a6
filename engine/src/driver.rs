//! The driver loop: one micro-batch from source offsets to one Delta commit.
//!
//! ```text
//!  trigger fires ─► plan ─► intent ─► read ─► time ─► watermark ─► execute ─► manifest ─► commit ─► purge
//!                   │       │         │       │       │            │          │            │          │
//!                   │       │         │       │       │            │          │            │          └ old batch folders,
//!                   │       │         │       │       │            │          │            │            old state files
//!                   │       │         │       │       │            │          │            └ side tables, then ONE output
//!                   │       │         │       │       │            │          │              commit with txn(job, batch)
//!                   │       │         │       │       │            │          └ state files, then end offsets,
//!                   │       │         │       │       │            │            watermark, state file list
//!                   │       │         │       │       │            └ DataFusion; failing rows → dead letters;
//!                   │       │         │       │       │              windowed: merge open windows into state,
//!                   │       │         │       │       │              emit the windows the new watermark closes
//!                   │       │         │       │       └ min over non-idle partitions of
//!                   │       │         │       │         (newest event time − max_out_of_orderness)
//!                   │       │         │       └ parse event time (unparsable → dead letters); rows of windows
//!                   │       │         │         closed under the watermark in force → late rows
//!                   │       │         └ Source::read per partition range; undecodable → dead letters
//!                   │       └ ranges and idle partitions fixed put-if-absent: a rerun is the same
//!                   └ [committed end, min(latest, committed end + budget)) per partition
//! ```
//!
//! `Pipeline::run_front` (plan to emit) and `Pipeline::run_back` (manifest to compaction) are
//! those steps, one short method each, in that order. From the manifest on, the next batch's
//! ranges are read ahead (`Pipeline::start_read_ahead`): only the sources' reads, used by the
//! next batch for exactly the ranges its intent then gives. When batches run back to back
//! (`available-now`), the next batch is also planned and executed while this one commits
//! (`Pipeline::commit_overlapped`) — in memory only: its intent is written after this commit
//! lands (`Pipeline::confirm`), so every write of a batch keeps its place in the protocol
//! (listing the sources may record the order of new files meanwhile, append-only, as any plan
//! does).
//!
//! **Restart.** The output table is the source of truth: its `txn` version for the job is the
//! last committed batch `V`; `batches/V/manifest.json` (written before commit `V`, live with it)
//! gives the end offsets, the watermark and the state files. If `batches/V+1/intent.json`
//! exists, batch `V+1` is rerun with exactly those ranges, idle set and planning clock; the sink
//! skips side tables that already hold `txn(job, V+1)`. Whatever step a crash interrupts, the
//! rerun produces the same rows and commits them once.
//!
//! **One instance.** A run first takes the job's lease ([`crate::lease`]): a second `sluice
//! run` of a live job stops with an error, one that finds a killed run's lease waits for it to
//! expire. A run that lost its lease, or finds its batch committed by someone else, stops
//! without writing further — and everything it might write before noticing is put-if-absent or
//! named by its lease epoch, so it cannot corrupt the checkpoint of the run that took over.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{AsArray, RecordBatch};
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use futures::future::try_join_all;
use tokio::sync::watch;
use tracing::{debug, info, warn};
use url::Url;

use crate::checkpoint::{
    BatchCounters, BatchIntent, BatchManifest, CheckpointStore, SkippedOffsets,
};
use crate::dead_letter::{dead_letter_batch, dead_letter_from_row};
use crate::error::{Error, Result};
use crate::expectations::{Expectations, QUARANTINE_SOURCE};
use crate::fault::{crash_point, pause_point};
use crate::input::{
    FutureTimes, NOT_READ_WHOLE, OpenSource, ReadsAhead, conform, make_whole, narrow_reads,
    open_sources_and_query, plan_query, read_source, whole_rows,
};
use crate::job::{DEAD_LETTER_BREAKER_MIN, Job, Trigger};
use crate::lease::{Lease, LeaseSettings, REWRITE_LEASE_FOLDER};
use crate::offsets::{
    BatchId, OffsetRange, PartitionId, SourceOffsets, SourceRanges, display_offsets,
    display_ranges, next_ranges, ranges_to_read, start_offsets,
};
use crate::operators::state_store::StateLog;
use crate::progress::{CommittedBatch, Progress};
use crate::query::{BatchWatermark, FailedRow, Query, QuerySettings, SourceInputs, StreamingQuery};
use crate::sink::{BatchCommit, CommitOutcome, Compaction, Sink};
use crate::source::SchemaInference;
use crate::source::{DeadLetter, SourceRead};
use crate::static_table::{StaticTables, VersionLog};
use crate::watermark::{
    SourcePartition, Watermark, WatermarkRules, display_watermark, max_event_time_by_partition,
};

/// What a run did, for the final summary line.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    /// Batches committed by this run.
    pub batches_committed: u64,
    /// The last batch committed for the job (by this or an earlier run).
    pub last_batch: Option<BatchId>,
    /// Rows read from sources.
    pub rows_in: u64,
    /// Rows written to the output.
    pub rows_out: u64,
    /// Rows written to the dead-letter table.
    pub rows_dead_lettered: u64,
    /// Rows written to the late table.
    pub rows_late: u64,
    /// Where the output went.
    pub location: Option<Url>,
    /// Each batch this run committed, in order: for benchmarks and progress reports.
    pub batches: Vec<BatchStats>,
}

/// What one committed batch took and left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// The batch's own wall time, ms: planning to compaction, less any wait for the batch
    /// before it to commit (batches back to back overlap).
    pub millis: u64,
    /// Rows read.
    pub rows_in: u64,
    /// Rows written to the output.
    pub rows_out: u64,
    /// State rows after the batch (0 for a stateless job).
    pub state_rows: u64,
    /// State bytes in memory after the batch.
    pub state_bytes: u64,
    /// Bytes of the rows read, as decoded Arrow (what the batch holds in memory at least once).
    pub input_bytes: u64,
}

/// What `sluice validate` prints: the source schemas and the optimised plan.
#[derive(Debug, Clone)]
pub struct Validation {
    /// Each source's schema as the query sees it.
    pub sources: Vec<(String, SchemaRef)>,
    /// How the schemas that were not declared were inferred, by source.
    pub inferred: Vec<(String, SchemaInference)>,
    /// Each static table's schema, by name.
    pub tables: BTreeMap<String, SchemaRef>,
    /// The output schema.
    pub output: SchemaRef,
    /// The optimised logical plan.
    pub plan: String,
    /// The stateful operators, in chain order (empty: a stateless query).
    pub operators: Vec<crate::operators::OperatorDescription>,
}

impl Job {
    /// Runs the job with its trigger until done (once, available-now) or forever (interval).
    pub async fn run(self) -> Result<RunSummary> {
        self.run_until(std::future::pending()).await
    }

    /// Runs the job until `shutdown` completes; the batch in flight finishes first.
    pub async fn run_until<F>(self, shutdown: F) -> Result<RunSummary>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (stop_tx, stop_rx) = watch::channel(false);
        let watcher = tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let trigger = self.trigger;
        let progress = Arc::clone(&self.progress);
        let result = async {
            let mut pipeline = Pipeline::open(self).await?;
            pipeline.progress.alive();
            let driven = pipeline.drive(trigger, stop_rx).await;
            // A read ahead of a batch that will not run is aborted (its CPU work on the rayon
            // pool may finish after the release; reads write nothing).
            pipeline.read_ahead = None;
            // Released whether the run ended well or not, so the next run starts at once.
            if let Err(error) = pipeline.lease.release().await {
                warn!(%error, "could not release the job's lease; the next run waits for it to expire");
            }
            driven.map(|()| pipeline.summary)
        }
        .await;
        watcher.abort();
        if let Err(error) = &result {
            progress.failed(&error.to_string());
        }
        result
    }

    /// Opens the sources and plans the query without writing anything.
    pub async fn validate(mut self) -> Result<Validation> {
        let OpenedJob {
            settings,
            sources,
            tables,
            query,
            ..
        } = open_job(&mut self, true).await?;
        Expectations::plan(
            &self.expectations,
            &query.output_schema(),
            &settings.functions,
        )?;
        Ok(Validation {
            sources: sources
                .iter()
                .map(|s| (s.name.clone(), Arc::clone(&s.schema)))
                .collect(),
            inferred: sources
                .iter()
                .filter_map(|s| Some((s.name.clone(), s.source.schema_inference()?)))
                .collect(),
            tables: tables.schemas().clone(),
            output: query.output_schema(),
            plan: query.display_plan()?,
            operators: query.operators(),
        })
    }
}

pub(crate) fn checkpoint_location(job: &Job) -> Result<CheckpointStore> {
    let url = match &job.checkpoint {
        Some(url) => url.clone(),
        None => {
            let mut url = job.sink.location().clone();
            let location = url.to_string();
            url.path_segments_mut()
                .map_err(|_| {
                    Error::InvalidJob(format!("sink location {location} cannot hold a checkpoint"))
                })?
                .pop_if_empty()
                .push("_sluice")
                .push(&job.id);
            url
        }
    };
    let options = job
        .checkpoint_storage
        .clone()
        .unwrap_or_else(|| job.sink.storage_options());
    CheckpointStore::open_with(&url, &options)
}

/// How a job's query is planned: its lineage and lateness settings and its sources' event-time
/// columns.
pub(crate) fn query_settings(job: &Job) -> QuerySettings {
    QuerySettings {
        lineage: job.lineage,
        allowed_lateness: job.allowed_lateness,
        output_mode: job.output_mode,
        key: job.key.clone(),
        state_ttl: job.state_ttl,
        functions: job.functions.clone(),
        static_tables: BTreeMap::new(),
        event_time: job
            .sources
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.event_time.as_ref()?.column.clone())))
            .collect(),
    }
}

/// A job's checkpoint, sources, static tables and planned query, opened: what a run, a
/// validation, a backfill and a reconcile all start from. Takes the sources and tables out of
/// `job`.
pub(crate) struct OpenedJob {
    pub(crate) checkpoint: CheckpointStore,
    /// How the query was planned (static tables' schemas included), for planning it again.
    pub(crate) settings: QuerySettings,
    pub(crate) sources: Vec<OpenSource>,
    pub(crate) tables: StaticTables,
    pub(crate) query: StreamingQuery,
}

/// Opens `job`'s inputs and plans its query; `validating`: nothing is written.
pub(crate) async fn open_job(job: &mut Job, validating: bool) -> Result<OpenedJob> {
    let checkpoint = checkpoint_location(job)?;
    let mut settings = query_settings(job);
    let (sources, tables, query) = open_sources_and_query(
        std::mem::take(&mut job.sources),
        std::mem::take(&mut job.tables),
        &job.query,
        &mut settings,
        &checkpoint,
        validating,
    )
    .await?;
    Ok(OpenedJob {
        checkpoint,
        settings,
        sources,
        tables,
        query,
    })
}

/// A job with its sources, query, sink, checkpoint and lease open, positioned after its last
/// commit.
struct Pipeline {
    job_id: String,
    sources: Vec<OpenSource>,
    /// Tables the query joins whole, at the version each batch's intent records.
    tables: StaticTables,
    /// The job's query and how it is planned: planned again when a source's schema grows.
    query_definition: Query,
    settings: QuerySettings,
    query: StreamingQuery,
    /// Shared with the commit task of a batch whose successor runs meanwhile
    /// ([`Pipeline::commit_overlapped`]).
    sink: Arc<dyn Sink>,
    checkpoint: CheckpointStore,
    lease: Lease,
    keep_batches: u32,
    /// Data-quality checks on the output rows.
    expectations: Expectations,
    /// The dead-letter circuit breaker's share.
    max_dead_letter_fraction: f64,
    /// The next batch to run.
    next_batch: BatchId,
    /// End offsets of the last committed batch.
    committed: SourceOffsets,
    /// The latest offsets the sources reported when the pending batch was planned, for its lag.
    latest_at_plan: SourceOffsets,
    /// Watermark rules of the sources with event time.
    rules: BTreeMap<String, WatermarkRules>,
    /// The event-time watermark as of the last committed batch.
    watermark: Watermark,
    /// Partitions behind their committed end offset (already reported), by that end.
    behind: SourceOffsets,
    summary: RunSummary,
    /// What the operator sees of the run (metrics, status page).
    progress: Arc<Progress>,
    /// Whether the trigger runs batches one after another (not `once`): the next batch's reads
    /// may then start while this one commits ([`Pipeline::start_read_ahead`]).
    reads_ahead: bool,
    /// The next batch's reads, started while the last batch committed.
    read_ahead: Option<ReadAhead>,
    /// The read ahead's reads, done, when a batch executed ahead could not use them all
    /// ([`Pipeline::run_next`]): the next batch takes those of its ranges.
    reads_done: Option<BTreeMap<String, ReadsAhead>>,
}

/// A read ahead is started only when what the batch commits (output, dead letters, late rows)
/// is at most this share of its input, in Arrow bytes: the next batch's rows then sit beside a
/// small output, not a second batch's worth (reasoned, not measured with the Nexmark runner;
/// the state snapshot written meanwhile and a compaction's buffers are not counted). A job
/// whose output is as large as its input (a passthrough) is not read ahead: the next rows
/// beside its output raised the peak by a third in an earlier experiment.
const READ_AHEAD_MAX_OUTPUT_SHARE: f64 = 0.25;

/// What a batch commits below this many Arrow bytes never keeps the next batch from being
/// read ahead, whatever its share of the input: next to it, the next rows cannot add much.
const READ_AHEAD_SMALL_OUTPUT_BYTES: usize = 8 * 1024 * 1024;

/// A batch reading less than this many Arrow bytes commits without the next batch executing
/// meanwhile ([`Pipeline::commit_overlapped`]): its commit takes a few milliseconds, and
/// overlapping it only makes two batches' steps share the cores — one small file (100 events)
/// a batch of a windowed job took the same wall time either way, while each batch's own time
/// rose from 11.0 to 14.6 ms (p50). `SLUICE_OVERLAP_MIN_INPUT_BYTES` overrides it (the
/// crash tests overlap their small batches).
const OVERLAP_MIN_INPUT_BYTES: u64 = 1024 * 1024;

/// [`OVERLAP_MIN_INPUT_BYTES`], or `SLUICE_OVERLAP_MIN_INPUT_BYTES` if set to a number.
fn overlap_min_input_bytes() -> u64 {
    static BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("SLUICE_OVERLAP_MIN_INPUT_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(OVERLAP_MIN_INPUT_BYTES)
    })
}

/// The next batch's source reads, each on a task of its own, running while the current batch
/// writes its manifest, commits, purges and compacts ([`Pipeline::start_read_ahead`]).
struct ReadAhead {
    reads: Vec<RangeReadAhead>,
}

/// One partition's range read ahead. Aborted if dropped unused.
struct RangeReadAhead {
    source: String,
    partition: PartitionId,
    range: OffsetRange,
    /// `None`: the source declined (the read would have grown its schema).
    task: tokio::task::JoinHandle<Result<Option<SourceRead>>>,
}

impl Drop for RangeReadAhead {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ReadAhead {
    /// Whether it reads exactly every range `intent` gives a partition (empty ones aside).
    fn covers(&self, intent: &SourceRanges) -> bool {
        ranges_to_read(intent).all(|(source, p, r)| {
            self.reads
                .iter()
                .any(|read| &read.source == source && &read.partition == p && &read.range == r)
        })
    }

    /// By source, the reads of exactly the ranges `intent` gives their partitions, once each
    /// is done; the others are aborted unwaited. A failed read is left out: the batch reads the
    /// range itself and reports the error.
    async fn finish(self, intent: &SourceRanges) -> BTreeMap<String, ReadsAhead> {
        let mut ahead: BTreeMap<String, ReadsAhead> = BTreeMap::new();
        for mut read in self.reads {
            let wanted = intent
                .get(&read.source)
                .and_then(|i| i.get(&read.partition));
            if wanted != Some(&read.range) {
                debug!(source = %read.source, partition = %read.partition, range = %read.range, "a range read ahead is not the next batch's");
                continue;
            }
            match (&mut read.task).await {
                Ok(Ok(Some(done))) => {
                    let at = ahead.entry(read.source.clone()).or_default();
                    at.insert(read.partition.clone(), (read.range, done));
                }
                Ok(Ok(None)) => {
                    debug!(source = %read.source, partition = %read.partition, range = %read.range, "the source declined to read this range ahead (its records bring fields the schema lacks, or its reads may grow the schema); the batch reads it itself");
                }
                Ok(Err(_)) => {}
                Err(error) => {
                    warn!(%error, source = %read.source, "a read ahead failed; the batch reads its range itself");
                }
            }
        }
        ahead
    }
}

/// A batch through step 7: its rows to commit and the watermark after it.
struct Executed {
    batch: Batch,
    output: Vec<RecordBatch>,
    watermark: Watermark,
    /// When step 7 ended: a batch executed while the one before it committed then waits for
    /// that commit ([`Pipeline::confirm`]).
    at: Instant,
}

/// One batch on its way through the steps: its intent, what it has produced so far, and how
/// long each step took.
struct Batch {
    intent: BatchIntent,
    started: Instant,
    /// The clock event times are judged against: the intent's planning time.
    clock: i64,
    /// End offsets of every partition after this batch.
    end_offsets: SourceOffsets,
    /// Per source and partition, the newest event time among the rows read.
    max_event_time: SourceOffsets,
    counters: BatchCounters,
    /// Rows read, per source.
    rows_in_by_source: BTreeMap<String, u64>,
    /// Arrow bytes of the rows read.
    input_bytes: u64,
    dead_letters: Vec<RecordBatch>,
    late: Vec<RecordBatch>,
    /// What compaction rewrote after the commit.
    compaction: Compaction,
    /// Time in the batch's span that was not its own ([`Batch::took`]): executed while the
    /// batch before it committed, its wait for that commit; committing while the next batch
    /// executed, its wait for that batch's steps once its own commit had landed.
    waited: Duration,
    /// The sources whose schema this batch's read grew: not read ahead for the next batch
    /// (records that keep bringing new fields would have every read ahead declined, decoded
    /// for nothing).
    schema_grew: BTreeSet<String>,
    times: StepTimes,
}

/// Wall time of the steps of one batch.
#[derive(Debug, Default)]
struct StepTimes {
    plan: Duration,
    read: Duration,
    execute: Duration,
    checkpoint: Duration,
    commit: Duration,
    purge: Duration,
    compact: Duration,
}

impl Batch {
    fn new(intent: BatchIntent, committed: &SourceOffsets, started: Instant) -> Batch {
        let mut end_offsets = committed.clone();
        for (source, parts) in &intent.ranges {
            let ends = end_offsets.entry(source.clone()).or_default();
            for (p, r) in parts {
                ends.insert(p.clone(), r.end);
            }
        }
        let clock = intent
            .planned_at_micros
            .unwrap_or_else(|| chrono::Utc::now().timestamp_micros());
        Batch {
            intent,
            started,
            clock,
            end_offsets,
            max_event_time: SourceOffsets::new(),
            counters: BatchCounters::default(),
            rows_in_by_source: BTreeMap::new(),
            input_bytes: 0,
            dead_letters: Vec::new(),
            late: Vec::new(),
            compaction: Compaction::default(),
            waited: Duration::ZERO,
            schema_grew: BTreeSet::new(),
            times: StepTimes {
                plan: started.elapsed(),
                ..StepTimes::default()
            },
        }
    }

    fn id(&self) -> BatchId {
        self.intent.batch_id
    }

    /// The batch's own time so far, from its planning: its waits for the batches before and
    /// after it are left out ([`Batch::waited`]), so that a batch's time is what its steps took.
    fn took(&self) -> Duration {
        self.started.elapsed().saturating_sub(self.waited)
    }
}

impl Pipeline {
    /// Opens everything, takes the job's lease, and finds where the job stands from the output
    /// table.
    async fn open(mut job: Job) -> Result<Pipeline> {
        let OpenedJob {
            checkpoint,
            settings,
            mut sources,
            tables,
            query,
        } = open_job(&mut job, false).await?;
        let mut query = narrow_reads(query, &job.query, &settings, &mut sources).await?;
        let Job {
            id: job_id,
            query: query_definition,
            mut sink,
            keep_batches,
            expectations,
            max_dead_letter_fraction,
            progress,
            ..
        } = job;
        let expectations =
            Expectations::plan(&expectations, &query.output_schema(), &settings.functions)?;
        checkpoint.check_conditional_put().await?;
        let lease = Lease::acquire(&checkpoint, &job_id, LeaseSettings::default()).await?;
        if let Err(error) = Lease::release_abandoned_in(
            &checkpoint,
            REWRITE_LEASE_FOLDER,
            &job_id,
            LeaseSettings::default(),
        )
        .await
        {
            warn!(%error, "could not look at the rewrite lease; compaction waits for it to expire");
        }
        let position = match restore(
            &checkpoint,
            sink.as_mut(),
            &job_id,
            &mut query,
            lease.epoch(),
        )
        .await
        {
            Ok(position) => position,
            Err(e) => {
                // Released, so fixing what stopped it and starting again needs no wait.
                let _ = lease.release().await;
                return Err(e);
            }
        };
        let Position {
            last,
            next_batch,
            committed,
            watermark,
            behind,
        } = position;
        let rules = sources
            .iter()
            .filter_map(|s| {
                let time = s.event_time.as_ref()?;
                let rules = WatermarkRules {
                    max_out_of_orderness: time.max_out_of_orderness,
                    idle_timeout: time.idle_timeout,
                };
                Some((s.name.clone(), rules))
            })
            .collect();
        info!(job_id, last_committed = ?last.map(|b| b.0), checkpoint = %checkpoint.url(), lease_epoch = lease.epoch(), "job opened");
        let summary = RunSummary {
            last_batch: last,
            location: Some(sink.location().clone()),
            ..RunSummary::default()
        };
        Ok(Pipeline {
            job_id,
            sources,
            tables,
            query_definition,
            settings,
            query,
            sink: Arc::from(sink),
            checkpoint,
            lease,
            keep_batches,
            expectations,
            max_dead_letter_fraction,
            next_batch,
            committed,
            latest_at_plan: SourceOffsets::new(),
            rules,
            watermark,
            behind,
            summary,
            progress,
            reads_ahead: false,
            read_ahead: None,
            reads_done: None,
        })
    }

    /// The trigger loop.
    async fn drive(&mut self, trigger: Trigger, mut stop: watch::Receiver<bool>) -> Result<()> {
        self.reads_ahead = !matches!(trigger, Trigger::Once);
        match trigger {
            Trigger::Once => {
                self.plan_and_run(None).await?;
            }
            Trigger::AvailableNow => {
                let (target, to_read) = self.latest_offsets().await?;
                self.progress.bounded_run(to_read);
                // Batches run back to back: each may execute while the one before commits.
                let mut next = None;
                while !*stop.borrow() {
                    let executed = match next.take() {
                        Some(executed) => self.confirm(executed).await?,
                        None => {
                            let started = Instant::now();
                            let Some(intent) = self.plan(Some(&target)).await? else {
                                break;
                            };
                            self.run_front(intent, started).await?
                        }
                    };
                    next = self
                        .run_back(executed, Some(&target), Some(&mut stop))
                        .await?;
                }
            }
            Trigger::Interval(every) => {
                let mut ticker = tokio::time::interval(every);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = ticker.tick() => {}
                        _ = stop.changed() => {}
                    }
                    if *stop.borrow() {
                        break;
                    }
                    self.plan_and_run(None).await?;
                }
            }
        }
        Ok(())
    }

    /// The sources' latest offsets (an available-now run's target), and how many offsets lie
    /// between the committed ones and them.
    async fn latest_offsets(&self) -> Result<(SourceOffsets, i64)> {
        let mut latest = SourceOffsets::new();
        let mut to_read = 0;
        for s in &self.sources {
            let available = s.source.available().await?;
            let committed = self.committed.get(&s.name);
            for (p, a) in &available {
                let from = committed
                    .and_then(|c| c.get(p))
                    .copied()
                    .unwrap_or(a.initial);
                to_read += (a.latest - from).max(0);
            }
            latest.insert(
                s.name.clone(),
                available.into_iter().map(|(p, a)| (p, a.latest)).collect(),
            );
        }
        Ok((latest, to_read))
    }

    /// Plans the next batch (capped at `limit`) and runs it; `false` if there was nothing to
    /// read.
    async fn plan_and_run(&mut self, limit: Option<&SourceOffsets>) -> Result<bool> {
        let started = Instant::now();
        let Some(intent) = self.plan(limit).await? else {
            return Ok(false);
        };
        let executed = self.run_front(intent, started).await?;
        self.run_back(executed, limit, None).await?;
        Ok(true)
    }

    /// Step 1–2: the next batch's ranges — a pending intent if a crashed run left one, else
    /// planned afresh (capped at `limit`) and recorded put-if-absent. `None` if there is nothing
    /// to read.
    async fn plan(&mut self, limit: Option<&SourceOffsets>) -> Result<Option<BatchIntent>> {
        pause_point("before_plan", self.next_batch).await;
        // Checked against the store, not only the renewal's last look: a process that was
        // paused past the lease's timeout must not plan (and write) a batch.
        self.lease.verify().await?;
        self.latest_at_plan.clear();
        if let Some(intent) = self.checkpoint.read_intent(self.next_batch).await? {
            self.progress.alive();
            info!(batch_id = intent.batch_id.0, ranges = %display_ranges(&intent.ranges), "rerunning the intent of an uncommitted batch");
            return Ok(Some(intent));
        }
        let Some(intent) = self.next_intent(limit).await? else {
            return Ok(None);
        };
        let intent = self.checkpoint.write_intent(intent).await?;
        crash_point("after_intent", intent.batch_id);
        Ok(Some(intent))
    }

    /// The next batch's ranges, idle partitions, planning clock and table versions, from the
    /// job's position (capped at `limit`), not yet recorded; `None` if there is nothing to
    /// read.
    async fn next_intent(&mut self, limit: Option<&SourceOffsets>) -> Result<Option<BatchIntent>> {
        self.latest_at_plan.clear();
        let mut ranges = SourceRanges::new();
        let mut skipped = Vec::new();
        let mut starts = SourceOffsets::new();
        for s in &self.sources {
            let available = s.source.available().await?;
            let committed = self.committed.get(&s.name);
            let mut start = BTreeMap::new();
            let seen = self.latest_at_plan.entry(s.name.clone()).or_default();
            for (p, a) in available {
                seen.insert(p.clone(), a.latest);
                let end = committed.and_then(|c| c.get(&p)).copied();
                let reported = self.behind.get(&s.name).and_then(|b| b.get(&p)).copied();
                if let Some(end) = end
                    && a.latest < end
                    && reported != Some(end)
                {
                    // The log went backwards: stop (the source's error) or skip, once.
                    let reason = s.source.offsets_behind(&p, end, a.latest)?;
                    warn!(source = %s.name, partition = %p, latest = a.latest, committed_end = end, %reason, "a partition's log went backwards; its records below the committed end are skipped");
                    skipped.push(SkippedOffsets {
                        source: s.name.clone(),
                        partition: p.clone(),
                        latest: a.latest,
                        committed_end: end,
                        reason,
                    });
                }
                start.insert(p, end.unwrap_or(a.initial));
            }
            let cap = limit.and_then(|l| l.get(&s.name));
            let planned = next_ranges(&start, seen, cap, s.source.max_per_batch());
            starts.insert(s.name.clone(), start);
            ranges.insert(s.name.clone(), planned);
        }
        self.progress
            .planned(consumer_lag(&self.latest_at_plan, &starts));
        let planned = ranges.iter().flat_map(|(source, parts)| {
            parts
                .iter()
                .map(move |(p, r)| (source.as_str(), p, !r.is_empty()))
        });
        let idle = self
            .watermark
            .idle_partitions(&self.rules, planned, Instant::now());
        let nothing_to_read = ranges
            .values()
            .flat_map(|r| r.values())
            .all(OffsetRange::is_empty);
        // With nothing to read, a batch is still worth it when partitions going idle let the
        // watermark advance (windows close on it), or to record skipped offsets.
        if nothing_to_read && skipped.is_empty() {
            let mut after = self.watermark.clone();
            let moved = after.advance(
                &self.rules,
                &SourceOffsets::new(),
                &event_time_partitions(&self.rules, &self.committed),
                &idle,
            );
            if moved <= self.watermark.current() {
                return Ok(None);
            }
        }
        Ok(Some(BatchIntent {
            batch_id: self.next_batch,
            ranges,
            idle,
            planned_at_micros: Some(chrono::Utc::now().timestamp_micros()),
            skipped,
            table_versions: self.tables.latest_versions().await?,
        }))
    }

    /// Steps 3–7 for one batch, in order (`started`: when its planning began): everything up to
    /// its output, in memory. Writes nothing but a static table's snapshot and version log.
    async fn run_front(&mut self, intent: BatchIntent, started: Instant) -> Result<Executed> {
        let mut batch = Batch::new(intent, &self.committed, started);
        let inputs = self.read(&mut batch).await?;
        self.load_tables(&batch).await?;
        let watermark = self.next_watermark(&batch);
        let output = self.execute(&mut batch, inputs, &watermark).await?;
        self.check_dead_letters(&batch)?;
        let output = self.check_expectations(&mut batch, output)?;
        Ok(Executed {
            batch,
            output,
            watermark,
            at: Instant::now(),
        })
    }

    /// Steps 8–11 for an executed batch, in order: manifest, commit, purge, compaction; the
    /// job's position then stands after it (`limit`: an available-now run's target, for the
    /// next batch's read ahead).
    ///
    /// With `overlap` (batches back to back; the run's stop signal), the next batch may run
    /// its steps 1 and 3–7 while this one commits ([`Pipeline::commit_overlapped`]); it is
    /// returned, its intent not yet written ([`Pipeline::confirm`]), or the error that stopped
    /// it, once this batch is done.
    async fn run_back(
        &mut self,
        executed: Executed,
        limit: Option<&SourceOffsets>,
        overlap: Option<&mut watch::Receiver<bool>>,
    ) -> Result<Option<Executed>> {
        let Executed {
            mut batch,
            output,
            watermark,
            ..
        } = executed;
        self.read_ahead = self.start_read_ahead(&batch, &output, limit);
        let manifest = self.write_manifest(&mut batch, &watermark).await?;
        // Only beside a small output (what lets the next batch be read ahead: memory), for a
        // batch large enough to gain, and not with static tables (their loading writes a
        // version log entry for the batch, which must follow its intent).
        let overlap = overlap.filter(|_| {
            self.read_ahead.is_some()
                && batch.input_bytes >= overlap_min_input_bytes()
                && self.tables.names().is_empty()
        });
        let (outcome, next) = if let Some(stop) = overlap {
            self.commit_overlapped(&mut batch, output, &manifest, watermark, limit, stop)
                .await?
        } else {
            let outcome = self.commit(&mut batch, output, &manifest).await?;
            self.advance(&batch.intent, &manifest, watermark);
            (outcome, Ok(None))
        };
        self.purge(&mut batch).await?;
        self.compact(&mut batch).await?;
        self.finish(batch, manifest, outcome);
        next
    }

    /// Step 9 commit, with the next batch planned, read and executed meanwhile (the commit's
    /// Parquet encoding and the next batch's query then share the cores: a fifth to a third of
    /// a windowed or filtering batch's time was its commit). The job's position moves past
    /// this batch first, as its manifest gives it. Nothing of the next batch is written before
    /// this commit lands: its intent is recorded afterwards ([`Pipeline::confirm`]), so the
    /// order of writes a restart relies on is unchanged, and a commit that fails ends the run
    /// with the next batch only in memory. A stop signal abandons the next batch at once.
    /// Returns the commit's outcome and the next batch (`None`: none executed), or the error
    /// that stopped it.
    async fn commit_overlapped(
        &mut self,
        batch: &mut Batch,
        output: Vec<RecordBatch>,
        manifest: &BatchManifest,
        watermark: Watermark,
        limit: Option<&SourceOffsets>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(CommitOutcome, Result<Option<Executed>>)> {
        let commit = self.batch_commit(batch, output, manifest)?;
        let sink = Arc::clone(&self.sink);
        // A set, so that the commit is cancelled with the run (as an awaited one would be).
        let mut committing = tokio::task::JoinSet::new();
        committing.spawn(async move {
            let t = Instant::now();
            let outcome = sink.commit(commit).await;
            (outcome, t.elapsed(), Instant::now())
        });
        self.advance(&batch.intent, manifest, watermark);
        let stopped = async {
            // A closed channel never signals a stop.
            if stop.wait_for(|stopped| *stopped).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let next = tokio::select! {
            next = self.run_next(limit) => next,
            () = stopped => Ok(None),
        };
        let (outcome, took, landed) = match committing.join_next().await {
            Some(Ok(done)) => done,
            Some(Err(error)) => {
                return Err(Error::Sink(
                    format!("the commit of batch {} failed: {error}", batch.id().0).into(),
                ));
            }
            None => {
                return Err(Error::Sink(
                    format!("the commit of batch {} did not run", batch.id().0).into(),
                ));
            }
        };
        let outcome = self.committed(batch, outcome?, took)?;
        // Not this batch's time: the next one's steps, once this commit had landed.
        batch.waited += landed.elapsed();
        Ok((outcome, next))
    }

    /// Steps 1 and 3–7 of the batch after the one committing: planned from the job's position
    /// (capped at `limit`), read and executed, its intent not written. `None`: not executed —
    /// nothing to read, or not every range was read ahead.
    ///
    /// It reads only what was read ahead, which never grows a source's schema: a schema grows
    /// (recorded put-if-absent) in the read of the batch whose intent is written, so a crashed
    /// batch is read again with the schema it was first read with. A range not read ahead, or
    /// declined (its records bring new fields), leaves the batch to be planned and read once
    /// the commit has landed, taking the reads that were done.
    async fn run_next(&mut self, limit: Option<&SourceOffsets>) -> Result<Option<Executed>> {
        let started = Instant::now();
        let Some(intent) = self.next_intent(limit).await? else {
            return Ok(None);
        };
        let planned = started.elapsed();
        let Some(read_ahead) = self
            .read_ahead
            .take_if(|ahead| ahead.covers(&intent.ranges))
        else {
            return Ok(None);
        };
        let reading = Instant::now();
        let done = read_ahead.finish(&intent.ranges).await;
        let read_ahead_wait = reading.elapsed();
        let complete = ranges_to_read(&intent.ranges)
            .all(|(source, p, _)| done.get(source).is_some_and(|reads| reads.contains_key(p)));
        self.reads_done = Some(done);
        if !complete {
            return Ok(None);
        }
        let mut executed = self.run_front(intent, started).await?;
        // Step times as a batch planned after the commit would count them.
        executed.batch.times.plan = planned;
        executed.batch.times.read += read_ahead_wait;
        Ok(Some(executed))
    }

    /// Step 2 for a batch executed while the one before it committed, which has landed now:
    /// the plan's pause point and lease check, then its intent, put-if-absent. Another intent
    /// already there was written by another run of the job (this run's intents follow their
    /// batch's predecessor's commit): the batch executed here is not the one to commit, and the
    /// run stops.
    async fn confirm(&mut self, mut executed: Executed) -> Result<Executed> {
        let id = executed.batch.id();
        executed.batch.waited += executed.at.elapsed();
        let t = Instant::now();
        pause_point("before_plan", id).await;
        self.lease.verify().await?;
        let intent = self
            .checkpoint
            .write_intent(executed.batch.intent.clone())
            .await?;
        if intent != executed.batch.intent {
            return Err(Error::InvalidJob(format!(
                "another run of job '{}' wrote the intent of batch {} while this run executed \
                 it ahead: another instance runs the job; this run stops without writing the batch",
                self.job_id, id.0
            )));
        }
        crash_point("after_intent", id);
        executed.batch.times.plan += t.elapsed();
        debug!(
            batch_id = id.0,
            waited_ms = log_ms(executed.batch.waited),
            "executed while the batch before it committed"
        );
        Ok(executed)
    }

    /// Starts reading the ranges the next batch will read, to overlap this batch's manifest,
    /// commit, purge and compaction (a quarter of a filter or windowed job's batch was its
    /// commit, with a core idle). Only the sources' reads: the next intent is still written
    /// after this batch commits, and the next batch uses a read only for exactly the range its
    /// intent gives that partition ([`read_source`]) — a read of a range is the same whenever
    /// it is made, so nothing about a batch depends on whether it was read ahead. The ranges
    /// are what the next plan gives if the sources report the latest offsets this batch's plan
    /// saw ([`next_ranges`]): a partition the run has caught up with is not read ahead, and a
    /// guess the next plan contradicts costs only its read.
    ///
    /// Not started for a `once` trigger, nor when what this batch commits (output, dead
    /// letters, late rows) is more than [`READ_AHEAD_MAX_OUTPUT_SHARE`] of its input and more
    /// than [`READ_AHEAD_SMALL_OUTPUT_BYTES`] (memory). A read ahead never grows a source's
    /// schema ([`crate::source::Source::read_ahead`]): a range whose records bring new fields
    /// is read by its batch, which records them; a source whose schema this batch grew is not
    /// read ahead.
    fn start_read_ahead(
        &self,
        batch: &Batch,
        output: &[RecordBatch],
        limit: Option<&SourceOffsets>,
    ) -> Option<ReadAhead> {
        if !self.reads_ahead {
            return None;
        }
        let committed_bytes: usize = output
            .iter()
            .chain(&batch.dead_letters)
            .chain(&batch.late)
            .map(crate::memory::batch_bytes)
            .sum();
        if committed_bytes > READ_AHEAD_SMALL_OUTPUT_BYTES
            && committed_bytes as f64 > batch.input_bytes as f64 * READ_AHEAD_MAX_OUTPUT_SHARE
        {
            return None;
        }
        let mut reads = Vec::new();
        for s in self
            .sources
            .iter()
            .filter(|s| !batch.schema_grew.contains(&s.name))
        {
            let (Some(ends), Some(latest)) = (
                batch.end_offsets.get(&s.name),
                self.latest_at_plan.get(&s.name),
            ) else {
                continue;
            };
            let cap = limit.and_then(|l| l.get(&s.name));
            let ranges = next_ranges(ends, latest, cap, s.source.max_per_batch());
            for (partition, range) in ranges.into_iter().filter(|(_, r)| !r.is_empty()) {
                let (source, columns) = (Arc::clone(&s.source), s.read_columns.clone());
                let (at, positions) = (partition.clone(), s.positions);
                let task = tokio::spawn(async move {
                    let columns = columns.as_deref();
                    source.read_ahead(&at, range, columns, positions).await
                });
                reads.push(RangeReadAhead {
                    source: s.name.clone(),
                    partition,
                    range,
                    task,
                });
            }
        }
        (!reads.is_empty()).then_some(ReadAhead { reads })
    }

    /// Steps 3 read + 4 time: each source's rows as its read produced them (several Arrow
    /// batches, in partition and offset order, never copied into one); undecodable rows and
    /// rows without a usable event time to dead letters; rows of windows the watermark in force
    /// has closed to the late table (they still count in their open windows; the query leaves
    /// the closed ones out).
    async fn read(&mut self, batch: &mut Batch) -> Result<SourceInputs> {
        let t = Instant::now();
        let future = FutureTimes::Clock(batch.clock);
        let mut inputs = BTreeMap::new();
        let mut grown = Vec::new();
        // Every source and partition is read at once (their decoding runs on the rayon pool);
        // the rows are then taken in source order, as before.
        let empty = BTreeMap::new();
        let mut ahead = match (self.reads_done.take(), self.read_ahead.take()) {
            (Some(done), _) => done,
            (None, Some(read_ahead)) => read_ahead.finish(&batch.intent.ranges).await,
            (None, None) => BTreeMap::new(),
        };
        let reads = try_join_all(self.sources.iter().map(|s| {
            let ranges = batch.intent.ranges.get(&s.name).unwrap_or(&empty);
            read_source(
                s,
                ranges,
                &future,
                ahead.remove(&s.name).unwrap_or_default(),
            )
        }))
        .await?;
        for (index, (s, read)) in self.sources.iter().zip(reads).enumerate() {
            if let Some(schema) = read.grown {
                batch.schema_grew.insert(s.name.clone());
                grown.push((index, schema));
            }
            let (rows, letters) = (read.rows, read.dead_letters);
            if let Some(time) = &s.event_time {
                let maxima = batch.max_event_time.entry(s.name.clone()).or_default();
                for chunk in &rows {
                    max_event_time_by_partition(chunk, &time.column, maxima)?;
                }
            }
            // Narrowed reads: the late rows' source columns, to be read again whole.
            let mut late_narrow = Vec::new();
            for chunk in &rows {
                let late =
                    self.query
                        .late_rows(&s.name, chunk, self.watermark.current(), batch.id())?;
                if let Some(late) = late {
                    batch.counters.rows_late += late.num_rows() as u64;
                    match s.read_columns {
                        Some(_) => late_narrow
                            .push(late.project(&(0..chunk.num_columns()).collect::<Vec<_>>())?),
                        None => batch.late.push(late),
                    }
                }
            }
            let mut letters = letters;
            if let Some(first) = late_narrow.first() {
                let narrow = concat_batches(&first.schema(), &late_narrow)?;
                let narrow = s.with_position_text(&narrow).await?;
                let whole = whole_rows(s, &narrow, true).await?;
                let mut found = Vec::with_capacity(whole.len());
                for (i, whole) in whole.into_iter().enumerate() {
                    match whole {
                        Some(row) => found.push(row),
                        // The late table's columns may be NOT NULL: a dead letter instead.
                        None => {
                            batch.counters.rows_late -= 1;
                            let reason = format!(
                                "late: its window had closed under the watermark; {NOT_READ_WHOLE}"
                            );
                            letters.push(dead_letter_from_row(&narrow.slice(i, 1), &reason)?);
                        }
                    }
                }
                if let Some(first) = found.first() {
                    let whole = concat_batches(&first.schema(), &found)?;
                    let late = self.query.late_rows(
                        &s.name,
                        &whole,
                        self.watermark.current(),
                        batch.id(),
                    )?;
                    batch.late.extend(late);
                }
            }
            for skip in batch.intent.skipped.iter().filter(|k| k.source == s.name) {
                letters.push(DeadLetter {
                    partition: skip.partition.clone(),
                    offset: skip.latest,
                    position: format!("{}@{}", skip.partition, skip.latest),
                    raw: Vec::new(),
                    error: skip.reason.clone(),
                });
            }
            let read_rows: usize = rows.iter().map(RecordBatch::num_rows).sum();
            batch.counters.rows_in += read_rows as u64;
            batch.input_bytes += rows
                .iter()
                .map(|chunk| crate::memory::batch_bytes(chunk) as u64)
                .sum::<u64>();
            batch
                .rows_in_by_source
                .insert(s.name.clone(), read_rows as u64);
            batch.counters.rows_dead_lettered += letters.len() as u64;
            if !letters.is_empty() {
                batch
                    .dead_letters
                    .push(dead_letter_batch(&s.name, batch.id(), &letters)?);
            }
            inputs.insert(s.name.clone(), rows);
        }
        if !grown.is_empty() {
            self.schemas_grew(grown).await?;
        }
        // The late table learns the window source's columns with every batch, so columns
        // schema evolution added join it in this batch's commit even without late rows.
        if let Some(source) = self.query.late_source()
            && let Some(s) = self.sources.iter().find(|s| s.name == source)
        {
            batch
                .late
                .push(RecordBatch::new_empty(self.query.late_schema_of(&s.schema)));
        }
        for s in &self.sources {
            for chunk in inputs.get_mut(&s.name).into_iter().flatten() {
                if chunk.schema() != s.planned {
                    // Read again whole (in text) when the schema grew: the query planned again
                    // may read positions as numbers.
                    let numbered = s.with_position_numbers(chunk).await?;
                    *chunk =
                        conform(&numbered, &s.planned).map_err(|e| Error::in_source(&s.name, e))?;
                }
            }
        }
        batch.times.read = t.elapsed();
        self.progress.alive();
        Ok(inputs)
    }

    /// Schema evolution added columns to sources during this batch's read: a stateless query
    /// is planned again over the grown schemas (so `SELECT *` carries the new columns from this
    /// batch on); a stateful one keeps its plan and state, and its input is conformed to the
    /// schemas it was planned over (the next run plans with the new columns). The late table
    /// takes the late rows as read, new columns included; the sink adds them to the tables in
    /// this batch's commit.
    async fn schemas_grew(&mut self, grown: Vec<(usize, SchemaRef)>) -> Result<()> {
        for (index, schema) in grown {
            let s = &mut self.sources[index];
            let added: Vec<String> = schema
                .fields()
                .iter()
                .filter(|f| s.schema.field_with_name(f.name()).ok() != Some(f.as_ref()))
                .map(|f| format!("{} {}", f.name(), f.data_type()))
                .collect();
            info!(source = %s.name, columns = %added.join(", "), replanned = !self.query.is_stateful(), "source schema grew");
            s.schema = schema;
        }
        if self.query.is_stateful() {
            return Ok(());
        }
        let schemas: Vec<(String, SchemaRef)> = self
            .sources
            .iter()
            .map(|s| (s.name.clone(), Arc::clone(&s.schema)))
            .collect();
        let query = plan_query(
            &self.query_definition,
            &schemas,
            &self.settings,
            &self.sources,
        )
        .await?;
        self.query = narrow_reads(
            query,
            &self.query_definition,
            &self.settings,
            &mut self.sources,
        )
        .await?;
        self.expectations = self.expectations.replan(&self.query.output_schema())?;
        Ok(())
    }

    /// Step 5, before executing: each static table at the version the intent records, read
    /// only when it is not the version the query holds (a query planned again because a
    /// source's schema grew holds none), and recorded in the table's version log. An intent from before tables
    /// were recorded, or one that lacks a table added since, takes the newest version.
    async fn load_tables(&mut self, batch: &Batch) -> Result<()> {
        // Where the batch's ranges start: a version log entry's `from`.
        let from = start_offsets(&batch.intent.ranges);
        for name in self.tables.names() {
            let (version, recorded) = match batch.intent.table_versions.get(&name) {
                Some(version) => (version.clone(), false),
                // An intent planned before the table joined the job: the newest version,
                // recorded before it is joined — or what an earlier attempt recorded first.
                None => match self.tables.latest_versions().await?.remove(&name) {
                    Some(newest) => {
                        let version = VersionLog::record_first(
                            &self.checkpoint,
                            &name,
                            batch.id(),
                            &newest,
                            from.clone(),
                        )
                        .await?;
                        (version, true)
                    }
                    None => continue,
                },
            };
            let Some(rows) = self
                .tables
                .load_into(&mut self.query, &name, &version)
                .await?
            else {
                continue;
            };
            info!(batch_id = batch.id().0, table = %name, version = %version, rows, "static table loaded");
            // Backfill and reconcile find each row's version here once the intent is purged.
            if !recorded {
                VersionLog::record(&self.checkpoint, &name, batch.id(), &version, from.clone())
                    .await?;
            }
        }
        Ok(())
    }

    /// Step 6 watermark: from the newest event time per partition, over the non-idle ones.
    /// Known once the batch is read; the query needs it to emit the windows it closes.
    fn next_watermark(&self, batch: &Batch) -> Watermark {
        let mut watermark = self.watermark.clone();
        watermark.advance(
            &self.rules,
            &batch.max_event_time,
            &event_time_partitions(&self.rules, &batch.end_offsets),
            &batch.intent.idle,
        );
        watermark
    }

    /// Steps 5 execute + 7 emit: the query over the batch (failing rows to dead letters);
    /// a stateful query merges into its state and emits what the new watermark closes.
    async fn execute(
        &mut self,
        batch: &mut Batch,
        inputs: SourceInputs,
        watermark: &Watermark,
    ) -> Result<Vec<RecordBatch>> {
        let t = Instant::now();
        let step = BatchWatermark {
            before: self.watermark.current(),
            after: watermark.current(),
        };
        let output = self.query.execute_read(inputs, step).await?;
        let mut failed_by_source: BTreeMap<&str, Vec<&FailedRow>> = BTreeMap::new();
        for failed in &output.failed {
            failed_by_source
                .entry(&failed.source)
                .or_default()
                .push(failed);
        }
        for (source, failed) in failed_by_source {
            let mut rows: Vec<RecordBatch> = failed.iter().map(|f| f.row.clone()).collect();
            let mut errors: Vec<String> = failed.iter().map(|f| f.error.clone()).collect();
            // A narrowed read's rows hold only the columns read: dead letters keep whole records.
            if let Some(s) = self.sources.iter().find(|s| s.name == source) {
                for i in make_whole(s, &mut rows).await? {
                    errors[i] = format!("{} ({NOT_READ_WHOLE})", errors[i]);
                }
            }
            let letters = rows
                .iter()
                .zip(&errors)
                .map(|(row, error)| dead_letter_from_row(row, error))
                .collect::<Result<Vec<DeadLetter>>>()?;
            batch
                .dead_letters
                .push(dead_letter_batch(source, batch.id(), &letters)?);
        }
        batch.counters.rows_dead_lettered += output.failed.len() as u64;
        batch.counters.rows_out = output.batches.iter().map(|b| b.num_rows() as u64).sum();
        batch.counters.rows_duplicate = self.query.rows_duplicate();
        batch.times.execute = t.elapsed();
        self.progress.alive();
        Ok(output.batches)
    }

    /// The dead-letter circuit breaker: a batch whose dead letters are more than
    /// `max_dead_letter_fraction` of the records it read, and more than
    /// [`DEAD_LETTER_BREAKER_MIN`], fails before anything of it is written.
    fn check_dead_letters(&self, batch: &Batch) -> Result<()> {
        let dead = batch.counters.rows_dead_lettered;
        let read = batch.counters.rows_in + dead;
        if dead <= DEAD_LETTER_BREAKER_MIN
            || dead as f64 <= self.max_dead_letter_fraction * read as f64
        {
            return Ok(());
        }
        let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
        for letters in &batch.dead_letters {
            if let Some(errors) = letters
                .column_by_name("error")
                .and_then(|c| c.as_string_opt::<i32>())
            {
                for error in errors.iter().flatten() {
                    let reason: String = error.chars().take(160).collect();
                    *reasons.entry(reason).or_default() += 1;
                }
            }
        }
        let mut reasons: Vec<(String, u64)> = reasons.into_iter().collect();
        reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let reasons: Vec<String> = reasons
            .iter()
            .take(3)
            .map(|(reason, n)| format!("{n} × \"{reason}\""))
            .collect();
        Err(Error::TooManyDeadLetters {
            batch_id: batch.id(),
            dead,
            read,
            percent: 100.0 * dead as f64 / read as f64,
            fraction: self.max_dead_letter_fraction,
            reasons: reasons.join(", "),
        })
    }

    /// The job's expectations on the output rows: counted per expectation; rows left out
    /// (`drop`), moved to the dead-letter table (`quarantine`), or the batch failed (`fail`).
    fn check_expectations(
        &self,
        batch: &mut Batch,
        output: Vec<RecordBatch>,
    ) -> Result<Vec<RecordBatch>> {
        if self.expectations.is_empty() {
            return Ok(output);
        }
        let checked = self.expectations.apply(output)?;
        if !checked.quarantined.is_empty() {
            let source = match self.sources.as_slice() {
                [only] => only.name.as_str(),
                _ => QUARANTINE_SOURCE,
            };
            batch
                .dead_letters
                .push(dead_letter_batch(source, batch.id(), &checked.quarantined)?);
        }
        let failing: Vec<String> = checked
            .failures
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(name, n)| format!("{name}={n}"))
            .collect();
        if !failing.is_empty() {
            warn!(batch_id = batch.id().0, failed = %failing.join(", "), dropped = checked.dropped, quarantined = checked.quarantined.len(), "output rows failed expectations");
        }
        batch.counters.rows_quarantined = checked.quarantined.len() as u64;
        batch.counters.rows_dropped = checked.dropped;
        batch.counters.rows_out = checked.kept.iter().map(|b| b.num_rows() as u64).sum();
        batch.counters.expectations = checked.failures;
        Ok(checked.kept)
    }

    /// Step 8 manifest: state files, then the end offsets of every partition, the watermark and
    /// the state file list — written put-if-absent, live once the commit lands. If an earlier
    /// attempt at this batch wrote the manifest first (a crashed run, a twin), that one is
    /// adopted: the same intent gave the same batch.
    async fn write_manifest(
        &mut self,
        batch: &mut Batch,
        watermark: &Watermark,
    ) -> Result<BatchManifest> {
        let t = Instant::now();
        let id = batch.id();
        let (operators, bytes_written) = self.query.write_state(id).await?;
        if !operators.is_empty() {
            batch.counters.state_bytes_written = bytes_written;
            crash_point("after_state", id);
        }
        if let Some(size) = self.query.state_size() {
            batch.counters.state_rows = size.rows;
            batch.counters.state_bytes = size.bytes;
        }
        let manifest = BatchManifest {
            batch_id: id,
            end_offsets: batch.end_offsets.clone(),
            watermark_micros: watermark.current(),
            max_event_time: watermark.max_event_time().clone(),
            state_files: operators.values().flat_map(|o| o.files.clone()).collect(),
            operators: Some(operators),
            counters: batch.counters.clone(),
            lag: consumer_lag(&self.latest_at_plan, &batch.end_offsets),
            planned_at_micros: batch.intent.planned_at_micros,
            // What was joined: the intent's versions, or the newest for a table the intent
            // does not name (an intent written before the table was added).
            table_versions: self
                .tables
                .names()
                .into_iter()
                .filter_map(|name| {
                    let version = self.query.table_version(&name)?.to_string();
                    Some((name, version))
                })
                .collect(),
            behind: still_behind(&self.behind, &batch.intent.skipped, &batch.end_offsets),
        };
        let in_force = self.checkpoint.write_manifest(manifest.clone()).await?;
        let same_batch = in_force.end_offsets == manifest.end_offsets
            && in_force.watermark_micros == manifest.watermark_micros
            && in_force.table_versions == manifest.table_versions;
        if !same_batch {
            return Err(Error::InvalidJob(format!(
                "the manifest {} was written by another run of batch {id} with other end offsets, \
                 watermark or table versions than this run's ({} / {} here): the checkpoint belongs to another \
                 job or another version of its input. Give the job a fresh checkpoint",
                self.checkpoint.manifest_location(id),
                display_offsets(&manifest.end_offsets),
                display_watermark(manifest.watermark_micros),
            )));
        }
        if in_force.state_files != manifest.state_files || in_force.operators != manifest.operators
        {
            info!(
                batch_id = id.0,
                "adopting the manifest an earlier attempt at this batch wrote"
            );
            self.query.adopt_state(&in_force).await?;
        }
        crash_point("after_manifest", id);
        batch.times.checkpoint = t.elapsed();
        self.progress.alive();
        Ok(in_force)
    }

    /// Step 9 commit: side tables, then one output commit carrying txn(job, batch). The output
    /// table already holding the batch means another instance of the job committed it.
    async fn commit(
        &mut self,
        batch: &mut Batch,
        output: Vec<RecordBatch>,
        manifest: &BatchManifest,
    ) -> Result<CommitOutcome> {
        let t = Instant::now();
        let commit = self.batch_commit(batch, output, manifest)?;
        let outcome = self.sink.commit(commit).await?;
        self.committed(batch, outcome, t.elapsed())
    }

    /// What the sink commits for `batch`, once the lease is checked.
    fn batch_commit(
        &self,
        batch: &mut Batch,
        output: Vec<RecordBatch>,
        manifest: &BatchManifest,
    ) -> Result<BatchCommit> {
        let id = batch.id();
        let manifest_json =
            serde_json::to_value(manifest).map_err(|source| Error::CheckpointFormat {
                path: self.checkpoint.manifest_location(id),
                source,
            })?;
        self.lease.check()?;
        Ok(BatchCommit {
            batch_id: id,
            output,
            dead_letters: std::mem::take(&mut batch.dead_letters),
            late: std::mem::take(&mut batch.late),
            manifest: manifest_json,
        })
    }

    /// The sink's answer to `batch`'s commit (which took `took`): the output table already
    /// holding the batch means another instance of the job committed it.
    fn committed(
        &self,
        batch: &mut Batch,
        outcome: CommitOutcome,
        took: Duration,
    ) -> Result<CommitOutcome> {
        let id = batch.id();
        if outcome == CommitOutcome::AlreadyCommitted {
            return Err(Error::AnotherInstance {
                job_id: self.job_id.clone(),
                batch_id: id,
                table: self.sink.location().to_string(),
            });
        }
        crash_point("after_commit", id);
        batch.times.commit = took;
        Ok(outcome)
    }

    /// Step 10 purge: keep the last `keep_batches` batch folders; delete the state files of
    /// batches up to this one that are no longer live. (Windows closed by the watermark left
    /// the state in step 7.)
    async fn purge(&mut self, batch: &mut Batch) -> Result<()> {
        let t = Instant::now();
        let keep_from = BatchId(batch.id().0 + 1 - i64::from(self.keep_batches));
        self.checkpoint.purge_batches_before(keep_from).await?;
        self.query.collect_state_garbage(batch.id()).await?;
        batch.times.purge = t.elapsed();
        Ok(())
    }

    /// Step 11, compaction: once a table of the sink holds enough small files, they are
    /// rewritten into larger ones (no row changes), under the job's rewrite lease so that a
    /// backfill replacing rows never runs at the same time. Skipped while a backfill holds the
    /// lease; a compaction that fails is logged and tried again after a later batch — the
    /// batch itself is committed already.
    async fn compact(&mut self, batch: &mut Batch) -> Result<()> {
        // A run that lost the job's lease stops instead (at its next look, or here).
        self.lease.check()?;
        let t = Instant::now();
        if let Err(error) = self.try_compact(batch).await {
            warn!(job_id = %self.job_id, %error, "compaction failed; it is tried again after a later batch");
        }
        batch.times.compact = t.elapsed();
        Ok(())
    }

    /// [`Pipeline::compact`] without its error handling.
    async fn try_compact(&mut self, batch: &mut Batch) -> Result<()> {
        if !self.sink.compaction_due().await? {
            return Ok(());
        }
        let Some(lease) = Lease::try_acquire_in(
            &self.checkpoint,
            REWRITE_LEASE_FOLDER,
            &self.job_id,
            LeaseSettings::default(),
        )
        .await?
        else {
            info!(job_id = %self.job_id, "compaction waits: a backfill holds the job's rewrite lease");
            return Ok(());
        };
        crash_point("before_compaction", batch.id());
        let compacted = self.sink.compact().await;
        if compacted.as_ref().is_ok_and(|c| c.files_removed > 0) {
            // A rewrite's reads and writes leave the allocator's arenas fragmented, and the
            // next batches' large buffers no longer fit in what it freed: return the free pages
            // (see `memory`). Once per rewrite (every `min_files` batches at most), so its cost
            // is noise.
            crate::memory::release_free_memory();
        }
        crash_point("after_compaction", batch.id());
        if let Err(error) = lease.release().await {
            warn!(%error, "could not release the rewrite lease; a backfill waits for it to expire");
        }
        batch.compaction = compacted?;
        Ok(())
    }

    /// Moves the job's position past the batch of `intent`, as its `manifest` gives it: what
    /// the next batch is planned and executed from.
    fn advance(
        &mut self,
        intent: &BatchIntent,
        manifest: &BatchManifest,
        mut watermark: Watermark,
    ) {
        watermark.saw_data(
            ranges_to_read(&intent.ranges).map(|(source, p, _)| (source.clone(), p.clone())),
            Instant::now(),
        );
        self.committed = manifest.end_offsets.clone();
        self.behind = manifest.behind.clone();
        self.watermark = watermark;
        self.next_batch = intent.batch_id.next();
    }

    /// The batch is done: add it to the run's summary, report and log it.
    fn finish(&mut self, batch: Batch, manifest: BatchManifest, outcome: CommitOutcome) {
        let took = batch.took();
        let Batch {
            intent,
            started,
            counters,
            times,
            rows_in_by_source,
            input_bytes,
            compaction,
            ..
        } = batch;
        self.summary.batches_committed += 1;
        self.summary.last_batch = Some(intent.batch_id);
        self.summary.rows_in += counters.rows_in;
        self.summary.rows_out += counters.rows_out;
        self.summary.rows_dead_lettered += counters.rows_dead_lettered;
        self.summary.rows_late += counters.rows_late;
        self.summary.batches.push(BatchStats {
            millis: ms(took),
            rows_in: counters.rows_in,
            rows_out: counters.rows_out,
            state_rows: counters.state_rows,
            state_bytes: counters.state_bytes,
            input_bytes,
        });
        let (files, bytes, version) = match outcome {
            CommitOutcome::Committed {
                files,
                bytes,
                version,
                ..
            } => (files, bytes, version),
            CommitOutcome::AlreadyCommitted => (0, 0, None),
        };
        self.progress.committed(CommittedBatch {
            batch_id: intent.batch_id.0,
            started_at: chrono::Utc::now()
                - chrono::Duration::from_std(started.elapsed()).unwrap_or_default(),
            duration: took,
            phases: [
                times.read,
                times.execute,
                times.checkpoint,
                times.commit + times.purge,
            ],
            rows_in: rows_in_by_source,
            rows_out: counters.rows_out,
            rows_dead_lettered: counters.rows_dead_lettered + counters.rows_quarantined,
            rows_late: counters.rows_late,
            rows_duplicate: counters.rows_duplicate,
            watermark_micros: manifest.watermark_micros,
            lag: manifest.lag.clone(),
            state_rows: counters.state_rows,
            state_bytes: counters.state_bytes,
            table_version: version,
            commit_conflicts: self.sink.commit_conflicts(),
            expectations: counters.expectations.clone(),
            offsets_read: intent
                .ranges
                .values()
                .flat_map(|parts| parts.values())
                .map(|r| r.len() as i64)
                .sum(),
        });
        info!(
            job_id = %self.job_id,
            batch_id = intent.batch_id.0,
            ranges = %display_ranges(&intent.ranges),
            lag = %display_offsets(&manifest.lag),
            watermark = %display_watermark(manifest.watermark_micros),
            watermark_lag_ms = watermark_lag_ms(manifest.watermark_micros),
            idle = intent.idle.len(),
            rows_in = counters.rows_in,
            rows_out = counters.rows_out,
            rows_dead_lettered = counters.rows_dead_lettered,
            rows_late = counters.rows_late,
            rows_duplicate = counters.rows_duplicate,
            rows_dropped = counters.rows_dropped,
            rows_quarantined = counters.rows_quarantined,
            expectations = %display_expectations(&counters.expectations),
            state_rows = counters.state_rows,
            state_bytes = counters.state_bytes,
            state_bytes_written = counters.state_bytes_written,
            files_written = files,
            bytes_written = bytes,
            plan_ms = log_ms(times.plan),
            read_ms = log_ms(times.read),
            execute_ms = log_ms(times.execute),
            checkpoint_ms = log_ms(times.checkpoint),
            commit_ms = log_ms(times.commit),
            purge_ms = log_ms(times.purge),
            files_compacted = compaction.files_removed,
            compact_ms = log_ms(times.compact),
            total_ms = log_ms(took),
            "batch committed"
        );
    }
}

/// Where a job stands after its last commit.
struct Position {
    last: Option<BatchId>,
    next_batch: BatchId,
    committed: SourceOffsets,
    watermark: Watermark,
    behind: SourceOffsets,
}

/// Restart: opens the sink's tables, reads the last committed batch from the output table,
/// refuses leftovers of an earlier life of the job, and restores the offsets, watermark and
/// state that batch's manifest records.
async fn restore(
    checkpoint: &CheckpointStore,
    sink: &mut dyn Sink,
    job_id: &str,
    query: &mut StreamingQuery,
    epoch: u64,
) -> Result<Position> {
    sink.open(job_id, query.output_tables()).await?;
    let last = sink.committed_batch(job_id).await?;
    refuse_leftovers(checkpoint, sink, job_id, last).await?;
    let (position, manifest) = match last {
        None => (
            Position {
                last,
                next_batch: BatchId(0),
                committed: SourceOffsets::new(),
                watermark: Watermark::default(),
                behind: SourceOffsets::new(),
            },
            None,
        ),
        Some(v) => {
            let manifest =
                checkpoint
                    .read_manifest(v)
                    .await?
                    .ok_or_else(|| Error::MissingManifest {
                        job_id: job_id.to_string(),
                        batch_id: v,
                        path: checkpoint.manifest_location(v),
                    })?;
            let position = Position {
                last,
                next_batch: v.next(),
                committed: manifest.end_offsets.clone(),
                watermark: Watermark::restore(
                    manifest.watermark_micros,
                    manifest.max_event_time.clone(),
                ),
                behind: manifest.behind.clone(),
            };
            (position, Some(manifest))
        }
    };
    // The state the last committed batch left, from the files its manifest lists, if this
    // query's operators are the ones that wrote it.
    let log = StateLog::new(checkpoint, epoch);
    query
        .restore_state(log, manifest.as_ref(), position.watermark.current())
        .await?;
    Ok(position)
}

/// Refuses to continue over what an earlier life of the job left behind: a checkpoint holding
/// batches the output table never committed (the table was deleted, the checkpoint kept), or a
/// side table holding a later batch than the output (the output and checkpoint were deleted,
/// the side table kept) — skipping its write would silently lose this run's rows. A side table
/// one batch ahead is fine when that batch's intent is pending: it committed its side tables,
/// then crashed before the output.
async fn refuse_leftovers(
    checkpoint: &CheckpointStore,
    sink: &dyn Sink,
    job_id: &str,
    last: Option<BatchId>,
) -> Result<()> {
    let next = last.map_or(BatchId(0), BatchId::next);
    if last.is_none()
        && let Some(newest) = checkpoint.newest_batch_folder().await?
        && newest.0 > 0
    {
        return Err(Error::StaleCheckpoint {
            job_id: job_id.to_string(),
            table: sink.location().to_string(),
            checkpoint: checkpoint.url().to_string(),
            newest: newest.0,
        });
    }
    let pending = checkpoint.read_intent(next).await?.is_some();
    for side in sink.side_table_batches(job_id).await? {
        let Some(found) = side.last_batch else {
            continue;
        };
        if found > next || (found == next && !pending) {
            return Err(Error::SideTableAhead {
                role: side.role,
                table: side.location,
                job_id: job_id.to_string(),
                found,
                expected: match last {
                    Some(v) => format!("the output table, which holds batch {v}"),
                    None => "the output table, which holds no batch of the job".to_string(),
                },
            });
        }
    }
    Ok(())
}

/// The partitions reported behind their committed end (before, or by this batch's intent)
/// whose end has not moved since: reported once, not again while they stay behind.
fn still_behind(
    reported: &SourceOffsets,
    skipped: &[SkippedOffsets],
    ends: &SourceOffsets,
) -> SourceOffsets {
    let mut behind = SourceOffsets::new();
    let all = reported
        .iter()
        .flat_map(|(s, parts)| parts.iter().map(move |(p, e)| (s.clone(), p.clone(), *e)))
        .chain(
            skipped
                .iter()
                .map(|k| (k.source.clone(), k.partition.clone(), k.committed_end)),
        );
    for (source, partition, end) in all {
        if ends.get(&source).and_then(|e| e.get(&partition)) == Some(&end) {
            behind.entry(source).or_default().insert(partition, end);
        }
    }
    behind
}

/// Every partition of every source with event time, as far as the offsets know them.
fn event_time_partitions(
    rules: &BTreeMap<String, WatermarkRules>,
    offsets: &SourceOffsets,
) -> std::collections::BTreeSet<SourcePartition> {
    offsets
        .iter()
        .filter(|(source, _)| rules.contains_key(*source))
        .flat_map(|(source, parts)| parts.keys().map(move |p| (source.clone(), p.clone())))
        .collect()
}

/// Wall clock minus watermark, in ms (0 if the watermark is ahead of the clock); -1 for none.
fn watermark_lag_ms(watermark: Option<i64>) -> i64 {
    watermark.map_or(-1, |w| {
        ((chrono::Utc::now().timestamp_micros() - w) / 1000).max(0)
    })
}

/// Per partition: offsets available at planning minus where this batch ended.
fn consumer_lag(latest: &SourceOffsets, ends: &SourceOffsets) -> SourceOffsets {
    latest
        .iter()
        .map(|(source, parts)| {
            let lag = parts
                .iter()
                .filter_map(|(p, l)| {
                    let end = ends.get(source)?.get(p)?;
                    Some((p.clone(), (l - end).max(0)))
                })
                .collect();
            (source.clone(), lag)
        })
        .collect()
}

/// Per expectation, its failing rows: `positive_amount=3, known_user=0`.
fn display_expectations(failures: &BTreeMap<String, u64>) -> String {
    failures
        .iter()
        .map(|(name, n)| format!("{name}={n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Milliseconds to a tenth, for the per-batch log line (a step of a small batch takes about one).
fn log_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}
