//! Reconciliation: the streamed output over a closed event-time period must equal a batch
//! recomputation of the same query over the raw events of that period.
//!
//! The recomputation reads every offset the job's committed batches read (from each partition's
//! starting offset to the end offsets of the last committed batch's manifest), keeps the rows
//! whose event time falls in `[from, to)`, and runs the job's SQL over them as **one** batch. The
//! output side is the output table's rows whose event-time column falls in the same period. The
//! two are compared as multisets: rows are grouped by their lineage (`_source_partition`,
//! `_source_offset`) when the output carries it, equal rows match, and leftover rows of a group
//! are paired as *different* (equal if every number agrees within 1e-9 relative) or reported
//! as *missing* (recomputed, not in the table) or *extra* (in the table, not recomputed).
//!
//! A **windowed** job is compared on its windows: the output rows whose `window_start` (or
//! `window_end`) lies in the period, against the query run once over every raw event of those
//! windows with every window finished — minus the late rows for the windows they missed. A late
//! row (in the late table with the watermark it met) is replayed under that watermark, so it
//! counts in exactly the windows that were still open, as it did in the stream. Every window of
//! the period must be closed under the job's watermark; an open one is refused by name.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::compute::kernels::cast;
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use arrow::row::{RowConverter, SortField};
use serde_json::Value;

use crate::checkpoint::{BatchManifest, CheckpointStore};
use crate::driver::{OpenedJob, open_job};
use crate::error::{Error, Result};
use crate::event_time::rows_in_period;
use crate::expectations::Expectations;
use crate::input::{FutureTimes, OpenSource, read_source_as_opened};
use crate::job::Job;
use crate::late::WATERMARK;
use crate::offsets::{BatchId, OffsetRange, PartitionId};
use crate::query::StreamingQuery;
use crate::sink::{Sink, TableScan};
use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};
use crate::static_table::TablesAtVersions;
use crate::watermark::display_watermark;
use crate::window::{WINDOW_END, WINDOW_START, WindowKind};

/// How a windowed job's reconcile treats late rows.
const WINDOW_LATE: &str = "replayed under the watermark they met, so they count only in the \
                           windows that were still open";
/// How a stream join's reconcile treats late rows.
const JOIN_LATE: &str = "left out of the recomputation: in the stream they joined nothing";

/// How far apart two floats may be (relative) and still count as equal.
pub const FLOAT_TOLERANCE: f64 = 1e-9;

/// How far apart the values of approximate aggregates (`approx_percentile_cont`,
/// `approx_median`: t-digests, whose merge depends on how rows were split into batches) may be
/// and still count as equal. `approx_distinct`'s HyperLogLog merges exactly.
pub const APPROX_TOLERANCE: f64 = 0.02;

/// What [`Job::reconcile`] found.
#[derive(Debug, Clone)]
pub struct Reconciliation {
    /// The event-time column the period applies to (empty: the whole table was compared, as
    /// its rows carry no event time).
    pub column: String,
    /// The last batch the job committed; the recomputation reads what batches up to it read.
    pub last_batch: BatchId,
    /// Rows the batch recomputation produced for the period.
    pub expected_rows: usize,
    /// Rows of the output table in the period.
    pub table_rows: usize,
    /// Windowed jobs: late rows of the period's windows (in the late table), replayed under the
    /// watermark they met, so they count only in the windows that were open.
    pub late_rows: usize,
    /// How the recomputation treated the late rows, for the report.
    pub late_treatment: &'static str,
    /// How the two sides compare.
    pub diff: RowDiff,
}

/// Two multisets of rows compared.
#[derive(Debug, Clone, Default)]
pub struct RowDiff {
    /// Rows found on both sides.
    pub matching: usize,
    /// Recomputed rows the table lacks (as JSON).
    pub missing: Vec<String>,
    /// Table rows the recomputation did not produce (as JSON).
    pub extra: Vec<String>,
    /// Pairs (recomputed, in the table) with the same lineage but different values.
    pub different: Vec<(String, String)>,
}

impl RowDiff {
    /// Missing + extra + different rows; 0 means the two sides agree.
    pub fn differences(&self) -> usize {
        self.missing.len() + self.extra.len() + self.different.len()
    }
}

