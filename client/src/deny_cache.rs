//! In-process cache of buckets known to be exhausted: until their retry-after, a request
//! for at least the same cost, under the same limit, is refused without a round trip.
//!
//! The limit is part of the entry: a bucket refused under one limit says nothing of another
//! (the same key checked by a policy listed twice, or a limit raised by a deploy), so a
//! raised daily limit is not refused for the old limit's hours.
//!
//! Bounded: 16 shards of at most `capacity / 16` entries each. A full shard drops an arbitrary
//! entry, and its expired ones with it when that is cheap (below 64 entries, or on about one
//! insert in 64); memory stays flat under millions of distinct keys, and forgetting an entry
//! only costs a round trip. A refund forgets the bucket's entry (tokens are back).

use redis_ratelimit_core::Limit;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64;

const SHARDS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The bucket has `cost` tokens again at this instant.
    until: Instant,
    cost: u64,
    /// The limit the store refused under.
    limit: Limit,
    /// The bucket is full again at this instant.
    reset: Instant,
}

/// A hit: the request is refused for this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hit {
    pub(crate) retry_after: Duration,
    pub(crate) reset_after: Duration,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct DenyCache {
    shards: Vec<Mutex<HashMap<Box<str>, Entry>>>,
    per_shard: usize,
}

impl DenyCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS),
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Entry>> {
        let i = (xxh3_64(key.as_bytes()) % SHARDS as u64) as usize;
        // Entries are plain values: a poisoned shard is still consistent.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Is `cost` from `key` under `limit` known to be refused at `now`?
    pub(crate) fn get(&self, key: &str, limit: Limit, cost: u64, now: Instant) -> Option<Hit> {
        if self.per_shard == 0 || cost == 0 {
            return None;
        }
        let mut shard = self.shard(key);
        let e = *shard.get(key)?;
        if now >= e.until {
            shard.remove(key);
            return None;
        }
        // Fewer tokens than the refused cost may already be there.
        (cost >= e.cost && limit == e.limit).then(|| Hit {
            retry_after: e.until - now,
            reset_after: e.reset.saturating_duration_since(now),
        })
    }

    /// Remembers that `cost` from `key` under `limit` is refused until `now + retry_after`.
    pub(crate) fn insert(
        &self,
        key: &str,
        limit: Limit,
        cost: u64,
        now: Instant,
        retry_after: Duration,
        reset_after: Duration,
    ) {
        if self.per_shard == 0 || retry_after.is_zero() {
            return;
        }
        let entry = Entry {
            until: now + retry_after,
            cost,
            limit,
            reset: now + reset_after,
        };
        let mut shard = self.shard(key);
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            // Drop one arbitrary entry, expired ones with it when it is cheap: a full scan
            // on every insert would make a cache full of live entries slow to update.
            if let Some(victim) = shard.keys().next().cloned() {
                shard.remove(&victim);
            }
            if shard.len() < 64 || xxh3_64(key.as_bytes()).is_multiple_of(64) {
                shard.retain(|_, e| e.until > now);
            }
        }
        shard.insert(key.into(), entry);
    }

    /// Forgets `key`'s refusal: tokens went back into its bucket (a refund).
    pub(crate) fn forget(&self, key: &str) {
        if self.per_shard > 0 {
            self.shard(key).remove(key);
        }
    }

    /// Entries held (expired ones included until they are next touched).
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map_or(0, |s| s.len()))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn limit() -> Limit {
        Limit::new(1.0, 5).unwrap()
    }

    #[test]
    fn hits_until_retry_after_for_same_or_larger_cost() {
        let c = DenyCache::new(100);
        let t0 = Instant::now();
        let l = limit();
        c.insert("k", l, 2, t0, S, 3 * S);
        assert_eq!(
            c.get("k", l, 2, t0),
            Some(Hit {
                retry_after: S,
                reset_after: 3 * S
            })
        );
        assert!(c.get("k", l, 5, t0).is_some());
        assert_eq!(c.get("k", l, 1, t0), None, "a smaller cost may fit");
        assert_eq!(c.get("other", l, 2, t0), None);
        assert_eq!(c.get("k", l, 2, t0 + S), None, "expired at retry-after");
        assert_eq!(c.len(), 0, "expired entry dropped");
    }

    #[test]
    fn a_forgotten_refusal_asks_the_store_again() {
        let c = DenyCache::new(100);
        let t0 = Instant::now();
        c.insert("k", limit(), 1, t0, S, S);
        c.insert("j", limit(), 1, t0, S, S);
        c.forget("k");
        assert_eq!(c.get("k", limit(), 1, t0), None);
        assert!(
            c.get("j", limit(), 1, t0).is_some(),
            "only that key forgotten"
        );
    }

    #[test]
    fn a_refusal_under_one_limit_says_nothing_of_another() {
        let c = DenyCache::new(100);
        let t0 = Instant::now();
        let day = Limit::new(1.0 / 86_400.0, 1).unwrap();
        c.insert("k", day, 1, t0, 86_400 * S, 86_400 * S);
        assert!(c.get("k", day, 1, t0).is_some());
        let raised = Limit::new(1.0 / 86_400.0, 100).unwrap();
        assert_eq!(
            c.get("k", raised, 1, t0),
            None,
            "a raised limit asks the store"
        );
    }

    #[test]
    fn stays_within_its_bound_under_many_keys() {
        let c = DenyCache::new(1_000);
        let t0 = Instant::now();
        for i in 0..200_000 {
            c.insert(&format!("key{i}"), limit(), 1, t0, S, S);
        }
        assert!(c.len() <= 1_000 + SHARDS, "{} entries", c.len());
        // The newest entry is always kept.
        assert!(c.get("key199999", limit(), 1, t0).is_some());
    }
}
