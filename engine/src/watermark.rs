//! The event-time watermark: how far event time has certainly progressed.
//!
//! Each source partition with event time contributes `max event time seen − max_out_of_orderness`.
//! The job's watermark is the minimum over the partitions that are not idle, and it never moves
//! backwards. A partition that has never delivered an event holds the watermark (it may still
//! deliver old events) until it counts as idle.
//!
//! **Idleness** is decided when a batch is planned — a partition with nothing to read whose last
//! data was read `idle_timeout` or more ago (wall clock) — and recorded in the batch intent, so a
//! rerun of the batch uses the same idle set and computes the same watermark. Without
//! `idle_timeout` a silent partition holds the watermark forever (visible as watermark lag). With
//! every partition idle the watermark holds: there is no evidence that time moved.
//!
//! The per-partition maxima and the watermark are written in each batch manifest and restored
//! on restart, so a restarted job continues from the same watermark.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::time::{Duration, Instant};

use arrow::array::{Array, AsArray, RecordBatch, StringArray};
use arrow::datatypes::TimestampMicrosecondType;

use crate::error::{Error, Result};
use crate::offsets::{PartitionId, SourceOffsets};
use crate::source::SOURCE_PARTITION;

/// A partition of a source: `(source name, partition id)`.
pub type SourcePartition = (String, PartitionId);

/// The watermark rules of one source with event time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatermarkRules {
    /// How far the watermark trails the newest event of a partition.
    pub max_out_of_orderness: Duration,
    /// After how long without data a partition stops holding the watermark (`None`: never).
    pub idle_timeout: Option<Duration>,
}

/// The watermark and what it is computed from.
#[derive(Debug, Clone, Default)]
pub struct Watermark {
    /// The current watermark, µs since the epoch; `None` until every non-idle partition has
    /// delivered an event.
    current: Option<i64>,
    /// Per source and partition, the newest event time read so far (µs since the epoch).
    max_event_time: SourceOffsets,
    /// When each partition last delivered rows (this process only; a restart starts the clock
    /// again, so a restart never makes a partition idle sooner).
    last_data: HashMap<SourcePartition, Instant>,
}

impl Watermark {
    /// The watermark a job restarts from: the committed manifest's watermark and maxima.
    pub fn restore(current: Option<i64>, max_event_time: SourceOffsets) -> Self {
        Watermark {
            current,
            max_event_time,
            last_data: HashMap::new(),
        }
    }

    /// The current watermark (µs since the epoch).
    pub fn current(&self) -> Option<i64> {
        self.current
    }

    /// Per source and partition, the newest event time read so far.
    pub fn max_event_time(&self) -> &SourceOffsets {
        &self.max_event_time
    }

