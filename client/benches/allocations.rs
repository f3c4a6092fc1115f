//! Heap allocations per check, through the public `check` path on a real server: a check
//! answered by the store (the module's `RL.CHECKALL`), a deny-cache hit, and a local
//! fallback answer. Counted with a counting global allocator around the system one (every
//! thread: the connection's driver task included), so the figures repeat exactly from run
//! to run, unlike times on a shared machine. Run: `cargo bench -p redis-ratelimit-client
//! --bench allocations`.

use redis_ratelimit_client::{Limiter, Policy, Source};
use redis_ratelimit_testkit::{Flavor, Server};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        // SAFETY: as for `dealloc`, and `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const N: u64 = 10_000;

/// Allocations and bytes per call of `f`, over `N` calls after 1 000 to warm up.
async fn per_check<F, Fut>(mut f: F) -> (f64, f64)
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..1_000 {
        f(i).await;
    }
    let (a, b) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    for i in 0..N {
        f(1_000 + i).await;
    }
    let per = |now: u64, before: u64| (now - before) as f64 / N as f64;
    (per(ALLOCS.load(Relaxed), a), per(BYTES.load(Relaxed), b))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = Server::start(Flavor::Redis);
    let policy = Policy::builder("api")
        .per_minute(100)
        .burst(20)
        .build()
        .expect("policy");
    rt.block_on(async {
        let l = Limiter::builder(server.url())
            .timeout(Duration::from_millis(500))
            .build()
            .expect("limiter");
        assert!(
            l.ready(Duration::from_secs(5)).await,
            "server never answered"
        );
        // A fresh subject per check: every one allowed, from the store. Named beforehand,
        // so the bench's own formatting is not counted.
        let subjects: Vec<String> = (0..1_000 + N).map(|i| format!("s{i}")).collect();
        let store = per_check(|i| {
            let (l, policy, subjects) = (&l, &policy, &subjects);
            async move {
                let subject = subjects.get(i as usize).expect("named");
                let d = l.check_one(policy, subject, 1).await.expect("check");
                assert_eq!(d.source, Source::Store);
            }
        })
        .await;
        // One subject, exhausted: the deny cache answers.
        for _ in 0..25 {
            l.check_one(&policy, "hog", 1).await.expect("check");
        }
        let denied = per_check(|_| {
            let (l, policy) = (&l, &policy);
            async move {
                let d = l.check_one(policy, "hog", 1).await.expect("check");
                assert_eq!(d.source, Source::DenyCache);
            }
        })
        .await;
        println!("allocations per check (bytes), {N} checks after 1000 to warm up:");
        println!("  store, allowed   {:6.1} ({:.0} B)", store.0, store.1);
        println!("  deny-cache hit   {:6.1} ({:.0} B)", denied.0, denied.1);
    });
}