impl Job {
    /// Recomputes the job's query over the raw events of `[from, to)` (µs since the epoch) and
    /// compares the result with the output table. Writes nothing.
    ///
    /// A stateless job's period is its rows' event time; a windowed job's is the window start
    /// (or end, whichever the output has), and every window in it must be closed.
    ///
    /// # Errors
    /// If the period is empty or has open windows, a source has no event time, the output does
    /// not carry the period's column, the job has committed nothing, or reading fails.
    pub async fn reconcile(mut self, from: i64, to: i64) -> Result<Reconciliation> {
        if from >= to {
            return Err(Error::InvalidJob(
                "reconcile: the period is empty (--from-time must be before --to-time)".into(),
            ));
        }
        let OpenedJob {
            checkpoint,
            settings,
            sources,
            tables,
            query,
        } = open_job(&mut self, false).await?;
        // Each row joins the static tables at the version its streamed batch joined.
        let tables = TablesAtVersions::open(tables, &checkpoint, true).await?;
        // The stream left out the rows its expectations dropped or quarantined; so does the
        // recomputation.
        let expectations = Expectations::plan(
            &self.expectations,
            &query.output_schema(),
            &settings.functions,
        )?;
        let last_batch = self.sink.committed_batch(&self.id).await?.ok_or_else(|| {
            Error::InvalidJob(format!(
                "reconcile: job '{}' has committed nothing to {} yet",
                self.id,
                self.sink.location()
            ))
        })?;
        let manifest =
            checkpoint
                .read_manifest(last_batch)
                .await?
                .ok_or_else(|| Error::MissingManifest {
                    job_id: self.id.clone(),
                    batch_id: last_batch,
                    path: checkpoint.manifest_location(last_batch),
                })?;
        let mut future = BTreeMap::new();
        for s in &sources {
            let judged = FutureTimes::as_recorded_by(self.sink.as_ref(), &s.name).await?;
            future.insert(s.name.clone(), judged);
        }
        let committed = Committed {
            sources: &sources,
            manifest: &manifest,
            future: &future,
        };
        if query.deduplicates() {
            return reconcile_deduplication(
                self.sink.as_ref(),
                &checkpoint,
                committed,
                query,
                &tables,
                &expectations,
                from,
                to,
            )
            .await;
        }
        if query.aggregates_a_join() {
            return reconcile_join_aggregate(
                self.sink.as_ref(),
                committed,
                query,
                &tables,
                &expectations,
                settings.state_ttl,
            )
            .await;
        }
        if query.joins_streams() {
            return reconcile_join(
                self.sink.as_ref(),
                committed,
                query,
                &tables,
                &expectations,
                from,
                to,
            )
            .await;
        }
        if query.is_stateful() {
            return reconcile_windows(
                self.sink.as_ref(),
                committed,
                query,
                &tables,
                &expectations,
                from,
                to,
            )
            .await;
        }
        let mut query = query;
        let mut columns = BTreeSet::new();
        for s in &sources {
            let time = s.event_time.as_ref().ok_or_else(|| {
                Error::in_source(
                    &s.name,
                    "reconcile compares event-time periods, and this source has no event_time",
                )
            })?;
            columns.insert(time.column.clone());
        }
        let column = match columns.len() {
            1 => columns.into_iter().next().unwrap_or_default(),
            _ => {
                return Err(Error::InvalidJob(format!(
                    "reconcile: the sources name different event-time columns ({}); it needs one",
                    columns.into_iter().collect::<Vec<_>>().join(", ")
                )));
            }
        };
        let output_schema = query.output_schema();
        if output_schema.index_of(&column).is_err() {
            return Err(Error::InvalidJob(format!(
                "reconcile: the query's output has no column '{column}' (the event time), so its \
                 rows cannot be assigned to a period; select it in the query"
            )));
        }

        // The batch recomputation: every committed offset, the period's rows, one query run.
        let mut inputs = BTreeMap::new();
        for s in &sources {
            inputs.insert(s.name.clone(), committed.read(s, from, to).await?);
        }
        let recomputed = tables
            .execute_bounded(&mut query, vec![(inputs, None)])
            .await?;
        let recomputed = expectations.apply(recomputed.batches)?.kept;
        let expected = concat_batches(&output_schema, &recomputed)?;

        // The streamed output of the same period, in the same column types.
        let table = conform(&output_schema, &self.sink.read_output().await?)?;
        let actual = rows_in_period(&table, &column, from, to)?;

        Ok(Reconciliation {
            column,
            last_batch,
            expected_rows: expected.num_rows(),
            table_rows: actual.num_rows(),
            late_rows: 0,
            late_treatment: "",
            diff: compare(
                &expected,
                &actual,
                &lineage_key(&output_schema),
                &BTreeSet::new(),
            )?,
        })
    }
}

/// What the job's committed batches read.
#[derive(Clone, Copy)]
struct Committed<'a> {
    sources: &'a [OpenSource],
    manifest: &'a BatchManifest,
    /// Per source, the rows the live job judged too far ahead: left out again.
    future: &'a BTreeMap<String, FutureTimes>,
}

