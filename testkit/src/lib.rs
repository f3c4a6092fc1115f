//! Test harness: real `redis-server` / `valkey-server` processes with the module loaded, one per
//! test, on OS-assigned loopback ports, each in its own temp dir, killed and reaped on drop.
//!
//! Environment:
//! - `RL_MODULE`: the module to load (default `target/release/libredis_ratelimit.so`; build it
//!   first with `cargo build --release -p redis-ratelimit`, which `scripts/test` does).
//! - `REDIS_SERVER_BIN`, `VALKEY_SERVER_BIN`: server binaries (default from `PATH`).
//! - `RL_SERVER_BIN` (with `RL_SERVER_FLAVOR`, `redis` or `valkey`; by default `valkey` when the
//!   binary's file name says so, else `redis`): run the tests on that one server only, instead
//!   of one Redis and one Valkey (`scripts/test-servers` loops over the extra servers this
//!   way). Tests take their servers from [`Flavor::selected`] (each kind a test covers) or
//!   [`Flavor::or_selected`] (one server of either kind), so none starts another.
//! - `REDIS_URL`: an external server with the module loaded (e.g. the Docker image): the
//!   behaviour tests then run against it alone; tests that need their own servers (AOF,
//!   cluster) still start them. With `REDIS_REPLICA_URL` and `REDIS_PLAIN_REPLICA_URL` also
//!   set (replicas of it, with and without the module), so does the replication test.
#![allow(missing_docs, missing_debug_implementations)]

mod blackhole;
mod http;
pub use blackhole::Blackhole;
pub use http::{http_request, HttpReply};

use redis::{Client, Connection, Value};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Which server implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Redis,
    Valkey,
}

/// The one server `RL_SERVER_BIN` (and `RL_SERVER_FLAVOR`) names, if set.
fn single_server() -> Option<(Flavor, String)> {
    let bin = std::env::var("RL_SERVER_BIN")
        .ok()
        .filter(|b| !b.is_empty())?;
    let flavor = match std::env::var("RL_SERVER_FLAVOR").ok().as_deref() {
        Some("redis") => Flavor::Redis,
        Some("valkey") => Flavor::Valkey,
        Some(other) => panic!("RL_SERVER_FLAVOR={other}: expected redis or valkey"),
        None => {
            let file = Path::new(&bin)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            if file.contains("valkey") {
                Flavor::Valkey
            } else {
                Flavor::Redis
            }
        }
    };
    Some((flavor, bin))
}

impl Flavor {
    /// The flavors the tests run on: both, or only the one `RL_SERVER_BIN` names.
    pub fn selected() -> Vec<Flavor> {
        match single_server() {
            Some((flavor, _)) => vec![flavor],
            None => Flavor::ALL.to_vec(),
        }
    }

    /// This flavor, or the one server's when `RL_SERVER_BIN` is set: for a test that needs
    /// a server of either kind, so that `scripts/test-servers` runs it on the server under
    /// test. Without the variable, tests name both kinds between them, as before.
    pub fn or_selected(self) -> Flavor {
        single_server().map_or(self, |(flavor, _)| flavor)
    }

    pub fn binary(self) -> String {
        if let Some((flavor, bin)) = single_server() {
            if flavor == self {
                return bin;
            }
        }
        let (var, default) = match self {
            Flavor::Redis => ("REDIS_SERVER_BIN", "redis-server"),
            Flavor::Valkey => ("VALKEY_SERVER_BIN", "valkey-server"),
        };
        std::env::var(var).unwrap_or_else(|_| default.to_string())
    }

    pub const ALL: [Flavor; 2] = [Flavor::Redis, Flavor::Valkey];
}

pub fn module_path() -> PathBuf {
    let path = std::env::var_os("RL_MODULE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/libredis_ratelimit.so")
        });
    assert!(
        path.exists(),
        "module not found at {} (run `cargo build --release -p redis-ratelimit` or set RL_MODULE)",
        path.display()
    );
    path
}

