//! The stored-value decoder on any key a server could hold (any expiry, any value bytes):
//! never a panic, and whatever decodes re-encodes to a key that decodes the same (to the
//! same expiry and value where the value is canonical).
#![no_main]

use libfuzzer_sys::fuzz_target;
use redis_ratelimit_core::stored;

fuzz_target!(|data: &[u8]| {
    let (head, value) = data.split_at(data.len().min(8));
    let mut word = [0u8; 8];
    word[..head.len()].copy_from_slice(head);
    let expire_at_ms = i64::from_le_bytes(word);
    let Ok(tat) = stored::decode(expire_at_ms, value) else {
        return;
    };
    let class = stored::parse_value(value).map_or(0, |v| (v / 10_000) as u8);
    let again = stored::encode(tat, class);
    // A key written by `encode` is read back exactly: re-encoded, the same expiry and value.
    if let Some(v) = stored::parse_value(value) {
        assert_eq!(
            again,
            stored::StoredBucket {
                expire_at_ms: expire_at_ms as u64,
                value: v
            }
        );
    }
    assert_eq!(
        stored::decode(
            again.expire_at_ms as i64,
            again.value.to_string().as_bytes()
        ),
        Ok(tat)
    );
});
