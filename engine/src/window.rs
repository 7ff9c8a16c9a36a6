//! Window table functions, in the style of Flink's and RisingWave's windowing TVFs:
//!
//! - `tumble(t, ts, size)` — every row of `t` once, in the window `[start, start + size)` that
//!   holds its `ts`;
//! - `hop(t, ts, slide, size)` — every row of `t` once per window of length `size` starting
//!   every `slide` that holds its `ts` (`size / slide` rows per input row; `size` must be a
//!   multiple of `slide`);
//! - `session(t, ts, gap)` — every row of `t` once, in its own session `[ts, ts + gap)`; the
//!   aggregate over it (grouped by `window_start, window_end` and the keys) merges overlapping
//!   sessions of a key into one, so a session ends after `gap` without an event of its key.
//!
//! All return `t`'s columns (lineage included) plus `window_start` and `window_end`
//! (timestamps). Tumbling and hopping windows are aligned to the Unix epoch, like `date_bin`.
//! Sizes are SQL intervals of a fixed length (`INTERVAL '1' MINUTE`; months are not a fixed
//! length and are refused).
//!
//! A function call becomes a view over the source's in-memory table, so the plan is built once
//! and sees each batch's rows like any other query. [`WindowKind::starts`] is the same
//! assignment in Rust, for the operators that must know a row's windows (lateness, state); a
//! property test keeps the two in agreement.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, AsArray, ListArray, TimestampMicrosecondArray};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer, OffsetBuffer};
use datafusion::arrow::datatypes::{DataType, Field, TimestampMicrosecondType};
use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::datasource::{ViewTable, provider_as_source};
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::{
    ColumnarValue, Expr, LogicalPlan, LogicalPlanBuilder, ScalarFunctionArgs, ScalarUDF,
    ScalarUDFImpl, Signature, Volatility, col, lit,
};
use datafusion::prelude::SessionContext;

/// Column added by the window functions: the window's start (inclusive).
pub const WINDOW_START: &str = "window_start";
/// Column added by the window functions: the window's end (exclusive).
pub const WINDOW_END: &str = "window_end";
const WINDOWS_LIST: &str = "__sluice_windows";

/// A window assignment, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowKind {
    /// Back-to-back windows of `size`.
    Tumble {
        /// Window length.
        size: i64,
    },
    /// Windows of `size` starting every `slide`.
    Hop {
        /// Distance between window starts.
        slide: i64,
        /// Window length, a multiple of `slide`.
        size: i64,
    },
    /// Sessions: each row starts as `[ts, ts + gap)`; overlapping sessions of a key merge.
    Session {
        /// How long a session lasts after its last event.
        gap: i64,
    },
}

impl WindowKind {
    /// The window length.
    pub fn size(&self) -> i64 {
        match self {
            WindowKind::Tumble { size } | WindowKind::Hop { size, .. } => *size,
            WindowKind::Session { gap } => *gap,
        }
    }

    /// The start of every window that holds event time `ts`, oldest first (for a session: the
    /// row's own session, before merging).
    pub fn starts(&self, ts: i64) -> Vec<i64> {
        match *self {
            WindowKind::Tumble { size } => vec![ts - ts.rem_euclid(size)],
            WindowKind::Hop { slide, size } => {
                hop_starts(ts - ts.rem_euclid(slide), slide, size / slide).collect()
            }
            WindowKind::Session { .. } => vec![ts],
        }
    }
}

/// The starts of the `count` hopping windows, `slide` apart, that end with the one starting at
/// `last`, oldest first: the one rule both [`WindowKind::starts`] and the `hop` view's
/// [`HopStarts`] list a row's windows by.
fn hop_starts(last: i64, slide: i64, count: i64) -> impl Iterator<Item = i64> {
    (0..count)
        .rev()
        .map(move |i| last.wrapping_sub(i.wrapping_mul(slide)))
}

/// The longest window (size, slide or gap): 1000 years in µs. With event times within years
/// 0001–9999 (see [`crate::event_time::MAX_EVENT_TIME`]), every window bound and every bound
/// plus `allowed_lateness` stays far inside `i64`.
pub const MAX_WINDOW: i64 = 1000 * 366 * 86_400_000_000;

