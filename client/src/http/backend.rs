//! What the layer checks with: one global [`Limiter`], or a [`RegionalLimiter`] checking at
//! its region's share.

use crate::region::RegionalLimiter;
use crate::{Decision, Error, Limiter, Policy, Reservation};

/// The limiter behind a [`RateLimitLayer`](super::RateLimitLayer): made from either kind by
/// `into()`, so `RateLimitLayer::builder` takes both.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Backend {
    /// One store (a server or a cluster) for every pod.
    Global(Limiter),
    /// A region's share of each policy, in the region's own store (see [`crate::region`]).
    Regional(RegionalLimiter),
}

impl From<Limiter> for Backend {
    fn from(l: Limiter) -> Self {
        Self::Global(l)
    }
}

impl From<RegionalLimiter> for Backend {
    fn from(l: RegionalLimiter) -> Self {
        Self::Regional(l)
    }
}

impl Backend {
    pub(crate) async fn check(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Decision, Error> {
        match self {
            Self::Global(l) => l.check(subject, policies).await,
            Self::Regional(l) => l.check(subject, policies).await,
        }
    }

    pub(crate) async fn reserve(
        &self,
        subject: &str,
        policies: &[(&Policy, u64)],
    ) -> Result<Reservation, Error> {
        match self {
            Self::Global(l) => l.reserve(subject, policies).await,
            Self::Regional(l) => l.reserve(subject, policies).await,
        }
    }
}
