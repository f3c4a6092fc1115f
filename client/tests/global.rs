//! One quota for many pods, the deny cache's round trips and bound, and clusters.

use redis_ratelimit_client::{slot, KeyLayout, Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::collections::HashSet;
use std::time::{Duration, Instant};

fn pod(url: &str) -> Limiter {
    Limiter::builder(url)
        .timeout(Duration::from_millis(500))
        .pods(10)
        .build()
        .unwrap()
}

/// 10 independent limiters (= pods, each its own connection and caches) hammering one key
/// admit no more than burst + rate × elapsed in total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_pods_share_one_quota() {
    for t in backends("global") {
        let p = Policy::builder("api")
            .per_second(20)
            .burst(30)
            .build()
            .unwrap();
        let started = Instant::now();
        let tasks: Vec<_> = (0..10)
            .map(|_| {
                let l = pod(&t.url);
                let p = p.clone();
                tokio::spawn(async move {
                    let mut admitted = 0u64;
                    let end = Instant::now() + Duration::from_millis(1500);
                    while Instant::now() < end {
                        let d = l.check_one(&p, "shared-tenant", 1).await.unwrap();
                        assert_ne!(d.source, Source::LocalFallback, "store unreachable?");
                        admitted += u64::from(d.is_allowed());
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    admitted
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        let elapsed = started.elapsed().as_secs_f64();
        let bound = 30.0 + 20.0 * elapsed;
        assert!(
            admitted as f64 <= bound,
            "{}: {admitted} > {bound:.1}",
            t.name
        );
        // And the quota was really used, not refused wholesale.
        assert!(admitted >= 30 + 20, "{}: only {admitted} admitted", t.name);
    }
}

/// A refused bucket is not asked again before its Retry-After: `INFO commandstats` counts
/// the calls that reached the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_saves_round_trips_until_retry_after() {
    for t in backends("deny") {
        let l = pod(&t.url);
        // One token a second: the refusal is cached for about a second, room enough for
        // the checks below on a loaded machine.
        let p = Policy::builder("api")
            .per_second(1)
            .burst(3)
            .build()
            .unwrap();
        let mut c = t.conn();
        let calls = |c: &mut redis::Connection| {
            ["rl.check", "rl.checkall", "evalsha", "eval"]
                .iter()
                .map(|n| command_calls(c, n))
                .sum::<i64>()
        };
        // 3 admitted, then 1 refusal that fills the cache.
        let mut refused_until = Instant::now();
        for i in 0..4 {
            let d = l.check_one(&p, "spammer", 1).await.unwrap();
            assert_eq!((d.source, d.is_allowed()), (Source::Store, i < 3));
            refused_until = Instant::now() + d.retry_after().unwrap_or_default();
        }
        let before = calls(&mut c);
        let mut sources = Vec::new();
        for _ in 0..46 {
            sources.push(l.check_one(&p, "spammer", 1).await.unwrap().source);
        }
        assert_eq!(
            calls(&mut c),
            before,
            "{}: refused checks reached the server",
            t.name
        );
        assert!(
            sources.iter().all(|s| *s == Source::DenyCache),
            "{}: {sources:?}",
            t.name
        );

        // After the Retry-After, the store is asked again and admits.
        tokio::time::sleep_until(refused_until.into()).await;
        let d = l.check_one(&p, "spammer", 1).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::Store, true),
            "{}",
            t.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_cache_stays_bounded_under_many_keys() {
    let s = Server::start(Flavor::Redis.or_selected());
    let l = Limiter::builder(s.url())
        .timeout(Duration::from_millis(500))
        .deny_cache_capacity(500)
        .build()
        .unwrap();
    let p = Policy::builder("tiny")
        .per_hour(1)
        .burst(1)
        .build()
        .unwrap();
    for i in 0..3000 {
        let subject = format!("bot{i}");
        l.check_one(&p, &subject, 1).await.unwrap();
        let d = l.check_one(&p, &subject, 1).await.unwrap();
        assert!(!d.is_allowed());
    }
    assert!(l.deny_cache_len() <= 512, "{} entries", l.deny_cache_len());
}

/// On a 3-primary cluster: checks route by hash tag, several policies go in one
/// RL.CHECKALL, and a hot policy's sub-buckets land on different slots (and nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_checks_and_hot_key_shards() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let api = Policy::builder("api").per_hour(1).burst(3).build().unwrap();
        let route = Policy::builder("route")
            .per_hour(1)
            .burst(2)
            .build()
            .unwrap();
        // The background connection may take a moment: wait for the first store answer.
        let deadline = Instant::now() + Duration::from_secs(10);
        while l.check_one(&api, "warmup", 0).await.unwrap().source != Source::Store {
            assert!(
                Instant::now() < deadline,
                "{flavor:?}: cluster never reachable"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for i in 0..30 {
            let subject = format!("tenant{i}");
            for _ in 0..2 {
                let d = l.check(&subject, &[(&api, 1), (&route, 1)]).await.unwrap();
                assert_eq!(
                    (d.source, d.is_allowed()),
                    (Source::Store, true),
                    "{flavor:?}"
                );
            }
            let d = l.check(&subject, &[(&api, 1), (&route, 1)]).await.unwrap();
            assert!(!d.is_allowed(), "{flavor:?}");
        }

        let hot = Policy::builder("search")
            .per_second(1000)
            .burst(800)
            .shards(8)
            .build()
            .unwrap();
        for _ in 0..400 {
            let d = l.check_one(&hot, "big-tenant", 1).await.unwrap();
            assert_eq!(
                (d.source, d.is_allowed()),
                (Source::Store, true),
                "{flavor:?}"
            );
        }
        let layout = KeyLayout::default();
        let tag = layout.subject_tag(b"big-tenant");
        let mut slots = HashSet::new();
        let mut nodes_used = 0;
        for node in &nodes {
            let mut c = node.conn();
            let keys: Vec<String> = redis::cmd("KEYS").arg("rl:*:search").query(&mut c).unwrap();
            nodes_used += usize::from(!keys.is_empty());
            for k in keys {
                let server_slot: u16 = redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(&k)
                    .query(&mut c)
                    .unwrap();
                assert_eq!(server_slot, slot(k.as_bytes()), "{flavor:?}: slot of {k}");
                slots.insert(server_slot);
            }
        }
        let expected: HashSet<u16> = (0..8)
            .map(|i| slot(layout.shard_key(&tag, "search", i, 8).as_bytes()))
            .collect();
        assert_eq!(slots, expected, "{flavor:?}: 8 sub-buckets on 8 slots");
        assert!(nodes_used >= 2, "{flavor:?}: all sub-buckets on one node");
    }
}

/// On a cluster, a reservation over a policy and a sharded one settles both, by module and
/// by script: the script's keys must share a slot, and a sub-bucket is on its own (at times
/// on the subject's node, at times not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_settles_reservations_with_sub_buckets() {
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    for script in [false, true] {
        let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
            .timeout(Duration::from_millis(500))
            .force_script(script)
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(10)).await);
        let api = Policy::builder("api")
            .per_hour(100)
            .burst(100)
            .build()
            .unwrap();
        // Hourly: nothing refills during the test, so what the sub-buckets hold adds up.
        let hot = Policy::builder("hot")
            .per_hour(800)
            .burst(800)
            .shards(8)
            .build()
            .unwrap();
        for i in 0..12 {
            let subject = format!("settler-{script}");
            let r = l.reserve(&subject, &[(&api, 1), (&hot, 1)]).await.unwrap();
            assert_eq!(
                (r.decision().source, r.is_allowed()),
                (Source::Store, true),
                "script {script} #{i}"
            );
            let d = r.settle_each(&[3, 2]).await.unwrap();
            assert_eq!(d.source, Source::Store, "script {script} #{i}");
        }
        // 12 requests of 3 each from the unsharded bucket.
        let d = l
            .check_one(&api, &format!("settler-{script}"), 0)
            .await
            .unwrap();
        assert_eq!(d.remaining, 100 - 36, "script {script}");
        // ...and 12 of 2 each from the sub-buckets (of 100 each), wherever they are.
        let layout = KeyLayout::default();
        let tag = layout.subject_tag(format!("settler-{script}").as_bytes());
        let rate = (hot.rate() / 8.0).to_string();
        let taken: i64 = (0..8)
            .map(|i| {
                let key = layout.shard_key(&tag, "hot", i, 8);
                // A peek (cost 0) on the node that serves the key; the others say MOVED.
                let r: Vec<i64> = nodes
                    .iter()
                    .find_map(|n| {
                        redis::cmd("RL.CHECK")
                            .arg(&key)
                            .arg(&rate)
                            .arg(100)
                            .arg(0)
                            .query(&mut n.conn())
                            .ok()
                    })
                    .unwrap();
                100 - r[1]
            })
            .sum();
        assert_eq!(taken, 24, "script {script}");
    }
}
