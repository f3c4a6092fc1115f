//! A runnable gateway: the quickest way to see the whole system.
//!
//! ```text
//! scripts/serve &        # Redis with the module on 127.0.0.1:6379
//! cargo run --release -p redis-ratelimit-client --example gateway
//! curl -i -H 'X-API-Key: k1' http://127.0.0.1:8080/api/hello
//! ```
//!
//! - `GET /api/{anything}`: 100 per minute per `X-API-Key`, burst 20, fail-open.
//! - `POST /login`: 5 per minute per `X-API-Key`, burst 5, fail-closed.
//! - `POST /llm`: 10 000 tokens per minute per `X-API-Key`, burst 10 000, charged after the
//!   fact: the request's `X-Estimated-Tokens` (default 1) is reserved, the stand-in upstream
//!   answers with `X-Used-Tokens` (the request's `X-Actual-Tokens`, default the estimate),
//!   and the difference is settled, into debt if the estimate was low.
//! - No `X-API-Key`: `401` problem+json.
//!
//! Environment: `LISTEN_ADDR` (default `127.0.0.1:8080`), `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), `PODS` (gateways sharing the limits, default 1), `TIMEOUT_MS`
//! (the store check's timeout, default the client's 5 ms), and `RL_DISABLE=1` to serve the
//! same routes without the layer (the latency baseline of `scripts/bench/http`).

use axum::extract::Path;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::{Json, Router};
use redis_ratelimit_client::http::{RateLimitLayer, Route};
use redis_ratelimit_client::{Limiter, Policy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = std::env::var("LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let pods = std::env::var("PODS")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(1);

    let mut limiter = Limiter::builder(redis.clone()).pods(pods);
    if let Some(ms) = std::env::var("TIMEOUT_MS")
        .ok()
        .and_then(|t| t.parse().ok())
    {
        limiter = limiter.timeout(std::time::Duration::from_millis(ms));
    }
    let limiter = limiter.build()?;
    // Connect before serving, so the first requests are limited by the store, not by the
    // fail modes while the connection is made. A store that is down does not stop the start.
    if !limiter.ready(std::time::Duration::from_secs(2)).await {
        eprintln!("gateway: {redis} not answering yet; serving with the fail modes");
    }
    let api = Policy::builder("api").per_minute(100).burst(20).build()?;
    let login = Policy::builder("login")
        .per_minute(5)
        .burst(5)
        .fail_closed()
        .build()?;
    let llm = Policy::builder("llm")
        .per_minute(10_000)
        .burst(10_000)
        .build()?;
    let limits = RateLimitLayer::builder(limiter)
        .route(Route::get("/api/").policy(api, 1))
        .route(Route::post("/login").policy(login, 1))
        .route(Route::post("/llm").metered(
            llm,
            |h| tokens(h, "x-estimated-tokens").unwrap_or(1),
            |h| tokens(h, "x-used-tokens"),
        ))
        .build();

    let app = Router::new()
        .route(
            "/api/{*rest}",
            get(|Path(rest): Path<String>| async move {
                Json(serde_json::json!({ "ok": true, "path": format!("/api/{rest}") }))
            }),
        )
        .route(
            "/login",
            post(|| async { Json(serde_json::json!({ "ok": true })) }),
        )
        .route("/llm", post(llm_upstream));
    let disabled = std::env::var("RL_DISABLE").is_ok_and(|v| v == "1");
    let app = if disabled { app } else { app.layer(limits) };

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let limits = if disabled {
        "RL_DISABLE: no limits".to_string()
    } else {
        format!("limits in {redis}")
    };
    eprintln!("gateway: http://{listen} ({limits})");
    axum::serve(listener, app).await?;
    Ok(())
}

fn tokens(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// Stands in for a model: "generates" `X-Actual-Tokens` tokens (default: the estimate) and
/// says so in `X-Used-Tokens`, as an LLM proxy reports usage.
async fn llm_upstream(headers: HeaderMap) -> (HeaderMap, Json<serde_json::Value>) {
    let used = tokens(&headers, "x-actual-tokens")
        .or_else(|| tokens(&headers, "x-estimated-tokens"))
        .unwrap_or(1);
    let mut out = HeaderMap::new();
    out.insert("x-used-tokens", used.into());
    (
        out,
        Json(serde_json::json!({ "ok": true, "used_tokens": used })),
    )
}
