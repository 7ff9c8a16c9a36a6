//! Fetching the record batches of one Kafka partition as they are in the log — transactional
//! batches and their COMMIT/ABORT markers included — so the source can read committed records
//! only (see [`super::KafkaSource`], "Transactions").
//!
//! rskafka's `PartitionClient::fetch_records` cannot serve this: it drops the producer id, the
//! transactional flag and the control batches that tell a committed transaction from an aborted
//! one, and it cannot decode a response holding a control batch at all (rskafka#297), so a
//! partition with a marker stalls it. The request is therefore made here, over rskafka's own
//! protocol layer (its connection handling, message framing and version negotiation: the
//! `unstable-fuzzing` feature makes them public; the version is pinned in `Cargo.lock`):
//!
//! - a Fetch (v4, `READ_UNCOMMITTED`: every batch up to the high watermark, markers included —
//!   the source never plans past the last stable offset, so what it reads is decided) sent to
//!   the partition's leader, found with a Metadata request;
//! - the response's records kept as bytes and split into batches by their headers: data batches
//!   decoded by rskafka's record-batch reader (CRC, compression), control batches read here (a
//!   record whose key is `version: i16, type: i16`, type 0 = ABORT, 1 = COMMIT).

use std::collections::{BTreeMap, HashMap};
use std::io::{Cursor, Read, Write};
use std::sync::Arc;

use rskafka::chrono::{TimeZone, Utc};
use rskafka::client::error::{Error as KafkaError, ProtocolError, RequestContext, RequestError};
use rskafka::messenger::Messenger;
use rskafka::protocol::api_key::ApiKey;
use rskafka::protocol::api_version::{ApiVersion, ApiVersionRange};
use rskafka::protocol::messages::{
    FetchRequest, FetchRequestPartition, FetchRequestTopic, IsolationLevel, MetadataRequest,
    MetadataRequestTopic, ReadVersionedError, ReadVersionedType, RequestBody, WriteVersionedError,
    WriteVersionedType,
};
use rskafka::protocol::primitives::{Boolean, Int16, Int32, Int64, NullableBytes, String_};
use rskafka::protocol::record::{ControlBatchOrRecords, Record as WireRecord, RecordBatch};
use rskafka::protocol::traits::{ReadError, ReadType};
use rskafka::record::{Record, RecordAndOffset};
use sluice_engine::OffsetRange;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

/// The largest message accepted from a broker.
const MAX_MESSAGE_SIZE: usize = 100 * 1024 * 1024;
/// Batch header bytes before the records: up to and including the record count.
const BATCH_HEADER: usize = 61;

/// A COMMIT or ABORT marker: the end of one producer's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    /// The transaction's records count.
    Commit,
    /// The transaction's records are void.
    Abort,
}

/// One record batch as it is in the log.
#[derive(Debug, Clone)]
pub(crate) struct Batch {
    /// The offset of its last record (markers take an offset too).
    pub(crate) last_offset: i64,
    /// The producer that wrote it.
    pub(crate) producer_id: i64,
    /// Written inside a transaction: its records count only once a COMMIT marker follows.
    pub(crate) transactional: bool,
    /// A control batch: the marker ending `producer_id`'s transaction.
    pub(crate) marker: Option<Marker>,
    /// The records (none for a control batch).
    pub(crate) records: Vec<RecordAndOffset>,
}

/// Read-committed over one range: the batches read for it go in, in log order; the records that
/// count come out. A producer's transactional records are held until its COMMIT (kept) or
/// ABORT (dropped) marker; markers of transactions with nothing in the range change nothing.
#[derive(Debug, Default)]
pub(crate) struct Transactions {
    /// Transactional records of the range, by producer, waiting for their marker.
    undecided: BTreeMap<i64, Vec<RecordAndOffset>>,
    /// The records that count so far.
    committed: Vec<RecordAndOffset>,
    /// Records of aborted transactions dropped.
    aborted: usize,
}

