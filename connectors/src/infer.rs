//! Schema inference that a few bad records cannot hijack.
//!
//! Arrow's inference gives a field the type that fits *every* value it sees: one `"id": "x"`
//! among ten thousand numeric ids makes `id` a string, and every numeric id then fails to decode
//! against it; one `"amount": "abc"` makes `amount` a string, and `amount * 2` no longer plans.
//! Here each top-level field gets the type that most of its sampled values fit — integers,
//! floats, booleans, else text — and the values that do not fit are counted, with
//! the first one's position, and left to become dead letters when their records are read. Only a
//! real mix (no type fitting [`MAJORITY`] of the values) makes a field a string, which then takes
//! numbers and booleans as text. Nested values (objects, arrays) are typed by Arrow's inference
//! over the nested values alone. Timestamps stay text: the event-time column is parsed in the
//! job's `event_time_format` (its bad values become dead letters naming the format), and any
//! other column keeps the producer's text exactly.
//!
//! The sample is the first [`INFER_RECORDS`] records, across as many files (or partitions) as it
//! takes.

use std::collections::HashMap;

use arrow::datatypes::{DataType, Field, Schema};
use sluice_engine::source::{InferredColumn, SchemaInference};

use crate::decode::{HeaderReading, header_line, header_reading, overflowed};
use crate::error::Result;

/// How many records inference looks at.
pub(crate) const INFER_RECORDS: usize = 10_000;

/// The share of a field's sampled values a type must fit to be the field's type.
pub(crate) const MAJORITY: f64 = 0.9;

/// The kinds of value a field is tallied by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Bool,
    Int,
    Float,
    /// A JSON string holding an integer (`"42"`): Arrow decodes it into an integer column.
    IntText,
    /// A JSON string holding a number.
    FloatText,
    /// An integer beyond the signed 64-bit range (a JSON number above `i64::MAX`, or such a
    /// CSV cell): fits only text (a float would round it).
    BigInt,
    String,
    Nested,
}

/// The largest integer a 64-bit float holds exactly: a column of larger integers is never
/// made a float.
const EXACT_IN_FLOAT: u64 = 1 << 53;

/// One field's sampled values, by kind, with the first position of each kind.
#[derive(Debug, Default)]
struct Tally {
    counts: HashMap<Kind, (u64, usize, String)>,
    /// The nested values, for Arrow's inference.
    nested: Vec<serde_json::Value>,
    values: u64,
    /// Integers beyond ±2^53, which a float column would round.
    large_ints: u64,
}

impl Tally {
    fn add(&mut self, kind: Kind, index: usize, position: &str) {
        self.values += 1;
        let entry = self
            .counts
            .entry(kind)
            .or_insert_with(|| (0, index, position.to_string()));
        entry.0 += 1;
    }

    fn count(&self, kinds: &[Kind]) -> u64 {
        kinds
            .iter()
            .filter_map(|k| self.counts.get(k))
            .map(|c| c.0)
            .sum()
    }

    /// The type most values fit, and the kinds that fit it.
    fn decide(&self) -> Result<(DataType, &'static [Kind])> {
        const INTS: &[Kind] = &[Kind::Int, Kind::IntText];
        const NUMBERS: &[Kind] = &[Kind::Int, Kind::Float, Kind::IntText, Kind::FloatText];
        const TEXT: &[Kind] = &[
            Kind::Bool,
            Kind::Int,
            Kind::Float,
            Kind::IntText,
            Kind::FloatText,
            Kind::BigInt,
            Kind::String,
        ];
        // A type is chosen when most values fit it and some are written as it (numbers written
        // as text alone keep a field text: that is how its producer writes it).
        let enough = |fits: &[Kind], written: &[Kind]| {
            self.values > 0
                && self.count(written) > 0
                && self.count(fits) as f64 >= MAJORITY * self.values as f64
        };
        let fractions = self.count(&[Kind::Float, Kind::FloatText]);
        Ok(if self.values == 0 {
            (DataType::Utf8, TEXT)
        } else if enough(&[Kind::Nested], &[Kind::Nested]) {
            let schema = arrow::json::reader::infer_json_schema_from_iterator(
                self.nested
                    .iter()
                    .map(|v| serde_json::json!({ "v": v }))
                    .map(Ok),
            )?;
            let data_type = schema
                .field_with_name("v")
                .map(|f| without_null_types(f.data_type()))
                .unwrap_or(DataType::Utf8);
            (data_type, &[Kind::Nested])
        } else if enough(INTS, &[Kind::Int]) && (fractions == 0 || self.large_ints > 0) {
            // Integers: one float makes the column a float, since an integer column refuses
            // `12.75` — unless a float would round some of the integers (beyond 2^53), which
            // then keep the column, and the floats are the misfits.
            (DataType::Int64, INTS)
        } else if enough(NUMBERS, &[Kind::Int, Kind::Float]) && self.large_ints == 0 {
            (DataType::Float64, NUMBERS)
        } else if enough(&[Kind::Bool], &[Kind::Bool]) {
            (DataType::Boolean, &[Kind::Bool])
        } else {
            (DataType::Utf8, TEXT)
        })
    }

