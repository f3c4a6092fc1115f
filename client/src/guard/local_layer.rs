//! Tower layers over a [`LocalLimiter`]: one answering HTTP (429 + headers, like the global
//! layer), one returning [`Refused`] for any other service.

use super::error::{BoxError, Refused};
use super::LocalLimiter;
use crate::http::headers::{self, HeaderStyle};
use crate::http::{problem, SubjectFn};
use bytes::Bytes;
use http::{Extensions, HeaderMap, Request, Response};
use http_body_util::{Either, Full};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
#[cfg(test)]
use std::time::Duration;
use tower_layer::Layer;
use tower_service::Service;

/// A request's cost in tokens, from its headers and extensions.
pub type CostFn = Arc<dyn Fn(&HeaderMap, &Extensions) -> u64 + Send + Sync>;

/// The future of the guard services: boxed, as the global layer's.
pub type GuardFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// A `tower::Layer` limiting HTTP requests with a [`LocalLimiter`]: over the limit, `429 Too
/// Many Requests` with `Retry-After` and a problem+json body; within it, the `RateLimit`
/// headers on the response. The same answers as [`RateLimitLayer`](crate::http::RateLimitLayer),
/// from this process's own buckets.
///
/// By default every request takes 1 token from one bucket for the whole process.
///
/// ```
/// use redis_ratelimit_client::guard::{LocalLimitLayer, LocalLimiter};
/// use redis_ratelimit_client::Policy;
///
/// let sms = Policy::builder("sms").per_second(10).burst(10).build().unwrap();
/// let layer = LocalLimitLayer::new(LocalLimiter::new(sms))
///     .per_key(|h, _| h.get("x-tenant")?.to_str().ok().map(str::to_owned));
/// // axum: Router::new().route("/sms", post(send)).layer(layer)
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct LocalLimitLayer {
    limiter: Arc<LocalLimiter>,
    key: Option<SubjectFn>,
    cost: Option<CostFn>,
    style: HeaderStyle,
}

impl fmt::Debug for LocalLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimitLayer")
            .field("limiter", &self.limiter)
            .field("per_key", &self.key.is_some())
            .field("style", &self.style)
            .finish_non_exhaustive()
    }
}

impl LocalLimitLayer {
    /// Limits every request against `limiter`, one bucket for the process, cost 1.
    pub fn new(limiter: LocalLimiter) -> Self {
        Self {
            limiter: Arc::new(limiter),
            key: None,
            cost: None,
            style: HeaderStyle::default(),
        }
    }

    /// One bucket per key that `key` finds in the request; requests where it finds none
    /// share one bucket. Keys should be ones the caller cannot mint at will (an
    /// authenticated tenant, not a free-form header): once the limiter holds its capacity
    /// of buckets still refilling, a new key is checked against a fresh bucket that is
    /// not kept, so a flood of new keys is not limited.
    #[must_use]
    pub fn per_key(
        mut self,
        key: impl Fn(&HeaderMap, &Extensions) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Some(Arc::new(key));
        self
    }

    /// Tokens each request takes (default 1).
    #[must_use]
    pub fn cost(
        mut self,
        cost: impl Fn(&HeaderMap, &Extensions) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// Which headers to send (default: the current draft's).
    #[must_use]
    pub fn header_style(mut self, style: HeaderStyle) -> Self {
        self.style = style;
        self
    }

    /// The limiter, shared by every service this layer makes.
    pub fn limiter(&self) -> &LocalLimiter {
        &self.limiter
    }
}

impl<S> Layer<S> for LocalLimitLayer {
    type Service = LocalLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LocalLimitService {
            inner,
            layer: self.clone(),
        }
    }
}

/// Made by [`LocalLimitLayer`]. Refusals are responses, never errors.
#[derive(Clone)]
pub struct LocalLimitService<S> {
    inner: S,
    layer: LocalLimitLayer,
}

impl<S> fmt::Debug for LocalLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimitService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for LocalLimitService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<Either<ResBody, Full<Bytes>>>;
    type Error = S::Error;
    type Future = GuardFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let l = &self.layer;
        let key = l
            .key
            .as_ref()
            .and_then(|k| k(req.headers(), req.extensions()));
        let cost = l
            .cost
            .as_ref()
            .map_or(1, |c| c(req.headers(), req.extensions()));
        let d = l.limiter.check(key.as_deref().unwrap_or(""), cost);
        let style = l.style;
        if !d.is_allowed() {
            // Built inside the future: it then needs no `Send` bound on the response types.
            return Box::pin(async move {
                Ok(problem::too_many_requests(&d, style).map(Either::Right))
            });
        }
        // The check is synchronous, so the instance polled ready is the one called.
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut r = fut.await?;
            headers::write(r.headers_mut(), &d, style);
            Ok(r.map(Either::Left))
        })
    }
}

