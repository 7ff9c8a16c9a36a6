//! Late rows: events that arrived after a window they belong to had closed, or after their
//! key's deduplication state was forgotten.
//!
//! A closed window has been emitted (append mode) and its state purged, so a row that falls into
//! it can no longer change it. Such a row is never dropped silently: it goes once to the late
//! table with the watermark that was in force and the windows it missed, and it still counts in
//! any of its windows that are open (hopping windows overlap). Likewise a row a deduplication
//! can no longer judge (its event time + `state_ttl` at or below the watermark: a first row of
//! its key would have been forgotten) goes to the late table instead of the output, with
//! [`WINDOWS_MISSED`] null. The late table's schema is the source row's columns plus
//! [`WATERMARK`], [`WINDOWS_MISSED`] and `batch_id`.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, AsArray, BooleanArray, Int64Array, ListBuilder, RecordBatch,
    TimestampMicrosecondArray, TimestampMicrosecondBuilder,
};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimestampMicrosecondType};

use crate::error::{Error, Result};
use crate::event_time::event_time_type;
use crate::offsets::BatchId;
use crate::window::WindowKind;

/// Late-table column: the watermark in force when the row arrived.
pub const WATERMARK: &str = "_watermark";
/// Late-table column: the starts of the windows the row missed.
pub const WINDOWS_MISSED: &str = "_windows_missed";
/// Late-table column: the batch that read the row.
pub const BATCH_ID: &str = "batch_id";
/// Late-table column of a job joining two streams: the source the row came from.
pub const SOURCE: &str = "_source";

/// The late table's schema for rows of `source` (a source schema after event-time parsing);
/// `windows`: whether rows are late for windows (else [`WINDOWS_MISSED`] is null).
pub fn late_schema(source: &SchemaRef, windows: bool) -> SchemaRef {
    let mut fields: Vec<Field> = source.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(WATERMARK, event_time_type(), false));
    fields.push(Field::new(
        WINDOWS_MISSED,
        DataType::List(Arc::new(Field::new_list_field(event_time_type(), true))),
        !windows,
    ));
    fields.push(Field::new(BATCH_ID, DataType::Int64, false));
    Arc::new(Schema::new(fields))
}

/// The late table's schema for a job joining streams: [`SOURCE`], then every column of the
/// `sources` (nullable; a column two sources share appears once), then the late columns.
///
/// # Errors
/// If two sources have a column of the same name and different types.
pub fn late_schema_of_sources(sources: &[(&str, &SchemaRef)]) -> Result<SchemaRef> {
    let mut fields = vec![Field::new(SOURCE, DataType::Utf8, false)];
    let mut owner: Vec<&str> = vec![""];
    for (source, schema) in sources {
        if schema.index_of(SOURCE).is_ok() {
            return Err(Error::InvalidJob(format!(
                "the late table of a job joining streams names each row's source in its column \
                 {SOURCE}, and source '{source}' has a column of that name: rename it"
            )));
        }
        for f in schema.fields() {
            match fields.iter().position(|g| g.name() == f.name()) {
                Some(i) if fields[i].data_type() != f.data_type() => {
                    return Err(Error::InvalidJob(format!(
                        "the late table holds the late rows of sources '{}' and '{source}' in \
                         one table, and their column '{}' has types {} and {}: declare the same \
                         type in both sources' schemas, or rename the column in one",
                        owner[i],
                        f.name(),
                        fields[i].data_type(),
                        f.data_type()
                    )));
                }
                Some(_) => {}
                None => {
                    fields.push(f.as_ref().clone().with_nullable(true));
                    owner.push(source);
                }
            }
        }
    }
    let late = late_schema(&Arc::new(Schema::empty()), false);
    fields.extend(late.fields().iter().map(|f| f.as_ref().clone()));
    Ok(Arc::new(Schema::new(fields)))
}

/// `rows` without those a join of streams leaves out as late: without an event time (in
/// `time_column`; such a row is a dead letter before this) or with one below `limit` — the rows
/// [`below_watermark`] puts in the late table. A chunk without one is kept as it is, not copied.
///
/// # Errors
/// If `time_column` is missing or not a timestamp (a planning bug, not a data problem).
pub fn on_time_rows(
    rows: &[RecordBatch],
    time_column: &str,
    limit: i64,
) -> Result<Vec<RecordBatch>> {
    let mut on_time = Vec::with_capacity(rows.len());
    for chunk in rows {
        let times = event_times(chunk, time_column, "join")?;
        if arrow::array::Array::null_count(times) == 0
            && arrow::compute::min(times).is_none_or(|t| t >= limit)
        {
            on_time.push(chunk.clone());
            continue;
        }
        let keep: BooleanArray = times
            .iter()
            .map(|t| Some(t.is_some_and(|t| t >= limit)))
            .collect();
        let kept = filter_record_batch(chunk, &keep)?;
        if kept.num_rows() > 0 {
            on_time.push(kept);
        }
    }
    Ok(on_time)
}

