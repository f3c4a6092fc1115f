//! Which servers the module knows the string-object header of, so that it may make its pooled
//! values immutable by writing that header (see `storage`). Pure: no module API, so the test
//! suite compiles this file on its own (`tests/layout.rs`).
//!
//! Known: every release line whose `object.c`/`server.h` was read and whose `int refcount` sits
//! at byte 4, after the 32-bit word of type, encoding and LRU bits:
//!
//! | server | lines | header |
//! |---|---|---|
//! | Redis | 7.0, 7.2, 7.4, 8.0 | `unsigned type:4, encoding:4, lru:24; int refcount; void *ptr;` |
//! | Valkey | 7.2, 8.0 | the same |
//!
//! Not known, so nothing is shared there: Valkey 8.1 and later (`refcount` is a 30-bit, then
//! 29-bit, field after `hasexpire`/`hasembkey` bits, and the key is embedded in the value
//! object, so a key cannot point at a shared value anyway), Redis 8.2 and later (not read),
//! anything older than 7.0, and any other name (a fork such as KeyDB keeps a flag in bit 31
//! of that word, which the load-time probe of the low bits alone would not see).

/// A version as `RedisModule_GetServerVersion` returns it: `0x00MMmmpp`.
pub(crate) fn version_parts(version: i32) -> (u8, u8, u8) {
    let [_, major, minor, patch] = version.to_be_bytes();
    (major, minor, patch)
}

/// The server's name from its `INFO server` fields: `server_name` where the server has one
/// (Valkey), else `redis` for a server that reports `redis_version` and no `server_name`.
/// `None` when neither is there.
pub(crate) fn server_name<'a>(
    server_name: Option<&'a str>,
    redis_version: Option<&str>,
) -> Option<&'a str> {
    match (server_name, redis_version) {
        (Some(name), _) => Some(name),
        (None, Some(_)) => Some("redis"),
        (None, None) => None,
    }
}

/// Whether `name` at `version` (`0x00MMmmpp`) is a release line whose object header the
/// module knows (table above). Names compare exactly: `redis`, `valkey`.
pub(crate) fn known_header(name: &str, version: i32) -> bool {
    let (major, minor, _) = version_parts(version);
    let line = (major, minor);
    match name {
        "redis" => matches!(line, (7, 0) | (7, 2) | (7, 4) | (8, 0)),
        "valkey" => matches!(line, (7, 2) | (8, 0)),
        _ => false,
    }
}
