//! A store that stalls for a moment (a slow command, a fork, the host) costs the store's
//! answers for about that moment, not for a whole probe interval: the breaker that the
//! stall opened probes first after 50 ms, then backs off, and the connection is kept.

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(20);
/// Longer than the timeout: the checks in flight during it time out and open the breaker.
const PAUSE: Duration = Duration::from_millis(100);
/// Longer than the run after the pause: only the first, short probes can close the breaker
/// in time (a fixed probe would next go after the run), and the back-off stays bounded.
const PROBE_INTERVAL: Duration = Duration::from_secs(2);
const PAUSE_AT: Duration = Duration::from_millis(300);
const RUN: Duration = Duration::from_millis(1_500);
/// From the pause's end: the first probe (50 ms after the breaker opened, 100 ms after a
/// failed one), with room for a loaded machine.
const RECOVERED_BY: Duration = Duration::from_millis(400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_stall_costs_a_short_fallback() {
    for flavor in Flavor::selected() {
        let s = Server::start(flavor);
        let l = Limiter::builder(s.url())
            .timeout(TIMEOUT)
            .breaker_threshold(3)
            .probe_interval(PROBE_INTERVAL)
            .build()
            .unwrap();
        let p = Policy::builder("api")
            .per_second(100_000)
            .burst(100_000)
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(5)).await, "{flavor:?}");
        let mut admin = s.conn();
        let connections = s.client_ports(&mut admin);

        // (started at, source) of every check, and whether the breaker was ever seen open.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let opened = Arc::new(Mutex::new(false));
        let start = Instant::now();
        let tasks: Vec<_> = (0..4)
            .map(|i| {
                let (l, p, seen, opened) = (l.clone(), p.clone(), seen.clone(), opened.clone());
                tokio::spawn(async move {
                    let subject = format!("user{i}");
                    while start.elapsed() < RUN {
                        let at = start.elapsed();
                        let d = l.check_one(&p, &subject, 1).await.unwrap();
                        assert!(d.is_allowed(), "{d:?}");
                        seen.lock().unwrap().push((at, d.source));
                        if l.breaker_open() {
                            *opened.lock().unwrap() = true;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
            })
            .collect();
        tokio::time::sleep(PAUSE_AT).await;
        let paused_at = start.elapsed();
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(PAUSE.as_millis() as u64)
            .arg("WRITE")
            .query(&mut s.conn())
            .unwrap();
        // The stall is real: a write waits it out.
        let write = Instant::now();
        let _: () = redis::cmd("SET")
            .arg("probe")
            .arg(1)
            .query(&mut s.conn())
            .unwrap();
        let held = write.elapsed();
        for t in tasks {
            t.await.unwrap();
        }

        let seen = seen.lock().unwrap();
        let during = paused_at..paused_at + PAUSE;
        assert!(
            held >= PAUSE / 2,
            "{flavor:?}: a write waited only {held:?}"
        );
        // Checks sent during the pause timed out to the local bucket, and the breaker opened.
        assert!(
            seen.iter()
                .any(|(at, src)| during.contains(at) && *src == Source::LocalFallback),
            "{flavor:?}: no check fell back during the pause"
        );
        assert!(
            *opened.lock().unwrap(),
            "{flavor:?}: the breaker never opened"
        );
        // ...and it was short: soon after the pause, the store answers again (before, the
        // breaker waited a whole probe interval, here 2 s, before asking it).
        let after: Vec<Source> = seen
            .iter()
            .filter(|(at, _)| *at >= paused_at + PAUSE + RECOVERED_BY)
            .map(|(_, src)| *src)
            .collect();
        let store = after.iter().filter(|s| **s == Source::Store).count();
        assert!(
            after.len() >= 20 && store * 10 >= after.len() * 9,
            "{flavor:?}: {store} of {} checks after the stall answered by the store",
            after.len()
        );
        // ...through the same connection: a stall is not a lost flow, and every pod
        // reconnecting at every stall would load the server just as it recovers.
        assert_eq!(
            s.client_ports(&mut admin),
            connections,
            "{flavor:?}: the connection was replaced"
        );
    }
}
