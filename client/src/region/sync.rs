//! The rebalancing task: every tick (a quarter of the rebalance period) each pod adds its
//! offered demand to its region's counters and reads its region's record; the region's
//! leader (one pod per region, by a lease in the region's store) also runs the protocol of
//! [`super::share`]: measure the region's demand and recompute targets (smoothed so that a
//! period's worth of rounds weighs the smoothing weight), publish the intent, read the
//! peers, grow if there is room, publish the claims. Other pods follow the record's shares.
//!
//! Leases, so that a shrink can be relied on: a pod may use a share only for
//! [`Settings::lease`] after the start of its last successful round trip to its own store,
//! then at most the floor; the leader keeps its claim for [`Settings::hold`] (a lease and a
//! tick) after writing a lower share.

use super::limiter::{Applied, Shared, Slot};
use super::record::{Record, RegionStore};
use super::share::{smooth, targets, Share, WHOLE};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A shrink smaller than this (ppm) is not made: demand noise would otherwise make regions
/// give up quota they cannot get back before the next period.
const DEADBAND: u32 = WHOLE / 100;

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
        }
    }
}

impl Settings {
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

#[derive(Debug, Default)]
struct Meter {
    last: Option<(u64, Instant)>,
    smoothed: Option<f64>,
}

#[derive(Debug)]
struct Leading {
    shares: HashMap<Arc<str>, Share>,
    meters: HashMap<Arc<str>, Meter>,
    /// Each peer's record as last read, and when.
    peers: Vec<Option<(Record, Instant)>>,
    renewed_at: Instant,
}

#[derive(Debug, Default)]
struct State {
    leading: Option<Leading>,
    /// Consecutive rounds that could not reach the own store.
    failed: u32,
}

/// Runs until the limiter is dropped.
pub(crate) async fn run(shared: Weak<Shared>, stores: Vec<RegionStore>) {
    let pod_id = format!("{:016x}", rand::random::<u64>());
    let mut state = State::default();
    loop {
        let Some(sh) = shared.upgrade() else { return };
        round(&sh, &stores, &pod_id, &mut state).await;
        let tick = sh.settings.tick();
        drop(sh);
        // ±10% so the regions' rounds do not stay in lock step.
        let jitter = rand::random_range(0.9..1.1);
        tokio::time::sleep(tick.mul_f64(jitter)).await;
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
    let started = Instant::now();
    let asked = tokio::time::timeout(
        s.timeout(),
        own.own_round(&offered, pod_id, s.leader_ttl(), true),
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
            let ppm = answer.record.figures(name).share.unwrap_or(s.floor);
            apply(sh, slot, ppm, valid_until);
        }
        return;
    }
    let now = Instant::now();
    let leading = state.leading.get_or_insert_with(|| {
        sh.leader.store(true, Relaxed);
        tracing::info!(
            region = sh.region,
            "ratelimit: leading the region's rebalancing"
        );
        Leading {
            shares: HashMap::new(),
            meters: HashMap::new(),
            peers: vec![None; sh.regions],
            renewed_at: started,
        }
    });
    leading.renewed_at = started;
    for (name, _) in &slots {
        leading.shares.entry(name.clone()).or_insert_with(|| {
            // A new leader: pods may still use up to what the record claims.
            let f = answer.record.figures(name);
            Share::restore(
                f.share.unwrap_or(s.floor),
                f.claim.unwrap_or(s.floor),
                now,
                s.hold(),
            )
        });
    }
    lead(sh, stores, &slots, &answer.offered, leading, valid_until).await;
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

async fn lead(
    sh: &Shared,
    stores: &[RegionStore],
    slots: &[(Arc<str>, Arc<Slot>)],
    offered: &HashMap<String, u64>,
    l: &mut Leading,
    valid_until: Instant,
) {
    let s = &sh.settings;
    let me = sh.region;
    let now = Instant::now();
    // Demand every round: the rate since the last one, smoothed so that a period's worth
    // of rounds weighs `smoothing` (the weight the builder sets per period). Then new
    // targets at once (a shrink applies at once; growth goes through the protocol): a
    // change of demand is acted on within a round or two, not at the next period.
    for (name, _) in slots {
        let meter = l.meters.entry(name.clone()).or_default();
        let total = offered.get(&**name).copied().unwrap_or(0);
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
    for (name, _) in slots {
        let demands: Vec<f64> = (0..sh.regions)
            .map(|q| {
                if q == me {
                    l.meters.get(name).and_then(|m| m.smoothed).unwrap_or(0.0)
                } else {
                    l.peers[q]
                        .as_ref()
                        .and_then(|(rec, _)| rec.figures(name).demand)
                        .unwrap_or(0.0)
                }
            })
            .collect();
        let target = targets(&demands, s.floor)[me];
        if let Some(share) = l.shares.get_mut(name) {
            let keep = target < share.share() && share.share() - target < DEADBAND;
            share.retarget(if keep { share.share() } else { target }, now);
        }
    }
    // Phase 1: the intents (and any shrink) published before the peers are read.
    let intents: Vec<u32> = slots
        .iter()
        .map(|(name, _)| l.shares.get(name).map_or(s.floor, |x| x.intent(now)))
        .collect();
    if publish(sh, &stores[me], slots, l, Some(&intents)).await {
        // Phase 2: every peer, at once, each with its own timeout.
        let reads = futures_join(stores, me, s.timeout()).await;
        let read_at = Instant::now();
        for (q, r) in reads.iter().enumerate() {
            if let Some(rec) = r {
                l.peers[q] = Some((rec.clone(), read_at));
            }
        }
        for ((name, _), intent) in slots.iter().zip(&intents) {
            let others: Vec<Option<u32>> = reads
                .iter()
                .enumerate()
                .filter(|(q, _)| *q != me)
                .map(|(_, r)| {
                    r.as_ref()
                        .map(|rec| rec.figures(name).claim.unwrap_or(s.floor))
                })
                .collect();
            if let Some(share) = l.shares.get_mut(name) {
                share.grow(*intent, &others);
            }
        }
        // Phase 3: back to claiming what is used.
        publish(sh, &stores[me], slots, l, None).await;
    }
    for (name, slot) in slots {
        if let Some(share) = l.shares.get(name) {
            apply(sh, slot, share.share(), valid_until);
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
}

/// Writes the leader's figures: `claims` (phase 1's intents) or each share's claim now.
/// A write that succeeded starts the hold of any shrink in it.
async fn publish(
    sh: &Shared,
    own: &RegionStore,
    slots: &[(Arc<str>, Arc<Slot>)],
    l: &mut Leading,
    claims: Option<&[u32]>,
) -> bool {
    let s = &sh.settings;
    let now = Instant::now();
    let figures: Vec<(&str, u32, u32, f64)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, (name, _))| {
            let share = l.shares.get(name)?;
            let claim = claims.and_then(|c| c.get(i).copied());
            let demand = l.meters.get(name).and_then(|m| m.smoothed).unwrap_or(0.0);
            Some((
                &**name,
                claim.unwrap_or_else(|| share.claim(now)),
                share.share(),
                demand,
            ))
        })
        .collect();
    if figures.is_empty() {
        return false;
    }
    let ok = matches!(
        tokio::time::timeout(s.timeout(), own.publish(&figures)).await,
        Ok(Ok(()))
    );
    if ok {
        let at = Instant::now();
        for share in l.shares.values_mut() {
            share.written(at, s.hold());
        }
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

/// Makes `ppm` the share this pod checks with, until `valid_until`.
fn apply(sh: &Shared, slot: &Slot, ppm: u32, valid_until: Instant) {
    let floor = sh.settings.floor;
    let mut applied = slot.applied();
    if applied.ppm == ppm {
        applied.valid_until = valid_until;
    } else {
        match Applied::at(&slot.base, ppm, floor, valid_until) {
            Ok(a) => *applied = a,
            // A share so small that the limit is out of range: stay at the old one until
            // its lease runs out, then the floor.
            Err(e) => tracing::warn!(error = %e, "ratelimit: share not applied"),
        }
    }
    metrics::gauge!("ratelimit_region_share", "region" => sh.region.to_string(), "policy" => slot.base.metric_label())
        .set(f64::from(applied.ppm) / f64::from(WHOLE));
}