impl Committed<'_> {
    /// The rows of `s` the committed batches read whose event time is in `[from, to)`.
    async fn read(&self, s: &OpenSource, from: i64, to: i64) -> Result<RecordBatch> {
        let time = s.event_time.as_ref().ok_or_else(|| {
            Error::in_source(
                &s.name,
                "reconcile compares event-time periods, and this source has no event_time",
            )
        })?;
        let ends = self.manifest.end_offsets.get(&s.name);
        let ranges: BTreeMap<PartitionId, OffsetRange> = s
            .source
            .available()
            .await?
            .into_iter()
            .filter_map(|(p, a)| {
                let end = *ends?.get(&p)?;
                Some((p, OffsetRange::new(a.initial, end.max(a.initial))))
            })
            .collect();
        let future = self
            .future
            .get(&s.name)
            .ok_or_else(|| Error::in_source(&s.name, "no recorded judgement of its event times"))?;
        let (rows, _dead_letters) = read_source_as_opened(s, &ranges, future).await?;
        rows_in_period(&rows, &time.column, from, to)
    }
}

/// Reconciles a windowed job: the windows starting (or ending) in `[from, to)`, recomputed in
/// one bounded run over every raw event they hold, minus the late rows for the windows they
/// missed, against the table's rows of those windows.
async fn reconcile_windows(
    sink: &dyn Sink,
    committed: Committed<'_>,
    mut query: StreamingQuery,
    tables: &TablesAtVersions,
    expectations: &Expectations,
    from: i64,
    to: i64,
) -> Result<Reconciliation> {
    let (window, lateness) = query.window().map(|(w, l)| (w.clone(), l)).ok_or_else(|| {
        Error::InvalidJob(
            "reconcile compares closed event-time periods, and a running aggregate (no \
                 window) has none: each group's value keeps changing"
                .into(),
        )
    })?;
    let output_schema = query.output_schema();
    let column = [WINDOW_START, WINDOW_END]
        .into_iter()
        .find(|c| output_schema.index_of(c).is_ok())
        .ok_or_else(|| {
            Error::InvalidJob(
                "reconcile: the query's output has neither window_start nor window_end, so its \
                 rows cannot be assigned to a period; select one of them"
                    .into(),
            )
        })?;
    // Every window in the period must be closed, or the table cannot hold it yet. (A session's
    // end is known only from the data: sessions still open are left out of both sides below.)
    // A window join's sides may differ in size (their ends are equal): the larger decides
    // which events can fall in the period's windows.
    let size = query
        .windowed_sources()
        .iter()
        .map(|(w, _)| w.kind.size())
        .max()
        .unwrap_or(window.kind.size());
    let sessions = matches!(window.kind, WindowKind::Session { .. });
    let (first, last) = match column {
        WINDOW_START => (from, to - 1),
        _ => (from.saturating_sub(size), (to - 1).saturating_sub(size)),
    };
    let watermark = committed.manifest.watermark_micros;
    // Each window kind's last window in the period (a window join's sides may differ).
    for (kind, lateness) in query
        .windowed_sources()
        .iter()
        .map(|(w, l)| (w.kind, *l))
        .filter(|_| !sessions)
    {
        let last = match column {
            WINDOW_START => to - 1,
            _ => (to - 1).saturating_sub(kind.size()),
        };
        let last_start = kind.starts(last).last().copied().unwrap_or(last);
        if !watermark.is_some_and(|wm| lateness.is_closed(last_start, wm)) {
            return Err(Error::InvalidJob(format!(
                "reconcile: the period is not closed yet: the window starting at {} closes when \
                 the watermark passes its end plus the allowed lateness, and the job's watermark \
                 is {}; pick an earlier --to-time",
                display_watermark(Some(last_start)),
                display_watermark(watermark),
            )));
        }
    }
    // The events of the windows overlapping the period; for sessions, which can span any
    // length, every committed event. A window join's two sources alike: their windows close
    // together.
    let (lo, hi) = if sessions {
        (i64::MIN, i64::MAX)
    } else {
        (first.saturating_sub(size), last.saturating_add(size) + 1)
    };
    let late_table = sink.read_late(&TableScan::all()).await?;
    let mut on_time = BTreeMap::new();
    // Late rows of those events, grouped by the watermark they met: replayed under it.
    let mut late_by_watermark: BTreeMap<i64, BTreeMap<String, Vec<RecordBatch>>> = BTreeMap::new();
    let mut late_rows = 0;
    for (window, _) in query.windowed_sources() {
        let source = committed
            .sources
            .iter()
            .find(|s| s.name == window.source)
            .ok_or_else(|| Error::in_source(&window.source, "not among the job's sources"))?;
        let raw = committed.read(source, lo, hi).await?;
        let mut late_all = Vec::new();
        for b in &late_table {
            let b = if query.joins_windows() {
                of_source(b, &source.name)?
            } else {
                b.clone()
            };
            let watermarks = b
                .column_by_name(WATERMARK)
                .map(|c| cast::cast(c, &DataType::Int64))
                .transpose()?
                .ok_or_else(|| {
                    Error::InvalidJob("reconcile: the late table has no _watermark column".into())
                })?;
            let rows = conform(&source.schema, std::slice::from_ref(&b))?;
            let times = rows
                .column_by_name(&window.time_column)
                .map(|c| cast::cast(c, &DataType::Int64))
                .transpose()?
                .ok_or_else(|| Error::InvalidJob("reconcile: late rows lack event time".into()))?;
            let (watermarks, times) = (
                watermarks.as_primitive::<Int64Type>(),
                times.as_primitive::<Int64Type>(),
            );
            for i in 0..rows.num_rows() {
                if (lo..hi).contains(&times.value(i)) {
                    late_rows += 1;
                    late_all.push(rows.slice(i, 1));
                    late_by_watermark
                        .entry(watermarks.value(i))
                        .or_default()
                        .entry(source.name.clone())
                        .or_default()
                        .push(rows.slice(i, 1));
                }
            }
        }
        on_time.insert(source.name.clone(), multiset_minus(&raw, &late_all)?);
    }
    let mut parts = vec![(on_time, None)];
    for (wm, by_source) in late_by_watermark {
        let mut inputs = BTreeMap::new();
        for (name, rows) in by_source {
            let schema = rows[0].schema();
            inputs.insert(name, concat_batches(&schema, &rows)?);
        }
        parts.push((inputs, Some(wm)));
    }
    let recomputed = tables.execute_bounded(&mut query, parts).await?;
    let recomputed = expectations.apply(recomputed.batches)?.kept;
    let expected = concat_batches(&output_schema, &recomputed)?;
    let mut expected = rows_in_period(&expected, column, from, to)?;
    if sessions {
        // Only sessions closed under the job's watermark are final (and in the table).
        let ends = expected
            .column_by_name(WINDOW_END)
            .ok_or_else(|| {
                Error::InvalidJob(
                    "reconcile: a session job's output must have window_end, to tell closed \
                     sessions from open ones"
                        .into(),
                )
            })?
            .clone();
        let ends = cast::cast(&ends, &DataType::Int64)?;
        let wm = watermark.unwrap_or(i64::MIN);
        let closed: BooleanArray = ends
            .as_primitive::<Int64Type>()
            .iter()
            .map(|e| e.map(|e| e.saturating_add(lateness.allowed_lateness) <= wm))
            .collect();
        expected = filter_record_batch(&expected, &closed)?;
    }
    let table = conform(&output_schema, &sink.read_output().await?)?;
    let actual = rows_in_period(&table, column, from, to)?;
    Ok(Reconciliation {
        column: column.to_string(),
        last_batch: committed.manifest.batch_id,
        expected_rows: expected.num_rows(),
        table_rows: actual.num_rows(),
        late_rows,
        late_treatment: WINDOW_LATE,
        diff: compare(&expected, &actual, &[column], &query.approximate_columns())?,
    })
}

