//! The pure check, as the module and the client's local fallback run it.

use criterion::{criterion_group, criterion_main, Criterion};
use redis_ratelimit_core::{check, check_all, Check, Limit, TICKS_PER_SECOND};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let limit = Limit::new(100.0 / 60.0, 20).unwrap();
    let now = 1_700_000_000 * TICKS_PER_SECOND;
    c.bench_function("core::check (allowed)", |b| {
        b.iter(|| {
            check(
                black_box(&limit),
                black_box(1),
                black_box(now),
                black_box(now),
            )
        })
    });
    c.bench_function("core::check_all (3 limits)", |b| {
        let checks = [
            Check {
                limit,
                cost: 1,
                bucket: 0,
            },
            Check {
                limit,
                cost: 1,
                bucket: 1,
            },
            Check {
                limit,
                cost: 1,
                bucket: 2,
            },
        ];
        b.iter(|| {
            let mut tats = [now, now, now];
            check_all(black_box(&checks), &mut tats, black_box(now))
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
