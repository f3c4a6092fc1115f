//! A bucket in a key: reading it, writing it with its absolute expiry, and replicating the
//! effect. The layout itself is `redis_ratelimit_core::stored`.
//!
//! Writes replicate `SET key <value> PXAT <expiry>`, never the command: `RL.CHECK` reads the
//! clock, so a replica or an AOF replay running it again would compute another bucket. The
//! `SET` is deterministic, and a replica without the module follows it too.
//!
//! The value is one of 50 000 small integers (a linger class and a sub-millisecond phase).
//! How it is kept depends on the server (chosen at load, see `layout`):
//!
//! - **Shared** (Redis 7.0-8.0, Valkey 7.2-8.0: servers whose object header the module knows,
//!   and whose header passed the load-time probe): like Redis with its own shared integers,
//!   the module creates each value once, at load, marks it immutable, and lets every key point
//!   to it, so a bucket costs what any key with a TTL costs. The key is opened once, read
//!   with `StringDMA` and written with `StringSet` (see `Bucket`). A value the server
//!   integer-encoded (a `SET` from the Lua script or from replication) or embedded is copied
//!   into a raw string of the key's own by that read, 8 bytes more until the next write; the
//!   module API has no way to see the encoding first (README: "Stored format").
//! - **Server-encoded** (every other server, e.g. Valkey 8.1+, where the key is embedded in
//!   its value object so no key can point at a shared one; and any server while an LRU/LFU
//!   eviction policy may be on, since the recency stamp lives in the value object and a shared
//!   one would blur it for every key): the module writes no object header. It writes with
//!   the server's own `SET key value PXAT expiry` (`RedisModule_Call`, propagated: the very
//!   `SET` described above), so the server stores the value integer-encoded, as it
//!   does for `SET k 1`: the floor again. It reads the value with `GET` for the same reason:
//!   `StringDMA`, even in read mode, turns an integer-encoded value into a raw string in the
//!   keyspace, which costs memory until the next write. Both calls show in
//!   `INFO commandstats` as `set` and `get`.

use crate::call::CallReply;
use crate::server::ServerId;
use redis_module::{raw, Context, RedisError};
use redis_ratelimit_core::stored::{self, VALUES};
use std::ffi::{c_int, c_longlong, c_uint};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, Ordering::Relaxed};
use std::sync::OnceLock;

/// A key name from the running command's arguments (valid for the call).
pub(crate) type KeyName = *mut raw::RedisModuleString;

/// The shared value strings `"0"` ..= `"49999"`, created at load and never freed: keys keep
/// pointing at them, even after a `MODULE UNLOAD`. Also the `PXAT` argument of every `SET`
/// the module writes or replicates, on every server, so a write creates only the strings
/// of its key's new value and expiry (of the expiry alone where values are shared).
///
/// Created at load (about 2 MB, once per server) rather than on first use: creating one costs
/// more than a whole check, and a busy server would otherwise pay it on ~10 000 checks of each
/// linger class. Load fills the pool through `ValuePool::get` and fails if any value cannot be
/// created, so a command always finds its value there. A server that stores values by `SET`
/// never uses them, and gets none.
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
    /// Creates the pool; called from the module's `OnLoad`. Values are shared only on a
    /// server whose name and version the module knows (`layout`) and whose header
    /// passes the probe; the choice is logged.
    pub(crate) fn init(ctx: &Context, server: &ServerId) -> Result<(), RedisError> {
        if POOL.get().is_some() {
            return Ok(());
        }
        let shareable = server.known_header() && immutable_refcount_supported()?;
        if shareable {
            ctx.log_notice(&format!("ratelimit: {server}: bucket values shared"));
        } else {
            ctx.log_notice(&format!(
                "ratelimit: {server}: object header not known, bucket values stored by SET"
            ));
        }
        let create = api!(RedisModule_CreateString)?;
        // SAFETY: NULL context (not auto-freed), a 4-byte literal.
        let pxat = unsafe { create(ptr::null_mut(), c"PXAT".as_ptr(), 4) };
        if pxat.is_null() {
            return Err(RedisError::Str("could not allocate value pool"));
        }
        // Only where keys will share them: on a server that stores values by `SET` they
        // are never used (2 MB for nothing).
        let made = if shareable { VALUES } else { 0 };
        let values = (0..made).map(|_| AtomicPtr::new(ptr::null_mut())).collect();
        // Lost race impossible (OnLoad runs once on the main thread); ignore it anyway.
        let _ = POOL.set(ValuePool {
            values,
            pxat: AtomicPtr::new(pxat),
            shareable,
        });
        for value in 0..made {
            Self::get(value)?;
        }
        Ok(())
    }

    /// The shared string for `value`, created on its first call (at load, by `init`).
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

