//! The Lua script against the core, through a real server, on random argument vectors and
//! times: every reply and every stored key the script leaves must be what the core computes
//! (the module *is* the core, so this keeps the two deployments of one limiter identical).
//!
//! The script reads the server's clock itself; the test brackets each call with `TIME` and
//! accepts the call if the core gives the same reply and the same stored key at some
//! microsecond of that bracket. Invalid vectors must be refused by the script with the
//! module's exact error, writing nothing.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use redis::Connection;
use redis_ratelimit_core::{check, settle, stored, Limit, TICKS_PER_SECOND};
use redis_ratelimit_testkit::*;

const SCRIPT: &str = include_str!("../src/checkall.lua");

/// Arguments as sent: mostly valid, sometimes the edge cases parsers disagree on.
fn rate() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (0.001f64..100_000.0).prop_map(|r| r.to_string()),
        2 => (1u64..10_000).prop_map(|r| r.to_string()),
        1 => Just("1.6666666666666667".to_string()),
        1 => prop::sample::select(vec![
            "0", "-1", "inf", "-inf", "+inf", "infinity", "nan", "NaN", "1e400", "1e-400",
            "1E3", "+5", "5.", ".5", ".", "e5", "1e", "0x10", " 5", "5 ", "1_0", "", "abc",
            "10000000", "10000001", "1e-9",
        ])
        .prop_map(String::from),
    ]
}

fn integer(valid: impl Strategy<Value = i64>) -> impl Strategy<Value = String> {
    prop_oneof![
        8 => valid.prop_map(|v| v.to_string()),
        1 => prop::sample::select(vec![
            "0", "-1", "+3", "007", "-0", "1.0", "1e3", "", " 1", "9223372036854775807",
            "9223372036854775808", "-9223372036854775808", "-9223372036854775809", "x",
        ])
        .prop_map(String::from),
    ]
}

#[derive(Debug, Clone)]
struct Op {
    key: usize,
    rate: String,
    burst: String,
    /// Cost, or delta when `settle`.
    amount: String,
    settle: bool,
    /// Sleep before the call, µs.
    pause_us: u64,
}

fn op() -> impl Strategy<Value = Op> {
    (
        0usize..2,
        rate(),
        integer(1i64..60),
        integer(-30i64..40),
        prop::bool::weighted(0.25),
        prop_oneof![3 => Just(0u64), 1 => 0u64..3_000],
    )
        .prop_map(|(key, rate, burst, amount, settle, pause_us)| Op {
            key,
            rate,
            burst,
            amount,
            settle,
            pause_us,
        })
}

/// A key's bucket state: `(PEXPIRETIME, value)`, or `None` when absent.
fn state(c: &mut Connection, key: &str) -> Option<(i64, String)> {
    let at: i64 = redis::cmd("PEXPIRETIME").arg(key).query(c).unwrap();
    if at == -2 {
        return None;
    }
    Some((at, redis::cmd("GET").arg(key).query(c).unwrap()))
}

fn time_us(c: &mut Connection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(c).unwrap();
    s * 1_000_000 + us
}

type Reply = Result<Vec<i64>, String>;

fn script(c: &mut Connection, key: &str, op: &Op) -> Reply {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SCRIPT)
        .arg(1)
        .arg(key)
        .arg(&op.rate)
        .arg(&op.burst)
        .arg(&op.amount);
    if op.settle {
        cmd.arg("settle");
    }
    // One reply per key, like RL.CHECKALL.
    cmd.query::<Vec<Vec<i64>>>(c)
        .map(|mut r| r.pop().unwrap_or_default())
        .map_err(|e| e.detail().unwrap_or_default().to_string())
}

fn module(c: &mut Connection, key: &str, op: &Op) -> Reply {
    let name = if op.settle { "RL.SETTLE" } else { "RL.CHECK" };
    redis::cmd(name)
        .arg(key)
        .arg(&op.rate)
        .arg(&op.burst)
        .arg(&op.amount)
        .query::<Vec<i64>>(c)
        .map_err(|e| e.detail().unwrap_or_default().to_string())
}

/// What the core answers at `now` (ticks) for a bucket at `tat`, and the key it leaves.
fn core(limit: &Limit, op: &Op, amount: i64, tat: u64, now: u64) -> Reply2 {
    let d = if op.settle {
        match settle(limit, amount, tat, now) {
            Ok(d) => d,
            Err(e) => return Reply2::Error(format!("{e}")),
        }
    } else {
        check(limit, amount as u64, tat, now)
    };
    let reply = vec![
        i64::from(d.allowed),
        d.remaining,
        d.retry_after_ms.map_or(-1, |ms| ms as i64),
        d.reset_after_ms as i64,
    ];
    let key = d.changed.then(|| {
        let s = stored::encode(d.tat, stored::linger_class(limit));
        (s.expire_at_ms as i64, s.value.to_string())
    });
    Reply2::Ok(reply, key)
}

#[derive(Debug, PartialEq)]
enum Reply2 {
    /// The reply, and the key written (`None`: unchanged).
    Ok(Vec<i64>, Option<(i64, String)>),
    Error(String),
}

/// One server for every case (each case uses its own keys), stopped when the test ends.
#[test]
fn script_matches_the_core() {
    let s = Server::start(Flavor::Redis.or_selected());
    // `TestRunner::run` takes a `Fn`: the connection and case counter are shared cells.
    let c = std::cell::RefCell::new(s.conn());
    let case = std::cell::Cell::new(0u64);
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(op(), 1..25), |ops| {
        case.set(case.get() + 1);
        run_case(&mut c.borrow_mut(), case.get(), &ops)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

fn run_case(c: &mut Connection, case: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    for (i, op) in ops.iter().enumerate() {
        if op.pause_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(op.pause_us));
        }
        let key = format!("diff:{case}:s{}", op.key);
        let before = state(c, &key);
        let t0 = time_us(c);
        let got = script(c, &key, op);
        let t1 = time_us(c);
        let after = state(c, &key);

        // Validation: the module's own answer on the same arguments (on a scratch key)
        // says whether they are valid, and with which error.
        let scratch = format!("diff:{case}:m{i}");
        let by_module = module(c, &scratch, op);
        if let Err(want) = &by_module {
            if !want.contains("debt") {
                prop_assert_eq!(&got, &by_module, "{:?}", op);
                prop_assert_eq!(&after, &before, "a refused call wrote: {:?}", op);
                continue;
            }
        }
        let limit = {
            let rate: f64 = op.rate.parse().unwrap();
            Limit::new(rate, op.burst.parse().unwrap()).unwrap()
        };
        let amount: i64 = op.amount.parse().unwrap();
        let tat = match &before {
            None => 0,
            Some((at, v)) => stored::decode(*at, v.as_bytes()).unwrap(),
        };
        let got = match got {
            Ok(r) => Reply2::Ok(r, (after != before).then(|| after.clone().unwrap())),
            Err(e) => Reply2::Error(e),
        };
        let per_us = TICKS_PER_SECOND / 1_000_000;
        let matched = (t0..=t1).any(|us| {
            let want = core(&limit, op, amount, tat, us * per_us);
            match (&want, &got) {
                (Reply2::Error(w), Reply2::Error(g)) => g.ends_with(w.as_str()),
                _ => want == got,
            }
        });
        prop_assert!(
            matched,
            "{:?} on {:?} (tat {}): script gave {:?}, core at {} µs gave {:?}",
            op,
            before,
            tat,
            got,
            t0,
            core(&limit, op, amount, tat, t0 * per_us)
        );
    }
    Ok(())
}
