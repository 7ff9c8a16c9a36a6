//! Decoding records of text (JSON objects, CSV rows) into Arrow, shared by the sources.
//!
//! A source hands over a buffer and the spans of its records (lines of a file, values of Kafka
//! messages). They are decoded in runs of [`DECODE_ROWS`], the runs in parallel; if a run fails,
//! its spans are split in halves until each bad record is alone, so one bad record costs a few
//! extra decodes, never the batch, and every good record is kept in order. Inference of a
//! missing schema is `crate::infer`'s.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, PrimitiveArray, RecordBatch, StringArray};
use arrow::datatypes::{ArrowPrimitiveType, DataType, Field, Schema, SchemaRef};
use rayon::prelude::*;

/// A line of a file: 1-based number and byte span (without the newline).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line {
    pub number: usize,
    pub start: usize,
    pub end: usize,
}

pub(crate) fn split_lines(bytes: &[u8]) -> Vec<Line> {
    let mut lines = Vec::with_capacity(bytes.iter().filter(|b| **b == b'\n').count() + 1);
    let mut start = 0;
    for (number, chunk) in bytes.split(|b| *b == b'\n').enumerate() {
        let mut end = start + chunk.len();
        if end > start && bytes[end - 1] == b'\r' {
            end -= 1;
        }
        lines.push(Line {
            number: number + 1,
            start,
            end,
        });
        start += chunk.len() + 1;
    }
    lines
}

pub(crate) type Decoded = (
    Vec<(RecordBatch, Vec<usize>)>,
    Vec<(usize, Vec<u8>, String)>,
);

/// Lines decoded together: a file becomes batches of at most this many rows, so a decoder's
/// working memory stays small whatever the file's size.
pub(crate) const DECODE_ROWS: usize = 8192;

/// Decodes `lines` in runs of [`DECODE_ROWS`], the runs in parallel (rayon), splitting a run in
/// halves around failures until each bad line is alone. Returns decoded batches with their line
/// numbers, in file order, and the bad lines, in file order.
pub(crate) fn decode_lines(
    bytes: &[u8],
    lines: &[Line],
    decode: impl Fn(&[Line]) -> std::result::Result<RecordBatch, String> + Sync,
) -> Decoded {
    let runs: Vec<Decoded> = lines
        .par_chunks(DECODE_ROWS)
        .map(|run| decode_run(bytes, run, &decode))
        .collect();
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (run_good, run_bad) in runs {
        good.extend(run_good);
        bad.extend(run_bad);
    }
    (good, bad)
}

/// [`decode_lines`] of one run, split in halves around failures.
fn decode_run(
    bytes: &[u8],
    lines: &[Line],
    decode: &impl Fn(&[Line]) -> std::result::Result<RecordBatch, String>,
) -> Decoded {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    let mut pending: Vec<(usize, usize)> = vec![(0, lines.len())];
    while let Some((from, to)) = pending.pop() {
        if from == to {
            continue;
        }
        let chunk = &lines[from..to];
        let result = decode(chunk).and_then(|batch| {
            if batch.num_rows() == chunk.len() {
                Ok(batch)
            } else {
                Err(format!(
                    "expected one record per line, the line holds {}",
                    batch.num_rows()
                ))
            }
        });
        match result {
            Ok(batch) => good.push((batch, chunk.iter().map(|l| l.number).collect())),
            Err(error) if chunk.len() == 1 => {
                let l = chunk[0];
                bad.push((l.number, bytes[l.start..l.end].to_vec(), error));
            }
            Err(_) => {
                let mid = from + (to - from) / 2;
                pending.push((mid, to));
                pending.push((from, mid));
            }
        }
    }
    (good, bad)
}

/// How deeply a JSON record may nest arrays and objects (as serde_json allows). Deeper records
/// are refused before decoding: Arrow's JSON decoder recurses into them and would overflow the
/// stack on a hostile line.
pub(crate) const MAX_JSON_DEPTH: usize = 128;