/// A bucket's key for the running command: the TAT read from it, and, where values are
/// shared, the key itself, opened once for reading and writing so that a write reuses it.
///
/// Opening a key for writing does not by itself tell the server it changed: the module sets
/// `REDISMODULE_OPTION_NO_IMPLICIT_SIGNAL_MODIFIED` at load (`server::declare_options`) and
/// [`Bucket::write`] signals the key. A refusal writes nothing, so it leaves `WATCH` and
/// client-side caching alone, as a read would. Unlike a read, a key opened for writing does
/// not count in `keyspace_hits`/`keyspace_misses` nor fire the `keymiss` event, on this shared
/// path; the server-encoded path reads with `GET`, which does both.
pub(crate) struct Bucket {
    name: KeyName,
    tat: u64,
    /// Open read-write where values are shared; `None` where the server's own `GET` and `SET`
    /// keep the value.
    key: Option<OpenKey>,
    /// Where values are shared, the bytes of the value the key holds (null for a new key):
    /// the shared value's own bytes exactly when the key holds that shared value itself.
    held: *const u8,
}

impl Bucket {
    /// Opens and reads the bucket in `name`; a missing key reads as TAT 0 (a full bucket).
    pub(crate) fn open(ctx: &Context, name: KeyName) -> Result<Bucket, RedisError> {
        if !may_share(ctx) {
            return Ok(Bucket {
                name,
                tat: read_by_call(ctx, name)?,
                key: None,
                held: ptr::null(),
            });
        }
        let k = OpenKey::open(
            ctx,
            name,
            (raw::REDISMODULE_READ | raw::REDISMODULE_WRITE) as c_int,
        )?
        .ok_or(RedisError::Str("ERR could not open the key"))?;
        let key_type = api!(RedisModule_KeyType)?;
        // SAFETY: `k` is open.
        let (tat, held) = match unsafe { key_type(k.0.as_ptr()) } as isize {
            raw::REDISMODULE_KEYTYPE_EMPTY => (0, ptr::null()),
            raw::REDISMODULE_KEYTYPE_STRING => read_shared(&k)?,
            _ => return Err(RedisError::WrongType),
        };
        Ok(Bucket {
            name,
            tat,
            key: Some(k),
            held,
        })
    }

    /// The TAT read when the bucket was opened, in ticks.
    pub(crate) fn tat(&self) -> u64 {
        self.tat
    }

    /// Stores TAT `tat` under linger class `class`, with its absolute expiry; tells the server
    /// the key changed and replicates the effect.
    pub(crate) fn write(&self, ctx: &Context, tat: u64, class: u8) -> Result<(), RedisError> {
        let s = stored::encode(tat, class);
        let expire = c_longlong::try_from(s.expire_at_ms)
            .map_err(|_| RedisError::Str("ERR expiry out of range"))?;
        match &self.key {
            Some(k) => {
                let value = ValuePool::get(s.value)?;
                // The key already points at this very value (the TAT moved by whole
                // milliseconds under the same class): only the expiry changes. Saves the
                // `StringSet`, which on a key that exists deletes it and adds it again
                // (about 2 600 instructions on Valkey 8.0, and a `new` keyspace event).
                let same = !self.held.is_null() && self.held == bytes_of(value)?;
                write_shared(ctx, k, self.name, (!same).then_some(value), expire)?;
                replicate(ctx, self.name, value, s.expire_at_ms)
            }
            // The server's SET replicates itself, as the same SET.
            None => write_by_call(ctx, self.name, s.value, s.expire_at_ms),
        }
    }
}

