//! The rebalancing task: every tick (a quarter of the rebalance period) each pod adds its
//! offered demand to its region's counters and reads its region's record; the region's
//! leader (one pod per region, by a lease in the region's store) also runs the protocol of
//! [`super::share`]: measure the region's demand and recompute targets (smoothed so that a
//! period's worth of rounds weighs the smoothing weight), publish the intent, read the
//! peers, grow if there is room, publish the claims. Other pods follow the record's shares.
//!
//! The leader leads every policy its region counts demand for, not only those its own pod
//! has met: a policy in its record or in its demand counters that it has no slot for (an
//! *orphan*: a policy met at run time that only other pods check, or one a former leader
//! left) is restored from the record and rebalanced from its counter like the rest, and
//! forgotten like the rest once idle. So pods need not all be built with the same policies.
//!
//! Hot subjects: each pod counts its busiest subjects per policy ([`super::hot`]) and adds
//! those with at least [`REPORT_FRACTION`] of its offered cost to the region's `hot` counters;
//! the leader takes them each round, smooths each subject's rate, marks hot those with at
//! least [`HOT_FRACTION`] of the region's demand and at least the floor's worth of the
//! limit (of an orphan, whose limit it does not know: the part of the demand alone; at
//! most [`HOT_MAX`] by default), tracks those and every subject a peer marks hot, and runs
//! [`super::split`] for them: each gets a share following its own demand.
//!
//! Leases, so that a shrink can be relied on: a pod may use a share only for
//! [`Settings::lease`] after the start of its last successful round trip to its own store,
//! then at most the floor; the leader keeps its claim for [`Settings::hold`] (a lease and a
//! tick) after writing a lower share.

use super::limiter::{Applied, Shared, Slot};
use super::record::{EntryFigures, Figures, Forgotten, Publication, Record, RegionStore};
use super::share::{smooth, targets, WHOLE};
use super::split::{Claims, Split, Subject};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A shrink smaller than this (ppm) is not made: demand noise would otherwise make regions
/// give up quota they cannot get back before the next period.
const DEADBAND: u32 = WHOLE / 100;

/// A pod reports a subject with at least this part of its offered cost for a policy.
const REPORT_FRACTION: f64 = 0.01;

/// A subject is hot in a region with at least this part of the region's demand for the
/// policy (and at least the floor's worth of the limit: below that any share serves it).
const HOT_FRACTION: f64 = 0.02;

/// Most subjects a region marks hot per policy, by default; every region tracks the union
/// of them.
pub(crate) const HOT_MAX: usize = 16;

/// The rebalancing settings (see the builder for each).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) period: Duration,
    pub(crate) floor_fraction: f64,
    /// The floor in ppm, set by the builder.
    pub(crate) floor: u32,
    pub(crate) smoothing: f64,
    pub(crate) timeout: Option<Duration>,
    pub(crate) prefix: String,
    /// Most subjects this region marks hot per policy (0: none, per-subject shares off).
    pub(crate) hot_max: usize,
    /// A policy met at run time and unchecked for this long is forgotten.
    pub(crate) forget_idle: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            period: Duration::from_secs(2),
            floor_fraction: 0.05,
            floor: WHOLE / 20,
            smoothing: 0.5,
            timeout: None,
            prefix: "rl".into(),
            hot_max: HOT_MAX,
            forget_idle: Duration::from_secs(600),
        }
    }
}

impl Settings {
    /// Whether what last moved at `since` has been still for `forget_idle` at `now`.
    fn idle(&self, since: Instant, now: Instant) -> bool {
        now.saturating_duration_since(since) >= self.forget_idle
    }

    pub(crate) fn tick(&self) -> Duration {
        self.period / 4
    }

    /// How long a pod may use a share after the start of its last good round trip: two
    /// ticks, so one missed round does not cap it.
    pub(crate) fn lease(&self) -> Duration {
        self.tick() * 2
    }

