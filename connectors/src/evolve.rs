//! Schema evolution of JSON sources: what happens to a record carrying a field the schema lacks,
//! or a value that does not fit its column.
//!
//! `[sources.NAME] schema_evolution` (default `add_columns` when the schema is inferred, `none`
//! when it is declared):
//!
//! - `add_columns`: a field the schema lacks — top-level, or a new field of a struct column —
//!   becomes a nullable column, typed by the majority of the values of it in the read (as
//!   inference does). The source records it in its checkpoint with where it first appeared
//!   (`schema_log`), then decodes the read again with it, so the batch that first carries the
//!   field has the column, and every later run and replay decodes with it (records from before
//!   it appeared read null). A value of the wrong type still makes its record a dead letter.
//! - `rescue`: the schema stays; a record's fields the schema lacks and values that do not
//!   decode as their column's type are kept, as the JSON text they were written as, in the
//!   `_rescued_data` column (an object of them) instead of dead-lettering the record.
//! - `fail`: a field the schema lacks stops the job, naming the field, where it first appeared
//!   and the setting that would accept it.
//! - `none`: fields the schema lacks are ignored (the record is read without them); a value of
//!   the wrong type dead-letters its record.
//!
//! All but `none` decode in Arrow's strict mode, which refuses a record with an unknown field;
//! those records are then looked at here. A field named like a column Sluice adds itself
//! (lineage, Kafka metadata, the late table's, `_rescued_data`) is never added: its records stay
//! dead letters. Fields of structs nested deeper than a list of structs (a list of lists) are not
//! evolved either.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sluice_engine::DeadLetter;
use sluice_engine::late;
use sluice_engine::source::{SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION};

use crate::decode::{Line, decode_json};
use crate::error::{ConnectorError, Result};
use crate::infer::infer_json;

/// The column `rescue` keeps what does not fit in.
pub const RESCUED_DATA: &str = "_rescued_data";

/// What a JSON source does with fields its schema lacks. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemaEvolution {
    /// New fields become columns.
    AddColumns,
    /// New fields and misfit values are kept in `_rescued_data`.
    Rescue,
    /// A new field stops the job.
    Fail,
    /// New fields are ignored.
    None,
}

impl SchemaEvolution {
    /// The mode in force: `configured`, else `add_columns` for an inferred schema and `none`
    /// for a declared one. Only JSON evolves.
    ///
    /// # Errors
    /// If a mode other than `none` is configured for a format that is not JSON.
    pub(crate) fn resolve(
        configured: Option<SchemaEvolution>,
        declared: bool,
        json: bool,
        format: &str,
    ) -> Result<SchemaEvolution> {
        match configured {
            Some(SchemaEvolution::None) => Ok(SchemaEvolution::None),
            Some(mode) if !json => Err(ConnectorError::Config(format!(
                "schema_evolution = \"{}\" applies to JSON records; {format} records keep their \
                 schema (use \"none\", or leave it out)",
                mode.name()
            ))),
            Some(mode) => Ok(mode),
            None if json && !declared => Ok(SchemaEvolution::AddColumns),
            None => Ok(SchemaEvolution::None),
        }
    }

    /// Its name in the job file.
    pub fn name(self) -> &'static str {
        match self {
            SchemaEvolution::AddColumns => "add_columns",
            SchemaEvolution::Rescue => "rescue",
            SchemaEvolution::Fail => "fail",
            SchemaEvolution::None => "none",
        }
    }

    /// Whether records are decoded strictly (an unknown field fails the record).
    pub(crate) fn strict(self) -> bool {
        self != SchemaEvolution::None
    }

    /// The data schema a source decodes with: `schema`, plus `_rescued_data` for `rescue`.
    pub(crate) fn data_schema(self, schema: SchemaRef) -> SchemaRef {
        if self != SchemaEvolution::Rescue || schema.field_with_name(RESCUED_DATA).is_ok() {
            return schema;
        }
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields.push(Field::new(RESCUED_DATA, DataType::Utf8, true));
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
    }
}

/// Fields records carry that the schema lacks.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NewFields {
    /// The columns to record: new top-level columns, and struct columns with their new fields
    /// (the whole column, replacing the old one).
    pub(crate) columns: Vec<Field>,
    /// The new fields by path (`a`, `s.b`), for messages.
    pub(crate) names: Vec<String>,
    /// Where the first record carrying one is, with its offset.
    pub(crate) first_seen: String,
}

