//! What a check answers.

use crate::Policy;
use std::fmt;
use std::time::Duration;

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// The shared store (`RL.CHECK`, `RL.CHECKALL` or their script): the global answer.
    Store,
    /// The in-process cache of exhausted buckets; no round trip.
    DenyCache,
    /// The store could not be asked: a per-pod local bucket at limit ÷ pod count answered.
    LocalFallback,
    /// The store could not be asked and local fallback is off: admitted unchecked.
    FailOpen,
    /// The store could not be asked and a fail-closed policy is involved: refused.
    FailClosed,
    /// An in-process `guard::LocalLimiter` (feature `guard`): this process's own limit,
    /// not a share of a global one.
    Local,
}

impl Source {
    /// A short name for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Store => "store",
            Source::DenyCache => "deny_cache",
            Source::LocalFallback => "local_fallback",
            Source::FailOpen => "fail_open",
            Source::FailClosed => "fail_closed",
            Source::Local => "local",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Allowed, or for how long not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The tokens were there and have been taken.
    Allowed,
    /// Not now: retrying after `retry_after` (never early) is admitted if nobody else takes
    /// the tokens first.
    Denied {
        /// How long to wait.
        retry_after: Duration,
    },
    /// The cost is larger than the burst (one sub-bucket's, for a sharded policy checked on
    /// the store; the whole burst in a guard's local limiter, which does not shard): this
    /// request can never pass.
    ExceedsBurst,
}

impl Verdict {
    /// Whether the request may proceed.
    pub fn is_allowed(self) -> bool {
        matches!(self, Verdict::Allowed)
    }

    fn rank(self) -> (u8, Duration) {
        match self {
            Verdict::Allowed => (0, Duration::ZERO),
            Verdict::Denied { retry_after } => (1, retry_after),
            Verdict::ExceedsBurst => (2, Duration::ZERO),
        }
    }
}

/// One policy's part of a decision.
#[derive(Debug, Clone)]
pub struct PolicyOutcome {
    /// The policy.
    pub policy: Policy,
    /// Its verdict (an allowed policy in a refused request had room, but nothing was taken).
    pub verdict: Verdict,
    /// Whole tokens left in its bucket. An answer that did not read the bucket reports it
    /// full (`burst`, `reset_after` zero): a fail-open admission, a policy the deny cache
    /// did not find refused when another one was (the `RateLimit` header leaves that one
    /// out), or on a cluster a sharded policy not asked after another one refused.
    pub remaining: u64,
    /// Until its bucket is full again.
    pub reset_after: Duration,
}

/// The answer to a check.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Allowed, or for how long not: the most restrictive of the policies' verdicts.
    pub verdict: Verdict,
    /// Where the answer came from.
    pub source: Source,
    /// The policy that decided: the one refusing longest, or if allowed, the one with the
    /// fewest tokens left.
    pub policy: Policy,
    /// Tokens left under the deciding policy.
    pub remaining: u64,
    /// Until the deciding policy's bucket is full again.
    pub reset_after: Duration,
    /// Every policy of the request, in the order given.
    pub outcomes: Vec<PolicyOutcome>,
}

impl Decision {
    /// Whether the request may proceed.
    pub fn is_allowed(&self) -> bool {
        self.verdict.is_allowed()
    }

    /// How long to wait before retrying, if denied and it can pass later.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.verdict {
            Verdict::Denied { retry_after } => Some(retry_after),
            _ => None,
        }
    }

    /// Combines per-policy outcomes (non-empty) into a decision.
    pub(crate) fn from_outcomes(outcomes: Vec<PolicyOutcome>, source: Source) -> Option<Self> {
        let deciding = outcomes
            .iter()
            .max_by(|a, b| {
                a.verdict
                    .rank()
                    .cmp(&b.verdict.rank())
                    // Among equals, fewer tokens left decides.
                    .then(b.remaining.cmp(&a.remaining))
            })?
            .clone();
        Some(Self {
            verdict: deciding.verdict,
            source,
            policy: deciding.policy,
            remaining: deciding.remaining,
            reset_after: deciding.reset_after,
            outcomes,
        })
    }
}
