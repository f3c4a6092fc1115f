//! The leader's round: meter each policy's demand, take the hot subjects, retarget, then
//! the three phases of the protocol (publish the intents, read the peers and grow, publish
//! the claims), and apply the shares to this pod's slots.

use super::super::limiter::{Shared, Slot};
use super::super::record::{EntryFigures, Forgotten, Publication, Record, RegionStore};
use super::super::share::{smooth, targets};
use super::super::split::{Claims, Split, Subject};
use super::forget::idle_region;
use super::{apply, Leading, Meter, DEADBAND, HOT_FRACTION, TICK_JITTER};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One round of the protocol for every policy `led` (each with this pod's slot, if any).
/// Returns the policies at rest that may be forgotten.
pub(super) async fn lead(
    sh: &Shared,
    stores: &[RegionStore],
    led: &[(Arc<str>, Option<Arc<Slot>>)],
    offered: &HashMap<String, u64>,
    l: &mut Leading,
    pod_id: &str,
    valid_until: Instant,
) -> Vec<Arc<str>> {
    let s = &sh.settings;
    let me = sh.region;
    let now = Instant::now();
    // Demand every round: the rate since the last one, smoothed so that a period's worth
    // of rounds weighs `smoothing` (the weight the builder sets per period). Then new
    // targets at once (a shrink applies at once; growth goes through the protocol): a
    // change of demand is acted on within a round or two, not at the next period.
    for (name, _) in led {
        let meter = l
            .meters
            .entry(name.clone())
            .or_insert_with(|| Meter::new(None, now));
        let total = offered.get(&**name).copied().unwrap_or(0);
        if meter.last.is_some_and(|(before, _)| before != total) {
            meter.moved = now;
        }
        if let Some((before, at)) = meter.last {
            let secs = now.duration_since(at).as_secs_f64().max(1e-3);
            let rate = total.saturating_sub(before) as f64 / secs;
            let periods = (secs / s.period.as_secs_f64()).min(1.0);
            let weight = 1.0 - (1.0 - s.smoothing).powf(periods);
            meter.smoothed = Some(smooth(meter.smoothed, rate, weight));
        }
        meter.last = Some((total, now));
    }
    sh.rebalances.fetch_add(1, Relaxed);
    take_hot(sh, &stores[me], led, l, now).await;
    // Targets only once this leader has read every peer: a peer's demand it has not seen
    // would count as none and move the shares on nothing (for good while the peer stays
    // unreadable, as rule 3 then keeps a cut region from growing back). Its own region's
    // demand starts from the record (see the restore). Meanwhile the restored shares stand.
    let peers_read = (0..sh.regions).all(|q| q == me || l.peers[q].is_some());
    for (name, slot) in led {
        // A policy met at run time that the region stopped using is steered to the floor
        // (no deadband), where its leader can forget it.
        let resting = idle_region(sh, l, name, slot.is_none(), offered, now);
        let Some(split) = l.splits.get_mut(name) else {
            continue;
        };
        let removed = split.prune(now);
        l.removed.entry(name.clone()).or_default().extend(removed);
        if !peers_read {
            continue;
        }
        let own = l.meters.get(name).and_then(|m| m.smoothed).unwrap_or(0.0);
        let subjects = l.subjects.get(name);
        // Hot here: a large part of the region's demand, and at least what the floor serves.
        // An orphan's limit is what the pods checking it report with its subjects. Until
        // one has, the second test cannot be made: it keeps the subjects marked hot (by the
        // leader that met it) while they stay a large part of its demand, and marks no new
        // one (a part of the demand alone would mark nearly every subject of a quiet policy).
        let limit = match slot {
            Some(x) => Some(x.base.rate()),
            None => l.rates.get(name).copied(),
        };
        let (least, marked) = match limit {
            Some(rate) => ((own * HOT_FRACTION).max(rate * s.floor_fraction), None),
            None if own > 0.0 && !resting => (own * HOT_FRACTION, Some(split.entries())),
            None => (f64::INFINITY, None),
        };
        let mut busiest: Vec<(Subject, f64)> = subjects
            .map(|m| {
                m.iter()
                    .filter(|(_, d)| **d >= least)
                    .filter(|(x, _)| marked.is_none_or(|e| e.get(x).is_some_and(|e| e.hot)))
                    .map(|(x, d)| (*x, *d))
                    .collect()
            })
            .unwrap_or_default();
        busiest.sort_by(|a, b| b.1.total_cmp(&a.1));
        let hot_here: BTreeSet<Subject> = busiest.iter().take(s.hot_max).map(|(x, _)| *x).collect();
        let peer_entries: Vec<Vec<(Subject, EntryFigures)>> = (0..sh.regions)
            .map(|q| match &l.peers[q] {
                Some((rec, _)) if q != me => rec.entries(name).unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect();
        let hot_elsewhere: BTreeSet<Subject> = peer_entries
            .iter()
            .flatten()
            .filter(|(_, e)| e.hot)
            .map(|(x, _)| *x)
            .collect();
        split.track(&hot_here, &hot_elsewhere);
        let demands: Vec<f64> = (0..sh.regions)
            .map(|q| {
                if q == me {
                    own
                } else {
                    l.peers[q]
                        .as_ref()
                        .and_then(|(rec, _)| rec.figures(name).demand)
                        .unwrap_or(0.0)
                }
            })
            .collect();
        let policy_target = if resting {
            s.floor
        } else {
            targets(&demands, s.floor)[me]
        };
        let entry_target = |x: Subject| {
            if resting {
                return s.floor;
            }
            let demands: Vec<f64> = (0..sh.regions)
                .map(|q| {
                    if q == me {
                        subjects.and_then(|m| m.get(&x)).copied().unwrap_or(0.0)
                    } else {
                        peer_entries[q]
                            .iter()
                            .find(|(y, _)| *y == x)
                            .map_or(0.0, |(_, e)| e.demand)
                    }
                })
                .collect();
            targets(&demands, s.floor)[me]
        };
        let deadband = if resting { 0 } else { DEADBAND };
        split.retarget(policy_target, entry_target, deadband, now);
    }
    // Phase 1: the intents (and any shrink) published before the peers are read.
    let intents: Vec<Claims> = led
        .iter()
        .map(|(name, _)| {
            l.splits.get(name).map_or_else(
                || Claims {
                    policy: s.floor,
                    entries: Default::default(),
                },
                |x| x.intents(now),
            )
        })
        .collect();
    if publish(sh, &stores[me], led, l, pod_id, Some(&intents)).await {
        // Phase 2: every peer, at once, each with its own timeout.
        let reads = futures_join(stores, me, s.timeout()).await;
        let read_at = Instant::now();
        for (q, r) in reads.iter().enumerate() {
            if let Some(rec) = r {
                l.peers[q] = Some((rec.clone(), read_at));
            }
        }
        for ((name, _), intents) in led.iter().zip(&intents) {
            let peers: Vec<Option<Claims>> = reads
                .iter()
                .enumerate()
                .filter(|(q, _)| *q != me)
                .map(|(_, r)| r.as_ref().and_then(|rec| rec.claims(name, s.floor)))
                .collect();
            if let Some(split) = l.splits.get_mut(name) {
                split.grow(intents, &peers);
            }
        }
        // Phase 3: back to claiming what is used.
        publish(sh, &stores[me], led, l, pod_id, None).await;
    }
    for (name, slot) in led {
        if let (Some(split), Some(slot)) = (l.splits.get(name), slot) {
            let entries: Vec<(Subject, u32)> = split
                .entries()
                .iter()
                .map(|(x, e)| (*x, e.share.share()))
                .collect();
            apply(sh, slot, split.policy().share(), &entries, valid_until);
        }
    }
    let oldest = l
        .peers
        .iter()
        .enumerate()
        .filter(|(q, _)| *q != me)
        .map(|(_, p)| {
            p.as_ref()
                .map_or(f64::INFINITY, |(_, at)| at.elapsed().as_secs_f64())
        })
        .fold(0.0, f64::max);
    metrics::gauge!("ratelimit_region_figure_age_seconds", "region" => me.to_string()).set(oldest);
    // How many policies the region holds state for: run-time names that pile up show here.
    metrics::gauge!("ratelimit_region_led_policies", "region" => me.to_string())
        .set(l.splits.len() as f64);
    let now = Instant::now();
    led.iter()
        .filter(|(name, slot)| {
            idle_region(sh, l, name, slot.is_none(), offered, now)
                && l.splits.get(name).is_some_and(|x| x.at_rest(s.floor, now))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// Takes the pods' counts of the region's busiest subjects and smooths each subject's rate
/// (a subject not counted this round counts 0): by policy, at most four times the hot ones.
async fn take_hot(
    sh: &Shared,
    own: &RegionStore,
    led: &[(Arc<str>, Option<Arc<Slot>>)],
    l: &mut Leading,
    now: Instant,
) {
    let s = &sh.settings;
    let Ok(Ok(mut taken)) = tokio::time::timeout(s.timeout(), own.take_hot()).await else {
        return;
    };
    // The limits the pods reported with their subjects, kept from take to take.
    for (name, _) in led {
        if let Some(rate) = taken.rates.remove(&**name) {
            l.rates.insert(name.clone(), rate);
        }
    }
    // The first take has no start to measure a rate from.
    let Some(since) = l.hot_taken.replace(now) else {
        return;
    };
    let secs = now.duration_since(since).as_secs_f64().max(1e-3);
    let periods = (secs / s.period.as_secs_f64()).min(1.0);
    let weight = 1.0 - (1.0 - s.smoothing).powf(periods);
    // A subject new to the figures starts at a lower bound of its rate: its count over
    // the take's interval and a pod's longest round interval (short of a stall). A
    // pod's rounds are not in step with the leader's, so its first report of the
    // subject may count from up to that long before the last take. Over `secs` alone,
    // that read up to twice the rate, and marked hot subjects under the floor's worth.
    let round = s.tick().mul_f64(1.0 + TICK_JITTER).max(s.timeout());
    let first = secs + round.as_secs_f64();
    for (name, _) in led {
        let counts: HashMap<Subject, u64> = taken
            .subjects
            .remove(&**name)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let smoothed = l.subjects.entry(name.clone()).or_default();
        for (x, d) in smoothed.iter_mut() {
            let rate = counts.get(x).map_or(0.0, |n| *n as f64 / secs);
            *d = smooth(Some(*d), rate, weight);
        }
        for (x, n) in &counts {
            smoothed.entry(*x).or_insert(*n as f64 / first);
        }
        smoothed.retain(|_, d| *d >= 1e-3);
        let kept = 4 * s.hot_max.max(1);
        if smoothed.len() > kept {
            let mut by_demand: Vec<f64> = smoothed.values().copied().collect();
            by_demand.sort_by(|a, b| b.total_cmp(a));
            let least = by_demand.get(kept - 1).copied().unwrap_or(f64::INFINITY);
            smoothed.retain(|_, d| *d >= least);
        }
    }
}

/// `split`'s entries as published with `claims`, each with its subject's demand in
/// `subjects` (0 if none).
fn entry_figures(
    split: &Split,
    claims: &Claims,
    subjects: Option<&HashMap<Subject, f64>>,
) -> Vec<(Subject, EntryFigures)> {
    split
        .entries()
        .iter()
        .map(|(x, e)| {
            let figures = EntryFigures {
                claim: claims.of(Some(*x)),
                share: e.share.share(),
                demand: subjects.and_then(|m| m.get(x)).copied().unwrap_or(0.0),
                hot: e.hot,
            };
            (*x, figures)
        })
        .collect()
}

/// Writes the leader's figures for the policies `led`: `claims` (phase 1's intents) or
/// each share's claim now, if `pod_id` still holds the lease. A write that succeeded
/// starts the hold of any shrink in it.
async fn publish(
    sh: &Shared,
    own: &RegionStore,
    led: &[(Arc<str>, Option<Arc<Slot>>)],
    l: &mut Leading,
    pod_id: &str,
    claims: Option<&[Claims]>,
) -> bool {
    let s = &sh.settings;
    let now = Instant::now();
    let figures: Vec<Publication<'_>> = led
        .iter()
        .enumerate()
        .filter_map(|(i, (name, _))| {
            let split = l.splits.get(name)?;
            let claims = claims
                .and_then(|c| c.get(i).cloned())
                .unwrap_or_else(|| split.claims(now));
            let entries = entry_figures(split, &claims, l.subjects.get(name));
            let meter = l.meters.get(name);
            let still = meter.and_then(|m| m.still(&l.clock));
            Some(Publication {
                policy: name,
                claim: claims.policy,
                share: split.policy().share(),
                demand: meter.and_then(|m| m.smoothed).unwrap_or(0.0),
                still,
                entries,
                removed: l.removed.get(name).cloned().unwrap_or_default(),
            })
        })
        .collect();
    if figures.is_empty() {
        return false;
    }
    // A policy met again since it was forgotten is in `figures`, restored from the record,
    // and its counter is metered again.
    let led_names: HashSet<&str> = led.iter().map(|(name, _)| &**name).collect();
    l.forgotten.retain(|f| !led_names.contains(&*f.policy));
    l.counters.retain(|(c, _)| !led_names.contains(&**c));
    let forgotten: Vec<&Forgotten> = l.forgotten.iter().collect();
    let counters: Vec<(&str, u64)> = l.counters.iter().map(|(c, n)| (&**c, *n)).collect();
    let ok = matches!(
        tokio::time::timeout(
            s.timeout(),
            own.publish(&figures, &forgotten, &counters, pod_id)
        )
        .await,
        Ok(Ok(true))
    );
    if ok {
        for f in figures.iter().filter(|f| f.still.is_some()) {
            if let Some(m) = l.meters.get_mut(f.policy) {
                m.written = m.stopped();
            }
        }
        let at = Instant::now();
        for split in l.splits.values_mut() {
            split.written(at, s.hold());
        }
        l.removed.clear();
        l.deleted();
    }
    ok
}

/// Reads every peer's record concurrently; `None` where it could not be read in time.
async fn futures_join(stores: &[RegionStore], me: usize, timeout: Duration) -> Vec<Option<Record>> {
    let tasks: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(q, store)| {
            let store = store.clone();
            tokio::spawn(async move {
                if q == me {
                    return None;
                }
                tokio::time::timeout(timeout, store.read())
                    .await
                    .ok()
                    .and_then(Result::ok)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.ok().flatten());
    }
    out
}
