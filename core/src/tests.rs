use super::*;
use proptest::prelude::*;

const NOW: u64 = 1_700_000_000 * TICKS_PER_SECOND;
const MS: u64 = TICKS_PER_MS;

fn limit(rate: f64, burst: u64) -> Limit {
    Limit::new(rate, burst).expect("valid limit")
}

// Numbered cases: (rate, burst, cost, tat relative to NOW (None = no key), expected
// allowed, remaining, retry_after_ms, reset_after_ms).
#[allow(clippy::type_complexity)]
const CASES: &[(f64, u64, u64, Option<u64>, bool, i64, Option<u64>, u64)] = &[
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
    // 11. limit shrunk from burst 1000 to 10: the deficit is honoured, and the wait is true
    (
        1.0,
        10,
        1,
        Some(1_000_000 * MS),
        false,
        -990,
        Some(991_000),
        1_000_000,
    ),
    // 12. in debt by 5 tokens: a peek reports it
    (1.0, 10, 0, Some(15_000 * MS), true, -5, Some(0), 15_000),
    // 13. a partial token of debt rounds remaining down
    (1.0, 10, 0, Some(10_500 * MS), true, -1, Some(0), 10_500),
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
    let s = stored::encode(17_000_000_001_234_567, 0);
    assert_eq!(s.expire_at_ms, 1_700_000_000_124);
    assert_eq!(s.value, 5433);
    let s = stored::encode(17_000_000_001_234_567, 3);
    assert_eq!(s.expire_at_ms, 1_700_000_015_124, "15 s of linger");
    assert_eq!(s.value, 35_433);
    assert_eq!(
        stored::decode(1_700_000_015_124, b"35433"),
        Ok(17_000_000_001_234_567)
    );
    // The first format: class 0, expiring when full.
    assert_eq!(
        stored::decode(1_700_000_000_124, b"5433"),
        Ok(17_000_000_001_234_567)
    );
    assert_eq!(stored::encode(NOW, 1).value, 10_000);
    for bad in [
        &b""[..],
        b"01",
        b"50000",
        b"100000",
        b"-1",
        b"+1",
        b"1.0",
        b" 1",
        b"abc",
    ] {
        assert_eq!(stored::parse_value(bad), None, "{bad:?}");
    }
    assert_eq!(stored::parse_value(b"49999"), Some(49_999));
    assert_eq!(stored::decode(-1, b"0"), Err(stored::FormatError::NoExpiry));
    assert_eq!(
        stored::decode(i64::MAX, b"0"),
        Err(stored::FormatError::Expiry)
    );
    // An expiry shorter than the class's linger is not a bucket this format wrote.
    assert_eq!(
        stored::decode(59_999, b"40000"),
        Err(stored::FormatError::Expiry)
    );
}

#[test]
fn linger_follows_the_refill_time_within_bounds() {
    // (rate, burst, class): refill times 10 ms, 1 s, 2 s, 12 s, 15 s, 1 h.
    for (rate, burst, class) in [
        (1000.0, 10, 1),
        (10.0, 10, 1),
        (5.0, 10, 2),
        (100.0 / 60.0, 20, 3),
        (1.0, 15, 3),
        (1.0 / 3600.0, 1, 4),
    ] {
        let l = limit(rate, burst);
        assert_eq!(stored::linger_class(&l), class, "rate {rate} burst {burst}");
        assert!(stored::LINGER_MS[usize::from(class)] <= stored::MAX_LINGER_MS);
    }
}

