//! The `[sources.<name>]` settings of `kind = "kafka"`, and what they resolve to.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rskafka::client::partition::OffsetAt;
use serde::{Deserialize, Serialize};

use crate::error::{ConnectorError, Result};

/// One topic name or several.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Topics {
    /// `topic = "clicks"`: partition ids are the partition numbers.
    One(String),
    /// `topic = ["a", "b"]`: partition ids are `topic:n`.
    Many(Vec<String>),
}

/// Where a partition starts (`starting_offsets`) or ends (`ending_offsets`), as written in the
/// job file: `"earliest"`, `"latest"`, an RFC 3339 time, or a table of partition → offset.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum OffsetSpec {
    /// `"earliest"`, `"latest"` or an RFC 3339 time.
    Named(String),
    /// `{ "0" = 42, "1" = 7 }`: explicit offsets by partition id.
    Partitions(BTreeMap<String, i64>),
}

impl OffsetSpec {
    pub(super) fn earliest() -> Self {
        OffsetSpec::Named("earliest".into())
    }

    /// Checks the spec and turns a named one into what to ask the broker.
    pub(super) fn resolve(&self, key: &str) -> Result<ResolvedSpec> {
        match self {
            OffsetSpec::Partitions(map) => {
                if let Some((p, o)) = map.iter().find(|(_, o)| **o < 0) {
                    return Err(ConnectorError::Config(format!(
                        "{key}: offset {o} for partition {p} is negative"
                    )));
                }
                Ok(ResolvedSpec::Explicit(map.clone()))
            }
            OffsetSpec::Named(s) => match s.as_str() {
                "earliest" => Ok(ResolvedSpec::At(OffsetAt::Earliest)),
                "latest" => Ok(ResolvedSpec::At(OffsetAt::Latest)),
                other => DateTime::parse_from_rfc3339(other)
                    .map(|t| ResolvedSpec::At(OffsetAt::Timestamp(t.with_timezone(&Utc))))
                    .map_err(|e| {
                        ConnectorError::Config(format!(
                            "{key} = \"{other}\": expected \"earliest\", \"latest\", an RFC 3339 \
                             time or a table of partition offsets ({e})"
                        ))
                    }),
            },
        }
    }
}

pub(super) enum ResolvedSpec {
    At(OffsetAt),
    Explicit(BTreeMap<String, i64>),
}

/// How a message value is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueFormat {
    /// One JSON object per message.
    Json,
    /// One CSV row per message (no header).
    Csv,
    /// No decoding: binary columns `key` and `value`.
    Raw,
}

/// The `[sources.<name>]` settings of `kind = "kafka"` (besides the engine's event-time keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSourceConfig {
    /// `host:port` of one or more brokers, comma-separated.
    pub bootstrap_servers: String,
    /// The topic, or a list of topics. Exactly one of `topic` and `topic_pattern`.
    #[serde(default)]
    pub topic: Option<Topics>,
    /// A regular expression; every topic whose whole name matches is read, including topics
    /// created while the job runs.
    #[serde(default)]
    pub topic_pattern: Option<String>,
    /// Where partitions start the first time the job runs (default `"earliest"`).
    #[serde(default = "OffsetSpec::earliest")]
    pub starting_offsets: OffsetSpec,
    /// For bounded runs: where partitions end (exclusive). `"latest"` = the latest offsets when
    /// the run opens the source; a table caps the partitions it lists.
    #[serde(default)]
    pub ending_offsets: Option<OffsetSpec>,
    /// At most this many records per batch, split fairly across partitions (default 100 000).
    #[serde(default = "default_max_records")]
    pub max_records_per_batch: u64,
    /// How values are decoded (default `json`).
    #[serde(default = "default_format")]
    pub format: ValueFormat,
    /// Column definitions of the value, e.g. `"id BIGINT, ts TIMESTAMP"`; inferred from the
    /// first records (JSON, CSV) when absent.
    #[serde(default)]
    pub schema: Option<String>,
    /// CSV: the field delimiter, one character (default `,`).
    #[serde(default = "default_delimiter")]
    pub delimiter: String,
    /// Stop with an error when records the job needs were deleted (default true).
    #[serde(default = "default_true")]
    pub fail_on_data_loss: bool,
    /// JSON values: what a field the schema lacks does (default `add_columns` when the schema
    /// is inferred, `none` when declared); see [`crate::evolve`].
    #[serde(default)]
    pub schema_evolution: Option<crate::evolve::SchemaEvolution>,
}

fn default_max_records() -> u64 {
    100_000
}
fn default_format() -> ValueFormat {
    ValueFormat::Json
}
fn default_delimiter() -> String {
    ",".into()
}
fn default_true() -> bool {
    true
}

impl KafkaSourceConfig {
    /// Settings for one topic on `bootstrap_servers`, everything else at its default (JSON values
    /// with an inferred schema, from the earliest offsets, 100 000 records per batch).
    pub fn new(bootstrap_servers: impl Into<String>, topic: impl Into<String>) -> Self {
        KafkaSourceConfig {
            bootstrap_servers: bootstrap_servers.into(),
            topic: Some(Topics::One(topic.into())),
            topic_pattern: None,
            starting_offsets: OffsetSpec::earliest(),
            ending_offsets: None,
            max_records_per_batch: default_max_records(),
            format: default_format(),
            schema: None,
            delimiter: default_delimiter(),
            fail_on_data_loss: true,
            schema_evolution: None,
        }
    }
}

/// Which topics the source reads.
#[derive(Debug, Clone)]
pub(super) enum TopicSelection {
    /// One topic: partition ids are bare numbers.
    Single(String),
    /// Named topics.
    List(Vec<String>),
    /// Every topic whose whole name matches.
    Pattern(regex::Regex),
}

impl TopicSelection {
    pub(super) fn matches(&self, topic: &str) -> bool {
        match self {
            TopicSelection::Single(t) => t == topic,
            TopicSelection::List(ts) => ts.iter().any(|t| t == topic),
            TopicSelection::Pattern(re) => re.is_match(topic),
        }
    }

    /// Topics that must exist.
    pub(super) fn required(&self) -> Vec<&str> {
        match self {
            TopicSelection::Single(t) => vec![t],
            TopicSelection::List(ts) => ts.iter().map(String::as_str).collect(),
            TopicSelection::Pattern(_) => vec![],
        }
    }
}
