"""Sluice vs Spark Structured Streaming on the same queries over the same files.

Run it with ``benches/peers/compare.sh`` (installs pyspark, builds Sluice in release). Suites
(``--suites``, all by default):

- ``nexmark-parquet``, ``nexmark-json``: ``--events`` Nexmark events are generated once with
  Sluice's own generator and the bids written in event-time order (one file per generated batch)
  as Parquet files, and as JSON lines (the same rows: that is how ingestion jobs see data). Each
  query runs over them with Sluice (``kind = "files"``, ``max_files_per_batch``) and with Spark
  Structured Streaming in local mode (``maxFilesPerTrigger``, trigger ``availableNow``), the same
  files per batch, no out-of-orderness allowance; both are given the schema. Throughput counts
  all generated events, as Nexmark does.
- ``clicks``: ``--clicks`` click events as JSON lines in 100 files, ~1 % of the lines malformed
  (and the same files with those lines removed), through a 1-minute tumbling count and sum per
  user, 10 files per batch. Sluice dead-letters the malformed lines; Spark (PERMISSIVE, the
  default) turns each into a row of nulls that the aggregation ignores. The malformed set runs
  a third time with Sluice inferring the schema (no ``schema``: how messy input arrives; the
  timestamps stay text, parsed as event time), Spark still given it.
- ``overhead``: the per-batch fixed cost — the same windowed job over 100 small files (100
  events each), one file per batch; the p50 of each engine's own per-batch time (Sluice:
  ``total_ms`` of its per-batch log line, its own time from planning to compaction; Spark: ``triggerExecution`` of its
  query progress).

It prints both sides and the ratio, and appends every result to ``benches/results/peers.jsonl``.
Sluice's time is its process's wall time (start-up included); Spark's is from ``start()`` of the
streaming query to its end (JVM and session start-up excluded). Each query runs ``--repeat``
times on each engine, alternately, from empty outputs; the median of each engine's times is
the result (all times are recorded): a sub-second run varies by a third between runs here. Sluice writes a Delta table,
Spark Parquet files (the Delta package for Spark is not on PyPI).
"""

import argparse
import json
import os
import random
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The bids' columns, for the JSON files (Sluice's schema option and Spark's schema).
BID_SCHEMA = (
    "auction BIGINT, bidder BIGINT, price BIGINT, channel VARCHAR, url VARCHAR, "
    "date_time TIMESTAMP, extra VARCHAR"
)
CLICK_SCHEMA = "user_id VARCHAR, page VARCHAR, amount DOUBLE, ts TIMESTAMP"
CLICKS_SQL = (
    "SELECT window_start, user_id, count(*) AS clicks, sum(amount) AS total "
    "FROM tumble(clicks, ts, INTERVAL '1' MINUTE) GROUP BY window_start, window_end, user_id"
)

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
    # One data file per commit; number them in commit order, which is event-time order. A
    # compaction's commit adds a file of rows already added (`dataChange` false): leave it out,
    # or its rows would be read twice, and out of event-time order.
    bids = work / "bids"
    bids.mkdir()
    log = sorted((dump / "_delta_log").glob("*.json"))
    n = 0
    for commit in log:
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action and action["add"].get("dataChange", True):
                shutil.copy(dump / action["add"]["path"], bids / f"bids-{n:05d}.parquet")
                n += 1
    shutil.rmtree(dump)
    return bids, n


def iso_millis(ts):
    """A timestamp as RFC 3339 with milliseconds and Z, which both engines parse."""
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def bids_as_json(bids, work):
    """The same bids, file for file, as JSON lines."""
    import pyarrow.parquet as pq

    out = work / "bids-json"
    out.mkdir()
    for parquet in sorted(bids.glob("*.parquet")):
        rows = pq.read_table(parquet).to_pylist()
        with open(out / (parquet.stem + ".json"), "w") as f:
            for r in rows:
                r["date_time"] = iso_millis(r["date_time"])
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
    return out


