//! The gateway example's `POST /llm` over real sockets: the estimate is reserved, the upstream's
//! `X-Used-Tokens` settled, and a subject that under-estimated waits out its debt. Runs the
//! example binary itself (built by `cargo test`) on every backend: Redis and Valkey, with the
//! module and with the Lua script.

use redis_ratelimit_testkit::*;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Gateway {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gateway_binary() -> std::path::PathBuf {
    // target/<profile>/deps/<this test> → target/<profile>/examples/gateway
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join("examples").join("gateway")
}

async fn start_gateway(redis_url: &str) -> Gateway {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let bin = gateway_binary();
    let child = Command::new(&bin)
        .env("LISTEN_ADDR", addr.to_string())
        .env("REDIS_URL", redis_url)
        // Generous: these requests are about settling, not the timeout; a slow run must
        // not answer from the local fallback.
        .env("TIMEOUT_MS", "500")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let g = Gateway { child, addr };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "gateway did not listen on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    g
}

async fn post_llm(addr: SocketAddr, key: &str, estimate: u64, actual: Option<u64>) -> HttpReply {
    let estimate = estimate.to_string();
    let actual = actual.map(|a| a.to_string());
    let mut headers = vec![
        ("X-API-Key", key),
        ("X-Estimated-Tokens", estimate.as_str()),
    ];
    if let Some(a) = &actual {
        headers.push(("X-Actual-Tokens", a.as_str()));
    }
    http_request(addr, "POST", "/llm", &headers).await
}

/// `r=` of the `RateLimit` header.
fn remaining(r: &HttpReply) -> i64 {
    let h = r.headers.get("ratelimit").expect("RateLimit header");
    h.split(';')
        .find_map(|p| p.strip_prefix("r="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no r= in {h}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_route_reserves_settles_and_refuses_while_in_debt() {
    if std::env::var("REDIS_URL").is_ok() {
        return; // the gateway's key layout is its own: run against servers started here
    }
    for t in backends("llm") {
        let g = start_gateway(&t.url).await;
        // Three requests estimating 1000 that used 4000 each: 12 000 of a 10 000 burst.
        for i in 0..3 {
            let r = post_llm(g.addr, "k1", 1_000, Some(4_000)).await;
            assert_eq!(r.status, 200, "{}: request {i}", t.name);
            assert_eq!(
                r.headers.get("x-used-tokens").map(String::as_str),
                Some("4000")
            );
            assert!(
                r.headers
                    .get("ratelimit-policy")
                    .is_some_and(|p| p.contains("\"llm\"")),
                "{}: {:?}",
                t.name,
                r.headers
            );
            let want = (10_000 - 4_000 * (i + 1)).max(0);
            // A token refills every 6 ms while the test runs.
            assert!(
                (remaining(&r) - want).abs() <= 50,
                "{}: r={} want {want}",
                t.name,
                remaining(&r)
            );
        }
        // 2000 in debt: a fourth estimating 1000 waits for 3000 tokens at 6 ms each: 18 s.
        let r = post_llm(g.addr, "k1", 1_000, None).await;
        assert_eq!(r.status, 429, "{}", t.name);
        assert_eq!(
            r.headers.get("retry-after").map(String::as_str),
            Some("18"),
            "{}",
            t.name
        );
        assert_eq!(remaining(&r), 0, "{}", t.name);
        // Another key is untouched, and an over-estimate is refunded.
        let r = post_llm(g.addr, "k2", 5_000, Some(100)).await;
        assert_eq!(r.status, 200, "{}", t.name);
        assert!(
            (remaining(&r) - 9_900).abs() <= 50,
            "{}: r={}",
            t.name,
            remaining(&r)
        );
        // Without the token headers the estimate is 1 and so is the use.
        let r = http_request(g.addr, "POST", "/llm", &[("X-API-Key", "k3")]).await;
        assert_eq!((r.status, remaining(&r)), (200, 9_999), "{}", t.name);
    }
}
