//! Exact token-bucket math for `redis-ratelimit`, with no I/O and no clock of its own.
//!
//! The bucket is kept as GCRA's *theoretical arrival time* (TAT): the instant at which the
//! bucket would be full again. A bucket with `burst` tokens refilled at `rate` tokens per
//! second is the same thing as a TAT that may run at most `burst / rate` seconds ahead of now;
//! taking `cost` tokens pushes the TAT `cost / rate` seconds further. One number is the whole
//! state, and "full" needs no state at all, which is why a Redis key holding a bucket can
//! simply expire soon after its TAT.
//!
//! All times are integer [ticks](TICKS_PER_SECOND) of 100 ns since the Unix epoch, and the time
//! per token is a whole number of ticks, so every step is exact integer arithmetic: no rounding
//! error accumulates and a burst from a full bucket admits exactly `burst` tokens. Absolute
//! times in ticks (~1.7 × 10^16) are above 2^53, but every quantity taken relative to the
//! current millisecond stays below it, so a Lua script (whose numbers are doubles) working
//! that way reproduces the same results bit for bit; see [`stored`] for the format shared
//! with that script.
//!
//! The Redis module (`RL.CHECK`, `RL.CHECKALL`, `RL.SETTLE`) and the client's local fallback
//! all call [`check`], [`check_all`] and [`settle`]. Time is always passed in.
//!
//! ```
//! use redis_ratelimit_core::{check, Limit, TICKS_PER_SECOND};
//!
//! // 100 per minute, burst 20.
//! let limit = Limit::per_period(100, std::time::Duration::from_secs(60), 20).unwrap();
//! let now = 1_700_000_000 * TICKS_PER_SECOND;
//! let mut tat = 0; // no state: a full bucket
//! for _ in 0..20 {
//!     let d = check(&limit, 1, tat, now);
//!     assert!(d.allowed);
//!     tat = d.tat;
//! }
//! let d = check(&limit, 1, tat, now);
//! assert!(!d.allowed);
//! assert_eq!(d.retry_after_ms, Some(600)); // one token every 0.6 s
//! ```
#![forbid(unsafe_code)]

use std::fmt;
use std::time::Duration;

pub mod args;
mod share;
pub mod stored;

pub use share::Share;

/// Ticks per second: the core's unit of time is 100 ns.
///
/// Fine enough that the time per token is a whole number of ticks with little rounding for the
/// rates limits use (less than `rate / 10^7` relative: < 0.01% at 1 000/s, though a rate just
/// under [`Limit::MAX_RATE`] rounds to half of it), coarse enough that the sub-millisecond part
/// of a TAT fits in 0..10 000 (see [`stored`]).
pub const TICKS_PER_SECOND: u64 = 10_000_000;
/// Ticks per millisecond.
pub const TICKS_PER_MS: u64 = 10_000;

/// Converts a time since the Unix epoch to ticks, rounding down (an earlier "now" is the
/// conservative side: it can only make the bucket look emptier).
pub fn ticks_since_epoch(since_epoch: Duration) -> u64 {
    // In u64 (no 128-bit division: this runs on every check), saturating past ~58 000 years.
    since_epoch
        .as_secs()
        .checked_mul(TICKS_PER_SECOND)
        .and_then(|t| t.checked_add(u64::from(since_epoch.subsec_nanos() / 100)))
        .unwrap_or(u64::MAX)
}

/// A validated limit: `burst` tokens of capacity, refilled one token every
/// [`interval`](Limit::interval_ticks) ticks.
///
/// GCRA calls the interval the *emission interval* `T` (the time one token takes to come back)
/// and `burst × T` the *delay variation tolerance* `τ` (how far ahead of now the TAT may run:
/// the time a fully drained bucket needs to refill).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    interval: u64,
    burst: u64,
}

impl Limit {
    /// The highest rate accepted, in tokens per second: one token per tick.
    pub const MAX_RATE: f64 = TICKS_PER_SECOND as f64;
    /// The longest refill time (`burst × interval`) accepted: 10^15 ticks, about 3.2 years.
    /// It keeps every value a Lua script handles below 2^53 and every sum far from overflow.
    pub const MAX_REFILL_TICKS: u64 = 1_000_000_000_000_000;

