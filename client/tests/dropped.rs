//! A connection whose packets are silently dropped (no RST: a NAT, load balancer or host
//! that lost the flow) while the server stays reachable on new connections. The limiter must
//! answer within its timeout meanwhile, keep limiting locally, and reach the store again
//! through a fresh connection instead of waiting on the dead one (which the kernel would only
//! give up after ~15 min of retransmissions).

use redis_ratelimit_client::pods::LivePods;
use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(20);
/// Scheduling noise on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(150);
const PROBE: Duration = Duration::from_millis(300);
/// Stated bound: 3 timeouts and 1 s without an answer retire the connection, the next probe
/// (≤ 300 ms) uses a fresh one.
const RECOVERY: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dropped_connection_is_replaced() {
    if !Blackhole::usable() {
        return;
    }
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let l = Limiter::builder(s.url())
            .timeout(TIMEOUT)
            .connect_timeout(Duration::from_millis(200))
            .breaker_threshold(3)
            .probe_interval(PROBE)
            .build()
            .unwrap();
        let api = Policy::builder("api")
            .per_minute(60)
            .burst(5)
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(5)).await, "{flavor:?}");
        let d = l.check_one(&api, "warm-up", 1).await.unwrap();
        assert_eq!(d.source, Source::Store, "{flavor:?}");
        let mut admin = s.conn();
        let dead = s.client_ports(&mut admin);
        assert_eq!(
            dead.len(),
            1,
            "{flavor:?}: the limiter's connections: {dead:?}"
        );
        let hole = Blackhole::ports(&dead);
        // The fault is the connection's, not the server's: a new connection is answered.
        let pong: String = redis::cmd("PING").query(&mut s.conn()).unwrap();
        assert_eq!(pong, "PONG");

        let started = Instant::now();
        let (mut local, mut local_allowed, mut slowest) = (0, 0, Duration::ZERO);
        let recovered = loop {
            let t = Instant::now();
            let d = l.check_one(&api, "victim", 1).await.unwrap();
            slowest = slowest.max(t.elapsed());
            match d.source {
                Source::Store => break started.elapsed(),
                Source::LocalFallback => {
                    local += 1;
                    local_allowed += usize::from(d.is_allowed());
                }
                other => panic!("{flavor:?}: answered by {other:?}"),
            }
            assert!(
                started.elapsed() < RECOVERY,
                "{flavor:?}: still not back at the store after {RECOVERY:?} ({local} local answers)"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // The drop really hit the limiter's connection: it went unanswered first.
        assert!(local >= 1, "{flavor:?}: no check went unanswered");
        assert!(
            slowest < TIMEOUT + MARGIN,
            "{flavor:?}: a check took {slowest:?}"
        );
        // Limits held meanwhile: one pod's local bucket, burst 5 and a token a second.
        let bound = 5 + recovered.as_secs_f64().ceil() as usize;
        assert!(
            local_allowed <= bound,
            "{flavor:?}: {local_allowed} admitted locally in {recovered:?}"
        );
        // Through a new connection, while the old one is still blackholed.
        let now = s.client_ports(&mut admin);
        assert!(now.iter().any(|p| !dead.contains(p)), "{flavor:?}: {now:?}");
        eprintln!(
            "{flavor:?}: back at the store {recovered:?} after the drop, {local} local answers, \
             slowest check {slowest:?}"
        );
        drop(hole);
    }
}

/// The same fault on a background connection (here a pod's heartbeat): its beats stop
/// landing, and resume through a fresh connection within seconds (`TCP_USER_TIMEOUT`
/// closes the dead one), not after the kernel's ~15 min of retransmissions, during which
/// the other pods would count this one out and raise their fallback shares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dropped_background_connection_is_replaced() {
    if !Blackhole::usable() {
        return;
    }
    let s = Server::start(Flavor::Valkey.or_selected());
    let l = Limiter::builder(s.url()).build().unwrap();
    let pod = LivePods::builder(s.url())
        .id("victim")
        .ttl(Duration::from_secs(30))
        .interval(Duration::from_millis(200))
        .timeout(Duration::from_millis(300))
        .start(&l)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while pod.count().is_none() {
        assert!(Instant::now() < deadline, "no first beat");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut admin = s.conn();
    // The limiter never checked: the pod's is the only connection but ours.
    let dead = s.client_ports(&mut admin);
    assert_eq!(dead.len(), 1, "the pod's connections: {dead:?}");
    // The beat's score: the server's clock at its last landing.
    let mut score = || -> Option<f64> {
        redis::cmd("ZSCORE")
            .arg("rl:pods")
            .arg("victim")
            .query(&mut admin)
            .unwrap()
    };
    let hole = Blackhole::ports(&dead);
    let dropped = Instant::now();
    let before = score();
    // The fault is real: a second passes and no beat lands (five were due).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        score(),
        before,
        "beats still landing through the blackholed flow"
    );
    let recovered = loop {
        if score() != before {
            break dropped.elapsed();
        }
        assert!(
            dropped.elapsed() < RECOVERY_BACKGROUND,
            "no beat landed {RECOVERY_BACKGROUND:?} after the drop"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Through a new connection: besides ours, only the pod connects, and the server lists
    // one it did not have before (the blackholed one may linger there: the server never
    // heard it close).
    let now = s.client_ports(&mut admin);
    assert!(now.iter().any(|p| !dead.contains(p)), "{now:?}");
    eprintln!("beats landing again {recovered:?} after the drop");
    drop(hole);
}

/// Stated bound: `TCP_USER_TIMEOUT` (3 s) closes the dead flow, the next beat reconnects.
const RECOVERY_BACKGROUND: Duration = Duration::from_secs(10);
