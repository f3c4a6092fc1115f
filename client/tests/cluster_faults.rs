//! A cluster under faults: one primary silently unreachable (its client port blackholed,
//! the cluster bus untouched, so no failover hides it), a slot moved behind the limiter's
//! back, a slot being migrated, one check meeting a recovering node and a silent one, and
//! settlements over several nodes.

use redis_ratelimit_client::{slot, KeyLayout, Limiter, Policy, Source, Verdict};
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_millis(20);
/// Scheduling noise on a loaded 2-core machine; the failure this guards against (checks
/// waiting on the lost node's recovery) is seconds.
const MARGIN: Duration = Duration::from_millis(100);
const PROBE: Duration = Duration::from_millis(500);
/// Stated bound: the lost node's subjects are back at the store within this after the fault.
const RECOVERY: Duration = Duration::from_secs(3);

fn key_of(subject: &str, policy: &str) -> String {
    let layout = KeyLayout::default();
    layout.key(&layout.subject_tag(subject.as_bytes()), policy)
}

/// The node (index into `start_cluster`'s list) serving `slot`.
fn owner(slot: u16) -> usize {
    match slot {
        0..=5460 => 0,
        5461..=10922 => 1,
        _ => 2,
    }
}

/// A limiter whose breaker opens on one failure and probes 50 ms later, with `timeout`:
/// long enough for a node to answer its probe on a loaded machine, shorter than the
/// 100 ms after which an unreported probe is replaced.
async fn probing_limiter(nodes: &[Server], timeout: Duration, flavor: Flavor) -> Limiter {
    let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
        .timeout(timeout)
        .connect_timeout(Duration::from_millis(200))
        .breaker_threshold(1)
        .probe_interval(Duration::from_secs(2))
        .build()
        .unwrap();
    assert!(l.ready(Duration::from_secs(10)).await, "{flavor:?}");
    l
}

/// 1000 a second, burst 1000: `plain`, and `hot` in two sub-buckets.
fn plain_and_hot() -> (Policy, Policy) {
    let policy = |name: &str, shards: u32| {
        Policy::builder(name)
            .per_second(1000)
            .burst(1000)
            .shards(shards)
            .build()
            .unwrap()
    };
    (policy("plain", 1), policy("hot", 2))
}

/// A subject whose `plain` bucket is on node `plain_on` and both `hot` sub-buckets (of two)
/// on node `hot_on`.
fn subject_on(plain_on: usize, hot_on: usize) -> String {
    let layout = KeyLayout::default();
    (0..10_000)
        .map(|i| format!("s{i}"))
        .find(|s| {
            let tag = layout.subject_tag(s.as_bytes());
            owner(slot(layout.key(&tag, "plain").as_bytes())) == plain_on
                && (0..2)
                    .all(|i| owner(slot(layout.shard_key(&tag, "hot", i, 2).as_bytes())) == hot_on)
        })
        .unwrap()
}

/// Stalls `node` for twice `timeout` (no packet lost, so it answers at once after);
/// returns when the stall began.
fn pause(node: &Server, timeout: Duration) -> Instant {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2 * timeout.as_millis() as u64)
        .arg("ALL")
        .query(&mut node.conn())
        .unwrap();
    Instant::now()
}

/// Waits until `node`, paused at `paused`, is back (a PING answered: the server ends a
/// pause on its next cron tick, up to 100 ms late) and the probe of a breaker opened by
/// the stall is due (opened after one timeout, probed 50 ms later; an open breaker stays
/// due).
async fn until_probe_due(node: &Server, paused: Instant, timeout: Duration) {
    let _: String = redis::cmd("PING").query(&mut node.conn()).unwrap();
    tokio::time::sleep((3 * timeout).saturating_sub(paused.elapsed())).await;
}