/// Reconciles a deduplicating job. Which row of a key is first depends on the order rows
/// arrived in and on the watermark each batch ran under (a key is forgotten `state_ttl` after
/// its first event; a row that old is late), so the recomputation replays every committed
/// batch's rows in order under the watermark it ran with — taken from the batches' manifests —
/// and compares the output rows whose event time falls in `[from, to)`.
#[allow(clippy::too_many_arguments)]
async fn reconcile_deduplication(
    sink: &dyn Sink,
    checkpoint: &CheckpointStore,
    committed: Committed<'_>,
    mut query: StreamingQuery,
    tables: &TablesAtVersions,
    expectations: &Expectations,
    from: i64,
    to: i64,
) -> Result<Reconciliation> {
    let last_batch = committed.manifest.batch_id;
    let output_schema = query.output_schema();
    let source_name = query.late_source().unwrap_or_default().to_string();
    let source = committed
        .sources
        .iter()
        .find(|s| s.name == source_name)
        .ok_or_else(|| Error::in_source(&source_name, "not among the job's sources"))?;
    let column = source
        .event_time
        .as_ref()
        .map(|t| t.column.clone())
        .unwrap_or_default();
    if output_schema.index_of(&column).is_err() {
        return Err(Error::InvalidJob(format!(
            "reconcile: the query's output has no column '{column}' (the event time), so its \
             rows cannot be assigned to a period; select it in the query"
        )));
    }
    // Every batch's end offsets and the watermark it ran under (the one before it).
    let mut batches = Vec::new();
    for id in 0..=last_batch.0 {
        let manifest = checkpoint
            .read_manifest(BatchId(id))
            .await?
            .ok_or_else(|| {
                Error::InvalidJob(format!(
                    "reconcile of a deduplicating job replays every committed batch under the \
                     watermark it ran with, and the manifest of batch {id} is gone ({}): the \
                     checkpoint keeps the last [job] keep_batches batches (default 10), so a \
                     deduplicating job to be reconciled must keep every batch from its start",
                    checkpoint.manifest_location(BatchId(id))
                ))
            })?;
        batches.push(manifest);
    }
    let raw = committed.read(source, i64::MIN, i64::MAX).await?;
    let parts = rows_by_batch(&raw, &source.name, &batches)?
        .into_iter()
        .enumerate()
        .map(|(b, rows)| {
            let before = b.checked_sub(1).and_then(|p| batches[p].watermark_micros);
            (BTreeMap::from([(source.name.clone(), rows)]), before)
        })
        .collect();
    let recomputed = tables.execute_bounded(&mut query, parts).await?;
    let recomputed = expectations.apply(recomputed.batches)?.kept;
    let expected = concat_batches(&output_schema, &recomputed)?;
    let expected = rows_in_period(&expected, &column, from, to)?;
    let table = conform(&output_schema, &sink.read_output().await?)?;
    let actual = rows_in_period(&table, &column, from, to)?;
    Ok(Reconciliation {
        column,
        last_batch,
        expected_rows: expected.num_rows(),
        table_rows: actual.num_rows(),
        late_rows: 0,
        late_treatment: "",
        diff: compare(
            &expected,
            &actual,
            &lineage_key(&output_schema),
            &BTreeSet::new(),
        )?,
    })
}

