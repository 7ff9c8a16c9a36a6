//! The `sluice` command line: run, backfill, reconcile, validate and inspect jobs defined in TOML
//! job files.
//!
//! The `sluice` binary is `cli::run(Registry::new())`. A program with its own functions or kinds
//! of source and sink gets the same command line by calling [`run`] with its [`Registry`]; its
//! job files may then use them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::engine::Trigger;
use crate::engine::backfill::BackfillRange;
use crate::engine::storage::StorageOptions;
use crate::job_file;
use crate::progress_display::ProgressDisplay;
use crate::registry::Registry;
use anyhow::Result;
use clap::{Parser, Subcommand};

/// Sluice: exactly-once micro-batch stream processing from files and Kafka to Delta tables.
///
/// A job file names the sources, one SQL query, the Delta sink and the trigger. Every batch
/// commits its output and its source offsets in one Delta commit, so a job can be killed at any
/// moment and restarted without losing or duplicating rows. Logs go to stderr (set RUST_LOG,
/// e.g. RUST_LOG=debug); results and summaries go to stdout.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a job: stream batches from its sources into its Delta table.
    ///
    /// Resumes after the last batch the table records as committed. With trigger `once` it runs
    /// one batch; `available-now` processes everything available at start and exits; with
    /// `interval:<duration>` it runs a batch per interval until SIGINT/SIGTERM, finishing the
    /// batch in flight; a second signal stops at once (exit 130; the batch is rerun on restart).
    Run {
        /// The job file (TOML).
        job: PathBuf,
        /// Override the job file's trigger: once | available-now | interval:<duration> (e.g. interval:5s).
        #[arg(long, value_parser = parse_trigger)]
        trigger: Option<Trigger>,
        /// Serve, while the job runs, Prometheus metrics (/metrics), the last 100 batches'
        /// progress (/api/progress), a health check (/healthz: 503 when the driver neither
        /// planned nor progressed within three trigger intervals) and a live status page (/) on this address,
        /// e.g. 127.0.0.1:9898 (overrides `[job] metrics_addr`).
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
    },
    /// Show what a Delta table written by Sluice says: its version and rows, and for each job
    /// writing it the last committed batch, its end offsets, watermark, counters and consumer lag.
    Status {
        /// The output table (local path or URL).
        table: String,
        /// How many recent commits to search for Sluice jobs.
        #[arg(long, default_value_t = 100)]
        history: usize,
        /// Print one JSON object (version, rows, and per job its last batch and manifest) for
        /// scripts instead of the text form.
        #[arg(long)]
        json: bool,
        /// A storage option of the table's store, KEY=VALUE (repeatable; keys as in a job
        /// file's `storage_options`, e.g. aws_endpoint=http://127.0.0.1:9000).
        #[arg(long = "storage-option", value_parser = parse_storage_option)]
        storage_options: Vec<(String, String)>,
    },
    /// Delete a Delta table's data files that no snapshot within the retention needs.
    ///
    /// Removes files the table's log removed (a backfill's replacement, a MERGE in update mode)
    /// longer ago than the retention, and files in the table's folder the log never referenced
    /// (left by a batch that crashed before its commit) older than the retention. Never touches
    /// a file the latest snapshot references, the Delta log, or anything under a folder starting
    /// with `_` (Sluice's checkpoint `_sluice/` with its manifests and state files). Readers of
    /// versions older than the retention (time travel) lose their files: keep the retention at
    /// least as long as your longest query. Storage is configured from the environment (see
    /// README, "Object storage").
    Vacuum {
        /// The table (local path or URL).
        table: String,
        /// Keep removed and unreferenced files younger than this (default 7d, Delta's
        /// `delta.deletedFileRetentionDuration` default).
        #[arg(long, default_value = "7d", value_parser = parse_retention)]
        retention: std::time::Duration,
        /// List what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Allow a retention below one hour: files of a batch (or backfill) being written right
        /// now are not referenced yet and would be deleted under it.
        #[arg(long)]
        force: bool,
        /// A storage option of the table's store, KEY=VALUE (repeatable; keys as in a job
        /// file's `storage_options`, e.g. aws_endpoint=http://127.0.0.1:9000).
        #[arg(long = "storage-option", value_parser = parse_storage_option)]
        storage_options: Vec<(String, String)>,
    },
    /// Rerun an offset range of a job as one bounded batch that replaces what the range covers.
    ///
    /// The same job file as `run`: its sources, SQL and sink, over [FROM, TO) per partition. The
    /// rows those offsets produced (found by the lineage columns `_source_partition`,
    /// `_source_offset`; dead letters by source, partition and offset) are replaced in one commit
    /// per table, so running the same backfill twice leaves the tables unchanged, and the live job
    /// may keep running meanwhile. Give offsets (`--from 0:120 --to 0:200`, `earliest`, `latest`;
    /// the files source is partition 0, offsets = positions in its recorded file order) or an
    /// event-time period (`--from-time`/`--to-time`: the offsets holding those events, found by
    /// scanning each partition once). Exits 0 when done, non-zero with a message otherwise.
    Backfill {
        /// The job file (TOML).
        job: PathBuf,
        /// Start offsets (inclusive): `earliest` or partition:offset pairs, e.g. 0:120,1:95.
        #[arg(long, requires = "to", conflicts_with_all = ["from_time", "to_time"])]
        from: Option<String>,
        /// End offsets (exclusive): `latest` or partition:offset pairs.
        #[arg(long, requires = "from")]
        to: Option<String>,
        /// Start of an event-time period (inclusive), RFC 3339.
        #[arg(long, value_parser = parse_time, requires = "to_time")]
        from_time: Option<i64>,
        /// End of the event-time period (exclusive), RFC 3339.
        #[arg(long, value_parser = parse_time, requires = "from_time")]
        to_time: Option<i64>,
        /// Resolve and print the ranges and what would be replaced; read and write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Check a job's output against a batch recomputation over a closed event-time period.
    ///
    /// Reads the raw events the job's committed batches read, keeps those with event time in
    /// [FROM, TO), runs the job's SQL over them as one batch, and compares the result with the
    /// output table's rows of that period (the output must carry the event-time column). A job
    /// whose join of two streams feeds a running aggregate has rows without event time: its
    /// whole table is compared with the query over every committed row. Prints matching,
    /// missing, extra and different rows; exits non-zero on any difference. Writes nothing.
    Reconcile {
        /// The job file (TOML).
        job: PathBuf,
        /// Start of the period (inclusive), RFC 3339, e.g. 2026-11-01T10:00:00Z.
        #[arg(long, value_parser = parse_time)]
        from_time: i64,
        /// End of the period (exclusive), RFC 3339.
        #[arg(long, value_parser = parse_time)]
        to_time: i64,
    },
    /// Check a job file: parse it, open its sources, plan the SQL and print the plan.
    ///
    /// Prints each source's schema (inferred ones with how), the output schema, every stateful
    /// operator (what its state is keyed by, when a state row leaves, what it emits) and the
    /// optimised plan. Writes nothing.
    Validate {
        /// The job file (TOML).
        job: PathBuf,
    },
}

