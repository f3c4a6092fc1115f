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
//! - `record`: what a region keeps in its store; every region reads the others' records,
//!   none writes to another's store.
//! - `sync`: the task that measures demand, elects one leader per region and runs the
//!   protocol every quarter period.
//! - [`RegionalLimiter`]: the check path.

mod limiter;
mod record;
pub mod share;
mod sync;

pub use limiter::{RegionalBuilder, RegionalLimiter};
