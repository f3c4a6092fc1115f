//! A bucket in a key: reading it, writing it with its absolute expiry, and replicating the
//! effect. The layout itself is `redis_ratelimit_core::stored`.
//!
//! Writes replicate `SET key <value> PXAT <expiry>`, never the command: `RL.CHECK` reads the
//! clock, so a replica or an AOF replay running it again would compute another bucket. The
//! `SET` is deterministic, and a replica without the module follows it too.
//!
//! The value is one of 50 000 small integers (a linger class and a sub-millisecond phase).
//! Like Redis with its own shared integers, the module creates each once, at load, marks it
//! immutable, and lets every key point to it, so a bucket costs what any key with a TTL
//! costs. Not when an LRU/LFU eviction policy may be on: the recency stamp lives in the value
//! object, and a shared one would blur it for every key (Redis stops sharing its integers then
//! too).

use redis_module::{raw, Context, RedisError};
use redis_ratelimit_core::stored::{self, VALUES};
use std::ffi::{c_int, c_longlong, c_uint};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, Ordering::Relaxed};
use std::sync::OnceLock;

/// A key name from the running command's arguments (valid for the call).
pub(crate) type KeyName = *mut raw::RedisModuleString;

/// The shared value strings `"0"` ..= `"49999"`, created at load and never freed: keys keep
/// pointing at them, even after a `MODULE UNLOAD`. Also the `PXAT` argument of the
/// replicated `SET`, so replicating creates only the expiry's string.
///
/// Created at load (about 2 MB, once per server) rather than on first use: creating one costs
/// more than a whole check, and a busy server would otherwise pay it on ~10 000 checks of each
/// linger class. `ValuePool::get` still creates one on demand should load-time creation have
/// failed part-way.
#[derive(Debug)]
pub struct ValuePool {
    /// Null until created. Only the main thread (at load, or inside a command) reads or writes
    /// them: the atomics just make the static safe to share without `unsafe impl Sync`.
    values: Box<[AtomicPtr<raw::RedisModuleString>]>,
    pxat: AtomicPtr<raw::RedisModuleString>,
    /// The values may be made immutable (see [`make_immutable`]) and go into keys.
    shareable: bool,
}

static POOL: OnceLock<ValuePool> = OnceLock::new();

impl ValuePool {
    /// Creates the pool; called from the module's `OnLoad`.
    pub fn init() -> Result<(), RedisError> {
        if POOL.get().is_some() {
            return Ok(());
        }
        let shareable = immutable_refcount_supported()?;
        let create = api!(RedisModule_CreateString)?;
        // SAFETY: NULL context (not auto-freed), a 4-byte literal.
        let pxat = unsafe { create(ptr::null_mut(), c"PXAT".as_ptr(), 4) };
        if pxat.is_null() {
            return Err(RedisError::Str("could not allocate value pool"));
        }
        let values = (0..VALUES)
            .map(|_| AtomicPtr::new(ptr::null_mut()))
            .collect();
        // Lost race impossible (OnLoad runs once on the main thread); ignore it anyway.
        let _ = POOL.set(ValuePool {
            values,
            pxat: AtomicPtr::new(pxat),
            shareable,
        });
        for value in 0..VALUES {
            Self::get(value)?;
        }
        Ok(())
    }

    /// The shared string for `value` (created if load-time creation missed it).
    fn get(value: u32) -> Result<*mut raw::RedisModuleString, RedisError> {
        let pool = POOL
            .get()
            .ok_or(RedisError::Str("ERR value pool missing"))?;
        let slot = usize::try_from(value)
            .ok()
            .and_then(|i| pool.values.get(i))
            .ok_or(RedisError::Str("ERR value out of range"))?;
        let existing = slot.load(Relaxed);
        if !existing.is_null() {
            return Ok(existing);
        }
        let printf = api!(RedisModule_CreateStringPrintf)?;
        // Printf makes a RAW-encoded string (CreateString would make EMBSTR): reading a RAW
        // value through StringDMA in read mode leaves it shared, an EMBSTR one would be
        // copied into the key.
        // SAFETY: NULL context (not auto-freed), a literal format taking one unsigned int.
        let s = unsafe { printf(ptr::null_mut(), c"%u".as_ptr(), value as c_uint) };
        let s = NonNull::new(s).ok_or(RedisError::Str("ERR could not allocate a value"))?;
        if pool.shareable {
            // SAFETY: a string just created by this module, layout probed at load.
            unsafe { make_immutable(s) };
        }
        slot.store(s.as_ptr(), Relaxed);
        Ok(s.as_ptr())
    }