/// A `tower::Layer` limiting any service with a [`LocalLimiter`], for non-HTTP callers (a
/// client of an SMS API, a job runner): over the limit the call fails at once with
/// [`Refused::RateLimited`] (boxed) without reaching the service.
///
/// `key` gives each request's bucket key and cost.
///
/// ```
/// use redis_ratelimit_client::guard::{LocalLimitErrorLayer, LocalLimiter};
/// use redis_ratelimit_client::Policy;
///
/// struct Sms { to: String }
/// let sms = Policy::builder("sms").per_second(10).build().unwrap();
/// // Per recipient, one token each.
/// let layer = LocalLimitErrorLayer::new(LocalLimiter::new(sms), |m: &Sms| (m.to.clone(), 1));
/// # let _ = layer;
/// ```
pub struct LocalLimitErrorLayer<F> {
    limiter: Arc<LocalLimiter>,
    key: Arc<F>,
}

impl<F> Clone for LocalLimitErrorLayer<F> {
    fn clone(&self) -> Self {
        Self {
            limiter: self.limiter.clone(),
            key: self.key.clone(),
        }
    }
}

impl<F> fmt::Debug for LocalLimitErrorLayer<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimitErrorLayer")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl<F> LocalLimitErrorLayer<F> {
    /// Limits with `limiter`, taking `(key, cost)` from each request with `key`.
    pub fn new(limiter: LocalLimiter, key: F) -> Self {
        Self {
            limiter: Arc::new(limiter),
            key: Arc::new(key),
        }
    }

    /// The limiter, shared by every service this layer makes.
    pub fn limiter(&self) -> &LocalLimiter {
        &self.limiter
    }
}

impl<S, F> Layer<S> for LocalLimitErrorLayer<F> {
    type Service = LocalLimitErrorService<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        LocalLimitErrorService {
            inner,
            layer: self.clone(),
        }
    }
}

/// Made by [`LocalLimitErrorLayer`].
pub struct LocalLimitErrorService<S, F> {
    inner: S,
    layer: LocalLimitErrorLayer<F>,
}

impl<S: Clone, F> Clone for LocalLimitErrorService<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S, F> fmt::Debug for LocalLimitErrorService<S, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimitErrorService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, F, Req> Service<Req> for LocalLimitErrorService<S, F>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    F: Fn(&Req) -> (String, u64),
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = GuardFuture<S::Response, BoxError>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let (key, cost) = (self.layer.key)(&req);
        let d = self.layer.limiter.check(&key, cost);
        if !d.is_allowed() {
            let refused = Refused::RateLimited {
                policy: d.policy.name().to_string(),
                retry_after: d.retry_after(),
            };
            return Box::pin(async move { Err(refused.into()) });
        }
        let fut = self.inner.call(req);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;
    use std::convert::Infallible;

    /// Answers every request, HTTP or not, with `200 ok`.
    #[derive(Clone)]
    struct Ok200;

    impl<T: Send + 'static> Service<T> for Ok200 {
        type Response = Response<&'static str>;
        type Error = Infallible;
        type Future = GuardFuture<Self::Response, Infallible>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: T) -> Self::Future {
            Box::pin(async { Ok(Response::new("ok")) })
        }
    }

    fn limiter() -> LocalLimiter {
        // 1 per hour: no token comes back during a test.
        LocalLimiter::new(Policy::builder("sms").per_hour(1).burst(5).build().unwrap())
    }

    fn req(tenant: &str, cost: &str) -> Request<()> {
        Request::builder()
            .header("x-tenant", tenant)
            .header("x-cost", cost)
            .body(())
            .unwrap()
    }

    #[tokio::test]
    async fn http_per_key_with_costs_answers_429_with_headers() {
        let layer = LocalLimitLayer::new(limiter())
            .per_key(|h, _| h.get("x-tenant")?.to_str().ok().map(str::to_owned))
            .cost(|h, _| {
                h.get("x-cost")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            });
        let mut svc = layer.layer(Ok200);
        let r = svc.call(req("a", "3")).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["ratelimit"].to_str().unwrap().split(';').nth(1),
            Some("r=2")
        );
        let r = svc.call(req("a", "3")).await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert!(r.headers().contains_key("retry-after"));
        // Another tenant has its own bucket.
        assert_eq!(svc.call(req("b", "5")).await.unwrap().status(), 200);
        // More than the burst can never pass: 429 without Retry-After.
        let r = svc.call(req("c", "6")).await.unwrap();
        assert_eq!(r.status(), 429);
        assert!(!r.headers().contains_key("retry-after"));
    }

    #[tokio::test]
    async fn the_error_layer_refuses_with_rate_limited() {
        let layer = LocalLimitErrorLayer::new(limiter(), |n: &u64| ("all".to_string(), *n));
        let mut svc = layer.layer(Ok200);
        assert!(svc.call(4).await.is_ok());
        let e = svc.call(2).await.unwrap_err();
        match e.downcast_ref::<Refused>() {
            Some(Refused::RateLimited {
                policy,
                retry_after: Some(wait),
            }) => {
                assert_eq!(policy, "sms");
                assert!(*wait > Duration::from_secs(60), "{wait:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(svc.call(1).await.is_ok(), "the last token");
    }
}
