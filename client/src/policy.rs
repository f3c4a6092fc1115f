//! Policies: "100 per minute, burst 20", with a name, a fail mode and optional sharding.

use crate::observe::DecisionKeys;
use crate::Error;
use redis_ratelimit_core::Limit;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The smallest burst of one shard (see [`PolicyBuilder::shards`]).
const MIN_SHARD_BURST: u64 = 10;

/// What a policy answers when the store cannot be asked (timeout, connection lost, breaker
/// open).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Admit the request, counted in a metric, within a per-pod local bucket at
    /// limit ÷ pod count. For ordinary API limits: the limiter must not become the outage.
    #[default]
    Open,
    /// Refuse the request with a Retry-After. For limits that guard money or safety
    /// (login attempts, OTP sends), where an unchecked request costs more than a refused one.
    Closed,
}

/// A named limit, cheap to clone.
///
/// ```
/// use redis_ratelimit_client::Policy;
/// let api = Policy::builder("api").per_minute(100).burst(20).build().unwrap();
/// let login = Policy::builder("login").per_minute(5).burst(5).fail_closed().build().unwrap();
/// assert_eq!(api.burst(), 20);
/// assert_eq!(login.name(), "login");
/// ```
#[derive(Clone, PartialEq)]
pub struct Policy(Arc<Inner>);

#[derive(PartialEq)]
struct Inner {
    /// Shared, so metrics can label with it on every check without copying it.
    name: Arc<str>,
    count: u64,
    period: Duration,
    burst: u64,
    fail_mode: FailMode,
    shards: u32,
    /// `count / period` as sent to the server (shortest text that parses back exactly).
    rate: f64,
    limit: Limit,
    /// One sub-bucket's rate and limit when sharded (`rate / shards`, `burst / shards`).
    shard_limit: Limit,
    /// `rate / shards` as sent to the server: the shortest text that parses back exactly.
    shard_rate_arg: String,
    /// Its decisions counter's keys, built once (see `observe`).
    decision_keys: DecisionKeys,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.0.name)
            .field("count", &self.0.count)
            .field("period", &self.0.period)
            .field("burst", &self.0.burst)
            .field("fail_mode", &self.0.fail_mode)
            .field("shards", &self.0.shards)
            .finish()
    }
}

impl Policy {
    /// Starts a policy named `name`: a short identifier (`[A-Za-z0-9_.-]`, at most 32
    /// bytes) that becomes part of every bucket key.
    pub fn builder(name: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder {
            name: name.into(),
            count: 0,
            period: Duration::ZERO,
            burst: None,
            fail_mode: FailMode::Open,
            shards: 1,
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Tokens per period ("100" of "100 per minute").
    pub fn count(&self) -> u64 {
        self.0.count
    }

    /// The period ("minute" of "100 per minute").
    pub fn period(&self) -> Duration {
        self.0.period
    }

    /// Capacity: the most tokens available at once.
    pub fn burst(&self) -> u64 {
        self.0.burst
    }

    /// Refill rate in tokens per second.
    pub fn rate(&self) -> f64 {
        self.0.rate
    }

    /// What happens when the store cannot be asked.
    pub fn fail_mode(&self) -> FailMode {
        self.0.fail_mode
    }

    /// Number of sub-buckets the policy is split into (1: not split).
    pub fn shards(&self) -> u32 {
        self.0.shards
    }

    /// The whole policy's limit, as the core checks it.
    pub fn limit(&self) -> &Limit {
        &self.0.limit
    }

    /// The name as a metrics label value (no copy).
    pub(crate) fn decision_keys(&self) -> &DecisionKeys {
        &self.0.decision_keys
    }

    pub(crate) fn metric_label(&self) -> metrics::SharedString {
        metrics::SharedString::from_shared(self.0.name.clone())
    }

    pub(crate) fn bucket_rate_arg(&self) -> &str {
        &self.0.shard_rate_arg
    }

    pub(crate) fn bucket_limit(&self) -> &Limit {
        &self.0.shard_limit
    }
}

/// Builds a [`Policy`]; see [`Policy::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PolicyBuilder {
    name: String,
    count: u64,
    period: Duration,
    burst: Option<u64>,
    fail_mode: FailMode,
    shards: u32,
}

impl PolicyBuilder {
    /// `count` tokens per `period`.
    pub fn per(mut self, count: u64, period: Duration) -> Self {
        self.count = count;
        self.period = period;
        self
    }

    /// `count` per second.
    pub fn per_second(self, count: u64) -> Self {
        self.per(count, Duration::from_secs(1))
    }

    /// `count` per minute.
    pub fn per_minute(self, count: u64) -> Self {
        self.per(count, Duration::from_secs(60))
    }

    /// `count` per hour.
    pub fn per_hour(self, count: u64) -> Self {
        self.per(count, Duration::from_secs(3600))
    }

    /// Capacity (default: `count`).
    pub fn burst(mut self, burst: u64) -> Self {
        self.burst = Some(burst);
        self
    }

    /// Refuse requests when the store cannot be asked (see [`FailMode::Closed`]).
    pub fn fail_closed(mut self) -> Self {
        self.fail_mode = FailMode::Closed;
        self
    }

    /// Sets the fail mode.
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.fail_mode = mode;
        self
    }

