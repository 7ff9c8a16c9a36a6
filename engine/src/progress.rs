//! What a running job tells its operator: a progress record per committed batch (the last
//! [`KEPT_BATCHES`]), running totals, and whether the driver loop is alive.
//!
//! The driver writes into a [`Progress`] when it plans (the consumer lag it saw), when it
//! finishes a step of a batch (it is alive) and when a batch has committed (backfill: per chunk
//! read), and anything holding the same `Arc<Progress>` reads it: the `sluice` binary serves it over HTTP (`/metrics` in Prometheus' text format,
//! `/api/progress`, `/healthz`) and draws a progress bar for bounded runs. Counters only move
//! when a batch commits, so they equal what the committed batches hold; nothing here is written
//! to the checkpoint, and a restarted process starts its counters at zero (Prometheus'
//! `rate()` handles counter resets).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::offsets::SourceOffsets;

/// How many batches' progress records are kept for `/api/progress`.
pub const KEPT_BATCHES: usize = 100;

/// Upper bounds (seconds) of the batch-duration histogram buckets: from a cheap micro-batch to a
/// batch that is falling behind any sane trigger.
pub const DURATION_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The phases of a batch's time: `read` (sources and event time), `execute` (the query),
/// `state` (state files and the batch manifest), `commit` (the Delta commits and the checkpoint
/// purge after them). The batch's duration also counts its planning (lease check, listing the
/// sources, the intent), which is in no phase.
pub const PHASES: [&str; 4] = ["read", "execute", "state", "commit"];

/// One committed batch, modelled on Spark's `StreamingQueryProgress`.
#[derive(Debug, Clone, Serialize)]
pub struct BatchProgress {
    /// The batch id.
    pub batch_id: i64,
    /// When the batch started and committed (RFC 3339, UTC).
    pub started_at: String,
    /// When the batch's commit completed.
    pub committed_at: String,
    /// Wall time of the whole batch.
    pub duration_ms: f64,
    /// Wall time per phase (see [`PHASES`]).
    pub phase_ms: BTreeMap<String, f64>,
    /// Rows read, per source.
    pub rows_in: BTreeMap<String, u64>,
    /// Rows committed to the output table.
    pub rows_out: u64,
    /// Rows committed to the dead-letter table.
    pub rows_dead_lettered: u64,
    /// Rows committed to the late table.
    pub rows_late: u64,
    /// Rows a deduplication left out as duplicates.
    pub rows_duplicate: u64,
    /// Rows read per second of wall time since the previous batch committed (Spark's
    /// `inputRowsPerSecond`: how fast data arrives, as far as the job takes it).
    pub input_rows_per_second: f64,
    /// Rows read per second of this batch's own duration (Spark's `processedRowsPerSecond`:
    /// how fast the job can go).
    pub processed_rows_per_second: f64,
    /// The event-time watermark after the batch (RFC 3339), if the job has event time.
    pub watermark: Option<String>,
    /// Wall clock minus the watermark, in seconds, at commit.
    pub watermark_lag_seconds: Option<f64>,
    /// Per source and partition, offsets available at planning that the batch did not read.
    pub lag: SourceOffsets,
    /// Rows and bytes of operator state after the batch (0 for a stateless job).
    pub state_rows: u64,
    /// Bytes of operator state in memory after the batch.
    pub state_bytes: u64,
    /// The output table's version after the commit.
    pub table_version: Option<i64>,
    /// Per expectation, output rows that failed it.
    pub expectations: BTreeMap<String, u64>,
}

/// What the job is, for the status page.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobDescription {
    /// The job id.
    pub job_id: String,
    /// The sources' names (their SQL tables).
    pub sources: Vec<String>,
    /// The output table.
    pub sink: String,
    /// The trigger, as the job file spells it.
    pub trigger: String,
    /// Interval triggers: the interval; `/healthz` allows three of them between commits.
    #[serde(skip)]
    pub interval: Option<Duration>,
    /// Per expectation, its action (`warn`, `drop`, `quarantine`, `fail`).
    pub expectations: BTreeMap<String, String>,
}

