//! Reserve an estimate, settle the real cost: on every backend (module and Lua script, Redis
//! and Valkey), with the same assertions, and during an outage.

use redis_ratelimit_client::{KeyLayout, Limiter, LimiterBuilder, Policy, Source};
use redis_ratelimit_testkit::*;
use std::time::Duration;

fn limiter(t: &Target) -> Limiter {
    Limiter::builder(t.url.as_str())
        .timeout(Duration::from_millis(500)) // generous: these tests are about semantics
        .key_layout(KeyLayout::new(t.prefix.trim_end_matches(':'), 0))
        .build()
        .unwrap()
}

/// 10 000 tokens per minute, burst 10 000: one token every 6 ms.
fn llm() -> Policy {
    Policy::builder("llm")
        .per_minute(10_000)
        .burst(10_000)
        .build()
        .unwrap()
}

/// The example: three requests estimating 1000 that used 4000 each leave the bucket
/// 2000 in debt, so a fourth estimating 1000 waits for 3000 tokens: 18 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_estimates_go_into_debt_and_the_next_request_waits_it_out() {
    for t in backends("llmdebt") {
        let l = limiter(&t);
        let p = llm();
        for i in 0..3 {
            let r = l.reserve("key-1", &[(&p, 1_000)]).await.unwrap();
            assert!(r.is_allowed(), "{}: request {i}", t.name);
            let after = r.settle(4_000).await.unwrap();
            assert_eq!(after.source, Source::Store, "{}", t.name);
            let want = 10_000u64.saturating_sub(4_000 * (i + 1));
            // A token refills every 6 ms while the test runs.
            assert!(
                after.remaining.abs_diff(want) <= 50,
                "{}: {} vs {want}",
                t.name,
                after.remaining
            );
        }
        let r = l.reserve("key-1", &[(&p, 1_000)]).await.unwrap();
        assert!(!r.is_allowed(), "{}: in debt", t.name);
        let retry = r.decision().retry_after().expect("can pass later");
        assert!(
            (Duration::from_secs(17)..=Duration::from_secs(18)).contains(&retry),
            "{}: {retry:?}",
            t.name
        );
        // Settling a refused reservation does nothing.
        let d = r.settle(5_000).await.unwrap();
        assert!(!d.is_allowed());
        let peek = l.check_one(&p, "key-1", 0).await.unwrap();
        assert_eq!(peek.remaining, 0, "{}", t.name);
        let still = l.check_one(&p, "key-1", 1_000).await.unwrap();
        assert!(
            !still.is_allowed(),
            "{}: the refusal took the debt away",
            t.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_estimates_are_refunded_and_dropped_reservations_refund_everything() {
    for t in backends("llmrefund") {
        let l = limiter(&t);
        let p = llm();
        let r = l.reserve("key-2", &[(&p, 5_000)]).await.unwrap();
        assert!(r.is_allowed());
        assert!(r.decision().remaining.abs_diff(5_000) <= 50, "{}", t.name);
        let after = r.settle(1_000).await.unwrap();
        assert!(
            after.remaining.abs_diff(9_000) <= 50,
            "{}: {}",
            t.name,
            after.remaining
        );

        let r = l.reserve("key-3", &[(&p, 6_000)]).await.unwrap();
        assert!(r.is_allowed());
        drop(r); // the request failed: everything comes back
        assert!(
            eventually_async(|| async {
                l.check_one(&p, "key-3", 0).await.unwrap().remaining >= 9_998
            })
            .await,
            "{}: dropped reservation not refunded",
            t.name
        );
        // A refund never fills past full.
        let r = l.reserve("key-4", &[(&p, 10)]).await.unwrap();
        let after = r.settle(0).await.unwrap();
        assert_eq!(after.remaining, 10_000, "{}", t.name);
    }
}

async fn eventually_async<F, Fut>(mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// An actual cost past the deepest debt a bucket can hold (about 6.3 years of refill) is
/// charged up to that debt, the same on every backend, not refused with nothing charged
/// (a response's usage header is not the caller's to bound). The request's other policies
/// settle as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_past_the_deepest_debt_is_capped_not_dropped() {
    for t in backends("llmcap") {
        let l = limiter(&t);
        let hourly = Policy::builder("hourly")
            .per_hour(1_000)
            .burst(1_000)
            .build()
            .unwrap();
        let minute = Policy::builder("minute")
            .per_minute(100)
            .burst(100)
            .build()
            .unwrap();
        let r = l
            .reserve("key-cap", &[(&hourly, 1), (&minute, 50)])
            .await
            .unwrap();
        assert!(r.is_allowed(), "{}", t.name);
        let d = r.settle_each(&[u64::MAX, 0]).await.unwrap();
        assert_eq!(d.source, Source::Store, "{}", t.name);
        let wait = l
            .check_one(&hourly, "key-cap", 1)
            .await
            .unwrap()
            .retry_after()
            .expect("in debt");
        assert!(
            wait > Duration::from_secs(5 * 365 * 86_400),
            "{}: {wait:?}",
            t.name
        );
        // The other policy's estimate was refunded.
        let m = l.check_one(&minute, "key-cap", 0).await.unwrap();
        assert!(m.remaining >= 99, "{}: {m:?}", t.name);
    }
}

/// Module and script settle the same way, field for field, on the same sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_and_module_settle_alike() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let mut c = s.conn();
        let steps: &[(&str, &str, &str)] = &[
            ("0.0002777777777777778", "5", "3"),
            ("0.0002777777777777778", "5", "7"),
            ("0.0002777777777777778", "5", "0"),
            ("0.0002777777777777778", "5", "-4"),
            ("0.0002777777777777778", "2", "1"),
            ("0.0002777777777777778", "5", "-100"),
            ("0.0002777777777777778", "5", "-1"),
            ("1", "5", "9223372036854775807"),
            ("1", "5", "x"),
            ("1", "0", "1"),
            ("0.001", "5", "200001"),
            ("0.001", "5", "199990"),
        ];
        for (i, (rate, burst, delta)) in steps.iter().enumerate() {
            let module: redis::RedisResult<Vec<i64>> = redis::cmd("RL.SETTLE")
                .arg("m")
                .arg(*rate)
                .arg(*burst)
                .arg(*delta)
                .query(&mut c);
            let script: redis::RedisResult<Vec<Vec<i64>>> = redis::cmd("EVAL")
                .arg(redis_ratelimit_client::CHECKALL_SCRIPT)
                .arg(1)
                .arg("s")
                .arg(*rate)
                .arg(*burst)
                .arg(*delta)
                .arg("settle")
                .query(&mut c);
            match (&module, &script) {
                (Ok(m), Ok(s)) => {
                    let s = &s[0];
                    assert_eq!(
                        (m[0], m[1], m[2]),
                        (s[0], s[1], s[2]),
                        "{flavor:?} step {i}"
                    );
                    assert!(
                        (m[3] - s[3]).abs() <= 20,
                        "{flavor:?} step {i}: {m:?} vs {s:?}"
                    );
                }
                (Err(m), Err(s)) => assert_eq!(m.detail(), s.detail(), "{flavor:?} step {i}"),
                _ => panic!("{flavor:?} step {i}: {module:?} vs {script:?}"),
            }
            let (em, es) = (pexpiretime(&mut c, "m"), pexpiretime(&mut c, "s"));
            assert!(
                (em - es).abs() <= 20,
                "{flavor:?} step {i}: expiry {em} vs {es}"
            );
            let vm: Option<String> = redis::cmd("GET").arg("m").query(&mut c).unwrap();
            let vs: Option<String> = redis::cmd("GET").arg("s").query(&mut c).unwrap();
            assert_eq!(
                vm.map(|v| v.len() > 4 && v.starts_with('4')),
                vs.map(|v| v.len() > 4 && v.starts_with('4')),
                "{flavor:?} step {i}: same linger class"
            );
        }
    }
}

