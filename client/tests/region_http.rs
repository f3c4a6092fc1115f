//! The HTTP layer on a [`RegionalLimiter`]: requests are limited at the region's share, and
//! a metered route's settlement counts the real cost as the region's demand.

use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::Router;
use redis_ratelimit_client::http::{RateLimitLayer, Route};
use redis_ratelimit_client::region::RegionalLimiter;
use redis_ratelimit_client::Policy;
use redis_ratelimit_testkit::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn used_tokens(h: &HeaderMap) -> Option<u64> {
    h.get("x-used-tokens")?.to_str().ok()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_limits_at_the_regions_share_and_settles_its_demand() {
    let servers: Vec<Server> = (0..3)
        .map(|_| Server::start(Flavor::Redis.or_selected()))
        .collect();
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    // 600/min = 10/s, burst 100: the whole limit would admit every one of 60 requests.
    let api = Policy::builder("api")
        .per_minute(600)
        .burst(100)
        .build()
        .unwrap();
    let llm = Policy::builder("llm")
        .per_minute(100_000)
        .burst(100_000)
        .build()
        .unwrap();
    let regional = RegionalLimiter::builder(0, urls)
        .policy(&api)
        .policy(&llm)
        .limiter(|b| b.timeout(Duration::from_millis(500)))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(regional.clone())
        .route(Route::get("/api/").policy(api.clone(), 1))
        .route(Route::post("/llm").metered(llm, |_| 1, used_tokens))
        .build();
    let app = Router::new()
        .route("/api/{*rest}", get(|| async { "ok" }))
        .route(
            "/llm",
            post(|| async { ([("x-used-tokens", "500")], "generated") }),
        )
        .layer(layer);
    let addr = serve(app).await;

    let share = || regional.share("api").unwrap_or(0.0);
    let before = share();
    let started = Instant::now();
    let mut admitted = 0u32;
    for _ in 0..60 {
        let r = http_request(addr, "GET", "/api/x", &[("X-API-Key", "k")]).await;
        match r.status {
            200 => admitted += 1,
            429 => assert!(r.headers.contains_key("retry-after")),
            s => panic!("status {s}"),
        }
    }
    let most_share = before.max(share());
    let bound = (100.0 * most_share).ceil() + 10.0 * most_share * started.elapsed().as_secs_f64();
    eprintln!(
        "share {before:.3}..{:.3}: {admitted} of 60 admitted, bound {bound:.1}",
        share()
    );
    assert!(most_share < 1.0, "three regions: a share, not the whole");
    assert!(
        f64::from(admitted) <= bound + 1.0,
        "{admitted} admitted above the region's share ({bound:.1})"
    );
    assert!(admitted < 60, "limited at the whole limit, not the share");

    // Estimated 1, used 500: the region's demand counter in its store says 500.
    let r = http_request(addr, "POST", "/llm", &[("X-API-Key", "k")]).await;
    assert_eq!(r.status, 200);
    let mut c = servers[0].conn();
    let counted = || -> u64 {
        redis::cmd("HGET")
            .arg("rl:{region.0}:demand")
            .arg("llm")
            .query::<Option<u64>>(&mut c)
            .unwrap()
            .unwrap_or(0)
    };
    let mut counted = counted;
    assert!(
        eventually(Duration::from_secs(5), || counted() == 500),
        "demand counted: {}",
        counted()
    );
}
