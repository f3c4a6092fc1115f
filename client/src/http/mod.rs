//! The HTTP face (feature `http`): a `tower` layer that limits requests by API key and route
//! group, answers `429 Too Many Requests` with `Retry-After` and an `application/problem+json`
//! body (RFC 9457), and puts `RateLimit-Policy` / `RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers-11, RFC 9651 structured fields) on every limited
//! response, not only on refusals, so clients can slow down before they hit the wall.
//!
//! ```no_run
//! # async fn demo() -> Result<(), redis_ratelimit_client::Error> {
//! use redis_ratelimit_client::http::{RateLimitLayer, Route};
//! use redis_ratelimit_client::{Limiter, Policy};
//!
//! let limiter = Limiter::builder("redis://127.0.0.1:6379").build()?;
//! let api = Policy::builder("api").per_minute(100).burst(20).build()?;
//! let login = Policy::builder("login").per_minute(5).burst(5).fail_closed().build()?;
//! let layer = RateLimitLayer::builder(limiter)
//!     .route(Route::post("/login").policy(login, 1))
//!     .route(Route::prefix("/api/").policy(api, 1))
//!     .build();
//! // axum: Router::new().route(...).layer(layer)
//! # let _ = layer; Ok(()) }
//! ```

mod backend;
pub(crate) mod headers;
mod layer;
pub(crate) mod problem;
mod retry;
mod service;

pub use backend::Backend;
pub use headers::HeaderStyle;
pub use layer::{
    MissingSubject, RateLimitLayer, RateLimitLayerBuilder, RequestCostFn, ResponseCostFn, Route,
    SubjectFn,
};
pub use retry::{retry_delay, retry_delay_with_jitter};
pub use service::{RateLimitService, ResponseFuture};