/// A pod of the outage tests, on `s`, answering from its fail mode after `timeout_ms`.
fn pod(s: &Server, timeout_ms: u64) -> LimiterBuilder {
    Limiter::builder(s.url()).timeout(Duration::from_millis(timeout_ms))
}

/// 100 per hour, burst 100: a local bucket of 100 on one pod, nothing refilled in a test.
fn hourly() -> Policy {
    Policy::builder("llm")
        .per_hour(100)
        .burst(100)
        .build()
        .unwrap()
}

/// With the server gone, a fail-open policy settles against its local bucket: the debt
/// holds there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_during_an_outage_charges_the_local_bucket() {
    let mut s = Server::start(Flavor::Redis.or_selected());
    let l = pod(&s, 50).build().unwrap();
    let p = hourly();
    assert!(l.ready(Duration::from_secs(5)).await);
    let r = l.reserve("key-5", &[(&p, 10)]).await.unwrap();
    assert_eq!(r.decision().source, Source::Store);
    s.kill();
    let after = r.settle(300).await.unwrap();
    assert_eq!(after.source, Source::LocalFallback);
    assert_eq!(
        after.remaining, 0,
        "300 tokens against a local bucket of 100: in debt"
    );
    let d = l.check_one(&p, "key-5", 1).await.unwrap();
    assert_eq!(d.source, Source::LocalFallback);
    // 290 charged past a full bucket of 100: 190 owed at 100 an hour, not merely empty
    // (an empty bucket would refuse for 36 s).
    let wait = d.retry_after().expect("refused until the debt is repaid");
    assert!(wait > Duration::from_secs(3_600), "{wait:?}");
}

