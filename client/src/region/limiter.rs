//! The region-aware limiter: a [`Limiter`] on the region's own store, checking each policy
//! at the region's current share; the shares come from [`super::sync`], off the request path.

use super::hot::HotCounter;
use super::record::RegionStore;
use super::share::WHOLE;
use super::split::Subject;
use super::sync::{self, Settings};
use super::RegionTarget;
use crate::pods::LivePods;
use crate::{Decision, Error, Limiter, LimiterBuilder, Policy, Reservation};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Checks requests against a region's share of each policy, in the region's own store.
/// Cheap to clone; clones share everything. The rebalancing task stops when the last clone
/// is dropped.
///
/// ```no_run
/// use redis_ratelimit_client::region::RegionalLimiter;
/// use redis_ratelimit_client::Policy;
/// # async fn demo() -> Result<(), redis_ratelimit_client::Error> {
/// let api = Policy::builder("api").per_second(300).burst(30).build()?;
/// // This pod is in region 1 of three; one store per region, in the same order everywhere.
/// let stores = ["redis://eu:6379", "redis://us:6379", "redis://ap:6379"];
/// let limiter = RegionalLimiter::builder(1, stores)
///     .policy(&api)
///     .build()?;
/// let d = limiter.check_one(&api, "api-key-123", 1).await?;
/// # let _ = d;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RegionalLimiter {
    shared: Arc<Shared>,
    _task: Arc<TaskGuard>,
    pods: Option<Arc<LivePods>>,
}

/// What the check path and the sync task share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) region: usize,
    pub(crate) regions: usize,
    pub(crate) limiter: Limiter,
    pub(crate) slots: RwLock<HashMap<Arc<str>, Arc<Slot>>>,
    /// The builder's policies: never forgotten (see [`RegionalBuilder::forget_idle`]).
    pub(crate) kept: HashSet<Arc<str>>,
    pub(crate) settings: Settings,
    pub(crate) rebalances: AtomicU64,
    pub(crate) leader: AtomicBool,
}

/// One policy as this pod applies it.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The global policy.
    pub(crate) base: Policy,
    /// Offered cost since the sync task last took it (this region's demand).
    pub(crate) offered: Arc<AtomicU64>,
    /// This pod's busiest subjects since the sync task last took them.
    pub(crate) hot: Mutex<HotCounter>,
    pub(crate) applied: Mutex<Applied>,
}

/// Where a regional request's cost is counted (its policy's offered counter: the region's
/// demand), and the policy at the region's share for its subject. The most one request
/// counts is the policy's whole burst: a larger cost can never pass, and the cap keeps the
/// counters (summed on the store with `HINCRBY`, a signed 64-bit integer, never reset)
/// from overflow for any burst in use: even the largest valid one, 10^15 tokens, would
/// take ~9 000 requests of that cost.
#[derive(Debug, Clone)]
pub(crate) struct Demand {
    slot: Arc<Slot>,
    subject: Subject,
}

impl Demand {
    /// What a request of `cost` counts.
    pub(crate) fn counted(&self, cost: u64) -> u64 {
        cost.min(self.slot.base.burst())
    }

    /// Counts a request of `cost`.
    pub(crate) fn add(&self, cost: u64) {
        self.offered().fetch_add(self.counted(cost), Relaxed);
    }

    /// The counter.
    pub(crate) fn offered(&self) -> &AtomicU64 {
        &self.slot.offered
    }

    /// The policy at the region's share for the subject, as it is now.
    pub(crate) fn policy_now(&self) -> Policy {
        self.slot
            .applied()
            .for_subject(self.subject, Instant::now())
            .clone()
    }
}

/// Subjects a pod's [`HotCounter`] keeps per policy: any subject with more than 1/64 of
/// the pod's offered cost is among them.
const HOT_CAPACITY: usize = 64;

/// A subject's id in the regions' records: XXH3-64 of its name, unseeded, so that every
/// region names it alike.
pub(crate) fn subject_id(subject: &str) -> Subject {
    xxhash_rust::xxh3::xxh3_64(subject.as_bytes())
}

/// The shares a pod checks with (the policy's, and each hot subject's), and until when it
/// may.
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    pub(crate) ppm: u32,
    pub(crate) policy: Policy,
    /// `policy` at no more than the floor: what a pod uses once its lease on `ppm` ran out
    /// (its own store unreachable for longer than a lease).
    pub(crate) capped: Policy,
    /// Hot subjects' own shares, each as `(ppm, policy, capped)`.
    pub(crate) entries: HashMap<Subject, (u32, Policy, Policy)>,
    pub(crate) valid_until: Instant,
}

