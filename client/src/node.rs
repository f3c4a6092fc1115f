//! One server the limiter talks to (the single server, or one cluster primary): its
//! connection, its circuit breaker, and the retirement of a connection that stopped
//! answering.
//!
//! Every node is independent: a node that stops answering opens its own breaker and
//! retires its own connection, and calls to the other nodes never wait on it.

use crate::breaker::Breaker;
use crate::error::StoreError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use redis::ConnectionInfo;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// Consecutive timeouts (or `READONLY` replies) after which a node's connection is dropped
/// and a fresh one made: the old one may be a flow a NAT or load balancer lost, which no
/// error would ever end, or lead to a demoted primary.
const RETIRE_AFTER: u32 = 3;

/// How long a node must have been silent before timeouts retire its connection. Checks in
/// flight together all time out in one stall (a fork, a slow command): counted alone, any
/// stall longer than the timeout would make every pod reconnect at once as the server
/// recovers. A lost flow stays silent; a stall ends.
const RETIRE_SILENCE: Duration = Duration::from_secs(1);

/// How nodes are made: the same for every node of a limiter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeSettings {
    pub(crate) connect_timeout: Duration,
    pub(crate) breaker_threshold: u32,
    pub(crate) probe_interval: Duration,
    /// A check's timeout: how long the breaker waits on a probe.
    pub(crate) call_timeout: Duration,
}

/// See the module docs.
pub(crate) struct Node {
    /// `host:port`, as the cluster names it (a socket's path for a Unix socket).
    addr: String,
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Connects on first use and reconnects by itself; replaced whole when retired.
    conn: RwLock<ConnectionManager>,
    /// Consecutive failures that suspect the connection itself.
    suspect: AtomicU32,
    /// When the node last answered (or was made), in ms since `made`.
    last_answer_ms: AtomicU64,
    made: Instant,
    pub(crate) breaker: Breaker,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("addr", &self.addr)
            .field("breaker_open", &self.breaker.is_open())
            .finish()
    }
}

/// TCP settings of every connection: keepalive probes find an idle connection whose peer
/// is gone within about 10 s, and `TCP_USER_TIMEOUT` closes one whose sent data has gone
/// unacknowledged for 3 s (instead of ~15 min of retransmissions), so the connection
/// manager reconnects.
pub(crate) fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(5);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
        .set_user_timeout(Duration::from_secs(3))
}

impl Node {
    /// A node at `info` (its TCP settings replaced by [`tcp_settings`]). Does not connect:
    /// the first call does.
    pub(crate) fn new(info: ConnectionInfo, settings: NodeSettings) -> redis::RedisResult<Self> {
        // `host:port` only: what `CLUSTER SLOTS` names it, and never the URL's password.
        let addr = info.addr().to_string();
        let client = redis::Client::open(info.set_tcp_settings(tcp_settings()))?;
        // Retries are left to the breaker: a dead server costs a call no more than the
        // connect timeout.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.connect_timeout))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(settings.connect_timeout);
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        Ok(Self {
            addr,
            client,
            config,
            conn: RwLock::new(conn),
            suspect: AtomicU32::new(0),
            last_answer_ms: AtomicU64::new(0),
            made: Instant::now(),
            breaker: Breaker::new(
                settings.breaker_threshold,
                settings.probe_interval,
                settings.call_timeout,
            ),
        })
    }

    /// `host:port`.
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    /// The connection for one call.
    pub(crate) fn conn(&self) -> ConnectionManager {
        // A connection handle is replaced whole: a poisoned lock still holds a valid one.
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A call reached the node.
    pub(crate) fn on_answer(&self) {
        self.suspect.store(0, Relaxed);
        self.last_answer_ms.store(self.ms_since_made(), Relaxed);
    }

    fn ms_since_made(&self) -> u64 {
        u64::try_from(self.made.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A call failed: after [`RETIRE_AFTER`] in a row that suspect the connection (and, for
    /// timeouts, [`RETIRE_SILENCE`] without an answer), it is replaced by a fresh one (made
    /// on first use), so the next call or probe connects anew instead of waiting on a dead
    /// flow.
    pub(crate) fn on_failure(&self, e: &StoreError) {
        if !e.suspects_connection() || self.suspect.fetch_add(1, Relaxed) + 1 < RETIRE_AFTER {
            return;
        }
        let silent = self
            .ms_since_made()
            .saturating_sub(self.last_answer_ms.load(Relaxed));
        if matches!(e, StoreError::Timeout) && silent < RETIRE_SILENCE.as_millis() as u64 {
            return;
        }
        self.suspect.store(0, Relaxed);
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                *self.conn.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                tracing::warn!(
                    node = %self.addr,
                    error = %e,
                    "ratelimit: connection retired, a fresh one replaces it"
                );
                metrics::counter!("ratelimit_connections_retired_total").increment(1);
            }
            Err(e) => {
                tracing::warn!(
                    node = %self.addr,
                    error = %e,
                    "ratelimit: could not replace the connection"
                );
            }
        }
    }
}
