//! JSON lines read straight into columns, in one pass over each line's bytes.
//!
//! [`crate::decode`] reads JSON into columns that are, for most schemas, text only: its number,
//! boolean and timestamp columns are read as text and converted per row afterwards. Through
//! Arrow's decoder such a line costs three passes — the object check that sorts lines, the
//! decoder's tape, the tape into columns. For a schema whose decoded columns are all text
//! ([`FlatJson::new`]), a line that is a flat object of strings, numbers, booleans and nulls is
//! read here instead, in one pass, its values appended to the columns as they are found — a
//! number, boolean or timestamp converted from its text there and then, by the same conversion
//! ([`crate::decode::json_from_text`]) the decoder's text columns go through. A read
//! that keeps only some columns (a query using a few of many) still reads every value of a line
//! — so a line is taken or declined alike — and still converts the number, boolean and
//! timestamp values of the columns not kept (a value that does not convert fails its line), but
//! copies only the kept text columns' values.
//!
//! A line this reader is not sure of it declines, and `decode` gives it to Arrow's decoder as
//! before: a nested value, a key written with an escape, a key given twice, a missing or
//! trailing comma, a field the schema lacks under strict decoding, no value for a NOT NULL
//! column, anything malformed, text that is not UTF-8. So a line decodes to the same row, or
//! fails with the same reason, whichever path reads it: what is read here is what Arrow's
//! decoder reads (with primitive coercion) — a string's unescaped text, a number's own text,
//! `true`/`false` as text, null or absent as null. The tests compare the two on generated lines.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, LargeStringBuilder, RecordBatch, RecordBatchOptions, StringBuilder, StringViewBuilder,
};
use arrow::datatypes::{DataType, SchemaRef};

use crate::decode::{
    FromText, Line, converted_from_text, json_from_text, literal_end, skip_whitespace, text_schema,
    unicode_escape,
};

/// A reader of flat JSON objects into a schema of text columns, numbers, booleans and
/// timestamps.
pub(crate) struct FlatJson {
    /// The schema as decoded: every column text, as its values are read off a line.
    schema: SchemaRef,
    /// The columns whose values are kept (by index in `schema`), in order: the batch a read
    /// makes holds these only. The others are still read over and checked as any column is.
    built: Vec<usize>,
    /// The `built` columns as the source declares them: the schema of the batches a read
    /// makes, its numbers, booleans and timestamps converted from each value's text as it is
    /// read ([`FromText`]).
    built_schema: SchemaRef,
    /// The columns that must have a value (NOT NULL): a line without one is declined.
    required: Vec<usize>,
    /// Whether a field the schema lacks fails its line (declined, for Arrow to give the reason).
    strict: bool,
    /// Each column's name as a key without escapes reads on a line (`None` for a name holding
    /// a quote or backslash): the expected key is matched in place.
    quoted_names: Vec<Option<QuotedName>>,
}

/// A column's name and its closing quote, as on a line.
struct QuotedName {
    bytes: Vec<u8>,
    /// The bytes as a little-endian number and the mask of their bits, where they fit in 16
    /// bytes (most names): a key is then matched with one load and compare, not a `memcmp`
    /// call (one per value was 8 % of a JSON job's CPU).
    short: Option<(u128, u128)>,
}

impl QuotedName {
    fn new(name: &str) -> Option<QuotedName> {
        let name = name.as_bytes();
        if name.iter().any(|b| matches!(b, b'"' | b'\\')) {
            return None;
        }
        let bytes = [name, b"\""].concat();
        let short = (bytes.len() <= 16).then(|| {
            let mut padded = [0u8; 16];
            padded[..bytes.len()].copy_from_slice(&bytes);
            let mask = u128::MAX >> (8 * (16 - bytes.len()));
            (u128::from_le_bytes(padded), mask)
        });
        Some(QuotedName { bytes, short })
    }

    /// Whether `line` holds this name and its closing quote at `at`.
    #[inline]
    fn is_at(&self, line: &[u8], at: usize) -> bool {
        let sixteen = line
            .get(at..at + 16)
            .and_then(|s| <[u8; 16]>::try_from(s).ok());
        match (self.short, sixteen) {
            (Some((name, mask)), Some(s)) => (u128::from_le_bytes(s) ^ name) & mask == 0,
            _ => line.get(at..at + self.bytes.len()) == Some(self.bytes.as_slice()),
        }
    }
}

