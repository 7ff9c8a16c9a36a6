//! The HTTP face of a running job (`sluice run --metrics-addr ADDR`, or `[job] metrics_addr`):
//!
//! - `/metrics` — Prometheus' text format ([`Progress::render_prometheus`]);
//! - `/api/progress` — the last 100 batches' progress records, a JSON array;
//! - `/api/job` — what the job is (sources, sink, trigger), the last error, a bounded run's
//!   offsets done and in all;
//! - `/healthz` — 200 while the driver loop plans, progresses or commits within its allowance
//!   ([`Progress::health`]), 503 with the reason otherwise;
//! - `/` — the status page: one self-contained HTML file that polls the two APIs and draws its
//!   charts as inline SVG (no build step, nothing fetched from elsewhere).
//!
//! The server only reads the shared [`Progress`]; the job waits at most while one scrape's text
//! is rendered under its lock.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::get;
use sluice_engine::progress::Progress;

/// The status page.
const STATUS_PAGE: &str = include_str!("status.html");

/// Binds `addr` and serves the job's endpoints on a background task. Returns the address
/// bound (the port chosen when `addr` asks for port 0).
///
/// # Errors
/// If `addr` cannot be bound (in use, not local).
pub async fn serve(addr: SocketAddr, progress: Arc<Progress>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/", get(|| async { Html(STATUS_PAGE) }))
        .route("/metrics", get(metrics))
        .route("/api/progress", get(batches))
        .route("/api/job", get(job))
        .route("/healthz", get(health))
        .with_state(progress);
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(%error, "the status server stopped");
        }
    });
    Ok(bound)
}

async fn metrics(State(progress): State<Arc<Progress>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        progress.render_prometheus(),
    )
        .into_response()
}

async fn batches(State(progress): State<Arc<Progress>>) -> Response {
    Json(progress.recent()).into_response()
}

async fn job(State(progress): State<Arc<Progress>>) -> Response {
    let bounded = progress
        .bounded()
        .map(|(done, total)| serde_json::json!({ "offsets_done": done, "offsets_total": total }));
    Json(serde_json::json!({
        "job": progress.job(),
        "last_error": progress.last_error(),
        "health": progress.health().err(),
        "bounded": bounded,
    }))
    .into_response()
}

async fn health(State(progress): State<Arc<Progress>>) -> Response {
    match progress.health() {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()).into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
    }
}
