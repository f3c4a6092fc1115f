//! The limiter: policies → keys → deny cache → breaker → store (with timeout) → decision,
//! or the fail mode when the store cannot be asked.

use crate::breaker::Admission;
use crate::deny_cache::DenyCache;
use crate::error::StoreError;
use crate::local::LocalBuckets;
use crate::node::{Node, NodeSettings};
use crate::observe::observe;
use crate::region::Demand;
use crate::reservation::{Held, Reservation};
use crate::store::{not_connected, Item, Replies, Reply, Store};
use crate::{Decision, Error, FailMode, KeyLayout, Policy, PolicyOutcome, Source, Verdict};
use redis_ratelimit_core::{ticks_since_epoch, Share};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod settle;

/// Checks requests against policies, globally through the store. Cheap to clone; clones
/// share the connections and breakers (one per server or cluster primary), the deny cache
/// and the local buckets (one set per pod).
#[derive(Debug, Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Store,
    deny: DenyCache,
    local: LocalBuckets,
    layout: KeyLayout,
    timeout: Duration,
    pods: AtomicU64,
    local_fallback: bool,
    probe_interval: Duration,
}

#[derive(Debug, Clone)]
enum Target {
    Single(String),
    Cluster(Vec<String>),
}

/// Configures a [`Limiter`]; see [`Limiter::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct LimiterBuilder {
    target: Target,
    timeout: Duration,
    connect_timeout: Duration,
    pods: u64,
    local_fallback: bool,
    breaker_threshold: u32,
    probe_interval: Duration,
    deny_cache_capacity: usize,
    local_capacity: usize,
    layout: KeyLayout,
    force_script: bool,
}

impl LimiterBuilder {
    fn new(target: Target) -> Self {
        Self {
            target,
            timeout: Duration::from_millis(5),
            connect_timeout: Duration::from_secs(1),
            pods: 1,
            local_fallback: true,
            breaker_threshold: 5,
            probe_interval: Duration::from_secs(2),
            deny_cache_capacity: 100_000,
            local_capacity: 100_000,
            layout: KeyLayout::default(),
            force_script: false,
        }
    }

    /// Longest wait for the store per check (default 5 ms, at most an hour); past it the
    /// fail mode answers.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.min(MAX_TIMEOUT);
        self
    }

    /// Longest wait for a (re)connection, in the background (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many pods share the limits (default 1): while the store cannot be asked, each
    /// pod admits limit ÷ pods locally. Can be changed later with [`Limiter::set_pods`].
    pub fn pods(mut self, pods: u64) -> Self {
        self.pods = pods.max(1);
        self
    }

    /// Turns the local fallback off: fail-open policies then admit everything while the
    /// store cannot be asked.
    pub fn without_local_fallback(mut self) -> Self {
        self.local_fallback = false;
        self
    }

    /// Consecutive transport failures that open the circuit breaker (default 5).
    pub fn breaker_threshold(mut self, failures: u32) -> Self {
        self.breaker_threshold = failures;
        self
    }

    /// How often an open breaker lets one probe through once it has backed off (default 2 s,
    /// at most an hour): the first probe goes 50 ms after the breaker opens (a store that
    /// only stalled is asked again at once), each failed one doubles the wait up to this.
    /// Also the Retry-After of fail-closed refusals when no probe is due sooner.
    pub fn probe_interval(mut self, interval: Duration) -> Self {
        self.probe_interval = interval.min(MAX_PROBE_INTERVAL);
        self
    }

    /// Most exhausted buckets remembered in-process (default 100 000; 0 turns it off).
    pub fn deny_cache_capacity(mut self, entries: usize) -> Self {
        self.deny_cache_capacity = entries;
        self
    }

    /// Most local fallback buckets (default 100 000). A subject past it, while every bucket
    /// is active, meets a fresh bucket that is not kept: 0 keeps none, so the fallback then
    /// limits nothing (counted in `ratelimit_local_overflow_total`).
    pub fn local_capacity(mut self, entries: usize) -> Self {
        self.local_capacity = entries;
        self
    }

    /// Key prefix and subject-hash seed (default `rl`, 0); see [`KeyLayout`].
    pub fn key_layout(mut self, layout: KeyLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Uses the Lua script even where the module is loaded (it is also chosen by itself
    /// when the server does not know the module's commands).
    pub fn force_script(mut self, yes: bool) -> Self {
        self.force_script = yes;
        self
    }

    /// Builds the limiter. Does not wait for the store: a pod starting while Redis is down
    /// still answers, through its fail modes. Must be called within a Tokio runtime.
    pub fn build(self) -> Result<Limiter, Error> {
        let settings = NodeSettings {
            connect_timeout: self.connect_timeout,
            breaker_threshold: self.breaker_threshold,
            probe_interval: self.probe_interval,
            call_timeout: self.timeout,
        };
        let store = match self.target {
            Target::Single(url) => Store::single(&url, settings, self.force_script),
            Target::Cluster(urls) => {
                Store::cluster(&urls, settings, self.probe_interval, self.force_script)
            }
        }
        .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Limiter {
            inner: Arc::new(Inner {
                store,
                deny: DenyCache::new(self.deny_cache_capacity),
                local: LocalBuckets::new(self.local_capacity),
                layout: self.layout,
                timeout: self.timeout,
                pods: AtomicU64::new(self.pods),
                local_fallback: self.local_fallback,
                probe_interval: self.probe_interval,
            }),
        })
    }
}