/// The most windows one row may fall into (`hop` size / slide).
pub const MAX_HOPS: i64 = 10_000;

/// One call of a window function in a query: which source, which time column, which windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowUse {
    /// The source table the function was called on.
    pub source: String,
    /// The time column the windows are assigned by.
    pub time_column: String,
    /// The windows.
    pub kind: WindowKind,
}

/// The window function calls seen while planning a query, in call order.
pub(crate) type WindowUses = Arc<Mutex<Vec<WindowUse>>>;

/// Registers `tumble` and `hop` over `tables` (source name → its in-memory table); every call
/// planned is recorded in the returned list.
pub(crate) fn register(
    ctx: &SessionContext,
    tables: &BTreeMap<String, Arc<dyn TableProvider>>,
) -> WindowUses {
    let uses = WindowUses::default();
    for kind in [
        FunctionKind::Tumble,
        FunctionKind::Hop,
        FunctionKind::Session,
    ] {
        ctx.register_udtf(
            kind.name(),
            Arc::new(WindowFunction {
                kind,
                tables: tables.clone(),
                uses: Arc::clone(&uses),
            }),
        );
    }
    uses
}

#[derive(Debug, Clone, Copy)]
enum FunctionKind {
    Tumble,
    Hop,
    Session,
}

impl FunctionKind {
    fn name(self) -> &'static str {
        match self {
            FunctionKind::Tumble => "tumble",
            FunctionKind::Hop => "hop",
            FunctionKind::Session => "session",
        }
    }

    fn usage(self) -> &'static str {
        match self {
            FunctionKind::Tumble => "tumble(table, time_column, INTERVAL '1' MINUTE)",
            FunctionKind::Hop => {
                "hop(table, time_column, INTERVAL '10' SECOND, INTERVAL '1' MINUTE) (slide, size)"
            }
            FunctionKind::Session => "session(table, time_column, INTERVAL '30' MINUTE) (gap)",
        }
    }
}

#[derive(Debug)]
struct WindowFunction {
    kind: FunctionKind,
    tables: BTreeMap<String, Arc<dyn TableProvider>>,
    uses: WindowUses,
}

impl WindowFunction {
    fn fail<T>(&self, why: impl std::fmt::Display) -> datafusion::common::Result<T> {
        Err(DataFusionError::Plan(format!(
            "{}: {why}; usage: {}",
            self.kind.name(),
            self.kind.usage()
        )))
    }

    fn column_name<'a>(&self, arg: &'a Expr, what: &str) -> datafusion::common::Result<&'a str> {
        match arg {
            Expr::Column(c) => Ok(c.name.as_str()),
            other => self.fail(format!("the {what} must be a name, not `{other}`")),
        }
    }

    /// A fixed-length interval in microseconds, at most [`MAX_WINDOW`].
    fn interval(&self, arg: &Expr, what: &str) -> datafusion::common::Result<i64> {
        let micros: i128 = match arg {
            Expr::Literal(ScalarValue::IntervalMonthDayNano(Some(i)), _) if i.months == 0 => {
                i128::from(i.days) * 86_400_000_000 + i128::from(i.nanoseconds / 1_000)
            }
            Expr::Literal(ScalarValue::IntervalDayTime(Some(i)), _) => {
                i128::from(i.days) * 86_400_000_000 + i128::from(i.milliseconds) * 1_000
            }
            Expr::Literal(ScalarValue::IntervalMonthDayNano(Some(_)), _) => {
                return self.fail(format!("the {what} counts months, which differ in length"));
            }
            other => return self.fail(format!("the {what} must be an INTERVAL, not `{other}`")),
        };
        if micros <= 0 {
            return self.fail(format!("the {what} must be positive"));
        }
        if micros > i128::from(MAX_WINDOW) {
            return self.fail(format!("the {what} must be at most 1000 years"));
        }
        Ok(micros as i64)
    }
}

/// `t + micros` for an event-time expression, computed on the microseconds: adding an
/// `INTERVAL` to a timestamp with a time zone goes through the zone's calendar for every value,
/// which took 40 % of a hopping-window query's time.
fn shift(t: Expr, micros: i64) -> Expr {
    use datafusion::logical_expr::cast;
    cast(
        cast(t, DataType::Int64) + lit(micros),
        crate::event_time::event_time_type(),
    )
}