/// Refuses a record nested deeper than [`MAX_JSON_DEPTH`] (strings are skipped, escapes
/// honoured).
fn check_depth(record: &[u8]) -> std::result::Result<(), String> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in record {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_JSON_DEPTH {
                    return Err(format!(
                        "the record nests arrays or objects deeper than {MAX_JSON_DEPTH} levels"
                    ));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Decodes JSON `lines` of `bytes` into `schema`. `strict`: a record with a field the schema
/// lacks fails (schema evolution looks at it); else such fields are ignored. A text column
/// takes numbers and booleans as their JSON text. An integer column (also in a struct or a
/// list) takes only whole numbers: Arrow alone would read `12.75` as 12.
pub(crate) fn decode_json(
    schema: &SchemaRef,
    bytes: &[u8],
    lines: &[Line],
    strict: bool,
) -> std::result::Result<RecordBatch, String> {
    for l in lines {
        check_depth(&bytes[l.start..l.end])?;
    }
    let decode_schema = integers_as_text(schema);
    let mut decoder = arrow::json::ReaderBuilder::new(Arc::clone(&decode_schema))
        .with_batch_size(lines.len() + 1)
        .with_strict_mode(strict)
        // A text column takes numbers and booleans as their text (inference makes a field
        // text only for a real mix of kinds).
        .with_coerce_primitive(true)
        .build_decoder()
        .map_err(|e| e.to_string())?;
    // Line by line, so a record spanning two lines, or two records on one line, is caught at
    // its line rather than decoded into rows attributed to the wrong lines.
    for l in lines {
        let before = decoder.len();
        feed(&mut decoder, &bytes[l.start..l.end])?;
        feed(&mut decoder, b"\n")?;
        if decoder.has_partial_record() {
            return Err("Json error: truncated record: the line ends inside a JSON record".into());
        }
        let records = decoder.len() - before;
        if records != 1 {
            return Err(format!(
                "Json error: the line holds {records} JSON records; one record per line is read"
            ));
        }
    }
    let batch = decoder
        .flush()
        .map_err(|e| e.to_string())?
        .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(&decode_schema)));
    exact_integers(batch, schema)
}

/// `schema` with its integer columns as text, nested ones (in structs, lists) too, for
/// [`exact_integers`].
fn integers_as_text(schema: &SchemaRef) -> SchemaRef {
    if !schema.fields().iter().any(|f| has_integers(f.data_type())) {
        return Arc::clone(schema);
    }
    let fields: Vec<Field> = schema.fields().iter().map(|f| as_text_field(f)).collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

fn has_integers(t: &DataType) -> bool {
    match t {
        t if t.is_integer() => true,
        DataType::Struct(fields) => fields.iter().any(|f| has_integers(f.data_type())),
        DataType::List(item) => has_integers(item.data_type()),
        _ => false,
    }
}

fn as_text_field(f: &Field) -> Field {
    let t = match f.data_type() {
        t if t.is_integer() => DataType::Utf8,
        DataType::Struct(fields) => {
            DataType::Struct(fields.iter().map(|f| as_text_field(f)).collect())
        }
        DataType::List(item) => DataType::List(Arc::new(as_text_field(item))),
        t => t.clone(),
    };
    f.clone().with_data_type(t)
}

/// `batch` (decoded with [`integers_as_text`]) in `schema`: each integer's text parsed as a
/// whole number that fits its column (`7`, `"7"`, `7.0`, `7e2`), or the batch fails naming the
/// value.
fn exact_integers(
    batch: RecordBatch,
    schema: &SchemaRef,
) -> std::result::Result<RecordBatch, String> {
    if batch.schema() == *schema {
        return Ok(batch);
    }
    let columns = schema
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(field, column)| as_integers(column, field))
        .collect::<std::result::Result<Vec<_>, String>>()?;
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
    .map_err(|e| e.to_string())
}

