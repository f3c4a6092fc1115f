//! The share protocol, pure: what one region's leader decides for one policy, with time
//! passed in. No I/O here; the `sync` task carries the figures between the stores.
//!
//! Shares are integers in parts per million ([`WHOLE`] = the whole limit), so the invariant
//! is checked exactly, without rounding.
//!
//! # The invariant
//!
//! For every policy, at every instant: **Σ over regions of the highest share any pod of that
//! region may be using ≤ [`WHOLE`]**.
//!
//! Each region publishes a *claim* in its own store: an upper bound on what its pods may use
//! now and until it publishes a higher claim. The rules that keep the sum within the whole:
//!
//! 1. **Claim ≥ use, always.** A shrink is applied at once, but the claim stays at the old
//!    share for a *hold* (longer than a pod's lease on a share it read) after the lower share
//!    was written, so pods still using the old share are covered; then the claim drops.
//! 2. **Publish before reading, to grow.** To grow, a region first publishes its *intent*
//!    (the claim it wants), then reads every other region's claim, then applies
//!    `min(target, intent, WHOLE − Σ others' claims)` if that is more than it has, then
//!    lowers its claim back to what it uses.
//! 3. **No figure, no growth.** A region any of whose peers cannot be read does not grow; it
//!    keeps its share or shrinks. A region whose record is missing (never started, store
//!    flushed) is counted at the floor, which is also where every region starts.
//!
//! Why it holds: take the region `r` whose last growth before instant `τ` published its
//! intent last. Every other region `q` had published the intent of its own last growth
//! before, and `r` read `q` after that, so `r` read a claim of `q` that is at least what `q`
//! uses at `τ` (the intent until `q` applied it, a claim ≥ use afterwards, and `q`'s use only
//! falls between its last growth and `τ`). So `r`'s share ≤ `WHOLE − Σ q's use`. Two regions
//! growing at once is the store-buffer case: since each publishes before it reads, at least
//! one of them sees the other's intent (each store is linearizable on its own). Regions that
//! never grew use at most the floor, or what they restored from their own record.

use std::time::{Duration, Instant};

/// The whole limit, in parts per million.
pub const WHOLE: u32 = 1_000_000;

/// One region's state for one policy, as its leader holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    /// What this region's pods may use from now on.
    share: u32,
    /// Higher shares that pods which read them before a shrink may still be using, each
    /// until its own hold ends (a region shrinking step by step claims the highest share
    /// still held, not the first one for as long as it keeps shrinking). At most a hold's
    /// worth of rounds long: expired ones are dropped.
    holds: Vec<Hold>,
    /// Where demand says the share should be.
    target: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Hold {
    share: u32,
    /// `None` while the shrink has not been written yet (it counts for ever until then).
    until: Option<Instant>,
}

impl Hold {
    fn counts(&self, now: Instant) -> bool {
        self.until.is_none_or(|until| now < until)
    }
}

impl Share {
    /// A region that starts (or restarts without a record) at `share` (the floor).
    pub fn new(share: u32) -> Self {
        Self {
            share,
            holds: Vec::new(),
            target: share,
        }
    }

    /// A region whose new leader found `share` and `claim` in its own record: pods may still
    /// use up to `claim` until `hold` has passed.
    pub fn restore(share: u32, claim: u32, now: Instant, hold: Duration) -> Self {
        Self {
            share,
            holds: vec![Hold {
                share: claim.max(share),
                until: Some(now + hold),
            }],
            target: share,
        }
    }

    /// What the region's pods may use from now on.
    pub fn share(&self) -> u32 {
        self.share
    }

    /// Where demand says the share should be.
    pub fn target(&self) -> u32 {
        self.target
    }

    /// The claim to publish when not growing: the most any pod of the region may use now.
    pub fn claim(&self, now: Instant) -> u32 {
        self.holds
            .iter()
            .filter(|h| h.counts(now))
            .map(|h| h.share)
            .fold(self.share, u32::max)
    }