/// `columns`, then a window's `window_start` (`start`) and `window_end` (`length` later): what
/// every window view projects.
fn with_window(mut columns: Vec<Expr>, start: Expr, length: i64) -> Vec<Expr> {
    columns.push(start.clone().alias(WINDOW_START));
    columns.push(shift(start, length).alias(WINDOW_END));
    columns
}

/// The start of the `stride`-aligned (from the epoch) bucket holding `ts`, as event time:
/// `ts` cast to event time (microseconds, UTC — a column in other units converted, not
/// reinterpreted), then `t − t.rem_euclid(stride)` on the microseconds (`date_bin` works
/// through the time zone's calendar), by [`WindowBucket`].
fn bucket(stride: i64, ts: &str) -> Expr {
    use datafusion::logical_expr::cast;
    let t = cast(col(ts), crate::event_time::event_time_type());
    Expr::ScalarFunction(ScalarFunction::new_udf(
        Arc::new(ScalarUDF::new_from_impl(WindowBucket::new(stride))),
        vec![t],
    ))
}

/// The one argument of the window function `name`, event time, as an array of the call's rows.
fn event_time_argument(
    name: &str,
    args: &ScalarFunctionArgs,
) -> datafusion::common::Result<TimestampMicrosecondArray> {
    let [arg] = &args.args[..] else {
        return Err(DataFusionError::Internal(format!(
            "{name} takes one argument"
        )));
    };
    let arg = arg.to_array(args.number_rows)?;
    arg.as_primitive_opt::<TimestampMicrosecondType>()
        .cloned()
        .ok_or_else(|| {
            DataFusionError::Internal(format!("{name} takes event time, not {}", arg.data_type()))
        })
}

/// Each event time's `stride`-aligned bucket start, `t − t.rem_euclid(stride)`, in one pass
/// over the rows. The same arithmetic in SQL (`((t % s) + s) % s` subtracted from `t`) ran four
/// kernels, each writing a new array: 8 % of a tumbling-window query's CPU (Nexmark q7 over
/// Parquet files, by profile).
#[derive(Debug, PartialEq, Eq, Hash)]
struct WindowBucket {
    stride: i64,
    signature: Signature,
}

impl WindowBucket {
    fn new(stride: i64) -> WindowBucket {
        WindowBucket {
            stride,
            signature: Signature::exact(
                vec![crate::event_time::event_time_type()],
                Volatility::Immutable,
            ),
        }
    }
}

impl ScalarUDFImpl for WindowBucket {
    fn name(&self) -> &str {
        "sluice_window_bucket"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _: &[DataType]) -> datafusion::common::Result<DataType> {
        Ok(crate::event_time::event_time_type())
    }

    fn invoke_with_args(
        &self,
        args: ScalarFunctionArgs,
    ) -> datafusion::common::Result<ColumnarValue> {
        let t = event_time_argument(self.name(), &args)?;
        let stride = self.stride;
        let starts: TimestampMicrosecondArray = t.unary(|t| t.wrapping_sub(t.rem_euclid(stride)));
        Ok(ColumnarValue::Array(Arc::new(
            starts.with_data_type(crate::event_time::event_time_type()),
        )))
    }
}

/// The starts of the `count` hopping windows that hold a row, from the start `last` of the
/// latest one — `[last − (count − 1) × slide, …, last]`, a list per row for `unnest` — built in
/// one pass over the rows. DataFusion's `make_array` over `count` computed start columns built
/// the lists value by value (`MutableArrayData`): a quarter of a hopping-window query's CPU
/// (Nexmark q5 over Parquet files, by profile). A null `last` gives `count` null starts, as
/// `make_array` of nulls did.
#[derive(Debug, PartialEq, Eq, Hash)]
struct HopStarts {
    slide: i64,
    count: usize,
    signature: Signature,
}

impl HopStarts {
    fn new(slide: i64, count: i64) -> HopStarts {
        HopStarts {
            slide,
            count: usize::try_from(count).unwrap_or(0),
            signature: Signature::exact(
                vec![crate::event_time::event_time_type()],
                Volatility::Immutable,
            ),
        }
    }

