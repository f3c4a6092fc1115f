//! The rebalancing task's settings, and the times derived from them (tick, lease, hold).

use super::super::share::WHOLE;
use super::HOT_MAX;
use std::time::{Duration, Instant};

/// The rebalancing settings (see the builder for each).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) period: Duration,
    pub(crate) floor_fraction: f64,
    /// The floor in ppm, set by the builder.
    pub(crate) floor: u32,
    pub(crate) smoothing: f64,
    pub(crate) timeout: Option<Duration>,
    pub(crate) prefix: String,
    /// Most subjects this region marks hot per policy (0: none, per-subject shares off).
    pub(crate) hot_max: usize,
    /// A policy met at run time and unchecked for this long is forgotten.
    pub(crate) forget_idle: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            period: Duration::from_secs(2),
            floor_fraction: 0.05,
            floor: WHOLE / 20,
            smoothing: 0.5,
            timeout: None,
            prefix: "rl".into(),
            hot_max: HOT_MAX,
            forget_idle: Duration::from_secs(600),
        }
    }
}

impl Settings {
    /// Whether what last moved at `since` has been still for `forget_idle` at `now`.
    pub(super) fn idle(&self, since: Instant, now: Instant) -> bool {
        now.saturating_duration_since(since) >= self.forget_idle
    }

    pub(crate) fn tick(&self) -> Duration {
        self.period / 4
    }

    /// How long a pod may use a share after the start of its last good round trip: two
    /// ticks, so one missed round does not cap it.
    pub(crate) fn lease(&self) -> Duration {
        self.tick() * 2
    }

    /// How long the leader keeps claiming a share it gave up, after writing that: longer
    /// than any pod's lease on it, plus a tick for clocks that run at slightly other rates.
    pub(crate) fn hold(&self) -> Duration {
        self.lease() + self.tick()
    }

    pub(super) fn leader_ttl(&self) -> Duration {
        self.tick() * 4
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
            .unwrap_or_else(|| self.tick().min(Duration::from_millis(500)))
    }
}