/// Reads a shared-layout value: the expiry and the value's digits give the TAT. Also returns
/// where those digits are (see `Bucket::held`).
fn read_shared(k: &OpenKey) -> Result<(u64, *const u8), RedisError> {
    let get_expire = api!(RedisModule_GetAbsExpire)?;
    let dma = api!(RedisModule_StringDMA)?;
    // SAFETY: `k` is open.
    let expire = unsafe { get_expire(k.0.as_ptr()) };
    let mut len = 0;
    // SAFETY: `k` is an open string key; read-mode access does not modify a RAW value.
    let p = unsafe { dma(k.0.as_ptr(), &mut len, raw::REDISMODULE_READ as c_int) };
    if p.is_null() {
        return Err(RedisError::Str("ERR could not read the key"));
    }
    // SAFETY: Redis guarantees `len` readable bytes at `p` while the key is open.
    let tat = decode(expire, unsafe {
        std::slice::from_raw_parts(p.cast::<u8>(), len)
    })?;
    Ok((tat, p.cast::<u8>().cast_const()))
}

/// Where the bytes of a (pooled) string are: what `StringDMA` returns for a key holding it.
fn bytes_of(s: *mut raw::RedisModuleString) -> Result<*const u8, RedisError> {
    let ptr_len = api!(RedisModule_StringPtrLen)?;
    let mut len = 0;
    // SAFETY: a live string of the pool.
    Ok(unsafe { ptr_len(s, &mut len) }.cast::<u8>())
}

/// Reads a server-encoded value with the server's `GET` (see the module docs for why).
fn read_by_call(ctx: &Context, name: KeyName) -> Result<u64, RedisError> {
    let Some(k) = OpenKey::open(ctx, name, raw::REDISMODULE_READ as c_int)? else {
        return Ok(0);
    };
    let key_type = api!(RedisModule_KeyType)?;
    // SAFETY: `k` is open.
    if unsafe { key_type(k.0.as_ptr()) } != raw::REDISMODULE_KEYTYPE_STRING as c_int {
        return Err(RedisError::WrongType);
    }
    let get_expire = api!(RedisModule_GetAbsExpire)?;
    // SAFETY: `k` is open.
    let expire = unsafe { get_expire(k.0.as_ptr()) };
    drop(k);
    let call = api!(RedisModule_Call)?;
    // SAFETY: live context, literal command and format; `name` is the command's argument.
    let reply = CallReply::new(unsafe { call(ctx.ctx, c"GET".as_ptr(), c"s".as_ptr(), name) })?;
    match reply.string()? {
        Some(value) => decode(expire, value),
        None => Ok(0),
    }
}

fn decode(expire: c_longlong, value: &[u8]) -> Result<u64, RedisError> {
    stored::decode(expire, value)
        .map_err(|e| RedisError::String(format!("ERR key is not a rate-limit bucket: {e}")))
}

