//! The limiter must never become the outage: with the server killed (`kill -9`) or hung
//! (`SIGSTOP`), every check returns within the timeout plus a margin, fail-open policies
//! admit (within the per-pod share), fail-closed ones refuse, the breaker opens and probes,
//! and all recovers when the server is back.

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(5);
/// Scheduling noise on a loaded 2-core machine; the failure this guards against (waiting
/// on a dead server for seconds) is orders of magnitude larger.
const MARGIN: Duration = Duration::from_millis(100);
const PROBE: Duration = Duration::from_millis(300);
/// How long a freshly started server may take to answer a first `PING`.
const READY: Duration = Duration::from_secs(5);

struct Policies {
    api: Policy,
    login: Policy,
}

fn policies() -> Policies {
    Policies {
        api: Policy::builder("api")
            .per_second(1000)
            .burst(1000)
            .build()
            .unwrap(),
        login: Policy::builder("login")
            .per_minute(5)
            .burst(5)
            .fail_closed()
            .build()
            .unwrap(),
    }
}

fn limiter(s: &Server) -> Limiter {
    Limiter::builder(s.url())
        .timeout(TIMEOUT)
        .connect_timeout(Duration::from_millis(200))
        .breaker_threshold(3)
        .probe_interval(PROBE)
        .pods(4)
        .build()
        .unwrap()
}

/// Runs `n` checks of each policy; returns the sources seen and the slowest check.
async fn round(l: &Limiter, p: &Policies, n: usize) -> (Vec<Source>, Vec<Source>, Duration) {
    let (mut api, mut login, mut slowest) = (Vec::new(), Vec::new(), Duration::ZERO);
    for i in 0..n {
        let t = Instant::now();
        let d = l
            .check_one(&p.api, &format!("user{}", i % 5), 1)
            .await
            .unwrap();
        slowest = slowest.max(t.elapsed());
        assert!(d.is_allowed(), "fail-open api refused: {d:?}");
        api.push(d.source);
        let t = Instant::now();
        let d = l.check_one(&p.login, "someone", 1).await.unwrap();
        slowest = slowest.max(t.elapsed());
        login.push(d.source);
        if d.source == Source::FailClosed {
            assert!(!d.is_allowed());
            let retry = d.retry_after().expect("a retry-after");
            assert!(retry >= Duration::from_secs(1), "whole seconds: {retry:?}");
        }
    }
    (api, login, slowest)
}

/// With the store out: every check is fast, fail-open answers locally, fail-closed
/// refuses, and the breaker is open.
async fn expect_outage_answers(l: &Limiter, p: &Policies, flavor: Flavor) {
    let (api, login, slowest) = round(l, p, 50).await;
    assert!(
        slowest < TIMEOUT + MARGIN,
        "{flavor:?}: a check took {slowest:?}"
    );
    assert!(
        api.iter().all(|s| *s == Source::LocalFallback),
        "{flavor:?}: {api:?}"
    );
    assert!(
        login.iter().all(|s| *s == Source::FailClosed),
        "{flavor:?}: {login:?}"
    );
    assert!(l.breaker_open(), "{flavor:?}: breaker still closed");
}

