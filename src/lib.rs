//! `redis-ratelimit`: a Redis / Valkey module adding `RL.CHECK` and `RL.CHECKALL`, an exact
//! token bucket checked and updated inside the server in one round trip.
//!
//! This file only registers the module. Argument parsing and replies live in [`command`], the
//! key layout, expiry and replication in [`storage`], the `INFO ratelimit` counters in
//! [`stats`], and the bucket math in the pure `redis-ratelimit-core` crate.
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

pub mod command;
pub mod stats;
pub mod storage;

fn init(ctx: &Context, _args: &[RedisString]) -> Status {
    match storage::ValuePool::init() {
        Ok(()) => Status::Ok,
        Err(e) => {
            ctx.log_warning(&format!("ratelimit: {e}"));
            Status::Err
        }
    }
}

// The macro's generated entry points (`RedisModule_OnLoad`, ...) carry no docs.
#[allow(missing_docs)]
mod entry_points {
    use super::{command, init};
    use redis_module::redis_module;

    redis_module! {
        name: "ratelimit",
        version: 1,
        allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
        data_types: [],
        init: init,
        commands: [
            // Key positions (first, last, step) let cluster clients route the commands and let the
            // server refuse a cross-slot RL.CHECKALL. ACL categories go in the optional slot: on
            // Redis 7.0, which cannot set them, a mandatory category would stop the module loading.
            ["rl.check", command::rl_check, "write deny-oom fast", 1, 1, 1,
                AclCategory::None, vec![AclCategory::Write, AclCategory::Fast]],
            ["rl.checkall", command::rl_checkall, "write deny-oom", 1, -1, 4,
                AclCategory::None, AclCategory::Write],
        ],
    }
}
