//! Circuit breaker: after repeated transport failures, stop calling a sick store and answer
//! locally at once; let one probe through (another only once it cannot be answered any more),
//! first after [`FIRST_PROBE`], then at twice the wait after each failed probe, up to every
//! `probe_interval`; close on a success (a probe's,
//! or a late answer to a call let through before it opened: either shows the store answers).
//! A breaker that opens again within `probe_interval` of closing starts from twice its last
//! wait, not from the first: a store that answers a lone probe but fails under the full load
//! is not given the full load again every 50 ms.
//!
//! The short first wait is for the store that only stalled: at thousands of checks a second,
//! one stall past the timeout (a slow command, a fork, the host) fails a pod's threshold of
//! calls at once. Probing only every `probe_interval` (2 s by default) then sent every check
//! of every pod to its local bucket for 2 s; measured at 50k checks/s over 10 pods, a 15 ms
//! `CLIENT PAUSE` moved 40% of a 5 s run's checks off the store.
//!
//! Only transport failures (timeout, refused, dropped) count: an `ERR` reply proves the
//! store is up.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first probe's wait after the breaker opens (or `probe_interval`, if shorter).
pub(crate) const FIRST_PROBE: Duration = Duration::from_millis(50);

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
    /// `recent`: when it last closed, and the wait it had then.
    Closed {
        failures: u32,
        recent: Option<(Instant, Duration)>,
    },
    /// `wait`: how long this opening lasts; doubled by each failed probe.
    Open { until: Instant, wait: Duration },
    /// A probe is out; if it has not reported back by `until` (its caller gave up, or never
    /// asked this node), another is let through.
    HalfOpen { until: Instant, wait: Duration },
}

#[derive(Debug, Clone, Copy)]
struct Inner {
    state: State,
    /// When the breaker last opened. Calls let through before then were in flight when it
    /// opened: one failing late (a timeout longer than the breaker's wait) says nothing the
    /// opening did not, and must not be taken for a probe's failure or reopen it.
    opened: Option<Instant>,
}

/// A circuit breaker, with time passed in.
#[derive(Debug)]
pub(crate) struct Breaker {
    inner: Mutex<Inner>,
    threshold: u32,
    probe_interval: Duration,
    /// How long a call may take: a probe is not given up on (and another let through) before.
    call_timeout: Duration,
}

