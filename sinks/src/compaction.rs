//! Compaction by copy: a partition's small files rewritten into larger ones by splicing their
//! encoded row groups into one file, without decoding or encoding a single value.
//!
//! delta-rs's optimize reads every row of the files it compacts and encodes it again: for a
//! stateless job that doubled the cost of each row written (Nexmark q0 over Parquet files:
//! 1.15 s of a 2.95 s run went to one compaction). Sluice's files are already encoded as it
//! wants them ([`crate::parquet_write`]: Snappy, bounded dictionaries, row groups of 128 Ki
//! rows), so a compacted file is the same row groups one after another: the same pages,
//! encodings, Parquet statistics, page indexes and bloom filters, at the cost of reading and
//! writing the bytes.
//!
//! ## What a compacted file is
//! - The small files of one partition, in commit order, packed into files of at most the
//!   target size; consecutive files whose Parquet schema (or Arrow schema, as written in the
//!   file) differs — a column added between them — go to different files.
//! - Its `add` (`dataChange = false`) carries the merge of its inputs' Delta statistics:
//!   record and null counts summed, bounds the least and greatest of theirs, a bound no input
//!   gives for a column (and not all nulls there) left out, as unknown.
//! - The `remove`s of its inputs (`dataChange = false`) and its `add` go in one commit of
//!   operation OPTIMIZE.
//!
//! ## When it is not taken
//! On tables whose protocol asks more of a writer than plain appends
//! ([`plain_for_append`]: deletion vectors, row tracking, column mapping, constraints,
//! invariants…) the caller falls back to delta-rs's optimize, which knows them.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake::kernel::{Action, Add, LogicalFileView};
use deltalake::parquet::bloom_filter::Sbbf;
use deltalake::parquet::column::writer::ColumnCloseResult;
use deltalake::parquet::errors::ParquetError;
use deltalake::parquet::file::metadata::{
    KeyValue, PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader,
};
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::parquet::file::writer::SerializedFileWriter;
use deltalake::protocol::DeltaOperation;
use deltalake::{DeltaResult, DeltaTable, ObjectStore, Path};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use object_store::buffered::BufWriter;
use serde_json::{Map, Value};
use tokio::io::AsyncWriteExt;

use crate::parquet_write::plain_for_append;

/// The Arrow schema Arrow writers put in a Parquet file's key-value metadata.
const ARROW_SCHEMA_KEY: &str = "ARROW:schema";

/// Footers fetched at once when planning a compaction.
const FOOTERS_AT_ONCE: usize = 8;

/// Bytes first fetched from the end of a file for its footer (more if the footer is larger).
const FOOTER_GUESS: u64 = 64 * 1024;

/// What one compaction did: files removed and added.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copied {
    pub(crate) files_removed: u64,
    pub(crate) files_added: u64,
}

