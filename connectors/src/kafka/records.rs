//! Fetched Kafka records → Arrow rows: the decoded value columns, the metadata columns, the
//! lineage columns; records that do not decode become dead letters with their raw bytes.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BinaryArray, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
    StructArray, TimestampMicrosecondArray,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use rskafka::record::RecordAndOffset;
use sluice_engine::source::{SOURCE_OFFSET, SOURCE_PARTITION, with_lineage_fields};
use sluice_engine::{DeadLetter, PartitionId, SourceRead};

use super::{TopicPartition, ValueFormat};
use crate::decode::{Line, decode_csv_lines, decode_json_lines};
use crate::error::{ConnectorError, Result};
use crate::evolve::{SchemaEvolution, rescue_lines};

/// Metadata column: the topic a record came from.
pub const TOPIC: &str = "_topic";
/// Metadata column: the Kafka partition number.
pub const PARTITION: &str = "_partition";
/// Metadata column: the Kafka offset.
pub const OFFSET: &str = "_offset";
/// Metadata column: the record's broker timestamp (create or log-append time).
pub const KAFKA_TIMESTAMP: &str = "_kafka_timestamp";
/// Metadata column: the record key, as bytes.
pub const KEY: &str = "_key";
/// Metadata column: the record headers, a list of `{key, value}`.
pub const HEADERS: &str = "_headers";

pub(super) fn raw_value_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("key", DataType::Binary, true),
        Field::new("value", DataType::Binary, true),
    ]))
}

fn header_fields() -> Fields {
    Fields::from(vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("value", DataType::Binary, true),
    ])
}

