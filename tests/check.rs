//! `RL.CHECK` and `RL.CHECKALL` behaviour against real servers (Redis 7.0 and Valkey 8, or
//! `REDIS_URL`).

use redis::Connection;
use redis_ratelimit_testkit::*;
use std::time::Duration;

/// 100 per minute.
const PER_MINUTE_100: &str = "1.6666666666666667";
/// One per hour: nothing refills while a test runs.
const PER_HOUR_1: &str = "0.0002777777777777778";

fn dump(c: &mut Connection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("DUMP").arg(key).query(c).expect("DUMP")
}

fn checkall(c: &mut Connection, args: &[&str]) -> Vec<Reply> {
    let mut cmd = redis::cmd("RL.CHECKALL");
    for a in args {
        cmd.arg(*a);
    }
    cmd.query(c)
        .unwrap_or_else(|e| panic!("RL.CHECKALL {args:?}: {e}"))
}

#[test]
fn reply_fields_on_a_fresh_key() {
    for t in targets("fields") {
        let mut c = t.conn();
        let k = t.key("a");
        let before = server_ms(&mut c);
        let (allowed, remaining, retry, reset) = rl_check(&mut c, &k, PER_MINUTE_100, 20, 1);
        let after = server_ms(&mut c);
        assert_eq!((allowed, remaining, retry), (1, 19, 0), "{}", t.name);
        // One token is back after 600 ms (the sub-ms phase of the server clock may add one).
        assert!((600..=601).contains(&reset), "{}: reset {reset}", t.name);
        // Refill time 12 s: the key lingers 15 s past full (class 3), value 3xxxx.
        let expire_at = pexpiretime(&mut c, &k);
        assert!(
            expire_at - after <= reset + 15_000 && reset + 15_000 <= expire_at - before,
            "{}: reset {reset} + 15 s vs PEXPIRETIME {expire_at} in [{before}, {after}]",
            t.name
        );
        let value: String = redis::cmd("GET").arg(&k).query(&mut c).unwrap();
        let value: u32 = value.parse().expect("value is an integer");
        assert_eq!(value / 10_000, 3, "{}: value {value}", t.name);
    }
}

#[test]
fn burst_from_fresh_key_admits_exactly_burst_then_denies() {
    for t in targets("burst") {
        let mut c = t.conn();
        let k = t.key("b");
        let replies: Vec<Reply> = (0..25)
            .map(|_| rl_check(&mut c, &k, PER_HOUR_1, 20, 1))
            .collect();
        let allowed = replies.iter().filter(|r| r.0 == 1).count();
        assert_eq!(allowed, 20, "{}", t.name);
        assert!(replies[..20].iter().all(|r| r.0 == 1), "{}", t.name);
        for (i, r) in replies[..20].iter().enumerate() {
            assert_eq!(
                r.1,
                19 - i as i64,
                "{}: remaining after {} takes",
                t.name,
                i + 1
            );
        }
        let (allowed, remaining, retry, reset) = replies[24];
        assert_eq!((allowed, remaining), (0, 0), "{}", t.name);
        // One token per hour: the wait is an hour, minus what elapsed since the first take.
        assert!(
            (3_599_000..=3_600_000).contains(&retry),
            "{}: retry {retry}",
            t.name
        );
        assert!(reset >= 20 * 3_599_000, "{}: reset {reset}", t.name);
        assert!(reset <= 20 * 3_600_000 + 1, "{}: reset {reset}", t.name);
    }
}

#[test]
fn waiting_retry_after_is_enough() {
    for t in targets("refill") {
        let mut c = t.conn();
        let k = t.key("r");
        // 20 tokens/s (50 ms each), burst 2.
        assert_eq!(rl_check(&mut c, &k, "20", 2, 2).0, 1);
        let (allowed, _, retry, _) = rl_check(&mut c, &k, "20", 2, 1);
        assert_eq!(allowed, 0, "{}", t.name);
        assert!((1..=50).contains(&retry), "{}: retry {retry}", t.name);
        std::thread::sleep(Duration::from_millis(retry as u64));
        let (allowed, remaining, _, _) = rl_check(&mut c, &k, "20", 2, 1);
        assert_eq!(
            (allowed, remaining),
            (1, 0),
            "{}: after waiting {retry} ms",
            t.name
        );
        // A full refill: the bucket is full again (the key lingers 1 s more).
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(rl_check(&mut c, &k, "20", 2, 0), (1, 2, 0, 0), "{}", t.name);
    }
}

