//! End-to-end Nexmark benchmark: runs one of the example jobs (`examples/nexmark/<query>.toml`)
//! over a generated stream into a fresh Delta table, and prints what it took.
//!
//! ```text
//! cargo bench --bench nexmark -- --query q5 --events 10000000 --batch-size 1000000
//! ```
//!
//! Prints events/s, events/s per core, per-batch latency p50/p99, peak RSS, bytes written and
//! the state rows/bytes at the start, middle and end of the run, and appends the same as one
//! JSON line (with the git commit) to `benches/results/nexmark.jsonl`.
//!
//! Memory: the peak anonymous memory (heap, stacks; sampled every 2 ms) above the opened job's
//! (the runtime and session before the first batch) is set against the largest batch's input
//! as Arrow plus the largest state, the goal being at most 2× — a batch is held about once as
//! input and once on its way out. The binary's resident code (file-backed: about 90 MiB once a
//! first batch has run, whatever its size) is not data held; the peak RSS with it, and the
//! ratio on it (peak RSS above the opened job's RSS: the only one recorded before 154ab4f), are
//! printed and recorded beside it. In the records, `memory_ratio` is that whole-RSS ratio and
//! `memory_ratio_anon` the anonymous one.
//!
//! Throughput counts every generated event (persons and auctions too), as Nexmark reports do.
//! The run includes generating, decoding, the query, state and the Delta commits — everything a
//! job does — but not process start-up.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{MEMORY_POLL, MemoryPeaks, git_commit, repo_root, status_bytes};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sluice::engine::Trigger;

struct Args {
    query: String,
    events: u64,
    batch_size: u64,
    partitions: u32,
    results: PathBuf,
    /// Serve the status endpoints and scrape `/metrics` and `/api/progress` every second, as a
    /// monitored job is (their cost, side by side with a run without).
    metrics: bool,
}

fn args() -> Args {
    let mut args = Args {
        query: "q0".into(),
        events: 10_000_000,
        batch_size: 1_000_000,
        partitions: 4,
        results: repo_root().join("benches/results/nexmark.jsonl"),
        metrics: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--query" => args.query = value(),
            "--events" => args.events = value().replace('_', "").parse().expect("--events N"),
            "--batch-size" => {
                args.batch_size = value().replace('_', "").parse().expect("--batch-size N")
            }
            "--partitions" => args.partitions = value().parse().expect("--partitions N"),
            "--results" => args.results = PathBuf::from(value()),
            "--metrics" => args.metrics = true,
            // cargo bench passes --bench; criterion-style filters are not used here.
            "--bench" => {}
            other => panic!(
                "unknown argument {other}; use --query qN --events N --batch-size N \
                 --partitions N --results FILE [--metrics]"
            ),
        }
    }
    args
}

/// The example job with the benchmark's stream size, batch size and output.
fn job_file(args: &Args, dir: &Path) -> PathBuf {
    let root = repo_root();
    let example = root.join(format!("examples/nexmark/{}.toml", args.query));
    let text =
        std::fs::read_to_string(&example).unwrap_or_else(|e| panic!("{}: {e}", example.display()));
    let text = text
        .replace(
            "total_events = 10_000_000",
            &format!(
                "total_events = {}\nmax_records_per_batch = {}",
                args.events, args.batch_size
            ),
        )
        .replace(
            "partitions = 4",
            &format!("partitions = {}", args.partitions),
        );
    let text = with_output(&text, &dir.join("out"));
    let path = dir.join("job.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Points `[sink] path` at `out`.
fn with_output(text: &str, out: &Path) -> String {
    text.lines()
        .map(|l| {
            if l.starts_with("path = \"../out/") {
                format!("path = \"{}\"", out.display())
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// This process's status file.
const OWN_STATUS: &str = "/proc/self/status";

/// This process's memory peaks, sampled on a thread of its own every [`MEMORY_POLL`] from
/// [`MemorySampler::start`] to [`MemorySampler::stop`].
struct MemorySampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<MemoryPeaks>,
}

impl MemorySampler {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut peaks = MemoryPeaks::default();
            while !stopped.load(Ordering::Relaxed) {
                peaks.observe(Path::new(OWN_STATUS));
                std::thread::sleep(MEMORY_POLL);
            }
            peaks.observe(Path::new(OWN_STATUS));
            peaks
        });
        MemorySampler { stop, thread }
    }

    fn stop(self) -> MemoryPeaks {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn dir_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dir_size(&p)
            } else {
                e.metadata().map_or(0, |m| m.len())
            }
        })
        .sum()
}