/// Reconciles a job joining two streams. Its streamed output is the SQL join of every row that
/// was not late (a late row — in the late table — joined nothing), whatever the batches were:
/// so the recomputation runs the query once over every committed row of both sources minus the
/// late rows, and compares the output rows whose event time falls in `[from, to)` (a pair's
/// other row may lie outside the period).
async fn reconcile_join(
    sink: &dyn Sink,
    committed: Committed<'_>,
    mut query: StreamingQuery,
    tables: &TablesAtVersions,
    expectations: &Expectations,
    from: i64,
    to: i64,
) -> Result<Reconciliation> {
    let output_schema = query.output_schema();
    let mut columns = BTreeSet::new();
    for s in committed.sources {
        if let Some(time) = &s.event_time {
            columns.insert(time.column.clone());
        }
    }
    let column = columns
        .iter()
        .find(|c| output_schema.index_of(c).is_ok())
        .cloned()
        .ok_or_else(|| {
            Error::InvalidJob(format!(
                "reconcile: the query's output has no event-time column ({}), so its rows \
                 cannot be assigned to a period; select one in the query",
                columns.into_iter().collect::<Vec<_>>().join(" or ")
            ))
        })?;
    let (inputs, late_rows, _) = join_inputs(sink, committed).await?;
    let expected = recompute_join(&mut query, tables, expectations, inputs, committed).await?;
    let expected = rows_in_period(&expected, &column, from, to)?;
    let table = conform(&output_schema, &sink.read_output().await?)?;
    let actual = rows_in_period(&table, &column, from, to)?;
    Ok(Reconciliation {
        column,
        last_batch: committed.manifest.batch_id,
        expected_rows: expected.num_rows(),
        table_rows: actual.num_rows(),
        late_rows,
        late_treatment: JOIN_LATE,
        diff: compare(&expected, &actual, &[], &BTreeSet::new())?,
    })
}

/// Reconciles a join of two streams feeding a running aggregate (Nexmark q4). Its rows carry
/// no event time (the aggregate's time is when the join emitted to it), so the whole table —
/// one row per group, upserted — is compared with the query run once over every committed row
/// of both sources minus the late rows, then the job's watermark (as [`reconcile_join`]), every
/// group finished. That holds while no group has expired: a group is forgotten once the
/// watermark is `state_ttl` past the batch that last fed it, and no batch emits under a
/// watermark below the earliest event read minus the largest `max_out_of_orderness`; so a
/// run whose watermark went further than `state_ttl` past that is refused.
async fn reconcile_join_aggregate(
    sink: &dyn Sink,
    committed: Committed<'_>,
    mut query: StreamingQuery,
    tables: &TablesAtVersions,
    expectations: &Expectations,
    state_ttl: Option<std::time::Duration>,
) -> Result<Reconciliation> {
    let output_schema = query.output_schema();
    let (inputs, late_rows, earliest) = join_inputs(sink, committed).await?;
    let micros = |d: std::time::Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    let out_of_orderness = committed
        .sources
        .iter()
        .filter_map(|s| s.event_time.as_ref())
        .map(|t| micros(t.max_out_of_orderness))
        .max()
        .unwrap_or(0);
    if let (Some(watermark), Some(earliest), Some(ttl)) = (
        committed.manifest.watermark_micros,
        earliest,
        state_ttl.map(micros),
    ) && watermark.saturating_sub(ttl) >= earliest.saturating_sub(out_of_orderness)
    {
        return Err(Error::InvalidJob(format!(
            "reconcile: the job aggregates a join's output, and its watermark ({}) is \
             state_ttl or more past the earliest event read ({}) minus the largest \
             max_out_of_orderness ({} s): a group may have expired and started over, so the \
             table need not equal a recomputation over every row; such a job reconciles \
             while its watermark is less than state_ttl past its start",
            display_watermark(Some(watermark)),
            display_watermark(Some(earliest)),
            out_of_orderness / 1_000_000,
        )));
    }
    let expected = recompute_join(&mut query, tables, expectations, inputs, committed).await?;
    let actual = conform(&output_schema, &sink.read_output().await?)?;
    Ok(Reconciliation {
        column: String::new(),
        last_batch: committed.manifest.batch_id,
        expected_rows: expected.num_rows(),
        table_rows: actual.num_rows(),
        late_rows,
        late_treatment: JOIN_LATE,
        diff: compare(&expected, &actual, &[], &query.approximate_columns())?,
    })
}

