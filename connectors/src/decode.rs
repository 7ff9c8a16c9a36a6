//! Decoding records of text (JSON objects, CSV rows) into Arrow, shared by the sources.
//!
//! A source hands over a buffer and the spans of its records (lines of a file, values of Kafka
//! messages). They are decoded in runs of [`DECODE_ROWS`], the runs in parallel, every good record
//! kept in order and every bad one given its reason — at about the cost of decoding the good ones:
//! - Each line is first checked, in one cheap pass over its bytes, to be one JSON object
//!   ([`is_one_json_object`]) or one CSV record of the schema's width ([`is_one_csv_record`]).
//!   The lines that pass are decoded together; a line that does not is decoded on its own, so
//!   the decoder itself gives the reason (or, where the check was stricter than the decoder,
//!   the row).
//! - Values that do not fit their column (`"amount": "n/a"` in a DOUBLE column) are found per
//!   row: top-level number, boolean and timestamp columns are decoded as text and converted
//!   here, a value that does not convert failing its own line only ([`decode_json_rows`],
//!   [`decode_csv`]).
//! - What is left — a failure the decoder reports only for a whole run: a bad value inside a
//!   struct or list (a nested `12.75` in an integer), an object or list where a top-level value
//!   is expected, a date or decimal column given bad text, a missing value in a NOT NULL column
//!   that is not converted, a field the schema lacks under strict decoding — is found by
//!   splitting the run in halves until each bad record is alone.
//!
//! Inference of a missing schema is `crate::infer`'s.

use std::sync::Arc;

use arrow::array::builder::{BooleanBufferBuilder, NullBufferBuilder};
use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, PrimitiveArray, RecordBatch, StringArray,
};
use arrow::buffer::NullBuffer;
use arrow::compute::kernels::cast_utils::{Parser, string_to_datetime};
use arrow::datatypes::{ArrowPrimitiveType, DataType, Field, Schema, SchemaRef, TimeUnit};
use rayon::prelude::*;
use sluice_engine::event_time::plain_utc_timestamp;

use crate::flat_json::{FlatJson, FlatRead};

/// A line of a file: 1-based number and byte span (without the newline).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line {
    pub number: usize,
    pub start: usize,
    pub end: usize,
}

/// Every line of `bytes`, blank ones too (the sources read [`data_lines`]).
#[cfg(test)]
pub(crate) fn split_lines(bytes: &[u8]) -> Vec<Line> {
    lines_where(bytes, |_| true)
}

/// The lines of `bytes` whose text `keep` keeps.
fn lines_where(bytes: &[u8], keep: impl Fn(&[u8]) -> bool) -> Vec<Line> {
    let mut kept = Vec::with_capacity(expected_lines(bytes));
    kept.extend(lines(bytes).filter(|line| keep(&bytes[line.start..line.end])));
    kept
}

/// Every line of `bytes`, its span without the newline (nor a carriage return before it).
fn lines(bytes: &[u8]) -> impl Iterator<Item = Line> + '_ {
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', bytes).chain(std::iter::once(bytes.len()));
    ends.enumerate().map(move |(number, newline)| {
        let mut end = newline;
        if end > start && bytes[end - 1] == b'\r' {
            end -= 1;
        }
        let line = Line {
            number: number + 1,
            start,
            end,
        };
        start = newline + 1;
        line
    })
}

/// About how many lines `bytes` holds, an eighth over: its length over the mean length of the
/// lines in its first [`LINE_SAMPLE_BYTES`] (all of them in a shorter text), at most
/// [`MAX_EXPECTED_LINES`]. Counting every newline first was a pass over the file of its own
/// (3.5 % of JSON q7's CPU samples). A file whose later lines are shorter only grows the
/// vector; one whose later lines are longer reserves room it does not use, bounded by the cap
/// (short first lines in a large file would otherwise reserve many times its size).
fn expected_lines(bytes: &[u8]) -> usize {
    let sample = &bytes[..bytes.len().min(LINE_SAMPLE_BYTES)];
    let newlines = memchr::memchr_iter(b'\n', sample).count();
    if sample.len() == bytes.len() {
        return newlines + 1;
    }
    let mean = sample.len() / newlines.max(1);
    let expected = bytes.len() / mean.max(1);
    (expected + expected / 8 + 1).min(MAX_EXPECTED_LINES)
}

/// The most lines [`expected_lines`] expects: room for a million lines (24 MiB) is reserved
/// at most; a text with more grows its vector beyond.
const MAX_EXPECTED_LINES: usize = 1 << 20;

/// The bytes of a text whose lines [`expected_lines`] counts to judge the rest.
const LINE_SAMPLE_BYTES: usize = 64 * 1024;

/// The lines of a text file that hold data: without blank lines (whitespace and byte-order
/// marks only) and, when `skip_header`, without the header ([`header_line`]: the first line
/// that is not blank), each judged as it is split off, while its bytes are in the cache.
pub(crate) fn data_lines(bytes: &[u8], skip_header: bool) -> Vec<Line> {
    let header_pending = std::cell::Cell::new(skip_header);
    lines_where(bytes, |text| {
        !is_blank(text) && !header_pending.replace(false)
    })
}

/// The header line of a CSV text: its first line that is not blank (`None`: every line is).
/// Blank lines before the header (an export that starts with an empty line) are skipped as
/// blank lines everywhere else are: the header is still the line that names the columns, for
/// inference and decoding alike.
pub(crate) fn header_line(bytes: &[u8]) -> Option<Line> {
    lines(bytes).find(|line| !is_blank(&bytes[line.start..line.end]))
}

/// Whether a line holds nothing: whitespace and byte-order marks only.
fn is_blank(text: &[u8]) -> bool {
    without_bom(text).iter().all(u8::is_ascii_whitespace)
}

/// Good rows as batches with their line numbers, in order, and bad lines (number, raw bytes,
/// reason), in order.
pub(crate) type Decoded = (
    Vec<(RecordBatch, Vec<usize>)>,
    Vec<(usize, Vec<u8>, String)>,
);

/// What decoding some lines together gave: one row per line, and the lines (by index among
/// them) whose value did not fit its column, with the reason. Their rows are dropped.
#[derive(Debug)]
pub(crate) struct DecodedRows {
    pub batch: RecordBatch,
    pub bad_rows: Vec<(usize, String)>,
}

impl DecodedRows {
    /// These rows with only the columns at `indices` (`None`: all), the bad rows as they are.
    fn project(self, indices: Option<&[usize]>) -> std::result::Result<DecodedRows, String> {
        let Some(indices) = indices else {
            return Ok(self);
        };
        let batch = self.batch.project(indices).map_err(|e| e.to_string())?;
        Ok(DecodedRows {
            batch,
            bad_rows: self.bad_rows,
        })
    }
}

impl From<RecordBatch> for DecodedRows {
    fn from(batch: RecordBatch) -> Self {
        DecodedRows {
            batch,
            bad_rows: Vec::new(),
        }
    }
}

/// Lines decoded together: a file becomes batches of at most this many rows, so a decoder's
/// working memory stays small whatever the file's size.
pub(crate) const DECODE_ROWS: usize = 8192;

/// Decodes `lines` in runs of [`DECODE_ROWS`], the runs in parallel (rayon), splitting a run in
/// halves around failures until each bad line is alone. Returns decoded batches with their line
/// numbers, in file order, and the bad lines, in file order. The reference the sorted decodes
/// ([`decode_json_lines`], [`decode_csv_lines`]) are tested against.
#[cfg(test)]
pub(crate) fn decode_lines(
    bytes: &[u8],
    lines: &[Line],
    decode: impl Fn(&[Line]) -> std::result::Result<DecodedRows, String> + Sync,
) -> Decoded {
    let runs: Vec<Decoded> = lines
        .par_chunks(DECODE_ROWS)
        .map(|run| decode_run(bytes, run, &decode))
        .collect();
    concat_runs(runs)
}

fn concat_runs(runs: Vec<Decoded>) -> Decoded {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (run_good, run_bad) in runs {
        good.extend(run_good);
        bad.extend(run_bad);
    }
    (good, bad)
}

/// The indices of `schema`'s columns named in `columns`, in the schema's order; `None` (no
/// projection) where `columns` is `None`. What a narrowed read keeps of the rows it decodes.
pub(crate) fn kept_columns(schema: &SchemaRef, columns: Option<&[String]>) -> Option<Vec<usize>> {
    let fields = schema.fields();
    columns.map(|columns| {
        (0..fields.len())
            .filter(|&i| columns.contains(fields[i].name()))
            .collect()
    })
}

/// JSON `lines` of `bytes` decoded into `schema` (see [`decode_json_rows`] for `strict`), as
/// `decode_lines` does, but a bad line costs about what a line costs: each run's lines are
/// sorted by [`is_one_json_object`], those that pass decoded together, the others one by one.
/// Where the schema decodes to text columns only, each run's flat objects are read first by
/// [`FlatJson`] in one pass, and only the lines it declines are sorted and decoded so.
/// The result is the same as `decode_lines` over [`decode_json_rows`] gives: the same rows,
/// the same bad lines, the same reasons.
///
/// `columns`: the rows keep only these data columns (in `schema`'s order; `None`: all), with
/// the same bad lines and reasons as when every column is kept — a line is still read whole,
/// and the number, boolean and timestamp columns not kept still converted, as a value that does
/// not convert fails its line. What is saved is the text columns not kept: the flat reader
/// steps over their values instead of copying them.
pub(crate) fn decode_json_lines(
    schema: &SchemaRef,
    columns: Option<&[String]>,
    bytes: &[u8],
    lines: &[Line],
    strict: bool,
) -> Decoded {
    let decode_schema = text_schema(schema);
    let fields = schema.fields();
    // The columns kept, and the ones the flat reader builds: those kept, and those not kept
    // that are converted from text (their bad values fail lines).
    let kept = kept_columns(schema, columns);
    let built: Option<Vec<usize>> = kept.as_ref().map(|kept| {
        (0..fields.len())
            .filter(|i| kept.contains(i) || converted_from_text(fields[*i].data_type()))
            .collect()
    });
    let passes = is_one_json_object;
    // Lines that passed the check are within the depth limit already.
    let decode_passed = |chunk: &[Line]| {
        decode_json_parsed(schema, &decode_schema, bytes, chunk, strict)?.project(kept.as_deref())
    };
    let decode_alone = |chunk: &[Line]| {
        for l in chunk {
            check_depth(&bytes[l.start..l.end])?;
        }
        decode_json_parsed(schema, &decode_schema, bytes, chunk, strict)?.project(kept.as_deref())
    };
    let Some(flat) = FlatJson::new(schema, strict, built.clone()) else {
        return decode_sorted(bytes, lines, passes, decode_passed, decode_alone);
    };
    // Where the kept columns sit among the flat reader's.
    let kept_of_built: Option<Vec<usize>> =
        built.as_ref().zip(kept.as_ref()).map(|(built, kept)| {
            (0..built.len())
                .filter(|&at| kept.contains(&built[at]))
                .collect()
        });
    let runs: Vec<Decoded> = lines
        .par_chunks(DECODE_ROWS)
        .map(|run| {
            let flat_read = flat.read(bytes, run).and_then(|r| match &kept_of_built {
                None => Ok(r),
                Some(kept) => {
                    let batch = r.batch.project(kept).map_err(|e| e.to_string())?;
                    Ok(FlatRead { batch, ..r })
                }
            });
            let FlatRead {
                batch,
                read,
                bad,
                declined,
            } = match flat_read {
                Ok(flat_read) => flat_read,
                Err(error) => {
                    // The conversion failed as a whole (as it would for any lines): the
                    // decoder's path gives each line its reason.
                    tracing::debug!(
                        %error,
                        lines = run.len(),
                        "the one-pass JSON reader left a run to the decoder"
                    );
                    return decode_sorted_run(bytes, run, &passes, &decode_passed, &decode_alone);
                }
            };
            let numbers = read.iter().map(|l| l.number).collect();
            let mut bad: Vec<_> = bad
                .into_iter()
                .map(|(l, reason)| (l.number, bytes[l.start..l.end].to_vec(), reason))
                .collect();
            let (others, others_bad) =
                decode_sorted_run(bytes, &declined, &passes, &decode_passed, &decode_alone);
            let good = merge_pieces(vec![(batch, numbers)], others);
            if !others_bad.is_empty() {
                bad.extend(others_bad);
                bad.sort_by_key(|(number, _, _)| *number);
            }
            (good, bad)
        })
        .collect();
    concat_runs(runs)
}

/// CSV `lines` of `bytes` decoded into `schema` as [`decode_json_lines`] decodes JSON: lines
/// sorted by [`is_one_csv_record`] first. The same result as `decode_lines` over
/// [`decode_csv`] gives.
pub(crate) fn decode_csv_lines(
    schema: &SchemaRef,
    delimiter: u8,
    bytes: &[u8],
    lines: &[Line],
) -> Decoded {
    let fields = schema.fields().len();
    let decode_schema = top_level_as_text(schema);
    decode_sorted(
        bytes,
        lines,
        |line| is_one_csv_record(line, delimiter, fields),
        // Lines that passed the check are one record each already.
        |chunk| decode_csv_shaped(schema, &decode_schema, delimiter, bytes, chunk),
        |chunk| decode_csv(schema, delimiter, bytes, chunk),
    )
}

/// The data lines of a CSV file (`header`: it starts with a header line) decoded into `schema`
/// (`declared`: by the job, else inferred).
///
/// A header that names every column of the schema once ([`match_names`]: exactly, else trimmed
/// and ignoring ASCII case), in another order or with others besides — files from another
/// producer, or another version of it — is read by name (under an inferred schema, not a
/// header of only numbers and booleans: [`holds_data`]). A column the schema lacks is then
/// ignored under a declared schema (the job chose its columns, as a JSON record's other fields
/// are ignored); an inferred schema, which a CSV source never grows, makes the file's lines
/// dead letters naming it, kept whole rather than losing the field. Any other header is read
/// by position, as a file without one: a declared schema may name the columns itself, and a
/// file without a header read with `header = true` has data there — unless a column the header
/// names sits at another position than the schema's (a column renamed and others reordered):
/// then neither way places the fields, and every line is a dead letter saying so, rather than
/// values landing in each other's columns.
pub(crate) fn decode_csv_file(
    schema: &SchemaRef,
    delimiter: u8,
    bytes: &[u8],
    header: bool,
    declared: bool,
) -> Decoded {
    let lines = data_lines(bytes, header);
    let names = if header {
        csv_header(bytes, delimiter)
    } else {
        None
    };
    match names.map(|names| csv_layout(schema, &names, declared)) {
        None | Some(Ok(CsvLayout::AsSchema)) => decode_csv_lines(schema, delimiter, bytes, &lines),
        Some(Ok(CsvLayout::ByName { file_schema, from })) => {
            let (good, bad) = decode_csv_lines(&file_schema, delimiter, bytes, &lines);
            let mut conformed = Vec::with_capacity(good.len());
            for (batch, numbers) in good {
                let columns = from.iter().map(|i| Arc::clone(batch.column(*i))).collect();
                match RecordBatch::try_new(Arc::clone(schema), columns) {
                    Ok(batch) => conformed.push((batch, numbers)),
                    // Not expected (each column decoded as the schema's): kept as dead letters.
                    Err(e) => {
                        return every_line_bad(bytes, &lines, &format!("CSV error: {e}"));
                    }
                }
            }
            (conformed, bad)
        }
        Some(Err(reason)) => every_line_bad(bytes, &lines, &reason),
    }
}

/// How a CSV file's header lays out the schema's columns ([`decode_csv_file`]).
#[derive(Debug, PartialEq)]
enum CsvLayout {
    /// The schema's columns by position.
    AsSchema,
    /// By name: the file's columns in header order (each typed as the schema's column it
    /// names; one it does not name as text, decoded and dropped), and for each schema column
    /// the file column holding it.
    ByName {
        file_schema: SchemaRef,
        from: Vec<usize>,
    },
}