impl Slot {
    fn new(base: &Policy, floor: u32, now: Instant) -> Result<Self, Error> {
        let applied = Applied::at(base, floor, floor, now)?;
        Ok(Self {
            base: base.clone(),
            offered: Arc::default(),
            hot: Mutex::new(HotCounter::new(HOT_CAPACITY)),
            applied: Mutex::new(applied),
        })
    }

    pub(crate) fn applied(&self) -> std::sync::MutexGuard<'_, Applied> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn hot(&self) -> std::sync::MutexGuard<'_, HotCounter> {
        self.hot.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Applied {
    pub(crate) fn at(
        base: &Policy,
        ppm: u32,
        floor: u32,
        valid_until: Instant,
    ) -> Result<Self, Error> {
        let (policy, capped) = scale(base, ppm, floor)?;
        Ok(Self {
            ppm,
            policy,
            capped,
            entries: HashMap::new(),
            valid_until,
        })
    }

    /// Hot subjects' shares: `entries` replaces the ones before (kept where unchanged).
    /// A share whose limit is out of range is applied at most at the floor, which every
    /// region's claim covers (no share is ever below it). Returns whether all applied.
    pub(crate) fn set_entries(
        &mut self,
        base: &Policy,
        entries: &[(Subject, u32)],
        floor: u32,
    ) -> bool {
        let mut all = true;
        let mut next = HashMap::with_capacity(entries.len());
        for &(x, ppm) in entries {
            let entry = match self.entries.get(&x) {
                Some(e) if e.0 == ppm => e.clone(),
                _ => match scale(base, ppm, floor) {
                    Ok((policy, capped)) => (ppm, policy, capped),
                    Err(_) => {
                        all = false;
                        (ppm.min(floor), self.capped.clone(), self.capped.clone())
                    }
                },
            };
            next.insert(x, entry);
        }
        self.entries = next;
        all
    }

    /// The policy to check `subject` with at `now`.
    fn for_subject(&self, subject: Subject, now: Instant) -> &Policy {
        let (policy, capped) = match self.entries.get(&subject) {
            Some((_, policy, capped)) => (policy, capped),
            None => (&self.policy, &self.capped),
        };
        if now < self.valid_until {
            policy
        } else {
            capped
        }
    }
}

/// `base` at `ppm`, and at no more than the floor.
fn scale(base: &Policy, ppm: u32, floor: u32) -> Result<(Policy, Policy), Error> {
    let fraction = |ppm: u32| f64::from(ppm) / f64::from(WHOLE);
    Ok((
        base.scaled(fraction(ppm))?,
        base.scaled(fraction(ppm.min(floor)))?,
    ))
}

/// A request's policies at the region's share, and where each one's demand is counted.
struct Scaled {
    policies: Vec<(Policy, u64)>,
    demand: Vec<Demand>,
}

impl Scaled {
    fn refs(&self) -> Vec<(&Policy, u64)> {
        self.policies.iter().map(|(p, c)| (p, *c)).collect()
    }
}

#[derive(Debug)]
struct TaskGuard(tokio::task::JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Configures a [`RegionalLimiter`]; see [`RegionalLimiter::builder`].
#[must_use]
pub struct RegionalBuilder {
    region: usize,
    urls: Vec<RegionTarget>,
    policies: Vec<Policy>,
    settings: Settings,
    configure: Box<dyn FnOnce(LimiterBuilder) -> LimiterBuilder + Send>,
    live_pods: Option<Duration>,
}

impl std::fmt::Debug for RegionalBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionalBuilder")
            .field("region", &self.region)
            .field("urls", &self.urls)
            .field("settings", &self.settings)
            .finish()
    }
}

impl RegionalBuilder {
    /// How often shares are recomputed from demand (default 2 s; from 40 ms to 1 h).
    /// Figures are exchanged four times per period, so a shrink elsewhere is used within
    /// about a period.
    pub fn rebalance_period(mut self, period: Duration) -> Self {
        self.settings.period = period.clamp(Duration::from_millis(40), Duration::from_secs(3_600));
        self
    }

    /// Least share of every policy per region (default 0.05; above 0, at most 1 ÷ regions):
    /// what an idle region can still serve in a sudden burst, and where every region starts.
    pub fn floor(mut self, fraction: f64) -> Self {
        self.settings.floor_fraction = fraction;
        self
    }

    /// Weight of the newest demand figure in the smoothed one (default 0.5 per period).
    pub fn smoothing(mut self, weight: f64) -> Self {
        self.settings.smoothing = weight.clamp(0.01, 1.0);
        self
    }