    /// How long the leader keeps claiming a share it gave up, after writing that: longer
    /// than any pod's lease on it, plus a tick for clocks that run at slightly other rates.
    pub(crate) fn hold(&self) -> Duration {
        self.lease() + self.tick()
    }

    fn leader_ttl(&self) -> Duration {
        self.tick() * 4
    }

    fn timeout(&self) -> Duration {
        self.timeout
            .unwrap_or_else(|| self.tick().min(Duration::from_millis(500)))
    }
}

#[derive(Debug)]
struct Meter {
    last: Option<(u64, Instant)>,
    smoothed: Option<f64>,
    /// When the region's count last moved, or metering began.
    moved: Instant,
}

impl Meter {
    fn new(smoothed: Option<f64>, now: Instant) -> Self {
        Self {
            last: None,
            smoothed,
            moved: now,
        }
    }
}

#[derive(Debug)]
struct Leading {
    splits: HashMap<Arc<str>, Split>,
    meters: HashMap<Arc<str>, Meter>,
    /// Smoothed offered cost per second of the region's busiest subjects, by policy.
    subjects: HashMap<Arc<str>, HashMap<Subject, f64>>,
    /// When the pods' subject counts were last taken.
    hot_taken: Option<Instant>,
    /// Entries removed and not yet deleted from the record, by policy.
    removed: HashMap<Arc<str>, Vec<Subject>>,
    /// The policies led (in `splits`) that this pod has no slot for (see [`adopt`]).
    orphans: HashSet<Arc<str>>,
    /// Policies forgotten and not yet deleted from the record.
    forgotten: Vec<Forgotten>,
    /// Demand counters to delete, each with its count as the round that forgot its policy
    /// read it (one that moved since is not deleted).
    counters: Vec<(Arc<str>, u64)>,
    /// Each peer's record as last read, and when.
    peers: Vec<Option<(Record, Instant)>>,
    renewed_at: Instant,
}

impl Leading {
    /// The pending deletions were written: forgotten policies' fields and counters gone.
    fn deleted(&mut self) {
        self.forgotten.clear();
        self.counters.clear();
    }

    /// Whether `name`'s fields or counter wait to be deleted.
    fn pending(&self, name: &str) -> bool {
        self.forgotten.iter().any(|f| &*f.policy == name)
            || self.counters.iter().any(|(c, _)| &**c == name)
    }
}

#[derive(Debug, Default)]
struct State {
    leading: Option<Leading>,
    /// Consecutive rounds that could not reach the own store.
    failed: u32,
    /// When this pod last counted demand for each policy, or first met it.
    used: HashMap<Arc<str>, Instant>,
}

/// Runs until the limiter is dropped.
pub(crate) async fn run(shared: Weak<Shared>, stores: Vec<RegionStore>) {
    let pod_id = format!("{:016x}", rand::random::<u64>());
    let mut state = State::default();
    loop {
        let Some(sh) = shared.upgrade() else { return };
        let began = tokio::time::Instant::now();
        round(&sh, &stores, &pod_id, &mut state).await;
        let tick = sh.settings.tick();
        drop(sh);
        // A tick from the round's start, not its end (±10% so the regions' rounds do not
        // stay in lock step): a round slowed by an unreadable peer (a whole timeout) must
        // not push the next one past the lease on the shares it renews.
        let jitter = rand::random_range(0.9..1.1);
        tokio::time::sleep_until(began + tick.mul_f64(jitter)).await;
    }
}

