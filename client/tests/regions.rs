//! Regions: three servers on loopback, one per region, two pods per region, the default
//! rebalance period (2 s). One subject, 300/s burst 30, offered 5× that for 12 s, split
//! over the regions by weight; or two subjects at 2.5× each, busy in different regions.
//!
//! The tests are CPU-heavy (1 500 checks/s over three servers on two cores), so they run
//! one at a time (`SERIAL`). Bounds are the issue's, with no timing assertions.

use redis_ratelimit_client::region::{RegionTarget, RegionalLimiter};
use redis_ratelimit_client::{slot, Policy, Source};
use redis_ratelimit_testkit::*;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LIMIT: f64 = 300.0;
const BURST: f64 = 30.0;
const OFFERED: f64 = 5.0 * LIMIT;
const PODS_PER_REGION: usize = 2;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn policy() -> Policy {
    Policy::builder("api")
        .per_second(LIMIT as u64)
        .burst(BURST as u64)
        .build()
        .unwrap()
}

struct Regions {
    servers: Vec<Server>,
    /// `pods[r]`: region r's pods.
    pods: Vec<Vec<RegionalLimiter>>,
}

/// One server per region, for three regions.
fn three_servers() -> Vec<Server> {
    (0..3)
        .map(|_| Server::start(Flavor::Redis.or_selected()))
        .collect()
}

fn start() -> Regions {
    let servers = three_servers();
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let p = policy();
    let pods = (0..3)
        .map(|r| {
            (0..PODS_PER_REGION)
                .map(|_| {
                    RegionalLimiter::builder(r, urls.clone())
                        .policy(&p)
                        .live_pods(Duration::from_secs(2))
                        .limiter(|b| b.timeout(Duration::from_millis(500)))
                        .build()
                        .unwrap()
                })
                .collect()
        })
        .collect();
    Regions { servers, pods }
}

impl Regions {
    /// Every pod's share of the policy, by region.
    fn shares(&self) -> Vec<Vec<f64>> {
        self.pods
            .iter()
            .map(|pods| pods.iter().map(|l| l.share("api").unwrap_or(0.0)).collect())
            .collect()
    }