#[test]
fn settle_charges_into_debt_and_refunds_up_to_full() {
    let l = limit(1.0, 10); // 1 token/s, burst 10
    let d = settle(&l, 25, 0, NOW).unwrap();
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_ms),
        (true, -15, Some(0))
    );
    assert_eq!(d.reset_after_ms, 25_000);
    assert!(d.changed);
    // The debt survives the next check, which says truly how long to wait.
    let refused = check(&l, 1, d.tat, NOW);
    assert!(!refused.allowed);
    assert_eq!(refused.retry_after_ms, Some(16_000));
    assert_eq!(refused.tat, d.tat, "a refusal keeps the debt");
    assert!(check(&l, 1, d.tat, NOW + 16_000 * TICKS_PER_SECOND / 1000).allowed);
    // A refund never goes past full.
    let full = settle(&l, -1_000, d.tat, NOW).unwrap();
    assert_eq!(
        (full.remaining, full.reset_after_ms, full.tat),
        (10, 0, NOW)
    );
    let full = settle(&l, i64::MIN, d.tat, NOW).unwrap();
    assert_eq!(full.tat, NOW);
    // A peek writes nothing, even on a fresh bucket.
    let peek = settle(&l, 0, 0, NOW).unwrap();
    assert!(!peek.changed);
    assert_eq!(peek.remaining, 10);
    // Refunding a full bucket changes nothing.
    assert!(!settle(&l, -3, 0, NOW).unwrap().changed);
    // Debt past the format's bound is an error, not a wrap-around.
    assert_eq!(settle(&l, i64::MAX, 0, NOW), Err(SettleError::DebtTooLarge));
    let max = (MAX_LEAD_TICKS / l.interval_ticks()) as i64;
    assert!(settle(&l, max, 0, NOW).is_ok());
    assert_eq!(settle(&l, max + 1, 0, NOW), Err(SettleError::DebtTooLarge));
}

#[test]
fn shrunk_limit_waits_exactly_what_it_says() {
    // The case from the issue: 1000 taken under burst 1000, then checked under burst 10.
    let big = limit(1.0, 1000);
    let small = limit(1.0, 10);
    let taken = check(&big, 1000, 0, NOW);
    assert!(taken.allowed);
    let d = check(&small, 1, taken.tat, NOW);
    assert_eq!((d.allowed, d.retry_after_ms), (false, Some(991_000)));
    let later = NOW + 991_000 * MS;
    assert!(check(&small, 1, taken.tat, later).allowed);
    assert!(!check(&small, 1, taken.tat, later - 1).allowed);
}

#[test]
fn a_now_at_the_end_of_time_still_limits() {
    // A caller's "far future" (`Duration::MAX`) saturates; the math neither overflows nor
    // wraps to a full bucket.
    let l = limit(1.0, 1);
    let now = ticks_since_epoch(std::time::Duration::MAX);
    let first = check(&l, 1, 0, now);
    assert!(first.allowed);
    let second = check(&l, 1, first.tat, now);
    assert_eq!(
        (second.allowed, second.retry_after_ms),
        (false, Some(1_000))
    );
    let owed = settle(&l, 5, first.tat, now).unwrap();
    assert_eq!(owed.remaining, -5);
    assert!(!check(&l, 1, owed.tat, u64::MAX).allowed);
}

#[test]
fn clock_stepping_back_is_honoured_and_truthful() {
    let l = limit(10.0, 5); // 100 ms per token
    let d = check(&l, 5, 0, NOW);
    // The clock steps back 30 s: the bucket looks 30 s further from full.
    let back = NOW - 30 * TICKS_PER_SECOND;
    let r = check(&l, 1, d.tat, back);
    assert!(!r.allowed);
    let ms = r.retry_after_ms.unwrap();
    assert_eq!(ms, 30_100);
    assert!(check(&l, 1, d.tat, back + ms * MS).allowed);
}

/// One step of a random schedule: advance the clock, then check `cost` tokens.
fn steps() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..3 * TICKS_PER_SECOND, 0u64..6), 1..200)
}

