//! Tower layers enforcing a [`Gradient`] concurrency limit: one answering HTTP (`503` +
//! `Retry-After`), one returning [`Refused::Overloaded`] for any other service.

use super::concurrency::{ConfigError, Gradient, GradientConfig};
use super::error::{BoxError, Refused};
use super::local_layer::GuardFuture;
use crate::http::problem;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Either, Full};
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

/// A snapshot of an adaptive concurrency limit (also published as metrics, see the
/// [module docs](super)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Calls that may be in flight now.
    pub limit: usize,
    /// Calls in flight now.
    pub in_flight: usize,
    /// Requests waiting in the queue now.
    pub queued: usize,
    /// Requests refused since the layer was built.
    pub refused: u64,
    /// The last measured no-load latency.
    pub min_rtt: Option<Duration>,
}

struct State {
    algo: Gradient,
    in_flight: usize,
    /// FIFO of queued requests; a slot is handed over by sending on the oldest live one.
    waiters: VecDeque<oneshot::Sender<()>>,
    refused: u64,
}

impl State {
    /// Gives free slots to the oldest waiters; whether any was given.
    fn hand_over(&mut self) -> bool {
        let before = self.in_flight;
        while self.in_flight < self.algo.limit() {
            let Some(w) = self.waiters.pop_front() else {
                break;
            };
            // Fails only if that waiter gave up; then try the next.
            if w.send(()).is_ok() {
                self.in_flight += 1;
            }
        }
        self.in_flight != before
    }
}

struct Shared {
    name: String,
    origin: Instant,
    queue: usize,
    queue_timeout: Duration,
    retry_after: Duration,
    state: Mutex<State>,
}

impl Shared {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, s: &State) {
        let name = self.name.clone();
        metrics::gauge!("guard_concurrency_limit", "name" => name.clone())
            .set(s.algo.limit() as f64);
        metrics::gauge!("guard_concurrency_in_flight", "name" => name).set(s.in_flight as f64);
    }

    fn refuse(&self, s: &mut State) -> Refused {
        s.refused += 1;
        metrics::counter!("guard_concurrency_refused_total", "name" => self.name.clone())
            .increment(1);
        Refused::Overloaded {
            limit: s.algo.limit(),
        }
    }

    /// Admits at once, queues (when a queue is configured and has room), or refuses.
    fn try_acquire(self: &Arc<Self>) -> Result<Permit, Result<Queued, Refused>> {
        let mut s = self.lock();
        // Waiters that gave up hold no place; live ones go first (the limit may have risen
        // since they queued): a newcomer does not overtake the queue.
        s.waiters.retain(|w| !w.is_closed());
        let handed = s.hand_over();
        if s.in_flight < s.algo.limit() {
            s.in_flight += 1;
            self.publish(&s);
            return Ok(self.permit());
        }
        if handed {
            self.publish(&s);
        }
        if s.waiters.len() < self.queue {
            let (tx, rx) = oneshot::channel();
            s.waiters.push_back(tx);
            return Err(Ok(Queued {
                rx,
                shared: self.clone(),
            }));
        }
        Err(Err(self.refuse(&mut s)))
    }

    async fn acquire(self: Arc<Self>) -> Result<Permit, Refused> {
        let mut q = match self.try_acquire() {
            Ok(p) => return Ok(p),
            Err(Err(refused)) => return Err(refused),
            Err(Ok(q)) => q,
        };
        if let Ok(Ok(())) = tokio::time::timeout(self.queue_timeout, &mut q.rx).await {
            return Ok(self.permit());
        }
        // Timed out; a slot handed over meanwhile is ours, otherwise none can come now.
        q.rx.close();
        if q.rx.try_recv().is_ok() {
            return Ok(self.permit());
        }
        drop(q);
        let mut s = self.lock();
        Err(self.refuse(&mut s))
    }

    /// A permit for a slot already counted in `in_flight`.
    fn permit(self: &Arc<Self>) -> Permit {
        Permit {
            started: self.now(),
            shared: self.clone(),
            finished: false,
        }
    }

    fn stats(&self) -> ConcurrencyStats {
        let s = self.lock();
        ConcurrencyStats {
            limit: s.algo.limit(),
            in_flight: s.in_flight,
            queued: s.waiters.iter().filter(|w| !w.is_closed()).count(),
            refused: s.refused,
            min_rtt: s.algo.min_rtt(),
        }
    }
}

