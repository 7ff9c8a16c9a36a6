//! A job's input: its sources opened against the checkpoint, and one range of a source read
//! into rows — decoded, event time parsed, and everything that fails set aside as dead letters.
//!
//! Shared by the live loop ([`crate::driver`]), [`crate::backfill`] and [`crate::reconcile`],
//! so all three see the same rows for the same offsets.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type, Schema, SchemaRef};
use futures::future::try_join_all;

use crate::checkpoint::CheckpointStore;
use crate::dead_letter::{SOURCE_NAME, dead_letter_from_row};
use crate::error::{Error, Result};
use crate::event_time::{
    EventTimeConfig, TOO_FAR_AHEAD, extract_event_time, schema_with_event_time,
};
use crate::job::SourceSpec;
use crate::offsets::{OffsetRange, PartitionId};
use crate::query::{Query, QuerySettings, StreamingQuery};
use crate::sink::{Sink, TableScan};
use crate::source::{
    DeadLetter, PositionForm, SOURCE_OFFSET, SOURCE_PARTITION, SOURCE_POSITION, SOURCE_ROW, Source,
    SourceContext, SourceRead, is_lineage, schema_in_form,
};
use crate::static_table::{StaticTables, TableSpec};

/// One opened source.
pub(crate) struct OpenSource {
    pub(crate) name: String,
    /// Shared with the reads the driver makes ahead of a batch, on tasks of their own.
    pub(crate) source: Arc<dyn Source>,
    pub(crate) event_time: Option<EventTimeConfig>,
    /// The schema the query sees (event-time column already converted); grows when schema
    /// evolution adds columns.
    pub(crate) schema: SchemaRef,
    /// The schema the query was planned over: [`OpenSource::schema`] until it grows; a stateful
    /// query keeps its plan (and state), so its input is conformed back to this. Only the
    /// columns read when the reads are narrowed ([`narrow_reads`]).
    pub(crate) planned: SchemaRef,
    /// The data columns its reads ask for when they are narrowed ([`narrow_reads`]): fewer
    /// than all, or all with positions as numbers; `None`: a plain read of every column.
    pub(crate) read_columns: Option<Vec<String>>,
    /// The form of the positions its narrowed reads give ([`narrow_reads`]): numbers when the
    /// query does not read them. Plain reads, and the reads that make rows whole, give text.
    pub(crate) positions: PositionForm,
}

impl OpenSource {
    /// `schema` (a schema of this source's batches, as read or as the query sees them) with
    /// only the columns its reads return: the data columns read, and the lineage columns (the
    /// position in the form read).
    fn as_read(&self, schema: &SchemaRef) -> SchemaRef {
        match &self.read_columns {
            Some(read) => only_columns(schema, read, self.positions),
            None => Arc::clone(schema),
        }
    }

    /// The rows of `partition` in `range`, with the columns [`OpenSource::read_columns`] names.
    async fn read(&self, partition: &PartitionId, range: OffsetRange) -> Result<SourceRead> {
        let read = read_from(
            self.source.as_ref(),
            self.read_columns.as_deref(),
            self.positions,
            partition,
            range,
        )
        .await?;
        self.narrowed(read)
    }

    /// `rows` (of this source) with their positions as text: a narrowed read's
    /// [`SOURCE_ROW`] numbers become [`SOURCE_POSITION`], in their place, each the source's
    /// prefix for the row's offset ([`Source::position_prefix`]) and the number — the text a
    /// read of every column gives. Rows already in text are returned as they are. For the few
    /// rows bound for a side table (whole records are matched by their position).
    ///
    /// # Errors
    /// If the lineage columns are not as a read gives them, or the source has no prefix.
    pub(crate) async fn with_position_text(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let schema = rows.schema();
        // Rows in text have their position: a `_source_row` beside it is data (a source's
        // schema may grow such a column while its reads give numbers; they then give text).
        let in_numbers = schema.index_of(SOURCE_POSITION).is_err();
        let (PositionForm::Numbers, true, Ok(index)) =
            (self.positions, in_numbers, schema.index_of(SOURCE_ROW))
        else {
            return Ok(rows.clone());
        };
        let numbers = rows.column(index).as_primitive_opt::<Int64Type>();
        let (Some(numbers), Some((partitions, offsets))) = (numbers, partitions_and_offsets(rows))
        else {
            return Err(self.malformed_lineage());
        };
        let prefixes = self.position_prefixes(partitions, offsets).await?;
        let mut text = arrow::array::StringBuilder::with_capacity(rows.num_rows(), 0);
        for row in 0..rows.num_rows() {
            let at = (partitions.value(row), offsets.value(row));
            let prefix = prefixes.get(&at).map_or("", String::as_str);
            text.append_value(format!("{prefix}{}", numbers.value(row)));
        }
        let mut fields: Vec<arrow::datatypes::FieldRef> = schema.fields().iter().cloned().collect();
        fields[index] = Arc::new(arrow::datatypes::Field::new(
            SOURCE_POSITION,
            DataType::Utf8,
            false,
        ));
        let mut columns = rows.columns().to_vec();
        columns[index] = Arc::new(text.finish());
        let schema = Schema::new_with_metadata(fields, schema.metadata().clone());
        Ok(RecordBatch::try_new(Arc::new(schema), columns)?)
    }