/// The column names of a CSV file's header line ([`header_line`]; not UTF-8: lossily), or
/// `None` if it has none or it does not parse.
fn csv_header(bytes: &[u8], delimiter: u8) -> Option<Vec<String>> {
    let header = header_line(bytes)?;
    let line = without_bom(&bytes[header.start..header.end]);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .delimiter(delimiter)
        .from_reader(line);
    let record = reader.byte_records().next()?.ok()?;
    Some(header_names(&record))
}

/// A CSV header's names: lossily UTF-8, without byte order marks starting the first, and
/// without empty names ending it (a delimiter ending the line names no column).
pub(crate) fn header_names(record: &csv::ByteRecord) -> Vec<String> {
    let mut names: Vec<String> = record
        .iter()
        .map(|name| String::from_utf8_lossy(name).into_owned())
        .collect();
    if let Some(first) = names.first_mut() {
        *first = first.trim_start_matches('\u{feff}').to_string();
    }
    while names.last().is_some_and(String::is_empty) {
        names.pop();
    }
    names
}

/// `header` with the fields beyond it that inference named `column_N` (every line one field
/// wider than its header, as with a delimiter ending each line): the schema's columns from the
/// header's width on, while they are named so.
fn with_unnamed_fields(header: &[String], columns: &[&str]) -> Vec<String> {
    let mut names = header.to_vec();
    while let Some(column) = columns.get(names.len()) {
        if *column != format!("column_{}", names.len() + 1) {
            break;
        }
        names.push((*column).to_string());
    }
    names
}

/// Where `header`'s columns go in `schema` (see [`decode_csv_file`]); `Err`: why no line of the
/// file can be read.
fn csv_layout(
    schema: &SchemaRef,
    header: &[String],
    declared: bool,
) -> std::result::Result<CsvLayout, String> {
    let fields = schema.fields();
    if header.len() == fields.len() && header.iter().zip(fields.iter()).all(|(h, f)| h == f.name())
    {
        return Ok(CsvLayout::AsSchema);
    }
    let columns: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
    match header_reading(&columns, header, declared) {
        HeaderReading::ByName {
            header,
            of_header,
            from,
        } => {
            let mut file_fields = Vec::with_capacity(header.len());
            for (name, field) in header.iter().zip(&of_header) {
                match field {
                    Some(i) => file_fields.push(Arc::clone(&fields[*i])),
                    None if declared => {
                        file_fields.push(Arc::new(Field::new(name, DataType::Utf8, true)));
                    }
                    None => {
                        return Err(format!(
                            "CSV error: the file's header has the column {name:?}, which the \
                             source's inferred schema lacks (a CSV source keeps the schema it \
                             inferred; declare the schema to read such files, without the \
                             columns it leaves out)"
                        ));
                    }
                }
            }
            Ok(CsvLayout::ByName {
                file_schema: Arc::new(Schema::new(file_fields)),
                from,
            })
        }
        HeaderReading::ByPosition {
            misplaced: Some((at, i)),
        } => Err(format!(
            "CSV error: the file's header has the column {} as field {} (the schema's field {}) \
             but does not name every column once: its fields can be placed neither by name nor \
             by position",
            columns[i],
            at + 1,
            i + 1,
        )),
        HeaderReading::ByPosition { misplaced: None } => Ok(CsvLayout::AsSchema),
    }
}

/// How a CSV header is read against `columns` (the schema's, or inference's so far; `declared`:
/// chosen by the job): the one decision [`decode_csv_file`] and inference share.
pub(crate) enum HeaderReading {
    /// By name: the header (with the inferred `column_N` fields past it,
    /// [`with_unnamed_fields`]), each of its fields' column (`None`: one the columns lack), and
    /// each column's field.
    ByName {
        header: Vec<String>,
        of_header: Vec<Option<usize>>,
        from: Vec<usize>,
    },
    /// By position; `misplaced`: a field the header names a column by, at another position
    /// than the column's (the field, the column).
    ByPosition { misplaced: Option<(usize, usize)> },
}

/// By name when `header` names every column once ([`match_names`]) — under an inferred schema,
/// not when it holds only data ([`holds_data`]: an inferred schema's names come from headers,
/// which a file's first line of data may repeat; a declared schema's were chosen) — else by
/// position.
pub(crate) fn header_reading(columns: &[&str], header: &[String], declared: bool) -> HeaderReading {
    if !declared && holds_data(header) {
        return HeaderReading::ByPosition { misplaced: None };
    }
    let header = with_unnamed_fields(header, columns);
    let NamesMatched {
        from,
        of_header,
        repeats,
    } = match_names(columns, &header);
    if let Some(from) = from
        .iter()
        .copied()
        .collect::<Option<Vec<usize>>>()
        .filter(|_| !repeats)
    {
        return HeaderReading::ByName {
            header,
            of_header,
            from,
        };
    }
    let misplaced = of_header
        .iter()
        .enumerate()
        .find_map(|(at, field)| field.filter(|i| *i != at).map(|i| (at, i)));
    HeaderReading::ByPosition { misplaced }
}

/// Where the columns are in a header ([`match_names`]).
struct NamesMatched {
    /// Each column's header field (its first, if named twice).
    from: Vec<Option<usize>>,
    /// Each header field's column.
    of_header: Vec<Option<usize>>,
    /// Whether the header names a column twice exactly: not a header to read by name.
    repeats: bool,
}

/// Whether a header holds only numbers, booleans and empty names: the first line of a file
/// without a header, read with `header = true` — never names to read an inferred schema by.
fn holds_data(header: &[String]) -> bool {
    header.iter().all(|name| {
        let name = name.trim();
        name.is_empty()
            || name.parse::<f64>().is_ok()
            || name.eq_ignore_ascii_case("true")
            || name.eq_ignore_ascii_case("false")
    })
}

/// Header names matched to column names: exactly first, then trimmed and ignoring ASCII case
/// where exactly one column not yet matched fits.
fn match_names(columns: &[&str], header: &[String]) -> NamesMatched {
    let mut from = vec![None; columns.len()];
    let mut of_header = vec![None; header.len()];
    let mut repeats = false;
    for (at, name) in header.iter().enumerate() {
        if let Some(i) = columns.iter().position(|c| c == name) {
            if from[i].is_some() {
                repeats = true;
                continue;
            }
            from[i] = Some(at);
            of_header[at] = Some(i);
        }
    }
    let loose = |name: &str| name.trim().to_ascii_lowercase();
    let loose_columns: Vec<String> = columns.iter().map(|c| loose(c)).collect();
    for (at, name) in header.iter().enumerate() {
        if of_header[at].is_some() {
            continue;
        }
        let name = loose(name);
        let mut like =
            (0..columns.len()).filter(|i| from[*i].is_none() && loose_columns[*i] == name);
        if let (Some(i), None) = (like.next(), like.next()) {
            from[i] = Some(at);
            of_header[at] = Some(i);
        }
    }
    NamesMatched {
        from,
        of_header,
        repeats,
    }
}

/// Every one of `lines` a dead letter for `reason`.
fn every_line_bad(bytes: &[u8], lines: &[Line], reason: &str) -> Decoded {
    let bad = lines
        .iter()
        .map(|l| (l.number, bytes[l.start..l.end].to_vec(), reason.to_string()))
        .collect();
    (Vec::new(), bad)
}

/// Each run of [`DECODE_ROWS`] `lines` (in parallel) decoded by [`decode_sorted_run`].
fn decode_sorted(
    bytes: &[u8],
    lines: &[Line],
    passes: impl Fn(&[u8]) -> bool + Sync,
    decode_passed: impl Fn(&[Line]) -> std::result::Result<DecodedRows, String> + Sync,
    decode_alone: impl Fn(&[Line]) -> std::result::Result<DecodedRows, String> + Sync,
) -> Decoded {
    let runs: Vec<Decoded> = lines
        .par_chunks(DECODE_ROWS)
        .map(|run| decode_sorted_run(bytes, run, &passes, &decode_passed, &decode_alone))
        .collect();
    concat_runs(runs)
}

/// `run` (lines in order) sorted by `passes`: the lines that pass decoded together by
/// `decode_passed`, the others one by one by `decode_alone`, then put back in line order.
/// Failures of whole chunks are still halved ([`decode_run`]).
fn decode_sorted_run(
    bytes: &[u8],
    run: &[Line],
    passes: &impl Fn(&[u8]) -> bool,
    decode_passed: &impl Fn(&[Line]) -> std::result::Result<DecodedRows, String>,
    decode_alone: &impl Fn(&[Line]) -> std::result::Result<DecodedRows, String>,
) -> Decoded {
    let (passed, others): (Vec<Line>, Vec<Line>) =
        run.iter().partition(|l| passes(&bytes[l.start..l.end]));
    let (good, mut bad) = decode_run(bytes, &passed, decode_passed);
    if others.is_empty() {
        return (good, bad);
    }
    let mut alone = Vec::new();
    for line in &others {
        let (line_good, line_bad) = decode_run(bytes, std::slice::from_ref(line), decode_alone);
        alone.extend(line_good);
        bad.extend(line_bad);
    }
    bad.sort_by_key(|(number, _, _)| *number);
    (merge_pieces(good, alone), bad)
}

/// Two lists of batches with their line numbers, each in line order, merged into one in line
/// order, slicing a batch where rows of the other fall inside it (pieces without rows dropped).
fn merge_pieces(
    a: Vec<(RecordBatch, Vec<usize>)>,
    b: Vec<(RecordBatch, Vec<usize>)>,
) -> Vec<(RecordBatch, Vec<usize>)> {
    let mut out = Vec::with_capacity(a.len() + 2 * b.len());
    let (mut a, mut b) = (Pieces::new(a), Pieces::new(b));
    loop {
        let piece = match (a.next_number(), b.next_number()) {
            (None, None) => return out,
            (Some(_), None) => a.take_below(usize::MAX),
            (None, Some(_)) => b.take_below(usize::MAX),
            (Some(x), Some(y)) if x < y => a.take_below(y),
            (Some(x), Some(_)) => b.take_below(x),
        };
        out.extend(piece);
    }
}

/// Batches with their line numbers, in line order, taken from the front.
struct Pieces {
    rest: std::vec::IntoIter<(RecordBatch, Vec<usize>)>,
    /// The piece being taken from, and how many of its rows are taken already.
    current: Option<(RecordBatch, Vec<usize>, usize)>,
}

impl Pieces {
    fn new(pieces: Vec<(RecordBatch, Vec<usize>)>) -> Self {
        let mut pieces = Pieces {
            rest: pieces.into_iter(),
            current: None,
        };
        pieces.advance();
        pieces
    }

    /// Starts taking from the next piece that has rows.
    fn advance(&mut self) {
        self.current = self
            .rest
            .find(|(_, numbers)| !numbers.is_empty())
            .map(|(batch, numbers)| (batch, numbers, 0));
    }

    /// The line number of the next row.
    fn next_number(&self) -> Option<usize> {
        self.current
            .as_ref()
            .map(|(_, numbers, from)| numbers[*from])
    }

    /// The next rows of the current piece whose line numbers are below `limit` (at least one),
    /// if any are left.
    fn take_below(&mut self, limit: usize) -> Option<(RecordBatch, Vec<usize>)> {
        let (batch, numbers, from) = self.current.take()?;
        let to = (from + 1).max(from + numbers[from..].partition_point(|n| *n < limit));
        if from == 0 && to == numbers.len() {
            self.advance();
            return Some((batch, numbers));
        }
        let piece = (batch.slice(from, to - from), numbers[from..to].to_vec());
        match to < numbers.len() {
            true => self.current = Some((batch, numbers, to)),
            false => self.advance(),
        }
        Some(piece)
    }
}

