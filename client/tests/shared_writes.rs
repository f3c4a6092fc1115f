//! Checks that are in flight together on one limiter share its connection's writes: redis-rs'
//! multiplexer sends whatever requests queued up while it was busy in one write. Counted as
//! this process's write system calls (`syscw` in `/proc/self/io`: `write` and `writev`), on a
//! real server. Its own test binary, so no other test's output counts.

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::{targets, Target};
use std::time::Duration;

/// Write system calls this process has made so far.
fn writes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("syscw: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("syscw in /proc/self/io")
}

const N: usize = 64;

#[test]
fn concurrent_checks_share_writes() {
    if !std::path::Path::new("/proc/self/io").exists() {
        eprintln!("no /proc/self/io: nothing to count with");
        return;
    }
    for t in targets("shared_writes") {
        run(&t);
    }
}

fn run(t: &Target) {
    // One thread: the checks below all queue their requests before the connection's driver
    // task runs, as checks arriving together on a busy pod would.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let policy = Policy::builder("writes")
        .per_minute(100)
        .burst(20)
        .build()
        .expect("policy");
    let subjects: Vec<String> = (0..2 * N).map(|i| t.key(&format!("w{i}"))).collect();
    rt.block_on(async {
        let l = Limiter::builder(t.url.clone())
            .timeout(Duration::from_secs(2))
            .build()
            .expect("limiter");
        assert!(l.ready(Duration::from_secs(5)).await, "{}", t.name);
        // One after another: each its own write. This also proves the counter sees the
        // client's writes at all.
        let before = writes();
        for s in &subjects[..N] {
            let d = l.check_one(&policy, s, 1).await.expect("check");
            assert_eq!(d.source, Source::Store, "{}", t.name);
        }
        let one_by_one = writes() - before;
        assert!(
            one_by_one >= N as u64,
            "{}: {N} checks in turn made {one_by_one} writes",
            t.name
        );
        // All at once.
        let before = writes();
        let tasks: Vec<_> = subjects[N..]
            .iter()
            .map(|s| {
                let (l, policy, s) = (l.clone(), policy.clone(), s.clone());
                tokio::spawn(async move { l.check_one(&policy, &s, 1).await })
            })
            .collect();
        for task in tasks {
            let d = task.await.expect("task").expect("check");
            assert_eq!(d.source, Source::Store, "{}", t.name);
        }
        let together = writes() - before;
        eprintln!(
            "{}: {N} checks: {one_by_one} writes in turn, {together} together",
            t.name
        );
        assert!(
            together <= N as u64 / 8,
            "{}: {N} concurrent checks made {together} writes",
            t.name
        );
    });
}
