//! Real HTTP against an in-process axum app with the layer, on a real Redis: statuses,
//! headers on every limited response (parsed as structured fields), problem+json bodies,
//! Retry-After that is never early, and the fail modes with Redis killed.

use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use axum::Router;
use redis_ratelimit_client::http::{MissingSubject, RateLimitLayer, Route};
use redis_ratelimit_client::{Limiter, Policy};
use redis_ratelimit_testkit::*;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request, with `X-API-Key` when a key is given.
async fn request(addr: SocketAddr, method: &str, path: &str, key: Option<&str>) -> HttpReply {
    let headers: Vec<(&str, &str)> = key.map(|k| ("X-API-Key", k)).into_iter().collect();
    http_request(addr, method, path, &headers).await
}

/// The gateway example's routes, plus a fast route for Retry-After and an anonymous
/// per-IP route.
async fn app(redis_url: String) -> SocketAddr {
    let limiter = Limiter::builder(redis_url)
        // Generous: a slow run must not answer from the local fallback (fresh, full buckets).
        .timeout(Duration::from_millis(500))
        .breaker_threshold(2)
        .probe_interval(Duration::from_millis(300))
        .build()
        .unwrap();
    let api = Policy::builder("api")
        .per_minute(100)
        .burst(20)
        .build()
        .unwrap();
    let login = Policy::builder("login")
        .per_minute(5)
        .burst(5)
        .fail_closed()
        .build()
        .unwrap();
    let fast = Policy::builder("fast")
        .per_second(2)
        .burst(1)
        .build()
        .unwrap();
    let limited = RateLimitLayer::builder(limiter.clone())
        .route(Route::get("/api/").policy(api, 1))
        .route(Route::post("/login").policy(login, 1))
        .route(Route::get("/fast").policy(fast, 1))
        .build();
    let anon = Policy::builder("anon")
        .per_hour(1)
        .burst(2)
        .build()
        .unwrap();
    let per_ip = RateLimitLayer::builder(limiter)
        .route(Route::get("/public").policy(anon.clone(), 1))
        .missing_subject(MissingSubject::Limit {
            policy: anon,
            subject: Arc::new(|_, ext| {
                ext.get::<ConnectInfo<SocketAddr>>()
                    .map(|c| c.0.ip().to_string())
            }),
        })
        .build();
    let app = Router::new()
        .route("/api/{*rest}", get(|| async { "{\"ok\":true}" }))
        .route("/login", post(|| async { "{\"ok\":true}" }))
        .route("/fast", get(|| async { "ok" }))
        .route("/open", get(|| async { "ok" }))
        .layer(limited)
        .merge(
            Router::new()
                .route("/public", get(|| async { "ok" }))
                .layer(per_ip),
        );
    serve(app).await
}

/// Serves `app` on a free loopback port, with the peer's address for per-IP subjects.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

fn parse_list(v: &str) -> sfv::List {
    sfv::Parser::new(v)
        .parse::<sfv::List>()
        .unwrap_or_else(|e| panic!("{v:?}: {e}"))
}

/// (name, params) of each list member.
fn items(v: &str) -> Vec<(String, HashMap<String, i64>)> {
    parse_list(v)
        .into_iter()
        .map(|m| match m {
            sfv::ListEntry::Item(i) => {
                let name = match i.bare_item {
                    sfv::BareItem::String(s) => s.as_str().to_string(),
                    other => panic!("policy name not a string: {other:?}"),
                };
                let params = i
                    .params
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), v.as_integer().map_or(-1, i64::from)))
                    .collect();
                (name, params)
            }
            other => panic!("not an item: {other:?}"),
        })
        .collect()
}