/// Sluice at info; libraries at warn. delta-kernel logs an error while probing a table that does
/// not exist yet (expected on first run; real failures reach us as errors), so it is silenced.
/// The Kafka client warns at every reconnect attempt; the Kafka source logs one line per retry
/// with the same error, so the client is kept to errors.
const DEFAULT_LOG_FILTER: &str = "warn,sluice=info,sluice_engine=info,sluice_connectors=info,sluice_sinks=info,\
     object_store::client::retry=info,buoyant_kernel=off,deltalake_core::writer::stats=error,rskafka=error";

/// An error and its causes as one line: each cause added unless the message already says it
/// (errors that wrap another usually repeat it; a job file error with its control characters
/// escaped), line breaks folded into spaces.
fn one_line(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(cause.as_str()) || text.contains(&*crate::error::on_one_line(&cause)) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An RFC 3339 time as µs since the epoch.
fn parse_time(s: &str) -> Result<i64, String> {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|t| t.timestamp_micros())
        .map_err(|e| format!("'{s}' is not an RFC 3339 time like 2026-11-01T10:00:00Z: {e}"))
}

fn parse_trigger(s: &str) -> Result<Trigger, String> {
    s.parse().map_err(|e: crate::engine::Error| e.to_string())
}

/// Runs the `sluice` command line (arguments from the process) with `registry`'s functions and
/// kinds of source and sink besides the built-in ones, and returns the exit code: a `main.rs`
/// is `fn main() -> ExitCode { sluice::cli::run(registry) }`.
///
/// Starts its own Tokio runtime; call it from a plain (not async) `main`.
pub fn run(registry: Registry) -> ExitCode {
    limit_malloc_arenas();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(cli_main(registry))
}