impl Transactions {
    /// Takes a batch read from offset `next` for `range`: only its records in `[next, end)`
    /// belong to the range (a batch may start before `next`; reading on past the range's end
    /// is only for markers).
    pub(crate) fn add(&mut self, batch: Batch, next: i64, range: OffsetRange) {
        let in_range = |r: &RecordAndOffset| r.offset >= next && r.offset < range.end;
        match batch.marker {
            Some(marker) => {
                if let Some(held) = self.undecided.remove(&batch.producer_id) {
                    match marker {
                        Marker::Commit => self.committed.extend(held),
                        Marker::Abort => self.aborted += held.len(),
                    }
                }
            }
            None if batch.transactional => {
                let mine: Vec<RecordAndOffset> =
                    batch.records.into_iter().filter(in_range).collect();
                if !mine.is_empty() {
                    self.undecided
                        .entry(batch.producer_id)
                        .or_default()
                        .extend(mine);
                }
            }
            None => self
                .committed
                .extend(batch.records.into_iter().filter(in_range)),
        }
    }

    /// The producers whose transactions in the range still wait for their marker.
    pub(crate) fn waiting(&self) -> Vec<i64> {
        self.undecided.keys().copied().collect()
    }

    /// The records that count, in offset order, and how many aborted ones were dropped.
    pub(crate) fn finish(mut self) -> (Vec<RecordAndOffset>, usize) {
        self.committed.sort_by_key(|r| r.offset);
        (self.committed, self.aborted)
    }
}

type Connection = Messenger<TcpStream>;

/// Fetches partitions' batches from their leaders; connections and leaders are cached, and
/// dropped on an error so the next attempt reconnects and asks again.
pub(crate) struct BatchFetcher {
    bootstrap: Vec<String>,
    connections: Mutex<HashMap<String, Arc<Connection>>>,
    leaders: Mutex<HashMap<(String, i32), String>>,
}

impl std::fmt::Debug for BatchFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchFetcher")
            .field("bootstrap", &self.bootstrap)
            .finish()
    }
}

fn io_error(e: impl std::fmt::Display) -> KafkaError {
    KafkaError::Request(RequestError::IO(std::io::Error::other(e.to_string())))
}

impl BatchFetcher {
    /// A fetcher that finds leaders through `bootstrap` (host:port each).
    pub(crate) fn new(bootstrap: Vec<String>) -> Self {
        BatchFetcher {
            bootstrap,
            connections: Mutex::new(HashMap::new()),
            leaders: Mutex::new(HashMap::new()),
        }
    }

