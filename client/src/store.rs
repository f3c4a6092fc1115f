//! The store: one Redis/Valkey server or a cluster, asked with `RL.CHECKALL`, or with the
//! equivalent Lua script where the module is not loaded.

use crate::breakers::Breakers;
use crate::error::StoreError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, Script, Value};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

/// One limit of a store call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item<'a> {
    pub(crate) key: &'a str,
    /// Tokens per second, as text that parses back to the policy's exact `f64`.
    pub(crate) rate: &'a str,
    pub(crate) burst: u64,
    pub(crate) cost: u64,
}

/// One bucket of a settle call: `delta` tokens charged (> 0) or refunded (< 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SettleItem<'a> {
    pub(crate) key: &'a str,
    pub(crate) rate: &'a str,
    pub(crate) burst: u64,
    pub(crate) delta: i64,
}

/// One `[allowed, remaining, retry_after_ms, reset_after_ms]`.
pub(crate) type Reply = [i64; 4];

/// A connection ready for one call: a single server's manager or a cluster connection
/// (also the region records' connection, `region::record`).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// See the module docs.
pub(crate) struct Store {
    /// Set once connected: at once for a single server (the manager connects lazily and
    /// reconnects by itself), by a background task for a cluster. Replaced by a fresh one
    /// when retired (see [`Store::on_failure`]).
    conn: Arc<RwLock<Option<Conn>>>,
    /// What a single server's connection is made from, to make a fresh one.
    single: Option<(redis::Client, ConnectionManagerConfig)>,
    /// Consecutive failures that suspect the connection itself.
    suspect: AtomicU32,
    script: Script,
    use_script: AtomicBool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("connected", &self.read().is_some())
            .field("use_script", &self.use_script.load(Relaxed))
            .finish()
    }
}

/// Consecutive timeouts (or `READONLY` replies) after which a single server's connection is
/// dropped and a fresh one made: the old one may be a flow a NAT or load balancer lost, which
/// no error would ever end, or lead to a demoted primary.
const RETIRE_AFTER: u32 = 3;

/// TCP settings of every connection: keepalive probes find an idle connection whose peer
/// is gone within about 10 s, and `TCP_USER_TIMEOUT` closes one whose sent data has gone
/// unacknowledged for 3 s (instead of ~15 min of retransmissions), so the connection
/// manager reconnects.
fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(5);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
        .set_user_timeout(Duration::from_secs(3))
}

/// The Lua equivalent of `RL.CHECKALL`.
pub(crate) const CHECKALL_LUA: &str = include_str!("checkall.lua");

