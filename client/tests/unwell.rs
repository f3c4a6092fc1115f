//! A server answering that it is unwell is an outage, not a free pass nor a bug: `BUSY` (a
//! runaway script), `MISCONF` (writes stopped after a failed save), `OOM` (`maxmemory`
//! reached). Checks are answered by the fail modes (the local bucket keeps limiting,
//! fail-closed policies refuse with a Retry-After), the breaker counts them, and the store
//! answers again once the fault ends.
//!
//! Each test proves the fault first (the server really answers with that error).

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

fn limiter(s: &Server) -> Limiter {
    Limiter::builder(s.url())
        .timeout(Duration::from_millis(100))
        .breaker_threshold(3)
        .probe_interval(Duration::from_millis(200))
        .build()
        .unwrap()
}

fn api() -> Policy {
    Policy::builder("api").per_hour(5).burst(5).build().unwrap()
}

/// Waits until a plain write gets `code` from the server: the fault is real.
fn prove(s: &Server, code: &str) {
    let mut c = s.conn();
    assert!(
        eventually(Duration::from_secs(5), || {
            let r: redis::RedisResult<()> = redis::cmd("SET").arg("probe").arg(1).query(&mut c);
            matches!(r, Err(e) if e.code() == Some(code))
        }),
        "{:?}: the server never answered {code}",
        s.flavor
    );
}

/// During the fault: fast fail-mode answers that still limit, and an open breaker.
async fn judge_outage(l: &Limiter, flavor: Flavor, fault: &str) {
    let login = Policy::builder("login")
        .per_hour(5)
        .burst(5)
        .fail_closed()
        .build()
        .unwrap();
    let api = api();
    assert_eq!(
        l.check_one(&api, "warm", 1).await.map(|d| d.source).ok(),
        Some(Source::LocalFallback),
        "{flavor:?} {fault}: the first check during the fault"
    );
    let started = Instant::now();
    let mut allowed = 0;
    for i in 0..10 {
        let d = l.check_one(&api, "alice", 1).await.unwrap_or_else(|e| {
            panic!("{flavor:?} {fault}: check {i} returned an error instead of a fail mode: {e}")
        });
        assert_eq!(
            d.source,
            Source::LocalFallback,
            "{flavor:?} {fault}: check {i}"
        );
        allowed += usize::from(d.is_allowed());
    }
    assert_eq!(
        allowed, 5,
        "{flavor:?} {fault}: the local bucket must keep limiting"
    );
    let d = l.check_one(&login, "alice", 1).await.unwrap();
    assert_eq!(
        (d.source, d.is_allowed()),
        (Source::FailClosed, false),
        "{flavor:?} {fault}"
    );
    assert!(
        d.retry_after().is_some(),
        "{flavor:?} {fault}: 503 needs a Retry-After"
    );
    assert!(
        l.breaker_open(),
        "{flavor:?} {fault}: must count for the breaker"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{flavor:?} {fault}: {:?}",
        started.elapsed()
    );
}

/// After the fault: the store answers again within a probe interval or two.
async fn await_recovery(l: &Limiter, flavor: Flavor, fault: &str) {
    let back = Instant::now();
    loop {
        let d = l.check_one(&api(), "bob", 1).await.unwrap();
        if d.source == Source::Store {
            return;
        }
        assert!(
            back.elapsed() < Duration::from_secs(3),
            "{flavor:?} {fault}: no recovery"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn warm_up(l: &Limiter) {
    assert!(l.ready(Duration::from_secs(5)).await);
    assert_eq!(
        l.check_one(&api(), "warm", 1).await.unwrap().source,
        Source::Store
    );
}

fn own_servers_only() -> bool {
    // These break the server on purpose: only servers started here.
    std::env::var("REDIS_URL").is_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_a_runaway_script() {
    if !own_servers_only() {
        return;
    }
    for flavor in Flavor::selected() {
        let s = Server::start_with(flavor, true, &["--busy-reply-threshold", "10"]);
        let l = limiter(&s);
        warm_up(&l).await;
        let url = s.url();
        let script = std::thread::spawn(move || {
            let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
            let _: redis::RedisResult<redis::Value> = redis::cmd("EVAL")
                .arg("while true do end")
                .arg(0)
                .query(&mut c);
        });
        prove(&s, "BUSY");
        judge_outage(&l, flavor, "BUSY").await;
        let _: () = redis::cmd("SCRIPT")
            .arg("KILL")
            .query(&mut s.conn())
            .unwrap();
        script.join().unwrap();
        await_recovery(&l, flavor, "BUSY").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconf_writes_stopped_after_a_failed_save() {
    if !own_servers_only() {
        return;
    }
    for flavor in Flavor::selected() {
        // `dir` is a protected config since 7.0; the default `stop-writes-on-bgsave-error yes`.
        let s = Server::start_with(flavor, true, &["--enable-protected-configs", "yes"]);
        let l = limiter(&s);
        warm_up(&l).await;
        let mut c = s.conn();
        let config = |c: &mut redis::Connection, k: &str, v: &str| {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(k)
                .arg(v)
                .query(c)
                .unwrap();
        };
        // A save point, and a directory no one can write a file into (not even root).
        config(&mut c, "save", "3600 1");
        config(&mut c, "dir", "/proc");
        let _: redis::RedisResult<()> = redis::cmd("BGSAVE").query(&mut c);
        prove(&s, "MISCONF");
        judge_outage(&l, flavor, "MISCONF").await;
        // Fixed as an operator would: a good directory and a save that succeeds.
        config(&mut c, "dir", &s.dir.display().to_string());
        let saved = eventually(Duration::from_secs(10), || {
            let _: redis::RedisResult<()> = redis::cmd("BGSAVE").query(&mut c);
            std::thread::sleep(Duration::from_millis(50));
            let info: String = redis::cmd("INFO").arg("persistence").query(&mut c).unwrap();
            info.contains("rdb_last_bgsave_status:ok")
        });
        assert!(saved, "{flavor:?}: the save never succeeded again");
        await_recovery(&l, flavor, "MISCONF").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_maxmemory_reached() {
    if !own_servers_only() {
        return;
    }
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let l = limiter(&s);
        warm_up(&l).await;
        let mut c = s.conn();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction")
            .arg("maxmemory")
            .arg("1")
            .query(&mut c)
            .unwrap();
        prove(&s, "OOM");
        judge_outage(&l, flavor, "OOM").await;
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("0")
            .query(&mut c)
            .unwrap();
        await_recovery(&l, flavor, "OOM").await;
    }
}
