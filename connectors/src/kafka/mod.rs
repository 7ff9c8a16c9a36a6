//! The Kafka source: topics of a Kafka-protocol broker, read by exact offset ranges.
//!
//! ## Offsets
//! A Kafka partition is a Sluice partition and a Kafka offset is a Sluice offset, so a batch's
//! `[start, end)` per partition is exactly what the driver recorded in its intent. The offsets of
//! record are the ones in the Delta commit; the broker's consumer-group offsets are never read
//! (nor written: this client has no group support, and monitoring reads the lag from the batch
//! log line and the manifest instead). Partition ids are the partition numbers (`"0"`, `"1"`, …)
//! for one topic, and `topic:n` when the source reads several topics (a list or a pattern).
//!
//! ## Where a partition starts
//! `starting_offsets` (`"earliest"`, `"latest"`, an RFC 3339 time, or `{ "0" = 42 }`) is
//! resolved once, the first time the job opens, and recorded in the checkpoint
//! (`sources/<name>/starting_offsets.json`), so `"latest"` means "latest when the job first
//! started", not "latest at each restart". Partitions that appear later (added to the topic, or a
//! new topic matching the pattern) start at their earliest offset. An explicit starting offset
//! outside what the broker holds is an error naming the partition, the offset and the range held.
//!
//! ## Data loss
//! If records the job still needs are gone (retention deleted them, the topic was deleted or
//! recreated), the job stops with an error naming partition, wanted offset and earliest offset —
//! unless `fail_on_data_loss = false`, where the gap becomes one dead letter (`raw` empty, the
//! error says which offsets were skipped) and the read continues at the earliest offset.
//!
//! ## Transactions
//! Records written inside a Kafka transaction count only if it commits. The source reads
//! committed records only: it never plans past a partition's last stable offset (where the
//! earliest transaction still open begins), reads record batches as they are in the log
//! (`fetch.rs`: producer ids, the transactional flag and the COMMIT/ABORT markers), holds each
//! producer's transactional records until its marker, and keeps them on COMMIT, drops them on
//! ABORT (counted in the log). A range ending inside a transaction reads on past its end for the
//! marker, which exists since everything below the last stable offset is decided; the records
//! past the range are the next batch's. This works whether or not the broker sends its list of
//! aborted transactions (tansu does not), so a replay reads the same committed records.
//!
//! ## A broker that goes away
//! Every broker call is retried with exponential backoff (0.2 s doubling to 10 s), forever, with a
//! `warn` line per attempt naming the brokers and the error, and an `info` line when the broker
//! answers again. Nothing is skipped meanwhile: the batch in flight simply waits.
//!
//! ## Columns
//! The value is decoded as JSON or CSV into the declared (or inferred, then fixed) schema, or
//! given as bytes (`format = "raw"`: columns `key`, `value`). Each row also carries `_topic`,
//! `_partition`, `_offset`, `_kafka_timestamp`, `_key` and `_headers`, then the lineage columns.
//! Event time comes from a payload field, or from the broker's timestamp only if the job says
//! `event_time = "_kafka_timestamp"`.
//!
//! ## The client
//! [`rskafka`]: pure Rust, async on tokio, no C library to build or install, and built around
//! exactly our access pattern — fetch records of one partition from an offset, list offsets —
//! with no consumer-group machinery we would have to switch off. Records are fetched over its
//! protocol layer rather than its partition client, for transactions (see `fetch.rs`). See ARCHITECTURE.md.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use rskafka::BackoffConfig;
use rskafka::client::error::{Error as KafkaError, ProtocolError};
use rskafka::client::partition::{OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::RecordAndOffset;
use serde::{Deserialize, Serialize};
use sluice_engine::checkpoint::CheckpointStore;
use sluice_engine::source::PositionForm;
use sluice_engine::{
    AvailableRange, DeadLetter, Offset, OffsetRange, PartitionId, SchemaInference, Source,
    SourceContext, SourceRead,
};
use tokio::sync::{Mutex, OnceCell};
use tracing::{info, warn};

use crate::error::{ConnectorError, Result};
use crate::evolve::{NewFields, SchemaEvolution, fields_to_add};
use crate::infer::{INFER_RECORDS, infer_csv, infer_json};
use crate::schema_log::SchemaLog;
mod config;
mod fetch;
mod records;

pub use config::{KafkaSourceConfig, OffsetSpec, Topics, ValueFormat};
pub use records::{HEADERS, KAFKA_TIMESTAMP, KEY, OFFSET, PARTITION, TOPIC};

use config::{ResolvedSpec, TopicSelection};
use fetch::{Batch, BatchFetcher, Transactions};
use records::{RecordDecoder, raw_value_schema};

const STARTING_OFFSETS_FILE: &str = "starting_offsets.json";
/// Schema evolutions one read may go through before it gives up (each adds columns).
const MAX_EVOLUTIONS_PER_READ: usize = 16;
/// The metadata columns the source adds to the value's: a value field of one of these names is
/// never added by schema evolution.
const METADATA_COLUMNS: [&str; 6] = [
    records::TOPIC,
    records::PARTITION,
    records::OFFSET,
    records::KAFKA_TIMESTAMP,
    records::KEY,
    records::HEADERS,
];
/// Upper bound of one fetch response; a single larger record batch is still returned whole.
const FETCH_MAX_BYTES: i32 = 16 * 1024 * 1024;
/// How long the broker may wait to fill a fetch. Our ranges end at offsets the broker already
/// has, so there is nothing to wait for; some brokers (tansu) wait this long regardless.
const FETCH_MAX_WAIT_MS: i32 = 50;
/// Empty fetches in a row, below the high watermark, before offsets count as holding no data
/// records (compacted away, or transaction markers).
const EMPTY_FETCHES_BEFORE_SKIP: u32 = 5;
const RETRY_FIRST_DELAY: Duration = Duration::from_millis(200);
const RETRY_MAX_DELAY: Duration = Duration::from_secs(10);
/// How long `sluice validate` waits for a broker that does not answer (a running job waits as
/// long as it takes).
const VALIDATE_PATIENCE: Duration = Duration::from_secs(5);
/// A Kafka partition: topic and number.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct TopicPartition {
    topic: String,
    partition: i32,
}

