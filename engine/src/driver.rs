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
//! **Restart.** The output table is the source of truth: its `txn` version for the job is the
//! last committed batch `V`; `batches/V/manifest.json` (written before commit `V`, live with it)
//! gives the end offsets, the watermark and the state files. If `batches/V+1/intent.json` exists, batch `V+1` is
//! rerun with exactly those ranges and idle set; the sink skips side tables that already hold
//! `txn(job, V+1)`. Whatever step a crash interrupts, the rerun produces the same rows and
//! commits them once.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::SchemaRef;
use futures::future::try_join_all;
use tokio::sync::watch;
use tracing::info;
use url::Url;

use crate::checkpoint::{BatchCounters, BatchIntent, BatchManifest, CheckpointStore};
use crate::dead_letter::{dead_letter_batch, dead_letter_from_row};
use crate::error::{Error, Result};
use crate::event_time::{EventTimeConfig, extract_event_time, schema_with_event_time};
use crate::fault::crash_point;
use crate::job::{Job, SourceSpec, Trigger};
use crate::offsets::{
    BatchId, OffsetRange, PartitionId, SourceOffsets, SourceRanges, display_offsets,
    display_ranges, plan_ranges,
};
use crate::query::{BatchWatermark, QuerySettings, StreamingQuery};
use crate::sink::{BatchCommit, CommitOutcome, Sink};
use crate::source::{DeadLetter, SOURCE_OFFSET, SOURCE_PARTITION, Source, SourceContext};
use crate::state_store::StateLog;
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
    /// Wall time from reading to the end of the purge, ms.
    pub millis: u64,
    /// Rows read.
    pub rows_in: u64,
    /// Rows written to the output.
    pub rows_out: u64,
    /// State rows after the batch (0 for a stateless job).
    pub state_rows: u64,
    /// State bytes in memory after the batch.
    pub state_bytes: u64,
}

/// What `sluice validate` prints: the source schemas and the optimised plan.
#[derive(Debug, Clone)]
pub struct Validation {
    /// Each source's schema as the query sees it.
    pub sources: Vec<(String, SchemaRef)>,
    /// The output schema.
    pub output: SchemaRef,
    /// The optimised logical plan.
    pub plan: String,
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
        let result = async {
            let mut pipeline = Pipeline::open(self).await?;
            pipeline.drive(trigger, stop_rx).await?;
            Ok(pipeline.summary)
        }
        .await;
        watcher.abort();
        result
    }

    /// Opens the sources and plans the query without writing anything.
    pub async fn validate(self) -> Result<Validation> {
        let checkpoint = checkpoint_location(&self)?;
        let settings = query_settings(&self);
        let (sources, query) =
            open_sources_and_query(self.sources, &self.sql, &settings, &checkpoint).await?;
        Ok(Validation {
            sources: sources
                .iter()
                .map(|s| (s.name.clone(), Arc::clone(&s.schema)))
                .collect(),
            output: query.output_schema(),
            plan: query.display_plan()?,
        })
    }
}

/// One opened source.
pub(crate) struct OpenSource {
    pub(crate) name: String,
    pub(crate) source: Box<dyn Source>,
    pub(crate) event_time: Option<EventTimeConfig>,
    /// The schema the query sees (event-time column already converted).
    pub(crate) schema: SchemaRef,
}

/// A job with its sources, query, sink and checkpoint open, positioned after its last commit.
struct Pipeline {
    job_id: String,
    sources: Vec<OpenSource>,
    query: StreamingQuery,
    sink: Box<dyn Sink>,
    checkpoint: CheckpointStore,
    keep_batches: u32,
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
    summary: RunSummary,
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
    CheckpointStore::open(&url)
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
        event_time: job
            .sources
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.event_time.as_ref()?.column.clone())))
            .collect(),
    }
}

pub(crate) async fn open_sources_and_query(
    specs: Vec<SourceSpec>,
    sql: &str,
    settings: &QuerySettings,
    checkpoint: &CheckpointStore,
) -> Result<(Vec<OpenSource>, StreamingQuery)> {
    let mut sources = Vec::with_capacity(specs.len());
    for spec in specs {
        let mut source = spec.source;
        let ctx = SourceContext {
            name: spec.name.clone(),
            checkpoint: checkpoint.child("sources").child(&spec.name),
        };
        let mut schema = source.open(ctx).await?;
        for col in [SOURCE_PARTITION, SOURCE_OFFSET] {
            if schema.index_of(col).is_err() {
                return Err(Error::source(
                    &spec.name,
                    format!("its batches lack the column {col}"),
                ));
            }
        }
        if let Some(time) = &spec.event_time {
            schema = schema_with_event_time(&schema, &time.column)
                .map_err(|e| Error::source(&spec.name, e))?;
        }
        sources.push(OpenSource {
            name: spec.name,
            source,
            event_time: spec.event_time,
            schema,
        });
    }
    let schemas: Vec<(String, SchemaRef)> = sources
        .iter()
        .map(|s| (s.name.clone(), Arc::clone(&s.schema)))
        .collect();
    let query = StreamingQuery::plan(sql, &schemas, settings).await?;
    Ok((sources, query))
}

