//! A service guarding its own expensive dependencies: the third kind of limiter, beside the
//! edge's per-IP limit and the gateway's global per-key one.
//!
//! ```text
//! cargo run --release -p redis-ratelimit-client --example guard
//! curl -i http://127.0.0.1:8090/report
//! curl -i -X POST http://127.0.0.1:8090/sms
//! ```
//!
//! - `GET /report`: calls a stand-in for a saturated database, which runs at most 4 calls at
//!   a time, 20 ms each, the rest waiting first come first served (so its latency grows with
//!   its queue), behind an adaptive concurrency limit: over the limit, `503` + `Retry-After`
//!   at once.
//! - `POST /sms`: at most 10 per second, burst 10, for the whole process (a provider billed
//!   per call): over it, `429` + `RateLimit` headers + problem+json.
//! - `GET /stats`: the concurrency limit's current state, as JSON.
//!
//! Needs no Redis. Environment: `LISTEN_ADDR` (default `127.0.0.1:8090`), and
//! `GUARD_DISABLE=1` to serve the same routes without the two layers (the baseline of
//! `scripts/bench/guard`).

use axum::routing::{get, post};
use axum::{Json, Router};
use redis_ratelimit_client::guard::{AdaptiveConcurrencyLayer, LocalLimitLayer, LocalLimiter};
use redis_ratelimit_client::Policy;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The stand-in dependency: 4 workers; tokio's semaphore queues waiters in FIFO order.
async fn report(db: Arc<Semaphore>) -> Json<serde_json::Value> {
    let _worker = db.acquire().await.ok();
    tokio::time::sleep(Duration::from_millis(20)).await;
    Json(serde_json::json!({ "rows": 42 }))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:8090".into());
    let disabled = std::env::var("GUARD_DISABLE").is_ok_and(|v| v == "1");
    let db = Arc::new(Semaphore::new(4));

    let report_route = get(move || report(db.clone()));
    let sms_route = post(|| async { Json(serde_json::json!({ "sent": true })) });
    let app = if disabled {
        Router::new()
            .route("/report", report_route)
            .route("/sms", sms_route)
    } else {
        let concurrency = AdaptiveConcurrencyLayer::builder().name("report").build()?;
        let sms = Policy::builder("sms").per_second(10).burst(10).build()?;
        let stats = concurrency.clone();
        Router::new()
            .route("/report", report_route.layer(concurrency))
            .route(
                "/sms",
                sms_route.layer(LocalLimitLayer::new(LocalLimiter::new(sms))),
            )
            .route(
                "/stats",
                get(move || async move {
                    let s = stats.stats();
                    Json(serde_json::json!({
                        "limit": s.limit,
                        "in_flight": s.in_flight,
                        "refused": s.refused,
                        "min_rtt_ms": s.min_rtt.map(|d| d.as_secs_f64() * 1e3),
                    }))
                }),
            )
    };

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let mode = if disabled {
        " (GUARD_DISABLE: no layers)"
    } else {
        ""
    };
    eprintln!("guard: http://{listen}{mode}");
    axum::serve(listener, app).await?;
    Ok(())
}
