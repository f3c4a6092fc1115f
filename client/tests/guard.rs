//! The in-service limits over real sockets: the guard example's two routes in an in-process
//! axum app (no store involved). Timing bounds are generous: the machine is shared.

use axum::routing::{get, post};
use axum::Router;
use redis_ratelimit_client::guard::{AdaptiveConcurrencyLayer, LocalLimitLayer, LocalLimiter};
use redis_ratelimit_client::Policy;
use redis_ratelimit_testkit::{http_request, HttpReply};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// One request, no extra headers.
async fn request(addr: SocketAddr, method: &str, path: &str) -> HttpReply {
    http_request(addr, method, path, &[]).await
}

/// The guard example's routes: `/report` on a dependency running 4 calls at a time, 20 ms
/// each, FIFO; `/sms` at 10 per second, burst 10, per process. `None`: without the layers.
async fn app(concurrency: Option<AdaptiveConcurrencyLayer>) -> SocketAddr {
    let db = Arc::new(Semaphore::new(4));
    let report = get(move || {
        let db = db.clone();
        async move {
            let _worker = db.acquire().await.ok();
            tokio::time::sleep(Duration::from_millis(20)).await;
            "{\"rows\":42}"
        }
    });
    let sms = post(|| async { "{\"sent\":true}" });
    let app = match concurrency {
        Some(c) => {
            let limit = Policy::builder("sms")
                .per_second(10)
                .burst(10)
                .build()
                .unwrap();
            Router::new().route("/report", report.layer(c)).route(
                "/sms",
                sms.layer(LocalLimitLayer::new(LocalLimiter::new(limit))),
            )
        }
        None => Router::new().route("/report", report).route("/sms", sms),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `clients` closed-loop clients on `/report` for `for_`: the statuses seen, and one refusal.
async fn load(
    addr: SocketAddr,
    clients: usize,
    for_: Duration,
) -> (HashMap<u16, usize>, Option<HttpReply>) {
    let deadline = Instant::now() + for_;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut refusal = None;
                while Instant::now() < deadline {
                    let r = request(addr, "GET", "/report").await;
                    seen.push(r.status);
                    if r.status != 200 {
                        refusal = Some(r);
                        // A polite client: do not spin on refusals.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                (seen, refusal)
            })
        })
        .collect();
    let mut counts = HashMap::new();
    let mut refusal = None;
    for t in tasks {
        let (seen, r) = t.await.unwrap();
        for s in seen {
            *counts.entry(s).or_insert(0) += 1;
        }
        refusal = refusal.or(r);
    }
    (counts, refusal)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_sheds_load_with_503_and_the_limit_adapts_below_the_clients() {
    let layer = AdaptiveConcurrencyLayer::builder()
        .name("report")
        .build()
        .unwrap();
    let addr = app(Some(layer.clone())).await;
    let (counts, refusal) = load(addr, 48, Duration::from_secs(2)).await;

    let ok = counts.get(&200).copied().unwrap_or(0);
    let shed = counts.get(&503).copied().unwrap_or(0);
    assert_eq!(
        ok + shed,
        counts.values().sum::<usize>(),
        "only 200 and 503: {counts:?}"
    );
    // The dependency serves 200/s; well over half of that in 2 s.
    assert!(ok >= 150, "{counts:?}");
    assert!(
        shed > 0,
        "48 clients on a 4-worker dependency, nothing refused: {counts:?}"
    );
    let r = refusal.expect("a refusal");
    assert_eq!(r.status, 503);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert!(r.headers["retry-after"].parse::<u64>().unwrap() >= 1);
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["status"], 503);

    let s = layer.stats();
    assert!(
        s.min_rtt.is_some_and(|m| m >= Duration::from_millis(20)),
        "{s:?}"
    );
    assert!(
        (1..=24).contains(&s.limit),
        "limit {} did not come down from 48 clients",
        s.limit
    );
    assert_eq!(s.refused, shed as u64);
    // Every permit is given back once the clients are gone.
    let deadline = Instant::now() + Duration::from_secs(2);
    while layer.stats().in_flight > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(layer.stats().in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layer_report_queues_everything() {
    let addr = app(None).await;
    let (counts, _) = load(addr, 48, Duration::from_secs(1)).await;
    assert_eq!(
        counts.keys().copied().collect::<Vec<_>>(),
        [200],
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sms_admits_the_burst_then_429_with_headers() {
    let addr = app(Some(AdaptiveConcurrencyLayer::builder().build().unwrap())).await;
    let start = Instant::now();
    let mut replies = Vec::new();
    for _ in 0..30 {
        replies.push(request(addr, "POST", "/sms").await);
    }
    let t = start.elapsed().as_secs_f64();
    let admitted = replies.iter().filter(|r| r.status == 200).count();
    assert!(
        replies[..10].iter().all(|r| r.status == 200),
        "the burst of 10"
    );
    assert!(
        admitted as f64 <= 10.0 + 10.0 * t,
        "{admitted} admitted in {t:.3} s"
    );
    for r in &replies[..10] {
        assert_eq!(r.headers["ratelimit-policy"], "\"sms\";q=10;w=1;burst=10");
    }
    assert!(replies[0].headers["ratelimit"].starts_with("\"sms\";r=9;"));
    let refused = replies
        .iter()
        .find(|r| r.status == 429)
        .expect("a 429 after the burst");
    assert_eq!(refused.headers["content-type"], "application/problem+json");
    assert_eq!(refused.headers["retry-after"], "1");
    let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(body["violated-policies"], serde_json::json!(["sms"]));

    // Tokens come back: after a second the burst is there again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(request(addr, "POST", "/sms").await.status, 200);
}
