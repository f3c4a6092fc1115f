//! Multi-region limits: each region holds a share of each policy's quota.
//!
//! - [`share`]: the protocol, pure (time passed in), property-tested.

pub mod share;