def write_clicks(folder, events, files, bad_every, seed=7):
    """`events` click events over `files` JSON-lines files in event-time order (a few seconds of
    jitter), 1 in `bad_every` lines malformed (0: none). Returns the malformed line count."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    start = 1_777_593_600.0  # 2026-05-01T00:00:00Z
    per_file = events // files
    bad = 0
    from datetime import datetime as dt

    for i in range(files):
        with open(folder / f"clicks-{i:04d}.json", "w") as f:
            for j in range(per_file):
                n = i * per_file + j
                if bad_every and rng.randrange(bad_every) == 0:
                    f.write('{"user_id":"u%d","page":"/p/%d","amount":' % (n % 10_000, n % 50) + "\n")
                    bad += 1
                    continue
                at = start + n * 0.001 + rng.uniform(-2, 0)
                ts = dt.fromtimestamp(at, tz=timezone.utc)
                f.write(
                    '{"user_id":"u%d","page":"/p/%d","amount":%d.25,"ts":"%s"}\n'
                    % (rng.randrange(10_000), n % 50, n % 100, iso_millis(ts))
                )
    return bad


def strip_malformed(source, target):
    """The files of `source` without their malformed lines."""
    target.mkdir(parents=True)
    for path in sorted(source.glob("*.json")):
        with open(path) as f, open(target / path.name, "w") as out:
            for line in f:
                try:
                    json.loads(line)
                except ValueError:
                    continue
                out.write(line)


def run_sluice(sluice, work, name, source_block, sql):
    """Runs one job to the end; its wall time, summary line, per-batch times and the p50 of each
    step's time (ms, from its per-batch log lines)."""
    job = work / f"sluice_{name}.toml"
    sluice_job(job, f"sluice_{name}", source_block, work / f"sluice_{name}", sql)
    started = time.monotonic()
    env = dict(os.environ, RUST_LOG="info")
    out = subprocess.run(
        [sluice, "run", str(job)], check=True, capture_output=True, text=True, env=env
    )
    elapsed = time.monotonic() - started
    per_batch = [float(m) for m in re.findall(r"total_ms=([0-9.]+)", out.stderr)]
    steps = {
        step: statistics.median(float(m) for m in found)
        for step in ("plan", "read", "execute", "checkpoint", "commit", "purge")
        if (found := re.findall(rf"\b{step}_ms=([0-9.]+)", out.stderr))
    }
    return elapsed, out.stdout.strip().splitlines()[0], per_batch, steps


def fresh(work, name):
    """Removes what a run of `name` left (outputs, side tables, checkpoints) on either engine."""
    for suffix in ("", "_dead_letter", "_late"):
        shutil.rmtree(work / f"sluice_{name}{suffix}", ignore_errors=True)
    for suffix in ("", "_checkpoint"):
        shutil.rmtree(work / f"spark_{name}{suffix}", ignore_errors=True)