#[test]
fn weighted_costs_and_never_passing_cost() {
    for t in targets("weighted") {
        let mut c = t.conn();
        let k = t.key("w");
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 10, 4).0, 1);
        let r = rl_check(&mut c, &k, PER_HOUR_1, 10, 7);
        assert_eq!((r.0, r.1), (0, 6), "{}: 7 of 6 left", t.name);
        assert!(r.2 > 0, "{}", t.name);
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 10, 6).0, 1, "{}", t.name);
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 10, 0).1, 0, "{}", t.name);

        let never = t.key("never");
        assert_eq!(
            rl_check(&mut c, &never, "10", 5, 6),
            (0, 5, -1, 0),
            "{}",
            t.name
        );
        assert!(!exists(&mut c, &never), "{}: a refused check wrote", t.name);
    }
}

#[test]
fn peek_never_writes() {
    for t in targets("peek") {
        let mut c = t.conn();
        let k = t.key("p");
        assert_eq!(rl_check(&mut c, &k, "10", 5, 0), (1, 5, 0, 0), "{}", t.name);
        assert!(!exists(&mut c, &k), "{}: peek created the key", t.name);
        rl_check(&mut c, &k, PER_HOUR_1, 5, 3);
        let before = (dump(&mut c, &k), pexpiretime(&mut c, &k));
        let (allowed, remaining, retry, _) = rl_check(&mut c, &k, PER_HOUR_1, 5, 0);
        assert_eq!((allowed, remaining, retry), (1, 2, 0), "{}", t.name);
        let denied = rl_check(&mut c, &k, PER_HOUR_1, 5, 3);
        assert_eq!(denied.0, 0, "{}", t.name);
        let after = (dump(&mut c, &k), pexpiretime(&mut c, &k));
        assert_eq!(before, after, "{}: peek or refusal changed the key", t.name);
    }
}

/// Runs `during` on a second connection between `WATCH key` and `MULTI`/`EXEC` on the first;
/// whether the transaction still ran (a changed key aborts it).
fn transaction_survives(t: &Target, key: &str, during: impl FnOnce(&mut Connection)) -> bool {
    let (mut watcher, mut other) = (t.conn(), t.conn());
    let _: () = redis::cmd("WATCH").arg(key).query(&mut watcher).unwrap();
    during(&mut other);
    let _: () = redis::cmd("MULTI").query(&mut watcher).unwrap();
    let _: () = redis::cmd("PING").query(&mut watcher).unwrap();
    match redis::cmd("EXEC").query(&mut watcher).unwrap() {
        redis::Value::Nil => false,
        redis::Value::Array(replies) => {
            assert_eq!(replies, [redis::Value::SimpleString("PONG".into())]);
            true
        }
        other => panic!("{}: EXEC answered {other:?}", t.name),
    }
}

