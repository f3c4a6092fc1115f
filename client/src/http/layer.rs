//! The layer and its configuration (cheap to clone: one `Arc`).

use super::backend::Backend;
use super::headers::HeaderStyle;
use super::service::RateLimitService;
use crate::Policy;
use http::{Extensions, HeaderMap, HeaderName, Method};
use std::fmt;
use std::sync::Arc;

/// Finds a request's subject (API key, user id, client IP) in its headers and extensions.
pub type SubjectFn = Arc<dyn Fn(&HeaderMap, &Extensions) -> Option<String> + Send + Sync>;

/// The estimated cost of a request, from its headers (e.g. `X-Estimated-Tokens`).
pub type RequestCostFn = Arc<dyn Fn(&HeaderMap) -> u64 + Send + Sync>;
/// The actual cost of a request, from its response's headers (e.g. `X-Used-Tokens` set by the
/// upstream); `None` keeps the estimate.
pub type ResponseCostFn = Arc<dyn Fn(&HeaderMap) -> Option<u64> + Send + Sync>;

/// A policy charged after the fact: the estimate is reserved before the request, the
/// difference to the actual cost settled from the response (see [`Route::metered`]).
#[derive(Clone)]
pub(crate) struct Meter {
    pub(crate) policy: Policy,
    pub(crate) estimate: RequestCostFn,
    pub(crate) actual: ResponseCostFn,
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// A route group: requests matching a method (or any) and a path pattern, limited by one or
/// more policies checked atomically, each with its cost.
#[derive(Debug, Clone)]
pub struct Route {
    method: Option<Method>,
    path: String,
    prefix: bool,
    pub(crate) policies: Vec<(Policy, u64)>,
    pub(crate) meter: Option<Meter>,
}

impl Route {
    /// Any method, paths starting with `prefix`.
    pub fn prefix(prefix: impl Into<String>) -> Self {
        Self {
            method: None,
            path: prefix.into(),
            prefix: true,
            policies: Vec::new(),
            meter: None,
        }
    }

    /// `method` on exactly `path`.
    pub fn exact(method: Method, path: impl Into<String>) -> Self {
        Self {
            method: Some(method),
            path: path.into(),
            prefix: false,
            policies: Vec::new(),
            meter: None,
        }
    }

    /// `GET` (and `HEAD`, which servers answer with the GET handler) on paths starting with
    /// `prefix`.
    pub fn get(prefix: impl Into<String>) -> Self {
        Self::prefix(prefix).method(Method::GET)
    }

    /// `POST` on exactly `path`.
    pub fn post(path: impl Into<String>) -> Self {
        Self::exact(Method::POST, path)
    }

    /// Restricts the route to one method.
    #[must_use]
    pub fn method(mut self, method: Method) -> Self {
        self.method = Some(method);
        self
    }

    /// Adds a policy taking `cost` tokens per request.
    #[must_use]
    pub fn policy(mut self, policy: Policy, cost: u64) -> Self {
        self.policies.push((policy, cost));
        self
    }

    /// Adds a policy whose cost is known only after the response: `estimate` of the request
    /// is reserved up front (checked with the route's other policies, atomically), and once
    /// the inner service answers, the difference to `actual` of the response is settled,
    /// into debt if the estimate was low. A request whose service fails (an error, not an
    /// error status) refunds everything. One metered policy per route; the last one set wins.
    #[must_use]
    pub fn metered(
        mut self,
        policy: Policy,
        estimate: impl Fn(&HeaderMap) -> u64 + Send + Sync + 'static,
        actual: impl Fn(&HeaderMap) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.meter = Some(Meter {
            policy,
            estimate: Arc::new(estimate),
            actual: Arc::new(actual),
        });
        self
    }