def median_run(runs):
    """The run whose time (its first item) is the median of `runs` (the lower middle one of an
    even number)."""
    ordered = sorted(runs, key=lambda r: r[0])
    return ordered[(len(ordered) - 1) // 2]


def format_steps(steps):
    return ", ".join(f"{k} {v:.1f} ms" for k, v in steps.items())


def bid_source(bids, fmt, files_per_batch):
    schema = f'schema = "{BID_SCHEMA}"\n' if fmt == "json" else ""
    return f"""[sources.bid]
kind = "files"
path = "{bids}"
format = "{fmt}"
{schema}event_time = "date_time"
max_out_of_orderness = "0s"
max_files_per_batch = {files_per_batch}
"""


def click_source(folder, files_per_batch, declared=True):
    schema = f'schema = "{CLICK_SCHEMA}"\n' if declared else ""
    return f"""[sources.clicks]
kind = "files"
path = "{folder}"
format = "json"
{schema}event_time = "ts"
max_out_of_orderness = "5s"
max_files_per_batch = {files_per_batch}
"""


def spark_schema(ddl):
    """A schema as Spark's DDL (its readers take the string)."""
    return ddl.replace("VARCHAR", "STRING")


def run_spark_query(spark, work, name, out):
    """Runs a streaming query to the end; its time, output rows and per-batch times (ms)."""
    target = work / f"spark_{name}"
    started = time.monotonic()
    handle = (
        out.writeStream.format("parquet")
        .option("path", str(target))
        .option("checkpointLocation", str(work / f"spark_{name}_checkpoint"))
        .outputMode("append")
        .trigger(availableNow=True)
        .start()
    )
    handle.awaitTermination()
    elapsed = time.monotonic() - started
    per_batch = [
        p["durationMs"]["triggerExecution"]
        for p in handle.recentProgress
        if p.get("numInputRows", 0) > 0 and "triggerExecution" in p.get("durationMs", {})
    ]
    rows = spark.read.parquet(str(target)).count() if target.exists() else 0
    return elapsed, rows, per_batch


def run_spark(spark, work, bids, fmt, query, files_per_batch):
    from pyspark.sql import functions as F

    reader = spark.readStream.option("maxFilesPerTrigger", files_per_batch)
    if fmt == "json":
        df = reader.schema(spark_schema(BID_SCHEMA)).json(str(bids))
    else:
        df = reader.schema(spark.read.parquet(str(bids)).schema).parquet(str(bids))
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
    elapsed, rows, _ = run_spark_query(spark, work, f"{fmt}_{query}", out)
    return elapsed, rows


def spark_clicks(spark, work, name, folder, files_per_batch):
    from pyspark.sql import functions as F

    df = (
        spark.readStream.option("maxFilesPerTrigger", files_per_batch)
        .schema(spark_schema(CLICK_SCHEMA))
        .json(str(folder))
    )
    out = (
        df.withWatermark("ts", "5 seconds")
        .groupBy(F.window("ts", "1 minute"), "user_id")
        .agg(F.count("*").alias("clicks"), F.sum("amount").alias("total"))
        .select(F.col("window.start").alias("window_start"), "user_id", "clicks", "total")
    )
    return run_spark_query(spark, work, name, out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sluice", required=True, help="the sluice binary (release build)")
    p.add_argument("--suites", default="nexmark-parquet,nexmark-json,clicks,overhead")
    p.add_argument("--events", type=int, default=5_000_000, help="Nexmark events")
    p.add_argument("--files", type=int, default=40, help="files the bids are split into")
    p.add_argument("--files-per-batch", type=int, default=4, help="Nexmark files per batch")
    p.add_argument("--queries", default="q0,q2,q5,q7", help="Nexmark queries")
    p.add_argument("--clicks", type=int, default=2_000_000, help="click events (clicks suite)")
    p.add_argument("--results", default=str(ROOT / "benches/results/peers.jsonl"))
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each query on each engine; the medians are compared")
    args = p.parse_args()
    suites = args.suites.split(",")

    from pyspark.sql import SparkSession

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="sluice-peers-"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    results = []

    def record(suite, name, events, s_time, k_time, **extra):
        s_rate, k_rate = events / s_time, events / k_time
        print(f"{name:24} {s_rate:14,.0f} {k_rate:14,.0f} {s_rate / k_rate:6.1f}×")
        results.append({
            "commit": commit, "at": datetime.now(timezone.utc).isoformat(), "suite": suite,
            "query": name, "events": events, "cores": cores, "sluice_seconds": s_time,
            "spark_seconds": k_time, "sluice_events_per_sec": s_rate,
            "spark_events_per_sec": k_rate, "ratio": s_rate / k_rate, **extra,
        })

    try:
        spark = (
            SparkSession.builder.master(f"local[{cores}]")
            .appName("sluice-peer")
            .config("spark.sql.shuffle.partitions", str(cores))
            .config("spark.driver.memory", "6g")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        header = f"{'':24} {'Sluice ev/s':>14} {'Spark ev/s':>14} {'ratio':>7}"
        formats = [s.split("-")[1] for s in suites if s.startswith("nexmark-")]
        if formats:
            bids, files = generate(args.sluice, work, args.events, args.files)
            print(f"{args.events} Nexmark events → {files} files of bids "
                  f"({args.files_per_batch} per batch, local mode, {cores} cores)")
            folders = {"parquet": bids}
            if "json" in formats:
                folders["json"] = bids_as_json(bids, work)
            # The files just written are flushed before any run is timed: their write-back
            # would otherwise share the disk with the first runs (JSON q0's first runs were
            # 50 % slower on both engines than its third).
            os.sync()
            for fmt in formats:
                print(f"nexmark, {fmt} files:\n{header}")
                for q in args.queries.split(","):
                    name = f"{fmt}_{q}"
                    s_runs, k_runs = [], []
                    for _ in range(args.repeat):
                        fresh(work, name)
                        s_runs.append(run_sluice(
                            args.sluice, work, name,
                            bid_source(folders[fmt], fmt, args.files_per_batch), QUERIES[q]))
                        k_runs.append(run_spark(spark, work, folders[fmt], fmt, q,
                                                args.files_per_batch))
                    s_time, summary, _, steps = median_run(s_runs)
                    k_time, k_rows = median_run(k_runs)
                    record(f"nexmark-{fmt}", q, args.events, s_time, k_time,
                           format=fmt, files_per_batch=args.files_per_batch,
                           sluice_p50_ms_per_step=steps,
                           sluice_seconds_runs=[r[0] for r in s_runs],
                           spark_seconds_runs=[r[0] for r in k_runs])
                    print(f"{'':9}sluice: {summary} ({s_time:.1f} s; steps p50: "
                          f"{format_steps(steps)}); spark: {k_rows} rows ({k_time:.1f} s)")
        if "clicks" in suites:
            bad_folder, clean_folder = work / "clicks-bad", work / "clicks-clean"
            bad = write_clicks(bad_folder, args.clicks, 100, 100)
            strip_malformed(bad_folder, clean_folder)
            os.sync()
            print(f"clicks: {args.clicks} JSON events in 100 files ({bad} malformed lines in the "
                  f"first set), 1-minute count+sum per user, 10 files per batch:\n{header}")
            for name, folder, declared in [
                ("1 % malformed", bad_folder, True),
                ("clean", clean_folder, True),
                ("1 % malformed, inferred", bad_folder, False),
            ]:
                tag = "bad" if folder == bad_folder else "clean"
                tag += "" if declared else "_inferred"
                s_runs, k_runs = [], []
                for _ in range(args.repeat):
                    fresh(work, f"clicks_{tag}")
                    s_runs.append(run_sluice(
                        args.sluice, work, f"clicks_{tag}",
                        click_source(folder, 10, declared), CLICKS_SQL))
                    k_runs.append(spark_clicks(spark, work, f"clicks_{tag}", folder, 10))
                s_time, summary, _, steps = median_run(s_runs)
                k_time, k_rows, _ = median_run(k_runs)
                record("clicks", name, args.clicks, s_time, k_time, malformed_lines=(
                    bad if folder == bad_folder else 0), files_per_batch=10,
                    sluice_schema="declared" if declared else "inferred",
                    sluice_p50_ms_per_step=steps,
                    sluice_seconds_runs=[r[0] for r in s_runs],
                    spark_seconds_runs=[r[0] for r in k_runs])
                print(f"{'':9}sluice: {summary} ({s_time:.1f} s; steps p50: "
                      f"{format_steps(steps)}); spark: {k_rows} rows ({k_time:.1f} s)")
        if "overhead" in suites:
            folder = work / "clicks-small"
            write_clicks(folder, 100 * 100, 100, 0, seed=11)
            os.sync()
            _, summary, s_batches, steps = run_sluice(
                args.sluice, work, "overhead", click_source(folder, 1), CLICKS_SQL)
            _, _, k_batches = spark_clicks(spark, work, "overhead", folder, 1)
            s_p50, k_p50 = statistics.median(s_batches), statistics.median(k_batches)
            print(f"per-batch overhead: one small file (100 events) a batch, windowed job, "
                  f"{len(s_batches)} Sluice / {len(k_batches)} Spark batches:")
            print(f"{'':18} {'Sluice p50':>14} {'Spark p50':>14} {'ratio':>7}")
            print(f"{'per batch':18} {s_p50:11.1f} ms {k_p50:11.1f} ms {k_p50 / max(s_p50, 0.1):6.1f}×")
            print(f"Sluice's steps, p50: {format_steps(steps)}")
            results.append({
                "commit": commit, "at": datetime.now(timezone.utc).isoformat(),
                "suite": "overhead", "query": "clicks 1-minute windows, 1 small file a batch",
                "cores": cores, "sluice_batches": len(s_batches), "spark_batches": len(k_batches),
                "sluice_p50_ms_per_batch": s_p50, "spark_p50_ms_per_batch": k_p50,
                "sluice_p50_ms_per_step": steps,
                "ratio": k_p50 / max(s_p50, 0.1),
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
