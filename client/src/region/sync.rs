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
//! limit (at most [`HOT_MAX`] by default; of an orphan, the limit its pods report with its
//! subjects), tracks those and every subject a peer marks hot, and runs
//! [`super::split`] for them: each gets a share following its own demand.
//!
//! Leases, so that a shrink can be relied on: a pod may use a share only for
//! [`Settings::lease`] after the start of its last successful round trip to its own store,
//! then at most the floor; the leader keeps its claim for [`Settings::hold`] (a lease and a
//! tick) after writing a lower share.
//!
//! Here: each pod's round, and what the leader keeps between rounds. The leader's round is
//! in [`mod@lead`], orphans and forgetting in [`mod@forget`], the settings in [`settings`].

mod forget;
mod lead;
mod settings;

use super::limiter::{Applied, Shared, Slot};
use super::record::{EntryFigures, Figures, Forgotten, Record, RegionStore, Still};
use super::share::WHOLE;
use super::split::{Split, Subject};
use forget::{adopt, drop_slot, forget, idle_here};
use lead::lead;
pub(crate) use settings::Settings;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
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

/// A pod's rounds start a tick apart, ± this part of it.
const TICK_JITTER: f64 = 0.1;

/// Most subjects a region marks hot per policy, by default; every region tracks the union
/// of them.
pub(crate) const HOT_MAX: usize = 16;

#[derive(Debug)]
struct Meter {
    last: Option<(u64, Instant)>,
    smoothed: Option<f64>,
    /// When the region's count last moved, or metering began.
    moved: Instant,
    /// The count and `moved` that this leader last wrote to the record as its idle clock.
    written: Option<(u64, Instant)>,
}

impl Meter {
    fn new(smoothed: Option<f64>, now: Instant) -> Self {
        Self {
            last: None,
            smoothed,
            moved: now,
            written: None,
        }
    }

    /// The idle clock to write, once the count has not moved at a reading, and once per
    /// stop: while the count moves, a new leader sees it move and starts from then, so
    /// the record need not follow it (a field written every round for every policy). A
    /// new leader writes a busy policy's once (its meter starts unmoved).
    fn still(&self, clock: &ServerClock) -> Option<Still> {
        let (_, at) = self.last?;
        let stopped = self.stopped()?;
        (at != self.moved && self.written != Some(stopped)).then(|| Still {
            ms: clock.ms(self.moved),
            count: stopped.0,
        })
    }

    /// The last count read and when it last moved: what [`Meter::still`] writes, and what
    /// `written` remembers once it is written.
    fn stopped(&self) -> Option<(u64, Instant)> {
        self.last.map(|(count, _)| (count, self.moved))
    }
}

/// The region's server clock as one round read it: its time, in ms since the epoch, at
/// `at`. The record keeps when each policy's count last moved on this clock, which every
/// pod of the region shares, so a new leader goes on counting a policy's idle time where
/// the last one left it. `at` is the round trip's start, and the server read its clock
/// up to a round trip later: a time written reads later by the writer's delay and earlier
/// by the reader's, an error of at most a sync timeout against an idle time of minutes.
#[derive(Debug, Clone, Copy)]
struct ServerClock {
    at: Instant,
    ms: u64,
}

impl ServerClock {
    /// `when` on the server's clock.
    fn ms(&self, when: Instant) -> u64 {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        match when.checked_duration_since(self.at) {
            Some(after) => self.ms.saturating_add(ms(after)),
            None => self.ms.saturating_sub(ms(self.at - when)),
        }
    }

    /// The instant the server's clock read `ms`, at most `cap` before `at`: further back
    /// is no more idle than that. A time after `at` (the clock went back, or another
    /// server's after a failover) counts as `at`.
    fn instant(&self, ms: u64, cap: Duration) -> Instant {
        let ago = Duration::from_millis(self.ms.saturating_sub(ms)).min(cap);
        self.at.checked_sub(ago).unwrap_or(self.at)
    }
}

#[derive(Debug)]
struct Leading {
    splits: HashMap<Arc<str>, Split>,
    meters: HashMap<Arc<str>, Meter>,
    /// Smoothed offered cost per second of the region's busiest subjects, by policy.
    subjects: HashMap<Arc<str>, HashMap<Subject, f64>>,
    /// The limits per second that pods report with their busiest subjects, by policy: an
    /// orphan's is known no other way.
    rates: HashMap<Arc<str>, f64>,
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
    /// The server's clock as this round read it.
    clock: ServerClock,
}