    /// `rows` (of this source, read whole with positions as text) with each row's number as
    /// well ([`SOURCE_ROW`], appended), where this source's reads now give numbers: the
    /// position's text less the source's prefix for the row's offset. For the batch whose read
    /// grew the schema: it is read again whole, in text, and given to the query planned again
    /// over the grown schema, whose reads may give numbers. Rows are returned as they are
    /// where the reads give text, or the rows have numbers already.
    ///
    /// # Errors
    /// If the lineage columns are not as a read gives them, or a position is not the source's
    /// prefix and a number (what [`Source::numbers_positions`] promises).
    pub(crate) async fn with_position_numbers(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let schema = rows.schema();
        if self.positions != PositionForm::Numbers || schema.index_of(SOURCE_ROW).is_ok() {
            return Ok(rows.clone());
        }
        let positions = rows
            .column_by_name(SOURCE_POSITION)
            .and_then(|c| c.as_string_opt::<i32>());
        let (Some(positions), Some((partitions, offsets))) =
            (positions, partitions_and_offsets(rows))
        else {
            return Err(self.malformed_lineage());
        };
        let prefixes = self.position_prefixes(partitions, offsets).await?;
        let mut numbers = Vec::with_capacity(rows.num_rows());
        for row in 0..rows.num_rows() {
            let at = (partitions.value(row), offsets.value(row));
            let prefix = prefixes.get(&at).map_or("", String::as_str);
            let position = positions.value(row);
            let number = position
                .strip_prefix(prefix)
                .and_then(|n| n.parse::<i64>().ok());
            let Some(number) = number else {
                return Err(Error::in_source(
                    &self.name,
                    format!("position '{position}' is not '{prefix}' and a row number"),
                ));
            };
            numbers.push(number);
        }
        let mut fields: Vec<arrow::datatypes::FieldRef> = schema.fields().iter().cloned().collect();
        fields.push(Arc::new(arrow::datatypes::Field::new(
            SOURCE_ROW,
            DataType::Int64,
            false,
        )));
        let mut columns = rows.columns().to_vec();
        columns.push(Arc::new(Int64Array::from(numbers)));
        let schema = Schema::new_with_metadata(fields, schema.metadata().clone());
        Ok(RecordBatch::try_new(Arc::new(schema), columns)?)
    }

    fn malformed_lineage(&self) -> Error {
        Error::in_source(&self.name, "a read's lineage columns are malformed")
    }

    /// The source's position prefix ([`Source::position_prefix`]) of each partition and offset
    /// among the rows of these lineage columns, asked once each.
    async fn position_prefixes<'a>(
        &self,
        partitions: &'a StringArray,
        offsets: &Int64Array,
    ) -> Result<HashMap<(&'a str, i64), String>> {
        let mut prefixes = HashMap::new();
        for row in 0..partitions.len() {
            let at = (partitions.value(row), offsets.value(row));
            if let Entry::Vacant(new) = prefixes.entry(at) {
                new.insert(self.source.position_prefix(&at.0.to_string(), at.1).await?);
            }
        }
        Ok(prefixes)
    }

    /// Whether its reads give fewer data columns than the source has (else they are whole
    /// records, narrowed only to give positions as numbers).
    fn reads_fewer_columns(&self) -> bool {
        self.read_columns.as_ref().is_some_and(|read| {
            let data = self.schema.fields().iter();
            read.len() < data.filter(|f| !is_lineage(f.name())).count()
        })
    }

    /// `read` (of [`read_from`] with this source's [`OpenSource::read_columns`]) with only the
    /// columns asked for: a source may give more.
    fn narrowed(&self, mut read: SourceRead) -> Result<SourceRead> {
        if self.read_columns.is_none() {
            return Ok(read);
        }
        for batch in &mut read.batches {
            let schema = self.as_read(&batch.schema());
            if schema.fields().len() < batch.num_columns() {
                let indices: Vec<usize> = schema
                    .fields()
                    .iter()
                    .map(|f| batch.schema().index_of(f.name()))
                    .collect::<std::result::Result<_, _>>()?;
                *batch = batch.project(&indices)?;
            }
        }
        Ok(read)
    }
}

/// The partition and offset columns of rows a read gave, if they are as reads give them.
fn partitions_and_offsets(rows: &RecordBatch) -> Option<(&StringArray, &Int64Array)> {
    let partitions = rows
        .column_by_name(SOURCE_PARTITION)?
        .as_string_opt::<i32>()?;
    let offsets = rows
        .column_by_name(SOURCE_OFFSET)?
        .as_primitive_opt::<Int64Type>()?;
    Some((partitions, offsets))
}

/// The rows of `partition` in `range` of `source`, with only the data `columns` named when it
/// can read only some (`None`: every column) — as the source gives them, before
/// [`OpenSource::narrowed`].
pub(crate) async fn read_from(
    source: &dyn Source,
    columns: Option<&[String]>,
    positions: PositionForm,
    partition: &PartitionId,
    range: OffsetRange,
) -> Result<SourceRead> {
    match columns {
        None => source.read(partition, range).await,
        Some(columns) => {
            source
                .read_columns(partition, range, columns, positions)
                .await
        }
    }
}

/// Reads of one source made ahead of their batch's intent, by partition: the range read and
/// what [`Source::read_ahead`] gave. [`read_source`] takes one only for exactly the range its batch
/// reads.
pub(crate) type ReadsAhead = BTreeMap<PartitionId, (OffsetRange, SourceRead)>;