    /// Longest wait for each store call of the rebalancing (default: a quarter period,
    /// at most 500 ms; more than a quarter period is refused by [`build`](Self::build)).
    /// Never on the request path.
    pub fn sync_timeout(mut self, timeout: Duration) -> Self {
        self.settings.timeout = Some(timeout);
        self
    }

    /// A policy to balance from the start, and never forget (others are added on their
    /// first check and forgotten once idle, see [`forget_idle`](Self::forget_idle)). Pods
    /// of a region need not have the same policies: the region's leader also rebalances
    /// the policies only other pods check, from the demand their checks count in the
    /// region's store, and judges their subjects by the limit those pods report with
    /// them. While a pod without this policy leads, though, it is led as one met at run
    /// time: at the floor until counted, forgotten by the leader when idle; give a policy
    /// that must keep its share while idle to every pod. Services that share a store with
    /// different policies need their own [`key_prefix`](Self::key_prefix).
    pub fn policy(mut self, policy: &Policy) -> Self {
        self.policies.push(policy.clone());
        self
    }

    /// Counts this region's live pods ([`LivePods`], in the region's own store, server or
    /// cluster, under `<prefix>:pods:<region>`, counted out after `ttl`) for the local
    /// fallback: the region's share ÷ its live pods. Pods beat every `ttl / 3` with a 500 ms
    /// timeout, so `ttl` must be over 1.5 s ([`build`](Self::build) refuses it otherwise).
    pub fn live_pods(mut self, ttl: Duration) -> Self {
        self.live_pods = Some(ttl);
        self
    }

    /// Most subjects this region marks hot per policy, each then getting a share of its own
    /// in every region (default 16; 0 turns per-subject shares off). Every pod of every
    /// region must run a version that knows per-subject shares before any region marks a
    /// subject hot: an older pod would check a hot subject at the policy's share while its
    /// region claims the subject's. Upgrading from one: 0 everywhere until all pods run
    /// this one.
    pub fn hot_subjects(mut self, max: usize) -> Self {
        self.settings.hot_max = max;
        self
    }

    /// How long a policy met at run time (one not given to [`policy`](Self::policy)) may
    /// go unchecked (checks of cost 0 do not count) before it is forgotten (default 10
    /// minutes, at least a rebalance period). The region's leader steers its share to the
    /// floor, then drops its slot, its figures in the region's record and its demand
    /// counter; another pod drops its slot once it applies the policy at the floor. So
    /// policy names made at run time (per tenant, say) do not pile up. A forgotten policy
    /// checked again starts at the floor, as a new one does, and grows with its measured
    /// demand. The leader forgets a policy it has no slot for once no pod has counted
    /// demand for it for as long (with `Duration::MAX`: once it has no demand counter at
    /// all, its figures steered to the floor first). The region's idle time is kept in its
    /// record on its server's clock, so a change of leader does not start it again.
    pub fn forget_idle(mut self, after: Duration) -> Self {
        self.settings.forget_idle = after;
        self
    }

    /// Key prefix of the regions' records (default `rl`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.prefix = prefix.into();
        self
    }

    /// Configures the limiter on the region's own store (timeout, breaker, pods...).
    pub fn limiter(
        mut self,
        configure: impl FnOnce(LimiterBuilder) -> LimiterBuilder + Send + 'static,
    ) -> Self {
        self.configure = Box::new(configure);
        self
    }

