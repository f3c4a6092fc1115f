//! `redis-ratelimit`: a Redis / Valkey module adding `RL.CHECK`, `RL.CHECKALL` and
//! `RL.SETTLE`, an exact token bucket checked and updated inside the server in one round trip.
//!
//! This file only registers the module. The commands' registration, argument parsing and
//! replies live in [`command`], the key layout, expiry and replication in [`storage`] (with
//! `layout`: which servers' object header it knows), what the module declares to the server
//! and needs from it in `server`, the `INFO ratelimit` counters in [`stats`], and the bucket
//! math in the pure `redis-ratelimit-core` crate.
// Unit tests build without the entry points, so most of the module is unreachable there.
#![cfg_attr(test, allow(dead_code))]
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

use redis_module::{Context, RedisString, Status};

/// Fetches a module API function pointer, or fails with an error instead of the panic an
/// `unwrap` would bring into the server.
macro_rules! api {
    ($name:ident) => {
        // SAFETY: the pointers are written once by RedisModule_Init, before any command runs.
        unsafe { redis_module::raw::$name }.ok_or(redis_module::RedisError::Str(concat!(
            "ERR this server lacks ",
            stringify!($name)
        )))
    };
}

mod call;
pub mod command;
mod eviction;
mod layout;
mod limits;
mod server;
pub mod stats;
pub mod storage;

fn init(ctx: &Context, _args: &[RedisString]) -> Status {
    // The server event subscriptions come last: Redis before 7.2.4 keeps a failed module's
    // listeners, which would then call into unloaded code.
    let server = server::ServerId::read(ctx);
    match server::declare_options(ctx, &server)
        .and_then(|()| server::require_commands(ctx))
        .and_then(|()| storage::ValuePool::init(ctx, &server))
        .and_then(|()| command::register(ctx))
        .and_then(|()| eviction::watch(ctx))
    {
        Ok(()) => Status::Ok,
        Err(e) => {
            ctx.log_warning(&format!("ratelimit: {e}"));
            Status::Err
        }
    }
}

// The macro's generated entry points (`RedisModule_OnLoad`, ...) carry no docs. Left out of
// unit tests: its global allocator is the server's, which a test binary does not have.
#[cfg(not(test))]
#[allow(missing_docs)]
mod entry_points {
    use super::init;
    use redis_module::redis_module;

    redis_module! {
        name: "ratelimit",
        version: 1,
        allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
        data_types: [],
        init: init,
    }
}