/// `array` (decoded with [`as_text_field`]) as `field`'s type.
fn as_integers(array: &ArrayRef, field: &Field) -> std::result::Result<ArrayRef, String> {
    use arrow::array::{ListArray, StructArray};
    use arrow::datatypes::{
        Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    if !has_integers(field.data_type()) {
        return Ok(Arc::clone(array));
    }
    Ok(match field.data_type() {
        DataType::Int8 => whole_numbers::<Int8Type>(array.as_string(), field)?,
        DataType::Int16 => whole_numbers::<Int16Type>(array.as_string(), field)?,
        DataType::Int32 => whole_numbers::<Int32Type>(array.as_string(), field)?,
        DataType::Int64 => whole_numbers::<Int64Type>(array.as_string(), field)?,
        DataType::UInt8 => whole_numbers::<UInt8Type>(array.as_string(), field)?,
        DataType::UInt16 => whole_numbers::<UInt16Type>(array.as_string(), field)?,
        DataType::UInt32 => whole_numbers::<UInt32Type>(array.as_string(), field)?,
        DataType::UInt64 => whole_numbers::<UInt64Type>(array.as_string(), field)?,
        DataType::Struct(fields) => {
            let array = array.as_struct();
            let children = fields
                .iter()
                .zip(array.columns())
                .map(|(f, c)| as_integers(c, f))
                .collect::<std::result::Result<Vec<_>, String>>()?;
            Arc::new(
                StructArray::try_new(fields.clone(), children, array.nulls().cloned())
                    .map_err(|e| e.to_string())?,
            )
        }
        DataType::List(item) => {
            let array = array.as_list::<i32>();
            let values = as_integers(array.values(), item)?;
            Arc::new(
                ListArray::try_new(
                    Arc::clone(item),
                    array.offsets().clone(),
                    values,
                    array.nulls().cloned(),
                )
                .map_err(|e| e.to_string())?,
            )
        }
        _ => Arc::clone(array),
    })
}

/// An integer column from the text of its values.
fn whole_numbers<T: ArrowPrimitiveType>(
    text: &StringArray,
    field: &Field,
) -> std::result::Result<ArrayRef, String>
where
    T::Native: TryFrom<i128>,
{
    let parse = |value: &str| -> std::result::Result<T::Native, String> {
        parse_whole(value)
            .and_then(|n| T::Native::try_from(n).ok())
            .ok_or_else(|| {
                format!(
                    "Json error: {value} is not a whole number that fits column '{}' ({})",
                    field.name(),
                    field.data_type()
                )
            })
    };
    let array: PrimitiveArray<T> = text
        .iter()
        .map(|v| v.map(parse).transpose())
        .collect::<std::result::Result<_, String>>()?;
    Ok(Arc::new(array))
}

/// The whole number a JSON number's text denotes, exactly: `-12`, `7.0`, `7e2`, `1.5e1`;
/// `None` for a fraction (`12.75`, `1e-400`), or beyond ±10^38.
fn parse_whole(text: &str) -> Option<i128> {
    let text = text.trim();
    if let Ok(n) = text.parse::<i128>() {
        return Some(n);
    }
    let (negative, rest) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() && fraction.is_empty() || !all_digits(whole) || !all_digits(fraction) {
        return None;
    }
    // digits × 10^scale, trailing zeros moved into the scale.
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    let trimmed = digits.trim_end_matches('0');
    let scale = exponent
        .checked_sub(fraction.len() as i64)?
        .checked_add((digits.len() - trimmed.len()) as i64)?;
    if trimmed.is_empty() {
        return Some(0);
    }
    if scale < 0 || trimmed.len() as i64 + scale > 38 {
        return None;
    }
    let n = trimmed
        .parse::<i128>()
        .ok()?
        .checked_mul(10i128.checked_pow(scale as u32)?)?;
    Some(if negative { -n } else { n })
}

pub(crate) fn feed(
    decoder: &mut arrow::json::reader::Decoder,
    mut buf: &[u8],
) -> std::result::Result<(), String> {
    while !buf.is_empty() {
        let used = decoder.decode(buf).map_err(|e| e.to_string())?;
        if used == 0 {
            return Err("the JSON decoder made no progress".into());
        }
        buf = &buf[used..];
    }
    Ok(())
}

pub(crate) fn decode_csv(
    schema: &SchemaRef,
    delimiter: u8,
    bytes: &[u8],
    lines: &[Line],
) -> std::result::Result<RecordBatch, String> {
    let mut decoder = arrow::csv::ReaderBuilder::new(Arc::clone(schema))
        .with_header(false)
        .with_delimiter(delimiter)
        .with_batch_size(lines.len() + 1)
        .build_decoder();
    let mut buf = Vec::new();
    for l in lines {
        buf.extend_from_slice(&bytes[l.start..l.end]);
        buf.push(b'\n');
    }
    let mut rest = buf.as_slice();
    while !rest.is_empty() {
        let used = decoder.decode(rest).map_err(|e| e.to_string())?;
        if used == 0 {
            break;
        }
        rest = &rest[used..];
    }
    Ok(decoder
        .flush()
        .map_err(|e| e.to_string())?
        .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(schema))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::AsArray;
    use arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use bytes::Bytes;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]))
    }

    #[test]
    fn bad_json_lines_are_isolated_and_good_lines_kept_in_order() {
        let text = b"{\"id\":1,\"name\":\"a\"}\n{\"id\":\n\n{\"id\":\"x\"}\n{\"id\":4}{\"id\":5}\n{\"id\":6}\n";
        let bytes = Bytes::from_static(text);
        let mut lines = split_lines(&bytes);
        lines.retain(|l| !bytes[l.start..l.end].iter().all(u8::is_ascii_whitespace));
        let s = schema();
        let (good, bad) = decode_lines(&bytes, &lines, |c| decode_json(&s, &bytes, c, false));
        let ids: Vec<i64> = good
            .iter()
            .flat_map(|(b, _)| b.column(0).as_primitive::<Int64Type>().values().to_vec())
            .collect();
        assert_eq!(ids, vec![1, 6]);
        let numbers: Vec<usize> = good.iter().flat_map(|(_, n)| n.clone()).collect();
        assert_eq!(numbers, vec![1, 6]);
        let bad_lines: Vec<usize> = bad.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(bad_lines, vec![2, 4, 5]);
        assert_eq!(bad[1].1, b"{\"id\":\"x\"}".to_vec());
    }

    #[test]
    fn csv_decodes_and_rejects_bad_values() {
        let bytes = Bytes::from_static(b"1,a\nnot-a-number,b\n3,c\n");
        let lines = split_lines(&bytes)
            .into_iter()
            .filter(|l| l.end > l.start)
            .collect::<Vec<_>>();
        let s = schema();
        let (good, bad) = decode_lines(&bytes, &lines, |c| decode_csv(&s, b',', &bytes, c));
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(rows, 2);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 2);
    }

    /// The files of `fuzz/corpus/<folder>`.
    fn corpus(folder: &str) -> Vec<(String, Vec<u8>)> {
        let dir = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("../fuzz/corpus")
        .join(folder);
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                (path.display().to_string(), std::fs::read(&path).unwrap())
            })
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no corpus in {}", dir.display());
        files
    }

    fn nested_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("amount", DataType::Float64, true),
            Field::new("ts", DataType::Utf8, true),
            Field::new_list("tags", Field::new_list_field(DataType::Utf8, true), true),
            Field::new_struct("nested", vec![Field::new("k", DataType::Int64, true)], true),
        ]))
    }

    /// Decodes `bytes` as JSON lines and as CSV lines, infers schemas from them: nothing may
    /// panic, and every non-blank line ends up as exactly one row or one bad line.
    fn exercise(bytes: &[u8]) {
        let mut lines = split_lines(bytes);
        lines.retain(|l| !bytes[l.start..l.end].iter().all(u8::is_ascii_whitespace));
        let json = nested_schema();
        let (good, bad) = decode_lines(bytes, &lines, |c| decode_json(&json, bytes, c, false));
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(rows + bad.len(), lines.len(), "a line got lost or doubled");
        let csv = schema();
        let (good, bad) = decode_lines(bytes, &lines, |c| decode_csv(&csv, b',', bytes, c));
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(
            rows + bad.len(),
            lines.len(),
            "a CSV line got lost or doubled"
        );
        let positions = bytes
            .split(|b| *b == b'\n')
            .enumerate()
            .map(|(i, l)| (l, format!("f:{i}")));
        let _ = crate::infer::infer_json(positions, String::new());
        let _ = crate::infer::infer_csv(&[("f".into(), bytes)], true, b',', String::new());
    }

    #[test]
    fn whole_numbers_are_parsed_exactly() {
        for (text, want) in [
            ("7", Some(7)),
            ("-7", Some(-7)),
            ("7.0", Some(7)),
            ("7e2", Some(700)),
            ("1.5e1", Some(15)),
            ("-0", Some(0)),
            ("0.0e5", Some(0)),
            ("1200e-2", Some(12)),
            ("12.75", None),
            ("12.0000000000000001", None),
            ("1e-400", None),
            ("123456789012345678.9", None),
            ("1e39", None),
            ("", None),
            (".", None),
            ("1e", None),
            ("abc", None),
        ] {
            assert_eq!(parse_whole(text), want, "{text:?}");
        }
    }

    /// An integer column takes whole numbers however written, and refuses a fraction (Arrow
    /// alone truncates it) or a value out of its range; a text column takes numbers as text.
    #[test]
    fn integer_columns_take_whole_numbers_only() {
        let s: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("small", DataType::Int8, true),
            Field::new("t", DataType::Utf8, true),
        ]));
        let bytes = b"{\"n\":7,\"small\":1,\"t\":5}\n{\"n\":\"8\",\"small\":7.0,\"t\":true}\n{\"n\":9e2}\n{\"n\":12.75}\n{\"small\":300}\n{\"n\":null}\n";
        let lines = split_lines(bytes);
        let lines: Vec<Line> = lines.into_iter().filter(|l| l.end > l.start).collect();
        let (good, bad) = decode_lines(bytes, &lines, |c| decode_json(&s, bytes, c, false));
        let mut n = Vec::new();
        for (batch, _) in &good {
            n.extend(batch.column(0).as_primitive::<Int64Type>().iter());
        }
        assert_eq!(n, vec![Some(7), Some(8), Some(900), None]);
        let bad: Vec<(usize, &str)> = bad.iter().map(|(l, _, e)| (*l, e.as_str())).collect();
        assert_eq!(
            bad,
            vec![
                (
                    4,
                    "Json error: 12.75 is not a whole number that fits column 'n' (Int64)"
                ),
                (
                    5,
                    "Json error: 300 is not a whole number that fits column 'small' (Int8)"
                ),
            ]
        );
        let t: Vec<Option<&str>> = good[0]
            .0
            .column(2)
            .as_string::<i32>()
            .iter()
            .take(2)
            .collect();
        assert_eq!(t, vec![Some("5"), Some("true")]);
    }

    /// One record split over two lines, and two records on one line, are bad lines — not rows
    /// given to the wrong lines.
    #[test]
    fn a_line_holds_exactly_one_record() {
        let bytes = b"{\"id\":1}\n{\"id\":\n2}\n{\"id\":3}{\"id\":4}\n{\"id\":5}\n";
        let lines = split_lines(bytes)
            .into_iter()
            .filter(|l| l.end > l.start)
            .collect::<Vec<_>>();
        let s = schema();
        let (good, bad) = decode_lines(bytes, &lines, |c| decode_json(&s, bytes, c, false));
        let numbers: Vec<usize> = good.iter().flat_map(|(_, n)| n.clone()).collect();
        assert_eq!(numbers, vec![1, 5]);
        let bad_lines: Vec<usize> = bad.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(bad_lines, vec![2, 3, 4]);
    }

    #[test]
    fn fuzz_corpus_decodes_without_panics() {
        for folder in ["json_lines", "csv_lines"] {
            for (name, bytes) in corpus(folder) {
                let result = std::panic::catch_unwind(|| exercise(&bytes));
                assert!(result.is_ok(), "decoding {name} panicked");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]
        /// Arbitrary bytes.
        #[test]
        fn fuzz_arbitrary_bytes_decode_without_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
        ) {
            exercise(&bytes);
        }

        /// Almost-JSON: tokens of JSON thrown together, so the decoder gets past the first byte.
        #[test]
        fn fuzz_json_like_lines_decode_without_panics(
            tokens in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just("{".to_string()),
                proptest::strategy::Just("}".to_string()),
                proptest::strategy::Just("[".to_string()),
                proptest::strategy::Just("]".to_string()),
                proptest::strategy::Just(",".to_string()),
                proptest::strategy::Just(":".to_string()),
                proptest::strategy::Just("\n".to_string()),
                proptest::strategy::Just("\"id\"".to_string()),
                proptest::strategy::Just("\"tags\"".to_string()),
                proptest::strategy::Just("\"nested\"".to_string()),
                "-?[0-9]{1,25}(\\.[0-9]{1,5})?(e[+-]?[0-9]{1,4})?",
                "\"[^\"\\\\]{0,8}(\\\\u[0-9a-fA-F]{4})?\"",
                proptest::strategy::Just("null".to_string()),
                proptest::strategy::Just("true".to_string()),
            ], 0..60),
        ) {
            exercise(tokens.concat().as_bytes());
        }

        /// Corpus files with bytes flipped.
        #[test]
        fn fuzz_mutated_corpus_decodes_without_panics(
            pick in 0usize..64,
            flips in proptest::collection::vec((0usize..100_000, proptest::prelude::any::<u8>()), 1..8),
        ) {
            let files = corpus("json_lines");
            let (_, bytes) = &files[pick % files.len()];
            let mut bytes = bytes.clone();
            for (at, value) in flips {
                if !bytes.is_empty() {
                    let i = at % bytes.len();
                    bytes[i] = value;
                }
            }
            exercise(&bytes);
        }
    }
}