/// A check that takes tokens changes the key for `WATCH` (and client-side caching, which is
/// told the same way); a refusal and a peek, which write nothing, do not.
#[test]
fn only_a_write_touches_a_watched_key() {
    for t in targets("watch") {
        let k = t.key("w");
        assert!(
            !transaction_survives(&t, &k, |c| {
                assert_eq!(rl_check(c, &k, PER_HOUR_1, 2, 2).0, 1);
            }),
            "{}: taking tokens left WATCH alone",
            t.name
        );
        assert!(
            transaction_survives(&t, &k, |c| {
                assert_eq!(rl_check(c, &k, PER_HOUR_1, 2, 1).0, 0);
                assert_eq!(rl_check(c, &k, PER_HOUR_1, 2, 0).1, 0);
            }),
            "{}: a refusal or a peek aborted a transaction watching the key",
            t.name
        );
        // A settle writes; RL.CHECKALL writes only where it took tokens.
        assert!(
            !transaction_survives(&t, &k, |c| {
                let _: Reply = redis::cmd("RL.SETTLE")
                    .arg(&k)
                    .arg(PER_HOUR_1)
                    .arg(2)
                    .arg(-1)
                    .query(c)
                    .unwrap();
            }),
            "{}: a settle left WATCH alone",
            t.name
        );
        let other = t.key("w2");
        assert!(
            transaction_survives(&t, &k, |c| {
                let refused =
                    checkall(c, &[&other, PER_HOUR_1, "2", "1", &k, PER_HOUR_1, "2", "2"]);
                assert_eq!(refused[1].0, 0);
            }),
            "{}: an RL.CHECKALL refused everywhere touched the key",
            t.name
        );
        assert!(
            !transaction_survives(&t, &k, |c| {
                assert_eq!(
                    checkall(c, &[&other, PER_HOUR_1, "2", "1", &k, PER_HOUR_1, "2", "1"])[1].0,
                    1
                );
            }),
            "{}: an RL.CHECKALL that took tokens left WATCH alone",
            t.name
        );
    }
}

/// The key outlives its full bucket by its class's linger: never less, and gone by then.
#[test]
fn key_expires_one_linger_after_the_bucket_is_full() {
    for t in targets("expiry") {
        let mut c = t.conn();
        let k = t.key("e");
        // 100 tokens/s, burst 5: taking 5 leaves a 50 ms deficit; refill 50 ms → linger 1 s.
        let before = server_ms(&mut c);
        let r = rl_check(&mut c, &k, "100", 5, 5);
        let after = server_ms(&mut c);
        assert_eq!((r.0, r.1), (1, 0), "{}", t.name);
        // The check's clock lies in [before, after + 1 ms): full 50 ms later, rounded up to
        // the ms, then 1 s of linger.
        let expire_at = pexpiretime(&mut c, &k);
        assert!(
            (before + 1_050..=after + 1_051).contains(&expire_at),
            "{}: expiry {expire_at}, check within [{before}, {after}]",
            t.name
        );
        // The stored TAT ((expiry − linger) × 10^4 − sub-ms ticks) is exactly 5 × 10 ms
        // after the check's own clock reading, which lies between `before` and now.
        let value: i64 = redis::cmd("GET").arg(&k).query(&mut c).unwrap();
        assert_eq!(value / 10_000, 1, "{}: class 1", t.name);
        let tat_ticks = (expire_at - 1_000) * 10_000 - value % 10_000;
        assert!(tat_ticks > (before + 50) * 10_000 - 10_000, "{}", t.name);
        // Full once the TAT has passed, while the key still lingers.
        assert!(eventually(Duration::from_secs(2), || server_ms(&mut c)
            > expire_at - 1_000));
        assert_eq!(rl_check(&mut c, &k, "100", 5, 0).1, 5, "{}", t.name);
        assert!(
            exists(&mut c, &k) || server_ms(&mut c) >= expire_at,
            "{}",
            t.name
        );
        // Gone once the linger has passed on the server's clock.
        assert!(eventually(Duration::from_secs(3), || !exists(&mut c, &k)));
        assert!(server_ms(&mut c) >= expire_at, "{}: expired early", t.name);
    }
}

