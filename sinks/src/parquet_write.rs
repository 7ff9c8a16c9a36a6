//! How Sluice encodes the Parquet files of its Delta tables: the writer settings every write
//! uses, and the parallel encode of a large append.
//!
//! ## Writer settings
//! Snappy (cheap to encode and decode; what Delta and Spark write by default), dictionaries
//! with a bounded page ([`DICTIONARY_PAGE_BYTES`]), row groups of [`ROW_GROUP_ROWS`], and
//! Parquet's default statistics (chunk and page min/max: readers prune on them, and delta-rs
//! builds each file's Delta statistics — the `stats` of each `add`, on the first 32 columns
//! unless the table says otherwise — from them). They cost about a tenth of a passthrough's CPU
//! (Nexmark q0: 2.36 → 2.11 s without them), kept for the files Delta readers can skip.
//!
//! ## Parallel encode
//! Encoding Parquet is the most expensive step of a stateless batch, and one writer is one
//! thread. An append whose rows hold at least 2 × [`MIN_ARROW_BYTES_PER_WRITER`] of Arrow
//! memory is cut into contiguous row ranges, one per core (each at least
//! [`MIN_ARROW_BYTES_PER_WRITER`]), each encoded by its own writer on its own blocking thread into its own
//! files; their `add` actions go into the batch's one commit. A smaller batch stays one writer
//! and one file, so a streaming job's small batches do not make more small files. Rows keep
//! their order within each file, and the files of a commit cover the rows in order.
//!
//! An append with rows is encoded here ([`encode_parallel`], one writer for a small batch) with
//! delta-rs's [`RecordBatchWriter`], and its `add` actions committed by the sink: delta-rs's
//! `write` operation plans and runs a DataFusion plan for each append and reads its commit
//! back, about 2 ms of CPU a commit (Nexmark q2, by profile). That writer checks types and
//! nullability but not what some table features demand of a writer (CHECK constraints,
//! invariants, generated or identity columns, column mapping, row tracking). So this path is
//! taken only on tables whose protocol asks nothing more of an append ([`plain_for_append`]),
//! and only when the batch adds no columns and its types go into the table's without loss
//! ([`casts_losslessly`]); everything else goes through delta-rs's `write` operation, which
//! enforces constraints and refuses truncating casts.

use std::num::NonZeroU64;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema};
use deltalake::DeltaTable;
use deltalake::kernel::Add;
use deltalake::kernel::schema::cast::cast_record_batch;
use deltalake::parquet::basic::Compression;
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::table::config::TablePropertiesExt;
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use deltalake::{DeltaResult, DeltaTableError};
use sluice_engine::memory::batch_bytes;
use sluice_engine::sink::row_groups;

/// Rows per Parquet row group in the files Sluice writes.
///
/// A Parquet writer holds its open row group encoded in memory until the group is full: at the
/// library default of about a million rows, a backfill (or any large batch) held a row group of
/// 20 MB or more beside the rows it was reading. 128 Ki rows keeps that to a few megabytes,
/// while groups stay large enough for scans to read efficiently (DuckDB writes 122,880).
pub(crate) const ROW_GROUP_ROWS: usize = 128 * 1024;

/// Bytes a column's dictionary may reach in a row group before the column falls back to plain
/// encoding.
///
/// At the library default (1 MiB) a column of unique 8-byte values (ids, timestamps) fills the
/// dictionary just as a 128 Ki-row group ends, so it never falls back and costs ~25 % more than
/// plain: files grew 36 % on the backfill benchmark. At 256 KiB such a column falls back after
/// 32 Ki values, and low-cardinality columns (pages, countries, codes) keep their dictionaries:
/// files are within 5 % of the million-row groups'.
pub(crate) const DICTIONARY_PAGE_BYTES: usize = 256 * 1024;

/// The least Arrow memory (rows as the query produced them) one writer of a parallel append
/// encodes: an append is split only from twice this size, 64 MiB, so files stay tens of
/// megabytes of Arrow each and a streaming job's ordinary batches stay one file each. (A batch
/// of 460 K Nexmark bids, `compare.py`'s, is just over it: on two cores, two files of ~6.6 MB
/// of Parquet.)
pub(crate) const MIN_ARROW_BYTES_PER_WRITER: usize = 32 * 1024 * 1024;

/// How Sluice's writes (appends, merges, replacements, the rewrites of deletes) encode Parquet:
/// see the module docs.
pub(crate) fn writer_properties() -> WriterProperties {
    WriterProperties::builder()
        .set_created_by(format!("sluice {} (delta-rs)", env!("CARGO_PKG_VERSION")))
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_dictionary_page_size_limit(DICTIONARY_PAGE_BYTES)
        .build()
}

