//! The live groups of a stateful aggregate, found by key: what makes a batch cost what it
//! touches rather than what the state holds.
//!
//! Each batch's partial aggregate rows must be merged with the state of their groups. Merging
//! them with the whole state (one hash aggregation over state and batch) costs O(state) a batch:
//! with a million open groups and ten thousand events a batch, nearly all of that work
//! re-aggregates groups the batch never touched. A keyed [`GroupTable`] holds the state as Arrow
//! chunks — one live row per group, its partial aggregate state — and a hash index from each
//! group's key (its group columns in Arrow's row format, which is one-to-one with the values
//! DataFusion's grouping tells apart) to that row. A batch
//!
//! ```text
//!  partial rows ─┬─ take(their keys) ──► the touched groups' rows, removed ─┐
//!                └──────────────────────────────────────────────────────────┴─ merge ─► insert
//! ```
//!
//! so it costs in proportion to the groups it touches.
//!
//! **Purge.** Groups leave by their purge column (the window, or a running aggregate's newest
//! event); a null purge value counts as below every bound. Each chunk knows a lower bound of its
//! live purge values, so a purge that closes nothing reads no rows; chunks made by a merge are
//! sorted by purge value, so a purge reads only the rows it removes (a binary search finds them).
//! Its groups leave the index one by one (each a random probe), or — when an eighth of the
//! groups or more go at once — in one pass over the index keeping the live rows' entries (the
//! index then shrunk if it is over four times the groups it held before the purge).
//!
//! **Chunks.** Each insert adds chunks and each take or purge leaves dead rows behind. A chunk
//! has a stable id (the index points at `(id, row)`), so a chunk whose rows are all dead is
//! simply dropped. At the start of a take and after a purge, when dead rows outnumber live
//! ones, every chunk's live rows are merged into new chunks. Merging small chunks runs only at
//! the start of a take, not after an insert or a purge: rows a batch inserts are often purged by
//! the same batch, and the owner's next step may replace the whole state (`take_all`), which
//! needs no merged chunks. When more than [`MAX_CHUNKS`] chunks below the size limit are left,
//! the smallest are merged — from the smallest up to the first that holds no more live rows
//! than those before it, then each next smallest while it holds no more than those taken — so a
//! merge at least doubles the chunk each of its rows lives in, and a row is copied
//! O(log(state / batch)) times over its life. Like a binary counter's carry, one batch now and then merges much more
//! than it brought (at most the state); the average per batch stays O(batch · log(state /
//! batch)). Merged chunks hold at most [`CHUNK_ROWS`] rows and about [`CHUNK_BYTES`] (cut by the
//! average row; a piece whose variable-width values would overflow Arrow's 32-bit offsets is
//! cut in two again). Memory held: the live rows, dead ones (after a purge at most as many as
//! live ones; between, also what a batch took out), the keys in row format and the index.
//!
//! An **unkeyed** table (session windows, whose groups merge with every overlapping session of
//! their key; an aggregate without group columns, one row) has no index: its owner merges the
//! whole state each batch and replaces it.

use std::hash::BuildHasher;

use arrow::array::{Array, AsArray, BooleanArray, PrimitiveArray, RecordBatch, UInt32Array};
use arrow::compute::{filter_record_batch, interleave_record_batch, take_record_batch};
use arrow::datatypes::{SchemaRef, TimestampMicrosecondType};
use arrow::error::ArrowError;
use arrow::row::{RowConverter, Rows, SortField};
use hashbrown::hash_table::Entry;
use hashbrown::{DefaultHashBuilder, HashTable};

use crate::error::{Error, Result};
use crate::memory::batch_bytes;

/// More chunks below the size limit than this start a merge of the smallest ones.
pub(crate) const MAX_CHUNKS: usize = if cfg!(test) { 4 } else { 32 };
/// A merged chunk holds at most this many rows …
pub(crate) const CHUNK_ROWS: usize = if cfg!(test) { 8 } else { 1 << 20 };
/// … and about this many bytes.
pub(crate) const CHUNK_BYTES: usize = 256 << 20;

/// Where a group's live row is: a chunk's id and the row in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Location {
    chunk: u32,
    row: u32,
}

/// An index entry: a group's row and its key's hash (kept so that growing the index and
/// comparing candidates need not read the key).
#[derive(Debug, Clone, Copy)]
struct Indexed {
    hash: u64,
    at: Location,
}

/// Rows inserted or merged together, and which of them are still live.
struct Chunk {
    rows: RecordBatch,
    /// The group keys of `rows` in row format (`None` in an unkeyed table).
    keys: Option<Rows>,
    live: Vec<bool>,
    live_rows: usize,
    /// Sorted by purge value, nulls first (made by a merge).
    sorted: bool,
    /// Sorted chunks: every row before this one has been purged.
    purged_to: usize,
    /// No live row has a non-null purge value below this (`None`: none has one).
    purge_floor: Option<i64>,
    /// Cut at the size limit by a merge: not merged again until dead rows outnumber live ones.
    full: bool,
    /// A live row may have a null purge value.
    null_purge: bool,
}

impl Chunk {
    /// Whether a live row may have a purge value below `bound`, or none (from the floor).
    fn may_have_below(&self, bound: i64) -> bool {
        self.live_rows > 0
            && (self.null_purge || self.purge_floor.is_some_and(|floor| floor < bound))
    }