/// A job's progress, shared between the driver and its readers. See the module docs.
#[derive(Debug)]
pub struct Progress {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    job: JobDescription,
    recent: VecDeque<BatchProgress>,
    batches_committed: u64,
    rows_in: BTreeMap<String, u64>,
    rows_out: u64,
    rows_dead_lettered: u64,
    rows_late: u64,
    rows_duplicate: u64,
    expectation_rows: BTreeMap<String, u64>,
    duration: Histogram,
    phases: BTreeMap<String, Histogram>,
    /// Latest consumer lag per source and partition (at the last planning).
    lag: SourceOffsets,
    watermark_micros: Option<i64>,
    last_committed_batch: Option<i64>,
    state_rows: u64,
    state_bytes: u64,
    table_version: Option<i64>,
    commit_conflicts: u64,
    last_error: Option<String>,
    /// When the driver loop last showed it is alive: a plan (with or without a batch) or a
    /// commit.
    alive_at: Option<Instant>,
    committed_at: Option<Instant>,
    /// A bounded run: offsets to read in all, and read so far.
    bounded: Option<(i64, i64)>,
}

#[derive(Debug, Clone)]
struct Histogram {
    buckets: [u64; DURATION_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: [0; DURATION_BUCKETS.len()],
            count: 0,
            sum: 0.0,
        }
    }
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, bucket) in DURATION_BUCKETS.iter().zip(self.buckets.iter_mut()) {
            if seconds <= *bound {
                *bucket += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, count) in DURATION_BUCKETS.iter().zip(self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// What the driver reports when a batch has committed.
#[derive(Debug, Clone)]
pub(crate) struct CommittedBatch {
    pub(crate) batch_id: i64,
    pub(crate) started_at: chrono::DateTime<chrono::Utc>,
    pub(crate) duration: Duration,
    pub(crate) phases: [Duration; 4],
    pub(crate) rows_in: BTreeMap<String, u64>,
    pub(crate) rows_out: u64,
    pub(crate) rows_dead_lettered: u64,
    pub(crate) rows_late: u64,
    pub(crate) rows_duplicate: u64,
    pub(crate) watermark_micros: Option<i64>,
    pub(crate) lag: SourceOffsets,
    pub(crate) state_rows: u64,
    pub(crate) state_bytes: u64,
    pub(crate) table_version: Option<i64>,
    pub(crate) commit_conflicts: u64,
    pub(crate) expectations: BTreeMap<String, u64>,
    /// Offsets the batch read, in all.
    pub(crate) offsets_read: i64,
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new(JobDescription::default())
    }
}

impl Progress {
    /// An empty progress for `job`.
    pub fn new(job: JobDescription) -> Self {
        let state = State {
            rows_in: job.sources.iter().map(|s| (s.clone(), 0)).collect(),
            expectation_rows: job.expectations.keys().map(|e| (e.clone(), 0)).collect(),
            phases: PHASES
                .iter()
                .map(|p| (p.to_string(), Histogram::default()))
                .collect(),
            job,
            ..State::default()
        };
        Progress {
            state: Mutex::new(state),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut state = match self.state.lock() {
            Ok(state) => state,
            // A reader that panicked cannot have left the counters half-written: each update
            // is made under the lock in one go.
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut state)
    }

    /// What the job is.
    pub fn job(&self) -> JobDescription {
        self.with(|s| s.job.clone())
    }

    /// The last [`KEPT_BATCHES`] batches, oldest first.
    pub fn recent(&self) -> Vec<BatchProgress> {
        self.with(|s| s.recent.iter().cloned().collect())
    }

    /// The error that stopped the job, if it stopped with one.
    pub fn last_error(&self) -> Option<String> {
        self.with(|s| s.last_error.clone())
    }

    /// A bounded run (`available-now`, backfill): offsets read so far and in all.
    pub fn bounded(&self) -> Option<(i64, i64)> {
        self.with(|s| s.bounded.map(|(total, done)| (done, total)))
    }

    /// Whether the driver loop shows signs of life: it planned, finished a step of a batch, or
    /// committed within the allowance — three trigger intervals, or three times the slowest
    /// recent batch if that is longer (a bounded run: at least 30 s). `Err` says why not.
    pub fn health(&self) -> std::result::Result<(), String> {
        self.with(|s| {
            if let Some(error) = &s.last_error {
                return Err(format!("the job stopped: {error}"));
            }
            let slowest = s
                .recent
                .iter()
                .map(|b| b.duration_ms)
                .fold(0.0_f64, f64::max);
            let slowest = Duration::from_secs_f64(slowest * 3.0 / 1000.0);
            let allowance = match s.job.interval {
                Some(interval) => (interval * 3).max(slowest),
                None => slowest.max(Duration::from_secs(30)),
            };
            match s.alive_at {
                None => Ok(()),
                Some(at) if at.elapsed() <= allowance => Ok(()),
                Some(at) => Err(format!(
                    "no batch planned or committed for {:.1} s (allowed: {:.1} s)",
                    at.elapsed().as_secs_f64(),
                    allowance.as_secs_f64()
                )),
            }
        })
    }

    /// The driver started, or finished a step of a batch: it counts as alive from now.
    pub(crate) fn alive(&self) {
        self.with(|s| s.alive_at = Some(Instant::now()));
    }

    /// The driver planned (whether or not there was anything to read): `lag` is what the
    /// sources had beyond the committed offsets.
    pub(crate) fn planned(&self, lag: SourceOffsets) {
        self.with(|s| {
            s.alive_at = Some(Instant::now());
            s.lag.extend(lag);
        });
    }

    /// A bounded run (or one pass of a backfill) starts: `total` offsets to read.
    pub(crate) fn bounded_run(&self, total: i64) {
        self.with(|s| s.bounded = Some((total, 0)));
    }

    /// A backfill read `offsets` more of its pass.
    pub(crate) fn advanced(&self, offsets: i64) {
        self.with(|s| {
            if let Some((_, done)) = &mut s.bounded {
                *done += offsets;
            }
        });
    }

    /// The job stopped with `error`.
    pub(crate) fn failed(&self, error: &str) {
        self.with(|s| s.last_error = Some(error.to_string()));
    }

    /// A batch committed.
    pub(crate) fn committed(&self, batch: CommittedBatch) {
        let now = Instant::now();
        let committed_at = chrono::Utc::now();
        self.with(|s| {
            let rows_in: u64 = batch.rows_in.values().sum();
            let seconds = batch.duration.as_secs_f64();
            let since_last = s
                .committed_at
                .map_or(seconds, |at| now.duration_since(at).as_secs_f64());
            let per_second = |secs: f64| {
                if secs > 0.0 {
                    rows_in as f64 / secs
                } else {
                    0.0
                }
            };
            let watermark_lag = batch
                .watermark_micros
                .map(|w| ((committed_at.timestamp_micros() - w) as f64 / 1e6).max(0.0));
            let record = BatchProgress {
                batch_id: batch.batch_id,
                started_at: batch.started_at.to_rfc3339(),
                committed_at: committed_at.to_rfc3339(),
                duration_ms: seconds * 1e3,
                phase_ms: PHASES
                    .iter()
                    .zip(batch.phases)
                    .map(|(p, d)| (p.to_string(), d.as_secs_f64() * 1e3))
                    .collect(),
                rows_in: batch.rows_in.clone(),
                rows_out: batch.rows_out,
                rows_dead_lettered: batch.rows_dead_lettered,
                rows_late: batch.rows_late,
                rows_duplicate: batch.rows_duplicate,
                input_rows_per_second: per_second(since_last),
                processed_rows_per_second: per_second(seconds),
                watermark: batch
                    .watermark_micros
                    .and_then(chrono::DateTime::from_timestamp_micros)
                    .map(|w| w.to_rfc3339()),
                watermark_lag_seconds: watermark_lag,
                lag: batch.lag.clone(),
                state_rows: batch.state_rows,
                state_bytes: batch.state_bytes,
                table_version: batch.table_version,
                expectations: batch.expectations.clone(),
            };
            if s.recent.len() == KEPT_BATCHES {
                s.recent.pop_front();
            }
            s.recent.push_back(record);
            s.batches_committed += 1;
            for (source, rows) in batch.rows_in {
                *s.rows_in.entry(source).or_default() += rows;
            }
            s.rows_out += batch.rows_out;
            s.rows_dead_lettered += batch.rows_dead_lettered;
            s.rows_late += batch.rows_late;
            s.rows_duplicate += batch.rows_duplicate;
            for (expectation, rows) in batch.expectations {
                *s.expectation_rows.entry(expectation).or_default() += rows;
            }
            s.duration.observe(seconds);
            for (phase, d) in PHASES.iter().zip(batch.phases) {
                s.phases
                    .entry(phase.to_string())
                    .or_default()
                    .observe(d.as_secs_f64());
            }
            s.lag.extend(batch.lag);
            s.watermark_micros = batch.watermark_micros;
            s.last_committed_batch = Some(batch.batch_id);
            s.state_rows = batch.state_rows;
            s.state_bytes = batch.state_bytes;
            s.table_version = batch.table_version.or(s.table_version);
            s.commit_conflicts = batch.commit_conflicts;
            s.alive_at = Some(now);
            s.committed_at = Some(now);
            if let Some((_, done)) = &mut s.bounded {
                *done += batch.offsets_read;
            }
        });
    }

    /// Every metric in Prometheus' text exposition format, labelled with the job id. Every
    /// family is present from the first scrape (at 0 until something happens).
    pub fn render_prometheus(&self) -> String {
        self.with(|s| {
            let job = escape(&s.job.job_id);
            let mut out = String::new();
            let family = |out: &mut String, name: &str, kind: &str, help: &str| {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} {kind}");
            };
            let sample = |out: &mut String, name: &str, labels: &str, value: f64| {
                let sep = if labels.is_empty() { "" } else { "," };
                let _ = writeln!(out, "{name}{{job=\"{job}\"{sep}{labels}}} {value}");
            };
            family(
                &mut out,
                "sluice_batches_committed_total",
                "counter",
                "Micro-batches committed by this process.",
            );
            sample(
                &mut out,
                "sluice_batches_committed_total",
                "",
                s.batches_committed as f64,
            );
            family(
                &mut out,
                "sluice_rows_in_total",
                "counter",
                "Rows read from each source by committed batches.",
            );
            for (source, rows) in &s.rows_in {
                sample(
                    &mut out,
                    "sluice_rows_in_total",
                    &format!("source=\"{}\"", escape(source)),
                    *rows as f64,
                );
            }
            for (name, help, value) in [
                (
                    "sluice_rows_out_total",
                    "Rows committed to the output table.",
                    s.rows_out,
                ),
                (
                    "sluice_rows_dead_lettered_total",
                    "Rows committed to the dead-letter table (quarantined rows included).",
                    s.rows_dead_lettered,
                ),
                (
                    "sluice_rows_late_total",
                    "Rows committed to the late table.",
                    s.rows_late,
                ),
                (
                    "sluice_rows_duplicate_total",
                    "Rows a deduplication left out as duplicates of a key already written.",
                    s.rows_duplicate,
                ),
                (
                    "sluice_commit_conflicts_total",
                    "Commits retried because a concurrent writer committed first.",
                    s.commit_conflicts,
                ),
            ] {
                family(&mut out, name, "counter", help);
                sample(&mut out, name, "", value as f64);
            }
            family(
                &mut out,
                "sluice_batch_duration_seconds",
                "histogram",
                "Wall time of committed batches.",
            );
            s.duration.render(
                &mut out,
                "sluice_batch_duration_seconds",
                &format!("job=\"{job}\""),
            );
            family(
                &mut out,
                "sluice_batch_phase_seconds",
                "histogram",
                "Wall time of each phase of committed batches (read, execute, state, commit).",
            );
            for (phase, histogram) in &s.phases {
                histogram.render(
                    &mut out,
                    "sluice_batch_phase_seconds",
                    &format!("job=\"{job}\",phase=\"{phase}\""),
                );
            }
            let watermark_lag = s.watermark_micros.map_or(0.0, |w| {
                ((chrono::Utc::now().timestamp_micros() - w) as f64 / 1e6).max(0.0)
            });
            for (name, help, value) in [
                (
                    "sluice_watermark_lag_seconds",
                    "Wall clock minus the event-time watermark (0 before the first watermark).",
                    watermark_lag,
                ),
                (
                    "sluice_last_committed_batch",
                    "Id of the last batch committed (0 before the first too: see \
                     sluice_batches_committed_total).",
                    s.last_committed_batch.map_or(0.0, |b| b as f64),
                ),
                (
                    "sluice_state_rows",
                    "Rows of operator state after the last batch.",
                    s.state_rows as f64,
                ),
                (
                    "sluice_state_bytes",
                    "Bytes of operator state in memory after the last batch.",
                    s.state_bytes as f64,
                ),
                (
                    "sluice_table_version",
                    "The output table's version after the last commit (0 before the first).",
                    s.table_version.map_or(0.0, |v| v as f64),
                ),
            ] {
                family(&mut out, name, "gauge", help);
                sample(&mut out, name, "", value);
            }
            family(
                &mut out,
                "sluice_source_lag",
                "gauge",
                "Offsets (files source: files) available at the last look that the job has not \
                 committed: seen at planning, then after each commit.",
            );
            for (source, parts) in &s.lag {
                for (partition, lag) in parts {
                    sample(
                        &mut out,
                        "sluice_source_lag",
                        &format!(
                            "source=\"{}\",partition=\"{}\"",
                            escape(source),
                            escape(partition)
                        ),
                        *lag as f64,
                    );
                }
            }
            if !s.job.expectations.is_empty() {
                family(
                    &mut out,
                    "sluice_expectation_rows_total",
                    "counter",
                    "Output rows that failed each expectation, by its action.",
                );
                for (expectation, action) in &s.job.expectations {
                    let rows = s.expectation_rows.get(expectation).copied().unwrap_or(0);
                    sample(
                        &mut out,
                        "sluice_expectation_rows_total",
                        &format!(
                            "expectation=\"{}\",action=\"{}\"",
                            escape(expectation),
                            escape(action)
                        ),
                        rows as f64,
                    );
                }
            }
            out
        })
    }
}

/// A label value as Prometheus' text format wants it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(id: i64, rows: u64) -> CommittedBatch {
        CommittedBatch {
            batch_id: id,
            started_at: chrono::Utc::now(),
            duration: Duration::from_millis(30),
            phases: [Duration::from_millis(10); 4],
            rows_in: BTreeMap::from([("clicks".to_string(), rows)]),
            rows_out: rows - 1,
            rows_dead_lettered: 1,
            rows_late: 0,
            rows_duplicate: 0,
            watermark_micros: None,
            lag: SourceOffsets::new(),
            state_rows: 0,
            state_bytes: 0,
            table_version: Some(id + 1),
            commit_conflicts: 0,
            expectations: BTreeMap::new(),
            offsets_read: 1,
        }
    }

    #[test]
    fn every_family_is_exported_from_the_start_and_counters_add_up() {
        let progress = Progress::new(JobDescription {
            job_id: "clicks".into(),
            sources: vec!["clicks".into()],
            ..JobDescription::default()
        });
        let text = progress.render_prometheus();
        for family in [
            "sluice_batches_committed_total{job=\"clicks\"} 0",
            "sluice_rows_in_total{job=\"clicks\",source=\"clicks\"} 0",
            "sluice_batch_duration_seconds_count{job=\"clicks\"} 0",
            "sluice_batch_phase_seconds_count{job=\"clicks\",phase=\"read\"} 0",
            "sluice_last_committed_batch{job=\"clicks\"} 0",
            "# TYPE sluice_source_lag gauge",
        ] {
            assert!(text.contains(family), "{family} missing from\n{text}");
        }
        progress.committed(batch(0, 10));
        progress.committed(batch(1, 5));
        let text = progress.render_prometheus();
        for line in [
            "sluice_batches_committed_total{job=\"clicks\"} 2",
            "sluice_rows_in_total{job=\"clicks\",source=\"clicks\"} 15",
            "sluice_rows_out_total{job=\"clicks\"} 13",
            "sluice_rows_dead_lettered_total{job=\"clicks\"} 2",
            "sluice_batch_duration_seconds_bucket{job=\"clicks\",le=\"0.05\"} 2",
            "sluice_batch_duration_seconds_bucket{job=\"clicks\",le=\"0.025\"} 0",
            "sluice_last_committed_batch{job=\"clicks\"} 1",
            "sluice_table_version{job=\"clicks\"} 2",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert_eq!(progress.recent().len(), 2);
    }

    #[test]
    fn only_the_last_batches_are_kept() {
        let progress = Progress::default();
        for id in 0..(KEPT_BATCHES as i64 + 5) {
            progress.committed(batch(id, 2));
        }
        let recent = progress.recent();
        assert_eq!(recent.len(), KEPT_BATCHES);
        assert_eq!(recent[0].batch_id, 5);
    }
}
