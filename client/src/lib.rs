//! Global rate limiting for apps, on the `redis-ratelimit` module's `RL.CHECKALL` (`RL.CHECK`
//! for one limit).
//!
//! One quota shared by every pod, checked in one round trip, and a limiter that never
//! becomes the outage:
//!
//! - [`Policy`]: "100 per minute, burst 20", per subject (API key, user, IP) and policy
//!   name, with a weighted cost per request; several policies checked atomically.
//! - A short timeout (5 ms) on every store call. When the store cannot be asked,
//!   [`FailMode::Open`] policies (the default) admit within a **per-pod local bucket at
//!   limit ÷ pod count**, [`FailMode::Closed`] ones (login attempts, OTP sends) refuse.
//! - A circuit breaker stops calling a sick store, answering locally at once, and probes it
//!   every few seconds. Only transport failures count; an `ERR` reply is returned as an error.
//! - A bounded in-process deny cache: a refused bucket is not asked again before its
//!   Retry-After.
//! - Hot keys: a policy split into N sub-buckets on N different cluster slots.
//! - Where the module cannot be loaded (managed Redis), an equivalent Lua script with the same
//!   semantics and the same stored format is used instead, by itself.
//! - [`Decision`] says allowed, remaining, retry-after, reset, which policy decided and where
//!   the answer came from ([`Source`]).
//! - Costs known only afterwards (LLM tokens, rows scanned): [`Limiter::reserve`] an estimate,
//!   then [`Reservation::settle`] the real cost, into debt if need be (`RL.SETTLE`).
//! - Several regions, each with its own store: [`region::RegionalLimiter`] checks a share
//!   of each policy per region, rebalanced by demand every few seconds, off the request
//!   path; [`pods::LivePods`] counts the pods alive for the local fallback's share.
//! - Inside a service (module `guard`, feature `guard`): a local limiter with the same math
//!   and an adaptive concurrency limit, as tower layers, to protect an expensive dependency.
//!
//! ```no_run
//! use redis_ratelimit_client::{Limiter, Policy};
//! # async fn demo() -> Result<(), redis_ratelimit_client::Error> {
//! let limiter = Limiter::builder("redis://127.0.0.1:6379").pods(10).build()?;
//! let api = Policy::builder("api").per_minute(100).burst(20).build()?;
//! let login = Policy::builder("login").per_minute(5).burst(5).fail_closed().build()?;
//!
//! let d = limiter.check("api-key-123", &[(&api, 1)]).await?;
//! if !d.is_allowed() {
//!     println!("429, retry after {:?}", d.retry_after());
//! }
//! let d = limiter.check_one(&login, "user@example.com", 1).await?;
//! # let _ = d;
//! # Ok(()) }
//! ```
//!
//! # Metrics (through the `metrics` facade; install any recorder)
//! - `ratelimit_decisions_total{source, allowed, policy}`
//! - `ratelimit_check_duration_seconds{source}` (histogram)
//! - `ratelimit_store_errors_total{kind}`: `timeout`, `transport`, `server`, `protocol`,
//!   `breaker_open` (a cluster node other than the subject's not asked: its breaker is open)
//! - `ratelimit_breaker_open` (gauge, 0 or 1)
//! - `ratelimit_script_fallback_total`, `ratelimit_local_overflow_total`
//! - `ratelimit_settle_dropped_total`: settlements no bucket took during an outage (of
//!   fail-closed policies, or of any with the local fallback off)
//! - `ratelimit_connections_retired_total`: connections replaced after they went silent (or
//!   answered `READONLY`)
//! - In-service limits (module `guard`, feature `guard`): `guard_*`, listed there.
//! - Regions ([`region`]): `ratelimit_region_share{region, policy}`,
//!   `ratelimit_region_rebalance_duration_seconds` (histogram),
//!   `ratelimit_region_figure_age_seconds{region}`,
//!   `ratelimit_region_led_policies{region}`,
//!   `ratelimit_region_hot_subjects{region, policy}`; live pods ([`pods`]):
//!   `ratelimit_live_pods`.

mod background;
mod breaker;
mod cluster;
mod decision;
mod deny_cache;
mod error;
#[cfg(feature = "guard")]
pub mod guard;
#[cfg(feature = "http")]
pub mod http;
mod key;
mod limiter;
mod local;
mod node;
mod observe;
pub mod pods;
mod policy;
pub mod region;
mod reservation;
mod store;

pub use decision::{Decision, PolicyOutcome, Source, Verdict};
pub use error::Error;
pub use key::{slot, KeyLayout};
pub use limiter::{Limiter, LimiterBuilder};
pub use policy::{FailMode, Policy, PolicyBuilder};
pub use reservation::Reservation;

/// The Lua script used where the module is not loaded: `RL.CHECKALL`'s arguments, reply
/// and stored format (see `redis_ratelimit_core::stored`); with a last argument `settle`,
/// `RL.SETTLE` for each key.
pub const CHECKALL_SCRIPT: &str = store::CHECKALL_LUA;