/// Compacts the files of `partition` (its column values) in `table` smaller than half of
/// `target` bytes into files of at most `target` bytes by copying their row groups, and commits
/// the result through `table`'s log store with `properties`. None when the table's protocol
/// leaves it to delta-rs's optimize (see the module docs).
pub(crate) async fn compact_by_copy(
    table: &DeltaTable,
    partition: &[(String, Option<String>)],
    target: u64,
    properties: CommitProperties,
) -> DeltaResult<Option<Copied>> {
    if !plain_for_append(table) {
        return Ok(None);
    }
    let snapshot = table.snapshot()?;
    let mut small: Vec<LogicalFileView> = snapshot
        .log_data()
        .iter()
        .filter(|file| {
            u64::try_from(file.size()).unwrap_or(u64::MAX) < target / 2
                && file.deletion_vector_descriptor().is_none()
                && in_partition(file, partition)
        })
        .collect();
    // Commit order (the order rows arrived in, so each file keeps its rows' event times close).
    small.sort_by(|a, b| (a.modification_time(), a.path()).cmp(&(b.modification_time(), b.path())));
    let store = table.object_store();
    let located: Vec<(Path, u64)> = small
        .iter()
        .map(|f| (f.object_store_path(), u64::try_from(f.size()).unwrap_or(0)))
        .collect();
    let footers: Vec<ParquetMetaData> = futures::stream::iter(located)
        .map(|(path, size)| {
            let store = Arc::clone(&store);
            async move { footer(store.as_ref(), &path, size).await }
        })
        .buffered(FOOTERS_AT_ONCE)
        .try_collect()
        .await?;
    let sizes: Vec<u64> = small
        .iter()
        .map(|f| u64::try_from(f.size()).unwrap_or(0))
        .collect();
    let kinds: Vec<FileKind<'_>> = footers.iter().map(FileKind::of).collect();

    let mut actions = Vec::new();
    let mut done = Copied::default();
    for bin in bins(&sizes, &kinds, target) {
        let inputs = &small[bin.clone()];
        let add = copy_into_one_file(&store, inputs, &footers[bin.start]).await?;
        actions.extend(
            inputs
                .iter()
                .map(|f| Action::Remove(f.remove_action(false))),
        );
        actions.push(Action::Add(add));
        done.files_removed += inputs.len() as u64;
        done.files_added += 1;
    }
    if actions.is_empty() {
        return Ok(Some(done));
    }
    let operation = DeltaOperation::Optimize {
        predicate: None,
        target_size: i64::try_from(target).unwrap_or(i64::MAX),
    };
    CommitBuilder::from(properties)
        .with_actions(actions)
        .build(Some(snapshot), table.log_store(), operation)
        .await?;
    Ok(Some(done))
}