    /// A new target from demand. A lower one is applied at once (rule 1: the claim keeps
    /// the old share until [`written`](Self::written) + hold).
    pub fn retarget(&mut self, target: u32, now: Instant) {
        self.target = target;
        if target < self.share {
            self.holds.retain(|h| h.counts(now));
            self.holds.push(Hold {
                share: self.share,
                until: None,
            });
            self.share = target;
        }
    }

    /// The share was written to the region's record at `at`: pods reading the record from
    /// now on see it, and those that read the old one stop using it within their lease,
    /// which `hold` must exceed.
    pub fn written(&mut self, at: Instant, hold: Duration) {
        for h in self.holds.iter_mut().filter(|h| h.until.is_none()) {
            h.until = Some(at + hold);
        }
    }

    /// Takes over `other`'s holds that still count: what pods may still use of a share
    /// folded into this one (a subject's entry removed into its policy's share) stays
    /// claimed here for as long as it would have been there.
    pub fn absorb(&mut self, other: &Share, now: Instant) {
        self.holds.retain(|h| h.counts(now));
        self.holds
            .extend(other.holds.iter().filter(|h| h.counts(now)).copied());
    }

    /// Phase 1 of a growth (rule 2): the claim to publish before reading the others.
    pub fn intent(&self, now: Instant) -> u32 {
        self.claim(now).max(self.target)
    }

    /// Phase 2 (rules 2 and 3): with `intent` published, and each other region's claim as
    /// read afterwards (`None`: could not be read), grows if there is room. Returns whether
    /// the share changed.
    pub fn grow(&mut self, intent: u32, others: &[Option<u32>]) -> bool {
        let mut taken: u64 = 0;
        for claim in others {
            match claim {
                Some(c) => taken += u64::from(*c),
                None => return false,
            }
        }
        self.grow_within(intent, taken)
    }

    /// Phase 2 with the others' claims already summed (`taken`, every peer read): grows to
    /// `min(target, intent, WHOLE − taken)` if that is more than it has.
    pub fn grow_within(&mut self, intent: u32, taken: u64) -> bool {
        let room = u64::from(WHOLE).saturating_sub(taken);
        let want = u64::from(self.target.min(intent)).min(room) as u32;
        if want > self.share {
            self.share = want;
            true
        } else {
            false
        }
    }
}

/// Shares that follow demand: proportional to each region's demand, at least `floor` each,
/// summing to at most [`WHOLE`] (water-filling: regions below the floor get the floor, the
/// rest is shared by the others in proportion). `floor × regions` must not exceed WHOLE.
/// With no demand anywhere, the split is even.
pub fn targets(demands: &[f64], floor: u32) -> Vec<u32> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let even = WHOLE / n as u32;
    let floor = floor.min(even);
    let demand: Vec<f64> = demands
        .iter()
        .map(|d| if d.is_finite() { d.max(0.0) } else { 0.0 })
        .collect();
    if demand.iter().sum::<f64>() <= 0.0 {
        return vec![even; n];
    }
    let mut floored = vec![false; n];
    loop {
        let fixed = floored.iter().filter(|f| **f).count() as u64 * u64::from(floor);
        let rest = u64::from(WHOLE) - fixed;
        let total: f64 = demand
            .iter()
            .zip(&floored)
            .filter(|(_, f)| !**f)
            .map(|(d, _)| d)
            .sum();
        let out: Vec<u32> = demand
            .iter()
            .zip(&floored)
            .map(|(d, f)| {
                if *f || total <= 0.0 {
                    floor
                } else {
                    // Rounded down: the sum never exceeds WHOLE.
                    ((rest as f64) * d / total).floor() as u32
                }
            })
            .collect();
        let mut changed = false;
        for (i, s) in out.iter().enumerate() {
            if !floored[i] && *s < floor {
                floored[i] = true;
                changed = true;
            }
        }
        if !changed {
            return out;
        }
    }
}

/// Exponential smoothing of a demand figure: `weight` of the new one.
pub fn smooth(previous: Option<f64>, measured: f64, weight: f64) -> f64 {
    match previous {
        Some(p) => p + weight * (measured - p),
        None => measured,
    }
}

#[cfg(test)]
mod tests;
