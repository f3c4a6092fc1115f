//! Load generator: P limiter instances (pods, each with its own connection and local state)
//! driven open-loop at an aggregate R checks/s over K distinct API keys for S seconds.
//! Prints one JSON line at the end.
//!
//! ```text
//! cargo run --release -p redis-ratelimit-client --example loadgen -- \
//!   --redis redis://127.0.0.1:6379 --pods 10 --keys 200000 --rate 50000 --duration 10 \
//!   --limit 100 --period 60 --burst 20 [--timeout-ms 5] [--cluster] [--threads 1] \
//!   [--tick-us 50] [--warmup-secs 0] [--closed N] [--pacer thread] [--floor]
//! ```
//!
//! `--warmup-secs W` runs the same open loop for W seconds first, unrecorded: counts,
//! latency and CPU are those of the `--duration` seconds after it.
//!
//! `--closed N` runs a closed loop instead: N workers (worker w on pod w mod pods), each
//! sending its next check when its last one returns, with no pacer (`--rate` and
//! `--tick-us` are then unused, `offered_rate` and `pacer_*` are 0, and `closed` in the JSON
//! is N; it is 0 in an open loop). That is `redis-benchmark -c N`'s shape: CPU per check like
//! for like with the C client's per request. Latency is from each check's own start.
//!
//! `--pacer inline` paces the open loop on the runtime's own thread instead of a thread of
//! its own (`thread`, the default): each tick the due checks start and run until they have
//! written, the replies already in are read, then the thread sleeps out the tick. That is
//! the C reference's `sleep` shape (`scripts/bench/paced.c`): one wake-up per tick, none
//! across threads, a reply read at the next tick. The pacing's CPU is then inside the
//! client's (`pacer_cpu_us_per_check` 0); `pacer` in the JSON says which ran (`none` for a
//! closed loop). Not with `--threads` above 1 or `--closed`.
//!
//! `--floor` sends each check through a minimal hand-written connection instead of the
//! library (`floor.rs`): the same load, tasks, timeout and recording, so its CPU per check is
//! what tokio and loadgen cost by themselves, the floor under the library's (`floor` in the
//! JSON says it ran). One plain `redis://host:port` server only: no password, database,
//! TLS, `--cluster` or `--regions`.
//!
//! Regions: `--regions N --redis URL0,URL1,...` (one store per region, in order), with
//! `--region-weights a,b,c` (how the offered load splits over the regions, default even) and
//! `--rebalance-secs S` (default 2). Pods are split evenly over the regions, each counting
//! its region's live pods for the local fallback; the JSON then
//! adds `per_region_allowed`, `shares` (the policy's last share in each region) and
//! `rebalances` (rebalancing rounds run by the regions' leaders).
//!
//! Open loop: check `i` is due at `start + i / rate` and started then whether or not earlier
//! ones have returned, and its latency is measured **from when it was due**, not from when
//! its task happened to run: queueing inside the load generator counts (no coordinated
//! omission). With `--keys 1` this is the exactness test: `allowed` must not exceed
//! `allowed_bound` = burst + limit / period × elapsed seconds.
//!
//! Also reported: the load generator's own CPU per check (user and system, from
//! `/proc/self/stat`, all threads), the part of it its pacing thread spent (load generation,
//! not the client; a closed-loop C client has none), the pacer's mean tick as it really ran
//! (`pacer_tick_us`: it asks to sleep `--tick-us`, 50 µs by default, and the kernel's timer
//! slack makes that ~145-180 µs here; each tick hands the runtime the checks that fell due, so
//! a longer tick wakes both sides less often and adds up to a tick of latency), and, on a
//! single server, the server's CPU per call (`INFO cpu` delta over `RL.CHECK` and
//! `RL.CHECKALL` calls), for comparison with a C client's.

mod floor;