    /// Values that do not fit `fits`, and the position of the first of them.
    fn misfits(&self, fits: &[Kind]) -> (u64, Option<String>) {
        let mut count = 0;
        let mut first: Option<(usize, &String)> = None;
        for (kind, (n, index, position)) in &self.counts {
            if fits.contains(kind) {
                continue;
            }
            count += n;
            if first.is_none_or(|(i, _)| *index < i) {
                first = Some((*index, position));
            }
        }
        (count, first.map(|(_, p)| p.clone()))
    }
}

/// The kind of a scalar written as text (a CSV cell); `None` for empty.
fn text_kind(s: &str) -> Option<Kind> {
    let s = s.trim();
    if s.is_empty() {
        None
    } else if s.parse::<i64>().is_ok() {
        Some(Kind::Int)
    } else if s
        .strip_prefix('-')
        .unwrap_or(s)
        .bytes()
        .all(|b| b.is_ascii_digit())
        && s.bytes().any(|b| b.is_ascii_digit())
    {
        Some(Kind::BigInt)
    } else if s
        .parse::<f64>()
        // Not beyond a DOUBLE (`1e400`, which the decoder refuses); `inf` and `NaN` are floats.
        .is_ok_and(|f| !overflowed(s, f.is_finite()))
    {
        Some(Kind::Float)
    } else if s.eq_ignore_ascii_case("true") || s.eq_ignore_ascii_case("false") {
        Some(Kind::Bool)
    } else {
        Some(Kind::String)
    }
}

/// The kind of a JSON number: an integer, an integer beyond 64 bits, or a float (as written:
/// `10.0` says the producer writes a float).
fn number_kind(n: &serde_json::Number) -> Kind {
    if n.is_i64() {
        Kind::Int
    } else if n.is_u64() {
        Kind::BigInt
    } else {
        Kind::Float
    }
}

/// Whether `n` is an integer a 64-bit float cannot hold exactly (beyond ±2^53). A number
/// written with a fraction or an exponent is a float, however large (`6.02e23`); one written
/// as an integer beyond 64 bits is read as a float by the JSON parser and counted as one.
fn is_large_integer(n: &serde_json::Number) -> bool {
    match (n.as_i64(), n.as_u64()) {
        (Some(i), _) => i.unsigned_abs() > EXACT_IN_FLOAT,
        (None, Some(_)) => true,
        _ => false,
    }
}

/// `t` with Arrow's `Null` type (a field only ever seen empty: `[]`, `null`) as text, so a
/// later value has a type to decode into.
fn without_null_types(t: &DataType) -> DataType {
    match t {
        DataType::Null => DataType::Utf8,
        DataType::List(item) => DataType::List(std::sync::Arc::new(
            item.as_ref()
                .clone()
                .with_data_type(without_null_types(item.data_type())),
        )),
        DataType::Struct(fields) => DataType::Struct(
            fields
                .iter()
                .map(|f| {
                    f.as_ref()
                        .clone()
                        .with_data_type(without_null_types(f.data_type()))
                })
                .collect(),
        ),
        t => t.clone(),
    }
}

/// Tallies fields in first-seen order.
#[derive(Default)]
struct Tallies {
    order: Vec<String>,
    fields: HashMap<String, Tally>,
    records: u64,
}

impl Tallies {
    fn field(&mut self, name: &str) -> &mut Tally {
        if !self.fields.contains_key(name) {
            self.order.push(name.to_string());
        }
        self.fields.entry(name.to_string()).or_default()
    }