/// The cluster node id of `node`.
fn node_id(node: &Server) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut node.conn())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_sends_only_its_own_subjects_to_the_fallback() {
    if !Blackhole::usable() {
        return;
    }
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
            .timeout(TIMEOUT)
            .connect_timeout(Duration::from_millis(200))
            .breaker_threshold(3)
            .probe_interval(PROBE)
            .pods(4)
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(10)).await, "{flavor:?}");
        let api = Policy::builder("api")
            .per_second(1000)
            .burst(1000)
            .build()
            .unwrap();
        let login = Policy::builder("login")
            .per_minute(5)
            .burst(5)
            .fail_closed()
            .build()
            .unwrap();
        let tight = Policy::builder("tight")
            .per_hour(1)
            .burst(8)
            .build()
            .unwrap();
        let subjects: Vec<String> = (0..300).map(|i| format!("s{i}")).collect();
        let lost = 2;
        let on_lost = |s: &str| owner(slot(key_of(s, "api").as_bytes())) == lost;
        let healthy: Vec<&String> = subjects.iter().filter(|s| !on_lost(s)).collect();
        let stranded: Vec<&String> = subjects.iter().filter(|s| on_lost(s)).collect();
        assert!(!healthy.is_empty() && !stranded.is_empty(), "{flavor:?}");

        let hole = Blackhole::ports(&[nodes[lost].port]);
        // The fault is real: the lost node does not answer a fresh connection.
        let probe = redis::Client::open(nodes[lost].url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_millis(300));
        assert!(probe.is_err(), "{flavor:?}: the node still answers");

        let started = Instant::now();
        let (mut healthy_store, mut healthy_total, mut slowest) = (0usize, 0usize, Duration::ZERO);
        let mut stranded_store = 0usize;
        while started.elapsed() < Duration::from_secs(4) {
            for s in &subjects {
                let t = Instant::now();
                let d = l.check_one(&api, s, 1).await.unwrap();
                slowest = slowest.max(t.elapsed());
                assert!(
                    d.is_allowed(),
                    "{flavor:?}: fail-open api refused {s}: {d:?}"
                );
                if on_lost(s) {
                    stranded_store += usize::from(d.source == Source::Store);
                } else {
                    healthy_total += 1;
                    healthy_store += usize::from(d.source == Source::Store);
                }
            }
        }
        assert!(
            slowest < TIMEOUT + MARGIN,
            "{flavor:?}: a check took {slowest:?}"
        );
        let share = healthy_store as f64 / healthy_total as f64;
        eprintln!(
            "{flavor:?}: healthy subjects {}/300, their checks answered by the store: \
             {:.2}% of {healthy_total}; slowest {slowest:?}",
            healthy.len(),
            100.0 * share
        );
        assert!(share > 0.99, "{flavor:?}: healthy store share {share}");
        assert_eq!(stranded_store, 0, "{flavor:?}: the lost node answered?");

        // On the lost node: fail-closed refuses, fail-open keeps limiting (4 pods: 2 of 8).
        let s = stranded[0];
        let d = l.check_one(&login, s, 1).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::FailClosed, false),
            "{flavor:?}"
        );
        let mut admitted = 0;
        for _ in 0..10 {
            let d = l.check_one(&tight, s, 1).await.unwrap();
            assert_eq!(d.source, Source::LocalFallback, "{flavor:?}");
            admitted += usize::from(d.is_allowed());
        }
        assert_eq!(admitted, 2, "{flavor:?}: the pod's share of 8 over 4 pods");
        // Healthy subjects still reach the store for every policy.
        let d = l.check_one(&login, healthy[0], 1).await.unwrap();
        assert_eq!(
            (d.source, d.is_allowed()),
            (Source::Store, true),
            "{flavor:?}"
        );

        drop(hole);
        let back = Instant::now();
        loop {
            let d = l.check_one(&api, stranded[0], 1).await.unwrap();
            if d.source == Source::Store {
                break;
            }
            assert!(back.elapsed() < RECOVERY, "{flavor:?}: no recovery");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "{flavor:?}: the lost node's subjects back at the store {:?} after the fault",
            back.elapsed()
        );
    }
}