    fn new(
        rows: RecordBatch,
        keys: Option<Rows>,
        purge_column: usize,
        sorted: bool,
    ) -> Result<Self> {
        let values = purge_values(&rows, purge_column)?;
        let n = rows.num_rows();
        Ok(Chunk {
            purge_floor: arrow::compute::min(values),
            null_purge: values.null_count() > 0,
            keys,
            live: vec![true; n],
            live_rows: n,
            sorted,
            purged_to: 0,
            full: false,
            rows,
        })
    }

    fn dead_rows(&self) -> usize {
        self.rows.num_rows() - self.live_rows
    }
}

/// One live row per group (partial aggregate states), found by the group's key.
pub(crate) struct GroupTable {
    /// The first `key_columns` columns are the group key.
    key_columns: usize,
    /// The timestamp column whose value decides when a group leaves.
    purge_column: usize,
    /// `None`: an unkeyed table.
    converter: Option<RowConverter>,
    /// foldhash, randomly seeded per table (as DataFusion's own grouping hashes with a seeded
    /// fast hash): keys come from outside data, the seed keeps collisions from being chosen.
    hasher: DefaultHashBuilder,
    /// The chunks by id; `None` is a free id (in `free_ids`).
    chunks: Vec<Option<Chunk>>,
    free_ids: Vec<u32>,
    index: HashTable<Indexed>,
    live_rows: usize,
    dead_rows: usize,
}

impl std::fmt::Debug for GroupTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupTable")
            .field("keyed", &self.converter.is_some())
            .field("live_rows", &self.live_rows)
            .field("dead_rows", &self.dead_rows)
            .field("chunks", &self.chunks().count())
            .finish()
    }
}

impl GroupTable {
    /// An empty table of rows in `schema`, keyed by its first `key_columns` columns (unkeyed if
    /// 0), purged by the timestamp column `purge_column`.
    ///
    /// # Errors
    /// If the key columns cannot be put in row format.
    pub(crate) fn keyed(
        schema: SchemaRef,
        key_columns: usize,
        purge_column: usize,
    ) -> Result<Self> {
        let mut table = GroupTable::unkeyed(purge_column);
        if key_columns > 0 {
            table.key_columns = key_columns;
            table.converter = Some(RowConverter::new(
                schema.fields()[..key_columns]
                    .iter()
                    .map(|f| SortField::new(f.data_type().clone()))
                    .collect(),
            )?);
        }
        Ok(table)
    }

    /// An empty unkeyed table: rows are inserted and replaced whole, never taken by key.
    pub(crate) fn unkeyed(purge_column: usize) -> Self {
        GroupTable {
            key_columns: 0,
            purge_column,
            converter: None,
            hasher: DefaultHashBuilder::default(),
            chunks: Vec::new(),
            free_ids: Vec::new(),
            index: HashTable::new(),
            live_rows: 0,
            dead_rows: 0,
        }
    }

    /// Whether groups can be taken by key.
    pub(crate) fn is_keyed(&self) -> bool {
        self.converter.is_some()
    }

    /// Live groups.
    pub(crate) fn live_rows(&self) -> usize {
        self.live_rows
    }