impl std::fmt::Display for TopicPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "topic {} partition {}", self.topic, self.partition)
    }
}

/// Offsets the job resolved the first time it opened, recorded in the checkpoint.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct StartingOffsets {
    partitions: BTreeMap<PartitionId, Offset>,
}

/// What the first `available()` must still record in the checkpoint.
#[derive(Debug, Default)]
struct ToRecord {
    /// Starting offsets resolved by this run (none if a previous run recorded them).
    starts: Option<StartingOffsets>,
}

/// Topics of a Kafka-protocol broker as a [`Source`]. See the module docs.
pub struct KafkaSource {
    config: KafkaSourceConfig,
    selection: TopicSelection,
    delimiter: u8,
    client: OnceCell<Client>,
    partition_clients: Mutex<HashMap<TopicPartition, Arc<PartitionClient>>>,
    /// Reads record batches as they are in the log, transaction markers included.
    fetcher: BatchFetcher,
    /// Validating only: give up on an unreachable broker after [`VALIDATE_PATIENCE`].
    fail_fast: bool,
    opened: Option<Opened>,
}

struct Opened {
    name: String,
    checkpoint: CheckpointStore,
    /// Decodes values with the schema in force; replaced when schema evolution grows it.
    decoder: Mutex<Arc<RecordDecoder>>,
    evolution: SchemaEvolution,
    /// The starting offsets in force: resolved by this run, or recorded by an earlier one.
    starts: Mutex<StartingOffsets>,
    /// Caps from `ending_offsets`, resolved at open.
    ends: Option<BTreeMap<PartitionId, Offset>>,
    /// What the first `available()` must still record in the checkpoint (`validate` writes
    /// nothing, so recording waits until the job really runs).
    to_record: Mutex<ToRecord>,
    /// The value schema as the checkpoint records it (an inferred one is fixed by the first
    /// `available()`); `None` for raw values.
    schema_log: Option<Mutex<SchemaLog>>,
    inference: Option<SchemaInference>,
    /// Partitions seen so far; one that disappears means the topic was deleted.
    known: Mutex<BTreeSet<PartitionId>>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("bootstrap_servers", &self.config.bootstrap_servers)
            .field("topics", &self.selection)
            .finish()
    }
}

impl KafkaSource {
    /// A Kafka source; nothing is contacted until the job opens it.
    ///
    /// # Errors
    /// If the settings are inconsistent: no topic or both `topic` and `topic_pattern`, a bad
    /// pattern, offsets spec or delimiter, or a `schema` with `format = "raw"`.
    pub fn new(config: KafkaSourceConfig) -> Result<Self> {
        let bad = |m: String| Err(ConnectorError::Config(m));
        let selection = match (&config.topic, &config.topic_pattern) {
            (Some(Topics::One(t)), None) => TopicSelection::Single(t.clone()),
            (Some(Topics::Many(ts)), None) if !ts.is_empty() => TopicSelection::List(ts.clone()),
            (None, Some(p)) => {
                let re = regex::Regex::new(&format!("^(?:{p})$")).map_err(|e| {
                    ConnectorError::Config(format!("topic_pattern '{p}' is not a regex: {e}"))
                })?;
                TopicSelection::Pattern(re)
            }
            (Some(_), Some(_)) => return bad("set either topic or topic_pattern, not both".into()),
            _ => return bad("topic (a name or a list) or topic_pattern is required".into()),
        };
        if config
            .bootstrap_servers
            .split(',')
            .all(|s| s.trim().is_empty())
        {
            return bad("bootstrap_servers is empty; give host:port of a broker".into());
        }
        if config.max_records_per_batch == 0 {
            return bad("max_records_per_batch = 0: a batch must read at least one record".into());
        }
        config.starting_offsets.resolve("starting_offsets")?;
        if let Some(end) = &config.ending_offsets {
            end.resolve("ending_offsets")?;
            if matches!(end, OffsetSpec::Named(n) if n != "latest") {
                return bad("ending_offsets must be \"latest\" or a table of offsets".into());
            }
        }
        let delimiter = match config.delimiter.as_bytes() {
            [b] if !matches!(b, b'"' | b'\r' | b'\n') => *b,
            _ => {
                return bad(format!(
                    "delimiter '{}' must be exactly one character, not a quote or a line break",
                    config.delimiter.escape_debug()
                ));
            }
        };
        if config.format == ValueFormat::Raw && config.schema.is_some() {
            return bad("format = \"raw\" has fixed columns key and value; drop schema".into());
        }
        let fetcher = BatchFetcher::new(brokers(&config.bootstrap_servers));
        Ok(KafkaSource {
            config,
            selection,
            delimiter,
            client: OnceCell::new(),
            partition_clients: Mutex::new(HashMap::new()),
            fetcher,
            fail_fast: false,
            opened: None,
        })
    }

