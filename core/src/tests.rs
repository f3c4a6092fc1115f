use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

const NOW: u64 = 1_700_000_000 * TICKS_PER_SECOND;
const MS: u64 = TICKS_PER_MS;

fn limit(rate: f64, burst: u64) -> Limit {
    Limit::new(rate, burst).expect("valid limit")
}

// Numbered cases: (rate, burst, cost, tat relative to NOW (None = no key), expected
// allowed, remaining, retry_after_ms, reset_after_ms).
#[allow(clippy::type_complexity)]
const CASES: &[(f64, u64, u64, Option<u64>, bool, u64, Option<u64>, u64)] = &[
    // 1. fresh key, 1 token out of 20 at 1 token / 600 ms
    (100.0 / 60.0, 20, 1, None, true, 19, Some(0), 600),
    // 2. fresh key, whole burst at once
    (100.0 / 60.0, 20, 20, None, true, 0, Some(0), 12_000),
    // 3. empty bucket: wait one interval
    (
        100.0 / 60.0,
        20,
        1,
        Some(12_000 * MS),
        false,
        0,
        Some(600),
        12_000,
    ),
    // 4. cost above burst: never
    (10.0, 5, 6, None, false, 5, None, 0),
    // 5. peek on a fresh key: full, nothing written
    (10.0, 5, 0, None, true, 5, Some(0), 0),
    // 6. peek on a drained bucket
    (10.0, 5, 0, Some(500 * MS), true, 0, Some(0), 500),
    // 7. half-empty bucket, weighted cost that fits exactly
    (10.0, 10, 5, Some(500 * MS), true, 0, Some(0), 1_000),
    // 8. weighted cost one token short: retry after one interval
    (10.0, 10, 6, Some(500 * MS), false, 5, Some(100), 500),
    // 9. sub-millisecond deficit rounds the retry up, never down
    (3.0, 1, 1, Some(1), false, 0, Some(1), 1),
    // 10. TAT in the past is a full bucket
    (1.0, 3, 1, Some(0), true, 2, Some(0), 1_000),
];

#[test]
fn table() {
    for (i, &(rate, burst, cost, tat, allowed, remaining, retry, reset)) in CASES.iter().enumerate()
    {
        let l = limit(rate, burst);
        let tat = tat.map_or(0, |t| NOW + t);
        let d = check(&l, cost, tat, NOW);
        let case = i + 1;
        assert_eq!(d.allowed, allowed, "case {case}: allowed");
        assert_eq!(d.remaining, remaining, "case {case}: remaining");
        assert_eq!(d.retry_after_ms, retry, "case {case}: retry_after_ms");
        assert_eq!(d.reset_after_ms, reset, "case {case}: reset_after_ms");
        assert_eq!(d.changed, allowed && cost > 0, "case {case}: changed");
    }
}

#[test]
fn invalid_limits() {
    assert_eq!(Limit::new(f64::NAN, 1), Err(LimitError::RateNotFinite));
    assert_eq!(Limit::new(f64::INFINITY, 1), Err(LimitError::RateNotFinite));
    assert_eq!(Limit::new(0.0, 1), Err(LimitError::RateNotPositive));
    assert_eq!(Limit::new(-1.0, 1), Err(LimitError::RateNotPositive));
    assert_eq!(Limit::new(1e7 + 1.0, 1), Err(LimitError::RateTooHigh));
    assert_eq!(Limit::new(1.0, 0), Err(LimitError::BurstZero));
    assert_eq!(Limit::new(1e-300, 1), Err(LimitError::RefillTooLong));
    assert_eq!(Limit::new(1.0, u64::MAX), Err(LimitError::RefillTooLong));
    assert!(Limit::new(1e7, 1).is_ok());
    assert!(Limit::new(0.01, 1_000_000).is_ok()); // 10^8 s: the bound itself
}

#[test]
fn intervals_are_exact_for_round_rates() {
    let per_minute = Limit::per_period(100, Duration::from_secs(60), 20).unwrap();
    assert_eq!(per_minute.interval_ticks(), 6_000_000);
    assert_eq!(limit(1000.0, 1).interval_ticks(), 10_000);
    // 3/s does not divide 10^7: rounded up, never faster than asked.
    assert_eq!(limit(3.0, 1).interval_ticks(), 3_333_334);
    assert!(limit(3.0, 1).effective_rate() <= 3.0);
}

