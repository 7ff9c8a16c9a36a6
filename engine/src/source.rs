//! The [`Source`] trait: partitioned, offset-addressed input that can be re-read exactly.
//!
//! The driver asks a source two things: which partitions exist and how far each one goes
//! ([`Source::available`]), and the rows of one partition between two offsets
//! ([`Source::read`]). Because a read is a pure function of `(partition, range)`, a batch that
//! crashed can be re-run from its intent and produce the same rows — the base of exactly-once.
//!
//! Every batch a source returns carries its data columns followed
//! by the lineage columns [`SOURCE_PARTITION`] and [`SOURCE_OFFSET`], and optionally
//! [`SOURCE_POSITION`] when a row's position is finer than its offset (a line in a file). Rows
//! that cannot be decoded are never dropped: they come back as [`DeadLetter`]s.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, StringBuilder};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use async_trait::async_trait;

use crate::checkpoint::CheckpointStore;
use crate::error::Result;
use crate::offsets::{Offset, OffsetRange, PartitionId};

/// Lineage column: the partition a row was read from.
pub const SOURCE_PARTITION: &str = "_source_partition";
/// Lineage column: the offset a row was read at (file position, Kafka offset).
pub const SOURCE_OFFSET: &str = "_source_offset";
/// Optional column: a finer position than the offset, such as `file.json:17`.
pub const SOURCE_POSITION: &str = "_source_position";

/// The lineage columns, in the order a source batch carries them.
pub const LINEAGE_COLUMNS: [&str; 3] = [SOURCE_PARTITION, SOURCE_OFFSET, SOURCE_POSITION];

/// Internal column: in place of [`SOURCE_POSITION`] in a read asked for
/// [`PositionForm::Numbers`], the number its text ends with (`17` for `file.json:17`), as Int64.
/// Never in a query's output nor in a table: rendered to text ([`Source::position_prefix`])
/// before a row goes to a side table. Not chosen for a source that has a column of this name
/// (one that schema evolution adds makes the reads made in this form stale: the batch is read
/// again whole, in text).
pub const SOURCE_ROW: &str = "_source_row";

/// Whether `name` is one of the [`LINEAGE_COLUMNS`].
pub fn is_lineage(name: &str) -> bool {
    LINEAGE_COLUMNS.contains(&name)
}

/// How a read gives each row's position finer than its offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PositionForm {
    /// As text in [`SOURCE_POSITION`] (`file.json:17`), as [`Source::read`] gives it.
    #[default]
    Text,
    /// As the number that text ends with, in [`SOURCE_ROW`]: for a query whose plan does not
    /// read the position. Formatting a position for every row was ~15 % of the CPU of a
    /// Parquet query that keeps one row in a hundred; the few rows bound for a side table get
    /// their text from [`Source::position_prefix`].
    Numbers,
}

/// What a source is given when the job opens it.
#[derive(Debug, Clone)]
pub struct SourceContext {
    /// The source's name in the job (its SQL table name).
    pub name: String,
    /// A folder of the job's checkpoint reserved for this source (`sources/<name>/`), for what
    /// the source must remember across restarts, such as the order in which it saw files.
    pub checkpoint: CheckpointStore,
    /// The job is only being validated (`sluice validate`): write nothing, and fail within
    /// seconds on a service that does not answer instead of retrying as a running job would.
    pub validating: bool,
}

/// The offsets one partition has available now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AvailableRange {
    /// Where a job that never read this partition starts (`starting_offsets`).
    pub initial: Offset,
    /// One past the last offset that can be read now.
    pub latest: Offset,
}

/// Rows read from one partition range.
#[derive(Debug, Default)]
pub struct SourceRead {
    /// Decoded rows: the source schema plus the lineage columns.
    pub batches: Vec<RecordBatch>,
    /// Input that could not be decoded, with the reason.
    pub dead_letters: Vec<DeadLetter>,
}