use hdrhistogram::Histogram;
use redis_ratelimit_client::region::RegionalLimiter;
use redis_ratelimit_client::{Decision, Error, Limiter, Policy, Source};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Args {
    redis: String,
    pods: u64,
    keys: u64,
    rate: u64,
    duration: f64,
    limit: u64,
    period: f64,
    burst: u64,
    timeout_ms: f64,
    cluster: bool,
    threads: usize,
    regions: usize,
    region_weights: Vec<f64>,
    rebalance_secs: f64,
    tick_us: u64,
    warmup_secs: f64,
    closed: usize,
    inline: bool,
    floor: bool,
}

/// The flags, as the module docs describe them.
const USAGE: &str = "usage: loadgen [--redis URL[,URL...]] [--pods P] [--keys K] [--rate R] \
[--duration S] [--limit N] [--period S] [--burst B] [--timeout-ms MS] [--cluster] \
[--threads T] [--tick-us US] [--warmup-secs W] [--closed N] [--pacer thread|inline] [--floor] \
[--regions N] [--region-weights a,b,...] [--rebalance-secs S]
(each flag is described at the top of client/examples/loadgen/main.rs)";

fn parse() -> Result<Args, String> {
    let mut a = Args {
        redis: "redis://127.0.0.1:6379".into(),
        pods: 1,
        keys: 1,
        rate: 1000,
        duration: 10.0,
        limit: 100,
        period: 60.0,
        burst: 20,
        timeout_ms: 5.0,
        cluster: false,
        threads: 1,
        regions: 0,
        region_weights: Vec::new(),
        rebalance_secs: 2.0,
        tick_us: 50,
        warmup_secs: 0.0,
        closed: 0,
        inline: false,
        floor: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        if flag == "--cluster" {
            a.cluster = true;
            continue;
        }
        if flag == "--floor" {
            a.floor = true;
            continue;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--redis" => a.redis = v,
            "--pods" => a.pods = num(&v)? as u64,
            "--keys" => a.keys = num(&v)? as u64,
            "--rate" => a.rate = num(&v)? as u64,
            "--duration" => a.duration = num(&v)?,
            "--limit" => a.limit = num(&v)? as u64,
            "--period" => a.period = num(&v)?,
            "--burst" => a.burst = num(&v)? as u64,
            "--timeout-ms" => a.timeout_ms = num(&v)?,
            "--threads" => a.threads = (num(&v)? as usize).max(1),
            "--regions" => a.regions = num(&v)? as usize,
            "--region-weights" => {
                a.region_weights = v.split(',').map(num).collect::<Result<_, _>>()?;
            }
            "--rebalance-secs" => a.rebalance_secs = num(&v)?,
            "--tick-us" => a.tick_us = num(&v)? as u64,
            "--warmup-secs" => a.warmup_secs = num(&v)?,
            "--closed" => a.closed = num(&v)? as usize,
            "--pacer" => {
                a.inline = match v.as_str() {
                    "thread" => false,
                    "inline" => true,
                    _ => return Err(format!("--pacer {v}: thread or inline")),
                }
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if !(a.warmup_secs >= 0.0 && a.duration > 0.0) {
        return Err("--warmup-secs must be at least 0 and --duration above 0".into());
    }
    if a.pods == 0 || a.keys == 0 || a.rate == 0 {
        return Err("--pods, --keys and --rate must be at least 1".into());
    }
    if a.inline && (a.threads > 1 || a.closed > 0) {
        return Err("--pacer inline paces an open loop on the one runtime thread".into());
    }
    if a.floor && (a.cluster || a.regions > 0) {
        return Err("--floor runs against one plain server".into());
    }
    if a.regions > 0 && a.closed > 0 {
        return Err("--closed runs without --regions".into());
    }
    if a.regions > 0 {
        if a.cluster || a.redis.split(',').count() != a.regions {
            return Err("--regions N needs N --redis URLs (single servers), one per region".into());
        }
        if a.region_weights.is_empty() {
            a.region_weights = vec![1.0; a.regions];
        }
        if a.region_weights.len() != a.regions || a.region_weights.iter().any(|w| *w < 0.0) {
            return Err("--region-weights needs one weight >= 0 per region".into());
        }
        if (a.pods as usize) < a.regions {
            return Err("--pods must be at least --regions".into());
        }
    }
    Ok(a)
}

#[derive(Default)]
struct Counts {
    checks: AtomicU64,
    allowed: AtomicU64,
    denied: AtomicU64,
    store: AtomicU64,
    fail_open: AtomicU64,
    fail_closed: AtomicU64,
    local_fallback: AtomicU64,
    deny_cache: AtomicU64,
    errors: AtomicU64,
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) if e == USAGE => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("loadgen: {e}");
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    // One runtime thread by default, a current-thread runtime: the pacer's batches wake the
    // thread that runs the checks directly (a worker pool would add a hop through the
    // `block_on` thread, ~0.8 µs per check at 50k/s here), and on a small machine shared
    // with the server more threads than cores only add context switches (see --threads).
    let rt = if args.threads > 1 {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    rt.block_on(run(args));
}

async fn run(a: Args) {
    let policy = Policy::builder("loadgen")
        .per(a.limit, Duration::from_secs_f64(a.period))
        .burst(a.burst)
        .build()
        .unwrap_or_else(|e| panic!("policy: {e}"));
    let timeout = Duration::from_secs_f64(a.timeout_ms / 1000.0);
    let pods: Vec<Pod> = if a.floor {
        let mut pods = Vec::new();
        for _ in 0..a.pods {
            match floor::Floor::connect(&a.redis, &policy, timeout).await {
                Ok(f) => pods.push(Pod::Floor(f)),
                Err(e) => {
                    eprintln!("loadgen: --floor connects to redis://host:port only: {e}");
                    std::process::exit(2);
                }
            }
        }
        pods
    } else if a.regions > 0 {
        regional_pods(&a, &policy, timeout)
    } else {
        (0..a.pods)
            .map(|_| {
                let b = if a.cluster {
                    Limiter::cluster_builder(a.redis.split(',').map(str::to_owned))
                } else {
                    Limiter::builder(a.redis.clone())
                };
                Pod::Plain(b.timeout(timeout).pods(a.pods).build().expect("limiter"))
            })
            .collect()
    };
    let regions = a.regions.max(1);
    // Region r's pods are r, r + regions, r + 2 × regions, ...
    let per_region = a.pods as usize / regions;
    let cumulative: Arc<Vec<f64>> = Arc::new(
        a.region_weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w;
                Some(*acc)
            })
            .collect(),
    );
    let per_region_allowed: Arc<Vec<AtomicU64>> =
        Arc::new((0..regions).map(|_| AtomicU64::new(0)).collect());
    // Let each pod connect before the clock starts.
    for l in &pods {
        let _ = l.check_one(&policy, "warmup", 0).await;
    }
    // Regions start at the floor and reach an even split within a few rounds: measure from
    // there (at most 10 s).
    let warm = Instant::now();
    while a.regions > 0 && warm.elapsed() < Duration::from_secs(10) {
        let even = 1.0 / a.regions as f64;
        let all_even = pods.iter().all(|p| match p {
            Pod::Regional(l) => l
                .share(policy.name())
                .is_some_and(|s| (s - even).abs() < 0.02),
            Pod::Plain(_) | Pod::Floor(_) => true,
        });
        if all_even {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let counts = Arc::new(Counts::default());
    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
    ));
    // The pacer (thread or inline, below) wakes every `--tick-us`, finer than tokio's 1 ms
    // timer: 50 us asked is ~145-180 us here with the kernel's timer slack.
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    // Checks due before `measured` are the warm-up's: run, not recorded.
    let warmup = Duration::from_secs_f64(a.warmup_secs);
    let measured = started + warmup;
    let end = warmup + Duration::from_secs_f64(a.duration);
    // The measured window's CPU starts at its first instant: the process's read then by a
    // task (the server's INFO on a blocking thread, not the runtime's), the pacer's by itself.
    let window_start = {
        let url = (!a.cluster && a.regions == 0).then(|| a.redis.clone());
        tokio::spawn(async move {
            tokio::time::sleep_until(measured.into()).await;
            let cpu = process_cpu();
            let server = match url {
                Some(url) => tokio::task::spawn_blocking(move || ServerCpu::read(&url))
                    .await
                    .ok()
                    .flatten(),
                None => None,
            };
            (cpu, server)
        })
    };
    let (ticks, pacer_cpu) = if a.closed > 0 {
        closed_loop(&a, &pods, &policy, started + end, measured, &counts, &hist).await;
        (0, Cpu::default())
    } else {
        let (rate, tick) = (a.rate, Duration::from_micros(a.tick_us));
        let per_check = Duration::from_secs_f64(1.0 / a.rate as f64);
        // How many checks are due `elapsed` into the run: check `i` is due at `i / rate`, so
        // checks `0..=elapsed × rate` are, up to the last one due before `end`.
        let total = (end.as_secs_f64() * rate as f64).ceil() as u64;
        let due_by =
            move |elapsed: Duration| ((elapsed.as_secs_f64() * rate as f64) as u64 + 1).min(total);
        // Starts checks `from..to`, each on its own task.
        let launch = |from: u64, to: u64| {
            for i in from..to {
                let region = pick_region(&cumulative);
                let pod = region + regions * ((i as usize / regions) % per_region.max(1));
                let limiter = if a.regions > 0 {
                    pods[pod].clone()
                } else {
                    pods[(i % a.pods) as usize].clone()
                };
                let per_region_allowed = per_region_allowed.clone();
                let subject = Subject::new(rand::random_range(0..a.keys));
                let (policy, counts, hist, done) =
                    (policy.clone(), counts.clone(), hist.clone(), done.clone());
                let due = started + per_check.mul_f64(i as f64);
                // Boxed: tokio aligns a task to 128 bytes, and a 2 kB block so aligned is
                // glibc's slow path (about 1 800 instructions a check, callgrind); the box
                // is a plain allocation, and the task a small one.
                tokio::spawn(Box::pin(async move {
                    let d = limiter.check_one(&policy, subject.as_str(), 1).await;
                    if due >= measured {
                        if d.as_ref().is_ok_and(Decision::is_allowed) {
                            per_region_allowed[region].fetch_add(1, Relaxed);
                        }
                        record(&hist, &counts, due, &d);
                    }
                    done.fetch_add(1, Relaxed);
                }));
            }
        };
        let wait_done = |launched: u64| {
            let done = done.clone();
            async move {
                while done.load(Relaxed) < launched {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        if a.inline {
            // The yield returns once the runtime has run the checks just started and
            // polled its I/O (tokio defers a yielding task until then); the sleep then
            // blocks the runtime's only thread, as the C client's `sleep` mode blocks its.
            let (mut launched, mut ticks) = (0u64, 0u64);
            loop {
                let elapsed = started.elapsed();
                if elapsed >= end {
                    break;
                }
                let due = due_by(elapsed);
                if due > launched {
                    launch(launched, due);
                    launched = due;
                }
                tokio::task::yield_now().await;
                std::thread::sleep(tick);
                if elapsed >= warmup {
                    ticks += 1;
                }
            }
            wait_done(launched).await;
            (ticks, Cpu::default())
        } else {
            // Each wake of the pacing thread hands the runtime one batch of due checks, so
            // the cross-thread wake-up is paid per batch, not per check.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, u64)>();
            let pacer = std::thread::spawn(move || {
                let mut cpu_before = None;
                let (mut launched, mut ticks) = (0u64, 0u64);
                loop {
                    let elapsed = started.elapsed();
                    let cpu_since =
                        |before: Option<Cpu>| thread_cpu().since(before.unwrap_or_default());
                    if elapsed >= end {
                        return (launched, ticks, cpu_since(cpu_before));
                    }
                    if elapsed >= warmup && cpu_before.is_none() {
                        cpu_before = Some(thread_cpu());
                    }
                    let due = due_by(elapsed);
                    if due > launched && tx.send((launched, due)).is_err() {
                        return (launched, ticks, cpu_since(cpu_before));
                    }
                    launched = launched.max(due);
                    std::thread::sleep(tick);
                    if cpu_before.is_some() {
                        ticks += 1;
                    }
                }
            });
            while let Some((from, to)) = rx.recv().await {
                launch(from, to);
            }
            let (launched, ticks, pacer_cpu) =
                tokio::task::spawn_blocking(move || pacer.join().expect("pacer"))
                    .await
                    .expect("pacer");
            wait_done(launched).await;
            (ticks, pacer_cpu)
        }
    };
    let elapsed = measured.elapsed().as_secs_f64();
    let cpu_after = process_cpu();
    let (cpu_before, server) = window_start.await.expect("window start");
    let cpu = cpu_after.since(cpu_before);
    let server_us = server
        .and_then(|before| Some((before, ServerCpu::read(&a.redis)?)))
        .map(|(b, now)| now.per_call_us(&b));

    let h = hist.lock().expect("histogram");
    let c = &*counts;
    let n = |x: &AtomicU64| x.load(Relaxed);
    let bound = a.keys as f64 * (a.burst as f64 + a.limit as f64 / a.period * elapsed);
    let regional = if a.regions > 0 {
        let list = |v: Vec<String>| v.join(",");
        let allowed = list(
            per_region_allowed
                .iter()
                .map(|x| x.load(Relaxed).to_string())
                .collect(),
        );
        let shares = list(
            (0..regions)
                .map(|r| match &pods[r] {
                    Pod::Regional(l) => format!("{:.4}", l.share(policy.name()).unwrap_or(0.0)),
                    Pod::Plain(_) | Pod::Floor(_) => "null".into(),
                })
                .collect(),
        );
        let rebalances: u64 = pods
            .iter()
            .map(|p| match p {
                Pod::Regional(l) => l.rebalances(),
                Pod::Plain(_) | Pod::Floor(_) => 0,
            })
            .sum();
        format!(
            concat!(
                ",\"regions\":{regions},\"per_region_allowed\":[{allowed}],",
                "\"shares\":[{shares}],\"rebalances\":{rebalances}"
            ),
            regions = regions,
            allowed = allowed,
            shares = shares,
            rebalances = rebalances
        )
    } else {
        String::new()
    };
    println!(
        concat!(
            "{{\"checks\":{},\"allowed\":{},\"denied\":{},\"store\":{},\"fail_open\":{},",
            "\"fail_closed\":{},\"local_fallback\":{},\"deny_cache\":{},\"errors\":{},",
            "\"checks_per_sec\":{:.0},\"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},",
            "\"elapsed_s\":{:.3},\"pods\":{},\"keys\":{},\"offered_rate\":{},",
            "\"allowed_bound\":{:.1},",
            "\"client_cpu_us_per_check\":{:.2},\"client_user_us_per_check\":{:.2},",
            "\"client_sys_us_per_check\":{:.2},\"pacer_cpu_us_per_check\":{:.2},",
            "\"pacer_tick_us\":{:.0},",
            "\"server_cpu_us_per_call\":{},\"closed\":{},\"pacer\":\"{}\",\"floor\":{}{}}}"
        ),
        n(&c.checks),
        n(&c.allowed),
        n(&c.denied),
        n(&c.store),
        n(&c.fail_open),
        n(&c.fail_closed),
        n(&c.local_fallback),
        n(&c.deny_cache),
        n(&c.errors),
        n(&c.checks) as f64 / elapsed,
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max(),
        elapsed,
        a.pods,
        a.keys,
        if a.closed > 0 { 0 } else { a.rate },
        bound,
        cpu.total_us() / n(&c.checks).max(1) as f64,
        cpu.user_us / n(&c.checks).max(1) as f64,
        cpu.sys_us / n(&c.checks).max(1) as f64,
        pacer_cpu.total_us() / n(&c.checks).max(1) as f64,
        if ticks == 0 {
            0.0
        } else {
            elapsed * 1e6 / ticks as f64
        },
        server_us.map_or("null".to_string(), |us| format!("{us:.2}")),
        a.closed,
        match (a.closed, a.inline) {
            (0, false) => "thread",
            (0, true) => "inline",
            _ => "none",
        },
        a.floor,
        regional,
    );
}

/// `--closed N`: N workers, worker w on pod w mod pods, each sending its next check when the
/// last one returns (no pacer), until the run ends: the shape of `redis-benchmark -c N`, for
/// CPU per check like for like. Latency is from each check's own start.
async fn closed_loop(
    a: &Args,
    pods: &[Pod],
    policy: &Policy,
    until: Instant,
    measured: Instant,
    counts: &Arc<Counts>,
    hist: &Arc<Mutex<Histogram<u64>>>,
) {
    let workers: Vec<_> = (0..a.closed)
        .map(|w| {
            let pod = pods[w % pods.len()].clone();
            let (policy, counts, hist, keys) =
                (policy.clone(), counts.clone(), hist.clone(), a.keys);
            tokio::spawn(async move {
                loop {
                    let start = Instant::now();
                    if start >= until {
                        return;
                    }
                    let subject = Subject::new(rand::random_range(0..keys));
                    let d = pod.check_one(&policy, subject.as_str(), 1).await;
                    // An answer from this pod's own state (deny cache, fallback) awaited
                    // nothing: without a yield this worker would keep the runtime's only
                    // thread from the others.
                    if !d.as_ref().is_ok_and(|d| d.source == Source::Store) {
                        tokio::task::yield_now().await;
                    }
                    if start >= measured {
                        record(&hist, &counts, start, &d);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
}

/// One measured check: its latency from `since` (when it was due, or started) and its outcome.
fn record(
    hist: &Mutex<Histogram<u64>>,
    counts: &Counts,
    since: Instant,
    d: &Result<Decision, Error>,
) {
    let us = since.elapsed().as_micros() as u64;
    if let Ok(mut h) = hist.lock() {
        let _ = h.record(us.max(1));
    }
    counts.record(d);
}

/// API key number `n`, `key<n>`, written on the stack. Not a table of every key: picking
/// from 200k strings at random made each check two cache misses (the table, then the
/// string), ~12% of loadgen's CPU (1.1-1.5 µs per check at 50k/s), which a service that
/// has just parsed the key from its request never pays.
struct Subject {
    buf: [u8; 24],
    len: usize,
}

impl Subject {
    fn new(n: u64) -> Self {
        use std::io::Write;
        let mut buf = [0; 24];
        let mut rest = &mut buf[..];
        // "key" and at most 20 digits: always fits.
        let _ = write!(rest, "key{n}");
        let len = 24 - rest.len();
        Self { buf, len }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

/// A pod: a plain limiter, one region's share of the quota, or the floor's bare connection.
#[derive(Clone)]
enum Pod {
    Plain(Limiter),
    Regional(RegionalLimiter),
    Floor(floor::Floor),
}

impl Pod {
    async fn check_one(&self, p: &Policy, subject: &str, cost: u64) -> Result<Decision, Error> {
        match self {
            Pod::Plain(l) => l.check_one(p, subject, cost).await,
            Pod::Regional(l) => l.check_one(p, subject, cost).await,
            Pod::Floor(f) => f.check_one(p, subject, cost).await,
        }
    }
}

/// `--pods` pods split evenly over `--regions` regions: pod i is in region i mod regions.
fn regional_pods(a: &Args, policy: &Policy, timeout: Duration) -> Vec<Pod> {
    let urls: Vec<String> = a.redis.split(',').map(str::to_owned).collect();
    let per_region = a.pods / a.regions as u64;
    (0..per_region as usize * a.regions)
        .map(|i| {
            let l = RegionalLimiter::builder(i % a.regions, urls.clone())
                .policy(policy)
                .rebalance_period(Duration::from_secs_f64(a.rebalance_secs))
                .live_pods(Duration::from_secs(10))
                .limiter(move |b| b.timeout(timeout).pods(per_region))
                .build()
                .expect("regional limiter");
            Pod::Regional(l)
        })
        .collect()
}

/// A region drawn by the offered-load weights (cumulative); 0 without regions.
fn pick_region(cumulative: &[f64]) -> usize {
    let Some(total) = cumulative.last().copied().filter(|t| *t > 0.0) else {
        return 0;
    };
    let x = rand::random_range(0.0..total);
    cumulative.iter().position(|c| x < *c).unwrap_or(0)
}

impl Counts {
    fn record(&self, d: &Result<redis_ratelimit_client::Decision, redis_ratelimit_client::Error>) {
        self.checks.fetch_add(1, Relaxed);
        match d {
            Ok(d) => {
                let by_source = match d.source {
                    Source::Store => &self.store,
                    Source::DenyCache => &self.deny_cache,
                    Source::LocalFallback => &self.local_fallback,
                    Source::FailOpen => &self.fail_open,
                    _ => &self.fail_closed,
                };
                by_source.fetch_add(1, Relaxed);
                let verdict = if d.is_allowed() {
                    &self.allowed
                } else {
                    &self.denied
                };
                verdict.fetch_add(1, Relaxed);
            }
            Err(_) => {
                self.errors.fetch_add(1, Relaxed);
            }
        }
    }
}

/// This process's CPU time so far, all threads (`/proc/self/stat`, Linux).
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    user_us: f64,
    sys_us: f64,
}

impl Cpu {
    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user_us: self.user_us - before.user_us,
            sys_us: self.sys_us - before.sys_us,
        }
    }

    fn total_us(self) -> f64 {
        self.user_us + self.sys_us
    }
}

fn process_cpu() -> Cpu {
    cpu_of("/proc/self/stat")
}

/// The calling thread's CPU time so far (`/proc/thread-self/stat`, Linux).
fn thread_cpu() -> Cpu {
    cpu_of("/proc/thread-self/stat")
}

fn cpu_of(stat: &str) -> Cpu {
    // Fields 14 and 15 (utime, stime) in clock ticks, after the parenthesised command name;
    // Linux reports them at USER_HZ = 100.
    const US_PER_TICK: f64 = 10_000.0;
    let stat = std::fs::read_to_string(stat).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Cpu {
        user_us: tick(11) * US_PER_TICK,
        sys_us: tick(12) * US_PER_TICK,
    }
}

/// The server's CPU seconds and `RL.CHECK`/`RL.CHECKALL` calls, from `INFO`.
#[derive(Debug, Clone, Copy)]
struct ServerCpu {
    cpu_s: f64,
    calls: f64,
}

impl ServerCpu {
    fn read(url: &str) -> Option<Self> {
        let mut c = redis::Client::open(url).ok()?.get_connection().ok()?;
        let info: String = redis::cmd("INFO").arg("everything").query(&mut c).ok()?;
        let field = |name: &str| -> f64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        // The client sends `RL.CHECK` for one limit, `RL.CHECKALL` for several.
        let calls_of = |command: &str| -> f64 {
            info.lines()
                .find_map(|l| l.strip_prefix(command))
                .and_then(|rest| rest.split(',').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        let calls = calls_of("cmdstat_rl.check:calls=") + calls_of("cmdstat_rl.checkall:calls=");
        Some(Self {
            cpu_s: field("used_cpu_sys:") + field("used_cpu_user:"),
            calls,
        })
    }

    fn per_call_us(&self, before: &Self) -> f64 {
        (self.cpu_s - before.cpu_s) * 1e6 / (self.calls - before.calls).max(1.0)
    }
}