/// A join's recomputation: `inputs` (see [`join_inputs`]) at once, then the job's watermark —
/// a preserved side's rows it let go unmatched are emitted, as the stream emitted them, and the
/// keys it closed; those it still holds are not yet — then, for a chain, every group finished.
async fn recompute_join(
    query: &mut StreamingQuery,
    tables: &TablesAtVersions,
    expectations: &Expectations,
    inputs: BTreeMap<String, RecordBatch>,
    committed: Committed<'_>,
) -> Result<RecordBatch> {
    let parts = vec![
        (inputs, None),
        (BTreeMap::new(), committed.manifest.watermark_micros),
    ];
    let recomputed = tables.execute_bounded(query, parts).await?;
    let recomputed = expectations.apply(recomputed.batches)?.kept;
    Ok(concat_batches(&query.output_schema(), &recomputed)?)
}

/// What a join's recomputation reads: every committed row of each source minus its late rows
/// (in the late table, under `_source`), how many late rows there were, and the earliest event
/// time read (late rows included).
async fn join_inputs(
    sink: &dyn Sink,
    committed: Committed<'_>,
) -> Result<(BTreeMap<String, RecordBatch>, usize, Option<i64>)> {
    let late_table = sink.read_late(&TableScan::all()).await?;
    let mut inputs = BTreeMap::new();
    let mut late_rows = 0;
    let mut earliest: Option<i64> = None;
    for s in committed.sources {
        let raw = committed.read(s, i64::MIN, i64::MAX).await?;
        if let Some(time) = &s.event_time {
            earliest = earliest_time(&raw, &time.column)?
                .into_iter()
                .chain(earliest)
                .min();
        }
        let mut late = Vec::new();
        for b in &late_table {
            let rows = of_source(b, &s.name)?;
            if rows.num_rows() > 0 {
                late_rows += rows.num_rows();
                late.push(conform(&s.schema, &[rows])?);
            }
        }
        inputs.insert(s.name.clone(), multiset_minus(&raw, &late)?);
    }
    Ok((inputs, late_rows, earliest))
}

/// The earliest value of the timestamp column `column` of `rows` (`None` if there is none).
fn earliest_time(rows: &RecordBatch, column: &str) -> Result<Option<i64>> {
    let Some(values) = rows.column_by_name(column) else {
        return Ok(None);
    };
    let values = cast::cast(values, &DataType::Int64)?;
    Ok(arrow::compute::min(values.as_primitive::<Int64Type>()))
}

/// The rows of a join's late table batch `late` that `source` read, as its
/// [`crate::late::SOURCE`] column names them.
fn of_source(late: &RecordBatch, source: &str) -> Result<RecordBatch> {
    let names = late.column_by_name(crate::late::SOURCE).ok_or_else(|| {
        Error::InvalidJob("reconcile: the late table has no _source column".into())
    })?;
    let names = cast::cast(names, &DataType::Utf8)?;
    let mine: BooleanArray = names
        .as_string::<i32>()
        .iter()
        .map(|n| Some(n == Some(source)))
        .collect();
    Ok(filter_record_batch(late, &mine)?)
}

