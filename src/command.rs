//! `RL.CHECK`, `RL.CHECKALL` and `RL.SETTLE`: parse the arguments, run the core, reply.
//!
//! Every argument is validated before any key is read, and every key is read before any is
//! written, so a bad input gets an error and changes nothing.

use crate::storage::Bucket;
use crate::{limits, stats, storage};
use redis_module::{raw, Context, RedisError};
use redis_ratelimit_core::{args, check, check_all, settle, ticks_since_epoch, Check, Decision};
use std::collections::HashMap;
use std::ffi::{c_int, c_long, CStr};
use std::ptr::NonNull;
use std::time::{SystemTime, UNIX_EPOCH};

/// One argument of the running command, borrowed from the server's `argv` without the
/// retain/release (and `Vec`) that `redis_module`'s command macro spends on every call.
#[repr(transparent)]
#[derive(Debug)]
pub struct Arg(NonNull<raw::RedisModuleString>);

impl Arg {
    /// The argument's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: reading a function pointer set once by RedisModule_Init.
        let Some(ptr_len) = (unsafe { raw::RedisModule_StringPtrLen }) else {
            return &[];
        };
        let mut len = 0;
        // SAFETY: a live argument of the running command; the bytes live as long as it.
        let p = unsafe { ptr_len(self.0.as_ptr(), &mut len) };
        if p.is_null() {
            return &[];
        }
        // SAFETY: `len` readable bytes at `p` for the duration of the command.
        unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }
    }

    fn key(&self) -> storage::KeyName {
        self.0.as_ptr()
    }
}

/// Registers the commands. Key positions (first, last, step) let cluster clients route them
/// and let the server refuse a cross-slot `RL.CHECKALL`. ACL categories are set where the
/// server can (7.2+, Valkey 8); Redis 7.0 cannot give module commands categories.
pub fn register(ctx: &Context) -> Result<(), RedisError> {
    let create = api!(RedisModule_CreateCommand)?;
    type Cmd = (
        &'static CStr,
        raw::RedisModuleCmdFunc,
        &'static CStr,
        c_int,
        c_int,
        c_int,
        &'static CStr,
    );
    let commands: [Cmd; 3] = [
        (
            c"rl.check",
            Some(rl_check),
            c"write deny-oom fast",
            1,
            1,
            1,
            c"write fast",
        ),
        (
            c"rl.checkall",
            Some(rl_checkall),
            c"write deny-oom",
            1,
            -1,
            4,
            c"write",
        ),
        (
            c"rl.settle",
            Some(rl_settle),
            c"write deny-oom fast",
            1,
            1,
            1,
            c"write fast",
        ),
    ];
    for (name, handler, flags, first, last, step, acl) in commands {
        // SAFETY: OnLoad context; static C strings.
        let created = unsafe {
            create(
                ctx.ctx,
                name.as_ptr(),
                handler,
                flags.as_ptr(),
                first,
                last,
                step,
            )
        };
        if created != raw::REDISMODULE_OK as c_int {
            return Err(RedisError::Str("could not create the commands"));
        }
        // SAFETY: reading function pointers set once by RedisModule_Init.
        let (get, set) = unsafe {
            (
                raw::RedisModule_GetCommand,
                raw::RedisModule_SetCommandACLCategories,
            )
        };
        if let (Some(get), Some(set)) = (get, set) {
            // SAFETY: OnLoad context, the command just created, a static category list.
            let cmd = unsafe { get(ctx.ctx, name.as_ptr()) };
            if cmd.is_null() || unsafe { set(cmd, acl.as_ptr()) } != raw::REDISMODULE_OK as c_int {
                return Err(RedisError::Str(
                    "could not set the commands' ACL categories",
                ));
            }
        }
    }
    Ok(())
}

extern "C" fn rl_check(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    dispatch(ctx, argv, argc, check_one)
}

extern "C" fn rl_checkall(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    dispatch(ctx, argv, argc, check_many)
}

extern "C" fn rl_settle(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
) -> c_int {
    context_call(ctx, argv, argc, settle_one, stats::record_settle)
}