/// Columns Sluice adds to every source's rows or to the late table: a field of one of these
/// names is never added, its records stay dead letters.
const SLUICE_COLUMNS: [&str; 7] = [
    SOURCE_PARTITION,
    SOURCE_OFFSET,
    SOURCE_POSITION,
    late::WATERMARK,
    late::WINDOWS_MISSED,
    late::BATCH_ID,
    RESCUED_DATA,
];

/// What `mode` makes of a read's dead letters (decoded against `schema`): under `add_columns`,
/// the fields to add (`None`: nothing new); under `fail`, the error naming the first new field;
/// under the other modes, nothing. `reserved`: the names of columns the source adds besides
/// Sluice's own.
///
/// # Errors
/// New fields under `fail`, or a failed inference of their types.
pub(crate) fn fields_to_add(
    mode: SchemaEvolution,
    schema: &Schema,
    dead_letters: &[DeadLetter],
    reserved: &[&str],
) -> Result<Option<NewFields>> {
    if !matches!(mode, SchemaEvolution::AddColumns | SchemaEvolution::Fail) {
        return Ok(None);
    }
    match new_fields(schema, dead_letters, reserved)? {
        Some(new) if mode == SchemaEvolution::Fail => Err(refuse_new_fields(&new)),
        new => Ok(new),
    }
}

/// The fields that `records` (JSON objects that failed to decode against `schema`) carry and
/// `schema` lacks — top-level, in structs, in the structs of lists — each typed by the majority
/// of its values; `None` if there are none. Top-level names of [`SLUICE_COLUMNS`] and
/// `reserved` are never added: their records stay dead letters.
///
/// # Errors
/// If inference of the new fields' types fails.
fn new_fields(
    schema: &Schema,
    records: &[DeadLetter],
    reserved: &[&str],
) -> Result<Option<NewFields>> {
    // Values of each unknown path, in record order, with the record's position.
    let mut found: BTreeMap<Vec<String>, Vec<(Box<RawValue>, String)>> = BTreeMap::new();
    let mut order: Vec<Vec<String>> = Vec::new();
    let mut first_seen: Option<String> = None;
    for record in records {
        let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(&record.raw) else {
            continue;
        };
        let mut unknown = Vec::new();
        unknown_fields(schema.fields(), &map, &mut Vec::new(), &mut unknown);
        unknown.retain(|(path, _)| {
            let name = path[0].as_str();
            !reserved.contains(&name) && !SLUICE_COLUMNS.contains(&name)
        });
        if !unknown.is_empty() && first_seen.is_none() {
            first_seen = Some(format!("{} (offset {})", record.position, record.offset));
        }
        for (path, value) in unknown {
            let raw = serde_json::value::to_raw_value(value)
                .map_err(|e| ConnectorError::Schema(format!("{}: {e}", record.position)))?;
            if !found.contains_key(&path) {
                order.push(path.clone());
            }
            found
                .entry(path)
                .or_default()
                .push((raw, record.position.clone()));
        }
    }
    let Some(first_seen) = first_seen else {
        return Ok(None);
    };
    let mut fields: Fields = schema.fields().clone();
    let mut names = Vec::new();
    for path in &order {
        // A field inside a struct that is itself new comes with the struct's inferred type.
        if order
            .iter()
            .any(|p| p.len() < path.len() && path.starts_with(p))
        {
            continue;
        }
        let leaf = path.last().cloned().unwrap_or_default();
        let values = &found[path];
        let records: Vec<(Vec<u8>, String)> = values
            .iter()
            .map(|(raw, position)| {
                let key = serde_json::to_string(&leaf).unwrap_or_default();
                (
                    format!("{{{key}:{}}}", raw.get()).into_bytes(),
                    position.clone(),
                )
            })
            .collect();
        let (inferred, _) = infer_json(
            records.iter().map(|(r, p)| (r.as_slice(), p.clone())),
            String::new(),
        )?;
        let Ok(field) = inferred.field_with_name(&leaf) else {
            continue;
        };
        fields = add_field(&fields, path, field.clone().with_nullable(true));
        names.push(path.join("."));
    }
    if names.is_empty() {
        return Ok(None);
    }
    let columns = fields
        .iter()
        .filter(|f| schema.field_with_name(f.name()).ok() != Some(f.as_ref()))
        .map(|f| f.as_ref().clone())
        .collect();
    Ok(Some(NewFields {
        columns,
        names,
        first_seen,
    }))
}