/// A slot moved to another node after the limiter read the topology: the old owner's
/// `MOVED` is followed in the same check, and the next checks go to the new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_slot_is_followed_at_once() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
            .timeout(Duration::from_millis(500))
            // No periodic topology read during the test: the MOVED reply tells (and asks for
            // a read at once; the per-slot update itself is a unit test in cluster.rs).
            .probe_interval(Duration::from_secs(600))
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(10)).await, "{flavor:?}");
        let api = Policy::builder("api")
            .per_hour(10)
            .burst(10)
            .build()
            .unwrap();
        let key = key_of("mover", "api");
        let key_slot = slot(key.as_bytes());
        let from = owner(key_slot);
        let to = (from + 1) % 3;
        let to_id = node_id(&nodes[to]);
        for n in [to, from, (from + 2) % 3] {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(key_slot)
                .arg("NODE")
                .arg(&to_id)
                .query(&mut nodes[n].conn())
                .unwrap();
        }
        // The fault is real: the old owner now answers MOVED for the key. (Asked with
        // `RL.CHECKALL`, so that the client's `RL.CHECK`s are counted alone below.)
        let e = redis::cmd("RL.CHECKALL")
            .arg(&key)
            .arg(1)
            .arg(1)
            .arg(0)
            .query::<redis::Value>(&mut nodes[from].conn())
            .unwrap_err();
        assert_eq!(e.code(), Some("MOVED"), "{flavor:?}: {e}");

        for i in 0..3 {
            let d = l.check_one(&api, "mover", 1).await.unwrap();
            assert_eq!(
                (d.source, d.is_allowed()),
                (Source::Store, true),
                "{flavor:?} #{i}"
            );
            assert_eq!(
                d.remaining,
                9 - i,
                "{flavor:?}: one bucket, on the new owner"
            );
        }
        assert!(exists(&mut nodes[to].conn(), &key), "{flavor:?}");
        // Followed once, then routed there directly: the old owner turned one call away.
        assert_eq!(
            (
                command_calls(&mut nodes[from].conn(), "rl.check"),
                rejected_calls(&nodes[from], "rl.check")
            ),
            (0, 1),
            "{flavor:?}"
        );
    }
}

/// A check over a plain policy and a sharded one, whose sub-buckets live on another node:
/// the subject's node answering its probe closes its breaker even when the sub-bucket's
/// node then fails the same check (before, only the node asked last recorded anything, and
/// the subject's node stayed half-open, its checks in the fallback, until the probe was
/// given up on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_answered_counts_though_a_sub_bucket_node_fails_the_check() {
    if !Blackhole::usable() {
        return;
    }
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        // Longer than the other tests' timeout; the next check must find node 0's breaker
        // as this check left it.
        let timeout = Duration::from_millis(60);
        let l = probing_limiter(&nodes, timeout, flavor).await;
        let (plain, hot) = plain_and_hot();
        let subject = subject_on(0, 2);
        let both = [(&plain, 1), (&hot, 1)];
        let d = l.check(&subject, &both).await.unwrap();
        assert_eq!(
            d.source,
            Source::Store,
            "{flavor:?}: connected to both nodes"
        );

        // Node 0 stalls past the timeout: its breaker opens.
        let paused = pause(&nodes[0], timeout);
        let d = l.check_one(&plain, &subject, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: the stall");
        let d = l.check_one(&plain, &subject, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: breaker open");
        // Node 2 goes silent; node 0 is back and its first probe due.
        let hole = Blackhole::ports(&[nodes[2].port]);
        until_probe_due(&nodes[0], paused, timeout).await;
        let asked = command_calls(&mut nodes[0].conn(), "rl.check");

        // The probe goes to node 0, which answers; the sub-bucket's call to node 2 times out.
        let d = l.check(&subject, &both).await.unwrap();
        assert_eq!(
            command_calls(&mut nodes[0].conn(), "rl.check"),
            asked + 1,
            "{flavor:?}: the check's probe reached node 0"
        );
        assert_eq!(
            d.source,
            Source::LocalFallback,
            "{flavor:?}: node 2 really is silent"
        );
        let d = l.check_one(&plain, &subject, 1).await.unwrap();
        assert_eq!(
            d.source,
            Source::Store,
            "{flavor:?}: node 0 answered its probe, so its breaker is closed"
        );
        drop(hole);
    }
}

