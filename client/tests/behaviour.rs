//! The limiter against real servers: each flavor with the module, and without it (the Lua
//! script takes over by itself). The same assertions hold on every backend.

use redis_ratelimit_client::{Error, KeyLayout, Limiter, Policy, Source, Verdict};
use redis_ratelimit_testkit::*;
use std::time::Duration;

fn limiter(t: &Target) -> Limiter {
    Limiter::builder(t.url.as_str())
        .timeout(Duration::from_millis(500)) // generous: these tests are about semantics
        .key_layout(layout(t))
        .build()
        .unwrap()
}

fn layout(t: &Target) -> KeyLayout {
    KeyLayout::new(t.prefix.trim_end_matches(':'), 0)
}

fn slow(name: &str, burst: u64) -> Policy {
    Policy::builder(name)
        .per_hour(1)
        .burst(burst)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_then_refusal_then_deny_cache() {
    for t in backends("cburst") {
        let l = limiter(&t);
        let p = slow("api", 5);
        for i in 0..5 {
            let d = l.check_one(&p, "alice", 1).await.unwrap();
            assert!(d.is_allowed(), "{}: check {i}", t.name);
            assert_eq!(
                (d.source, d.remaining),
                (Source::Store, 4 - i),
                "{}",
                t.name
            );
        }
        let d = l.check_one(&p, "alice", 1).await.unwrap();
        assert_eq!(d.source, Source::Store, "{}", t.name);
        let retry = d.retry_after().expect("denied");
        assert!(retry > Duration::from_secs(3500), "{}: {retry:?}", t.name);
        assert_eq!(d.policy.name(), "api");
        let d = l.check_one(&p, "alice", 1).await.unwrap();
        assert_eq!(d.source, Source::DenyCache, "{}", t.name);
        assert!(!d.is_allowed());
        // Another subject is untouched.
        assert!(l.check_one(&p, "bob", 1).await.unwrap().is_allowed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_retry_after_admits() {
    for t in backends("cwait") {
        let l = limiter(&t);
        let p = Policy::builder("fast")
            .per_second(20)
            .burst(2)
            .build()
            .unwrap();
        assert!(l.check_one(&p, "s", 2).await.unwrap().is_allowed());
        let d = l.check_one(&p, "s", 1).await.unwrap();
        let retry = d.retry_after().expect("denied");
        assert!(retry <= Duration::from_millis(50), "{}: {retry:?}", t.name);
        tokio::time::sleep(retry).await;
        let d = l.check_one(&p, "s", 1).await.unwrap();
        assert!(
            d.is_allowed(),
            "{}: refused after waiting {retry:?}: {d:?}",
            t.name
        );
        assert_eq!(d.source, Source::Store);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_policies_are_all_or_nothing() {
    for t in backends("cmulti") {
        let l = limiter(&t);
        let (api, route) = (slow("api", 10), slow("upload", 2));
        for _ in 0..2 {
            let d = l.check("k1", &[(&api, 1), (&route, 1)]).await.unwrap();
            assert!(d.is_allowed(), "{}", t.name);
        }
        let d = l.check("k1", &[(&api, 1), (&route, 1)]).await.unwrap();
        assert!(!d.is_allowed(), "{}", t.name);
        assert_eq!(
            d.policy.name(),
            "upload",
            "{}: the refusing policy decides",
            t.name
        );
        assert_eq!(d.outcomes[0].verdict, Verdict::Allowed);
        assert_eq!(
            d.outcomes[0].remaining, 8,
            "{}: nothing taken from api",
            t.name
        );
        // api alone still has its 8 tokens.
        let d = l.check_one(&api, "k1", 8).await.unwrap();
        assert!(d.is_allowed(), "{}: {d:?}", t.name);
    }
}

/// A policy listed twice in one check is refused together (all or nothing), but its wait
/// then counts the first listing's provisional take: it is not cached, so the same cost
/// alone is asked of the store, which still holds the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_listed_twice_leaves_no_cached_refusal() {
    for t in backends("ctwice") {
        let l = limiter(&t);
        let p = slow("api", 4);
        let d = l.check("k1", &[(&p, 3), (&p, 3)]).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::Store, false),
            "{}",
            t.name
        );
        let d = l.check_one(&p, "k1", 3).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::Store, true),
            "{}",
            t.name
        );
    }
}

/// On one server a sharded policy's sub-bucket is checked in the same atomic call as the
/// subject's other buckets: a refusal by the sub-bucket takes nothing from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_policy_is_all_or_nothing_with_the_others_on_one_server() {
    for t in backends("cshard") {
        let l = limiter(&t);
        let api = slow("api", 10);
        // Two sub-buckets of 10, hourly: drained by 10 at a time, nothing refills.
        let hot = Policy::builder("hot")
            .per_hour(20)
            .burst(20)
            .shards(2)
            .build()
            .unwrap();
        let mut drained = 0;
        for _ in 0..40 {
            drained += usize::from(l.check_one(&hot, "k1", 10).await.unwrap().is_allowed());
        }
        assert_eq!(drained, 2, "{}: both sub-buckets drained", t.name);
        let d = l.check("k1", &[(&api, 1), (&hot, 1)]).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::Store, false),
            "{}",
            t.name
        );
        assert_eq!(d.policy.name(), "hot", "{}", t.name);
        let d = l.check_one(&api, "k1", 0).await.unwrap();
        assert_eq!(d.remaining, 10, "{}: api was charged", t.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_cost_and_cost_above_burst() {
    for t in backends("cweight") {
        let l = limiter(&t);
        let p = slow("llm", 5);
        let d = l.check_one(&p, "w", 3).await.unwrap();
        assert_eq!((d.is_allowed(), d.remaining), (true, 2), "{}", t.name);
        let d = l.check_one(&p, "w", 6).await.unwrap();
        assert_eq!(d.verdict, Verdict::ExceedsBurst, "{}", t.name);
        // Past what the module's integers and the script's doubles hold: refused the same.
        for huge in [1 << 53, i64::MAX as u64 + 1, u64::MAX] {
            let d = l.check_one(&p, "w", huge).await.unwrap();
            assert_eq!(d.verdict, Verdict::ExceedsBurst, "{}: {huge}", t.name);
            assert_eq!(d.source, Source::Store, "{}: {huge}", t.name);
        }
        let d = l.check_one(&p, "w", 3).await.unwrap();
        assert!(d.retry_after().is_some(), "{}", t.name);
        let d = l.check_one(&p, "w", 2).await.unwrap();
        assert!(
            d.is_allowed(),
            "{}: a smaller cost is not refused by the cache",
            t.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_replies_are_returned_and_do_not_trip_the_breaker() {
    for t in backends("cerr") {
        let l = Limiter::builder(t.url.as_str())
            .timeout(Duration::from_millis(500))
            .key_layout(layout(&t))
            .breaker_threshold(1)
            .build()
            .unwrap();
        let p = slow("api", 5);
        let key = layout(&t).key(&layout(&t).subject_tag(b"mallory"), "api");
        let mut c = t.conn();
        let _: i64 = redis::cmd("RPUSH")
            .arg(&key)
            .arg("x")
            .query(&mut c)
            .unwrap();
        for _ in 0..3 {
            let e = l.check_one(&p, "mallory", 1).await.unwrap_err();
            assert!(matches!(e, Error::Server(_)), "{}: {e}", t.name);
            assert!(e.to_string().contains("WRONGTYPE"), "{}: {e}", t.name);
        }
        assert!(!l.breaker_open(), "{}", t.name);
        let _: i64 = redis::cmd("DEL").arg(&key).query(&mut c).unwrap();
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("hello")
            .arg("PX")
            .arg(60_000)
            .query(&mut c)
            .unwrap();
        let e = l.check_one(&p, "mallory", 1).await.unwrap_err();
        assert!(
            e.to_string().contains("not a rate-limit bucket"),
            "{}: {e}",
            t.name
        );
    }
}

/// Module and script on the same keys: a deployment can run both side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_and_script_share_buckets() {
    for t in targets("cshare") {
        let build = |script: bool| {
            Limiter::builder(t.url.as_str())
                .timeout(Duration::from_millis(500))
                .key_layout(layout(&t))
                .deny_cache_capacity(0)
                .force_script(script)
                .build()
                .unwrap()
        };
        let (module, script) = (build(false), build(true));
        let p = slow("api", 5);
        let mut seen = Vec::new();
        for i in 0..7 {
            let l = if i % 2 == 0 { &module } else { &script };
            let d = l.check_one(&p, "shared", 1).await.unwrap();
            seen.push((d.is_allowed(), d.remaining));
        }
        let want = [
            (true, 4),
            (true, 3),
            (true, 2),
            (true, 1),
            (true, 0),
            (false, 0),
            (false, 0),
        ];
        assert_eq!(seen, want, "{}", t.name);
        let mut c = t.conn();
        assert!(command_calls(&mut c, "evalsha") + command_calls(&mut c, "eval") > 0);
        // One limit: the module is asked with `RL.CHECK`.
        assert!(command_calls(&mut c, "rl.check") > 0);
    }
}

/// The same sequence of requests, on a server with the module and on one without: the
/// same decisions, field by field (times within the few ms the run takes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_and_module_give_the_same_decisions() {
    for flavor in Flavor::selected() {
        let with = Server::start(flavor);
        let without = Server::start_with(flavor, false, &[]);
        let build = |url: String| {
            Limiter::builder(url)
                .timeout(Duration::from_millis(500))
                .deny_cache_capacity(0)
                .build()
                .unwrap()
        };
        let (a, b) = (build(with.url()), build(without.url()));
        let p1 = Policy::builder("p1")
            .per_minute(7)
            .burst(4)
            .build()
            .unwrap();
        let p2 = Policy::builder("p2")
            .per(3, Duration::from_secs(10))
            .burst(6)
            .build()
            .unwrap();
        let script: [(&str, u64, u64); 12] = [
            ("x", 1, 1),
            ("x", 2, 0),
            ("x", 1, 3),
            ("x", 1, 1),
            ("x", 0, 0),
            ("x", 5, 1),
            ("y", 4, 6),
            ("y", 0, 1),
            ("x", 1, 1),
            ("y", 1, 0),
            ("x", 0, 7),
            ("y", 0, 0),
        ];
        for (i, (subject, c1, c2)) in script.iter().enumerate() {
            let req = [(&p1, *c1), (&p2, *c2)];
            let (da, db) = (
                a.check(subject, &req).await.unwrap(),
                b.check(subject, &req).await.unwrap(),
            );
            assert_eq!(
                (da.source, db.source, da.outcomes.len(), db.outcomes.len()),
                (Source::Store, Source::Store, 2, 2),
                "{flavor:?} step {i}"
            );
            for (oa, ob) in da.outcomes.iter().zip(&db.outcomes) {
                let same_kind =
                    std::mem::discriminant(&oa.verdict) == std::mem::discriminant(&ob.verdict);
                assert!(same_kind, "{flavor:?} step {i}: {oa:?} vs {ob:?}");
                assert_eq!(oa.remaining, ob.remaining, "{flavor:?} step {i}");
                let near = |x: Duration, y: Duration| x.abs_diff(y) <= Duration::from_millis(50);
                assert!(
                    near(oa.reset_after, ob.reset_after),
                    "{flavor:?} step {i}: {oa:?} vs {ob:?}"
                );
                if let (Verdict::Denied { retry_after: x }, Verdict::Denied { retry_after: y }) =
                    (oa.verdict, ob.verdict)
                {
                    assert!(near(x, y), "{flavor:?} step {i}: {x:?} vs {y:?}");
                }
            }
        }
        // Same stored state too: the same keys, expiring at the same time.
        let (mut ca, mut cb) = (with.conn(), without.conn());
        let mut ka: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut ca).unwrap();
        let mut kb: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut cb).unwrap();
        ka.sort();
        kb.sort();
        assert_eq!(ka, kb, "{flavor:?}");
        for k in &ka {
            let (ea, eb) = (pexpiretime(&mut ca, k), pexpiretime(&mut cb, k));
            assert!((ea - eb).abs() <= 50, "{flavor:?}: {k} {ea} vs {eb}");
        }
    }
}

