//! Crash points: a test hook that kills the process at a named step of a named batch.
//!
//! The crash tests must prove that a SIGKILL at *any* step loses and duplicates nothing, including
//! the narrow gaps between two commits that a randomly timed kill rarely hits. Setting
//! `SLUICE_CRASH_AT=<point>:<batch_id>` (for example `after_side_tables:3`) makes the process send
//! itself SIGKILL when it reaches that point; unset, a crash point costs one comparison.
//!
//! Points, in the order a batch passes them: `after_intent`, `after_state` (windowed jobs: state
//! files written, manifest not yet), `after_manifest`, `after_side_tables`, `after_commit`.
//!
//! Pause points are the same idea for races: `SLUICE_PAUSE_AT=<point>[:<batch>]:<millis>` makes
//! passes through that point wait, so a test can make two writers' commits overlap on purpose,
//! or stop a process at a precise step to play a paused machine. Points: `before_plan` (a
//! batch about to be planned — or, executed while the batch before it committed, about to
//! record its intent), `before_output_commit` (after the sink loaded the table, before
//! it commits), `before_replacement` (a backfill about to replace what it covers).

use std::sync::OnceLock;

use crate::offsets::BatchId;

/// The environment variable that arms a crash point.
pub const CRASH_AT_ENV: &str = "SLUICE_CRASH_AT";

fn armed() -> Option<&'static (String, i64)> {
    static ARMED: OnceLock<Option<(String, i64)>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(CRASH_AT_ENV).ok()?;
            let (point, batch) = spec.split_once(':')?;
            Some((point.to_string(), batch.parse().ok()?))
        })
        .as_ref()
}

/// Kills the process with SIGKILL if `SLUICE_CRASH_AT` names this point and batch.
pub fn crash_point(point: &str, batch_id: BatchId) {
    if let Some((armed_point, armed_batch)) = armed()
        && armed_point == point
        && *armed_batch == batch_id.0
    {
        tracing::warn!(
            point,
            batch_id = batch_id.0,
            "crash point reached: sending SIGKILL to self"
        );
        let pid = std::process::id().to_string();
        // SIGKILL cannot be caught: nothing after this line runs once `kill` delivers it.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid])
            .status();
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
}

/// The environment variable that arms a pause point.
pub const PAUSE_AT_ENV: &str = "SLUICE_PAUSE_AT";

/// Waits if `SLUICE_PAUSE_AT` names this point: `<point>:<millis>` pauses every pass,
/// `<point>:<batch>:<millis>` only the pass of that batch. Unset, costs one comparison. Logs
/// `pause point reached` first, so a test can act while the process waits (stop it, start a
/// twin).
pub async fn pause_point(point: &str, batch_id: BatchId) {
    static ARMED: OnceLock<Option<(String, Option<i64>, u64)>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let spec = std::env::var(PAUSE_AT_ENV).ok()?;
        let parts: Vec<&str> = spec.split(':').collect();
        match parts.as_slice() {
            [point, millis] => Some((point.to_string(), None, millis.parse().ok()?)),
            [point, batch, millis] => Some((
                point.to_string(),
                Some(batch.parse().ok()?),
                millis.parse().ok()?,
            )),
            _ => None,
        }
    });
    if let Some((armed_point, armed_batch, millis)) = armed
        && armed_point == point
        && armed_batch.is_none_or(|b| b == batch_id.0)
    {
        tracing::warn!(point, batch_id = batch_id.0, millis, "pause point reached");
        tokio::time::sleep(std::time::Duration::from_millis(*millis)).await;
    }
}
