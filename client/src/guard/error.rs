//! What the non-HTTP services return when they refuse a request.

use std::time::Duration;

/// A request refused by a guard layer before it reached the service. The `*ErrorLayer`s
/// return it boxed (tower's `BoxError`, as `tower::load_shed` does); downcast to tell it from
/// the service's own errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// A [`LocalLimiter`](super::LocalLimiter) had no tokens for the request.
    #[error("rate limit '{policy}' exceeded")]
    RateLimited {
        /// The policy that refused.
        policy: String,
        /// After how long the same request is admitted; `None` when its cost exceeds the
        /// burst and it never is.
        retry_after: Option<Duration>,
    },
    /// The concurrency limit was reached (and the queue, if any, was full or the wait too
    /// long).
    #[error("concurrency limit of {limit} reached")]
    Overloaded {
        /// The limit at the time.
        limit: usize,
    },
}

/// The error type of the `*ErrorService`s: [`Refused`] or the inner service's error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