/// Buckets written before the linger classes (value 0..9999, expiring exactly when full)
/// read exactly, and the next write moves them to the new format.
#[test]
fn first_format_keys_read_exactly() {
    for t in targets("oldformat") {
        let mut c = t.conn();
        let k = t.key("o");
        // One token per hour, burst 3; TAT 1 h − 0.5001 ms ahead of `now`.
        let now = server_ms(&mut c);
        let _: () = redis::cmd("SET")
            .arg(&k)
            .arg(5001)
            .arg("PXAT")
            .arg(now + 3_600_000)
            .query(&mut c)
            .unwrap();
        let (allowed, remaining, _, reset) = rl_check(&mut c, &k, PER_HOUR_1, 3, 0);
        assert_eq!((allowed, remaining), (1, 2), "{}", t.name);
        assert!(
            (3_599_000..=3_600_000).contains(&reset),
            "{}: reset {reset}",
            t.name
        );
        let r = rl_check(&mut c, &k, PER_HOUR_1, 3, 1);
        assert_eq!((r.0, r.1), (1, 1), "{}", t.name);
        // Rewritten with 60 s of linger: TAT one more hour ahead, to the tick.
        let value: i64 = redis::cmd("GET").arg(&k).query(&mut c).unwrap();
        assert_eq!(value, 45_001, "{}: class 4, same sub-ms phase", t.name);
        assert_eq!(
            pexpiretime(&mut c, &k),
            now + 2 * 3_600_000 + 60_000,
            "{}",
            t.name
        );
    }
}

#[test]
fn checkall_is_all_or_nothing() {
    for t in targets("all") {
        let mut c = t.conn();
        let (a, b) = (t.key("{u1}:key"), t.key("{u1}:route"));
        let r = checkall(
            &mut c,
            &[&a, PER_HOUR_1, "10", "1", &b, PER_HOUR_1, "3", "2"],
        );
        assert_eq!(r, vec![(1, 9, 0, r[0].3), (1, 1, 0, r[1].3)], "{}", t.name);
        // Full again after the hour (a) and two hours (b) their takes refill in.
        assert!(
            (3_599_999..=3_600_001).contains(&r[0].3),
            "{}: {r:?}",
            t.name
        );
        assert!(
            (7_199_999..=7_200_001).contains(&r[1].3),
            "{}: {r:?}",
            t.name
        );
        let before = (dump(&mut c, &a), dump(&mut c, &b), pexpiretime(&mut c, &a));
        // `b` has one token left: nothing may be taken from `a` either.
        let r = checkall(
            &mut c,
            &[&a, PER_HOUR_1, "10", "1", &b, PER_HOUR_1, "3", "2"],
        );
        assert_eq!(
            (r[0].0, r[0].1, r[0].2),
            (1, 9, 0),
            "{}: a had room",
            t.name
        );
        assert_eq!((r[1].0, r[1].1), (0, 1), "{}: b had not", t.name);
        assert!(r[1].2 > 0, "{}", t.name);
        let after = (dump(&mut c, &a), dump(&mut c, &b), pexpiretime(&mut c, &a));
        assert_eq!(before, after, "{}: a refused RL.CHECKALL wrote", t.name);
        // Cost above burst anywhere: -1, nothing taken.
        let r = checkall(
            &mut c,
            &[&a, PER_HOUR_1, "10", "1", &b, PER_HOUR_1, "3", "4"],
        );
        assert_eq!(r[1].2, -1, "{}", t.name);
        // Both fit: both taken.
        let r = checkall(
            &mut c,
            &[&a, PER_HOUR_1, "10", "2", &b, PER_HOUR_1, "3", "1"],
        );
        assert_eq!((r[0].0, r[0].1, r[1].0, r[1].1), (1, 7, 1, 0), "{}", t.name);
    }
}

#[test]
fn one_limit_checkall_is_rl_check_in_an_array() {
    for t in targets("one") {
        let mut c = t.conn();
        let k = t.key("o");
        let mut seen = Vec::new();
        for i in 0..6 {
            let before = (dump(&mut c, &k), pexpiretime(&mut c, &k));
            let r = if i % 2 == 0 {
                let r = checkall(&mut c, &[&k, PER_HOUR_1, "3", "1"]);
                assert_eq!(r.len(), 1, "{}: one reply per limit", t.name);
                r[0]
            } else {
                rl_check(&mut c, &k, PER_HOUR_1, 3, 1)
            };
            let after = (dump(&mut c, &k), pexpiretime(&mut c, &k));
            // A refusal writes nothing, whichever command asked.
            assert_eq!(r.0 == 0, before == after, "{}: call {i}: {r:?}", t.name);
            seen.push((r.0, r.1, r.2 > 0));
        }
        let want = [
            (1, 2, false),
            (1, 1, false),
            (1, 0, false),
            (0, 0, true),
            (0, 0, true),
            (0, 0, true),
        ];
        assert_eq!(seen, want, "{}", t.name);
    }
}