/// A settlement over a sharded policy whose sub-buckets live on a silent node and a plain
/// one: the plain bucket is settled on its node, which is not blamed, and only the
/// sub-buckets' share goes to the local bucket (before, the whole settlement fell back,
/// charging the plain policy's local bucket too, and the subject's node took the blame for
/// the silent one's timeout). The silent node's buckets come first: the nodes are asked
/// at once, not one after another under one timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_falls_back_only_for_the_silent_nodes_buckets() {
    if !Blackhole::usable() {
        return;
    }
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        // Long enough for node 0 to answer on a loaded machine.
        let timeout = Duration::from_millis(60);
        let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
            .timeout(timeout)
            .connect_timeout(Duration::from_millis(200))
            .breaker_threshold(1)
            .probe_interval(Duration::from_secs(10))
            .pods(2)
            .build()
            .unwrap();
        assert!(l.ready(Duration::from_secs(10)).await, "{flavor:?}");
        // 10 tokens a second: refill is a token or two over the test's steps.
        let plain = Policy::builder("plain")
            .per_minute(600)
            .burst(600)
            .build()
            .unwrap();
        let hot = Policy::builder("hot")
            .per_minute(600)
            .burst(600)
            .shards(2)
            .build()
            .unwrap();
        let layout = KeyLayout::default();
        let subject = subject_on(0, 2);
        let tag = layout.subject_tag(subject.as_bytes());
        let r = l
            .reserve(&subject, &[(&hot, 1), (&plain, 1)])
            .await
            .unwrap();
        assert_eq!(r.decision().source, Source::Store, "{flavor:?}");

        let hole = Blackhole::ports(&[nodes[2].port]);
        let fresh = redis::Client::open(nodes[2].url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_millis(300));
        assert!(fresh.is_err(), "{flavor:?}: node 2 still answers");
        let settled_on_0 = command_calls(&mut nodes[0].conn(), "rl.settle");

        let started = Instant::now();
        let after = r.settle_each(&[101, 101]).await.unwrap();
        let took = started.elapsed();
        assert_eq!(
            after.source,
            Source::LocalFallback,
            "{flavor:?}: the sub-buckets' node is silent"
        );
        assert!(l.breaker_open(), "{flavor:?}: node 2 blamed");
        assert!(took < timeout + MARGIN, "{flavor:?}: took {took:?}");
        assert_eq!(
            command_calls(&mut nodes[0].conn(), "rl.settle"),
            settled_on_0 + 1,
            "{flavor:?}: the plain bucket is settled on node 0"
        );
        // Its outcome is the store's (600 - 101 and some refill), not a local bucket's (300
        // a pod, 200 after the charge of 100).
        let peek: Vec<i64> = redis::cmd("RL.CHECK")
            .arg(layout.key(&tag, "plain"))
            .arg(10)
            .arg(600)
            .arg(0)
            .query(&mut nodes[0].conn())
            .unwrap();
        let outcome = |p: &Policy| {
            after
                .outcomes
                .iter()
                .find(|o| o.policy.name() == p.name())
                .map(|o| o.remaining)
                .unwrap()
        };
        let stored = u64::try_from(peek[1]).unwrap();
        assert!(
            (499..=stored).contains(&outcome(&plain)) && stored < 550,
            "{flavor:?}: plain {} against the store's {stored}",
            outcome(&plain)
        );
        assert!(
            outcome(&hot) <= 200,
            "{flavor:?}: hot {} from its local bucket, charged 100",
            outcome(&hot)
        );
        // The silent node took the blame: node 0's breaker (threshold 1) is closed.
        let d = l.check_one(&plain, &subject, 1).await.unwrap();
        assert_eq!(d.source, Source::Store, "{flavor:?}: node 0 not blamed");
        let d = l.check_one(&hot, &subject, 1).await.unwrap();
        assert_eq!(
            d.source,
            Source::LocalFallback,
            "{flavor:?}: node 2's breaker"
        );
        // 200 after the charge, and 5 a second of refill: far below a fresh 300.
        assert!(d.remaining < 290, "{flavor:?}: the local debt holds");
        drop(hole);
    }
}

