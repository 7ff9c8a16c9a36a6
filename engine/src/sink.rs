//! The [`Sink`] trait: an idempotent, atomic commit of one batch.
//!
//! The driver hands a sink everything one batch produced — output rows and dead letters — together
//! with its [`BatchId`]. The sink makes the output visible in **one** atomic commit that also
//! records `txn(job_id, batch_id)`, after committing the side tables the same way. Because the
//! table itself remembers the last batch id, the sink is the source of truth on restart
//! ([`Sink::committed_batch`]) and can refuse to commit a batch twice.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::execution::SendableRecordBatchStream;
use url::Url;

use crate::error::{Error, Result};
use crate::offsets::{BatchId, OffsetRange, PartitionId};
use crate::storage::StorageOptions;

/// How a batch's output rows reach the output table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputMode {
    /// Each batch appends its rows; a windowed job emits each window once, when it closes.
    #[default]
    Append,
    /// Each batch upserts its rows (MERGE on the key columns); a windowed or running aggregate
    /// emits every group that changed, so the table always shows the latest value.
    Update,
}

impl std::str::FromStr for OutputMode {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "append" => Ok(OutputMode::Append),
            "update" => Ok(OutputMode::Update),
            other => Err(crate::error::Error::InvalidJob(format!(
                "mode '{other}' is not one of append, update"
            ))),
        }
    }
}

/// The tables a job writes, as [`Sink::open`] prepares them.
#[derive(Debug, Clone)]
pub struct OutputTables {
    /// The output rows' schema.
    pub output: SchemaRef,
    /// Windowed jobs: the late rows' schema (see [`crate::late`]).
    pub late: Option<SchemaRef>,
    /// Update mode: the columns output rows are upserted on; `None` appends.
    pub merge_key: Option<Vec<String>>,
}

impl OutputTables {
    /// An append-only output of `schema` with no late table.
    pub fn append(schema: SchemaRef) -> Self {
        OutputTables {
            output: schema,
            late: None,
            merge_key: None,
        }
    }
}

/// What one batch hands to the sink.
#[derive(Debug)]
pub struct BatchCommit {
    /// The batch; committed as `txn(job_id, batch_id)`.
    pub batch_id: BatchId,
    /// Output rows (may be empty: the batch still commits its txn).
    pub output: Vec<RecordBatch>,
    /// Dead-letter rows, in [`crate::dead_letter::dead_letter_schema`].
    pub dead_letters: Vec<RecordBatch>,
    /// Late rows (windowed jobs only), in the late schema given to [`Sink::open`] — or that
    /// schema grown by columns schema evolution added: then the table gains them in this
    /// commit. The driver always passes an empty batch of the late schema in force, so the
    /// columns join even in a batch without late rows.
    pub late: Vec<RecordBatch>,
    /// A copy of the batch manifest, stored in the commit's metadata for humans.
    pub manifest: serde_json::Value,
}

/// The windows a backfill of a windowed job replaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplacedWindows {
    /// The output column identifying a window (`window_start` or `window_end`).
    pub column: String,
    /// That column's value (µs since the epoch) for every replaced window.
    pub values: Vec<i64>,
    /// The starts of the replaced windows: late rows that missed any of them, and whose
    /// offsets are in `read`, are deleted from the late table (the recomputation counted them).
    pub starts: Vec<i64>,
    /// Per partition, the offsets the recomputation read: late rows outside them (committed by
    /// the live job while the backfill ran) were not counted and stay in the late table.
    pub read: BTreeMap<PartitionId, OffsetRange>,
}

