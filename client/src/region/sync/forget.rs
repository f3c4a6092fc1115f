//! Forgetting: the policies this pod has no slot for that the leader leads (orphans), when
//! a policy is idle here or in the region, and how the leader drops an idle policy's slot,
//! figures and counter.

use super::super::limiter::Shared;
use super::super::record::{Forgotten, Record, RegionStore};
use super::super::split::Subject;
use super::{Leading, State};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Leads each policy this pod has no slot (`known`) for that the record has figures for
/// or a pod's checks counted (`offered`): nobody may lead it now, yet pods may use what
/// the record says, and other pods' checks may want it to grow. It is restored as a new
/// leader restores its own policies, and metered from its counter from now on. Left as
/// it is: a policy whose entries cannot be read (its claims are not known), and one whose
/// deletion is pending.
pub(super) fn adopt(
    sh: &Shared,
    l: &mut Leading,
    record: &Record,
    offered: &HashMap<String, u64>,
    known: &HashSet<&str>,
    now: Instant,
) {
    let s = &sh.settings;
    // A counter queued for deletion (its write failed) that moved since is in use again:
    // kept, and led again once its policy's fields are deleted. (The write itself keeps one
    // that moved after the round read it.)
    l.counters
        .retain(|(c, was)| offered.get(&**c).is_none_or(|n| n == was));
    let pending = l.pending();
    let counted = offered.keys().map(String::as_str);
    let unled: BTreeSet<&str> = record
        .policies()
        .into_iter()
        .chain(counted)
        .filter(|name| !known.contains(name) && !l.splits.contains_key(*name))
        .filter(|name| !pending.contains(name))
        .collect();
    drop(pending);
    for name in unled {
        let Some(entries) = record.entries(name) else {
            continue;
        };
        let f = record.figures(name);
        let region = sh.region;
        tracing::debug!(region, policy = %name, "ratelimit: leading a policy met elsewhere");
        // As a new leader's own; measured from then on from the counter alone, its subjects
        // from the pods' reports.
        let name: Arc<str> = name.into();
        let counted = offered.get(&*name).copied().unwrap_or(0);
        l.restore(s, name.clone(), &f, &entries, counted, now);
        l.orphans.insert(name);
    }
}

/// Whether `name` is a policy met at run time that this pod has not used for
/// [`Settings::forget_idle`](super::Settings::forget_idle).
pub(super) fn idle_here(sh: &Shared, state: &State, name: &str, now: Instant) -> bool {
    !sh.kept.contains(name)
        && state
            .used
            .get(name)
            .is_some_and(|at| sh.settings.idle(*at, now))
}

/// Whether `name` is a policy met at run time that no pod of the region has used for
/// [`Settings::forget_idle`](super::Settings::forget_idle), as this leader has metered it
/// (from where the record's idle clock says the last leader left it); or an orphan
/// (`slotless`) without a counter in `offered` (no pod has counted it since its counter
/// was deleted, if ever).
pub(super) fn idle_region(
    sh: &Shared,
    l: &Leading,
    name: &str,
    slotless: bool,
    offered: &HashMap<String, u64>,
    now: Instant,
) -> bool {
    let uncounted = slotless && !offered.contains_key(name);
    !sh.kept.contains(name)
        && (uncounted
            || l.meters
                .get(name)
                .is_some_and(|m| sh.settings.idle(m.moved, now)))
}

/// Drops this pod's slot for `name` unless a check or a reservation holds it (one that
/// did would count its demand in a slot nobody reads any more). Whether it went.
pub(super) fn drop_slot(sh: &Shared, name: &str) -> bool {
    let mut slots = sh.slots.write().unwrap_or_else(|p| p.into_inner());
    // The fence orders the count's load before the counter's: a check that released the
    // slot has its cost in `offered` by then.
    let free = slots.get(name).is_some_and(|slot| {
        Arc::strong_count(slot) == 1 && {
            std::sync::atomic::fence(Acquire);
            slot.offered.load(Relaxed) == 0
        }
    });
    if free {
        slots.remove(name);
    }
    free
}

/// The leader forgets the policies at rest (`resting`) whose slot it can drop (an orphan
/// has none): their split, meter and subjects, then their fields in the record and their
/// demand counter, at once (or with a later round's figures if that write fails). A peer
/// reads a missing figure at the floor, which is where a policy at rest is, so nothing any
/// pod may use or any region claims changes.
pub(super) async fn forget(
    sh: &Shared,
    own: &RegionStore,
    l: &mut Leading,
    resting: Vec<Arc<str>>,
    pod_id: &str,
) {
    let s = &sh.settings;
    let has_slot = |name: &str| {
        sh.slots
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
    };
    for name in resting {
        // An orphan met here since this round's snapshot is led with its slot next round.
        let free = if l.orphans.contains(&name) {
            !has_slot(&name)
        } else {
            drop_slot(sh, &name)
        };
        if !free {
            continue;
        }
        l.orphans.remove(&name);
        let mut entries: Vec<Subject> = l
            .splits
            .remove(&name)
            .map(|x| x.entries().keys().copied().collect())
            .unwrap_or_default();
        entries.extend(l.removed.remove(&name).unwrap_or_default());
        let count = l
            .meters
            .remove(&name)
            .and_then(|m| m.last)
            .map_or(0, |(n, _)| n);
        l.subjects.remove(&name);
        l.rates.remove(&name);
        tracing::debug!(region = sh.region, policy = %name, "ratelimit: forgot an idle policy");
        l.counters.push((name.clone(), count));
        l.forgotten.push(Forgotten {
            policy: name,
            entries,
        });
    }
    // A policy met since (a slot made after this round's snapshot): its figures and counter
    // are the next round's.
    l.forgotten.retain(|f| !has_slot(&f.policy));
    l.counters.retain(|(c, _)| !has_slot(c));
    if l.forgotten.is_empty() && l.counters.is_empty() {
        return;
    }
    let forgotten: Vec<&Forgotten> = l.forgotten.iter().collect();
    let counters: Vec<(&str, u64)> = l.counters.iter().map(|(c, n)| (&**c, *n)).collect();
    let wrote =
        tokio::time::timeout(s.timeout(), own.publish(&[], &forgotten, &counters, pod_id)).await;
    if matches!(wrote, Ok(Ok(true))) {
        l.deleted();
    }
}