/// Runs a command body: it replies itself on success; errors are replied here and counted.
fn dispatch(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
    body: impl FnOnce(&Context, &[Arg]) -> Result<bool, RedisError>,
) -> c_int {
    context_call(ctx, argv, argc, body, stats::record)
}

/// Runs a command body and counts its outcome with `record`. Generic, not function
/// pointers, so each command's body is compiled into its entry point.
fn context_call(
    ctx: *mut raw::RedisModuleCtx,
    argv: *mut *mut raw::RedisModuleString,
    argc: c_int,
    body: impl FnOnce(&Context, &[Arg]) -> Result<bool, RedisError>,
    record: impl FnOnce(bool),
) -> c_int {
    let context = Context::new(ctx);
    let args: &[Arg] = match usize::try_from(argc) {
        // SAFETY: the server passes `argc` non-null arguments that outlive the call; `Arg` is
        // a transparent wrapper of the pointer.
        Ok(n) if !argv.is_null() => unsafe { std::slice::from_raw_parts(argv.cast::<Arg>(), n) },
        _ => &[],
    };
    match body(&context, args) {
        Ok(allowed) => record(allowed),
        Err(e) => {
            stats::record_error();
            context.reply(Err(e));
        }
    }
    raw::REDISMODULE_OK as c_int
}

/// `RL.CHECK key rate burst [cost]` → `[allowed, remaining, retry_after_ms, reset_after_ms]`.
fn check_one(ctx: &Context, args: &[Arg]) -> Result<bool, RedisError> {
    check_single(ctx, args, false)
}

/// One limit checked: `RL.CHECK`, or with `in_array` a one-limit `RL.CHECKALL`, whose reply is
/// the same decision inside an array of one. Nothing is replied before the bucket is written,
/// so an error is the whole reply.
fn check_single(ctx: &Context, args: &[Arg], in_array: bool) -> Result<bool, RedisError> {
    let (key, rate, burst, cost) = match args {
        [_, key, rate, burst] => (key, rate, burst, None),
        [_, key, rate, burst, cost] => (key, rate, burst, Some(cost)),
        _ => return Err(RedisError::WrongArity),
    };
    let parsed = parse_limit(rate, burst)?;
    let cost = match cost {
        Some(cost) => parse_cost(cost)?,
        None => 1,
    };
    let bucket = Bucket::open(ctx, key.key())?;
    let d = check(&parsed.limit, cost, bucket.tat(), now());
    if d.changed {
        bucket.write(ctx, d.tat, parsed.class)?;
    }
    if in_array {
        raw::reply_with_array(ctx.ctx, 1);
    }
    reply(ctx, &d);
    Ok(d.allowed)
}

/// `RL.SETTLE key rate burst delta` → `[1, remaining, 0, reset_after_ms]`: charges `delta`
/// tokens unconditionally (into debt if need be) or, when negative, refunds them up to full.
fn settle_one(ctx: &Context, args: &[Arg]) -> Result<bool, RedisError> {
    let [_, key, rate, burst, delta] = args else {
        return Err(RedisError::WrongArity);
    };
    let parsed = parse_limit(rate, burst)?;
    let delta = args::delta(delta.bytes()).map_err(refused)?;
    let bucket = Bucket::open(ctx, key.key())?;
    let d = settle(&parsed.limit, delta, bucket.tat(), now())
        .map_err(|e| RedisError::String(format!("ERR {e}")))?;
    if d.changed {
        bucket.write(ctx, d.tat, parsed.class)?;
    }
    reply(ctx, &d);
    Ok(true)
}

