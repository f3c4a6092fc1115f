//! Settling a reservation: each node asked at once for its buckets, through its own
//! breaker (one admission per node, whatever its number of slots); the buckets of a node
//! that cannot be asked, or does not answer in time, are settled on the local buckets alone.

use super::{now_ticks, refusal, Limiter};
use crate::breaker::Admission;
use crate::error::StoreError;
use crate::node::Node;
use crate::reservation::Held;
use crate::store::{Reply, SettleItem};
use crate::{Decision, Error, FailMode, PolicyOutcome, Source, Verdict};
use futures_util::future::join_all;
use redis_ratelimit_core::{Limit, MAX_LEAD_TICKS};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How one slot group's call ended.
enum Settled {
    /// Applied by the store: one reply per bucket of the group.
    Store(Vec<Reply>),
    /// Not applied by the store as far as this pod knows (not asked, or no answer in
    /// time): the local buckets take it.
    Local,
    /// Refused by the store (it answered with an error): not applied anywhere.
    Refused(Error),
}

/// Slot groups (by index) on the node that serves them.
type ByNode = Vec<(Arc<Node>, Vec<usize>)>;

impl Limiter {
    /// Settles `deltas` (one per held policy) where the estimates were taken: with
    /// `at_store`, against the store, each node's buckets on it, or on the local buckets for
    /// the nodes that cannot be asked; otherwise (the local fallback admitted them) on the
    /// local buckets alone, even if the store is back, since it never took the estimates. A
    /// refusal is returned once every node has answered or timed out; the rest stays settled.
    pub(crate) async fn settle_held(
        &self,
        held: &[Held],
        deltas: &[i64],
        at_store: bool,
    ) -> Result<Decision, Error> {
        let store = &self.inner.store;
        let items: Vec<SettleItem<'_>> = held
            .iter()
            .zip(deltas)
            .map(|(h, &delta)| SettleItem {
                key: &h.key,
                rate: h.policy.bucket_rate_arg(),
                burst: h.policy.bucket_limit().burst(),
                delta: delta.min(deepest_charge(h.policy.bucket_limit())),
            })
            .collect();
        let at_groups = store.settle_groups(&items);
        let groups: Vec<Vec<SettleItem<'_>>> = at_groups
            .iter()
            .map(|at| at.iter().filter_map(|&i| items.get(i).copied()).collect())
            .collect();
        let settled = if at_store {
            self.settle_groups(&groups).await
        } else {
            groups.iter().map(|_| Settled::Local).collect()
        };

        // Back from groups to items, in the order of `items` (groups keep it within).
        let mut per_item: Vec<Option<Reply>> = vec![None; held.len()];
        let mut local = Vec::new();
        let mut refused = None;
        for (at, s) in at_groups.into_iter().zip(settled) {
            match s {
                Settled::Store(replies) => {
                    for (i, reply) in at.into_iter().zip(replies) {
                        set(&mut per_item, i, reply);
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
        // A refund puts tokens back wherever it went: a cached refusal no longer holds.
        for (h, _) in held.iter().zip(deltas).filter(|(_, &d)| d < 0) {
            self.inner.deny.forget(&h.key);
        }
        if let Some(e) = refused {
            return Err(e);
        }
        let mut any_open = false;
        let mut locally = locally.into_iter();
        let outcomes: Vec<PolicyOutcome> = held
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let (remaining, reset_ms) = match per_item.get(i).copied().flatten() {
                    Some([_, remaining, _, reset_ms]) => {
                        // A sub-bucket holds 1/shards of the policy: scale back.
                        let shards = u64::from(h.policy.shards());
                        let remaining = remaining.max(0).unsigned_abs() * shards;
                        (remaining, reset_ms.max(0).unsigned_abs())
                    }
                    // Every item not from the store is in `local` (a refusal returned
                    // above), in order.
                    None => match locally.next().flatten() {
                        Some(local) => {
                            any_open = true;
                            local
                        }
                        None => (0, 0),
                    },
                };
                PolicyOutcome {
                    policy: h.policy.clone(),
                    verdict: Verdict::Allowed,
                    remaining,
                    reset_after: Duration::from_millis(reset_ms),
                }
            })
            .collect();
        // Partly from the store, partly local: the weaker source is reported. Items off the
        // store that no local bucket took were dropped: fail-closed policies, or fail-open
        // ones with the local fallback off (which keeps no buckets).
        let open = local
            .iter()
            .filter_map(|&i| held.get(i))
            .any(|h| h.policy.fail_mode() == FailMode::Open);
        let source = match (local.is_empty(), any_open, open) {
            (true, _, _) => Source::Store,
            (false, true, _) => Source::LocalFallback,
            (false, false, true) => Source::FailOpen,
            (false, false, false) => Source::FailClosed,
        };
        Decision::from_outcomes(outcomes, source)
            .ok_or_else(|| Error::Config("a settlement needs at least one policy".into()))
    }

    /// Settles each slot group on its node, every node at once within one deadline,
    /// following one `MOVED` per group.
    async fn settle_groups(&self, groups: &[Vec<SettleItem<'_>>]) -> Vec<Settled> {
        let store = &self.inner.store;
        let deadline = Instant::now() + self.inner.timeout;
        let mut settled: Vec<Option<Settled>> = groups.iter().map(|_| None).collect();
        let mut by_node: ByNode = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            match group.first().and_then(|i| store.route(i.key)) {
                Some(node) => add(&mut by_node, node, g),
                None => {
                    metrics::counter!("ratelimit_store_errors_total", "kind" => "transport")
                        .increment(1);
                    set(&mut settled, g, Settled::Local);
                }
            }
        }
        for round in 0..2 {
            let answers = join_all(
                by_node
                    .iter()
                    .map(|(node, gs)| self.call_node(node, groups, gs, deadline)),
            )
            .await;
            let mut moved: ByNode = Vec::new();
            for ((node, gs), answers) in by_node.iter().zip(answers) {
                for (&g, answer) in gs.iter().zip(answers) {
                    let to = match &answer {
                        Err(e) if round == 0 => store.redirect(node, e),
                        _ => None,
                    };
                    match (to, answer) {
                        (Some(to), _) => add(&mut moved, to, g),
                        (None, Ok(replies)) => set(&mut settled, g, Settled::Store(replies)),
                        (None, Err(e)) if e.is_transient() => set(&mut settled, g, Settled::Local),
                        (None, Err(e)) => set(&mut settled, g, Settled::Refused(refusal(e))),
                    }
                }
            }
            by_node = moved;
        }
        settled
            .into_iter()
            .map(|s| s.unwrap_or(Settled::Local))
            .collect()
    }

    /// One node's calls for the slot groups `gs`, under one admission of its breaker and
    /// reported to it once: an answer to each, or `BreakerOpen` for each if it was not
    /// asked (its breaker refused, or no time was left after a redirection).
    async fn call_node(
        &self,
        node: &Node,
        groups: &[Vec<SettleItem<'_>>],
        gs: &[usize],
        deadline: Instant,
    ) -> Vec<Result<Vec<Reply>, StoreError>> {
        let store = &self.inner.store;
        let admitted = Instant::now();
        let refused =
            admitted >= deadline || matches!(node.breaker.admit(admitted), Admission::Reject(_));
        if refused {
            return gs.iter().map(|_| Err(StoreError::BreakerOpen)).collect();
        }
        let answers = join_all(gs.iter().map(|&g| async move {
            let part = groups.get(g).map_or(&[][..], Vec::as_slice);
            tokio::time::timeout_at(deadline.into(), store.settle_on(node, part))
                .await
                .unwrap_or(Err(StoreError::Timeout))
        }))
        .await;
        // The node failed if any call found it down or silent; otherwise it answered
        // (a redirection or a refusal is an answer too).
        match answers
            .iter()
            .filter_map(|a| a.as_ref().err())
            .find(|e| e.is_transient() && e.counts_against_breaker())
        {
            Some(e) => self.store_failed(node, admitted, e),
            None => self.store_answered(node, Instant::now()),
        }
        answers
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

/// Adds slot group `g` to `node`'s list.
fn add(by_node: &mut ByNode, node: Arc<Node>, g: usize) {
    match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
        Some((_, gs)) => gs.push(g),
        None => by_node.push((node, vec![g])),
    }
}

/// `v[i] = Some(x)` (`v` is sized for every index it is given).
fn set<T>(v: &mut [Option<T>], i: usize, x: T) {
    if let Some(slot) = v.get_mut(i) {
        *slot = Some(x);
    }
}

/// The largest charge the store takes from an empty bucket: more would put it further in
/// debt than [`MAX_LEAD_TICKS`] and be refused, charging nothing. The work was done either
/// way, so a larger actual cost is charged up to that debt instead (as the local buckets
/// do).
fn deepest_charge(limit: &Limit) -> i64 {
    let most = MAX_LEAD_TICKS / limit.interval_ticks();
    i64::try_from(most.saturating_sub(limit.burst())).unwrap_or(i64::MAX)
}