/// axum answers HEAD with the GET handler: a GET route must limit HEAD too, or HEAD would
/// be a way around the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_requests_are_limited_like_get() {
    let s = Server::start(Flavor::Redis.or_selected());
    let addr = app(s.url()).await;
    for i in 0..20 {
        let r = request(addr, "HEAD", "/api/hello", Some("h1")).await;
        assert_eq!(r.status, 200, "HEAD {i}");
        assert_eq!(items(&r.headers["ratelimit"])[0].1["r"], 19 - i, "HEAD {i}");
    }
    let r = request(addr, "HEAD", "/api/hello", Some("h1")).await;
    assert_eq!(r.status, 429, "the 21st HEAD");
    assert!(r.headers.contains_key("retry-after"));
    // HEAD and GET share the bucket.
    assert_eq!(
        request(addr, "GET", "/api/hello", Some("h1")).await.status,
        429
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_21st_quick_request_is_429_with_headers_and_problem() {
    let s = Server::start(Flavor::Redis.or_selected());
    let addr = app(s.url()).await;
    for i in 0..20 {
        let r = request(addr, "GET", "/api/hello", Some("k1")).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        let policy = items(&r.headers["ratelimit-policy"]);
        assert_eq!(policy[0].0, "api");
        assert_eq!(policy[0].1["q"], 100);
        assert_eq!(policy[0].1["w"], 60);
        assert_eq!(policy[0].1["burst"], 20);
        let state = items(&r.headers["ratelimit"]);
        assert_eq!(state[0].0, "api");
        assert_eq!(state[0].1["r"], 19 - i, "remaining after request {i}");
        assert!(state[0].1["t"] >= 1);
        assert!(!r.headers.contains_key("retry-after"));
    }
    let r = request(addr, "GET", "/api/hello", Some("k1")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    let retry: u64 = r.headers["retry-after"].parse().expect("whole seconds");
    assert!(retry >= 1);
    assert_eq!(items(&r.headers["ratelimit"])[0].1["r"], 0);
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Too Many Requests");
    assert!(body["type"].as_str().unwrap().ends_with("#quota-exceeded"));
    assert!(body["detail"].as_str().unwrap().contains("'api'"));
    assert_eq!(body["retry_after"], retry);
    assert_eq!(body["violated-policies"], serde_json::json!(["api"]));
    // Another key is not affected; unlimited routes carry no headers.
    assert_eq!(
        request(addr, "GET", "/api/hello", Some("k2")).await.status,
        200
    );
    let open = request(addr, "GET", "/open", Some("k1")).await;
    assert_eq!(open.status, 200);
    assert!(!open.headers.contains_key("ratelimit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_never_early() {
    let s = Server::start(Flavor::Valkey.or_selected());
    let addr = app(s.url()).await;
    assert_eq!(request(addr, "GET", "/fast", Some("k")).await.status, 200);
    let r = request(addr, "GET", "/fast", Some("k")).await;
    assert_eq!(r.status, 429);
    let retry: u64 = r.headers["retry-after"].parse().unwrap();
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let r = request(addr, "GET", "/fast", Some("k")).await;
    assert_eq!(
        r.status, 200,
        "refused after waiting Retry-After {retry} s: {}",
        r.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_is_401_or_limited_per_ip() {
    let s = Server::start(Flavor::Redis.or_selected());
    let addr = app(s.url()).await;
    let r = request(addr, "GET", "/api/x", None).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["status"], 401);
    assert!(r.headers.contains_key("www-authenticate"));

    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(request(addr, "GET", "/public", None).await.status);
    }
    assert_eq!(seen, [200, 200, 429], "2 per hour per IP");
}

/// An anonymous request is limited by the anonymous policy alone, never the route's meter,
/// whatever the number of the route's own policies (one here, as the meter's check once
/// mistook for a keyed request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_request_is_not_metered() {
    let s = Server::start(Flavor::Redis.or_selected());
    let limiter = Limiter::builder(s.url())
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let policy = |name, per_hour| {
        Policy::builder(name)
            .per_hour(per_hour)
            .burst(per_hour)
            .build()
            .unwrap()
    };
    let layer = RateLimitLayer::builder(limiter)
        .route(Route::get("/gen").policy(policy("api", 100), 1).metered(
            policy("tokens", 10_000),
            |_| 100,
            |_| None,
        ))
        .missing_subject(MissingSubject::Limit {
            policy: policy("anon", 10),
            subject: Arc::new(|_, _| Some("203.0.113.7".to_string())),
        })
        .build();
    let addr = serve(
        Router::new()
            .route("/gen", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let names = |r: &HttpReply| -> Vec<String> {
        items(&r.headers["ratelimit"])
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    };
    let r = request(addr, "GET", "/gen", None).await;
    assert_eq!(r.status, 200);
    assert_eq!(names(&r), ["anon"]);
    let r = request(addr, "GET", "/gen", Some("k1")).await;
    assert_eq!(r.status, 200);
    assert_eq!(names(&r), ["api", "tokens"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_api_serves_login_refuses_then_recovers() {
    let mut s = Server::start(Flavor::Redis.or_selected());
    let addr = app(s.url()).await;
    assert_eq!(request(addr, "POST", "/login", Some("u")).await.status, 200);

    s.kill();
    for _ in 0..10 {
        let t = Instant::now();
        let r = request(addr, "GET", "/api/x", Some("u")).await;
        assert_eq!(r.status, 200, "fail-open route refused: {}", r.body);
        assert!(
            t.elapsed() < Duration::from_millis(200),
            "took {:?}",
            t.elapsed()
        );
        let r = request(addr, "POST", "/login", Some("u")).await;
        assert_eq!(r.status, 503, "fail-closed route: {}", r.body);
        assert!(r.headers["retry-after"].parse::<u64>().unwrap() >= 1);
        assert_eq!(r.headers["content-type"], "application/problem+json");
    }

    s.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = request(addr, "POST", "/login", Some("u")).await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery: {} {}",
            r.status,
            r.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