/// `rows` (of `source`, in read order) split by the batch that read them: the first whose end
/// offset for the row's partition is above the row's offset. Each part keeps the read order.
fn rows_by_batch(
    rows: &RecordBatch,
    source: &str,
    batches: &[BatchManifest],
) -> Result<Vec<RecordBatch>> {
    let partitions = rows
        .column_by_name(SOURCE_PARTITION)
        .and_then(|c| c.as_string_opt::<i32>())
        .ok_or_else(|| Error::in_source(source, "rows without _source_partition"))?;
    let offsets = rows
        .column_by_name(SOURCE_OFFSET)
        .and_then(|c| c.as_primitive_opt::<Int64Type>())
        .ok_or_else(|| Error::in_source(source, "rows without _source_offset"))?;
    let mut indices: Vec<Vec<u32>> = vec![Vec::new(); batches.len()];
    for i in 0..rows.num_rows() {
        let partition = partitions.value(i);
        let offset = offsets.value(i);
        let batch = batches.partition_point(|m| {
            m.end_offsets
                .get(source)
                .and_then(|ends| ends.get(partition))
                .is_none_or(|end| *end <= offset)
        });
        let batch = batch.min(batches.len().saturating_sub(1));
        indices[batch].push(i as u32);
    }
    indices
        .into_iter()
        .map(|rows_of_batch| {
            Ok(arrow::compute::take_record_batch(
                rows,
                &arrow::array::UInt32Array::from(rows_of_batch),
            )?)
        })
        .collect()
}

/// The lineage columns, if the output carries them.
fn lineage_key(schema: &SchemaRef) -> Vec<&'static str> {
    let keyed = schema.index_of(SOURCE_PARTITION).is_ok() && schema.index_of(SOURCE_OFFSET).is_ok();
    if keyed {
        vec![SOURCE_PARTITION, SOURCE_OFFSET]
    } else {
        vec![]
    }
}

/// The rows of `all` less one occurrence of each row of `remove` (same schema).
fn multiset_minus(all: &RecordBatch, remove: &[RecordBatch]) -> Result<RecordBatch> {
    if remove.is_empty() {
        return Ok(all.clone());
    }
    let fields = all
        .schema()
        .fields()
        .iter()
        .map(|f| SortField::new(f.data_type().clone()))
        .collect();
    let converter = RowConverter::new(fields)?;
    let mut counts: HashMap<Vec<u8>, usize> = HashMap::new();
    for b in remove {
        let rows = converter.convert_columns(b.columns())?;
        for r in rows.iter() {
            *counts.entry(r.as_ref().to_vec()).or_default() += 1;
        }
    }
    let rows = converter.convert_columns(all.columns())?;
    let keep: BooleanArray = rows
        .iter()
        .map(|r| match counts.get_mut(r.as_ref()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Some(false)
            }
            _ => Some(true),
        })
        .collect();
    Ok(filter_record_batch(all, &keep)?)
}