/// The footer (Parquet metadata, without page indexes) of the file at `path` of `size` bytes.
async fn footer(store: &dyn ObjectStore, path: &Path, size: u64) -> DeltaResult<ParquetMetaData> {
    let mut suffix = FOOTER_GUESS.min(size);
    loop {
        let bytes = store.get_range(path, size - suffix..size).await?;
        let mut reader = ParquetMetaDataReader::new();
        match reader.try_parse_sized(&bytes, size) {
            Ok(()) => return Ok(reader.finish()?),
            Err(ParquetError::NeedMoreData(needed))
                if (needed as u64) > suffix && suffix < size =>
            {
                suffix = (needed as u64).min(size);
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// Whether `file` holds rows of `partition` (all its partition values, exactly).
fn in_partition(file: &LogicalFileView, partition: &[(String, Option<String>)]) -> bool {
    let values: BTreeMap<String, Option<String>> =
        file.partition_values_map().into_iter().collect();
    values.len() == partition.len()
        && partition
            .iter()
            .all(|(column, value)| values.get(column) == Some(value))
}

/// What files must share to be copied into one: their Parquet schema and the Arrow schema
/// written beside it.
#[derive(Debug, PartialEq)]
struct FileKind<'a> {
    schema: &'a deltalake::parquet::schema::types::Type,
    arrow_schema: Option<&'a str>,
}

impl<'a> FileKind<'a> {
    fn of(footer: &'a ParquetMetaData) -> Self {
        let metadata = footer.file_metadata();
        FileKind {
            schema: metadata.schema(),
            arrow_schema: arrow_schema(metadata.key_value_metadata()),
        }
    }
}

fn arrow_schema(metadata: Option<&Vec<KeyValue>>) -> Option<&str> {
    metadata?
        .iter()
        .find(|kv| kv.key == ARROW_SCHEMA_KEY)
        .and_then(|kv| kv.value.as_deref())
}

/// The files (index ranges, in order) that go into one compacted file each: consecutive files
/// of one kind whose sizes add up to at most `target` (a file alone is left as it is).
fn bins<K: PartialEq>(sizes: &[u64], kinds: &[K], target: u64) -> Vec<std::ops::Range<usize>> {
    let mut bins = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for i in 0..=sizes.len() {
        let fits = i < sizes.len()
            && i > start
            && kinds[i] == kinds[start]
            && bytes.saturating_add(sizes[i]) <= target;
        if i == sizes.len() || (i > start && !fits) {
            if i - start >= 2 {
                bins.push(start..i);
            }
            (start, bytes) = (i, 0);
        }
        if i < sizes.len() {
            bytes = bytes.saturating_add(sizes[i]);
        }
    }
    bins
}

/// Writes the row groups of `inputs` (of one kind, `first` the footer of the first) into one new
/// file beside the first, and returns its `add`. Each input is fetched whole in turn and its
/// bytes go out before the next is fetched, so the copy holds about one input file.
async fn copy_into_one_file(
    store: &Arc<dyn ObjectStore>,
    inputs: &[LogicalFileView],
    first: &ParquetMetaData,
) -> DeltaResult<Add> {
    let first_path = inputs[0].object_store_path();
    let folder: Path = first_path
        .parts()
        .take(first_path.parts().count() - 1)
        .collect();
    let path = folder.join(format!(
        "part-00000-{}-c000.snappy.parquet",
        uuid::Uuid::new_v4()
    ));
    let key_value = first.file_metadata().key_value_metadata().cloned();
    let properties = WriterProperties::builder()
        .set_created_by(format!(
            "sluice {} (compaction by copy)",
            env!("CARGO_PKG_VERSION")
        ))
        .set_key_value_metadata(key_value)
        .build();
    let root = first.file_metadata().schema_descr().root_schema_ptr();
    let mut writer = SerializedFileWriter::new(Vec::new(), root, Arc::new(properties))?;
    let mut out = BufWriter::new(Arc::clone(store), path.clone());
    let mut size = 0u64;
    for input in inputs {
        let bytes: Bytes = store.get(&input.object_store_path()).await?.bytes().await?;
        append_row_groups(&mut writer, &bytes)?;
        writer.flush()?;
        let written = std::mem::take(writer.inner_mut());
        size += written.len() as u64;
        out.write_all(&written).await?;
    }
    let footer = writer.into_inner()?;
    size += footer.len() as u64;
    out.write_all(&footer).await?;
    out.shutdown().await?;

    let stats: Vec<Option<String>> = inputs.iter().map(LogicalFileView::stats).collect();
    Ok(Add {
        path: path.to_string(),
        partition_values: inputs[0].partition_values_map(),
        size: i64::try_from(size).unwrap_or(i64::MAX),
        modification_time: chrono::Utc::now().timestamp_millis(),
        data_change: false,
        stats: merged_stats(&stats),
        tags: None,
        deletion_vector: None,
        base_row_id: None,
        default_row_commit_version: None,
        clustering_provider: None,
    })
}

/// Appends every row group of the Parquet file `bytes` to `writer`, copying its column chunks
/// (with their page indexes and bloom filters) as they are.
fn append_row_groups(writer: &mut SerializedFileWriter<Vec<u8>>, bytes: &Bytes) -> DeltaResult<()> {
    let metadata = ParquetMetaDataReader::new()
        .with_page_index_policy(PageIndexPolicy::Optional)
        .parse_and_finish(bytes)?;
    let column_indexes = metadata.column_index();
    let offset_indexes = metadata.offset_index();
    for (g, group) in metadata.row_groups().iter().enumerate() {
        let mut out = writer.next_row_group()?;
        for (c, column) in group.columns().iter().enumerate() {
            let result = ColumnCloseResult {
                bytes_written: u64::try_from(column.compressed_size()).unwrap_or(0),
                rows_written: u64::try_from(group.num_rows()).unwrap_or(0),
                metadata: column.clone(),
                bloom_filter: Sbbf::read_from_column_chunk(column, bytes).ok().flatten(),
                column_index: column_indexes.and_then(|i| i.get(g)?.get(c).cloned()),
                offset_index: offset_indexes.and_then(|i| i.get(g)?.get(c).cloned()),
            };
            out.append_column(bytes, result)?;
        }
        out.close()?;
    }
    Ok(())
}

/// The Delta statistics of a file holding the rows of files with statistics `inputs`: record
/// and null counts summed, each bound the least (`minValues`) or greatest (`maxValues`) of the
/// inputs'. A column's bound is left out when an input lacks it and does not hold only nulls
/// there; a count is left out when an input lacks it. None if an input has no statistics.
pub(crate) fn merged_stats(inputs: &[Option<String>]) -> Option<String> {
    let parsed: Vec<Map<String, Value>> = inputs
        .iter()
        .map(|s| serde_json::from_str::<Map<String, Value>>(s.as_deref()?).ok())
        .collect::<Option<_>>()?;
    let records: Vec<i64> = parsed
        .iter()
        .map(|s| s.get("numRecords")?.as_i64())
        .collect::<Option<_>>()?;
    let leaves = |key: &str| -> Vec<BTreeMap<Vec<String>, Value>> {
        parsed
            .iter()
            .map(|s| {
                let mut leaves = BTreeMap::new();
                if let Some(value) = s.get(key) {
                    flatten(value, &mut Vec::new(), &mut leaves);
                }
                leaves
            })
            .collect()
    };
    let (nulls, mins, maxes) = (
        leaves("nullCount"),
        leaves("minValues"),
        leaves("maxValues"),
    );

    let mut merged = Map::new();
    merged.insert(
        "numRecords".into(),
        Value::from(records.iter().sum::<i64>()),
    );
    // A count, where every input has it.
    let mut null_count = BTreeMap::new();
    for path in nulls.first().map(|n| n.keys()).into_iter().flatten() {
        let counts: Option<Vec<i64>> = nulls.iter().map(|n| n.get(path)?.as_i64()).collect();
        if let Some(counts) = counts {
            null_count.insert(path.clone(), Value::from(counts.iter().sum::<i64>()));
        }
    }
    // Whether input `i` holds only nulls in the column at `path`.
    let all_null = |i: usize, path: &Vec<String>| {
        nulls[i].get(path).and_then(Value::as_i64) == Some(records[i])
    };
    for (key, sides, least) in [("minValues", &mins, true), ("maxValues", &maxes, false)] {
        let paths: std::collections::BTreeSet<&Vec<String>> =
            sides.iter().flat_map(|s| s.keys()).collect();
        let mut bounds = BTreeMap::new();
        'path: for path in paths {
            let mut bound: Option<&Value> = None;
            for (i, side) in sides.iter().enumerate() {
                let Some(value) = side.get(path) else {
                    if all_null(i, path) {
                        continue;
                    }
                    continue 'path;
                };
                bound = match bound {
                    None => Some(value),
                    Some(kept) => match compare(value, kept) {
                        Some(order) if (order.is_lt() == least) && order.is_ne() => Some(value),
                        Some(_) => Some(kept),
                        None => continue 'path,
                    },
                };
            }
            if let Some(bound) = bound {
                bounds.insert(path.clone(), bound.clone());
            }
        }
        merged.insert(key.into(), unflatten(bounds));
    }
    merged.insert("nullCount".into(), unflatten(null_count));
    // Bounds copied from the inputs are as tight as theirs.
    let tight: Option<Vec<bool>> = parsed
        .iter()
        .map(|s| s.get("tightBounds")?.as_bool())
        .collect();
    if let Some(tight) = tight {
        merged.insert("tightBounds".into(), Value::from(tight.iter().all(|t| *t)));
    }
    serde_json::to_string(&Value::Object(merged)).ok()
}

/// The leaves of a statistics object (a value per column, nested as structs are) by path.
fn flatten(value: &Value, path: &mut Vec<String>, leaves: &mut BTreeMap<Vec<String>, Value>) {
    match value {
        Value::Object(fields) => {
            for (name, value) in fields {
                path.push(name.clone());
                flatten(value, path, leaves);
                path.pop();
            }
        }
        leaf if !path.is_empty() => {
            leaves.insert(path.clone(), leaf.clone());
        }
        _ => {}
    }
}

/// The statistics object of `leaves` (the inverse of [`flatten`]).
fn unflatten(leaves: BTreeMap<Vec<String>, Value>) -> Value {
    fn insert(node: &mut Map<String, Value>, path: &[String], value: Value) {
        match path {
            [] => {}
            [last] => {
                node.insert(last.clone(), value);
            }
            [first, rest @ ..] => {
                let child = node
                    .entry(first.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(child) = child {
                    insert(child, rest, value);
                }
            }
        }
    }
    let mut root = Map::new();
    for (path, value) in leaves {
        insert(&mut root, &path, value);
    }
    Value::Object(root)
}

/// How two bounds of one column compare: numbers as numbers, timestamps as instants, other
/// text byte by byte (Delta's order for strings); None for bounds that do not compare (a
/// column whose type changed between files).
fn compare(a: &Value, b: &Value) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => match (a.as_i64(), b.as_i64()) {
            (Some(a), Some(b)) => Some(a.cmp(&b)),
            _ => a.as_f64()?.partial_cmp(&b.as_f64()?),
        },
        (Value::String(a), Value::String(b)) => {
            let instant = |s: &str| chrono::DateTime::parse_from_rfc3339(s).ok();
            match (instant(a), instant(b)) {
                (Some(a), Some(b)) => Some(a.cmp(&b)),
                _ => Some(a.as_bytes().cmp(b.as_bytes())),
            }
        }
        (Value::Bool(a), Value::Bool(b)) => Some(a.cmp(b)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, StructArray,
        TimestampMicrosecondArray,
    };
    use arrow::datatypes::{DataType, Field, Fields, Schema, TimeUnit};
    use deltalake::kernel::StructType;
    use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
    use deltalake::operations::write::SchemaMode;

    /// Rows `from..from + n` of every kind of column Delta keeps statistics for: numbers,
    /// text (some null, some longer than Delta's 32-character prefix), instants, a struct; and
    /// `spare` all null in the first files.
    fn rows(from: i64, n: i64, spare: bool) -> RecordBatch {
        let ids = from..from + n;
        let x = Fields::from(vec![Field::new("x", DataType::Float64, true)]);
        let mut fields = vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
            Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
            Field::new("s", DataType::Struct(x.clone()), true),
            Field::new("spare", DataType::Utf8, true),
        ];
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(
                ids.clone().map(|i| (i * 7919) % 1000 - 300),
            )),
            Arc::new(StringArray::from_iter(ids.clone().map(|i| {
                (i % 5 != 0).then(|| format!("{}-{}", "a long name past thirty-two chars", i % 97))
            }))),
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(
                    ids.clone().map(|i| 1_700_000_000_000_000 + i * 1_500_001),
                )
                .with_timezone("UTC"),
            ),
            Arc::new(StructArray::new(
                x,
                vec![Arc::new(Float64Array::from_iter_values(
                    ids.clone().map(|i| (i as f64) / 3.0 - 10.0),
                ))],
                None,
            )),
            Arc::new(StringArray::from_iter(
                ids.clone().map(|i| spare.then(|| format!("v{i}"))),
            )),
        ];
        if spare && from >= 1000 {
            // A column added to the table after the first files.
            fields.push(Field::new("added", DataType::Int64, true));
            columns.push(Arc::new(Int64Array::from_iter_values(ids)));
        }
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
    }

    async fn table_of(dir: &std::path::Path, appends: &[RecordBatch]) -> DeltaTable {
        let url = url::Url::from_directory_path(dir).unwrap();
        let schema: StructType = appends[0].schema().as_ref().try_into_kernel().unwrap();
        let mut table = DeltaTable::try_from_url(url)
            .await
            .unwrap()
            .create()
            .with_columns(schema.fields().cloned())
            .await
            .unwrap();
        for batch in appends {
            table = table
                .write(vec![batch.clone()])
                .with_schema_mode(SchemaMode::Merge)
                .await
                .unwrap();
        }
        table
    }

    fn adds(table: &DeltaTable) -> Vec<(String, Value)> {
        let mut adds: Vec<(String, Value)> = table
            .snapshot()
            .unwrap()
            .log_data()
            .iter()
            .map(|f| {
                let stats = serde_json::from_str(&f.stats().unwrap()).unwrap();
                (f.path().to_string(), stats)
            })
            .collect();
        adds.sort_by(|a, b| a.0.cmp(&b.0));
        adds
    }

    async fn sorted_rows(table: &DeltaTable) -> Vec<String> {
        use deltalake::datafusion::prelude::SessionContext;
        let ctx = SessionContext::new();
        ctx.register_table("t", table.table_provider().await.unwrap())
            .unwrap();
        let batches = ctx
            .sql("SELECT * FROM t ORDER BY ts")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Four appends copied into one file hold the same rows as before, and the file's Delta
    /// statistics are those delta-rs's optimize computes by reading and writing every row of
    /// the same files (its oracle): the merge of the inputs' statistics loses nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copied_file_holds_the_rows_and_statistics_optimize_writes() {
        let appends = [
            rows(0, 300, false),
            rows(300, 5, false),
            rows(305, 600, true),
            rows(905, 1, true),
        ];
        let (copied_dir, optimized_dir) =
            (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let copied = table_of(copied_dir.path(), &appends).await;
        let optimized = table_of(optimized_dir.path(), &appends).await;
        let before = sorted_rows(&copied).await;

        let done = compact_by_copy(&copied, &[], 1 << 30, CommitProperties::default())
            .await
            .unwrap();
        assert_eq!(
            done,
            Some(Copied {
                files_removed: 4,
                files_added: 1
            })
        );
        let mut copied = copied;
        copied.update_state().await.unwrap();
        let (optimized, metrics) = optimized.optimize().await.unwrap();
        assert_eq!((metrics.num_files_removed, metrics.num_files_added), (4, 1));

        assert_eq!(sorted_rows(&copied).await, before);
        let (copied_adds, optimized_adds) = (adds(&copied), adds(&optimized));
        assert_eq!(copied_adds.len(), 1);
        assert_eq!(copied_adds[0].1, optimized_adds[0].1);
        assert_eq!(copied_adds[0].1["numRecords"], 906);
    }

    /// Files written before a column was added and files written after it go into different
    /// files (their Parquet schemas differ); every row is kept, the old ones null in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn files_of_different_schemas_are_copied_apart() {
        let appends = [
            rows(0, 10, true),
            rows(10, 10, true),
            rows(1000, 10, true),
            rows(1010, 10, true),
            rows(1020, 10, true),
        ];
        let dir = tempfile::tempdir().unwrap();
        let mut table = table_of(dir.path(), &appends).await;
        let before = sorted_rows(&table).await;
        let done = compact_by_copy(&table, &[], 1 << 30, CommitProperties::default())
            .await
            .unwrap();
        assert_eq!(
            done,
            Some(Copied {
                files_removed: 5,
                files_added: 2
            })
        );
        table.update_state().await.unwrap();
        assert_eq!(adds(&table).len(), 2);
        assert_eq!(sorted_rows(&table).await, before);
    }

    #[test]
    fn bins_pack_consecutive_files_of_one_kind_up_to_the_target() {
        let kinds = ['a', 'a', 'a', 'b', 'b', 'a', 'a', 'a'];
        let sizes = [40, 40, 40, 10, 10, 90, 20, 5];
        // 40+40 fit 100, the third does not; b's pair; 90 then 20 does not fit, 20+5 do.
        assert_eq!(bins(&sizes, &kinds, 100), vec![0..2, 3..5, 6..8]);
        assert_eq!(
            bins(&[10], &['a'], 100),
            Vec::<std::ops::Range<usize>>::new()
        );
        assert_eq!(
            bins::<char>(&[], &[], 100),
            Vec::<std::ops::Range<usize>>::new()
        );
        assert_eq!(
            bins(&[60, 60], &['a', 'a'], 100),
            Vec::<std::ops::Range<usize>>::new()
        );
    }

    fn stats(json: serde_json::Value) -> Option<String> {
        Some(json.to_string())
    }

    #[test]
    fn merged_stats_sum_counts_and_keep_the_widest_bounds() {
        let a = stats(serde_json::json!({
            "numRecords": 3,
            "minValues": {"id": 5, "name": "b", "ts": "2024-01-01T00:00:01.500Z", "s": {"x": 1.5}},
            "maxValues": {"id": 9, "name": "d", "ts": "2024-01-01T00:00:02Z", "s": {"x": 2.5}},
            "nullCount": {"id": 0, "name": 1, "ts": 0, "s": {"x": 0}, "gone": 3}
        }));
        let b = stats(serde_json::json!({
            "numRecords": 2,
            "minValues": {"id": -1, "name": "a", "ts": "2024-01-01T00:00:01Z", "s": {"x": 0.5}},
            "maxValues": {"id": 4, "name": "z", "ts": "2024-01-01T00:00:03.25Z", "s": {"x": 0.75}},
            "nullCount": {"id": 0, "name": 0, "ts": 0, "s": {"x": 1}, "gone": 2}
        }));
        let merged: Value = serde_json::from_str(&merged_stats(&[a, b]).unwrap()).unwrap();
        assert_eq!(
            merged,
            serde_json::json!({
                "numRecords": 5,
                "minValues": {"id": -1, "name": "a", "ts": "2024-01-01T00:00:01Z", "s": {"x": 0.5}},
                "maxValues": {"id": 9, "name": "z", "ts": "2024-01-01T00:00:03.25Z", "s": {"x": 2.5}},
                "nullCount": {"id": 0, "name": 1, "ts": 0, "s": {"x": 1}, "gone": 5}
            })
        );
    }

    /// A column one input has no bound for is unknown in the merge — unless that input holds
    /// only nulls there; an input without statistics leaves the merge without any.
    #[test]
    fn merged_stats_leave_out_what_an_input_does_not_know() {
        let a = stats(serde_json::json!({
            "numRecords": 2,
            "minValues": {"id": 1, "note": "x"},
            "maxValues": {"id": 2, "note": "y"},
            "nullCount": {"id": 0, "note": 0}
        }));
        let only_nulls = stats(serde_json::json!({
            "numRecords": 4,
            "minValues": {"id": 0},
            "maxValues": {"id": 7},
            "nullCount": {"id": 0, "note": 4}
        }));
        let merged: Value =
            serde_json::from_str(&merged_stats(&[a.clone(), only_nulls]).unwrap()).unwrap();
        assert_eq!(
            merged["minValues"],
            serde_json::json!({"id": 0, "note": "x"})
        );
        assert_eq!(
            merged["maxValues"],
            serde_json::json!({"id": 7, "note": "y"})
        );

        let unknown = stats(serde_json::json!({
            "numRecords": 4,
            "minValues": {"id": 0},
            "maxValues": {"id": 7},
            "nullCount": {"id": 0, "note": 1}
        }));
        let merged: Value =
            serde_json::from_str(&merged_stats(&[a.clone(), unknown]).unwrap()).unwrap();
        assert_eq!(merged["minValues"], serde_json::json!({"id": 0}));
        assert_eq!(merged["nullCount"], serde_json::json!({"id": 0, "note": 1}));

        assert_eq!(merged_stats(&[a.clone(), None]), None);
        assert_eq!(merged_stats(&[a, Some("not json".into())]), None);
    }
}
