//! A connection for calls off the request path (the regions' records, the live pod count):
//! a server or a cluster, through redis-rs' own clients.
//!
//! A server's is a connection manager (lazy, reconnects by itself); a cluster's is
//! connected on first use and retried on the next call until it works. These calls run a
//! few times per second at most, so redis-rs' cluster connection serves them (the checks'
//! own per-node routing, `crate::cluster`, is about not waiting on a lost node per
//! request).

use crate::node::tcp_settings;
use crate::region::RegionTarget;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, Value};
use std::sync::atomic::{AtomicBool, Ordering::AcqRel, Ordering::Release};
use std::sync::Arc;
use std::time::Duration;

/// See the module docs.
#[derive(Clone)]
pub(crate) enum BackgroundConn {
    Single(ConnectionManager),
    Cluster(Arc<ClusterClient>, Arc<ClusterCell>),
}

/// Marks a cluster's connect task ended when dropped.
struct Connected<'a>(&'a ClusterCell);

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.connecting.store(false, Release);
    }
}

/// A cluster's connection once made, and whether a task is making it.
#[derive(Default)]
pub(crate) struct ClusterCell {
    conn: tokio::sync::OnceCell<ClusterConnection>,
    connecting: AtomicBool,
}

impl std::fmt::Debug for BackgroundConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackgroundConn::Single(_) => "BackgroundConn::Single",
            BackgroundConn::Cluster(..) => "BackgroundConn::Cluster",
        })
    }
}

/// A connection ready for one call.
#[derive(Clone)]
pub(crate) enum Live {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Live {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Live::Single(c) => c.req_packed_command(cmd),
            Live::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Live::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Live::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Live::Single(c) => c.get_db(),
            Live::Cluster(c) => c.get_db(),
        }
    }
}

impl BackgroundConn {
    /// A connection to `target`, made on first use.
    pub(crate) fn open(
        target: &RegionTarget,
        connect_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        Ok(match target {
            RegionTarget::Server(url) => {
                // The request path's TCP settings: a flow lost without a reset is closed
                // within seconds, and the manager reconnects.
                let info = url.as_str().into_connection_info()?;
                let client = redis::Client::open(info.set_tcp_settings(tcp_settings()))?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(None)
                    .set_number_of_retries(1)
                    .set_max_delay(connect_timeout);
                BackgroundConn::Single(ConnectionManager::new_lazy_with_config(client, config)?)
            }
            RegionTarget::Cluster(urls) => {
                let client = ClusterClient::builder(urls.clone())
                    .tcp_settings(tcp_settings())
                    .connection_timeout(connect_timeout)
                    .retries(1)
                    .build()?;
                BackgroundConn::Cluster(Arc::new(client), Arc::default())
            }
        })
    }

    /// The connection for one call (a cluster's is made now if it is not yet).
    pub(crate) async fn live(&self) -> redis::RedisResult<Live> {
        match self {
            BackgroundConn::Single(c) => Ok(Live::Single(c.clone())),
            BackgroundConn::Cluster(client, cell) => {
                if let Some(c) = cell.conn.get() {
                    return Ok(Live::Cluster(c.clone()));
                }
                // Made in a task of its own: a caller's timeout (a beat's, a round's) must
                // not throw away a connect half done, or a slow cluster (several round
                // trips to connect) would never get connected. One such task at a time:
                // calls while it runs fail at once, where a task each would pile up behind
                // it for as long as the cluster stays silent (a round every 500 ms, a
                // connect given up after 1 s).
                if cell.connecting.swap(true, AcqRel) {
                    return Err(std::io::Error::other("cluster connection under way").into());
                }
                let (client, cell) = (Arc::clone(client), Arc::clone(cell));
                let made = tokio::spawn(async move {
                    // Cleared however the task ends: done, panicked, or dropped at shutdown.
                    let _done = Connected(&cell);
                    cell.conn
                        .get_or_try_init(|| client.get_async_connection())
                        .await
                        .cloned()
                });
                let c = made.await.map_err(std::io::Error::other)??;
                Ok(Live::Cluster(c))
            }
        }
    }
}