    fn matches(&self, method: &Method, path: &str) -> bool {
        // A GET route covers HEAD too: servers (axum among them) answer HEAD with the GET
        // handler, so leaving it out would be a way around the limit.
        let covers = |m: &Method| m == method || (*m == Method::GET && *method == Method::HEAD);
        self.method.as_ref().is_none_or(covers)
            && if self.prefix {
                path.starts_with(&self.path)
            } else {
                path == self.path
            }
    }
}

/// What to do with a request on a limited route that carries no subject.
#[derive(Clone)]
pub enum MissingSubject {
    /// Answer `401 Unauthorized` (problem+json) without calling the service.
    Unauthorized,
    /// Limit it under `policy` alone (not the route's policies, nor its meter), keyed by
    /// what `subject` finds (typically the client IP); `401` if that finds nothing either.
    Limit {
        /// The policy for anonymous requests.
        policy: Policy,
        /// Where the anonymous subject comes from.
        subject: SubjectFn,
    },
}

impl fmt::Debug for MissingSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unauthorized => f.write_str("Unauthorized"),
            Self::Limit { policy, .. } => f.debug_struct("Limit").field("policy", policy).finish(),
        }
    }
}

pub(crate) struct Config {
    pub(crate) limiter: Backend,
    pub(crate) routes: Vec<Route>,
    pub(crate) subject: SubjectFn,
    pub(crate) subject_header: String,
    pub(crate) missing: MissingSubject,
    pub(crate) style: HeaderStyle,
}

impl Config {
    pub(crate) fn route(&self, method: &Method, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.matches(method, path))
    }
}

/// A `tower::Layer` limiting requests; see the [module docs](super).
#[derive(Clone)]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("routes", &self.config.routes)
            .field("missing", &self.config.missing)
            .field("style", &self.config.style)
            .finish()
    }
}

impl RateLimitLayer {
    /// Starts a layer on `limiter`: a [`Limiter`](crate::Limiter), or a
    /// [`RegionalLimiter`](crate::region::RegionalLimiter) (checks and reservations at the
    /// region's share). By default the subject is the `X-API-Key` header, requests without
    /// one get `401`, and headers follow the current draft.
    pub fn builder(limiter: impl Into<Backend>) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            limiter: limiter.into(),
            routes: Vec::new(),
            subject: None,
            subject_header: "X-API-Key".into(),
            missing: MissingSubject::Unauthorized,
            style: HeaderStyle::default(),
        }
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.config.clone())
    }
}

/// Configures a [`RateLimitLayer`].
#[must_use]
pub struct RateLimitLayerBuilder {
    limiter: Backend,
    routes: Vec<Route>,
    subject: Option<SubjectFn>,
    subject_header: String,
    missing: MissingSubject,
    style: HeaderStyle,
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayerBuilder {
    /// Adds a route group; the first matching route applies. Unmatched requests pass
    /// unlimited and without headers.
    pub fn route(mut self, route: Route) -> Self {
        self.routes.push(route);
        self
    }

    /// Takes the subject from this header (default `X-API-Key`).
    pub fn subject_header(mut self, name: &str) -> Self {
        self.subject_header = name.to_string();
        self
    }

    /// Takes the subject from a function of the request's headers and extensions.
    pub fn subject_fn(
        mut self,
        f: impl Fn(&HeaderMap, &Extensions) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.subject = Some(Arc::new(f));
        self
    }

    /// What to do when a request has no subject (default: `401`).
    pub fn missing_subject(mut self, missing: MissingSubject) -> Self {
        self.missing = missing;
        self
    }

    /// Which headers to send (default: the current draft's).
    pub fn header_style(mut self, style: HeaderStyle) -> Self {
        self.style = style;
        self
    }

    /// Builds the layer.
    pub fn build(self) -> RateLimitLayer {
        let subject = self.subject.unwrap_or_else(|| {
            let name = HeaderName::try_from(self.subject_header.as_str())
                .unwrap_or(HeaderName::from_static("x-api-key"));
            Arc::new(move |h: &HeaderMap, _: &Extensions| {
                h.get(&name)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
            })
        });
        RateLimitLayer {
            config: Arc::new(Config {
                limiter: self.limiter,
                routes: self.routes,
                subject,
                subject_header: self.subject_header,
                missing: self.missing,
                style: self.style,
            }),
        }
    }
}
