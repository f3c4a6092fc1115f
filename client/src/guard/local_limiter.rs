//! A per-process limiter: the module's exact bucket math on a bounded in-memory map.

use crate::local::LocalBuckets;
use crate::{Decision, Policy, PolicyOutcome, Source, Verdict};
use redis_ratelimit_core::ticks_since_epoch;
use std::fmt;
use std::time::{Duration, Instant};

/// Buckets kept by default: beyond this, full buckets are dropped first, then new keys are
/// checked against a fresh bucket that is not kept.
pub const DEFAULT_CAPACITY: usize = 100_000;

/// A [`Policy`] enforced inside this process, per key, with no store: for limits that are
/// about this process's own resources (an expensive dependency it calls) rather than a
/// client's global quota.
///
/// The same exact integer GCRA as `RL.CHECK` (`redis_ratelimit_core::check`), so "10 per
/// second, burst 10" admits exactly 10 at once and one more every 100 ms. Memory is bounded
/// (see [`with_capacity`](Self::with_capacity)); a full bucket carries no state. The policy's
/// fail mode and shards do not apply: nothing here can fail or be hot.
///
/// ```
/// use redis_ratelimit_client::guard::LocalLimiter;
/// use redis_ratelimit_client::Policy;
/// use std::time::Duration;
///
/// let sms = LocalLimiter::new(Policy::builder("sms").per_second(10).burst(10).build().unwrap());
/// let t0 = Duration::ZERO;
/// assert!((0..10).all(|_| sms.check_at("", 1, t0).is_allowed()));
/// let d = sms.check_at("", 1, t0);
/// assert_eq!(d.retry_after(), Some(Duration::from_millis(100)));
/// assert!(sms.check_at("", 1, t0 + Duration::from_millis(100)).is_allowed());
/// ```
pub struct LocalLimiter {
    policy: Policy,
    buckets: LocalBuckets,
    origin: Instant,
}

impl fmt::Debug for LocalLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimiter")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl LocalLimiter {
    /// A limiter for `policy` keeping at most [`DEFAULT_CAPACITY`] buckets.
    pub fn new(policy: Policy) -> Self {
        Self::with_capacity(policy, DEFAULT_CAPACITY)
    }

    /// A limiter for `policy` keeping at most `capacity` buckets (at least 1).
    pub fn with_capacity(policy: Policy, capacity: usize) -> Self {
        Self {
            policy,
            buckets: LocalBuckets::new(capacity.max(1)),
            origin: Instant::now(),
        }
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Takes `cost` tokens from `key`'s bucket if they are there, now (a monotonic clock
    /// started with the limiter). Use one key, such as `""`, for a limit on the whole process.
    pub fn check(&self, key: &str, cost: u64) -> Decision {
        self.check_at(key, cost, self.origin.elapsed())
    }

    /// [`check`](Self::check) at `now`, a time since any fixed origin (the same for every
    /// call on this limiter): for tests and simulations with a manual clock.
    pub fn check_at(&self, key: &str, cost: u64, now: Duration) -> Decision {
        // The whole limit: this process is its only holder.
        let share = self.policy.limit().share(1);
        let (_, decisions) = self
            .buckets
            .check(&[(key, share, cost)], ticks_since_epoch(now));
        let d = decisions.first().copied();
        let verdict = match d.map(|d| (d.allowed, d.retry_after_ms)) {
            Some((true, _)) => Verdict::Allowed,
            Some((false, Some(ms))) => Verdict::Denied {
                retry_after: Duration::from_millis(ms),
            },
            _ => Verdict::ExceedsBurst,
        };
        let allowed = verdict.is_allowed();
        metrics::counter!(
            "guard_local_decisions_total",
            "policy" => self.policy.name().to_string(),
            "allowed" => if allowed { "true" } else { "false" },
        )
        .increment(1);
        let outcome = PolicyOutcome {
            policy: self.policy.clone(),
            verdict,
            remaining: d.map_or(0, |d| d.remaining.max(0) as u64),
            reset_after: Duration::from_millis(d.map_or(0, |d| d.reset_after_ms)),
        };
        Decision {
            verdict,
            source: Source::Local,
            policy: self.policy.clone(),
            remaining: outcome.remaining,
            reset_after: outcome.reset_after,
            outcomes: vec![outcome],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sms() -> LocalLimiter {
        LocalLimiter::with_capacity(
            Policy::builder("sms")
                .per_second(10)
                .burst(10)
                .build()
                .unwrap(),
            100,
        )
    }

    #[test]
    fn admits_the_burst_then_one_per_interval() {
        let l = sms();
        let ms = Duration::from_millis;
        // 50 requests evenly over one second: at most 10 + 10 t.
        let admitted: Vec<u64> = (0..50)
            .map(|i| ms(i * 20))
            .filter(|t| l.check_at("", 1, *t).is_allowed())
            .map(|t| t.as_millis() as u64)
            .collect();
        assert_eq!(admitted.len(), 10 + 9, "{admitted:?}");
        assert!(admitted[..10].iter().all(|t| *t < 200), "{admitted:?}");
        let d = l.check_at("", 1, ms(980));
        assert_eq!(d.source, Source::Local);
        assert_eq!(d.remaining, 0);
        assert!(d.retry_after().is_some_and(|r| r <= ms(100)));
    }

    #[test]
    fn keys_are_separate_and_costs_weigh() {
        let l = sms();
        let t = Duration::ZERO;
        assert!(l.check_at("a", 7, t).is_allowed());
        assert!(!l.check_at("a", 4, t).is_allowed());
        assert_eq!(l.check_at("b", 4, t).remaining, 6);
        assert_eq!(l.check_at("a", 11, t).verdict, Verdict::ExceedsBurst);
    }

    #[test]
    fn a_full_map_still_answers_new_keys() {
        // Capacity 100, every bucket active: a new key gets a fresh bucket that is not kept
        // (the bound itself is tested in `local`).
        let l = sms();
        let t = Duration::from_secs(5);
        assert!((0..1_000).all(|i| l.check_at(&format!("k{i}"), 2, t).remaining == 8));
    }
}
