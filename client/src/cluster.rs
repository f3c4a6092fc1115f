//! A Redis / Valkey Cluster: one [`Node`] per primary (its own connection and breaker), the
//! slot → node map read with `CLUSTER SLOTS` in the background, and `MOVED` redirections
//! learnt at once.
//!
//! Why not redis-rs' cluster connection: its recovery (a slot refresh, a reconnect) holds
//! one lock over every node's connection while it waits on the node that went silent, and
//! requests queue behind it. With one of three primaries blackholed, the subjects on the
//! two healthy nodes went from 100% answered by the store to 1.3% once the first recovery
//! started (about 3 s in). Here a call only ever waits on its own node, and topology reads
//! happen off the request path, each with its own timeout. Routing is [`crate::slot`] (CRC16
//! of the hash tag, as the cluster computes it); failover and resharding are the cluster's.

use crate::node::{Node, NodeSettings};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use tokio::sync::Notify;

/// Slots in a Redis / Valkey Cluster.
const SLOTS: usize = 16_384;

/// Each `CLUSTER SLOTS` gets this long before the next node is asked.
const SLOTS_TIMEOUT: Duration = Duration::from_secs(1);

/// At most one topology read per this interval, however many redirections ask for one.
const MIN_REFRESH_GAP: Duration = Duration::from_millis(200);

/// See the module docs.
pub(crate) struct Cluster {
    map: RwLock<Option<SlotMap>>,
    /// The nodes the limiter was given, asked for the topology when no known node answers.
    seeds: Vec<Arc<Node>>,
    /// Credentials and TLS of the first seed, for the nodes learnt from the cluster.
    template: ConnectionInfo,
    settings: NodeSettings,
    refresh: Arc<Notify>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes())
            .finish()
    }
}

struct SlotMap {
    /// Index into `nodes` for each slot; `u16::MAX`: no node serves it.
    owner: Box<[u16]>,
    nodes: Vec<Arc<Node>>,
}

/// `(first, last, "host:port")` of one slot range.
pub(crate) type Range = (u16, u16, String);

