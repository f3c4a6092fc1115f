//! Errors. Transport trouble (timeout, refused, dropped) is not an error for callers: it
//! is answered by the policy's fail mode and counted. What reaches the caller is a bug to fix:
//! an invalid policy, or an `ERR` reply from the store.

/// What `Limiter` calls return instead of a decision.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A policy failed validation.
    #[error("invalid policy {0}")]
    InvalidPolicy(String),
    /// The limiter's configuration is invalid (bad URL, no policies...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The store answered with an error (`ERR ...`, `WRONGTYPE ...`): a bug, not an outage.
    #[error("the store refused the check: {0}")]
    Server(#[source] redis::RedisError),
    /// The store's reply did not have the expected shape.
    #[error("unexpected reply from the store: {0}")]
    Protocol(String),
}

/// Why one store call failed.
#[derive(Debug)]
pub(crate) enum StoreError {
    /// No answer within the timeout.
    Timeout,
    /// Connection refused, dropped, not yet established, or the cluster is down.
    Transport(redis::RedisError),
    /// An error reply.
    Server(redis::RedisError),
    /// A reply of the wrong shape.
    Protocol(String),
    /// Not asked: the node's breaker is open (a cluster node other than the subject's, e.g.
    /// a sub-bucket's, or the target of a redirection).
    BreakerOpen,
    /// Not asked: no node serves the key's slot (a cluster whose topology is not known yet,
    /// or a slot no node serves).
    NoNode,
}

impl StoreError {
    /// Timeouts and transport failures: the store may be fine again later; the breaker
    /// counts these and the fail mode answers them. Nothing else is.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Timeout | Self::Transport(_) | Self::BreakerOpen | Self::NoNode
        )
    }

    /// Whether the node asked should count this against its breaker: not when it was not
    /// asked, nor for a redirection or a slot in migration (`MOVED`, `ASK`, `TRYAGAIN`: the
    /// node is up, the key is elsewhere for now), which a resharding produces by the
    /// thousand and which must not cut off the node's other slots.
    pub(crate) fn counts_against_breaker(&self) -> bool {
        match self {
            Self::BreakerOpen | Self::NoNode => false,
            Self::Transport(e) => !matches!(e.code(), Some("MOVED" | "ASK" | "TRYAGAIN")),
            _ => true,
        }
    }

    /// Failures that a fresh connection may not have: no answer at all (a connection whose
    /// packets are silently dropped stays open for the kernel's ~15 min of retransmissions),
    /// or `READONLY` (the name now leads to a new primary, the old connection to a replica).
    pub(crate) fn suspects_connection(&self) -> bool {
        match self {
            Self::Timeout => true,
            Self::Transport(e) => e.code() == Some("READONLY"),
            Self::Server(_) | Self::Protocol(_) | Self::BreakerOpen | Self::NoNode => false,
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            // Counted as before it had a variant of its own.
            Self::Transport(_) | Self::NoNode => "transport",
            Self::Server(_) => "server",
            Self::Protocol(_) => "protocol",
            Self::BreakerOpen => "breaker_open",
        }
    }

    pub(crate) fn from_redis(e: redis::RedisError) -> Self {
        use redis::ErrorKind;
        let transport = e.is_io_error()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || matches!(e.kind(), ErrorKind::ClusterConnectionNotFound)
            || e.code().is_some_and(|code| UNWELL.contains(&code));
        if transport {
            Self::Transport(e)
        } else {
            Self::Server(e)
        }
    }
}

/// Error replies that say the store is unwell, not that the request is wrong: answered by
/// the fail mode (the local fallback keeps limiting), counted, and counted by the breaker.
/// `BUSY`: a runaway script; `LOADING`: a dataset loading; `MISCONF`: writes stopped after a
/// failed save; `NOREPLICAS`: `min-replicas-to-write` unmet; `READONLY`: a replica after a
/// failover; `OOM`: `maxmemory` reached; `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`: a cluster
/// or replica in transition; `MOVED`, `ASK`: a redirection not followed (`MOVED` is followed
/// once, see `crate::cluster`; `ASK`, a slot being migrated, is not). The redirections and
/// `TRYAGAIN` are answered by the fail mode but not counted by the breaker. Every other
/// reply (`ERR`, `WRONGTYPE`, ...) is a bug to fix.
const UNWELL: [&str; 11] = [
    "BUSY",
    "LOADING",
    "MISCONF",
    "NOREPLICAS",
    "READONLY",
    "OOM",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "MOVED",
    "ASK",
];

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => f.write_str("no answer within the timeout"),
            Self::Transport(e) | Self::Server(e) => e.fmt(f),
            Self::Protocol(s) => f.write_str(s),
            Self::BreakerOpen => f.write_str("the node's breaker is open"),
            Self::NoNode => f.write_str("no node serves this key yet"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sub-bucket whose slot no node serves: the fail mode answers, and neither the
    /// subject's node (asked just before, and fine) nor its connection is blamed.
    #[test]
    fn a_slot_without_a_node_blames_no_node() {
        let e = StoreError::NoNode;
        assert!(e.is_transient());
        assert!(!e.counts_against_breaker());
        assert!(!e.suspects_connection());
        assert_eq!(e.kind(), "transport");
    }
}