#[test]
fn split_divides_rate_and_burst() {
    let l = limit(100.0, 20).split(4).unwrap();
    assert_eq!(l.effective_rate(), 25.0);
    assert_eq!(l.burst(), 5);
    assert_eq!(limit(1.0, 3).split(10).unwrap().burst(), 1);
}

#[test]
fn burst_from_fresh_bucket_is_exact_for_any_rate() {
    for rate in [3.0, 7.0, 100.0 / 60.0, 0.37, 123_456.7] {
        let l = limit(rate, 1000);
        let mut tat = 0;
        let mut admitted = 0;
        for _ in 0..1001 {
            let d = check(&l, 1, tat, NOW);
            if d.allowed {
                admitted += 1;
                tat = d.tat;
            }
        }
        assert_eq!(admitted, 1000, "rate {rate}");
    }
}

#[test]
fn check_all_is_all_or_nothing() {
    let a = limit(10.0, 5);
    let b = limit(1.0, 2);
    let checks = [
        Check {
            limit: a,
            cost: 1,
            bucket: 0,
        },
        Check {
            limit: b,
            cost: 3,
            bucket: 1,
        },
    ];
    let mut tats = [0, 0];
    let (all, ds) = check_all(&checks, &mut tats, NOW);
    assert!(!all);
    assert_eq!(tats, [0, 0], "nothing taken");
    assert!(ds[0].allowed && ds[0].remaining == 5 && !ds[0].changed);
    assert!(!ds[1].allowed && ds[1].retry_after_ms.is_none());

    let checks = [
        Check {
            limit: a,
            cost: 1,
            bucket: 0,
        },
        Check {
            limit: b,
            cost: 2,
            bucket: 1,
        },
    ];
    let (all, ds) = check_all(&checks, &mut tats, NOW);
    assert!(all);
    assert_eq!(ds[0].remaining, 4);
    assert_eq!(ds[1].remaining, 0);
    assert_eq!(tats, [NOW + 1_000_000, NOW + 20_000_000]);
}

#[test]
fn check_all_same_bucket_twice_sees_its_own_take() {
    let l = limit(1.0, 2);
    let checks = [
        Check {
            limit: l,
            cost: 1,
            bucket: 0,
        },
        Check {
            limit: l,
            cost: 1,
            bucket: 0,
        },
    ];
    let mut tats = [NOW + 10_000_000]; // one token left
    let (all, ds) = check_all(&checks, &mut tats, NOW);
    assert!(!all);
    assert!(ds[0].allowed);
    assert!(!ds[1].allowed);
    assert_eq!(ds[1].retry_after_ms, Some(1000));
    assert_eq!(ds[0].remaining, 1, "reported untouched");
    assert_eq!(tats, [NOW + 10_000_000]);
}

#[test]
fn stored_round_trip_and_canonical_values() {
    let s = stored::encode(17_000_000_001_234_567);
    assert_eq!(s.expire_at_ms, 1_700_000_000_124);
    assert_eq!(s.sub_ms, 5433);
    assert_eq!(
        stored::decode(1_700_000_000_124, b"5433"),
        Ok(17_000_000_001_234_567)
    );
    assert_eq!(stored::encode(NOW).sub_ms, 0);
    for bad in [
        &b""[..],
        b"01",
        b"10000",
        b"-1",
        b"+1",
        b"1.0",
        b" 1",
        b"abc",
    ] {
        assert_eq!(stored::parse_value(bad), None, "{bad:?}");
    }
    assert_eq!(stored::decode(-1, b"0"), Err(stored::FormatError::NoExpiry));
    assert_eq!(
        stored::decode(i64::MAX, b"0"),
        Err(stored::FormatError::Expiry)
    );
}

/// One step of a random schedule: advance the clock, then check `cost` tokens.
fn steps() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..3 * TICKS_PER_SECOND, 0u64..6), 1..200)
}

fn limits() -> impl Strategy<Value = Limit> {
    (0.05f64..5_000.0, 1u64..50).prop_map(|(r, b)| limit(r, b))
}