/// The paths of `map`'s fields that `fields` lacks, recursing into struct columns and the
/// structs of list columns (a path goes through a list by its name).
fn unknown_fields<'a>(
    fields: &Fields,
    map: &'a serde_json::Map<String, serde_json::Value>,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Vec<String>, &'a serde_json::Value)>,
) {
    for (key, value) in map {
        prefix.push(key.clone());
        match fields.find(key) {
            None => out.push((prefix.clone(), value)),
            Some((_, field)) => match (field.data_type(), value) {
                (DataType::Struct(inner), serde_json::Value::Object(m)) => {
                    unknown_fields(inner, m, prefix, out);
                }
                (DataType::List(item), serde_json::Value::Array(elements)) => {
                    if let DataType::Struct(inner) = item.data_type() {
                        for element in elements {
                            if let serde_json::Value::Object(m) = element {
                                unknown_fields(inner, m, prefix, out);
                            }
                        }
                    }
                }
                _ => {}
            },
        }
        prefix.pop();
    }
}

/// `fields` with `field` added at `path` (its last element is the field's own name).
fn add_field(fields: &Fields, path: &[String], field: Field) -> Fields {
    match path {
        [] => fields.clone(),
        [_] => {
            let mut all: Vec<Field> = fields.iter().map(|f| f.as_ref().clone()).collect();
            all.push(field);
            Fields::from(all)
        }
        [head, rest @ ..] => Fields::from(
            fields
                .iter()
                .map(|f| match f.data_type() {
                    DataType::Struct(inner) if f.name() == head => f
                        .as_ref()
                        .clone()
                        .with_data_type(DataType::Struct(add_field(inner, rest, field.clone()))),
                    DataType::List(item) if f.name() == head => {
                        match item.data_type() {
                            DataType::Struct(inner) => {
                                let item = item.as_ref().clone().with_data_type(DataType::Struct(
                                    add_field(inner, rest, field.clone()),
                                ));
                                f.as_ref()
                                    .clone()
                                    .with_data_type(DataType::List(Arc::new(item)))
                            }
                            _ => f.as_ref().clone(),
                        }
                    }
                    _ => f.as_ref().clone(),
                })
                .collect::<Vec<_>>(),
        ),
    }
}

/// The error of `fail` for new fields.
fn refuse_new_fields(new: &NewFields) -> ConnectorError {
    ConnectorError::Schema(format!(
        "field{} {} first appear{} at {}, and the schema lacks {}; schema_evolution = \"fail\" \
         stops the job here. Set schema_evolution = \"add_columns\" to add new fields as columns, \
         \"rescue\" to keep them in {RESCUED_DATA}, or \"none\" to ignore them",
        if new.names.len() == 1 { "" } else { "s" },
        new.names
            .iter()
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", "),
        if new.names.len() == 1 { "s" } else { "" },
        new.first_seen,
        if new.names.len() == 1 { "it" } else { "them" },
    ))
}

/// A record rewritten for `rescue`: its fields whose values decode as their column's type
/// kept as written; the others (fields the schema lacks, values of the wrong type) moved into
/// `_rescued_data` as a JSON object of exactly the text they were written as. `None` if the
/// record is not a JSON object.
pub(crate) fn rescue(schema: &SchemaRef, record: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(record).ok()?;
    let map: BTreeMap<String, &RawValue> = serde_json::from_str(text).ok()?;
    // In the order written (a duplicated key keeps its last value, as serde reads it).
    let mut entries: Vec<(&String, &RawValue)> = map.iter().map(|(k, v)| (k, *v)).collect();
    entries.sort_by_key(|(_, v)| v.get().as_ptr() as usize);
    let mut kept = Vec::new();
    let mut rescued = Vec::new();
    for (key, value) in entries {
        let pair = format!("{}:{}", serde_json::to_string(key).ok()?, value.get());
        let fits = key != RESCUED_DATA
            && schema.field_with_name(key).is_ok_and(|field| {
                let one = Arc::new(Schema::new(vec![field.clone()]));
                let line = format!("{{{pair}}}");
                let lines = [Line {
                    number: 1,
                    start: 0,
                    end: line.len(),
                }];
                decode_json(&one, line.as_bytes(), &lines, true).is_ok()
            });
        if fits {
            kept.push(pair);
        } else {
            rescued.push(pair);
        }
    }
    if !rescued.is_empty() {
        let object = format!("{{{}}}", rescued.join(","));
        kept.push(format!(
            "{}:{}",
            serde_json::to_string(RESCUED_DATA).ok()?,
            serde_json::to_string(&object).ok()?
        ));
    }
    Some(format!("{{{}}}", kept.join(",")).into_bytes())
}

