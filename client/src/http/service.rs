//! The service: check, then call the inner service or answer the refusal.

use super::headers;
use super::layer::{Config, MissingSubject};
use super::problem;
use crate::{FailMode, Policy, Source};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Either, Full};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_service::Service;

/// The future of a [`RateLimitService`] call.
pub type ResponseFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Limits requests before they reach `S`; made by [`RateLimitLayer`](super::RateLimitLayer).
///
/// Limit decisions are responses (`429`, `401`), never errors: the only errors are the
/// inner service's own.
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitService").finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }
}

impl<S, B, ResBody> Service<Request<B>> for RateLimitService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    // Held across the settle after a metered response.
    ResBody: Send,
{
    type Response = Response<Either<ResBody, Full<Bytes>>>;
    type Error = S::Error;
    type Future = ResponseFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Call the instance that was polled ready; leave a fresh clone for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move {
            let pass = |r: Response<ResBody>| r.map(Either::Left);
            let ours = |r: Response<Full<Bytes>>| r.map(Either::Right);
            let Some(route) = config.route(req.method(), req.uri().path()) else {
                return inner.call(req).await.map(pass);
            };
            let mut policies: Vec<(&Policy, u64)> =
                route.policies.iter().map(|(p, c)| (p, *c)).collect();
            // An anonymous request is limited by its own policy alone, without the meter.
            let mut anonymous = false;
            let subject = match (config.subject)(req.headers(), req.extensions()) {
                Some(s) => s,
                None => match &config.missing {
                    MissingSubject::Limit { policy, subject } => {
                        match subject(req.headers(), req.extensions()) {
                            Some(s) => {
                                policies = vec![(policy, 1)];
                                anonymous = true;
                                s
                            }
                            None => return Ok(ours(problem::unauthorized(&config.subject_header))),
                        }
                    }
                    MissingSubject::Unauthorized => {
                        return Ok(ours(problem::unauthorized(&config.subject_header)));
                    }
                },
            };
            // A metered policy reserves its estimate now and settles from the response.
            let meter = route.meter.as_ref().filter(|_| !anonymous);
            if let Some(m) = meter {
                policies.push((&m.policy, (m.estimate)(req.headers())));
            }
            if policies.is_empty() {
                return inner.call(req).await.map(pass);
            }
            let (decision, reservation) = if meter.is_some() {
                match config.limiter.reserve(&subject, &policies).await {
                    Ok(r) => (Ok(r.decision().clone()), Some(r)),
                    Err(e) => (Err(e), None),
                }
            } else {
                (config.limiter.check(&subject, &policies).await, None)
            };
            match decision {
                Ok(d) if d.is_allowed() => {
                    // An error from the service drops the reservation: a full refund.
                    let mut r = inner.call(req).await?;
                    let d = match (reservation, meter) {
                        (Some(res), Some(m)) => {
                            let actual: Vec<u64> = policies
                                .iter()
                                .enumerate()
                                .map(|(i, &(_, cost))| match i + 1 == policies.len() {
                                    true => (m.actual)(r.headers()).unwrap_or(cost),
                                    false => cost,
                                })
                                .collect();
                            res.settle_each(&actual).await.unwrap_or_else(|e| {
                                tracing::error!(error = %e, "ratelimit: settle failed");
                                d
                            })
                        }
                        _ => d,
                    };
                    headers::write(r.headers_mut(), &d, config.style);
                    Ok(pass(r))
                }
                // The store could not be asked and a fail-closed policy refused: not the
                // client's fault, so 503, with the Retry-After of the next probe.
                Ok(d) if d.source == Source::FailClosed => {
                    Ok(ours(problem::unavailable(d.retry_after())))
                }
                Ok(d) => Ok(ours(problem::too_many_requests(&d, config.style))),
                Err(e) => {
                    // An error reply is a bug to fix, not an outage: log it loudly, then
                    // honour the fail modes.
                    tracing::error!(error = %e, "ratelimit: check failed");
                    if policies
                        .iter()
                        .any(|(p, _)| p.fail_mode() == FailMode::Closed)
                    {
                        Ok(ours(problem::unavailable(None)))
                    } else {
                        inner.call(req).await.map(pass)
                    }
                }
            }
        })
    }
}
