//! The store: one Redis/Valkey server or a cluster, asked with `RL.CHECKALL`, or with the
//! equivalent Lua script where the module is not loaded.

use crate::cluster::{parse_moved, Cluster};
use crate::error::StoreError;
use crate::node::{Node, NodeSettings};
use redis::{IntoConnectionInfo, Script};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
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

/// See the module docs.
pub(crate) struct Store {
    target: Target,
    script: Script,
    use_script: AtomicBool,
}

enum Target {
    Single(Arc<Node>),
    Cluster(Arc<Cluster>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Store");
        match &self.target {
            Target::Single(node) => d.field("node", node),
            Target::Cluster(cluster) => d.field("cluster", cluster),
        };
        d.field("use_script", &self.use_script.load(Relaxed))
            .finish()
    }
}

/// The Lua equivalent of `RL.CHECKALL`.
pub(crate) const CHECKALL_LUA: &str = include_str!("checkall.lua");

impl Store {
    fn new(target: Target, force_script: bool) -> Self {
        Self {
            target,
            script: Script::new(CHECKALL_LUA),
            use_script: AtomicBool::new(force_script),
        }
    }

    /// A single server. Connects on first use and reconnects by itself.
    pub(crate) fn single(
        url: &str,
        settings: NodeSettings,
        force_script: bool,
    ) -> redis::RedisResult<Self> {
        let info = url.into_connection_info()?;
        let node = Node::new(url.to_owned(), info, settings)?;
        Ok(Self::new(Target::Single(Arc::new(node)), force_script))
    }

    /// A cluster, reached through any of `urls`; its topology is read in the background,
    /// every `every`. Until it is known, calls are answered by the fail modes.
    pub(crate) fn cluster(
        urls: &[String],
        settings: NodeSettings,
        every: Duration,
        force_script: bool,
    ) -> redis::RedisResult<Self> {
        let cluster = Cluster::start(urls, settings, every)?;
        Ok(Self::new(Target::Cluster(cluster), force_script))
    }

    /// The node serving `key` (for a cluster: none until the topology is known, or if no
    /// node serves the slot).
    pub(crate) fn route(&self, key: &str) -> Option<Arc<Node>> {
        match &self.target {
            Target::Single(node) => Some(Arc::clone(node)),
            Target::Cluster(cluster) => cluster.node_for(key),
        }
    }

    /// Whether any node's breaker keeps calls from it.
    pub(crate) fn any_open(&self) -> bool {
        match &self.target {
            Target::Single(node) => node.breaker.is_open(),
            Target::Cluster(cluster) => cluster.nodes().iter().any(|n| n.breaker.is_open()),
        }
    }

    /// A call to `node` failed; `opened`: it opened the node's breaker. A cluster reads its
    /// topology again at once then (the node may have been failed over).
    pub(crate) fn on_failure(&self, node: &Node, e: &StoreError, opened: bool) {
        node.on_failure(e);
        if let (Target::Cluster(cluster), true) = (&self.target, opened) {
            cluster.refresh_soon();
        }
    }

    /// `PING`s every node (a cluster's once its topology is known).
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        let nodes = match &self.target {
            Target::Single(node) => vec![Arc::clone(node)],
            Target::Cluster(cluster) => cluster.nodes(),
        };
        if nodes.is_empty() {
            return Err(not_connected());
        }
        for node in nodes {
            redis::cmd("PING")
                .query_async::<()>(&mut node.conn())
                .await
                .map_err(StoreError::from_redis)?;
            node.on_answer();
        }
        Ok(())
    }

    /// The node a `MOVED` reply from a cluster node sends the call to (learnt for the
    /// next calls too).
    fn redirect(&self, r: &Result<Vec<Reply>, StoreError>) -> Option<Arc<Node>> {
        let (Target::Cluster(cluster), Err(StoreError::Transport(e))) = (&self.target, r) else {
            return None;
        };
        let (slot, addr) = parse_moved(e)?;
        cluster.moved(slot, &addr)
    }

    /// Checks `items` atomically on `node` (all keys must share a slot), following one
    /// `MOVED`.
    pub(crate) async fn check_all(
        &self,
        node: &Node,
        items: &[Item<'_>],
    ) -> Result<Vec<Reply>, StoreError> {
        let r = self.check_all_on(node, items).await;
        match self.redirect(&r) {
            Some(to) => self.check_all_on(&to, items).await,
            None => r,
        }
    }

    async fn check_all_on(
        &self,
        node: &Node,
        items: &[Item<'_>],
    ) -> Result<Vec<Reply>, StoreError> {
        let mut conn = node.conn();
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
    /// Settles each item (one `RL.SETTLE` per bucket, pipelined into one round trip per
    /// node; the script settles a node's buckets in one call where the module is not
    /// loaded). A reservation's buckets share a slot, but for sharded policies' sub-buckets.
    pub(crate) async fn settle(&self, items: &[SettleItem<'_>]) -> Result<Vec<Reply>, StoreError> {
        let mut groups: Vec<(Arc<Node>, Vec<SettleItem<'_>>, Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let node = self.route(item.key).ok_or_else(not_connected)?;
            match groups.iter_mut().find(|(n, ..)| Arc::ptr_eq(n, &node)) {
                Some((_, part, at)) => {
                    part.push(*item);
                    at.push(i);
                }
                None => groups.push((node, vec![*item], vec![i])),
            }
        }
        let mut replies = vec![[0; 4]; items.len()];
        for (node, part, at) in groups {
            let r = self.settle_on(&node, &part).await;
            let r = match self.redirect(&r) {
                Some(to) => self.settle_on(&to, &part).await,
                None => r,
            }?;
            for (i, reply) in at.into_iter().zip(r) {
                if let Some(slot) = replies.get_mut(i) {
                    *slot = reply;
                }
            }
        }
        Ok(replies)
    }

    async fn settle_on(
        &self,
        node: &Node,
        items: &[SettleItem<'_>],
    ) -> Result<Vec<Reply>, StoreError> {
        let mut conn = node.conn();
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

/// No node to ask: a cluster whose topology is not known yet, or a slot no node serves.
pub(crate) fn not_connected() -> StoreError {
    StoreError::Transport(redis::RedisError::from((
        redis::ErrorKind::ClusterConnectionNotFound,
        "no node serves this key yet",
    )))
}