    /// A limit of `rate` tokens per second with a capacity of `burst` tokens.
    ///
    /// The time per token is `ceil(10^7 / rate)` ticks: rounded up, so the effective rate is
    /// never above the one asked for (exact for any rate that divides 10^7, such as 100/min;
    /// otherwise slower by less than `rate / 10^7` relative: at most 1 ppm below 10 tokens/s).
    pub fn new(rate: f64, burst: u64) -> Result<Self, LimitError> {
        if !rate.is_finite() {
            return Err(LimitError::RateNotFinite);
        }
        if rate <= 0.0 {
            return Err(LimitError::RateNotPositive);
        }
        if rate > Self::MAX_RATE {
            return Err(LimitError::RateTooHigh);
        }
        if burst == 0 {
            return Err(LimitError::BurstZero);
        }
        // Finite and positive here, so a quotient above the bound is the only failure; the
        // bound also keeps the `as` conversion exact.
        let interval = (Self::MAX_RATE / rate).ceil();
        if interval > Self::MAX_REFILL_TICKS as f64 {
            return Err(LimitError::RefillTooLong);
        }
        let interval = interval as u64;
        match burst.checked_mul(interval) {
            Some(tau) if tau <= Self::MAX_REFILL_TICKS => Ok(Self { interval, burst }),
            _ => Err(LimitError::RefillTooLong),
        }
    }

    /// A limit of `count` tokens per `period`, with a capacity of `burst` tokens
    /// ("100 per minute, burst 20").
    pub fn per_period(count: u64, period: Duration, burst: u64) -> Result<Self, LimitError> {
        Self::new(count as f64 / period.as_secs_f64(), burst)
    }

    /// Ticks for one token to come back (GCRA's emission interval `T`).
    pub fn interval_ticks(&self) -> u64 {
        self.interval
    }

    /// Capacity in tokens.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Ticks for an empty bucket to fill (`τ = burst × T`).
    pub fn refill_ticks(&self) -> u64 {
        self.burst * self.interval
    }

    /// The rate actually enforced, in tokens per second (at most the one asked for).
    pub fn effective_rate(&self) -> f64 {
        TICKS_PER_SECOND as f64 / self.interval as f64
    }

    /// The same limit with rate and burst divided by `parts` (rounding the burst down, to at
    /// least one token): one share of a limit split across sub-buckets or pods.
    pub fn split(&self, parts: u64) -> Result<Self, LimitError> {
        let parts = parts.max(1);
        let interval = self
            .interval
            .checked_mul(parts)
            .filter(|i| *i <= Self::MAX_REFILL_TICKS)
            .ok_or(LimitError::RefillTooLong)?;
        let burst = (self.burst / parts).max(1);
        match burst.checked_mul(interval) {
            Some(tau) if tau <= Self::MAX_REFILL_TICKS => Ok(Self { interval, burst }),
            _ => Err(LimitError::RefillTooLong),
        }
    }
}

/// Why a limit was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitError {
    /// The rate is NaN or infinite.
    RateNotFinite,
    /// The rate is zero or negative.
    RateNotPositive,
    /// The rate is above [`Limit::MAX_RATE`].
    RateTooHigh,
    /// The burst is zero.
    BurstZero,
    /// `burst / rate` is above [`Limit::MAX_REFILL_TICKS`].
    RefillTooLong,
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RateNotFinite => "rate must be a finite number",
            Self::RateNotPositive => "rate must be greater than 0",
            Self::RateTooHigh => "rate must be at most 10000000 tokens per second",
            Self::BurstZero => "burst must be at least 1",
            Self::RefillTooLong => "burst / rate is too long (at most 100000000 seconds)",
        })
    }
}

impl std::error::Error for LimitError {}

/// The longest a TAT may run ahead of now after [`settle`]: 2 × [`Limit::MAX_REFILL_TICKS`]
/// (about 6.3 years). Debt past it is refused, never wrapped, and every value a Lua script
/// handles stays below 2^53.
pub const MAX_LEAD_TICKS: u64 = 2 * Limit::MAX_REFILL_TICKS;