/// `RL.CHECKALL key rate burst cost [key rate burst cost ...]` → one reply of `RL.CHECK` per
/// limit; tokens are taken from all buckets or from none.
fn check_many(ctx: &Context, args: &[Arg]) -> Result<bool, RedisError> {
    // One limit, the common case (a policy with a single rate): `RL.CHECK`'s path, without the
    // bucket table's vectors (about 2 000 instructions of a 9 000-instruction call).
    if args.len() == 5 {
        return check_single(ctx, args, true);
    }
    {
        if args.len() < 5 || !(args.len() - 1).is_multiple_of(4) {
            return Err(RedisError::WrongArity);
        }
        let mut keys: Vec<&Arg> = Vec::new();
        // Each bucket is written with the longest linger of the limits naming it.
        let mut classes: Vec<u8> = Vec::new();
        // Key → bucket index once there are more than a few keys (linear search below that).
        let mut index: Option<HashMap<&[u8], usize>> = None;
        let mut checks = Vec::with_capacity((args.len() - 1) / 4);
        for quad in args.get(1..).unwrap_or_default().chunks_exact(4) {
            let [key, rate, burst, cost] = quad else {
                return Err(RedisError::WrongArity);
            };
            let parsed = parse_limit(rate, burst)?;
            let cost = parse_cost(cost)?;
            // A key named twice is one bucket: the second limit sees the first one's take.
            let found = match &index {
                Some(map) => map.get(key.bytes()).copied(),
                None => keys.iter().position(|k| k.bytes() == key.bytes()),
            };
            let bucket = found.unwrap_or_else(|| {
                keys.push(key);
                classes.push(0);
                if let Some(map) = &mut index {
                    map.insert(key.bytes(), keys.len() - 1);
                } else if keys.len() > 16 {
                    index = Some(
                        keys.iter()
                            .enumerate()
                            .map(|(i, k)| (k.bytes(), i))
                            .collect(),
                    );
                }
                keys.len() - 1
            });
            if let Some(class) = classes.get_mut(bucket) {
                *class = (*class).max(parsed.class);
            }
            checks.push(Check {
                limit: parsed.limit,
                cost,
                bucket,
            });
        }
        let buckets = keys
            .iter()
            .map(|k| Bucket::open(ctx, k.key()))
            .collect::<Result<Vec<Bucket>, _>>()?;
        let mut tats: Vec<u64> = buckets.iter().map(Bucket::tat).collect();
        let (all, decisions) = check_all(&checks, &mut tats, now());
        for ((bucket, new), class) in buckets.iter().zip(&tats).zip(&classes) {
            if *new != bucket.tat() {
                bucket.write(ctx, *new, *class)?;
            }
        }
        raw::reply_with_array(ctx.ctx, decisions.len() as c_long);
        for d in &decisions {
            reply(ctx, d);
        }
        Ok(all)
    }
}

/// The server host's wall clock, the clock key expiry runs on, in 100 ns ticks.
///
/// Where the server exports it (Redis 7.2+, Valkey), this is the time the server read when
/// it started the command (`RedisModule_CachedMicroseconds`): the instant it judges key
/// expiry by, already paid for, and one for all of a `MULTI` or a script, as it is for
/// expiry. Elsewhere the module reads the clock itself.
fn now() -> u64 {
    // SAFETY: reading a function pointer set once by RedisModule_Init (null if the server
    // lacks the call).
    if let Some(cached) = unsafe { raw::RedisModule_CachedMicroseconds } {
        // SAFETY: takes no arguments; valid inside a command.
        let us = unsafe { cached() };
        return u64::try_from(us).map_or(0, |us| us.saturating_mul(TICKS_PER_US));
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, ticks_since_epoch)
}

/// Ticks (100 ns) per microsecond.
const TICKS_PER_US: u64 = 10;

fn parse_limit(rate: &Arg, burst: &Arg) -> Result<limits::Parsed, RedisError> {
    limits::limit(rate.bytes(), burst.bytes()).map_err(refused)
}

fn parse_cost(cost: &Arg) -> Result<u64, RedisError> {
    args::cost(cost.bytes()).map_err(refused)
}

fn refused(e: args::ArgError) -> RedisError {
    RedisError::String(format!("ERR {e}"))
}

/// Writes `[allowed, remaining, retry_after_ms, reset_after_ms]` straight to the client
/// (no intermediate `RedisValue` tree: this is the hot path).
fn reply(ctx: &Context, d: &Decision) {
    let retry = d.retry_after_ms.map_or(-1, saturate);
    raw::reply_with_array(ctx.ctx, 4);
    for v in [
        i64::from(d.allowed),
        d.remaining,
        retry,
        saturate(d.reset_after_ms),
    ] {
        raw::reply_with_long_long(ctx.ctx, v);
    }
}

fn saturate(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