#[test]
fn checkall_same_key_twice_counts_both() {
    for t in targets("dup") {
        let mut c = t.conn();
        let k = t.key("d");
        rl_check(&mut c, &k, PER_HOUR_1, 3, 2); // one token left
        let r = checkall(
            &mut c,
            &[&k, PER_HOUR_1, "3", "1", &k, PER_HOUR_1, "3", "1"],
        );
        assert_eq!(
            (r[0].0, r[1].0),
            (1, 0),
            "{}: the second sees the first's take",
            t.name
        );
        assert_eq!(
            rl_check(&mut c, &k, PER_HOUR_1, 3, 0).1,
            1,
            "{}: nothing taken",
            t.name
        );
        let r = checkall(&mut c, &[&k, PER_HOUR_1, "3", "1", &k, "1000", "3", "0"]);
        assert_eq!((r[0].0, r[0].1, r[1].0), (1, 0, 1), "{}", t.name);
        // Under the second limit (3 ms to refill) a bucket 3 h from full is deep in debt.
        assert!(r[1].1 < -10_000_000, "{}: {:?}", t.name, r[1]);
    }
}

#[test]
fn concurrent_connections_never_over_admit() {
    for t in targets("race") {
        let k = t.key("hot");
        let admitted: i64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..10)
                .map(|_| {
                    s.spawn(|| {
                        let mut c = t.conn();
                        (0..30)
                            .map(|_| rl_check(&mut c, &k, PER_HOUR_1, 100, 1).0)
                            .sum::<i64>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 100, "{}: 300 checks against burst 100", t.name);
    }
}

/// `OBJECT REFCOUNT key`: above 1 where the key's value is shared.
fn refcount(c: &mut Connection, key: &str) -> i64 {
    redis::cmd("OBJECT")
        .arg("REFCOUNT")
        .arg(key)
        .query(c)
        .unwrap()
}

fn object(c: &mut Connection, sub: &str, key: &str) -> redis::Value {
    redis::cmd("OBJECT").arg(sub).arg(key).query(c).unwrap()
}

#[test]
fn values_are_shared_where_the_header_is_known_and_never_under_an_lru_policy() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let version = s.version();
        let shared = expect_shared(flavor, version);
        let mut c = s.conn();
        for i in 0..50 {
            rl_check(&mut c, &format!("k{i}"), "1000", 10, 10);
        }
        let count = refcount(&mut c, "k0");
        if shared {
            assert!(
                count > 1,
                "{flavor:?} {version:?}: value not shared (refcount {count})"
            );
        } else {
            // Stored by the server's own SET: integer-encoded, one object per key, costing
            // what the same SET costs.
            assert_eq!(count, 1, "{flavor:?} {version:?}: shared");
            assert_eq!(
                object(&mut c, "ENCODING", "k0"),
                redis::Value::BulkString(b"int".to_vec()),
                "{flavor:?} {version:?}"
            );
            let v: String = redis::cmd("GET").arg("k0").query(&mut c).unwrap();
            let at = pexpiretime(&mut c, "k0");
            let _: () = redis::cmd("SET")
                .arg("j0")
                .arg(&v)
                .arg("PXAT")
                .arg(at)
                .query(&mut c)
                .unwrap();
            let usage = |c: &mut Connection, k: &str| -> i64 {
                redis::cmd("MEMORY").arg("USAGE").arg(k).query(c).unwrap()
            };
            assert_eq!(
                usage(&mut c, "k0"),
                usage(&mut c, "j0"),
                "{flavor:?} {version:?}: a bucket costs more than SET"
            );
            // A refused check and a peek read it without re-encoding it.
            assert_eq!(rl_check(&mut c, "k0", "1000", 10, 11).0, 0);
            rl_check(&mut c, "k0", "1000", 10, 0);
            assert_eq!(
                object(&mut c, "ENCODING", "k0"),
                redis::Value::BulkString(b"int".to_vec()),
                "{flavor:?} {version:?}: read re-encoded the value"
            );
        }
        // Writing to a key that shares its value must unshare it, not touch the others.
        let v0: String = redis::cmd("GET").arg("k0").query(&mut c).unwrap();
        let _: i64 = redis::cmd("APPEND")
            .arg("k0")
            .arg("x")
            .query(&mut c)
            .unwrap();
        let others: Vec<Option<String>> = (1..50)
            .map(|i| {
                redis::cmd("GET")
                    .arg(format!("k{i}"))
                    .query(&mut c)
                    .unwrap()
            })
            .collect();
        assert!(
            others.iter().flatten().all(|v| !v.ends_with('x')),
            "{flavor:?}"
        );
        let v0x: String = redis::cmd("GET").arg("k0").query(&mut c).unwrap();
        assert_eq!(v0x, format!("{v0}x"));
        // An eviction policy turned on at run time stops the sharing at once; turned off, it
        // resumes.
        let config_set = |c: &mut Connection, name: &str, value: &str| {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query(c)
                .unwrap();
        };
        config_set(&mut c, "maxmemory", "1gb");
        config_set(&mut c, "maxmemory-policy", "allkeys-lru");
        rl_check(&mut c, "lru-on", "1000", 10, 10);
        assert_eq!(
            refcount(&mut c, "lru-on"),
            1,
            "{flavor:?} {version:?}: shared under allkeys-lru set at run time"
        );
        config_set(&mut c, "maxmemory-policy", "noeviction");
        rl_check(&mut c, "lru-off", "1000", 10, 10);
        assert_eq!(
            refcount(&mut c, "lru-off") > 1,
            shared,
            "{flavor:?} {version:?}: sharing after the policy was turned off"
        );
        drop(s);

        let s = Server::start_with(
            flavor,
            true,
            &["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
        );
        let mut c = s.conn();
        rl_check(&mut c, "a", "0.001", 10, 10);
        rl_check(&mut c, "b", "0.001", 10, 10);
        assert_eq!(
            refcount(&mut c, "a"),
            1,
            "{flavor:?}: shared under allkeys-lru"
        );
        assert_eq!(
            object(&mut c, "ENCODING", "a"),
            redis::Value::BulkString(b"int".to_vec()),
            "{flavor:?}: under allkeys-lru the value is the server's own SET's"
        );
        assert_eq!(rl_check(&mut c, "a", "0.001", 10, 0).1, 0, "{flavor:?}");
    }
}

/// Where values are shared, a write that keeps the bucket's value (the TAT moved by whole
/// milliseconds, the same linger class) leaves the key's value object alone, but only if the
/// key really holds the shared one: a value the server integer-encoded (a `SET` from the
/// script or from replication), read into a copy of the key's own, is replaced by the
/// shared value as any write would. (That the write is skipped at all shows only in the
/// keyspace events, `tests/events.rs`, and in instructions, `scripts/bench/run`.)
#[test]
fn a_write_that_keeps_the_value_keeps_it_shared() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let version = s.version();
        if !expect_shared(flavor, version) {
            eprintln!("{flavor:?} {version:?}: values not shared here, skipped");
            continue;
        }
        let mut c = s.conn();
        let get = |c: &mut Connection| -> String { redis::cmd("GET").arg("k").query(c).unwrap() };
        assert_eq!(rl_check(&mut c, "k", PER_HOUR_1, 3, 1).1, 2);
        let (value, at) = (get(&mut c), pexpiretime(&mut c, "k"));
        assert_eq!(refcount(&mut c, "k"), i64::from(i32::MAX), "{flavor:?}");
        // The same bucket as the server's own SET stores it: integer-encoded, the key's own.
        let _: () = redis::cmd("SET")
            .arg("k")
            .arg(&value)
            .arg("PXAT")
            .arg(at)
            .query(&mut c)
            .unwrap();
        assert_eq!(refcount(&mut c, "k"), 1, "{flavor:?}");
        for (remaining, hours) in [(1, 1), (0, 2)] {
            assert_eq!(rl_check(&mut c, "k", PER_HOUR_1, 3, 1).1, remaining);
            assert_eq!(get(&mut c), value, "{flavor:?}: the value moved");
            assert_eq!(
                pexpiretime(&mut c, "k"),
                at + hours * 3_600_000,
                "{flavor:?}"
            );
            assert_eq!(
                refcount(&mut c, "k"),
                i64::from(i32::MAX),
                "{flavor:?} {version:?}: not the shared value after {hours} write(s)"
            );
        }
    }
}