    /// Waits (bounded) until every pod checks at about an even share (the start-up from
    /// the floor) and counts its region's two live pods, before any load is measured.
    async fn settle_even(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let ready = |r: &Regions| {
            r.shares()
                .iter()
                .flatten()
                .all(|s| (s - 1.0 / 3.0).abs() < 0.02)
                && r.pods.iter().flatten().all(|l| {
                    l.live_pods() == Some(PODS_PER_REGION as u64)
                        && l.limiter().pods() == PODS_PER_REGION as u64
                })
        };
        while !ready(self) {
            assert!(
                Instant::now() < deadline,
                "shares never evened out: {:?}",
                self.shares()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Regions {
    /// The largest sum over regions of the highest share any of its pods checks with,
    /// sampled every 5 ms until `stop` (the invariant, observed on the real system: a sample
    /// reads the pods one after another, microseconds apart, while a share freed by one
    /// region is taken by another only after a hold of most of a period).
    fn sample_sum(&self, stop: Arc<std::sync::atomic::AtomicBool>) -> tokio::task::JoinHandle<f64> {
        let pods = self.pods.clone();
        tokio::spawn(async move {
            let mut most: f64 = 0.0;
            while !stop.load(Relaxed) {
                // The policy's shares (any other subject) and the subject's own.
                for share in [
                    |l: &RegionalLimiter| l.share("api"),
                    |l: &RegionalLimiter| l.share_for("api", "the-one-subject"),
                ] {
                    let sum: f64 = pods
                        .iter()
                        .map(|region| {
                            region
                                .iter()
                                .map(|l| share(l).unwrap_or(0.0))
                                .fold(0.0, f64::max)
                        })
                        .sum();
                    most = most.max(sum);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            most
        })
    }
}

#[derive(Debug)]
struct Run {
    allowed: Vec<u64>,
    local: u64,
    errors: u64,
    secs: f64,
}

impl Run {
    fn total(&self) -> u64 {
        self.allowed.iter().sum()
    }

    /// What one global bucket would admit over the run: limit × t + burst.
    fn bound(&self) -> f64 {
        LIMIT * self.secs + BURST
    }
}

/// Offers `OFFERED` checks/s of one subject for `secs`, split by `weights` over the
/// regions and round-robin over each region's pods, open loop (checks are launched when
/// due, whether or not earlier ones have returned).
async fn drive(regions: &Regions, weights: [f64; 3], secs: f64) -> Run {
    let mut runs = drive_subjects(regions, &[("the-one-subject", weights)], OFFERED, secs).await;
    runs.remove(0)
}

/// [`drive`] for several subjects at once, each offered `offered` checks/s split by its
/// own weights: one run per subject.
async fn drive_subjects(
    regions: &Regions,
    subjects: &[(&'static str, [f64; 3])],
    offered: f64,
    secs: f64,
) -> Vec<Run> {
    let p = policy();
    let n = subjects.len();
    let allowed: Arc<Vec<AtomicU64>> = Arc::new((0..3 * n).map(|_| AtomicU64::new(0)).collect());
    let local = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut launched = vec![0u64; 3 * n];
    let mut tasks = Vec::new();
    let started = Instant::now();
    loop {
        let t = started.elapsed().as_secs_f64().min(secs);
        for (s, (subject, weights)) in subjects.iter().enumerate() {
            let total_w: f64 = weights.iter().sum();
            for (r, weight) in weights.iter().enumerate() {
                let due = (offered * weight / total_w * t) as u64;
                let i = 3 * s + r;
                while launched[i] < due {
                    let l = regions.pods[r][launched[i] as usize % PODS_PER_REGION].clone();
                    let (p, allowed, local, errors) =
                        (p.clone(), allowed.clone(), local.clone(), errors.clone());
                    let subject = *subject;
                    tasks.push(tokio::spawn(async move {
                        match l.check_one(&p, subject, 1).await {
                            Ok(d) => {
                                if d.is_allowed() {
                                    allowed[i].fetch_add(1, Relaxed);
                                }
                                if d.source == Source::LocalFallback {
                                    local.fetch_add(1, Relaxed);
                                }
                            }
                            Err(_) => {
                                errors.fetch_add(1, Relaxed);
                            }
                        }
                    }));
                    launched[i] += 1;
                }
            }
        }
        if t >= secs {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Until the last check returned: admissions may happen that late.
    let secs = started.elapsed().as_secs_f64();
    (0..n)
        .map(|s| Run {
            allowed: (0..3).map(|r| allowed[3 * s + r].load(Relaxed)).collect(),
            local: local.load(Relaxed),
            errors: errors.load(Relaxed),
            secs,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_region_gets_most_then_shares_return_to_even() {
    let _serial = SERIAL.lock().await;
    let regions = start();
    regions.settle_even().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = regions.sample_sum(stop.clone());
    let run = drive(&regions, [80.0, 10.0, 10.0], 12.0).await;
    let total = run.total();
    eprintln!(
        "80/10/10: {run:?} total {total} bound {:.0} busy {:.1}% shares {:?}",
        run.bound(),
        100.0 * run.allowed[0] as f64 / total as f64,
        regions.shares()
    );
    assert_eq!(run.errors, 0);
    assert!(
        run.allowed[0] as f64 >= 0.65 * total as f64,
        "busy region admitted {} of {total}",
        run.allowed[0]
    );
    assert!(total as f64 <= run.bound(), "{total} > {:.1}", run.bound());
    assert!(
        total as f64 >= 0.85 * run.bound(),
        "quota stranded: {total} < 85% of {:.1}",
        run.bound()
    );
    let busy = regions.shares()[0][0];
    assert!(busy > 0.6, "busy region's share {busy}");

    // Demand evens out: so do the shares (six periods to follow the smoothed demand: at a
    // weight of 0.5 per period, 1.6% of the old difference is left).
    let run = drive(&regions, [1.0, 1.0, 1.0], 12.0).await;
    let shares = regions.shares();
    stop.store(true, Relaxed);
    let most = sampler.await.unwrap();
    eprintln!("then 1/1/1: {run:?} shares {shares:?}; largest sum of shares seen {most}");
    assert_eq!(run.errors, 0);
    assert!(most <= 1.0 + 1e-9, "shares in use summed to {most}");
    // The policy's shares, and the subject's own (it is hot everywhere, so it has an entry).
    let own: Vec<f64> = regions
        .pods
        .iter()
        .flatten()
        .map(|l| l.share_for("api", "the-one-subject").unwrap_or(0.0))
        .collect();
    for s in shares.iter().flatten().chain(&own) {
        assert!(
            (s - 1.0 / 3.0).abs() <= 0.05,
            "not back to even: {shares:?}, the subject's {own:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn even_demand_uses_the_whole_quota_and_no_more() {
    let _serial = SERIAL.lock().await;
    let regions = start();
    regions.settle_even().await;
    let run = drive(&regions, [1.0, 1.0, 1.0], 12.0).await;
    let (total, bound) = (run.total() as f64, run.bound());
    eprintln!(
        "1/1/1: {run:?} total {total} bound {bound:.0} ({:.1}%) shares {:?}",
        100.0 * total / bound,
        regions.shares()
    );
    assert_eq!(run.errors, 0);
    assert!(total >= 0.85 * bound, "{total} < 85% of {bound:.1}");
    assert!(total <= 1.02 * bound, "{total} > 102% of {bound:.1}");
}

/// Per-subject shares: subject A busy in region 0, B in region 2, both over the limit.
/// A policy-wide split would give regions 0 and 2 about 0.45 each, so each subject about
/// half its limit where it is busy (and quota stranded where it is not); each subject's
/// own split gives it most of its limit where it is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subjects_busy_in_different_regions_each_get_their_own_split() {
    let _serial = SERIAL.lock().await;
    let regions = start();
    regions.settle_even().await;
    let subjects = [("key-a", [80.0, 10.0, 10.0]), ("key-b", [10.0, 10.0, 80.0])];
    // 2.5x the limit each: the same load as one subject at 5x.
    let runs = drive_subjects(&regions, &subjects, OFFERED / 2.0, 12.0).await;
    let own = |subject: &str| -> Vec<f64> {
        regions
            .pods
            .iter()
            .map(|pods| pods[0].share_for("api", subject).unwrap_or(0.0))
            .collect()
    };
    let (a, b) = (own("key-a"), own("key-b"));
    eprintln!(
        "A 80/10/10, B 10/10/80: {runs:?}; A's shares {a:?}, B's {b:?}, policy {:?}",
        regions.shares()
    );
    for ((subject, _), (run, busy)) in subjects.iter().zip(runs.iter().zip([0, 2])) {
        let total = run.total() as f64;
        assert_eq!(run.errors, 0);
        assert!(
            run.allowed[busy] as f64 >= 0.65 * total,
            "{subject}: its busy region admitted {} of {total}",
            run.allowed[busy]
        );
        assert!(
            total <= run.bound(),
            "{subject}: {total} > {:.1}",
            run.bound()
        );
        assert!(
            total >= 0.85 * run.bound(),
            "{subject}: quota stranded: {total} < 85% of {:.1}",
            run.bound()
        );
    }
    assert!(a[0] > 0.6 && b[2] > 0.6, "A's {a:?}, B's {b:?}");
    assert!(a.iter().sum::<f64>() <= 1.0 + 1e-9 && b.iter().sum::<f64>() <= 1.0 + 1e-9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_region_neither_errs_nor_lets_the_total_overrun() {
    let _serial = SERIAL.lock().await;
    let regions = start();
    regions.settle_even().await;
    let stopper = {
        let pid = regions.servers[2].pid();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let kill = |sig: &str| {
                std::process::Command::new("kill")
                    .args([format!("-{sig}"), pid.to_string()])
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false)
            };
            assert!(kill("STOP"));
            tokio::time::sleep(Duration::from_secs(4)).await;
            assert!(kill("CONT"));
        })
    };
    let run = drive(&regions, [1.0, 1.0, 1.0], 12.0).await;
    stopper.await.unwrap();
    let (total, bound) = (run.total() as f64, run.bound());
    eprintln!(
        "region 2 stopped 4 s: {run:?} total {total} bound {bound:.0} ({:.1}%) shares {:?}",
        100.0 * total / bound,
        regions.shares()
    );
    assert_eq!(run.errors, 0);
    assert!(run.local > 0, "the stopped region's pods never fell back");
    assert!(total <= 1.05 * bound, "{total} > 105% of {bound:.1}");
}

/// A region on a cluster beside one on a single server: the leader's lease, record and
/// counters live in the cluster (one hash tag), the peer reads them there, checks go to
/// the cluster, and the region's live pods are counted there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_on_a_cluster() {
    let _serial = SERIAL.lock().await;
    let nodes = start_cluster(Flavor::Valkey.or_selected());
    let server = Server::start(Flavor::Valkey.or_selected());
    let stores = vec![
        RegionTarget::Cluster(nodes.iter().map(Server::url).collect()),
        RegionTarget::Server(server.url()),
    ];
    let p = policy();
    let pods: Vec<RegionalLimiter> = (0..2)
        .map(|r| {
            RegionalLimiter::builder(r, stores.clone())
                .policy(&p)
                .rebalance_period(Duration::from_millis(400))
                .live_pods(Duration::from_secs(2))
                .limiter(|b| b.timeout(Duration::from_millis(500)))
                .build()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Even shares, and each region's one pod counted in its own store (the cluster too).
    while pods
        .iter()
        .any(|l| l.share("api") != Some(0.5) || l.live_pods() != Some(1))
    {
        let shares: Vec<_> = pods
            .iter()
            .map(|l| (l.share("api"), l.live_pods()))
            .collect();
        assert!(Instant::now() < deadline, "never even: {shares:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(pods.iter().all(RegionalLimiter::is_leader));
    // The cluster region's lease and record (and counters, once counted): on one node,
    // under one slot.
    let found: Vec<(usize, String)> = nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("rl:{region.0}*")
                .query(&mut n.conn())
                .unwrap();
            keys.into_iter().map(move |k| (i, k))
        })
        .collect();
    let names: std::collections::BTreeSet<&str> = found.iter().map(|(_, k)| k.as_str()).collect();
    for k in ["rl:{region.0}", "rl:{region.0}:leader"] {
        assert!(names.contains(k), "{k} not in the cluster: {found:?}");
    }
    assert!(
        found
            .iter()
            .all(|(i, k)| *i == found[0].0 && slot(k.as_bytes()) == slot(b"region.0")),
        "{found:?}"
    );
    // Half of 300/s burst 30 is the cluster region's: 15 at once, then 150/s of refill.
    let mut seen = Vec::new();
    let started = Instant::now();
    for _ in 0..40 {
        let d = pods[0].check_one(&p, "someone", 1).await.unwrap();
        seen.push((d.source, d.is_allowed()));
    }
    let most = 15.0 + 150.0 * started.elapsed().as_secs_f64();
    let admitted = seen.iter().filter(|(_, ok)| *ok).count();
    assert!(
        seen.iter()
            .all(|(s, _)| matches!(s, Source::Store | Source::DenyCache)),
        "{seen:?}"
    );
    assert!(
        (15..=most as usize).contains(&admitted),
        "{admitted} of {seen:?}, at most {most:.1}"
    );
}

/// Rule 3 on the real system: the busy region cannot read a stopped peer, so it does not
/// grow, although another region gave quota up; once the peer answers again, it grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_that_cannot_read_a_peer_does_not_grow() {
    let _serial = SERIAL.lock().await;
    let regions = start();
    regions.settle_even().await;
    let before = regions.shares()[0][0];
    regions.servers[2].signal("STOP");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (pods, stop) = (regions.pods[0].clone(), stop.clone());
        tokio::spawn(async move {
            let mut most: f64 = 0.0;
            while !stop.load(Relaxed) {
                for l in &pods {
                    most = most.max(l.share("api").unwrap_or(0.0));
                    most = most.max(l.share_for("api", "the-one-subject").unwrap_or(0.0));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            most
        })
    };
    let cut_off = drive(&regions, [80.0, 10.0, 10.0], 5.0).await;
    stop.store(true, Relaxed);
    let most = sampler.await.unwrap();
    let freed = regions.pods[1][0]
        .share_for("api", "the-one-subject")
        .unwrap_or(1.0);
    regions.servers[2].signal("CONT");
    let after = drive(&regions, [80.0, 10.0, 10.0], 6.0).await;
    let shares = regions.shares();
    eprintln!(
        "cut off: {cut_off:?}, busy share at most {most} (before {before}), region 1 at {freed}; \
         then {after:?} shares {shares:?}"
    );
    assert!(freed < before, "region 1 did not shrink: {freed}");
    assert!(
        most <= before,
        "grew while a peer was unreadable: {most} > {before}"
    );
    assert!(
        shares[0][0] > 0.5,
        "did not grow once it could read again: {shares:?}"
    );
    assert_eq!(cut_off.errors + after.errors, 0);
}

/// A floor of 0 (or one too large for the regions) is refused when the limiter is built:
/// a region at a share of 0 would have a policy with no rate at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_outside_its_range_is_refused_at_build() {
    let p = policy();
    let urls = ["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"];
    let build = |floor: f64| {
        RegionalLimiter::builder(0, urls)
            .policy(&p)
            .floor(floor)
            .build()
            .map(|_| ())
    };
    for bad in [0.0, -0.1, 0.6, f64::NAN] {
        let e = build(bad).expect_err("refused");
        assert!(e.to_string().contains("floor"), "{bad}: {e}");
    }
    assert!(build(0.5).is_ok());
    // More regions than parts of the whole: refused, not a panic.
    let many: Vec<String> = (0..1_000_001)
        .map(|_| "redis://127.0.0.1:1/".into())
        .collect();
    let e = RegionalLimiter::builder(0, many)
        .policy(&p)
        .floor(1e-9)
        .build()
        .map(|_| ())
        .expect_err("refused");
    assert!(e.to_string().contains("at most 1000000"), "{e}");
    assert!(build(1e-9).is_ok(), "a tiny floor is one part per million");
    // A sync timeout above a tick (a quarter period) would let the shares' leases lapse.
    let timeout = |t: Duration| {
        RegionalLimiter::builder(0, urls)
            .policy(&p)
            .rebalance_period(Duration::from_secs(2))
            .sync_timeout(t)
            .build()
            .map(|_| ())
    };
    let e = timeout(Duration::from_millis(501)).expect_err("refused");
    assert!(e.to_string().contains("sync_timeout"), "{e}");
    assert!(timeout(Duration::from_millis(500)).is_ok());
}

/// A cost no request could pass counts in the region's demand as the policy's burst. The
/// pods sum their demand on the store with `HINCRBY`, a signed 64-bit integer: uncapped, two
/// requests costing `i64::MAX` failed every sync round from then on (out of range), and the
/// region's pods lost their leases to the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impossible_cost_counts_as_the_burst_in_the_demand() {
    let _serial = SERIAL.lock().await;
    let s = Server::start(Flavor::Redis.or_selected());
    let p = policy();
    let l = RegionalLimiter::builder(0, [s.url()])
        .policy(&p)
        .rebalance_period(Duration::from_millis(400))
        .limiter(|b| b.timeout(Duration::from_millis(500)))
        .build()
        .unwrap();
    for _ in 0..2 {
        let d = l.check("k", &[(&p, i64::MAX as u64)]).await.unwrap();
        assert!(!d.is_allowed());
    }
    let mut c = s.conn();
    let want = Some(2 * BURST as u64);
    let deadline = Instant::now() + Duration::from_secs(10);
    let counted = loop {
        let n = counted(&mut c, "api");
        if n == want || Instant::now() >= deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(counted, want);
}

/// A peer region's cluster gone silent (packets dropped: every connect waits out its 1 s)
/// is connected by one task at a time: a task per sync round, each queued behind the last,
/// piled up for as long as the silence lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_cluster_is_connected_by_one_task_at_a_time() {
    if !Blackhole::usable() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let own = Server::start(Flavor::Redis.or_selected());
    let silent = Server::start(Flavor::Redis.or_selected());
    let _hole = Blackhole::ports(&[silent.port]);
    // The fault is real: a connect to the silent server is not answered.
    let fresh = redis::Client::open(silent.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_millis(300));
    assert!(fresh.is_err(), "the blackholed server answered");
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let before = tasks();
    let l = RegionalLimiter::builder(
        0,
        [
            RegionTarget::Server(own.url()),
            RegionTarget::Cluster(vec![silent.url()]),
        ],
    )
    .policy(&policy())
    .rebalance_period(Duration::from_millis(200)) // a round every 50 ms
    .limiter(|b| b.timeout(Duration::from_millis(500)))
    .build()
    .unwrap();
    let d = l.check_one(&policy(), "k", 1).await.unwrap();
    assert!(d.is_allowed());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let added = tasks().saturating_sub(before);
    // The sync task, the limiter's own, and at most one connect.
    assert!(added <= 6, "{added} tasks alive after 3 s of silence");
}

/// A region's leader gone while a peer is unreadable: the pod that takes the lease over
/// leads from the record (its share held), not from a first round that has measured no
/// demand yet (which read as none, cut the region to an even split, and rule 3 then kept it
/// there for as long as the peer stayed unreadable). Sampled every 10 ms, the leader's own
/// share never lapses to the floor either (its rounds, each slowed by the unreadable peer's
/// timeout, used to let its lease run out for a moment every round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_keeps_the_share_while_a_peer_is_unreadable() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let p = policy();
    let pod = |r: usize| {
        RegionalLimiter::builder(r, urls.clone())
            .policy(&p)
            .rebalance_period(Duration::from_millis(800))
            .limiter(|b| b.timeout(Duration::from_millis(300)))
            .build()
            .unwrap()
    };
    let mut region0 = vec![pod(0), pod(0)];
    let _others = [pod(1), pod(2)];
    // All the demand in region 0, through both its pods: its share grows toward 0.9.
    let drive = |pods: Vec<RegionalLimiter>, until: Instant| {
        let p = p.clone();
        tokio::spawn(async move {
            let mut i = 0usize;
            while Instant::now() < until {
                let _ = pods[i % pods.len()].check_one(&p, "busy", 1).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let load = drive(region0.clone(), deadline);
    while region0.iter().any(|l| l.share("api").unwrap_or(0.0) < 0.7) {
        assert!(Instant::now() < deadline, "region 0 never grew");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let grown = region0[0].share("api").unwrap();
    // Region 2 goes silent, then region 0's leader goes.
    let mut probe = servers[2].conn();
    probe
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    servers[2].signal("STOP");
    let stopped: redis::RedisResult<String> = redis::cmd("PING").query(&mut probe);
    let leader = region0.iter().position(RegionalLimiter::is_leader);
    let survivor = match leader {
        Some(i) => region0.remove(1 - i),
        None => {
            servers[2].signal("CONT");
            panic!("region 0 has no leader");
        }
    };
    load.abort();
    drop(region0);
    let until = Instant::now() + Duration::from_secs(8);
    let load = drive(vec![survivor.clone()], until);
    let mut lowest = f64::MAX;
    let mut led = false;
    while Instant::now() < until {
        if survivor.is_leader() {
            led = true;
            lowest = lowest.min(survivor.share("api").unwrap_or(0.0));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    servers[2].signal("CONT");
    load.abort();
    assert!(stopped.is_err(), "region 2 answered while stopped");
    assert!(led, "the surviving pod never took the lead");
    assert!(
        lowest >= grown - 0.05,
        "the new leader cut region 0 from {grown} to {lowest}"
    );
}

/// Three regions, one server each, rebalanced every `period`, forgetting after `idle`;
/// region 0 has two pods. Every pod is built with `api`.
fn forgetting_pods(
    servers: &[Server],
    period: Duration,
    idle: Duration,
) -> Vec<Vec<RegionalLimiter>> {
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let p = policy();
    let pod = |r: usize| {
        RegionalLimiter::builder(r, urls.clone())
            .policy(&p)
            .rebalance_period(period)
            .forget_idle(idle)
            .limiter(|b| b.timeout(Duration::from_millis(300)))
            .build()
            .unwrap()
    };
    vec![vec![pod(0), pod(0)], vec![pod(1)], vec![pod(2)]]
}

const TWO_SECONDS: Duration = Duration::from_secs(2);

fn tenant() -> Policy {
    Policy::builder("tenant-7")
        .per_second(LIMIT as u64)
        .burst(BURST as u64)
        .build()
        .unwrap()
}

/// A field of region 0's record.
fn recorded<T: redis::FromRedisValue>(c: &mut redis::Connection, field: &str) -> Option<T> {
    redis::cmd("HGET")
        .arg("rl:{region.0}")
        .arg(field)
        .query(c)
        .unwrap()
}

/// Region 0's demand counter of `policy`.
fn counted(c: &mut redis::Connection, policy: &str) -> Option<u64> {
    redis::cmd("HGET")
        .arg("rl:{region.0}:demand")
        .arg(policy)
        .query(c)
        .unwrap()
}

/// The fields region 0's store holds: its record's and its demand counters'.
fn region0_fields(server: &Server) -> (Vec<String>, Vec<String>) {
    let mut c = server.conn();
    let mut keys = |key: &str| -> Vec<String> {
        let mut f: Vec<String> = redis::cmd("HKEYS").arg(key).query(&mut c).unwrap();
        f.sort();
        f
    };
    (keys("rl:{region.0}"), keys("rl:{region.0}:demand"))
}

/// A policy met at run time (a tenant's, say) that region 0 used and then left idle: its
/// share there grows, then goes back to the floor, and every pod forgets it; the leader
/// deletes its figures from the record and its demand counter, so run-time policy names
/// do not pile up. The builder's policy, idle all along, is kept. Met again, the policy
/// starts at the floor and grows as a new one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_time_policy_is_forgotten_everywhere_and_met_again() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let pods = forgetting_pods(&servers, Duration::from_millis(400), TWO_SECONDS);
    let t = tenant();
    let region0 = pods[0].clone();
    let drive = |until: Instant| {
        let (pods, t) = (region0.clone(), t.clone());
        tokio::spawn(async move {
            let mut i = 0usize;
            while Instant::now() < until {
                let _ = pods[i % pods.len()].check_one(&t, "busy", 1).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let grown = |pods: &[RegionalLimiter]| {
        pods.iter()
            .all(|l| l.share("tenant-7").is_some_and(|s| s > 0.5))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let load = drive(deadline);
    while !grown(&region0) {
        assert!(Instant::now() < deadline, "region 0 never grew");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    load.abort();
    let (record, demand) = region0_fields(&servers[0]);
    assert!(record.contains(&"tenant-7:claim".to_string()), "{record:?}");
    assert_eq!(demand, ["tenant-7"]);

    // Idle: steered to the floor before it is forgotten. The record's last share, and the
    // last share a pod checked with while it led, are the floor (a follower drops its slot
    // in the round it first applies the floor, so it may never be seen there).
    let mut c = servers[0].conn();
    let mut last_led = None;
    let mut last_recorded = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now: Vec<Option<f64>> = region0.iter().map(|l| l.share("tenant-7")).collect();
        for (l, s) in region0.iter().zip(&now) {
            if l.is_leader() && s.is_some() {
                last_led = *s;
            }
        }
        let share: Option<u32> = recorded(&mut c, "tenant-7:share");
        last_recorded = share.or(last_recorded);
        if now.iter().all(Option::is_none) {
            break;
        }
        assert!(Instant::now() < deadline, "never forgotten: {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(last_led, Some(0.05), "the leader forgot it above the floor");
    assert_eq!(last_recorded, Some(50_000), "forgotten above the floor");
    // The leader deletes the fields right after dropping its slot.
    let deadline = Instant::now() + Duration::from_secs(5);
    let (record, demand) = loop {
        let (record, demand) = region0_fields(&servers[0]);
        if !record.iter().any(|f| f.starts_with("tenant-7:")) || Instant::now() > deadline {
            break (record, demand);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        !record.iter().any(|f| f.starts_with("tenant-7:")),
        "{record:?}"
    );
    assert!(record.contains(&"api:claim".to_string()), "{record:?}");
    assert!(!demand.contains(&"tenant-7".to_string()), "{demand:?}");
    for l in pods.iter().flatten() {
        assert!(
            l.share("api").is_some(),
            "the builder's policy was forgotten"
        );
    }

    // Met again: checked at the floor, then grown.
    let d = region0[0].check_one(&t, "busy", 1).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(region0[0].share("tenant-7"), Some(0.05));
    let deadline = Instant::now() + Duration::from_secs(20);
    let load = drive(deadline);
    while !grown(&region0) {
        assert!(Instant::now() < deadline, "region 0 never grew again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    load.abort();
}

/// A reservation held past `forget_idle` keeps its policy (its settlement corrects the
/// demand counted in the pod's slot); settled, the policy is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reservation_keeps_its_policy() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let pods = forgetting_pods(&servers, Duration::from_millis(400), TWO_SECONDS);
    let t = tenant();
    let pod = &pods[1][0];
    let held = pod.reserve("busy", &[(&t, 1)]).await.unwrap();
    assert!(held.decision().is_allowed());
    // Four times `forget_idle`, ten periods.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(pod.share("tenant-7"), Some(0.05), "forgotten while held");
    held.settle(2).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pod.share("tenant-7").is_some() {
        assert!(Instant::now() < deadline, "never forgotten once settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What region 0's leader has no slot for and nobody uses is cleaned too, where an earlier
/// leader or other pods left it:
/// - figures in the record with no demand counter: led and steered to the floor at once,
///   as any shrink is (a claim above the floor stays for the hold: sampled, each figure
///   only falls), then deleted;
/// - a demand counter with no figures (written by hand here, as another pod's checks would
///   make it): led like any policy (with no demand anywhere, at an even split), then, once
///   it has not moved for `forget_idle`, steered to the floor and deleted with the counter;
/// - and, for the policy one pod checked, that pod's slot and its counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_leader_never_met_is_cleaned() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let mut c = servers[0].conn();
    let entry = "held:s:00000000000000ab";
    let _: () = redis::cmd("HSET")
        .arg("rl:{region.0}")
        .arg(&[
            "ghost:claim",
            "50000",
            "ghost:share",
            "50000",
            "ghost:demand",
            "3.5",
        ])
        .arg(&[
            "held:claim",
            "700000",
            "held:share",
            "300000",
            "held:demand",
            "9",
        ])
        .arg(&[entry, "600000 300000 4 1"])
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("rl:{region.0}:demand")
        .arg(&["stray", "12"])
        .query(&mut c)
        .unwrap();
    // A 1.6 s period: a hold of 1.2 s, long enough to be seen however the host is loaded.
    let pods = forgetting_pods(&servers, Duration::from_millis(1_600), TWO_SECONDS);
    let t = tenant();
    for _ in 0..5 {
        pods[0][1].check_one(&t, "a", 1).await.unwrap();
    }
    let figure = |c: &mut redis::Connection, field: &str| -> Option<u32> {
        let v: Option<String> = recorded(c, field);
        v.and_then(|v| v.split(' ').next()?.parse().ok())
    };
    let mut seen: Vec<[Option<u32>; 3]> = Vec::new();
    // When the share was first and last seen at the floor under the claim still held.
    let mut held: Option<(Instant, Instant)> = None;
    let mut counted = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = ["held:claim", "held:share", entry].map(|f| figure(&mut c, f));
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        if now[0] == Some(700_000) && now[1] == Some(50_000) {
            let at = Instant::now();
            held = Some((held.map_or(at, |(first, _)| first), at));
        }
        let (record, demand) = region0_fields(&servers[0]);
        counted |= demand.contains(&"tenant-7".to_string());
        let left = |p: &str| record.iter().any(|f| f.starts_with(p));
        let done = !left("ghost:") && !left("held:") && !left("tenant-7:");
        if done && counted && demand.is_empty() && pods[0][1].share("tenant-7").is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not cleaned: {record:?} {demand:?} (counted: {counted})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The figures as they are now (they may have gone after the loop's last sample).
    let now = ["held:claim", "held:share", entry].map(|f| figure(&mut c, f));
    if seen.last() != Some(&now) {
        seen.push(now);
    }
    assert_eq!(seen.last(), Some(&[None; 3]));
    for pair in seen.windows(2) {
        for (before, after) in pair[0].iter().zip(&pair[1]) {
            let rises = match (before, after) {
                (Some(a), Some(b)) => b > a,
                (None, Some(_)) => true,
                _ => false,
            };
            assert!(!rises, "a figure rose: {seen:?}");
        }
    }
    // The share at the floor while the claim is still held above it, for most of the
    // hold (a deletion without the hold leaves milliseconds between the two writes).
    let (first, last) = held.unwrap_or_else(|| panic!("no held claim seen: {seen:?}"));
    assert!(
        last - first >= Duration::from_millis(200),
        "the claim held for {:?} only: {seen:?}",
        last - first
    );
}

/// A policy in region 0's record that its leader has no slot for, while other pods still
/// count demand for it (its counter moves; by hand here, about 100 a second): the leader
/// leads it from its counter. It starts from the record's figures, grows the share with
/// the demand it measures (region 0 alone has any), and publishes that demand; no claim
/// ever falls under its share. Once the counter has stood still for `forget_idle`, it
/// steers the policy to the floor, then deletes it and the counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_in_use_is_led_from_its_counter_until_idle() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let mut c = servers[0].conn();
    let entry = "busy:s:00000000000000ab";
    let _: () = redis::cmd("HSET")
        .arg("rl:{region.0}")
        .arg(&[
            "busy:claim",
            "600000",
            "busy:share",
            "400000",
            "busy:demand",
            "7",
        ])
        .arg(&[entry, "700000 500000 3 0"])
        .query(&mut c)
        .unwrap();
    // The first figure of a field (claim and share of an entry: its first two).
    // One HMGET: the figures of one write, never of two.
    let figures = |c: &mut redis::Connection| -> [Option<String>; 5] {
        let [claim, share, demand, e]: [Option<String>; 4] = redis::cmd("HMGET")
            .arg("rl:{region.0}")
            .arg(&["busy:claim", "busy:share", "busy:demand", entry])
            .query(c)
            .unwrap();
        [claim, share, demand, e.clone(), e]
    };
    let parsed = |f: &[Option<String>; 5]| -> [Option<f64>; 5] {
        let word = |v: &Option<String>, i: usize| {
            v.as_deref().and_then(|v| v.split(' ').nth(i)?.parse().ok())
        };
        [
            word(&f[0], 0),
            word(&f[1], 0),
            word(&f[2], 0),
            word(&f[3], 0),
            word(&f[4], 1),
        ]
    };
    let count = |c: &mut redis::Connection| {
        let _: () = redis::cmd("HINCRBY")
            .arg("rl:{region.0}:demand")
            .arg("busy")
            .arg(1)
            .query(c)
            .unwrap();
    };
    count(&mut c);
    // A 1.6 s period: a hold of 1.2 s, long enough to be seen however the host is loaded.
    let pods = forgetting_pods(&servers, Duration::from_millis(1_600), TWO_SECONDS);
    // In use for 6 s, three times `forget_idle`.
    let mut seen: Vec<[Option<f64>; 5]> = Vec::new();
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        count(&mut c);
        let now = parsed(&figures(&mut c));
        if seen.last() != Some(&now) {
            seen.push(now);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // [policy claim, share, demand, entry claim, entry share].
    let seeded = [
        Some(600_000.0),
        Some(400_000.0),
        Some(7.0),
        Some(700_000.0),
        Some(500_000.0),
    ];
    assert_eq!(seen.first(), Some(&seeded), "{seen:?}");
    for s in &seen {
        // Led from the record's figures, not from the floor: region 0 alone counts demand
        // for it, so its share only grows.
        assert!(
            s[1] >= Some(400_000.0),
            "the share fell under the record's: {seen:?}"
        );
        assert!(s[0] >= s[1], "a claim under its share: {seen:?}");
        assert!(
            s[3].is_none() || s[3] >= s[4],
            "an entry's claim under its share: {seen:?}"
        );
    }
    let last = seen.last().copied().unwrap_or_default();
    // Region 0 alone counts demand for it: all but the peers' floors.
    assert!(
        last[1].is_some_and(|s| s >= 850_000.0),
        "never grew with its counter: {seen:?}"
    );
    assert!(
        last[2].is_some_and(|d| d > 30.0),
        "the demand published is not the counter's: {seen:?}"
    );
    // No pod of region 0 met it: the leader led it without a slot.
    assert!(pods[0].iter().all(|l| l.share("busy").is_none()));

    // Idle: to the floor, then gone, the counter too.
    let mut floored = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = parsed(&figures(&mut c));
        floored |= now[1] == Some(50_000.0);
        let counter = counted(&mut c, "busy");
        if now.iter().all(Option::is_none) && counter.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never forgotten: {now:?} {counter:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(floored, "deleted without being steered to the floor");
}

/// `policy`'s entry fields in region 0's record.
fn entries(c: &mut redis::Connection, policy: &str) -> Vec<String> {
    let fields: Vec<String> = redis::cmd("HKEYS").arg("rl:{region.0}").query(c).unwrap();
    let prefix = format!("{policy}:s:");
    fields
        .into_iter()
        .filter(|f| f.starts_with(&prefix))
        .collect()
}

/// One step of the follower's load, about twice the limit on one subject and about a
/// tenth of it over ten quiet ones (`subject` the next): six checks of the busy subject,
/// one of `subject`; then no quiet subject has an entry.
async fn follower_step(
    follower: &RegionalLimiter,
    busy: &Policy,
    quiet: &Policy,
    subject: &str,
    c: &mut redis::Connection,
) {
    for _ in 0..6 {
        let _ = follower.check_one(busy, "busy", 1).await;
    }
    let _ = follower.check_one(quiet, subject, 1).await;
    let quiet_entries = entries(c, quiet.name());
    assert!(
        quiet_entries.is_empty(),
        "a quiet subject: {quiet_entries:?}"
    );
}

/// Run-time policies only one pod of region 0 checks, and not the region's leader pod:
/// the leader grows the region's share with the demand the other pod's checks count, and
/// that pod checks with it (before, it stayed at the floor while the other pod led). It
/// judges their subjects by the limit that pod reports with them: one subject at twice
/// the limit gets an entry; ten at most at a thirtieth of the limit each (under the floor's worth,
/// though each is a tenth of its policy's demand, and new ones every second) get none,
/// at any time (a first count over too short an interval once gave them entries for a
/// few rounds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_only_a_follower_checks_grows_with_its_demand() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    // A 1.6 s period: a lease of 1.6 s, which a loaded host does not let lapse.
    let pods = forgetting_pods(&servers, Duration::from_millis(1_600), TWO_SECONDS);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (leader, follower) = loop {
        match pods[0].iter().position(RegionalLimiter::is_leader) {
            Some(i) => break (&pods[0][i], &pods[0][1 - i]),
            None => assert!(Instant::now() < deadline, "region 0 has no leader"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (busy, quiet) = (
        tenant(),
        Policy::builder("tenant-8")
            .per_second(LIMIT as u64)
            .burst(BURST as u64)
            .build()
            .unwrap(),
    );
    let mut c = servers[0].conn();
    // Ten quiet subjects at a time, new ones every second: each batch's first count is
    // measured afresh, at a random phase of the pods' rounds against the leader's.
    let began = Instant::now();
    let quiet_subject = |i: usize| format!("q{}-{}", began.elapsed().as_secs(), i % 10);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 0usize;
    loop {
        follower_step(follower, &busy, &quiet, &quiet_subject(i), &mut c).await;
        i += 1;
        let share = follower.share("tenant-7");
        let hot = entries(&mut c, "tenant-7").iter().any(|f| {
            let figures: Option<String> = recorded(&mut c, f);
            figures.is_some_and(|v| v.ends_with(" 1"))
        });
        if share.is_some_and(|s| s >= 0.8) && hot {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower's share stayed at {share:?}, its subject hot: {hot}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A few more rounds of both, so that the quiet subjects are measured for a while.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        follower_step(follower, &busy, &quiet, &quiet_subject(i), &mut c).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Led all along by the other pod, which never met either policy.
    assert!(
        !follower.is_leader(),
        "leadership moved to the pod checking"
    );
    assert_eq!(leader.share("tenant-7"), None, "the leader pod met it");
    assert_eq!(leader.share("tenant-8"), None, "the leader pod met it");
    let recorded: Option<u32> = recorded(&mut c, "tenant-7:share");
    assert!(recorded.is_some_and(|s| s >= 800_000), "{recorded:?}");
    assert_eq!(entries(&mut c, "tenant-8"), Vec::<String>::new());
}

/// A run-time policy's idle clock outlives its leader. The record keeps when the region's
/// count last moved (`<policy>:still`, on the server's clock), and the pod that leads next
/// goes on from there: the figure it publishes is the one its predecessor published, not
/// the moment it took over, and the policy is forgotten `forget_idle` after its last check,
/// not after the leader change (before, each leader change started the clock again, so
/// rolling restarts could keep an idle policy for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_goes_on_with_the_idle_clock() {
    let _serial = SERIAL.lock().await;
    let servers = three_servers();
    let idle = Duration::from_secs(6);
    let mut pods = forgetting_pods(&servers, Duration::from_millis(400), idle);
    let mut c = servers[0].conn();
    let deadline = Instant::now() + Duration::from_secs(10);
    let leader = loop {
        if let Some(i) = pods[0].iter().position(RegionalLimiter::is_leader) {
            break i;
        }
        assert!(Instant::now() < deadline, "region 0 never had a leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let follower = 1 - leader;
    let t = tenant();
    // The follower checks the policy for a second; the leader meters its counter.
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        pods[0][follower].check_one(&t, "busy", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stopped = Instant::now();
    let still = |c: &mut redis::Connection| -> Option<(u64, u64)> {
        let v: Option<String> = recorded(c, "tenant-7:still");
        let (ms, count) = v?.split_once(' ').map(|(a, b)| (a.parse(), b.parse()))?;
        Some((ms.ok()?, count.ok()?))
    };
    // Until the leader has written the last count (the figure the record then keeps).
    let deadline = Instant::now() + Duration::from_secs(10);
    let before = loop {
        let first = still(&mut c);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (Some(a), b) = (first, still(&mut c)) else {
            assert!(Instant::now() < deadline, "no idle clock in the record");
            continue;
        };
        if Some(a) == b && counted(&mut c, "tenant-7") == Some(a.1) {
            break a;
        }
        assert!(Instant::now() < deadline, "the idle clock never settled");
    };
    // Half of `forget_idle` after the last check, the leader pod goes.
    tokio::time::sleep((stopped + idle / 2).saturating_duration_since(Instant::now())).await;
    let lease = |c: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET")
            .arg("rl:{region.0}:leader")
            .query(c)
            .unwrap()
    };
    let old = lease(&mut c);
    assert!(old.is_some(), "no lease held");
    drop(pods[0].remove(leader));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pods[0][0].is_leader() {
        assert!(Instant::now() < deadline, "the other pod never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let new = lease(&mut c);
    assert!(
        new.is_some() && new != old,
        "the lease did not change hands"
    );
    let changed = Instant::now();
    // A few rounds of the new leader's.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = still(&mut c).expect("the new leader dropped the idle clock");
    assert_eq!(after.1, before.1, "the count moved");
    assert!(
        after.0.abs_diff(before.0) <= 50,
        "the idle clock started again: {} ms after the old one",
        after.0 as i64 - before.0 as i64
    );
    // Forgotten by the new leader, and not before `forget_idle` after the last check.
    let deadline = Instant::now() + Duration::from_secs(20);
    while recorded::<String>(&mut c, "tenant-7:claim").is_some() {
        assert!(Instant::now() < deadline, "never forgotten");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(stopped.elapsed() >= idle, "forgotten early");
    // A clock started at the change would keep it until `forget_idle` after that.
    assert!(
        changed.elapsed() < idle,
        "kept {:?} after the leader change",
        changed.elapsed()
    );
    assert_eq!(counted(&mut c, "tenant-7"), None, "the counter stayed");
}
