//! The gateway example's `POST /llm` over real sockets: the estimate is reserved, the upstream's
//! `X-Used-Tokens` settled, and a subject that under-estimated waits out its debt. Runs the
//! example binary itself (built by `cargo test`) on every backend: Redis and Valkey, with the
//! module and with the Lua script.

use redis_ratelimit_testkit::*;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

struct Reply {
    status: u16,
    headers: HashMap<String, String>,
}

async fn post_llm(addr: SocketAddr, key: &str, estimate: u64, actual: Option<u64>) -> Reply {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let actual = actual
        .map(|a| format!("X-Actual-Tokens: {a}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "POST /llm HTTP/1.1\r\nHost: test\r\nX-API-Key: {key}\r\nX-Estimated-Tokens: {estimate}\r\n\
         {actual}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let head = raw.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad response: {raw}"));
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_string()))
        .collect();
    Reply { status, headers }
}

/// `r=` of the `RateLimit` header.
fn remaining(r: &Reply) -> i64 {
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
            assert!(
                (remaining(&r) - want).abs() <= 50, // a token refills every 6 ms while the test runs
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
        // Without headers the estimate is 1 and so is the use.
        let r = post_llm(g.addr, "k3", 1, None).await;
        assert_eq!((r.status, remaining(&r)), (200, 9_999), "{}", t.name);
    }
}
