//! The store: one Redis/Valkey server or a cluster, asked with `RL.CHECK` (one limit) or
//! `RL.CHECKALL` (several), or with the equivalent Lua script where the module is not loaded.

use crate::cluster::{parse_moved, Cluster};
use crate::error::StoreError;
use crate::node::{Node, NodeSettings};
use redis::{IntoConnectionInfo, Script, Value};
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

/// The replies of one check call, in the order of its items: one is kept inline, as a
/// one-limit check (the common case) needs no vector.
#[derive(Debug)]
pub(crate) enum Replies {
    One(Reply),
    Many(Vec<Reply>),
}

impl std::ops::Deref for Replies {
    type Target = [Reply];

    fn deref(&self) -> &[Reply] {
        match self {
            Replies::One(r) => std::slice::from_ref(r),
            Replies::Many(v) => v,
        }
    }
}

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
        let node = Node::new(info, settings)?;
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

    /// One server: every key in one call, whatever its slot.
    pub(crate) fn is_single(&self) -> bool {
        matches!(self.target, Target::Single(_))
    }

    /// The node serving `key` (for a cluster: none until the topology is known, or if no
    /// node serves the slot; then a topology read is asked for).
    pub(crate) fn route(&self, key: &str) -> Option<Arc<Node>> {
        match &self.target {
            Target::Single(node) => Some(Arc::clone(node)),
            Target::Cluster(cluster) => {
                let node = cluster.node_for(key);
                if node.is_none() {
                    cluster.refresh_soon();
                }
                node
            }
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

    /// The node a `MOVED` reply from `from` sends the call to (learnt for the next calls
    /// too); `None` for any other error, or a single server.
    pub(crate) fn redirect(&self, from: &Node, e: &StoreError) -> Option<Arc<Node>> {
        let (Target::Cluster(cluster), StoreError::Transport(e)) = (&self.target, e) else {
            return None;
        };
        let (slot, addr) = parse_moved(e)?;
        cluster.moved(slot, &addr, from)
    }

    /// Checks `items` atomically on `node` (all keys must share a slot). A `MOVED` is
    /// returned, for the caller to follow ([`redirect`](Self::redirect)) with its own
    /// breaker accounting.
    pub(crate) async fn check_all(
        &self,
        node: &Node,
        items: &[Item<'_>],
    ) -> Result<Replies, StoreError> {
        let mut conn = node.conn();
        if !self.use_script.load(Relaxed) {
            // Sized up front: growing the buffers took 3 allocations of a check's 19.
            let bytes = items
                .iter()
                .map(|i| i.key.len() + i.rate.len() + 2 * 20)
                .sum::<usize>();
            let mut cmd = redis::Cmd::with_capacity(1 + 4 * items.len(), 11 + bytes);
            // One limit (the common case): `RL.CHECK`, whose flat reply is one array fewer
            // for redis-rs to parse and allocate.
            let single = items.len() == 1;
            cmd.arg(if single { "RL.CHECK" } else { "RL.CHECKALL" });
            for i in items {
                cmd.arg(i.key).arg(i.rate).arg(i.burst).arg(i.cost);
            }
            // The connection manager's own method, not `ConnectionLike`'s, which boxes the
            // call's future: 1.3 kB, past glibc's per-thread cache.
            let answer = conn
                .send_packed_command(&cmd)
                .await
                .and_then(|v| replies(v, single));
            match answer {
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
        check_len(Replies::Many(r), items.len())
    }
}

impl Store {
    /// `items` (by index) in the calls a settle makes: one on a single server, one per slot
    /// on a cluster (a reservation's buckets share one, but for sharded policies'
    /// sub-buckets), in first-seen order.
    pub(crate) fn settle_groups(&self, items: &[SettleItem<'_>]) -> Vec<Vec<usize>> {
        if let Target::Single(_) = self.target {
            return vec![(0..items.len()).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let slot = crate::key::slot(item.key.as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, at)) => at.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups.into_iter().map(|(_, at)| at).collect()
    }

    /// Settles one group's buckets on `node` (see [`settle_groups`](Self::settle_groups)):
    /// `RL.SETTLE` per bucket pipelined, or the script for all of them where the module is
    /// not loaded. A `MOVED` is returned, for the caller to follow: nothing was applied.
    pub(crate) async fn settle_on(
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
            // Each command's own reply: a pipeline's error would hide the MOVED's target
            // (and an unknown command's text).
            let answers = pipe
                .ignore_errors()
                .query_async::<Vec<redis::RedisResult<Reply>>>(&mut conn)
                .await
                .map_err(StoreError::from_redis)?;
            let mut replies = Vec::with_capacity(answers.len());
            let mut unknown = false;
            for a in answers {
                match a {
                    Ok(r) => replies.push(r),
                    Err(e) if is_unknown_command(&e) => unknown = true,
                    Err(e) => return Err(StoreError::from_redis(e)),
                }
            }
            if !unknown {
                return check_len(replies, items.len());
            }
            // Unknown everywhere at once (a server without the module): nothing applied.
            self.switch_to_script();
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

/// A check's reply: `[a, b, c, d]` for `RL.CHECK` (`single`), an array of them for
/// `RL.CHECKALL`. Those shapes are read directly; anything else (an error reply, integers
/// as bulk strings, Nil, other lengths) goes through redis-rs' generic conversion, as
/// `query_async` does, which rebuilds the value to look for errors first and costs a check
/// several hundred instructions more.
fn replies(v: Value, single: bool) -> redis::RedisResult<Replies> {
    fn four(v: &Value) -> Option<Reply> {
        match v {
            Value::Array(items) => match items.as_slice() {
                [Value::Int(a), Value::Int(b), Value::Int(c), Value::Int(d)] => {
                    Some([*a, *b, *c, *d])
                }
                _ => None,
            },
            _ => None,
        }
    }
    let read = match (&v, single) {
        (_, true) => four(&v).map(Replies::One),
        (Value::Array(all), false) => all
            .iter()
            .map(four)
            .collect::<Option<Vec<_>>>()
            .map(Replies::Many),
        (_, false) => None,
    };
    match read {
        Some(r) => Ok(r),
        None => converted(v, single),
    }
}

/// What `query_async` makes of a reply: errors anywhere in it first, then redis-rs' generic
/// conversion.
fn converted(v: Value, single: bool) -> redis::RedisResult<Replies> {
    let v = v.extract_error()?;
    Ok(if single {
        Replies::One(redis::from_redis_value(v)?)
    } else {
        Replies::Many(redis::from_redis_value(v)?)
    })
}

fn check_len<R: std::ops::Deref<Target = [Reply]>>(r: R, want: usize) -> Result<R, StoreError> {
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
    StoreError::NoNode
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(resp: &str) -> Value {
        redis::parse_redis_value(resp.as_bytes()).expect("valid RESP")
    }

    #[test]
    fn a_check_reply_is_read_as_its_four_integers() {
        let r = replies(value("*4\r\n:1\r\n:19\r\n:-1\r\n:600\r\n"), true).expect("a reply");
        assert_eq!(&*r, &[[1, 19, -1, 600]]);
        let r = replies(
            value("*2\r\n*4\r\n:1\r\n:19\r\n:-1\r\n:600\r\n*4\r\n:0\r\n:0\r\n:250\r\n:3000\r\n"),
            false,
        )
        .expect("replies");
        assert_eq!(&*r, &[[1, 19, -1, 600], [0, 0, 250, 3000]]);
    }

    #[test]
    fn every_reply_is_read_as_query_async_read_it() {
        for (resp, single) in [
            ("*4\r\n:1\r\n:19\r\n:-1\r\n:600\r\n", true),
            ("*1\r\n*4\r\n:1\r\n:19\r\n:-1\r\n:600\r\n", false),
            (
                "*2\r\n*4\r\n:1\r\n:19\r\n:-1\r\n:600\r\n*4\r\n:0\r\n:0\r\n:250\r\n:3000\r\n",
                false,
            ),
            // Integers as bulk strings still convert.
            ("*4\r\n$1\r\n1\r\n:19\r\n:-1\r\n:600\r\n", true),
            ("*1\r\n*4\r\n$1\r\n0\r\n:0\r\n:5\r\n:6\r\n", false),
            ("*3\r\n:1\r\n:19\r\n:-1\r\n", true),
            ("*5\r\n:1\r\n:19\r\n:-1\r\n:600\r\n:0\r\n", true),
            ("$-1\r\n", true),
            ("$-1\r\n", false),
            ("*0\r\n", false),
            (":1\r\n", false),
            ("*1\r\n*3\r\n:1\r\n:2\r\n:3\r\n", false),
            ("*2\r\n*4\r\n:1\r\n:2\r\n:3\r\n:4\r\n:5\r\n", false),
            ("-MOVED 3999 127.0.0.1:7001\r\n", true),
            ("-ERR unknown command 'RL.CHECKALL'\r\n", false),
            // An error inside the reply fails the whole call.
            ("*4\r\n:1\r\n-ERR inner\r\n:-1\r\n:600\r\n", true),
            (
                "*2\r\n*4\r\n:1\r\n:2\r\n:3\r\n:4\r\n-ERR rate must be positive\r\n",
                false,
            ),
        ] {
            let (fast, slow) = (replies(value(resp), single), converted(value(resp), single));
            match (fast, slow) {
                (Ok(f), Ok(s)) => assert_eq!(&*f, &*s, "{resp:?}"),
                (Err(f), Err(s)) => {
                    assert_eq!(
                        (f.kind(), f.code(), f.detail()),
                        (s.kind(), s.code(), s.detail()),
                        "{resp:?}"
                    );
                }
                (f, s) => panic!("{resp:?}: {f:?} against {s:?}"),
            }
        }
    }

    #[test]
    fn an_error_reply_keeps_its_code() {
        let e = replies(value("-MOVED 3999 127.0.0.1:7001\r\n"), true).expect_err("an error");
        assert_eq!(parse_moved(&e), Some((3999, "127.0.0.1:7001".into())));
        let e =
            replies(value("-ERR unknown command 'RL.CHECKALL'\r\n"), false).expect_err("an error");
        assert!(is_unknown_command(&e));
        // An error inside the array fails the whole call, as before.
        let e =
            replies(value("*1\r\n-ERR rate must be positive\r\n"), false).expect_err("an error");
        assert_eq!(e.code(), Some("ERR"));
    }
}
