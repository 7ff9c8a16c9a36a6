#!/usr/bin/env bash
# Sluice vs Spark Structured Streaming on the same queries over the same files (Parquet, JSON).
# Installs pyspark (Java 17 must be on PATH), builds Sluice in release, runs compare.py.
#   benches/peers/compare.sh [--suites nexmark-parquet,nexmark-json,clicks,overhead] [--events N]
#                            [--files-per-batch N] [--queries q0,q2,q5,q7] [--clicks N]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice-target}"
python3 -m pip install -q -r "$root/benches/peers/requirements.txt"
(cd "$root" && cargo build --release -j2 --bin sluice)
exec python3 "$root/benches/peers/compare.py" --sluice "$CARGO_TARGET_DIR/release/sluice" "$@"