impl Leading {
    /// A pod that starts to lead, its lease renewed at `renewed_at`.
    fn new(regions: usize, renewed_at: Instant, clock: ServerClock) -> Self {
        Self {
            splits: HashMap::new(),
            meters: HashMap::new(),
            subjects: HashMap::new(),
            rates: HashMap::new(),
            hot_taken: None,
            removed: HashMap::new(),
            orphans: HashSet::new(),
            forgotten: Vec::new(),
            counters: Vec::new(),
            peers: vec![None; regions],
            renewed_at,
            clock,
        }
    }

    /// The pending deletions were written: forgotten policies' fields and counters gone.
    fn deleted(&mut self) {
        self.forgotten.clear();
        self.counters.clear();
    }

    /// Leads `name` from the record's figures `f` and `entries`, as a new leader takes a
    /// policy: each share with its claim held for a hold from `now` (a missing figure at the
    /// floor), as pods may still use up to what the record claims; the region's demand and
    /// its subjects' as last published, until this leader has measured its own (or every
    /// entry would look cold for a round and collapse to the policy's share); its idle
    /// clock from when the last leader saw its count move, unless the count (`counted`) has
    /// moved since.
    fn restore(
        &mut self,
        s: &Settings,
        name: Arc<str>,
        f: &Figures,
        entries: &[(Subject, EntryFigures)],
        counted: u64,
        now: Instant,
    ) {
        let split = Split::restore(
            (f.share.unwrap_or(s.floor), f.claim.unwrap_or(s.floor)),
            entries.iter().map(|(x, e)| (*x, e.share, e.claim, e.hot)),
            now,
            s.hold(),
        );
        let demands = entries.iter().map(|(x, e)| (*x, e.demand)).collect();
        self.subjects.insert(name.clone(), demands);
        let mut meter = Meter::new(f.demand, now);
        if let Some(still) = f.still.filter(|still| still.count == counted) {
            meter.moved = self.clock.instant(still.ms, s.forget_idle);
            // The record has it already.
            meter.written = Some((counted, meter.moved));
        }
        self.meters.insert(name.clone(), meter);
        self.splits.insert(name, split);
    }