    fn opened(&self) -> Result<&Opened> {
        self.opened
            .as_ref()
            .ok_or_else(|| ConnectorError::Config("the kafka source was used before open()".into()))
    }

    /// The partition id of `tp` as the engine sees it.
    fn partition_id(&self, tp: &TopicPartition) -> PartitionId {
        match self.selection {
            TopicSelection::Single(_) => tp.partition.to_string(),
            _ => format!("{}:{}", tp.topic, tp.partition),
        }
    }

    fn topic_partition(&self, id: &str) -> Result<TopicPartition> {
        let parsed = match &self.selection {
            TopicSelection::Single(topic) => id.parse().ok().map(|p| (topic.clone(), p)),
            _ => id
                .rsplit_once(':')
                .and_then(|(t, p)| Some((t.to_string(), p.parse().ok()?))),
        };
        match parsed {
            Some((topic, partition)) if partition >= 0 => Ok(TopicPartition { topic, partition }),
            _ => Err(ConnectorError::Config(format!(
                "'{id}' is not a partition id of this source (expected {})",
                match self.selection {
                    TopicSelection::Single(_) => "a partition number",
                    _ => "topic:number",
                }
            ))),
        }
    }

    /// Runs one broker call, retrying transient failures with backoff until it succeeds.
    async fn retry<T, F, Fut>(&self, what: &str, call: F) -> Result<T, KafkaError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, KafkaError>>,
    {
        let started = Instant::now();
        let mut delay = RETRY_FIRST_DELAY;
        let mut attempt = 1u32;
        loop {
            let result = if self.fail_fast {
                tokio::time::timeout(VALIDATE_PATIENCE, call())
                    .await
                    .unwrap_or(Err(KafkaError::Timeout))
            } else {
                call().await
            };
            match result {
                Ok(v) => {
                    if attempt > 1 {
                        info!(
                            brokers = %self.config.bootstrap_servers,
                            what,
                            attempts = attempt,
                            waited_ms = started.elapsed().as_millis() as u64,
                            "kafka broker answers again"
                        );
                    }
                    return Ok(v);
                }
                Err(e) if self.fail_fast && started.elapsed() + delay >= VALIDATE_PATIENCE => {
                    return Err(e);
                }
                Err(e) if is_transient(&e) => {
                    warn!(
                        brokers = %self.config.bootstrap_servers,
                        what,
                        attempt,
                        retry_in_ms = delay.as_millis() as u64,
                        error = %e,
                        "kafka broker unavailable; retrying"
                    );
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX_DELAY);
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn kafka_error(&self, what: impl Into<String>, e: KafkaError) -> ConnectorError {
        ConnectorError::Kafka {
            brokers: self.config.bootstrap_servers.clone(),
            what: what.into(),
            detail: e.to_string(),
        }
    }

    async fn client(&self) -> Result<&Client> {
        self.client
            .get_or_try_init(|| async {
                let brokers = brokers(&self.config.bootstrap_servers);
                self.retry("connect", || {
                    ClientBuilder::new(brokers.clone())
                        .client_id("sluice")
                        .backoff_config(client_backoff())
                        .build()
                })
                .await
                .map_err(|e| self.kafka_error("connect", e))
            })
            .await
    }

    async fn partition_client(&self, tp: &TopicPartition) -> Result<Arc<PartitionClient>> {
        if let Some(c) = self.partition_clients.lock().await.get(tp) {
            return Ok(Arc::clone(c));
        }
        let client = self.client().await?;
        let pc = self
            .retry(&format!("find the leader of {tp}"), || {
                client.partition_client(tp.topic.clone(), tp.partition, UnknownTopicHandling::Error)
            })
            .await
            .map_err(|e| self.kafka_error(format!("find the leader of {tp}"), e))?;
        let pc = Arc::new(pc);
        self.partition_clients
            .lock()
            .await
            .insert(tp.clone(), Arc::clone(&pc));
        Ok(pc)
    }

    async fn offset_at(&self, tp: &TopicPartition, at: OffsetAt) -> Result<Offset> {
        let pc = self.partition_client(tp).await?;
        let what = format!("list the {at:?} offset of {tp}");
        self.retry(&what, || pc.get_offset(at))
            .await
            .map_err(|e| self.kafka_error(what.clone(), e))
    }

    /// The partitions of the selected topics that exist now, by partition id.
    async fn partitions(&self) -> Result<BTreeMap<PartitionId, TopicPartition>> {
        let client = self.client().await?;
        let topics = self
            .retry("list topics", || client.list_topics())
            .await
            .map_err(|e| self.kafka_error("list topics", e))?;
        for required in self.selection.required() {
            if !topics.iter().any(|t| t.name == required) {
                return Err(ConnectorError::Kafka {
                    brokers: self.config.bootstrap_servers.clone(),
                    what: format!("topic '{required}'"),
                    detail: "no such topic (create it first; Sluice does not create topics)".into(),
                });
            }
        }
        let mut out = BTreeMap::new();
        for topic in topics.iter().filter(|t| self.selection.matches(&t.name)) {
            for &partition in &topic.partitions {
                let tp = TopicPartition {
                    topic: topic.name.clone(),
                    partition,
                };
                out.insert(self.partition_id(&tp), tp);
            }
        }
        Ok(out)
    }

    /// Resolves `starting_offsets` for the partitions that exist now, checking explicit offsets
    /// against what the broker holds.
    async fn resolve_starts(
        &self,
        partitions: &BTreeMap<PartitionId, TopicPartition>,
    ) -> Result<StartingOffsets> {
        let mut starts = StartingOffsets::default();
        match self.config.starting_offsets.resolve("starting_offsets")? {
            ResolvedSpec::At(at) => {
                for (id, tp) in partitions {
                    let offset = match at {
                        // No record at or after the time: start at the end.
                        OffsetAt::Timestamp(_) => match self.offset_at(tp, at).await? {
                            o if o >= 0 => o,
                            _ => self.offset_at(tp, OffsetAt::Latest).await?,
                        },
                        _ => self.offset_at(tp, at).await?,
                    };
                    starts.partitions.insert(id.clone(), offset);
                }
            }
            ResolvedSpec::Explicit(map) => {
                if let Some(unknown) = map.keys().find(|k| !partitions.contains_key(*k)) {
                    return Err(ConnectorError::Config(format!(
                        "starting_offsets names partition '{unknown}', which the topic does not \
                         have (partitions: {})",
                        partitions.keys().cloned().collect::<Vec<_>>().join(", ")
                    )));
                }
                for (id, tp) in partitions {
                    let earliest = self.offset_at(tp, OffsetAt::Earliest).await?;
                    let Some(&wanted) = map.get(id) else {
                        starts.partitions.insert(id.clone(), earliest);
                        continue;
                    };
                    let latest = self.offset_at(tp, OffsetAt::Latest).await?;
                    if wanted > latest || (wanted < earliest && self.config.fail_on_data_loss) {
                        return Err(ConnectorError::OffsetOutOfRange {
                            partition: tp.to_string(),
                            wanted,
                            earliest,
                            latest,
                            detail: format!("starting_offsets.\"{id}\" = {wanted}"),
                        });
                    }
                    if wanted < earliest {
                        warn!(partition = %tp, wanted, earliest, "starting offset is below the earliest held; starting at the earliest (fail_on_data_loss = false)");
                    }
                    starts.partitions.insert(id.clone(), wanted.max(earliest));
                }
            }
        }
        Ok(starts)
    }

    /// Samples up to [`INFER_RECORDS`] values from the start of the partitions.
    async fn sample_values(
        &self,
        partitions: &BTreeMap<PartitionId, TopicPartition>,
        starts: &StartingOffsets,
    ) -> Result<Vec<(String, Vec<u8>)>> {
        let mut values = Vec::new();
        for (id, tp) in partitions {
            let from = starts.partitions.get(id).copied().unwrap_or(0);
            let latest = self.offset_at(tp, OffsetAt::Latest).await?;
            let wanted = (INFER_RECORDS - values.len()) as i64;
            let (records, _) = self
                .fetch(tp, OffsetRange::new(from, latest.min(from + wanted)))
                .await?;
            values.extend(records.into_iter().filter_map(|r| {
                let value = r.record.value?;
                Some((format!("{id}@{}", r.offset), value))
            }));
            if values.len() >= INFER_RECORDS {
                break;
            }
        }
        Ok(values)
    }

    /// `records` of `partition` decoded (on a blocking thread) with the schema in force, and
    /// the fields they bring that it lacks, under `add_columns` ([`fields_to_add`]; `None`:
    /// nothing new) — judged against the schema this read decoded with, as another
    /// partition's read may grow it meanwhile.
    async fn decode(
        &self,
        partition: &PartitionId,
        tp: &TopicPartition,
        records: &Arc<Vec<RecordAndOffset>>,
    ) -> sluice_engine::Result<(SourceRead, Option<NewFields>)> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("kafka", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        let decoder = Arc::clone(&*opened.decoder.lock().await);
        let decoded_with = decoder.value_schema();
        let (id, tp, records) = (partition.clone(), tp.clone(), Arc::clone(records));
        let read = tokio::task::spawn_blocking(move || decoder.decode(&id, &tp, &records))
            .await
            .map_err(|e| wrap(ConnectorError::Config(format!("decoding task failed: {e}"))))?
            .map_err(wrap)?;
        let new = fields_to_add(
            opened.evolution,
            &decoded_with,
            &read.dead_letters,
            &METADATA_COLUMNS,
        );
        Ok((read, new.map_err(wrap)?))
    }

    /// Fetches the committed records of `range` (see "Transactions" in the module docs).
    /// Returns them in offset order and, when `fail_on_data_loss = false`, the gaps skipped as
    /// dead letters.
    async fn fetch(
        &self,
        tp: &TopicPartition,
        range: OffsetRange,
    ) -> Result<(Vec<RecordAndOffset>, Vec<DeadLetter>)> {
        let id = self.partition_id(tp);
        let mut gaps = Vec::new();
        let mut txns = Transactions::default();
        let mut next = range.start;
        let mut empty_fetches = 0;
        while next < range.end || !txns.waiting().is_empty() {
            let what = format!("fetch {tp} from offset {next}");
            let batches = match self
                .retry(&what, || {
                    self.fetcher.fetch(
                        &tp.topic,
                        tp.partition,
                        next,
                        FETCH_MAX_BYTES,
                        FETCH_MAX_WAIT_MS,
                    )
                })
                .await
            {
                Ok(batches) => batches,
                Err(KafkaError::ServerError {
                    protocol_error: ProtocolError::OffsetOutOfRange,
                    ..
                }) => Vec::new(),
                Err(e) => return Err(self.kafka_error(what, e)),
            };
            let batches: Vec<Batch> = batches
                .into_iter()
                .filter(|b| b.last_offset >= next)
                .collect();
            let first = batches.first().map(|b| {
                b.records
                    .iter()
                    .map(|r| r.offset)
                    .find(|o| *o >= next)
                    .unwrap_or(b.last_offset)
            });
            // Nothing at `next`: deleted (retention), truncated, or offsets without records
            // (compaction). Only the first is data loss.
            let mut earliest = None;
            if first != Some(next) {
                earliest = Some(self.offset_at(tp, OffsetAt::Earliest).await?);
            }
            if let Some(earliest) = earliest.filter(|e| next < *e) {
                if self.config.fail_on_data_loss || !txns.waiting().is_empty() {
                    return Err(ConnectorError::DataLoss {
                        partition: tp.to_string(),
                        wanted: next,
                        earliest,
                    });
                }
                let skipped_to = earliest.min(range.end);
                warn!(partition = %tp, from = next, to = skipped_to, "data loss: offsets deleted before the job read them were skipped (fail_on_data_loss = false)");
                gaps.push(DeadLetter {
                    partition: id.clone(),
                    offset: next,
                    position: format!("{id}@{next}"),
                    raw: Vec::new(),
                    error: format!(
                        "data loss: offsets {next}..{skipped_to} of {tp} were deleted from \
                         the broker before this job read them; skipped \
                         (fail_on_data_loss = false)"
                    ),
                });
                next = skipped_to;
                continue;
            }
            if batches.is_empty() {
                let latest = self.offset_at(tp, OffsetAt::Latest).await?;
                if next < range.end && latest < range.end {
                    return Err(ConnectorError::OffsetOutOfRange {
                        partition: tp.to_string(),
                        wanted: range.end - 1,
                        earliest: earliest.unwrap_or(next),
                        latest,
                        detail: "this batch read up to it before; was the topic deleted or \
                                 recreated?"
                            .into(),
                    });
                }
                if next >= range.end {
                    // Past the range, still waiting for a transaction's marker: it is decided
                    // (the range ends at or below the last stable offset), so it will come.
                    warn!(partition = %tp, producers = ?txns.waiting(), "waiting for the COMMIT or ABORT marker of transactions read in this batch");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                empty_fetches += 1;
                if empty_fetches >= EMPTY_FETCHES_BEFORE_SKIP {
                    info!(partition = %tp, from = next, to = range.end, "these offsets hold no records (compacted away); moving on");
                    next = range.end;
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(20 * u64::from(empty_fetches))).await;
                continue;
            }
            empty_fetches = 0;
            for batch in batches {
                let last = batch.last_offset;
                txns.add(batch, next, range);
                next = next.max(last + 1);
            }
        }
        let (records, aborted) = txns.finish();
        if aborted > 0 {
            info!(partition = %tp, range = %range, aborted, "records of aborted transactions skipped");
        }
        Ok((records, gaps))
    }
}

/// The `host:port` entries of `bootstrap_servers`.
fn brokers(bootstrap_servers: &str) -> Vec<String> {
    bootstrap_servers
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Errors worth retrying: the broker is unreachable, restarting, or moving leadership.
fn is_transient(e: &KafkaError) -> bool {
    match e {
        KafkaError::Connection(_)
        | KafkaError::Request(_)
        | KafkaError::RetryFailed(_)
        | KafkaError::Timeout => true,
        KafkaError::ServerError { protocol_error, .. } => matches!(
            protocol_error,
            ProtocolError::UnknownServerError
                | ProtocolError::LeaderNotAvailable
                | ProtocolError::NotLeaderOrFollower
                | ProtocolError::RequestTimedOut
                | ProtocolError::BrokerNotAvailable
                | ProtocolError::ReplicaNotAvailable
                | ProtocolError::NetworkException
                | ProtocolError::NotEnoughReplicas
                | ProtocolError::NotEnoughReplicasAfterAppend
                | ProtocolError::CoordinatorLoadInProgress
                | ProtocolError::CoordinatorNotAvailable
                | ProtocolError::KafkaStorageError
                | ProtocolError::OffsetNotAvailable
        ),
        _ => false,
    }
}

/// The client's own retries (nested: a request retries its connection attempts) give up after a
/// second or two, so that an outage surfaces in [`KafkaSource::retry`], which logs it.
fn client_backoff() -> BackoffConfig {
    BackoffConfig {
        init_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(500),
        base: 2.0,
        deadline: Some(Duration::from_millis(500)),
    }
}

#[async_trait]
impl Source for KafkaSource {
    async fn open(&mut self, ctx: SourceContext) -> sluice_engine::Result<SchemaRef> {
        let name = ctx.name.clone();
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&name, e);
        self.fail_fast = ctx.validating;
        let partitions = self.partitions().await.map_err(wrap)?;
        let recorded_starts: Option<StartingOffsets> =
            ctx.checkpoint.get_json(STARTING_OFFSETS_FILE).await?;
        let (starts, record_starts) = match recorded_starts {
            Some(s) => (s, false),
            None => (self.resolve_starts(&partitions).await.map_err(wrap)?, true),
        };
        let (value_schema, schema_log) = match &self.config.format {
            ValueFormat::Raw => (raw_value_schema(), None),
            _ => {
                let declared = match &self.config.schema {
                    Some(ddl) => Some(sluice_engine::schema::parse_schema(ddl).await?),
                    None => None,
                };
                let log = SchemaLog::open(ctx.checkpoint.clone(), &name, declared, || {
                    self.infer_schema(&partitions, &starts)
                })
                .await
                .map_err(wrap)?;
                (log.current(), Some(log))
            }
        };
        let inference = schema_log.as_ref().and_then(|l| l.inference().cloned());
        let format = format!("{:?}", self.config.format).to_lowercase();
        let evolution = SchemaEvolution::resolve(
            self.config.schema_evolution,
            self.config.schema.is_some(),
            self.config.format == ValueFormat::Json,
            &format,
        )
        .map_err(wrap)?;
        let decoder = RecordDecoder::new(
            evolution.data_schema(value_schema),
            self.config.format,
            self.delimiter,
            evolution,
        )
        .map_err(wrap)?;
        let batch_schema = Arc::clone(&decoder.batch_schema);
        let ends = match &self.config.ending_offsets {
            None => None,
            Some(OffsetSpec::Partitions(map)) => Some(map.clone()),
            Some(OffsetSpec::Named(_)) => {
                let mut ends = BTreeMap::new();
                for (id, tp) in &partitions {
                    let latest = self.offset_at(tp, OffsetAt::Latest).await.map_err(wrap)?;
                    ends.insert(id.clone(), latest);
                }
                Some(ends)
            }
        };
        let to_record = ToRecord {
            starts: record_starts.then(|| starts.clone()),
        };
        self.opened = Some(Opened {
            name: ctx.name,
            checkpoint: ctx.checkpoint,
            decoder: Mutex::new(Arc::new(decoder)),
            evolution,
            starts: Mutex::new(starts),
            ends,
            to_record: Mutex::new(to_record),
            schema_log: schema_log.map(Mutex::new),
            inference,
            known: Mutex::new(BTreeSet::new()),
        });
        Ok(batch_schema)
    }

    async fn available(&self) -> sluice_engine::Result<BTreeMap<PartitionId, AvailableRange>> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("kafka", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        let to_record = std::mem::take(&mut *opened.to_record.lock().await);
        if let Some(starts) = to_record.starts.filter(|s| !s.partitions.is_empty()) {
            let bytes = opened.checkpoint.to_json(STARTING_OFFSETS_FILE, &starts)?;
            let recorded = opened
                .checkpoint
                .put_if_absent(STARTING_OFFSETS_FILE, bytes)
                .await?;
            if !recorded {
                // Another run of the job recorded its starting offsets first: they are the
                // job's, whatever this run resolved ("latest" may have moved since).
                let theirs: Option<StartingOffsets> =
                    opened.checkpoint.get_json(STARTING_OFFSETS_FILE).await?;
                if let Some(theirs) = theirs {
                    info!(source = %opened.name, "starting offsets recorded by another run of the job are used");
                    *opened.starts.lock().await = theirs;
                }
            }
        }
        let starts = opened.starts.lock().await.clone();
        if let Some(log) = &opened.schema_log {
            log.lock().await.record_pending().await.map_err(wrap)?;
        }
        let partitions = self.partitions().await.map_err(wrap)?;
        let mut known = opened.known.lock().await;
        let expected = known.iter().chain(starts.partitions.keys());
        if let Some(gone) = expected.clone().find(|id| !partitions.contains_key(*id)) {
            return Err(wrap(ConnectorError::Kafka {
                brokers: self.config.bootstrap_servers.clone(),
                what: format!("partition '{gone}'"),
                detail: "it no longer exists (was the topic deleted?); the offsets this job has \
                         committed for it can no longer be continued"
                    .into(),
            }));
        }
        let latest = futures::future::try_join_all(
            partitions
                .values()
                .map(|tp| self.offset_at(tp, OffsetAt::Latest)),
        )
        .await
        .map_err(wrap)?;
        let mut out = BTreeMap::new();
        for ((id, tp), mut latest) in partitions.iter().zip(latest) {
            let initial = match starts.partitions.get(id) {
                Some(&start) => start,
                None => {
                    if !known.contains(id) {
                        info!(source = %opened.name, partition = %tp, "new partition; reading it from its earliest offset");
                    }
                    self.offset_at(tp, OffsetAt::Earliest).await.map_err(wrap)?
                }
            };
            if let Some(&end) = opened.ends.as_ref().and_then(|ends| ends.get(id)) {
                latest = latest.min(end);
            }
            out.insert(id.clone(), AvailableRange { initial, latest });
        }
        known.extend(partitions.into_keys());
        Ok(out)
    }

    async fn read(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
    ) -> sluice_engine::Result<SourceRead> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("kafka", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        let tp = self.topic_partition(partition).map_err(wrap)?;
        let (records, gaps) = self.fetch(&tp, range).await.map_err(wrap)?;
        let records = Arc::new(records);
        // Decoded with the schema in force; under `add_columns`, fields it lacks grow it (the
        // growth recorded first) and the records are decoded again with the grown schema.
        for _ in 0..MAX_EVOLUTIONS_PER_READ {
            let (mut read, new) = self.decode(partition, &tp, &records).await?;
            let (Some(new), Some(log)) = (new, &opened.schema_log) else {
                read.dead_letters.extend(gaps);
                return Ok(read);
            };
            let (format, delimiter, evolution) =
                (self.config.format, self.delimiter, opened.evolution);
            // A grown schema the decoder refuses (a field named like a metadata column) is
            // never recorded: the job stops here, naming it.
            let accept = |schema: &SchemaRef| {
                RecordDecoder::new(
                    evolution.data_schema(Arc::clone(schema)),
                    format,
                    delimiter,
                    evolution,
                )
                .map(|_| ())
            };
            // The decoder is replaced under the log's lock, so it only ever moves forward.
            let mut log = log.lock().await;
            let grown = log
                .evolve(new.columns, new.first_seen, accept)
                .await
                .map_err(wrap)?;
            let grown = evolution.data_schema(grown);
            let mut decoder = opened.decoder.lock().await;
            if decoder.value_schema() != grown {
                *decoder = Arc::new(
                    RecordDecoder::new(grown, format, delimiter, evolution).map_err(wrap)?,
                );
            }
        }
        Err(wrap(ConnectorError::Schema(format!(
            "partition {partition} offsets {range} kept bringing new fields after \
             {MAX_EVOLUTIONS_PER_READ} schema evolutions in one read"
        ))))
    }

    /// Decoded once with the schema in force; declined where the records bring fields it
    /// lacks (under `add_columns`), for the batch's own read to add them.
    async fn read_ahead(
        &self,
        partition: &PartitionId,
        range: OffsetRange,
        _columns: Option<&[String]>,
        _positions: PositionForm,
    ) -> sluice_engine::Result<Option<SourceRead>> {
        let opened = self
            .opened()
            .map_err(|e| sluice_engine::Error::in_source("kafka", e))?;
        let wrap = |e: ConnectorError| sluice_engine::Error::in_source(&opened.name, e);
        let tp = self.topic_partition(partition).map_err(wrap)?;
        let (records, gaps) = self.fetch(&tp, range).await.map_err(wrap)?;
        let (mut read, new) = self.decode(partition, &tp, &Arc::new(records)).await?;
        if new.is_some() {
            return Ok(None);
        }
        read.dead_letters.extend(gaps);
        Ok(Some(read))
    }

    async fn current_schema(&self) -> Option<SchemaRef> {
        let opened = self.opened.as_ref()?;
        Some(Arc::clone(&opened.decoder.lock().await.batch_schema))
    }

    fn schema_inference(&self) -> Option<SchemaInference> {
        self.opened.as_ref()?.inference.clone()
    }

    fn max_per_batch(&self) -> Option<u64> {
        Some(self.config.max_records_per_batch.max(1))
    }

    fn reads_may_grow_schema(&self) -> bool {
        self.opened
            .as_ref()
            .is_none_or(|o| o.evolution == SchemaEvolution::AddColumns)
    }

    fn offsets_behind(
        &self,
        partition: &PartitionId,
        committed_end: Offset,
        latest: Offset,
    ) -> sluice_engine::Result<String> {
        let tp = self
            .topic_partition(partition)
            .map(|tp| tp.to_string())
            .unwrap_or_else(|_| format!("partition {partition}"));
        if self.config.fail_on_data_loss {
            let name = self.opened.as_ref().map_or("kafka", |o| o.name.as_str());
            return Err(sluice_engine::Error::in_source(
                name,
                ConnectorError::OffsetsBehind {
                    partition: tp,
                    latest,
                    committed_end,
                },
            ));
        }
        Ok(format!(
            "data loss: {tp} now ends at offset {latest}, below the {committed_end} this job had \
             already read (the topic was deleted and recreated, or an unclean leader election \
             lost records); its records below offset {committed_end} are skipped and reading \
             goes on from there (fail_on_data_loss = false)"
        ))
    }
}

impl KafkaSource {
    async fn infer_schema(
        &self,
        partitions: &BTreeMap<PartitionId, TopicPartition>,
        starts: &StartingOffsets,
    ) -> Result<(SchemaRef, SchemaInference)> {
        let values = self.sample_values(partitions, starts).await?;
        let Some(((first, _), (last, _))) = values.first().zip(values.last()) else {
            return Err(ConnectorError::Schema(format!(
                "cannot infer the schema: {:?} holds no messages yet; produce some or declare \
                 `schema`",
                self.selection
            )));
        };
        let sample = format!("{} messages, {first} to {last}", values.len());
        let (schema, inference) = match self.config.format {
            ValueFormat::Csv => {
                let texts: Vec<(String, &[u8])> = values
                    .iter()
                    .map(|(position, value)| (position.clone(), value.as_slice()))
                    .collect();
                infer_csv(&texts, false, self.delimiter, sample)?
            }
            _ => infer_json(
                values
                    .iter()
                    .map(|(position, value)| (value.as_slice(), position.clone())),
                sample,
            )?,
        };
        if schema.fields().is_empty() {
            return Err(ConnectorError::Schema(
                "no columns could be inferred from the first messages; declare `schema`".into(),
            ));
        }
        Ok((Arc::new(schema), inference))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp() -> TopicPartition {
        TopicPartition {
            topic: "clicks".into(),
            partition: 2,
        }
    }

    #[test]
    fn partition_ids_name_the_topic_only_for_several_topics() {
        let one = KafkaSource::new(KafkaSourceConfig::new("127.0.0.1:9092", "clicks")).unwrap();
        assert_eq!(one.partition_id(&tp()), "2");
        assert_eq!(one.topic_partition("2").unwrap(), tp());
        assert!(one.topic_partition("x").is_err());
        let mut config = KafkaSourceConfig::new("127.0.0.1:9092", "clicks");
        config.topic = None;
        config.topic_pattern = Some("click.*".into());
        let many = KafkaSource::new(config).unwrap();
        assert_eq!(many.partition_id(&tp()), "clicks:2");
        assert_eq!(many.topic_partition("clicks:2").unwrap(), tp());
        assert!(many.selection.matches("clicks"));
        assert!(!many.selection.matches("xclicks"));
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = KafkaSourceConfig::new("127.0.0.1:9092", "clicks");
        c.starting_offsets = OffsetSpec::Named("yesterday".into());
        let e = KafkaSource::new(c).unwrap_err().to_string();
        assert!(e.contains("starting_offsets = \"yesterday\""), "{e}");
        let mut c = KafkaSourceConfig::new("127.0.0.1:9092", "clicks");
        c.topic_pattern = Some("x".into());
        assert!(KafkaSource::new(c).is_err());
        let mut c = KafkaSourceConfig::new("127.0.0.1:9092", "clicks");
        c.format = ValueFormat::Raw;
        c.schema = Some("id BIGINT".into());
        assert!(KafkaSource::new(c).is_err());
    }
}