/// A replica ignores `maxmemory` (`replica-ignore-maxmemory`, on by default), so one loaded
/// under `allkeys-lru` may share values; promoted, it evicts, and from then on must not.
#[test]
fn a_promoted_replica_stops_sharing_under_an_lru_policy() {
    for flavor in Flavor::selected() {
        let primary = Server::start(flavor);
        let port = primary.port.to_string();
        let replica = Server::start_with(
            flavor,
            true,
            &[
                "--maxmemory",
                "1gb",
                "--maxmemory-policy",
                "allkeys-lru",
                "--replicaof",
                "127.0.0.1",
                &port,
            ],
        );
        let mut c = replica.conn();
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut c).unwrap();
        assert_eq!(
            role.first(),
            Some(&redis::Value::BulkString(b"slave".to_vec())),
            "{flavor:?}: not started as a replica"
        );
        let _: () = redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query(&mut c)
            .unwrap();
        for i in 0..10 {
            rl_check(&mut c, &format!("p{i}"), "1000", 10, 10);
        }
        assert_eq!(
            refcount(&mut c, "p0"),
            1,
            "{flavor:?}: shared after promotion under allkeys-lru"
        );
    }
}

#[test]
fn reads_buckets_written_in_the_documented_format() {
    for t in targets("format") {
        let mut c = t.conn();
        let k = t.key("f");
        // One token an hour, one token missing, written the way a Lua script would: the TAT
        // is an hour ahead, expiry rounded up to the ms plus 60 s of linger (class 4), value
        // the class and the 100 ns ticks it rounded.
        let now = server_ms(&mut c);
        let expire_at = now + 3_600_000 + 60_000;
        let _: () = redis::cmd("SET")
            .arg(&k)
            .arg(45000)
            .arg("PXAT")
            .arg(expire_at)
            .query(&mut c)
            .unwrap();
        // Exactly one token (of 3) is missing.
        let (allowed, remaining, _, reset) = rl_check(&mut c, &k, PER_HOUR_1, 3, 0);
        assert_eq!((allowed, remaining), (1, 2), "{}", t.name);
        assert!(
            (3_599_000..=3_600_000).contains(&reset),
            "{}: reset {reset}",
            t.name
        );
    }
}

