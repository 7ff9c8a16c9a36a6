//! The `sluice` binary: the command line ([`sluice::cli`]) with the built-in sources, sinks and
//! functions only.

/// jemalloc, not glibc's malloc: a batch's buffers are allocated on one rayon or tokio thread
/// and freed on another, and glibc gives every thread that allocates at the same time an arena
/// of its own (up to 8 per core) that keeps the freed pages. On the Nexmark runs
/// (`benches/nexmark.rs`, which runs with this allocator too) peak memory was 30–45 % higher
/// under glibc (q0 5.9×, q1 5.3×, q5 4.7× the batch's Arrow size, against 4.2×, 3.9×, 3.6×)
/// for the same throughput within the runs' noise. A program built on the `sluice` library
/// picks its own allocator.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    sluice::cli::run(sluice::Registry::new())
}