async fn round(sh: &Shared, stores: &[RegionStore], pod_id: &str, state: &mut State) {
    let s = &sh.settings;
    let own = &stores[sh.region];
    let slots: Vec<(Arc<str>, Arc<Slot>)> = sh
        .slots
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let offered: Vec<(&str, u64)> = slots
        .iter()
        .map(|(name, slot)| (&**name, slot.offered.swap(0, Relaxed)))
        .filter(|(_, n)| *n > 0)
        .collect();
    let now = Instant::now();
    let known: HashSet<&str> = slots.iter().map(|(name, _)| &**name).collect();
    state.used.retain(|name, _| known.contains(&**name));
    for (name, _) in &slots {
        state.used.entry(name.clone()).or_insert(now);
    }
    for (name, _) in &offered {
        if let Some(at) = state.used.get_mut(*name) {
            *at = now;
        }
    }
    let hot: Vec<(&str, Subject, u64)> = slots
        .iter()
        .flat_map(|(name, slot)| {
            let taken = slot.hot().take(REPORT_FRACTION);
            taken.into_iter().map(move |(x, n)| (&**name, x, n))
        })
        .collect();
    let started = Instant::now();
    let asked = tokio::time::timeout(
        s.timeout(),
        own.own_round(&offered, &hot, pod_id, s.leader_ttl(), true),
    )
    .await;
    let answer = match asked {
        Ok(Ok(a)) => a,
        _ => {
            // One missed round's demand is counted in the next; an outage's is dropped, or
            // it would reach the store in one round and read as a spike of demand. The
            // shares' leases run out by themselves.
            state.failed += 1;
            if state.failed == 1 {
                for (name, n) in offered {
                    if let Some((_, slot)) = slots.iter().find(|(k, _)| &**k == name) {
                        slot.offered.fetch_add(n, Relaxed);
                    }
                }
            }
            if let Some(l) = &state.leading {
                if started.saturating_duration_since(l.renewed_at) + s.tick() >= s.leader_ttl() {
                    step_down(sh, state);
                }
            }
            return;
        }
    };
    state.failed = 0;
    let valid_until = started + s.lease();
    if !answer.leader {
        if state.leading.is_some() {
            step_down(sh, state);
        }
        for (name, slot) in &slots {
            // A record whose entries cannot be read: the floor for every subject.
            let (ppm, entries) = match answer.record.entries(name) {
                Some(entries) => (
                    answer.record.figures(name).share.unwrap_or(s.floor),
                    entries.into_iter().map(|(x, e)| (x, e.share)).collect(),
                ),
                None => (s.floor, Vec::new()),
            };
            apply(sh, slot, ppm, &entries, valid_until);
        }
        // A slot this pod has not used for a while, applied as a slot made now would be
        // (the floor, no entries), can go: meeting the policy again changes nothing.
        let idle: Vec<Arc<str>> = slots
            .iter()
            .filter(|(name, slot)| {
                let applied = slot.applied();
                idle_here(sh, state, name, now)
                    && applied.ppm == s.floor
                    && applied.entries.is_empty()
            })
            .map(|(name, _)| name.clone())
            .collect();
        drop(known);
        drop(slots);
        for name in idle {
            drop_slot(sh, &name);
        }
        return;
    }
    // A lease taken rather than renewed: another pod may have led meanwhile (this one
    // stalled past its lease), so what this one knew is stale; lead from the record.
    if answer.took_lease && state.leading.is_some() {
        step_down(sh, state);
    }
    // This pod's own store answered, and only this pod changes the region's shares: the
    // shares it applies stay good from this round's start, as a follower's do. (Applied
    // only at the end of the round, after the peers' reads, they lapsed to the floor for
    // a tick of every round while a peer could not be read.)
    for (_, slot) in &slots {
        let mut applied = slot.applied();
        applied.valid_until = applied.valid_until.max(valid_until);
    }
    let now = Instant::now();
    let leading = state.leading.get_or_insert_with(|| {
        sh.leader.store(true, Relaxed);
        tracing::info!(
            region = sh.region,
            "ratelimit: leading the region's rebalancing"
        );
        Leading {
            splits: HashMap::new(),
            meters: HashMap::new(),
            subjects: HashMap::new(),
            hot_taken: None,
            removed: HashMap::new(),
            orphans: HashSet::new(),
            forgotten: Vec::new(),
            counters: Vec::new(),
            peers: vec![None; sh.regions],
            renewed_at: started,
        }
    });
    leading.renewed_at = started;
    for (name, _) in &slots {
        if leading.splits.contains_key(name) {
            // An orphan this pod has met since: led as it was, now with a slot.
            leading.orphans.remove(name);
            continue;
        }
        // A new leader: pods may still use up to what the record claims, and the subjects'
        // demand it published stands until the next figures come (or every entry would
        // look cold for a round and collapse to the policy's share).
        let f = answer.record.figures(name);
        let entries = answer.record.entries(name).unwrap_or_default();
        leading.subjects.insert(
            name.clone(),
            entries.iter().map(|(x, e)| (*x, e.demand)).collect(),
        );
        // The region's demand as last published, until this leader has measured its own.
        leading
            .meters
            .insert(name.clone(), Meter::new(f.demand, now));
        leading
            .splits
            .insert(name.clone(), restore(s, &f, &entries, now));
    }
    adopt(sh, leading, &answer.record, &answer.offered, &known, now);
    drop(known);
    // Every policy led: this pod's slots, then the orphans (no slot to apply shares to).
    let led: Vec<(Arc<str>, Option<Arc<Slot>>)> = slots
        .into_iter()
        .map(|(name, slot)| (name, Some(slot)))
        .chain(leading.orphans.iter().map(|name| (name.clone(), None)))
        .collect();
    let resting = lead(
        sh,
        stores,
        &led,
        &answer.offered,
        leading,
        pod_id,
        valid_until,
    )
    .await;
    // The slots' references go before `forget` counts them.
    drop(led);
    forget(sh, own, leading, resting, pod_id).await;
    metrics::histogram!("ratelimit_region_rebalance_duration_seconds")
        .record(started.elapsed().as_secs_f64());
}

