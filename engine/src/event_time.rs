//! Event time: the timestamp a row carries, parsed from one of its columns — never the clock.
//!
//! A source names its event-time column and format in the job file. Here the column is parsed
//! into `Timestamp(Microsecond, UTC)` in place; rows whose event time is missing or unparsable are
//! returned separately so the driver can dead-letter them with the reason.
//!
//! Two more kinds of event time are refused, because one such row would wreck the watermark,
//! which never moves backwards:
//! - outside years 0001–9999 ([`MIN_EVENT_TIME`], [`MAX_EVENT_TIME`]; an epoch value that
//!   overflows, say) — which also keeps all window arithmetic far inside `i64`;
//! - more than `max_event_time_skew` (default one day) ahead of **the clock when the batch was
//!   planned**. That clock is recorded in the batch intent, so a rerun judges every row the same;
//!   backfill and reconcile reapply the live job's judgement from its dead-letter table (rows
//!   whose reason starts with [`TOO_FAR_AHEAD`]) rather than a clock of their own.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::Scalar;
use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, TimestampMicrosecondArray};
use arrow::compute::filter_record_batch;
use arrow::compute::kernels::{boolean, cast, cmp};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, TimeUnit};
use chrono::{DateTime, NaiveDateTime, Utc};

use crate::error::{Error, Result};

/// The earliest event time accepted: 0001-01-01T00:00:00Z, in µs since the epoch.
pub const MIN_EVENT_TIME: i64 = -62_135_596_800_000_000;
/// The latest event time accepted: 9999-12-31T23:59:59.999999Z, in µs since the epoch.
pub const MAX_EVENT_TIME: i64 = 253_402_300_799_999_999;
/// How the dead-letter reason of a row whose event time is too far ahead of the clock starts.
pub const TOO_FAR_AHEAD: &str = "event time too far ahead of the clock";
/// The default `max_event_time_skew`: one day.
pub const DEFAULT_MAX_EVENT_TIME_SKEW: Duration = Duration::from_secs(86_400);

/// The type every event-time column is converted to.
pub fn event_time_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some(EVENT_TIME_ZONE.into()))
}

/// The zone of [`event_time_type`].
const EVENT_TIME_ZONE: &str = "UTC";

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
    /// Rows whose event time is further than this ahead of the clock at planning are dead
    /// letters ([`DEFAULT_MAX_EVENT_TIME_SKEW`] unless set).
    pub max_event_time_skew: Duration,
}

