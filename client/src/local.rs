//! The per-pod fallback: while the store cannot be asked, fail-open policies are checked
//! against local buckets holding one pod's [`Share`] of the limit (rate and burst ÷ pods,
//! counted in fractions of a token), with the same core math as the module, so N pods
//! together admit at most the global limit rather than N times it.
//!
//! Bounded: at most `capacity` buckets. Full buckets carry no state and are dropped first;
//! if every bucket is active, a new subject is checked against a fresh bucket that is not
//! kept (counted in `ratelimit_local_overflow_total`).

use redis_ratelimit_core::{check_all, settle, Check, Decision, Share};
use std::collections::HashMap;
use std::sync::Mutex;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct LocalBuckets {
    tats: Mutex<Buckets>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Buckets {
    tats: HashMap<Box<str>, u64>,
    /// When full buckets were last swept out (ticks): a sweep scans every bucket, so a map
    /// full of active buckets is swept at most once per [`SWEEP_EVERY`], not per insert.
    swept_at: u64,
}

/// 10 ms, in ticks.
const SWEEP_EVERY: u64 = 100_000;

impl LocalBuckets {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            tats: Mutex::new(Buckets::default()),
            capacity,
        }
    }

    /// Checks `(key, share, cost)` all-or-nothing at `now` (ticks), as `RL.CHECKALL` would.
    /// Decisions count whole tokens.
    pub(crate) fn check(&self, items: &[(&str, Share, u64)], now: u64) -> (bool, Vec<Decision>) {
        let mut guard = self.tats.lock().unwrap_or_else(|p| p.into_inner());
        let Buckets {
            tats: map,
            swept_at,
        } = &mut *guard;
        let mut keys: Vec<&str> = Vec::with_capacity(items.len());
        let mut checks = Vec::with_capacity(items.len());
        for &(key, share, cost) in items {
            let bucket = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                keys.push(key);
                keys.len() - 1
            });
            let (limit, cost) = share.check_args(cost);
            checks.push(Check {
                limit,
                cost,
                bucket,
            });
        }
        let mut tats: Vec<u64> = keys
            .iter()
            .map(|k| map.get(*k).copied().unwrap_or(0))
            .collect();
        let before = tats.clone();
        let (all, mut decisions) = check_all(&checks, &mut tats, now);
        for ((d, (_, share, _)), c) in decisions.iter_mut().zip(items).zip(&checks) {
            d.remaining = share.remaining(&c.limit, d.remaining);
        }
        for ((key, tat), old) in keys.iter().zip(tats).zip(before) {
            if tat == old {
                continue;
            }
            if map.len() >= self.capacity && !map.contains_key(*key) {
                if now.saturating_sub(*swept_at) >= SWEEP_EVERY {
                    map.retain(|_, t| *t > now);
                    *swept_at = now;
                }
                if map.len() >= self.capacity {
                    metrics::counter!("ratelimit_local_overflow_total").increment(1);
                    continue;
                }
            }
            map.insert((*key).into(), tat);
        }
        (all, decisions)
    }

    /// Settles `(key, share, delta)` at `now`, as `RL.SETTLE` would; a debt beyond the
    /// format's bound is capped there rather than refused (the work was done either way).
    pub(crate) fn settle(&self, items: &[(&str, Share, i64)], now: u64) -> Vec<Decision> {
        let mut guard = self.tats.lock().unwrap_or_else(|p| p.into_inner());
        let map = &mut guard.tats;
        items
            .iter()
            .map(|&(key, share, delta)| {
                let (limit, delta) = share.settle_args(delta);
                let tat = map.get(key).copied().unwrap_or(0);
                let d = settle(&limit, delta, tat, now).unwrap_or_else(|_| {
                    let most = redis_ratelimit_core::MAX_LEAD_TICKS / limit.interval_ticks();
                    let room =
                        most.saturating_sub(tat.saturating_sub(now) / limit.interval_ticks());
                    settle(&limit, room as i64, tat, now)
                        .unwrap_or_else(|_| redis_ratelimit_core::check(&limit, 0, tat, now))
                });
                if d.changed && (map.len() < self.capacity || map.contains_key(key)) {
                    map.insert(key.into(), d.tat);
                }
                Decision {
                    remaining: share.tokens(d.remaining),
                    ..d
                }
            })
            .collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tats.lock().map_or(0, |m| m.tats.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis_ratelimit_core::{Limit, TICKS_PER_SECOND};

    #[test]
    fn admits_the_pod_share_then_refuses() {
        let local = LocalBuckets::new(10);
        // 100/min burst 20 over 4 pods: 5 per pod at once.
        let share = Limit::new(100.0 / 60.0, 20).unwrap().share(4);
        let now = 1_700_000_000 * TICKS_PER_SECOND;
        let admitted = (0..10)
            .filter(|_| local.check(&[("k", share, 1)], now).0)
            .count();
        assert_eq!(admitted, 5);
    }

    #[test]
    fn stays_bounded() {
        let local = LocalBuckets::new(100);
        let l = Limit::new(1.0, 5).unwrap().share(1);
        let now = 1_700_000_000 * TICKS_PER_SECOND;
        for i in 0..10_000 {
            assert!(local.check(&[(&format!("k{i}"), l, 1)], now).0);
        }
        assert!(local.len() <= 100);
    }

    #[test]
    fn a_cost_above_the_pod_share_gets_a_retry_after() {
        // burst 20 over 10 pods: 2 tokens a pod. A cost of 3 passes on a full bucket; then
        // it waits for the bucket to be full again, 3 tokens at a tenth of 100/min.
        let local = LocalBuckets::new(10);
        let share = Limit::new(100.0 / 60.0, 20).unwrap().share(10);
        let now = 1_700_000_000 * TICKS_PER_SECOND;
        let (ok, d) = local.check(&[("k", share, 3)], now);
        assert!(ok);
        assert_eq!(d[0].remaining, -1, "one token of debt");
        let (ok, d) = local.check(&[("k", share, 3)], now);
        assert!(!ok);
        assert_eq!(d[0].retry_after_ms, Some(18_000));
        assert!(
            local
                .check(&[("k", share, 3)], now + 18 * TICKS_PER_SECOND)
                .0
        );
    }
}
