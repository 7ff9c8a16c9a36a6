//! Event time: the timestamp a row carries, parsed from one of its columns — never the clock.
//!
//! A source names its event-time column and format in the job file. Here the column is parsed
//! into `Timestamp(Microsecond, UTC)` in place; rows whose event time is missing or unparsable are
//! returned separately so the driver can dead-letter them with the reason.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::Scalar;
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, TimestampMicrosecondArray};
use arrow::compute::filter_record_batch;
use arrow::compute::kernels::{boolean, cast, cmp};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, TimeUnit};
use chrono::{DateTime, NaiveDateTime, Utc};

use crate::error::{Error, Result};

/// The type every event-time column is converted to.
pub fn event_time_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// How event-time strings or numbers are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventTimeFormat {
    /// RFC 3339 strings (`2024-05-01T12:00:00Z`); a space for `T` and a missing offset (UTC) are
    /// accepted too. Timestamp columns are used as they are.
    Rfc3339,
    /// Integers: milliseconds since the Unix epoch.
    EpochMillis,
    /// Integers: microseconds since the Unix epoch.
    EpochMicros,
    /// Strings in a `strftime` pattern such as `%d/%m/%Y %H:%M:%S` (UTC unless it has `%z`).
    Strftime(String),
}

impl std::str::FromStr for EventTimeFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rfc3339" => Ok(EventTimeFormat::Rfc3339),
            "epoch_millis" => Ok(EventTimeFormat::EpochMillis),
            "epoch_micros" => Ok(EventTimeFormat::EpochMicros),
            p if p.contains('%') => Ok(EventTimeFormat::Strftime(p.to_string())),
            other => Err(Error::InvalidJob(format!(
                "event_time_format '{other}' is not one of rfc3339, epoch_millis, epoch_micros \
                 or a strftime pattern (containing %)"
            ))),
        }
    }
}

/// Event-time settings of one source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTimeConfig {
    /// The column holding event time.
    pub column: String,
    /// How it is written.
    pub format: EventTimeFormat,
    /// How far behind the newest event the watermark trails.
    pub max_out_of_orderness: Duration,
    /// After how long a silent partition stops holding the watermark back (`None`: never).
    pub idle_timeout: Option<Duration>,
}

/// A row whose event time could not be read, with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadEventTime {
    /// Row index in the batch.
    pub row: usize,
    /// Why.
    pub reason: String,
}

/// The schema after event-time extraction: the event-time column becomes
/// `Timestamp(Microsecond, UTC)`.
///
/// # Errors
/// If the column does not exist, naming it and the columns that do.
pub fn schema_with_event_time(schema: &Schema, column: &str) -> Result<Arc<Schema>> {
    let idx = schema.index_of(column).map_err(|_| {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        Error::InvalidJob(format!(
            "event_time column '{column}' is not in the source schema ({})",
            names.join(", ")
        ))
    })?;
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields[idx] = Field::new(column, event_time_type(), true);
    Ok(Arc::new(Schema::new_with_metadata(
        fields,
        schema.metadata().clone(),
    )))
}

/// Parses the event-time column of `batch` in place.
///
/// Returns the batch with the column converted and the rows whose event time is missing or
/// unparsable (those rows are still in the batch, with a null event time; the caller removes
/// them).
pub fn extract_event_time(
    batch: &RecordBatch,
    config: &EventTimeConfig,
) -> Result<(RecordBatch, Vec<BadEventTime>)> {
    let schema = schema_with_event_time(&batch.schema(), &config.column)?;
    let idx = schema.index_of(&config.column)?;
    let input = batch.column(idx);
    let mut bad = Vec::new();
    let parsed: TimestampMicrosecondArray = match (input.data_type(), &config.format) {
        (DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View, format) => {
            let strings = cast::cast(input, &DataType::Utf8)?;
            let strings = strings.as_string::<i32>();
            (0..strings.len())
                .map(|row| {
                    if strings.is_null(row) {
                        bad.push(missing(row, &config.column));
                        return None;
                    }
                    let s = strings.value(row);
                    match parse_string(s, format) {
                        Ok(micros) => Some(micros),
                        Err(reason) => {
                            bad.push(BadEventTime {
                                row,
                                reason: format!(
                                    "event time column '{}': cannot parse '{s}' as {reason}",
                                    config.column
                                ),
                            });
                            None
                        }
                    }
                })
                .collect()
        }
        (
            DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::UInt64,
            format,
        ) => {
            let scale = match format {
                EventTimeFormat::EpochMillis => 1000,
                EventTimeFormat::EpochMicros => 1,
                other => {
                    return Err(Error::InvalidJob(format!(
                        "event_time column '{}' holds integers, but event_time_format is {other:?}; \
                         use epoch_millis or epoch_micros",
                        config.column
                    )));
                }
            };
            let ints = cast::cast(input, &DataType::Int64)?;
            let ints = ints.as_primitive::<Int64Type>();
            (0..ints.len())
                .map(|row| {
                    if ints.is_null(row) {
                        bad.push(missing(row, &config.column));
                        None
                    } else {
                        Some(ints.value(row).saturating_mul(scale))
                    }
                })
                .collect()
        }
        (DataType::Timestamp(_, _) | DataType::Date32 | DataType::Date64, _) => {
            let cast = cast::cast(input, &event_time_type())?;
            let ts = cast.as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
            for row in 0..ts.len() {
                if ts.is_null(row) {
                    bad.push(missing(row, &config.column));
                }
            }
            ts.clone()
        }
        (other, _) => {
            return Err(Error::InvalidJob(format!(
                "event_time column '{}' has type {other}, which is not a timestamp, string or integer",
                config.column
            )));
        }
    };
    let parsed: ArrayRef = Arc::new(parsed.with_timezone("UTC"));
    let mut columns = batch.columns().to_vec();
    columns[idx] = parsed;
    Ok((RecordBatch::try_new(schema, columns)?, bad))
}