fn metadata_fields() -> Vec<Field> {
    vec![
        Field::new(TOPIC, DataType::Utf8, false),
        Field::new(PARTITION, DataType::Int32, false),
        Field::new(OFFSET, DataType::Int64, false),
        Field::new(
            KAFKA_TIMESTAMP,
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
        Field::new(KEY, DataType::Binary, true),
        Field::new(
            HEADERS,
            DataType::List(Arc::new(Field::new(
                "item",
                DataType::Struct(header_fields()),
                false,
            ))),
            false,
        ),
    ]
}

/// Turns fetched records into rows (value columns, metadata, lineage) and dead letters.
pub(super) struct RecordDecoder {
    value_schema: SchemaRef,
    /// Value columns, metadata columns, lineage columns: what `read` returns.
    pub(super) batch_schema: SchemaRef,
    format: ValueFormat,
    delimiter: u8,
    evolution: SchemaEvolution,
}

impl RecordDecoder {
    /// A decoder of values into `value_schema` (`_rescued_data` included under `rescue`).
    pub(super) fn new(
        value_schema: SchemaRef,
        format: ValueFormat,
        delimiter: u8,
        evolution: SchemaEvolution,
    ) -> Result<Self> {
        let metadata = metadata_fields();
        for f in value_schema.fields() {
            let reserved = metadata.iter().any(|m| m.name() == f.name())
                || [SOURCE_PARTITION, SOURCE_OFFSET].contains(&f.name().as_str());
            if reserved {
                return Err(ConnectorError::Schema(format!(
                    "value column '{}' clashes with a metadata column of the kafka source; \
                     rename it in the producer or declare a schema without it",
                    f.name()
                )));
            }
        }
        let mut fields: Vec<Field> = value_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.extend(metadata);
        let batch_schema = with_lineage_fields(&Schema::new(fields), false);
        Ok(RecordDecoder {
            value_schema,
            batch_schema,
            format,
            delimiter,
            evolution,
        })
    }

    /// The value schema it decodes with.
    pub(super) fn value_schema(&self) -> SchemaRef {
        Arc::clone(&self.value_schema)
    }

    pub(super) fn decode(
        &self,
        id: &PartitionId,
        tp: &TopicPartition,
        records: &[RecordAndOffset],
    ) -> Result<SourceRead> {
        let mut read = SourceRead::default();
        let letter = |r: &RecordAndOffset, error: String| DeadLetter {
            partition: id.clone(),
            offset: r.offset,
            position: format!("{id}@{}", r.offset),
            raw: r.record.value.clone().unwrap_or_default(),
            error,
        };
        if self.format == ValueFormat::Raw {
            if !records.is_empty() {
                let all: Vec<&RecordAndOffset> = records.iter().collect();
                let key = BinaryArray::from_iter(all.iter().map(|r| r.record.key.as_deref()));
                let value = BinaryArray::from_iter(all.iter().map(|r| r.record.value.as_deref()));
                let values: Vec<ArrayRef> = vec![Arc::new(key), Arc::new(value)];
                read.batches.push(self.with_metadata(values, id, tp, &all)?);
            }
            return Ok(read);
        }
        // Lay the values out one per line; record `i` is line number `i`.
        let mut buffer = Vec::new();
        let mut lines = Vec::new();
        for (i, r) in records.iter().enumerate() {
            match &r.record.value {
                None => read.dead_letters.push(letter(
                    r,
                    "the message has no value (a tombstone); nothing to decode".into(),
                )),
                Some(v) => {
                    let v = v.trim_ascii_end();
                    let start = buffer.len();
                    buffer.extend_from_slice(v);
                    lines.push(Line {
                        number: i,
                        start,
                        end: buffer.len(),
                    });
                    buffer.push(b'\n');
                }
            }
        }
        let schema = &self.value_schema;
        let (good, bad) = match self.format {
            ValueFormat::Json => {
                let strict = self.evolution.strict();
                let (good, bad) = decode_json_lines(schema, None, &buffer, &lines, strict);
                if self.evolution == SchemaEvolution::Rescue {
                    let (rescued, bad) = rescue_lines(schema, bad);
                    (good.into_iter().chain(rescued).collect(), bad)
                } else {
                    (good, bad)
                }
            }
            _ => decode_csv_lines(schema, self.delimiter, &buffer, &lines),
        };
        for (batch, numbers) in good {
            let rows: Vec<&RecordAndOffset> = numbers.iter().map(|&i| &records[i]).collect();
            read.batches
                .push(self.with_metadata(batch.columns().to_vec(), id, tp, &rows)?);
        }
        for (i, _, error) in bad {
            read.dead_letters.push(letter(&records[i], error));
        }
        read.dead_letters.sort_by_key(|d| d.offset);
        Ok(read)
    }

    /// Appends the metadata and lineage columns of `rows` to their decoded value columns.
    fn with_metadata(
        &self,
        mut columns: Vec<ArrayRef>,
        id: &PartitionId,
        tp: &TopicPartition,
        rows: &[&RecordAndOffset],
    ) -> Result<RecordBatch> {
        let n = rows.len();
        columns.push(Arc::new(StringArray::from(vec![tp.topic.as_str(); n])));
        columns.push(Arc::new(Int32Array::from(vec![tp.partition; n])));
        columns.push(Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| r.offset),
        )));
        columns.push(Arc::new(
            TimestampMicrosecondArray::from_iter_values(
                rows.iter().map(|r| r.record.timestamp.timestamp_micros()),
            )
            .with_timezone("UTC"),
        ));
        columns.push(Arc::new(BinaryArray::from_iter(
            rows.iter().map(|r| r.record.key.as_deref()),
        )));
        columns.push(headers_array(rows)?);
        columns.push(Arc::new(StringArray::from(vec![id.as_str(); n])));
        columns.push(Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| r.offset),
        )));
        Ok(RecordBatch::try_new(
            Arc::clone(&self.batch_schema),
            columns,
        )?)
    }
}

