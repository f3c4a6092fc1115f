//! `RL.SETTLE`: charging after the fact (into debt) and refunding, against real servers
//! (Redis 7.0 and Valkey 8, or `REDIS_URL`).

use redis::Connection;
use redis_ratelimit_testkit::*;
use std::time::Duration;

/// One per hour: nothing refills while a test runs.
const PER_HOUR_1: &str = "0.0002777777777777778";
const HOUR_MS: i64 = 3_600_000;

fn rl_settle(c: &mut Connection, key: &str, rate: &str, burst: i64, delta: i64) -> Reply {
    redis::cmd("RL.SETTLE")
        .arg(key)
        .arg(rate)
        .arg(burst)
        .arg(delta)
        .query(c)
        .unwrap_or_else(|e| panic!("RL.SETTLE {key} {rate} {burst} {delta}: {e}"))
}

#[test]
fn charges_go_into_debt_and_checks_wait_it_out() {
    for t in targets("debt") {
        let mut c = t.conn();
        let k = t.key("d");
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 3, 2).1, 1, "{}", t.name);
        // 5 more than the one left: 4 tokens in debt.
        let (allowed, remaining, retry, reset) = rl_settle(&mut c, &k, PER_HOUR_1, 3, 5);
        assert_eq!((allowed, remaining, retry), (1, -4, 0), "{}", t.name);
        assert!(
            (7 * HOUR_MS - 1_000..=7 * HOUR_MS + 1).contains(&reset),
            "{}: {reset}",
            t.name
        );
        // Every check is refused until the debt and one token are repaid: 5 hours.
        let (allowed, remaining, retry, _) = rl_check(&mut c, &k, PER_HOUR_1, 3, 1);
        assert_eq!((allowed, remaining), (0, -4), "{}", t.name);
        assert!(
            (5 * HOUR_MS - 1_000..=5 * HOUR_MS).contains(&retry),
            "{}: {retry}",
            t.name
        );
        // The debt survives the refusal.
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 3, 0).1, -4, "{}", t.name);
    }
}

#[test]
fn refunds_never_fill_past_full_and_zero_is_a_peek() {
    for t in targets("refund") {
        let mut c = t.conn();
        let k = t.key("r");
        assert_eq!(
            rl_settle(&mut c, &k, PER_HOUR_1, 5, 0),
            (1, 5, 0, 0),
            "{}",
            t.name
        );
        assert!(!exists(&mut c, &k), "{}: a peek created the key", t.name);
        assert_eq!(
            rl_settle(&mut c, &k, PER_HOUR_1, 5, -3),
            (1, 5, 0, 0),
            "{}",
            t.name
        );
        assert!(
            !exists(&mut c, &k),
            "{}: refunding a full bucket wrote",
            t.name
        );
        rl_check(&mut c, &k, PER_HOUR_1, 5, 4);
        let before = (
            redis::cmd("DUMP").arg(&k).query::<Vec<u8>>(&mut c).unwrap(),
            pexpiretime(&mut c, &k),
        );
        assert_eq!(rl_settle(&mut c, &k, PER_HOUR_1, 5, 0).1, 1, "{}", t.name);
        let after = (
            redis::cmd("DUMP").arg(&k).query::<Vec<u8>>(&mut c).unwrap(),
            pexpiretime(&mut c, &k),
        );
        assert_eq!(before, after, "{}: a peek changed the key", t.name);
        let (_, remaining, _, _) = rl_settle(&mut c, &k, PER_HOUR_1, 5, -2);
        assert_eq!(remaining, 3, "{}", t.name);
        assert_eq!(
            rl_settle(&mut c, &k, PER_HOUR_1, 5, -1_000),
            (1, 5, 0, 0),
            "{}",
            t.name
        );
        assert_eq!(rl_check(&mut c, &k, PER_HOUR_1, 5, 0).1, 5, "{}", t.name);
    }
}

/// The issue's case: a subject used burst 1000, then the limit shrank to burst 10. The stored
/// deficit is honoured and the wait the server names is enough (shown at 1000 tokens/s so the
/// test waits ~1 s rather than ~1000 s).
#[test]
fn a_shrunk_limit_says_truly_how_long_to_wait() {
    for t in targets("shrink") {
        let mut c = t.conn();
        let k = t.key("s");
        assert_eq!(rl_check(&mut c, &k, "1000", 1000, 1000).0, 1, "{}", t.name);
        let (allowed, remaining, retry, _) = rl_check(&mut c, &k, "1000", 10, 1);
        assert_eq!(allowed, 0, "{}", t.name);
        // 991 ms less the time between the two checks (generous: a loaded CI machine).
        assert!(remaining <= -900, "{}: remaining {remaining}", t.name);
        assert!((900..=991).contains(&retry), "{}: retry {retry}", t.name);
        std::thread::sleep(Duration::from_millis(retry as u64));
        assert_eq!(
            rl_check(&mut c, &k, "1000", 10, 1).0,
            1,
            "{}: after {retry} ms",
            t.name
        );
    }
}

#[test]
fn info_counts_settles() {
    for t in targets("settleinfo") {
        let mut c = t.conn();
        let settles = |c: &mut Connection| -> i64 {
            let info: String = redis::cmd("INFO").arg("ratelimit").query(c).unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix("ratelimit_settles:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no ratelimit_settles in INFO:\n{info}"))
        };
        let before = settles(&mut c);
        let k = t.key("i");
        rl_settle(&mut c, &k, PER_HOUR_1, 1, 3);
        rl_settle(&mut c, &k, PER_HOUR_1, 1, -1);
        let after = settles(&mut c);
        if std::env::var("REDIS_URL").is_err() {
            assert_eq!(after, before + 2, "{}", t.name);
        } else {
            assert!(after >= before + 2, "{}", t.name);
        }
    }
}

#[test]
fn settle_has_the_flags_and_key_positions_of_check() {
    for t in targets("settleflags") {
        let mut c = t.conn();
        let keys: Vec<String> = redis::cmd("COMMAND")
            .arg("GETKEYS")
            .arg("RL.SETTLE")
            .arg("k")
            .arg("1")
            .arg("1")
            .arg("1")
            .query(&mut c)
            .unwrap();
        assert_eq!(keys, ["k"], "{}", t.name);
        let info: redis::Value = redis::cmd("COMMAND")
            .arg("INFO")
            .arg("RL.SETTLE")
            .query(&mut c)
            .unwrap();
        let text = format!("{info:?}").to_lowercase();
        for flag in ["write", "denyoom", "fast"] {
            assert!(text.contains(flag), "{}: {flag} missing in {text}", t.name);
        }
    }
}