    /// Bytes held: the chunks' Arrow buffers (dead rows too), their keys and the index.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.chunks()
            .map(|c| batch_bytes(&c.rows) + c.keys.as_ref().map_or(0, Rows::size))
            .sum::<usize>()
            + self.index.allocation_size()
    }

    /// Replaces the contents with `rows`, one row per group.
    ///
    /// # Errors
    /// As [`GroupTable::insert`]; a group in `rows` twice is an error here.
    pub(crate) fn reset(&mut self, rows: Vec<RecordBatch>) -> Result<()> {
        self.clear();
        let twice = self.insert(rows)?;
        if twice.iter().any(|b| b.num_rows() > 0) {
            return Err(Error::InvalidJob(
                "internal error: the aggregate's state holds a group twice".into(),
            ));
        }
        Ok(())
    }

    /// Removes the groups that have a row in `partials` and returns their rows, each once.
    ///
    /// # Errors
    /// If the table is unkeyed, or the keys cannot be converted or the rows gathered.
    /// Compacts first, if due (see the module docs).
    pub(crate) fn take(&mut self, partials: &[RecordBatch]) -> Result<Vec<RecordBatch>> {
        self.compact_if_due()?;
        let found = self.unindex(partials)?;
        self.gather(&found)
    }

    /// The rows of the groups that have a row in `partials`, each once, left in the table.
    ///
    /// # Errors
    /// As [`GroupTable::take`].
    pub(crate) fn lookup(&self, partials: &[RecordBatch]) -> Result<Vec<RecordBatch>> {
        let mut found = self.find(partials)?;
        found.sort_unstable_by_key(|l| (l.chunk, l.row));
        found.dedup();
        self.rows_at(&found)
    }

    /// Adds `rows`, one chunk per batch. In a keyed table, a row whose group is present already
    /// (in the table, or earlier in `rows`) is not added but returned, for the caller to merge
    /// with that group's row and insert again (DataFusion may emit a group more than once).
    ///
    /// # Errors
    /// If the purge column is not a timestamp or the keys cannot be converted.
    pub(crate) fn insert(&mut self, rows: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
        let mut twice = Vec::new();
        for batch in rows.into_iter().filter(|b| b.num_rows() > 0) {
            let keys = match &self.converter {
                Some(c) => Some(c.convert_columns(&batch.columns()[..self.key_columns])?),
                None => None,
            };
            let n = batch.num_rows();
            let id = self.add_chunk(Chunk::new(batch, keys, self.purge_column, false)?)?;
            self.live_rows += n;
            if self.converter.is_none() {
                continue;
            }
            let mut repeated = Vec::new();
            for row in 0..n {
                let here = Location {
                    chunk: id,
                    row: location_part(row)?,
                };
                let chunks = &self.chunks;
                let key = key_at(chunks, here);
                let hash = self.hasher.hash_one(key);
                let same = |e: &Indexed| e.hash == hash && key_at(chunks, e.at) == key;
                match self.index.entry(hash, same, |e| e.hash) {
                    Entry::Occupied(_) => repeated.push(here),
                    Entry::Vacant(slot) => {
                        slot.insert(Indexed { hash, at: here });
                    }
                }
            }
            twice.extend(self.gather(&repeated)?);
        }
        Ok(twice)
    }

    /// Whether a group may have a purge value below `bound` (or null): what
    /// [`GroupTable::remove_below`] would look at (`false` only if it would remove nothing; a
    /// stale floor may say `true` when it would not).
    pub(crate) fn may_have_below(&self, bound: i64) -> bool {
        self.chunks
            .iter()
            .flatten()
            .any(|chunk| chunk.may_have_below(bound))
    }

    /// Whether a row of `rows` (state rows, not in the table) has a purge value below `bound`,
    /// or none.
    ///
    /// # Errors
    /// If the purge column is not a timestamp.
    pub(crate) fn any_row_below(&self, rows: &[RecordBatch], bound: i64) -> Result<bool> {
        for b in rows {
            let values = purge_values(b, self.purge_column)?;
            if values.null_count() > 0 || arrow::compute::min(values).is_some_and(|m| m < bound) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes the groups whose purge value is below `bound` (or null) and returns their rows.
    ///
    /// # Errors
    /// If the purge column is not a timestamp.
    pub(crate) fn remove_below(&mut self, bound: i64) -> Result<Vec<RecordBatch>> {
        // (chunk id, rows) of the groups removed: marked dead as found, their index entries
        // removed after the scan — also when it fails part way, so the index holds exactly
        // the live rows whatever happens.
        let mut purged: Vec<(usize, Vec<u32>)> = Vec::new();
        let purge_column = self.purge_column;
        let chunks = &mut self.chunks;
        let scanned = (|| -> Result<()> {
            for (id, slot) in chunks.iter_mut().enumerate() {
                let Some(chunk) = slot else { continue };
                if !chunk.may_have_below(bound) {
                    continue;
                }
                let values = purge_values(&chunk.rows, purge_column)?;
                let is_below = |row: usize| values.is_null(row) || values.value(row) < bound;
                let n = chunk.rows.num_rows();
                // Sorted: the rows below are a run from `purged_to`, found by binary search.
                let (from, to) = if chunk.sorted {
                    let (mut lo, mut hi) = (chunk.purged_to, n);
                    while lo < hi {
                        let mid = lo + (hi - lo) / 2;
                        if is_below(mid) {
                            lo = mid + 1;
                        } else {
                            hi = mid;
                        }
                    }
                    (chunk.purged_to, lo)
                } else {
                    (0, n)
                };
                let mut rows = Vec::new();
                let mut floor: Option<i64> = None;
                for row in from..to {
                    if !chunk.live[row] {
                        continue;
                    }
                    if is_below(row) {
                        rows.push(location_part(row)?);
                    } else {
                        let value = values.value(row);
                        floor = Some(floor.map_or(value, |f| f.min(value)));
                    }
                }
                if chunk.sorted {
                    chunk.purged_to = to;
                    floor = (to..n).find(|r| chunk.live[*r]).map(|r| values.value(r));
                }
                chunk.purge_floor = floor;
                chunk.null_purge = false;
                if rows.is_empty() {
                    continue;
                }
                for &row in &rows {
                    chunk.live[row as usize] = false;
                }
                chunk.live_rows -= rows.len();
                purged.push((id, rows));
            }
            Ok(())
        })();
        let removed: usize = purged.iter().map(|(_, rows)| rows.len()).sum();
        self.unindex_purged(&purged, removed);
        self.live_rows -= removed;
        self.dead_rows += removed;
        scanned?;
        let mut out = Vec::with_capacity(purged.len());
        for (id, rows) in &purged {
            if let Some(Some(chunk)) = self.chunks.get(*id) {
                let rows = UInt32Array::from_iter_values(rows.iter().copied());
                out.push(take_record_batch(&chunk.rows, &rows)?);
            }
        }
        // Only dead rows are dropped here (a copy of the live rows, when they are outnumbered);
        // merging small chunks waits for the next take.
        self.drop_dead_rows_if_due()?;
        Ok(out)
    }

    /// Removes the index entries of `purged` rows (by chunk id), `removed` in all, whose rows
    /// are already marked dead. Each entry found by its key's hash is a cache miss or two at a
    /// random place in the index; where an eighth of the index or more goes (a watermark
    /// closing most windows at once, as a batch spanning a window does), one pass over the
    /// index keeping the entries of live rows is cheaper (it was a tenth of a hopping-window
    /// job's CPU the other way).
    fn unindex_purged(&mut self, purged: &[(usize, Vec<u32>)], removed: usize) {
        if removed == 0 {
            return;
        }
        let before = self.index.len();
        if removed.saturating_mul(8) >= before {
            let chunks = &self.chunks;
            // An entry of a row or chunk that is not there is dropped too (none is expected).
            self.index.retain(|e| {
                let chunk = chunks.get(e.at.chunk as usize).and_then(Option::as_ref);
                chunk.is_some_and(|c| c.live.get(e.at.row as usize) == Some(&true))
            });
            // `retain` (and the next purge's pass) reads every bucket, so an index much larger
            // than the state it held before this purge (left so by a spike) is cut down —
            // to that state's size, not to what is left: a state that fills up and empties
            // every batch (windows opening and closing) would otherwise have its index
            // shrunk and grown back, rehashed both ways, at every batch.
            if self.index.capacity() > 4 * before.max(1024) {
                self.index.shrink_to(before, |e| e.hash);
            }
            return;
        }
        for (id, rows) in purged {
            let Some(Some(chunk)) = self.chunks.get(*id) else {
                continue;
            };
            let Some(keys) = &chunk.keys else { continue };
            let Ok(id) = u32::try_from(*id) else { continue };
            for &row in rows {
                let hash = self.hasher.hash_one(keys.row(row as usize).as_ref());
                let here = Location { chunk: id, row };
                if let Ok(entry) = self.index.find_entry(hash, |e| e.at == here) {
                    entry.remove();
                }
            }
        }
    }

    /// The live rows (chunks without dead rows are not copied).
    ///
    /// # Errors
    /// If filtering fails.
    pub(crate) fn rows(&self) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::new();
        for chunk in self.chunks() {
            if chunk.dead_rows() == 0 {
                out.push(chunk.rows.clone());
            } else if chunk.live_rows > 0 {
                let live = BooleanArray::from(chunk.live.clone());
                out.push(filter_record_batch(&chunk.rows, &live)?);
            }
        }
        Ok(out)
    }

    /// Removes every group and returns the rows.
    ///
    /// # Errors
    /// If filtering fails.
    pub(crate) fn take_all(&mut self) -> Result<Vec<RecordBatch>> {
        let rows = self.rows()?;
        self.clear();
        Ok(rows)
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.free_ids.clear();
        self.index = HashTable::new();
        self.live_rows = 0;
        self.dead_rows = 0;
    }

    fn chunks(&self) -> impl Iterator<Item = &Chunk> {
        self.chunks.iter().flatten()
    }

    fn chunk(&self, id: u32) -> Result<&Chunk> {
        self.chunks
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| internal("a group is indexed in a chunk that is gone"))
    }

    /// Stores `chunk` under a free id.
    fn add_chunk(&mut self, chunk: Chunk) -> Result<u32> {
        if let Some(id) = self.free_ids.pop() {
            self.chunks[id as usize] = Some(chunk);
            return Ok(id);
        }
        self.chunks.push(Some(chunk));
        location_part(self.chunks.len() - 1)
    }

    /// Where the groups that have a row in `partials` live, each once, removed from the index
    /// (a group is found once however often `partials` repeats it).
    fn unindex(&mut self, partials: &[RecordBatch]) -> Result<Vec<Location>> {
        let mut found = Vec::new();
        for keys in self.keys_of(partials)? {
            let chunks = &self.chunks;
            for key in keys.iter() {
                let hash = self.hasher.hash_one(key.as_ref());
                let same = |e: &Indexed| e.hash == hash && key_at(chunks, e.at) == key.as_ref();
                if let Ok(entry) = self.index.find_entry(hash, same) {
                    found.push(entry.remove().0.at);
                }
            }
        }
        Ok(found)
    }

    /// Where the groups that have a row in `partials` live (repeated as `partials` repeats them).
    fn find(&self, partials: &[RecordBatch]) -> Result<Vec<Location>> {
        let mut found = Vec::new();
        for keys in self.keys_of(partials)? {
            for key in keys.iter() {
                let hash = self.hasher.hash_one(key.as_ref());
                let same =
                    |e: &Indexed| e.hash == hash && key_at(&self.chunks, e.at) == key.as_ref();
                if let Some(e) = self.index.find(hash, same) {
                    found.push(e.at);
                }
            }
        }
        Ok(found)
    }

    /// The group keys of `partials`' rows in row format, a `Rows` per non-empty batch.
    fn keys_of(&self, partials: &[RecordBatch]) -> Result<Vec<Rows>> {
        let Some(converter) = &self.converter else {
            return Err(internal("groups looked up by key in an unkeyed state"));
        };
        partials
            .iter()
            .filter(|b| b.num_rows() > 0)
            .map(|b| Ok(converter.convert_columns(&b.columns()[..self.key_columns])?))
            .collect()
    }

    /// The rows at `found` (sorted by chunk), one batch per chunk.
    fn rows_at(&self, found: &[Location]) -> Result<Vec<RecordBatch>> {
        let mut out = Vec::new();
        for run in found.chunk_by(|a, b| a.chunk == b.chunk) {
            let rows = UInt32Array::from_iter_values(run.iter().map(|l| l.row));
            out.push(take_record_batch(&self.chunk(run[0].chunk)?.rows, &rows)?);
        }
        Ok(out)
    }

    /// Marks the rows at `found` (no longer indexed) dead and returns them, one batch per chunk.
    fn gather(&mut self, found: &[Location]) -> Result<Vec<RecordBatch>> {
        let mut found = found.to_vec();
        found.sort_unstable_by_key(|l| (l.chunk, l.row));
        for run in found.chunk_by(|a, b| a.chunk == b.chunk) {
            let chunk = self.chunks[run[0].chunk as usize]
                .as_mut()
                .ok_or_else(|| internal("a group is indexed in a chunk that is gone"))?;
            for l in run {
                chunk.live[l.row as usize] = false;
            }
            chunk.live_rows -= run.len();
        }
        self.live_rows -= found.len();
        self.dead_rows += found.len();
        self.rows_at(&found)
    }

    /// Drops chunks without live rows, and merges every chunk when dead rows outnumber live
    /// ones; whether it merged.
    fn drop_dead_rows_if_due(&mut self) -> Result<bool> {
        for id in 0..self.chunks.len() {
            if let Some(chunk) = self.chunks[id].take_if(|c| c.live_rows == 0) {
                self.dead_rows -= chunk.dead_rows();
                self.free_ids.push(location_part(id)?);
            }
        }
        if self.dead_rows <= self.live_rows {
            return Ok(false);
        }
        let all: Vec<u32> = (0..self.chunks.len())
            .filter(|id| self.chunks[*id].is_some())
            .map(location_part)
            .collect::<Result<_>>()?;
        self.merge(&all)?;
        Ok(true)
    }

    /// Drops dead rows if due, then, while more than [`MAX_CHUNKS`] chunks below the size limit
    /// are left, merges the smallest (see the module docs).
    fn compact_if_due(&mut self) -> Result<()> {
        if self.drop_dead_rows_if_due()? || self.converter.is_none() {
            return Ok(());
        }
        loop {
            let mut open: Vec<(usize, u32)> = Vec::new();
            for (id, chunk) in self.chunks.iter().enumerate() {
                if let Some(chunk) = chunk.as_ref().filter(|c| !c.full) {
                    open.push((chunk.live_rows, location_part(id)?));
                }
            }
            if open.len() <= MAX_CHUNKS {
                return Ok(());
            }
            open.sort_unstable();
            // The smallest chunks up to the first that holds no more rows than those before it
            // (there is one: without, sizes would double 32 times), then each next while it
            // holds no more than those taken: every merged row's chunk at least doubles.
            let mut rows = open[0].0;
            let mut taken = 1;
            while taken < open.len() && (open[taken].0 > rows && taken < open.len() - 1) {
                rows += open[taken].0;
                taken += 1;
            }
            rows += open[taken].0;
            taken += 1;
            while taken < open.len() && open[taken].0 <= rows {
                rows += open[taken].0;
                taken += 1;
            }
            let ids: Vec<u32> = open[..taken].iter().map(|(_, id)| *id).collect();
            self.merge(&ids)?;
        }
    }

    /// Replaces the chunks `ids` with chunks of their live rows, sorted by purge value (nulls
    /// first) and cut at [`CHUNK_ROWS`] rows and about [`CHUNK_BYTES`]; the keys are moved in
    /// row format, not converted again, and the index is pointed at the new places.
    ///
    /// The new chunks are built before anything changes, so an error (an overflow `cut` cannot
    /// split) leaves the table as it was.
    fn merge(&mut self, ids: &[u32]) -> Result<()> {
        let merged: Vec<&Chunk> = ids
            .iter()
            .map(|id| self.chunk(*id))
            .collect::<Result<_>>()?;
        let mut live: Vec<(Option<i64>, usize, usize)> = Vec::new();
        let mut bytes = 0;
        for (offset, chunk) in merged.iter().enumerate() {
            let values = purge_values(&chunk.rows, self.purge_column)?;
            bytes += batch_bytes(&chunk.rows) * chunk.live_rows / chunk.rows.num_rows().max(1);
            for row in (0..chunk.rows.num_rows()).filter(|r| chunk.live[*r]) {
                let value = values.is_valid(row).then(|| values.value(row));
                live.push((value, offset, row));
            }
        }
        live.sort_by_key(|(value, _, _)| *value);
        let per_row = bytes / live.len().max(1);
        let rows_per_chunk = (CHUNK_BYTES / per_row.max(1)).clamp(1, CHUNK_ROWS);
        let places: Vec<(usize, usize)> = live.iter().map(|(_, c, r)| (*c, *r)).collect();
        let mut made = Vec::new();
        for piece in places.chunks(rows_per_chunk) {
            self.cut(&merged, piece, piece.len() == rows_per_chunk, &mut made)?;
        }
        let dropped: usize = merged.iter().map(|c| c.dead_rows()).sum();
        // Ids for the new chunks, none of the merged ones': those are freed only once the index
        // no longer names them.
        let mut new_ids = Vec::with_capacity(made.len());
        for _ in &made {
            let id = match self.free_ids.pop() {
                Some(id) => id,
                None => {
                    self.chunks.push(None);
                    location_part(self.chunks.len() - 1)?
                }
            };
            new_ids.push(id);
        }
        if self.converter.is_some() {
            for ((chunk, places), new_id) in made.iter().zip(&new_ids) {
                for (new_row, (old_chunk, old_row)) in places.iter().enumerate() {
                    let old = Location {
                        chunk: ids[*old_chunk],
                        row: location_part(*old_row)?,
                    };
                    let hash = self.hasher.hash_one(key_of(chunk, new_row));
                    let entry = self
                        .index
                        .find_mut(hash, |e| e.at == old)
                        .ok_or_else(|| internal("a live group of the state is not indexed"))?;
                    entry.at = Location {
                        chunk: *new_id,
                        row: location_part(new_row)?,
                    };
                }
            }
        }
        for ((chunk, _), id) in made.into_iter().zip(new_ids) {
            self.chunks[id as usize] = Some(chunk);
        }
        for id in ids {
            self.chunks[*id as usize] = None;
        }
        self.free_ids.extend_from_slice(ids);
        self.dead_rows -= dropped;
        Ok(())
    }

    /// Gathers the rows at `places` of `merged` into a chunk, cut in two again (recursively) if
    /// their variable-width values overflow Arrow's 32-bit offsets. `full`: at the size limit.
    fn cut(
        &self,
        merged: &[&Chunk],
        places: &[(usize, usize)],
        full: bool,
        made: &mut Vec<(Chunk, Vec<(usize, usize)>)>,
    ) -> Result<()> {
        let batches: Vec<&RecordBatch> = merged.iter().map(|c| &c.rows).collect();
        let rows = match interleave_record_batch(&batches, places) {
            Err(ArrowError::OffsetOverflowError(_)) if places.len() > 1 => {
                let (first, second) = places.split_at(places.len() / 2);
                self.cut(merged, first, true, made)?;
                return self.cut(merged, second, true, made);
            }
            rows => rows?,
        };
        let keys = match &self.converter {
            Some(converter) => {
                let data: usize = places
                    .iter()
                    .map(|(c, r)| key_of(merged[*c], *r).len())
                    .sum();
                let mut keys = converter.empty_rows(places.len(), data);
                for (c, r) in places {
                    if let Some(from) = &merged[*c].keys {
                        keys.push(from.row(*r));
                    }
                }
                Some(keys)
            }
            None => None,
        };
        let mut chunk = Chunk::new(rows, keys, self.purge_column, true)?;
        chunk.full = full;
        made.push((chunk, places.to_vec()));
        Ok(())
    }
}