    /// Step 1 (plan): the partitions that count as idle for the next batch — those of sources with
    /// an `idle_timeout` that have nothing to read in it and delivered no rows for that long.
    /// `has_data` says whether a partition's planned range is non-empty.
    pub fn idle_partitions<'a>(
        &mut self,
        rules: &BTreeMap<String, WatermarkRules>,
        planned: impl IntoIterator<Item = (&'a str, &'a PartitionId, bool)>,
        now: Instant,
    ) -> BTreeSet<SourcePartition> {
        let mut idle = BTreeSet::new();
        for (source, partition, has_data) in planned {
            let Some(timeout) = rules.get(source).and_then(|r| r.idle_timeout) else {
                continue;
            };
            let key = (source.to_string(), partition.clone());
            let since = *self.last_data.entry(key.clone()).or_insert(now);
            if has_data {
                continue;
            }
            if now.saturating_duration_since(since) >= timeout {
                idle.insert(key);
            }
        }
        idle
    }

    /// Notes that partitions delivered rows (for idleness).
    pub fn saw_data(
        &mut self,
        partitions: impl IntoIterator<Item = SourcePartition>,
        now: Instant,
    ) {
        for p in partitions {
            self.last_data.insert(p, now);
        }
    }

    /// Step 6: folds one batch's newest event time per partition into the maxima and computes the
    /// new watermark over `partitions` (every partition of every source with event time) minus
    /// `idle`. Never moves backwards. Returns the new watermark.
    pub fn advance(
        &mut self,
        rules: &BTreeMap<String, WatermarkRules>,
        batch_max: &SourceOffsets,
        partitions: &BTreeSet<SourcePartition>,
        idle: &BTreeSet<SourcePartition>,
    ) -> Option<i64> {
        for (source, parts) in batch_max {
            let maxima = self.max_event_time.entry(source.clone()).or_default();
            for (p, t) in parts {
                let m = maxima.entry(p.clone()).or_insert(*t);
                *m = (*m).max(*t);
            }
        }
        let mut candidate: Option<i64> = None;
        let mut active = 0;
        for key @ (source, p) in partitions {
            let Some(rule) = rules.get(source) else {
                continue;
            };
            if idle.contains(key) {
                continue;
            }
            active += 1;
            let Some(max) = self.max_event_time.get(source).and_then(|m| m.get(p)) else {
                // Never delivered an event: it may still deliver old ones, so it holds.
                return self.current;
            };
            let wm = max.saturating_sub(micros(rule.max_out_of_orderness));
            candidate = Some(candidate.map_or(wm, |c| c.min(wm)));
        }
        if active > 0 {
            self.current = match (self.current, candidate) {
                (Some(c), Some(n)) => Some(c.max(n)),
                (c, n) => c.or(n),
            };
        }
        self.current
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// The newest event time per partition in `batch` (rows carry [`SOURCE_PARTITION`] and the
/// event-time column as `Timestamp(µs, UTC)`), merged into `into`.
///
/// # Errors
/// If either column is missing or of another type.
pub fn max_event_time_by_partition(
    batch: &RecordBatch,
    event_time_column: &str,
    into: &mut BTreeMap<PartitionId, i64>,
) -> Result<()> {
    let missing = |c: &str| Error::InvalidJob(format!("watermark: the batch has no column {c}"));
    let partitions = batch
        .column_by_name(SOURCE_PARTITION)
        .ok_or_else(|| missing(SOURCE_PARTITION))?
        .as_string_opt::<i32>()
        .ok_or_else(|| missing(SOURCE_PARTITION))?;
    let times = batch
        .column_by_name(event_time_column)
        .ok_or_else(|| missing(event_time_column))?
        .as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| missing(event_time_column))?;
    // Rows of one partition come in runs (most batches, a source's read, hold one partition):
    // each run's newest time is taken by Arrow's kernel over its rows.
    for run in runs(partitions) {
        if let Some(max) = arrow::compute::max(&times.slice(run.start, run.len())) {
            let m = into
                .entry(partitions.value(run.start).to_string())
                .or_insert(max);
            *m = (*m).max(max);
        }
    }
    Ok(())
}

/// The runs of rows of `column` that hold the same text, in order.
fn runs(column: &StringArray) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    if holds_one_text(column) {
        runs.push(0..column.len());
        return runs;
    }
    let mut from = 0;
    while from < column.len() {
        let text = column.value(from);
        let to = (from + 1..column.len())
            .find(|&row| column.value(row) != text)
            .unwrap_or(column.len());
        runs.push(from..to);
        from = to;
    }
    runs
}

/// Whether `column` has rows and every one holds the same text: every length the first's,
/// then all the text compared with the first row's repeated, a block at a time (comparing row
/// by row was most of the time finding a batch's newest event time took).
fn holds_one_text(column: &StringArray) -> bool {
    if column.is_empty() {
        return false;
    }
    let first = column.value(0).as_bytes();
    let offsets = column.value_offsets();
    if !offsets
        .windows(2)
        .all(|w| (w[1] - w[0]) as usize == first.len())
    {
        return false;
    }
    if first.is_empty() {
        return true;
    }
    let text = &column.value_data()[offsets[0] as usize..offsets[column.len()] as usize];
    let block = first.repeat((4096 / first.len()).max(1));
    text.chunks(block.len())
        .all(|chunk| chunk == &block[..chunk.len()])
}

