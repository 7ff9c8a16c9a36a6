//! The functions the UDF examples register: a scalar function and an aggregate function.
//!
//! Shared by `examples/udf.rs` (a job built in Rust) and `examples/my_sluice.rs` (a `sluice`
//! binary whose job files may call them).

use std::sync::Arc;

use sluice::engine::arrow::array::{Array, ArrayRef, AsArray, StringBuilder};
use sluice::engine::arrow::datatypes::{DataType, Float64Type};
use sluice::engine::datafusion::common::{Result, ScalarValue, exec_err};
use sluice::engine::datafusion::logical_expr::{
    Accumulator, AggregateUDF, ColumnarValue, ScalarUDF, Volatility, create_udaf, create_udf,
};

/// `page_section(page)`: the first segment of a URL path (`/blog/rust` → `blog`), `home` for
/// `/`.
pub fn page_section() -> ScalarUDF {
    create_udf(
        "page_section",
        vec![DataType::Utf8],
        DataType::Utf8,
        Volatility::Immutable,
        Arc::new(|args: &[ColumnarValue]| {
            let pages = match &args[0] {
                ColumnarValue::Array(a) => Arc::clone(a),
                ColumnarValue::Scalar(s) => s.to_array()?,
            };
            let pages = pages.as_string::<i32>();
            let mut sections = StringBuilder::with_capacity(pages.len(), pages.len() * 8);
            for page in pages.iter() {
                match page {
                    None => sections.append_null(),
                    Some(page) => match page.trim_start_matches('/').split('/').next() {
                        Some("") | None => sections.append_value("home"),
                        Some(first) => sections.append_value(first),
                    },
                }
            }
            Ok(ColumnarValue::Array(Arc::new(sections.finish())))
        }),
    )
}

/// `amount_range(x)`: the largest minus the smallest value of a group (null for no values).
///
/// Its partial state is two columns, the smallest and the largest value so far: that is what
/// Sluice writes to the state files between batches and merges with the next batch's.
pub fn amount_range() -> AggregateUDF {
    create_udaf(
        "amount_range",
        vec![DataType::Float64],
        Arc::new(DataType::Float64),
        Volatility::Immutable,
        Arc::new(|_| Ok(Box::new(RangeAccumulator::default()) as Box<dyn Accumulator>)),
        Arc::new(vec![DataType::Float64, DataType::Float64]),
    )
}

/// The smallest and largest value seen.
#[derive(Debug, Default)]
struct RangeAccumulator {
    min: Option<f64>,
    max: Option<f64>,
}

impl RangeAccumulator {
    fn add(&mut self, value: f64) {
        self.min = Some(self.min.map_or(value, |m| m.min(value)));
        self.max = Some(self.max.map_or(value, |m| m.max(value)));
    }

    fn add_all(&mut self, values: &ArrayRef) -> Result<()> {
        let Some(values) = values.as_primitive_opt::<Float64Type>() else {
            return exec_err!("amount_range takes a DOUBLE, not {}", values.data_type());
        };
        values.iter().flatten().for_each(|v| self.add(v));
        Ok(())
    }
}

impl Accumulator for RangeAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.add_all(&values[0])
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        self.add_all(&states[0])?;
        self.add_all(&states[1])
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        Ok(vec![
            ScalarValue::Float64(self.min),
            ScalarValue::Float64(self.max),
        ])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        Ok(ScalarValue::Float64(
            self.min.zip(self.max).map(|(min, max)| max - min),
        ))
    }

    fn size(&self) -> usize {
        std::mem::size_of_val(self)
    }
}