    fn pxat() -> Option<*mut raw::RedisModuleString> {
        POOL.get().map(|p| p.pxat.load(Relaxed))
    }
}

/// An open key, closed on drop.
struct OpenKey(NonNull<raw::RedisModuleKey>);

impl OpenKey {
    fn open(ctx: &Context, key: KeyName, mode: c_int) -> Result<Option<Self>, RedisError> {
        let open = api!(RedisModule_OpenKey)?;
        // SAFETY: live context and key name of the running command.
        let k = unsafe { open(ctx.ctx, key, mode) };
        Ok(NonNull::new(k).map(Self))
    }
}

impl Drop for OpenKey {
    fn drop(&mut self) {
        // SAFETY: opened by RedisModule_OpenKey and closed exactly once, here.
        if let Some(close) = unsafe { raw::RedisModule_CloseKey } {
            unsafe { close(self.0.as_ptr()) };
        }
    }
}

/// Reads the bucket's TAT, in ticks; 0 for a missing key (a full bucket).
pub(crate) fn read(ctx: &Context, key: KeyName) -> Result<u64, RedisError> {
    let Some(k) = OpenKey::open(ctx, key, raw::REDISMODULE_READ as c_int)? else {
        return Ok(0);
    };
    let key_type = api!(RedisModule_KeyType)?;
    // SAFETY: `k` is open.
    if unsafe { key_type(k.0.as_ptr()) } != raw::REDISMODULE_KEYTYPE_STRING as c_int {
        return Err(RedisError::WrongType);
    }
    let dma = api!(RedisModule_StringDMA)?;
    let get_expire = api!(RedisModule_GetAbsExpire)?;
    let mut len = 0;
    // SAFETY: `k` is an open string key; read mode does not modify a RAW value.
    let p = unsafe { dma(k.0.as_ptr(), &mut len, raw::REDISMODULE_READ as c_int) };
    if p.is_null() {
        return Err(RedisError::Str("ERR could not read the key"));
    }
    // SAFETY: Redis guarantees `len` readable bytes at `p` while the key is open.
    let value = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    // SAFETY: `k` is open.
    let expire = unsafe { get_expire(k.0.as_ptr()) };
    stored::decode(expire, value)
        .map_err(|e| RedisError::String(format!("ERR key is not a rate-limit bucket: {e}")))
}

/// Stores the bucket's TAT, written under linger class `class`, with its absolute expiry, and
/// replicates the effect.
pub(crate) fn write(ctx: &Context, key: KeyName, tat: u64, class: u8) -> Result<(), RedisError> {
    let s = stored::encode(tat, class);
    let expire = c_longlong::try_from(s.expire_at_ms)
        .map_err(|_| RedisError::Str("ERR expiry out of range"))?;
    let string_set = api!(RedisModule_StringSet)?;
    let set_expire = api!(RedisModule_SetAbsExpire)?;
    let replicate = api!(RedisModule_Replicate)?;
    let k = OpenKey::open(
        ctx,
        key,
        (raw::REDISMODULE_READ | raw::REDISMODULE_WRITE) as c_int,
    )?
    .ok_or(RedisError::Str("ERR could not open the key for writing"))?;

    let value = ValuePool::get(s.value)?;
    let pooled = may_share(ctx).then_some(value);
    let set = match pooled {
        // SAFETY: `k` is open for writing; the key takes its own reference to the string.
        Some(value) => unsafe { string_set(k.0.as_ptr(), value) },
        None => {
            let printf = api!(RedisModule_CreateStringPrintf)?;
            let free = api!(RedisModule_FreeString)?;
            // SAFETY: live context, literal format taking one unsigned int; the key keeps its
            // own reference, so ours is released right after.
            unsafe {
                let value = printf(ctx.ctx, c"%u".as_ptr(), s.value as c_uint);
                let set = string_set(k.0.as_ptr(), value);
                free(ctx.ctx, value);
                set
            }
        }
    };
    if set != raw::REDISMODULE_OK as c_int {
        return Err(RedisError::Str("ERR could not write the key"));
    }
    // SAFETY: `k` is open for writing and now holds a value.
    if unsafe { set_expire(k.0.as_ptr(), expire) } != raw::REDISMODULE_OK as c_int {
        return Err(RedisError::Str("ERR could not set the key's expiry"));
    }
    drop(k);
    let pxat = ValuePool::pxat().ok_or(RedisError::Str("ERR value pool missing"))?;
    // SAFETY: format "sssl" matches (RedisModuleString* ×3, long long); the pooled strings
    // outlive the call (the propagated command takes its own references).
    let replicated = unsafe {
        replicate(
            ctx.ctx,
            c"SET".as_ptr(),
            c"sssl".as_ptr(),
            key,
            value,
            pxat,
            expire,
        )
    };
    if replicated != raw::REDISMODULE_OK as c_int {
        return Err(RedisError::Str("ERR could not replicate the write"));
    }
    Ok(())
}