/// A value found on a line, by byte span.
#[derive(Debug, Clone, Copy)]
enum Value {
    Null,
    /// A string without escapes (its text between the quotes), or a number's text.
    Text(usize, usize),
    /// A string with escapes: its unescaped text, by span in the line's unescaped strings.
    Escaped(usize, usize),
    True,
    False,
}

/// A text column being built.
enum TextColumn {
    Utf8(StringBuilder),
    LargeUtf8(LargeStringBuilder),
    Utf8View(StringViewBuilder),
}

impl TextColumn {
    fn append(&mut self, value: Option<&str>) {
        match self {
            TextColumn::Utf8(b) => b.append_option(value),
            TextColumn::LargeUtf8(b) => b.append_option(value),
            TextColumn::Utf8View(b) => b.append_option(value),
        }
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            TextColumn::Utf8(b) => Arc::new(b.finish()),
            TextColumn::LargeUtf8(b) => Arc::new(b.finish()),
            TextColumn::Utf8View(b) => Arc::new(b.finish()),
        }
    }
}

/// What [`FlatJson::read`] made of some lines.
#[derive(Debug)]
pub(crate) struct FlatRead {
    /// The rows of the lines read (the `built` columns), one per line of `read`.
    pub batch: RecordBatch,
    /// The lines read into the batch, in order.
    pub read: Vec<Line>,
    /// The lines read whose value did not convert, with the first such column's reason, in
    /// order. They have no row in the batch. (A line with no value for a NOT NULL column is
    /// declined, not read.)
    pub bad: Vec<(Line, String)>,
    /// The lines declined, in order: for Arrow's decoder.
    pub declined: Vec<Line>,
}

impl FlatJson {
    /// A reader for `schema`, if every column of it is text or converted from text (numbers,
    /// booleans, timestamps) and their names differ; `None` otherwise (any other column —
    /// nested, binary, date, decimal, … — and such schemas go through Arrow's decoder only).
    /// `built`: the columns whose values the batches keep (by index, ascending; `None`: all).
    pub(crate) fn new(
        schema: &SchemaRef,
        strict: bool,
        built: Option<Vec<usize>>,
    ) -> Option<FlatJson> {
        let decode_schema = &text_schema(schema);
        let fields = decode_schema.fields();
        let text =
            |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
        let mut names: Vec<&String> = fields.iter().map(|f| f.name()).collect();
        names.sort();
        names.dedup();
        let unique = names.len() == fields.len();
        if fields.is_empty() || !unique || !fields.iter().all(|f| text(f.data_type())) {
            return None;
        }
        let built = built.unwrap_or_else(|| (0..fields.len()).collect());
        let built_schema = Arc::new(schema.project(&built).ok()?);
        Some(FlatJson {
            schema: Arc::clone(decode_schema),
            built,
            built_schema,
            required: (0..fields.len())
                .filter(|i| !fields[*i].is_nullable())
                .collect(),
            strict,
            quoted_names: fields.iter().map(|f| QuotedName::new(f.name())).collect(),
        })
    }