/// Starts a server process that dies with this one.
///
/// A test process killed outright (a timeout's `kill -9`, a pipe closed under it) runs no
/// `Drop`, so each server is started with `PR_SET_PDEATHSIG`: the kernel kills it when its
/// parent goes. The kernel means the parent *thread*, and test threads (and a runtime's
/// worker threads) end while their servers may still be in use, so every server is started
/// from one thread that lives as long as the process.
fn spawn(flavor: Flavor, args: &[String], dir: &Path) -> Child {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    });
    let mut command = Command::new(flavor.binary());
    command
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit).
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the prctl took: nobody would signal this child.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    };
    let (tx, rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((command, tx))
        .expect("spawner thread gone");
    rx.recv()
        .expect("spawner thread gone")
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", flavor.binary()))
}

/// A server process owned by a test.
#[derive(Debug)]
pub struct Server {
    pub flavor: Flavor,
    pub port: u16,
    pub dir: PathBuf,
    args: Vec<String>,
    child: Child,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A loopback port that was free a moment ago. Another process may take it before the
/// server binds it: [`Server::start_in`] then sees the server exit and tries another.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

/// Why a started server is not serving.
enum NotReady {
    /// The process exited; its log.
    Exited(String),
    /// Still not answering, or another process answers on its port.
    Timeout(String),
}

impl Server {
    /// Starts a server with the module loaded.
    pub fn start(flavor: Flavor) -> Server {
        Self::start_with(flavor, true, &[])
    }