impl Cluster {
    /// A cluster reached through any of `urls`. Reads the topology in the background, at
    /// once and then every `every` (at least 1 s; sooner when asked, and with a backoff from
    /// 200 ms while no node answers), until the last handle is dropped.
    pub(crate) fn start(
        urls: &[String],
        settings: NodeSettings,
        every: Duration,
    ) -> redis::RedisResult<Arc<Self>> {
        let infos = urls
            .iter()
            .map(|u| u.as_str().into_connection_info())
            .collect::<Result<Vec<_>, _>>()?;
        let Some(template) = infos.first().cloned() else {
            return Err((
                redis::ErrorKind::InvalidClientConfig,
                "no cluster node given",
            )
                .into());
        };
        let seeds = infos
            .into_iter()
            .map(|info| Node::new(info, settings).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let cluster = Arc::new(Self {
            map: RwLock::new(None),
            seeds,
            template,
            settings,
            refresh: Arc::new(Notify::new()),
        });
        tokio::spawn(refresh_loop(
            Arc::downgrade(&cluster),
            Arc::clone(&cluster.refresh),
            every.max(Duration::from_secs(1)),
        ));
        Ok(cluster)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<SlotMap>> {
        // The map is replaced whole: a poisoned lock still holds a valid one.
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The primary serving `key`'s slot, once the topology is known.
    pub(crate) fn node_for(&self, key: &str) -> Option<Arc<Node>> {
        let map = self.read();
        let map = map.as_ref()?;
        let slot = usize::from(crate::key::slot(key.as_bytes()));
        let i = *map.owner.get(slot)?;
        map.nodes.get(usize::from(i)).cloned()
    }

    /// The primaries serving slots (none before the topology is known).
    pub(crate) fn nodes(&self) -> Vec<Arc<Node>> {
        self.read()
            .as_ref()
            .map(|m| m.nodes.clone())
            .unwrap_or_default()
    }

    /// Asks the background task for a topology read now (a redirection, a node failing).
    pub(crate) fn refresh_soon(&self) {
        self.refresh.notify_one();
    }

    /// A `MOVED <slot> <host:port>` reply from `from`: the slot is served there from now
    /// on (a full read follows, for the rest of what moved). An empty host is `from`'s (a
    /// cluster announcing no endpoint). Returns the node to ask again.
    pub(crate) fn moved(&self, slot: u16, addr: &str, from: &Node) -> Option<Arc<Node>> {
        self.refresh_soon();
        // `:port` has no host; `::1:7001` is an IPv6 host (Redis writes them unbracketed).
        let no_host = addr
            .strip_prefix(':')
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        let addr = match no_host {
            Some(port) => {
                let host = from.addr().rsplit_once(':').map_or("", |(h, _)| h);
                format!("{host}:{port}")
            }
            None => addr.to_owned(),
        };
        // Looked up and added under one write lock: concurrent redirections to a new node
        // make one node, not one each.
        let mut guard = self.map.write().unwrap_or_else(|p| p.into_inner());
        let map = guard.as_mut()?;
        let i = match map.nodes.iter().position(|n| n.addr() == addr) {
            Some(i) => i,
            None => {
                let node = self
                    .seeds
                    .iter()
                    .find(|n| n.addr() == addr)
                    .cloned()
                    .or_else(|| self.make(&addr))?;
                map.nodes.push(node);
                map.nodes.len() - 1
            }
        };
        *map.owner.get_mut(usize::from(slot))? = u16::try_from(i).ok()?;
        map.nodes.get(i).cloned()
    }

    /// Installs the slot ranges of a `CLUSTER SLOTS` reply, keeping the nodes (connection
    /// and breaker) already known by address.
    pub(crate) fn install(&self, ranges: &[Range]) {
        let mut nodes: Vec<Arc<Node>> = Vec::new();
        let mut owner = vec![u16::MAX; SLOTS].into_boxed_slice();
        for (first, last, addr) in ranges {
            let i = match nodes.iter().position(|n| n.addr() == addr) {
                Some(i) => i,
                None => {
                    let Some(node) = self.node_at(addr) else {
                        continue;
                    };
                    nodes.push(node);
                    nodes.len() - 1
                }
            };
            let Ok(i) = u16::try_from(i) else { continue };
            for slot in usize::from(*first)..=usize::from(*last).min(SLOTS - 1) {
                owner[slot] = i;
            }
        }
        *self.map.write().unwrap_or_else(|p| p.into_inner()) = Some(SlotMap { owner, nodes });
    }

    /// The node at `addr`: a known one (in the map or a seed), else a new one.
    fn node_at(&self, addr: &str) -> Option<Arc<Node>> {
        let known = self
            .read()
            .as_ref()
            .and_then(|m| m.nodes.iter().find(|n| n.addr() == addr).cloned())
            .or_else(|| self.seeds.iter().find(|n| n.addr() == addr).cloned());
        known.or_else(|| self.make(addr))
    }

    /// A new node at `host:port`, with the first seed's credentials and TLS.
    fn make(&self, addr: &str) -> Option<Arc<Node>> {
        let (host, port) = addr.rsplit_once(':')?;
        let port = port.parse().ok()?;
        let at = match self.template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let info = self.template.clone().set_addr(at);
        match Node::new(info, self.settings) {
            Ok(node) => Some(Arc::new(node)),
            Err(e) => {
                tracing::warn!(node = addr, error = %e, "ratelimit: cannot make a connection");
                None
            }
        }
    }

    /// One topology read: the known nodes whose breaker is closed first, then the others,
    /// then the seeds; the first answer wins.
    async fn read_slots(&self) -> Option<Vec<Range>> {
        let mut candidates = self.nodes();
        candidates.sort_by_key(|n| n.breaker.is_open());
        for seed in &self.seeds {
            if !candidates.iter().any(|n| n.addr() == seed.addr()) {
                candidates.push(Arc::clone(seed));
            }
        }
        for node in candidates {
            let mut conn = node.conn();
            let asked = tokio::time::timeout(
                SLOTS_TIMEOUT,
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn),
            )
            .await;
            match asked {
                Ok(Ok(reply)) => match slot_ranges(&reply, node.addr()) {
                    Some(ranges) if !ranges.is_empty() => return Some(ranges),
                    _ => tracing::warn!(
                        node = node.addr(),
                        "ratelimit: CLUSTER SLOTS reply not understood"
                    ),
                },
                Ok(Err(e)) => {
                    let node = node.addr();
                    tracing::debug!(node, error = %e, "ratelimit: CLUSTER SLOTS failed")
                }
                Err(_) => tracing::debug!(node = node.addr(), "ratelimit: CLUSTER SLOTS timed out"),
            }
        }
        None
    }
}

/// Reads the topology at once, then every `every` or sooner when asked (at most once per
/// [`MIN_REFRESH_GAP`]), until the cluster is dropped.
async fn refresh_loop(cluster: Weak<Cluster>, asked: Arc<Notify>, every: Duration) {
    let mut known = false;
    // While no node answers: ask again soon, then less and less often, up to `every`.
    let mut backoff = MIN_REFRESH_GAP;
    let mut failing = false;
    loop {
        // Holds no strong handle while it waits, so dropping the limiter ends the task.
        let Some(live) = cluster.upgrade() else {
            return;
        };
        match live.read_slots().await {
            Some(ranges) => {
                live.install(&ranges);
                if failing {
                    tracing::info!("ratelimit: cluster topology read again");
                }
                (known, failing, backoff) = (true, false, MIN_REFRESH_GAP);
            }
            None => {
                // Once per outage, not once per attempt.
                if !failing && !known {
                    tracing::warn!("ratelimit: cluster not reachable yet");
                } else if !failing {
                    tracing::warn!("ratelimit: no node answered CLUSTER SLOTS; keeping the map");
                }
                failing = true;
            }
        }
        drop(live);
        tokio::time::sleep(MIN_REFRESH_GAP).await;
        if failing {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(every);
        } else {
            // Woken early by a redirection, a failing node, or a key no node serves.
            let _ = tokio::time::timeout(every, asked.notified()).await;
        }
    }
}

/// The ranges of a `CLUSTER SLOTS` reply (each range's primary). A primary with an empty
/// host is the node asked (`asked`'s host), as the cluster spec says; one whose host is
/// `?` is unknown (a hostname preferred but none announced), and its range is left out:
/// its slots have no node until a later read names one.
pub(crate) fn slot_ranges(reply: &Value, asked: &str) -> Option<Vec<Range>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let asked_host = asked.rsplit_once(':').map_or(asked, |(h, _)| h);
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
                Value::Nil => String::new(),
                _ => return None,
            };
            let port = match primary.get(1)? {
                Value::Int(p) => *p,
                _ => return None,
            };
            Some(match host.as_str() {
                "?" => None,
                "" => Some((first, last, format!("{asked_host}:{port}"))),
                _ => Some((first, last, format!("{host}:{port}"))),
            })
        })
        .collect::<Option<Vec<_>>>()
        .map(|ranges| ranges.into_iter().flatten().collect())
}

