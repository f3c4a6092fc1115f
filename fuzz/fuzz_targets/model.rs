//! The core's check and settle against a reference model written the other way round: a
//! token level in exact 128-bit arithmetic rather than a TAT. Any limit the module accepts,
//! any stored state, any clock, any sequence of checks and settles: same answers, same state.
#![no_main]

use libfuzzer_sys::fuzz_target;
use redis_ratelimit_core::{check, settle, Limit, TICKS_PER_MS};

/// The reference: the bucket's deficit (ticks of refill it lacks), never negative.
struct Model {
    interval: u128,
    tau: u128,
}

struct Answer {
    allowed: bool,
    remaining: i128,
    retry_after_ms: Option<u128>,
    reset_after_ms: u128,
    tat: u128,
}

impl Model {
    fn answer(&self, allowed: bool, retry: Option<u128>, tat: u128, now: u128) -> Answer {
        let deficit = tat - now;
        let left = self.tau as i128 - deficit as i128;
        Answer {
            allowed,
            remaining: left.div_euclid(self.interval as i128),
            retry_after_ms: retry,
            // The key is full at the next whole millisecond of the server's clock.
            reset_after_ms: if deficit == 0 {
                0
            } else {
                tat.div_ceil(TICKS_PER_MS as u128) - now / TICKS_PER_MS as u128
            },
            tat,
        }
    }

    fn check(&self, cost: u128, tat: u128, now: u128) -> Answer {
        let tat = tat.max(now);
        let need = cost * self.interval;
        if need > self.tau {
            return self.answer(false, None, tat, now);
        }
        if cost == 0 || (tat - now) + need <= self.tau {
            return self.answer(true, Some(0), tat + need, now);
        }
        let short = (tat - now) + need - self.tau;
        self.answer(false, Some(short.div_ceil(TICKS_PER_MS as u128)), tat, now)
    }

    fn settle(&self, delta: i128, tat: u128, now: u128) -> Answer {
        let tat = tat.max(now);
        let moved = tat as i128 + delta * self.interval as i128;
        self.answer(true, Some(0), (moved.max(now as i128)) as u128, now)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut words = data.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    });
    let mut next = || words.next();
    let (Some(rate_bits), Some(burst), Some(tat), Some(now)) = (next(), next(), next(), next())
    else {
        return;
    };
    let rate = f64::from_bits(rate_bits);
    let Ok(limit) = Limit::new(rate, burst) else {
        return;
    };
    let model = Model {
        interval: u128::from(limit.interval_ticks()),
        tau: u128::from(limit.refill_ticks()),
    };
    let mut tat = tat;
    let mut now = now >> 2; // a clock far from overflow
    while let (Some(step), Some(amount)) = (next(), next()) {
        now += step % (10 * limit.refill_ticks().max(1));
        let (got, want) = if step & 1 == 0 {
            let cost = amount % (limit.burst() + 2);
            let d = check(&limit, cost, tat, now);
            (
                d,
                model.check(u128::from(cost), u128::from(tat), u128::from(now)),
            )
        } else {
            let delta = (amount as i64) % (4 * limit.burst() as i64 + 1);
            let Ok(d) = settle(&limit, delta, tat, now) else {
                continue; // debt beyond the format's bound: refused, nothing changed
            };
            (
                d,
                model.settle(i128::from(delta), u128::from(tat), u128::from(now)),
            )
        };
        assert_eq!(got.allowed, want.allowed);
        assert_eq!(
            i128::from(got.remaining),
            want.remaining.max(i128::from(i64::MIN))
        );
        assert_eq!(got.retry_after_ms.map(u128::from), want.retry_after_ms);
        assert_eq!(u128::from(got.reset_after_ms), want.reset_after_ms);
        assert_eq!(u128::from(got.tat), want.tat);
        tat = got.tat;
    }
});