/// A store unreachable for an hour is probed at least hourly; also keeps `now + interval`
/// far from `Instant`'s overflow (`Duration::MAX` would panic there).
const MAX_PROBE_INTERVAL: Duration = Duration::from_secs(3600);

/// Keeps a check's deadline (`now + timeout`) far from `Instant`'s overflow too.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// How often [`Limiter::ready`] asks again while the store does not answer.
const READY_RETRY: Duration = Duration::from_millis(20);

/// One policy of a request, planned: its bucket key and cost.
struct Planned<'a> {
    policy: &'a Policy,
    cost: u64,
    key: String,
    /// For a sharded policy, the unsharded key: the local fallback keeps one bucket per
    /// policy, not per sub-bucket.
    whole_key: Option<String>,
}

impl Limiter {
    /// A limiter on one server, e.g. `redis://127.0.0.1:6379`.
    pub fn builder(url: impl Into<String>) -> LimiterBuilder {
        LimiterBuilder::new(Target::Single(url.into()))
    }

    /// A limiter on a Redis / Valkey Cluster, reached through any of `urls`.
    pub fn cluster_builder(urls: impl IntoIterator<Item = impl Into<String>>) -> LimiterBuilder {
        LimiterBuilder::new(Target::Cluster(urls.into_iter().map(Into::into).collect()))
    }

    /// Sets the number of pods sharing the limits (for the local fallback share), e.g. as
    /// learnt from live pods.
    pub fn set_pods(&self, pods: u64) {
        self.inner.pods.store(pods.max(1), Relaxed);
    }

    /// The number of pods the local fallback divides limits by.
    pub fn pods(&self) -> u64 {
        self.inner.pods.load(Relaxed)
    }

    /// Whether a circuit breaker (of any cluster node) is currently keeping calls from the
    /// store.
    pub fn breaker_open(&self) -> bool {
        self.inner.store.any_open()
    }