/// Points the open key at the shared `value` (`None`: it points there already) and sets its
/// expiry, signals the change (the module option leaves that to the module) and fires the
/// keyspace events of the `SET key value PXAT expiry` it replicates, `set` then `expire`:
/// what a replica applying it fires, and what the server-encoded path's own `SET` fires.
/// The module API fires none by itself.
///
/// They are fired only where `notify-keyspace-events` asks for them: firing one costs about
/// 75 instructions on Redis 7.0 even when nobody listens, reading the setting about 5. So
/// another module's own subscription, which the module API cannot see, gets them only with
/// the setting on.
fn write_shared(
    ctx: &Context,
    k: &OpenKey,
    name: KeyName,
    value: Option<*mut raw::RedisModuleString>,
    expire: c_longlong,
) -> Result<(), RedisError> {
    let string_set = api!(RedisModule_StringSet)?;
    let set_expire = api!(RedisModule_SetAbsExpire)?;
    let signal = api!(RedisModule_SignalModifiedKey)?;
    let notify = api!(RedisModule_NotifyKeyspaceEvent)?;
    let notified = api!(RedisModule_GetNotifyKeyspaceEvents)?;
    // SAFETY: no arguments; reads the server's setting.
    let asked = unsafe { notified() };
    let fire = |kind: c_int, event: &std::ffi::CStr| {
        if asked & kind != 0 {
            // SAFETY: live context; `name` is the command's argument; a literal event name.
            unsafe { notify(ctx.ctx, kind, event.as_ptr(), name) };
        }
    };
    // `None`: the key holds the value already.
    if let Some(value) = value {
        // SAFETY: `k` is open for writing; the key takes its own reference to the string.
        if unsafe { string_set(k.0.as_ptr(), value) } != raw::REDISMODULE_OK as c_int {
            return Err(RedisError::Str("ERR could not write the key"));
        }
    }
    // Signalled as soon as the value changed, so that even a failed expiry below cannot leave
    // a changed key unsignalled to WATCH and client tracking.
    // SAFETY: live context; `name` is the command's argument.
    unsafe { signal(ctx.ctx, name) };
    fire(raw::REDISMODULE_NOTIFY_STRING, c"set");
    // SAFETY: `k` is open for writing and now holds a value.
    if unsafe { set_expire(k.0.as_ptr(), expire) } != raw::REDISMODULE_OK as c_int {
        return Err(RedisError::Str("ERR could not set the key's expiry"));
    }
    fire(raw::REDISMODULE_NOTIFY_GENERIC, c"expire");
    Ok(())
}

/// Writes `value` with the server's own `SET key value PXAT expiry`, which signals the key
/// and, called with `!`, replicates itself: the same `SET` that [`replicate`] would send,
/// without a second command lookup and argv.
fn write_by_call(ctx: &Context, name: KeyName, value: u32, expire: u64) -> Result<(), RedisError> {
    // The digits as a buffer: the argument the server builds from them is its own (refcount
    // 1), so SET may integer-encode it. A shared string would be stored as it is.
    let mut digits = [0u8; 20];
    let digits = decimal(value.into(), &mut digits);
    let mut at = [0u8; 20];
    let at = decimal(expire, &mut at);
    // The pooled token, not a C string the call would make a string of each time.
    let pxat = ValuePool::pxat().ok_or(RedisError::Str("ERR value pool missing"))?;
    let call = api!(RedisModule_Call)?;
    // SAFETY: live context; format "!sbsb": propagate the call, then (RedisModuleString*,
    // buffer and length, RedisModuleString*, buffer and length); the pooled token outlives
    // the call (the propagated command takes its own reference).
    let reply = CallReply::new(unsafe {
        call(
            ctx.ctx,
            c"SET".as_ptr(),
            c"!sbsb".as_ptr(),
            name,
            digits.as_ptr().cast::<std::ffi::c_char>(),
            digits.len(),
            pxat,
            at.as_ptr().cast::<std::ffi::c_char>(),
            at.len(),
        )
    })?;
    if reply.kind()? == raw::REDISMODULE_REPLY_ERROR {
        return Err(RedisError::Str("ERR could not write the key"));
    }
    Ok(())
}

/// Replicates the write as `SET key value PXAT expiry` (see the module docs).
fn replicate(
    ctx: &Context,
    name: KeyName,
    value: *mut raw::RedisModuleString,
    expire: u64,
) -> Result<(), RedisError> {
    let replicate = api!(RedisModule_Replicate)?;
    let pxat = ValuePool::pxat().ok_or(RedisError::Str("ERR value pool missing"))?;
    // The expiry's digits written here: the server's own `l` conversion costs about 150
    // instructions more (its `ll2string`, and on Redis 7.0 a second allocation).
    let mut at = [0u8; 20];
    let at = decimal(expire, &mut at);
    // SAFETY: format "sssb" matches (RedisModuleString* ×3, buffer and length); the pooled
    // strings outlive the call (the propagated command takes its own references).
    let replicated = unsafe {
        replicate(
            ctx.ctx,
            c"SET".as_ptr(),
            c"sssb".as_ptr(),
            name,
            value,
            pxat,
            at.as_ptr().cast::<std::ffi::c_char>(),
            at.len(),
        )
    };
    if replicated != raw::REDISMODULE_OK as c_int {
        return Err(RedisError::Str("ERR could not replicate the write"));
    }
    Ok(())
}