    /// Reads what it can of `lines` of `bytes` ([`FlatRead`]). A line's converted columns
    /// (numbers, booleans, timestamps) are appended first: where a value does not convert, the
    /// line's values appended before it are taken back and the line is bad, so a bad line
    /// costs about what a good one does — no filter copies its neighbours afterwards.
    ///
    /// # Errors
    /// If a column cannot be converted from text at all (its time zone does not parse), or the
    /// columns do not make a batch of the schema (not expected: they are built for it).
    pub(crate) fn read(
        &self,
        bytes: &[u8],
        lines: &[Line],
    ) -> std::result::Result<FlatRead, String> {
        let span: usize = lines.iter().map(|l| l.end - l.start).sum();
        if span > i32::MAX as usize {
            // A column's text could outgrow 32-bit offsets: the decoder says so, line by line.
            return Ok(FlatRead {
                batch: RecordBatch::new_empty(Arc::clone(&self.built_schema)),
                read: Vec::new(),
                bad: Vec::new(),
                declined: lines.to_vec(),
            });
        }
        let per_column = span / self.schema.fields().len().max(1);
        // The built columns by kind, each with its index in `built` and in the schema.
        let mut converted: Vec<(usize, usize, Box<dyn FromText>)> = Vec::new();
        let mut text_columns: Vec<(usize, usize, TextColumn)> = Vec::new();
        for (at, (f, &index)) in self
            .built_schema
            .fields()
            .iter()
            .zip(&self.built)
            .enumerate()
        {
            let text_column = match f.data_type() {
                t if converted_from_text(t) => {
                    converted.push((at, index, json_from_text(f, lines.len())?));
                    continue;
                }
                DataType::LargeUtf8 => TextColumn::LargeUtf8(LargeStringBuilder::with_capacity(
                    lines.len(),
                    per_column,
                )),
                DataType::Utf8View => {
                    TextColumn::Utf8View(StringViewBuilder::with_capacity(lines.len()))
                }
                _ => TextColumn::Utf8(StringBuilder::with_capacity(lines.len(), per_column)),
            };
            text_columns.push((at, index, text_column));
        }
        let mut values: Vec<Option<Value>> = vec![None; self.schema.fields().len()];
        let mut unescaped = String::new();
        let mut read = Vec::with_capacity(lines.len());
        let (mut bad, mut declined) = (Vec::new(), Vec::new());
        let all_text = AllText::of(bytes, lines);
        for line in lines {
            let Some(text) = all_text
                .line(bytes, line)
                .filter(|text| self.values(text, &mut values, &mut unescaped).is_some())
            else {
                declined.push(*line);
                continue;
            };
            let value_of = |index: usize| match values[index] {
                None | Some(Value::Null) => None,
                Some(Value::Text(from, to)) => Some(&text[from..to]),
                Some(Value::Escaped(from, to)) => Some(&unescaped[from..to]),
                Some(Value::True) => Some("true"),
                Some(Value::False) => Some("false"),
            };
            let row = read.len();
            let failed = converted
                .iter_mut()
                .enumerate()
                .find_map(|(c, (_, index, column))| {
                    column.append(value_of(*index)).err().map(|e| (c, e))
                });
            if let Some((c, reason)) = failed {
                for (_, _, column) in &mut converted[..c] {
                    column.truncate(row);
                }
                bad.push((*line, reason));
                continue;
            }
            for (_, index, column) in &mut text_columns {
                column.append(value_of(*index));
            }
            read.push(*line);
        }
        let mut arrays: Vec<(usize, ArrayRef)> = converted
            .iter_mut()
            .map(|(at, _, c)| (*at, c.finish()))
            .chain(text_columns.iter_mut().map(|(at, _, c)| (*at, c.finish())))
            .collect();
        arrays.sort_by_key(|(at, _)| *at);
        let batch = RecordBatch::try_new_with_options(
            Arc::clone(&self.built_schema),
            arrays.into_iter().map(|(_, array)| array).collect(),
            &RecordBatchOptions::new().with_row_count(Some(read.len())),
        )
        .map_err(|e| e.to_string())?;
        Ok(FlatRead {
            batch,
            read,
            bad,
            declined,
        })
    }

