//! Offsets, offset ranges and batch ids: the coordinates of the exactly-once protocol.
//!
//! Every source is a set of partitions, each an ordered log addressed by `i64` offsets. A batch
//! reads, for each partition, a half-open range `[start, end)`; the end offsets of a committed batch
//! are where the next one starts. Batch ids are the Delta `txn` versions of the job: the first batch
//! is 0 and each commit is the previous plus one.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A position in one source partition. For files: the position of a file in the recorded file
/// order; for Kafka: the record offset.
pub type Offset = i64;

/// A partition of a source, named as the source names it (`"0"`, `"1"`, …).
pub type PartitionId = String;

/// The id of one micro-batch: the Delta `txn` version it commits with.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct BatchId(pub i64);

impl BatchId {
    /// The batch after this one.
    pub fn next(self) -> BatchId {
        BatchId(self.0 + 1)
    }
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A half-open range of offsets `[start, end)` in one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetRange {
    /// First offset read.
    pub start: Offset,
    /// One past the last offset read.
    pub end: Offset,
}

impl OffsetRange {
    /// The range `[start, end)`.
    pub fn new(start: Offset, end: Offset) -> Self {
        OffsetRange { start, end }
    }

    /// Number of offsets in the range.
    pub fn len(&self) -> u64 {
        (self.end - self.start).max(0) as u64
    }

    /// Whether the range holds no offset.
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

impl fmt::Display for OffsetRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// Offsets of every partition of every source: `source name → partition → offset`.
pub type SourceOffsets = BTreeMap<String, BTreeMap<PartitionId, Offset>>;

/// Ranges of every partition of every source: `source name → partition → range`.
pub type SourceRanges = BTreeMap<String, BTreeMap<PartitionId, OffsetRange>>;

/// The start offsets of a set of ranges.
pub fn start_offsets(ranges: &SourceRanges) -> SourceOffsets {
    ranges
        .iter()
        .map(|(source, parts)| {
            let starts = parts.iter().map(|(p, r)| (p.clone(), r.start)).collect();
            (source.clone(), starts)
        })
        .collect()
}

/// The ranges that read something: `(source, partition, range)` for every non-empty range.
pub fn ranges_to_read(
    ranges: &SourceRanges,
) -> impl Iterator<Item = (&String, &PartitionId, &OffsetRange)> {
    ranges.iter().flat_map(|(source, parts)| {
        parts
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(move |(p, r)| (source, p, r))
    })
}

/// The end offsets of a set of ranges.
pub fn end_offsets(ranges: &SourceRanges) -> SourceOffsets {
    ranges
        .iter()
        .map(|(source, parts)| {
            let ends = parts.iter().map(|(p, r)| (p.clone(), r.end)).collect();
            (source.clone(), ends)
        })
        .collect()
}

/// Formats ranges compactly for logs: `clicks{0:[0, 5)}`.
pub fn display_ranges(ranges: &SourceRanges) -> String {
    let mut out = String::new();
    for (i, (source, parts)) in ranges.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(source);
        out.push('{');
        for (j, (p, r)) in parts.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            out.push_str(&format!("{p}:{r}"));
        }
        out.push('}');
    }
    out
}