/// A settlement whose buckets are in several slots of one node takes that node's probe
/// once, for all of them: all are settled on the store and the breaker closes (asked slot
/// by slot, the first would take the probe and the others be refused, settled locally).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_takes_one_probe_for_all_its_buckets_on_a_node() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let timeout = Duration::from_millis(60);
        let l = probing_limiter(&nodes, timeout, flavor).await;
        let (plain, hot) = plain_and_hot();
        // Its plain bucket and both sub-buckets on node 0, in three slots.
        let subject = subject_on(0, 0);
        let r = l
            .reserve(&subject, &[(&plain, 1), (&hot, 1)])
            .await
            .unwrap();
        assert_eq!(r.decision().source, Source::Store, "{flavor:?}");

        // Node 0 stalls past the timeout: its breaker opens.
        let paused = pause(&nodes[0], timeout);
        let d = l.check_one(&plain, &subject, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: the stall");
        assert!(l.breaker_open(), "{flavor:?}");
        until_probe_due(&nodes[0], paused, timeout).await;
        let settled = command_calls(&mut nodes[0].conn(), "rl.settle");

        let after = r.settle(2).await.unwrap();
        assert_eq!(
            command_calls(&mut nodes[0].conn(), "rl.settle"),
            settled + 2,
            "{flavor:?}: both policies settled on node 0"
        );
        assert_eq!(after.source, Source::Store, "{flavor:?}: nothing local");
        assert!(!l.breaker_open(), "{flavor:?}: the probe answered");
    }
}

/// A slot being migrated away (`ASK` for a key the old owner does not hold) is answered by
/// the fail mode, is not counted against the node's breaker, and answers the node's probe:
/// the node's other slots go back to the store at once (before, the probe was left
/// unreported and the node's checks stayed in the fallback until it was given up on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_in_migration_is_answered_by_the_fail_mode_and_answers_a_probe() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let timeout = Duration::from_millis(60);
        let l = probing_limiter(&nodes, timeout, flavor).await;
        let (api, _) = plain_and_hot();
        // Two subjects on node 0, in different slots: one whose slot migrates, one whose
        // slot stays.
        let mut on_node0 = (0..10_000)
            .map(|i| format!("s{i}"))
            .filter(|s| owner(slot(key_of(s, "plain").as_bytes())) == 0);
        let migrating = on_node0.next().unwrap();
        let key_slot = slot(key_of(&migrating, "plain").as_bytes());
        let staying = on_node0
            .find(|s| slot(key_of(s, "plain").as_bytes()) != key_slot)
            .unwrap();
        let (from_id, to_id) = (node_id(&nodes[0]), node_id(&nodes[1]));
        let setslot = |n: usize, state: &str, other: &str| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(key_slot)
                .arg(state)
                .arg(other)
                .query(&mut nodes[n].conn())
                .unwrap();
        };
        setslot(1, "IMPORTING", &from_id);
        setslot(0, "MIGRATING", &to_id);
        // The fault is real: node 0 answers ASK for the key it does not hold.
        let e = redis::cmd("RL.CHECK")
            .arg(key_of(&migrating, "plain"))
            .arg(1)
            .arg(1)
            .arg(0)
            .query::<redis::Value>(&mut nodes[0].conn())
            .unwrap_err();
        assert_eq!(e.code(), Some("ASK"), "{flavor:?}: {e}");

        let d = l.check_one(&api, &migrating, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: ASK");
        assert!(!l.breaker_open(), "{flavor:?}: ASK is not a failure");

        // Node 0 stalls past the timeout: its breaker opens.
        let paused = pause(&nodes[0], timeout);
        let d = l.check_one(&api, &staying, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: the stall");
        assert!(l.breaker_open(), "{flavor:?}");
        until_probe_due(&nodes[0], paused, timeout).await;

        // The probe meets the migration: answered by the fail mode, and it closes the
        // breaker, so the slot that stays is asked at once.
        let calls = command_calls(&mut nodes[0].conn(), "rl.check");
        let rejected = rejected_calls(&nodes[0], "rl.check");
        let d = l.check_one(&api, &migrating, 1).await.unwrap();
        assert_eq!(d.source, Source::LocalFallback, "{flavor:?}: ASK again");
        assert_eq!(
            rejected_calls(&nodes[0], "rl.check"),
            rejected + 1,
            "{flavor:?}: node 0 answered the probe with ASK"
        );
        assert!(!l.breaker_open(), "{flavor:?}: the probe answered");
        let d = l.check_one(&api, &staying, 1).await.unwrap();
        assert_eq!(d.source, Source::Store, "{flavor:?}: node 0 asked at once");
        assert_eq!(
            command_calls(&mut nodes[0].conn(), "rl.check"),
            calls + 1,
            "{flavor:?}"
        );
    }
}

