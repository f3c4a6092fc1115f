//! How a bucket is kept in one Redis string key: the format the module and the Lua script
//! both read and write.
//!
//! A bucket whose TAT is `tat` ticks (100 ns since the Unix epoch), written under a limit of
//! [linger class](linger_class) `c`, is a string key with
//!
//! - **expiry** (`PEXPIRETIME`, absolute ms) `E = ceil(tat / 10 000) + LINGER_MS[c]`: the key
//!   outlives the moment its bucket is full by the class's linger, at most 60 s, and never
//!   disappears before the bucket is full;
//! - **value** the decimal integer `c × 10 000 + (ceil(tat / 10 000) × 10 000 − tat)`, in
//!   `0..=49_999`, written without sign or leading zeros: the class, and how many ticks before
//!   the full millisecond the bucket is really full.
//!
//! Decoding reads the class from the value, so it never depends on the limit a call passes:
//! `tat = (E − LINGER_MS[c]) × 10 000 − sub_ms`. Class 0 lingers 0 ms: values `0..=9999` are
//! the first format (key expiring exactly when full), so keys written before it still read
//! exactly.
//!
//! Why linger: a key that expires the moment it is full is deleted and re-created by nearly
//! every check of a busy deployment (200k subjects checked at random at 50k/s: ~50k expirations
//! per second), and the server's active expiry cycle then stalls for milliseconds at a time. A
//! key that stays a little past full is simply overwritten by the next check.
//!
//! A missing key is a full bucket, and so is a key whose TAT has passed (it lingers). Nothing
//! else is a bucket: another type, other text, or a key without an expiry is refused rather
//! than guessed at.
//!
//! Example: `tat = 17_000_000_001_234_567` ticks under class 3 (15 s) gives `E =
//! 1_700_000_015_124` ms and value `35433` (`SET key 35433 PXAT 1700000015124`). Since the value
//! is one of 50 000 small integers, the module can share one object per value among all keys,
//! and a key costs no more memory than any key with a TTL.

use crate::{Limit, TICKS_PER_MS};
use std::fmt;

/// Sub-millisecond values per class: `0..SUB_MS_VALUES`.
pub const SUB_MS_VALUES: u16 = TICKS_PER_MS as u16;

/// How long a key of each class outlives its full bucket, in ms. Class 0 is the first format.
pub const LINGER_MS: [u64; 5] = [0, 1_000, 4_000, 15_000, 60_000];

/// Number of distinct values: `0..VALUES`.
pub const VALUES: u32 = LINGER_MS.len() as u32 * SUB_MS_VALUES as u32;

/// The longest a key outlives its full bucket: the largest linger.
pub const MAX_LINGER_MS: u64 = LINGER_MS[LINGER_MS.len() - 1];

/// The linger class a write under `limit` uses: the smallest linger at least as long as the
/// limit's refill time (`burst / rate`), capped at [`MAX_LINGER_MS`], and at least 1 s.
///
/// So a key of an idle subject is gone one linger after its bucket is full: at least the
/// refill time, as the usual Lua limiter's `EXPIRE burst/rate + 1` would keep it, at most the
/// next class up (a 1.01 s refill lingers 4 s, a 15.01 s one 60 s) and never over 60 s, while
/// a subject seen again within that time finds its key still there.
pub fn linger_class(limit: &Limit) -> u8 {
    let refill_ms = limit.refill_ticks().div_ceil(TICKS_PER_MS);
    let class = LINGER_MS
        .iter()
        .skip(1)
        .position(|&l| l >= refill_ms)
        .map_or(LINGER_MS.len() - 1, |i| i + 1);
    class as u8
}

/// A bucket as it is stored: absolute expiry and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBucket {
    /// Absolute expiry of the key, in ms since the Unix epoch.
    pub expire_at_ms: u64,
    /// The key's value, in `0..VALUES`: `class × 10 000 + sub_ms`.
    pub value: u32,
}

/// The millisecond at which a bucket with this TAT is full: the TAT rounded up.
pub fn full_at_ms(tat: u64) -> u64 {
    tat.div_ceil(TICKS_PER_MS)
}

/// Encodes a TAT written under linger class `class` (taken modulo the number of classes).
pub fn encode(tat: u64, class: u8) -> StoredBucket {
    let class = usize::from(class) % LINGER_MS.len();
    let full_at = full_at_ms(tat);
    // Below TICKS_PER_MS by construction of the ceiling.
    let sub_ms = (full_at * TICKS_PER_MS - tat) as u32;
    StoredBucket {
        expire_at_ms: full_at.saturating_add(LINGER_MS[class]),
        value: class as u32 * u32::from(SUB_MS_VALUES) + sub_ms,
    }
}

/// Decodes a stored bucket read from a key with absolute expiry `expire_at_ms` (as Redis
/// reports it: negative when the key has none) and string value `value`.
pub fn decode(expire_at_ms: i64, value: &[u8]) -> Result<u64, FormatError> {
    let value = parse_value(value).ok_or(FormatError::Value)?;
    let expire_at_ms = u64::try_from(expire_at_ms).map_err(|_| FormatError::NoExpiry)?;
    let class = (value / u32::from(SUB_MS_VALUES)) as usize;
    let sub_ms = u64::from(value % u32::from(SUB_MS_VALUES));
    let linger = LINGER_MS.get(class).copied().ok_or(FormatError::Value)?;
    expire_at_ms
        .checked_sub(linger)
        .and_then(|full_at| full_at.checked_mul(TICKS_PER_MS))
        .and_then(|t| t.checked_sub(sub_ms))
        .ok_or(FormatError::Expiry)
}

/// Parses a stored value: canonical decimal in `0..VALUES`.
pub fn parse_value(value: &[u8]) -> Option<u32> {
    let canonical = match value {
        [b'0'] => true,
        [first, ..] => *first != b'0' && value.len() <= 5,
        [] => false,
    };
    if !canonical {
        return None;
    }
    value
        .iter()
        .try_fold(0u32, |acc, b| match b {
            b'0'..=b'9' => Some(acc * 10 + u32::from(b - b'0')),
            _ => None,
        })
        .filter(|v| *v < VALUES)
}

/// Why a key could not be read as a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// The value is not a decimal integer in `0..VALUES`.
    Value,
    /// The key has no expiry.
    NoExpiry,
    /// The expiry is out of range.
    Expiry,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Value => "its value is not an integer in 0..49999",
            Self::NoExpiry => "it has no expiry",
            Self::Expiry => "its expiry is out of range",
        })
    }
}

impl std::error::Error for FormatError {}