/// `clicks{0=12,1=0}`: one offset (or count) per partition, for log lines.
pub fn display_offsets(offsets: &SourceOffsets) -> String {
    offsets
        .iter()
        .map(|(source, parts)| {
            let parts: Vec<String> = parts.iter().map(|(p, o)| format!("{p}={o}")).collect();
            format!("{source}{{{}}}", parts.join(","))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The ranges a plan gives a source's partitions: each from `starts` (its end offset so far,
/// or where it begins) to the `latest` offset the source reports, capped by `cap` (an
/// available-now run's target: a partition it lacks gets nothing), cut by `max_per_batch` as
/// [`plan_ranges`] cuts them. A partition `starts` lacks is left out. The driver's plan uses
/// it, and its read ahead guesses the next plan with it.
pub fn next_ranges(
    starts: &BTreeMap<PartitionId, Offset>,
    latest: &BTreeMap<PartitionId, Offset>,
    cap: Option<&BTreeMap<PartitionId, Offset>>,
    max_per_batch: Option<u64>,
) -> BTreeMap<PartitionId, OffsetRange> {
    let mut start = BTreeMap::new();
    let mut to = BTreeMap::new();
    for (p, &latest) in latest {
        let Some(&from) = starts.get(p) else {
            continue;
        };
        let end = match cap {
            Some(cap) => latest.min(cap.get(p).copied().unwrap_or(from)),
            None => latest,
        };
        start.insert(p.clone(), from);
        to.insert(p.clone(), end.max(from));
    }
    plan_ranges(&start, &to, max_per_batch)
}

/// Plans one batch's ranges for the partitions of one source.
///
/// Each partition starts at `start[p]` and may read up to `latest[p]`. With a budget
/// (`max_per_batch`, a total over the source's partitions) the budget is split fairly: every
/// partition with data gets an equal share, and what a partition cannot use is handed to the
/// others, so a budget is never wasted while any partition still has data. Partitions whose range
/// is empty are still listed (an empty range keeps their offset in the manifest).
pub fn plan_ranges(
    start: &BTreeMap<PartitionId, Offset>,
    latest: &BTreeMap<PartitionId, Offset>,
    max_per_batch: Option<u64>,
) -> BTreeMap<PartitionId, OffsetRange> {
    let available = |p: &PartitionId| -> u64 {
        let s = start.get(p).copied().unwrap_or(0);
        (latest[p] - s).max(0) as u64
    };
    let mut take: BTreeMap<PartitionId, u64> = latest.keys().map(|p| (p.clone(), 0)).collect();
    match max_per_batch {
        None => {
            for (p, t) in take.iter_mut() {
                *t = available(p);
            }
        }
        Some(budget) => {
            let mut left = budget;
            loop {
                let hungry: Vec<&PartitionId> =
                    latest.keys().filter(|p| take[*p] < available(p)).collect();
                if hungry.is_empty() || left == 0 {
                    break;
                }
                let share = (left / hungry.len() as u64).max(1);
                for p in hungry {
                    if left == 0 {
                        break;
                    }
                    let want = (available(p) - take[p]).min(share).min(left);
                    if let Some(t) = take.get_mut(p) {
                        *t += want;
                        left -= want;
                    }
                }
            }
        }
    }
    latest
        .keys()
        .map(|p| {
            let s = start.get(p).copied().unwrap_or(0);
            (p.clone(), OffsetRange::new(s, s + take[p] as i64))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(v: &[(&str, i64)]) -> BTreeMap<PartitionId, Offset> {
        v.iter().map(|(p, o)| (p.to_string(), *o)).collect()
    }

    #[test]
    fn unbounded_reads_everything() {
        let r = plan_ranges(&map(&[("0", 3)]), &map(&[("0", 10)]), None);
        assert_eq!(r["0"], OffsetRange::new(3, 10));
    }

    #[test]
    fn budget_is_shared_and_leftovers_move_on() {
        let r = plan_ranges(
            &map(&[("0", 0), ("1", 0), ("2", 5)]),
            &map(&[("0", 100), ("1", 1), ("2", 5)]),
            Some(10),
        );
        assert_eq!(r["1"], OffsetRange::new(0, 1));
        assert_eq!(r["0"], OffsetRange::new(0, 9));
        assert!(r["2"].is_empty());
    }

    /// The next batch's ranges as its plan will give them: from this batch's ends, the budget
    /// shared among the partitions with data left, an available-now target capping them (a
    /// partition it lacks gets nothing), a partition never read left out, one caught up empty.
    #[test]
    fn next_ranges_start_at_the_ends_within_the_latest_and_the_cap() {
        let ends = map(&[("0", 4), ("1", 10), ("2", 7)]);
        let latest = map(&[("0", 40), ("1", 12), ("2", 7), ("3", 9)]);
        let r = next_ranges(&ends, &latest, None, Some(8));
        assert_eq!(r["0"], OffsetRange::new(4, 10));
        assert_eq!(r["1"], OffsetRange::new(10, 12));
        assert!(r["2"].is_empty());
        assert!(!r.contains_key("3"));
        let cap = map(&[("0", 6), ("2", 7)]);
        let r = next_ranges(&ends, &latest, Some(&cap), None);
        assert_eq!(r["0"], OffsetRange::new(4, 6));
        assert!(r["1"].is_empty());
        assert!(r["2"].is_empty());
        // A log that went backwards: nothing (the plan skips or stops).
        let r = next_ranges(&map(&[("0", 20)]), &map(&[("0", 5)]), None, None);
        assert!(r["0"].is_empty());
    }

    proptest! {
        /// Ranges start at the committed offset, never pass the latest, never exceed the budget,
        /// and use the whole budget when data is there.
        #[test]
        fn ranges_respect_bounds(
            parts in proptest::collection::vec((0i64..50, 0i64..50), 1..6),
            budget in proptest::option::of(1u64..40),
        ) {
            let start: BTreeMap<_, _> = parts.iter().enumerate().map(|(i, (s, _))| (i.to_string(), *s)).collect();
            let latest: BTreeMap<_, _> = parts.iter().enumerate().map(|(i, (s, n))| (i.to_string(), s + n)).collect();
            let ranges = plan_ranges(&start, &latest, budget);
            let mut total = 0;
            for (p, r) in &ranges {
                prop_assert_eq!(r.start, start[p]);
                prop_assert!(r.end <= latest[p]);
                total += r.len();
            }
            let available: u64 = parts.iter().map(|(_, n)| *n as u64).sum();
            match budget {
                None => prop_assert_eq!(total, available),
                Some(b) => prop_assert_eq!(total, available.min(b)),
            }
        }
    }
}