/// A check whose first policy is sharded sends the subject's other buckets to the subject's
/// own node, not to the node of the sub-bucket drawn (which would turn every such check
/// away with a `MOVED`, an extra round trip and a topology read each time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_led_by_a_sharded_policy_asks_the_subjects_node() {
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
        .timeout(Duration::from_millis(500))
        .probe_interval(Duration::from_secs(600))
        .build()
        .unwrap();
    assert!(l.ready(Duration::from_secs(10)).await);
    let (plain, hot) = plain_and_hot();
    let subject = subject_on(0, 2);
    for i in 0..20 {
        let d = l.check(&subject, &[(&hot, 1), (&plain, 1)]).await.unwrap();
        assert_eq!((d.source, d.is_allowed()), (Source::Store, true), "#{i}");
    }
    let calls = |n: usize| command_calls(&mut nodes[n].conn(), "rl.check");
    // Each check: `plain` on node 0, one `hot` sub-bucket on node 2, nothing turned away.
    assert_eq!(
        (calls(0), calls(2), rejected_calls(&nodes[2], "rl.check")),
        (20, 20, 0)
    );
}

/// The subject's own bucket refuses; the sharded policy's node is stalled. The store's
/// refusal stands: the sub-bucket is not asked (it would only have been peeked at), so its
/// node's stall cannot turn the refusal into a local admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_stands_while_a_sub_buckets_node_stalls() {
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    let timeout = Duration::from_millis(100);
    let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
        .timeout(timeout)
        .probe_interval(Duration::from_secs(600))
        .build()
        .unwrap();
    assert!(l.ready(Duration::from_secs(10)).await);
    let (_, hot) = plain_and_hot();
    let plain = Policy::builder("plain")
        .per_hour(1)
        .burst(1)
        .build()
        .unwrap();
    let subject = subject_on(0, 2);
    assert!(l.check_one(&plain, &subject, 1).await.unwrap().is_allowed());
    let mut probe = nodes[2].conn();
    probe
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let paused = pause(&nodes[2], Duration::from_secs(1));
    let d = l.check(&subject, &[(&plain, 1), (&hot, 1)]).await.unwrap();
    // The fault is real: node 2 was still paused when the check returned.
    let still: Result<String, _> = redis::cmd("PING").query(&mut probe);
    assert!(
        still.is_err(),
        "node 2 answered {:?} after the pause",
        paused.elapsed()
    );
    assert_eq!((d.source, d.is_allowed()), (Source::Store, false), "{d:?}");
    assert_eq!(d.policy.name(), "plain");
}

/// A cost above a sub-bucket's burst can never pass: the subject's other buckets are not
/// charged for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_over_a_sub_buckets_burst_charges_nothing() {
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    let l = Limiter::cluster_builder(nodes.iter().map(Server::url))
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    assert!(l.ready(Duration::from_secs(10)).await);
    let plain = Policy::builder("plain")
        .per_hour(10)
        .burst(10)
        .build()
        .unwrap();
    let (_, hot) = plain_and_hot(); // two sub-buckets of 500
    let subject = subject_on(0, 2);
    let d = l
        .check(&subject, &[(&plain, 1), (&hot, 501)])
        .await
        .unwrap();
    assert_eq!(d.verdict, Verdict::ExceedsBurst, "{d:?}");
    let d = l.check_one(&plain, &subject, 0).await.unwrap();
    assert_eq!(d.remaining, 10, "plain was charged");
}

/// `rejected_calls=` of a command in `INFO commandstats` (redirections count there).
fn rejected_calls(node: &Server, command: &str) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut node.conn())
        .unwrap();
    let prefix = format!("cmdstat_{command}:");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
