//! The module as the server reports it: `MODULE LIST` names it `ratelimit`, version 1, with
//! the file it was loaded from, on Redis 7.0 and Valkey 8, or on the `REDIS_URL` server (the
//! Docker images load it from `/usr/local/lib/redis-ratelimit/`).

use redis::Value;
use redis_ratelimit_testkit::*;
use std::collections::HashMap;

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        other => format!("{other:?}"),
    }
}

#[test]
fn module_list_names_the_module_and_its_file() {
    for t in targets("modlist") {
        let mut c = t.conn();
        let modules: Vec<HashMap<String, Value>> = redis::cmd("MODULE")
            .arg("LIST")
            .query(&mut c)
            .unwrap_or_else(|e| panic!("{}: MODULE LIST: {e}", t.name));
        let ours: Vec<_> = modules
            .iter()
            .filter(|m| text(m.get("name")) == "ratelimit")
            .collect();
        assert_eq!(ours.len(), 1, "{}: MODULE LIST {modules:?}", t.name);
        assert_eq!(ours[0].get("ver"), Some(&Value::Int(1)), "{}", t.name);
        let path = text(ours[0].get("path"));
        assert!(
            path.ends_with("/libredis_ratelimit.so"),
            "{}: loaded from {path}",
            t.name
        );
    }
}

/// The 50 000 shared values (about 2 MB) are made at load only on a server that shares
/// them; one that stores values by `SET` (Valkey 8.1+) never uses them, and loads without.
#[test]
fn the_value_pool_is_built_only_where_values_are_shared() {
    let used = |s: &Server| -> i64 {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(&mut s.conn())
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    for flavor in Flavor::selected() {
        let (with, without) = (
            Server::start_with(flavor, true, &[]),
            Server::start_with(flavor, false, &[]),
        );
        let pool = used(&with) - used(&without);
        eprintln!("{flavor:?}: the module's memory at load: {pool} B");
        if with.log().contains("bucket values shared") {
            assert!(pool > 1_500_000, "{flavor:?}: {pool} B");
        } else {
            assert!(
                with.log().contains("bucket values stored by SET"),
                "{flavor:?}"
            );
            assert!(pool < 500_000, "{flavor:?}: {pool} B for values never used");
        }
    }
}

/// The module writes and replicates buckets with `SET` and reads them with `GET`, by name: a
/// server where either is renamed refuses it at load, saying why in its log, rather than
/// failing every check (or writing a bucket it then cannot replicate). Loaded the same way on
/// the same server without the rename, it loads.
#[test]
fn the_module_refuses_to_load_where_set_or_get_is_renamed() {
    let module = module_path().display().to_string();
    for flavor in Flavor::selected() {
        // `COMMAND` renamed away (a hardening setting) must not stop it: it is not needed.
        for renamed in [None, Some("COMMAND"), Some("SET"), Some("GET")] {
            let mut extra = vec!["--enable-module-command".to_string(), "yes".to_string()];
            if let Some(name) = renamed {
                extra.extend(["--rename-command".into(), name.into(), format!("{name}_X")]);
            }
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let server = Server::start_with(flavor, false, &extra);
            let mut c = server.conn();
            let loaded: redis::RedisResult<()> =
                redis::cmd("MODULE").arg("LOAD").arg(&module).query(&mut c);
            let command = match renamed {
                Some("COMMAND") => "COMMAND_X",
                _ => "COMMAND",
            };
            let registered: Vec<Value> = redis::cmd(command)
                .arg("INFO")
                .arg("RL.CHECK")
                .query(&mut c)
                .unwrap();
            let log = server.log();
            match renamed {
                None | Some("COMMAND") => {
                    assert!(loaded.is_ok(), "{flavor:?}: {loaded:?}\n{log}");
                    assert_ne!(registered, [Value::Nil], "{flavor:?}");
                }
                Some(name) => {
                    assert!(loaded.is_err(), "{flavor:?}: loaded with {name} renamed");
                    assert_eq!(registered, [Value::Nil], "{flavor:?}: {name} renamed");
                    assert!(
                        log.contains(&format!("no {name} command (rename-command?)")),
                        "{flavor:?}: {name} renamed; log:\n{log}"
                    );
                }
            }
        }
    }
}