/// `decode_lines` of one run, split in halves around failures.
fn decode_run(
    bytes: &[u8],
    lines: &[Line],
    decode: &impl Fn(&[Line]) -> std::result::Result<DecodedRows, String>,
) -> Decoded {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    let mut pending: Vec<(usize, usize)> = vec![(0, lines.len())];
    while let Some((from, to)) = pending.pop() {
        if from == to {
            continue;
        }
        let chunk = &lines[from..to];
        match decode(chunk).and_then(|rows| drop_bad_rows(bytes, chunk, rows)) {
            Ok((batch, numbers, chunk_bad)) => {
                if !numbers.is_empty() {
                    good.push((batch, numbers));
                }
                bad.extend(chunk_bad);
            }
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

/// The rows of `chunk` decoded as `rows`, without its bad rows: the batch, the line numbers of
/// its rows, and the bad lines.
#[allow(clippy::type_complexity)]
fn drop_bad_rows(
    bytes: &[u8],
    chunk: &[Line],
    rows: DecodedRows,
) -> std::result::Result<(RecordBatch, Vec<usize>, Vec<(usize, Vec<u8>, String)>), String> {
    let DecodedRows { batch, bad_rows } = rows;
    if batch.num_rows() != chunk.len() {
        return Err(format!(
            "expected one record per line, the line holds {}",
            batch.num_rows()
        ));
    }
    if bad_rows.is_empty() {
        return Ok((batch, chunk.iter().map(|l| l.number).collect(), Vec::new()));
    }
    let mut keep = vec![true; chunk.len()];
    let mut bad = Vec::with_capacity(bad_rows.len());
    for (row, reason) in bad_rows {
        let l = chunk[row];
        keep[row] = false;
        bad.push((l.number, bytes[l.start..l.end].to_vec(), reason));
    }
    let numbers = chunk
        .iter()
        .zip(&keep)
        .filter_map(|(l, keep)| keep.then_some(l.number))
        .collect();
    let batch = arrow::compute::filter_record_batch(&batch, &BooleanArray::from(keep))
        .map_err(|e| e.to_string())?;
    Ok((batch, numbers, bad))
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

/// Whether `line` is one JSON object and nothing else, nesting at most [`MAX_JSON_DEPTH`] deep,
/// in UTF-8 — one pass over its bytes, to sort lines before decoding ([`decode_json_lines`]).
///
/// The grammar is the Arrow decoder's, which is laxer than RFC 8259 in two ways: commas
/// between members and elements are optional (`{"a":1 "b":2}`), and a number is any run of
/// `0-9 + - . e E` after a digit or `-` (its column's conversion judges it). A line this passes,
/// the decoder reads; a line it stops, the decoder judges on its own.
pub(crate) fn is_one_json_object(line: &[u8]) -> bool {
    one_json_object(line).is_some()
}

fn one_json_object(line: &[u8]) -> Option<()> {
    simdutf8::basic::from_utf8(line).ok()?;
    let mut at = skip_whitespace(line, 0, false);
    (line.get(at) == Some(&b'{')).then_some(())?;
    // Bit `d` says whether the container at depth `d + 1` is an object (else a list).
    let mut objects: u128 = 0;
    let mut depth = 0usize;
    'value: loop {
        at = skip_whitespace(line, at, false);
        let first = *line.get(at)?;
        at += 1;
        match first {
            b'{' | b'[' => {
                (depth < MAX_JSON_DEPTH).then_some(())?;
                if first == b'{' {
                    objects |= 1 << depth;
                } else {
                    objects &= !(1 << depth);
                }
                depth += 1;
            }
            b'"' => at = string_end(line, at)?,
            b'-' | b'0'..=b'9' => {
                at += line[at..]
                    .iter()
                    .take_while(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                    .count();
            }
            b't' => at = literal_end(line, at, b"rue")?,
            b'f' => at = literal_end(line, at, b"alse")?,
            b'n' => at = literal_end(line, at, b"ull")?,
            _ => return None,
        }
        // After a value or an opening bracket: close containers, or start the next element.
        loop {
            if depth == 0 {
                return (skip_whitespace(line, at, false) == line.len()).then_some(());
            }
            at = skip_whitespace(line, at, true);
            let in_object = objects & (1 << (depth - 1)) != 0;
            match (*line.get(at)?, in_object) {
                (b'}', true) | (b']', false) => {
                    at += 1;
                    depth -= 1;
                }
                (b'"', true) => {
                    at = skip_whitespace(line, string_end(line, at + 1)?, false);
                    (line.get(at) == Some(&b':')).then_some(())?;
                    at += 1;
                    continue 'value;
                }
                (_, false) => continue 'value,
                (_, true) => return None,
            }
        }
    }
}

/// The index after JSON whitespace (and commas, if `commas`) from `at`.
pub(crate) fn skip_whitespace(line: &[u8], at: usize, commas: bool) -> usize {
    at + line[at.min(line.len())..]
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r') || commas && **b == b',')
        .count()
}

/// The index after `rest` at `at`, if it is there.
pub(crate) fn literal_end(line: &[u8], at: usize, rest: &[u8]) -> Option<usize> {
    (line.get(at..at + rest.len()) == Some(rest)).then_some(at + rest.len())
}

/// The index after the closing quote of the string whose text starts at `at`, if its escapes
/// are valid (a `\u` surrogate only as a high-low pair, as the Arrow decoder takes them).
fn string_end(line: &[u8], mut at: usize) -> Option<usize> {
    loop {
        at += memchr::memchr2(b'"', b'\\', line.get(at..)?)?;
        if line[at] == b'"' {
            return Some(at + 1);
        }
        at += 2;
        match *line.get(at - 1)? {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
            b'u' => at = unicode_escape(line, at)?.1,
            _ => return None,
        }
    }
}

/// The character of the `\u` escape whose hex digits start at `at` — a surrogate pair
/// (`\uD8xx\uDCxx`) as the one character it stands for — and the index after it; `None` where
/// Arrow's decoder refuses the escape (bad hex digits, a surrogate not in a high-low pair).
/// The escape grammar of [`string_end`], the flat reader's unescaping and
/// [`surrogate_pairs_as_utf8`].
pub(crate) fn unicode_escape(line: &[u8], at: usize) -> Option<(char, usize)> {
    let unit = hex4(line, at)?;
    if let Some(c) = char::from_u32(unit) {
        return Some((c, at + 4));
    }
    (line.get(at + 4..at + 6)? == b"\\u").then_some(())?;
    let low = hex4(line, at + 6)?;
    let pair = (0xD800..=0xDBFF).contains(&unit) && (0xDC00..=0xDFFF).contains(&low);
    pair.then_some(())?;
    let c = char::from_u32(0x1_0000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?;
    Some((c, at + 10))
}

/// The four hex digits at `at`, as a number.
fn hex4(line: &[u8], at: usize) -> Option<u32> {
    let digits = std::str::from_utf8(line.get(at..at + 4)?).ok()?;
    u32::from_str_radix(digits, 16)
        .ok()
        .filter(|_| digits.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Decodes JSON `lines` of `bytes` into `schema`, all or nothing: a line that fails fails the
/// call, with its reason. See [`decode_json_rows`].
pub(crate) fn decode_json(
    schema: &SchemaRef,
    bytes: &[u8],
    lines: &[Line],
    strict: bool,
) -> std::result::Result<RecordBatch, String> {
    let mut rows = decode_json_rows(schema, bytes, lines, strict)?;
    match rows.bad_rows.is_empty() {
        true => Ok(rows.batch),
        false => Err(rows.bad_rows.swap_remove(0).1),
    }
}

/// Decodes JSON `lines` of `bytes` into `schema`, one row per line. `strict`: a record with a
/// field the schema lacks fails (schema evolution looks at it); else such fields are ignored.
/// A text column takes numbers and booleans as their JSON text. A value that does not fit a
/// top-level number, boolean or timestamp column fails its own line
/// ([`DecodedRows::bad_rows`]); any other failure fails the call.
///
/// Number and timestamp columns take what the Arrow decoder takes — a number, or a string
/// holding one (`"12.5"`), a timestamp as RFC 3339-like text (in the column's zone where it
/// names none) or a number of the column's unit — and also a quoted number for a timestamp
/// (`"1700000000"`) and a quoted `"true"`/`"false"` for a boolean. An integer column (also in
/// a struct or a list) takes only whole numbers: Arrow alone would read `12.75` as 12. A
/// top-level Float32 or Float64 column refuses a number beyond its range ([`in_range`]), which
/// Arrow would make infinity.
pub(crate) fn decode_json_rows(
    schema: &SchemaRef,
    bytes: &[u8],
    lines: &[Line],
    strict: bool,
) -> std::result::Result<DecodedRows, String> {
    for l in lines {
        check_depth(&bytes[l.start..l.end])?;
    }
    decode_json_parsed(schema, &text_schema(schema), bytes, lines, strict)
}

/// [`decode_json_rows`] of lines whose depth has been checked; `decode_schema` is
/// [`text_schema`] of `schema`.
fn decode_json_parsed(
    schema: &SchemaRef,
    decode_schema: &SchemaRef,
    bytes: &[u8],
    lines: &[Line],
    strict: bool,
) -> std::result::Result<DecodedRows, String> {
    let mut decoder = arrow::json::ReaderBuilder::new(Arc::clone(decode_schema))
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
        let line = &bytes[l.start..l.end];
        match surrogate_pairs_as_utf8(line) {
            Some(mended) => feed(&mut decoder, &mended)?,
            None => feed(&mut decoder, line)?,
        }
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
        .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(decode_schema)));
    typed_rows(batch, schema)
}

/// `line` with each `\uD8xx\uDCxx` surrogate pair in its strings written as the UTF-8 of the
/// character it stands for, or `None` if it has none before the first escape the decoder
/// refuses (most lines have no backslash at all: one `memchr` tells).
///
/// Arrow's JSON decoder (arrow-json 59) ORs 0x1_0000 into a pair's code point where it should
/// add it, so for half the high surrogates (those with bit 0x40 of `high - 0xD800` set:
/// U+20000–U+2FFFF among them, e.g. `"\ud842\udfb7"`, 𠮷 as Python's `json.dumps` writes it)
/// it yields another character (U+10BB7). A pair and the UTF-8 of its character are the same
/// JSON string, so the decoder is handed the latter. The scan stops at the first escape the
/// decoder refuses (a backslash outside a string, an unknown letter, bad hex digits, a
/// surrogate not in a high-low pair), leaving the rest as it is: the decoder fails there, with
/// the reason it gives the original line. The raw line kept for a dead letter is the original.
fn surrogate_pairs_as_utf8(line: &[u8]) -> Option<Vec<u8>> {
    memchr::memchr(b'\\', line)?;
    let mut mended: Option<Vec<u8>> = None;
    let (mut copied, mut at, mut in_string) = (0, 0, false);
    while let Some(found) = memchr::memchr2(b'"', b'\\', line.get(at..).unwrap_or_default()) {
        let i = at + found;
        if line[i] == b'"' {
            in_string = !in_string;
            at = i + 1;
            continue;
        }
        // An escape: a backslash (in a string) and the letter after it.
        match (in_string, line.get(i + 1)) {
            (true, Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't')) => {
                at = i + 2;
                continue;
            }
            (true, Some(b'u')) => {}
            _ => break,
        }
        let Some((c, end)) = unicode_escape(line, i + 2) else {
            break;
        };
        at = end;
        if end - i == 12 {
            // A pair (twelve bytes; one `\uXXXX` is six).
            let out = mended.get_or_insert_with(|| Vec::with_capacity(line.len()));
            out.extend_from_slice(&line[copied..i]);
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
            copied = end;
        }
    }
    let mut out = mended?;
    out.extend_from_slice(&line[copied..]);
    Some(out)
}

/// Whether a top-level column of type `t` is decoded as text and converted from it (by
/// [`typed_rows`], or by [`FlatJson`] as it reads), so its bad values are found per row:
/// numbers, booleans, timestamps.
pub(crate) fn converted_from_text(t: &DataType) -> bool {
    t.is_integer() || t.is_floating() || matches!(t, DataType::Boolean | DataType::Timestamp(_, _))
}

/// `schema` as decoded: its top-level number, boolean and timestamp columns, and the integers nested in
/// structs and lists, as text, for [`typed_rows`].
pub(crate) fn text_schema(schema: &SchemaRef) -> SchemaRef {
    with_text_columns(schema, as_text_field)
}

/// `schema` with its top-level number, boolean and timestamp columns as text (CSV's numbers are
/// never nested).
fn top_level_as_text(schema: &SchemaRef) -> SchemaRef {
    with_text_columns(schema, Field::clone)
}

/// `schema` with its top-level number, boolean and timestamp columns as nullable text (a missing
/// value in a NOT NULL one fails its row, not the batch), its other columns as `other` makes them.
fn with_text_columns(schema: &SchemaRef, other: impl Fn(&Field) -> Field) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            t if converted_from_text(t) => f
                .as_ref()
                .clone()
                .with_data_type(DataType::Utf8)
                .with_nullable(true),
            _ => other(f),
        })
        .collect();
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

/// `batch` (decoded with [`text_schema`]) in `schema`. A top-level value that does not convert
/// fails its row (the first such column in schema order gives the reason); a nested integer that
/// does not fails the batch (and so decides the reason of a line it is on).
fn typed_rows(batch: RecordBatch, schema: &SchemaRef) -> std::result::Result<DecodedRows, String> {
    if batch.schema() == *schema {
        return Ok(batch.into());
    }
    let mut bad_rows = Vec::new();
    let mut columns = Vec::with_capacity(schema.fields().len());
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        columns.push(match field.data_type() {
            t if converted_from_text(t) => {
                convert_column(column.as_string::<i32>(), field, &mut bad_rows)?
            }
            _ => as_integers(column, field)?,
        });
    }
    rows_of(schema, columns, batch.num_rows(), bad_rows)
}

/// The rows of `columns` in `schema`, with `bad_rows` (in column order) reduced to one reason per
/// row: its first bad column's.
fn rows_of(
    schema: &SchemaRef,
    columns: Vec<ArrayRef>,
    rows: usize,
    mut bad_rows: Vec<(usize, String)>,
) -> std::result::Result<DecodedRows, String> {
    bad_rows.sort_by_key(|(row, _)| *row);
    bad_rows.dedup_by_key(|(row, _)| *row);
    let batch = RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(rows)),
    )
    .map_err(|e| e.to_string())?;
    Ok(DecodedRows { batch, bad_rows })
}

/// The zone of a timestamp column: its own, else UTC.
fn zone(tz: Option<&str>) -> std::result::Result<arrow::array::timezone::Tz, String> {
    tz.unwrap_or("+00:00")
        .parse()
        .map_err(|e: arrow::error::ArrowError| e.to_string())
}

/// A top-level number, boolean or timestamp column from its text; a value that does not convert
/// has its row and reason added to `bad_rows`.
fn convert_column(
    text: &StringArray,
    field: &Field,
    bad_rows: &mut Vec<(usize, String)>,
) -> std::result::Result<ArrayRef, String> {
    let converting = json_from_text(field, text.len())?;
    Ok(convert_all(converting, text, bad_rows))
}

/// `text`'s values, in order, through `converting`.
fn convert_all(
    mut converting: Box<dyn FromText>,
    text: &StringArray,
    bad_rows: &mut Vec<(usize, String)>,
) -> ArrayRef {
    for (row, value) in text.iter().enumerate() {
        if let Err(reason) = converting.append(value) {
            bad_rows.push((row, reason));
            converting.append_default();
        }
    }
    converting.finish()
}

/// A number, boolean or timestamp column built from its values' text one value at a time. A
/// value that does not convert appends nothing and gives its reason: [`convert_all`] then puts
/// the type's default in its place (its row is to be dropped; a null would break a NOT NULL
/// column), while [`FlatJson`], which builds such columns as it reads lines, takes back the
/// line's values in the other columns ([`FromText::truncate`]) so a bad line never enters the
/// batch — no filter copies the rows around it.
pub(crate) trait FromText {
    /// Appends a value converted from `text` (`None`: null or absent); if it does not convert
    /// (or is absent from a NOT NULL column), appends nothing and gives the reason.
    fn append(&mut self, text: Option<&str>) -> std::result::Result<(), String>;

    /// Appends the type's default value: the place of a bad value in a row to be dropped.
    fn append_default(&mut self);

    /// Keeps the first `len` values only.
    fn truncate(&mut self, len: usize);

    /// The column of the values appended so far (the builder starts again empty).
    fn finish(&mut self) -> ArrayRef;
}

/// A JSON top-level number, boolean or timestamp column of `field`'s type built from text
/// ([`FromText`]), with room for `capacity` values. Converted as the Arrow JSON decoder converts
/// (see [`decode_json_rows`]).
///
/// # Errors
/// If the type is not converted from text, or the column's time zone does not parse.
pub(crate) fn json_from_text(
    field: &Field,
    capacity: usize,
) -> std::result::Result<Box<dyn FromText>, String> {
    use arrow::datatypes::{
        Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
        UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    let c = capacity;
    Ok(match field.data_type() {
        DataType::Int8 => parsed::<Int8Type>(field, c, whole::<Int8Type>),
        DataType::Int16 => parsed::<Int16Type>(field, c, whole::<Int16Type>),
        DataType::Int32 => parsed::<Int32Type>(field, c, whole::<Int32Type>),
        DataType::Int64 => parsed::<Int64Type>(field, c, whole::<Int64Type>),
        DataType::UInt8 => parsed::<UInt8Type>(field, c, whole::<UInt8Type>),
        DataType::UInt16 => parsed::<UInt16Type>(field, c, whole::<UInt16Type>),
        DataType::UInt32 => parsed::<UInt32Type>(field, c, whole::<UInt32Type>),
        DataType::UInt64 => parsed::<UInt64Type>(field, c, whole::<UInt64Type>),
        DataType::Float16 => parsed::<Float16Type>(field, c, float::<Float16Type>),
        DataType::Float32 => parsed::<Float32Type>(
            field,
            c,
            in_range(float::<Float32Type>, f32::is_finite, "Json error"),
        ),
        DataType::Float64 => parsed::<Float64Type>(
            field,
            c,
            in_range(float::<Float64Type>, f64::is_finite, "Json error"),
        ),
        DataType::Boolean => booleans(field, c, |value, field| match value {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!(
                "Json error: whilst decoding field '{}': expected boolean got {value}",
                field.name()
            )),
        }),
        DataType::Timestamp(unit, tz) => {
            let utc = tz.as_deref().is_none_or(|tz| tz == "+00:00" || tz == "UTC");
            let (tz, unit) = (zone(tz.as_deref())?, *unit);
            timestamps(field, c, unit, move |v, f| {
                match utc.then(|| plain_utc_timestamp(v, unit)).flatten() {
                    Some(units) => Ok(units),
                    None => timestamp(v, f, &tz, unit),
                }
            })
        }
        t => {
            return Err(format!(
                "column '{}': {t} is not converted from text",
                field.name()
            ));
        }
    })
}

/// A [`FromText`] column: its values and nulls kept apart, so the last ones can be taken back,
/// each value parsed by `parse`.
struct Parsed<V, P> {
    values: V,
    nulls: NullBufferBuilder,
    field: Field,
    parse: P,
}

/// Where a [`Parsed`] column keeps its values: natives in a `Vec`, booleans as bits.
trait Values {
    /// One value; its default stands where a value is null or bad.
    type Value: Default;
    fn push(&mut self, value: Self::Value);
    fn truncate(&mut self, len: usize);
    /// The column of the values kept so far (emptied), with `nulls`, of `field`'s type.
    fn finish(&mut self, nulls: Option<NullBuffer>, field: &Field) -> ArrayRef;
}

/// The values of a primitive column of type `T`.
struct Natives<T: ArrowPrimitiveType>(Vec<T::Native>);

impl<T: ArrowPrimitiveType> Values for Natives<T> {
    type Value = T::Native;

    fn push(&mut self, value: T::Native) {
        self.0.push(value);
    }