/// `value` in decimal, written into `buf` (20 bytes hold any `u64`); the digits written.
/// Two digits per division: an expiry has 13, and this runs on every write.
fn decimal(mut value: u64, buf: &mut [u8; 20]) -> &[u8] {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut start = buf.len();
    while value >= 10 {
        let pair = (value % 100) as usize * 2;
        value /= 100;
        start -= 2;
        if let (Some(to), Some(from)) = (buf.get_mut(start..start + 2), PAIRS.get(pair..pair + 2)) {
            to.copy_from_slice(from);
        }
    }
    // A last single digit (an odd count of digits), or the 0 of zero itself.
    if value > 0 || start == buf.len() {
        start -= 1;
        if let Some(slot) = buf.get_mut(start) {
            *slot = b'0' + value as u8;
        }
    }
    buf.get(start..).unwrap_or_default()
}

/// Whether values are shared now: on a server where the pool is shareable, unless maxmemory
/// is set with an eviction policy, since LRU and LFU keep each key's recency in its value
/// object.
fn may_share(ctx: &Context) -> bool {
    POOL.get().is_some_and(|p| p.shareable) && !crate::eviction::evicting(ctx)
}

/// Redis's marker for an object shared for good (`OBJ_SHARED_REFCOUNT`): `incrRefCount` and
/// `decrRefCount` leave such a count alone.
const OBJ_SHARED_REFCOUNT: i32 = i32::MAX;
/// Where `int refcount` sits in the object header of Redis 7.0-8.0 and Valkey 7.2-8.0, after
/// the 32-bit word of type, encoding and LRU bits.
const REFCOUNT_OFFSET: usize = 4;

/// Makes a pooled value immutable the way the server makes its own shared integers
/// (`makeObjectShared`).
///
/// Why: a shared object's ordinary count is not thread-safe. `FLUSHALL ASYNC` (and Valkey 8's
/// plain `FLUSHALL`, lazy by default) frees the old keyspace on a background thread, which
/// decrements the counts of every value while the main thread keeps incrementing them for new
/// buckets; a lost update could free a value keys still use. An immutable count is never
/// written by either thread. The module API has no call for this, so it writes the header,
/// and only on a server the name and version gate knows ([`crate::layout`]) where
/// [`immutable_refcount_supported`] also found the expected layout.
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
/// [`REFCOUNT_OFFSET`]: 1 when created, 2 after one retain. A second guard behind the name and
/// version gate ([`crate::layout`]): servers whose header is laid out otherwise (Valkey 8.1+
/// packs `hasexpire`/`hasembkey` bits below a bit-field count) fail it, but a fork with a flag
/// in the high bits of that word would pass it, which is why the gate comes first. Where
/// either says no, no value is shared and no header is written.
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

#[cfg(test)]
mod tests {
    use super::decimal;

    proptest::proptest! {
        /// The digits the module writes for a value or an expiry are `to_string`'s, so the
        /// replicated `SET` is byte for byte what the server's own conversion gave.
        #[test]
        fn decimal_is_to_string(v in proptest::num::u64::ANY) {
            let mut buf = [0u8; 20];
            let expected = v.to_string();
            proptest::prop_assert_eq!(decimal(v, &mut buf), expected.as_bytes());
        }
    }

    #[test]
    fn decimal_edges() {
        for v in [0, 9, 10, 1_796_309_398_400, u64::MAX] {
            let mut buf = [0u8; 20];
            assert_eq!(decimal(v, &mut buf), v.to_string().as_bytes());
        }
    }
}