/// One input record that could not be turned into a row, kept with its raw bytes and the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// The partition it was read from.
    pub partition: PartitionId,
    /// Its offset.
    pub offset: Offset,
    /// A human-readable position: `file.json:17` or `3@42`.
    pub position: String,
    /// The bytes as read.
    pub raw: Vec<u8>,
    /// Why it was rejected.
    pub error: String,
}

/// How a source's schema was inferred from a sample of its data, for `sluice validate`, the
/// first batch's log and error messages: per column, the type chosen and how many sampled values
/// did not fit it (their records become dead letters when read).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchemaInference {
    /// Where the sample came from: the files, or the partitions.
    pub sample: String,
    /// Records sampled.
    pub records: u64,
    /// The inferred columns, in order.
    pub columns: Vec<InferredColumn>,
}

/// One inferred column.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InferredColumn {
    /// The column.
    pub name: String,
    /// The type chosen, as Arrow writes it.
    pub data_type: String,
    /// Non-null values sampled.
    pub values: u64,
    /// Sampled values that do not fit the type.
    pub misfits: u64,
    /// Where the first value that does not fit is (`file.json:3`, `0@42`).
    pub first_misfit: Option<String>,
}

impl SchemaInference {
    /// The inferred column `name`, if any.
    pub fn column(&self, name: &str) -> Option<&InferredColumn> {
        self.columns.iter().find(|c| c.name == name)
    }
}

impl std::fmt::Display for InferredColumn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.name, self.data_type)?;
        match (&self.first_misfit, self.misfits) {
            (Some(first), n) if n > 0 => write!(
                f,
                " ({n} of {} sampled values do not fit; the first at {first})",
                self.values
            ),
            _ => write!(f, " ({} values sampled, all fit)", self.values),
        }
    }
}

/// Runs `work` on the rayon pool (one thread per core) and waits for it without holding an
/// async worker thread: what a [`Source::read`] (or any step) does with the CPU. Several
/// reads awaiting it at once run in parallel; `work` may itself use rayon's parallel
/// iterators. A panic in `work` resumes in the caller. Dropping the returned future (a sibling
/// read failed, the job stops) does not stop `work`: it runs to its end and its result is
/// dropped.
pub async fn cpu_bound<T, F>(work: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (done, result) = tokio::sync::oneshot::channel();
    rayon::spawn(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        // The caller stopped waiting (its future was dropped): nothing to hand over.
        let _ = done.send(outcome);
    });
    match result.await {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        // Unreachable: the closure above always sends (a panic is caught).
        Err(_) => panic!("a cpu_bound task ended without a result"),
    }
}

/// A partitioned, replayable input.
///
/// # Contract
/// - [`Source::open`] is called once, before anything else, and fixes the schema — which may
///   only grow afterwards, by schema evolution: a read that meets new fields records them (so
///   every later run and replay decodes with them) and returns its rows in the grown schema,
///   reported by [`Source::current_schema`]. Columns are only ever added (new top-level columns
///   at the end, new fields at the end of a struct), all nullable.
/// - [`Source::read`] is deterministic: the same `(partition, range)` always gives the same rows
///   and dead letters, or an error naming what changed. It may be called at any time and
///   concurrently with other reads: the driver reads the next batch's ranges
///   ([`Source::read_ahead`]) while the current batch commits, before the next intent is
///   written, and uses such a read only for exactly the range the intent then gives.
/// - Offsets only grow: `available()` never reports a `latest` below one it reported before.
/// - A read does its CPU-bound work (decoding, generating) in [`cpu_bound`], never inline in
///   the async fn: the driver reads a batch's partitions concurrently, and work done inline
///   runs them one after another on one task while the other cores wait.
///
/// # Errors
/// Errors name the source, partition and offset or file at fault. A transient failure (a broker
/// restarting) should be retried inside the source; an error returned here stops the job, which
/// can be restarted safely.
#[async_trait]
pub trait Source: Send + Sync {
    /// Opens the source and returns the schema of the batches [`Source::read`] returns: the data
    /// columns followed by the lineage columns (build it with [`with_lineage_fields`]).
    async fn open(&mut self, ctx: SourceContext) -> Result<SchemaRef>;