impl EventTimeConfig {
    /// Event time in `column` with `format`, every other setting at its default.
    pub fn new(column: impl Into<String>, format: EventTimeFormat) -> Self {
        EventTimeConfig {
            column: column.into(),
            format,
            max_out_of_orderness: Duration::ZERO,
            idle_timeout: None,
            max_event_time_skew: DEFAULT_MAX_EVENT_TIME_SKEW,
        }
    }
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

/// A timestamp or date column as [`event_time_type`], a value the type cannot hold null.
///
/// Naive nanoseconds (what a `TIMESTAMP` column of a declared schema holds) take the unit's
/// conversion alone: Arrow's cast would then move each value from UTC local time to UTC one by
/// one, which changes nothing for values nanoseconds can hold, and cost a tenth of a JSON
/// batch's read.
fn as_event_time(input: &ArrayRef) -> Result<ArrayRef> {
    if input.data_type() == &DataType::Timestamp(TimeUnit::Nanosecond, None) {
        let micros = cast::cast(input, &DataType::Timestamp(TimeUnit::Microsecond, None))?;
        let micros = micros
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>()
            .clone()
            .with_timezone(EVENT_TIME_ZONE);
        return Ok(Arc::new(micros));
    }
    let options = cast::CastOptions {
        safe: true,
        ..Default::default()
    };
    Ok(cast::cast_with_options(
        input,
        &event_time_type(),
        &options,
    )?)
}

/// Parses the event-time column of `batch` in place.
///
/// Returns the batch with the column converted and the rows whose event time is missing,
/// unparsable, outside years 0001–9999, or — with a `clock` (µs since the epoch; the batch's
/// planning time) — more than `max_event_time_skew` ahead of it. Those rows are still in the
/// batch; the caller removes them.
pub fn extract_event_time(
    batch: &RecordBatch,
    config: &EventTimeConfig,
    clock: Option<i64>,
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
                        let v = ints.value(row);
                        let micros = v.checked_mul(scale);
                        if micros.is_none() {
                            bad.push(out_of_range(row, &config.column, &v.to_string()));
                        }
                        micros
                    }
                })
                .collect()
        }
        (DataType::Timestamp(_, _) | DataType::Date32 | DataType::Date64, _) => {
            let cast = as_event_time(input)?;
            let ts = cast.as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
            if ts.null_count() > 0 {
                for row in 0..ts.len() {
                    if ts.is_null(row) {
                        bad.push(missing(row, &config.column));
                    }
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
    let horizon = clock.map(|c| c.saturating_add(micros(config.max_event_time_skew)));
    // Most batches hold no time out of range or too far ahead: their oldest and newest show it,
    // and the rows are looked at one by one only when they do not.
    let newest_allowed = horizon.map_or(MAX_EVENT_TIME, |h| h.min(MAX_EVENT_TIME));
    let all_allowed = match (arrow::compute::min(&parsed), arrow::compute::max(&parsed)) {
        (Some(oldest), Some(newest)) => oldest >= MIN_EVENT_TIME && newest <= newest_allowed,
        _ => true,
    };
    if !all_allowed {
        let flagged: std::collections::HashSet<usize> = bad.iter().map(|b| b.row).collect();
        for (row, t) in parsed.iter().enumerate() {
            let Some(t) = t else { continue };
            if flagged.contains(&row) {
                continue;
            }
            if !(MIN_EVENT_TIME..=MAX_EVENT_TIME).contains(&t) {
                bad.push(out_of_range(row, &config.column, &t.to_string()));
            } else if let (Some(horizon), Some(clock)) = (horizon, clock)
                && t > horizon
            {
                bad.push(BadEventTime {
                    row,
                    reason: format!(
                        "{TOO_FAR_AHEAD}: '{}' is {}, more than {} past {} (the clock when the batch \
                         was planned); raise max_event_time_skew if such times are real",
                        config.column,
                        display_micros(t),
                        humantime::format_duration(config.max_event_time_skew),
                        display_micros(clock),
                    ),
                });
            }
        }
    }
    bad.sort_by_key(|b| b.row);
    let parsed: ArrayRef = Arc::new(parsed.with_timezone("UTC"));
    let mut columns = batch.columns().to_vec();
    columns[idx] = parsed;
    Ok((RecordBatch::try_new(schema, columns)?, bad))
}

/// `text` as a number of `unit` since the epoch, if it is the plain form most timestamps are
/// written in — `YYYY-MM-DDTHH:MM:SS`, a `.` and 1 to 9 digits of a second or not, then `Z` or
/// nothing (read as UTC), year 1678 to 2261 — with every field in range; `None` otherwise, for
/// a general parser to read. The same number Arrow's parser gives (in a UTC column, or as an
/// RFC 3339 event time), without its general parsing and zone lookup: a tenth of reading a JSON
/// click file into a declared timestamp column, and a tenth of a JSON job's CPU where the
/// event time is text (an inferred schema keeps timestamps as text).
pub fn plain_utc_timestamp(text: &str, unit: TimeUnit) -> Option<i64> {
    let b = text.as_bytes();
    // The date and time at fixed places: read with no bounds checks, each field's digits checked
    // as they are added up.
    let head: &[u8; 19] = b.first_chunk()?;
    let digit = |i: usize| {
        let d = head[i].wrapping_sub(b'0');
        (d < 10).then_some(i64::from(d))
    };
    let two = |i: usize| Some(digit(i)? * 10 + digit(i + 1)?);
    let separated = head[4] == b'-'
        && head[7] == b'-'
        && head[10] == b'T'
        && head[13] == b':'
        && head[16] == b':';
    separated.then_some(())?;
    let (year, month, day) = (two(0)? * 100 + two(2)?, two(5)?, two(8)?);
    let (hour, minute, second) = (two(11)?, two(14)?, two(17)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    let in_range = (1678..=2261).contains(&year)
        && (1..=12).contains(&month)
        && (1..=month_days).contains(&day)
        && hour < 24
        && minute < 60
        && second < 60;
    in_range.then_some(())?;
    let mut end = 19;
    let mut nanos = 0;
    if let [b'.', fraction @ ..] = &b[19..] {
        let count = fraction.iter().take_while(|d| d.is_ascii_digit()).count();
        (1..=9).contains(&count).then_some(())?;
        let n = fraction[..count]
            .iter()
            .fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
        nanos = n * 10i64.pow(9 - count as u32);
        end = 20 + count;
    }
    match &b[end..] {
        b"" | b"Z" => {}
        _ => return None,
    }
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some(match unit {
        TimeUnit::Second => seconds,
        TimeUnit::Millisecond => seconds * 1_000 + nanos / 1_000_000,
        TimeUnit::Microsecond => seconds * 1_000_000 + nanos / 1_000,
        TimeUnit::Nanosecond => seconds * 1_000_000_000 + nanos,
    })
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// µs since the epoch as RFC 3339.
fn display_micros(t: i64) -> String {
    chrono::DateTime::from_timestamp_micros(t)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_else(|| format!("{t} µs since the epoch"))
}

fn out_of_range(row: usize, column: &str, value: &str) -> BadEventTime {
    BadEventTime {
        row,
        reason: format!(
            "event time column '{column}': {value} is outside the years 0001 to 9999 \
             (µs since the epoch, after applying event_time_format)"
        ),
    }
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
            if let Some(micros) = plain_utc_timestamp(s, TimeUnit::Microsecond) {
                return Ok(micros);
            }
            // Arrow's parser is lenient (a space for `T`, no offset); what it refuses, chrono's
            // RFC 3339 parser and the naive forms may read, to be judged by range and skew.
            arrow::compute::kernels::cast_utils::string_to_datetime(&Utc, s)
                .map(|t| t.timestamp_micros())
                .or_else(|_| DateTime::parse_from_rfc3339(s.trim()).map(|t| t.timestamp_micros()))
                .or_else(|_| {
                    ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f"]
                        .iter()
                        .find_map(|p| NaiveDateTime::parse_from_str(s.trim(), p).ok())
                        .map(|t| t.and_utc().timestamp_micros())
                        .ok_or(())
                })
                .map_err(|_| "RFC 3339".to_string())
        }
        EventTimeFormat::EpochMillis | EventTimeFormat::EpochMicros => {
            let n: i64 = s.trim().parse().map_err(|_| format!("{format:?}"))?;
            if *format == EventTimeFormat::EpochMillis {
                n.checked_mul(1000)
                    .ok_or_else(|| "epoch_millis (too large)".to_string())
            } else {
                Ok(n)
            }
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
        EventTimeConfig::new("ts", format)
    }

    /// Naive nanoseconds become event time as Arrow's cast makes them, without its per-value
    /// zone adjustment: the extremes, negatives (truncated toward zero) and nulls alike.
    #[test]
    fn naive_nanoseconds_convert_as_arrows_cast_does() {
        let values = arrow::array::TimestampNanosecondArray::from(vec![
            Some(i64::MIN),
            Some(-1_999),
            Some(-1),
            None,
            Some(0),
            Some(999),
            Some(1_700_000_000_123_456_789),
            Some(i64::MAX),
        ]);
        let input: ArrayRef = Arc::new(values);
        let options = cast::CastOptions {
            safe: true,
            ..Default::default()
        };
        let arrows = cast::cast_with_options(&input, &event_time_type(), &options).unwrap();
        let ours = as_event_time(&input).unwrap();
        assert_eq!(ours.data_type(), &event_time_type());
        assert_eq!(&ours, &arrows);
    }

    /// The plain form is read by the shortcut as Arrow's parser reads it, before and after the
    /// epoch and at the edges of the shortcut's years; every other text gives what the general
    /// parsers give, the shortcut declining it.
    #[test]
    fn plain_rfc3339_times_parse_as_arrows_parser_does() {
        let arrows = |s: &str| {
            arrow::compute::kernels::cast_utils::string_to_datetime(&Utc, s)
                .map(|t| t.timestamp_micros())
                .ok()
        };
        for s in [
            "2024-01-01T00:00:07.123Z",
            "2024-02-29T23:59:59",
            "1969-12-31T23:59:59.999999999Z",
            "1678-01-01T00:00:00Z",
            "2261-12-31T23:59:59.1Z",
            "2000-03-01T12:30:00.000001",
        ] {
            let shortcut = plain_utc_timestamp(s, TimeUnit::Microsecond);
            assert!(shortcut.is_some(), "{s}");
            assert_eq!(shortcut, arrows(s), "{s}");
            assert_eq!(
                parse_string(s, &EventTimeFormat::Rfc3339).ok(),
                shortcut,
                "{s}"
            );
        }
        for s in [
            "2024-01-01 00:00:07Z",
            "2024-01-01T00:00:07+02:00",
            "2024-01-01T00:00:07.1234567890Z",
            "2023-02-29T00:00:00Z",
            "2024-01-01T24:00:00Z",
            "2300-01-01T00:00:00Z",
            "2024-01-01",
            "not a time",
        ] {
            assert_eq!(plain_utc_timestamp(s, TimeUnit::Microsecond), None, "{s}");
        }
        assert_eq!(
            parse_string("2024-01-01T00:00:07+02:00", &EventTimeFormat::Rfc3339).ok(),
            arrows("2024-01-01T00:00:07+02:00")
        );
        assert!(parse_string("2300-01-01T00:00:00Z", &EventTimeFormat::Rfc3339).is_ok());
        assert!(parse_string("2023-02-29T00:00:00Z", &EventTimeFormat::Rfc3339).is_err());
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
        let (out, bad) =
            extract_event_time(&input, &config(EventTimeFormat::Rfc3339), None).unwrap();
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
        let (out, bad) =
            extract_event_time(&input, &config(EventTimeFormat::EpochMillis), None).unwrap();
        assert!(bad.is_empty());
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(0), 1_714_564_800_000_000);

        let input = batch(Arc::new(StringArray::from(vec!["01/05/2024 12:00:00"])));
        let format: EventTimeFormat = "%d/%m/%Y %H:%M:%S".parse().unwrap();
        let (out, bad) = extract_event_time(&input, &config(format), None).unwrap();
        assert!(bad.is_empty());
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(0), 1_714_564_800_000_000);
    }

    /// Year 9999 and an overflowing epoch value must not reach the watermark: the first is too
    /// far ahead of the planning clock, the second out of range; a time within the skew passes.
    #[test]
    fn times_far_ahead_of_the_clock_or_out_of_range_are_refused() {
        let clock = 1_714_564_800_000_000; // 2024-05-01T12:00:00Z
        let input = batch(Arc::new(StringArray::from(vec![
            "2024-05-01T13:00:00Z",
            "9999-12-31T00:00:00Z",
            "2024-05-03T12:00:00Z",
        ])));
        let (_, bad) =
            extract_event_time(&input, &config(EventTimeFormat::Rfc3339), Some(clock)).unwrap();
        assert_eq!(bad.iter().map(|b| b.row).collect::<Vec<_>>(), vec![1, 2]);
        assert!(
            bad[0].reason.starts_with(TOO_FAR_AHEAD),
            "{}",
            bad[0].reason
        );
        assert!(bad[0].reason.contains("1day"), "{}", bad[0].reason);
        // Without a clock (a replay judging by the dead-letter table) only the range counts.
        let (_, bad) = extract_event_time(&input, &config(EventTimeFormat::Rfc3339), None).unwrap();
        assert!(bad.is_empty(), "{bad:?}");

        let input = batch(Arc::new(Int64Array::from(vec![
            i64::MAX,
            -9_000_000_000_000_000,
            1_714_564_800_000,
        ])));
        let (out, bad) =
            extract_event_time(&input, &config(EventTimeFormat::EpochMillis), Some(clock)).unwrap();
        assert_eq!(bad.iter().map(|b| b.row).collect::<Vec<_>>(), vec![0, 1]);
        assert!(
            bad[0].reason.contains("outside the years"),
            "{}",
            bad[0].reason
        );
        let ts = out
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(ts.value(2), clock);
        let input = batch(Arc::new(StringArray::from(vec!["9223372036854775807"])));
        let (_, bad) =
            extract_event_time(&input, &config(EventTimeFormat::EpochMillis), None).unwrap();
        assert_eq!(bad.len(), 1, "{bad:?}");
    }

    /// A timestamp column: a null is missing, a time past the skew or the range is refused,
    /// the others pass — whether every time is allowed or only some.
    #[test]
    fn timestamp_columns_are_judged_row_by_row_when_some_time_is_not_allowed() {
        let clock = 1_714_564_800_000_000; // 2024-05-01T12:00:00Z
        let hour = 3_600_000_000;
        let column = |values: Vec<Option<i64>>| {
            batch(Arc::new(
                arrow::array::TimestampMicrosecondArray::from(values).with_timezone("UTC"),
            ))
        };
        let judged = |input: &RecordBatch| {
            let (_, bad) =
                extract_event_time(input, &config(EventTimeFormat::Rfc3339), Some(clock)).unwrap();
            bad.iter().map(|b| b.row).collect::<Vec<_>>()
        };
        assert!(judged(&column(vec![Some(clock), Some(clock + hour)])).is_empty());
        assert_eq!(judged(&column(vec![Some(clock), None])), [1]);
        let mixed = column(vec![
            Some(clock + 48 * hour),
            None,
            Some(clock),
            Some(i64::MIN + 1),
            Some(clock - hour),
        ]);
        assert_eq!(judged(&mixed), [0, 1, 3]);
    }

    fn formats() -> Vec<EventTimeFormat> {
        vec![
            EventTimeFormat::Rfc3339,
            EventTimeFormat::EpochMillis,
            EventTimeFormat::EpochMicros,
            EventTimeFormat::Strftime("%d/%m/%Y %H:%M:%S%.f".into()),
            EventTimeFormat::Strftime("%Y-%m-%dT%H:%M:%S%z".into()),
        ]
    }

    /// Parses `values` as strings in every format, and as integers in the epoch formats:
    /// nothing panics, and every row is either parsed within years 0001–9999 or reported.
    fn exercise(values: &[String], ints: &[i64], clock: i64) {
        let strings = batch(Arc::new(StringArray::from(values.to_vec())));
        let numbers = batch(Arc::new(Int64Array::from(ints.to_vec())));
        for format in formats() {
            for (input, epoch_only) in [(&strings, false), (&numbers, true)] {
                if epoch_only
                    && matches!(
                        format,
                        EventTimeFormat::Rfc3339 | EventTimeFormat::Strftime(_)
                    )
                {
                    continue;
                }
                let (out, bad) =
                    extract_event_time(input, &config(format.clone()), Some(clock)).unwrap();
                let ts = out
                    .column(0)
                    .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
                for row in 0..input.num_rows() {
                    if bad.iter().any(|b| b.row == row) {
                        continue;
                    }
                    let t = ts.value(row);
                    assert!((MIN_EVENT_TIME..=MAX_EVENT_TIME).contains(&t), "{t}");
                }
            }
        }
    }

    #[test]
    fn fuzz_corpus_parses_without_panics() {
        let path = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("../fuzz/corpus/event_times/times.txt");
        let text = std::fs::read_to_string(path).unwrap();
        let values: Vec<String> = text.lines().map(str::to_string).collect();
        let ints: Vec<i64> = text.lines().filter_map(|l| l.parse().ok()).collect();
        exercise(&values, &ints, 1_714_564_800_000_000);
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]
        #[test]
        fn fuzz_arbitrary_event_times_parse_without_panics(
            values in proptest::collection::vec(proptest::prelude::any::<String>(), 0..20),
            timestamps in proptest::collection::vec("[+-]?[0-9]{1,7}-[0-9]{1,3}-[0-9]{1,3}[T ][0-9]{1,3}:[0-9]{1,3}:[0-9]{1,3}(\\.[0-9]{0,12})?(Z|[+-][0-9]{2}:?[0-9]{2})?", 0..20),
            ints in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..20),
            clock in proptest::prelude::any::<i64>(),
        ) {
            let mut all = values;
            all.extend(timestamps);
            exercise(&all, &ints, clock);
        }
    }

    #[test]
    fn unknown_format_is_named() {
        let err = "iso".parse::<EventTimeFormat>().unwrap_err().to_string();
        assert!(err.contains("'iso'"), "{err}");
    }
}