/// How many malloc arenas glibc may use, unless `MALLOC_ARENA_MAX` says otherwise.
///
/// Batches are decoded, queried and written on many threads (tokio's workers and blocking pool,
/// rayon), and a batch's memory is mostly freed on another thread than the one that allocated
/// it. With glibc's default of 8 arenas per core, memory freed into one thread's arena is not
/// reused by the next batch on another, and the resident size of a long scan grows to several
/// times what it holds; mimalloc (used before) returns memory lazily and showed the same. With
/// two arenas, measured on a 24-hour history (`cargo bench --bench scale -- backfill-memory`),
/// the live job ran as fast as with either and its peak resident size halved.
const MALLOC_ARENAS: i32 = 2;

/// Caps glibc's malloc arenas at two (unless `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES` sets
/// them), as [`run`] does first: a batch's memory is mostly freed on another thread than the
/// one that allocated it, and with glibc's default of eight arenas per core the next batch does
/// not reuse it. Public for programs that measure what the `sluice` binary does without going
/// through [`run`] (the Nexmark runner, the `hot_paths` benchmarks); call it before any thread
/// starts.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn limit_malloc_arenas() {
    let tuned = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"));
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() && !tuned {
        // SAFETY: `mallopt` only sets an allocator parameter; it is called once, before the
        // runtime starts any other thread.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
        }
    }
}

/// Caps glibc's malloc arenas; nothing elsewhere.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn limit_malloc_arenas() {}

async fn cli_main(registry: Registry) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| DEFAULT_LOG_FILTER.into()),
        )
        .with_writer(crate::progress_display::LogWriter)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match dispatch(cli.command, &registry).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command, registry: &Registry) -> Result<()> {
    match command {
        Command::Run {
            job,
            trigger,
            metrics_addr,
        } => run_job(job, trigger, metrics_addr, registry).await,
        Command::Validate { job } => validate(job, registry).await,
        Command::Reconcile {
            job,
            from_time,
            to_time,
        } => reconcile(job, from_time, to_time, registry).await,
        Command::Backfill {
            job,
            from,
            to,
            from_time,
            to_time,
            dry_run,
        } => {
            let range = match (from, to, from_time, to_time) {
                (Some(from), Some(to), None, None) => BackfillRange::Offsets {
                    from: from.parse()?,
                    to: to.parse()?,
                },
                (None, None, Some(from), Some(to)) => BackfillRange::Time { from, to },
                _ => anyhow::bail!(
                    "give --from and --to (offsets), or --from-time and --to-time (event time)"
                ),
            };
            backfill(job, range, dry_run, registry).await
        }
        Command::Vacuum {
            table,
            retention,
            dry_run,
            force,
            storage_options,
        } => {
            vacuum(
                &table,
                &StorageOptions::new(storage_options),
                retention,
                dry_run,
                force,
            )
            .await
        }
        Command::Status {
            table,
            history,
            json,
            storage_options,
        } => status(&table, &StorageOptions::new(storage_options), history, json).await,
    }
}

