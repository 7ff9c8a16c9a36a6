//! A job's input: its sources opened against the checkpoint, and one range of a source read
//! into rows — decoded, event time parsed, and everything that fails set aside as dead letters.
//!
//! Shared by the live loop ([`crate::driver`]), [`crate::backfill`] and [`crate::reconcile`],
//! so all three see the same rows for the same offsets.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use futures::future::try_join_all;

use crate::checkpoint::CheckpointStore;
use crate::dead_letter::{SOURCE_NAME, dead_letter_from_row};
use crate::error::{Error, Result};
use crate::event_time::{
    EventTimeConfig, TOO_FAR_AHEAD, extract_event_time, schema_with_event_time,
};
use crate::job::SourceSpec;
use crate::offsets::{OffsetRange, PartitionId};
use crate::query::{QuerySettings, StreamingQuery};
use crate::sink::{Sink, TableScan};
use crate::source::{
    DeadLetter, SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION, Source, SourceContext,
};

/// One opened source.
pub(crate) struct OpenSource {
    pub(crate) name: String,
    pub(crate) source: Box<dyn Source>,
    pub(crate) event_time: Option<EventTimeConfig>,
    /// The schema the query sees (event-time column already converted).
    pub(crate) schema: SchemaRef,
}

/// Opens every source (with its folder of the checkpoint) and plans the query over their
/// schemas. `validating`: the job is only being checked — sources write nothing and give up on
/// an unreachable service instead of retrying.
pub(crate) async fn open_sources_and_query(
    specs: Vec<SourceSpec>,
    sql: &str,
    settings: &QuerySettings,
    checkpoint: &CheckpointStore,
    validating: bool,
) -> Result<(Vec<OpenSource>, StreamingQuery)> {
    let mut sources = Vec::with_capacity(specs.len());
    for spec in specs {
        let mut source = spec.source;
        let ctx = SourceContext {
            name: spec.name.clone(),
            checkpoint: checkpoint.child("sources").child(&spec.name),
            validating,
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

/// Where a row came from: partition, offset and position (`file.json:17`, or `partition@offset`
/// where there is nothing finer) — the same triple a dead letter records.
type RowKey = (String, i64, String);

/// How a read judges event times that lie too far ahead (see [`crate::event_time`]).
#[derive(Debug, Clone)]
pub(crate) enum FutureTimes {
    /// A live batch: against the clock recorded in its intent (µs since the epoch).
    Clock(i64),
    /// A replay of committed offsets (backfill, reconcile): exactly as the live job judged
    /// them — the rows its dead-letter table lists as too far ahead, with the reason it gave.
    AsRecorded(Arc<HashMap<RowKey, String>>),
}

impl FutureTimes {
    /// The live job's judgement of `source`'s rows, read from its dead-letter table (only the
    /// rows it judged too far ahead).
    ///
    /// # Errors
    /// If the table cannot be read.
    pub(crate) async fn as_recorded_by(sink: &dyn Sink, source: &str) -> Result<FutureTimes> {
        let scan = TableScan {
            columns: None,
            filter: Some(format!(
                "{SOURCE_NAME} = '{}' AND starts_with(error, '{TOO_FAR_AHEAD}')",
                source.replace('\'', "''")
            )),
        };
        FutureTimes::recorded(&sink.read_dead_letters(&scan).await?, source)
    }

    /// The live job's judgement, from its dead-letter table's rows of `source`.
    ///
    /// # Errors
    /// If the rows lack the dead-letter columns.
    fn recorded(dead_letters: &[RecordBatch], source: &str) -> Result<FutureTimes> {
        let mut rows = HashMap::new();
        for b in dead_letters {
            let column = |name: &str, to: &DataType| table_column(b, name, to, "dead-letter");
            let (names, partitions, positions, errors) = (
                column(SOURCE_NAME, &DataType::Utf8)?,
                column(SOURCE_PARTITION, &DataType::Utf8)?,
                column(SOURCE_POSITION, &DataType::Utf8)?,
                column("error", &DataType::Utf8)?,
            );
            let offsets = column(SOURCE_OFFSET, &DataType::Int64)?;
            let (names, partitions, positions, errors) = (
                names.as_string::<i32>(),
                partitions.as_string::<i32>(),
                positions.as_string::<i32>(),
                errors.as_string::<i32>(),
            );
            let offsets = offsets.as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                if names.value(i) == source && errors.value(i).starts_with(TOO_FAR_AHEAD) {
                    let key = (
                        partitions.value(i).to_string(),
                        offsets.value(i),
                        positions.value(i).to_string(),
                    );
                    rows.insert(key, errors.value(i).to_string());
                }
            }
        }
        Ok(FutureTimes::AsRecorded(Arc::new(rows)))
    }
}

/// Column `name` of rows read back from the `table` table, cast to `to` (strings read back from
/// a table may come as views).
///
/// # Errors
/// If the column is missing or does not cast.
pub(crate) fn table_column(
    batch: &RecordBatch,
    name: &str,
    to: &DataType,
    table: &str,
) -> Result<ArrayRef> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| Error::InvalidJob(format!("the {table} table has no column {name}")))?;
    Ok(arrow::compute::kernels::cast::cast(column, to)?)
}

/// Reads every range of one source (partitions concurrently), parses event time, and returns
/// the rows as one batch plus the dead letters.
pub(crate) async fn read_source(
    s: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
    future: &FutureTimes,
) -> Result<(RecordBatch, Vec<DeadLetter>)> {
    let reads = try_join_all(
        ranges
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(p, r)| s.source.read(p, *r)),
    )
    .await?;
    let clock = match future {
        FutureTimes::Clock(clock) => Some(*clock),
        FutureTimes::AsRecorded(_) => None,
    };
    let mut letters = Vec::new();
    let mut batches = Vec::new();
    for read in reads {
        letters.extend(read.dead_letters);
        for batch in read.batches {
            let Some(time) = &s.event_time else {
                batches.push(batch);
                continue;
            };
            let (parsed, mut bad) =
                extract_event_time(&batch, time, clock).map_err(|e| Error::source(&s.name, e))?;
            if let FutureTimes::AsRecorded(recorded) = future
                && !recorded.is_empty()
            {
                for row in 0..batch.num_rows() {
                    if let Some(reason) = recorded.get(&row_key(&batch, row))
                        && !bad.iter().any(|b| b.row == row)
                    {
                        bad.push(crate::event_time::BadEventTime {
                            row,
                            reason: reason.clone(),
                        });
                    }
                }
                bad.sort_by_key(|b| b.row);
            }
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
    let rows = concat_batches(&s.schema, &batches)?;
    Ok((rows, letters))
}

/// The key of row `row` of a source batch, as [`dead_letter_from_row`] would record it.
fn row_key(batch: &RecordBatch, row: usize) -> RowKey {
    let string = |name: &str| {
        batch
            .column_by_name(name)
            .and_then(|c| c.as_string_opt::<i32>())
            .filter(|c| !c.is_null(row))
            .map(|c| c.value(row).to_string())
    };
    let partition = string(SOURCE_PARTITION).unwrap_or_default();
    let offset = batch
        .column_by_name(SOURCE_OFFSET)
        .and_then(|c| c.as_primitive_opt::<Int64Type>())
        .map_or(0, |c| c.value(row));
    let position = string(SOURCE_POSITION).unwrap_or_else(|| format!("{partition}@{offset}"));
    (partition, offset, position)
}