/// Narrows the reads of the sources that can read only some columns
/// ([`Source::reads_columns`]: Parquet and JSON files) to the columns `query` reads
/// ([`StreamingQuery::columns_read`]), their event-time column and lineage, and plans
/// `definition` again over those columns. Decoding is most of a batch that reads a few of many
/// columns. The rows that go to the dead-letter and late tables, which keep whole
/// records, are read again whole ([`whole_rows`]), and the late table keeps the whole schema.
///
/// A stateless query that does not read [`SOURCE_POSITION`] (its output's lineage is the
/// partition and offset) has it read as numbers ([`PositionForm::Numbers`], where the source
/// can), even when it reads every column: formatting a position for every row was ~15 % of
/// such a query's CPU, and only the rows bound for a side table need one
/// ([`OpenSource::with_position_text`]). A stateful query keeps text: its operators keep
/// lineage in their state and their failed rows. The batch whose read grows a source's schema
/// is read again whole, in text, and given to the query planned again with its numbers
/// ([`OpenSource::with_position_numbers`]).
///
/// The narrower plan is kept only if it runs exactly the plan `query` runs
/// ([`StreamingQuery::runs_as`]): a column the SQL names but the optimizer drops (`WHERE x IS
/// NOT NULL` on a NOT NULL column) fails the second planning, or could name another table's
/// column; then it is planned again with positions as text (the sources that read fewer
/// columns stay narrowed), and failing that every column is read, as before. Returns `query`
/// as it is when no read narrows.
///
/// # Errors
/// If the plan does not optimize.
pub(crate) async fn narrow_reads(
    query: StreamingQuery,
    definition: &Query,
    settings: &QuerySettings,
    sources: &mut [OpenSource],
) -> Result<StreamingQuery> {
    for s in sources.iter_mut() {
        s.read_columns = None;
        s.positions = PositionForm::Text;
        s.planned = Arc::clone(&s.schema);
    }
    let Some(read) = query.columns_read()? else {
        return Ok(query);
    };
    // By source: the data columns read, whether they are fewer than all, the positions' form.
    let mut narrowed: BTreeMap<usize, (Vec<String>, bool, PositionForm)> = BTreeMap::new();
    for (index, s) in sources.iter().enumerate() {
        if !s.source.reads_columns() {
            continue;
        }
        let used = read.get(&s.name);
        let event_time = s.event_time.as_ref().map(|t| t.column.as_str());
        let data: Vec<&String> = s
            .schema
            .fields()
            .iter()
            .map(|f| f.name())
            .filter(|name| !is_lineage(name))
            .collect();
        let columns: Vec<String> = data
            .iter()
            .filter(|name| {
                Some(name.as_str()) == event_time || used.is_some_and(|u| u.contains(**name))
            })
            .map(|name| (*name).clone())
            .collect();
        let numbers = !query.is_stateful()
            && s.source.numbers_positions()
            && s.schema.index_of(SOURCE_POSITION).is_ok()
            && s.schema.index_of(SOURCE_ROW).is_err()
            && !used.is_some_and(|u| u.contains(SOURCE_POSITION));
        let positions = match numbers {
            true => PositionForm::Numbers,
            false => PositionForm::Text,
        };
        let fewer = columns.len() < data.len();
        if fewer || numbers {
            narrowed.insert(index, (columns, fewer, positions));
        }
    }
    // The narrowest first. A query that names the position where the optimizer drops it
    // (`WHERE _source_position IS NOT NULL`) fails that planning: then positions as text.
    let as_text: Narrowing = narrowed
        .iter()
        .filter(|(_, (_, fewer, _))| *fewer)
        .map(|(i, (columns, _, _))| (*i, (columns.clone(), PositionForm::Text)))
        .collect();
    let narrowest: Narrowing = narrowed
        .into_iter()
        .map(|(i, (columns, _, positions))| (i, (columns, positions)))
        .collect();
    let mut tried = vec![narrowest];
    if tried[0] != as_text {
        tried.push(as_text);
    }
    for narrowed in tried {
        if narrowed.is_empty() {
            return Ok(query);
        }
        let mut schemas = Vec::with_capacity(sources.len());
        for (index, s) in sources.iter().enumerate() {
            let schema = match narrowed.get(&index) {
                Some((columns, positions)) => only_columns(&s.schema, columns, *positions),
                None => Arc::clone(&s.schema),
            };
            schemas.push((s.name.clone(), schema));
        }
        let narrow = match StreamingQuery::plan(definition.clone(), &schemas, settings).await {
            Ok(narrow) if narrow.runs_as(&query)? => narrow,
            _ => continue,
        };
        let mut whole = BTreeMap::new();
        for (index, (columns, positions)) in narrowed {
            let s = &mut sources[index];
            let of = s
                .schema
                .fields()
                .iter()
                .filter(|f| !is_lineage(f.name()))
                .count();
            match columns.len() < of {
                true => {
                    tracing::info!(source = %s.name, columns = %columns.join(", "), of, positions = ?positions, "reading only the columns the query uses")
                }
                false => {
                    tracing::info!(source = %s.name, positions = ?positions, "reading every column, the rows' positions as numbers")
                }
            }
            whole.insert(s.name.clone(), Arc::clone(&s.schema));
            s.read_columns = Some(columns);
            s.positions = positions;
            s.planned = s.as_read(&s.schema);
        }
        return Ok(narrow.with_whole_sources(whole));
    }
    tracing::info!(
        "the query names columns its plan does not read: every column of its sources is read"
    );
    Ok(query)
}