/// A queued request. If it is dropped (the caller went away) after a slot was handed to it,
/// the slot is given back rather than lost.
struct Queued {
    rx: oneshot::Receiver<()>,
    shared: Arc<Shared>,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.rx.close();
        // Empty once received: a slot taken by `acquire` is not given back twice.
        if self.rx.try_recv().is_ok() {
            drop(self.shared.permit());
        }
    }
}

/// One admitted call. Dropping it frees the slot; a call that completed (`finished`) also
/// gives its latency to the algorithm, a cancelled one does not (its latency is unknown).
struct Permit {
    shared: Arc<Shared>,
    started: Duration,
    finished: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let shared = &self.shared;
        let now = shared.now();
        let mut s = shared.lock();
        if self.finished {
            s.algo.record(self.started, now);
        }
        s.in_flight = s.in_flight.saturating_sub(1);
        let _ = s.hand_over();
        shared.publish(&s);
    }
}

/// A `tower::Layer` enforcing an adaptive concurrency limit on HTTP requests: the limit
/// follows the service's observed latency ([`Gradient`], documented there), and a request
/// over it (and past the optional queue) is answered with `503 Service Unavailable`,
/// `Retry-After` and a problem+json body, rather than queued without bound. An optional
/// short FIFO queue absorbs small bursts.
///
/// Clones share one limit: apply the same layer (or a clone) wherever the same dependency is
/// called.
///
/// ```
/// use redis_ratelimit_client::guard::AdaptiveConcurrencyLayer;
/// use std::time::Duration;
///
/// let report = AdaptiveConcurrencyLayer::builder()
///     .name("report")
///     .queue(8, Duration::from_millis(10))
///     .build()
///     .unwrap();
/// // axum: Router::new().route("/report", get(report_handler)).layer(report.clone())
/// assert_eq!(report.stats().in_flight, 0);
/// ```
#[derive(Clone)]
pub struct AdaptiveConcurrencyLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for AdaptiveConcurrencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveConcurrencyLayer")
            .field("name", &self.shared.name)
            .field("stats", &self.stats())
            .finish()
    }
}

impl AdaptiveConcurrencyLayer {
    /// Starts a layer with the default [`GradientConfig`], no queue and `Retry-After: 1`.
    pub fn builder() -> AdaptiveConcurrencyBuilder {
        AdaptiveConcurrencyBuilder {
            config: GradientConfig::default(),
            name: "default".into(),
            queue: 0,
            queue_timeout: Duration::ZERO,
            retry_after: Duration::from_secs(1),
        }
    }

    /// The current limit, calls in flight and refusals so far.
    pub fn stats(&self) -> ConcurrencyStats {
        self.shared.stats()
    }

    /// The same limit (shared, not copied) as a layer for non-HTTP services, which fail
    /// with [`Refused::Overloaded`].
    pub fn errors(&self) -> AdaptiveConcurrencyErrorLayer {
        AdaptiveConcurrencyErrorLayer {
            shared: self.shared.clone(),
        }
    }
}

/// Configures an [`AdaptiveConcurrencyLayer`].
#[derive(Debug, Clone)]
#[must_use]
pub struct AdaptiveConcurrencyBuilder {
    config: GradientConfig,
    name: String,
    queue: usize,
    queue_timeout: Duration,
    retry_after: Duration,
}

impl AdaptiveConcurrencyBuilder {
    /// The algorithm's parameters (default: [`GradientConfig::default`]).
    pub fn gradient(mut self, config: GradientConfig) -> Self {
        self.config = config;
        self
    }

    /// The `name` label of this layer's metrics (default `default`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Lets up to `len` requests over the limit wait, first come first served, at most
    /// `max_wait` each, before they are refused (default: no queue, refuse at once).
    pub fn queue(mut self, len: usize, max_wait: Duration) -> Self {
        self.queue = len;
        self.queue_timeout = max_wait;
        self
    }