/// The latest `now` the bucket math uses (about 58 000 years after the epoch, less 25 years):
/// a later one is taken as this, so a TAT ahead of it, by debt or by a take, still fits in
/// 64 bits.
pub const MAX_NOW_TICKS: u64 = u64::MAX - 4 * MAX_LEAD_TICKS;

/// The outcome of one check against one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The bucket held at least `cost` tokens.
    pub allowed: bool,
    /// Whole tokens left after this check, rounded down; negative while the bucket is in
    /// debt (after [`settle`], or drained under a larger burst than the current one).
    pub remaining: i64,
    /// `Some(0)` when allowed; otherwise the wait in ms, rounded up, after which the same check
    /// is admitted (if nobody else takes tokens meanwhile). `None`: `cost > burst`, never.
    pub retry_after_ms: Option<u64>,
    /// Milliseconds until the bucket is full again (0 if full). The key itself lingers a
    /// little longer (see [`stored`]).
    pub reset_after_ms: u64,
    /// The bucket's TAT after this check, in ticks.
    pub tat: u64,
    /// The state changed and must be stored (`allowed` with a non-zero cost).
    pub changed: bool,
}

/// Checks `cost` tokens against a bucket whose TAT is `tat` (0, or anything not after `now`,
/// for a full bucket) at time `now`, and takes them if they are there.
///
/// A refused check changes nothing (`changed == false`); so does `cost == 0`, a peek. Their
/// `tat` is the bucket as read at `now`: the stored TAT, or `now` if that has passed (full).
///
/// A TAT more than `burst / rate` ahead of now is honoured, not clamped: it is debt charged by
/// [`settle`], a bucket drained under a larger burst than this limit's, or a server clock that
/// stepped back. The check is refused until refill has brought the bucket back within this
/// limit, and `retry_after_ms` says exactly when that is.
pub fn check(limit: &Limit, cost: u64, tat: u64, now: u64) -> Decision {
    evaluate(limit, cost, tat, now, true)
}

fn evaluate(limit: &Limit, cost: u64, tat: u64, now: u64, take: bool) -> Decision {
    let now = now.min(MAX_NOW_TICKS);
    let tau = limit.refill_ticks();
    let tat = tat.max(now);
    let used = tat - now; // the bucket's deficit, in ticks
    let (allowed, retry_after_ms) = if cost > limit.burst {
        (false, None)
    } else if cost == 0 {
        // A peek always fits, also in debt: it reports the state and takes nothing.
        (true, Some(0))
    } else {
        // Ticks the bucket is short of `cost` tokens (`used + cost × T − τ`), 0 when they are
        // there. `cost × T <= τ` here, so this form cannot overflow, even for a TAT near
        // `u64::MAX` (a saturating sum would understate the wait there).
        let short = used.saturating_sub(tau - cost * limit.interval);
        if short == 0 {
            (true, Some(0))
        } else {
            (false, Some(short.div_ceil(TICKS_PER_MS)))
        }
    };
    let changed = take && allowed && cost > 0;
    // Allowed means `used + cost × T <= τ`, and `now <= MAX_NOW_TICKS`: no overflow.
    let new_tat = if changed {
        tat + cost * limit.interval
    } else {
        tat
    };
    decision(limit, allowed, retry_after_ms, new_tat, now, changed)
}

fn decision(
    limit: &Limit,
    allowed: bool,
    retry_after_ms: Option<u64>,
    tat: u64,
    now: u64,
    changed: bool,
) -> Decision {
    let deficit = tat - now;
    let tau = limit.refill_ticks();
    // floor((τ − deficit) / T) in 64 bits: whole tokens left, or the debt rounded up (a TAT
    // far past any real debt saturates at i64::MIN).
    let remaining = if deficit <= tau {
        ((tau - deficit) / limit.interval) as i64 // at most the burst
    } else {
        i64::try_from((deficit - tau).div_ceil(limit.interval)).map_or(i64::MIN, |d| -d)
    };
    Decision {
        allowed,
        remaining,
        retry_after_ms,
        reset_after_ms: if deficit == 0 {
            0
        } else {
            stored::full_at_ms(tat) - now / TICKS_PER_MS
        },
        tat,
        changed,
    }
}

