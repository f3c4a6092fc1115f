//! Load generator: P limiter instances (pods, each with its own connection and local state)
//! driven open-loop at an aggregate R checks/s over K distinct API keys for S seconds.
//! Prints one JSON line at the end.
//!
//! ```text
//! cargo run --release -p redis-ratelimit-client --example loadgen -- \
//!   --redis redis://127.0.0.1:6379 --pods 10 --keys 200000 --rate 50000 --duration 10 \
//!   --limit 100 --period 60 --burst 20 [--timeout-ms 5] [--cluster] [--threads 1]
//! ```
//!
//! Open loop: checks are started on schedule whether or not earlier ones have returned, so
//! a slow store shows up as latency, not as a lower offered rate. Latency is that of
//! `check()` as the app sees it. With `--keys 1` this is the exactness test: `allowed` must
//! not exceed `allowed_bound` = burst + limit / period × elapsed seconds.

use hdrhistogram::Histogram;
use redis_ratelimit_client::{Limiter, Policy, Source};
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
}

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
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--cluster" {
            a.cluster = true;
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
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.pods == 0 || a.keys == 0 || a.rate == 0 {
        return Err("--pods, --keys and --rate must be at least 1".into());
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
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    };
    // One runtime thread by default: on a small machine shared with the server, more threads
    // than cores only add context switches (see --threads).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
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
    let pods: Vec<Limiter> = (0..a.pods)
        .map(|_| {
            let b = if a.cluster {
                Limiter::cluster_builder(a.redis.split(',').map(str::to_owned))
            } else {
                Limiter::builder(a.redis.clone())
            };
            b.timeout(timeout).pods(a.pods).build().expect("limiter")
        })
        .collect();
    // Let each pod connect before the clock starts.
    for l in &pods {
        let _ = l.check_one(&policy, "warmup", 0).await;
    }

    let counts = Arc::new(Counts::default());
    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
    ));
    let subjects: Arc<Vec<String>> = Arc::new((0..a.keys).map(|i| format!("key{i}")).collect());
    // Pacing runs on its own thread, waking every ~50 us, so checks start spread out rather
    // than in one burst per millisecond (tokio's timer resolution).
    let done = Arc::new(AtomicU64::new(0));
    let handle = tokio::runtime::Handle::current();
    let started = Instant::now();
    let end = Duration::from_secs_f64(a.duration);
    let pacer = {
        let (pods, subjects, policy, counts, hist, done) = (
            pods.clone(),
            subjects.clone(),
            policy.clone(),
            counts.clone(),
            hist.clone(),
            done.clone(),
        );
        std::thread::spawn(move || {
            let mut launched: u64 = 0;
            loop {
                let elapsed = started.elapsed();
                if elapsed >= end {
                    return launched;
                }
                let due = (elapsed.as_secs_f64() * a.rate as f64) as u64;
                while launched < due {
                    let limiter = pods[(launched % a.pods) as usize].clone();
                    let subject = subjects[rand::random_range(0..subjects.len())].clone();
                    let (policy, counts, hist, done) =
                        (policy.clone(), counts.clone(), hist.clone(), done.clone());
                    handle.spawn(async move {
                        let t = Instant::now();
                        let d = limiter.check_one(&policy, &subject, 1).await;
                        let us = t.elapsed().as_micros() as u64;
                        if let Ok(mut h) = hist.lock() {
                            let _ = h.record(us.max(1));
                        }
                        counts.checks.fetch_add(1, Relaxed);
                        done.fetch_add(1, Relaxed);
                        match d {
                            Ok(d) => {
                                let by_source = match d.source {
                                    Source::Store => &counts.store,
                                    Source::DenyCache => &counts.deny_cache,
                                    Source::LocalFallback => &counts.local_fallback,
                                    Source::FailOpen => &counts.fail_open,
                                    _ => &counts.fail_closed,
                                };
                                by_source.fetch_add(1, Relaxed);
                                let verdict = if d.is_allowed() {
                                    &counts.allowed
                                } else {
                                    &counts.denied
                                };
                                verdict.fetch_add(1, Relaxed);
                            }
                            Err(_) => {
                                counts.errors.fetch_add(1, Relaxed);
                            }
                        }
                    });
                    launched += 1;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    let launched = tokio::task::spawn_blocking(move || pacer.join().expect("pacer"))
        .await
        .expect("pacer");
    while done.load(Relaxed) < launched {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();

    let h = hist.lock().expect("histogram");
    let c = &*counts;
    let n = |x: &AtomicU64| x.load(Relaxed);
    let bound = a.keys as f64 * (a.burst as f64 + a.limit as f64 / a.period * elapsed);
    println!(
        concat!(
            "{{\"checks\":{},\"allowed\":{},\"denied\":{},\"store\":{},\"fail_open\":{},",
            "\"fail_closed\":{},\"local_fallback\":{},\"deny_cache\":{},\"errors\":{},",
            "\"checks_per_sec\":{:.0},\"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},",
            "\"elapsed_s\":{:.3},\"pods\":{},\"keys\":{},\"offered_rate\":{},\"allowed_bound\":{:.1}}}"
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
        a.rate,
        bound,
    );
}