    /// Connects to the store and waits until it answers, for at most `within`: call it at
    /// startup so the first requests are not answered by the fail modes while the connection
    /// is being made (making it can take longer than a check's timeout). Returns whether the
    /// store answered; a limiter whose store is down still works, through its fail modes.
    pub async fn ready(&self, within: Duration) -> bool {
        // `Duration::MAX` (wait for good) would overflow an `Instant`: a year is as long.
        let deadline = Instant::now() + within.min(Duration::from_secs(365 * 86_400));
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Ok(Ok(())) = tokio::time::timeout(left, self.inner.store.ping()).await {
                return true;
            }
            if Instant::now() + READY_RETRY >= deadline {
                return false;
            }
            tokio::time::sleep(READY_RETRY).await;
        }
    }

    /// Entries in the deny cache.
    pub fn deny_cache_len(&self) -> usize {
        self.inner.deny.len()
    }

    /// Checks `cost` tokens of one policy for `subject` (an API key, a user id, an IP).
    pub async fn check_one(
        &self,
        policy: &Policy,
        subject: &str,
        cost: u64,
    ) -> Result<Decision, Error> {
        self.check(subject, &[(policy, cost)]).await
    }

    /// Checks a request against several policies at once, each with its own cost: tokens
    /// are taken from every bucket or from none (one `RL.CHECKALL`, the subject's buckets
    /// sharing a hash tag).
    ///
    /// On one server sharded policies are in the same atomic call. On a cluster their
    /// sub-buckets live on other slots and are checked after the others, only if those
    /// passed: a refusal there leaves the others' tokens taken (it errs on the strict side),
    /// except for a cost no sub-bucket can ever hold, which takes nothing. A sub-bucket not
    /// asked because a bucket before it refused is reported full.
    ///
    /// Returns an error only for bugs (an `ERR` reply); timeouts and transport failures are
    /// answered by the policies' fail modes.
    pub async fn check(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Decision, Error> {
        let started = Instant::now();
        let planned = self.plan(subject, policies)?;
        let d = self.decide(&planned).await;
        observe(started, &d);
        d
    }

    /// Reserves an estimate now and settles the real cost later, for costs known only after
    /// the work (tokens an LLM generated, rows a report scanned, bytes sent).
    ///
    /// The estimates are checked like [`check`](Self::check)'s costs. If the reservation is
    /// allowed, [`Reservation::settle`] charges or refunds the difference between the actual
    /// cost and the estimate in one round trip, unconditionally: a bucket may go into debt,
    /// and later checks wait it out. A reservation dropped unsettled (the request failed, a
    /// task was cancelled) refunds its whole estimate, in a background task.
    ///
    /// ```no_run
    /// # use redis_ratelimit_client::{Limiter, Policy};
    /// # async fn demo(limiter: Limiter) -> Result<(), redis_ratelimit_client::Error> {
    /// let llm = Policy::builder("llm").per_minute(10_000).burst(10_000).build()?;
    /// let r = limiter.reserve("api-key-123", &[(&llm, 1_000)]).await?;
    /// if r.is_allowed() {
    ///     let used = 4_000; // what the model really generated
    ///     let after = r.settle(used).await?; // charges 3 000 more, into debt if need be
    ///     # let _ = after;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn reserve(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Reservation, Error> {
        self.reserve_counted(subject, policies, &[]).await
    }

    /// [`reserve`](Self::reserve), where `demand[i]` (if any) counts policy `i`'s offered
    /// cost and is corrected when it is settled (a region's demand).
    pub(crate) async fn reserve_counted(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
        demand: &[Demand],
    ) -> Result<Reservation, Error> {
        let started = Instant::now();
        let planned = self.plan(subject, policies)?;
        let d = self.decide(&planned).await;
        observe(started, &d);
        let d = d?;
        let held = if d.is_allowed() {
            planned
                .into_iter()
                .enumerate()
                .map(|(i, p)| Held {
                    policy: p.policy.clone(),
                    key: p.key,
                    whole_key: p.whole_key,
                    estimate: p.cost,
                    demand: demand.get(i).cloned(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Reservation::new(self.clone(), held, d))
    }

    /// This pod's share of `policy` for the local fallback (see [`Share`]: together the
    /// pods admit at most the limit). Checks and settles use the same one.
    fn local_share(&self, policy: &Policy) -> Share {
        policy.limit().share(self.inner.pods.load(Relaxed))
    }

    fn plan<'a>(
        &self,
        subject: &str,
        policies: &[(&'a Policy, u64)],
    ) -> Result<Vec<Planned<'a>>, Error> {
        let inner = &self.inner;
        if policies.is_empty() {
            return Err(Error::Config("a check needs at least one policy".into()));
        }
        let tag = inner.layout.tag(subject.as_bytes());
        let tag = std::str::from_utf8(&tag).unwrap_or_default();
        Ok(policies
            .iter()
            .map(|&(policy, cost)| {
                let whole = inner.layout.key(tag, policy.name());
                let (key, whole_key) = if policy.shards() > 1 {
                    let shard = rand::random_range(0..policy.shards());
                    let key = inner
                        .layout
                        .shard_key(tag, policy.name(), shard, policy.shards());
                    (key, Some(whole))
                } else {
                    (whole, None)
                };
                Planned {
                    policy,
                    cost,
                    key,
                    whole_key,
                }
            })
            .collect())
    }

    async fn decide(&self, planned: &[Planned<'_>]) -> Result<Decision, Error> {
        let inner = &self.inner;
        let now = Instant::now();
        if let Some(d) = self.answer_from_deny_cache(planned, now) {
            return Ok(d);
        }
        // The subject's own buckets decide which node it is: a sub-bucket's key is on a
        // slot of its own. Only sharded policies: the first sub-bucket's node.
        let Some(first) = planned
            .iter()
            .find(|p| p.policy.shards() == 1)
            .or(planned.first())
        else {
            return Err(Error::Config("a check needs at least one policy".into()));
        };
        let Some(node) = inner.store.route(&first.key) else {
            // A cluster whose topology is not known yet (or a slot no node serves).
            metrics::counter!("ratelimit_store_errors_total", "kind" => "transport").increment(1);
            return Ok(self.fallback(planned, inner.probe_interval));
        };
        if let Admission::Reject(probe_at) = node.breaker.admit(now) {
            return Ok(self.fallback(planned, probe_at.saturating_duration_since(now)));
        }
        // The node asked last: a sub-bucket's or a redirection's may not be the subject's,
        // and a failure (or the timeout) is that node's.
        let asking = Mutex::new(Asking {
            node: Arc::clone(&node),
            admitted: now,
            began: now,
            deadline: now + inner.timeout,
        });
        let asked = tokio::time::timeout(inner.timeout, self.ask_store(&asking, planned)).await;
        let Asking {
            node: last,
            admitted,
            ..
        } = asking.into_inner().unwrap_or_else(|p| p.into_inner());
        match asked.unwrap_or(Err(StoreError::Timeout)) {
            Ok(replies) => {
                // Each node asked has recorded its answer (`ask`).
                // Retry-After counts from the reply, not from before the round trip.
                Ok(self.answer_from_store(planned, &replies, Instant::now()))
            }
            Err(e) if e.is_transient() => {
                self.store_failed(&last, admitted, &e);
                // The next probe, if this opened the breaker (50 ms away the first time).
                let retry = last
                    .breaker
                    .next_probe()
                    .map_or(inner.probe_interval, |at| {
                        at.saturating_duration_since(Instant::now())
                    });
                Ok(self.fallback(planned, retry))
            }
            Err(e) => Err(self.store_refused(&last, e, now)),
        }
    }

    /// `node` answered a call (`now`: when the call started or its answer came).
    fn store_answered(&self, node: &Node, now: Instant) {
        node.on_answer();
        if node.breaker.on_success(now) {
            tracing::info!("ratelimit: store reachable again, breaker closed");
            self.breaker_gauge();
        }
    }

    /// 1 while any breaker is open.
    fn breaker_gauge(&self) {
        let open = if self.inner.store.any_open() {
            1.0
        } else {
            0.0
        };
        metrics::gauge!("ratelimit_breaker_open").set(open);
    }

    /// A call to `node`, let through by its breaker at `admitted`, failed.
    fn store_failed(&self, node: &Node, admitted: Instant, e: &StoreError) {
        metrics::counter!("ratelimit_store_errors_total", "kind" => e.kind()).increment(1);
        if !e.counts_against_breaker() {
            // A redirection or a slot in migration is the node's answer: it is up, and a
            // probe it was given is reported (not left to be given up on). `BreakerOpen`,
            // `NoNode`: the node was not asked (a sub-bucket's slot may have no node).
            if !matches!(e, StoreError::BreakerOpen | StoreError::NoNode) {
                self.store_answered(node, Instant::now());
            }
            return;
        }
        let opened = node.breaker.on_failure(admitted, Instant::now());
        self.inner.store.on_failure(node, e, opened);
        if opened {
            tracing::warn!(error = %e, "ratelimit: store failing, breaker open");
            self.breaker_gauge();
        }
    }

    fn store_refused(&self, node: &Node, e: StoreError, now: Instant) -> Error {
        // The store answered: it is up, whatever the answer.
        node.on_answer();
        node.breaker.on_success(now);
        refusal(e)
    }

    fn answer_from_deny_cache(&self, planned: &[Planned<'_>], now: Instant) -> Option<Decision> {
        // The common case, a single policy, looks its key up once and allocates nothing
        // unless it is refused.
        let (first, hit) = planned.iter().enumerate().find_map(|(i, p)| {
            self.inner
                .deny
                .get(&p.key, *p.policy.bucket_limit(), p.cost, now)
                .map(|hit| (i, hit))
        })?;
        let mut hit = Some(hit);
        let hits: Vec<_> = planned
            .iter()
            .enumerate()
            .map(|(i, p)| match i.cmp(&first) {
                std::cmp::Ordering::Less => None,
                std::cmp::Ordering::Equal => hit.take(),
                std::cmp::Ordering::Greater => {
                    self.inner
                        .deny
                        .get(&p.key, *p.policy.bucket_limit(), p.cost, now)
                }
            })
            .collect();
        let outcomes = planned
            .iter()
            .zip(hits)
            .map(|(p, hit)| match hit {
                Some(hit) => PolicyOutcome {
                    policy: p.policy.clone(),
                    verdict: Verdict::Denied {
                        retry_after: hit.retry_after,
                    },
                    remaining: 0,
                    reset_after: hit.reset_after,
                },
                // Unknown without a round trip; this request is refused anyway.
                None => PolicyOutcome {
                    policy: p.policy.clone(),
                    verdict: Verdict::Allowed,
                    remaining: p.policy.burst(),
                    reset_after: Duration::ZERO,
                },
            })
            .collect();
        Decision::from_outcomes(outcomes, Source::DenyCache)
    }

    /// One `RL.CHECKALL` for every bucket (`RL.CHECK` for one), atomic. On a cluster a
    /// sharded policy's sub-bucket is on a slot of its own: the subject's own buckets go
    /// first, then each sub-bucket (see [`ask_sharded`](Self::ask_sharded)).
    async fn ask_store(
        &self,
        asking: &Mutex<Asking>,
        planned: &[Planned<'_>],
    ) -> Result<Replies, StoreError> {
        let node = Arc::clone(&lock(asking).node);
        // The common case, one policy and not sharded: no vectors.
        if let [p] = planned {
            if p.policy.shards() == 1 {
                return self.ask(asking, &node, &node, &[item(p, p.cost)]).await;
            }
        }
        // No sharded policy, or one server (no slots to keep apart): one atomic call.
        if self.inner.store.is_single() || planned.iter().all(|p| p.policy.shards() == 1) {
            let items: Vec<Item<'_>> = planned.iter().map(|p| item(p, p.cost)).collect();
            return self.ask(asking, &node, &node, &items).await;
        }
        // A cost over a sub-bucket's burst can never pass: the subject's own buckets are
        // then only peeked at, so nothing is taken for it.
        let impossible = planned
            .iter()
            .any(|p| p.policy.shards() > 1 && p.cost > p.policy.bucket_limit().burst());
        let main: Vec<Item<'_>> = planned
            .iter()
            .filter(|p| p.policy.shards() == 1)
            .map(|p| item(p, if impossible { 0 } else { p.cost }))
            .collect();
        // Boxed: the state of its calls would otherwise be carried by every check's
        // future, the common case's too.
        Box::pin(self.ask_sharded(asking, &node, planned, &main)).await
    }

    /// [`ask_store`](Self::ask_store) with a sharded policy on a cluster: `main`, the
    /// others' items, first, then each sub-bucket until one refuses. Once a bucket has
    /// refused, the rest are not asked (nothing would be taken from them, and a failure
    /// there must not turn the store's refusal into the fail mode's answer): they are
    /// reported full.
    async fn ask_sharded(
        &self,
        asking: &Mutex<Asking>,
        node: &Arc<Node>,
        planned: &[Planned<'_>],
        main: &[Item<'_>],
    ) -> Result<Replies, StoreError> {
        let main_replies = if main.is_empty() {
            Replies::Many(Vec::new())
        } else {
            self.ask(asking, node, node, main).await?
        };
        let mut passed = main_replies.iter().all(|r| r[0] == 1);
        let mut main_replies = main_replies.iter().copied();
        let mut replies = Vec::with_capacity(planned.len());
        for p in planned {
            if p.policy.shards() == 1 {
                let r = main_replies
                    .next()
                    .ok_or_else(|| StoreError::Protocol("missing reply".into()))?;
                replies.push(r);
            } else if !passed {
                let burst = p.policy.bucket_limit().burst();
                replies.push([1, i64::try_from(burst).unwrap_or(i64::MAX), 0, 0]);
            } else {
                // A sub-bucket lives on its own slot, maybe another node.
                let shard_node = self.inner.store.route(&p.key).ok_or_else(not_connected)?;
                let r = self
                    .ask(asking, node, &shard_node, &[item(p, p.cost)])
                    .await?;
                let r = r
                    .first()
                    .copied()
                    .ok_or_else(|| StoreError::Protocol("missing reply".into()))?;
                passed &= r[0] == 1;
                replies.push(r);
            }
        }
        Ok(Replies::Many(replies))
    }

    /// One call to `node` (through its breaker unless it is `subject`'s node, admitted
    /// already), following one `MOVED`; `asking` is left at the node asked last.
    async fn ask(
        &self,
        asking: &Mutex<Asking>,
        subject: &Arc<Node>,
        node: &Arc<Node>,
        items: &[Item<'_>],
    ) -> Result<Replies, StoreError> {
        let store = &self.inner.store;
        let through_breaker = |n: &Arc<Node>| -> Result<(), StoreError> {
            let mut a = lock(asking);
            if Arc::ptr_eq(n, subject) {
                a.node = Arc::clone(n);
                a.admitted = a.began;
                return Ok(());
            }
            let now = Instant::now();
            // The check's time is up: the node that answered late keeps the blame, and the
            // next one is neither asked (its probe taken) nor blamed for a timeout it had no
            // time to meet.
            if now >= a.deadline {
                return Err(StoreError::Timeout);
            }
            a.node = Arc::clone(n);
            a.admitted = now;
            match n.breaker.admit(now) {
                Admission::Reject(_) => Err(StoreError::BreakerOpen),
                Admission::Call | Admission::Probe => Ok(()),
            }
        };
        through_breaker(node)?;
        let r = store.check_all(node, items).await;
        // An answer is recorded as soon as it comes: a later call of the same check (a
        // sub-bucket's on another node) failing must not leave this node's probe unreported.
        let Some(to) = r.as_ref().err().and_then(|e| store.redirect(node, e)) else {
            if r.is_ok() {
                self.store_answered(node, Instant::now());
            }
            return r;
        };
        // The old owner answered, with a redirection: it is up.
        self.store_answered(node, Instant::now());
        through_breaker(&to)?;
        let r = store.check_all(&to, items).await;
        if r.is_ok() {
            self.store_answered(&to, Instant::now());
        }
        r
    }

    fn answer_from_store(
        &self,
        planned: &[Planned<'_>],
        replies: &[Reply],
        now: Instant,
    ) -> Decision {
        let outcomes: Vec<PolicyOutcome> = planned
            .iter()
            .zip(replies)
            .map(|(p, &[allowed, remaining, retry_ms, reset_ms])| {
                let reset_after = Duration::from_millis(reset_ms.max(0) as u64);
                let verdict = match (allowed, retry_ms) {
                    (1, _) => Verdict::Allowed,
                    (_, r) if r < 0 => Verdict::ExceedsBurst,
                    (_, r) => Verdict::Denied {
                        retry_after: Duration::from_millis(r as u64),
                    },
                };
                // A key listed twice in one call was refused after its own provisional
                // take: that wait is not the bucket's, so it is not cached.
                let once = || planned.iter().filter(|q| q.key == p.key).count() == 1;
                match verdict {
                    Verdict::Denied { retry_after } if once() => self.inner.deny.insert(
                        &p.key,
                        *p.policy.bucket_limit(),
                        p.cost,
                        now,
                        retry_after,
                        reset_after,
                    ),
                    _ => {}
                }
                // A sub-bucket holds 1/shards of the policy: scale back for reporting.
                let remaining = remaining.max(0) as u64 * u64::from(p.policy.shards());
                PolicyOutcome {
                    policy: p.policy.clone(),
                    verdict,
                    remaining,
                    reset_after,
                }
            })
            .collect();
        Decision::from_outcomes(outcomes, Source::Store).unwrap_or_else(unreachable_empty)
    }

    /// The store cannot be asked: fail-closed policies refuse; otherwise the local bucket
    /// (limit ÷ pods) answers, or everything is admitted if local fallback is off.
    fn fallback(&self, planned: &[Planned<'_>], retry_hint: Duration) -> Decision {
        let inner = &self.inner;
        let closed = planned
            .iter()
            .any(|p| p.policy.fail_mode() == FailMode::Closed);
        let outcome = |p: &Planned<'_>, verdict, remaining, reset_after| PolicyOutcome {
            policy: p.policy.clone(),
            verdict,
            remaining,
            reset_after,
        };
        let (source, outcomes) = if closed {
            // Whole seconds, at least one: what a Retry-After header can say.
            let retry_after = Duration::from_secs(retry_hint.as_secs_f64().ceil().max(1.0) as u64);
            let outcomes = planned
                .iter()
                .map(|p| {
                    let verdict = match p.policy.fail_mode() {
                        FailMode::Closed => Verdict::Denied { retry_after },
                        FailMode::Open => Verdict::Allowed,
                    };
                    outcome(p, verdict, 0, Duration::ZERO)
                })
                .collect();
            (Source::FailClosed, outcomes)
        } else if inner.local_fallback {
            let items: Vec<(&str, Share, u64)> = planned
                .iter()
                .map(|p| {
                    let key = p.whole_key.as_deref().unwrap_or(&p.key);
                    (key, self.local_share(p.policy), p.cost)
                })
                .collect();
            let (_, decisions) = inner.local.check(&items, now_ticks());
            let outcomes = planned
                .iter()
                .zip(decisions)
                .map(|(p, d)| {
                    let verdict = match (d.allowed, d.retry_after_ms) {
                        (true, _) => Verdict::Allowed,
                        (false, None) => Verdict::ExceedsBurst,
                        (false, Some(ms)) => Verdict::Denied {
                            retry_after: Duration::from_millis(ms),
                        },
                    };
                    outcome(
                        p,
                        verdict,
                        d.remaining.max(0) as u64,
                        Duration::from_millis(d.reset_after_ms),
                    )
                })
                .collect();
            (Source::LocalFallback, outcomes)
        } else {
            let outcomes = planned
                .iter()
                .map(|p| outcome(p, Verdict::Allowed, p.policy.burst(), Duration::ZERO))
                .collect();
            (Source::FailOpen, outcomes)
        };
        Decision::from_outcomes(outcomes, source).unwrap_or_else(unreachable_empty)
    }
}

/// The caller's error for a store's refusal (an error reply, or one it cannot read), counted.
fn refusal(e: StoreError) -> Error {
    metrics::counter!("ratelimit_store_errors_total", "kind" => e.kind()).increment(1);
    match e {
        StoreError::Server(e) => Error::Server(e),
        other => Error::Protocol(other.to_string()),
    }
}

/// Now, in the core's ticks since the Unix epoch: the local buckets' clock.
fn now_ticks() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, ticks_since_epoch)
}

#[cold]
fn unreachable_empty() -> Decision {
    // `decide` refuses an empty policy list before planning anything.
    unreachable!("a decision over no policies")
}

/// The node a check asked last, and when its breaker let the call through: a failure is
/// that node's, and its probe's only if this call was the probe.
struct Asking {
    node: Arc<Node>,
    admitted: Instant,
    /// When the subject's own node let the check through (the check's start).
    began: Instant,
    /// When the check times out.
    deadline: Instant,
}

/// The store call's item of one planned bucket, at `cost`.
fn item<'p>(p: &'p Planned<'_>, cost: u64) -> Item<'p> {
    let burst = p.policy.bucket_limit().burst();
    Item {
        key: &p.key,
        rate: p.policy.bucket_rate_arg(),
        burst,
        // Any cost above the burst is refused alike (it can never pass); sent as burst + 1,
        // it stays within the module's 64-bit integers and the script's exact doubles.
        cost: cost.min(burst.saturating_add(1)),
    }
}

/// The node being asked (plain fields: a poisoned lock still holds valid ones).
fn lock(asking: &Mutex<Asking>) -> std::sync::MutexGuard<'_, Asking> {
    asking.lock().unwrap_or_else(|p| p.into_inner())
}