fn step_down(sh: &Shared, state: &mut State) {
    state.leading = None;
    sh.leader.store(false, Relaxed);
    tracing::info!(
        region = sh.region,
        "ratelimit: no longer leading the region"
    );
}

/// One round of the protocol for every policy `led` (each with this pod's slot, if any).
/// Returns the policies at rest that may be forgotten.
async fn lead(
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
        // An orphan's limit is known only to the pods that check it: for it, a part of the
        // demand alone, and no subject while none is measured (a part of nothing would mark
        // every subject remembered).
        let least = match slot {
            Some(x) => (own * HOT_FRACTION).max(x.base.rate() * s.floor_fraction),
            None if own > 0.0 && !resting => own * HOT_FRACTION,
            None => f64::INFINITY,
        };
        let mut busiest: Vec<(Subject, f64)> = subjects
            .map(|m| {
                m.iter()
                    .filter(|(_, d)| **d >= least)
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
    let now = Instant::now();
    led.iter()
        .filter(|(name, slot)| {
            idle_region(sh, l, name, slot.is_none(), offered, now)
                && l.splits.get(name).is_some_and(|x| x.at_rest(s.floor, now))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// A policy's split as a new leader takes it from the record: each share with its claim
/// held for a hold from `now` (a missing figure at the floor).
fn restore(s: &Settings, f: &Figures, entries: &[(Subject, EntryFigures)], now: Instant) -> Split {
    Split::restore(
        (f.share.unwrap_or(s.floor), f.claim.unwrap_or(s.floor)),
        entries.iter().map(|(x, e)| (*x, e.share, e.claim, e.hot)),
        now,
        s.hold(),
    )
}

/// Leads each policy this pod has no slot (`known`) for that the record has figures for
/// or a pod's checks counted (`offered`): nobody may lead it now, yet pods may use what
/// the record says, and other pods' checks may want it to grow. It is restored as a new
/// leader restores its own policies, and metered from its counter from now on. Left as
/// it is: a policy whose entries cannot be read (its claims are not known), and one whose
/// deletion is pending.
fn adopt(
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
    let counted = offered.keys().map(String::as_str);
    for name in record.policies().into_iter().chain(counted) {
        if known.contains(name) || l.splits.contains_key(name) || l.pending(name) {
            continue;
        }
        let Some(entries) = record.entries(name) else {
            continue;
        };
        let f = record.figures(name);
        tracing::debug!(region = sh.region, policy = %name, "ratelimit: leading a policy met elsewhere");
        let name: Arc<str> = name.into();
        // As a new leader's own: the demand published stands until this leader has measured
        // its own (here from the counter alone; its subjects' from the pods' reports).
        l.subjects.insert(
            name.clone(),
            entries.iter().map(|(x, e)| (*x, e.demand)).collect(),
        );
        l.meters.insert(name.clone(), Meter::new(f.demand, now));
        l.splits.insert(name.clone(), restore(s, &f, &entries, now));
        l.orphans.insert(name);
    }
}

/// Whether `name` is a policy met at run time that this pod has not used for
/// [`Settings::forget_idle`].
fn idle_here(sh: &Shared, state: &State, name: &str, now: Instant) -> bool {
    !sh.kept.contains(name)
        && state
            .used
            .get(name)
            .is_some_and(|at| sh.settings.idle(*at, now))
}

/// Whether `name` is a policy met at run time that no pod of the region has used for
/// [`Settings::forget_idle`], as far as this leader has metered; or an orphan (`slotless`)
/// without a counter in `offered` (no pod has counted it since its counter was deleted,
/// if ever).
fn idle_region(
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
fn drop_slot(sh: &Shared, name: &str) -> bool {
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
async fn forget(
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
    // The first take has no start to measure a rate from.
    let Some(since) = l.hot_taken.replace(now) else {
        return;
    };
    let secs = now.duration_since(since).as_secs_f64().max(1e-3);
    let periods = (secs / s.period.as_secs_f64()).min(1.0);
    let weight = 1.0 - (1.0 - s.smoothing).powf(periods);
    for (name, _) in led {
        let counts: HashMap<Subject, u64> = taken
            .remove(&**name)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let smoothed = l.subjects.entry(name.clone()).or_default();
        for (x, d) in smoothed.iter_mut() {
            let rate = counts.get(x).map_or(0.0, |n| *n as f64 / secs);
            *d = smooth(Some(*d), rate, weight);
        }
        // A subject new to the figures starts at its measured rate, as a policy does.
        for (x, n) in &counts {
            smoothed.entry(*x).or_insert(*n as f64 / secs);
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
            Some(Publication {
                policy: name,
                claim: claims.policy,
                share: split.policy().share(),
                demand: l.meters.get(name).and_then(|m| m.smoothed).unwrap_or(0.0),
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
    l.forgotten
        .retain(|f| !led.iter().any(|(name, _)| *name == f.policy));
    l.counters
        .retain(|(c, _)| !led.iter().any(|(name, _)| name == c));
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

/// Makes `ppm` the share this pod checks with, and `entries` the hot subjects' own, until
/// `valid_until`.
fn apply(sh: &Shared, slot: &Slot, ppm: u32, entries: &[(Subject, u32)], valid_until: Instant) {
    let floor = sh.settings.floor;
    let mut applied = slot.applied();
    if applied.ppm == ppm {
        applied.valid_until = valid_until;
    } else {
        match Applied::at(&slot.base, ppm, floor, valid_until) {
            Ok(a) => {
                *applied = Applied {
                    entries: std::mem::take(&mut applied.entries),
                    ..a
                }
            }
            // A share so small that the limit is out of range: stay at the old one until
            // its lease runs out, then the floor.
            Err(e) => tracing::warn!(error = %e, "ratelimit: share not applied"),
        }
    }
    if !applied.set_entries(&slot.base, entries, floor) {
        tracing::warn!("ratelimit: a subject's share out of range, applied at the floor");
    }
    let (region, policy) = (sh.region.to_string(), slot.base.metric_label());
    metrics::gauge!("ratelimit_region_share", "region" => region.clone(), "policy" => policy.clone())
        .set(f64::from(applied.ppm) / f64::from(WHOLE));
    metrics::gauge!("ratelimit_region_hot_subjects", "region" => region, "policy" => policy)
        .set(applied.entries.len() as f64);
}