async fn run_job(
    path: PathBuf,
    trigger: Option<Trigger>,
    metrics_addr: Option<std::net::SocketAddr>,
    registry: &Registry,
) -> Result<()> {
    let (job, info) = job_file::load(&path, trigger, registry).await?;
    if let Some(addr) = metrics_addr.or(info.metrics_addr) {
        let bound = crate::status_server::serve(addr, std::sync::Arc::clone(&job.progress))
            .await
            .map_err(|e| anyhow::anyhow!("cannot serve metrics on {addr}: {e}"))?;
        tracing::info!(address = %bound, "serving metrics on http://{bound}/metrics and the status page on http://{bound}/");
    }
    let display = matches!(job.trigger, Trigger::AvailableNow)
        .then(|| ProgressDisplay::start(std::sync::Arc::clone(&job.progress), "available-now run"));
    let summary = job.run_until(shutdown_signal()).await;
    if let Some(display) = display {
        display.finish();
    }
    let summary = summary?;
    let location = summary
        .location
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the job has no output location"))?;
    // Rows in the table: a Delta table's count; another kind of sink says what it holds itself.
    let total = if info.sink_kind == "delta" {
        Some(crate::sinks::delta::table_row_count(&location, &info.sink_storage).await?)
    } else {
        None
    };
    let shown = location
        .to_file_path()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| location.to_string());
    println!(
        "job {}: {} batch(es) committed this run (rows in {}, out {}, dead-lettered {}, late {}); last batch {}",
        info.job_id,
        summary.batches_committed,
        summary.rows_in,
        summary.rows_out,
        summary.rows_dead_lettered,
        summary.rows_late,
        summary
            .last_batch
            .map(|b| b.to_string())
            .unwrap_or_else(|| "none".into()),
    );
    match total {
        Some(total) => println!("table {shown} holds {total} rows"),
        None => println!("output: {shown}"),
    }
    Ok(())
}

async fn validate(path: PathBuf, registry: &Registry) -> Result<()> {
    let (job, info) = job_file::load(&path, None, registry).await?;
    let validation = job.validate().await?;
    println!("job {} is valid", info.job_id);
    for (name, schema) in &validation.sources {
        let inferred = validation
            .inferred
            .iter()
            .find(|(source, _)| source == name)
            .map(|(_, inference)| inference);
        match inferred {
            Some(i) => println!(
                "\nsource {name} (schema inferred from {}, {} records; declare `schema` to fix it):",
                i.sample, i.records
            ),
            None => println!("\nsource {name}:"),
        }
        for f in schema.fields() {
            // The event-time column is shown as parsed (a timestamp), not as inferred.
            let column = inferred.and_then(|i| i.column(f.name()));
            match column.filter(|c| c.data_type == f.data_type().to_string()) {
                Some(column) => println!("  {column}"),
                None => println!("  {} {}", f.name(), f.data_type()),
            }
        }
    }
    for (name, schema) in &validation.tables {
        println!(
            "\ntable {name} (static: read whole at the version each batch records, joined \
             without state):"
        );
        for f in schema.fields() {
            println!("  {} {}", f.name(), f.data_type());
        }
    }
    println!("\noutput:");
    for f in validation.output.fields() {
        println!("  {} {}", f.name(), f.data_type());
    }
    if validation.operators.is_empty() {
        println!("\nstate: none (stateless: each batch's output depends on its rows only)");
    } else {
        println!("\nstateful operators (state carried between batches, bounded by its purge):");
        for op in &validation.operators {
            println!("  {}  {}", op.id, op.what);
            if op.state_key.is_empty() {
                println!("    state key: none (no state of its own)");
            } else {
                println!("    state key: {}", op.state_key.join(", "));
            }
            println!("    purge: {}", op.purge);
            println!("    emits: {}", op.emits);
        }
    }
    println!("\nplan:\n{}", validation.plan);
    Ok(())
}

/// The first and last few of a long list.
fn summarize(items: &[String]) -> String {
    if items.len() <= 6 {
        return items.join(", ");
    }
    format!(
        "{}, … {}",
        items[..3].join(", "),
        items[items.len() - 3..].join(", ")
    )
}