/// `rescue` for the records of `bad` (line number, raw bytes, error) that failed to decode:
/// each rewritten by [`rescue`] and decoded again. Returns the rows rescued, with their line
/// numbers, and the records that still fail (with their first error).
#[allow(clippy::type_complexity)]
pub(crate) fn rescue_lines(
    schema: &SchemaRef,
    bad: Vec<(usize, Vec<u8>, String)>,
) -> (
    Vec<(arrow::array::RecordBatch, Vec<usize>)>,
    Vec<(usize, Vec<u8>, String)>,
) {
    let mut rescued = Vec::new();
    let mut still_bad = Vec::new();
    for (number, raw, error) in bad {
        let decoded = rescue(schema, &raw).and_then(|line| {
            let lines = [Line {
                number,
                start: 0,
                end: line.len(),
            }];
            decode_json(schema, &line, &lines, true).ok()
        });
        match decoded {
            Some(batch) if batch.num_rows() == 1 => rescued.push((batch, vec![number])),
            _ => still_bad.push((number, raw, error)),
        }
    }
    (rescued, still_bad)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new_struct("user", vec![Field::new("name", DataType::Utf8, true)], true),
        ])
    }

    fn item(fields: Vec<Field>) -> Field {
        Field::new_list(
            "items",
            Field::new_list_field(DataType::Struct(Fields::from(fields)), true),
            true,
        )
    }

    /// A new field of the structs in a list, and a field named like a lineage column (never
    /// added).
    #[test]
    fn fields_of_structs_in_lists_are_added_and_reserved_names_are_not() {
        let sku = Field::new("sku", DataType::Utf8, true);
        let schema = Schema::new(vec![item(vec![sku.clone()])]);
        let records = [letter(
            r#"{"items":[{"sku":"a","qty":2},{"sku":"b"}],"_source_offset":3}"#,
            "f.json:1",
            0,
        )];
        let new = new_fields(&schema, &records, &["_source_offset"])
            .unwrap()
            .unwrap();
        assert_eq!(new.names, vec!["items.qty"]);
        assert_eq!(
            new.columns,
            vec![item(vec![sku, Field::new("qty", DataType::Int64, true)])]
        );
        let only_reserved = [letter(r#"{"_source_offset":3}"#, "f.json:2", 0)];
        assert_eq!(
            new_fields(&schema, &only_reserved, &["_source_offset"]).unwrap(),
            None
        );
    }

    fn letter(raw: &str, position: &str, offset: i64) -> DeadLetter {
        DeadLetter {
            partition: "0".into(),
            offset,
            position: position.into(),
            raw: raw.as_bytes().to_vec(),
            error: String::new(),
        }
    }

    #[test]
    fn new_top_level_and_nested_fields_are_found_and_typed_by_majority() {
        let records = [
            letter(r#"{"id":1,"plan":"pro"}"#, "f.json:3", 7),
            letter(
                r#"{"id":2,"user":{"name":"a","age":30},"score":1}"#,
                "f.json:4",
                7,
            ),
            letter(r#"{"id":3,"score":2,"user":{"age":29}}"#, "f.json:5", 7),
            letter(r#"{"id":4,"score":3.5,"user":{"age":31}}"#, "f.json:6", 7),
            letter("not json", "f.json:7", 7),
        ];
        let new = new_fields(&schema(), &records, &[]).unwrap().unwrap();
        assert_eq!(new.names, vec!["plan", "user.age", "score"]);
        assert_eq!(new.first_seen, "f.json:3 (offset 7)");
        let columns: Vec<(String, DataType)> = new
            .columns
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect();
        assert_eq!(
            columns,
            vec![
                (
                    "user".into(),
                    DataType::Struct(Fields::from(vec![
                        Field::new("name", DataType::Utf8, true),
                        Field::new("age", DataType::Int64, true),
                    ]))
                ),
                ("plan".into(), DataType::Utf8),
                ("score".into(), DataType::Float64),
            ]
        );
        let none = new_fields(&schema(), &[letter(r#"{"id":"x"}"#, "f:1", 0)], &[]).unwrap();
        assert_eq!(none, None, "a misfit value is not a new field");
    }

    #[test]
    fn rescue_keeps_what_fits_and_the_exact_text_of_the_rest() {
        let schema = SchemaEvolution::Rescue.data_schema(Arc::new(schema()));
        let record = br#"{"id": "seven", "extra":[1, 2.50,{"k":null}], "user":{"name":"a"}}"#;
        let rescued = String::from_utf8(rescue(&schema, record).unwrap()).unwrap();
        let value: serde_json::Value = serde_json::from_str(&rescued).unwrap();
        assert_eq!(value["user"]["name"], "a");
        assert!(value.get("id").is_none());
        assert_eq!(
            value[RESCUED_DATA].as_str().unwrap(),
            r#"{"id":"seven","extra":[1, 2.50,{"k":null}]}"#
        );
        assert_eq!(rescue(&schema, b"[1,2]"), None);
    }
}