/// Charges (`delta > 0`) or refunds (`delta < 0`) tokens after the fact, unconditionally.
///
/// A charge may take the bucket past empty into debt: `remaining` goes negative, and
/// [`check`] refuses until refill has repaid it. A refund never fills the bucket beyond full.
/// `delta == 0` is a peek. Always `allowed`, with `retry_after_ms == Some(0)`.
///
/// Fails, changing nothing, when the debt would put the TAT more than [`MAX_LEAD_TICKS`]
/// ahead of now.
pub fn settle(limit: &Limit, delta: i64, tat: u64, now: u64) -> Result<Decision, SettleError> {
    let now = now.min(MAX_NOW_TICKS);
    let tat = tat.max(now);
    let new_tat = if delta >= 0 {
        delta
            .unsigned_abs()
            .checked_mul(limit.interval)
            .and_then(|ticks| tat.checked_add(ticks))
            .filter(|t| t - now <= MAX_LEAD_TICKS || delta == 0)
            .ok_or(SettleError::DebtTooLarge)?
    } else {
        let back = delta.unsigned_abs().saturating_mul(limit.interval);
        tat.saturating_sub(back).max(now)
    };
    Ok(decision(limit, true, Some(0), new_tat, now, new_tat != tat))
}

/// Why [`settle`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettleError {
    /// The debt would put the bucket more than [`MAX_LEAD_TICKS`] behind.
    DebtTooLarge,
}

impl fmt::Display for SettleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DebtTooLarge => {
                "delta would put the bucket in debt for more than 200000000 seconds"
            }
        })
    }
}

impl std::error::Error for SettleError {}

/// One limit of a multi-limit check: `cost` tokens from the bucket at index `bucket` of the
/// state slice given to [`check_all`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// The limit this bucket is checked against.
    pub limit: Limit,
    /// Tokens to take.
    pub cost: u64,
    /// Index of the bucket's TAT in the state slice. Two checks may name the same bucket: the
    /// second then sees the first one's tokens as taken.
    pub bucket: usize,
}

/// Checks several limits as one all-or-nothing step: tokens are taken from every bucket only
/// if every bucket has room, otherwise nothing is taken anywhere.
///
/// `tats` holds each distinct bucket's TAT and is updated in place only when all are allowed.
/// Returns whether all were allowed, and one decision per check, in order. A decision's
/// `allowed` says whether that bucket had room (after earlier checks of this call on the same
/// bucket); when the whole step is refused, `remaining` and `reset_after_ms` describe the
/// buckets untouched and no decision is `changed`.
///
/// A `bucket` index outside `tats` is treated as a full bucket that is not stored.
pub fn check_all(checks: &[Check], tats: &mut [u64], now: u64) -> (bool, Vec<Decision>) {
    let mut tentative = tats.to_vec();
    let mut decisions = Vec::with_capacity(checks.len());
    let mut all = true;
    for c in checks {
        let tat = tentative.get(c.bucket).copied().unwrap_or(0);
        let d = evaluate(&c.limit, c.cost, tat, now, true);
        if let Some(slot) = tentative.get_mut(c.bucket).filter(|_| d.changed) {
            *slot = d.tat;
        }
        all &= d.allowed;
        decisions.push(d);
    }
    if all {
        tats.copy_from_slice(&tentative);
    } else {
        for (d, c) in decisions.iter_mut().zip(checks) {
            let tat = tats.get(c.bucket).copied().unwrap_or(0);
            let untouched = evaluate(&c.limit, c.cost, tat, now, false);
            d.remaining = untouched.remaining;
            d.reset_after_ms = untouched.reset_after_ms;
            d.tat = untouched.tat;
            d.changed = false;
        }
    }
    (all, decisions)
}

#[cfg(test)]
mod tests;