/// Within a few seconds a check is answered by the store.
async fn expect_store(l: &Limiter, p: &Policies) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = l.check_one(&p.api, "recovery", 1).await.unwrap();
        if d.source == Source::Store {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery: still {:?}",
            d.source
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn expect_recovery(l: &Limiter, p: &Policies) {
    expect_store(l, p).await;
    assert!(!l.breaker_open());
    let d = l.check_one(&p.login, "after", 1).await.unwrap();
    assert_eq!((d.source, d.is_allowed()), (Source::Store, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_server() {
    for flavor in Flavor::selected() {
        let mut s = Server::start(flavor);
        let l = limiter(&s);
        let p = policies();
        // The store answers before the fault (checks themselves may miss the 5 ms timeout
        // on a loaded machine; connection setup often does).
        assert!(l.ready(READY).await, "{flavor:?}: store never answered");
        expect_store(&l, &p).await;

        s.kill();
        expect_outage_answers(&l, &p, flavor).await;

        // Still down across several probe intervals: probes fail, the breaker stays open.
        tokio::time::sleep(PROBE * 2).await;
        let (_, login, slowest) = round(&l, &p, 10).await;
        assert!(slowest < TIMEOUT + MARGIN, "{flavor:?}: {slowest:?}");
        assert!(login.iter().all(|s| *s == Source::FailClosed), "{flavor:?}");

        s.restart();
        expect_recovery(&l, &p).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_server() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let l = limiter(&s);
        let p = policies();
        assert!(l.ready(READY).await, "{flavor:?}: store never answered");
        expect_store(&l, &p).await;
        let mut probe = s.conn();
        probe
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();

        s.signal("STOP");
        {
            // Resumes the server even if an assertion fails, so it can be stopped.
            let _resume = Resume(&s);
            // The fault is real: the server answers nobody.
            let ping: redis::RedisResult<String> = redis::cmd("PING").query(&mut probe);
            assert!(ping.is_err(), "{flavor:?}: a stopped server answered");
            expect_outage_answers(&l, &p, flavor).await;
        }
        expect_recovery(&l, &p).await;
    }
}

/// While the store is out, a pod admits its share (limit ÷ pods), not the whole limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_fallback_admits_the_pod_share() {
    let mut s = Server::start(Flavor::Redis.or_selected());
    let l = limiter(&s); // 4 pods
    s.kill();
    let p = Policy::builder("share")
        .per_hour(1)
        .burst(40)
        .build()
        .unwrap();
    let mut admitted = 0;
    for _ in 0..30 {
        let d = l.check_one(&p, "tenant", 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback);
        admitted += usize::from(d.is_allowed());
    }
    assert_eq!(admitted, 10, "40 / 4 pods");
}

struct Resume<'a>(&'a Server);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.pid().to_string()])
            .status();
    }
}

/// Counters since the previous snapshot (the debugging recorder drains on snapshot),
/// summed over label sets.
fn counters(snapshotter: &metrics_util::debugging::Snapshotter) -> HashMap<String, u64> {
    let mut sums = HashMap::new();
    for (k, .., v) in snapshotter.snapshot().into_vec() {
        if let metrics_util::debugging::DebugValue::Counter(n) = v {
            *sums.entry(k.key().name().to_string()).or_default() += n;
        }
    }
    sums
}

/// An open breaker stops calling the store, lets one probe through per interval, and
/// closes on the first probe that succeeds. Counted through the metrics the limiter emits
/// (a thread-local recorder: this test runs on one thread).
#[tokio::test(flavor = "current_thread")]
async fn breaker_stops_hammering_and_probes() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let errors = |c: &HashMap<String, u64>| c.get("ratelimit_store_errors_total").copied();
    let decisions = |c: &HashMap<String, u64>| c.get("ratelimit_decisions_total").copied();

    let mut s = Server::start(Flavor::Valkey.or_selected());
    // Opens after 3 failures, probes after 50 ms, then backs off to every PROBE. A killed
    // server refuses connections at once, so a generous timeout changes nothing below and
    // keeps a slow first check on a loaded machine from counting as a failure.
    let l = Limiter::builder(s.url())
        .timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(200))
        .breaker_threshold(3)
        .probe_interval(PROBE)
        .build()
        .unwrap();
    let p = policies();
    assert!(l.ready(READY).await);
    assert_eq!(
        l.check_one(&p.api, "u", 1).await.unwrap().source,
        Source::Store
    );
    counters(&snapshotter);

    s.kill();
    for _ in 0..20 {
        l.check_one(&p.api, "u", 1).await.unwrap();
    }
    let c = counters(&snapshotter);
    assert_eq!(
        errors(&c),
        Some(3),
        "opened after 3 failures, then stopped calling"
    );
    assert_eq!(decisions(&c), Some(20));

    tokio::time::sleep(PROBE + PROBE / 2).await;
    for _ in 0..20 {
        l.check_one(&p.api, "u", 1).await.unwrap();
    }
    let c = counters(&snapshotter);
    assert_eq!(errors(&c), Some(1), "exactly one probe in one interval");

    s.restart();
    tokio::time::sleep(PROBE + PROBE / 2).await;
    let d = l.check_one(&p.api, "u", 1).await.unwrap();
    assert_eq!(d.source, Source::Store, "the probe reached the store again");
    assert!(!l.breaker_open());
    assert_eq!(errors(&counters(&snapshotter)).unwrap_or(0), 0);
}
