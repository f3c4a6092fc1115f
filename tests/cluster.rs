//! A cluster of 3 primaries on loopback: both commands are routed by their declared key
//! positions, a cross-slot `RL.CHECKALL` is refused by the server, and a bucket moves with its
//! slot in an atomic slot migration.

use redis::cluster::ClusterClient;
use redis::{Connection, ErrorKind, ServerErrorKind, Value};
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

/// How a server migrates a slot atomically, if it can.
#[derive(Debug, Clone, Copy)]
enum Migration {
    /// Valkey 9: `CLUSTER MIGRATESLOTS SLOTSRANGE s s NODE <target>`, sent to the source.
    MigrateSlots,
    /// Redis 8.4: `CLUSTER MIGRATION IMPORT s s`, sent to the target.
    MigrationImport,
}

impl Migration {
    /// The way this server has, by the commands it knows.
    fn of(c: &mut Connection) -> Option<Migration> {
        let known = |c: &mut Connection, name: &str| {
            let info: Vec<Value> = redis::cmd("COMMAND")
                .arg("INFO")
                .arg(name)
                .query(c)
                .unwrap();
            info.first().is_some_and(|v| *v != Value::Nil)
        };
        if known(c, "CLUSTER|MIGRATESLOTS") {
            Some(Migration::MigrateSlots)
        } else if known(c, "CLUSTER|MIGRATION") {
            Some(Migration::MigrationImport)
        } else {
            None
        }
    }

    /// Starts moving `slot` from `source` to `target`; returns at once.
    fn start(self, slot: i64, source: &Server, target: &Server) -> redis::RedisResult<Value> {
        match self {
            Migration::MigrateSlots => {
                let target_id: String = redis::cmd("CLUSTER")
                    .arg("MYID")
                    .query(&mut target.conn())?;
                redis::cmd("CLUSTER")
                    .arg("MIGRATESLOTS")
                    .arg("SLOTSRANGE")
                    .arg(slot)
                    .arg(slot)
                    .arg("NODE")
                    .arg(target_id)
                    .query(&mut source.conn())
            }
            Migration::MigrationImport => redis::cmd("CLUSTER")
                .arg("MIGRATION")
                .arg("IMPORT")
                .arg(slot)
                .arg(slot)
                .query(&mut target.conn()),
        }
    }

    /// What the server says of its migrations, for a failure's message.
    fn status(self, node: &Server) -> String {
        let asked = match self {
            Migration::MigrateSlots => redis::cmd("CLUSTER")
                .arg("GETSLOTMIGRATIONS")
                .query::<Value>(&mut node.conn()),
            Migration::MigrationImport => redis::cmd("CLUSTER")
                .arg("MIGRATION")
                .arg("STATUS")
                .arg("ALL")
                .query::<Value>(&mut node.conn()),
        };
        format!("{asked:?}")
    }
}

/// A bucket with room for every check of the test and one token back every 1 000 s (the
/// loop below gives up after 30 s): `remaining` counts the checks exactly. (Its refill
/// time, 10^15 ticks, is the longest a limit may have.)
const WIDE_BURST: i64 = 100_000;
const WIDE_RATE: &str = "0.001";

/// Other keys in the bucket's slot, so that the migration takes long enough for checks to
/// be answered by the source while it runs.
const FILLERS: usize = 100_000;

/// Atomic slot migration (Valkey 9's `CLUSTER MIGRATESLOTS`, Redis 8.4's `CLUSTER MIGRATION
/// IMPORT`): a bucket moves with its slot and carries every check made before and while the
/// slot moved, and the target goes on from there. Valkey refuses the migration while a
/// loaded module has not declared it can handle it (the module keeps nothing per slot, so it
/// declares it); Redis asks nothing of modules. Servers without either print that they
/// skipped it.
#[test]
fn atomic_slot_migration_moves_buckets_with_their_slot() {
    for flavor in Flavor::selected() {
        let nodes = start_cluster(flavor);
        let version = nodes[0].version();
        let Some(migration) = Migration::of(&mut nodes[0].conn()) else {
            eprintln!("{flavor:?} {version:?}: no atomic slot migration, skipped");
            continue;
        };
        let key = "{asm}:bucket";
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
        let mut fill = redis::pipe();
        for i in 0..FILLERS {
            fill.set(format!("{{asm}}:filler:{i}"), i).ignore();
        }
        let () = fill.query(&mut src).unwrap();
        let first = rl_check(&mut src, key, WIDE_RATE, WIDE_BURST, 1);
        assert_eq!(first.1, WIDE_BURST - 1, "{flavor:?} {version:?}");
        let mut taken = 1;

        let started = migration.start(slot, source, target);
        assert!(started.is_ok(), "{flavor:?} {version:?}: {started:?}");
        // The source answers until it hands the slot over, then redirects.
        let mut while_moving = 0;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r: redis::RedisResult<Reply> = redis::cmd("RL.CHECK")
                .arg(key)
                .arg(WIDE_RATE)
                .arg(WIDE_BURST)
                .arg(1)
                .query(&mut src);
            match r {
                Ok(r) => {
                    taken += 1;
                    while_moving += 1;
                    assert_eq!(
                        (r.0, r.1),
                        (1, WIDE_BURST - taken),
                        "{flavor:?} {version:?}: check {taken} on the source"
                    );
                }
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::Moved) => break,
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::TryAgain) => {}
                Err(e) => panic!("{flavor:?} {version:?}: the source answered {e}"),
            }
            if std::time::Instant::now() >= deadline {
                panic!(
                    "{flavor:?} {version:?}: slot {slot} never moved; the source's \
                     migrations: {}",
                    migration.status(source)
                );
            }
        }
        // Checks were answered while the slot moved: the migration took them along.
        assert!(while_moving > 0, "{flavor:?} {version:?}: {migration:?}");

        let mut dst = target.conn();
        let next = rl_check(&mut dst, key, WIDE_RATE, WIDE_BURST, 1);
        taken += 1;
        assert_eq!(
            (next.0, next.1),
            (1, WIDE_BURST - taken),
            "{flavor:?} {version:?}: the target after {while_moving} checks while moving"
        );
        let fillers: i64 = redis::cmd("CLUSTER")
            .arg("COUNTKEYSINSLOT")
            .arg(slot)
            .query(&mut dst)
            .unwrap();
        assert_eq!(fillers, FILLERS as i64 + 1, "{flavor:?} {version:?}");
        eprintln!(
            "{flavor:?} {version:?}: slot {slot} moved ({migration:?}) with its bucket, \
             {while_moving} checks answered by the source while it moved"
        );
    }
}