    /// The call of this function on `last`.
    fn call(self, last: Expr) -> Expr {
        Expr::ScalarFunction(ScalarFunction::new_udf(
            Arc::new(ScalarUDF::new_from_impl(self)),
            vec![last],
        ))
    }
}

impl ScalarUDFImpl for HopStarts {
    fn name(&self) -> &str {
        "sluice_hop_starts"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _: &[DataType]) -> datafusion::common::Result<DataType> {
        Ok(DataType::new_list(
            crate::event_time::event_time_type(),
            true,
        ))
    }

    fn invoke_with_args(
        &self,
        args: ScalarFunctionArgs,
    ) -> datafusion::common::Result<ColumnarValue> {
        let last = event_time_argument(self.name(), &args)?;
        let mut starts = Vec::with_capacity(last.len() * self.count);
        for &latest in last.values() {
            starts.extend(hop_starts(latest, self.slide, self.count as i64));
        }
        let nulls = last.nulls().map(|nulls| {
            NullBuffer::new(BooleanBuffer::collect_bool(starts.len(), |i| {
                nulls.is_valid(i / self.count)
            }))
        });
        let starts = TimestampMicrosecondArray::new(starts.into(), nulls)
            .with_data_type(crate::event_time::event_time_type());
        let lists = ListArray::try_new(
            Arc::new(Field::new_list_field(
                crate::event_time::event_time_type(),
                true,
            )),
            OffsetBuffer::from_lengths(std::iter::repeat_n(self.count, last.len())),
            Arc::new(starts),
            None,
        )?;
        Ok(ColumnarValue::Array(Arc::new(lists)))
    }
}

/// For the rows of a `hop(…)` call over `window` as planned into a query (the view's top node:
/// the windows unnested from [`HopStarts`]' lists over the source's scan): the same rows once
/// each, in their newest window (`window_start` the row's time rounded down to the slide,
/// `window_end` that plus the size) — what an aggregate over the hop reads when it aggregates
/// by panes (see `crate::operators::panes`). A row's other windows start `slide`,
/// 2 × `slide`, … earlier, as [`hop_starts`] lists them. `None` if `plan` is not that call's
/// rows.
pub(crate) fn newest_hop_window(
    plan: &LogicalPlan,
    window: &WindowUse,
) -> datafusion::common::Result<Option<LogicalPlan>> {
    let WindowKind::Hop { slide, size } = window.kind else {
        return Ok(None);
    };
    let LogicalPlan::Projection(top) = plan else {
        return Ok(None);
    };
    let LogicalPlan::Unnest(unnest) = top.input.as_ref() else {
        return Ok(None);
    };
    let LogicalPlan::Projection(lists) = unnest.input.as_ref() else {
        return Ok(None);
    };
    let rows = lists.input.as_ref();
    let from_source = matches!(rows, LogicalPlan::TableScan(scan)
        if scan.table_name.table() == window.source);
    // This call's lists: its slide, and as many windows per row.
    let these_windows = lists.expr.iter().any(|e| match e {
        Expr::Alias(alias) if alias.name == WINDOWS_LIST => matches!(
            alias.expr.as_ref(),
            Expr::ScalarFunction(f) if f.func.inner().downcast_ref::<HopStarts>().is_some_and(
                |h| h.slide == slide && i64::try_from(h.count) == Ok(size / slide)
            )
        ),
        _ => false,
    });
    let unnests_them = unnest.exec_columns.iter().any(|c| c.name == WINDOWS_LIST);
    if !(from_source && these_windows && unnests_them) {
        return Ok(None);
    }
    let columns = rows
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    let start = bucket(slide, &window.time_column);
    Ok(Some(
        LogicalPlanBuilder::from(rows.clone())
            .project(with_window(columns, start, size))?
            .build()?,
    ))
}