    /// The partitions that exist now and the offsets available in each.
    async fn available(&self) -> Result<BTreeMap<PartitionId, AvailableRange>>;

    /// The rows of `partition` in `range`.
    async fn read(&self, partition: &PartitionId, range: OffsetRange) -> Result<SourceRead>;

    /// Whether [`Source::read_columns`] decodes only the columns it is asked for (Parquet
    /// files do: each column is stored apart; JSON files skip copying the text of the others).
    /// When it does, a query that uses a few of the source's columns has only those read, and
    /// the engine reads a record again in full for the few rows that go to the dead-letter or
    /// late tables, which keep whole records.
    fn reads_columns(&self) -> bool {
        false
    }

    /// The rows of `partition` in `range` as [`Source::read`] gives them, with only the data
    /// columns named in `columns` (in the schema's order) followed by the lineage columns;
    /// dead letters as `read` gives them. Called only when [`Source::reads_columns`]; a row
    /// must carry the same lineage as in `read` (its position in `positions`' form), and
    /// (partition, offset, position) must name one row. `positions`:
    /// [`PositionForm::Numbers`] only when [`Source::numbers_positions`].
    /// The default reads every column (the engine keeps those it asked for).
    async fn read_columns(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        columns: &[String],
        positions: PositionForm,
    ) -> Result<SourceRead> {
        let _ = (columns, positions);
        self.read(partition, range).await
    }

    /// Whether [`Source::read_columns`] can give positions as [`PositionForm::Numbers`]: each
    /// row's [`SOURCE_POSITION`] is always [`Source::position_prefix`] of its offset followed
    /// by a number, which such a read gives in [`SOURCE_ROW`] instead.
    fn numbers_positions(&self) -> bool {
        false
    }

    /// The text every [`SOURCE_POSITION`] of the rows at `offset` of `partition` starts with,
    /// before its number (`file.json:`). Called only when [`Source::numbers_positions`].
    ///
    /// # Errors
    /// If the source does not number positions, or `offset` names nothing it read.
    async fn position_prefix(&self, partition: &PartitionId, offset: Offset) -> Result<String> {
        Err(crate::error::Error::InvalidJob(format!(
            "partition {partition} offset {offset}: this source does not number positions"
        )))
    }

    /// The most offsets one batch may read across all partitions (`max_files_per_batch`,
    /// `max_records_per_batch`); `None` for no limit.
    fn max_per_batch(&self) -> Option<u64>;

    /// How the schema was inferred, when it was (`None`: declared, or not from the data).
    fn schema_inference(&self) -> Option<SchemaInference> {
        None
    }

    /// Whether a read may grow the schema (schema evolution that records new columns). Only
    /// the batch's own read grows it, never a read made ahead of the batch's intent
    /// ([`Source::read_ahead`]): columns are added in the commit of the batch whose read found
    /// them, and a crashed batch is read again with the schema it was first read with. `true`
    /// unless a source says otherwise: return `false` when reads never record columns
    /// ([`Source::current_schema`] stays `None`).
    fn reads_may_grow_schema(&self) -> bool {
        true
    }

    /// The rows of `partition` in `range` read ahead of the batch that will read them (the
    /// driver reads the next batch's ranges while the current one commits): as [`Source::read`]
    /// gives them (`columns`: `None`), or as [`Source::read_columns`] does. Such a read must
    /// not grow the schema: where the records bring fields the schema in force lacks, give
    /// `Ok(None)`, and the batch reads the range itself, growing the schema in its own read.
    /// The default reads as usual from a source whose reads never grow the schema
    /// ([`Source::reads_may_grow_schema`]), and nothing from one whose reads may.
    async fn read_ahead(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        columns: Option<&[String]>,
        positions: PositionForm,
    ) -> Result<Option<SourceRead>> {
        if self.reads_may_grow_schema() {
            return Ok(None);
        }
        let read = match columns {
            None => self.read(partition, range).await?,
            Some(columns) => {
                self.read_columns(partition, range, columns, positions)
                    .await?
            }
        };
        Ok(Some(read))
    }