impl Store {
    fn new(force_script: bool) -> Self {
        Self {
            conn: Arc::new(RwLock::new(None)),
            single: None,
            suspect: AtomicU32::new(0),
            script: Script::new(CHECKALL_LUA),
            use_script: AtomicBool::new(force_script),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<Conn>> {
        // A connection handle is replaced whole: a poisoned lock still holds a valid one.
        self.conn.read().unwrap_or_else(|p| p.into_inner())
    }

    fn set(slot: &RwLock<Option<Conn>>, conn: Conn) {
        *slot.write().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    }

    /// A single server. Connects on first use and reconnects by itself; retries are left to
    /// the breaker, so a dead server costs each call no more than the connect timeout.
    pub(crate) fn single(
        url: &str,
        connect_timeout: Duration,
        force_script: bool,
    ) -> redis::RedisResult<Self> {
        let info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
        let client = redis::Client::open(info)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(connect_timeout);
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        let mut store = Self::new(force_script);
        Self::set(&store.conn, Conn::Single(manager));
        store.single = Some((client, config));
        Ok(store)
    }

    /// A call reached the store.
    pub(crate) fn on_answer(&self) {
        self.suspect.store(0, Relaxed);
    }

    /// A call failed: after [`RETIRE_AFTER`] in a row that suspect the connection, a single
    /// server's is replaced by a fresh one (made on first use), so the next call or probe
    /// connects anew instead of waiting on a dead flow. A cluster client manages its own
    /// connections per node.
    pub(crate) fn on_failure(&self, e: &StoreError) {
        if !e.suspects_connection() {
            return;
        }
        if self.suspect.fetch_add(1, Relaxed) + 1 < RETIRE_AFTER {
            return;
        }
        self.suspect.store(0, Relaxed);
        let Some((client, config)) = &self.single else {
            return;
        };
        match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
            Ok(fresh) => {
                Self::set(&self.conn, Conn::Single(fresh));
                tracing::warn!(error = %e, "ratelimit: connection retired, a fresh one replaces it");
                metrics::counter!("ratelimit_connections_retired_total").increment(1);
            }
            Err(e) => tracing::warn!(error = %e, "ratelimit: could not replace the connection"),
        }
    }

    /// A cluster, reached through any of `urls`. The first connection is made in the
    /// background, retried every `retry`: until then calls fail as transport errors and
    /// are answered by the fail mode.
    pub(crate) fn cluster(
        urls: Vec<String>,
        connect_timeout: Duration,
        retry: Duration,
        force_script: bool,
        breakers: Weak<Breakers>,
    ) -> redis::RedisResult<Self> {
        let client = redis::cluster::ClusterClient::builder(urls)
            .tcp_settings(tcp_settings())
            .connection_timeout(connect_timeout)
            .retries(1)
            .build()?;
        let store = Self::new(force_script);
        let slot = Arc::downgrade(&store.conn);
        tokio::spawn(async move {
            let conn = loop {
                match client.get_async_connection().await {
                    Ok(c) => break c,
                    Err(e) => tracing::warn!(error = %e, "ratelimit: cluster not reachable yet"),
                }
                if slot.strong_count() == 0 {
                    return;
                }
                tokio::time::sleep(retry).await;
            };
            let Some(live) = slot.upgrade() else { return };
            Self::set(&live, Conn::Cluster(conn.clone()));
            drop(live);
            refresh_slot_map(conn, breakers, retry).await;
        });
        Ok(store)
    }

    /// Checks `items` atomically (all keys must share a slot).
    pub(crate) async fn check_all(&self, items: &[Item<'_>]) -> Result<Vec<Reply>, StoreError> {
        let mut conn = self.connection()?;
        if !self.use_script.load(Relaxed) {
            let mut cmd = redis::cmd("RL.CHECKALL");
            for i in items {
                cmd.arg(i.key).arg(i.rate).arg(i.burst).arg(i.cost);
            }
            match cmd.query_async::<Vec<Reply>>(&mut conn).await {
                Ok(r) => return check_len(r, items.len()),
                Err(e) if is_unknown_command(&e) => self.switch_to_script(),
                Err(e) => return Err(StoreError::from_redis(e)),
            }
        }
        let mut invocation = self.script.prepare_invoke();
        for i in items {
            invocation.key(i.key).arg(i.rate).arg(i.burst).arg(i.cost);
        }
        let r = invocation
            .invoke_async::<Vec<Reply>>(&mut conn)
            .await
            .map_err(StoreError::from_redis)?;
        check_len(r, items.len())
    }
}

impl Store {
    /// Settles each item (one `RL.SETTLE` per bucket, pipelined into one round trip; the
    /// script settles them all in one call where the module is not loaded).
    pub(crate) async fn settle(&self, items: &[SettleItem<'_>]) -> Result<Vec<Reply>, StoreError> {
        let mut conn = self.connection()?;
        if !self.use_script.load(Relaxed) {
            let mut pipe = redis::pipe();
            for i in items {
                pipe.cmd("RL.SETTLE")
                    .arg(i.key)
                    .arg(i.rate)
                    .arg(i.burst)
                    .arg(i.delta);
            }
            match pipe.query_async::<Vec<Reply>>(&mut conn).await {
                Ok(r) => return check_len(r, items.len()),
                Err(e) if is_unknown_command(&e) => self.switch_to_script(),
                Err(e) => return Err(StoreError::from_redis(e)),
            }
        }
        let mut invocation = self.script.prepare_invoke();
        for i in items {
            invocation.key(i.key).arg(i.rate).arg(i.burst).arg(i.delta);
        }
        invocation.arg("settle");
        let r = invocation
            .invoke_async::<Vec<Reply>>(&mut conn)
            .await
            .map_err(StoreError::from_redis)?;
        check_len(r, items.len())
    }

    /// One `PING`: whether the store answers (made to connect at startup, see
    /// [`Limiter::ready`](crate::Limiter::ready)).
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection()?;
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(StoreError::from_redis)
    }

    fn connection(&self) -> Result<Conn, StoreError> {
        self.read().clone().ok_or_else(|| {
            StoreError::Transport(redis::RedisError::from((
                redis::ErrorKind::ClusterConnectionNotFound,
                "not connected yet",
            )))
        })
    }

    /// Managed servers cannot load modules: same semantics, same keys, by script.
    fn switch_to_script(&self) {
        if !self.use_script.swap(true, Relaxed) {
            tracing::warn!("ratelimit: module commands unknown, using the Lua script");
            metrics::counter!("ratelimit_script_fallback_total").increment(1);
        }
    }
}

fn check_len(r: Vec<Reply>, want: usize) -> Result<Vec<Reply>, StoreError> {
    if r.len() == want {
        Ok(r)
    } else {
        Err(StoreError::Protocol(format!(
            "{} replies for {want} limits",
            r.len()
        )))
    }
}

fn is_unknown_command(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.to_ascii_lowercase().starts_with("unknown command"))
}

/// Keeps the breakers' slot → node map current: `CLUSTER SLOTS` every `every` (at least
/// 1 s), each with a 1 s timeout of its own, until the limiter is gone. A failed read keeps
/// the map it had.
async fn refresh_slot_map(mut conn: ClusterConnection, breakers: Weak<Breakers>, every: Duration) {
    let every = every.max(Duration::from_secs(1));
    loop {
        let asked = tokio::time::timeout(
            Duration::from_secs(1),
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async::<Value>(&mut conn),
        )
        .await;
        let Some(breakers) = breakers.upgrade() else {
            return;
        };
        match asked {
            Ok(Ok(reply)) => match slot_ranges(&reply) {
                Some(ranges) => breakers.update(&ranges),
                None => tracing::warn!("ratelimit: CLUSTER SLOTS reply not understood"),
            },
            Ok(Err(e)) => tracing::debug!(error = %e, "ratelimit: CLUSTER SLOTS failed"),
            Err(_) => tracing::debug!("ratelimit: CLUSTER SLOTS timed out"),
        }
        drop(breakers);
        tokio::time::sleep(every).await;
    }
}

/// `(first, last, "host:port")` of each range in a `CLUSTER SLOTS` reply (the primary's).
fn slot_ranges(reply: &Value) -> Option<Vec<(u16, u16, String)>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    ranges
        .iter()
        .map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let int = |v: &Value| match v {
                Value::Int(i) => u16::try_from(*i).ok(),
                _ => None,
            };
            let (first, last) = (int(fields.first()?)?, int(fields.get(1)?)?);
            let Value::Array(primary) = fields.get(2)? else {
                return None;
            };
            let host = match primary.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let port = match primary.get(1)? {
                Value::Int(p) => *p,
                _ => return None,
            };
            Some((first, last, format!("{host}:{port}")))
        })
        .collect()
}