    fn truncate(&mut self, len: usize) {
        self.0.truncate(len);
    }

    fn finish(&mut self, nulls: Option<NullBuffer>, field: &Field) -> ArrayRef {
        let values = std::mem::take(&mut self.0);
        let array = PrimitiveArray::<T>::new(values.into(), nulls);
        Arc::new(array.with_data_type(field.data_type().clone()))
    }
}

impl Values for BooleanBufferBuilder {
    type Value = bool;

    fn push(&mut self, value: bool) {
        self.append(value);
    }

    fn truncate(&mut self, len: usize) {
        BooleanBufferBuilder::truncate(self, len);
    }

    fn finish(&mut self, nulls: Option<NullBuffer>, _field: &Field) -> ArrayRef {
        Arc::new(BooleanArray::new(BooleanBufferBuilder::finish(self), nulls))
    }
}

impl<V, P> FromText for Parsed<V, P>
where
    V: Values,
    P: Fn(&str, &Field) -> std::result::Result<V::Value, String>,
{
    fn append(&mut self, text: Option<&str>) -> std::result::Result<(), String> {
        match text {
            Some(value) => {
                let value = (self.parse)(value, &self.field)?;
                self.values.push(value);
                self.nulls.append_non_null();
            }
            None if self.field.is_nullable() => {
                self.values.push(V::Value::default());
                self.nulls.append_null();
            }
            None => return Err(not_null(&self.field)),
        }
        Ok(())
    }

    fn append_default(&mut self) {
        self.values.push(V::Value::default());
        self.nulls.append_non_null();
    }

    fn truncate(&mut self, len: usize) {
        self.values.truncate(len);
        self.nulls.truncate(len);
    }

    fn finish(&mut self) -> ArrayRef {
        self.values.finish(self.nulls.finish(), &self.field)
    }
}

/// A [`FromText`] column of `field`'s primitive type, each value parsed by `parse`.
fn parsed<T: ArrowPrimitiveType>(
    field: &Field,
    capacity: usize,
    parse: impl Fn(&str, &Field) -> std::result::Result<T::Native, String> + 'static,
) -> Box<dyn FromText> {
    Box::new(Parsed {
        values: Natives::<T>(Vec::with_capacity(capacity)),
        nulls: NullBufferBuilder::new(capacity),
        field: field.clone(),
        parse,
    })
}

/// A [`FromText`] column of booleans, each value parsed by `parse`.
fn booleans(
    field: &Field,
    capacity: usize,
    parse: impl Fn(&str, &Field) -> std::result::Result<bool, String> + 'static,
) -> Box<dyn FromText> {
    Box::new(Parsed {
        values: BooleanBufferBuilder::new(capacity),
        nulls: NullBufferBuilder::new(capacity),
        field: field.clone(),
        parse,
    })
}

/// The reason of a row with no value for NOT NULL `field`.
fn not_null(field: &Field) -> String {
    format!(
        "column '{}' is NOT NULL, and the record has no value for it",
        field.name()
    )
}

/// A whole number that fits `field` (`7`, `"7"`, `7.0`, `7e2`).
fn whole<T: ArrowPrimitiveType>(
    value: &str,
    field: &Field,
) -> std::result::Result<T::Native, String>
where
    T::Native: TryFrom<i128>,
{
    parse_whole(value)
        .and_then(|n| T::Native::try_from(n).ok())
        .ok_or_else(|| {
            format!(
                "Json error: {value} is not a whole number that fits column '{}' ({})",
                field.name(),
                field.data_type()
            )
        })
}

/// A floating-point number, parsed as the Arrow decoder parses it.
fn float<T: ArrowPrimitiveType + Parser>(
    value: &str,
    field: &Field,
) -> std::result::Result<T::Native, String> {
    T::parse(value).ok_or_else(|| {
        format!(
            "Json error: whilst decoding field '{}': failed to parse \"{value}\" as {}",
            field.name(),
            field.data_type()
        )
    })
}

/// `parse`, refusing a number too large for its float column (`1e400` in a DOUBLE, `1e39` in a
/// FLOAT), which parses as infinity: the value would change, not only lose precision. Text that
/// names infinity or NaN itself (`inf`, `NaN`: no digits) keeps its value.
fn in_range<N: Copy + 'static>(
    parse: impl Fn(&str, &Field) -> std::result::Result<N, String> + 'static,
    is_finite: fn(N) -> bool,
    error: &'static str,
) -> impl Fn(&str, &Field) -> std::result::Result<N, String> + 'static {
    move |value, field| {
        let number = parse(value, field)?;
        if !overflowed(value, is_finite(number)) {
            return Ok(number);
        }
        Err(format!(
            "{error}: {value} is beyond the range of column '{}' ({})",
            field.name(),
            field.data_type()
        ))
    }
}

/// Whether `text`, parsed to a value that is not `finite`, was a number too large for its type
/// (`1e400`) rather than text naming infinity or NaN (`inf`, `NaN`: no digits). Inference asks
/// the same, so it types a column as the decoder will read it.
pub(crate) fn overflowed(text: &str, finite: bool) -> bool {
    !finite && text.bytes().any(|b| b.is_ascii_digit())
}

/// A timestamp from RFC 3339-like text in `tz` (where it names no zone), or from a number of
/// the column's unit, as the Arrow decoder reads them — a number quoted too (`"1762000000"`).
fn timestamp(
    value: &str,
    field: &Field,
    tz: &arrow::array::timezone::Tz,
    unit: TimeUnit,
) -> std::result::Result<i64, String> {
    let error = |e: &dyn std::fmt::Display| {
        format!(
            "Json error: whilst decoding field '{}': failed to parse \"{value}\" as {}: {e}",
            field.name(),
            field.data_type()
        )
    };
    if is_json_number(value) {
        return value
            .parse::<i64>()
            .ok()
            .or_else(|| {
                let x = value.parse::<f64>().ok()?;
                // Whole units, truncated toward zero as the Arrow decoder does; out of range fails.
                (x.is_finite() && x.abs() < 9.2e18).then_some(x as i64)
            })
            .ok_or_else(|| error(&"not a number of the column's unit"));
    }
    let date = string_to_datetime(tz, value).map_err(|e| error(&e))?;
    in_unit(&date, unit).map_err(|e| error(&e))
}

/// A [`FromText`] timestamp column of `unit`, each value turned into a number of units by
/// `to_units` (JSON's and CSV's rules differ).
fn timestamps(
    field: &Field,
    capacity: usize,
    unit: TimeUnit,
    to_units: impl Fn(&str, &Field) -> std::result::Result<i64, String> + 'static,
) -> Box<dyn FromText> {
    use arrow::datatypes::{
        TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
        TimestampSecondType,
    };
    match unit {
        TimeUnit::Second => parsed::<TimestampSecondType>(field, capacity, to_units),
        TimeUnit::Millisecond => parsed::<TimestampMillisecondType>(field, capacity, to_units),
        TimeUnit::Microsecond => parsed::<TimestampMicrosecondType>(field, capacity, to_units),
        TimeUnit::Nanosecond => parsed::<TimestampNanosecondType>(field, capacity, to_units),
    }
}

/// `date` as a number of `unit` since the epoch, as Arrow's readers compute it.
fn in_unit(
    date: &chrono::DateTime<arrow::array::timezone::Tz>,
    unit: TimeUnit,
) -> std::result::Result<i64, String> {
    match unit {
        TimeUnit::Second => Ok(date.timestamp()),
        TimeUnit::Millisecond => Ok(date.timestamp_millis()),
        TimeUnit::Microsecond => Ok(date.timestamp_micros()),
        TimeUnit::Nanosecond => date.timestamp_nanos_opt().ok_or_else(|| {
            format!(
                "{} would overflow 64-bit signed nanoseconds",
                date.to_rfc3339()
            )
        }),
    }
}

/// Whether `text` is a JSON number: `-?digits(.digits)?([eE][+-]?digits)?` (leading zeros
/// allowed).
fn is_json_number(text: &str) -> bool {
    let digits = |s: &str| s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let rest = text.strip_prefix('-').unwrap_or(text);
    let whole = digits(rest);
    let mut rest = &rest[whole..];
    if whole == 0 {
        return false;
    }
    if let Some(fraction) = rest.strip_prefix('.') {
        let n = digits(fraction);
        if n == 0 {
            return false;
        }
        rest = &fraction[n..];
    }
    if let Some(exponent) = rest.strip_prefix(['e', 'E']) {
        let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
        let n = digits(exponent);
        return n > 0 && n == exponent.len();
    }
    rest.is_empty()
}

/// `array` (decoded with [`as_text_field`]) as `field`'s type; a nested integer that does not
/// fit fails the whole array.
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

/// A nested integer column from the text of its values, all or nothing.
fn whole_numbers<T: ArrowPrimitiveType>(
    text: &StringArray,
    field: &Field,
) -> std::result::Result<ArrayRef, String>
where
    T::Native: TryFrom<i128>,
{
    let array: PrimitiveArray<T> = text
        .iter()
        .map(|v| v.map(|v| whole::<T>(v, field)).transpose())
        .collect::<std::result::Result<_, String>>()?;
    Ok(Arc::new(array))
}

/// The whole number a JSON number's text denotes, exactly: `-12`, `7.0`, `7e2`, `1.5e1`;
/// `None` for a fraction (`12.75`, `1e-400`), or beyond ±10^38.
fn parse_whole(text: &str) -> Option<i128> {
    // Plain decimal digits, as most whole numbers are written: read in place.
    let (negative, digits) = match text.as_bytes() {
        [b'-', digits @ ..] => (true, digits),
        digits => (false, digits),
    };
    if (1..=18).contains(&digits.len()) {
        let n = digits.iter().try_fold(0i64, |n, d| {
            let d = d.wrapping_sub(b'0');
            (d < 10).then(|| n * 10 + i64::from(d))
        });
        if let Some(n) = n {
            return Some(i128::from(if negative { -n } else { n }));
        }
    }
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

/// Feeds all of `buf` to a JSON decoder.
pub(crate) fn feed(
    decoder: &mut arrow::json::reader::Decoder,
    buf: &[u8],
) -> std::result::Result<(), String> {
    feed_all(buf, |b| decoder.decode(b))
}

/// Feeds all of `buf` to a decoder's `decode`, which takes what it can each call.
fn feed_all(
    mut buf: &[u8],
    mut decode: impl FnMut(&[u8]) -> std::result::Result<usize, arrow::error::ArrowError>,
) -> std::result::Result<(), String> {
    while !buf.is_empty() {
        let used = decode(buf).map_err(|e| e.to_string())?;
        if used == 0 {
            return Err("the decoder made no progress".into());
        }
        buf = &buf[used..];
    }
    Ok(())
}

/// Whether `line` is one CSV record of `fields` fields in UTF-8 ([`csv_record_shape`]) — one
/// pass, to sort lines before decoding ([`decode_csv_lines`]).
pub(crate) fn is_one_csv_record(line: &[u8], delimiter: u8, fields: usize) -> bool {
    csv_record_shape(line, delimiter, fields).is_ok()
}

/// Checks that `line` is one CSV record of `fields` fields in UTF-8, split as Arrow's CSV reader
/// splits it: a quote opens a quoted field only at the field's start, `""` in one is a quote,
/// and a `\r` or `\n` outside quotes ends the record (only line breaks may follow it). Stricter
/// than the reader where it would drop bytes: text after a record's end.
fn csv_record_shape(line: &[u8], delimiter: u8, fields: usize) -> std::result::Result<(), String> {
    let line = without_bom(line);
    let line_break = |b: &u8| matches!(b, b'\r' | b'\n');
    // The reader skips line breaks before a record; a line of nothing else holds none.
    let Some(mut at) = line.iter().position(|b| !line_break(b)) else {
        return Err("CSV error: the line is empty".into());
    };
    let (mut count, mut field_start, mut quoted) = (1, true, false);
    while at < line.len() {
        let b = line[at];
        at += 1;
        if quoted {
            if b == b'"' {
                if line.get(at) == Some(&b'"') {
                    at += 1;
                } else {
                    quoted = false;
                }
            }
            continue;
        }
        if b == delimiter {
            count += 1;
            field_start = true;
            continue;
        }
        if line_break(&b) {
            if !line[at..].iter().all(line_break) {
                return Err(
                    "CSV error: a line break outside quotes ends the record, and more \
                            follows it on the line"
                        .into(),
                );
            }
            break;
        }
        quoted = b == b'"' && field_start;
        field_start = false;
    }
    if quoted {
        return Err("CSV error: a quoted field is not closed on its line".into());
    }
    if count != fields {
        return Err(format!(
            "CSV error: the line holds {count} fields; the schema has {fields}"
        ));
    }
    std::str::from_utf8(line)
        .map(|_| ())
        .map_err(|e| format!("CSV error: the line is not UTF-8: {e}"))
}

/// Decodes CSV `lines` of `bytes` into `schema`, one row per line. Number, boolean and
/// timestamp columns are read as text and converted here with the Arrow CSV reader's own
/// parsers (an empty field is null), so a value that does not fit fails its own line
/// ([`DecodedRows::bad_rows`]); any other failure fails the call.
pub(crate) fn decode_csv(
    schema: &SchemaRef,
    delimiter: u8,
    bytes: &[u8],
    lines: &[Line],
) -> std::result::Result<DecodedRows, String> {
    // The reader checks UTF-8 only on a record's fields joined together (`\xC3,\xA9` passes),
    // and drops what follows a record's end on the same line.
    for l in lines {
        csv_record_shape(&bytes[l.start..l.end], delimiter, schema.fields().len())?;
    }
    decode_csv_shaped(schema, &top_level_as_text(schema), delimiter, bytes, lines)
}

/// [`decode_csv`] of lines whose shape has been checked; `decode_schema` is
/// [`top_level_as_text`] of `schema`.
fn decode_csv_shaped(
    schema: &SchemaRef,
    decode_schema: &SchemaRef,
    delimiter: u8,
    bytes: &[u8],
    lines: &[Line],
) -> std::result::Result<DecodedRows, String> {
    let mut decoder = arrow::csv::ReaderBuilder::new(Arc::clone(decode_schema))
        .with_header(false)
        .with_delimiter(delimiter)
        .with_batch_size(lines.len() + 1)
        .build_decoder();
    // Line by line, so a line holding no record, two records, or the start of a record the next
    // line ends is caught at its line rather than decoded into rows given to the wrong lines.
    for l in lines {
        let line = without_bom(&bytes[l.start..l.end]);
        let before = decoder.capacity();
        feed_csv(&mut decoder, line)?;
        feed_csv(&mut decoder, b"\n")?;
        let records = before - decoder.capacity();
        if records != 1 {
            return Err(format!(
                "CSV error: the line holds {records} CSV records (a quoted field left open \
                 holds none); one record per line is read"
            ));
        }
    }
    let batch = decoder
        .flush()
        .map_err(|e| e.to_string())?
        .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(decode_schema)));
    if batch.schema() == *schema {
        return Ok(batch.into());
    }
    let mut bad_rows = Vec::new();
    let mut columns = Vec::with_capacity(schema.fields().len());
    for (index, (field, column)) in schema.fields().iter().zip(batch.columns()).enumerate() {
        columns.push(match field.data_type() {
            t if converted_from_text(t) => {
                csv_column(column.as_string::<i32>(), index, field, &mut bad_rows)?
            }
            _ => Arc::clone(column),
        });
    }
    rows_of(schema, columns, batch.num_rows(), bad_rows)
}

/// `line` without the UTF-8 byte order marks it starts with: not data in a CSV line (a file
/// saved by Excel starts with one, and files concatenated keep theirs). The CSV reader drops
/// one only at the start of what a decoder is first fed, which would make a line's value depend
/// on where a run of lines begins; dropping them from every line gives each line one reading.
pub(crate) fn without_bom(mut line: &[u8]) -> &[u8] {
    while let Some(rest) = line.strip_prefix(b"\xEF\xBB\xBF") {
        line = rest;
    }
    line
}