fn main() {
    // The allocator as the `sluice` binary sets it up (before this runner, it measured glibc's
    // default of eight arenas per core, which the binary does not run with).
    sluice::cli::limit_malloc_arenas();
    let args = args();
    let dir = tempfile::tempdir().unwrap();
    let path = job_file(&args, dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (summary, elapsed, (opened_rss, opened_anon), peaks, progress) = rt.block_on(async {
        let (job, _) =
            sluice::job_file::load(&path, Some(Trigger::AvailableNow), &Default::default())
                .await
                .unwrap();
        let progress = std::sync::Arc::clone(&job.progress);
        if args.metrics {
            let addr = sluice::status_server::serve(
                "127.0.0.1:0".parse().unwrap(),
                std::sync::Arc::clone(&job.progress),
            )
            .await
            .unwrap();
            std::thread::spawn(move || {
                loop {
                    for path in ["/metrics", "/api/progress"] {
                        scrape(&addr.to_string(), path);
                    }
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            });
        }
        // The opened job's resident memory now: in all, and anonymous.
        let opened = std::fs::read_to_string(OWN_STATUS).unwrap_or_default();
        let opened = (
            status_bytes(&opened, "VmRSS:"),
            status_bytes(&opened, "RssAnon:"),
        );
        let sampler = MemorySampler::start();
        let started = Instant::now();
        let summary = job.run().await.unwrap();
        let elapsed = started.elapsed();
        let peaks = sampler.stop();
        (summary, elapsed, opened, peaks, progress)
    });
    // Median wall time per phase over the batches the progress keeps (the last 100).
    let recent = progress.recent();
    let phase_p50: std::collections::BTreeMap<String, f64> = sluice::engine::progress::PHASES
        .iter()
        .map(|phase| {
            let mut ms: Vec<f64> = recent
                .iter()
                .filter_map(|b| b.phase_ms.get(*phase).copied())
                .collect();
            ms.sort_by(f64::total_cmp);
            let p50 = ms.get(ms.len() / 2).copied().unwrap_or(0.0);
            (phase.to_string(), (p50 * 10.0).round() / 10.0)
        })
        .collect();
    let secs = elapsed.as_secs_f64();
    let events_per_sec = args.events as f64 / secs;
    let mut millis: Vec<u64> = summary.batches.iter().map(|b| b.millis).collect();
    millis.sort_unstable();
    let (p50, p99) = (percentile(&millis, 0.5), percentile(&millis, 0.99));
    let rss = peaks.rss;
    let largest_input = summary
        .batches
        .iter()
        .map(|b| b.input_bytes)
        .max()
        .unwrap_or(0);
    let largest_state = summary
        .batches
        .iter()
        .map(|b| b.state_bytes)
        .max()
        .unwrap_or(0);
    let held = largest_input + largest_state;
    // Named as in the record: `memory_ratio` on the whole RSS, `memory_ratio_anon` on the
    // anonymous memory (the goal's measure).
    let anon_above_opened = peaks.anon.saturating_sub(opened_anon);
    let memory_ratio_anon = anon_above_opened as f64 / held.max(1) as f64;
    let memory_ratio = rss.saturating_sub(opened_rss) as f64 / held.max(1) as f64;
    let out = dir.path().join("out");
    let bytes = dir_size(&out);
    let state_at = |i: usize| {
        summary
            .batches
            .get(i)
            .map_or((0, 0), |b| (b.state_rows, b.state_bytes))
    };
    let n = summary.batches.len();
    let (start, middle, end) = (state_at(0), state_at(n / 2), state_at(n.saturating_sub(1)));
    println!(
        "nexmark {}: {} events in {:.2} s over {} batch(es) of up to {} events, {} partitions{}",
        args.query,
        args.events,
        secs,
        n,
        args.batch_size,
        args.partitions,
        if args.metrics {
            " (status server on, scraped every second)"
        } else {
            ""
        }
    );
    println!(
        "  {:.0} events/s, {:.0} events/s per core ({cores} cores)",
        events_per_sec,
        events_per_sec / cores as f64
    );
    println!(
        "  batch latency p50 {p50} ms, p99 {p99} ms; p50 per phase: {}",
        phase_p50
            .iter()
            .map(|(phase, ms)| format!("{phase} {ms} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  rows out {}, peak RSS {:.0} MiB, bytes written {:.1} MiB",
        summary.rows_out,
        rss as f64 / 1048576.0,
        bytes as f64 / 1048576.0
    );
    println!(
        "  state rows/bytes: start {}/{}, middle {}/{}, end {}/{}",
        start.0, start.1, middle.0, middle.1, end.0, end.1
    );
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "  memory: {}; anonymous {:.0} MiB above the opened job's {:.0} MiB; largest batch \
         {:.0} MiB as Arrow + largest state {:.0} MiB = {:.0} MiB; ratio {memory_ratio_anon:.2} (goal ≤ 2; \
         with code pages, peak RSS above the opened job's: {memory_ratio:.2})",
        peaks.describe(),
        mib(anon_above_opened),
        mib(opened_anon),
        mib(largest_input),
        mib(largest_state),
        mib(held)
    );
    let record = serde_json::json!({
        "commit": git_commit(),
        "at": chrono::Utc::now().to_rfc3339(),
        "allocator": common::allocator(),
        "query": args.query,
        "events": args.events,
        "batch_size": args.batch_size,
        "partitions": args.partitions,
        "batches": n,
        "seconds": secs,
        "events_per_sec": events_per_sec,
        "events_per_sec_per_core": events_per_sec / cores as f64,
        "cores": cores,
        "batch_ms_p50": p50,
        "batch_ms_p99": p99,
        "phase_ms_p50": phase_p50,
        "peak_rss_bytes": rss,
        "opened_rss_bytes": opened_rss,
        "largest_batch_arrow_bytes": largest_input,
        "largest_state_bytes": largest_state,
        "peak_anon_bytes": peaks.anon,
        "opened_anon_bytes": opened_anon,
        "peak_file_bytes": peaks.file,
        "memory_ratio": memory_ratio,
        "memory_ratio_anon": memory_ratio_anon,
        "bytes_written": bytes,
        "rows_out": summary.rows_out,
        "state_rows": [start.0, middle.0, end.0],
        "state_bytes": [start.1, middle.1, end.1],
        "metrics": args.metrics,
    });
    if let Some(parent) = args.results.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.results)
        .unwrap();
    writeln!(file, "{record}").unwrap();
    println!("  appended to {}", args.results.display());
}

/// `GET path` on `addr`, the body read and dropped (a scrape).
fn scrape(addr: &str, path: &str) {
    use std::io::{Read, Write};
    if let Ok(mut stream) = std::net::TcpStream::connect(addr) {
        let _ = write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        );
        let _ = stream.read_to_end(&mut Vec::new());
    }
}
