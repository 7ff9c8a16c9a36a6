//! The `sluice` binary: the command line ([`sluice::cli`]) with the built-in sources, sinks and
//! functions only.

fn main() -> std::process::ExitCode {
    sluice::cli::run(sluice::Registry::new())
}