fn headers_array(rows: &[&RecordAndOffset]) -> Result<ArrayRef> {
    let mut keys = Vec::new();
    let mut values: Vec<&[u8]> = Vec::new();
    let mut lengths = Vec::with_capacity(rows.len());
    for r in rows {
        lengths.push(r.record.headers.len());
        for (k, v) in &r.record.headers {
            keys.push(k.as_str());
            values.push(v);
        }
    }
    let entries = StructArray::try_new(
        header_fields(),
        vec![
            Arc::new(StringArray::from(keys)) as ArrayRef,
            Arc::new(BinaryArray::from_iter_values(values)) as ArrayRef,
        ],
        None,
    )?;
    let item = Arc::new(Field::new("item", DataType::Struct(header_fields()), false));
    let list = ListArray::try_new(
        item,
        OffsetBuffer::from_lengths(lengths),
        Arc::new(entries),
        None,
    )?;
    debug_assert_eq!(list.len(), rows.len());
    Ok(Arc::new(list))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    use chrono::DateTime;
    use rskafka::record::Record;

    fn record(offset: i64, value: Option<&str>) -> RecordAndOffset {
        RecordAndOffset {
            record: Record {
                key: Some(format!("k{offset}").into_bytes()),
                value: value.map(|v| v.as_bytes().to_vec()),
                headers: BTreeMap::from([("trace".to_string(), b"t".to_vec())]),
                timestamp: DateTime::from_timestamp_millis(1_700_000_000_000 + offset)
                    .unwrap_or_default(),
            },
            offset,
        }
    }

    fn decoder(format: ValueFormat) -> RecordDecoder {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]));
        RecordDecoder::new(schema, format, b',', SchemaEvolution::None).unwrap()
    }

    fn tp() -> TopicPartition {
        TopicPartition {
            topic: "clicks".into(),
            partition: 2,
        }
    }

    #[test]
    fn json_values_decode_with_metadata_and_bad_ones_become_dead_letters() {
        let records = vec![
            record(10, Some("{\"id\":1,\"name\":\"a\"}")),
            record(11, Some("{\"id\":")),
            record(12, None),
            record(13, Some("{\"id\":3,\n \"name\":\"multi-line\"}\n")),
        ];
        let read = decoder(ValueFormat::Json)
            .decode(&"2".to_string(), &tp(), &records)
            .unwrap();
        let rows: Vec<(i64, i64)> = read
            .batches
            .iter()
            .flat_map(|b| {
                let ids = b.column_by_name("id").unwrap().as_primitive::<Int64Type>();
                let offs = b
                    .column_by_name(OFFSET)
                    .unwrap()
                    .as_primitive::<Int64Type>();
                (0..b.num_rows())
                    .map(|i| (ids.value(i), offs.value(i)))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(rows, vec![(1, 10), (3, 13)]);
        let b = &read.batches[0];
        assert_eq!(
            b.schema().field(b.num_columns() - 2).name(),
            SOURCE_PARTITION
        );
        let headers = b.column_by_name(HEADERS).unwrap().as_list::<i32>();
        assert_eq!(headers.value(0).len(), 1);
        let letters: Vec<(i64, &str)> = read
            .dead_letters
            .iter()
            .map(|d| (d.offset, d.position.as_str()))
            .collect();
        assert_eq!(letters, vec![(11, "2@11"), (12, "2@12")]);
        assert_eq!(read.dead_letters[0].raw, b"{\"id\":".to_vec());
    }

    #[test]
    fn raw_values_keep_key_and_value_bytes() {
        let records = vec![record(0, Some("not json")), record(1, None)];
        let read = RecordDecoder::new(
            raw_value_schema(),
            ValueFormat::Raw,
            b',',
            SchemaEvolution::None,
        )
        .unwrap()
        .decode(&"0".to_string(), &tp(), &records)
        .unwrap();
        assert!(read.dead_letters.is_empty());
        let b = &read.batches[0];
        assert_eq!(b.num_rows(), 2);
        let value = b.column_by_name("value").unwrap().as_binary::<i32>();
        assert_eq!(value.value(0), b"not json");
        assert!(value.is_null(1));
    }
}
