//! What every benchmark binary shares: where the repository is and which commit is measured,
//! for the lines they append to `benches/results/`, and how a run's memory peaks are read.

use std::path::{Path, PathBuf};

/// The commit being measured (`git describe --always --dirty`: a working tree with changes is
/// marked), or `unknown` outside a checkout.
pub fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(repo_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// The repository's root folder, looked up at run time: a bench binary cached from a clone at
/// another path must not write there.
pub fn repo_root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
        .into()
}

/// The allocator setup of a runner that calls `sluice::cli::limit_malloc_arenas` first, as the
/// `sluice` binary does: memory figures depend on it, so the records name it.
#[allow(
    dead_code,
    reason = "scale and storage keep glibc's defaults and do not record it"
)]
pub fn allocator() -> String {
    if let Ok(tunables) = std::env::var("GLIBC_TUNABLES")
        && tunables.contains("arena_max")
    {
        return format!("glibc malloc, GLIBC_TUNABLES={tunables}");
    }
    match std::env::var("MALLOC_ARENA_MAX") {
        Ok(n) => format!("glibc malloc, MALLOC_ARENA_MAX={n}"),
        Err(_) if cfg!(all(target_os = "linux", target_env = "gnu")) => {
            "glibc malloc, two arenas (sluice::cli::limit_malloc_arenas)".into()
        }
        Err(_) => "the system allocator".into(),
    }
}

/// A process's resident memory peaks, folded from looks at its `/proc/<pid>/status`.
///
/// The memory goals count the anonymous memory (heap, stacks: what holds a batch's data). The
/// binary's resident code is file-backed, shared, and the same for a batch of a thousand rows
/// as for one of a million (about 90 MiB of this workspace's code once a first batch has run),
/// so it is printed beside the anonymous peak but not counted as data held. Input files of
/// 1 MiB or more on a local disk are mapped while they are decoded (`read_immutable_body`):
/// their pages are file-backed too — page cache shared with the system, not copies — and so
/// are in the file-backed figure (shared memory, in neither, where the files are on tmpfs),
/// not the anonymous one.
#[allow(dead_code, reason = "hot_paths and storage measure no memory")]
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryPeaks {
    /// Peak resident set size (`VmHWM`, kept by the kernel).
    pub rss: u64,
    /// Peak anonymous resident memory (`RssAnon`), as sampled.
    pub anon: u64,
    /// Peak file-backed resident memory (`RssFile`: the binary's code pages, and the input files
    /// mapped while being decoded), as sampled.
    pub file: u64,
}

#[allow(dead_code, reason = "hot_paths and storage measure no memory")]
impl MemoryPeaks {
    /// Folds one look at `status` (a `/proc/<pid>/status` file) into the peaks; nothing if the
    /// file cannot be read (the process is gone).
    pub fn observe(&mut self, status: &Path) {
        let Ok(text) = std::fs::read_to_string(status) else {
            return;
        };
        self.rss = self.rss.max(status_bytes(&text, "VmHWM:"));
        self.anon = self.anon.max(status_bytes(&text, "RssAnon:"));
        self.file = self.file.max(status_bytes(&text, "RssFile:"));
    }

    /// The peaks in words, for the printed report.
    pub fn describe(&self) -> String {
        let mib = |b: u64| b as f64 / 1048576.0;
        format!(
            "peak RSS {:.0} MiB (anonymous {:.0} MiB, code and other file pages {:.0} MiB)",
            mib(self.rss),
            mib(self.anon),
            mib(self.file)
        )
    }
}

/// How often a sampler looks at `/proc/<pid>/status`: a batch's buffers take longer than this
/// to fault in, so a peak is not missed between looks.
#[allow(dead_code, reason = "hot_paths and storage measure no memory")]
pub const MEMORY_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// The size a `/proc/<pid>/status` text gives for `key` (e.g. `"VmRSS:"`), in bytes; 0 if
/// absent.
#[allow(dead_code, reason = "hot_paths and storage measure no memory")]
pub fn status_bytes(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}
