//! Dead letters: input that could not be decoded or made the query fail, kept with the reason.
//!
//! Nothing is dropped silently. A line that is not valid JSON, a value that does not fit the
//! schema, a missing event time or a row on which the SQL fails (a bad CAST) becomes a row of the
//! dead-letter table, committed with the batch's txn before the output commit.

use std::sync::Arc;

use arrow::array::{BinaryArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::error::Result;
use crate::offsets::BatchId;
use crate::source::{DeadLetter, SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION};

/// Dead-letter column: the name of the source the input came from.
pub const SOURCE_NAME: &str = "_source_name";

/// The dead-letter table's schema (the columns users query, plus `_source_name`).
pub fn dead_letter_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(SOURCE_NAME, DataType::Utf8, false),
        Field::new(SOURCE_PARTITION, DataType::Utf8, false),
        Field::new(SOURCE_OFFSET, DataType::Int64, false),
        Field::new(SOURCE_POSITION, DataType::Utf8, false),
        Field::new("raw", DataType::Binary, false),
        Field::new("error", DataType::Utf8, false),
        Field::new("batch_id", DataType::Int64, false),
    ]))
}

/// Turns dead letters of one source into a batch of the dead-letter table.
pub fn dead_letter_batch(
    source_name: &str,
    batch_id: BatchId,
    letters: &[DeadLetter],
) -> Result<RecordBatch> {
    let n = letters.len();
    Ok(RecordBatch::try_new(
        dead_letter_schema(),
        vec![
            Arc::new(StringArray::from(vec![source_name; n])),
            Arc::new(StringArray::from_iter_values(
                letters.iter().map(|l| l.partition.as_str()),
            )),
            Arc::new(Int64Array::from_iter_values(
                letters.iter().map(|l| l.offset),
            )),
            Arc::new(StringArray::from_iter_values(
                letters.iter().map(|l| l.position.as_str()),
            )),
            Arc::new(BinaryArray::from_iter_values(
                letters.iter().map(|l| l.raw.as_slice()),
            )),
            Arc::new(StringArray::from_iter_values(
                letters.iter().map(|l| l.error.as_str()),
            )),
            Arc::new(Int64Array::from(vec![batch_id.0; n])),
        ],
    )?)
}

/// Builds the dead letter of one decoded row (a one-row batch with lineage columns) that was
/// rejected after decoding — bad event time, or a query error. `raw` is the row's data columns as
/// JSON, since the original bytes are no longer at hand.
pub fn dead_letter_from_row(row: &RecordBatch, error: &str) -> Result<DeadLetter> {
    use crate::source::{SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION};
    use arrow::array::{Array, AsArray};

    let schema = row.schema();
    let partition = schema
        .index_of(SOURCE_PARTITION)
        .ok()
        .map(|i| row.column(i).as_string::<i32>().value(0).to_string())
        .unwrap_or_default();
    let offset = schema
        .index_of(SOURCE_OFFSET)
        .ok()
        .map(|i| {
            row.column(i)
                .as_primitive::<arrow::datatypes::Int64Type>()
                .value(0)
        })
        .unwrap_or_default();
    let position = match schema.index_of(SOURCE_POSITION) {
        Ok(i) if !row.column(i).is_null(0) => row.column(i).as_string::<i32>().value(0).to_string(),
        _ => format!("{partition}@{offset}"),
    };
    let data_columns: Vec<usize> = schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| !crate::source::is_lineage(f.name()))
        .map(|(i, _)| i)
        .collect();
    let data = row.project(&data_columns)?;
    let mut writer = arrow::json::LineDelimitedWriter::new(Vec::new());
    writer.write(&data)?;
    writer.finish()?;
    let mut raw = writer.into_inner();
    if raw.last() == Some(&b'\n') {
        raw.pop();
    }
    Ok(DeadLetter {
        partition,
        offset,
        position,
        raw,
        error: error.to_string(),
    })
}