    /// The policies whose fields or counter wait to be deleted.
    fn pending(&self) -> HashSet<&str> {
        let fields = self.forgotten.iter().map(|f| &*f.policy);
        fields
            .chain(self.counters.iter().map(|(c, _)| &**c))
            .collect()
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
        let jitter = rand::random_range(1.0 - TICK_JITTER..1.0 + TICK_JITTER);
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
    // Each slot's demand since the last round, in the slots' order.
    let taken: Vec<u64> = slots
        .iter()
        .map(|(_, slot)| slot.offered.swap(0, Relaxed))
        .collect();
    let offered: Vec<(&str, u64)> = slots
        .iter()
        .zip(&taken)
        .map(|((name, _), n)| (&**name, *n))
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
    // With its subjects, each policy's limit: a leader that has not met the policy judges
    // them by it. Not from the leader itself (its own slots' limits are its own), nor with
    // per-subject shares off.
    let reported: HashSet<&str> = if state.leading.is_none() && s.hot_max > 0 {
        hot.iter().map(|(p, _, _)| *p).collect()
    } else {
        HashSet::new()
    };
    let rates: Vec<(&str, f64)> = slots
        .iter()
        .filter(|(name, _)| reported.contains(&**name))
        .map(|(name, slot)| (&**name, slot.base.rate()))
        .collect();
    let started = Instant::now();
    let asked = tokio::time::timeout(
        s.timeout(),
        own.own_round(&offered, &hot, &rates, pod_id, s.leader_ttl(), true),
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
                for ((_, slot), n) in slots.iter().zip(&taken) {
                    slot.offered.fetch_add(*n, Relaxed);
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
    let clock = ServerClock {
        at: started,
        ms: answer.server_ms,
    };
    let leading = state.leading.get_or_insert_with(|| {
        sh.leader.store(true, Relaxed);
        tracing::info!(
            region = sh.region,
            "ratelimit: leading the region's rebalancing"
        );
        Leading::new(sh.regions, started, clock)
    });
    leading.renewed_at = started;
    leading.clock = clock;
    for (name, _) in &slots {
        if leading.splits.contains_key(name) {
            // An orphan this pod has met since: led as it was, now with a slot.
            leading.orphans.remove(name);
            continue;
        }
        // A new leader (entries that cannot be read: none, the floor for every subject).
        let f = answer.record.figures(name);
        let entries = answer.record.entries(name).unwrap_or_default();
        let counted = answer.offered.get(&**name).copied().unwrap_or(0);
        leading.restore(s, name.clone(), &f, &entries, counted, now);
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
    // Every pod of the region reports these under the same labels: only the leader's count.
    let region = sh.region.to_string();
    metrics::gauge!("ratelimit_region_figure_age_seconds", "region" => region.clone()).set(0.0);
    metrics::gauge!("ratelimit_region_led_policies", "region" => region).set(0.0);
    tracing::info!(
        region = sh.region,
        "ratelimit: no longer leading the region"
    );
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
    metrics::gauge!(
        "ratelimit_region_share",
        "region" => region.clone(),
        "policy" => policy.clone()
    )
    .set(f64::from(applied.ppm) / f64::from(WHOLE));
    metrics::gauge!("ratelimit_region_hot_subjects", "region" => region, "policy" => policy)
        .set(applied.entries.len() as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_clock_maps_both_ways() {
        let at = Instant::now();
        let clock = ServerClock {
            at,
            ms: 1_796_309_398_400,
        };
        let cap = Duration::from_secs(600);
        let before = at.checked_sub(Duration::from_millis(2_500));
        if let Some(before) = before {
            assert_eq!(clock.ms(before), 1_796_309_395_900);
            assert_eq!(clock.instant(1_796_309_395_900, cap), before);
        }
        assert_eq!(clock.ms(at + Duration::from_millis(40)), 1_796_309_398_440);
        // Later than the clock read (it went back): now. Further back than the cap: the cap.
        assert_eq!(clock.instant(1_796_309_399_000, cap), at);
        let long_ago = clock.instant(0, cap);
        assert!(long_ago == at || at - long_ago == cap);
    }

    /// The idle clock is written once per stop of the count, not while it moves.
    #[test]
    fn the_idle_clock_is_written_when_the_count_stops() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let clock = ServerClock { at: t0, ms: 1_000 };
        let mut m = Meter::new(None, t0);
        assert_eq!(m.still(&clock), None, "not metered yet");
        // Metered at 500 ms: unmoved since metering began.
        m.last = Some((7, at(500)));
        assert_eq!(
            m.still(&clock),
            Some(Still {
                ms: 1_000,
                count: 7
            })
        );
        m.written = Some((7, t0));
        assert_eq!(m.still(&clock), None, "written already");
        // It moves at 1 s: nothing while it moves.
        (m.last, m.moved) = (Some((9, at(1_000))), at(1_000));
        assert_eq!(m.still(&clock), None, "moving");
        // Then stays: written once more.
        m.last = Some((9, at(1_500)));
        assert_eq!(
            m.still(&clock),
            Some(Still {
                ms: 2_000,
                count: 9
            })
        );
    }

    /// A new leader's idle clock for a policy: where the record's says it stopped, if the
    /// count has not moved since; else from now.
    #[test]
    fn a_restored_policy_keeps_its_idle_clock_unless_its_count_moved() {
        let s = Settings::default();
        let now = Instant::now();
        let ms = 1_796_309_398_400;
        let mut l = Leading::new(3, now, ServerClock { at: now, ms });
        let f = Figures {
            claim: None,
            share: None,
            demand: Some(2.0),
            still: Some(Still {
                ms: ms - 90_000,
                count: 12,
            }),
        };
        let unknown = Figures { still: None, ..f };
        let ancient = Figures {
            still: Some(Still { ms: 0, count: 12 }),
            ..f
        };
        l.restore(&s, "still".into(), &f, &[], 12, now);
        l.restore(&s, "moved".into(), &f, &[], 13, now);
        l.restore(&s, "unknown".into(), &unknown, &[], 12, now);
        l.restore(&s, "ancient".into(), &ancient, &[], 12, now);
        let moved = |name: &str| l.meters[name].moved;
        if let Some(then) = now.checked_sub(Duration::from_secs(90)) {
            assert_eq!(moved("still"), then);
        }
        // Idle since the epoch: no further back than `forget_idle` (or now, if the
        // platform's instants cannot go that far back).
        let ancient = moved("ancient");
        assert!(ancient == now || now - ancient == s.forget_idle);
        assert_eq!(moved("moved"), now);
        assert_eq!(moved("unknown"), now);
        assert_eq!(l.meters["still"].smoothed, Some(2.0));
        // Read again unmoved: the clock taken over is not written again; the others' are.
        let later = now + Duration::from_millis(500);
        for m in l.meters.values_mut() {
            m.last = Some((12, later));
        }
        let to_write = |name: &str| l.meters[name].still(&l.clock).map(|x| x.count);
        assert_eq!(to_write("still"), None);
        assert_eq!(to_write("unknown"), Some(12));
    }
}