/// Narrowed reads by source index: the data columns read and the positions' form.
type Narrowing = BTreeMap<usize, (Vec<String>, PositionForm)>;

/// `schema` (a source's, or a read's) with only the data `columns` and the lineage columns, in
/// its order, the position in `positions`' form ([`schema_in_form`]; [`SOURCE_ROW`] is kept
/// only in the numbers form, which is not chosen for a source with a column of that name).
fn only_columns(schema: &SchemaRef, columns: &[String], positions: PositionForm) -> SchemaRef {
    let numbers = positions == PositionForm::Numbers;
    let kept = schema
        .fields()
        .iter()
        .filter(|f| {
            is_lineage(f.name())
                || (numbers && f.name() == SOURCE_ROW)
                || columns.contains(f.name())
        })
        .cloned()
        .collect::<Vec<_>>();
    let kept = Arc::new(Schema::new_with_metadata(kept, schema.metadata().clone()));
    schema_in_form(&kept, positions)
}

/// Opens every source (with its folder of the checkpoint) and static table, and plans the
/// query over their schemas (recorded in `settings`, for planning again). `validating`: the job is only being checked — sources write nothing and give up on
/// an unreachable service instead of retrying.
pub(crate) async fn open_sources_and_query(
    specs: Vec<SourceSpec>,
    tables: Vec<TableSpec>,
    query: &Query,
    settings: &mut QuerySettings,
    checkpoint: &CheckpointStore,
    validating: bool,
) -> Result<(Vec<OpenSource>, StaticTables, StreamingQuery)> {
    let tables = StaticTables::open(tables).await?;
    let tables = if validating {
        tables
    } else {
        tables.with_snapshots(checkpoint)
    };
    settings.static_tables = tables.schemas().clone();
    let mut sources = Vec::with_capacity(specs.len());
    for spec in specs {
        let mut source = spec.source;
        let ctx = SourceContext {
            name: spec.name.clone(),
            checkpoint: checkpoint.child("sources").child(&spec.name),
            validating,
        };
        let mut schema = source.open(ctx).await?;
        for col in [SOURCE_PARTITION, SOURCE_OFFSET] {
            if schema.index_of(col).is_err() {
                return Err(Error::in_source(
                    &spec.name,
                    format!("its batches lack the column {col}"),
                ));
            }
        }
        if let Some(time) = &spec.event_time {
            schema = schema_with_event_time(&schema, &time.column)
                .map_err(|e| Error::in_source(&spec.name, e))?;
        }
        sources.push(OpenSource {
            name: spec.name,
            source: Arc::from(source),
            event_time: spec.event_time,
            planned: Arc::clone(&schema),
            schema,
            read_columns: None,
            positions: PositionForm::Text,
        });
    }
    let schemas: Vec<(String, SchemaRef)> = sources
        .iter()
        .map(|s| (s.name.clone(), Arc::clone(&s.schema)))
        .collect();
    let query = plan_query(query, &schemas, settings, &sources).await?;
    Ok((sources, tables, query))
}

/// Plans the job's query over the sources' schemas, a planning error explained in the job's
/// terms.
pub(crate) async fn plan_query(
    query: &Query,
    schemas: &[(String, SchemaRef)],
    settings: &QuerySettings,
    sources: &[OpenSource],
) -> Result<StreamingQuery> {
    StreamingQuery::plan(query.clone(), schemas, settings)
        .await
        .map_err(|e| explain_plan_error(e, query, sources))
}

/// What DataFusion appends to an internal error; a type mismatch in a user's query is not a
/// bug in DataFusion, and the text sends the user to the wrong place.
const DATAFUSION_BUG_TEXT: &str = "This issue was likely caused by a bug in DataFusion's code";

/// A planning error in the job's terms: DataFusion's "file a bug" text removed, and for each
/// column whose type was inferred that the error (or else the query, for a text column) names:
/// that it was inferred, as what, from which sample, and how to declare it.
fn explain_plan_error(error: Error, query: &Query, sources: &[OpenSource]) -> Error {
    let Error::DataFusion(inner) = &error else {
        return error;
    };
    let mut message = inner.to_string();
    if let Some(at) = message.find(DATAFUSION_BUG_TEXT) {
        message.truncate(at);
    }
    let message = message.trim_end().trim_end_matches('.').to_string();
    // Inferred columns as the query sees them (not the event-time column, which is parsed).
    let inferred: Vec<(&str, crate::source::InferredColumn, String)> = sources
        .iter()
        .filter_map(|s| Some((s, s.source.schema_inference()?)))
        .flat_map(|(s, inference)| {
            inference
                .columns
                .into_iter()
                .filter(|c| {
                    s.schema
                        .field_with_name(&c.name)
                        .is_ok_and(|f| f.data_type().to_string() == c.data_type)
                })
                .map(move |c| (s.name.as_str(), c, inference.sample.clone()))
        })
        .collect();
    let mentions = |text: &str, name: &str| {
        text.match_indices(name).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + name.len()..].chars().next();
            let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            !word(before) && !word(after)
        })
    };
    let mut named: Vec<_> = inferred
        .iter()
        .filter(|(_, c, _)| mentions(&message, &c.name))
        .collect();
    // A type error that names no column (`Cannot coerce … Utf8 * Int64`): the text columns
    // the query uses.
    // (A query built in Rust has no text to search.)
    let text = query.sql().map(str::to_string).unwrap_or_default();
    if named.is_empty() && message.contains("Utf8") {
        named = inferred
            .iter()
            .filter(|(_, c, _)| c.data_type == "Utf8" && mentions(&text, &c.name))
            .collect();
    }
    let mut out = message;
    for (source, column, sample) in named {
        out.push_str(&format!(
            ". Column '{name}' of source '{source}' was not declared: it was inferred from \
             {sample} as: {column}. Declare its type in the job file ([sources.{source}] \
             schema = \"{name} DOUBLE, …\", every column listed), or convert it in the query \
             (CAST({name} AS DOUBLE))",
            name = column.name,
        ));
    }
    Error::Query(out)
}