/// GCRA's guarantee over `(time, tokens admitted)` in time order: over every window
/// [t1, t2] between two entries, at most burst + rate × (t2 − t1), i.e.
/// `sum(tokens) × T <= τ + (t2 − t1)`.
fn within_limit_over_every_window(l: &Limit, admitted: &[(u64, u64)]) -> Result<(), TestCaseError> {
    for (i, &(t1, _)) in admitted.iter().enumerate() {
        let mut tokens = 0;
        for &(t2, cost) in &admitted[i..] {
            tokens += cost;
            prop_assert!(
                tokens * l.interval_ticks() <= l.refill_ticks() + (t2 - t1),
                "{tokens} tokens in {} ticks",
                t2 - t1
            );
        }
    }
    Ok(())
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
        within_limit_over_every_window(&l, &admitted)?;
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
                prop_assert_eq!(d.tat, tat.max(now));
            } else {
                prop_assert!(d.changed);
                tat = d.tat;
            }
        }
    }

    /// Waiting exactly `retry_after_ms` and retrying is admitted.
    #[test]
    fn waiting_retry_after_is_enough(
        l in limits(),
        steps in steps(),
        cost in 1u64..6,
        jitter in 0..MS,
    ) {
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
            prop_assert_eq!(at_reset.remaining, l.burst() as i64, "not full at reset");
            if d.reset_after_ms > 0 {
                let before = check(&l, 0, d.tat, d.tat - 1);
                prop_assert!(before.remaining < l.burst() as i64, "full before the TAT");
                let class = stored::linger_class(&l);
                let s = stored::encode(d.tat, class);
                let linger = stored::LINGER_MS[usize::from(class)];
                prop_assert_eq!(s.expire_at_ms - now / MS, d.reset_after_ms + linger);
                prop_assert!(linger <= stored::MAX_LINGER_MS);
                let value = s.value.to_string();
                prop_assert_eq!(stored::decode(s.expire_at_ms as i64, value.as_bytes()), Ok(d.tat));
            }
        }
    }

    /// Over every window the same bound holds when checks race on one bucket through
    /// `check_all` and the bucket is shared by two checks in one call.
    #[test]
    fn check_all_never_over_admits(l in limits(), steps in steps()) {
        let mut now = NOW;
        let mut tats = [0u64];
        let mut admitted = Vec::new();
        for (dt, cost) in steps {
            now += dt;
            let checks = [
                Check { limit: l, cost, bucket: 0 },
                Check { limit: l, cost: 1, bucket: 0 },
            ];
            let (all, _) = check_all(&checks, &mut tats, now);
            if all {
                admitted.push((now, cost + 1));
            }
        }
        within_limit_over_every_window(&l, &admitted)?;
    }
}

/// A starting TAT anywhere from long past to ten refill times ahead (debt, a shrunk limit or a
/// clock that stepped back), as a multiple of the refill time in tenths.
fn start_lead() -> impl Strategy<Value = Option<u64>> {
    prop::option::of(0u64..100)
}

fn start_tat(l: &Limit, lead: Option<u64>) -> u64 {
    lead.map_or(0, |tenths| NOW + l.refill_ticks() * tenths / 10)
}

/// Steps that either check `cost` tokens or settle a charge of `cost` more.
fn mixed_steps() -> impl Strategy<Value = Vec<(u64, u64, bool)>> {
    prop::collection::vec(
        (
            0u64..3 * TICKS_PER_SECOND,
            0u64..6,
            prop::bool::weighted(0.2),
        ),
        1..150,
    )
}

