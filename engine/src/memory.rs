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
//! Whole files are read into one buffer each ([`crate::storage::read_body`]: the sources,
//! file tables, compaction). A buffer of more than glibc's mmap threshold (a few MiB up to
//! 32 MiB) is mapped afresh for every file and unmapped when its bytes are dropped, so each
//! read faulted in and zeroed every page of its buffer before the kernel copied the file
//! into it — on the Nexmark JSON bids (25 MB
//! files) a twentieth of the job's CPU, and the next batch's other buffers took fresh pages
//! as well. Finished buffers of at least [`MIN_KEPT_READ_BUFFER_BYTES`] are therefore kept for
//! the next read ([`read_buffer`], [`recycled_bytes`]), at most [`KEPT_READ_BUFFER_BYTES`] of
//! them, and [`release_free_memory`] frees them with the arenas' free pages. Smaller buffers
//! are left to malloc, whose arenas reuse them well: keeping the 3 MB buffers of a Parquet
//! job's files cost it system time (the kept pages were not there for its other buffers).

/// Frees the kept read buffers ([`read_buffer`]) and returns the free pages of glibc's malloc
/// arenas to the system (`malloc_trim(0)`; elsewhere, only the buffers are freed).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_memory() {
    READ_BUFFERS.clear();
    // SAFETY: `malloc_trim` only releases memory the allocator holds free; it takes the
    // arenas' locks itself and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Frees the kept read buffers ([`read_buffer`]); there are no glibc arenas to trim here.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {
    READ_BUFFERS.clear();
}

/// At most this many bytes of finished read buffers are kept for the next reads; a buffer
/// that would take the kept ones past it is freed. Two 25 MB files' buffers fit, so a source
/// reading such files one while it decodes another reuses them.
pub const KEPT_READ_BUFFER_BYTES: usize = 64 * 1024 * 1024;

/// A read buffer smaller than this is malloc's alone: never kept, nor taken from the kept.
pub const MIN_KEPT_READ_BUFFER_BYTES: usize = 8 * 1024 * 1024;

/// Finished read buffers, emptied, waiting for the next read.
struct ReadBuffers {
    kept: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// The process's read buffers (what [`read_buffer`] and [`recycled_bytes`] use).
static READ_BUFFERS: ReadBuffers = ReadBuffers {
    kept: std::sync::Mutex::new(Vec::new()),
};

impl ReadBuffers {
    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // A panic while holding the lock leaves only a list of empty buffers behind.
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// See [`read_buffer`].
    fn take(&self, len: usize) -> Vec<u8> {
        if len < MIN_KEPT_READ_BUFFER_BYTES {
            return Vec::with_capacity(len);
        }
        let mut kept = self.kept();
        let fits = (kept.iter().enumerate())
            .filter(|(_, buffer)| (len..=len.saturating_mul(2)).contains(&buffer.capacity()))
            .min_by_key(|(_, buffer)| buffer.capacity())
            .map(|(i, _)| i);
        if let Some(i) = fits {
            return kept.swap_remove(i);
        }
        let (too_small, others): (Vec<_>, Vec<_>) = std::mem::take(&mut *kept)
            .into_iter()
            .partition(|buffer| buffer.capacity() < len);
        *kept = others;
        drop(kept);
        drop(too_small);
        let step = len
            .checked_next_power_of_two()
            .map_or(1, |p| p / 8)
            .max(4096);
        Vec::with_capacity(len.div_ceil(step).saturating_mul(step).max(len))
    }

    /// Keeps `buffer` (emptied) if the kept ones leave room for it; frees it otherwise.
    fn keep(&self, mut buffer: Vec<u8>) {
        if buffer.capacity() < MIN_KEPT_READ_BUFFER_BYTES {
            return;
        }
        buffer.clear();
        let mut kept = self.kept();
        let held: usize = kept.iter().map(Vec::capacity).sum();
        if held.saturating_add(buffer.capacity()) <= KEPT_READ_BUFFER_BYTES {
            kept.push(buffer);
        }
    }

