//! Silent network faults on loopback: packets to and from a port dropped by `iptables`, with
//! no RST (a NAT, load balancer or host that lost the flow). Needs root and iptables; under
//! CI (`CI` set) their absence is a failure, elsewhere the tests that need them are skipped.
//!
//! Every rule carries this process's comment and is deleted on drop, also when a test panics.

use std::process::{Command, Stdio};

/// Dropping every packet from or to some loopback ports, while alive.
#[derive(Debug)]
pub struct Blackhole {
    rules: Vec<Vec<String>>,
}

fn iptables(args: &[String]) -> bool {
    Command::new("iptables")
        .arg("-w")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Blackhole {
    /// Whether rules can be added here. Panics under CI when they cannot: the fault tests
    /// must run there.
    pub fn usable() -> bool {
        let ok = iptables(&["-n".into(), "-L".into(), "INPUT".into()]);
        if !ok && std::env::var_os("CI").is_some() {
            panic!("iptables unusable under CI: run as root with iptables installed");
        }
        if !ok {
            eprintln!("skipped: needs root and iptables");
        }
        ok
    }

    /// Drops every TCP packet from or to each of `ports` on loopback: the connections using
    /// them go silent, in both directions.
    pub fn ports(ports: &[u16]) -> Blackhole {
        let comment = format!("rl-test-{}", std::process::id());
        let mut hole = Blackhole { rules: Vec::new() };
        for port in ports {
            for dir in ["--sport", "--dport"] {
                let rule: Vec<String> = [
                    "INPUT",
                    "-i",
                    "lo",
                    "-p",
                    "tcp",
                    dir,
                    &port.to_string(),
                    "-m",
                    "comment",
                    "--comment",
                    &comment,
                    "-j",
                    "DROP",
                ]
                .map(String::from)
                .to_vec();
                let mut add = vec!["-I".to_string()];
                add.extend(rule.iter().cloned());
                assert!(iptables(&add), "iptables {add:?} failed");
                hole.rules.push(rule);
            }
        }
        hole
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        for rule in &self.rules {
            let mut del = vec!["-D".to_string()];
            del.extend(rule.iter().cloned());
            if !iptables(&del) {
                eprintln!("could not delete iptables rule {rule:?}");
            }
        }
    }
}