    async fn connection(&self, addr: &str) -> Result<Arc<Connection>, KafkaError> {
        if let Some(c) = self.connections.lock().await.get(addr) {
            return Ok(Arc::clone(c));
        }
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| KafkaError::Request(RequestError::IO(e)))?;
        let mut messenger = Messenger::new(stream, MAX_MESSAGE_SIZE, Arc::from("sluice"));
        messenger.sync_versions().await.map_err(io_error)?;
        let messenger = Arc::new(messenger);
        self.connections
            .lock()
            .await
            .insert(addr.to_string(), Arc::clone(&messenger));
        Ok(messenger)
    }

    /// The address of the leader of `topic`/`partition`, asked of the first bootstrap broker
    /// that answers.
    async fn leader(&self, topic: &str, partition: i32) -> Result<String, KafkaError> {
        let key = (topic.to_string(), partition);
        if let Some(addr) = self.leaders.lock().await.get(&key) {
            return Ok(addr.clone());
        }
        let mut last_error = io_error("no bootstrap server");
        for broker in &self.bootstrap {
            let connection = match self.connection(broker).await {
                Ok(c) => c,
                Err(e) => {
                    last_error = e;
                    continue;
                }
            };
            let request = MetadataRequest {
                topics: Some(vec![MetadataRequestTopic {
                    name: String_(topic.to_string()),
                }]),
                allow_auto_topic_creation: Some(Boolean(false)),
            };
            let metadata = match connection.request(request).await {
                Ok(m) => m,
                Err(e) => {
                    self.connections.lock().await.remove(broker);
                    last_error = KafkaError::Request(e);
                    continue;
                }
            };
            let leader = metadata
                .topics
                .iter()
                .filter(|t| t.name.0 == topic)
                .flat_map(|t| &t.partitions)
                .find(|p| p.partition_index.0 == partition)
                .map(|p| p.leader_id.0);
            let addr = leader.and_then(|id| {
                metadata
                    .brokers
                    .iter()
                    .find(|b| b.node_id.0 == id)
                    .map(|b| format!("{}:{}", b.host.0, b.port.0))
            });
            let Some(addr) = addr else {
                return Err(KafkaError::ServerError {
                    protocol_error: ProtocolError::LeaderNotAvailable,
                    error_message: None,
                    request: RequestContext::Partition(topic.to_string(), partition),
                    response: None,
                    is_virtual: true,
                });
            };
            self.leaders.lock().await.insert(key, addr.clone());
            return Ok(addr);
        }
        Err(last_error)
    }

    /// The batches of `topic`/`partition` from the one holding `offset` on, at most about
    /// `max_bytes` of them (at least one whole batch).
    ///
    /// # Errors
    /// The broker's error for the partition (`OffsetOutOfRange`, …), a connection error, or a
    /// response that does not decode.
    pub(crate) async fn fetch(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        max_bytes: i32,
        max_wait_ms: i32,
    ) -> Result<Vec<Batch>, KafkaError> {
        // A batch larger than the budget comes back cut off: ask again with room for it.
        let mut budget = max_bytes;
        loop {
            let (batches, cut_off) = self
                .fetch_once(topic, partition, offset, budget, max_wait_ms)
                .await?;
            if !batches.is_empty() || !cut_off {
                return Ok(batches);
            }
            if budget >= MAX_MESSAGE_SIZE as i32 / 4 {
                return Err(KafkaError::InvalidResponse(format!(
                    "topic {topic} partition {partition}: the record batch at offset {offset} is \
                     larger than {MAX_MESSAGE_SIZE} bytes"
                )));
            }
            budget = budget.saturating_mul(4);
        }
    }

    async fn fetch_once(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        max_bytes: i32,
        max_wait_ms: i32,
    ) -> Result<(Vec<Batch>, bool), KafkaError> {
        let leader = self.leader(topic, partition).await?;
        let result = async {
            let connection = self.connection(&leader).await?;
            let request = RawFetch(FetchRequest {
                replica_id: Int32(-1),
                max_wait_ms: Int32(max_wait_ms),
                min_bytes: Int32(1),
                max_bytes: Some(Int32(max_bytes)),
                isolation_level: Some(IsolationLevel::ReadUncommitted),
                topics: vec![FetchRequestTopic {
                    topic: String_(topic.to_string()),
                    partitions: vec![FetchRequestPartition {
                        partition: Int32(partition),
                        fetch_offset: Int64(offset),
                        partition_max_bytes: Int32(max_bytes),
                    }],
                }],
            });
            let response = connection.request(request).await?;
            let part = response
                .partitions
                .into_iter()
                .find(|p| p.topic == topic && p.partition == partition)
                .ok_or_else(|| {
                    KafkaError::InvalidResponse(format!(
                        "the fetch response has no topic {topic} partition {partition}"
                    ))
                })?;
            if let Some(protocol_error) = part.error {
                return Err(KafkaError::ServerError {
                    protocol_error,
                    error_message: None,
                    request: RequestContext::Partition(topic.to_string(), partition),
                    response: None,
                    is_virtual: false,
                });
            }
            parse_batches(&part.records).map_err(|e| {
                KafkaError::InvalidResponse(format!(
                    "topic {topic} partition {partition} from offset {offset}: {e}"
                ))
            })
        }
        .await;
        if let Err(e) = &result {
            // A broker that restarted, or leadership that moved: reconnect and ask again.
            if !matches!(
                e,
                KafkaError::ServerError {
                    protocol_error: ProtocolError::OffsetOutOfRange,
                    ..
                }
            ) {
                self.connections.lock().await.remove(&leader);
                self.leaders
                    .lock()
                    .await
                    .remove(&(topic.to_string(), partition));
            }
        }
        result
    }
}