/// The table's rows as one batch of `schema`: columns by name, cast to the query's types.
fn conform(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<RecordBatch> {
    let mut out = Vec::with_capacity(batches.len());
    for b in batches {
        let columns = schema
            .fields()
            .iter()
            .map(|f| {
                let col = b.column_by_name(f.name()).ok_or_else(|| {
                    Error::InvalidJob(format!(
                        "reconcile: the output table has no column '{}'",
                        f.name()
                    ))
                })?;
                Ok(cast::cast(col, f.data_type())?)
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        out.push(RecordBatch::try_new(Arc::clone(schema), columns)?);
    }
    Ok(concat_batches(schema, &out)?)
}

/// Rows as JSON objects.
fn json_rows(batch: &RecordBatch) -> Result<Vec<serde_json::Map<String, Value>>> {
    let mut writer = arrow::json::ArrayWriter::new(Vec::new());
    writer.write(batch)?;
    writer.finish()?;
    let bytes = writer.into_inner();
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::InvalidJob(format!("reconcile: rows do not serialize: {e}")))
}

/// Compares two multisets of rows, grouped by the `key` columns (lineage for stateless jobs, the
/// window for windowed ones), so leftover rows are paired within their group.
fn compare(
    expected: &RecordBatch,
    actual: &RecordBatch,
    key: &[&str],
    approximate: &BTreeSet<String>,
) -> Result<RowDiff> {
    let group = |rows: Vec<serde_json::Map<String, Value>>| {
        let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for row in rows {
            let key = key
                .iter()
                .map(|k| row.get(*k).map(Value::to_string).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("@");
            groups
                .entry(key)
                .or_default()
                .push(Value::Object(row).to_string());
        }
        groups
    };
    let expected_groups = group(json_rows(expected)?);
    let mut actual_groups = group(json_rows(actual)?);
    let mut report = RowDiff::default();
    for (key, mut want) in expected_groups {
        let mut got = actual_groups.remove(&key).unwrap_or_default();
        want.sort();
        got.sort();
        let (want, got) = remove_common(want, got, &mut report.matching);
        let mut got = got.into_iter();
        for w in want {
            match got.next() {
                Some(g) if approx_equal(&w, &g, approximate) => report.matching += 1,
                Some(g) => report.different.push((w, g)),
                None => report.missing.push(w),
            }
        }
        report.extra.extend(got);
    }
    report.extra.extend(actual_groups.into_values().flatten());
    Ok(report)
}

/// Removes the rows both sorted lists hold (as a multiset), counting them.
fn remove_common(
    want: Vec<String>,
    got: Vec<String>,
    matching: &mut usize,
) -> (Vec<String>, Vec<String>) {
    let (mut w_left, mut g_left) = (Vec::new(), Vec::new());
    let (mut w, mut g) = (want.into_iter().peekable(), got.into_iter().peekable());
    loop {
        match (w.peek(), g.peek()) {
            (Some(a), Some(b)) if a == b => {
                *matching += 1;
                w.next();
                g.next();
            }
            (Some(a), Some(b)) if a < b => w_left.extend(w.next()),
            (Some(_), Some(_)) => g_left.extend(g.next()),
            (Some(_), None) => w_left.extend(w.next()),
            (None, Some(_)) => g_left.extend(g.next()),
            (None, None) => return (w_left, g_left),
        }
    }
}

/// Equal as JSON, with numbers compared within [`FLOAT_TOLERANCE`] relative — or
/// [`APPROX_TOLERANCE`] for the top-level fields in `approximate`.
fn approx_equal(a: &str, b: &str, approximate: &BTreeSet<String>) -> bool {
    fn close(a: &Value, b: &Value, tolerance: f64) -> bool {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => x == y || (x - y).abs() <= tolerance * x.abs().max(y.abs()),
                _ => x == y,
            },
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .all(|(k, v)| y.get(k).is_some_and(|w| close(v, w, tolerance)))
            }
            (Value::Array(x), Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(v, w)| close(v, w, tolerance))
            }
            _ => a == b,
        }
    }
    match (
        serde_json::from_str::<Value>(a),
        serde_json::from_str::<Value>(b),
    ) {
        (Ok(Value::Object(a)), Ok(Value::Object(b))) => {
            a.len() == b.len()
                && a.iter().all(|(k, v)| {
                    let tolerance = if approximate.contains(k) {
                        APPROX_TOLERANCE
                    } else {
                        FLOAT_TOLERANCE
                    };
                    b.get(k).is_some_and(|w| close(v, w, tolerance))
                })
        }
        (Ok(a), Ok(b)) => close(&a, &b, FLOAT_TOLERANCE),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    fn rows(values: &[(&str, i64, f64)]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
            Field::new("amount", DataType::Float64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(values.iter().map(|v| v.0))),
                Arc::new(Int64Array::from_iter_values(values.iter().map(|v| v.1))),
                Arc::new(Float64Array::from_iter_values(values.iter().map(|v| v.2))),
            ],
        )
        .unwrap()
    }

    #[test]
    fn approximate_columns_are_compared_within_their_tolerance() {
        let approximate = BTreeSet::from(["median".to_string()]);
        let a = r#"{"w":1,"median":100.0,"exact":1.0}"#;
        assert!(approx_equal(
            a,
            r#"{"w":1,"median":101.0,"exact":1.0}"#,
            &approximate
        ));
        assert!(!approx_equal(
            a,
            r#"{"w":1,"median":110.0,"exact":1.0}"#,
            &approximate
        ));
        assert!(!approx_equal(
            a,
            r#"{"w":1,"median":100.0,"exact":1.01}"#,
            &approximate
        ));
    }

    #[test]
    fn matching_missing_extra_and_different_rows_are_told_apart() {
        let expected = rows(&[
            ("0", 1, 1.0),
            ("0", 1, 2.0),
            ("0", 2, 3.0),
            ("0", 3, 0.1 + 0.2),
        ]);
        let actual = rows(&[("0", 1, 2.0), ("0", 1, 9.0), ("0", 3, 0.3), ("0", 4, 5.0)]);
        let key = [SOURCE_PARTITION, SOURCE_OFFSET];
        let r = compare(&expected, &actual, &key, &BTreeSet::new()).unwrap();
        // (0,1,2.0) equal; (0,3) equal within tolerance; (0,1,1.0) vs (0,1,9.0) differ;
        // (0,2) missing; (0,4) extra.
        assert_eq!(r.matching, 2);
        assert_eq!(r.different.len(), 1);
        assert!(r.different[0].0.contains("1.0") && r.different[0].1.contains("9.0"));
        assert_eq!(r.missing.len(), 1);
        assert!(r.missing[0].contains("\"_source_offset\":2"));
        assert_eq!(r.extra.len(), 1);
        assert_eq!(r.differences(), 3);
        assert_eq!(
            compare(&expected, &expected, &key, &BTreeSet::new())
                .unwrap()
                .differences(),
            0
        );
    }
}
