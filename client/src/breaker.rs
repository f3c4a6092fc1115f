//! Circuit breaker: after repeated transport failures, stop calling a sick store and answer
//! locally at once; let one probe through every `probe_interval`; close on its success.
//!
//! Only transport failures (timeout, refused, dropped) count: an `ERR` reply proves the
//! store is up.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the breaker lets a call do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Closed: call the store.
    Call,
    /// Half-open: this call is the probe.
    Probe,
    /// Open: do not call; the next probe is due at the given instant.
    Reject(Instant),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe is out since `since`; if it never reports back (its caller was cancelled),
    /// another is let through after a probe interval.
    HalfOpen {
        since: Instant,
    },
}

/// A circuit breaker, with time passed in.
#[derive(Debug)]
pub(crate) struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    probe_interval: Duration,
}

impl Breaker {
    /// Opens after `threshold` consecutive transport failures; probes every `probe_interval`
    /// (at most a day, so that `now + probe_interval` cannot overflow).
    pub(crate) fn new(threshold: u32, probe_interval: Duration) -> Self {
        Self {
            state: Mutex::new(State::Closed { failures: 0 }),
            threshold: threshold.max(1),
            probe_interval: probe_interval.min(Duration::from_secs(86_400)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state inconsistent (plain copies).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn admit(&self, now: Instant) -> Admission {
        let mut s = self.lock();
        match *s {
            State::Closed { .. } => Admission::Call,
            State::Open { until } | State::HalfOpen { since: until } if now < until => {
                Admission::Reject(until)
            }
            State::Open { .. } | State::HalfOpen { .. } => {
                *s = State::HalfOpen {
                    since: now + self.probe_interval,
                };
                Admission::Probe
            }
        }
    }

    /// Records a call that reached the store. Returns true if this closed the breaker.
    pub(crate) fn on_success(&self) -> bool {
        let mut s = self.lock();
        let was_open = !matches!(*s, State::Closed { .. });
        *s = State::Closed { failures: 0 };
        was_open
    }

    /// Records a transport failure. Returns true if this opened the breaker.
    pub(crate) fn on_failure(&self, now: Instant) -> bool {
        let mut s = self.lock();
        let until = now + self.probe_interval;
        match *s {
            State::Closed { failures } if failures + 1 < self.threshold => {
                *s = State::Closed {
                    failures: failures + 1,
                };
                false
            }
            State::Closed { .. } | State::HalfOpen { .. } => {
                *s = State::Open { until };
                true
            }
            State::Open { .. } => false,
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        !matches!(*self.lock(), State::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_probes_and_closes() {
        let b = Breaker::new(3, Duration::from_secs(2));
        let t0 = Instant::now();
        assert_eq!(b.admit(t0), Admission::Call);
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        assert!(!b.on_success(), "a success resets the count");
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        assert!(b.on_failure(t0), "third consecutive failure opens");
        assert_eq!(b.admit(t0), Admission::Reject(t0 + Duration::from_secs(2)));
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(b.admit(t1), Admission::Probe);
        assert!(
            matches!(b.admit(t1), Admission::Reject(_)),
            "one probe at a time"
        );
        assert!(b.on_failure(t1), "a failed probe reopens");
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(b.admit(t2), Admission::Probe);
        assert!(b.on_success(), "a good probe closes");
        assert_eq!(b.admit(t2), Admission::Call);
    }

    #[test]
    fn a_huge_probe_interval_does_not_overflow() {
        let b = Breaker::new(1, Duration::MAX);
        let t0 = Instant::now();
        assert!(b.on_failure(t0));
        assert!(matches!(b.admit(t0), Admission::Reject(_)));
    }

    #[test]
    fn a_lost_probe_is_replaced() {
        let b = Breaker::new(1, Duration::from_secs(1));
        let t0 = Instant::now();
        b.on_failure(t0);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit(t1), Admission::Probe);
        // The probe's caller went away without reporting.
        assert_eq!(b.admit(t1 + Duration::from_secs(1)), Admission::Probe);
    }
}
