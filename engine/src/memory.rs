//! Memory: how much a batch's rows occupy, and handing memory a bounded read has freed back
//! to the system between its chunks.
//!
//! A batch's size is counted as the bytes its rows use ([`batch_bytes`]), not the buffers they
//! point into: a query's output is often slices of one buffer, which Arrow's
//! `get_array_memory_size` counts whole once per slice. What rows kept in memory hold (a
//! join's state: slices of many batches, one null array shared by many columns) is counted as
//! the allocations they keep alive, each once ([`held_bytes`]).
//!
//! A backfill reads a long range chunk by chunk (its recomputation, its windows' span, the scan
//! resolving a time range to offsets), each chunk decoded, queried and released on several
//! threads. glibc's malloc keeps what a chunk freed in its arenas, fragmented between what is
//! still live, and the resident size of such a read grew to about twice what it held at once.
//! Returning the free pages before each chunk took a quarter off a stateless backfill's peak
//! (`cargo bench --bench scale -- backfill-memory`: 2.1× the hour to 1.6×) at the cost of one
//! walk of the arenas per chunk, noise beside a chunk's decoding. The live job calls it only
//! after a compaction (which rewrites many files through many medium-sized buffers, after which
//! the next batches' large buffers fit nowhere in what it freed): after an ordinary batch the
//! next one reuses the pages at once, and faulting them in again costs throughput.
//!
//! Large local files that are never rewritten (a files source's inputs, compaction's Delta
//! files) are mapped, not read into buffers ([`crate::storage::read_immutable_body`]), so no
//! read buffers are pooled here.

/// Returns the free pages of glibc's malloc arenas to the system (`malloc_trim(0)`; a no-op
/// elsewhere).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_memory() {
    // SAFETY: `malloc_trim` only releases memory the allocator holds free; it takes the
    // arenas' locks itself and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Nothing to return: there are no glibc arenas here.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {}

/// `batch` cut into slices of at most `rows` rows, in order: views, nothing copied (each slice
/// keeps the whole batch's buffers until the last one is dropped).
pub fn slices(batch: &arrow::array::RecordBatch, rows: usize) -> Vec<arrow::array::RecordBatch> {
    let rows = rows.max(1);
    (0..batch.num_rows())
        .step_by(rows)
        .map(|from| batch.slice(from, rows.min(batch.num_rows() - from)))
        .collect()
}

/// Bytes of `batch`'s buffers that its rows use: a slice counts only its part of a buffer it
/// shares with other slices. String and binary views count their data buffers whole (a view's
/// text may be anywhere in them). Approximate for nested types.
pub fn batch_bytes(batch: &arrow::array::RecordBatch) -> usize {
    use arrow::datatypes::DataType;
    batch
        .columns()
        .iter()
        .map(|c| {
            let data = c.to_data();
            let slice = data
                .get_slice_memory_size()
                .unwrap_or_else(|_| c.get_array_memory_size());
            let texts: usize = match c.data_type() {
                DataType::Utf8View | DataType::BinaryView => {
                    data.buffers().iter().skip(1).map(|b| b.len()).sum()
                }
                _ => 0,
            };
            slice + texts
        })
        .sum()
}

/// Bytes of the allocations `batches` keep alive, each allocation counted once however many
/// slices, columns or batches share it — what holding these rows costs. A buffer borrowed from
/// a larger one it does not own (zero-copy from a file's bytes) counts only its own length.
pub fn held_bytes<'a>(batches: impl IntoIterator<Item = &'a arrow::array::RecordBatch>) -> usize {
    fn visit(data: &arrow::array::ArrayData, seen: &mut std::collections::HashMap<usize, usize>) {
        let buffers = data
            .buffers()
            .iter()
            .chain(data.nulls().map(|n| n.buffer()));
        for buffer in buffers {
            // A buffer borrowed from elsewhere (`bytes::Bytes`) reports only its own length:
            // the largest seen at one address is kept.
            let size = seen.entry(buffer.data_ptr().as_ptr() as usize).or_default();
            *size = (*size).max(buffer.capacity());
        }
        for child in data.child_data() {
            visit(child, seen);
        }
    }
    let mut seen = std::collections::HashMap::new();
    for batch in batches {
        for column in batch.columns() {
            visit(&column.to_data(), &mut seen);
        }
    }
    seen.values().sum()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, RecordBatch, new_null_array};
    use arrow::datatypes::DataType;

    use super::*;

    /// Slices of one batch and one null array shared by several columns count once.
    #[test]
    fn held_bytes_count_each_allocation_once() {
        let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..1024));
        let nulls = new_null_array(&DataType::Int64, 1024);
        let batch = RecordBatch::try_from_iter([
            ("v", Arc::clone(&values)),
            ("a", Arc::clone(&nulls)),
            ("b", Arc::clone(&nulls)),
        ])
        .unwrap();
        let whole = held_bytes([&batch]);
        let alone = held_bytes([&RecordBatch::try_from_iter([("v", values)]).unwrap()])
            + held_bytes([&RecordBatch::try_from_iter([("a", nulls)]).unwrap()]);
        assert_eq!(whole, alone);
        assert!(whole >= 1024 * 8, "{whole}");
        let (front, back) = (batch.slice(0, 10), batch.slice(10, 1014));
        assert_eq!(held_bytes([&front, &back]), whole);
        assert!(batch.get_array_memory_size() > whole);
    }
}