/// A `MOVED <slot> <host:port>` error's slot and address.
pub(crate) fn parse_moved(e: &redis::RedisError) -> Option<(u16, String)> {
    if e.code() != Some("MOVED") {
        return None;
    }
    moved_to(e.detail()?)
}

/// `<slot> <host:port>`, the detail of a `MOVED` error.
fn moved_to(detail: &str) -> Option<(u16, String)> {
    let mut words = detail.split_ascii_whitespace();
    let slot = words.next()?.parse().ok()?;
    let addr = words.next()?;
    Some((slot, addr.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn settings() -> NodeSettings {
        NodeSettings {
            connect_timeout: Duration::from_millis(100),
            breaker_threshold: 1,
            probe_interval: Duration::from_secs(1),
            call_timeout: Duration::from_millis(5),
        }
    }

    /// A cluster on port 1 of loopback: the background reads fail; the tests install the
    /// map by hand.
    fn unreachable() -> Arc<Cluster> {
        Cluster::start(
            &["redis://127.0.0.1:1".into()],
            settings(),
            Duration::from_secs(3600),
        )
        .unwrap()
    }

    fn key_on(want: std::ops::RangeInclusive<u16>) -> String {
        (0..)
            .map(|i| format!("k{i}"))
            .find(|k| want.contains(&crate::key::slot(k.as_bytes())))
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn a_failing_node_opens_only_its_own_breaker_and_keeps_it_across_maps() {
        let c = unreachable();
        let (a, b) = (key_on(0..=8191), key_on(8192..=16383));
        assert!(c.node_for(&a).is_none(), "no node before the map");
        c.install(&[(0, 8191, "n1:1".into()), (8192, 16383, "n2:2".into())]);
        let (na, nb) = (c.node_for(&a).unwrap(), c.node_for(&b).unwrap());
        assert_eq!((na.addr(), nb.addr()), ("n1:1", "n2:2"));
        let now = Instant::now();
        nb.breaker.on_failure(now, now);
        assert!(nb.breaker.is_open());
        assert!(!na.breaker.is_open());
        // A new map keeps a known node (and so its breaker's state).
        c.install(&[(0, 16383, "n2:2".into())]);
        assert!(Arc::ptr_eq(&c.node_for(&a).unwrap(), &nb));
        assert_eq!(c.nodes().len(), 1);
    }

    #[tokio::test]
    async fn moved_points_one_slot_at_the_new_node() {
        let c = unreachable();
        c.install(&[(0, 16383, "n1:1".into())]);
        let k = key_on(0..=16383);
        let slot = crate::key::slot(k.as_bytes());
        let other = key_on(slot.wrapping_add(1)..=slot.wrapping_add(1));
        let from = c.node_for(&k).unwrap();
        let to = c.moved(slot, "n2:2", &from).unwrap();
        assert_eq!(to.addr(), "n2:2");
        assert!(Arc::ptr_eq(&c.node_for(&k).unwrap(), &to));
        assert_eq!(
            c.node_for(&other).unwrap().addr(),
            "n1:1",
            "other slots stay"
        );
        // The same new node again: found by address, not made twice.
        let again = c.moved((slot + 1) % 16384, "n2:2", &from).unwrap();
        assert!(Arc::ptr_eq(&again, &to));
        assert_eq!(c.nodes().len(), 2);
        // No host: the replying node's.
        assert_eq!(c.moved(slot, ":7", &from).unwrap().addr(), "n1:7");
        // An IPv6 host, unbracketed as Redis writes it, is a host.
        assert_eq!(c.moved(slot, "::1:7001", &from).unwrap().addr(), "::1:7001");
    }

    #[test]
    fn moved_details_parse() {
        assert_eq!(
            moved_to("3999 127.0.0.1:6381"),
            Some((3999, "127.0.0.1:6381".to_owned()))
        );
        assert_eq!(moved_to("99999 h:1"), None, "not a slot");
        assert_eq!(moved_to("12"), None);
    }

    #[test]
    fn slot_ranges_fill_an_empty_host_with_the_asked_node() {
        let node = |host: &str, port| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(0), Value::Int(99), node("10.0.0.1", 7000)]),
            Value::Array(vec![Value::Int(100), Value::Int(16383), node("", 7001)]),
        ]);
        assert_eq!(
            slot_ranges(&reply, "10.0.0.9:7005").unwrap(),
            vec![
                (0, 99, "10.0.0.1:7000".to_owned()),
                (100, 16383, "10.0.0.9:7001".to_owned())
            ]
        );
        // `?`: a node whose endpoint is unknown, not the node asked.
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(0), Value::Int(99), node("?", 7000)]),
            Value::Array(vec![Value::Int(100), Value::Int(16383), node("", 7001)]),
        ]);
        assert_eq!(
            slot_ranges(&reply, "10.0.0.9:7005").unwrap(),
            vec![(100, 16383, "10.0.0.9:7001".to_owned())]
        );
        assert!(slot_ranges(&Value::Int(1), "x:1").is_none());
        let bad = Value::Array(vec![Value::Array(vec![Value::Int(-1)])]);
        assert!(slot_ranges(&bad, "x:1").is_none());
    }
}