/// How many writers encode `batches` (1: not worth splitting). See the module docs.
///
/// Counts the bytes the rows occupy ([`batch_bytes`]), not the buffers they point into.
pub(crate) fn writers_for(batches: &[RecordBatch]) -> usize {
    let bytes: usize = batches.iter().map(batch_bytes).sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (bytes / MIN_ARROW_BYTES_PER_WRITER).clamp(1, cores.max(1))
}

/// Whether every column of `batch` goes into the table's column of its name without losing
/// anything: the same type (nested types exactly), or text and binary in another layout. Anything else — a float into an integer column, a finer timestamp, a
/// smaller decimal — is left to delta-rs's `write`, which refuses what would truncate.
pub(crate) fn casts_losslessly(batch: &Schema, table: &Schema) -> bool {
    batch.fields().iter().all(|f| {
        table.field_with_name(f.name()).is_ok_and(|t| {
            let (from, to) = (f.data_type(), t.data_type());
            // Nested: exactly the table's type (the cast matches struct and map children by
            // name, which `equals_datatype` ignores).
            if from.is_nested() || to.is_nested() {
                return from == to;
            }
            from.equals_datatype(to)
                || matches!(
                    (from, to),
                    (DataType::Utf8View | DataType::LargeUtf8, DataType::Utf8)
                        | (
                            DataType::BinaryView | DataType::LargeBinary,
                            DataType::Binary
                        )
                )
        })
    })
}

/// Whether an append to `table` needs nothing beyond matching types and nullability: writer
/// protocol 2 or below, or 7 with only `appendOnly`, `invariants` and `timestampNtz` among its
/// writer features, and no column invariants in the schema. Anything else (constraints,
/// generated or identity columns, column mapping, row tracking, change data feed, features
/// newer than this code) is left to delta-rs's `write`, which knows them.
pub(crate) fn plain_for_append(table: &DeltaTable) -> bool {
    let Ok(snapshot) = table.snapshot() else {
        return false;
    };
    let Ok(protocol) = serde_json::to_value(snapshot.protocol()) else {
        return false;
    };
    let writer_version = protocol["minWriterVersion"].as_i64().unwrap_or(i64::MAX);
    let features_plain = protocol["writerFeatures"]
        .as_array()
        .is_none_or(|features| {
            features.iter().all(|f| {
                matches!(
                    f.as_str(),
                    Some("appendOnly" | "invariants" | "timestampNtz")
                )
            })
        });
    let plain_protocol = writer_version <= 2 || (writer_version == 7 && features_plain);
    // Conservative: a column merely named so also takes delta-rs's path.
    let invariants = serde_json::to_value(snapshot.metadata()).map_or(true, |m| {
        m["schemaString"]
            .as_str()
            .is_none_or(|s| s.contains("delta.invariants"))
    });
    plain_protocol && !invariants
}

/// Encodes `batches` (rows in order) into new data files of `table` with `writers` writers
/// running concurrently, each on a blocking thread over a contiguous range of the rows, and returns
/// their `add` actions in row order. Nothing is committed: the caller commits the actions.
/// The batches are cast to the table's column types first; call it only for batches that
/// cast losslessly ([`casts_losslessly`]).
///
/// On an error the writers not yet started are cancelled; files already written stay in the
/// table's folder unreferenced, as after a failed delta-rs write, until `VACUUM`.
///
/// # Errors
/// If a batch does not match the table's columns, or a file cannot be written.
pub(crate) async fn encode_parallel(
    table: &DeltaTable,
    batches: Vec<RecordBatch>,
    writers: usize,
    target_file_size: Option<NonZeroU64>,
) -> DeltaResult<Vec<Add>> {
    let snapshot = table.snapshot()?;
    let schema = snapshot.snapshot().arrow_schema();
    let target = target_file_size.unwrap_or_else(|| snapshot.table_config().target_file_size());
    // Each writer on a blocking thread (encoding is CPU work; its uploads are awaited there),
    // so the runtime's workers stay free for the status server and the uploads.
    let runtime = tokio::runtime::Handle::current();
    let mut tasks = tokio::task::JoinSet::new();
    for (index, rows) in row_ranges(batches, writers).into_iter().enumerate() {
        let mut writer = RecordBatchWriter::for_table(table)?
            .with_writer_properties(writer_properties())
            .with_target_file_size(target.get());
        let schema = schema.clone();
        let runtime = runtime.clone();
        tasks.spawn_blocking(move || {
            runtime.block_on(async move {
                for batch in rows {
                    let batch = if batch.schema() == schema {
                        batch
                    } else {
                        cast_record_batch(&batch, schema.clone(), false, false)?
                    };
                    writer.write(batch).await?;
                }
                Ok::<_, DeltaTableError>((index, writer.flush().await?))
            })
        });
    }
    let mut files = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let done = done.map_err(|e| DeltaTableError::Generic(format!("writer task: {e}")))?;
        match done {
            Ok(written) => files.push(written),
            Err(e) => {
                tasks.abort_all();
                return Err(e);
            }
        }
    }
    files.sort_by_key(|(index, _)| *index);
    Ok(files.into_iter().flat_map(|(_, adds)| adds).collect())
}

