//! One circuit breaker per cluster node (one in all for a single server): a node that stops
//! answering sends only the subjects on its own slots to the fail modes, and the others keep
//! reaching the store.
//!
//! The slot → node map comes from `CLUSTER SLOTS`, read in the background by the store (off
//! the request path, with its own timeout). Until it is known, one breaker covers everything.

use crate::breaker::Breaker;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Slots in a Redis / Valkey Cluster.
const SLOTS: usize = 16_384;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Breakers {
    whole: Arc<Breaker>,
    map: RwLock<Option<SlotMap>>,
    threshold: u32,
    probe_interval: Duration,
}

#[derive(Debug)]
struct SlotMap {
    /// Index into `nodes` for each slot; `u16::MAX`: no node serves it.
    owner: Box<[u16]>,
    /// `host:port` and its breaker.
    nodes: Vec<(String, Arc<Breaker>)>,
}

impl Breakers {
    pub(crate) fn new(threshold: u32, probe_interval: Duration) -> Self {
        Self {
            whole: Arc::new(Breaker::new(threshold, probe_interval)),
            map: RwLock::new(None),
            threshold,
            probe_interval,
        }
    }

    /// The breaker guarding `key`'s slot.
    pub(crate) fn for_key(&self, key: &str) -> Arc<Breaker> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let Some(map) = map.as_ref() else {
            return self.whole.clone();
        };
        let slot = usize::from(crate::key::slot(key.as_bytes()));
        map.owner
            .get(slot)
            .and_then(|&i| map.nodes.get(usize::from(i)))
            .map_or_else(|| self.whole.clone(), |(_, b)| b.clone())
    }

    /// Whether any breaker keeps calls from the store.
    pub(crate) fn any_open(&self) -> bool {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        self.whole.is_open()
            || map
                .as_ref()
                .is_some_and(|m| m.nodes.iter().any(|(_, b)| b.is_open()))
    }

    /// Installs the slot ranges `(first, last, "host:port")` of a `CLUSTER SLOTS` reply,
    /// keeping the breakers (and so the state) of the nodes already known.
    pub(crate) fn update(&self, ranges: &[(u16, u16, String)]) {
        let mut guard = self.map.write().unwrap_or_else(|p| p.into_inner());
        let old: HashMap<&str, &Arc<Breaker>> = guard
            .as_ref()
            .map(|m| m.nodes.iter().map(|(n, b)| (n.as_str(), b)).collect())
            .unwrap_or_default();
        let mut nodes: Vec<(String, Arc<Breaker>)> = Vec::new();
        let mut owner = vec![u16::MAX; SLOTS].into_boxed_slice();
        for (first, last, node) in ranges {
            let i = match nodes.iter().position(|(n, _)| n == node) {
                Some(i) => i,
                None => {
                    let breaker = old.get(node.as_str()).map_or_else(
                        || Arc::new(Breaker::new(self.threshold, self.probe_interval)),
                        |b| Arc::clone(b),
                    );
                    nodes.push((node.clone(), breaker));
                    nodes.len() - 1
                }
            };
            let Ok(i) = u16::try_from(i) else { continue };
            for slot in usize::from(*first)..=usize::from(*last).min(SLOTS - 1) {
                owner[slot] = i;
            }
        }
        *guard = Some(SlotMap { owner, nodes });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_failing_node_opens_only_its_own_breaker() {
        let b = Breakers::new(1, Duration::from_secs(1));
        let key_on = |want: std::ops::RangeInclusive<u16>| {
            (0..)
                .map(|i| format!("k{i}"))
                .find(|k| want.contains(&crate::key::slot(k.as_bytes())))
                .unwrap()
        };
        let (a, c) = (key_on(0..=8191), key_on(8192..=16383));
        assert!(
            Arc::ptr_eq(&b.for_key(&a), &b.for_key(&c)),
            "one breaker before the map"
        );
        b.update(&[(0, 8191, "n1:1".into()), (8192, 16383, "n2:2".into())]);
        b.for_key(&c).on_failure(Instant::now());
        assert!(b.for_key(&c).is_open());
        assert!(!b.for_key(&a).is_open());
        assert!(b.any_open());
        // A new map keeps a known node's state.
        b.update(&[(0, 16383, "n2:2".into())]);
        assert!(b.for_key(&a).is_open());
    }
}
