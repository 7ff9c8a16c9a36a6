"""Sluice vs Spark Structured Streaming on the same Nexmark queries over the same events.

Run it with ``benches/peers/compare.sh`` (installs pyspark, builds Sluice in release). It:

1. generates ``--events`` Nexmark events once with Sluice's own generator and writes the bids as
   Parquet files, in event-time order (one file per generated batch);
2. for each query, runs it over those files with Sluice (``kind = "files"``,
   ``max_files_per_batch``) and with Spark Structured Streaming in local mode
   (``maxFilesPerTrigger``, trigger ``availableNow``) with the same number of files per batch and
   no out-of-orderness allowance, each writing its output to local files;
3. prints both throughputs (events/s, counting all generated events as Nexmark does) and the
   ratio side by side, and appends them to ``benches/results/peers.jsonl``.

Sluice's time is its process's wall time (start-up included); Spark's is from ``start()`` of the
streaming query to its end (JVM and session start-up excluded). Sluice writes a Delta table,
Spark Parquet files (the Delta package for Spark is not on PyPI).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each query in Sluice SQL, and the same in Spark's DataFrame API (built in run_spark).
QUERIES = {
    "q0": "SELECT auction, bidder, price, channel, url, date_time, extra FROM bid",
    "q2": "SELECT auction, price, date_time FROM bid WHERE auction % 123 = 0",
    # q5's core: bids per auction per hopping window (the busiest-auction step on top is a
    # second stateful operator Spark's append mode cannot chain here).
    "q5": "SELECT auction, count(*) AS num, window_start, window_end "
    "FROM hop(bid, date_time, INTERVAL '2' SECOND, INTERVAL '10' SECOND) "
    "GROUP BY auction, window_start, window_end",
    # q7's core: the highest price per tumbling window.
    "q7": "SELECT window_start, window_end, max(price) AS price "
    "FROM tumble(bid, date_time, INTERVAL '10' SECOND) GROUP BY window_start, window_end",
}


def sluice_job(path, job_id, source_block, sink_path, sql, lineage=False):
    path.write_text(
        f"""
[job]
id = "{job_id}"

{source_block}

[sink]
kind = "delta"
path = "{sink_path}"
lineage = {"true" if lineage else "false"}

[trigger]
mode = "available-now"

[query]
sql = \"\"\"{sql}\"\"\"
"""
    )


def run(cmd, **kw):
    env = dict(os.environ, RUST_LOG="warn")
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, **kw)


def generate(sluice, work, events, files):
    """The bids of `events` Nexmark events as Parquet files in event-time order."""
    dump = work / "dump"
    job = work / "dump.toml"
    per_batch = max(events // files, 1)
    sluice_job(
        job,
        "dump",
        f"""[sources.bid]
kind = "nexmark"
table = "bid"
total_events = {events}
partitions = 4
max_records_per_batch = {per_batch}
event_time = "date_time"
max_out_of_orderness = "0s"
""",
        dump,
        QUERIES["q0"],
    )
    run([sluice, "run", str(job)])
    # One data file per commit; number them in commit order, which is event-time order.
    bids = work / "bids"
    bids.mkdir()
    log = sorted((dump / "_delta_log").glob("*.json"))
    n = 0
    for commit in log:
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                shutil.copy(dump / action["add"]["path"], bids / f"bids-{n:05d}.parquet")
                n += 1
    shutil.rmtree(dump)
    return bids, n


def run_sluice(sluice, work, bids, query, files_per_batch):
    job = work / f"sluice_{query}.toml"
    sluice_job(
        job,
        f"sluice_{query}",
        f"""[sources.bid]