/// A reservation the local fallback admitted is settled on that local bucket even once the
/// store is back: the store never took its estimate, so refunding it there would let the
/// other pods take more than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_admitted_locally_is_settled_locally_after_the_store_is_back() {
    let mut s = Server::start(Flavor::Redis.or_selected());
    let (a, b) = (pod(&s, 50).build().unwrap(), pod(&s, 500).build().unwrap());
    let p = hourly();
    assert!(a.ready(Duration::from_secs(5)).await);
    s.kill();
    let r = a.reserve("key-6", &[(&p, 10)]).await.unwrap();
    assert!(r.is_allowed());
    assert_eq!(r.decision().source, Source::LocalFallback);

    s.restart();
    // Until pod a's breaker lets it reach the store again (its first probe is 50 ms away).
    let back = tokio::time::timeout(Duration::from_secs(10), async {
        while a.check_one(&p, "key-other", 0).await.unwrap().source != Source::Store {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(back.is_ok(), "pod a never reached the restarted store");
    // Pod b takes the whole limit from the store.
    let d = b.check_one(&p, "key-6", 100).await.unwrap();
    assert_eq!(d.source, Source::Store);
    assert!(d.is_allowed());

    let after = r.settle(0).await.unwrap();
    assert_eq!(
        after.source,
        Source::LocalFallback,
        "settled where it was taken"
    );
    let d = b.check_one(&p, "key-6", 1).await.unwrap();
    assert_eq!(d.source, Source::Store);
    assert!(
        !d.is_allowed(),
        "the store refunded 10 tokens it never took: {} remaining",
        d.remaining
    );
}

/// With the local fallback off, a fail-open reservation takes nothing while the store is down,
/// so its settlement is dropped and reported as fail-open (not fail-closed: nothing refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_local_fallback_an_outage_settlement_is_dropped_as_fail_open() {
    let mut s = Server::start(Flavor::Redis.or_selected());
    let l = pod(&s, 50).without_local_fallback().build().unwrap();
    let p = llm();
    assert!(l.ready(Duration::from_secs(5)).await);
    s.kill();
    let r = l.reserve("key-7", &[(&p, 10)]).await.unwrap();
    assert!(r.is_allowed());
    assert_eq!(r.decision().source, Source::FailOpen);
    let after = r.settle(300).await.unwrap();
    assert_eq!(after.source, Source::FailOpen);
    assert!(after.is_allowed());
}

/// A refund puts the tokens back at once: the deny cache forgets the bucket's refusal
/// instead of refusing until the refusal's retry-after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_clears_the_buckets_cached_refusal() {
    for t in backends("llmdeny") {
        let l = limiter(&t);
        let p = llm();
        let r = l.reserve("key-8", &[(&p, 10_000)]).await.unwrap();
        assert!(r.is_allowed(), "{}", t.name);
        let d = l.check_one(&p, "key-8", 1_000).await.unwrap();
        assert_eq!(
            (d.is_allowed(), d.source),
            (false, Source::Store),
            "{}",
            t.name
        );
        let d = l.check_one(&p, "key-8", 1_000).await.unwrap();
        assert_eq!(d.source, Source::DenyCache, "{}: refusal cached", t.name);
        r.settle(0).await.unwrap();
        let d = l.check_one(&p, "key-8", 1_000).await.unwrap();
        assert_eq!(
            (d.is_allowed(), d.source),
            (true, Source::Store),
            "{}",
            t.name
        );
    }
}