fn missing(row: usize, column: &str) -> BadEventTime {
    BadEventTime {
        row,
        reason: format!("event time column '{column}' is missing (null)"),
    }
}

fn parse_string(s: &str, format: &EventTimeFormat) -> std::result::Result<i64, String> {
    match format {
        EventTimeFormat::Rfc3339 => {
            arrow::compute::kernels::cast_utils::string_to_datetime(&Utc, s)
                .map(|t| t.timestamp_micros())
                .map_err(|_| "RFC 3339".to_string())
        }
        EventTimeFormat::EpochMillis | EventTimeFormat::EpochMicros => {
            let n: i64 = s.trim().parse().map_err(|_| format!("{format:?}"))?;
            Ok(if *format == EventTimeFormat::EpochMillis {
                n.saturating_mul(1000)
            } else {
                n
            })
        }
        EventTimeFormat::Strftime(pattern) => {
            if pattern.contains("%z") || pattern.contains("%:z") {
                DateTime::parse_from_str(s, pattern).map(|t| t.timestamp_micros())
            } else {
                NaiveDateTime::parse_from_str(s, pattern).map(|t| t.and_utc().timestamp_micros())
            }
            .map_err(|_| format!("'{pattern}'"))
        }
    }
}

/// The rows of `batch` whose event time (`column`, any timestamp type) lies in `[from, to)`
/// (µs since the epoch): the one definition of "in a period" for reconciliation and backfill.
///
/// # Errors
/// If the column is missing or not a timestamp.
pub fn rows_in_period(
    batch: &RecordBatch,
    column: &str,
    from: i64,
    to: i64,
) -> Result<RecordBatch> {
    let times = batch
        .column_by_name(column)
        .ok_or_else(|| Error::InvalidJob(format!("rows lack the event-time column '{column}'")))?;
    let times = cast::cast(times, &event_time_type())?;
    let bound = |t: i64| Scalar::new(TimestampMicrosecondArray::from(vec![t]).with_timezone("UTC"));
    let after = cmp::gt_eq(&times, &bound(from))?;
    let before = cmp::lt(&times, &bound(to))?;
    Ok(filter_record_batch(batch, &boolean::and(&after, &before)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};

    fn config(format: EventTimeFormat) -> EventTimeConfig {
        EventTimeConfig {
            column: "ts".into(),
            format,
            max_out_of_orderness: Duration::ZERO,
            idle_timeout: None,
        }
    }

    fn batch(col: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter(vec![("ts", col)]).unwrap()
    }

    #[test]
    fn rfc3339_strings_parse_and_bad_ones_are_reported() {
        let input = batch(Arc::new(StringArray::from(vec![
            Some("2024-05-01T12:00:00Z"),
            Some("2024-05-01T14:00:00+02:00"),
            Some("yesterday"),
            None,
        ])));
        let (out, bad) = extract_event_time(&input, &config(EventTimeFormat::Rfc3339)).unwrap();
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(0), 1_714_564_800_000_000);
        assert_eq!(ts.value(1), ts.value(0));
        assert_eq!(bad.iter().map(|b| b.row).collect::<Vec<_>>(), vec![2, 3]);
        assert!(bad[0].reason.contains("'yesterday'"), "{}", bad[0].reason);
        assert!(bad[1].reason.contains("missing"));
    }

    #[test]
    fn epoch_millis_and_strftime() {
        let input = batch(Arc::new(Int64Array::from(vec![1_714_564_800_000])));
        let (out, bad) = extract_event_time(&input, &config(EventTimeFormat::EpochMillis)).unwrap();
        assert!(bad.is_empty());
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(0), 1_714_564_800_000_000);

        let input = batch(Arc::new(StringArray::from(vec!["01/05/2024 12:00:00"])));
        let format: EventTimeFormat = "%d/%m/%Y %H:%M:%S".parse().unwrap();
        let (out, bad) = extract_event_time(&input, &config(format)).unwrap();
        assert!(bad.is_empty());
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(0), 1_714_564_800_000_000);
    }

    #[test]
    fn unknown_format_is_named() {
        let err = "iso".parse::<EventTimeFormat>().unwrap_err().to_string();
        assert!(err.contains("'iso'"), "{err}");
    }
}
