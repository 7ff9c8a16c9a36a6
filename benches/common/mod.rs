//! What every benchmark binary shares: where the repository is and which commit is measured,
//! for the lines they append to `benches/results/`.

use std::path::PathBuf;

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