/// `rows` in `schema`, a schema it extends: columns picked by name, struct columns' fields too
/// (recursively, also in lists); what `schema` lacks is dropped.
///
/// # Errors
/// If a column of `schema` is missing from `rows` or has another type.
pub(crate) fn conform(rows: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    fn conform_array(array: &ArrayRef, to: &DataType) -> Result<ArrayRef> {
        match (array.data_type(), to) {
            (from, to) if from == to => Ok(Arc::clone(array)),
            (DataType::Struct(_), DataType::Struct(fields)) => {
                let array = array.as_struct();
                let children = fields
                    .iter()
                    .map(|f| {
                        let child = array.column_by_name(f.name()).ok_or_else(|| {
                            Error::InvalidJob(format!("the struct has no field {}", f.name()))
                        })?;
                        conform_array(child, f.data_type())
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Arc::new(arrow::array::StructArray::try_new(
                    fields.clone(),
                    children,
                    array.nulls().cloned(),
                )?))
            }
            (DataType::List(_), DataType::List(item)) => {
                let array = array.as_list::<i32>();
                let values = conform_array(array.values(), item.data_type())?;
                Ok(Arc::new(arrow::array::ListArray::try_new(
                    Arc::clone(item),
                    array.offsets().clone(),
                    values,
                    array.nulls().cloned(),
                )?))
            }
            (from, to) => Err(Error::InvalidJob(format!(
                "a column of type {from} cannot be read as {to}"
            ))),
        }
    }
    let columns = schema
        .fields()
        .iter()
        .map(|f| {
            let column = rows.column_by_name(f.name()).ok_or_else(|| {
                Error::InvalidJob(format!("the rows have no column {}", f.name()))
            })?;
            conform_array(column, f.data_type())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(rows.num_rows())),
    )?)
}

/// Where a row came from: partition, offset and position (`file.json:17`, or `partition@offset`
/// where there is nothing finer) — the same triple a dead letter records.
type RowKey = (String, i64, String);

/// How a read judges event times that lie too far ahead (see [`crate::event_time`]).
#[derive(Debug, Clone)]
pub(crate) enum FutureTimes {
    /// A live batch: against the clock recorded in its intent (µs since the epoch).
    Clock(i64),
    /// A replay of committed offsets (backfill, reconcile): exactly as the live job judged
    /// them — the rows its dead-letter table lists as too far ahead, with the reason it gave.
    AsRecorded(Arc<HashMap<RowKey, String>>),
}

impl FutureTimes {
    /// The live job's judgement of `source`'s rows, read from its dead-letter table (only the
    /// rows it judged too far ahead).
    ///
    /// # Errors
    /// If the table cannot be read.
    pub(crate) async fn as_recorded_by(sink: &dyn Sink, source: &str) -> Result<FutureTimes> {
        let scan = TableScan {
            columns: None,
            filter: Some(format!(
                "{SOURCE_NAME} = '{}' AND starts_with(error, '{TOO_FAR_AHEAD}')",
                source.replace('\'', "''")
            )),
        };
        FutureTimes::recorded(&sink.read_dead_letters(&scan).await?, source)
    }

    /// The live job's judgement, from its dead-letter table's rows of `source`.
    ///
    /// # Errors
    /// If the rows lack the dead-letter columns.
    fn recorded(dead_letters: &[RecordBatch], source: &str) -> Result<FutureTimes> {
        let mut rows = HashMap::new();
        for b in dead_letters {
            let column = |name: &str, to: &DataType| table_column(b, name, to, "dead-letter");
            let (names, partitions, positions, errors) = (
                column(SOURCE_NAME, &DataType::Utf8)?,
                column(SOURCE_PARTITION, &DataType::Utf8)?,
                column(SOURCE_POSITION, &DataType::Utf8)?,
                column("error", &DataType::Utf8)?,
            );
            let offsets = column(SOURCE_OFFSET, &DataType::Int64)?;
            let (names, partitions, positions, errors) = (
                names.as_string::<i32>(),
                partitions.as_string::<i32>(),
                positions.as_string::<i32>(),
                errors.as_string::<i32>(),
            );
            let offsets = offsets.as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                if names.value(i) == source && errors.value(i).starts_with(TOO_FAR_AHEAD) {
                    let key = (
                        partitions.value(i).to_string(),
                        offsets.value(i),
                        positions.value(i).to_string(),
                    );
                    rows.insert(key, errors.value(i).to_string());
                }
            }
        }
        Ok(FutureTimes::AsRecorded(Arc::new(rows)))
    }
}