impl Pipeline {
    /// Opens everything and finds where the job stands from the output table.
    async fn open(job: Job) -> Result<Pipeline> {
        let checkpoint = checkpoint_location(&job)?;
        let settings = query_settings(&job);
        let Job {
            id: job_id,
            sources,
            sql,
            mut sink,
            keep_batches,
            ..
        } = job;
        let (sources, mut query) =
            open_sources_and_query(sources, &sql, &settings, &checkpoint).await?;
        sink.open(&job_id, query.output_tables()).await?;
        let last = sink.committed_batch(&job_id).await?;
        let (next_batch, committed, watermark, state_files) =
            match last {
                None => (
                    BatchId(0),
                    SourceOffsets::new(),
                    Watermark::default(),
                    vec![],
                ),
                Some(v) => {
                    let manifest = checkpoint.read_manifest(v).await?.ok_or_else(|| {
                        Error::MissingManifest {
                            job_id: job_id.clone(),
                            batch_id: v,
                            path: checkpoint.manifest_location(v),
                        }
                    })?;
                    let watermark =
                        Watermark::restore(manifest.watermark_micros, manifest.max_event_time);
                    (
                        v.next(),
                        manifest.end_offsets,
                        watermark,
                        manifest.state_files,
                    )
                }
            };
        // The state the last committed batch left, from the files its manifest lists.
        if let Some(stateful) = query.stateful_mut() {
            stateful
                .restore(
                    StateLog::new(&checkpoint),
                    &state_files,
                    watermark.current(),
                )
                .await?;
        }
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
        info!(job_id, last_committed = ?last.map(|b| b.0), checkpoint = %checkpoint.url(), "job opened");
        let summary = RunSummary {
            last_batch: last,
            location: Some(sink.location().clone()),
            ..RunSummary::default()
        };
        Ok(Pipeline {
            job_id,
            sources,
            query,
            sink,
            checkpoint,
            keep_batches,
            next_batch,
            committed,
            latest_at_plan: SourceOffsets::new(),
            rules,
            watermark,
            summary,
        })
    }

    /// The trigger loop.
    async fn drive(&mut self, trigger: Trigger, mut stop: watch::Receiver<bool>) -> Result<()> {
        match trigger {
            Trigger::Once => {
                if let Some(intent) = self.plan(None).await? {
                    self.run_batch(intent).await?;
                }
            }
            Trigger::AvailableNow => {
                let target = self.latest_offsets().await?;
                while !*stop.borrow() {
                    let Some(intent) = self.plan(Some(&target)).await? else {
                        break;
                    };
                    self.run_batch(intent).await?;
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
                    if let Some(intent) = self.plan(None).await? {
                        self.run_batch(intent).await?;
                    }
                }
            }
        }
        Ok(())
    }

    async fn latest_offsets(&self) -> Result<SourceOffsets> {
        let mut latest = SourceOffsets::new();
        for s in &self.sources {
            let available = s.source.available().await?;
            latest.insert(
                s.name.clone(),
                available.into_iter().map(|(p, a)| (p, a.latest)).collect(),
            );
        }
        Ok(latest)
    }