    /// Splits one subject's bucket into `n` sub-buckets, each with `rate / n` and
    /// `burst / n`, on different cluster slots; each request takes from one chosen at random.
    /// Each sub-bucket needs at least 10 tokens of burst: a request meeting an empty one is
    /// refused while the others still hold tokens, and with 10 that stays under 1% of
    /// requests at 80% of the rate (under 2% at 90%; 45% with 1-token shards). One request
    /// then costs at most `burst / n` tokens (one sub-bucket's): more is
    /// [`Verdict::ExceedsBurst`](crate::Verdict::ExceedsBurst).
    /// For hot keys that would otherwise load one node. On a cluster, not atomic with the
    /// request's other policies (see [`Limiter::check`](crate::Limiter::check)).
    pub fn shards(mut self, n: u32) -> Self {
        self.shards = n;
        self
    }

    /// Validates and builds the policy.
    pub fn build(self) -> Result<Policy, Error> {
        let name = self.name.clone();
        let invalid = move |why: String| Error::InvalidPolicy(format!("{name}: {why}"));
        let bad = |why: String| Err(invalid(why));
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 32
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !name_ok {
            return bad("name must be 1-32 characters of [A-Za-z0-9_.-]".into());
        }
        if self.count == 0 || self.period.is_zero() {
            return bad("needs a count and a period, e.g. .per_minute(100)".into());
        }
        if !(1..=64).contains(&self.shards) {
            return bad("shards must be within 1..=64".into());
        }
        let burst = self.burst.unwrap_or(self.count);
        let rate = self.count as f64 / self.period.as_secs_f64();
        let shards = u64::from(self.shards);
        if shards > 1 && burst / shards < MIN_SHARD_BURST {
            return bad(format!(
                "burst {burst} over {shards} shards leaves fewer than {MIN_SHARD_BURST} tokens \
                 per shard (a request lands on a random shard: small shards refuse while \
                 others still hold tokens); use fewer shards or a larger burst"
            ));
        }
        Ok(Policy(Arc::new(
            Inner::new(
                self.name.into(),
                self.count,
                self.period,
                burst,
                rate,
                self.fail_mode,
                self.shards,
            )
            .map_err(|e| invalid(e.to_string()))?,
        )))
    }
}

impl Inner {
    fn new(
        name: Arc<str>,
        count: u64,
        period: Duration,
        burst: u64,
        rate: f64,
        fail_mode: FailMode,
        shards: u32,
    ) -> Result<Self, redis_ratelimit_core::LimitError> {
        let limit = Limit::new(rate, burst)?;
        let shard_rate = rate / f64::from(shards);
        let shard_limit = Limit::new(shard_rate, burst / u64::from(shards))?;
        Ok(Self {
            count,
            period,
            burst,
            fail_mode,
            shards,
            rate,
            limit,
            shard_limit,
            shard_rate_arg: shard_rate.to_string(),
            decision_keys: DecisionKeys::new(&name),
            name,
        })
    }
}

impl Policy {
    /// This policy at `share` of its rate and burst (the burst rounded down, never below one
    /// token per shard), under the same name, so the same bucket keys: a region's part of a
    /// global quota. Count and period stay the global contract's.
    pub(crate) fn scaled(&self, share: f64) -> Result<Policy, Error> {
        let p = &self.0;
        let burst = ((p.burst as f64 * share).floor() as u64).max(u64::from(p.shards));
        Inner::new(
            p.name.clone(),
            p.count,
            p.period,
            burst,
            p.rate * share,
            p.fail_mode,
            p.shards,
        )
        .map(|inner| Policy(Arc::new(inner)))
        .map_err(|e| Error::InvalidPolicy(format!("{} at share {share}: {e}", p.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_like_people_say_it() {
        let p = Policy::builder("api")
            .per_minute(100)
            .burst(20)
            .build()
            .unwrap();
        assert_eq!(p.rate(), 100.0 / 60.0);
        assert_eq!(p.limit().interval_ticks(), 6_000_000);
        assert_eq!(p.fail_mode(), FailMode::Open);
        assert_eq!(
            Policy::builder("x").per_second(5).build().unwrap().burst(),
            5
        );
    }

    #[test]
    fn invalid_policies_are_refused() {
        for b in [
            Policy::builder("").per_second(1),
            Policy::builder("a{b}").per_second(1),
            Policy::builder("a:b").per_second(1),
            Policy::builder("x".repeat(33)).per_second(1),
            Policy::builder("nocount"),
            Policy::builder("zero").per_second(1).burst(0),
            Policy::builder("shards").per_second(100).shards(0),
            Policy::builder("shards").per_second(100).burst(3).shards(4),
            // 5 tokens a shard: too small to share the load fairly.
            Policy::builder("shards")
                .per_second(100)
                .burst(20)
                .shards(4),
        ] {
            assert!(matches!(b.build(), Err(Error::InvalidPolicy(_))));
        }
    }

    #[test]
    fn a_share_scales_rate_and_burst_under_the_same_name() {
        let p = Policy::builder("api")
            .per_second(300)
            .burst(30)
            .build()
            .unwrap();
        let s = p.scaled(0.8).unwrap();
        assert_eq!((s.name(), s.rate(), s.burst()), ("api", 240.0, 24));
        assert_eq!(p.scaled(0.01).unwrap().burst(), 1, "never below one token");
    }

    #[test]
    fn shards_divide_rate_and_burst() {
        let p = Policy::builder("hot")
            .per_second(1000)
            .burst(100)
            .shards(4)
            .build()
            .unwrap();
        assert_eq!(p.bucket_rate_arg(), "250");
        assert_eq!(p.bucket_limit().burst(), 25);
    }
}