/// Whether values may be shared: not when maxmemory is set with an eviction policy, since LRU
/// and LFU keep each key's recency in its value object.
fn may_share(ctx: &Context) -> bool {
    if !POOL.get().is_some_and(|p| p.shareable) {
        return false;
    }
    let Ok(flags) = api!(RedisModule_GetContextFlags) else {
        return false;
    };
    // SAFETY: live context.
    let flags = unsafe { flags(ctx.ctx) } as u32;
    let evicting = raw::REDISMODULE_CTX_FLAGS_MAXMEMORY | raw::REDISMODULE_CTX_FLAGS_EVICT;
    flags & evicting != evicting
}

/// Redis's marker for an object shared for good (`OBJ_SHARED_REFCOUNT`): `incrRefCount` and
/// `decrRefCount` leave such a count alone.
const OBJ_SHARED_REFCOUNT: i32 = i32::MAX;
/// Where `int refcount` sits in Redis 7.x's and Valkey 8.0's object header, after the 32-bit
/// word of type, encoding and LRU bits.
const REFCOUNT_OFFSET: usize = 4;

/// Makes a pooled value immutable the way the server makes its own shared integers
/// (`makeObjectShared`).
///
/// Why: a shared object's ordinary count is not thread-safe. `FLUSHALL ASYNC` (and Valkey 8's
/// plain `FLUSHALL`, lazy by default) frees the old keyspace on a background thread, which
/// decrements the counts of every value while the main thread keeps incrementing them for new
/// buckets; a lost update could free a value keys still use. An immutable count is never
/// written by either thread. The module API has no call for this, so it writes the header,
/// and only where [`immutable_refcount_supported`] found the expected layout.
///
/// # Safety
/// `s` must be a live string object created by this module on a server where the probe
/// passed.
unsafe fn make_immutable(s: NonNull<raw::RedisModuleString>) {
    // SAFETY: per the caller; the header is at least 8 bytes (robj is 16).
    unsafe {
        s.as_ptr()
            .cast::<u8>()
            .add(REFCOUNT_OFFSET)
            .cast::<i32>()
            .write_unaligned(OBJ_SHARED_REFCOUNT)
    };
}

/// Checks on a throwaway string that the running server keeps an `int refcount` at
/// [`REFCOUNT_OFFSET`]: 1 when created, 2 after one retain. Servers whose object header is laid
/// out otherwise (Redis 8 and Valkey 8.1 pack flags beside a bit-field count) fail the probe,
/// and then no value is shared: each key gets its own (more memory, never unsafe).
fn immutable_refcount_supported() -> Result<bool, RedisError> {
    let create = api!(RedisModule_CreateString)?;
    let retain = api!(RedisModule_RetainString)?;
    let free = api!(RedisModule_FreeString)?;
    // SAFETY: NULL context, 1-byte literal; the probe is released before returning.
    let probe = unsafe { create(ptr::null_mut(), c"p".as_ptr(), 1) };
    let Some(probe) = NonNull::new(probe) else {
        return Ok(false);
    };
    // SAFETY: reads 4 bytes inside the live object's 16-byte header.
    let count = || unsafe {
        probe
            .as_ptr()
            .cast::<u8>()
            .add(REFCOUNT_OFFSET)
            .cast::<i32>()
            .read_unaligned()
    };
    let fresh = count();
    // SAFETY: live string; retained once and released twice below.
    unsafe { retain(ptr::null_mut(), probe.as_ptr()) };
    let retained = count();
    // SAFETY: one release per reference taken.
    unsafe {
        free(ptr::null_mut(), probe.as_ptr());
        free(ptr::null_mut(), probe.as_ptr());
    }
    Ok(fresh == 1 && retained == 2)
}