/// Column `name` of rows read back from the `table` table, cast to `to` (strings read back from
/// a table may come as views).
///
/// # Errors
/// If the column is missing or does not cast.
pub(crate) fn table_column(
    batch: &RecordBatch,
    name: &str,
    to: &DataType,
    table: &str,
) -> Result<ArrayRef> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| Error::InvalidJob(format!("the {table} table has no column {name}")))?;
    Ok(arrow::compute::kernels::cast::cast(column, to)?)
}

/// Rows of one source as the query sees them, with what became dead letters.
pub(crate) struct SourceRows {
    /// The rows, in the source's query schema (event time parsed), as the read produced them:
    /// the partitions' batches in partition and offset order, never copied into one batch (that
    /// copy was a pass over the whole input on one thread, and its memory came on top of what
    /// the read had allocated).
    pub(crate) rows: Vec<RecordBatch>,
    /// What could not be decoded or had no usable event time.
    pub(crate) dead_letters: Vec<DeadLetter>,
    /// The source's query schema, if schema evolution grew it during this read.
    pub(crate) grown: Option<SchemaRef>,
}

/// Reads every range of one source (partitions concurrently), parses event time, and returns
/// the rows (the reads' batches, in order) plus the dead letters. A range `ahead` holds (read
/// before the batch's intent, exactly this range) is taken from it instead of read again. If
/// schema evolution grew the source's schema during the read (or since a read ahead), ranges
/// read before it grew are read again, so all rows come in the grown schema.
pub(crate) async fn read_source(
    s: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
    future: &FutureTimes,
    mut ahead: ReadsAhead,
) -> Result<SourceRows> {
    let ranges: Vec<(&PartitionId, &OffsetRange)> =
        ranges.iter().filter(|(_, r)| !r.is_empty()).collect();
    let reading = try_join_all(ranges.iter().map(|(p, r)| {
        let read_ahead = ahead
            .remove(*p)
            .filter(|(read_range, _)| read_range == *r)
            .map(|(_, read)| s.narrowed(read));
        if read_ahead.is_some() {
            tracing::debug!(source = %s.name, partition = %p, range = %r, "taken from the read ahead");
        }
        async move {
            match read_ahead {
                Some(read) => read,
                None => s.read(p, **r).await,
            }
        }
    }));
    // What is left was read for a range this batch does not read.
    drop(ahead);
    let mut reads = reading.await?;
    let mut query_schema = Arc::clone(&s.schema);
    if let Some(mut current) = s.source.current_schema().await {
        // Bounded: every pass that finds a stale read follows a growth of the schema. Reads
        // made again with the schema in force, which did not grow meanwhile, are as fresh as
        // they get (a data column named like the internal `_source_row` keeps a numbers read
        // from ever matching: the batch is then read again whole, below).
        for _ in 0..MAX_REREADS {
            let as_read = s.as_read(&current);
            let stale: Vec<usize> = (0..reads.len())
                .filter(|&i| reads[i].batches.iter().any(|b| b.schema() != as_read))
                .collect();
            if stale.is_empty() {
                break;
            }
            for i in stale {
                let (p, r) = ranges[i];
                reads[i] = s.read(p, *r).await?;
            }
            let now = s.source.current_schema().await;
            match now {
                Some(now) if now != current => current = now,
                _ => break,
            }
        }
        query_schema = match &s.event_time {
            Some(time) => schema_with_event_time(&current, &time.column)
                .map_err(|e| Error::in_source(&s.name, e))?,
            None => current,
        };
    }
    // A grown schema has the query planned again, and it may read other columns than these
    // reads did: this batch is read again with every column.
    let narrowed = s.read_columns.is_some() && query_schema == s.schema;
    if s.read_columns.is_some() && !narrowed {
        reads = try_join_all(ranges.iter().map(|(p, r)| s.source.read(p, **r))).await?;
    }
    let clock = match future {
        FutureTimes::Clock(clock) => Some(*clock),
        FutureTimes::AsRecorded(_) => None,
    };
    let mut letters = Vec::new();
    // Rows of narrowed reads without a usable event time: where in `letters` each goes, once
    // read again whole.
    let mut no_time: Vec<(usize, RecordBatch, String)> = Vec::new();
    let mut batches = Vec::new();
    for read in reads {
        letters.extend(read.dead_letters);
        for batch in read.batches {
            let Some(time) = &s.event_time else {
                batches.push(batch);
                continue;
            };
            let (parsed, mut bad) = extract_event_time(&batch, time, clock)
                .map_err(|e| Error::in_source(&s.name, e))?;
            if let FutureTimes::AsRecorded(recorded) = future
                && !recorded.is_empty()
            {
                // Keyed by the positions' text (as the dead-letter table records them).
                let keyed = s.with_position_text(&batch).await?;
                for row in 0..batch.num_rows() {
                    if let Some(reason) = recorded.get(&row_key(&keyed, row))
                        && !bad.iter().any(|b| b.row == row)
                    {
                        bad.push(crate::event_time::BadEventTime {
                            row,
                            reason: reason.clone(),
                        });
                    }
                }
                bad.sort_by_key(|b| b.row);
            }
            if bad.is_empty() {
                batches.push(parsed);
                continue;
            }
            let mut keep = vec![true; batch.num_rows()];
            for b in &bad {
                keep[b.row] = false;
                let row = batch.slice(b.row, 1);
                match narrowed && s.reads_fewer_columns() {
                    true => no_time.push((letters.len(), row, b.reason.clone())),
                    // Whole already; its position as text.
                    false => {
                        let row = s.with_position_text(&row).await?;
                        letters.push(dead_letter_from_row(&row, &b.reason)?);
                    }
                }
            }
            batches.push(filter_record_batch(&parsed, &keep.into())?);
        }
    }
    if !no_time.is_empty() {
        let narrow: Vec<&RecordBatch> = no_time.iter().map(|(_, row, _)| row).collect();
        let narrow = concat_batches(&narrow[0].schema(), narrow)?;
        let narrow = s.with_position_text(&narrow).await?;
        let whole = whole_rows(s, &narrow, false).await?;
        // From the last, so each goes in where it was found among the others.
        for (i, ((at, _, reason), whole)) in no_time.iter().zip(whole).enumerate().rev() {
            let letter = match whole {
                Some(whole) => dead_letter_from_row(&whole, reason)?,
                None => dead_letter_from_row(
                    &narrow.slice(i, 1),
                    &format!("{reason} ({NOT_READ_WHOLE})"),
                )?,
            };
            letters.insert(*at, letter);
        }
    }
    let as_read = match narrowed {
        true => s.as_read(&query_schema),
        false => Arc::clone(&query_schema),
    };
    let mut rows = batches
        .into_iter()
        .map(|b| in_schema(&as_read, b))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::in_source(&s.name, format!("its reads disagree on the schema: {e}")))?;
    rows.retain(|b| b.num_rows() > 0);
    let grown = (query_schema != s.schema).then_some(query_schema);
    Ok(SourceRows {
        rows,
        dead_letters: letters,
        grown,
    })
}

