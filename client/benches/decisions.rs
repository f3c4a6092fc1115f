//! The decisions a pod makes without a round trip, through the public `check` path (key
//! hashing, planning, decision building, metrics calls with no recorder installed):
//! - a deny-cache hit (a bucket known to be exhausted),
//! - a local fallback decision (the store is down and the breaker open).

use criterion::{criterion_group, criterion_main, Criterion};
use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::{Flavor, Server};
use std::net::TcpListener;
use std::time::Duration;

/// A loopback port with nothing listening: every connection is refused at once.
fn dead_url() -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    format!("redis://127.0.0.1:{port}")
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let policy = Policy::builder("api")
        .per_minute(100)
        .burst(20)
        .build()
        .unwrap();

    // Store down, breaker opened by the first failure: every check answers locally.
    let fallback = rt.block_on(async {
        let l = Limiter::builder(dead_url())
            .breaker_threshold(1)
            .probe_interval(Duration::from_secs(3600))
            .pods(10)
            .local_capacity(1_000_000)
            .build()
            .unwrap();
        l.check_one(&policy, "warm", 1).await.unwrap();
        assert!(l.breaker_open());
        l
    });
    let mut i = 0u64;
    c.bench_function("local fallback decision", |b| {
        b.to_async(&rt).iter(|| {
            i += 1;
            let subject = format!("user{}", i % 10_000);
            let (l, p) = (&fallback, &policy);
            async move {
                let d = l.check_one(p, &subject, 1).await.unwrap();
                debug_assert_eq!(d.source, Source::LocalFallback);
                d
            }
        })
    });

    // A deny-cache hit: one real refusal from a real server fills the cache.
    let server = Server::start(Flavor::Redis);
    let tiny = Policy::builder("tiny")
        .per_hour(1)
        .burst(1)
        .build()
        .unwrap();
    let cached = rt.block_on(async {
        let l = Limiter::builder(server.url())
            .timeout(Duration::from_millis(200))
            .build()
            .unwrap();
        for _ in 0..2 {
            l.check_one(&tiny, "spammer", 1).await.unwrap();
        }
        let d = l.check_one(&tiny, "spammer", 1).await.unwrap();
        assert_eq!(d.source, Source::DenyCache);
        l
    });
    c.bench_function("deny cache hit", |b| {
        b.to_async(&rt).iter(|| async {
            let d = cached.check_one(&tiny, "spammer", 1).await.unwrap();
            debug_assert_eq!(d.source, Source::DenyCache);
            d
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
