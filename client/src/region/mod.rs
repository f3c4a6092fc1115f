//! Multi-region limits: each region has its own store and holds a share of each policy's
//! quota, rebalanced every few seconds by observed demand, off the request path.
//!
//! An exact global check would need a cross-region round trip on every request. Instead
//! region `r` checks a policy at `rate × s_r` and `burst × s_r` (never below one token) in
//! its own store, where the shares `s_r` of a policy sum to at most 1 at every instant,
//! also while regions switch shares at different moments and while one cannot be read
//! (the invariant and its proof: [`share`]). Requests never wait on another region.
//!
//! - [`share`]: the protocol, pure (time passed in), property-tested.
//! - `split`: per-subject shares for the hottest subjects, on top of the protocol, pure.
//! - `hot`: the pods' bounded count of their busiest subjects.
//! - `record`: what a region keeps in its store; every region reads the others' records,
//!   none writes to another's store.
//! - `sync`: the task that measures demand, elects one leader per region and runs the
//!   protocol every quarter period.
//! - [`RegionalLimiter`]: the check path.

mod hot;
mod limiter;
mod record;
pub mod share;
mod split;
mod sync;

pub(crate) use limiter::Demand;
pub use limiter::{RegionalBuilder, RegionalLimiter};

/// One region's store: a server or a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionTarget {
    /// A single server, e.g. `redis://eu:6379`.
    Server(String),
    /// A Redis / Valkey Cluster, reached through any of these nodes.
    Cluster(Vec<String>),
}

impl From<String> for RegionTarget {
    fn from(url: String) -> Self {
        RegionTarget::Server(url)
    }
}

impl From<&str> for RegionTarget {
    fn from(url: &str) -> Self {
        RegionTarget::Server(url.into())
    }
}