    /// The values of the flat object `text`, by column, into `values` (escaped strings
    /// unescaped into `unescaped`); `None` if the line is not one this reader takes (see the
    /// module's documentation).
    fn values(
        &self,
        text: &str,
        values: &mut [Option<Value>],
        unescaped: &mut String,
    ) -> Option<()> {
        values.fill(None);
        unescaped.clear();
        let line = text.as_bytes();
        let mut at = skip_whitespace(line, 0, false);
        (line.get(at) == Some(&b'{')).then_some(())?;
        at = skip_whitespace(line, at + 1, false);
        // Where the next key is expected: fields usually come in the schema's order.
        let mut next_column = 0;
        if line.get(at) == Some(&b'}') {
            at += 1;
        } else {
            loop {
                (line.get(at) == Some(&b'"')).then_some(())?;
                let (column, key_end) = match self.expected_key(line, at + 1, next_column) {
                    Some(key_end) => (Some(next_column), key_end),
                    None => {
                        let key_end = at + 1 + memchr::memchr2(b'"', b'\\', line.get(at + 1..)?)?;
                        // A key with an escape is left to the decoder, which unescapes it.
                        (line[key_end] == b'"').then_some(())?;
                        (self.column(&line[at + 1..key_end], next_column), key_end)
                    }
                };
                at = skip_whitespace(line, key_end + 1, false);
                (line.get(at) == Some(&b':')).then_some(())?;
                at = skip_whitespace(line, at + 1, false);
                let (value, end) = value(text, at, unescaped)?;
                at = skip_whitespace(line, end, false);
                match column {
                    Some(column) => {
                        // A key given twice is left to the decoder (the last one wins there).
                        values[column].is_none().then_some(())?;
                        values[column] = Some(value);
                        next_column = column + 1;
                    }
                    None if self.strict => return None,
                    None => {}
                }
                match line.get(at)? {
                    b',' => at = skip_whitespace(line, at + 1, false),
                    b'}' => {
                        at += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        (skip_whitespace(line, at, false) == line.len()).then_some(())?;
        self.required
            .iter()
            .all(|c| !matches!(values[*c], None | Some(Value::Null)))
            .then_some(())
    }

    /// If the key whose text starts at `at` is column `expected`'s name, the index of its
    /// closing quote — one comparison in place, where fields come in the schema's order.
    fn expected_key(&self, line: &[u8], at: usize, expected: usize) -> Option<usize> {
        let quoted = self.quoted_names.get(expected)?.as_ref()?;
        quoted.is_at(line, at).then(|| at + quoted.bytes.len() - 1)
    }

    /// The column named `key`: `expected` is tried first.
    fn column(&self, key: &[u8], expected: usize) -> Option<usize> {
        let fields = self.schema.fields();
        let named = |i: &usize| fields[*i].name().as_bytes() == key;
        Some(expected)
            .filter(|i| *i < fields.len() && named(i))
            .or_else(|| (0..fields.len()).find(named))
    }
}

/// The text of the lines a read is given, checked as UTF-8 once from the first line's start to
/// the last one's end: a check per line cost more than the check itself (simdutf8 takes blocks
/// of 64 bytes, and a line's tail went through its slower path). Where that span is not all
/// UTF-8 (a line holding other bytes, or the skipped ones between lines), each line is checked
/// on its own, as before.
struct AllText<'a> {
    /// The span's text and where it starts in the bytes, if it is all UTF-8.
    span: Option<(&'a str, usize)>,
}

impl<'a> AllText<'a> {
    fn of(bytes: &'a [u8], lines: &[Line]) -> AllText<'a> {
        let span = lines.first().zip(lines.last()).and_then(|(first, last)| {
            let text = simdutf8::basic::from_utf8(bytes.get(first.start..last.end)?).ok()?;
            Some((text, first.start))
        });
        AllText { span }
    }

    /// `line`'s text, if it is UTF-8.
    fn line(&self, bytes: &'a [u8], line: &Line) -> Option<&'a str> {
        let in_span = self.span.and_then(|(text, start)| {
            text.get(line.start.checked_sub(start)?..line.end.checked_sub(start)?)
        });
        in_span.or_else(|| simdutf8::basic::from_utf8(bytes.get(line.start..line.end)?).ok())
    }
}

/// The scalar value at `at` and the index after it (an escaped string's text unescaped onto
/// `unescaped`); `None` for a nested value or bad text. A number is what Arrow's decoder takes
/// as one: a `-` or digit, then any of `0-9 + - . e E`.
fn value(text: &str, at: usize, unescaped: &mut String) -> Option<(Value, usize)> {
    let line = text.as_bytes();
    match *line.get(at)? {
        b'"' => {
            let from = at + 1;
            let stop = from + memchr::memchr2(b'"', b'\\', line.get(from..)?)?;
            if line[stop] == b'"' {
                return Some((Value::Text(from, stop), stop + 1));
            }
            let start = unescaped.len();
            let end = unescape(text, from, unescaped)?;
            Some((Value::Escaped(start, unescaped.len()), end))
        }
        b'-' | b'0'..=b'9' => {
            let end = at
                + 1
                + line[at + 1..]
                    .iter()
                    .take_while(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                    .count();
            Some((Value::Text(at, end), end))
        }
        b't' => Some((Value::True, literal_end(line, at + 1, b"rue")?)),
        b'f' => Some((Value::False, literal_end(line, at + 1, b"alse")?)),
        b'n' => Some((Value::Null, literal_end(line, at + 1, b"ull")?)),
        _ => None,
    }
}

/// The string of `line` whose text starts at `from` (after its opening quote) unescaped onto
/// `out`, as the decoder path reads it (Arrow's decoder, its surrogate pairs mended first:
/// `decode::surrogate_pairs_as_utf8`): the index after its closing quote, or `None` for an
/// escape the decoder refuses (an unknown letter, bad hex digits, a `\u` surrogate not in a
/// high-low pair).
fn unescape(line: &str, from: usize, out: &mut String) -> Option<usize> {
    let bytes = line.as_bytes();
    let mut at = from;
    loop {
        let found = at + memchr::memchr2(b'"', b'\\', bytes.get(at..)?)?;
        out.push_str(line.get(at..found)?);
        if bytes[found] == b'"' {
            return Some(found + 1);
        }
        at = found + 2;
        let c = match *bytes.get(found + 1)? {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let (c, end) = unicode_escape(bytes, at)?;
                at = end;
                c
            }
            _ => return None,
        };
        out.push(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key is matched in place only where the whole name and its closing quote are there,
    /// whatever the name's length and however close the line's end.
    #[test]
    fn quoted_names_match_whole_keys_only() {
        for name in [
            "",
            "id",
            "fifteen_chars__",
            "sixteen_chars___",
            "a_longer_name_than_16",
        ] {
            let quoted = QuotedName::new(name).unwrap();
            assert_eq!(quoted.short.is_some(), name.len() < 16, "{name}");
            let line = format!("\"{name}\":1}}");
            assert!(quoted.is_at(line.as_bytes(), 1), "{name}");
            let cut = &line.as_bytes()[..name.len() + 2];
            assert!(quoted.is_at(cut, 1), "{name} at the line's end");
            assert!(!quoted.is_at(&cut[..cut.len() - 1], 1), "{name} cut short");
            let longer = format!("\"{name}x\":1}}");
            assert!(!quoted.is_at(longer.as_bytes(), 1), "{name}x");
            if let Some(first) = name.chars().next() {
                let other = line.replacen(first, "Z", 1);
                assert!(!quoted.is_at(other.as_bytes(), 1), "{other}");
                let last = name.len();
                let mut changed = line.clone().into_bytes();
                changed[last] ^= 1;
                assert!(!quoted.is_at(&changed, 1), "{name}, last byte changed");
            }
        }
        assert!(QuotedName::new("a\"b").is_none());
        assert!(QuotedName::new("a\\b").is_none());
    }

    /// Lines are read as UTF-8 whether the span they cover is all UTF-8 or not: a line that is
    /// not is declined, its neighbours read; bytes that are not UTF-8 between the lines given
    /// (a line not read here) change nothing.
    #[test]
    fn lines_are_checked_as_utf8_with_or_without_the_whole_span() {
        use arrow::array::{Array, AsArray};
        use arrow::datatypes::{Field, Schema};
        let schema: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]));
        let flat = FlatJson::new(&schema, false, None).unwrap();
        let mut bytes = b"{\"id\":1,\"name\":\"\xc3\xa9t\xc3\xa9\"}\n".to_vec();
        bytes.extend_from_slice(b"{\"id\":2,\"name\":\"\xff\"}\n");
        bytes.extend_from_slice(b"{\"id\":3,\"name\":\"\xf0\x9f\x98\x80\"}");
        let lines = crate::decode::split_lines(&bytes);
        let numbers = |lines: &[Line]| lines.iter().map(|l| l.number).collect::<Vec<_>>();
        let names = |rows: &FlatRead| {
            let names = rows.batch.column(1).as_string::<i32>();
            (0..names.len())
                .map(|i| names.value(i).to_string())
                .collect::<Vec<_>>()
        };

        let rows = flat.read(&bytes, &lines).unwrap();
        assert_eq!(numbers(&rows.read), vec![1, 3]);
        assert_eq!(numbers(&rows.declined), vec![2]);
        assert_eq!(names(&rows), vec!["été", "😀"]);

        let around = [lines[0], lines[2]];
        let rows = flat.read(&bytes, &around).unwrap();
        assert_eq!(numbers(&rows.read), vec![1, 3]);
        assert!(rows.declined.is_empty());
        assert_eq!(names(&rows), vec!["été", "😀"]);
        assert!(AllText::of(&bytes, &around).span.is_none());

        // Through the span, which starts past the first byte: the last line alone.
        let last = AllText::of(&bytes, &lines[2..]);
        assert_eq!(last.span.map(|(_, start)| start), Some(lines[2].start));
        assert_eq!(
            last.line(&bytes, &lines[2]),
            Some("{\"id\":3,\"name\":\"😀\"}")
        );
        // Given no bytes to check on its own, a line is found in the span or not at all.
        assert_eq!(
            last.line(&[], &lines[2]),
            Some("{\"id\":3,\"name\":\"😀\"}")
        );
        assert_eq!(last.line(&[], &lines[0]), None);
        assert_eq!(
            last.line(&bytes, &lines[0]),
            AllText::of(&bytes, &lines[..1]).line(&bytes, &lines[0])
        );
        let rows = flat.read(&bytes, &lines[2..]).unwrap();
        assert_eq!(numbers(&rows.read), vec![3]);
        assert_eq!(names(&rows), vec!["😀"]);
    }
}