impl Breaker {
    /// Opens after `threshold` consecutive transport failures; probes after [`FIRST_PROBE`],
    /// then backs off to every `probe_interval` (at most a day, so that `now + probe_interval`
    /// cannot overflow). `call_timeout` is the longest a call waits for its answer (also at
    /// most a day).
    pub(crate) fn new(threshold: u32, probe_interval: Duration, call_timeout: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                state: State::Closed {
                    failures: 0,
                    recent: None,
                },
                opened: None,
            }),
            threshold: threshold.max(1),
            probe_interval: probe_interval.min(Duration::from_secs(86_400)),
            call_timeout: call_timeout.min(Duration::from_secs(86_400)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the state inconsistent (plain copies).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn admit(&self, now: Instant) -> Admission {
        let s = &mut self.lock().state;
        match *s {
            State::Closed { .. } => Admission::Call,
            State::Open { until, .. } | State::HalfOpen { until, .. } if now < until => {
                Admission::Reject(until)
            }
            State::Open { wait, .. } | State::HalfOpen { wait, .. } => {
                // Given up on after the wait a failure would bring (not a whole
                // `probe_interval` of no probe for one lost caller), but never while it may
                // still be answered: a second probe would only add load to a sick store.
                *s = State::HalfOpen {
                    until: now + self.backed_off(wait).max(self.call_timeout),
                    wait,
                };
                Admission::Probe
            }
        }
    }

    /// `wait` doubled, at most `probe_interval`.
    fn backed_off(&self, wait: Duration) -> Duration {
        wait.saturating_mul(2).min(self.probe_interval)
    }

    /// Records a call that reached the store (`now`: when it started or was answered; the
    /// time a close is remembered from). Returns true if this closed the breaker.
    pub(crate) fn on_success(&self, now: Instant) -> bool {
        let s = &mut self.lock().state;
        match s {
            State::Closed { failures, .. } => {
                *failures = 0;
                false
            }
            State::Open { wait, .. } | State::HalfOpen { wait, .. } => {
                let recent = Some((now, *wait));
                *s = State::Closed {
                    failures: 0,
                    recent,
                };
                true
            }
        }
    }

    /// Records a transport failure of a call let through at `admitted` (the `now` its
    /// [`admit`](Self::admit) was given). Returns true if this opened the breaker.
    pub(crate) fn on_failure(&self, admitted: Instant, now: Instant) -> bool {
        let mut inner = self.lock();
        if inner.opened.is_some_and(|opened| admitted < opened) {
            return false;
        }
        let s = &mut inner.state;
        let wait = match *s {
            State::Closed { failures, recent } if failures + 1 < self.threshold => {
                *s = State::Closed {
                    failures: failures + 1,
                    recent,
                };
                return false;
            }
            // Open again soon after closing: the store is still unwell, back off further.
            State::Closed {
                recent: Some((closed, wait)),
                ..
            } if now.saturating_duration_since(closed) < self.probe_interval => {
                self.backed_off(wait)
            }
            State::Closed { .. } => FIRST_PROBE.min(self.probe_interval),
            // A failed probe: the store is still out, wait twice as long.
            State::HalfOpen { wait, .. } => self.backed_off(wait),
            State::Open { .. } => return false,
        };
        *s = State::Open {
            until: now + wait,
            wait,
        };
        inner.opened = Some(now);
        true
    }

    pub(crate) fn is_open(&self) -> bool {
        !matches!(self.lock().state, State::Closed { .. })
    }

    /// When the next probe may go, while the breaker is open.
    pub(crate) fn next_probe(&self) -> Option<Instant> {
        match self.lock().state {
            State::Open { until, .. } => Some(until),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limiter's default call timeout.
    const TIMEOUT: Duration = Duration::from_millis(5);

    #[test]
    fn opens_after_threshold_probes_and_closes() {
        let b = Breaker::new(3, Duration::from_secs(2), TIMEOUT);
        let t0 = Instant::now();
        assert_eq!(b.admit(t0), Admission::Call);
        assert!(!b.on_failure(t0, t0));
        assert!(!b.on_failure(t0, t0));
        assert!(!b.on_success(t0), "a success resets the count");
        assert!(!b.on_failure(t0, t0));
        assert!(!b.on_failure(t0, t0));
        assert!(b.on_failure(t0, t0), "third consecutive failure opens");
        assert_eq!(b.admit(t0), Admission::Reject(t0 + FIRST_PROBE));
        let t1 = t0 + FIRST_PROBE;
        assert_eq!(b.admit(t1), Admission::Probe);
        assert!(
            matches!(b.admit(t1), Admission::Reject(_)),
            "one probe at a time"
        );
        assert!(b.on_failure(t1, t1), "a failed probe reopens");
        let t2 = t1 + 2 * FIRST_PROBE;
        assert_eq!(
            b.admit(t2 - Duration::from_millis(1)),
            Admission::Reject(t2)
        );
        assert_eq!(b.admit(t2), Admission::Probe);
        assert!(b.on_success(t2), "a good probe closes");
        assert_eq!(b.admit(t2), Admission::Call);
    }

    #[test]
    fn probes_back_off_to_the_interval_and_start_over_once_closed_long_enough() {
        let interval = Duration::from_secs(2);
        let b = Breaker::new(1, interval, TIMEOUT);
        let mut now = Instant::now();
        assert!(b.on_failure(now, now));
        let mut waits = Vec::new();
        for _ in 0..8 {
            let Admission::Reject(until) = b.admit(now) else {
                panic!("open breaker let a call through");
            };
            waits.push(until - now);
            now = until;
            assert_eq!(b.admit(now), Admission::Probe);
            assert!(b.on_failure(now, now), "the probe failed: open again");
        }
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(
            waits,
            [50, 100, 200, 400, 800, 1600, 2000, 2000].map(ms),
            "doubling from the first probe to the interval"
        );
        let closed = now + interval;
        assert_eq!(b.admit(closed), Admission::Probe);
        assert!(b.on_success(closed));
        let later = closed + interval;
        assert!(
            b.on_failure(later, later),
            "closed: the threshold opens it again"
        );
        assert_eq!(b.admit(later), Admission::Reject(later + FIRST_PROBE));
    }

    #[test]
    fn opening_again_soon_after_closing_backs_off_further() {
        // A store that answers a lone probe but fails under the full load.
        let interval = Duration::from_secs(2);
        let b = Breaker::new(1, interval, TIMEOUT);
        let mut now = Instant::now();
        assert!(b.on_failure(now, now));
        let mut waits = Vec::new();
        for _ in 0..7 {
            let Admission::Reject(until) = b.admit(now) else {
                panic!("open breaker let a call through");
            };
            let wait = until - now;
            waits.push(wait);
            now = until;
            assert_eq!(b.admit(now), Admission::Probe);
            assert!(b.on_success(now), "the probe closes it");
            assert_eq!(b.next_probe(), None);
            now += Duration::from_millis(5);
            assert!(b.on_failure(now, now), "the full load fails it again");
            assert_eq!(b.next_probe(), Some(now + (2 * wait).min(interval)));
        }
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(waits, [50, 100, 200, 400, 800, 1600, 2000].map(ms));
    }

    #[test]
    fn a_short_probe_interval_caps_the_first_wait() {
        let b = Breaker::new(1, Duration::from_millis(10), TIMEOUT);
        let t0 = Instant::now();
        assert!(b.on_failure(t0, t0));
        assert_eq!(
            b.admit(t0),
            Admission::Reject(t0 + Duration::from_millis(10))
        );
    }

    #[test]
    fn a_huge_probe_interval_does_not_overflow() {
        let b = Breaker::new(1, Duration::MAX, TIMEOUT);
        let t0 = Instant::now();
        assert!(b.on_failure(t0, t0));
        assert!(matches!(b.admit(t0), Admission::Reject(_)));
    }

    #[test]
    fn a_late_failure_of_a_call_from_before_the_opening_counts_for_nothing() {
        // A timeout longer than the first wait: calls let through before the breaker opened
        // still fail after the probe has gone out, or after it has closed the breaker.
        let ms = Duration::from_millis;
        let b = Breaker::new(1, Duration::from_secs(2), TIMEOUT);
        let t0 = Instant::now();
        let before = t0 - ms(1);
        assert!(b.on_failure(before, t0));
        let t1 = t0 + FIRST_PROBE;
        assert_eq!(b.admit(t1), Admission::Probe);
        let late = t1 + ms(20);
        assert!(!b.on_failure(before, late), "not the probe's failure");
        assert_eq!(
            b.admit(late),
            Admission::Reject(t1 + 2 * FIRST_PROBE),
            "still waiting on the probe, no doubled wait"
        );
        assert!(b.on_success(late), "the probe answers: closed");
        assert!(!b.on_failure(before, late + ms(20)), "closed, and stays so");
        assert_eq!(b.admit(late + ms(20)), Admission::Call);
        // Calls let through since count as ever: the store fails again, soon after closing.
        let t2 = late + ms(30);
        assert!(b.on_failure(t2, t2));
        assert_eq!(b.next_probe(), Some(t2 + 2 * FIRST_PROBE));

        // The probe's own failure counts.
        let b = Breaker::new(1, Duration::from_secs(2), TIMEOUT);
        assert!(b.on_failure(before, t0));
        assert_eq!(b.admit(t1), Admission::Probe);
        assert!(b.on_failure(t1, late), "the probe's own failure");
        assert_eq!(b.next_probe(), Some(late + 2 * FIRST_PROBE));
    }

    #[test]
    fn a_lost_probe_is_replaced() {
        let b = Breaker::new(1, Duration::from_secs(1), TIMEOUT);
        let t0 = Instant::now();
        b.on_failure(t0, t0);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit(t1), Admission::Probe);
        // The probe's caller went away without reporting: another probe goes after the
        // wait a failed probe would have brought (twice the first), not a whole interval.
        let t2 = t1 + 2 * FIRST_PROBE;
        assert_eq!(
            b.admit(t2 - Duration::from_millis(1)),
            Admission::Reject(t2)
        );
        assert_eq!(b.admit(t2), Admission::Probe);
    }

    #[test]
    fn a_probe_is_not_replaced_while_it_may_still_be_answered() {
        // A timeout longer than twice the first wait (a fail-closed login policy's, say).
        let ms = Duration::from_millis;
        let b = Breaker::new(1, Duration::from_secs(2), ms(300));
        let t0 = Instant::now();
        assert!(b.on_failure(t0, t0));
        let t1 = t0 + FIRST_PROBE;
        assert_eq!(b.admit(t1), Admission::Probe);
        assert_eq!(
            b.admit(t1 + 2 * FIRST_PROBE),
            Admission::Reject(t1 + ms(300)),
            "the first probe may still be answered"
        );
        assert_eq!(b.admit(t1 + ms(300)), Admission::Probe, "now it is lost");
    }
}