    fn finish(self, sample: String) -> Result<(Schema, SchemaInference)> {
        let mut fields = Vec::new();
        let mut columns = Vec::new();
        for name in &self.order {
            let tally = &self.fields[name];
            let (data_type, fits) = tally.decide()?;
            let (misfits, first_misfit) = tally.misfits(fits);
            columns.push(InferredColumn {
                name: name.clone(),
                data_type: data_type.to_string(),
                values: tally.values,
                misfits,
                first_misfit,
            });
            fields.push(Field::new(name, data_type, true));
        }
        let inference = SchemaInference {
            sample,
            records: self.records,
            columns,
        };
        Ok((Schema::new(fields), inference))
    }
}

/// Infers a schema from JSON records (one object each; anything else is skipped), each with its
/// position (`file.json:3`), fields in first-seen order. `sample` says where the records came
/// from, for the report. Looks at no more than [`INFER_RECORDS`] records.
pub(crate) fn infer_json<'a>(
    records: impl IntoIterator<Item = (&'a [u8], String)>,
    sample: String,
) -> Result<(Schema, SchemaInference)> {
    let mut tallies = Tallies::default();
    for (index, (record, position)) in records.into_iter().take(INFER_RECORDS).enumerate() {
        let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(record) else {
            continue;
        };
        tallies.records += 1;
        for (key, value) in map {
            let kind = match &value {
                serde_json::Value::Null => {
                    tallies.field(&key);
                    continue;
                }
                serde_json::Value::Bool(_) => Kind::Bool,
                serde_json::Value::Number(n) => number_kind(n),
                serde_json::Value::String(s) => match text_kind(s) {
                    Some(Kind::Int) => Kind::IntText,
                    Some(Kind::Float) => Kind::FloatText,
                    _ => Kind::String,
                },
                serde_json::Value::Array(_) | serde_json::Value::Object(_) => Kind::Nested,
            };
            let tally = tallies.field(&key);
            tally.add(kind, index, &position);
            if let serde_json::Value::Number(n) = &value
                && is_large_integer(n)
            {
                tally.large_ints += 1;
            }
            if kind == Kind::Nested {
                tally.nested.push(value);
            }
        }
    }
    tallies.finish(sample)
}

