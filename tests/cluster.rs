//! A cluster of 3 primaries on loopback: both commands are routed by their declared key
//! positions, a cross-slot `RL.CHECKALL` is refused by the server, and a bucket moves with its
//! slot in an atomic slot migration.

use redis::cluster::ClusterClient;
use redis::{Connection, Value};
use redis_ratelimit_testkit::*;
use std::time::Duration;

fn dbsize(c: &mut Connection) -> i64 {
    redis::cmd("DBSIZE").query(c).unwrap()
}

#[test]
fn cluster_routes_both_commands_and_refuses_cross_slot() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let urls: Vec<String> = nodes.iter().map(Server::url).collect();
        let client = ClusterClient::new(urls).unwrap();
        let mut cc = client.get_connection().unwrap();

        for i in 0..60 {
            let r: Reply = redis::cmd("RL.CHECK")
                .arg(format!("user:{i}"))
                .arg(1)
                .arg(3)
                .query(&mut cc)
                .unwrap();
            assert_eq!((r.0, r.1), (1, 2), "{flavor:?}: user:{i}");
            let all: Vec<Reply> = redis::cmd("RL.CHECKALL")
                .arg(format!("{{t{i}}}:key"))
                .arg(1)
                .arg(3)
                .arg(1)
                .arg(format!("{{t{i}}}:route"))
                .arg(1)
                .arg(3)
                .arg(2)
                .query(&mut cc)
                .unwrap();
            assert_eq!(all.len(), 2, "{flavor:?}");
            assert!(all.iter().all(|r| r.0 == 1), "{flavor:?}: {all:?}");
        }
        for node in &nodes {
            let n = dbsize(&mut node.conn());
            assert!(n > 0, "{flavor:?}: node {} got no keys", node.port);
        }
        assert_eq!(
            nodes.iter().map(|n| dbsize(&mut n.conn())).sum::<i64>(),
            180
        );

        // The server knows where the keys are...
        let keys: Vec<String> = redis::cmd("COMMAND")
            .arg(&[
                "GETKEYS",
                "RL.CHECKALL",
                "a",
                "1",
                "1",
                "1",
                "b",
                "1",
                "1",
                "1",
            ])
            .query(&mut nodes[0].conn())
            .unwrap();
        assert_eq!(keys, ["a", "b"], "{flavor:?}");
        // ...so it refuses one RL.CHECKALL across slots, on whichever node gets it.
        for node in &nodes {
            let err = expect_err(
                &mut node.conn(),
                &["RL.CHECKALL", "a", "1", "1", "1", "b", "1", "1", "1"],
            );
            assert!(err.contains("CrossSlot"), "{flavor:?}: {err}");
        }
    }
}

/// One per hour: nothing refills while a test runs.
const PER_HOUR_1: &str = "0.0002777777777777778";

/// Atomic slot migration (`CLUSTER MIGRATESLOTS`, Valkey 9): the server refuses it while any
/// loaded module has not declared it can handle it. The module keeps nothing per slot, so it
/// declares it, and a bucket moves with its slot: the target carries on where the source
/// left off. Servers without the command print that they skipped it.
#[test]
fn atomic_slot_migration_moves_buckets_with_their_slot() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let version = nodes[0].version();
        let info: Vec<Value> = redis::cmd("COMMAND")
            .arg("INFO")
            .arg("CLUSTER|MIGRATESLOTS")
            .query(&mut nodes[0].conn())
            .unwrap();
        if info.first().is_none_or(|v| *v == Value::Nil) {
            eprintln!("{flavor:?} {version:?}: no CLUSTER MIGRATESLOTS, skipped");
            continue;
        }
        let key = "user:asm";
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut nodes[0].conn())
            .unwrap();
        // start_cluster's split: 0-5460, 5461-10922, 10923-16383.
        let owner = match slot {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        };
        let (source, target) = (&nodes[owner], &nodes[(owner + 1) % 3]);
        let mut src = source.conn();
        let first = rl_check(&mut src, key, PER_HOUR_1, 3, 1);
        assert_eq!((first.0, first.1), (1, 2), "{flavor:?} {version:?}");
        let target_id: String = redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut target.conn())
            .unwrap();
        let started: redis::RedisResult<Value> = redis::cmd("CLUSTER")
            .arg("MIGRATESLOTS")
            .arg("SLOTSRANGE")
            .arg(slot)
            .arg(slot)
            .arg("NODE")
            .arg(&target_id)
            .query(&mut src);
        assert!(started.is_ok(), "{flavor:?} {version:?}: {started:?}");

        // Once the target owns the slot it answers instead of redirecting: from the same
        // bucket, one token already taken.
        let mut dst = target.conn();
        let mut reply = None;
        let moved = eventually(Duration::from_secs(20), || {
            let r: redis::RedisResult<Reply> = redis::cmd("RL.CHECK")
                .arg(key)
                .arg(PER_HOUR_1)
                .arg(3)
                .arg(1)
                .query(&mut dst);
            reply = r.ok();
            reply.is_some()
        });
        assert!(moved, "{flavor:?} {version:?}: slot {slot} never moved");
        let (allowed, remaining, _, _) = reply.unwrap();
        assert_eq!((allowed, remaining), (1, 1), "{flavor:?} {version:?}");
        assert_eq!(rl_check(&mut dst, key, PER_HOUR_1, 3, 1).1, 0);
        assert_eq!(rl_check(&mut dst, key, PER_HOUR_1, 3, 1).0, 0);
        eprintln!("{flavor:?} {version:?}: slot {slot} migrated with its bucket");
    }
}
