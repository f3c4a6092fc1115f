//! A cluster of 3 primaries on loopback: both commands are routed by their declared key
//! positions, and a cross-slot `RL.CHECKALL` is refused by the server.

use redis::cluster::ClusterClient;
use redis::Connection;
use redis_ratelimit_testkit::*;

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