/// What a backfill hands to the sink: rows that replace everything its offset ranges produced.
pub struct Replacement {
    /// The backfill's own app id (`<job_id>/backfill/<n>`), committed as `txn(app_id, 0)` on
    /// every table it changes, so a rerun after a crash skips tables already done.
    pub app_id: String,
    /// The source whose offsets are replaced (dead letters are keyed by source name).
    pub source: String,
    /// Per partition, the offsets whose rows are replaced (dead letters by `_source_name`,
    /// `_source_partition`, `_source_offset`; a stateless job's output rows by their lineage
    /// columns).
    pub ranges: BTreeMap<PartitionId, OffsetRange>,
    /// A windowed job: the windows whose output rows (and late rows) are replaced instead of
    /// lineage ranges.
    pub windows: Option<ReplacedWindows>,
    /// The recomputation of those offsets: its output rows, streamed while the sink writes
    /// them, and its dead letters.
    pub rows: Arc<dyn RecomputedRows>,
    /// What the backfill did, stored in the commits' metadata for humans.
    pub summary: serde_json::Value,
}

/// A backfill's recomputed rows, produced while the sink writes them: the output of a long range
/// flows from the source through the query into the table's files and never sits whole in
/// memory.
#[async_trait]
pub trait RecomputedRows: Send + Sync {
    /// The schema of the output rows.
    fn schema(&self) -> SchemaRef;

    /// Runs the recomputation from its start and streams its output rows. The sink reads it to
    /// its end once per commit attempt: a replacement that lost a race to a concurrent commit is
    /// recomputed (the same offsets give the same rows).
    fn output(self: Arc<Self>) -> SendableRecordBatchStream;

    /// The recomputed dead letters: those of the last run of [`RecomputedRows::output`] read to
    /// its end, or of a run made now if none was (the output table already held the
    /// replacement when a crashed backfill ran again).
    async fn dead_letters(self: Arc<Self>) -> Result<Vec<RecordBatch>>;
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The batch was committed now.
    Committed {
        /// Rows written to the output table.
        rows: u64,
        /// Data files added to the output table.
        files: u64,
        /// Bytes of data files added.
        bytes: u64,
        /// The output table's version after the commit, if the sink has versions.
        version: Option<i64>,
    },
    /// The table already held this batch (a rerun after a crash right after the commit).
    AlreadyCommitted,
}

/// Which columns and rows of a table to read: a side table can grow for as long as a job runs,
/// so readers that need a part of it ask for that part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableScan {
    /// Only these columns (`None`: all).
    pub columns: Option<Vec<String>>,
    /// Only the rows matching this SQL predicate over the table's columns (`None`: all).
    pub filter: Option<String>,
}

impl TableScan {
    /// Every column of every row.
    pub fn all() -> Self {
        TableScan::default()
    }
}

/// What a side table (dead letters, late rows) holds of a job, for the start-up check that no
/// side table is ahead of the output (see `Pipeline::open`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideTableBatch {
    /// What the table is for: "dead-letter", "late".
    pub role: String,
    /// Where it is.
    pub location: String,
    /// The last batch of the job it holds (`None`: none, or no table yet).
    pub last_batch: Option<BatchId>,
}

/// Where a job's results go.
///
/// # Contract
/// - [`Sink::commit`] is atomic for the output: the rows and `txn(job_id, batch_id)` become
///   visible together or not at all. Side tables are committed first, each with the same txn,
///   and skipped if they already hold it.
/// - A batch id at or below [`Sink::committed_batch`] is never written again.
#[async_trait]
pub trait Sink: Send + Sync {
    /// Where the sink writes; the default checkpoint lives below it, in `_sluice/<job_id>`.
    fn location(&self) -> &Url;

    /// How the store at [`Sink::location`] is configured; the checkpoint uses the same unless
    /// the job configures its own ([`crate::JobBuilder::with_checkpoint_storage`]).
    fn storage_options(&self) -> StorageOptions {
        StorageOptions::default()
    }

    /// Prepares the tables for `job_id` (creating them if needed): output rows (appended, or
    /// merged on `tables.merge_key`) and, for a windowed job, late rows.
    async fn open(&mut self, job_id: &str, tables: OutputTables) -> Result<()>;

    /// Commits one batch, idempotently.
    async fn commit(&self, batch: BatchCommit) -> Result<CommitOutcome>;

    /// Whether the sink implements [`Sink::replace`], which a backfill needs: a backfill of a
    /// job whose sink cannot replace is refused before anything is read. (No default: a sink
    /// says what it can do.)
    fn can_replace(&self) -> bool;

