//! Progress of a bounded run (`sluice run` with `available-now`, `sluice backfill`) for whoever
//! watches it: on a terminal, a bar of offsets read against the run's target with the rate and
//! the time left; otherwise (a log file, CI) a plain line every [`PLAIN_EVERY`].
//!
//! The numbers come from the job's [`Progress`] (the driver and backfill update it). Log lines
//! go through [`LogWriter`], which lifts the bar while a line is written so the two never mix.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use sluice_engine::progress::Progress;

/// How often a run without a terminal prints its progress line, unless `SLUICE_PROGRESS_EVERY`
/// (a duration: `30s`, `1m`) says otherwise.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// The bar on screen, if any: log lines lift it while they are written.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Shows `progress` until [`ProgressDisplay::finish`].
pub struct ProgressDisplay {
    task: tokio::task::JoinHandle<()>,
    progress: Arc<Progress>,
    what: &'static str,
    plain: bool,
}

impl ProgressDisplay {
    /// Starts following `progress`; `what` names the run (`backfill`, `available-now run`).
    pub fn start(progress: Arc<Progress>, what: &'static str) -> ProgressDisplay {
        let plain = !std::io::stderr().is_terminal();
        let task = if plain {
            tokio::spawn(print_lines(Arc::clone(&progress), what))
        } else {
            tokio::spawn(draw_bar(Arc::clone(&progress), what))
        };
        ProgressDisplay {
            task,
            progress,
            what,
            plain,
        }
    }

    /// Stops the display: clears the bar, or prints where the run ended.
    pub fn finish(self) {
        self.task.abort();
        if self.plain
            && let Some((done, total)) = self.progress.bounded()
        {
            tracing::info!("{}: {done} of {total} offsets read", self.what);
        }
        if let Ok(mut bar) = BAR.lock()
            && let Some(bar) = bar.take()
        {
            bar.finish_and_clear();
        }
    }
}

async fn draw_bar(progress: Arc<Progress>, what: &'static str) {
    let bar = ProgressBar::hidden();
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} offsets  {per_sec}  ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(what);
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    if let Ok(mut slot) = BAR.lock() {
        *slot = Some(bar.clone());
    }
    loop {
        if let Some((done, total)) = progress.bounded() {
            bar.set_length(total.max(0) as u64);
            bar.set_position(done.max(0) as u64);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn print_lines(progress: Arc<Progress>, what: &'static str) {
    let every = std::env::var("SLUICE_PROGRESS_EVERY")
        .ok()
        .and_then(|text| humantime::parse_duration(&text).ok())
        .filter(|d| !d.is_zero())
        .unwrap_or(PLAIN_EVERY);
    // A backfill reads in passes (resolving a period, recomputing windows, writing), each
    // with its own total: the rate is over the current pass.
    let mut pass = (Instant::now(), -1_i64, 0_i64);
    loop {
        tokio::time::sleep(every).await;
        let Some((done, total)) = progress.bounded() else {
            continue;
        };
        if total != pass.1 || done < pass.2 {
            let started = Instant::now()
                .checked_sub(every)
                .unwrap_or_else(Instant::now);
            pass = (started, total, done);
        }
        pass.2 = done;
        let seconds = pass.0.elapsed().as_secs_f64();
        let rate = done as f64 / seconds.max(1e-9);
        let left = if rate > 0.0 {
            format!("{:.0} s", (total - done).max(0) as f64 / rate)
        } else {
            "unknown".into()
        };
        tracing::info!("{what}: {done} of {total} offsets read ({rate:.1}/s, about {left} left)");
    }
}

/// Where log lines go: stderr, with the progress bar lifted while each line is written.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

/// One log line, written to stderr when dropped.
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let write = || {
            let _ = std::io::stderr().write_all(&self.0);
        };
        let bar = BAR.lock().ok().and_then(|b| b.clone());
        match bar {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> Self::Writer {
        LogLine(Vec::new())
    }
}