    /// The `Retry-After` of a `503`, rounded up to whole seconds, at least 1 (default 1 s).
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Builds the layer, or says which parameter is out of range.
    pub fn build(self) -> Result<AdaptiveConcurrencyLayer, ConfigError> {
        let origin = Instant::now();
        let algo = Gradient::new(self.config, Duration::ZERO)?;
        let shared = Shared {
            name: self.name,
            origin,
            queue: self.queue,
            queue_timeout: self.queue_timeout,
            retry_after: self.retry_after,
            state: Mutex::new(State {
                algo,
                in_flight: 0,
                waiters: VecDeque::new(),
                refused: 0,
            }),
        };
        {
            let s = shared.lock();
            shared.publish(&s);
        }
        Ok(AdaptiveConcurrencyLayer {
            shared: Arc::new(shared),
        })
    }
}

impl<S> Layer<S> for AdaptiveConcurrencyLayer {
    type Service = AdaptiveConcurrencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveConcurrencyService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// Made by [`AdaptiveConcurrencyLayer`]. Refusals are responses, never errors.
#[derive(Clone)]
pub struct AdaptiveConcurrencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> fmt::Debug for AdaptiveConcurrencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveConcurrencyService")
            .field("name", &self.shared.name)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for AdaptiveConcurrencyService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response<Either<ResBody, Full<Bytes>>>;
    type Error = S::Error;
    type Future = GuardFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Call the instance that was polled ready; leave a fresh clone for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let retry_after = shared.retry_after;
            let Ok(mut permit) = shared.acquire().await else {
                return Ok(problem::overloaded(retry_after).map(Either::Right));
            };
            let r = inner.call(req).await;
            permit.finished = true;
            drop(permit);
            r.map(|r| r.map(Either::Left))
        })
    }
}

/// [`AdaptiveConcurrencyLayer`]'s limit for any service: over the limit (and past the
/// queue's `max_wait`, if one is configured), the call fails with [`Refused::Overloaded`]
/// (boxed). Made by [`AdaptiveConcurrencyLayer::errors`].
#[derive(Clone)]
pub struct AdaptiveConcurrencyErrorLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for AdaptiveConcurrencyErrorLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveConcurrencyErrorLayer")
            .field("name", &self.shared.name)
            .field("stats", &self.shared.stats())
            .finish()
    }
}

impl AdaptiveConcurrencyErrorLayer {
    /// The current limit, calls in flight and refusals so far.
    pub fn stats(&self) -> ConcurrencyStats {
        self.shared.stats()
    }
}

impl<S> Layer<S> for AdaptiveConcurrencyErrorLayer {
    type Service = AdaptiveConcurrencyErrorService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveConcurrencyErrorService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// Made by [`AdaptiveConcurrencyErrorLayer`].
#[derive(Clone)]
pub struct AdaptiveConcurrencyErrorService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> fmt::Debug for AdaptiveConcurrencyErrorService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveConcurrencyErrorService")
            .field("name", &self.shared.name)
            .finish_non_exhaustive()
    }
}