    /// The schema of the batches [`Source::read`] returns now, if schema evolution has grown it
    /// since [`Source::open`] (`None`: the schema `open` returned is still in force).
    async fn current_schema(&self) -> Option<SchemaRef> {
        None
    }

    /// Called when `partition`'s latest offset is below `committed_end`, where the job's
    /// committed batches already read up to: the log went backwards (a Kafka topic deleted and
    /// recreated, an unclean leader election). Offsets only grow in Sluice, so the records the
    /// new log holds below `committed_end` can never be read. Return an error to stop the job
    /// (the default, and what the user should see unless they chose otherwise), or the reason
    /// for one dead letter naming the skipped offsets, after which the job reads on from
    /// `committed_end` once the partition gets there.
    ///
    /// # Errors
    /// The error that stops the job, naming the partition and both offsets.
    fn offsets_behind(
        &self,
        partition: &PartitionId,
        committed_end: Offset,
        latest: Offset,
    ) -> Result<String> {
        Err(crate::error::Error::InvalidJob(format!(
            "partition {partition}: the latest offset is {latest}, below the {committed_end} \
             this job has committed: the input was replaced or truncated, and its records \
             below {committed_end} would never be read"
        )))
    }
}

/// The schema of a source's batches: its data columns plus the lineage columns.
pub fn with_lineage_fields(data: &Schema, with_position: bool) -> SchemaRef {
    let mut fields: Vec<Field> = data.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(SOURCE_PARTITION, DataType::Utf8, false));
    fields.push(Field::new(SOURCE_OFFSET, DataType::Int64, false));
    if with_position {
        fields.push(Field::new(SOURCE_POSITION, DataType::Utf8, false));
    }
    Arc::new(Schema::new_with_metadata(fields, data.metadata().clone()))
}

/// Appends the lineage columns to a batch of decoded rows that all come from one offset, with
/// an optional per-row position (see [`numbered_positions`]).
///
/// # Errors
/// If `positions` does not have one entry per row, or has a null; if the partition name
/// repeated on every row passes 2 GiB (32-bit offsets).
pub fn attach_lineage(
    data: RecordBatch,
    partition: &str,
    offset: Offset,
    positions: Option<StringArray>,
) -> Result<RecordBatch> {
    let schema = with_lineage_fields(&data.schema(), positions.is_some());
    let positions = positions.map(|p| Arc::new(p) as ArrayRef);
    with_lineage_columns(data, schema, partition, offset, positions)
}