    /// Starts a server, with or without the module, with extra config arguments.
    pub fn start_with(flavor: Flavor, with_module: bool, extra: &[&str]) -> Server {
        let dir = std::env::temp_dir().join(format!(
            "rl-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self::start_in(flavor, with_module, extra, dir)
    }

    /// Starts a server in `dir` (for restarts that must find their AOF or RDB files).
    pub fn start_in(flavor: Flavor, with_module: bool, extra: &[&str], dir: PathBuf) -> Server {
        Self::start_on(
            flavor,
            with_module,
            extra,
            dir,
            std::iter::repeat_with(free_port),
        )
    }

    /// [`Server::start_in`] on the first of `ports` the server manages to bind (at most 5
    /// tried).
    fn start_on(
        flavor: Flavor,
        with_module: bool,
        extra: &[&str],
        dir: PathBuf,
        mut ports: impl Iterator<Item = u16>,
    ) -> Server {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let port = ports.next().unwrap_or_else(free_port);
            let mut args: Vec<String> = vec![
                "--port".into(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                "".into(),
                "--dir".into(),
                dir.display().to_string(),
                "--logfile".into(),
                "server.log".into(),
                "--daemonize".into(),
                "no".into(),
            ];
            if with_module {
                args.push("--loadmodule".into());
                args.push(module_path().display().to_string());
            }
            args.extend(extra.iter().map(|s| s.to_string()));
            let _ = std::fs::remove_file(dir.join("server.log"));
            let child = spawn(flavor, &args, &dir);
            let mut server = Server {
                flavor,
                port,
                dir: dir.clone(),
                args,
                child,
            };
            match server.wait_ready() {
                Ok(()) => return server,
                // The port was taken between `free_port` and the bind, or (cluster mode)
                // is above 55535, where its cluster bus port (+10 000) would not fit: try
                // another.
                Err(NotReady::Exited(log))
                    if (log.contains("in use") || log.contains("port number too high"))
                        && attempts < 5 =>
                {
                    eprintln!("{flavor:?}: port {port} unusable, trying another; log:\n{log}");
                    // Keep the directory for the next attempt.
                    let _ = std::mem::take(&mut server.dir);
                }
                Err(NotReady::Exited(log) | NotReady::Timeout(log)) => {
                    panic!("{flavor:?} on port {port} did not start; log:\n{log}")
                }
            }
        }
    }

    /// Kills the server (`kill -9`) and starts it again on the same port and directory.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(self.flavor, &self.args, &self.dir);
        if let Err(NotReady::Exited(log) | NotReady::Timeout(log)) = self.wait_ready() {
            panic!(
                "{:?} on port {} did not restart; log:\n{log}",
                self.flavor, self.port
            );
        }
    }

    /// Kills the server (`kill -9`) and reaps it; [`Server::restart`] brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits until this process (not another on the same port) answers `PING`.
    fn wait_ready(&mut self) -> Result<(), NotReady> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let pid = format!("process_id:{}", self.child.id());
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Err(NotReady::Exited(self.log()));
            }
            if let Ok(mut c) = self.try_conn() {
                // Ours (not another process on the port), and past loading its AOF or RDB:
                // `INFO` answers while loading, `PING` answers LOADING until done.
                let info: redis::RedisResult<String> =
                    redis::cmd("INFO").arg("server").query(&mut c);
                let ours = info.is_ok_and(|info| info.lines().any(|l| l.trim() == pid));
                let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut c);
                if ours && pong.is_ok() {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(NotReady::Timeout(format!(
                    "not ready in 10 s (or another process answers on the port):\n{}",
                    self.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn try_conn(&self) -> redis::RedisResult<Connection> {
        Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    pub fn conn(&self) -> Connection {
        self.try_conn().expect("connect")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// The client-side ports of every connection to the server but the caller's own
    /// (`CLIENT LIST` seen from `c`).
    pub fn client_ports(&self, c: &mut Connection) -> Vec<u16> {
        let me: i64 = redis::cmd("CLIENT").arg("ID").query(c).expect("CLIENT ID");
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(c)
            .expect("CLIENT LIST");
        list.lines()
            .filter(|l| !l.starts_with(&format!("id={me} ")))
            .filter_map(|l| {
                let addr = l.split(' ').find_map(|f| f.strip_prefix("addr="))?;
                addr.rsplit_once(':')?.1.parse().ok()
            })
            .collect()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's own version, `(major, minor, patch)`: `valkey_version` where the server
    /// reports one, else `redis_version` (from `INFO server`).
    pub fn version(&self) -> (u32, u32, u32) {
        server_version(&mut self.conn())
    }

    /// Sends a signal to the server process (`STOP`, `CONT`, `KILL`).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// Stops the server and waits for it, keeping its directory.
    pub fn stop(mut self) -> PathBuf {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = std::mem::take(&mut self.dir);
        std::mem::forget(self);
        dir
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- {:?} log (port {}) ---\n{}",
                self.flavor,
                self.port,
                self.log()
            );
        }
        if !self.dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Where a behaviour test runs: the external `REDIS_URL` server, or a fresh server of each
/// flavor. Keys get a per-test prefix so tests can share an external server.
#[derive(Debug)]
pub struct Target {
    pub name: String,
    pub url: String,
    pub prefix: String,
    _server: Option<Server>,
}

impl Target {
    pub fn conn(&self) -> Connection {
        Client::open(self.url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .unwrap_or_else(|e| panic!("{}: connect: {e}", self.name))
    }

    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

pub fn targets(test: &str) -> Vec<Target> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        let prefix = format!("rltest:{test}:{}:", std::process::id());
        return vec![Target {
            name: format!("external {url}"),
            url,
            prefix,
            _server: None,
        }];
    }
    Flavor::selected()
        .into_iter()
        .map(|f| {
            let s = Server::start(f);
            Target {
                name: format!("{f:?}"),
                url: s.url(),
                prefix: format!("{test}:"),
                _server: Some(s),
            }
        })
        .collect()
}

/// `RL.CHECK` reply.
pub type Reply = (i64, i64, i64, i64);

pub fn rl_check(c: &mut Connection, key: &str, rate: &str, burst: i64, cost: i64) -> Reply {
    redis::cmd("RL.CHECK")
        .arg(key)
        .arg(rate)
        .arg(burst)
        .arg(cost)
        .query(c)
        .unwrap_or_else(|e| panic!("RL.CHECK {key} {rate} {burst} {cost}: {e}"))
}

/// Runs a raw command and returns its error text (panics if it succeeded).
pub fn expect_err(c: &mut Connection, args: &[&str]) -> String {
    match run(c, args) {
        Ok(v) => panic!("{args:?} succeeded: {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// Runs a raw command, `args[0]` its name.
pub fn run(c: &mut Connection, args: &[&str]) -> redis::RedisResult<Value> {
    redis::cmd(args[0]).arg(&args[1..]).query(c)
}

pub fn exists(c: &mut Connection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(c)
        .expect("EXISTS")
        == 1
}

pub fn pttl(c: &mut Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(c).expect("PTTL")
}

pub fn pexpiretime(c: &mut Connection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME")
        .arg(key)
        .query(c)
        .expect("PEXPIRETIME")
}

/// The version a connected server reports, `(major, minor, patch)`: `valkey_version` where it
/// has one, else `redis_version`.
pub fn server_version(c: &mut Connection) -> (u32, u32, u32) {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(c)
        .expect("INFO server");
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_string())
    };
    let v = field("valkey_version")
        .or_else(|| field("redis_version"))
        .unwrap_or_else(|| panic!("no version in INFO server:\n{info}"));
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// Server time in ms.
pub fn server_ms(c: &mut Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(c).expect("TIME");
    s * 1000 + us / 1000
}

/// Polls `f` until it returns true or `limit` passes (for replication lag, not for timing).
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// Starts 3 primaries and splits the 16384 slots between them.
pub fn start_cluster(flavor: Flavor) -> Vec<Server> {
    let nodes: Vec<Server> = (0..3)
        .map(|_| {
            Server::start_with(
                flavor,
                true,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
        })
        .collect();
    let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
    for (node, (from, to)) in nodes.iter().zip(ranges) {
        let _: () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(from)
            .arg(to)
            .query(&mut node.conn())
            .unwrap();
    }
    let mut first = nodes[0].conn();
    for node in &nodes[1..] {
        let _: () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(node.port)
            .query(&mut first)
            .unwrap();
    }
    for node in &nodes {
        let mut c = node.conn();
        let ok = eventually(Duration::from_secs(20), || {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut c).unwrap();
            info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
        });
        assert!(ok, "{flavor:?}: cluster did not converge");
    }
    nodes
}

/// Whether the module shares its values on this server (with no eviction policy): the
/// servers whose object header it knows (Redis 7.0 to 8.0, Valkey up to 8.0), written out
/// here rather than taken from the module's own table.
pub fn expect_shared(flavor: Flavor, version: (u32, u32, u32)) -> bool {
    let line = (version.0, version.1);
    match flavor {
        Flavor::Redis => [(7, 0), (7, 2), (7, 4), (8, 0)].contains(&line),
        Flavor::Valkey => [(7, 2), (8, 0)].contains(&line),
    }
}

/// `calls=` of a command in `INFO commandstats` (0 if never called).
pub fn command_calls(c: &mut Connection, command: &str) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(c)
        .expect("INFO");
    let prefix = format!("cmdstat_{}:calls=", command.to_lowercase());
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The servers a client behaviour test runs on: each flavor with the module (`RL.CHECKALL`)
/// and without it (the client's Lua script), or the external `REDIS_URL` server alone.
pub fn backends(test: &str) -> Vec<Target> {
    if std::env::var("REDIS_URL").is_ok() {
        return targets(test);
    }
    let mut all = Vec::new();
    for f in Flavor::selected() {
        for with_module in [true, false] {
            let s = Server::start_with(f, with_module, &[]);
            let how = if with_module { "module" } else { "script" };
            all.push(Target {
                name: format!("{f:?}/{how}"),
                url: s.url(),
                prefix: format!("{test}:"),
                _server: Some(s),
            });
        }
    }
    all
}

/// A primary with two replicas attached, one loading the module and one not.
#[derive(Debug)]
pub struct ReplicaSet {
    pub name: String,
    pub primary: Target,
    pub with_module: Target,
    pub without_module: Target,
}

/// The replica sets a replication test runs on: the external `REDIS_URL` primary with the
/// replicas at `REDIS_REPLICA_URL` (module loaded) and `REDIS_PLAIN_REPLICA_URL` (no module),
/// when all three are set (`scripts/docker/test` sets them to three containers); otherwise a
/// fresh local set of each flavor.
pub fn replica_sets() -> Vec<ReplicaSet> {
    let external = |url: String, role: &str| Target {
        name: format!("external {role} {url}"),
        url,
        prefix: String::new(),
        _server: None,
    };
    if let (Ok(p), Ok(w), Ok(o)) = (
        std::env::var("REDIS_URL"),
        std::env::var("REDIS_REPLICA_URL"),
        std::env::var("REDIS_PLAIN_REPLICA_URL"),
    ) {
        return vec![ReplicaSet {
            name: format!("external {p}"),
            primary: external(p, "primary"),
            with_module: external(w, "replica"),
            without_module: external(o, "replica without module"),
        }];
    }
    let local = |s: Server| Target {
        name: format!("{:?} port {}", s.flavor, s.port),
        url: s.url(),
        prefix: String::new(),
        _server: Some(s),
    };
    Flavor::selected()
        .into_iter()
        .map(|f| {
            let primary = Server::start(f);
            let port = primary.port.to_string();
            let with = Server::start_with(f, true, &["--replicaof", "127.0.0.1", &port]);
            let without = Server::start_with(f, false, &["--replicaof", "127.0.0.1", &port]);
            ReplicaSet {
                name: format!("{f:?}"),
                primary: local(primary),
                with_module: local(with),
                without_module: local(without),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The race `free_port` leaves open: the port is taken (here by another server) before
    /// ours binds it. Ours must move to another port, and never pass the other for itself.
    #[test]
    fn a_taken_port_is_retried_elsewhere() {
        if std::env::var_os("REDIS_URL").is_some() {
            return; // uses its own servers only; nothing external to check
        }
        let other = Server::start_with(Flavor::Redis.or_selected(), false, &[]);
        let dir = std::env::temp_dir().join(format!("rl-testkit-retry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ours = Server::start_on(
            Flavor::Redis.or_selected(),
            false,
            &[],
            dir,
            [other.port]
                .into_iter()
                .chain(std::iter::repeat_with(free_port)),
        );
        assert_ne!(ours.port, other.port);
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut ours.conn())
            .unwrap();
        assert!(info.contains(&format!("process_id:{}", ours.pid())));
        assert_ne!(ours.pid(), other.pid());
    }

    /// Where the helper below writes its server's pid.
    const HOLD_VAR: &str = "RL_TESTKIT_HOLD_PID_FILE";

    /// Run by [`servers_die_with_the_test_process`] in a child test process: starts a server,
    /// says its pid, and waits to be killed.
    #[test]
    #[ignore = "a helper, run by servers_die_with_the_test_process"]
    fn helper_holds_a_server_until_killed() {
        let path = std::env::var(HOLD_VAR).expect("run by servers_die_with_the_test_process");
        let server = Server::start_with(Flavor::Redis.or_selected(), false, &[]);
        std::fs::write(&path, server.pid().to_string()).unwrap();
        std::thread::sleep(Duration::from_secs(60));
    }

    /// A test process killed outright (a timeout's `kill -9`, a closed pipe) runs no `Drop`:
    /// its servers must not outlive it, holding ports and memory.
    #[test]
    fn servers_die_with_the_test_process() {
        if std::env::var_os("REDIS_URL").is_some() {
            return; // uses its own servers only
        }
        let pid_file = std::env::temp_dir().join(format!("rl-testkit-hold-{}", std::process::id()));
        let _ = std::fs::remove_file(&pid_file);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "tests::helper_holds_a_server_until_killed",
            ])
            .env(HOLD_VAR, &pid_file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Read until whole: the helper may be caught mid-write.
        let read = || std::fs::read_to_string(&pid_file).ok()?.parse::<u32>().ok();
        let started = eventually(Duration::from_secs(20), || read().is_some());
        assert!(started, "the helper never started its server");
        let server = read().unwrap();
        let _ = std::fs::remove_file(&pid_file);
        let alive = |pid: u32| {
            // Gone, or a zombie nobody has reaped yet, is dead.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| !rest.starts_with('Z'))
            })
        };
        assert!(alive(server), "the helper's server is not running");
        child.kill().unwrap();
        child.wait().unwrap();
        let gone = eventually(Duration::from_secs(5), || !alive(server));
        if !gone {
            let _ = Command::new("kill")
                .args(["-9", &server.to_string()])
                .status();
        }
        assert!(gone, "server {server} outlived its test process");
    }
}
