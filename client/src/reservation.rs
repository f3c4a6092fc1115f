//! Reserve an estimate, settle the real cost after the work: [`Limiter::reserve`].

use crate::region::Demand;
use crate::{Decision, Error, Limiter, Policy, Source};
use std::sync::atomic::Ordering::Relaxed;

/// One policy of an allowed reservation: where its tokens were taken, and how many.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) policy: Policy,
    pub(crate) key: String,
    /// For a sharded policy, the unsharded key (the local fallback's bucket).
    pub(crate) whole_key: Option<String>,
    pub(crate) estimate: u64,
    /// Where the policy's offered cost is counted (a region's demand, see
    /// [`crate::region`]): a settlement corrects it by the difference to the estimate.
    pub(crate) demand: Option<Demand>,
}

impl Held {
    /// Readies a regional policy for settling at the `actual` cost (nothing to do for
    /// another).
    ///
    /// The counted demand is corrected from the estimate to `actual`. And the policy becomes
    /// the region's share as it is now, not as it was when reserved: the bucket holds time,
    /// which that share turns into tokens. At the old share a charge after the region shrank
    /// would be undercharged while its peers grew into the rest (and a refund after it grew,
    /// overpaid); at the current one the bucket never gives more than the share the peers
    /// leave it.
    fn prepare(&mut self, actual: u64) {
        let Some(demand) = &self.demand else { return };
        self.policy = demand.policy_now();
        let (actual, estimate) = (demand.counted(actual), demand.counted(self.estimate));
        if actual >= estimate {
            demand.offered().fetch_add(actual - estimate, Relaxed);
        } else {
            // What was counted may have been taken by a sync round already: never below 0.
            let _ = demand.offered().fetch_update(Relaxed, Relaxed, |n| {
                Some(n.saturating_sub(estimate - actual))
            });
        }
    }
}

/// Tokens reserved by [`Limiter::reserve`], to be settled with the real cost.
///
/// - [`settle`](Self::settle) charges `actual − estimate` more, or refunds the difference, in
///   one round trip. A charge is unconditional: the work already happened, so the bucket may
///   go into debt and later checks are refused until refill has repaid it.
/// - Dropped unsettled, it refunds the whole estimate in a background task on the current
///   Tokio runtime (the request failed, or its task was cancelled), so a failure costs the
///   subject nothing. Outside a runtime nothing is refunded.
/// - A refused reservation holds nothing: settling or dropping it does nothing.
/// - While the store cannot be asked, fail-open policies settle against the local bucket
///   their checks fall back to; fail-closed ones refuse every check meanwhile, and their
///   settlement is dropped (counted in `ratelimit_settle_dropped_total`), as is every
///   policy's with the local fallback off (then reported `FailOpen`). On a cluster this is
///   per node: the buckets of the nodes that answer are settled on them, and a decision
///   partly settled locally has the local source.
/// - A reservation the local fallback admitted is settled on the local buckets even once
///   the store is back: the store never took its estimate, so a refund there would let the
///   pods together take more than the limit. (A sharded check whose sub-bucket could not
///   be asked falls back after the store took its other policies: those stay charged on the
///   store, as a plain check's do, and the settlement goes to the local buckets.)
#[derive(Debug)]
#[must_use = "settle it with the actual cost; dropping it refunds the estimate"]
pub struct Reservation {
    limiter: Limiter,
    held: Vec<Held>,
    decision: Decision,
}

impl Reservation {
    pub(crate) fn new(limiter: Limiter, held: Vec<Held>, decision: Decision) -> Self {
        Self {
            limiter,
            held,
            decision,
        }
    }

    /// The check of the estimates.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Whether the estimates were admitted (the work may proceed).
    pub fn is_allowed(&self) -> bool {
        self.decision.is_allowed()
    }

    /// Whether the store took the estimates; otherwise the local fallback did (or, with it
    /// off, nothing did).
    fn taken_at_store(&self) -> bool {
        self.decision.source == Source::Store
    }

    /// Settles every policy of the reservation at `actual` tokens. Returns the buckets'
    /// state after it (`remaining` is 0 while in debt); a refused reservation returns its
    /// decision unchanged.
    pub async fn settle(self, actual: u64) -> Result<Decision, Error> {
        let actual = vec![actual; self.held.len()];
        self.settle_each(&actual).await
    }

    /// Settles each policy at its own actual cost, in the order they were reserved.
    pub async fn settle_each(mut self, actual: &[u64]) -> Result<Decision, Error> {
        let mut held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return Ok(self.decision.clone());
        }
        if actual.len() != held.len() {
            // Keep the reservation to refund it on drop.
            self.held = held;
            return Err(Error::Config(format!(
                "{} actual costs for {} reserved policies",
                actual.len(),
                self.held.len()
            )));
        }
        let deltas: Vec<i64> = held
            .iter()
            .zip(actual)
            .map(|(h, &a)| signed(a).saturating_sub(signed(h.estimate)))
            .collect();
        for (h, &a) in held.iter_mut().zip(actual) {
            h.prepare(a);
        }
        let at_store = self.taken_at_store();
        self.limiter.settle_held(&held, &deltas, at_store).await
    }
}

fn signed(tokens: u64) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let mut held = std::mem::take(&mut self.held);
        let limiter = self.limiter.clone();
        let at_store = self.taken_at_store();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let deltas: Vec<i64> = held.iter().map(|h| -signed(h.estimate)).collect();
                for h in &mut held {
                    h.prepare(0);
                }
                if let Err(e) = limiter.settle_held(&held, &deltas, at_store).await {
                    tracing::warn!(error = %e, "ratelimit: refund of a dropped reservation failed");
                }
            });
        }
    }
}