kind = "files"
path = "{bids}"
format = "parquet"
event_time = "date_time"
max_out_of_orderness = "0s"
max_files_per_batch = {files_per_batch}
""",
        work / f"sluice_{query}",
        QUERIES[query],
    )
    started = time.monotonic()
    out = run([sluice, "run", str(job)])
    elapsed = time.monotonic() - started
    return elapsed, out.stdout.strip().splitlines()[0]


def run_spark(spark, work, bids, query, files_per_batch):
    from pyspark.sql import functions as F

    schema = spark.read.parquet(str(bids)).schema
    df = (
        spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", files_per_batch)
        .parquet(str(bids))
    )
    mode = "append"
    if query == "q0":
        out = df.select("auction", "bidder", "price", "channel", "url", "date_time", "extra")
    elif query == "q2":
        out = df.where(F.col("auction") % 123 == 0).select("auction", "price", "date_time")
    elif query == "q5":
        w = F.window("date_time", "10 seconds", "2 seconds")
        out = (
            df.withWatermark("date_time", "0 seconds")
            .groupBy(w, "auction")
            .agg(F.count("*").alias("num"))
            .select("auction", "num", F.col("window.start").alias("window_start"),
                    F.col("window.end").alias("window_end"))
        )
    elif query == "q7":
        w = F.window("date_time", "10 seconds")
        out = (
            df.withWatermark("date_time", "0 seconds")
            .groupBy(w)
            .agg(F.max("price").alias("price"))
            .select(F.col("window.start").alias("window_start"),
                    F.col("window.end").alias("window_end"), "price")
        )
    else:
        raise SystemExit(f"no Spark version of {query}")
    target = work / f"spark_{query}"
    started = time.monotonic()
    handle = (
        out.writeStream.format("parquet")
        .option("path", str(target))
        .option("checkpointLocation", str(work / f"spark_{query}_checkpoint"))
        .outputMode(mode)
        .trigger(availableNow=True)
        .start()
    )
    handle.awaitTermination()
    elapsed = time.monotonic() - started
    rows = spark.read.parquet(str(target)).count()
    return elapsed, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sluice", required=True, help="the sluice binary (release build)")
    p.add_argument("--events", type=int, default=5_000_000)
    p.add_argument("--files", type=int, default=40, help="Parquet files the bids are split into")
    p.add_argument("--files-per-batch", type=int, default=4)
    p.add_argument("--queries", default="q0,q2,q5,q7")
    p.add_argument("--results", default=str(ROOT / "benches/results/peers.jsonl"))
    args = p.parse_args()

    from pyspark.sql import SparkSession

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="sluice-peers-"))
    try:
        bids, files = generate(args.sluice, work, args.events, args.files)
        print(f"{args.events} Nexmark events → {files} Parquet files of bids in {bids}")
        spark = (
            SparkSession.builder.master(f"local[{cores}]")
            .appName("nexmark-peer")
            .config("spark.sql.shuffle.partitions", str(cores))
            .config("spark.driver.memory", "6g")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        print(f"{'query':6} {'Sluice ev/s':>14} {'Spark ev/s':>14} {'ratio':>7}   "
              f"(local mode, {cores} cores, {args.files_per_batch} files per batch)")
        results = []
        for q in args.queries.split(","):
            s_time, s_summary = run_sluice(args.sluice, work, bids, q, args.files_per_batch)
            k_time, k_rows = run_spark(spark, work, bids, q, args.files_per_batch)
            s_rate, k_rate = args.events / s_time, args.events / k_time
            print(f"{q:6} {s_rate:14,.0f} {k_rate:14,.0f} {s_rate / k_rate:6.1f}×")
            print(f"         sluice: {s_summary} ({s_time:.1f} s); spark: {k_rows} rows ({k_time:.1f} s)")
            results.append({
                "commit": commit,
                "at": datetime.now(timezone.utc).isoformat(),
                "query": q,
                "events": args.events,
                "files_per_batch": args.files_per_batch,
                "cores": cores,
                "sluice_seconds": s_time,
                "spark_seconds": k_time,
                "sluice_events_per_sec": s_rate,
                "spark_events_per_sec": k_rate,
                "ratio": s_rate / k_rate,
            })
        spark.stop()
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
        print(f"appended to {args.results}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