/// The key bytes of the row at `l` (none if its chunk is gone, which matches no key).
fn key_at(chunks: &[Option<Chunk>], l: Location) -> &[u8] {
    chunks
        .get(l.chunk as usize)
        .and_then(Option::as_ref)
        .map_or(&[], |chunk| key_of(chunk, l.row as usize))
}

fn key_of(chunk: &Chunk, row: usize) -> &[u8] {
    chunk.keys.as_ref().map_or(&[], |keys| keys.row(row).data())
}

fn purge_values(
    rows: &RecordBatch,
    column: usize,
) -> Result<&PrimitiveArray<TimestampMicrosecondType>> {
    rows.column(column)
        .as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| {
            Error::UnsupportedQuery(format!(
                "the state's column {} is not a timestamp",
                rows.schema().field(column).name()
            ))
        })
}

/// A chunk or row number as stored in the index.
fn location_part(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        Error::InvalidJob("the aggregate's state holds more than 2³² chunks or rows in one".into())
    })
}

fn internal(what: &str) -> Error {
    Error::InvalidJob(format!("internal error in the aggregate's state: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray, TimestampMicrosecondArray};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema, TimeUnit};
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    /// A group is (k, w) — a key and a window — and carries the newest time `t` seen (the purge
    /// column, as a running aggregate's) and a sum `v`.
    fn schema() -> SchemaRef {
        let time = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("w", time.clone(), false),
            Field::new("t", time, true),
            Field::new("v", DataType::Int64, false),
        ]))
    }

    type Key = (Option<u8>, i64);
    type Value = (Option<i64>, i64);

    fn rows(values: &[(Key, Value)]) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(StringArray::from_iter(
                    values.iter().map(|r| r.0.0.map(|k| format!("k{k}"))),
                )),
                Arc::new(
                    TimestampMicrosecondArray::from_iter_values(values.iter().map(|r| r.0.1))
                        .with_timezone("UTC"),
                ),
                Arc::new(
                    TimestampMicrosecondArray::from_iter(values.iter().map(|r| r.1.0))
                        .with_timezone("UTC"),
                ),
                Arc::new(Int64Array::from_iter_values(values.iter().map(|r| r.1.1))),
            ],
        )
        .unwrap()
    }

    /// Rows as (key, value) pairs; a group's rows merged (newest `t`, summed `v`) if `merge`,
    /// else a group twice is a failure.
    fn contents(batches: &[RecordBatch], merge: bool) -> BTreeMap<Key, Value> {
        let mut out: BTreeMap<Key, Value> = BTreeMap::new();
        for b in batches {
            let k = b.column(0).as_string::<i32>();
            let w = b.column(1).as_primitive::<TimestampMicrosecondType>();
            let t = b.column(2).as_primitive::<TimestampMicrosecondType>();
            let v = b.column(3).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                let key = (
                    k.is_valid(i).then(|| k.value(i)[1..].parse().unwrap()),
                    w.value(i),
                );
                let value = (t.is_valid(i).then(|| t.value(i)), v.value(i));
                match out.get_mut(&key) {
                    Some(old) if merge => *old = (old.0.max(value.0), old.1 + value.1),
                    Some(_) => panic!("group {key:?} twice"),
                    None => {
                        out.insert(key, value);
                    }
                }
            }
        }
        out
    }

    fn as_rows(groups: &BTreeMap<Key, Value>) -> Vec<(Key, Value)> {
        groups.iter().map(|(k, v)| (*k, *v)).collect()
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// A batch's partial rows, in pieces (a group may be in several, as from several
        /// partitions); `split` cuts the merged rows in two before inserting them, so a group
        /// may come back to be merged again.
        Add(Vec<Vec<(Key, Value)>>, usize),
        /// Remove the groups whose `t` is below this (or null).
        Purge(i64),
    }

    fn step() -> impl Strategy<Value = Step> {
        let row = (
            (proptest::option::weighted(0.9, 0..30u8), 0..3i64),
            (proptest::option::weighted(0.9, 0..20i64), 1..5i64),
        );
        prop_oneof![
            4 => (
                proptest::collection::vec(proptest::collection::vec(row, 0..12), 1..4),
                0..12usize,
            )
                .prop_map(|(pieces, split)| Step::Add(pieces, split)),
            1 => (0..22i64).prop_map(Step::Purge),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// Taking the touched groups, merging and inserting them back (again for a group
        /// inserted twice), and purging keep exactly what a map of the groups keeps, through
        /// merges of the smallest chunks, full merges and size-capped chunks.
        #[test]
        fn the_table_holds_what_a_map_of_the_groups_holds(
            steps in proptest::collection::vec(step(), 1..80),
        ) {
            let mut table = GroupTable::keyed(schema(), 2, 2).unwrap();
            let mut model: BTreeMap<Key, Value> = BTreeMap::new();
            for (number, step) in steps.into_iter().enumerate() {
                match step {
                    Step::Add(pieces, split) => {
                        let partials: Vec<RecordBatch> = pieces.iter().map(|p| rows(p)).collect();
                        let mut pending = partials;
                        let mut first_take = true;
                        while pending.iter().any(|b| b.num_rows() > 0) {
                            let taken = table.take(&pending).unwrap();
                            let old = contents(&taken, false);
                            // The first take finds the groups as they were (later ones, what
                            // the first insert put back).
                            for (key, value) in old.iter().filter(|_| first_take) {
                                prop_assert_eq!(model.get(key), Some(value));
                            }
                            let mut all = taken;
                            all.append(&mut pending);
                            let merged = as_rows(&contents(&all, true));
                            let cut = split.min(merged.len());
                            let (first, second) = merged.split_at(cut);
                            let mut second = second.to_vec();
                            if let Some(a) = first.first().filter(|_| first_take && split % 3 == 0) {
                                // The group again in the second half (adding nothing): inserted
                                // twice, it must come back.
                                second.push((a.0, (a.1.0, 0)));
                            }
                            pending = table.insert(vec![rows(first), rows(&second)]).unwrap();
                            first_take = false;
                        }
                        let partials: Vec<RecordBatch> = pieces.iter().map(|p| rows(p)).collect();
                        for (key, value) in contents(&partials, true) {
                            let entry = model.entry(key).or_insert((None, 0));
                            *entry = (entry.0.max(value.0), entry.1 + value.1);
                        }
                        // The touched groups, each once, as merged.
                        let touched = contents(&table.lookup(&partials).unwrap(), false);
                        let want: BTreeMap<Key, Value> = contents(&partials, true)
                            .keys()
                            .map(|k| (*k, model[k]))
                            .collect();
                        prop_assert_eq!(touched, want);
                    }
                    Step::Purge(bound) => {
                        let may_remove = table.may_have_below(bound);
                        let gone = contents(&table.remove_below(bound).unwrap(), false);
                        prop_assert!(may_remove || gone.is_empty(), "removed what it may not");
                        let want: BTreeMap<Key, Value> = model
                            .iter()
                            .filter(|(_, (t, _))| t.is_none_or(|t| t < bound))
                            .map(|(k, v)| (*k, *v))
                            .collect();
                        prop_assert_eq!(gone, want);
                        model.retain(|_, (t, _)| t.is_some_and(|t| t >= bound));
                    }
                }
                prop_assert_eq!(table.live_rows(), model.len());
                prop_assert_eq!(table.index.len(), table.live_rows());
                for e in &table.index {
                    let chunk = table.chunk(e.at.chunk).unwrap();
                    prop_assert!(chunk.live[e.at.row as usize], "indexed rows are live");
                    prop_assert_eq!(table.hasher.hash_one(key_of(chunk, e.at.row as usize)), e.hash);
                }
                prop_assert_eq!(contents(&table.rows().unwrap(), false), model.clone());
                if number % 3 == 2 {
                    // As a take begins (other steps leave compaction to the next take).
                    table.compact_if_due().unwrap();
                    prop_assert!(table.chunks().filter(|c| !c.full).count() <= MAX_CHUNKS);
                    prop_assert!(table.chunks().all(|c| c.live_rows > 0), "no empty chunk is kept");
                    prop_assert!(table.dead_rows <= table.live_rows);
                    prop_assert_eq!(contents(&table.rows().unwrap(), false), model.clone());
                }
                prop_assert!(table.chunks().all(|c| !c.sorted || c.rows.num_rows() <= CHUNK_ROWS));
                prop_assert_eq!(
                    table.chunks.len(),
                    table.chunks().count() + table.free_ids.len(),
                    "every id is a chunk or free"
                );
                prop_assert!(table.chunks.len() <= 64, "ids are reused: {}", table.chunks.len());
                prop_assert_eq!(
                    table.dead_rows,
                    table.chunks().map(Chunk::dead_rows).sum::<usize>()
                );
            }
        }
    }

    /// A purge closing a few groups unindexes them one by one, one closing many in a pass over
    /// the index (shrunk when over 4× the groups before the purge): either way the index holds
    /// the live rows, and the groups left are found.
    #[test]
    fn a_purge_unindexes_few_groups_by_probe_and_many_in_one_pass() {
        let mut table = GroupTable::keyed(schema(), 2, 2).unwrap();
        let groups: Vec<(Key, Value)> = (0..4 * 2000i64)
            .map(|i| ((Some((i % 200) as u8), i / 200), (Some(i / 8), 1)))
            .collect();
        assert!(table.insert(vec![rows(&groups)]).unwrap().is_empty());
        let allocated = table.index.allocation_size();
        // 80 of 8000 groups (a probe each), then 4000 of 7920 (one pass), then all but 80 (one
        // pass; the index kept: it is not 4× the 3920 groups before), then half of the 80 (one
        // pass, the index shrunk: 4× more than the 80 before).
        let count = |batches: Vec<RecordBatch>| batches.iter().map(RecordBatch::num_rows).sum();
        let mut live = groups.len();
        for (bound, left) in [(10, 7920), (510, 3920), (990, 80), (995, 40)] {
            let gone: usize = count(table.remove_below(bound).unwrap());
            assert_eq!((gone, table.live_rows()), (live - left, left));
            live = left;
            assert_eq!(table.index.len(), left);
            for e in &table.index {
                assert!(table.chunk(e.at.chunk).unwrap().live[e.at.row as usize]);
            }
            let found: usize = count(table.lookup(&[rows(&groups)]).unwrap());
            assert_eq!(found, left);
            if bound == 990 {
                assert_eq!(table.index.allocation_size(), allocated);
            }
        }
        assert!(
            table.index.allocation_size() < allocated / 4,
            "{allocated} → {}",
            table.index.allocation_size()
        );
    }

    #[test]
    fn a_group_inserted_again_comes_back_and_reset_refuses_it() {
        let mut table = GroupTable::keyed(schema(), 2, 2).unwrap();
        let one = ((Some(1), 0), (Some(5), 1));
        assert!(table.insert(vec![rows(&[one])]).unwrap().is_empty());
        let back = table
            .insert(vec![rows(&[((Some(1), 0), (Some(6), 2))])])
            .unwrap();
        assert_eq!(contents(&back, false).len(), 1);
        assert_eq!(
            contents(&table.rows().unwrap(), false)[&(Some(1), 0)],
            (Some(5), 1)
        );
        let err = table.reset(vec![rows(&[one, one])]).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    /// Two values of 1.1 GiB sorted next to each other, among many small rows (so the cut by
    /// the average row puts them in one piece): 2.2 GiB overflow a string column's 32-bit
    /// offsets, and the piece is cut in two again until each fits.
    #[test]
    fn a_merge_cuts_a_piece_again_when_its_strings_overflow_32_bit_offsets() {
        let time = DataType::Timestamp(TimeUnit::Microsecond, None);
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("t", time, false),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = |keys: std::ops::Range<i64>, t: i64, text: &str| {
            let n = keys.end - keys.start;
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from_iter_values(keys)),
                    Arc::new(TimestampMicrosecondArray::from_iter_values(
                        (0..n).map(|_| t),
                    )),
                    Arc::new(StringArray::from_iter_values((0..n).map(|_| text))),
                ],
            )
            .unwrap()
        };
        let big = "x".repeat(1_100 << 20);
        let mut table = GroupTable::keyed(Arc::clone(&schema), 1, 1).unwrap();
        let inserted = vec![
            batch(0..1, 0, &big),
            batch(1..2, 0, &big),
            batch(2..3000, 1, "small"),
        ];
        assert!(table.insert(inserted).unwrap().is_empty());
        drop(big);
        let ids: Vec<u32> = (0..3).collect();
        table.merge(&ids).unwrap();
        let sizes: Vec<usize> = table
            .rows()
            .unwrap()
            .iter()
            .map(RecordBatch::num_rows)
            .collect();
        assert_eq!(sizes.iter().sum::<usize>(), 3000);
        assert_eq!(table.live_rows(), 3000);
        assert!(
            table
                .chunks()
                .all(|c| c.rows.column(2).as_string::<i32>().value_data().len() < 1 << 31),
            "{sizes:?}"
        );
        // Read in place (a copy would add 2.2 GiB to the test's peak).
        let lens: Vec<usize> = table
            .chunks()
            .flat_map(|c| {
                let text = c.rows.column(2).as_string::<i32>();
                (0..text.len()).map(move |i| text.value_length(i) as usize)
            })
            .filter(|len| *len > "small".len())
            .collect();
        assert_eq!(
            lens,
            vec![1_100 << 20; 2],
            "both big rows are still there, whole"
        );
    }

    #[test]
    fn an_unkeyed_table_refuses_take_and_purges_like_a_keyed_one() {
        let mut table = GroupTable::unkeyed(2);
        assert!(table.take(&[rows(&[])]).is_err());
        table
            .reset(vec![rows(&[
                ((Some(1), 0), (Some(5), 1)),
                ((Some(1), 0), (None, 2)),
            ])])
            .unwrap();
        assert_eq!(table.live_rows(), 2);
        let gone = table.remove_below(3).unwrap();
        assert_eq!(
            gone.iter().map(RecordBatch::num_rows).sum::<usize>(),
            1,
            "the null"
        );
        assert_eq!(table.remove_below(6).unwrap()[0].num_rows(), 1);
        assert_eq!(table.live_rows(), 0);
    }
}
