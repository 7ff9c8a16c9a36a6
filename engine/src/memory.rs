//! Memory: how much a batch's rows occupy, and handing memory a bounded read has freed back
//! to the system between its chunks.
//!
//! A batch's size is counted as the bytes its rows use ([`batch_bytes`]), not the buffers they
//! point into: a query's output is often slices of one buffer, which Arrow's
//! `get_array_memory_size` counts whole once per slice.
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

/// Returns the free pages of glibc's malloc arenas to the system (`malloc_trim(0)`); nothing
/// elsewhere.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_memory() {
    // SAFETY: `malloc_trim` only releases memory the allocator holds free; it takes the
    // arenas' locks itself and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns the free pages of glibc's malloc arenas to the system; nothing elsewhere.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {}

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
