//! The regions' and live pods' metrics, read through a debugging recorder (thread-local:
//! this test runs on one thread, and so do the tasks it spawns).

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use redis_ratelimit_client::pods::LivePods;
use redis_ratelimit_client::region::RegionalLimiter;
use redis_ratelimit_client::Policy;
use redis_ratelimit_testkit::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "current_thread")]
async fn shares_rebalances_figure_age_led_policies_hot_subjects_and_pods_are_reported() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let servers: Vec<Server> = (0..2)
        .map(|_| Server::start(Flavor::Valkey.or_selected()))
        .collect();
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let p = Policy::builder("api")
        .per_second(100)
        .burst(10)
        .build()
        .unwrap();
    let regions: Vec<RegionalLimiter> = (0..2)
        .map(|r| {
            RegionalLimiter::builder(r, urls.clone())
                .policy(&p)
                .rebalance_period(Duration::from_millis(200))
                .limiter(|b| b.timeout(Duration::from_millis(500)))
                .build()
                .unwrap()
        })
        .collect();
    let pods = LivePods::builder(urls[0].clone())
        .ttl(Duration::from_secs(1))
        .interval(Duration::from_millis(100))
        .timeout(Duration::from_millis(300))
        .start(regions[0].limiter())
        .unwrap();
    // The shares settle where the demand puts them (all of it in region 0), together the
    // whole limit, and the region's one pod is counted.
    let settled = |regions: &[RegionalLimiter]| {
        let sum: f64 = regions.iter().filter_map(|l| l.share("api")).sum();
        (sum - 1.0).abs() < 1e-6
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !settled(&regions) || pods.count() != Some(1) {
        assert!(
            Instant::now() < deadline,
            "shares never summed to the whole, or no pod count: {:?} {:?}",
            regions.iter().map(|l| l.share("api")).collect::<Vec<_>>(),
            pods.count()
        );
        regions[0].check_one(&p, "k", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut share = Vec::new();
    let (mut durations, mut ages, mut led, mut live) = (0, Vec::new(), Vec::new(), None);
    for (k, _, _, v) in snapshotter.snapshot().into_vec() {
        let key = k.key();
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_string())
        };
        match (key.name(), v) {
            ("ratelimit_region_share", DebugValue::Gauge(g)) => {
                share.push((label("region"), label("policy"), g.into_inner()));
            }
            ("ratelimit_region_rebalance_duration_seconds", DebugValue::Histogram(h)) => {
                durations += h.len();
            }
            ("ratelimit_region_figure_age_seconds", DebugValue::Gauge(g)) => {
                ages.push(g.into_inner());
            }
            ("ratelimit_region_led_policies", DebugValue::Gauge(g)) => {
                led.push((label("region"), g.into_inner()));
            }
            ("ratelimit_live_pods", DebugValue::Gauge(g)) => live = Some(g.into_inner()),
            _ => {}
        }
    }
    share.sort_by(|a, b| a.0.cmp(&b.0));
    // The gauges say what the pods apply (read again if a round moved them in between).
    let api = Some("api".to_string());
    let applied: Vec<_> = (0..2)
        .map(|r| {
            (
                Some(r.to_string()),
                api.clone(),
                regions[r].share("api").unwrap(),
            )
        })
        .collect();
    if share != applied && !reported_again(&snapshotter, &regions) {
        panic!("gauges {share:?}, applied {applied:?}");
    }
    assert!(durations > 0, "no rebalance duration recorded");
    // Peers are read every round (50 ms here): the oldest figure used is recent.
    assert_eq!(ages.len(), 2);
    assert!(ages.iter().all(|a| a.is_finite() && *a < 5.0), "{ages:?}");
    // Each region's leader (its one pod) leads `api` alone.
    led.sort_by(|a, b| a.0.cmp(&b.0));
    let one = |r: &str| (Some(r.to_string()), 1.0);
    assert_eq!(led, [one("0"), one("1")]);
    assert_eq!(live, Some(1.0));

    // "k", checked only in region 0, is its hottest subject: region 0 gives it an entry,
    // and region 1 tracks it too.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        regions[0].check_one(&p, "k", 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut hot = Vec::new();
        for (k, _, _, v) in snapshotter.snapshot().into_vec() {
            if let ("ratelimit_region_hot_subjects", DebugValue::Gauge(g)) = (k.key().name(), v) {
                hot.push(g.into_inner());
            }
        }
        if hot == [1.0, 1.0] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "hot subjects per region: {hot:?}"
        );
    }

    // A policy met at run time in region 0 only: led there, not in region 1.
    let tenant = Policy::builder("tenant-7")
        .per_second(10)
        .burst(5)
        .build()
        .unwrap();
    regions[0].check_one(&tenant, "k", 1).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut led = Vec::new();
        for (k, _, _, v) in snapshotter.snapshot().into_vec() {
            if let ("ratelimit_region_led_policies", DebugValue::Gauge(g)) = (k.key().name(), v) {
                let region = k.key().labels().find(|l| l.key() == "region");
                led.push((region.map(|l| l.value().to_string()), g.into_inner()));
            }
        }
        led.sort_by(|a, b| a.0.cmp(&b.0));
        if led == [(Some("0".to_string()), 2.0), (Some("1".to_string()), 1.0)] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "policies led per region: {led:?}"
        );
    }
}

/// Whether, read again within a few rounds, the share gauges match what the pods apply.
fn reported_again(snapshotter: &Snapshotter, regions: &[RegionalLimiter]) -> bool {
    (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        let mut share: Vec<(String, f64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(k, _, _, v)| match (k.key().name(), v) {
                ("ratelimit_region_share", DebugValue::Gauge(g)) => k
                    .key()
                    .labels()
                    .find(|l| l.key() == "region")
                    .map(|l| (l.value().to_string(), g.into_inner())),
                _ => None,
            })
            .collect();
        share.sort_by(|a, b| a.0.cmp(&b.0));
        let applied: Vec<(String, f64)> = (0..regions.len())
            .map(|r| (r.to_string(), regions[r].share("api").unwrap_or(0.0)))
            .collect();
        share == applied
    })
}