/// `2026-11-29T10:00:00Z` for a watermark in µs, `-` for none.
pub fn display_watermark(micros: Option<i64>) -> String {
    micros
        .and_then(chrono::DateTime::from_timestamp_micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_else(|| "-".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: i64 = 1_000_000;

    fn rules(idle: Option<u64>) -> BTreeMap<String, WatermarkRules> {
        BTreeMap::from([(
            "s".to_string(),
            WatermarkRules {
                max_out_of_orderness: Duration::from_secs(5),
                idle_timeout: idle.map(Duration::from_secs),
            },
        )])
    }

    fn parts(ids: &[&str]) -> BTreeSet<SourcePartition> {
        ids.iter()
            .map(|p| ("s".to_string(), p.to_string()))
            .collect()
    }

    fn maxima(pairs: &[(&str, i64)]) -> SourceOffsets {
        BTreeMap::from([(
            "s".to_string(),
            pairs.iter().map(|(p, t)| (p.to_string(), *t)).collect(),
        )])
    }

    /// The newest time per partition, whatever the layout of the partitions' rows: one text
    /// throughout (long, empty, cut short by a slice), runs, rows alternating, texts of one
    /// length that differ late in the column, null times — as a plain scan of the rows finds.
    #[test]
    fn newest_event_time_per_partition_for_any_layout_of_rows() {
        use arrow::array::TimestampMicrosecondArray;
        use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
        use std::sync::Arc;

        let long = "a-partition-name-longer-than-a-few-bytes";
        let mut layouts: Vec<Vec<&str>> = vec![
            vec!["0"; 10_000],
            vec![long; 5_000],
            vec![""; 7],
            vec!["p-1", "p-1", "p-2", "p-2", "p-2", "p-1"],
            (0..999).map(|i| ["p-1", "p-2"][i % 2]).collect(),
        ];
        // One text of one length but the very last row's.
        let mut late = vec!["p-1"; 20_000];
        late[19_999] = "p-2";
        layouts.push(late);
        let mut shorter = vec![long; 3_000];
        shorter[1_500] = "x";
        layouts.push(shorter);
        let schema = Arc::new(Schema::new(vec![
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(
                "t",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ]));
        for partitions in layouts {
            let times: TimestampMicrosecondArray = (0..partitions.len())
                .map(|i| (i % 7 != 3).then_some(((i * 7_919) % 10_007) as i64))
                .collect();
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(partitions.clone())),
                    Arc::new(times.with_timezone("UTC")),
                ],
            )
            .unwrap();
            for (from, len) in [(0, batch.num_rows()), (1, batch.num_rows() - 1), (2, 3)] {
                let batch = batch.slice(from, len.min(batch.num_rows() - from));
                let mut found = BTreeMap::from([("p-1".to_string(), 5_000)]);
                max_event_time_by_partition(&batch, "t", &mut found).unwrap();
                let mut expected = BTreeMap::from([("p-1".to_string(), 5_000)]);
                let times = batch.column(1).as_primitive::<TimestampMicrosecondType>();
                for row in 0..batch.num_rows() {
                    if times.is_valid(row) {
                        let p = partitions[from + row].to_string();
                        let m = expected.entry(p).or_insert(i64::MIN);
                        *m = (*m).max(times.value(row));
                    }
                }
                assert_eq!(found, expected, "{:?}…, from row {from}", &partitions[..2]);
            }
        }
    }

    #[test]
    fn minimum_over_partitions_minus_out_of_orderness_never_backwards() {
        let r = rules(None);
        let all = parts(&["0", "1"]);
        let none = BTreeSet::new();
        let mut wm = Watermark::default();
        // Partition 1 has not delivered anything yet: it holds the watermark.
        assert_eq!(
            wm.advance(&r, &maxima(&[("0", 100 * SECOND)]), &all, &none),
            None
        );
        assert_eq!(
            wm.advance(&r, &maxima(&[("1", 50 * SECOND)]), &all, &none),
            Some(45 * SECOND)
        );
        assert_eq!(
            wm.advance(&r, &maxima(&[("1", 80 * SECOND)]), &all, &none),
            Some(75 * SECOND)
        );
        // An older event does not move it back.
        assert_eq!(
            wm.advance(&r, &maxima(&[("1", 10 * SECOND)]), &all, &none),
            Some(75 * SECOND)
        );
    }

    #[test]
    fn idle_partitions_stop_holding_and_all_idle_holds() {
        let r = rules(Some(30));
        let all = parts(&["0", "1"]);
        let mut wm = Watermark::default();
        wm.advance(
            &r,
            &maxima(&[("0", 100 * SECOND), ("1", 20 * SECOND)]),
            &all,
            &BTreeSet::new(),
        );
        assert_eq!(wm.current(), Some(15 * SECOND));
        let t0 = Instant::now();
        wm.saw_data(all.iter().cloned(), t0);
        let p0 = "0".to_string();
        let p1 = "1".to_string();
        let plan = [("s", &p0, true), ("s", &p1, false)];
        // Partition 1 is silent, but not for 30 s yet.
        assert!(
            wm.idle_partitions(&r, plan, t0 + Duration::from_secs(10))
                .is_empty()
        );
        let idle = wm.idle_partitions(&r, plan, t0 + Duration::from_secs(31));
        assert_eq!(idle, parts(&["1"]));
        assert_eq!(
            wm.advance(&r, &maxima(&[("0", 200 * SECOND)]), &all, &idle),
            Some(195 * SECOND)
        );
        // Everything idle: the watermark holds.
        assert_eq!(
            wm.advance(&r, &SourceOffsets::new(), &all, &all),
            Some(195 * SECOND)
        );
        // Without idle_timeout nothing is ever idle.
        assert!(
            Watermark::default()
                .idle_partitions(&rules(None), plan, t0 + Duration::from_secs(3600))
                .is_empty()
        );
    }
}
