//! Produces the bundled click events to a Kafka topic, for the Kafka example job.
//!
//! `cargo run --example kafka_produce -- BROKER TOPIC PARTITIONS`: creates `TOPIC` with
//! `PARTITIONS` partitions if it does not exist, then sends every line of
//! `examples/data/clicks/*.json` as one message, keyed by `user_id`, spread over the partitions by
//! key (as Kafka's default partitioner does). `examples/kafka/run.sh` calls it.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use rskafka::client::ClientBuilder;
use rskafka::client::partition::{Compression, UnknownTopicHandling};
use rskafka::record::Record;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [broker, topic, partitions] = args.as_slice() else {
        bail!("usage: kafka_produce BROKER TOPIC PARTITIONS (e.g. 127.0.0.1:9092 clicks 4)");
    };
    let partitions: i32 = partitions.parse().context("PARTITIONS must be a number")?;
    let client = ClientBuilder::new(vec![broker.clone()])
        .build()
        .await
        .with_context(|| format!("cannot reach the broker at {broker}"))?;
    if !client.list_topics().await?.iter().any(|t| &t.name == topic) {
        client
            .controller_client()?
            .create_topic(topic, partitions, 1, 5_000)
            .await?;
    }

    let data = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("examples/data/clicks");
    let mut files: Vec<_> = std::fs::read_dir(&data)?.collect::<Result<_, _>>()?;
    files.sort_by_key(|f| f.file_name());
    let mut by_partition: BTreeMap<i32, Vec<Record>> = BTreeMap::new();
    for file in files {
        for line in std::fs::read_to_string(file.path())?.lines() {
            if line.trim().is_empty() {
                continue;
            }
            // Malformed lines are sent too: the job must dead-letter them, not lose them.
            let user = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("user_id").and_then(|u| u.as_i64()))
                .unwrap_or(0);
            by_partition
                .entry((user % i64::from(partitions)) as i32)
                .or_default()
                .push(Record {
                    key: Some(user.to_string().into_bytes()),
                    value: Some(line.as_bytes().to_vec()),
                    headers: BTreeMap::from([("producer".into(), b"kafka_produce".to_vec())]),
                    timestamp: chrono::Utc::now(),
                });
        }
    }
    let mut total = 0;
    for (partition, records) in by_partition {
        let pc = client
            .partition_client(topic.clone(), partition, UnknownTopicHandling::Retry)
            .await?;
        total += records.len();
        pc.produce(records, Compression::NoCompression).await?;
    }
    println!("produced {total} messages to {topic} on {broker}");
    Ok(())
}
