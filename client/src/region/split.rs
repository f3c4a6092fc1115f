//! Per-subject shares, pure: one policy's split at one region's leader, the policy's own
//! [`Share`] plus an *entry* (a `Share` of its own) for each hot subject, with time passed
//! in. The `sync` task carries the figures between the stores.
//!
//! A policy-wide split serves a policy whose subjects all come from the same places. It
//! fails the subject that is busy where the others are not: API key A hammered from
//! region 0 and key B from region 1 give both regions about half of the policy, so each
//! key gets about half its limit where it is used. An entry splits one subject's limit by
//! that subject's own demand.
//!
//! A subject's share in region `r` is its entry's there if `r` has one, else `r`'s
//! policy share; likewise its *claim*. The invariant of [`share`](super::share) then holds
//! **for every subject**: Σ over regions of what any pod may use for it ≤ the whole. The
//! rules, on top of the three of `share`:
//!
//! 4. *An entry grows like a share*: its intent is published, then
//!    `min(target, intent, WHOLE − Σ others' claims for that subject)`.
//! 5. *The policy share grows within every subject it covers*: for each subject a peer has
//!    an entry for and this region has not, and for the subjects nobody tracks, the
//!    others' claims for it must leave room. Each region tracks every subject a peer
//!    marks hot, so this caps the policy only for the round until it adopts the entry.
//! 6. *Entries change nothing when they come and go*: an entry starts as a copy of the
//!    policy's share (same share, same holds), and is removed only once no region marks
//!    its subject hot (as last read) and its share equals the policy's; its holds then
//!    move into the policy's share, so the claim for the subject never drops early.
//!
//! Why it holds: fix a subject `x`. What a region's pods use for `x` changes only through
//! the growth of `x`'s entry there (rule 4) or of the policy share while `x` has no entry
//! there (rule 5), each after its intent was published; adoption and removal change
//! neither the use nor the claim for `x` upwards (rule 6), and a claim is at least the
//! use (rule 1). So the argument of `share` runs unchanged with "claim for `x`" in place
//! of "claim". Property-tested in `split/tests.rs` with arbitrary tracking decisions:
//! safety never depends on which subjects are hot.

use super::share::Share;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// A subject, by the unseeded XXH3-64 hash of its name (so every region names it alike): records
/// never hold API keys in clear, and a pod counts demand without copying them.
pub(crate) type Subject = u64;

/// One hot subject's share in this region.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) share: Share,
    /// Hot here (published, so that every region tracks it).
    pub(crate) hot: bool,
    /// Hot here or marked hot by a peer: follows its own target. Otherwise it follows the
    /// policy's share until it can be removed.
    wanted: bool,
}

/// A region's claims (or intents) for one policy, as published or read: the policy's and
/// each entry's.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Claims {
    pub(crate) policy: u32,
    pub(crate) entries: BTreeMap<Subject, u32>,
}

impl Claims {
    /// This region's claim for `subject`: its entry's, else the policy's.
    pub(crate) fn of(&self, subject: Option<Subject>) -> u32 {
        subject
            .and_then(|x| self.entries.get(&x).copied())
            .unwrap_or(self.policy)
    }
}

/// See the module docs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Split {
    policy: Share,
    entries: BTreeMap<Subject, Entry>,
}

impl Split {
    /// A region that starts (or restarts without a record) at `share` (the floor), with no
    /// entries.
    #[cfg(test)]
    pub(crate) fn new(share: u32) -> Self {
        Self {
            policy: Share::new(share),
            entries: BTreeMap::new(),
        }
    }

    /// A new leader's split from its own record: each share with its claim held for `hold`
    /// (pods may still use up to the claim), each entry as hot as the record says until
    /// the next [`track`](Self::track).
    pub(crate) fn restore(
        policy: (u32, u32),
        entries: impl IntoIterator<Item = (Subject, u32, u32, bool)>,
        now: Instant,
        hold: Duration,
    ) -> Self {
        Self {
            policy: Share::restore(policy.0, policy.1, now, hold),
            entries: entries
                .into_iter()
                .map(|(x, share, claim, hot)| {
                    let entry = Entry {
                        share: Share::restore(share, claim, now, hold),
                        hot,
                        wanted: hot,
                    };
                    (x, entry)
                })
                .collect(),
        }
    }

    /// The policy's own share (every subject without an entry).
    pub(crate) fn policy(&self) -> &Share {
        &self.policy
    }

    /// The entries, by subject.
    pub(crate) fn entries(&self) -> &BTreeMap<Subject, Entry> {
        &self.entries
    }

    /// The share pods use for `subject` (`None`: a subject without an entry).
    #[cfg(test)]
    pub(crate) fn share_of(&self, subject: Option<Subject>) -> u32 {
        subject
            .and_then(|x| self.entries.get(&x))
            .map_or(self.policy.share(), |e| e.share.share())
    }