impl TableFunctionImpl for WindowFunction {
    fn call_with_args(
        &self,
        args: TableFunctionArgs,
    ) -> datafusion::common::Result<Arc<dyn TableProvider>> {
        let exprs = args.exprs();
        let (table, ts, window) = match (self.kind, exprs) {
            (FunctionKind::Tumble, [t, ts, size]) => (
                t,
                ts,
                WindowKind::Tumble {
                    size: self.interval(size, "size")?,
                },
            ),
            (FunctionKind::Hop, [t, ts, slide, size]) => {
                let slide = self.interval(slide, "slide")?;
                let size = self.interval(size, "size")?;
                if size % slide != 0 {
                    return self.fail("the size must be a multiple of the slide");
                }
                if size / slide > MAX_HOPS {
                    return self.fail(format!(
                        "a row would fall into {} windows; at most {MAX_HOPS} (size / slide)",
                        size / slide
                    ));
                }
                (t, ts, WindowKind::Hop { slide, size })
            }
            (FunctionKind::Session, [t, ts, gap]) => (
                t,
                ts,
                WindowKind::Session {
                    gap: self.interval(gap, "gap")?,
                },
            ),
            _ => return self.fail(format!("takes {} arguments", self.kind.usage())),
        };
        let table = self.column_name(table, "first argument (the table)")?;
        let ts = self.column_name(ts, "second argument (the time column)")?;
        let Some(provider) = self.tables.get(table) else {
            return self.fail(format!(
                "there is no source named '{table}' (sources: {})",
                self.tables.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        };
        let schema = provider.schema();
        match schema.field_with_name(ts).map(|f| f.data_type().clone()) {
            Ok(datafusion::arrow::datatypes::DataType::Timestamp(_, _)) => {}
            Ok(other) => {
                return self.fail(format!(
                    "column '{ts}' of {table} is {other}, not a timestamp (name the source's \
                     event_time column)"
                ));
            }
            Err(_) => return self.fail(format!("{table} has no column '{ts}'")),
        }
        for reserved in [WINDOW_START, WINDOW_END] {
            if schema.field_with_name(reserved).is_ok() {
                return self.fail(format!("{table} already has a column '{reserved}'"));
            }
        }
        let columns: Vec<Expr> = schema.fields().iter().map(|f| col(f.name())).collect();
        let size = window.size();
        let scan = LogicalPlanBuilder::scan(table, provider_as_source(Arc::clone(provider)), None)?;
        let plan = match window {
            WindowKind::Tumble { size } => scan
                .project(with_window(columns, bucket(size, ts), size))?
                .build()?,
            WindowKind::Hop { slide, size } => {
                let starts = HopStarts::new(slide, size / slide).call(bucket(slide, ts));
                let mut with_list = columns.clone();
                with_list.push(starts.alias(WINDOWS_LIST));
                scan.project(with_list)?
                    .unnest_column(WINDOWS_LIST)?
                    .project(with_window(columns, col(WINDOWS_LIST), size))?
                    .build()?
            }
            WindowKind::Session { gap } => {
                let start =
                    datafusion::logical_expr::cast(col(ts), crate::event_time::event_time_type());
                scan.project(with_window(columns, start, gap))?.build()?
            }
        };
        debug_assert_eq!(size, window.size());
        if let Ok(mut uses) = self.uses.lock() {
            uses.push(WindowUse {
                source: table.to_string(),
                time_column: ts.to_string(),
                kind: window,
            });
        }
        Ok(Arc::new(ViewTable::new(plan, None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::{QuerySettings, StreamingQuery};
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION};
    use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::{
        DataType, Field, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType,
    };
    use proptest::prelude::*;

    const MINUTE: i64 = 60_000_000;

    /// The list a hop's rows are unnested from: each row's window starts, oldest first, ending
    /// at its latest window's start; `count` nulls for a null time.
    #[test]
    fn hop_starts_list_each_rows_windows_oldest_first() {
        use datafusion::config::ConfigOptions;

        let time = crate::event_time::event_time_type();
        // What `make_array` of event times gave: a list of nullable "item"s.
        let list_type = DataType::List(Arc::new(Field::new("item", time.clone(), true)));
        let run = |count: i64, last: ColumnarValue, rows: usize| -> Vec<Vec<Option<i64>>> {
            let starts = HopStarts::new(20, count);
            assert_eq!(starts.return_type(&[]).unwrap(), list_type);
            let args = ScalarFunctionArgs {
                args: vec![last],
                arg_fields: vec![Arc::new(Field::new("t", time.clone(), true))],
                number_rows: rows,
                return_field: Arc::new(Field::new("starts", list_type.clone(), true)),
                config_options: Arc::new(ConfigOptions::default()),
            };
            let ColumnarValue::Array(lists) = starts.invoke_with_args(args).unwrap() else {
                panic!("an array of lists");
            };
            assert_eq!(lists.data_type(), &list_type);
            assert_eq!(lists.null_count(), 0);
            let lists = lists.as_list::<i32>();
            (0..lists.len())
                .map(|i| {
                    let starts = lists.value(i);
                    starts
                        .as_primitive::<TimestampMicrosecondType>()
                        .iter()
                        .collect()
                })
                .collect()
        };
        // A slice (its offset not 0), with a null time.
        let last = TimestampMicrosecondArray::from(vec![Some(7), Some(100), None, Some(-40)])
            .with_timezone("UTC")
            .slice(1, 3);
        assert_eq!(
            run(3, ColumnarValue::Array(Arc::new(last.clone())), 3),
            [
                vec![Some(60), Some(80), Some(100)],
                vec![None, None, None],
                vec![Some(-80), Some(-60), Some(-40)],
            ]
        );
        assert_eq!(
            run(1, ColumnarValue::Array(Arc::new(last)), 3),
            [vec![Some(100)], vec![None], vec![Some(-40)]]
        );
        let scalar = ScalarValue::TimestampMicrosecond(Some(40), Some("UTC".into()));
        assert_eq!(
            run(2, ColumnarValue::Scalar(scalar), 2),
            [vec![Some(20), Some(40)], vec![Some(20), Some(40)]]
        );
    }

    #[test]
    fn starts_are_epoch_aligned_also_before_the_epoch() {
        let tumble = WindowKind::Tumble { size: MINUTE };
        assert_eq!(tumble.starts(90_000_000), vec![MINUTE]);
        assert_eq!(tumble.starts(MINUTE), vec![MINUTE]);
        assert_eq!(tumble.starts(-1), vec![-MINUTE]);
        let hop = WindowKind::Hop {
            slide: 20_000_000,
            size: MINUTE,
        };
        assert_eq!(
            hop.starts(65_000_000),
            vec![20_000_000, 40_000_000, 60_000_000]
        );
        assert_eq!(
            hop.starts(60_000_000),
            vec![20_000_000, 40_000_000, 60_000_000]
        );
    }

    fn events(times: &[i64]) -> (SchemaRef, RecordBatch) {
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                false,
            ),
            Field::new(SOURCE_PARTITION, DataType::Utf8, false),
            Field::new(SOURCE_OFFSET, DataType::Int64, false),
        ]));
        let n = times.len();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(TimestampMicrosecondArray::from(times.to_vec()).with_timezone("UTC")),
                Arc::new(StringArray::from(vec!["0"; n])),
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
            ],
        )
        .unwrap();
        (schema, batch)
    }

    /// (offset, window_start, window_end) for every output row, sorted.
    async fn assign(sql: &str, times: &[i64]) -> Vec<(i64, i64, i64)> {
        let (schema, batch) = events(times);
        let lineage = QuerySettings {
            lineage: true,
            ..QuerySettings::default()
        };
        let query = StreamingQuery::plan(sql, &[("clicks".into(), schema)], &lineage)
            .await
            .unwrap();
        let out = query
            .execute(&BTreeMap::from([("clicks".to_string(), batch)]))
            .await
            .unwrap();
        let mut rows = Vec::new();
        for b in &out {
            let offsets = b
                .column_by_name(SOURCE_OFFSET)
                .unwrap()
                .as_primitive::<arrow::datatypes::Int64Type>();
            let starts = b
                .column_by_name(WINDOW_START)
                .unwrap()
                .as_primitive::<TimestampMicrosecondType>();
            let ends = b
                .column_by_name(WINDOW_END)
                .unwrap()
                .as_primitive::<TimestampMicrosecondType>();
            for i in 0..b.num_rows() {
                rows.push((offsets.value(i), starts.value(i), ends.value(i)));
            }
        }
        rows.sort();
        rows
    }

    fn expected(kind: WindowKind, times: &[i64]) -> Vec<(i64, i64, i64)> {
        let mut rows: Vec<(i64, i64, i64)> = times
            .iter()
            .enumerate()
            .flat_map(|(o, t)| {
                kind.starts(*t)
                    .into_iter()
                    .map(move |s| (o as i64, s, s + kind.size()))
            })
            .collect();
        rows.sort();
        rows
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// The SQL functions and `WindowKind::starts` assign the same windows.
        #[test]
        fn sql_windows_equal_the_rust_assignment(
            times in proptest::collection::vec(-10 * MINUTE..10 * MINUTE, 1..40),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let tumble = rt.block_on(assign(
                "SELECT ts, window_start, window_end FROM tumble(clicks, ts, INTERVAL '1' MINUTE)",
                &times,
            ));
            prop_assert_eq!(tumble, expected(WindowKind::Tumble { size: MINUTE }, &times));
            let hop = rt.block_on(assign(
                "SELECT * FROM hop(clicks, ts, INTERVAL '20' SECOND, INTERVAL '1' MINUTE)",
                &times,
            ));
            prop_assert_eq!(hop, expected(WindowKind::Hop { slide: MINUTE / 3, size: MINUTE }, &times));
        }
    }

    /// A window over a timestamp column in another unit (milliseconds here) is assigned by its
    /// time, not by its raw number read as microseconds.
    #[tokio::test]
    async fn windows_over_a_millisecond_column_follow_its_time() {
        use arrow::array::TimestampMillisecondArray;
        let schema = Arc::new(Schema::new(vec![Field::new(
            "seen",
            DataType::Timestamp(TimeUnit::Millisecond, None),
            false,
        )]));
        // 00:01:30 and 1969-12-31T23:59:59.5, in milliseconds.
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(TimestampMillisecondArray::from(vec![
                90_000, -500,
            ]))],
        )
        .unwrap();
        let query = StreamingQuery::plan(
            "SELECT CAST(window_start AS BIGINT) AS s, CAST(window_end AS BIGINT) AS e \
             FROM tumble(clicks, seen, INTERVAL '1' MINUTE)",
            &[("clicks".into(), schema)],
            &QuerySettings::default(),
        )
        .await
        .unwrap();
        let out = query
            .execute(&BTreeMap::from([("clicks".to_string(), batch)]))
            .await
            .unwrap();
        let mut windows: Vec<(i64, i64)> = Vec::new();
        for b in &out {
            let s = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
            let e = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
            windows.extend(s.values().iter().copied().zip(e.values().iter().copied()));
        }
        windows.sort_unstable();
        assert_eq!(windows, vec![(-MINUTE, 0), (MINUTE, 2 * MINUTE)]);
    }

    #[tokio::test]
    async fn bad_calls_say_what_is_wrong() {
        let (schema, _) = events(&[0]);
        let lineage = QuerySettings {
            lineage: true,
            ..QuerySettings::default()
        };
        for (sql, wanted) in [
            ("SELECT * FROM tumble(clicks, ts)", "usage: tumble("),
            (
                "SELECT * FROM tumble(nope, ts, INTERVAL '1' MINUTE)",
                "no source named 'nope'",
            ),
            (
                "SELECT * FROM tumble(clicks, _source_offset, INTERVAL '1' MINUTE)",
                "not a timestamp",
            ),
            (
                "SELECT * FROM tumble(clicks, ts, INTERVAL '1' MONTH)",
                "counts months",
            ),
            (
                "SELECT * FROM hop(clicks, ts, INTERVAL '7' SECOND, INTERVAL '1' MINUTE)",
                "multiple of the slide",
            ),
            (
                "SELECT * FROM tumble(clicks, ts, INTERVAL '2000000000' DAY)",
                "at most 1000 years",
            ),
            (
                "SELECT * FROM hop(clicks, ts, INTERVAL '1' SECOND, INTERVAL '1' DAY)",
                "into 86400 windows",
            ),
        ] {
            let e = StreamingQuery::plan(sql, &[("clicks".into(), Arc::clone(&schema))], &lineage)
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(wanted), "{sql}: {e}");
        }
    }
}
