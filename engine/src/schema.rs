//! Parses a schema written as SQL column definitions: `id BIGINT, name VARCHAR, ts TIMESTAMP`.
//!
//! Job files state schemas the way users write tables, so the parsing is DataFusion's own SQL
//! type mapping rather than a second dialect of ours — but for text: `VARCHAR`, `TEXT` and
//! `STRING` are Arrow's `Utf8` (offsets and bytes), not the `Utf8View` DataFusion maps them to
//! by default. Text inferred from JSON or CSV is `Utf8` too, as is a Delta table's `string`: a
//! declared column then reaches the sink in the table's own layout, where views were cast
//! (copied) into it on every write. Measured on Nexmark q0 (5 M bids, JSON and Parquet files
//! into Delta): 12–14 % less CPU and a quarter less peak memory (see README, benchmarks).

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::{can_cast_types, cast};
use arrow::datatypes::{DataType, FieldRef, Schema, SchemaRef};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::error::{Error, Result};

/// Parses `ddl` (column definitions separated by commas) into an Arrow schema.
///
/// # Errors
/// If the text is not a list of `name TYPE` pairs DataFusion understands, quoting it.
pub async fn parse_schema(ddl: &str) -> Result<SchemaRef> {
    let mut config = SessionConfig::new();
    // Text as `Utf8`: see the module docs.
    config.options_mut().sql_parser.map_string_types_to_utf8view = false;
    let ctx = SessionContext::new_with_config(config);
    let plan = ctx
        .state()
        .create_logical_plan(&format!("CREATE TABLE schema_check ({ddl})"))
        .await
        .map_err(|e| Error::InvalidJob(format!("schema \"{ddl}\" is not valid: {e}")))?;
    let input = plan.inputs();
    let schema = input
        .first()
        .map(|p| p.schema().as_arrow().clone())
        .ok_or_else(|| Error::InvalidJob(format!("schema \"{ddl}\" declares no columns")))?;
    if schema.fields().is_empty() {
        return Err(Error::InvalidJob(format!(
            "schema \"{ddl}\" declares no columns"
        )));
    }
    Ok(Arc::new(Schema::new(schema.fields().clone())))
}

/// `batch` with each column whose type differs from `schema`'s column at its place only in
/// the layout of text or bytes ([`same_but_layout`]: `Utf8View` or `LargeUtf8` for `Utf8`,
/// `BinaryView` or `LargeBinary` for `Binary`, also inside lists, structs, maps and
/// dictionaries) cast to the schema's type. Declared text columns were `Utf8View` before they
/// became `Utf8` ([`parse_schema`]), so operator state a job stored before then is read in its
/// operator's current types (static table snapshots are conformed column by column by name,
/// with [`same_but_layout`] alone). Any other difference is left as it is, for the reader to
/// refuse.
///
/// # Errors
/// If a cast fails (not expected: these casts only copy).
pub(crate) fn in_layout_of(batch: RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let fields = schema.fields();
    if batch.schema() == *schema || batch.num_columns() != fields.len() {
        return Ok(batch);
    }
    let mut changed = false;
    let mut columns = Vec::with_capacity(fields.len());
    let mut batch_fields = Vec::with_capacity(fields.len());
    for ((column, field), want) in batch
        .columns()
        .iter()
        .zip(batch.schema().fields())
        .zip(fields)
    {
        let (from, to) = (column.data_type(), want.data_type());
        if from != to && same_but_layout(from, to) {
            columns.push(cast(column, to)?);
            batch_fields.push(Arc::new(field.as_ref().clone().with_data_type(to.clone())));
            changed = true;
        } else {
            columns.push(Arc::clone(column));
            batch_fields.push(Arc::clone(field));
        }
    }
    if !changed {
        return Ok(batch);
    }
    let schema = Arc::new(Schema::new_with_metadata(
        batch_fields,
        batch.schema().metadata().clone(),
    ));
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// Whether a column of type `from` goes into `to` by a cast that only copies: they differ at
/// most in how text or bytes are laid out.
pub(crate) fn same_but_layout(from: &DataType, to: &DataType) -> bool {
    plain_layout(from) == plain_layout(to) && can_cast_types(from, to)
}

/// `t` with text as `Utf8` and bytes as `Binary`, however they are laid out, down lists,
/// structs, maps and dictionaries.
fn plain_layout(t: &DataType) -> DataType {
    let field = |f: &FieldRef| {
        Arc::new(
            f.as_ref()
                .clone()
                .with_data_type(plain_layout(f.data_type())),
        )
    };
    match t {
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        DataType::List(item) => DataType::List(field(item)),
        DataType::LargeList(item) => DataType::LargeList(field(item)),
        DataType::FixedSizeList(item, n) => DataType::FixedSizeList(field(item), *n),
        DataType::Struct(fields) => DataType::Struct(fields.iter().map(field).collect()),
        DataType::Map(entries, sorted) => DataType::Map(field(entries), *sorted),
        DataType::Dictionary(key, value) => {
            DataType::Dictionary(key.clone(), Box::new(plain_layout(value)))
        }
        t => t.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sql_types_map_to_arrow() {
        let schema = parse_schema("id BIGINT, amount DOUBLE, name VARCHAR, ts TIMESTAMP")
            .await
            .unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64);
        assert_eq!(schema.field(2).data_type(), &DataType::Utf8);
        assert!(matches!(
            schema.field(3).data_type(),
            DataType::Timestamp(_, None)
        ));
    }

    #[tokio::test]
    async fn every_text_type_is_utf8() {
        let schema = parse_schema("a VARCHAR, b TEXT, c STRING, d CHAR(3), e VARCHAR(10)")
            .await
            .unwrap();
        for field in schema.fields() {
            assert_eq!(field.data_type(), &DataType::Utf8, "{}", field.name());
        }
    }

    /// Text and bytes in any layout, down nested types, are the same but for layout; any
    /// other difference is not.
    #[test]
    fn only_text_and_bytes_layouts_are_the_same_but_for_layout() {
        use arrow::datatypes::Field;
        let list = |t: DataType| DataType::new_list(t, true);
        let fixed = |t: DataType| DataType::new_fixed_size_list(t, 3, true);
        let dict = |t: DataType| DataType::Dictionary(Box::new(DataType::Int32), Box::new(t));
        let strct = |t: DataType| DataType::Struct(vec![Field::new("s", t, true)].into());
        let same = [
            (DataType::Utf8View, DataType::Utf8),
            (DataType::Utf8, DataType::Utf8View),
            (DataType::LargeUtf8, DataType::Utf8),
            (DataType::BinaryView, DataType::Binary),
            (list(DataType::Utf8View), list(DataType::Utf8)),
            (fixed(DataType::Utf8View), fixed(DataType::Utf8)),
            (dict(DataType::Utf8View), dict(DataType::Utf8)),
            (strct(DataType::Utf8View), strct(DataType::Utf8)),
        ];
        for (from, to) in same {
            assert!(same_but_layout(&from, &to), "{from} → {to}");
        }
        let other = [
            (DataType::Int64, DataType::Utf8),
            (DataType::Utf8View, DataType::Binary),
            (list(DataType::Utf8View), list(DataType::Int64)),
            (strct(DataType::Int32), strct(DataType::Int64)),
        ];
        for (from, to) in other {
            assert!(!same_but_layout(&from, &to), "{from} → {to}");
        }
    }

    #[tokio::test]
    async fn bad_schema_is_quoted() {
        let err = parse_schema("id WIBBLE").await.unwrap_err().to_string();
        assert!(err.contains("id WIBBLE"), "{err}");
    }
}
