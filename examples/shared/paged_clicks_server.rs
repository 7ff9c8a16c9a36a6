//! A small HTTP service serving click records in numbered pages, for `examples/custom_source.rs`
//! (its demo) and the test that runs that example through the crash test.
//!
//! `GET /pages` → `{"pages": N}`: how many pages are complete (only complete pages are served,
//! and a page never changes once complete: what makes a page number a replayable offset).
//! `GET /clicks/{page}` → a JSON array of that page's records. Every `bad_every`-th record has
//! an `id` that is not a number, for the dead-letter path.

// Each program including this file uses a part of it.
#![allow(dead_code)]

use std::net::SocketAddr;

use axum::Json;
use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::get;
use serde_json::{Value, json};

/// What the service serves.
#[derive(Debug, Clone, Copy)]
pub struct PagedClicks {
    /// Complete pages.
    pub pages: u64,
    /// Records per page.
    pub per_page: u64,
    /// Every this many records, one has a malformed id (0: none).
    pub bad_every: u64,
}

impl PagedClicks {
    /// The record with number `n` (pages hold records `page * per_page ..`).
    pub fn record(&self, n: u64) -> Value {
        const PAGES: [&str; 5] = ["/", "/blog", "/blog/rust", "/shop/cart", "/about"];
        let ts = chrono::DateTime::from_timestamp(1_793_523_600 + n as i64, 0)
            .map(|t| t.to_rfc3339())
            .unwrap_or_default();
        let id = if self.bad_every > 0 && n % self.bad_every == self.bad_every - 1 {
            json!(format!("oops-{n}"))
        } else {
            json!(n)
        };
        json!({
            "id": id,
            "user_id": n % 17,
            "page": PAGES[(n % 5) as usize],
            "amount": ((n * 37) % 10_000) as f64 / 100.0,
            "ts": ts,
        })
    }

    /// Whether record `n` is malformed.
    pub fn is_bad(&self, n: u64) -> bool {
        self.bad_every > 0 && n % self.bad_every == self.bad_every - 1
    }

    /// Serves the pages on 127.0.0.1 (a free port) until the process ends; returns the address.
    pub async fn serve(self) -> std::io::Result<SocketAddr> {
        let app = Router::new()
            .route(
                "/pages",
                get(move || async move { Json(json!({ "pages": self.pages })) }),
            )
            .route(
                "/clicks/{page}",
                get(move |Path(page): Path<u64>| async move {
                    if page >= self.pages {
                        return Err(StatusCode::NOT_FOUND);
                    }
                    let first = page * self.per_page;
                    let records: Vec<Value> = (first..first + self.per_page)
                        .map(|n| self.record(n))
                        .collect();
                    Ok(Json(Value::Array(records)))
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(address)
    }
}
