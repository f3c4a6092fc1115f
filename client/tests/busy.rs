//! A server answering `BUSY` (a runaway script) is an outage, not a free pass: checks are
//! answered by the fail modes (the local bucket keeps limiting), the breaker counts it, and
//! the store answers again once the script is killed.

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_replies_fall_back_to_the_local_bucket_and_recover() {
    if std::env::var("REDIS_URL").is_ok() {
        return; // hangs the server on purpose: only servers started here
    }
    for flavor in Flavor::ALL {
        let s = Server::start_with(flavor, true, &["--busy-reply-threshold", "10"]);
        let l = Limiter::builder(s.url())
            .timeout(Duration::from_millis(100))
            .breaker_threshold(3)
            .probe_interval(Duration::from_millis(200))
            .build()
            .unwrap();
        let api = Policy::builder("api").per_hour(5).burst(5).build().unwrap();
        let login = Policy::builder("login")
            .per_hour(5)
            .burst(5)
            .fail_closed()
            .build()
            .unwrap();
        assert_eq!(
            l.check_one(&api, "warm", 1).await.unwrap().source,
            Source::Store
        );

        // A runaway script holds the server.
        let url = s.url();
        let script = std::thread::spawn(move || {
            let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
            let _: redis::RedisResult<redis::Value> = redis::cmd("EVAL")
                .arg("while true do end")
                .arg(0)
                .query(&mut c);
        });
        // Prove the fault before judging the client: the server really answers BUSY.
        let mut c = s.conn();
        assert!(
            eventually(Duration::from_secs(5), || {
                let r: redis::RedisResult<Option<String>> =
                    redis::cmd("GET").arg("x").query(&mut c);
                matches!(r, Err(e) if e.code() == Some("BUSY"))
            }),
            "{flavor:?}: the server never answered BUSY"
        );

        let started = Instant::now();
        let mut allowed = 0;
        for i in 0..10 {
            let d = l.check_one(&api, "alice", 1).await.unwrap_or_else(|e| {
                panic!("{flavor:?}: check {i} returned an error instead of a fail mode: {e}")
            });
            assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: check {i}");
            allowed += usize::from(d.is_allowed());
        }
        assert_eq!(
            allowed, 5,
            "{flavor:?}: the local bucket must keep limiting"
        );
        let d = l.check_one(&login, "alice", 1).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::FailClosed, false),
            "{flavor:?}"
        );
        assert!(
            d.retry_after().is_some(),
            "{flavor:?}: 503 needs a Retry-After"
        );
        assert!(
            l.breaker_open(),
            "{flavor:?}: BUSY must count for the breaker"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{flavor:?}: {:?}",
            started.elapsed()
        );

        // Kill the script: the store answers again within a probe interval or two.
        let _: () = redis::cmd("SCRIPT").arg("KILL").query(&mut c).unwrap();
        script.join().unwrap();
        let back = Instant::now();
        loop {
            let d = l.check_one(&api, "bob", 1).await.unwrap();
            if d.source == Source::Store {
                break;
            }
            assert!(
                back.elapsed() < Duration::from_secs(3),
                "{flavor:?}: no recovery"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
