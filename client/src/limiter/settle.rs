//! Settling a reservation: each group of buckets (one per slot on a cluster) on its own
//! node, through that node's breaker, all at once; a group whose node cannot be asked, or
//! does not answer in time, is settled on the local buckets alone.

use super::{now_ticks, Limiter};
use crate::breaker::Admission;
use crate::error::StoreError;
use crate::reservation::Held;
use crate::store::{Reply, SettleItem};
use crate::{Decision, Error, FailMode, PolicyOutcome, Source, Verdict};
use std::time::{Duration, Instant};

/// How one group's call ended.
enum Settled {
    /// Applied by the store: one reply per bucket of the group.
    Store(Vec<Reply>),
    /// Not applied by the store as far as this pod knows (not asked, or no answer in
    /// time): the local buckets take it.
    Local,
    /// Refused by the store (it answered with an error): not applied anywhere.
    Refused(Error),
}

impl Limiter {
    /// Settles `deltas` (one per held policy) against the store, each group of buckets on
    /// its node, or the local buckets for the groups whose node cannot be asked. A refusal
    /// is returned once every group has ended; the others stay settled.
    pub(crate) async fn settle_held(
        &self,
        held: &[Held],
        deltas: &[i64],
    ) -> Result<Decision, Error> {
        let store = &self.inner.store;
        let items: Vec<SettleItem<'_>> = held
            .iter()
            .zip(deltas)
            .map(|(h, &delta)| SettleItem {
                key: &h.key,
                rate: h.policy.bucket_rate_arg(),
                burst: h.policy.bucket_limit().burst(),
                delta,
            })
            .collect();
        let groups = store.settle_groups(&items);
        // One deadline for all: the groups are asked at once, each node's answer (or
        // silence) its own.
        let deadline = Instant::now() + self.inner.timeout;
        let settled = futures_util::future::join_all(groups.iter().map(|at| {
            let part: Vec<SettleItem<'_>> =
                at.iter().filter_map(|&i| items.get(i).copied()).collect();
            async move { self.settle_group(&part, deadline).await }
        }))
        .await;

        let mut from_store: Vec<Option<Reply>> = vec![None; held.len()];
        let mut local = Vec::new();
        let mut refused = None;
        for (at, s) in groups.into_iter().zip(settled) {
            match s {
                Settled::Store(replies) => {
                    for (i, reply) in at.into_iter().zip(replies) {
                        if let Some(slot) = from_store.get_mut(i) {
                            *slot = Some(reply);
                        }
                    }
                }
                Settled::Local => local.extend(at),
                Settled::Refused(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        local.sort_unstable();
        let locally = self.settle_locally(held, deltas, &local);
        if let Some(e) = refused {
            return Err(e);
        }
        let mut any_open = false;
        let mut locally = locally.into_iter();
        let outcomes: Vec<PolicyOutcome> = held
            .iter()
            .zip(&from_store)
            .enumerate()
            .map(|(i, (h, reply))| {
                let (remaining, reset_ms) = match reply {
                    Some([_, remaining, _, reset_ms]) => {
                        // A sub-bucket holds 1/shards of the policy: scale back.
                        let shards = u64::from(h.policy.shards());
                        let remaining = (*remaining).max(0).unsigned_abs() * shards;
                        (remaining, (*reset_ms).max(0).unsigned_abs())
                    }
                    None if local.binary_search(&i).is_ok() => match locally.next() {
                        Some(Some((remaining, reset_ms))) => {
                            any_open = true;
                            (remaining, reset_ms)
                        }
                        _ => (0, 0),
                    },
                    // Refused: nothing applied.
                    None => (0, 0),
                };
                PolicyOutcome {
                    policy: h.policy.clone(),
                    verdict: Verdict::Allowed,
                    remaining,
                    reset_after: Duration::from_millis(reset_ms),
                }
            })
            .collect();
        let source = match (local.is_empty(), any_open) {
            (true, _) => Source::Store,
            (false, true) => Source::LocalFallback,
            (false, false) => Source::FailClosed,
        };
        Decision::from_outcomes(outcomes, source)
            .ok_or_else(|| Error::Config("a settlement needs at least one policy".into()))
    }

    /// Settles one group on its node (following one `MOVED`), within `deadline`.
    async fn settle_group(&self, part: &[SettleItem<'_>], deadline: Instant) -> Settled {
        let store = &self.inner.store;
        let Some(mut node) = part.first().and_then(|i| store.route(i.key)) else {
            metrics::counter!("ratelimit_store_errors_total", "kind" => "transport").increment(1);
            return Settled::Local;
        };
        let mut redirected = false;
        loop {
            let admitted = Instant::now();
            // Out of time (after a redirection): the next node is neither asked nor blamed.
            if admitted >= deadline {
                return Settled::Local;
            }
            if let Admission::Reject(_) = node.breaker.admit(admitted) {
                return Settled::Local;
            }
            let asked =
                tokio::time::timeout_at(deadline.into(), store.settle_on(&node, part)).await;
            let e = match asked.unwrap_or(Err(StoreError::Timeout)) {
                Ok(replies) => {
                    self.store_answered(&node, Instant::now());
                    return Settled::Store(replies);
                }
                Err(e) => e,
            };
            if !redirected {
                if let Some(to) = store.redirect(&node, &e) {
                    // The old owner answered, with a redirection: it is up.
                    self.store_answered(&node, Instant::now());
                    node = to;
                    redirected = true;
                    continue;
                }
            }
            if e.is_transient() {
                self.store_failed(&node, admitted, &e);
                return Settled::Local;
            }
            return Settled::Refused(self.store_refused(&node, e, admitted));
        }
    }

    /// Settles `held[i]` for each `i` in `at` (ascending) on the local buckets: fail-open
    /// policies on the one their checks fall back to; fail-closed ones refuse every check
    /// meanwhile, so their settlement is dropped and counted. Returns, per `i`, the local
    /// bucket's remaining tokens and reset in ms, or `None` where it was dropped.
    fn settle_locally(
        &self,
        held: &[Held],
        deltas: &[i64],
        at: &[usize],
    ) -> Vec<Option<(u64, u64)>> {
        let settles_locally =
            |h: &Held| h.policy.fail_mode() == FailMode::Open && self.inner.local_fallback;
        let mut open = Vec::new();
        for &i in at {
            let (Some(h), Some(&delta)) = (held.get(i), deltas.get(i)) else {
                continue;
            };
            if settles_locally(h) {
                let key = h.whole_key.as_deref().unwrap_or(&h.key);
                open.push((key, self.local_share(&h.policy), delta));
            } else {
                metrics::counter!("ratelimit_settle_dropped_total").increment(1);
            }
        }
        if open.is_empty() {
            return vec![None; at.len()];
        }
        let mut local = self.inner.local.settle(&open, now_ticks()).into_iter();
        at.iter()
            .map(|&i| {
                held.get(i).filter(|h| settles_locally(h))?;
                let d = local.next()?;
                Some((d.remaining.max(0).unsigned_abs(), d.reset_after_ms))
            })
            .collect()
    }
}