/// `batch` under `schema`: its columns taken by position, as Arrow's `concat_batches` took
/// them when a source's batches were still copied into one (names, nullability and metadata
/// may differ; the number of columns and their types may not).
///
/// # Errors
/// If the columns differ in number or type, naming both schemas.
fn in_schema(
    schema: &SchemaRef,
    batch: RecordBatch,
) -> std::result::Result<RecordBatch, arrow::error::ArrowError> {
    if batch.schema() == *schema {
        return Ok(batch);
    }
    let types_match = batch.num_columns() == schema.fields().len()
        && batch
            .columns()
            .iter()
            .zip(schema.fields())
            .all(|(c, f)| c.data_type() == f.data_type());
    if !types_match {
        return Err(arrow::error::ArrowError::SchemaError(format!(
            "expected {}, a read gave {}",
            schema_summary(schema),
            schema_summary(&batch.schema())
        )));
    }
    let rows = batch.num_rows();
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        batch.columns().to_vec(),
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(rows)),
    )
}

/// `name type, …` of a schema's columns.
fn schema_summary(schema: &SchemaRef) -> String {
    schema
        .fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `batches` as one batch (for backfill and reconcile, which take one batch per source),
/// built column by column, each column of the inputs released once it is copied.
fn concat_consuming(
    schema: &SchemaRef,
    batches: Vec<RecordBatch>,
) -> std::result::Result<RecordBatch, arrow::error::ArrowError> {
    if let [only] = batches.as_slice()
        && only.schema() == *schema
    {
        return Ok(only.clone());
    }
    if batches
        .iter()
        .any(|b| b.schema().fields() != schema.fields())
    {
        // Let Arrow name the difference.
        return concat_batches(schema, &batches);
    }
    let rows = batches.iter().map(RecordBatch::num_rows).sum();
    let mut columns: Vec<Vec<ArrayRef>> = (0..schema.fields().len())
        .map(|i| batches.iter().map(|b| Arc::clone(b.column(i))).collect())
        .collect();
    drop(batches);
    let mut out = Vec::with_capacity(columns.len());
    for parts in &mut columns {
        let refs: Vec<&dyn Array> = parts.iter().map(AsRef::as_ref).collect();
        out.push(if refs.is_empty() {
            arrow::array::new_empty_array(schema.field(out.len()).data_type())
        } else {
            arrow::compute::concat(&refs)?
        });
        parts.clear();
    }
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        out,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(rows)),
    )
}

/// How many times a read is repeated because another partition's read grew the schema.
const MAX_REREADS: usize = 8;

/// [`read_source`] for commands that read committed offsets over the schema they opened with
/// (backfill, reconcile): a schema grown during the read means the job's input holds columns
/// these commands' query was not planned with.
///
/// # Errors
/// If the schema grew during the read, asking to run the command again.
pub(crate) async fn read_source_as_opened(
    s: &OpenSource,
    ranges: &BTreeMap<PartitionId, OffsetRange>,
    future: &FutureTimes,
) -> Result<(RecordBatch, Vec<DeadLetter>)> {
    let read = read_source(s, ranges, future, ReadsAhead::new()).await?;
    if read.grown.is_some() {
        return Err(Error::in_source(
            &s.name,
            "schema evolution added columns while this command read it; run the command again \
             (it then opens the source with them)",
        ));
    }
    let rows = concat_consuming(&s.schema, read.rows)
        .map_err(|e| Error::in_source(&s.name, format!("its reads disagree on the schema: {e}")))?;
    Ok((rows, read.dead_letters))
}

/// What a dead letter's reason says of a record [`whole_rows`] could not read again whole.
pub(crate) const NOT_READ_WHOLE: &str =
    "only the columns the query reads are kept: the record could not be read again whole";

