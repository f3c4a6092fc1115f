//! Replicas and persistence end up with the primary's bucket, byte for byte: the module
//! replicates `SET key value PXAT expiry`, never the clock-reading command.

use redis::Connection;
use redis_ratelimit_testkit::*;
use std::time::Duration;

/// One token per hour: buckets stay put while a test runs.
const SLOW: &str = "0.0002777777777777778";

type Snapshot = Vec<(String, Option<Vec<u8>>, i64)>;

fn snapshot(c: &mut Connection, keys: &[String]) -> Snapshot {
    keys.iter()
        .map(|k| {
            let dump: Option<Vec<u8>> = redis::cmd("DUMP").arg(k).query(c).unwrap();
            (k.clone(), dump, pexpiretime(c, k))
        })
        .collect()
}

/// A mix of writes: fresh keys, repeated takes, weighted costs, RL.CHECKALL, refusals, peeks,
/// and RL.SETTLE charges (into debt), refunds and peeks.
fn workload(c: &mut Connection) -> Vec<String> {
    let keys: Vec<String> = (0..20).map(|i| format!("{{t}}:k{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        for _ in 0..(i % 4 + 1) {
            rl_check(c, k, SLOW, 5, 1 + (i as i64 % 2));
        }
        rl_check(c, k, SLOW, 5, 0);
    }
    let _: Vec<Reply> = redis::cmd("RL.CHECKALL")
        .arg(&keys[0])
        .arg(SLOW)
        .arg(9)
        .arg(1)
        .arg(&keys[1])
        .arg("7.5")
        .arg(3)
        .arg(1)
        .query(c)
        .unwrap();
    for (i, k) in keys.iter().enumerate().skip(10) {
        let delta = [7, -2, 0, 40, -100][i % 5];
        let _: Reply = redis::cmd("RL.SETTLE")
            .arg(k)
            .arg(SLOW)
            .arg(5)
            .arg(delta)
            .query(c)
            .unwrap();
    }
    keys
}

fn offset(c: &mut Connection) -> i64 {
    let info: String = redis::cmd("INFO").arg("replication").query(c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("master_repl_offset:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("master_repl_offset")
}

fn wait_link_up(replica: &mut Connection) {
    assert!(
        eventually(Duration::from_secs(10), || {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(replica)
                .unwrap();
            info.contains("master_link_status:up")
        }),
        "replica link not up"
    );
}

#[test]
fn replicas_with_and_without_the_module_hold_identical_buckets() {
    for set in replica_sets() {
        let flavor = &set.name;
        let (mut p, mut r1, mut r2) = (
            set.primary.conn(),
            set.with_module.conn(),
            set.without_module.conn(),
        );
        wait_link_up(&mut r1);
        wait_link_up(&mut r2);

        let keys = workload(&mut p);
        let acked: i64 = redis::cmd("WAIT").arg(2).arg(5000).query(&mut p).unwrap();
        assert_eq!(acked, 2, "{flavor:?}: replicas did not acknowledge");
        let want = snapshot(&mut p, &keys);
        assert!(
            want.iter().all(|(_, d, e)| d.is_some() && *e > 0),
            "{flavor:?}"
        );
        assert_eq!(
            snapshot(&mut r1, &keys),
            want,
            "{flavor:?}: replica with module"
        );
        assert_eq!(
            snapshot(&mut r2, &keys),
            want,
            "{flavor:?}: replica without module"
        );

        // Refusals and peeks write nothing, so they replicate nothing.
        let before = offset(&mut p);
        for k in &keys {
            rl_check(&mut p, k, SLOW, 5, 0);
            rl_check(&mut p, k, SLOW, 5, 6);
        }
        assert_eq!(
            offset(&mut p),
            before,
            "{flavor:?}: refusals reached the stream"
        );
    }
}

#[test]
fn aof_replay_restores_identical_buckets_even_without_the_module() {
    for flavor in Flavor::selected() {
        let aof = ["--appendonly", "yes", "--appendfsync", "always"];
        let server = Server::start_with(flavor, true, &aof);
        let mut c = server.conn();
        let keys = workload(&mut c);
        let want = snapshot(&mut c, &keys);
        drop(c);
        let dir = server.stop();

        let aof_text: String = std::fs::read_dir(dir.join("appendonlydir"))
            .expect("appendonlydir")
            .flatten()
            .map(|f| String::from_utf8_lossy(&std::fs::read(f.path()).unwrap()).into_owned())
            .collect();
        assert!(
            aof_text.contains("PXAT"),
            "{flavor:?}: no SET ... PXAT in the AOF"
        );
        assert!(
            !aof_text.to_lowercase().contains("rl.check"),
            "{flavor:?}: the AOF holds the clock-reading command"
        );

        for with_module in [true, false] {
            let again = Server::start_in(flavor, with_module, &aof, dir.clone());
            let mut c = again.conn();
            assert_eq!(
                snapshot(&mut c, &keys),
                want,
                "{flavor:?}: after AOF replay (module loaded: {with_module})"
            );
            if with_module {
                // And the replayed buckets are still buckets.
                assert_eq!(rl_check(&mut c, &keys[3], SLOW, 5, 0).0, 1);
            }
            drop(c);
            again.stop();
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn rdb_reload_restores_identical_buckets() {
    for flavor in Flavor::selected() {
        let server = Server::start_with(flavor, true, &["--enable-debug-command", "yes"]);
        let mut c = server.conn();
        let keys = workload(&mut c);
        let want = snapshot(&mut c, &keys);
        let _: () = redis::cmd("DEBUG").arg("RELOAD").query(&mut c).unwrap();
        assert_eq!(
            snapshot(&mut c, &keys),
            want,
            "{flavor:?}: after DEBUG RELOAD"
        );
        assert_eq!(rl_check(&mut c, &keys[2], SLOW, 5, 0).0, 1);
    }
}

/// A replica set to load the primary's snapshot straight into memory
/// (`repl-diskless-load swapdb`) still does with the module loaded: the module declares it
/// handles asynchronous loading, which the server otherwise requires of every module before
/// it will (it wrote the snapshot to disk first), and the buckets arrive the same.
#[test]
fn a_replica_loads_the_snapshot_disklessly_with_the_module() {
    for flavor in Flavor::selected() {
        let primary = Server::start_with(
            flavor,
            true,
            &[
                "--repl-diskless-sync",
                "yes",
                "--repl-diskless-sync-delay",
                "0",
            ],
        );
        let mut p = primary.conn();
        let keys = workload(&mut p);
        let want = snapshot(&mut p, &keys);
        let port = primary.port.to_string();
        let replica = Server::start_with(
            flavor,
            true,
            &[
                "--replicaof",
                "127.0.0.1",
                &port,
                "--repl-diskless-load",
                "swapdb",
            ],
        );
        let mut r = replica.conn();
        wait_link_up(&mut r);
        let log = replica.log();
        assert!(!log.contains("not aware of async"), "{flavor:?}: {log}");
        assert!(
            log.contains("EOF to parser"),
            "{flavor:?}: not diskless: {log}"
        );
        assert_eq!(snapshot(&mut r, &keys), want, "{flavor:?}");
    }
}