/// `batches` cut into `parts` contiguous ranges of (nearly) equal row counts (fewer if there
/// are fewer rows), slicing batches where a range ends inside one (zero-copy).
fn row_ranges(batches: Vec<RecordBatch>, parts: usize) -> Vec<Vec<RecordBatch>> {
    let total: usize = batches.iter().map(RecordBatch::num_rows).sum();
    row_groups(&batches, total.div_ceil(parts.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn batch(values: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))]).unwrap()
    }

    fn values(ranges: &[Vec<RecordBatch>]) -> Vec<Vec<i64>> {
        ranges
            .iter()
            .map(|r| {
                r.iter()
                    .flat_map(|b| {
                        let c = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                        (0..c.len()).map(|i| c.value(i)).collect::<Vec<_>>()
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn row_ranges_keep_every_row_in_order_and_balance_the_parts() {
        let input = vec![batch(0..5), batch(5..6), batch(6..20), batch(20..23)];
        for parts in 1..=30 {
            let ranges = row_ranges(input.clone(), parts);
            let flat: Vec<i64> = values(&ranges).concat();
            assert_eq!(flat, (0..23).collect::<Vec<_>>(), "{parts} parts");
            assert!(ranges.len() <= parts, "{parts} parts gave {}", ranges.len());
            let sizes: Vec<usize> = values(&ranges).iter().map(Vec::len).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            // Every part but the last is full; the last holds the remainder.
            assert!(
                sizes[..sizes.len() - 1].iter().all(|s| s == max),
                "{parts}: {sizes:?}"
            );
            assert!(*min >= 1, "{parts}: {sizes:?}");
        }
        assert!(row_ranges(Vec::new(), 4).is_empty());
        assert!(row_ranges(vec![batch(0..0)], 4).is_empty());
    }

    #[test]
    fn small_batches_get_one_writer_even_as_slices_of_a_large_buffer() {
        assert_eq!(writers_for(&[batch(0..1000)]), 1);
        assert_eq!(writers_for(&[]), 1);
        // 80 MB of buffer, but the slices hold 8 MB of rows between them.
        let large = batch(0..10_000_000);
        let slices: Vec<RecordBatch> = (0..10)
            .map(|i| large.slice(i * 1_000_000, 100_000))
            .collect();
        assert_eq!(writers_for(&slices), 1);
    }

    #[test]
    fn only_lossless_type_differences_take_the_parallel_path() {
        let schema = |t: DataType| Schema::new(vec![Field::new("x", t, true)]);
        let ts = |unit, tz: Option<&str>| DataType::Timestamp(unit, tz.map(Into::into));
        use arrow::datatypes::TimeUnit::{Microsecond, Nanosecond};
        let yes = [
            (DataType::Int64, DataType::Int64),
            (DataType::Utf8View, DataType::Utf8),
            (DataType::LargeUtf8, DataType::Utf8),
            (ts(Microsecond, Some("UTC")), ts(Microsecond, Some("UTC"))),
        ];
        for (from, to) in yes {
            assert!(
                casts_losslessly(&schema(from.clone()), &schema(to.clone())),
                "{from} → {to}"
            );
        }
        let no = [
            (DataType::Float64, DataType::Int64),
            (DataType::Int64, DataType::Int32),
            (ts(Nanosecond, Some("UTC")), ts(Microsecond, Some("UTC"))),
            (DataType::Decimal128(10, 4), DataType::Decimal128(10, 2)),
        ];
        for (from, to) in no {
            assert!(
                !casts_losslessly(&schema(from.clone()), &schema(to.clone())),
                "{from} → {to}"
            );
        }
        let other = Schema::new(vec![Field::new("y", DataType::Int64, true)]);
        assert!(!casts_losslessly(&schema(DataType::Int64), &other));
    }
}