impl<S, Req> Service<Req> for AdaptiveConcurrencyErrorService<S>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = GuardFuture<S::Response, BoxError>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let mut permit = shared.acquire().await?;
            let r = inner.call(req).await;
            permit.finished = true;
            drop(permit);
            r.map_err(Into::into)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::convert::Infallible;

    /// A service that takes `latency` (tokio time) per call.
    #[derive(Clone)]
    struct Slow(Duration);

    impl Service<u32> for Slow {
        type Response = u32;
        type Error = Infallible;
        type Future = GuardFuture<u32, Infallible>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: u32) -> Self::Future {
            let d = self.0;
            Box::pin(async move {
                tokio::time::sleep(d).await;
                Ok(req)
            })
        }
    }

    fn layer(queue: usize) -> AdaptiveConcurrencyLayer {
        AdaptiveConcurrencyLayer::builder()
            .gradient(GradientConfig {
                probe_limit: 2,
                ..GradientConfig::default()
            })
            .queue(queue, Duration::from_millis(50))
            .build()
            .unwrap()
    }

    async fn call(
        svc: &mut AdaptiveConcurrencyErrorService<Slow>,
        n: u32,
    ) -> Result<u32, BoxError> {
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
        svc.call(n).await
    }

    #[tokio::test(start_paused = true)]
    async fn over_the_limit_is_refused_at_once() {
        let l = layer(0);
        let svc = l.errors().layer(Slow(Duration::from_millis(20)));
        let started = Instant::now();
        let calls: Vec<_> = (0..5)
            .map(|i| {
                let mut s = svc.clone();
                tokio::spawn(async move { call(&mut s, i).await })
            })
            .collect();
        let mut ok = 0;
        for c in calls {
            match c.await.unwrap() {
                Ok(_) => ok += 1,
                Err(e) => assert!(matches!(
                    e.downcast_ref::<Refused>(),
                    Some(Refused::Overloaded { limit: 2 })
                )),
            }
        }
        assert_eq!(ok, 2, "the probe limit");
        assert_eq!(started.elapsed(), Duration::from_millis(20));
        let s = l.stats();
        assert_eq!((s.in_flight, s.refused), (0, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_is_fifo_and_bounded_in_length_and_time() {
        let l = layer(2);
        let svc = l.errors().layer(Slow(Duration::from_millis(20)));
        let t = Instant::now();
        // Spawned in order, polled in order: 0 and 1 run, 2 and 3 wait one turn (20 ms,
        // within the 50 ms wait), 4 and 5 find the queue full.
        let calls: Vec<_> = (0..6)
            .map(|i| {
                let mut s = svc.clone();
                tokio::spawn(async move { (call(&mut s, i).await.ok(), t.elapsed().as_millis()) })
            })
            .collect();
        let mut results = Vec::new();
        for c in calls {
            results.push(c.await.unwrap());
        }
        assert_eq!(
            results,
            [
                (Some(0), 20),
                (Some(1), 20),
                (Some(2), 40),
                (Some(3), 40),
                (None, 0),
                (None, 0)
            ]
        );
        assert_eq!(l.stats().refused, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_gives_up_after_max_wait() {
        let l = layer(1);
        let svc = l.errors().layer(Slow(Duration::from_millis(200)));
        let (mut a, mut b, mut c) = (svc.clone(), svc.clone(), svc.clone());
        let a = tokio::spawn(async move { call(&mut a, 1).await.is_ok() });
        let b = tokio::spawn(async move { call(&mut b, 2).await.is_ok() });
        tokio::task::yield_now().await;
        let t = Instant::now();
        let refused = call(&mut c, 3).await.is_err();
        assert!(refused);
        assert_eq!(
            t.elapsed(),
            Duration::from_millis(50),
            "the queue's max wait"
        );
        assert!(a.await.unwrap() && b.await.unwrap());
        let s = l.stats();
        assert_eq!((s.in_flight, s.queued, s.refused), (0, 0, 1));
        // The waiter that gave up holds no place: the next request runs at once.
        let t = Instant::now();
        assert!(call(&mut svc.clone(), 4).await.is_ok());
        assert_eq!(t.elapsed(), Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn publishes_limit_in_flight_and_refused() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _guard = metrics::set_default_local_recorder(&recorder);
        let l = layer(0);
        let svc = l.errors().layer(Slow(Duration::from_millis(20)));
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let mut s = svc.clone();
                tokio::spawn(async move { call(&mut s, i).await.is_ok() })
            })
            .collect();
        tokio::task::yield_now().await;
        let mut ok = 0;
        for c in calls {
            ok += usize::from(c.await.unwrap());
        }
        assert_eq!(ok, 2);
        let values: HashMap<String, f64> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(k, .., v)| {
                let v = match v {
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Counter(c) => c as f64,
                    DebugValue::Histogram(_) => f64::NAN,
                };
                (k.key().name().to_string(), v)
            })
            .collect();
        assert_eq!(values["guard_concurrency_limit"], 2.0);
        assert_eq!(values["guard_concurrency_in_flight"], 0.0);
        assert_eq!(values["guard_concurrency_refused_total"], 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_handed_to_a_caller_that_went_away_is_given_back() {
        let l = layer(1);
        let shared = &l.shared;
        let (Ok(a), Ok(b)) = (shared.try_acquire(), shared.try_acquire()) else {
            panic!("the probe limit admits 2");
        };
        let Err(Ok(queued)) = shared.try_acquire() else {
            panic!("the third waits");
        };
        drop(a); // hands the slot to the queued request...
        assert_eq!(l.stats().in_flight, 2);
        drop(queued); // ...which is cancelled before it ran.
        assert_eq!(l.stats().in_flight, 1);
        drop(b);
        assert_eq!(l.stats().in_flight, 0);
    }
}
