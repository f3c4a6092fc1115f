//! Whether the server may evict keys by recency (`maxmemory` set with an eviction policy),
//! under which values must not be shared (see [`crate::storage`]).
//!
//! Asked once at load and again whenever it may change: after every configuration change
//! (`maxmemory`, `maxmemory-policy`, `replica-ignore-maxmemory`) and every replication role
//! change (a replica ignoring `maxmemory` starts to evict when promoted), through those two
//! server events; not on every check: `RedisModule_GetContextFlags` computes all of the
//! server's flags, memory state included, which costs about 140 instructions, 1.5% of an
//! `RL.CHECK`. A server lacking either event is asked on every call.

use redis_module::{raw, Context, RedisError};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Not known: ask on every call.
const UNKNOWN: u8 = 0;
const KEEPS_ALL: u8 = 1;
const EVICTS: u8 = 2;

/// The answer as of the last configuration or role change, or [`UNKNOWN`].
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Whether keys may be evicted by recency now.
pub(crate) fn evicting(ctx: &Context) -> bool {
    match STATE.load(Relaxed) {
        KEEPS_ALL => false,
        EVICTS => true,
        _ => ask(ctx.ctx),
    }
}

/// Subscribes to configuration and role changes and takes the first answer; called last from
/// `OnLoad` (see `init`). Leaves the answer unknown (asked per call) where the server lacks
/// either event.
pub(crate) fn watch(ctx: &Context) -> Result<(), RedisError> {
    let event = |id| raw::RedisModuleEvent { id, dataver: 1 };
    let events = [
        (
            event(raw::REDISMODULE_EVENT_CONFIG),
            [raw::REDISMODULE_SUBEVENT_CONFIG_CHANGE].as_slice(),
        ),
        (
            event(raw::REDISMODULE_EVENT_REPLICATION_ROLE_CHANGED),
            [
                raw::REDISMODULE_EVENT_REPLROLECHANGED_NOW_MASTER,
                raw::REDISMODULE_EVENT_REPLROLECHANGED_NOW_REPLICA,
            ]
            .as_slice(),
        ),
    ];
    let (Ok(supported), Ok(subscribe)) = (
        api!(RedisModule_IsSubEventSupported),
        api!(RedisModule_SubscribeToServerEvent),
    ) else {
        return Ok(());
    };
    // SAFETY: plain values; the function only looks each pair up.
    let all_supported = events.iter().all(|&(event, subevents)| {
        subevents
            .iter()
            .all(|&sub| unsafe { supported(event, sub) } != 0)
    });
    if !all_supported {
        return Ok(());
    }
    for &(event, _) in &events {
        // SAFETY: OnLoad context; the callback has the signature the server calls.
        if unsafe { subscribe(ctx.ctx, event, Some(on_change)) } != raw::REDISMODULE_OK as c_int {
            // Half a watch would keep a stale answer: drop it (no callback unsubscribes) and
            // stay UNKNOWN.
            for &(event, _) in &events {
                // SAFETY: as above.
                unsafe { subscribe(ctx.ctx, event, None) };
            }
            return Ok(());
        }
    }
    remember(ctx.ctx);
    Ok(())
}

extern "C" fn on_change(
    ctx: *mut raw::RedisModuleCtx,
    _event: raw::RedisModuleEvent,
    _subevent: u64,
    _data: *mut c_void,
) {
    remember(ctx);
}

fn remember(ctx: *mut raw::RedisModuleCtx) {
    STATE.store(if ask(ctx) { EVICTS } else { KEEPS_ALL }, Relaxed);
}

/// Asks the server: both flags together mean a policy that may evict is in force.
fn ask(ctx: *mut raw::RedisModuleCtx) -> bool {
    let Ok(flags) = api!(RedisModule_GetContextFlags) else {
        // Cannot tell: behave as if evicting, which never shares a value.
        return true;
    };
    // SAFETY: a live context from the server (a command's, OnLoad's or an event's).
    let flags = unsafe { flags(ctx) } as u32;
    let evicting = raw::REDISMODULE_CTX_FLAGS_MAXMEMORY | raw::REDISMODULE_CTX_FLAGS_EVICT;
    flags & evicting == evicting
}