    fn clear(&self) {
        let kept = std::mem::take(&mut *self.kept());
        drop(kept);
    }
}

/// An empty buffer with room for at least `len` bytes. For `len` of at least
/// [`MIN_KEPT_READ_BUFFER_BYTES`]: the smallest kept buffer with room that is at most twice
/// `len` (a larger one would hold pages an earlier read touched that this one does not need),
/// or else a new one — and the kept ones too small for it are freed. A new large buffer is
/// rounded up to the next eighth of `len`'s power of two, so files of about one size share
/// buffers (the room past what its first read writes costs address space, not memory). A
/// smaller `len` gets a new buffer of its size.
pub fn read_buffer(len: usize) -> Vec<u8> {
    READ_BUFFERS.take(len)
}

/// `buffer`'s bytes, which give the buffer back to be kept for the next read
/// ([`read_buffer`]) once the last clone or slice of them is dropped.
pub fn recycled_bytes(buffer: Vec<u8>) -> bytes::Bytes {
    if buffer.capacity() < MIN_KEPT_READ_BUFFER_BYTES {
        return bytes::Bytes::from(buffer);
    }
    bytes::Bytes::from_owner(ReadBuffer {
        buffer,
        pool: &READ_BUFFERS,
    })
}

/// The owner of a read's bytes: gives its buffer back to its pool when dropped.
struct ReadBuffer {
    buffer: Vec<u8>,
    pool: &'static ReadBuffers,
}

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        self.pool.keep(std::mem::take(&mut self.buffer));
    }
}

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

    /// A read's buffer comes back for the next read once its last slice is gone, files of
    /// about one size share one, a much smaller read gets a buffer of its own, a read that
    /// fits none frees the kept ones too small for it, and what is kept stays within its
    /// bound.
    #[test]
    fn read_buffers_are_reused_within_their_bound() {
        const MIB: usize = 1024 * 1024;
        let pool: &'static ReadBuffers = Box::leak(Box::new(ReadBuffers {
            kept: std::sync::Mutex::new(Vec::new()),
        }));
        let bytes_of = |buffer: Vec<u8>| bytes::Bytes::from_owner(ReadBuffer { buffer, pool });
        let capacities = || {
            let mut c: Vec<usize> = pool.kept().iter().map(Vec::capacity).collect();
            c.sort();
            c
        };
        // 9 MB: rounded up to 10 MiB.
        let size = 9_000_000;
        let mut first = pool.take(size);
        assert_eq!(first.capacity(), 10 * MIB);
        first.extend_from_slice(&vec![7; size]);
        let address = first.as_ptr();
        let bytes = bytes_of(first);
        let slice = bytes.slice(10..20);
        drop(bytes);
        // Still held by its slice: the next read gets another buffer.
        let second = pool.take(size);
        assert_ne!(second.as_ptr(), address);
        drop(bytes_of(second));
        assert_eq!(&slice[..], &[7; 10]);
        drop(slice);
        assert_eq!(capacities(), [10 * MIB, 10 * MIB]);
        // A file a little larger fits the rounded-up buffers; the other stays kept.
        let again = pool.take(10_000_000);
        assert!(again.is_empty() && again.capacity() == 10 * MIB);
        assert_eq!(capacities(), [10 * MIB]);
        drop(bytes_of(again));
        // A read too large for every kept buffer frees them.
        let large = pool.take(32 * MIB);
        assert!(pool.kept().is_empty());
        let (other, third) = (pool.take(32 * MIB), pool.take(16 * MIB));
        // Kept while they fit in the bound (32 + 32 MiB), the last one freed.
        drop((bytes_of(large), bytes_of(other), bytes_of(third)));
        assert_eq!(capacities(), [32 * MIB, 32 * MIB]);
        assert_eq!(KEPT_READ_BUFFER_BYTES, 64 * MIB);
        // A buffer more than twice a read's size is not given to it, nor freed for it.
        let small = pool.take(MIN_KEPT_READ_BUFFER_BYTES);
        assert_eq!(small.capacity(), MIN_KEPT_READ_BUFFER_BYTES);
        drop(bytes_of(small));
        assert_eq!(capacities(), [32 * MIB, 32 * MIB]);
        // Small buffers are malloc's.
        drop(bytes_of(pool.take(MIN_KEPT_READ_BUFFER_BYTES - 1)));
        assert_eq!(capacities(), [32 * MIB, 32 * MIB]);
        pool.clear();
        assert!(pool.kept().is_empty());
    }

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