async fn backfill(
    path: PathBuf,
    range: BackfillRange,
    dry_run: bool,
    registry: &Registry,
) -> Result<()> {
    use crate::engine::watermark::display_watermark;
    let (job, info) = job_file::load(&path, None, registry).await?;
    let display = ProgressDisplay::start(std::sync::Arc::clone(&job.progress), "backfill");
    let r = job.backfill(range, dry_run).await;
    display.finish();
    let r = r?;
    let ranges: Vec<String> = r
        .spec
        .ranges
        .iter()
        .map(|(p, range)| format!("{p}:{range}"))
        .collect();
    let ranges = if ranges.is_empty() {
        "nothing (no offsets in the range)".to_string()
    } else {
        ranges.join(", ")
    };
    let windows = r.windows.as_ref().map(|w| {
        let shown: Vec<String> = w
            .starts
            .iter()
            .map(|s| display_watermark(Some(*s)))
            .collect();
        let (from, to) = r.read_span.unwrap_or_default();
        format!(
            "{} window(s) starting {}\n  read widened to whole windows: every committed event with \
             event time in [{}, {})",
            shown.len(),
            summarize(&shown),
            display_watermark(Some(from)),
            display_watermark(Some(to)),
        )
    });
    if r.dry_run {
        println!(
            "dry run of backfill {} (writes nothing):\n  source {}: offsets {ranges} ({} offsets)",
            r.spec.app_id, r.spec.source, r.offsets
        );
        match &windows {
            None => println!(
                "  would replace the output rows with _source_partition/_source_offset in those \
                 ranges, and the dead letters of source {} in them",
                r.spec.source
            ),
            Some(w) => println!(
                "  would replace {w}\n  and count again the {} late row(s) that missed those \
                 windows (removing them from the late table); and replace the dead letters of \
                 source {} in the offsets",
                r.late_rows_recounted, r.spec.source
            ),
        }
        return Ok(());
    }
    println!(
        "backfill {} of job {}: source {} offsets {ranges}",
        r.spec.app_id, info.job_id, r.spec.source
    );
    if let Some(w) = &windows {
        println!("  replaced {w}");
        println!(
            "  late rows counted again (removed from the late table): {}",
            r.late_rows_recounted
        );
    }
    println!(
        "  rows in {}, out {}, dead-lettered {}; {} file(s), {} bytes written{}; {:.1} s",
        r.rows_in,
        r.rows_out,
        r.rows_dead_lettered,
        r.files_written,
        r.bytes_written,
        if r.already_committed {
            " (already committed by an earlier attempt)"
        } else {
            ""
        },
        r.elapsed.as_secs_f64()
    );
    if !r.live_job {
        println!(
            "  note: job {} has never committed a batch of its own, so this was its batch run; \
             a later `sluice run` of it would start at its starting offsets and append these \
             rows again",
            info.job_id
        );
    }
    Ok(())
}

async fn reconcile(path: PathBuf, from: i64, to: i64, registry: &Registry) -> Result<()> {
    use crate::engine::watermark::display_watermark;
    let (job, info) = job_file::load(&path, None, registry).await?;
    let r = job.reconcile(from, to).await?;
    let d = &r.diff;
    if r.column.is_empty() {
        println!(
            "job {}: the whole table (its rows carry no event time, so the period is not \
             used), committed batches up to {}",
            info.job_id, r.last_batch
        );
    } else {
        println!(
            "job {}: {} in [{}, {}), committed batches up to {}",
            info.job_id,
            r.column,
            display_watermark(Some(from)),
            display_watermark(Some(to)),
            r.last_batch
        );
    }
    println!(
        "  batch recomputation: {} rows; output table: {} rows",
        r.expected_rows, r.table_rows
    );
    if r.late_rows > 0 {
        println!(
            "  late rows: {} (in the late table; {})",
            r.late_rows, r.late_treatment
        );
    }
    println!(
        "  matching {}, missing {}, extra {}, different {}",
        d.matching,
        d.missing.len(),
        d.extra.len(),
        d.different.len()
    );
    const SHOWN: usize = 10;
    for row in d.missing.iter().take(SHOWN) {
        println!("  missing:   {row}");
    }
    for row in d.extra.iter().take(SHOWN) {
        println!("  extra:     {row}");
    }
    for (want, got) in d.different.iter().take(SHOWN) {
        println!("  different: recomputed {want}\n             in table   {got}");
    }
    if d.differences() > 0 {
        anyhow::bail!(
            "the output does not reconcile: {} difference(s)",
            d.differences()
        );
    }
    println!("  the output reconciles");
    Ok(())
}