    /// Decides which subjects have entries: those hot here and those a peer marks hot. A
    /// new one starts as a copy of the policy's share, holds included (rule 6).
    pub(crate) fn track(
        &mut self,
        hot_here: &BTreeSet<Subject>,
        hot_elsewhere: &BTreeSet<Subject>,
    ) {
        for x in hot_here.union(hot_elsewhere) {
            self.entries.entry(*x).or_insert_with(|| Entry {
                share: self.policy.clone(),
                hot: false,
                wanted: true,
            });
        }
        for (x, e) in &mut self.entries {
            e.hot = hot_here.contains(x);
            e.wanted = e.hot || hot_elsewhere.contains(x);
        }
    }

    /// New targets: the policy's, and each wanted entry's from `entry_target`; an entry no
    /// longer wanted is steered to the policy's share, so that it can be removed. A shrink
    /// by less than `deadband` is not made (demand noise would otherwise give up quota
    /// that takes a round to get back).
    pub(crate) fn retarget(
        &mut self,
        policy: u32,
        entry_target: impl Fn(Subject) -> u32,
        deadband: u32,
        now: Instant,
    ) {
        let banded = |share: &Share, target: u32| {
            if target < share.share() && share.share() - target < deadband {
                share.share()
            } else {
                target
            }
        };
        let policy = banded(&self.policy, policy);
        self.policy.retarget(policy, now);
        let policy_share = self.policy.share();
        for (x, e) in &mut self.entries {
            let target = if e.wanted {
                banded(&e.share, entry_target(*x))
            } else {
                policy_share
            };
            e.share.retarget(target, now);
        }
    }

    /// The claims to publish when not growing.
    pub(crate) fn claims(&self, now: Instant) -> Claims {
        Claims {
            policy: self.policy.claim(now),
            entries: self
                .entries
                .iter()
                .map(|(x, e)| (*x, e.share.claim(now)))
                .collect(),
        }
    }

    /// Phase 1: the intents to publish before reading the peers.
    pub(crate) fn intents(&self, now: Instant) -> Claims {
        Claims {
            policy: self.policy.intent(now),
            entries: self
                .entries
                .iter()
                .map(|(x, e)| (*x, e.share.intent(now)))
                .collect(),
        }
    }

    /// Phase 2: with `intents` published and each peer's claims read afterwards (`None`:
    /// could not be read), grows whatever has room (rules 3, 4 and 5).
    pub(crate) fn grow(&mut self, intents: &Claims, peers: &[Option<Claims>]) {
        let Some(peers) = peers
            .iter()
            .map(Option::as_ref)
            .collect::<Option<Vec<&Claims>>>()
        else {
            return;
        };
        let taken = |x: Option<Subject>| -> u64 { peers.iter().map(|c| u64::from(c.of(x))).sum() };
        // The policy share covers the subjects nobody tracks and those only peers track.
        let covered: BTreeSet<Subject> = peers
            .iter()
            .flat_map(|c| c.entries.keys().copied())
            .filter(|x| !self.entries.contains_key(x))
            .collect();
        let policy_taken = covered
            .into_iter()
            .map(|x| taken(Some(x)))
            .fold(taken(None), u64::max);
        self.policy.grow_within(intents.policy, policy_taken);
        for (x, e) in &mut self.entries {
            // An entry adopted after the intents were published waits for the next round.
            if let Some(intent) = intents.entries.get(x) {
                e.share.grow_within(*intent, taken(Some(*x)));
            }
        }
    }

    /// Removes the entries rule 6 lets go; returns them (their fields leave the record).
    /// An entry's holds outlive it in the policy's share: the policy's own holds may end
    /// sooner, and the region's claim for the subject is the policy's from now on.
    pub(crate) fn prune(&mut self, now: Instant) -> Vec<Subject> {
        let share = self.policy.share();
        let gone: Vec<Subject> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.wanted && e.share.share() == share)
            .map(|(x, _)| *x)
            .collect();
        for x in &gone {
            if let Some(e) = self.entries.remove(x) {
                self.policy.absorb(&e.share, now);
            }
        }
        gone
    }

    /// Whether the region's record could drop this policy: its share, claim and intent
    /// are all `floor`, for the policy and every entry, which is what a peer reads where
    /// the record has no figures for it and what a pod checks a policy it has just met
    /// with. So forgetting it changes neither what any pod may use nor any claim.
    pub(crate) fn at_rest(&self, floor: u32, now: Instant) -> bool {
        let rests = |s: &Share| s.share() == floor && s.intent(now) == floor;
        rests(&self.policy) && self.entries.values().all(|e| rests(&e.share))
    }

    /// Every share was written at `at` (see [`Share::written`]).
    pub(crate) fn written(&mut self, at: Instant, hold: Duration) {
        self.policy.written(at, hold);
        for e in self.entries.values_mut() {
            e.share.written(at, hold);
        }
    }
}

#[cfg(test)]
mod tests;
