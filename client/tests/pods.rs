//! Live pod count: pods beat into their store; each counts the live ones and uses the count
//! for its local fallback share. A pod that stops beating is counted out after its TTL; the
//! last count stands while the store cannot be reached.

use redis_ratelimit_client::pods::LivePods;
use redis_ratelimit_client::Limiter;
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

const TTL: Duration = Duration::from_millis(1000);
const INTERVAL: Duration = Duration::from_millis(200);
/// A beat's timeout: interval + 2 × timeout must stay below the TTL.
const BEAT_TIMEOUT: Duration = Duration::from_millis(300);
/// Scheduling noise on a loaded 2-core machine, on top of TTL + one interval.
const SLACK: Duration = Duration::from_secs(3);

fn pod(s: &Server) -> (Limiter, LivePods) {
    let l = Limiter::builder(s.url()).build().unwrap();
    let p = LivePods::builder(s.url())
        .ttl(TTL)
        .interval(INTERVAL)
        .timeout(BEAT_TIMEOUT)
        .start(&l)
        .unwrap();
    (l, p)
}

async fn until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_follows_the_pods_alive() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let members = || -> i64 {
            redis::cmd("ZCARD")
                .arg("rl:pods")
                .query(&mut s.conn())
                .unwrap()
        };
        follows_three_pods(
            (0..3).map(|_| pod(&s)).collect(),
            &members,
            &format!("{flavor:?}"),
        )
        .await;
    }
}

/// Three pods are counted; one that crashes (stops beating without leaving) is counted out
/// within its TTL; one that leaves is gone from the set at once (`members`: the set's size
/// in the store), and from the others' count at their next beat.
async fn follows_three_pods(
    mut pods: Vec<(Limiter, LivePods)>,
    members: &dyn Fn() -> i64,
    label: &str,
) {
    let all_three = until(TTL + SLACK, || {
        pods.iter()
            .all(|(l, p)| p.count() == Some(3) && l.pods() == 3)
    })
    .await;
    let counts: Vec<_> = pods.iter().map(|(l, p)| (p.count(), l.pods())).collect();
    assert!(all_three, "{label}: {counts:?}");

    let stopped_at = Instant::now();
    drop(pods.pop());
    let two = until(TTL + INTERVAL + SLACK, || {
        pods.iter()
            .all(|(l, p)| p.count() == Some(2) && l.pods() == 2)
    })
    .await;
    let took = stopped_at.elapsed();
    let counts: Vec<_> = pods.iter().map(|(l, p)| (p.count(), l.pods())).collect();
    assert!(two, "{label}: {counts:?} after {took:?}");
    eprintln!("{label}: a stopped pod counted out after {took:?} (TTL {TTL:?})");

    assert_eq!(members(), 2, "{label}");
    let (_, leaving) = pods.pop().unwrap();
    leaving.leave().await;
    assert_eq!(members(), 1, "{label}: left, yet still in the set");
    let one = until(INTERVAL + SLACK, || pods[0].1.count() == Some(1)).await;
    assert!(one, "{label}: {:?}", pods[0].1.count());
    assert_eq!(pods[0].0.pods(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_count_kept_while_the_store_is_unreachable() {
    let s = Server::start(Flavor::Redis.or_selected());
    let pods: Vec<_> = (0..2).map(|_| pod(&s)).collect();
    assert!(
        until(TTL + SLACK, || pods
            .iter()
            .all(|(_, p)| p.count() == Some(2)))
        .await
    );
    let mut probe = s.conn();
    probe
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    s.signal("STOP");
    // The fault is real: the server answers nobody.
    let ping: redis::RedisResult<String> = redis::cmd("PING").query(&mut probe);
    assert!(ping.is_err(), "a stopped server answered: {ping:?}");
    // Several beats fail meanwhile (each times out after BEAT_TIMEOUT).
    tokio::time::sleep(TTL * 2).await;
    let counts: Vec<_> = pods.iter().map(|(l, p)| (p.count(), l.pods())).collect();
    s.signal("CONT");
    assert!(
        counts.iter().all(|c| *c == (Some(2), 2)),
        "count lost while unreachable: {counts:?}"
    );
}

/// The same on a cluster: the set is one key on its own slot, reached through redis-rs'
/// cluster client from any of the nodes' URLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_on_a_cluster() {
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    let urls: Vec<String> = nodes.iter().map(Server::url).collect();
    let pods = (0..3)
        .map(|_| {
            let l = Limiter::cluster_builder(urls.clone()).build().unwrap();
            let p = LivePods::cluster_builder(urls.clone())
                .ttl(TTL)
                .interval(INTERVAL)
                .timeout(BEAT_TIMEOUT)
                .start(&l)
                .unwrap();
            (l, p)
        })
        .collect();
    let client = redis::cluster::ClusterClient::new(urls.clone()).unwrap();
    let members = || -> i64 {
        let mut c = client.get_connection().unwrap();
        redis::cmd("ZCARD").arg("rl:pods").query(&mut c).unwrap()
    };
    follows_three_pods(pods, &members, "cluster").await;
}

/// A beat interval that, with twice a beat's timeout, reaches the TTL could count live pods
/// out between beats (a count too low raises every pod's fallback share): refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_that_reaches_the_ttl_is_refused() {
    let l = Limiter::builder("redis://127.0.0.1:1/").build().unwrap();
    let start = |interval: Duration, timeout: Duration| {
        LivePods::builder("redis://127.0.0.1:1/")
            .ttl(Duration::from_secs(10))
            .interval(interval)
            .timeout(timeout)
            .start(&l)
            .map(drop)
    };
    let ms = Duration::from_millis;
    for (interval, timeout) in [
        (ms(15_000), ms(500)),
        (ms(9_600), ms(500)),
        // 3 000 + 2 × 3 500 = 10 000: the beats' scores may lie a TTL apart.
        (ms(3_000), ms(3_500)),
        (ms(100), Duration::MAX),
    ] {
        let e = start(interval, timeout).expect_err("refused");
        assert!(e.to_string().contains("below the TTL"), "{e}");
    }
    assert!(start(ms(3_000), ms(500)).is_ok());
    assert!(start(ms(3_000), ms(3_400)).is_ok());
}
