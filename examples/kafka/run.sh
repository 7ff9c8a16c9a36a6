#!/usr/bin/env bash
# Runs the Kafka example end to end on this machine: starts a tansu broker (a Kafka-protocol
# broker, SQLite storage) on 127.0.0.1:9092, produces the bundled click events to topic
# `clicks` (4 partitions), runs examples/kafka/clicks.toml, and stops the broker.
# Needs `tansu` (cargo install tansu --version 0.6.0 --locked --features libsql).
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v tansu >/dev/null || { echo "tansu not found: cargo install tansu --version 0.6.0 --locked --features libsql" >&2; exit 1; }
state=$(mktemp -d)
tansu broker --listener-url tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092 \
  --storage-engine "sqlite:///$state/tansu.db" >"$state/broker.log" 2>&1 &
broker=$!
trap 'kill $broker 2>/dev/null; rm -rf "$state"' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/9092) 2>/dev/null && break; sleep 0.1; done
rm -rf examples/out/clicks_from_kafka examples/out/clicks_from_kafka_dead_letter
cargo run --quiet --example kafka_produce -- 127.0.0.1:9092 clicks 4
cargo run --quiet -- run examples/kafka/clicks.toml