/// Splits a fetch response's record bytes into batches, and says whether a batch was cut off
/// at the end (the broker fills the byte budget with whole batches and may add a partial one,
/// left for the next fetch — unless it is the only one).
fn parse_batches(bytes: &[u8]) -> Result<(Vec<Batch>, bool), String> {
    let mut batches = Vec::new();
    let mut at = 0;
    while bytes.len() >= at + 12 {
        let base_offset = be_i64(&bytes[at..at + 8]);
        let length = usize::try_from(be_i32(&bytes[at + 8..at + 12]))
            .map_err(|_| format!("a record batch at offset {base_offset} has a negative length"))?;
        let end = at + 12 + length;
        if end > bytes.len() {
            return Ok((batches, true));
        }
        let batch = &bytes[at..end];
        at = end;
        if batch.len() < BATCH_HEADER {
            return Err(format!(
                "the record batch at offset {base_offset} is only {} bytes",
                batch.len()
            ));
        }
        let magic = batch[16];
        if magic != 2 {
            return Err(format!(
                "the batch at offset {base_offset} has message format v{magic}; only v2 (Kafka \
                 0.11 and later) is read"
            ));
        }
        let attributes = i16::from_be_bytes([batch[21], batch[22]]);
        let last_offset = base_offset + i64::from(be_i32(&batch[23..27]));
        let producer_id = be_i64(&batch[43..51]);
        let transactional = attributes & 0x10 != 0;
        if attributes & 0x20 != 0 {
            batches.push(Batch {
                last_offset,
                producer_id,
                transactional,
                marker: Some(control_marker(&batch[BATCH_HEADER..], base_offset)?),
                records: Vec::new(),
            });
            continue;
        }
        let decoded = RecordBatch::read(&mut Cursor::new(batch))
            .map_err(|e| format!("the record batch at offset {base_offset}: {e}"))?;
        let ControlBatchOrRecords::Records(records) = decoded.records else {
            return Err(format!(
                "the record batch at offset {base_offset} is a control batch in disguise"
            ));
        };
        let records = records
            .into_iter()
            .map(|r| record(decoded.base_offset, decoded.first_timestamp, r))
            .collect::<Result<Vec<_>, String>>()?;
        batches.push(Batch {
            last_offset,
            producer_id,
            transactional,
            marker: None,
            records,
        });
    }
    Ok((batches, at < bytes.len()))
}

/// The marker in a control batch's first record: its key is `version: i16, type: i16`.
fn control_marker(records: &[u8], base_offset: i64) -> Result<Marker, String> {
    let record = WireRecord::read(&mut Cursor::new(records))
        .map_err(|e| format!("the control batch at offset {base_offset}: {e}"))?;
    let key = record.key.unwrap_or_default();
    match key.get(2..4).map(|t| i16::from_be_bytes([t[0], t[1]])) {
        Some(0) => Ok(Marker::Abort),
        Some(1) => Ok(Marker::Commit),
        other => Err(format!(
            "the control batch at offset {base_offset} is neither COMMIT nor ABORT (type {other:?})"
        )),
    }
}

/// A wire record as the public record type, with its offset.
fn record(
    base_offset: i64,
    first_timestamp: i64,
    r: WireRecord,
) -> Result<RecordAndOffset, String> {
    let millis = first_timestamp
        .checked_add(r.timestamp_delta)
        .ok_or("a record's timestamp overflows")?;
    let timestamp = Utc
        .timestamp_millis_opt(millis)
        .single()
        .ok_or_else(|| format!("a record's timestamp {millis} is not a time"))?;
    Ok(RecordAndOffset {
        record: Record {
            key: r.key,
            value: r.value,
            headers: r
                .headers
                .into_iter()
                .map(|h| (h.key, h.value))
                .collect::<BTreeMap<_, _>>(),
            timestamp,
        },
        offset: base_offset + i64::from(r.offset_delta),
    })
}

fn be_i64(b: &[u8]) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    i64::from_be_bytes(a)
}

fn be_i32(b: &[u8]) -> i32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    i32::from_be_bytes(a)
}

/// rskafka's Fetch request, answered with the records left as bytes.
struct RawFetch(FetchRequest);

