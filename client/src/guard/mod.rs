//! Inside a service (feature `guard`): limits that protect this process's own expensive
//! dependencies, with no store, beside the global per-key limits of [`crate::http`].
//!
//! - [`LocalLimiter`]: a [`Policy`](crate::Policy) per key (or for the whole process) with the
//!   module's exact bucket math, bounded memory and time passed in for tests;
//!   [`LocalLimitLayer`] answers HTTP with the global layer's `429`, `RateLimit` headers and
//!   problem+json, [`LocalLimitErrorLayer`] fails any other service with [`Refused`].
//!   For "the SMS provider bills per call: at most 10 per second from this process".
//! - [`AdaptiveConcurrencyLayer`]: at most *limit* calls in flight, the limit moved by the
//!   observed latency ([`Gradient`], Envoy's gradient controller: measured no-load latency,
//!   25% buffer, square-root headroom). Over the limit a request is refused at once (`503` +
//!   `Retry-After`, or [`Refused::Overloaded`] through
//!   [`errors()`](AdaptiveConcurrencyLayer::errors)), optionally after a short FIFO queue.
//!   For "the report query eats a CPU: find how many at once keep it fast".
//!
//! ```no_run
//! use redis_ratelimit_client::guard::{AdaptiveConcurrencyLayer, LocalLimitLayer, LocalLimiter};
//! use redis_ratelimit_client::Policy;
//!
//! let sms = Policy::builder("sms").per_second(10).burst(10).build().unwrap();
//! let sms = LocalLimitLayer::new(LocalLimiter::new(sms));
//! let report = AdaptiveConcurrencyLayer::builder().name("report").build().unwrap();
//! // axum:
//! //   Router::new()
//! //       .route("/sms", post(send).layer(sms))
//! //       .route("/report", get(report_handler).layer(report))
//! # let _ = (sms, report);
//! ```
//!
//! # Metrics
//! - `guard_local_decisions_total{policy, allowed}`
//! - `guard_concurrency_limit{name}`, `guard_concurrency_in_flight{name}` (gauges)
//! - `guard_concurrency_refused_total{name}`

mod concurrency;
mod concurrency_layer;
mod error;
mod local_layer;
mod local_limiter;

pub use concurrency::{ConfigError, Gradient, GradientConfig};
pub use concurrency_layer::{
    AdaptiveConcurrencyBuilder, AdaptiveConcurrencyErrorLayer, AdaptiveConcurrencyErrorService,
    AdaptiveConcurrencyLayer, AdaptiveConcurrencyService, ConcurrencyStats,
};
pub use error::{BoxError, Refused};
pub use local_layer::{
    CostFn, GuardFuture, LocalLimitErrorLayer, LocalLimitErrorService, LocalLimitLayer,
    LocalLimitService,
};
pub use local_limiter::{LocalLimiter, DEFAULT_CAPACITY};