/// `data` with the lineage columns of `schema` (its data columns followed by them) appended:
/// the partition and offset repeated, and `position` if given.
fn with_lineage_columns(
    data: RecordBatch,
    schema: SchemaRef,
    partition: &str,
    offset: Offset,
    position: Option<ArrayRef>,
) -> Result<RecordBatch> {
    let n = data.num_rows();
    let mut columns: Vec<ArrayRef> = data.columns().to_vec();
    columns.push(Arc::new(repeated(partition, n)?));
    columns.push(Arc::new(Int64Array::from_value(offset, n)));
    columns.extend(position);
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// [`attach_lineage`] with each row's position `numbers` in `form`: as text `{name}:{number}`
/// ([`numbered_positions`]), or as the numbers themselves in [`SOURCE_ROW`].
///
/// # Errors
/// As [`attach_lineage`].
pub fn attach_numbered_lineage(
    data: RecordBatch,
    partition: &str,
    offset: Offset,
    name: &str,
    numbers: &[usize],
    form: PositionForm,
) -> Result<RecordBatch> {
    let position: ArrayRef = match form {
        PositionForm::Text => Arc::new(numbered_positions(name, numbers)?),
        // In one pass over a trusted length (a fallible collect built the array a value at a
        // time: 2 % of a Parquet filter query's CPU). No row number reaches `i64::MAX`.
        PositionForm::Numbers => Arc::new(Int64Array::from_iter_values(
            numbers
                .iter()
                .map(|&n| i64::try_from(n).unwrap_or(i64::MAX)),
        )),
    };
    // The schema the engine checks such a read against.
    let schema = schema_in_form(&with_lineage_fields(&data.schema(), true), form);
    with_lineage_columns(data, schema, partition, offset, Some(position))
}

/// `schema` (a source's, with [`SOURCE_POSITION`]) as a read in `form` gives it: for
/// [`PositionForm::Numbers`], [`SOURCE_ROW`] (Int64) where the position was.
pub fn schema_in_form(schema: &SchemaRef, form: PositionForm) -> SchemaRef {
    if form == PositionForm::Text {
        return Arc::clone(schema);
    }
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| match f.name() == SOURCE_POSITION {
            true => Field::new(SOURCE_ROW, DataType::Int64, false),
            false => f.as_ref().clone(),
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// `value` `n` times, its text copied in one go (a value appended per row was a few percent of
/// reading a Parquet batch).
fn repeated(value: &str, n: usize) -> Result<StringArray> {
    // Arrow's constructor panics past 32-bit offsets: checked here first.
    let total = value
        .len()
        .checked_mul(n)
        .filter(|t| i32::try_from(*t).is_ok());
    if total.is_none() {
        let total = value.len().saturating_mul(n);
        return Err(arrow::error::ArrowError::OffsetOverflowError(total).into());
    }
    Ok(StringArray::new_repeated(value, n))
}

/// The positions `{name}:{number}` of rows numbered `numbers` within `name` (lines of a file),
/// for [`SOURCE_POSITION`], written into one buffer. A read makes one per row, so it is cheap:
/// numbers of one ten share all their text but the last digit (`{name}:{number / 10}`, or
/// `{name}:` below 10), held aside and formatted afresh only when the tens change; each row is
/// that text and its last digit. A `String` per row made a Parquet batch's read about a third
/// slower, and counting each row's digits up in place (characters popped and pushed) was still
/// a fifth of a Parquet filter query's CPU.
///
/// # Errors
/// If the positions' text passes 2 GiB (32-bit offsets).
pub fn numbered_positions(name: &str, numbers: &[usize]) -> Result<StringArray> {
    // `{name}:` and up to 7 digits a row; the builder grows past that if it must.
    let bytes = numbers.len().saturating_mul(name.len() + 8);
    let mut positions = StringBuilder::with_capacity(numbers.len(), bytes.min(i32::MAX as usize));
    let mut formatter = itoa::Buffer::new();
    // The row's text: `{name}:`, the number's digits but its last (none below 10), the last.
    let mut row = String::with_capacity(name.len() + 21);
    let mut tens_held: Option<usize> = None;
    let mut head = 0;
    let mut written = 0usize;
    for &number in numbers {
        let tens = number / 10;
        if tens_held != Some(tens) {
            row.clear();
            row.push_str(name);
            row.push(':');
            if tens > 0 {
                row.push_str(formatter.format(tens));
            }
            head = row.len();
            tens_held = Some(tens);
        }
        row.truncate(head);
        row.push(char::from(b'0' + (number % 10) as u8));
        written += row.len();
        if i32::try_from(written).is_err() {
            return Err(arrow::error::ArrowError::OffsetOverflowError(written).into());
        }
        positions.append_value(&row);
    }
    Ok(positions.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    use arrow::array::Array;

    #[test]
    fn numbered_positions_name_each_row() {
        let positions = numbered_positions("data/a.json", &[1, 9, 10, 1_234_567_890]).unwrap();
        let positions: Vec<&str> = positions.iter().flatten().collect();
        assert_eq!(
            positions,
            [
                "data/a.json:1",
                "data/a.json:9",
                "data/a.json:10",
                "data/a.json:1234567890"
            ]
        );
        assert_eq!(numbered_positions("a", &[]).unwrap().len(), 0);
    }

    /// A read in either form carries the same rows and lineage: the numbers form has the
    /// schema [`schema_in_form`] gives (what the engine checks a read against), and each
    /// number is what the text ends with, after the name.
    #[test]
    fn numbered_lineage_in_either_form_names_the_same_rows() {
        let data = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, true)])),
            vec![Arc::new(Int64Array::from(vec![Some(4), None, Some(6)]))],
        )
        .unwrap();
        let numbers = [1, 3, 10];
        let form = |form| {
            attach_numbered_lineage(data.clone(), "0", 7, "in/a:b.json", &numbers, form).unwrap()
        };
        let (text, numbered) = (form(PositionForm::Text), form(PositionForm::Numbers));
        assert_eq!(
            numbered.schema(),
            schema_in_form(&text.schema(), PositionForm::Numbers)
        );
        assert_eq!(
            schema_in_form(&text.schema(), PositionForm::Text),
            text.schema()
        );
        let positions = text.column_by_name(SOURCE_POSITION).unwrap();
        let positions: Vec<&str> = positions
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap()
            .iter()
            .flatten()
            .collect();
        let rows = numbered.column_by_name(SOURCE_ROW).unwrap();
        let rows: Vec<i64> = rows
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .values()
            .to_vec();
        assert_eq!(
            positions,
            ["in/a:b.json:1", "in/a:b.json:3", "in/a:b.json:10"]
        );
        assert_eq!(rows, [1, 3, 10]);
        for name in [SOURCE_PARTITION, SOURCE_OFFSET, "v"] {
            assert_eq!(
                text.column_by_name(name),
                numbered.column_by_name(name),
                "{name}"
            );
        }
    }

    /// Runs of numbers across tens, carries, skips and repeats: each row reads as its number
    /// formatted on its own.
    #[test]
    fn numbered_positions_count_up_across_carries_and_skips() {
        let mut numbers: Vec<usize> = (0..=1_100).collect();
        numbers.extend([
            1_105,
            1_106,
            1_106,
            3,
            4,
            99_999,
            100_000,
            100_001,
            usize::MAX,
        ]);
        numbers.extend(999_998..1_000_003);
        let positions = numbered_positions("f.json", &numbers).unwrap();
        assert_eq!(positions.len(), numbers.len());
        for (row, number) in numbers.iter().enumerate() {
            assert_eq!(positions.value(row), format!("f.json:{number}"));
        }
    }

    #[test]
    fn lineage_repeats_the_partition_on_every_row() {
        let data = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)])),
            vec![Arc::new(Int64Array::from(vec![1, 2, 3]))],
        )
        .unwrap();
        for partition in ["p-7", ""] {
            let batch = attach_lineage(data.clone(), partition, 4, None).unwrap();
            let partitions = batch
                .column_by_name(SOURCE_PARTITION)
                .unwrap()
                .as_any()
                .downcast_ref::<StringArray>()
                .unwrap();
            let values: Vec<&str> = partitions.iter().flatten().collect();
            assert_eq!(values, [partition; 3]);
        }
        let empty = attach_lineage(data.slice(0, 0), "p", 4, None).unwrap();
        assert_eq!(empty.num_rows(), 0);
    }

    #[tokio::test]
    async fn cpu_bound_work_runs_off_the_calling_thread_and_returns_its_result() {
        let caller = std::thread::current().id();
        let (value, worker) = cpu_bound(|| (6 * 7, std::thread::current().id())).await;
        assert_eq!(value, 42);
        assert_ne!(worker, caller);
    }

    #[tokio::test]
    async fn a_panic_in_cpu_bound_work_resumes_in_the_caller() {
        let caught = tokio::spawn(cpu_bound(|| -> u8 { panic!("decoder bug") })).await;
        let panic = caught.unwrap_err().into_panic();
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"decoder bug"));
    }
}