#[test]
fn info_section_counts_checks() {
    for t in targets("info") {
        let mut c = t.conn();
        let field = |c: &mut Connection, name: &str| -> i64 {
            let info: String = redis::cmd("INFO").arg("ratelimit").query(c).unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("ratelimit_{name}:")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no ratelimit_{name} in INFO:\n{info}"))
        };
        let (checks, allowed, denied, errors) = (
            field(&mut c, "checks"),
            field(&mut c, "allowed"),
            field(&mut c, "denied"),
            field(&mut c, "errors"),
        );
        let k = t.key("i");
        rl_check(&mut c, &k, PER_HOUR_1, 1, 1);
        rl_check(&mut c, &k, PER_HOUR_1, 1, 1);
        expect_err(&mut c, &["RL.CHECK", &k, "x", "1"]);
        if std::env::var("REDIS_URL").is_err() {
            assert_eq!(field(&mut c, "checks"), checks + 2, "{}", t.name);
            assert_eq!(field(&mut c, "allowed"), allowed + 1, "{}", t.name);
            assert_eq!(field(&mut c, "denied"), denied + 1, "{}", t.name);
            assert_eq!(field(&mut c, "errors"), errors + 1, "{}", t.name);
        } else {
            assert!(field(&mut c, "checks") >= checks + 2);
        }
    }
}

