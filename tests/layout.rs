//! The gate on the module's object-header write: which (name, version) pairs it lets share
//! values. `src/layout.rs` uses no module API, so it is compiled here on its own; the
//! integration check that the known servers really share is in `check.rs`
//! (`values_are_shared_where_the_header_is_known_...`).

#[allow(dead_code)]
#[path = "../src/layout.rs"]
mod layout;

use layout::{known_header, server_name, version_parts};

fn v(major: u8, minor: u8, patch: u8) -> i32 {
    i32::from_be_bytes([0, major, minor, patch])
}

#[test]
fn versions_split_as_the_server_encodes_them() {
    assert_eq!(version_parts(0x0007_000f), (7, 0, 15));
    assert_eq!(version_parts(0x0008_0102), (8, 1, 2));
    assert_eq!(version_parts(0), (0, 0, 0));
}

#[test]
fn the_name_comes_from_server_name_then_redis_version() {
    // 1. Valkey reports server_name (and a redis_version for compatibility).
    assert_eq!(server_name(Some("valkey"), Some("7.2.4")), Some("valkey"));
    // 2. Redis reports redis_version only.
    assert_eq!(server_name(None, Some("7.4.1")), Some("redis"));
    // 3. Any other server_name is that name, whatever its redis_version says.
    assert_eq!(server_name(Some("keydb"), Some("7.0.0")), Some("keydb"));
    // 4. Nothing to go by.
    assert_eq!(server_name(None, None), None);
}

#[test]
fn only_known_release_lines_share() {
    let cases: &[(u32, &str, i32, bool)] = &[
        // Known: int refcount at byte 4 (object.c/server.h read for each line).
        (1, "redis", v(7, 0, 15), true),
        (2, "redis", v(7, 2, 4), true),
        (3, "redis", v(7, 4, 1), true),
        (4, "redis", v(8, 0, 6), true),
        (5, "redis", v(8, 0, 0), true),
        (6, "valkey", v(7, 2, 5), true),
        (7, "valkey", v(8, 0, 1), true),
        // Valkey 8.1+: bit-field refcount after hasexpire/hasembkey, key embedded.
        (8, "valkey", v(8, 1, 1), false),
        (9, "valkey", v(9, 1, 2), false),
        (10, "valkey", v(9, 0, 0), false),
        // Redis lines not read: before 7.0, release candidates between lines, after 8.0.
        (11, "redis", v(6, 2, 14), false),
        (12, "redis", v(7, 1, 242), false),
        (13, "redis", v(7, 9, 227), false),
        (14, "redis", v(8, 2, 0), false),
        (15, "redis", v(9, 0, 0), false),
        // Valkey before 7.2 did not exist; a Redis version number under the Valkey name is
        // not a Valkey line.
        (16, "valkey", v(7, 0, 15), false),
        // Forks and unknown names never share, whatever version they claim (KeyDB keeps a
        // flag in bit 31 of the refcount word, which the low-bit probe would not see).
        (17, "keydb", v(7, 0, 0), false),
        (18, "keydb", v(6, 3, 4), false),
        (19, "Redis", v(7, 0, 15), false),
        (20, "", v(7, 0, 15), false),
        (21, "redis", v(0, 0, 0), false),
    ];
    for &(n, name, version, expected) in cases {
        assert_eq!(
            known_header(name, version),
            expected,
            "case {n}: {name} {:?}",
            version_parts(version)
        );
    }
}
