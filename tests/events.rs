//! Keyspace notifications: a bucket's write fires on the primary the events of the `SET key
//! value PXAT expiry` it replicates (`new` for a new key, `set`, then `expire`), exactly as
//! that `SET` fires them on a replica, whichever way the server keeps the value (shared, or
//! by the server's own `SET`); a refusal writes nothing and fires nothing. (Where values are
//! shared, a rewrite that changes the value also fires `new`: see the README.)

use redis::{Connection, Msg};
use redis_ratelimit_testkit::*;
use std::time::Duration;

/// One per hour: nothing refills while the test runs.
const PER_HOUR_1: &str = "0.0002777777777777778";

/// `(key, event)` of each message on `__keyspace@0__:*` until the `SET` of `sentinel`.
fn events_until(ps: &mut redis::PubSub<'_>, sentinel: &str) -> Vec<(String, String)> {
    let mut seen = Vec::new();
    loop {
        let msg: Msg = ps.get_message().expect("a keyspace event within 5 s");
        let channel = msg.get_channel_name().to_string();
        let key = channel
            .strip_prefix("__keyspace@0__:")
            .unwrap_or(&channel)
            .to_string();
        let event: String = msg.get_payload().unwrap();
        if key == sentinel {
            return seen;
        }
        seen.push((key, event));
    }
}

fn ok(c: &mut Connection, args: &[&str]) {
    run(c, args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

fn pair(key: &str, event: &str) -> (String, String) {
    (key.to_string(), event.to_string())
}

#[test]
fn bucket_writes_fire_the_events_of_their_set_and_refusals_none() {
    // The second configuration turns on an eviction policy, under which every server keeps
    // the value by its own `SET` (the other write path).
    let configs: [&[&str]; 2] = [
        &[],
        &["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
    ];
    for flavor in Flavor::selected() {
        for extra in configs {
            // `n`, the new-key event, is not in `A`: asked for too.
            let mut args = vec!["--notify-keyspace-events", "KAn"];
            args.extend_from_slice(extra);
            let server = Server::start_with(flavor, true, &args);
            let version = server.version();
            let shared = extra.is_empty() && expect_shared(flavor, version);
            assert_eq!(
                server.log().contains("bucket values shared"),
                expect_shared(flavor, version),
                "{flavor:?} {version:?}"
            );
            let layout = if shared { "shared" } else { "by SET" };
            let what = format!("{flavor:?} {version:?}, values {layout}");

            let mut sub = server.conn();
            let mut ps = sub.as_pubsub();
            ps.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            ps.psubscribe("__keyspace@0__:*").unwrap();
            let mut c = server.conn();
            let at = (server_ms(&mut c) + 60_000).to_string();

            // The reference: the SET the module replicates, run by hand.
            ok(&mut c, &["SET", "plain", "1", "PXAT", &at]);
            // A new bucket, the same bucket again, then a refusal (cost 3 > the 1 left).
            for cost in ["1", "1", "3"] {
                ok(&mut c, &["RL.CHECK", "b", PER_HOUR_1, "3", cost]);
            }
            ok(
                &mut c,
                &[
                    "RL.CHECKALL",
                    "{t}x",
                    PER_HOUR_1,
                    "3",
                    "1",
                    "{t}y",
                    PER_HOUR_1,
                    "3",
                    "1",
                ],
            );
            // A charge after the fact writes the bucket like a check.
            ok(&mut c, &["RL.SETTLE", "b", PER_HOUR_1, "3", "2"]);
            ok(&mut c, &["SET", "sentinel", "1"]);

            let seen = events_until(&mut ps, "sentinel");
            let set_pxat = |k: &str| vec![pair(k, "set"), pair(k, "expire")];
            let created = |k: &str| [vec![pair(k, "new")], set_pxat(k)].concat();
            // The same bucket's later writes keep its value (one per hour: each token moves
            // the TAT by whole milliseconds), and rewrite the key as a SET overwrite does.
            let expected: Vec<_> = [
                created("plain"),
                created("b"),
                set_pxat("b"),
                created("{t}x"),
                created("{t}y"),
                set_pxat("b"),
            ]
            .concat();
            assert_eq!(seen, expected, "{what}");
            eprintln!("{what}: {} events as expected", seen.len());
        }
    }
}
