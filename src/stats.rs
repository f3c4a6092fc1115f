//! Counters shown by `INFO ratelimit` (section `ratelimit_stats`): checks (`RL.CHECK`,
//! `RL.CHECKALL`), their outcomes, settles and errors.
//!
//! Process-wide by nature, like the server's own `INFO stats`; relaxed atomics because they are
//! only ever read for display.

use redis_module::{InfoContext, RedisResult};
use redis_module_macros::info_command_handler;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static CHECKS: AtomicU64 = AtomicU64::new(0);
static ALLOWED: AtomicU64 = AtomicU64::new(0);
static DENIED: AtomicU64 = AtomicU64::new(0);
static ERRORS: AtomicU64 = AtomicU64::new(0);
static SETTLES: AtomicU64 = AtomicU64::new(0);

/// Counts one answered call (`RL.CHECK`, or `RL.CHECKALL` as a whole).
pub fn record(allowed: bool) {
    CHECKS.fetch_add(1, Relaxed);
    if allowed {
        ALLOWED.fetch_add(1, Relaxed)
    } else {
        DENIED.fetch_add(1, Relaxed)
    };
}

/// Counts one answered `RL.SETTLE` (always applied: `_applied` is for the dispatcher's shape).
pub fn record_settle(_applied: bool) {
    SETTLES.fetch_add(1, Relaxed);
}

/// Counts one call answered with an error.
pub fn record_error() {
    ERRORS.fetch_add(1, Relaxed);
}

#[info_command_handler]
fn add_info(ctx: &InfoContext, _for_crash_report: bool) -> RedisResult<()> {
    ctx.builder()
        .add_section("stats")
        .field("checks", CHECKS.load(Relaxed))?
        .field("allowed", ALLOWED.load(Relaxed))?
        .field("denied", DENIED.load(Relaxed))?
        .field("errors", ERRORS.load(Relaxed))?
        .field("settles", SETTLES.load(Relaxed))?
        .build_section()?
        .build_info()?;
    Ok(())
}
