//! Live pod count, for the local fallback's share (limit ÷ pods) instead of a number
//! configured by hand.
//!
//! Each pod beats into a sorted set in its store, scored by the server's clock, every
//! `interval`; the same call drops members not seen for `ttl` and counts the rest
//! (`ZADD`, `ZREMRANGEBYSCORE`, `ZCARD` in one script: no `SCAN`, nothing on the request
//! path). The count is handed to the [`Limiter`] ([`Limiter::set_pods`]); while the store
//! cannot be reached, the last known count is kept. With regions, use one set per region
//! in the region's own store ([`LivePodsBuilder::key`]): the fallback is then the region's
//! share ÷ the region's live pods. The store may be a cluster
//! ([`LivePods::cluster_builder`]): the set is one key, on its own slot.
//!
//! ```no_run
//! # use redis_ratelimit_client::{Limiter, pods::LivePods};
//! # async fn demo() -> Result<(), redis_ratelimit_client::Error> {
//! let limiter = Limiter::builder("redis://127.0.0.1:6379").build()?;
//! let pods = LivePods::builder("redis://127.0.0.1:6379").start(&limiter)?;
//! // ... later: pods.count() == Some(n)
//! pods.leave().await; // on shutdown: counted out at once rather than after the TTL
//! # Ok(()) }
//! ```

use crate::background::BackgroundConn;
use crate::region::RegionTarget;
use crate::{Error, Limiter};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Beats, drops the silent, counts the rest: `KEYS[1]` the set, `ARGV` the pod id and the
/// TTL in ms. The server's clock scores every member, so pods' clocks never matter.
const BEAT_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])";

/// A pod's heartbeat and its view of how many pods are alive. Dropping it stops the beat
/// (the pod is then counted out after the TTL, as if it had crashed); [`leave`](Self::leave)
/// counts it out at once.
#[derive(Debug)]
pub struct LivePods {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    conn: BackgroundConn,
    id: String,
    key: String,
    /// 0: not known yet.
    count: AtomicU64,
}

/// Configures [`LivePods`]; see [`LivePods::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct LivePodsBuilder {
    target: RegionTarget,
    key: String,
    id: Option<String>,
    ttl: Duration,
    interval: Option<Duration>,
    timeout: Duration,
}

impl LivePodsBuilder {
    /// The sorted set (default `rl:pods`); one per region with regions.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// This pod's id (default: random).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// A pod not heard from for this long is not counted (default 10 s).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.max(Duration::from_millis(10));
        self
    }

    /// How often to beat and count (default a third of the TTL; with twice the timeout,
    /// below the TTL, or [`start`](Self::start) refuses).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = Some(interval);
        self
    }

    /// Longest wait per beat (default 500 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts beating and feeding the count to `limiter`. Must be called within a Tokio
    /// runtime; does not wait for the store.
    pub fn start(self, limiter: &Limiter) -> Result<LivePods, Error> {
        let conn = BackgroundConn::open(&self.target, self.timeout)
            .map_err(|e| Error::Config(e.to_string()))?;
        let shared = Arc::new(Shared {
            conn,
            id: self
                .id
                .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>())),
            key: self.key,
            count: AtomicU64::new(0),
        });
        let interval = self
            .interval
            .unwrap_or(self.ttl / 3)
            .max(Duration::from_millis(5));
        // A live pod must beat again before its TTL runs out. A beat runs on the server
        // anywhere within its timeout and the next one starts up to a timeout after it was
        // sent, so two beats' scores lie up to interval + 2 × timeout apart: counted out
        // between them, a pod would raise every other pod's fallback share (limit ÷ a
        // count too low).
        if self
            .timeout
            .checked_mul(2)
            .and_then(|t| t.checked_add(interval))
            .is_none_or(|t| t >= self.ttl)
        {
            return Err(Error::Config(format!(
                "live pods: interval {interval:?} + 2 × timeout {:?} must be below the TTL {:?}",
                self.timeout, self.ttl
            )));
        }
        let task = tokio::spawn(beat(
            shared.clone(),
            limiter.clone(),
            self.ttl,
            interval,
            self.timeout,
        ));
        Ok(LivePods { shared, task })
    }
}

impl LivePods {
    /// Beats into the store at `url`.
    pub fn builder(url: impl Into<String>) -> LivePodsBuilder {
        Self::builder_for(RegionTarget::Server(url.into()))
    }

    /// Beats into a cluster, reached through any of `urls`.
    pub fn cluster_builder(urls: impl IntoIterator<Item = impl Into<String>>) -> LivePodsBuilder {
        Self::builder_for(RegionTarget::Cluster(
            urls.into_iter().map(Into::into).collect(),
        ))
    }

    /// Beats into `target`: a server or a cluster.
    pub(crate) fn builder_for(target: RegionTarget) -> LivePodsBuilder {
        LivePodsBuilder {
            target,
            key: "rl:pods".into(),
            id: None,
            ttl: Duration::from_secs(10),
            interval: None,
            timeout: Duration::from_millis(500),
        }
    }

    /// Live pods as last counted (this one included), or `None` before the first count.
    pub fn count(&self) -> Option<u64> {
        match self.shared.count.load(Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// This pod's id in the set.
    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// Stops beating and removes this pod from the set (a graceful shutdown).
    pub async fn leave(self) {
        self.task.abort();
        let remove = || async {
            let mut c = self.shared.conn.live().await?;
            redis::cmd("ZREM")
                .arg(&self.shared.key)
                .arg(&self.shared.id)
                .query_async::<i64>(&mut c)
                .await
        };
        // Twice: a connection whose last reconnect failed (the store was down, is back)
        // answers its stored error once, then reconnects.
        let removed = async {
            if remove().await.is_err() {
                let _ = remove().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), removed).await;
    }
}

impl Drop for LivePods {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn beat(
    shared: Arc<Shared>,
    limiter: Limiter,
    ttl: Duration,
    interval: Duration,
    timeout: Duration,
) {
    let ttl_ms = ttl.as_millis().max(1) as u64;
    loop {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(BEAT_LUA)
            .arg(1)
            .arg(&shared.key)
            .arg(&shared.id)
            .arg(ttl_ms);
        let counted = async {
            let mut conn = shared.conn.live().await?;
            cmd.query_async::<u64>(&mut conn).await
        };
        match tokio::time::timeout(timeout, counted).await {
            Ok(Ok(n)) if n > 0 => {
                if shared.count.swap(n, Relaxed) != n {
                    tracing::info!(pods = n, "ratelimit: live pods");
                }
                limiter.set_pods(n);
                metrics::gauge!("ratelimit_live_pods").set(n as f64);
            }
            // Unreachable: the last count stands.
            _ => {}
        }
        tokio::time::sleep(interval).await;
    }
}