proptest! {
    /// GCRA's guarantee: over any window [t1, t2] the tokens admitted are at most
    /// burst + rate × (t2 − t1), i.e. `sum(cost) × T <= τ + (t2 − t1)`.
    #[test]
    fn admitted_never_exceed_burst_plus_rate_times_window(l in limits(), steps in steps()) {
        let mut now = NOW;
        let mut tat = 0;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (dt, cost) in steps {
            now += dt;
            let d = check(&l, cost, tat, now);
            if d.allowed && cost > 0 {
                admitted.push((now, cost));
                tat = d.tat;
            }
        }
        for (i, &(t1, _)) in admitted.iter().enumerate() {
            let mut tokens = 0;
            for &(t2, cost) in &admitted[i..] {
                tokens += cost;
                prop_assert!(
                    tokens * l.interval_ticks() <= l.refill_ticks() + (t2 - t1),
                    "{tokens} tokens in {} ticks", t2 - t1
                );
            }
        }
    }

    /// A refused check, and a peek, change nothing.
    #[test]
    fn refused_checks_change_nothing(l in limits(), steps in steps()) {
        let mut now = NOW;
        let mut tat = 0;
        for (dt, cost) in steps {
            now += dt;
            let d = check(&l, cost, tat, now);
            if !d.allowed || cost == 0 {
                prop_assert!(!d.changed);
                prop_assert_eq!(d.tat, tat.clamp(now, now + l.refill_ticks()));
            } else {
                prop_assert!(d.changed);
                tat = d.tat;
            }
        }
    }

    /// Waiting exactly `retry_after_ms` and retrying is admitted.
    #[test]
    fn waiting_retry_after_is_enough(l in limits(), steps in steps(), cost in 1u64..6, jitter in 0..MS) {
        let mut now = NOW;
        let mut tat = 0;
        for (dt, c) in steps {
            now += dt;
            let d = check(&l, c, tat, now);
            if d.changed { tat = d.tat; }
        }
        now += jitter; // any sub-millisecond phase
        let d = check(&l, cost, tat, now);
        match d.retry_after_ms {
            None => prop_assert!(cost > l.burst()),
            Some(0) => prop_assert!(d.allowed),
            Some(ms) => {
                prop_assert!(!d.allowed);
                let later = check(&l, cost, tat, now + ms * MS);
                prop_assert!(later.allowed, "still refused after {ms} ms: {later:?}");
            }
        }
    }

    /// `reset_after_ms` is when the bucket is full, and the stored expiry says the same.
    #[test]
    fn reset_after_is_when_full(l in limits(), steps in steps()) {
        let mut now = NOW;
        let mut tat = 0;
        for (dt, cost) in steps {
            now += dt;
            let d = check(&l, cost, tat, now);
            if d.changed { tat = d.tat; }
            let reset_at = now + d.reset_after_ms * MS;
            let at_reset = check(&l, 0, d.tat, reset_at);
            prop_assert_eq!(at_reset.remaining, l.burst(), "not full at reset");
            if d.reset_after_ms > 0 {
                let before = check(&l, 0, d.tat, d.tat - 1);
                prop_assert!(before.remaining < l.burst(), "full before the TAT");
                let s = stored::encode(d.tat);
                prop_assert_eq!(s.expire_at_ms - now / MS, d.reset_after_ms);
                prop_assert_eq!(stored::decode(s.expire_at_ms as i64, s.sub_ms.to_string().as_bytes()), Ok(d.tat));
            }
        }
    }

    /// Over a sliding window the same bound holds when checks race on one bucket through
    /// `check_all` and the bucket is shared by two checks in one call.
    #[test]
    fn check_all_never_over_admits(l in limits(), steps in steps()) {
        let mut now = NOW;
        let mut tats = [0u64];
        let mut window: VecDeque<(u64, u64)> = VecDeque::new();
        for (dt, cost) in steps {
            now += dt;
            let checks = [Check { limit: l, cost, bucket: 0 }, Check { limit: l, cost: 1, bucket: 0 }];
            let (all, _) = check_all(&checks, &mut tats, now);
            if all {
                window.push_back((now, cost + 1));
            }
            let total: u64 = window.iter().map(|w| w.1).sum();
            let span = window.front().map_or(0, |w| now - w.0);
            prop_assert!(total * l.interval_ticks() <= l.refill_ticks() + span);
        }
    }
}