impl RequestBody for RawFetch {
    type ResponseBody = RawFetchResponse;
    const API_KEY: ApiKey = ApiKey::Fetch;
    const API_VERSION_RANGE: ApiVersionRange =
        ApiVersionRange::new(ApiVersion(Int16(4)), ApiVersion(Int16(4)));
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: ApiVersion = ApiVersion(Int16(12));
}

impl<W: Write> WriteVersionedType<W> for RawFetch {
    fn write_versioned(
        &self,
        writer: &mut W,
        version: ApiVersion,
    ) -> Result<(), WriteVersionedError> {
        self.0.write_versioned(writer, version)
    }
}

/// The parts of a Fetch v4 response this module needs, per topic partition.
struct RawFetchResponse {
    partitions: Vec<RawPartition>,
}

struct RawPartition {
    topic: String,
    partition: i32,
    error: Option<ProtocolError>,
    records: Vec<u8>,
}

fn array_len<R: Read>(reader: &mut R) -> Result<usize, ReadError> {
    // -1 is a null array.
    Ok(usize::try_from(Int32::read(reader)?.0).unwrap_or(0))
}

impl<R: Read> ReadVersionedType<R> for RawFetchResponse {
    fn read_versioned(reader: &mut R, _version: ApiVersion) -> Result<Self, ReadVersionedError> {
        Int32::read(reader)?; // throttle_time_ms
        let mut partitions = Vec::new();
        for _ in 0..array_len(reader)? {
            let topic = String_::read(reader)?.0;
            for _ in 0..array_len(reader)? {
                let partition = Int32::read(reader)?.0;
                let error = ProtocolError::new(Int16::read(reader)?.0);
                Int64::read(reader)?; // high_watermark
                Int64::read(reader)?; // last_stable_offset
                for _ in 0..array_len(reader)? {
                    Int64::read(reader)?; // aborted: producer_id
                    Int64::read(reader)?; // aborted: first_offset
                }
                let records = NullableBytes::read(reader)?.0.unwrap_or_default();
                partitions.push(RawPartition {
                    topic: topic.clone(),
                    partition,
                    error,
                    records,
                });
            }
        }
        Ok(RawFetchResponse { partitions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch header for `producer_id` with `attributes`, `records` and its records' bytes.
    fn batch(
        base_offset: i64,
        attributes: i16,
        last_delta: i32,
        producer_id: i64,
        records: &[u8],
        count: i32,
    ) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&0i32.to_be_bytes()); // partition leader epoch
        body.push(2); // magic
        body.extend_from_slice(&0u32.to_be_bytes()); // crc (not checked for control batches)
        body.extend_from_slice(&attributes.to_be_bytes());
        body.extend_from_slice(&last_delta.to_be_bytes());
        body.extend_from_slice(&0i64.to_be_bytes()); // first timestamp
        body.extend_from_slice(&0i64.to_be_bytes()); // max timestamp
        body.extend_from_slice(&producer_id.to_be_bytes());
        body.extend_from_slice(&0i16.to_be_bytes()); // producer epoch
        body.extend_from_slice(&0i32.to_be_bytes()); // base sequence
        body.extend_from_slice(&count.to_be_bytes());
        body.extend_from_slice(records);
        let mut out = base_offset.to_be_bytes().to_vec();
        out.extend_from_slice(&(body.len() as i32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// The record envelope of a control record with `key`.
    fn control_record(kind: i16) -> Vec<u8> {
        let key = [0i16.to_be_bytes(), kind.to_be_bytes()].concat();
        // attributes, timestamp delta 0, offset delta 0, key length 4 (zigzag 8), key,
        // value length -1 (zigzag 1), no headers
        let mut inner = vec![0u8, 0, 0, 8];
        inner.extend_from_slice(&key);
        inner.extend_from_slice(&[1, 0]);
        let mut out = vec![(inner.len() as u8) << 1];
        out.extend_from_slice(&inner);
        out
    }

    fn data(producer_id: i64, transactional: bool, offsets: std::ops::Range<i64>) -> Batch {
        Batch {
            last_offset: offsets.end - 1,
            producer_id,
            transactional,
            marker: None,
            records: offsets
                .map(|offset| RecordAndOffset {
                    record: Record {
                        key: None,
                        value: Some(offset.to_string().into_bytes()),
                        headers: BTreeMap::new(),
                        timestamp: Utc.timestamp_millis_opt(0).unwrap(),
                    },
                    offset,
                })
                .collect(),
        }
    }

    fn marker(producer_id: i64, offset: i64, marker: Marker) -> Batch {
        Batch {
            last_offset: offset,
            producer_id,
            transactional: true,
            marker: Some(marker),
            records: Vec::new(),
        }
    }

    /// Feeds `batches` for `range` as the source does (`next` moving past each batch) and
    /// returns the offsets that count, the records dropped, and whether anything still waits.
    fn resolve(batches: Vec<Batch>, range: OffsetRange) -> (Vec<i64>, usize, Vec<i64>) {
        let mut txns = Transactions::default();
        let mut next = range.start;
        for batch in batches {
            let last = batch.last_offset;
            txns.add(batch, next, range);
            next = next.max(last + 1);
        }
        let waiting = txns.waiting();
        let (records, aborted) = txns.finish();
        (records.iter().map(|r| r.offset).collect(), aborted, waiting)
    }

    #[test]
    fn committed_transactions_count_aborted_ones_do_not() {
        // Producer 1 commits 2..4, producer 2 aborts 5..6 interleaved with plain records.
        let log = || {
            vec![
                data(-1, false, 0..2),
                data(1, true, 2..4),
                data(2, true, 4..6),
                data(-1, false, 6..7),
                marker(2, 7, Marker::Abort),
                marker(1, 8, Marker::Commit),
                data(-1, false, 9..10),
            ]
        };
        let (offsets, aborted, waiting) = resolve(log(), OffsetRange::new(0, 10));
        assert_eq!(offsets, vec![0, 1, 2, 3, 6, 9]);
        assert_eq!(aborted, 2);
        assert!(waiting.is_empty());

        // A range ending inside producer 1's transaction: its records wait for the marker
        // (read past the range's end), the records past the end are not the range's.
        let (offsets, _, waiting) = resolve(log()[..3].to_vec(), OffsetRange::new(0, 3));
        assert_eq!(offsets, vec![0, 1]);
        assert_eq!(waiting, vec![1]);
        let (offsets, _, waiting) = resolve(log(), OffsetRange::new(0, 3));
        assert_eq!(offsets, vec![0, 1, 2]);
        assert!(waiting.is_empty());

        // The next range starts inside the same transaction; its marker decides the rest.
        let (offsets, aborted, _) = resolve(log()[1..].to_vec(), OffsetRange::new(3, 10));
        assert_eq!(offsets, vec![3, 6, 9]);
        assert_eq!(aborted, 2);
    }

    #[test]
    fn markers_and_cut_off_batches_are_read_from_the_headers() {
        let mut bytes = batch(7, 0x30, 0, 42, &control_record(0), 1);
        bytes.extend(batch(8, 0x30, 0, 43, &control_record(1), 1));
        let full = bytes.len();
        // A third batch cut off by the byte budget.
        bytes.extend(&batch(9, 0x30, 0, 44, &control_record(1), 1)[..20]);
        let (batches, cut_off) = parse_batches(&bytes).unwrap();
        assert!(cut_off);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].marker, Some(Marker::Abort));
        assert_eq!(batches[0].producer_id, 42);
        assert!(batches[0].transactional);
        assert_eq!(batches[1].marker, Some(Marker::Commit));
        assert_eq!(batches[1].last_offset, 8);
        assert!(!parse_batches(&bytes[..full]).unwrap().1);
        // Only a cut-off batch: nothing, and the caller asks again with a bigger budget.
        let (none, cut_off) = parse_batches(&bytes[full..]).unwrap();
        assert!(none.is_empty() && cut_off);
        let mut old = batch(1, 0, 0, -1, &[], 0);
        old[16] = 1;
        assert!(parse_batches(&old).unwrap_err().contains("format v1"));
    }
}