/// Feeds all of `buf` to a CSV decoder.
fn feed_csv(
    decoder: &mut arrow::csv::reader::Decoder,
    buf: &[u8],
) -> std::result::Result<(), String> {
    feed_all(buf, |b| decoder.decode(b))
}

/// A top-level number, boolean or timestamp column of a CSV file from its text, converted as
/// the Arrow CSV reader converts it; a value that does not has its row and reason added to
/// `bad_rows`.
fn csv_column(
    text: &StringArray,
    index: usize,
    field: &Field,
    bad_rows: &mut Vec<(usize, String)>,
) -> std::result::Result<ArrayRef, String> {
    let converting = csv_from_text(index, field, text.len())?;
    Ok(convert_all(converting, text, bad_rows))
}

/// A CSV top-level number, boolean or timestamp column (column `index` of the file) of
/// `field`'s type built from text ([`FromText`]), converted as the Arrow CSV reader converts
/// (but for a number beyond a float column, refused: [`in_range`]).
///
/// # Errors
/// If the type is not converted from text, or the column's time zone does not parse.
fn csv_from_text(
    index: usize,
    field: &Field,
    capacity: usize,
) -> std::result::Result<Box<dyn FromText>, String> {
    use arrow::datatypes::{
        Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
        UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    fn parse<T: ArrowPrimitiveType + Parser>(
        index: usize,
    ) -> impl Fn(&str, &Field) -> std::result::Result<T::Native, String> {
        move |value, field| {
            T::parse(value).ok_or_else(|| {
                format!(
                    "Parser error: Error while parsing value '{value}' as type '{}' for \
                     column {index} ('{}')",
                    field.data_type(),
                    field.name()
                )
            })
        }
    }
    fn timestamp(
        index: usize,
        tz: arrow::array::timezone::Tz,
        unit: TimeUnit,
    ) -> impl Fn(&str, &Field) -> std::result::Result<i64, String> {
        move |value, field| {
            let error = |e: &dyn std::fmt::Display| {
                format!(
                    "Parser error: Error parsing column {index} ('{}'): {e}",
                    field.name()
                )
            };
            let date = string_to_datetime(&tz, value).map_err(|e| error(&e))?;
            in_unit(&date, unit).map_err(|e| error(&e))
        }
    }
    let c = capacity;
    Ok(match field.data_type() {
        DataType::Int8 => parsed::<Int8Type>(field, c, parse::<Int8Type>(index)),
        DataType::Int16 => parsed::<Int16Type>(field, c, parse::<Int16Type>(index)),
        DataType::Int32 => parsed::<Int32Type>(field, c, parse::<Int32Type>(index)),
        DataType::Int64 => parsed::<Int64Type>(field, c, parse::<Int64Type>(index)),
        DataType::UInt8 => parsed::<UInt8Type>(field, c, parse::<UInt8Type>(index)),
        DataType::UInt16 => parsed::<UInt16Type>(field, c, parse::<UInt16Type>(index)),
        DataType::UInt32 => parsed::<UInt32Type>(field, c, parse::<UInt32Type>(index)),
        DataType::UInt64 => parsed::<UInt64Type>(field, c, parse::<UInt64Type>(index)),
        DataType::Float16 => parsed::<Float16Type>(field, c, parse::<Float16Type>(index)),
        DataType::Float32 => parsed::<Float32Type>(
            field,
            c,
            in_range(parse::<Float32Type>(index), f32::is_finite, "Parser error"),
        ),
        DataType::Float64 => parsed::<Float64Type>(
            field,
            c,
            in_range(parse::<Float64Type>(index), f64::is_finite, "Parser error"),
        ),
        DataType::Boolean => booleans(field, c, move |value, field| {
            if value.eq_ignore_ascii_case("true") {
                Ok(true)
            } else if value.eq_ignore_ascii_case("false") {
                Ok(false)
            } else {
                Err(format!(
                    "Parser error: Error while parsing value '{value}' as type 'Boolean' for \
                     column {index} ('{}')",
                    field.name()
                ))
            }
        }),
        DataType::Timestamp(unit, tz) => {
            let tz = zone(tz.as_deref())?;
            timestamps(field, c, *unit, timestamp(index, tz, *unit))
        }
        t => {
            return Err(format!(
                "column '{}': {t} is not converted from text",
                field.name()
            ));
        }
    })
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

    /// The room made for a text's lines is a little over their number where lines are alike;
    /// where the later lines are shorter than the sampled ones, every line is still split off.
    #[test]
    fn lines_are_split_whatever_room_was_expected() {
        let alike: Vec<u8> = (0..100_000)
            .flat_map(|i| format!("{{\"n\":{i:06}}}\n").into_bytes())
            .collect();
        let count = split_lines(&alike).len();
        assert_eq!(count, 100_001);
        let expected = expected_lines(&alike);
        assert!(
            (count..=count + count / 4).contains(&expected),
            "{expected}"
        );
        assert_eq!(expected_lines(b"a\nb"), 2);
        let mut shorter = vec![b'x'; LINE_SAMPLE_BYTES];
        shorter.extend(std::iter::repeat_n(b"1\n".as_slice(), 50_000).flatten());
        assert!(expected_lines(&shorter) < 100);
        // Short lines first: the room expected is capped, not the text's length in lines.
        let mut longer: Vec<u8> = b"\n".repeat(LINE_SAMPLE_BYTES);
        longer.extend(vec![b'y'; 2 * MAX_EXPECTED_LINES]);
        assert_eq!(expected_lines(&longer), MAX_EXPECTED_LINES);
        assert_eq!(split_lines(&longer).len(), LINE_SAMPLE_BYTES + 1);
        let lines = split_lines(&shorter);
        assert_eq!(lines.len(), 50_001);
        assert_eq!(
            (lines[1].number, lines[1].start),
            (2, LINE_SAMPLE_BYTES + 2)
        );
    }

    #[test]
    fn bad_json_lines_are_isolated_and_good_lines_kept_in_order() {
        let text = b"{\"id\":1,\"name\":\"a\"}\n{\"id\":\n\n{\"id\":\"x\"}\n{\"id\":4}{\"id\":5}\n{\"id\":6}\n";
        let bytes = Bytes::from_static(text);
        let mut lines = split_lines(&bytes);
        lines.retain(|l| !bytes[l.start..l.end].iter().all(u8::is_ascii_whitespace));
        let s = schema();
        let (good, bad) = decode_json_lines(&s, None, &bytes, &lines, false);
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
        let (good, bad) = decode_csv_lines(&s, b',', &bytes, &lines);
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(rows, 2);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 2);
    }

    /// A CSV file's header decides where each column is: naming them all once (reordered, with
    /// others besides, in another case), by name; otherwise by position — but a named column
    /// elsewhere makes every line a dead letter. Exact names win over
    /// loose ones; a column an inferred schema lacks makes every line a dead letter naming it,
    /// a declared schema ignores it. Inferred `column_N` fields past the header are named by
    /// their position; a delimiter ending the header names nothing; a header of numbers is data
    /// under an inferred schema and names under a declared one.
    #[test]
    fn a_csv_header_lays_out_the_columns_by_name() {
        let s: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("user", DataType::Utf8, true),
            Field::new("page", DataType::Utf8, true),
            Field::new("n", DataType::Int64, true),
        ]));
        // Each good row as `line:user/page/n` (`-`: null); each bad line as `line:reason`.
        let read = |s: &SchemaRef, declared: bool, text: &str| {
            let (good, bad) = decode_csv_file(s, b',', text.as_bytes(), true, declared);
            let mut rows = Vec::new();
            for (batch, numbers) in good {
                assert_eq!(&batch.schema(), s);
                for (row, number) in numbers.iter().enumerate() {
                    let cell = |c: usize| {
                        let column = batch.column(c);
                        if column.is_null(row) {
                            "-".to_string()
                        } else if column.data_type() == &DataType::Int64 {
                            column.as_primitive::<Int64Type>().value(row).to_string()
                        } else {
                            column.as_string::<i32>().value(row).to_string()
                        }
                    };
                    let cells: Vec<String> = (0..batch.num_columns()).map(cell).collect();
                    rows.push(format!("{number}:{}", cells.join("/")));
                }
            }
            let bad: Vec<String> = bad
                .into_iter()
                .map(|(n, _, why)| format!("{n}:{why}"))
                .collect();
            (rows, bad)
        };
        let row = |r: &str| vec![r.to_string()];
        for declared in [true, false] {
            let (rows, bad) = read(&s, declared, "user,page,n\na,home,1\n");
            assert_eq!((rows, bad.len()), (row("2:a/home/1"), 0));
            // Reordered, another case, a byte order mark and CRLF; a bad value still fails
            // its own line.
            let text = "\u{feff}PAGE,n, user\r\nhome,1,a\r\ncart,x,b\r\n";
            let (rows, bad) = read(&s, declared, text);
            assert_eq!(rows, row("2:a/home/1"));
            assert!(bad.len() == 1 && bad[0].starts_with("3:"), "{bad:?}");
            // Naming some or none of the columns: by position.
            for text in ["who,where,count\na,home,1\n", "user,where,n\na,home,1\n"] {
                let (rows, bad) = read(&s, declared, text);
                assert_eq!((rows, bad.len()), (row("2:a/home/1"), 0), "{text}");
            }
            // Exact names win over loose ones: `N` is another column here, not `n` again.
            let (rows, bad) = read(&s, declared, "n,N,user,page\n1,x,a,home\n");
            if declared {
                assert_eq!((rows, bad.len()), (row("2:a/home/1"), 0));
            } else {
                assert!(
                    rows.is_empty() && bad[0].contains("the column \"N\""),
                    "{bad:?}"
                );
            }
        }
        // Some columns named, one of them elsewhere (one renamed, others reordered): neither
        // by name nor by position places the fields, whether the schema was declared or
        // inferred; read by position, `home` would be the user.
        for declared in [true, false] {
            let (rows, bad) = read(&s, declared, "page,user,x\nhome,a,1\n");
            assert!(rows.is_empty(), "{rows:?}");
            assert!(
                bad.len() == 1 && bad[0].contains("field 1 (the schema's field 2)"),
                "{bad:?}"
            );
        }
        // Blank lines before the header: the header is still the first line that names.
        for declared in [true, false] {
            let (rows, bad) = read(&s, declared, "\n \r\npage,n,user\nhome,1,a\n");
            assert_eq!((rows, bad.len()), (row("4:a/home/1"), 0));
        }
        // A column an inferred schema lacks keeps the file's lines whole, as dead letters; a
        // declared schema ignores it.
        let (rows, bad) = read(&s, false, "n,colour,page,user\n3,red,home,a\n");
        assert!(rows.is_empty());
        assert!(
            bad.len() == 1 && bad[0].contains("the column \"colour\""),
            "{bad:?}"
        );
        let (rows, bad) = read(&s, true, "n,colour,page,user\n3,red,home,a\n");
        assert_eq!((rows, bad.len()), (row("2:a/home/3"), 0));
        // Inferred `column_N` past the header: a delimiter ending each line, reordered.
        let trailing: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Utf8, true),
            Field::new("b", DataType::Utf8, true),
            Field::new("column_3", DataType::Utf8, true),
        ]));
        for text in ["b,a\n2,1,\n", "b,a,\n2,1,\n"] {
            let (rows, bad) = read(&trailing, false, text);
            assert_eq!((rows, bad.len()), (row("2:1/2/-"), 0), "{text}");
        }
        // A delimiter ending the header names no column.
        let (rows, bad) = read(&s, true, "user,page,n,\na,home,1\n");
        assert_eq!((rows, bad.len()), (row("2:a/home/1"), 0));
        // A first line of numbers and booleans is data (a file without a header read with
        // one), never names to reorder by.
        let numbered: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("0", DataType::Utf8, true),
            Field::new("1", DataType::Utf8, true),
        ]));
        let (rows, bad) = read(&numbered, false, "1,0\nx,y\n");
        assert_eq!((rows, bad.len()), (row("2:x/y"), 0));
        // ... unless the schema was declared so: its names were chosen (year columns).
        let (rows, bad) = read(&numbered, true, "1,0\nx,y\n");
        assert_eq!((rows, bad.len()), (row("2:y/x"), 0));
        // A column named twice, the first time out of place: placed neither way.
        for declared in [true, false] {
            let (rows, bad) = read(&s, declared, "n,page,n\na,home,1\n");
            assert!(
                rows.is_empty() && bad[0].contains("not name every column once"),
                "{bad:?}"
            );
        }
        // Without a header, by position.
        let (good, bad) = decode_csv_file(&s, b',', b"a,home,1\n", false, true);
        assert_eq!((good.len(), bad.len()), (1, 0));
    }

    /// A CSV line is one record or a bad line: a quote left open, an empty value, a field that
    /// is not UTF-8 on its own, an empty NOT NULL number are bad lines — never rows given to
    /// the wrong lines; a quoted line break in a Kafka value is one record.
    #[test]
    fn a_csv_line_holds_exactly_one_record() {
        let s: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]));
        let texts: [&[u8]; 9] = [
            b"1,a",
            b"\"2,b",
            b"3,c",
            b"4,\"x\ny\"",
            b"",
            b"5,\xC3\xA9",
            b"\xC3,\xA9",
            b",e",
            b"8,h",
        ];
        // As Kafka values are put together: a value may hold a line break.
        let (mut bytes, mut lines) = (Vec::new(), Vec::new());
        for (i, text) in texts.iter().enumerate() {
            let start = bytes.len();
            bytes.extend_from_slice(text);
            lines.push(Line {
                number: i + 1,
                start,
                end: bytes.len(),
            });
            bytes.push(b'\n');
        }
        let bytes = bytes.as_slice();
        let decoded = decode_csv_lines(&s, b',', bytes, &lines);
        let numbers: Vec<usize> = decoded.0.iter().flat_map(|(_, n)| n.clone()).collect();
        assert_eq!(numbers, vec![1, 3, 4, 6, 9]);
        let names: Vec<Option<String>> = decoded
            .0
            .iter()
            .flat_map(|(b, _)| {
                b.column(1)
                    .as_string::<i32>()
                    .iter()
                    .map(|v| v.map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(
            names,
            vec![
                Some("a".into()),
                Some("c".into()),
                Some("x\ny".into()),
                Some("é".into()),
                Some("h".into())
            ]
        );
        let bad: Vec<usize> = decoded.1.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(bad, vec![2, 5, 7, 8]);
        assert!(decoded.1[3].2.contains("NOT NULL"), "{}", decoded.1[3].2);
        let halved = decode_lines(bytes, &lines, |c| decode_csv(&s, b',', bytes, c));
        assert_same_decoding(&decoded, &halved);
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
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, None),
                true,
            ),
            Field::new("ok", DataType::Boolean, true),
            Field::new_list("tags", Field::new_list_field(DataType::Utf8, true), true),
            Field::new_struct("nested", vec![Field::new("k", DataType::Int64, true)], true),
        ]))
    }

    /// Columns that all decode as text: numbers, booleans and timestamps converted from it, and
    /// text of each kind.
    fn flat_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8View, true),
            Field::new("amount", DataType::Float64, true),
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, None),
                true,
            ),
            Field::new("ok", DataType::Boolean, false),
            Field::new("tags", DataType::LargeUtf8, true),
        ]))
    }

    /// A flat schema with a NOT NULL text column.
    fn flat_schema_not_null() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int32, true),
            Field::new("name", DataType::Utf8, false),
        ]))
    }

    /// Decodes `bytes` as JSON lines and as CSV lines, infers schemas from them: nothing may
    /// panic, and every non-blank line ends up as exactly one row or one bad line. The JSON
    /// lines decode to the same rows, bad lines and reasons whether sorted by
    /// [`is_one_json_object`] first or only split in halves around failures.
    fn exercise(bytes: &[u8]) {
        let mut lines = split_lines(bytes);
        lines.retain(|l| !bytes[l.start..l.end].iter().all(u8::is_ascii_whitespace));
        let json = nested_schema();
        let (good, bad) = decode_json_lines(&json, None, bytes, &lines, false);
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(rows + bad.len(), lines.len(), "a line got lost or doubled");
        let halved = decode_lines(bytes, &lines, |c| decode_json_rows(&json, bytes, c, false));
        assert_same_decoding(&(good, bad), &halved);
        let strict = decode_json_lines(&json, None, bytes, &lines, true);
        let halved = decode_lines(bytes, &lines, |c| decode_json_rows(&json, bytes, c, true));
        assert_same_decoding(&strict, &halved);
        assert_narrowed_reads_alike(&json, bytes, &lines, true, &strict);
        // Schemas of text columns once decoded: flat objects are read in one pass first.
        for flat in [flat_schema(), flat_schema_not_null()] {
            assert!(FlatJson::new(&flat, false, None).is_some());
            for strict in [false, true] {
                let read = decode_json_lines(&flat, None, bytes, &lines, strict);
                let halved =
                    decode_lines(bytes, &lines, |c| decode_json_rows(&flat, bytes, c, strict));
                assert_same_decoding(&read, &halved);
                assert_narrowed_reads_alike(&flat, bytes, &lines, strict, &read);
            }
        }
        let csv = schema();
        let (good, bad) = decode_csv_lines(&csv, b',', bytes, &lines);
        let rows: usize = good.iter().map(|(b, _)| b.num_rows()).sum();
        assert_eq!(
            rows + bad.len(),
            lines.len(),
            "a CSV line got lost or doubled"
        );
        let halved = decode_lines(bytes, &lines, |c| decode_csv(&csv, b',', bytes, c));
        assert_same_decoding(&(good, bad), &halved);
        let positions = bytes
            .split(|b| *b == b'\n')
            .enumerate()
            .map(|(i, l)| (l, format!("f:{i}")));
        let _ = crate::infer::infer_json(positions, String::new());
        let _ = crate::infer::infer_csv(&[("f".into(), bytes)], true, b',', String::new());
    }

    /// Decoding `lines` keeping only some columns — none, the second, every other one — gives
    /// `whole`'s rows with only those columns, and the same bad lines and reasons.
    fn assert_narrowed_reads_alike(
        schema: &SchemaRef,
        bytes: &[u8],
        lines: &[Line],
        strict: bool,
        whole: &Decoded,
    ) {
        let names: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let every_other: Vec<usize> = (0..names.len()).step_by(2).collect();
        for kept in [vec![], vec![1], every_other] {
            let columns: Vec<String> = kept.iter().map(|i| names[*i].clone()).collect();
            let narrowed = decode_json_lines(schema, Some(&columns), bytes, lines, strict);
            let projected: Vec<(RecordBatch, Vec<usize>)> = whole
                .0
                .iter()
                .map(|(b, n)| (b.project(&kept).unwrap(), n.clone()))
                .collect();
            for (batch, _) in &narrowed.0 {
                assert_eq!(batch.schema(), Arc::new(schema.project(&kept).unwrap()));
            }
            assert_same_decoding(&narrowed, &(projected, whole.1.clone()));
        }
    }

    /// Two decodings hold the same rows for the same lines and the same bad lines and reasons.
    fn assert_same_decoding(a: &Decoded, b: &Decoded) {
        let rows = |d: &Decoded| {
            let numbers: Vec<usize> = d.0.iter().flat_map(|(_, n)| n.clone()).collect();
            let batches: Vec<RecordBatch> = d.0.iter().map(|(b, _)| b.clone()).collect();
            let schema = batches.first().map(|b| b.schema());
            let all = schema.map(|s| arrow::compute::concat_batches(&s, &batches).unwrap());
            (numbers, all)
        };
        assert_eq!(rows(a), rows(b), "the good rows differ");
        assert_eq!(a.1, b.1, "the bad lines differ");
    }

    /// A byte order mark at the start of a CSV line is not data, wherever the line falls in a
    /// run: the line decodes alike alone and among others (the CSV reader drops one only at
    /// the start of a decoder's input).
    #[test]
    fn a_csv_line_starting_with_a_byte_order_mark_reads_the_same_anywhere() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]));
        for text in [
            "1,a\n\u{feff}2,b\n\u{feff}x,c\n\u{feff}\"d,e\",f\n",
            "\u{feff}\u{feff}x,c\n1,a\n",
        ] {
            let bytes = text.as_bytes();
            let lines = split_lines(bytes);
            exercise_csv_against_halving(&schema, bytes, &lines);
        }
        let bytes = "1,a\n\u{feff}2,b".as_bytes();
        let (good, bad) = decode_csv_lines(&schema, b',', bytes, &split_lines(bytes));
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(good.iter().map(|(b, _)| b.num_rows()).sum::<usize>(), 2);
    }

    fn exercise_csv_against_halving(schema: &SchemaRef, bytes: &[u8], lines: &[Line]) {
        let sorted = decode_csv_lines(schema, b',', bytes, lines);
        let halved = decode_lines(bytes, lines, |c| decode_csv(schema, b',', bytes, c));
        assert_same_decoding(&sorted, &halved);
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
            ("-", None),
            ("+5", Some(5)),
            (" 5", Some(5)),
            ("5 ", Some(5)),
            ("007", Some(7)),
            ("-000", Some(0)),
            ("999999999999999999", Some(999_999_999_999_999_999)),
            ("-999999999999999999", Some(-999_999_999_999_999_999)),
            ("1234567890123456789", Some(1_234_567_890_123_456_789)),
            ("-99999999999999999999", Some(-99_999_999_999_999_999_999)),
            ("1-2", None),
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
        let (good, bad) = decode_json_lines(&s, None, bytes, &lines, false);
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
        let (good, bad) = decode_json_lines(&s, None, bytes, &lines, false);
        let numbers: Vec<usize> = good.iter().flat_map(|(_, n)| n.clone()).collect();
        assert_eq!(numbers, vec![1, 5]);
        let bad_lines: Vec<usize> = bad.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(bad_lines, vec![2, 3, 4]);
    }

    /// A number too large for its float column (`1e400` in a DOUBLE) fails its line rather
    /// than becoming infinity; a value that names infinity itself keeps it. JSON and CSV alike.
    #[test]
    fn numbers_beyond_a_float_column_fail_their_line() {
        let s: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("d", DataType::Float64, true),
            Field::new("f", DataType::Float32, true),
        ]));
        let json = concat!(
            "{\"d\":1e308,\"f\":1.5}\n",
            "{\"d\":1e400,\"f\":1}\n",
            "{\"d\":-1e400,\"f\":1}\n",
            "{\"d\":1,\"f\":1e39}\n",
            "{\"d\":\"inf\",\"f\":\"-inf\"}\n",
        );
        let csv = "1e308,1.5\n1e400,1\n-1e400,1\n1,1e39\ninf,-inf\n";
        for (text, is_json) in [(json, true), (csv, false)] {
            let bytes = text.as_bytes();
            let lines = data_lines(bytes, false);
            let (good, bad) = if is_json {
                decode_json_lines(&s, None, bytes, &lines, false)
            } else {
                decode_csv_lines(&s, b',', bytes, &lines)
            };
            let numbers: Vec<usize> = good.iter().flat_map(|(_, n)| n.clone()).collect();
            assert_eq!(numbers, vec![1, 5], "{text}");
            let d: Vec<f64> = good
                .iter()
                .flat_map(|(b, _)| {
                    b.column(0)
                        .as_primitive::<arrow::datatypes::Float64Type>()
                        .values()
                        .to_vec()
                })
                .collect();
            assert_eq!(d, vec![1e308, f64::INFINITY], "{text}");
            let reasons: Vec<(usize, &str)> =
                bad.iter().map(|(n, _, e)| (*n, e.as_str())).collect();
            assert_eq!(reasons.len(), 3, "{reasons:?}");
            assert!(
                reasons[0]
                    .1
                    .contains("1e400 is beyond the range of column 'd' (Float64)")
            );
            assert!(
                reasons[2]
                    .1
                    .contains("1e39 is beyond the range of column 'f' (Float32)")
            );
            assert_eq!(
                reasons.iter().map(|r| r.0).collect::<Vec<_>>(),
                vec![2, 3, 4]
            );
        }
    }

    /// A value that does not fit its number or timestamp column fails its own line with the
    /// column's reason; the lines around it decode together, in order.
    #[test]
    fn bad_values_fail_their_line_only() {
        let s: SchemaRef = Arc::new(Schema::new(vec![
            // NOT NULL: a bad row's placeholder must not break the batch.
            Field::new("id", DataType::Int64, false),
            Field::new("amount", DataType::Float64, true),
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, None),
                true,
            ),
        ]));
        let bytes = concat!(
            "{\"id\":1,\"amount\":1.5,\"ts\":\"2026-11-01T10:00:00Z\"}\n",
            "{\"id\":2,\"amount\":\"n/a\",\"ts\":\"2026-11-01T10:00:01Z\"}\n",
            "{\"id\":3,\"amount\":\"2.5\",\"ts\":1762000000000}\n",
            "{\"id\":4,\"amount\":3,\"ts\":\"yesterday\"}\n",
            "{\"id\":5.5,\"amount\":true,\"ts\":\"soon\"}\n",
            "{\"id\":6,\"amount\":null,\"ts\":\"1762000000000\"}\n",
            "{\"id\":7,\"amount\":4,\"ts\":\"2026-11-01T10:00:07+01:00\"}\n",
            "{\"id\":8,\"amount\":4,\"ts\":\"NaN\"}\n",
            "{\"id\":9,\"amount\":4,\"ts\":\"-Infinity\"}\n",
            "{\"id\":10,\"amount\":4,\"ts\":1e30}\n",
            "{\"amount\":4}\n",
        )
        .as_bytes();
        let lines = split_lines(bytes);
        let lines: Vec<Line> = lines.into_iter().filter(|l| l.end > l.start).collect();
        let decoded = decode_json_lines(&s, None, bytes, &lines, false);
        let (good, bad) = &decoded;
        assert_eq!(good.len(), 1, "the good lines decode as one batch");
        let (batch, numbers) = &good[0];
        assert_eq!(numbers, &vec![1, 3, 6, 7]);
        let amount: Vec<Option<f64>> = batch
            .column(1)
            .as_primitive::<arrow::datatypes::Float64Type>()
            .iter()
            .collect();
        assert_eq!(amount, vec![Some(1.5), Some(2.5), None, Some(4.0)]);
        let ts: Vec<Option<i64>> = batch
            .column(2)
            .as_primitive::<arrow::datatypes::TimestampMillisecondType>()
            .iter()
            .collect();
        assert_eq!(
            ts,
            vec![
                Some(1_793_527_200_000),
                Some(1_762_000_000_000),
                Some(1_762_000_000_000),
                Some(1_793_523_607_000)
            ]
        );
        let reasons: Vec<(usize, &str)> = bad.iter().map(|(n, _, e)| (*n, e.as_str())).collect();
        assert_eq!(
            reasons,
            vec![
                (
                    2,
                    "Json error: whilst decoding field 'amount': failed to parse \"n/a\" as Float64"
                ),
                (
                    4,
                    "Json error: whilst decoding field 'ts': failed to parse \"yesterday\" as \
                     Timestamp(ms): Parser error: Error parsing timestamp from 'yesterday': \
                     timestamp must contain at least 10 characters"
                ),
                (
                    5,
                    "Json error: 5.5 is not a whole number that fits column 'id' (Int64)"
                ),
                (
                    8,
                    "Json error: whilst decoding field 'ts': failed to parse \"NaN\" as \
                     Timestamp(ms): Parser error: Error parsing timestamp from 'NaN': \
                     timestamp must contain at least 10 characters"
                ),
                (
                    9,
                    "Json error: whilst decoding field 'ts': failed to parse \"-Infinity\" as \
                     Timestamp(ms): Parser error: Error parsing timestamp from '-Infinity': \
                     timestamp must contain at least 10 characters"
                ),
                (
                    10,
                    "Json error: whilst decoding field 'ts': failed to parse \"1e30\" as \
                     Timestamp(ms): not a number of the column's unit"
                ),
                (
                    11,
                    "column 'id' is NOT NULL, and the record has no value for it"
                ),
            ]
        );
        let halved = decode_lines(bytes, &lines, |c| decode_json_rows(&s, bytes, c, false));
        assert_same_decoding(&decoded, &halved);
    }

    /// The check before decoding takes what the Arrow decoder takes (its optional commas, its
    /// loose numbers) and stops what it does not: a line it passes decodes alone, a line it
    /// stops does not (against a schema with no columns, so only the syntax counts).
    #[test]
    fn the_object_check_agrees_with_the_decoder() {
        let passes = [
            r#"{}"#,
            r#" { "a" : 1 } "#,
            r#"{"a":1 "b":2}"#,
            r#"{,"a":1,,}"#,
            r#"{"a":[1 2,,3],"b":{"c":[]}}"#,
            r#"{"a":1-2e+}"#,
            r#"{"a":"\u00e9\ud83d\ude00\n","b":"tab	here"}"#,
            r#"{"a":true,"b":false,"c":null}"#,
        ];
        let stops = [
            r#""#,
            r#"[1]"#,
            r#"5"#,
            r#"{"a":1}{"b":2}"#,
            r#"{"a":1},"#,
            r#"{"a":}"#,
            r#"{"a" 1}"#,
            r#"{1:2}"#,
            r#"{"a":tru}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":"\ud83d"}"#,
            r#"{"a":"\ude00\ud83d"}"#,
            r#"{"a":[1}"#,
            r#"{"a":1"#,
            r#"{"a":"b"#,
            r#"{"a":.5}"#,
        ];
        let no_columns: SchemaRef = Arc::new(Schema::empty());
        let decodes = |line: &[u8]| {
            let lines = [Line {
                number: 1,
                start: 0,
                end: line.len(),
            }];
            decode_json(&no_columns, line, &lines, false).is_ok()
        };
        for line in passes {
            assert!(is_one_json_object(line.as_bytes()), "{line} should pass");
            assert!(decodes(line.as_bytes()), "{line} should decode");
        }
        for line in stops {
            assert!(
                !is_one_json_object(line.as_bytes()),
                "{line} should be stopped"
            );
            assert!(!decodes(line.as_bytes()), "{line} should not decode");
        }
        let deep = format!(
            "{{\"a\":{}{}}}",
            "[".repeat(MAX_JSON_DEPTH),
            "]".repeat(MAX_JSON_DEPTH)
        );
        assert!(!is_one_json_object(deep.as_bytes()));
        let deepest = format!(
            "{{\"a\":{}{}}}",
            "[".repeat(MAX_JSON_DEPTH - 1),
            "]".repeat(MAX_JSON_DEPTH - 1)
        );
        assert!(is_one_json_object(deepest.as_bytes()));
        assert!(!is_one_json_object(b"{\"a\":\"\xff\"}"));
    }

    /// Data lines leave out blank lines (whitespace, byte-order marks) and the header (the
    /// first line that is not blank), and keep every line's number and span.
    #[test]
    fn data_lines_skip_the_header_and_blank_lines() {
        let text = b"\na,b\r\n  \t\n\xEF\xBB\xBF\n\xEF\xBB\xBF1,2\n3,4";
        let lines = |skip_header| {
            data_lines(text, skip_header)
                .iter()
                .map(|l| {
                    (
                        l.number,
                        String::from_utf8_lossy(&text[l.start..l.end]).into_owned(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let all = vec![
            (2, "a,b".to_string()),
            (5, "\u{feff}1,2".to_string()),
            (6, "3,4".to_string()),
        ];
        assert_eq!(lines(false), all);
        assert_eq!(lines(true), all[1..]);
        assert_eq!(
            header_line(text).map(|l| (l.number, l.start, l.end)),
            Some((2, 1, 4))
        );
        let text = b"h\n\n1\n";
        let numbers: Vec<usize> = data_lines(text, true).iter().map(|l| l.number).collect();
        assert_eq!(numbers, vec![3]);
        assert!(data_lines(b"", true).is_empty());
        assert!(header_line(b" \n\r\n\xEF\xBB\xBF").is_none());
    }

    /// Surrogate pairs inside strings become the UTF-8 of their character; escaped
    /// backslashes, pairs outside strings, lone or reversed surrogates stay as they are.
    #[test]
    fn surrogate_pairs_are_handed_to_the_decoder_as_utf8() {
        let mend = |line: &str| {
            surrogate_pairs_as_utf8(line.as_bytes()).map(|b| String::from_utf8(b).unwrap())
        };
        assert_eq!(mend(r#"{"a":"x"}"#), None);
        assert_eq!(mend(r#"{"a":"\n\u00e9"}"#), None);
        assert_eq!(
            mend(r#"{"a":"<\ud842\udfb7>","\uD83D\uDE00":"\ud83d\ude00\ud842\uDFB7"}"#),
            Some(r#"{"a":"<𠮷>","😀":"😀𠮷"}"#.to_string())
        );
        // An escaped backslash before `ud842`: text, not an escape.
        assert_eq!(mend(r#"{"a":"\\ud842\udfb7"}"#), None);
        assert_eq!(
            mend(r#"{"a":"\\\ud842\udfb7"}"#),
            Some(r#"{"a":"\\𠮷"}"#.to_string())
        );
        // Outside a string, reversed, alone, cut short: left for the decoder to refuse.
        assert_eq!(mend(r#"{"a":\ud842\udfb7}"#), None);
        assert_eq!(mend(r#"{"a":"\udfb7\ud842"}"#), None);
        assert_eq!(mend(r#"{"a":"\ud842x\udfb7"}"#), None);
        assert_eq!(mend(r#"{"a":"\ud842\udfb"#), None);
        // After an escape the decoder refuses, nothing is mended: it fails there either way,
        // with the same reason.
        assert_eq!(mend(r#"{"a":"\ud842\ud842\udfb7"}"#), None);
        assert_eq!(mend(r#"{"a":"\udfb7\ud842\udfb7"}"#), None);
        assert_eq!(mend(r#"{"a":"\u00\ud842\udfb7"}"#), None);
        assert_eq!(mend(r#"{"a":"\q\ud842\udfb7"}"#), None);
        assert_eq!(
            mend(r#"{"a":"\ud842\udfb7\ud842\ud842\udfb7"}"#),
            Some(r#"{"a":"𠮷\ud842\ud842\udfb7"}"#.to_string())
        );
    }

    /// The one-pass reader reads flat objects, and leaves what it is not sure of to the
    /// decoder — which then gives the same rows and reasons as decoding every line there.
    #[test]
    fn flat_objects_are_read_in_one_pass_and_the_rest_decoded() {
        let text = concat!(
            "{\"id\":1,\"name\":\"a\",\"amount\":2.5,\"ts\":\"2026-01-01T00:00:00Z\",\"ok\":true}\n",
            " { \"ok\" : false , \"name\" : \"tab\\tq\\\"\\u00e9\\ud83d\\ude00\" , \"id\" : -7 } \n",
            "{\"id\":3,\"ok\":true,\"extra\":\"x\",\"tags\":null}\n",
            "{\"id\":4,\"ok\":true,\"tags\":[1]}\n",
            "{\"id\":5 \"ok\":true}\n",
            "{\"id\":6,\"ok\":true,\"id\":7}\n",
            "{\"i\\u0064\":8,\"ok\":true}\n",
            "{\"id\":\"x\",\"ok\":true}\n",
            "{\"id\":10}\n",
            "{\"id\":11,\"ok\":true}{}\n",
            "{\"id\":12,\"ok\":1}\n",
            "{\"id\":13,\"ok\":true,\"name\":\"\\udc00\\ud800\"}\n",
            "{\"id\":14,\"ok\":true,\"name\":\"\\ud800\"}\n",
            "{\"id\":15,\"ok\":true,\"name\":\"\\u00zz\"}\n",
            "{\"id\":16,\"ok\":true,\"name\":\"a\\/b\\u0041\"}\n",
            "{\"id\":17,\"ok\":true,\"name\":\"\\ud842\\udfb7\"}\n",
        );
        let bytes = text.as_bytes();
        let lines = split_lines(bytes);
        let lines = &lines[..lines.len() - 1];
        let s = flat_schema();
        let flat = FlatJson::new(&s, false, None).unwrap();
        let FlatRead {
            batch,
            read,
            bad,
            declined,
        } = flat.read(bytes, lines).unwrap();
        let numbers = |lines: &[Line]| lines.iter().map(|l| l.number).collect::<Vec<_>>();
        // A nested value, a missing comma, a repeated key, an escaped key and a second object
        // are left to the decoder; a bad value is read here and fails its line as it converts,
        // the line's other values taken back: it has no row.
        assert_eq!(numbers(&read), vec![1, 2, 3, 15, 16]);
        assert_eq!(batch.num_rows(), 5);
        let bad_lines: Vec<usize> = bad.iter().map(|(l, _)| l.number).collect();
        assert_eq!(bad_lines, vec![8, 9, 11]);
        assert_eq!(numbers(&declined), vec![4, 5, 6, 7, 10, 12, 13, 14]);
        let names = batch.column(1).as_string_view();
        assert_eq!(names.value(1), "tab\tq\"é😀");
        assert_eq!(names.value(3), "a/bA");
        assert_eq!(names.value(4), "𠮷");
        assert!(!batch.column(4).as_boolean().value(1));
        let ids = batch
            .column(0)
            .as_primitive::<arrow::datatypes::Int64Type>();
        assert_eq!(ids.values().to_vec(), vec![1, -7, 3, 16, 17]);
        assert!(FlatJson::new(&s, true, None).is_some());
        assert!(FlatJson::new(&nested_schema(), false, None).is_none());
        let decoded = decode_json_lines(&s, None, bytes, lines, false);
        let halved = decode_lines(bytes, lines, |c| decode_json_rows(&s, bytes, c, false));
        assert_same_decoding(&decoded, &halved);
        let good: Vec<usize> = decoded.0.iter().flat_map(|(_, n)| n.clone()).collect();
        assert_eq!(good, vec![1, 2, 3, 5, 6, 7, 15, 16]);
        let bad: Vec<usize> = decoded.1.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(bad, vec![4, 8, 9, 10, 11, 12, 13, 14]);
        let strict = decode_json_lines(&s, None, bytes, lines, true);
        let halved = decode_lines(bytes, lines, |c| decode_json_rows(&s, bytes, c, true));
        assert_same_decoding(&strict, &halved);
    }

    /// The plain UTC form is read by the shortcut, at the edges of its range too; other forms
    /// are left to the general parser.
    #[test]
    fn plain_utc_timestamps_take_the_shortcut() {
        use arrow::datatypes::TimeUnit;
        let field = Field::new("t", DataType::Timestamp(TimeUnit::Microsecond, None), true);
        let tz = zone(None).unwrap();
        for text in [
            "2026-04-30T23:59:59.895Z",
            "2024-02-29T00:00:00",
            "1969-12-31T23:59:59.999999999Z",
            "1678-01-01T00:00:00Z",
            "2261-12-31T23:59:59.1Z",
            "2000-03-01T12:30:00.000001",
            "2000-02-29T00:00:00Z",
        ] {
            let taken = plain_utc_timestamp(text, TimeUnit::Microsecond);
            assert!(taken.is_some(), "{text}");
            assert_eq!(
                taken.ok_or(()),
                timestamp(text, &field, &tz, TimeUnit::Microsecond).map_err(|_| ()),
                "{text}"
            );
        }
        for text in [
            "2026-04-30 23:59:59Z",
            "2026-02-29T00:00:00Z",
            "2026-04-30T24:00:00Z",
            "2026-04-30T23:59:60Z",
            "2026-04-30T23:59:59.1234567890Z",
            "2026-04-30T23:59:59+01:00",
            "2026-04-30",
            "1677-12-31T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2026-04-31T00:00:00Z",
        ] {
            assert_eq!(
                plain_utc_timestamp(text, TimeUnit::Microsecond),
                None,
                "{text}"
            );
        }
    }

    /// Rows decoded apart go back between each other in line order, slicing a batch where rows
    /// of the other fall inside it, whichever list comes first.
    #[test]
    fn pieces_are_merged_in_line_order() {
        let piece = |numbers: &[usize]| {
            let ids: Vec<i64> = numbers.iter().map(|n| *n as i64).collect();
            let batch = RecordBatch::try_new(
                Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)])),
                vec![Arc::new(arrow::array::Int64Array::from(ids))],
            )
            .unwrap();
            (batch, numbers.to_vec())
        };
        let numbers = |out: &[(RecordBatch, Vec<usize>)]| -> Vec<Vec<usize>> {
            out.iter().map(|(_, n)| n.clone()).collect()
        };
        let out = merge_pieces(
            vec![piece(&[1, 2, 5, 6]), piece(&[9])],
            vec![piece(&[0]), piece(&[3]), piece(&[7]), piece(&[10])],
        );
        let expected = vec![
            vec![0],
            vec![1, 2],
            vec![3],
            vec![5, 6],
            vec![7],
            vec![9],
            vec![10],
        ];
        assert_eq!(numbers(&out), expected);
        let swapped = merge_pieces(
            vec![piece(&[0]), piece(&[3]), piece(&[7]), piece(&[10])],
            vec![piece(&[1, 2, 5, 6]), piece(&[9])],
        );
        assert_eq!(numbers(&swapped), expected);
        let long = merge_pieces(
            vec![piece(&[1, 4, 5, 8, 9])],
            vec![piece(&[2, 3, 6]), piece(&[7, 10])],
        );
        assert_eq!(
            numbers(&long),
            vec![
                vec![1],
                vec![2, 3],
                vec![4, 5],
                vec![6],
                vec![7],
                vec![8, 9],
                vec![10]
            ]
        );
        for (batch, numbers) in out.iter().chain(&swapped).chain(&long) {
            let ids: Vec<usize> = batch
                .column(0)
                .as_primitive::<Int64Type>()
                .values()
                .iter()
                .map(|n| *n as usize)
                .collect();
            assert_eq!(&ids, numbers, "a row moved away from its line number");
        }
        assert_eq!(merge_pieces(vec![piece(&[1, 2])], Vec::new()).len(), 1);
        assert_eq!(merge_pieces(Vec::new(), vec![piece(&[1, 2])]).len(), 1);
        // Pieces without rows (a run none of whose lines one path read) are dropped.
        let with_empty = merge_pieces(vec![piece(&[])], vec![piece(&[1, 2])]);
        assert_eq!(numbers(&with_empty), vec![vec![1, 2]]);
        let with_empty = merge_pieces(
            vec![piece(&[]), piece(&[2]), piece(&[])],
            vec![piece(&[1, 3]), piece(&[])],
        );
        assert_eq!(numbers(&with_empty), vec![vec![1], vec![2], vec![3]]);
        let with_empty = merge_pieces(vec![piece(&[]), piece(&[2])], Vec::new());
        assert_eq!(numbers(&with_empty), vec![vec![2]]);
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

    #[derive(Debug, Clone, Copy)]
    enum Kind {
        Float,
        Boolean,
        Timestamp,
    }

    /// A JSON value for a column of `kind`: good ones, quoted ones, bad ones, null — with
    /// whether the per-row conversion takes it where Arrow's decoder does not.
    fn value_of(kind: Kind) -> proptest::strategy::BoxedStrategy<(String, bool)> {
        use proptest::prelude::*;
        let number = "-?[0-9]{1,6}(\\.[0-9]{1,4})?([eE][+-]?[0-9]{1,2})?";
        let plain = |s: BoxedStrategy<String>| s.prop_map(|v| (v, false)).boxed();
        let bad = plain(
            prop_oneof![
                "\"x[a-z ]{0,4}\"".boxed(),
                Just("{}".to_string()).boxed(),
                Just("[1]".to_string()).boxed(),
            ]
            .boxed(),
        );
        let null = plain(Just("null".to_string()).boxed());
        match kind {
            Kind::Float => prop_oneof![
                plain(number.boxed()),
                plain(number.prop_map(|n| format!("\"{n}\"")).boxed()),
                plain(Just("true".to_string()).boxed()),
                bad,
                null,
            ]
            .boxed(),
            Kind::Boolean => prop_oneof![
                plain(prop_oneof![Just("true".to_string()), Just("false".to_string())].boxed()),
                prop_oneof![Just("\"true\"".to_string()), Just("\"false\"".to_string())]
                    .prop_map(|v| (v, true))
                    .boxed(),
                plain(Just("1".to_string()).boxed()),
                bad,
                null,
            ]
            .boxed(),
            Kind::Timestamp => prop_oneof![
                plain(
                    "\"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])([T ][01][0-9]:[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]0[0-9]:[03]0)?)?\""
                        .boxed()
                ),
                plain("-?[0-9]{1,13}(\\.[0-9]{1,3})?".boxed()),
                "-?[0-9]{1,13}"
                    .prop_map(|n| (format!("\"{n}\""), true))
                    .boxed(),
                plain(Just("true".to_string()).boxed()),
                bad,
                null,
            ]
            .boxed(),
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
                proptest::strategy::Just("\"amount\"".to_string()),
                proptest::strategy::Just("\"ts\"".to_string()),
                proptest::strategy::Just("\"ok\"".to_string()),
                proptest::strategy::Just("\"2026-11-01T10:00:05Z\"".to_string()),
                "-?[0-9]{1,25}(\\.[0-9]{1,5})?(e[+-]?[0-9]{1,4})?",
                "\"[^\"\\\\]{0,8}(\\\\u[0-9a-fA-F]{4})?\"",
                proptest::strategy::Just("null".to_string()),
                proptest::strategy::Just("true".to_string()),
            ], 0..60),
        ) {
            exercise(tokens.concat().as_bytes());
        }

        /// The per-row conversions give what Arrow's own typed decoders give: a line both
        /// accept decodes to the same row; a line only one accepts is a quoted number in a
        /// timestamp column or a quoted boolean (which the conversions take on purpose), or a
        /// number beyond its float column, which Arrow makes infinity and the conversions
        /// refuse on purpose.
        #[test]
        fn fuzz_conversions_agree_with_arrows_decoders(
            f in value_of(Kind::Float),
            g in value_of(Kind::Float),
            b in value_of(Kind::Boolean),
            t in value_of(Kind::Timestamp),
            z in value_of(Kind::Timestamp),
        ) {
            use arrow::datatypes::TimeUnit;
            let schema: SchemaRef = Arc::new(Schema::new(vec![
                Field::new("f", DataType::Float64, true),
                Field::new("g", DataType::Float32, false),
                Field::new("b", DataType::Boolean, true),
                Field::new("t", DataType::Timestamp(TimeUnit::Millisecond, None), true),
                Field::new("z", DataType::Timestamp(TimeUnit::Second, Some("+02:00".into())), true),
            ]));
            let line = format!(
                r#"{{"f":{},"g":{},"b":{},"t":{},"z":{}}}"#,
                f.0, g.0, b.0, t.0, z.0
            );
            let mut arrow = arrow::json::ReaderBuilder::new(Arc::clone(&schema))
                .with_coerce_primitive(true)
                .build_decoder()
                .unwrap();
            let arrows = feed(&mut arrow, format!("{line}\n").as_bytes())
                .and_then(|()| arrow.flush().map_err(|e| e.to_string()));
            let lines = [Line { number: 1, start: 0, end: line.len() }];
            let ours = decode_json(&schema, line.as_bytes(), &lines, false);
            let taken_on_purpose = [&f, &g, &b, &t, &z].iter().any(|v| v.1);
            match (arrows, ours) {
                (Ok(Some(theirs)), Ok(ours)) => proptest::prop_assert_eq!(theirs, ours, "{}", line),
                (Err(_), Ok(_)) => proptest::prop_assert!(taken_on_purpose, "only we take {}", line),
                (Ok(Some(theirs)), Err(e)) if e.contains("is beyond the range of column") => {
                    let infinite = (0..2).any(|c| {
                        let column = theirs.column(c);
                        (0..column.len()).any(|row| match column.data_type() {
                            DataType::Float64 => column
                                .as_primitive::<arrow::datatypes::Float64Type>()
                                .value(row)
                                .is_infinite(),
                            _ => column
                                .as_primitive::<arrow::datatypes::Float32Type>()
                                .value(row)
                                .is_infinite(),
                        })
                    });
                    proptest::prop_assert!(infinite, "refused {} ({}), Arrow's is finite", line, e);
                }
                (Ok(_), Err(e)) => proptest::prop_assert!(false, "only Arrow takes {}: {}", line, e),
                (Err(_), Err(_)) | (Ok(None), _) => {}
            }
        }

        /// Lines of records with values of every kind, some cut short: sorting the lines first
        /// gives what halving alone gives, row for row and reason for reason.
        #[test]
        fn fuzz_records_decode_the_same_either_way(
            records in proptest::collection::vec(
                (
                    value_of(Kind::Float),
                    value_of(Kind::Timestamp),
                    value_of(Kind::Boolean),
                    -5i64..5,
                    0usize..40,
                ),
                0..40,
            ),
        ) {
            let mut text = String::new();
            for (amount, ts, ok, id, cut) in records {
                let line = format!(
                    r#"{{"id":{id},"amount":{},"ts":{},"ok":{},"name":"n{id}"}}"#,
                    amount.0, ts.0, ok.0
                );
                // One line in eight is cut short.
                let line = if cut < 5 { &line[..line.len() * cut / 5] } else { &line[..] };
                text.push_str(line);
                text.push('\n');
            }
            exercise(text.as_bytes());
        }

        /// CSV lines of numbers, booleans and timestamps — good, bad, empty, quoted, with too
        /// few or too many fields: the check agrees with the reader on the record's shape, and
        /// the per-row conversions give what Arrow's typed CSV reader gives, line by line.
        #[test]
        fn fuzz_csv_conversions_agree_with_arrows_reader(
            i in proptest::prop_oneof![4 => "-?[0-9]{1,6}", 1 => "[0-9]\\.5", 1 => "x[a-z]{0,3}", 1 => ""],
            f in proptest::prop_oneof![4 => "-?[0-9]{1,4}(\\.[0-9]{1,3})?([eE]-?[0-9])?", 1 => "x[a-z]{0,3}", 1 => ""],
            b in "(true|false|TRUE|False|yes|1|)",
            t in proptest::prop_oneof![
                4 => "20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])([T ][01][0-9]:[0-5][0-9]:[0-5][0-9](Z|[+-]0[0-9]:00)?)?",
                1 => "[0-9]{10}",
                1 => "",
            ],
            extra in proptest::prop_oneof![
                6 => proptest::strategy::Just(None),
                1 => proptest::strategy::Just(Some(String::new())),
                1 => proptest::strategy::Strategy::prop_map("\"[a-z,]{0,3}(\"\")?[a-z]{0,2}\"", Some),
            ],
            drop_last in proptest::prop_oneof![8 => proptest::strategy::Just(false), 1 => proptest::strategy::Just(true)],
        ) {
            let mut fields = vec![i, f, b, t];
            fields.extend(extra);
            if drop_last {
                fields.pop();
            }
            use arrow::datatypes::TimeUnit;
            let schema: SchemaRef = Arc::new(Schema::new(vec![
                Field::new("i", DataType::Int64, true),
                Field::new("f", DataType::Float64, true),
                Field::new("b", DataType::Boolean, true),
                Field::new("t", DataType::Timestamp(TimeUnit::Millisecond, Some("+02:00".into())), true),
            ]));
            let line = fields.join(",");
            let lines = [Line { number: 1, start: 0, end: line.len() }];
            let as_text: SchemaRef = Arc::new(Schema::new(
                (0..4).map(|i| Field::new(format!("c{i}"), DataType::Utf8, true)).collect::<Vec<_>>(),
            ));
            let one_record = |schema: &SchemaRef| -> std::result::Result<RecordBatch, String> {
                let mut reader = arrow::csv::ReaderBuilder::new(Arc::clone(schema))
                    .with_header(false)
                    .build_decoder();
                reader.decode(format!("{line}\n").as_bytes()).map_err(|e| e.to_string())?;
                let batch = reader.flush().map_err(|e| e.to_string())?.ok_or("no record")?;
                (batch.num_rows() == 1).then_some(batch).ok_or_else(|| "rows".to_string())
            };
            proptest::prop_assert_eq!(
                is_one_csv_record(line.as_bytes(), b',', 4),
                one_record(&as_text).is_ok(),
                "{}", line
            );
            let theirs = one_record(&schema);
            let ours = decode_csv(&schema, b',', line.as_bytes(), &lines).and_then(|rows| {
                match rows.bad_rows.is_empty() {
                    true => Ok(rows.batch),
                    false => Err(rows.bad_rows[0].1.clone()),
                }
            });
            match (theirs, ours) {
                (Ok(theirs), Ok(ours)) => proptest::prop_assert_eq!(theirs, ours, "{}", line),
                (Err(_), Err(_)) => {}
                (theirs, ours) => proptest::prop_assert!(false, "{}: Arrow {:?}, ours {:?}", line, theirs.err(), ours.err()),
            }
        }

        /// The CSV check agrees with the reader on lines of quotes, delimiters, line breaks and
        /// broken UTF-8: a line it passes the reader reads as one record of the schema's width;
        /// a line without line breaks it passes exactly then (and if UTF-8 on its own).
        #[test]
        fn fuzz_csv_check_agrees_with_the_reader(
            line in proptest::collection::vec(
                proptest::sample::select(vec![b'"', b',', b'\r', b'\n', b' ', b'a', b'b', 0xC3, 0xA9]),
                0..12,
            ),
            fields in 1usize..4,
        ) {
            let as_text: SchemaRef = Arc::new(Schema::new(
                (0..fields).map(|i| Field::new(format!("c{i}"), DataType::Utf8, true)).collect::<Vec<_>>(),
            ));
            let mut reader = arrow::csv::ReaderBuilder::new(as_text)
                .with_header(false)
                .build_decoder();
            let mut text = line.clone();
            text.push(b'\n');
            let one_record = feed_csv(&mut reader, &text).is_ok()
                && reader.flush().is_ok_and(|b| b.is_some_and(|b| b.num_rows() == 1));
            let utf8 = std::str::from_utf8(&line).is_ok();
            let passes = is_one_csv_record(&line, b',', fields);
            let line_break = line.iter().any(|b| matches!(b, b'\r' | b'\n'));
            // What passes is one record to the reader; without line breaks, the converse too.
            proptest::prop_assert!(!passes || one_record && utf8, "{:?}", String::from_utf8_lossy(&line));
            proptest::prop_assert!(
                line_break || passes == (one_record && utf8),
                "{:?}", String::from_utf8_lossy(&line)
            );
        }

        /// The check before decoding agrees with the decoder on single almost-JSON lines: what
        /// it passes decodes, what it stops does not (nothing may go the slow way unnoticed).
        #[test]
        fn fuzz_object_check_agrees_with_the_decoder(
            tokens in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just("{".to_string()),
                proptest::strategy::Just("}".to_string()),
                proptest::strategy::Just("[".to_string()),
                proptest::strategy::Just("]".to_string()),
                proptest::strategy::Just(",".to_string()),
                proptest::strategy::Just(":".to_string()),
                proptest::strategy::Just(" ".to_string()),
                proptest::strategy::Just("\"k\"".to_string()),
                "-?[0-9]{1,5}(\\.[0-9]{1,3})?([eE][+-]?[0-9]{1,2})?",
                "\"([^\"\\\\]|\\\\[\"\\\\/bfnrtux]|\\\\u[0-9a-fA-F]{4}){0,4}\"",
                proptest::strategy::Just("null".to_string()),
                proptest::strategy::Just("true".to_string()),
                proptest::strategy::Just("fals".to_string()),
                proptest::strategy::Just("false".to_string()),
                proptest::strategy::Just("\t".to_string()),
                proptest::strategy::Just("\r".to_string()),
            ], 0..24),
        ) {
            let line = format!("{{{}", tokens.concat()).replace('\n', " ");
            let no_columns: SchemaRef = Arc::new(Schema::empty());
            let lines = [Line { number: 1, start: 0, end: line.len() }];
            let decodes = decode_json(&no_columns, line.as_bytes(), &lines, false).is_ok();
            proptest::prop_assert_eq!(is_one_json_object(line.as_bytes()), decodes, "{}", line);
        }

        /// Mending a line's surrogate pairs changes no parse failure: into a text column, a
        /// line Arrow's decoder refuses is refused with the same reason once mended, and a
        /// line it takes is still taken. (What depends on the decoded text may differ — a
        /// value quoted in a reason, a key matched under strict decoding: the mend's point.)
        #[test]
        fn fuzz_mended_lines_fail_as_the_originals_fail(
            pieces in proptest::collection::vec(proptest::prop_oneof![
                "\\\\ud[89ab][0-9a-f]{2}",
                "\\\\ud[c-f][0-9a-f]{2}",
                "\\\\u[0-9a-f]{0,4}",
                "\\\\[\"\\\\nqx]",
                "[a\"{}:, ]",
            ], 0..10),
        ) {
            let line = format!("{{\"a\":\"{}\"}}", pieces.concat());
            let arrow = |bytes: &[u8]| {
                let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Utf8, true)]));
                let mut decoder = arrow::json::ReaderBuilder::new(schema).build_decoder().unwrap();
                feed(&mut decoder, bytes)
                    .and_then(|()| feed(&mut decoder, b"\n"))
                    .and_then(|()| decoder.flush().map_err(|e| e.to_string()))
                    .map(|_| ())
            };
            if let Some(mended) = surrogate_pairs_as_utf8(line.as_bytes()) {
                proptest::prop_assert_eq!(arrow(line.as_bytes()), arrow(&mended), "{}", line);
            }
        }

        /// Any text, written as JSON in ASCII (every other character `\\u`-escaped, outside the
        /// Basic Multilingual Plane as a surrogate pair, in either case of hex digit), reads
        /// back as itself, by the one-pass reader and by Arrow's decoder alike.
        #[test]
        fn fuzz_escaped_text_reads_back_as_itself(
            texts in proptest::collection::vec(
                (proptest::arbitrary::any::<String>(), proptest::arbitrary::any::<bool>()),
                1..8,
            ),
        ) {
            let mut file = String::new();
            for (text, upper) in &texts {
                let mut escaped = String::new();
                for c in text.chars() {
                    match c {
                        ' '..='~' if c != '"' && c != '\\' => escaped.push(c),
                        _ => {
                            for unit in c.encode_utf16(&mut [0; 2]) {
                                match upper {
                                    true => escaped.push_str(&format!("\\u{unit:04X}")),
                                    false => escaped.push_str(&format!("\\u{unit:04x}")),
                                }
                            }
                        }
                    }
                }
                file.push_str(&format!("{{\"id\":1,\"ok\":true,\"name\":\"{escaped}\"}}\n"));
            }
            let bytes = file.as_bytes();
            let lines = split_lines(bytes);
            let lines = &lines[..lines.len() - 1];
            let expected: Vec<&str> = texts.iter().map(|(t, _)| t.as_str()).collect();
            for schema in [flat_schema(), nested_schema()] {
                let (good, bad) = decode_json_lines(&schema, None, bytes, lines, false);
                proptest::prop_assert!(bad.is_empty(), "{:?}", bad);
                let names = arrow::compute::concat(
                    &good.iter().map(|(b, _)| b.column(1).as_ref()).collect::<Vec<_>>(),
                ).unwrap();
                let names = arrow::compute::cast(&names, &DataType::Utf8).unwrap();
                let names: Vec<&str> = names.as_string::<i32>().iter().flatten().collect();
                proptest::prop_assert_eq!(&names, &expected, "{}", file);
            }
        }

        /// Flat and almost-flat objects — keys in and out of order, repeated, escaped, unknown;
        /// values of every kind, escaped strings, nested ones; commas dropped or doubled;
        /// whitespace — read in one pass where they can be, decode to what decoding every line
        /// with Arrow's decoder gives, row for row and reason for reason.
        #[test]
        fn fuzz_flat_objects_read_as_the_decoder_reads_them(
            records in proptest::collection::vec(
                proptest::collection::vec(
                    (
                        proptest::prop_oneof![
                            proptest::strategy::Just("id"),
                            proptest::strategy::Just("name"),
                            proptest::strategy::Just("amount"),
                            proptest::strategy::Just("ts"),
                            proptest::strategy::Just("ok"),
                            proptest::strategy::Just("tags"),
                            proptest::strategy::Just("other"),
                            proptest::strategy::Just("na\\u006de"),
                        ],
                        proptest::prop_oneof![
                            "-?[0-9]{1,6}(\\.[0-9]{1,3})?([eE][+-]?[0-9]{1,2})?",
                            "\"([a-zé 0-9:T-]|\\\\[\"\\\\/bfnrtux]|\\\\u[0-9a-fA-F]{4}|\\\\ud[89ab][0-9a-f]{2}\\\\ud[c-f][0-9a-f]{2}){0,6}\"",
                            "\"20[0-9]{2}-0[1-9]-[0-2][1-9]T[01][0-9]:00:00(\\.[0-9]{3})?Z?\"",
                            proptest::strategy::Just("true".to_string()),
                            proptest::strategy::Just("false".to_string()),
                            proptest::strategy::Just("null".to_string()),
                            proptest::strategy::Just("{}".to_string()),
                            proptest::strategy::Just("[1,\"a\"]".to_string()),
                            proptest::strategy::Just("tru".to_string()),
                        ],
                        proptest::prop_oneof![
                            6 => proptest::strategy::Just(","),
                            1 => proptest::strategy::Just(" , "),
                            1 => proptest::strategy::Just(""),
                            1 => proptest::strategy::Just(",,"),
                        ],
                    ),
                    0..7,
                ),
                0..24,
            ),
        ) {
            let mut text = String::new();
            for members in records {
                text.push('{');
                let last = members.len().saturating_sub(1);
                for (i, (key, value, comma)) in members.iter().enumerate() {
                    text.push_str(&format!("\"{key}\":{value}"));
                    if i < last {
                        text.push_str(comma);
                    }
                }
                text.push_str("}\n");
            }
            exercise(text.as_bytes());
        }

        /// Plain UTC timestamps, good and bad (days past a month's end, leap days, hour 24,
        /// second 60, long fractions, other zones, years at the edges), in every unit: where
        /// the shortcut reads one, it gives what the general reading gives.
        #[test]
        fn fuzz_plain_timestamps_read_as_the_general_parser_reads_them(
            text in proptest::prop_oneof![
                "(1[6-9]|2[0-2])[0-9]{2}-(0[1-9]|1[0-2]|00|13)-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-4]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]{1,10})?Z?",
                "(1[6-9]|2[0-3])[0-9]{2}-[01][0-9]-[0-3][0-9][T ][0-2][0-9]:[0-6][0-9]:[0-6][0-9](\\.[0-9]{0,11})?(Z|z|\\+01:00|)",
            ],
        ) {
            use arrow::datatypes::TimeUnit;
            let field = Field::new("t", DataType::Timestamp(TimeUnit::Nanosecond, None), true);
            let tz = zone(None).unwrap();
            for unit in [TimeUnit::Second, TimeUnit::Millisecond, TimeUnit::Microsecond, TimeUnit::Nanosecond] {
                if let Some(units) = plain_utc_timestamp(&text, unit) {
                    proptest::prop_assert_eq!(Ok(units), timestamp(&text, &field, &tz, unit), "{}", text);
                }
            }
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