fn parse_retention(text: &str) -> std::result::Result<std::time::Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("'{text}' is not a duration like 7d or 24h: {e}"))
}

fn parse_storage_option(text: &str) -> std::result::Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("'{text}' is not KEY=VALUE"))?;
    Ok((key.trim().to_string(), value.to_string()))
}

/// Below this, `vacuum` needs `--force`.
const VACUUM_MIN_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

async fn vacuum(
    table: &str,
    options: &StorageOptions,
    retention: std::time::Duration,
    dry_run: bool,
    force: bool,
) -> Result<()> {
    if retention < VACUUM_MIN_RETENTION && !force && !dry_run {
        anyhow::bail!(
            "--retention {} is below one hour: the files of a batch or backfill being written \
             right now are not in the log yet and would be deleted; stop the job and its \
             backfills and add --force, or keep at least 1h",
            humantime::format_duration(retention)
        );
    }
    let url = crate::sinks::delta::table_url(table)?;
    let files = crate::sinks::delta::vacuum(&url, options, retention, dry_run).await?;
    let verb = if dry_run { "would delete" } else { "deleted" };
    println!(
        "table {table}: {verb} {} file(s) older than {}",
        files.len(),
        humantime::format_duration(retention)
    );
    for file in &files {
        println!("  {file}");
    }
    Ok(())
}

async fn status(table: &str, options: &StorageOptions, history: usize, json: bool) -> Result<()> {
    let url = crate::sinks::delta::table_url(table)?;
    let status = crate::sinks::delta::table_status(&url, options, history).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    let version = status
        .version
        .map(|v| v.to_string())
        .unwrap_or_else(|| "none".into());
    println!(
        "table {table}: Delta version {version}, {} rows",
        status.rows
    );
    if status.jobs.is_empty() {
        println!("no Sluice job found in the last {history} commits");
    }
    for job in &status.jobs {
        let last = job
            .last_batch
            .map(|b| b.to_string())
            .unwrap_or_else(|| "none".into());
        println!("job {}: last committed batch {last}", job.job_id);
        if let Some(m) = &job.manifest {
            println!("  end offsets: {}", m["end_offsets"]);
            let watermark = m["watermark_micros"].as_i64();
            println!(
                "  watermark: {} ({} µs since the epoch)",
                crate::engine::watermark::display_watermark(watermark),
                m["watermark_micros"]
            );
            println!("  counters of that batch: {}", m["counters"]);
            if let Some(lag) = m.get("lag") {
                println!("  consumer lag when that batch was planned: {lag}");
            }
        }
    }
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
/// Completes on the first SIGINT or SIGTERM. A second one stops the process at once: a batch
/// stuck waiting (a broker that is down) must not keep the job from stopping, and stopping
/// mid-batch is safe — the batch is rerun from its intent on restart, like after a crash.
async fn shutdown_signal() {
    next_signal().await;
    tracing::info!(
        "shutdown requested: finishing the batch in flight (signal again to stop at once)"
    );
    tokio::spawn(async {
        next_signal().await;
        tracing::warn!(
            "second shutdown signal: stopping now; the batch in flight is rerun on restart"
        );
        std::process::exit(130);
    });
}

/// The next SIGINT or SIGTERM.
async fn next_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job file error quoting a value with a newline is printed once, on one line: its
    /// cause (the same text, not escaped) is not added again.
    #[test]
    fn an_escaped_job_file_error_is_not_repeated_by_its_cause() {
        let cause = sluice_engine::Error::InvalidJob("trigger 'a\nb' is not known".into());
        let error = crate::error::Error::job_file_cause(
            std::path::Path::new("job.toml"),
            Some("trigger"),
            cause,
        );
        let text = one_line(&anyhow::Error::from(error));
        assert_eq!(
            text,
            "job file job.toml: [trigger]: invalid job: trigger 'a\\nb' is not known"
        );
    }
}