    /// Replaces, in one commit per table, every row the replacement's ranges produced with its
    /// recomputed rows (output first — the dead letters are known once its rows have been read
    /// — then the dead-letter and late tables). Retries when a concurrent writer (the live job)
    /// committed in between; returns [`CommitOutcome::AlreadyCommitted`] if the output table
    /// already holds `txn(app_id, 0)`. A sink that implements it says so in
    /// [`Sink::can_replace`]; the default, for sinks that cannot, is an error (a backfill never
    /// calls it for them).
    async fn replace(&self, _replacement: Replacement) -> Result<CommitOutcome> {
        Err(Error::Sink(
            format!(
                "the sink writing to {} was asked to replace rows, which it cannot \
                 (can_replace is false)",
                self.location()
            )
            .into(),
        ))
    }

    /// The last batch `job_id` committed, read from the output table without writing or
    /// creating anything (`None`: no table, or nothing committed by that job): where a restart
    /// continues, and what backfill and reconciliation may touch.
    async fn committed_batch(&self, job_id: &str) -> Result<Option<BatchId>>;

    /// The last batch of `job_id` each side table holds, read without writing anything. A sink
    /// without side tables returns none.
    async fn side_table_batches(&self, job_id: &str) -> Result<Vec<SideTableBatch>> {
        let _ = job_id;
        Ok(Vec::new())
    }

    /// Commits this sink retried because a concurrent writer committed first, since it was
    /// created.
    fn commit_conflicts(&self) -> u64 {
        0
    }

    /// Whether one of the sink's tables holds enough small files to be compacted now (see
    /// [`Sink::compact`]); looks at the tables as last loaded, reads nothing.
    async fn compaction_due(&self) -> Result<bool> {
        Ok(false)
    }

    /// Rewrites the small files of the tables that are due into larger ones, changing no row
    /// (Delta `dataChange = false`). The driver calls it between batches, holding the job's
    /// rewrite lease ([`crate::lease::REWRITE_LEASE_FOLDER`]), so it never overlaps a
    /// backfill's replacement; a compaction that loses a race to another commit is given up,
    /// not retried over the newer version.
    async fn compact(&self) -> Result<Compaction> {
        Ok(Compaction::default())
    }

    /// Every row of the output table, read without writing anything. For reconciliation.
    async fn read_output(&self) -> Result<Vec<RecordBatch>>;

    /// The late table's rows and columns `scan` asks for (none if there is no table), read
    /// without writing anything. For reconciliation and windowed backfills.
    async fn read_late(&self, scan: &TableScan) -> Result<Vec<RecordBatch>>;

    /// The dead-letter table's rows and columns `scan` asks for (none if there is no table),
    /// read without writing anything: backfill and reconcile reapply the live job's judgement of
    /// event times too far ahead from it.
    async fn read_dead_letters(&self, scan: &TableScan) -> Result<Vec<RecordBatch>> {
        let _ = scan;
        Ok(Vec::new())
    }
}

/// What one [`Sink::compact`] rewrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compaction {
    /// Small files removed (`dataChange = false`).
    pub files_removed: u64,
    /// Files written in their place.
    pub files_added: u64,
}

/// `batches` cut into consecutive groups of `rows` rows (the last one shorter; `rows` at least
/// 1), slicing a batch (zero-copy) where a group ends inside it: how rows are spread over
/// writers and Parquet row groups. Every row is in one group, in order.
pub fn row_groups(batches: &[RecordBatch], rows: usize) -> Vec<Vec<RecordBatch>> {
    let rows = rows.max(1);
    let mut groups: Vec<Vec<RecordBatch>> = Vec::new();
    let mut filled = rows;
    for batch in batches {
        let mut start = 0;
        while start < batch.num_rows() {
            if filled == rows {
                groups.push(Vec::new());
                filled = 0;
            }
            let take = (rows - filled).min(batch.num_rows() - start);
            if let Some(group) = groups.last_mut() {
                group.push(batch.slice(start, take));
            }
            filled += take;
            start += take;
        }
    }
    groups
}
