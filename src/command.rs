//! `RL.CHECK` and `RL.CHECKALL`: parse the arguments, run the core, reply.
//!
//! Every argument is validated before any key is read, and every key is read before any is
//! written, so a bad input gets an error and changes nothing.

use crate::{stats, storage};
use redis_module::{raw, Context, NextArg, RedisError, RedisResult, RedisString, RedisValue};
use redis_ratelimit_core::{check, check_all, ticks_since_epoch, Check, Decision, Limit};
use std::collections::HashMap;
use std::ffi::c_long;
use std::time::{SystemTime, UNIX_EPOCH};

/// `RL.CHECK key rate burst [cost]` → `[allowed, remaining, retry_after_ms, reset_after_ms]`.
pub fn rl_check(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    counted(|| {
        if !(4..=5).contains(&args.len()) {
            return Err(RedisError::WrongArity);
        }
        let mut args = args.into_iter().skip(1);
        let key = args.next_arg()?;
        let limit = parse_limit(&args.next_arg()?, &args.next_arg()?)?;
        let cost = match args.next() {
            Some(cost) => parse_cost(&cost)?,
            None => 1,
        };
        let tat = storage::read(ctx, &key)?;
        let d = check(&limit, cost, tat, now());
        if d.changed {
            storage::write(ctx, &key, d.tat)?;
        }
        reply(ctx, &d);
        Ok((d.allowed, RedisValue::NoReply))
    })
}

/// `RL.CHECKALL key rate burst cost [key rate burst cost ...]` → one reply of `RL.CHECK` per
/// limit; tokens are taken from all buckets or from none.
pub fn rl_checkall(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    counted(|| {
        if args.len() < 5 || (args.len() - 1) % 4 != 0 {
            return Err(RedisError::WrongArity);
        }
        let mut keys: Vec<&RedisString> = Vec::new();
        // Key → bucket index once there are more than a few keys (linear search below that).
        let mut index: Option<HashMap<&[u8], usize>> = None;
        let mut checks = Vec::with_capacity((args.len() - 1) / 4);
        for quad in args.get(1..).unwrap_or_default().chunks_exact(4) {
            let [key, rate, burst, cost] = quad else {
                return Err(RedisError::WrongArity);
            };
            let limit = parse_limit(rate, burst)?;
            let cost = parse_cost(cost)?;
            // A key named twice is one bucket: the second limit sees the first one's take.
            let found = match &index {
                Some(map) => map.get(key.as_slice()).copied(),
                None => keys.iter().position(|k| k.as_slice() == key.as_slice()),
            };
            let bucket = found.unwrap_or_else(|| {
                keys.push(key);
                if let Some(map) = &mut index {
                    map.insert(key.as_slice(), keys.len() - 1);
                } else if keys.len() > 16 {
                    index = Some(
                        keys.iter()
                            .enumerate()
                            .map(|(i, k)| (k.as_slice(), i))
                            .collect(),
                    );
                }
                keys.len() - 1
            });
            checks.push(Check {
                limit,
                cost,
                bucket,
            });
        }
        let before = keys
            .iter()
            .map(|k| storage::read(ctx, k))
            .collect::<Result<Vec<u64>, _>>()?;
        let mut tats = before.clone();
        let (all, decisions) = check_all(&checks, &mut tats, now());
        for ((key, new), old) in keys.iter().zip(&tats).zip(&before) {
            if new != old {
                storage::write(ctx, key, *new)?;
            }
        }
        raw::reply_with_array(ctx.ctx, decisions.len() as c_long);
        for d in &decisions {
            reply(ctx, d);
        }
        Ok((all, RedisValue::NoReply))
    })
}

/// Runs a command body and counts its outcome for `INFO ratelimit`.
fn counted(body: impl FnOnce() -> Result<(bool, RedisValue), RedisError>) -> RedisResult {
    match body() {
        Ok((allowed, value)) => {
            stats::record(allowed);
            Ok(value)
        }
        Err(e) => {
            stats::record_error();
            Err(e)
        }
    }
}

/// The server host's wall clock, the clock key expiry runs on, in 100 ns ticks.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, ticks_since_epoch)
}

fn parse_limit(rate: &RedisString, burst: &RedisString) -> Result<Limit, RedisError> {
    let rate = std::str::from_utf8(rate.as_slice())
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or(RedisError::Str(
            "ERR rate must be a number (tokens per second)",
        ))?;
    let burst = parse_int(burst)
        .filter(|b| *b >= 1)
        .ok_or(RedisError::Str("ERR burst must be an integer >= 1"))?;
    Limit::new(rate, burst as u64).map_err(|e| RedisError::String(format!("ERR {e}")))
}

fn parse_cost(cost: &RedisString) -> Result<u64, RedisError> {
    parse_int(cost)
        .and_then(|c| u64::try_from(c).ok())
        .ok_or(RedisError::Str("ERR cost must be an integer >= 0"))
}

fn parse_int(s: &RedisString) -> Option<i64> {
    std::str::from_utf8(s.as_slice()).ok()?.parse().ok()
}

/// Writes `[allowed, remaining, retry_after_ms, reset_after_ms]` straight to the client
/// (no intermediate `RedisValue` tree: this is the hot path).
fn reply(ctx: &Context, d: &Decision) {
    let retry = d.retry_after_ms.map_or(-1, saturate);
    raw::reply_with_array(ctx.ctx, 4);
    for v in [
        i64::from(d.allowed),
        saturate(d.remaining),
        retry,
        saturate(d.reset_after_ms),
    ] {
        raw::reply_with_long_long(ctx.ctx, v);
    }
}

fn saturate(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