    /// Step 1–2: the next batch's ranges — a pending intent if a crashed run left one, else
    /// planned afresh (capped at `limit`) and recorded put-if-absent. `None` if there is nothing
    /// to read.
    async fn plan(&mut self, limit: Option<&SourceOffsets>) -> Result<Option<BatchIntent>> {
        self.latest_at_plan.clear();
        if let Some(intent) = self.checkpoint.read_intent(self.next_batch).await? {
            info!(batch_id = intent.batch_id.0, ranges = %display_ranges(&intent.ranges), "rerunning the intent of an uncommitted batch");
            return Ok(Some(intent));
        }
        let mut ranges = SourceRanges::new();
        for s in &self.sources {
            let available = s.source.available().await?;
            let committed = self.committed.get(&s.name);
            let mut start = BTreeMap::new();
            let mut latest = BTreeMap::new();
            let seen = self.latest_at_plan.entry(s.name.clone()).or_default();
            for (p, a) in available {
                seen.insert(p.clone(), a.latest);
                let from = committed
                    .and_then(|c| c.get(&p))
                    .copied()
                    .unwrap_or(a.initial);
                let mut to = a.latest;
                if let Some(cap) = limit
                    .and_then(|l| l.get(&s.name))
                    .map(|l| l.get(&p).copied().unwrap_or(from))
                {
                    to = to.min(cap);
                }
                start.insert(p.clone(), from);
                latest.insert(p, to.max(from));
            }
            ranges.insert(
                s.name.clone(),
                plan_ranges(&start, &latest, s.source.max_per_batch()),
            );
        }
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
        // watermark advance (windows close on it).
        if nothing_to_read {
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
        let intent = BatchIntent {
            batch_id: self.next_batch,
            ranges,
            idle,
        };
        let intent = self.checkpoint.write_intent(intent).await?;
        crash_point("after_intent", intent.batch_id);
        Ok(Some(intent))
    }

    /// Steps 3–10 for one batch.
    async fn run_batch(&mut self, intent: BatchIntent) -> Result<()> {
        let batch_id = intent.batch_id;
        let started = Instant::now();
        let mut counters = BatchCounters::default();
        let mut dead_letters: Vec<RecordBatch> = Vec::new();
        let mut late: Vec<RecordBatch> = Vec::new();

        // 3 read + 4 time: one batch of rows per source.
        let t = Instant::now();
        let mut inputs = BTreeMap::new();
        let mut batch_max_event_time = SourceOffsets::new();
        for s in &self.sources {
            let empty = BTreeMap::new();
            let ranges = intent.ranges.get(&s.name).unwrap_or(&empty);
            let (rows, letters) = read_source(s, ranges).await?;
            if let Some(time) = &s.event_time {
                let maxima = batch_max_event_time.entry(s.name.clone()).or_default();
                max_event_time_by_partition(&rows, &time.column, maxima)?;
            }
            // Rows of windows the watermark in force has closed: to the late table (they
            // still count in their open windows; the query leaves the closed ones out).
            if let Some(rows_late) =
                self.query
                    .late_rows(&s.name, &rows, self.watermark.current(), batch_id)?
            {
                counters.rows_late += rows_late.num_rows() as u64;
                late.push(rows_late);
            }
            counters.rows_in += rows.num_rows() as u64;
            counters.rows_dead_lettered += letters.len() as u64;
            if !letters.is_empty() {
                dead_letters.push(dead_letter_batch(&s.name, batch_id, &letters)?);
            }
            inputs.insert(s.name.clone(), rows);
        }
        let read_time = t.elapsed();

        // 6 watermark: from the newest event time per partition, over the non-idle ones. Known
        // once the batch is read; the query needs it to emit the windows it closes.
        let mut end_offsets = self.committed.clone();
        for (source, parts) in &intent.ranges {
            let ends = end_offsets.entry(source.clone()).or_default();
            for (p, r) in parts {
                ends.insert(p.clone(), r.end);
            }
        }
        let mut watermark = self.watermark.clone();
        watermark.advance(
            &self.rules,
            &batch_max_event_time,
            &event_time_partitions(&self.rules, &end_offsets),
            &intent.idle,
        );

        // 5 execute (+ 7 emit).
        let t = Instant::now();
        let batch_watermark = BatchWatermark {
            before: self.watermark.current(),
            after: watermark.current(),
        };
        let output = self
            .query
            .execute_isolating(&inputs, batch_watermark)
            .await?;
        drop(inputs);
        let mut failed_by_source: BTreeMap<&str, Vec<DeadLetter>> = BTreeMap::new();
        for failed in &output.failed {
            let letter = dead_letter_from_row(&failed.row, &failed.error)?;
            failed_by_source
                .entry(&failed.source)
                .or_default()
                .push(letter);
        }
        for (source, letters) in failed_by_source {
            dead_letters.push(dead_letter_batch(source, batch_id, &letters)?);
        }
        counters.rows_dead_lettered += output.failed.len() as u64;
        counters.rows_out = output.batches.iter().map(|b| b.num_rows() as u64).sum();
        let execute_time = t.elapsed();

        // 8 manifest: state files, then end offsets of every partition, the watermark and the
        // state file list — live once the commit lands.
        let t = Instant::now();
        let mut state_files = Vec::new();
        if let Some(stateful) = self.query.stateful_mut() {
            let written = stateful.write_state(batch_id).await?;
            counters.state_bytes_written = written.bytes_written;
            state_files = written.live_files;
            crash_point("after_state", batch_id);
        }
        if let Some(size) = self.query.state_size() {
            counters.state_rows = size.rows;
            counters.state_bytes = size.bytes;
        }
        let lag = consumer_lag(&self.latest_at_plan, &end_offsets);
        let manifest = BatchManifest {
            batch_id,
            end_offsets,
            watermark_micros: watermark.current(),
            max_event_time: watermark.max_event_time().clone(),
            state_files,
            counters: counters.clone(),
            lag,
        };
        self.checkpoint.write_manifest(&manifest).await?;
        crash_point("after_manifest", batch_id);
        let manifest_time = t.elapsed();

        // 9 commit: side tables, then one output commit carrying txn(job, batch).
        let t = Instant::now();
        let manifest_json =
            serde_json::to_value(&manifest).map_err(|source| Error::CheckpointFormat {
                path: self.checkpoint.manifest_location(batch_id),
                source,
            })?;
        let outcome = self
            .sink
            .commit(BatchCommit {
                batch_id,
                output: output.batches,
                dead_letters,
                late,
                manifest: manifest_json,
            })
            .await?;
        crash_point("after_commit", batch_id);
        let commit_time = t.elapsed();

        // 10 purge: keep the last `keep_batches` batch folders; delete state files no longer
        // live. (Windows closed by the watermark left the state in step 7.)
        let t = Instant::now();
        let keep_from = BatchId(batch_id.0 + 1 - i64::from(self.keep_batches));
        self.checkpoint.purge_batches_before(keep_from).await?;
        if let Some(stateful) = self.query.stateful_mut() {
            stateful.collect_garbage().await?;
        }
        let purge_time = t.elapsed();

        self.committed = manifest.end_offsets;
        watermark.saw_data(
            intent.ranges.iter().flat_map(|(source, parts)| {
                parts
                    .iter()
                    .filter(|(_, r)| !r.is_empty())
                    .map(|(p, _)| (source.clone(), p.clone()))
            }),
            Instant::now(),
        );
        self.watermark = watermark;
        self.next_batch = batch_id.next();
        self.summary.batches_committed += 1;
        self.summary.last_batch = Some(batch_id);
        self.summary.rows_in += counters.rows_in;
        self.summary.rows_out += counters.rows_out;
        self.summary.rows_dead_lettered += counters.rows_dead_lettered;
        self.summary.rows_late += counters.rows_late;
        self.summary.batches.push(BatchStats {
            millis: ms(started.elapsed()),
            rows_in: counters.rows_in,
            rows_out: counters.rows_out,
            state_rows: counters.state_rows,
            state_bytes: counters.state_bytes,
        });
        let (files, bytes, already) = match outcome {
            CommitOutcome::Committed { files, bytes, .. } => (files, bytes, false),
            CommitOutcome::AlreadyCommitted => (0, 0, true),
        };
        info!(
            job_id = %self.job_id,
            batch_id = batch_id.0,
            ranges = %display_ranges(&intent.ranges),
            lag = %display_offsets(&manifest.lag),
            watermark = %display_watermark(manifest.watermark_micros),
            watermark_lag_ms = watermark_lag_ms(manifest.watermark_micros),
            idle = intent.idle.len(),
            rows_in = counters.rows_in,
            rows_out = counters.rows_out,
            rows_dead_lettered = counters.rows_dead_lettered,
            rows_late = counters.rows_late,
            state_rows = counters.state_rows,
            state_bytes = counters.state_bytes,
            state_bytes_written = counters.state_bytes_written,
            files_written = files,
            bytes_written = bytes,
            already_committed = already,
            read_ms = ms(read_time),
            execute_ms = ms(execute_time),
            checkpoint_ms = ms(manifest_time),
            commit_ms = ms(commit_time),
            purge_ms = ms(purge_time),
            total_ms = ms(started.elapsed()),
            "batch committed"
        );
        Ok(())
    }
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

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Reads every range of one source (partitions concurrently), parses event time, and returns
/// the rows as one batch plus the dead letters.
pub(crate) async fn read_source(
    s: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
) -> Result<(RecordBatch, Vec<DeadLetter>)> {
    let reads = try_join_all(
        ranges
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(p, r)| s.source.read(p, *r)),
    )
    .await?;
    let mut letters = Vec::new();
    let mut batches = Vec::new();
    for read in reads {
        letters.extend(read.dead_letters);
        for batch in read.batches {
            match &s.event_time {
                None => batches.push(batch),
                Some(time) => {
                    let (parsed, bad) =
                        extract_event_time(&batch, time).map_err(|e| Error::source(&s.name, e))?;
                    if bad.is_empty() {
                        batches.push(parsed);
                        continue;
                    }
                    let mut keep = vec![true; batch.num_rows()];
                    for b in &bad {
                        keep[b.row] = false;
                        letters.push(dead_letter_from_row(&batch.slice(b.row, 1), &b.reason)?);
                    }
                    batches.push(filter_record_batch(&parsed, &keep.into())?);
                }
            }
        }
    }
    let rows = concat_batches(&s.schema, &batches)?;
    Ok((rows, letters))
}