#[test]
fn acl_can_deny_the_commands() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let mut admin = s.conn();
        // Valkey and Redis 7.2+ put the commands in @write; Redis 7.0 cannot give module
        // commands categories, so there they are denied by name.
        let version = s.version();
        let rules: &[&str] = match flavor {
            Flavor::Redis if version < (7, 2, 0) => &["-rl.check", "-rl.settle"],
            _ => &["-@write"],
        };
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", "app", "on", ">pw", "~*", "+@all"])
            .arg(rules)
            .query(&mut admin)
            .unwrap();
        let mut c = redis::Client::open(format!("redis://app:pw@127.0.0.1:{}/", s.port))
            .unwrap()
            .get_connection()
            .unwrap();
        for cmd in [
            &["RL.CHECK", "k", "1", "1"][..],
            &["RL.SETTLE", "k", "1", "1", "1"],
        ] {
            let err = expect_err(&mut c, cmd);
            assert!(err.to_lowercase().contains("noperm"), "{flavor:?}: {err}");
        }
        assert!(!exists(&mut admin, "k"), "{flavor:?}");
    }
}

#[test]
fn checkall_with_many_limits_and_repeated_keys() {
    for t in targets("many") {
        let mut c = t.conn();
        let keys: Vec<String> = (0..20).map(|i| t.key(&format!("{{m}}:{i}"))).collect();
        let args = |cost: &str| -> Vec<String> {
            keys.iter()
                .chain(keys.iter())
                .flat_map(|k| [k.clone(), PER_HOUR_1.into(), "3".into(), cost.into()])
                .collect()
        };
        let a = args("1");
        let r = checkall(&mut c, &a.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(r.len(), 40, "{}", t.name);
        assert!(r.iter().all(|x| x.0 == 1), "{}: {r:?}", t.name);
        // Each key was named twice: both takes landed, one token left everywhere.
        assert!(r[20..].iter().all(|x| x.1 == 1), "{}: {r:?}", t.name);
        let a = args("1");
        let r = checkall(&mut c, &a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(r[..20].iter().all(|x| x.0 == 1), "{}", t.name);
        assert!(
            r[20..].iter().all(|x| x.0 == 0),
            "{}: second take must not fit",
            t.name
        );
        for k in &keys {
            assert_eq!(
                rl_check(&mut c, k, PER_HOUR_1, 3, 0).1,
                1,
                "{}: {k} changed",
                t.name
            );
        }
    }
}

/// Background flushes free the old keyspace on another thread while checks keep writing
/// buckets that share the same value objects: the shared values must survive that.
#[test]
fn async_flushes_during_checks_leave_the_server_healthy() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            for w in 0..3 {
                let (s, stop) = (&s, &stop);
                scope.spawn(move || {
                    let mut c = s.conn();
                    let mut i = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let mut p = redis::pipe();
                        for _ in 0..200 {
                            i += 1;
                            p.cmd("RL.CHECK")
                                .arg(format!("w{w}:{}", i % 20_000))
                                .arg("1000")
                                .arg(50)
                                .arg(1);
                        }
                        let _: Vec<Reply> = p.query(&mut c).expect("RL.CHECK during flushes");
                    }
                });
            }
            let mut c = s.conn();
            for n in 0..20 {
                std::thread::sleep(Duration::from_millis(50));
                // Valkey 8 flushes lazily by default; ASYNC forces it on both.
                let how = if n % 2 == 0 { "ASYNC" } else { "SYNC" };
                let _: () = redis::cmd("FLUSHALL").arg(how).query(&mut c).unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let mut c = s.conn();
        let pong: String = redis::cmd("PING").query(&mut c).unwrap();
        assert_eq!(pong, "PONG", "{flavor:?}");
        assert_eq!(rl_check(&mut c, "after", "1", 2, 1).0, 1, "{flavor:?}");
        assert!(!s.log().contains("crashed"), "{flavor:?}: {}", s.log());
    }
}