/// The rows of `rows` (of `source`, event time in `time_column`) below `limit` — late for a
/// join of streams under `watermark` — as rows of the late table `schema` (see
/// [`late_schema_of_sources`]); `None` if there are none.
///
/// # Errors
/// If `time_column` is missing or not a timestamp (a planning bug, not a data problem).
pub fn below_watermark(
    rows: &RecordBatch,
    source: &str,
    time_column: &str,
    (limit, watermark): (i64, i64),
    batch_id: BatchId,
    schema: &SchemaRef,
) -> Result<Option<RecordBatch>> {
    let times = event_times(rows, time_column, "join")?;
    let late: BooleanArray = times
        .iter()
        .map(|t| Some(t.is_some_and(|t| t < limit)))
        .collect();
    let late = filter_record_batch(rows, &late)?;
    if late.num_rows() == 0 {
        return Ok(None);
    }
    let late = late_table_rows(&late, watermark, None, batch_id)?;
    of_source(&late, source, schema).map(Some)
}

/// `late` (late-table rows of one source, see [`late_schema`]) as rows of the late table
/// `schema` of a job joining streams (see [`late_schema_of_sources`]): [`SOURCE`] set to
/// `source`, the other sources' columns null.
///
/// # Errors
/// If a column cannot be cast to the table's type (a planning bug: the schemas were checked).
pub fn of_source(late: &RecordBatch, source: &str, schema: &SchemaRef) -> Result<RecordBatch> {
    let n = late.num_rows();
    let columns = schema
        .fields()
        .iter()
        .map(|f| {
            if f.name() == SOURCE {
                Ok(Arc::new(arrow::array::StringArray::from(vec![source; n])) as ArrayRef)
            } else {
                match late.column_by_name(f.name()) {
                    Some(c) if c.data_type() == f.data_type() => Ok(Arc::clone(c)),
                    Some(c) => Ok(arrow::compute::cast(c, f.data_type())?),
                    None => Ok(arrow::array::new_null_array(f.data_type(), n)),
                }
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

/// Which windows are closed under a watermark: those whose end plus the allowed lateness is at
/// or below it.
#[derive(Debug, Clone, Copy)]
pub struct Lateness {
    /// The windows rows are assigned to.
    pub kind: WindowKind,
    /// How long after its end a window still accepts rows, in µs.
    pub allowed_lateness: i64,
}

impl Lateness {
    /// Whether the window starting at `start` is closed under `watermark`.
    pub fn is_closed(&self, start: i64, watermark: i64) -> bool {
        start
            .saturating_add(self.kind.size())
            .saturating_add(self.allowed_lateness)
            <= watermark
    }

    /// The smallest window start that is still open under `watermark`.
    pub fn first_open_start(&self, watermark: i64) -> i64 {
        watermark
            .saturating_sub(self.kind.size())
            .saturating_sub(self.allowed_lateness)
            .saturating_add(1)
    }

    /// The rows of `rows` (with event time in `time_column`) that missed a closed window, as
    /// late-table rows; `None` if none did. Without a watermark nothing is closed.
    ///
    /// # Errors
    /// If `time_column` is missing or not a timestamp (a planning bug, not a data problem).
    pub fn late_rows(
        &self,
        rows: &RecordBatch,
        time_column: &str,
        watermark: Option<i64>,
        batch_id: BatchId,
    ) -> Result<Option<RecordBatch>> {
        let Some(watermark) = watermark else {
            return Ok(None);
        };
        let times = event_times(rows, time_column, "window")?;
        // The common case: even the oldest row's oldest window is open, so nothing is late.
        let oldest = arrow::compute::min(times);
        if oldest.is_none_or(|t| {
            self.kind
                .starts(t)
                .first()
                .is_none_or(|s| !self.is_closed(*s, watermark))
        }) {
            return Ok(None);
        }
        let mut keep = Vec::with_capacity(rows.num_rows());
        let mut missed = ListBuilder::new(TimestampMicrosecondBuilder::new().with_timezone("UTC"))
            .with_field(Arc::new(Field::new_list_field(event_time_type(), true)));
        for i in 0..rows.num_rows() {
            // Event time is never null here: rows without it are dead letters already.
            let starts: Vec<i64> = self
                .kind
                .starts(times.value(i))
                .into_iter()
                .filter(|s| self.is_closed(*s, watermark))
                .collect();
            keep.push(!starts.is_empty());
            if !starts.is_empty() {
                missed.values().append_slice(&starts);
                missed.append(true);
            }
        }
        let late = filter_record_batch(rows, &BooleanArray::from(keep))?;
        if late.num_rows() == 0 {
            return Ok(None);
        }
        let missed: ArrayRef = Arc::new(missed.finish());
        late_table_rows(&late, watermark, Some(missed), batch_id).map(Some)
    }
}

/// The event times of `rows` in `time_column`, which the `operator` (for the message) reads.
fn event_times<'a>(
    rows: &'a RecordBatch,
    time_column: &str,
    operator: &str,
) -> Result<&'a arrow::array::PrimitiveArray<TimestampMicrosecondType>> {
    rows.column_by_name(time_column)
        .and_then(|c| c.as_primitive_opt::<TimestampMicrosecondType>())
        .ok_or_else(|| {
            Error::UnsupportedQuery(format!(
                "the {operator}'s time column '{time_column}' is not an event-time column"
            ))
        })
}

/// `late` (source rows) as late-table rows: the watermark they met, the windows they missed
/// (`None`: no window applies, null) and the batch.
fn late_table_rows(
    late: &RecordBatch,
    watermark: i64,
    missed: Option<ArrayRef>,
    batch_id: BatchId,
) -> Result<RecordBatch> {
    let n = late.num_rows();
    let windows = missed.is_some();
    let missed = missed.unwrap_or_else(|| {
        arrow::array::new_null_array(
            &DataType::List(Arc::new(Field::new_list_field(event_time_type(), true))),
            n,
        )
    });
    let mut columns: Vec<ArrayRef> = late.columns().to_vec();
    columns.push(Arc::new(
        TimestampMicrosecondArray::from(vec![watermark; n]).with_timezone("UTC"),
    ));
    columns.push(missed);
    columns.push(Arc::new(Int64Array::from(vec![batch_id.0; n])));
    Ok(RecordBatch::try_new(
        late_schema(&late.schema(), windows),
        columns,
    )?)
}

/// The rows of `rows` (event time in `time_column`) a deduplication remembering keys for
/// `horizon` µs can no longer judge under `watermark` (event time + horizon at or below it),
/// as late-table rows with no windows missed; `None` if there are none.
///
/// # Errors
/// If `time_column` is missing or not a timestamp (a planning bug, not a data problem).
pub fn expired_rows(
    rows: &RecordBatch,
    time_column: &str,
    watermark: Option<i64>,
    horizon: i64,
    batch_id: BatchId,
) -> Result<Option<RecordBatch>> {
    let Some(watermark) = watermark else {
        return Ok(None);
    };
    let times = event_times(rows, time_column, "deduplication")?;
    let late: BooleanArray = times
        .iter()
        .map(|t| Some(t.is_some_and(|t| t.saturating_add(horizon) <= watermark)))
        .collect();
    let late = filter_record_batch(rows, &late)?;
    if late.num_rows() == 0 {
        return Ok(None);
    }
    late_table_rows(&late, watermark, None, batch_id).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Array;

    const MINUTE: i64 = 60_000_000;

    fn rows(times: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "ts",
            event_time_type(),
            false,
        )]));
        RecordBatch::try_new(
            schema,
            vec![Arc::new(
                TimestampMicrosecondArray::from(times.to_vec()).with_timezone("UTC"),
            )],
        )
        .unwrap()
    }

    #[test]
    fn a_row_is_late_for_the_closed_windows_only() {
        let hop = Lateness {
            kind: WindowKind::Hop {
                slide: 20_000_000,
                size: MINUTE,
            },
            allowed_lateness: 10_000_000,
        };
        // Watermark 1:30: windows ending by 1:20 are closed ([0:20, 1:20) and before).
        let watermark = 90_000_000;
        let late = hop
            .late_rows(
                &rows(&[65_000_000, 85_000_000, 100_000_000]),
                "ts",
                Some(watermark),
                BatchId(7),
            )
            .unwrap()
            .unwrap();
        // 1:05 is in [0:20,1:20) (closed), [0:40,1:40) and [1:00,2:00) (open); 1:25 and 1:40 miss none.
        assert_eq!(late.num_rows(), 1);
        let missed = late
            .column_by_name(WINDOWS_MISSED)
            .unwrap()
            .as_list::<i32>();
        let starts = missed.value(0);
        assert_eq!(
            starts.as_primitive::<TimestampMicrosecondType>().values(),
            &[20_000_000]
        );
        assert_eq!(late.schema(), late_schema(&rows(&[]).schema(), true));
        assert!(
            hop.late_rows(&rows(&[65_000_000]), "ts", None, BatchId(0))
                .unwrap()
                .is_none()
        );
        assert_eq!(late.column_by_name(BATCH_ID).unwrap().len(), 1);
    }

    #[test]
    fn the_first_open_start_agrees_with_is_closed() {
        let l = Lateness {
            kind: WindowKind::Tumble { size: MINUTE },
            allowed_lateness: 5,
        };
        for wm in [-3 * MINUTE, 0, 7, MINUTE + 5, 10 * MINUTE + 3] {
            let first = l.first_open_start(wm);
            assert!(!l.is_closed(first, wm));
            assert!(l.is_closed(first - 1, wm));
        }
    }
}