    /// Builds the limiter and starts the rebalancing task. Does not wait for any store.
    /// Must be called within a Tokio runtime.
    pub fn build(self) -> Result<RegionalLimiter, Error> {
        let regions = self.urls.len();
        if self.region >= regions {
            return Err(Error::Config(format!(
                "region {} of {regions} store URLs",
                self.region
            )));
        }
        let mut settings = self.settings;
        let floor = settings.floor_fraction;
        // Every region's floor is at least one part of `WHOLE`.
        if regions > WHOLE as usize {
            return Err(Error::Config(format!("{regions} regions: at most {WHOLE}")));
        }
        // Above 0: a policy at a share of 0 would have no rate at all (no valid limit).
        if !(floor > 0.0 && floor * regions as f64 <= 1.0 + 1e-9) {
            return Err(Error::Config(format!(
                "floor {floor} × {regions} regions must be above 0 and at most 1"
            )));
        }
        settings.floor = ((floor * f64::from(WHOLE)) as u32).clamp(1, WHOLE / regions as u32);
        // Shorter, one quiet round would steer a policy to the floor and its slots would
        // churn.
        settings.forget_idle = settings.forget_idle.max(settings.period);
        // A round makes a few store calls, each up to this timeout, and the shares it
        // renews last two ticks: a timeout above a tick would let them lapse, and the
        // leader's lease (four ticks) with them.
        if let Some(t) = settings.timeout.filter(|t| *t > settings.tick()) {
            return Err(Error::Config(format!(
                "sync_timeout {t:?} must be at most a quarter of the rebalance period ({:?})",
                settings.tick()
            )));
        }
        let own = match &self.urls[self.region] {
            RegionTarget::Server(url) => Limiter::builder(url.clone()),
            RegionTarget::Cluster(urls) => Limiter::cluster_builder(urls.clone()),
        };
        let limiter = (self.configure)(own).build()?;
        let stores = self
            .urls
            .iter()
            .enumerate()
            .map(|(r, target)| {
                RegionStore::open(target, &settings.prefix, r, Duration::from_secs(1))
                    .map_err(|e| Error::Config(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let now = Instant::now();
        let mut slots = HashMap::new();
        for p in &self.policies {
            let name: Arc<str> = p.name().into();
            slots.insert(name, Arc::new(Slot::new(p, settings.floor, now)?));
        }
        let shared = Arc::new(Shared {
            region: self.region,
            regions,
            limiter,
            kept: self.policies.iter().map(|p| p.name().into()).collect(),
            slots: RwLock::new(slots),
            settings,
            rebalances: AtomicU64::new(0),
            leader: AtomicBool::new(false),
        });
        let pods = match self.live_pods {
            Some(ttl) => Some(Arc::new(
                LivePods::builder_for(self.urls[self.region].clone())
                    .key(format!("{}:pods:{}", shared.settings.prefix, self.region))
                    .ttl(ttl)
                    .start(&shared.limiter)?,
            )),
            None => None,
        };
        let task = tokio::spawn(sync::run(Arc::downgrade(&shared), stores));
        Ok(RegionalLimiter {
            shared,
            _task: Arc::new(TaskGuard(task)),
            pods,
        })
    }
}

impl RegionalLimiter {
    /// A limiter for a pod in region `region` (an index into `stores`), where `stores` are
    /// the regions' stores (a URL each, or a [`RegionTarget::Cluster`]), in the same order
    /// in every region.
    pub fn builder(
        region: usize,
        stores: impl IntoIterator<Item = impl Into<RegionTarget>>,
    ) -> RegionalBuilder {
        RegionalBuilder {
            region,
            urls: stores.into_iter().map(Into::into).collect(),
            policies: Vec::new(),
            settings: Settings::default(),
            configure: Box::new(|b| b),
            live_pods: None,
        }
    }

    /// Checks `cost` tokens of one policy for `subject` in this region's share.
    pub async fn check_one(
        &self,
        policy: &Policy,
        subject: &str,
        cost: u64,
    ) -> Result<Decision, Error> {
        self.check(subject, &[(policy, cost)]).await
    }

    /// Checks a request against several policies, each at this region's share, as
    /// [`Limiter::check`] does. Only the region's own store is asked.
    pub async fn check(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Decision, Error> {
        let scaled = self.scaled(subject, policies)?;
        let refs = scaled.refs();
        self.shared.limiter.check(subject, &refs).await
    }

    /// Reserves estimates at this region's share, as [`Limiter::reserve`] does; the
    /// settlement charges the same (regional) buckets, and corrects the region's counted
    /// demand by the difference to the estimate, so shares follow the real cost.
    pub async fn reserve(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Reservation, Error> {
        let scaled = self.scaled(subject, policies)?;
        let refs = scaled.refs();
        self.shared
            .limiter
            .reserve_counted(subject, &refs, &scaled.demand)
            .await
    }

    /// Each policy at this region's share for `subject` (its own if it is hot, the floor
    /// once the share's lease ran out), its cost counted as the region's demand and the
    /// subject's; and the demand counters.
    fn scaled(&self, subject: &str, policies: &[(&Policy, u64)]) -> Result<Scaled, Error> {
        let now = Instant::now();
        let x = subject_id(subject);
        let mut scaled = Vec::with_capacity(policies.len());
        let mut demand = Vec::with_capacity(policies.len());
        for &(policy, cost) in policies {
            let slot = self.slot(policy)?;
            let counter = Demand {
                slot: Arc::clone(&slot),
                subject: x,
            };
            counter.add(cost);
            slot.hot().add(x, counter.counted(cost));
            let p = slot.applied().for_subject(x, now).clone();
            scaled.push((p, cost));
            demand.push(counter);
        }
        Ok(Scaled {
            policies: scaled,
            demand,
        })
    }

    fn slot(&self, policy: &Policy) -> Result<Arc<Slot>, Error> {
        let slots = &self.shared.slots;
        if let Some(s) = slots
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(policy.name())
        {
            if s.base == *policy {
                return Ok(s.clone());
            }
        }
        // First check of this policy (or its limits changed): it starts at the floor, which
        // is always safe, and grows through the protocol.
        let slot = Arc::new(Slot::new(
            policy,
            self.shared.settings.floor,
            Instant::now(),
        )?);
        let mut w = slots.write().unwrap_or_else(|p| p.into_inner());
        let entry = w
            .entry(policy.name().into())
            .or_insert_with(|| slot.clone());
        if entry.base != *policy {
            *entry = slot;
        }
        Ok(entry.clone())
    }

    /// This region's index.
    pub fn region(&self) -> usize {
        self.shared.region
    }

    /// The share of `policy` this pod checks with now (0..=1); `None` if it has not met the
    /// policy, or has forgotten it ([`RegionalBuilder::forget_idle`]).
    pub fn share(&self, policy: &str) -> Option<f64> {
        self.share_in_use(policy, None)
    }

    /// The share of `policy` this pod checks `subject` with now (0..=1): the subject's own
    /// if it is hot, else the policy's.
    pub fn share_for(&self, policy: &str, subject: &str) -> Option<f64> {
        self.share_in_use(policy, Some(subject_id(subject)))
    }

    /// The share applied to `subject` (`None`: the policy's own), capped at the floor once
    /// its lease ran out.
    fn share_in_use(&self, policy: &str, subject: Option<Subject>) -> Option<f64> {
        let slots = self.shared.slots.read().unwrap_or_else(|p| p.into_inner());
        let applied = slots.get(policy)?.applied();
        let ppm = subject
            .and_then(|x| applied.entries.get(&x))
            .map_or(applied.ppm, |e| e.0);
        let ppm = if Instant::now() < applied.valid_until {
            ppm
        } else {
            ppm.min(self.shared.settings.floor)
        };
        Some(f64::from(ppm) / f64::from(WHOLE))
    }

    /// Rebalancing rounds this pod ran as its region's leader.
    pub fn rebalances(&self) -> u64 {
        self.shared.rebalances.load(Relaxed)
    }

    /// Whether this pod currently leads its region's rebalancing.
    pub fn is_leader(&self) -> bool {
        self.shared.leader.load(Relaxed)
    }

    /// The region's live pods as last counted, with [`RegionalBuilder::live_pods`].
    pub fn live_pods(&self) -> Option<u64> {
        self.pods.as_ref().and_then(|p| p.count())
    }

    /// The limiter on the region's own store (e.g. for [`Limiter::set_pods`]).
    pub fn limiter(&self) -> &Limiter {
        &self.shared.limiter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis_ratelimit_testkit::{Flavor, Server};

    /// A reservation made at one share and settled after the region's share changed is
    /// charged at the share in force: the bucket holds time, which that share turns into
    /// tokens (at the old, larger share a charge after a shrink took a tenth of what it
    /// should, while the peers grew into the rest).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_settlement_charges_at_the_share_in_force() {
        let server = Server::start(Flavor::Redis.or_selected());
        // 10 a second, burst 1000; one region, so it soon holds the whole limit.
        let p = Policy::builder("api")
            .per_hour(36_000)
            .burst(1_000)
            .build()
            .unwrap();
        // A long timeout: the answer must come from the store even while the property
        // tests beside it load both cores (a 5 ms timeout once fell back locally there).
        let l = RegionalLimiter::builder(0, [server.url()])
            .policy(&p)
            .rebalance_period(Duration::from_secs(3_600))
            .limiter(|b| b.timeout(Duration::from_millis(500)))
            .build()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while l.share("api") != Some(1.0) {
            assert!(Instant::now() < deadline, "{:?}", l.share("api"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = l.reserve("k", &[(&p, 1)]).await.unwrap();
        assert!(r.is_allowed());
        // The region shrinks to a tenth: 1 a second, burst 100.
        let slot = l.slot(&p).unwrap();
        let tenth = Applied::at(
            &p,
            WHOLE / 10,
            l.shared.settings.floor,
            Instant::now() + Duration::from_secs(3_600),
        )
        .unwrap();
        *slot.applied() = tenth;
        assert_eq!(l.share("api"), Some(0.1));
        // 50 tokens more than reserved: 50 s of the tenth's refill, and the 0.1 s the
        // estimate took at the whole share.
        let d = r.settle(51).await.unwrap();
        assert_eq!(d.source, crate::Source::Store);
        assert_eq!(d.remaining, 49, "{d:?}");
        assert_eq!(l.check_one(&p, "k", 0).await.unwrap().remaining, 49);
    }
}
