//! One of `n` equal shares of a limit, for holders that cannot coordinate: the pods of a
//! service answering from local buckets while the store is unreachable.
//!
//! Splitting the burst into whole tokens (`burst / n` each, at least one) goes wrong two
//! ways: a request costing more than `burst / n` can never pass, and with `n > burst` every
//! holder still gets a whole token, so together they admit more than the burst. A share
//! counts in units of `1/n` token instead: a capacity of `burst` units and one unit back
//! every interval of the whole limit, so `n` holders together refill at the limit's rate and
//! hold its burst, exactly, fractions included. Over any window of `t`, holders that only see
//! costs of at most `burst / n` tokens admit at most `burst + rate × t` between them.
//!
//! A cost above `burst / n` tokens (or any cost when `n > burst`) is admitted only when the
//! holder's bucket is full, and runs it into debt for the rest: it waits its turn with an
//! honest Retry-After rather than never passing. Together the holders then admit at most
//! `max(burst, n × cost) + rate × t`.

use crate::Limit;

/// See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Share {
    /// Counted in units: interval per unit, capacity in units.
    units: Limit,
    parts: u64,
}

impl Limit {
    /// One of `parts` shares (see [`Share`]); `parts` 0 counts as 1.
    pub fn share(&self, parts: u64) -> Share {
        Share {
            units: *self,
            parts: parts.max(1),
        }
    }
}

impl Share {
    /// The limit and cost in units to check `cost` tokens with (core [`check`](crate::check)).
    /// A cost above the whole limit's burst, or so large that its refill at the share's
    /// rate would pass [`Limit::MAX_REFILL_TICKS`] (years), is refused as never passing.
    pub fn check_args(&self, cost: u64) -> (Limit, u64) {
        let units = cost.saturating_mul(self.parts);
        let burst = units.max(self.units.burst);
        match burst.checked_mul(self.units.interval) {
            Some(tau) if tau <= Limit::MAX_REFILL_TICKS && cost <= self.units.burst => (
                Limit {
                    interval: self.units.interval,
                    burst,
                },
                units,
            ),
            _ => (self.units, units),
        }
    }

    /// Whole tokens left in the share (rounded down, so a debt stays a debt), from the
    /// `remaining` units of a check made with `limit` (from [`check_args`](Self::check_args)).
    pub fn remaining(&self, limit: &Limit, remaining: i64) -> i64 {
        let raised = i64::try_from(limit.burst - self.units.burst.min(limit.burst)).unwrap_or(0);
        self.tokens(remaining.saturating_sub(raised))
    }

    /// The limit and delta in units to settle `delta` tokens with (core
    /// [`settle`](crate::settle)): refunds stop at the share's capacity.
    pub fn settle_args(&self, delta: i64) -> (Limit, i64) {
        let parts = i64::try_from(self.parts).unwrap_or(i64::MAX);
        (self.units, delta.saturating_mul(parts))
    }

    /// Whole tokens in `units` (rounded down, so a debt stays a debt), e.g. the `remaining`
    /// of a settle.
    pub fn tokens(&self, units: i64) -> i64 {
        units.div_euclid(i64::try_from(self.parts).unwrap_or(i64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{check, TICKS_PER_SECOND};

    const NOW: u64 = 1_700_000_000 * TICKS_PER_SECOND;

    /// Requests of `cost` one holder of `share` admits at once from a full bucket.
    fn admitted_at_once(share: &Share, cost: u64) -> u64 {
        let (limit, units) = share.check_args(cost);
        let mut tat = 0;
        let mut n = 0;
        loop {
            let d = check(&limit, units, tat, NOW);
            if !d.allowed {
                return n;
            }
            tat = d.tat;
            n += 1;
        }
    }

    #[test]
    fn one_part_is_the_limit_itself() {
        let l = Limit::new(100.0 / 60.0, 20).unwrap();
        let s = l.share(1);
        assert_eq!(s.check_args(3), (l, 3));
        assert_eq!(admitted_at_once(&s, 1), 20);
    }

    #[test]
    fn holders_together_hold_the_burst() {
        let l = Limit::new(100.0 / 60.0, 20).unwrap();
        assert_eq!(admitted_at_once(&l.share(4), 1), 5);
        // 20 over 3: 6.67 each, 6 whole requests; the fraction is kept, not lost.
        assert_eq!(admitted_at_once(&l.share(3), 1), 6);
    }

    #[test]
    fn a_cost_above_the_share_waits_for_a_full_bucket_instead_of_never_passing() {
        // burst 20 over 10 pods: 2 tokens each; a cost of 3 passes on a full bucket only.
        let l = Limit::new(100.0 / 60.0, 20).unwrap();
        let s = l.share(10);
        assert_eq!(admitted_at_once(&s, 3), 1);
        let (limit, units) = s.check_args(1);
        let first = check(&limit, units, 0, NOW);
        assert!(first.allowed);
        let (big, big_units) = s.check_args(3);
        let d = check(&big, big_units, first.tat, NOW);
        assert!(!d.allowed);
        assert_eq!(s.remaining(&big, d.remaining), 1, "one of two tokens left");
        // Full again once the one token taken is back, at a tenth of 100/min: 6 s.
        assert_eq!(d.retry_after_ms, Some(6_000));
        let later = NOW + 6 * TICKS_PER_SECOND;
        assert!(check(&big, big_units, first.tat, later).allowed);
    }

    #[test]
    fn a_cost_above_the_whole_burst_never_passes() {
        let l = Limit::new(1.0, 5).unwrap();
        for parts in [1, 3] {
            let (limit, units) = l.share(parts).check_args(6);
            let d = check(&limit, units, 0, NOW);
            assert_eq!((d.allowed, d.retry_after_ms), (false, None));
        }
    }

    #[test]
    fn more_holders_than_tokens_admit_one_each_when_full() {
        let l = Limit::new(1.0, 5).unwrap();
        let s = l.share(10);
        assert_eq!(admitted_at_once(&s, 1), 1);
        let (limit, units) = s.check_args(1);
        let d = check(&limit, units, 0, NOW);
        // Ten holders at 1/10 token per second: a whole token every 10 s.
        assert_eq!(
            check(&limit, units, d.tat, NOW).retry_after_ms,
            Some(10_000)
        );
    }

    #[test]
    fn settles_count_in_units_and_report_tokens() {
        let l = Limit::new(1.0, 20).unwrap();
        let s = l.share(4);
        let (limit, delta) = s.settle_args(7);
        assert_eq!((limit.burst(), delta), (20, 28));
        let d = crate::settle(&limit, delta, 0, NOW).unwrap();
        assert_eq!(s.tokens(d.remaining), -2, "5 tokens held, 7 charged");
    }

    #[test]
    fn a_cost_beyond_the_format_never_passes_instead_of_overflowing() {
        let l = Limit::new(1.0 / 86_400.0, 1000).unwrap();
        for (parts, cost) in [(1_000_000, 1000), (u64::MAX, u64::MAX)] {
            let (limit, units) = l.share(parts).check_args(cost);
            let d = check(&limit, units, 0, NOW);
            assert_eq!((d.allowed, d.retry_after_ms), (false, None));
        }
    }
}