/// Infers a schema from CSV texts (`(name, text)`: records separated by newlines; the first
/// line of each that is not blank is the header when `header`, else columns are `column_1`, …),
/// each cell typed by the text it holds. Positions are `name:line`.
///
/// The columns are the names of the first header followed by records (a header alone counts
/// only if no text has records), then `column_N` for the fields its usual record has beyond
/// them (a delimiter ending each line). Each text is tallied as the decoder will read it
/// (`crate::decode::decode_csv_file`, through the same [`header_reading`]): by name when its
/// header names every column, and not at all when it names others besides or names a column
/// at another position than its own (its lines will be dead letters); else by position. Only
/// the records of the width that reading takes are tallied — for the first text, the width
/// most of its records have (a tie: its header's, else the wider; never less than its
/// header's); without headers, the width most sampled records have — so one line with a field
/// too many adds no column and fails alone.
pub(crate) fn infer_csv(
    texts: &[(String, &[u8])],
    header: bool,
    delimiter: u8,
    sample: String,
) -> Result<(Schema, SchemaInference)> {
    // Each text's header names, and its records with their positions, while the sample lasts.
    type Sampled = (Vec<String>, Vec<(csv::StringRecord, String)>);
    let mut sampled: Vec<Sampled> = Vec::new();
    let mut count = 0;
    for (text_name, text) in texts {
        if count >= INFER_RECORDS {
            break;
        }
        // With a header, from its line on ([`header_line`], as the decoder reads it): the
        // reader would take a line of whitespace before it for the header.
        let (text, lines_before) = if header {
            match header_line(text) {
                Some(line) => (&text[line.start..], line.number - 1),
                // Blank lines only: no header, no records.
                None => continue,
            }
        } else {
            (*text, 0)
        };
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(header)
            .delimiter(delimiter)
            .flexible(true)
            .from_reader(text);
        let names: Vec<String> = if header {
            reader
                .byte_headers()
                .map(crate::decode::header_names)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let mut records = Vec::new();
        for record in reader.records() {
            if count >= INFER_RECORDS {
                break;
            }
            let Ok(record) = record else { continue };
            let line = record.position().map_or(0, |p| p.line() as usize) + lines_before;
            records.push((record, format!("{text_name}:{line}")));
            count += 1;
        }
        sampled.push((names, records));
    }
    // The width most of `widths` have (a tie: `preferred` if among them, else the wider).
    let usual = |widths: &mut dyn Iterator<Item = usize>, preferred: Option<usize>| {
        let mut counts: HashMap<usize, usize> = HashMap::new();
        for w in widths {
            *counts.entry(w).or_default() += 1;
        }
        let most = counts.values().copied().max().unwrap_or(0);
        preferred
            .filter(|p| counts.get(p) == Some(&most))
            .or_else(|| {
                counts
                    .into_iter()
                    .filter(|(_, n)| *n == most)
                    .map(|(w, _)| w)
                    .max()
            })
            .unwrap_or(0)
    };
    let mut columns: Vec<String> = Vec::new();
    if !header {
        let width = usual(
            &mut sampled
                .iter()
                .flat_map(|(_, r)| r.iter().map(|(r, _)| r.len())),
            None,
        );
        columns = (1..=width).map(|i| format!("column_{i}")).collect();
    }
    let mut tallies = Tallies::default();
    for name in &columns {
        tallies.field(name);
    }
    let mut index = 0;
    let mut header_only: Vec<String> = Vec::new();
    for (names, records) in &sampled {
        // The name each field is tallied under, and the width of the records tallied.
        let (names_here, width) = if !header {
            (columns.clone(), columns.len())
        } else if columns.is_empty() && records.is_empty() {
            // A header alone: its names are the columns only if no file has lines.
            if header_only.is_empty() {
                header_only.clone_from(names);
            }
            continue;
        } else if columns.is_empty() {
            // The first header with lines: its names, and `column_N` beyond them.
            let mut first: Vec<String> = names.clone();
            let width = usual(&mut records.iter().map(|(r, _)| r.len()), Some(first.len()));
            // Lines narrower than the header are not read (dead letters): it names the columns.
            let width = width.max(first.len());
            while first.len() < width {
                first.push(format!("column_{}", first.len() + 1));
            }
            columns.clone_from(&first);
            for name in &columns {
                tallies.field(name);
            }
            (first, width)
        } else {
            let known: Vec<&str> = columns.iter().map(String::as_str).collect();
            match header_reading(&known, names, false) {
                HeaderReading::ByPosition { misplaced: None } => (columns.clone(), columns.len()),
                // A column named at another position: its lines will be dead letters.
                HeaderReading::ByPosition { misplaced: Some(_) } => continue,
                HeaderReading::ByName { of_header, .. } => {
                    // Naming a column the schema will lack: its lines will be dead letters.
                    let Some(by_name) = of_header
                        .iter()
                        .map(|i| i.map(|i| columns[i].clone()))
                        .collect::<Option<Vec<String>>>()
                    else {
                        continue;
                    };
                    let width = by_name.len();
                    (by_name, width)
                }
            }
        };
        for (record, position) in records {
            index += 1;
            if record.len() != width {
                continue;
            }
            tallies.records += 1;
            for (i, (cell, name)) in record.iter().zip(&names_here).enumerate() {
                // A byte order mark starting a line is not data (as the decoder reads it).
                let cell = if i == 0 {
                    cell.trim_start_matches('\u{feff}')
                } else {
                    cell
                };
                let tally = tallies.field(name);
                if let Some(kind) = text_kind(cell) {
                    if kind == Kind::BigInt
                        || kind == Kind::Int
                            && cell
                                .trim()
                                .parse::<i64>()
                                .is_ok_and(|i| i.unsigned_abs() > EXACT_IN_FLOAT)
                    {
                        tally.large_ints += 1;
                    }
                    tally.add(kind, index, position);
                }
            }
        }
    }
    if columns.is_empty() {
        for name in &header_only {
            tallies.field(name);
        }
    }
    tallies.finish(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn lines(text: &str) -> Vec<(&[u8], String)> {
        text.lines()
            .enumerate()
            .map(|(i, l)| (l.as_bytes(), format!("f.json:{}", i + 1)))
            .collect()
    }

    /// One string id among numbers, one string amount among numbers: both stay numeric, and
    /// the report names how many values did not fit and where the first was.
    #[test]
    fn a_minority_does_not_decide_the_type() {
        let mut text = String::from(
            r#"{"id":"x","amount":"abc","ok":true,"ts":"2026-11-01T10:00:00Z","tags":["a"]}"#,
        );
        text.push('\n');
        for i in 0..99 {
            text.push_str(&format!(
                r#"{{"id":{i},"amount":{i}.5,"ok":false,"ts":"2026-11-01T10:00:{:02}Z","tags":[],"mixed":{}}}"#,
                i % 60,
                if i % 2 == 0 { "1".to_string() } else { "\"one\"".to_string() }
            ));
            text.push('\n');
        }
        let (schema, report) = infer_json(lines(&text), "f.json".into()).unwrap();
        let types: Vec<(String, DataType)> = schema
            .fields()
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect();
        assert_eq!(
            types,
            vec![
                ("id".into(), DataType::Int64),
                ("amount".into(), DataType::Float64),
                ("ok".into(), DataType::Boolean),
                ("ts".into(), DataType::Utf8),
                (
                    "tags".into(),
                    DataType::List(Arc::new(Field::new_list_field(DataType::Utf8, true)))
                ),
                ("mixed".into(), DataType::Utf8),
            ]
        );
        let id = &report.columns[0];
        assert_eq!((id.values, id.misfits), (100, 1));
        assert_eq!(id.first_misfit.as_deref(), Some("f.json:1"));
        assert_eq!(report.columns[5].misfits, 0, "a real mix is text");
        assert_eq!(report.records, 100);
    }

    /// One fractional value among integers makes a float column (an integer column would
    /// truncate it); numbers written as text count for the number types.
    #[test]
    fn a_single_fraction_makes_a_float_column() {
        let mut text = String::new();
        for i in 0..50 {
            text.push_str(&format!(r#"{{"n":{i},"s":"{i}","m":{i}}}"#));
            text.push('\n');
        }
        text.push_str(r#"{"n":12.75,"s":"7","m":"8"}"#);
        let (schema, report) = infer_json(lines(&text), "f.json".into()).unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Float64);
        assert_eq!(report.columns[0].misfits, 0);
        assert_eq!(
            schema.field(1).data_type(),
            &DataType::Utf8,
            "numbers written as text"
        );
        assert_eq!(schema.field(2).data_type(), &DataType::Int64);
        assert_eq!(
            report.columns[2].misfits, 0,
            "\"8\" decodes into an integer column"
        );
    }

    /// Integers a float would round keep their column integer (the floats are the misfits);
    /// integers beyond 64 bits make text; a field only ever seen empty is typed to take values.
    #[test]
    fn large_integers_are_never_rounded() {
        let mut text = String::new();
        for i in 0..50 {
            let id = 9_007_199_254_740_993_i64 + i;
            text.push_str(&format!(
                r#"{{"id":{id},"hash":1844674407370955161{},"tags":[]}}"#,
                i % 10
            ));
            text.push('\n');
        }
        text.push_str(r#"{"id":1.5,"hash":18446744073709551615,"tags":[]}"#);
        let (schema, report) = infer_json(lines(&text), "f.json".into()).unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
        assert_eq!(report.columns[0].misfits, 1);
        assert_eq!(schema.field(1).data_type(), &DataType::Utf8);
        assert_eq!(
            schema.field(2).data_type(),
            &DataType::List(Arc::new(Field::new_list_field(DataType::Utf8, true)))
        );

        // Large numbers written as floats are floats; `-` in a CSV is not a number.
        let mut text = String::new();
        for i in 0..50 {
            text.push_str(&format!(r#"{{"x":{i}.5}}"#));
            text.push('\n');
        }
        text.push_str(r#"{"x":6.02e23}"#);
        let (schema, _) = infer_json(lines(&text), "f.json".into()).unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Float64);
        let csv = b"x\n1.5\n-\n2.5\n3.5\n4.5\n5.5\n6.5\n7.5\n8.5\n9.5\n10.5\n";
        let (schema, report) =
            infer_csv(&[("f.csv".into(), csv)], true, b',', String::new()).unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Float64);
        assert_eq!(report.columns[0].misfits, 1);
    }

    #[test]
    fn csv_cells_are_typed_by_their_text() {
        let text = b"id,amount,name\n1,1.5,a\nx,2.5,b\n3,abc,c\n4,4.5,d\n5,5.5,e\n6,6.5,f\n7,7,g\n8,8.5,h\n9,9.5,i\n10,10.5,j\n11,1,k\n";
        let (schema, report) =
            infer_csv(&[("f.csv".into(), text)], true, b',', "f.csv".into()).unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64);
        assert_eq!(schema.field(2).data_type(), &DataType::Utf8);
        assert_eq!(report.columns[0].first_misfit.as_deref(), Some("f.csv:3"));
        // A number beyond a DOUBLE is not a float (the decoder refuses it); NaN is.
        assert_eq!(text_kind("1e400"), Some(Kind::String));
        assert_eq!(text_kind("NaN"), Some(Kind::Float));
        assert_eq!(text_kind("1e300"), Some(Kind::Float));
    }

    /// A line with a field more than its header adds no column (it will be a dead letter),
    /// while most lines wider than the header (a delimiter ending each line) add one; a file
    /// whose header names every column, in another order or case, is tallied by name; one
    /// naming others besides, or a column out of place, is not tallied (its lines will be dead
    /// letters); one naming some or none, in place, by position; without headers, the width
    /// most lines have is the schema's. Blank lines before a header are skipped.
    #[test]
    fn csv_columns_are_tallied_as_the_decoder_reads_them() {
        let names = |schema: &Schema| -> Vec<String> {
            schema.fields().iter().map(|f| f.name().clone()).collect()
        };
        let first = b"user,amount,ts\nalice,1.5,t1\ndave,3,t2,extra\n";
        let reordered = b"TS,User,amount\nt3,bob,2.5\n";
        let more = b"user,amount,ts,note\nerin,x,t5,hi\n";
        let positional = b"who,how_much,when\ncarol,4.5,t4\n";
        let misplaced = b"amount,who,when\nfrank,x,y\n";
        let texts = [
            ("a.csv".to_string(), &first[..]),
            ("b.csv".into(), &reordered[..]),
            ("c.csv".into(), &more[..]),
            ("d.csv".into(), &positional[..]),
            ("e.csv".into(), &misplaced[..]),
        ];
        let (schema, report) = infer_csv(&texts, true, b',', String::new()).unwrap();
        assert_eq!(names(&schema), vec!["user", "amount", "ts"]);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64);
        assert_eq!(report.records, 3, "alice, bob and carol");
        assert_eq!(report.columns[0].values, 3);
        assert_eq!(
            report.columns[1].first_misfit, None,
            "frank's line is not tallied"
        );
        // Blank lines before a header: the header is the first line that is not blank, and
        // positions count every line.
        let late =
            b"\n  \nuser,amount\nann,x\nb,1.5\nc,2\nd,3\ne,4\nf,5\ng,6\nh,7\ni,8\nj,9\nk,10\n";
        let (schema, report) =
            infer_csv(&[("l.csv".into(), &late[..])], true, b',', String::new()).unwrap();
        assert_eq!(names(&schema), vec!["user", "amount"]);
        assert_eq!(schema.field(1).data_type(), &DataType::Float64);
        assert_eq!(report.columns[1].first_misfit.as_deref(), Some("l.csv:4"));
        let trailing = b"a,b\n1,2,\n3,4,\n";
        let reordered = b"b,a\n5,6,\n";
        let texts = [
            ("t.csv".to_string(), &trailing[..]),
            ("u.csv".into(), &reordered[..]),
        ];
        let (schema, report) = infer_csv(&texts, true, b',', String::new()).unwrap();
        assert_eq!(names(&schema), vec!["a", "b", "column_3"]);
        assert_eq!(report.records, 3);
        // A header alone first: the next file's lines decide the width.
        let alone = b"a,b\n";
        let texts = [
            ("s.csv".to_string(), &alone[..]),
            ("t.csv".into(), &trailing[..]),
        ];
        let (schema, _) = infer_csv(&texts, true, b',', String::new()).unwrap();
        assert_eq!(names(&schema), vec!["a", "b", "column_3"]);
        let (schema, _) =
            infer_csv(&[("s.csv".into(), &alone[..])], true, b',', String::new()).unwrap();
        assert_eq!(names(&schema), vec!["a", "b"]);
        let headless = b"1,a\n2,b\n3,c,x\n4,d\n";
        let (schema, _) = infer_csv(
            &[("c.csv".into(), &headless[..])],
            false,
            b',',
            String::new(),
        )
        .unwrap();
        assert_eq!(names(&schema), vec!["column_1", "column_2"]);
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
    }

    #[test]
    fn json_inference_keeps_first_seen_order() {
        let sample = b"{\"b\":1,\"a\":\"x\"}\nnot json\n{\"c\":1.5}\n";
        let (schema, _) =
            infer_json(lines(std::str::from_utf8(sample).unwrap()), String::new()).unwrap();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, vec!["b", "a", "c"]);
        let types: Vec<_> = schema
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        assert_eq!(
            types,
            vec![DataType::Int64, DataType::Utf8, DataType::Float64]
        );
    }
}