/// Bad arguments get the same answer from the script as from the module, message for message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_validates_arguments_like_the_module() {
    let cases: &[[&str; 3]] = &[
        ["abc", "1", "1"],
        ["", "1", "1"],
        ["0x10", "1", "1"],
        ["infx", "1", "1"],
        ["nan", "1", "-1"],
        ["inf", "1", "1"],
        ["-inf", "0", "1"],
        ["0", "1", "1"],
        ["-2", "1", "1"],
        ["1e300", "1", "1"],
        ["1e-12", "1", "1"],
        ["1", "0", "1"],
        ["1", "1.5", "1"],
        ["1", "abc", "1"],
        ["1", "99999999999999999999999", "1"],
        ["1", "9223372036854775808", "1"],
        ["1", "999999999999", "1"],
        ["1", "5", "-1"],
        ["1", "5", "x"],
        ["1", "5", "9223372036854775807"],
        ["1", "00000000000000000000005", "+2"],
        ["+1.5", "5", "-0"],
    ];
    // The cases both accept: a cost past the burst (answered -1), and signed or padded
    // numbers that still parse.
    let accepted = [19, 20, 21];
    for t in targets("cvalid") {
        let mut c = t.conn();
        let mut ok = Vec::new();
        for (i, [rate, burst, cost]) in cases.iter().enumerate() {
            let key = t.key(&format!("v{i}"));
            let module: redis::RedisResult<redis::Value> = redis::cmd("RL.CHECKALL")
                .arg(&key)
                .arg(*rate)
                .arg(*burst)
                .arg(*cost)
                .query(&mut c);
            let script: redis::RedisResult<redis::Value> = redis::cmd("EVAL")
                .arg(redis_ratelimit_client::CHECKALL_SCRIPT)
                .arg(1)
                .arg(t.key(&format!("s{i}")))
                .arg(*rate)
                .arg(*burst)
                .arg(*cost)
                .query(&mut c);
            match (&module, &script) {
                (Err(m), Err(s)) => {
                    assert_eq!(
                        m.detail(),
                        s.detail(),
                        "{} case {i} {rate} {burst} {cost}",
                        t.name
                    )
                }
                (Ok(m), Ok(s)) => {
                    // Allowed, remaining and retry exactly; the reset within the ms between.
                    let fields = |v: &redis::Value| -> Vec<i64> {
                        redis::from_redis_value::<Vec<Vec<i64>>>(v.clone())
                            .unwrap()
                            .concat()
                    };
                    let (m, s) = (fields(m), fields(s));
                    assert_eq!(m.len(), 4, "{} case {i}: {m:?}", t.name);
                    assert_eq!(m[..3], s[..3], "{} case {i}", t.name);
                    assert!(
                        (m[3] - s[3]).abs() <= 50,
                        "{} case {i}: {m:?} {s:?}",
                        t.name
                    );
                    ok.push(i);
                }
                _ => panic!(
                    "{} case {i} {rate} {burst} {cost}: {module:?} vs {script:?}",
                    t.name
                ),
            }
        }
        assert_eq!(ok, accepted, "{}", t.name);
    }
}