proptest! {
    /// Over every window [t1, t2] between any two steps (not only from the first admission),
    /// from any starting state and with charges settled in between, the tokens admitted by
    /// checks are at most burst + rate × (t2 − t1).
    #[test]
    fn sliding_windows_never_over_admit(
        l in limits(),
        lead in start_lead(),
        steps in mixed_steps(),
    ) {
        let mut now = NOW;
        let mut tat = start_tat(&l, lead);
        let mut log: Vec<(u64, u64)> = Vec::new(); // (time, tokens admitted by a check)
        for (dt, cost, is_settle) in steps {
            now += dt;
            if is_settle {
                tat = settle(&l, cost as i64, tat, now).unwrap().tat;
                log.push((now, 0));
            } else {
                let d = check(&l, cost, tat, now);
                if d.changed { tat = d.tat; }
                log.push((now, if d.allowed { cost } else { 0 }));
            }
        }
        within_limit_over_every_window(&l, &log)?;
    }

    /// From a TAT far ahead, waiting exactly `retry_after_ms` is enough, and not a tick less
    /// than the whole milliseconds before it.
    #[test]
    fn retry_after_is_true_from_far_ahead(
        l in limits(),
        lead in start_lead(),
        cost in 1u64..6,
        jitter in 0..MS,
    ) {
        let tat = start_tat(&l, lead);
        let now = NOW + jitter;
        let d = check(&l, cost, tat, now);
        match d.retry_after_ms {
            None => prop_assert!(cost > l.burst()),
            Some(0) => prop_assert!(d.allowed),
            Some(ms) => {
                prop_assert!(!d.allowed);
                prop_assert_eq!(d.tat, tat.max(now), "a refusal keeps the state");
                prop_assert!(check(&l, cost, tat, now + ms * MS).allowed);
                prop_assert!(!check(&l, cost, tat, now + (ms - 1) * MS).allowed);
            }
        }
    }

    /// Debt from a settle survives later checks: none is admitted before refill repaid it.
    #[test]
    fn debt_survives_checks(l in limits(), debt in 1i64..100, steps in steps()) {
        let d = settle(&l, l.burst() as i64 + debt, 0, NOW).unwrap();
        prop_assert!(d.remaining <= -debt);
        let repaid_at = NOW + (debt as u64) * l.interval_ticks();
        let mut now = NOW;
        let mut tat = d.tat;
        for (dt, cost) in steps {
            now += dt / 10;
            let c = check(&l, cost.max(1), tat, now);
            if c.allowed {
                prop_assert!(now >= repaid_at, "admitted while in debt");
                tat = c.tat;
            }
        }
    }

    /// A refund never fills the bucket past full, and a charge followed by the same refund
    /// is a no-op while the bucket stays in range.
    #[test]
    fn refunds_stop_at_full(l in limits(), lead in start_lead(), delta in 0i64..1000) {
        let tat = start_tat(&l, lead);
        let charged = settle(&l, delta, tat, NOW).unwrap();
        let back = settle(&l, -delta, charged.tat, NOW).unwrap();
        prop_assert_eq!(back.tat, tat.max(NOW));
        let refunded = settle(&l, -delta - 1_000_000, tat, NOW).unwrap();
        prop_assert!(refunded.remaining <= l.burst() as i64);
        prop_assert!(refunded.tat >= NOW);
    }

    /// Every TAT and class round-trips through the stored format, and the key never expires
    /// before the bucket is full nor later than the longest linger after it.
    #[test]
    fn stored_round_trip(tat in NOW..NOW + MAX_LEAD_TICKS, class in 0u8..5) {
        let s = stored::encode(tat, class);
        let value = s.value.to_string();
        prop_assert_eq!(stored::decode(s.expire_at_ms as i64, value.as_bytes()), Ok(tat));
        prop_assert!(s.expire_at_ms * MS >= tat);
        prop_assert!(s.expire_at_ms * MS < tat + (stored::MAX_LINGER_MS + 1) * MS);
    }
}

proptest! {
    /// `n` holders of a share, each seeing costs of at most `burst / n` tokens, admit together
    /// at most burst + rate × (t2 − t1) over every window, like one bucket of the whole limit.
    #[test]
    fn shares_together_admit_at_most_the_limit(
        l in limits(),
        parts in 1u64..12,
        steps in prop::collection::vec((0u64..TICKS_PER_SECOND, 0usize..12, 1u64..6), 1..300),
    ) {
        let share = l.share(parts);
        let most_cost = (l.burst() / parts).max(1);
        let mut tats = vec![0u64; parts as usize];
        let mut now = NOW;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (dt, holder, cost) in steps {
            now += dt;
            let holder = holder % tats.len();
            let cost = cost.min(most_cost);
            if cost * parts > l.burst() {
                continue; // above the share: bounded differently (see `Share`)
            }
            let (limit, units) = share.check_args(cost);
            let d = check(&limit, units, tats[holder], now);
            if d.allowed {
                tats[holder] = d.tat;
                admitted.push((now, cost));
            }
        }
        within_limit_over_every_window(&l, &admitted)?;
    }
}

/// Found by the `model` fuzz target: for a TAT near `u64::MAX` (a garbage key decodes to one),
/// a saturating `used + cost × T` understated the wait by about 10 000 years.
#[test]
fn retry_after_is_exact_for_a_tat_near_the_end_of_time() {
    let l = limit(5.0, 3);
    let tat = u64::MAX - 5;
    let now = NOW;
    let d = check(&l, 3, tat, now);
    let want = (u128::from(tat - now) + 3 * u128::from(l.interval_ticks())
        - u128::from(l.refill_ticks()))
    .div_ceil(u128::from(TICKS_PER_MS));
    assert_eq!(d.retry_after_ms.map(u128::from), Some(want));
}

proptest! {
    /// The clock conversion is the exact floor of nanoseconds ÷ 100, saturating.
    #[test]
    fn ticks_are_nanoseconds_over_100(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
        let d = std::time::Duration::new(secs, nanos);
        let exact = u64::try_from(d.as_nanos() / 100).unwrap_or(u64::MAX);
        prop_assert_eq!(ticks_since_epoch(d), exact);
    }
}