/// The whole records of `rows` — rows of `s` as its narrowed reads gave them, lineage
/// included — one single-row batch each, in their order, read again with every column: the
/// offsets they came from are read again one at a time (so one offset's rows are in memory at
/// once, cut to those asked for), and each row found by its partition, offset and position.
/// `as_queried`: with the event-time column parsed, as the query sees rows (else as the
/// source gives them).
///
/// `None` for a record the second read does not give back (its file could not be read whole:
/// a column the query does not read is corrupt); the caller keeps the columns that were read,
/// saying so ([`NOT_READ_WHOLE`]).
pub(crate) async fn whole_rows(
    s: &OpenSource,
    rows: &RecordBatch,
    as_queried: bool,
) -> Result<Vec<Option<RecordBatch>>> {
    // Matched by the positions' text, as a read of every column gives them.
    let rows = &s.with_position_text(rows).await?;
    let keys: Vec<RowKey> = (0..rows.num_rows()).map(|r| row_key(rows, r)).collect();
    // (partition, offset) → position → the rows asking for it.
    let mut wanted: BTreeMap<(&str, i64), HashMap<&str, Vec<usize>>> = BTreeMap::new();
    for (i, (partition, offset, position)) in keys.iter().enumerate() {
        let at = wanted.entry((partition.as_str(), *offset)).or_default();
        at.entry(position.as_str()).or_default().push(i);
    }
    let mut whole: Vec<Option<RecordBatch>> = vec![None; keys.len()];
    for ((partition, offset), positions) in &wanted {
        let read = s
            .source
            .read(
                &partition.to_string(),
                OffsetRange::new(*offset, offset + 1),
            )
            .await?;
        for batch in read.batches {
            let mut picks: Vec<u32> = Vec::new();
            let mut asking: Vec<&[usize]> = Vec::new();
            let named = batch
                .column_by_name(SOURCE_POSITION)
                .and_then(|c| c.as_string_opt::<i32>());
            for row in 0..batch.num_rows() {
                // Without a position column, an offset is one record (`row_key`'s `p@o`).
                let position = match named {
                    Some(column) => positions.get(column.value(row)),
                    None => positions.values().next(),
                };
                if let Some(rows) = position {
                    picks.push(row as u32);
                    asking.push(rows);
                }
            }
            if picks.is_empty() {
                continue;
            }
            let picks = arrow::array::UInt32Array::from(picks);
            let picked = arrow::compute::take_record_batch(&batch, &picks)?;
            let picked = match (&s.event_time, as_queried) {
                (Some(time), true) => {
                    extract_event_time(&picked, time, None)
                        .map_err(|e| Error::in_source(&s.name, e))?
                        .0
                }
                _ => picked,
            };
            for (k, rows) in asking.iter().enumerate() {
                for &i in *rows {
                    whole[i] = Some(picked.slice(k, 1));
                }
            }
        }
    }
    let missing = whole.iter().filter(|w| w.is_none()).count();
    if missing > 0 {
        tracing::warn!(source = %s.name, rows = missing, "{NOT_READ_WHOLE}");
    }
    Ok(whole)
}

/// `rows` (one row each, of source `s`) with the rows of its narrowed reads made whole
/// ([`whole_rows`], as the query sees rows); the rows an operator made (a failed group or
/// pair, offset -1), which carry no record, stay as they are. Returns the indices of the rows
/// that could not be read again whole (they keep the columns read, their positions as text:
/// see [`NOT_READ_WHOLE`]).
pub(crate) async fn make_whole(s: &OpenSource, rows: &mut [RecordBatch]) -> Result<Vec<usize>> {
    if s.read_columns.is_none() {
        return Ok(Vec::new());
    }
    let read: Vec<usize> = (0..rows.len())
        .filter(|&i| rows[i].schema() == s.planned && row_key(&rows[i], 0).1 >= 0)
        .collect();
    if read.is_empty() {
        return Ok(Vec::new());
    }
    let narrow = concat_batches(&s.planned, read.iter().map(|&i| &rows[i]))?;
    let narrow = s.with_position_text(&narrow).await?;
    if !s.reads_fewer_columns() {
        // Every column read (positions as numbers): whole already.
        for (k, &i) in read.iter().enumerate() {
            rows[i] = narrow.slice(k, 1);
        }
        return Ok(Vec::new());
    }
    let whole = whole_rows(s, &narrow, true).await?;
    let mut not_whole = Vec::new();
    for (k, (&i, whole)) in read.iter().zip(whole).enumerate() {
        match whole {
            Some(whole) => rows[i] = whole,
            None => {
                rows[i] = narrow.slice(k, 1);
                not_whole.push(i);
            }
        }
    }
    Ok(not_whole)
}

/// The key of row `row` of a source batch, as [`dead_letter_from_row`] would record it.
fn row_key(batch: &RecordBatch, row: usize) -> RowKey {
    let string = |name: &str| {
        batch
            .column_by_name(name)
            .and_then(|c| c.as_string_opt::<i32>())
            .filter(|c| !c.is_null(row))
            .map(|c| c.value(row).to_string())
    };
    let partition = string(SOURCE_PARTITION).unwrap_or_default();
    let offset = batch
        .column_by_name(SOURCE_OFFSET)
        .and_then(|c| c.as_primitive_opt::<Int64Type>())
        .map_or(0, |c| c.value(row));
    let position = string(SOURCE_POSITION).unwrap_or_else(|| format!("{partition}@{offset}"));
    (partition, offset, position)
}
