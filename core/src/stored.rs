//! How a bucket is kept in one Redis string key: the format the module and the Lua script
//! both read and write.
//!
//! A bucket whose TAT is `tat` ticks (100 ns since the Unix epoch) is a string key with
//!
//! - **expiry** (`PEXPIRETIME`, absolute ms) `E = ceil(tat / 10 000)`: the key disappears when
//!   the bucket is full again, to the millisecond and never before;
//! - **value** the decimal integer `E × 10 000 − tat`, in `0..=9999`, written without sign or
//!   leading zeros: how many ticks before `E` the bucket is really full.
//!
//! A missing key is a full bucket. Nothing else is a bucket: another type, other text, or a key
//! without an expiry is refused rather than guessed at.
//!
//! Example: `tat = 17_000_000_001_234_567` ticks gives `E = 1_700_000_000_124` ms and value
//! `5433` (`SET key 5433 PXAT 1700000000124`). Since the value is a small integer, Redis and the
//! module can share one object per value among all keys, and a key costs no more memory than
//! any key with a TTL.

use crate::TICKS_PER_MS;
use std::fmt;

/// Number of distinct values: `0..SUB_MS_VALUES`.
pub const SUB_MS_VALUES: u16 = TICKS_PER_MS as u16;

/// A bucket as it is stored: absolute expiry and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBucket {
    /// Absolute expiry of the key, in ms since the Unix epoch.
    pub expire_at_ms: u64,
    /// The key's value: ticks between the TAT and `expire_at_ms`, in `0..SUB_MS_VALUES`.
    pub sub_ms: u16,
}

/// The key's absolute expiry for a TAT: the TAT rounded up to the millisecond.
pub fn expire_at_ms(tat: u64) -> u64 {
    tat.div_ceil(TICKS_PER_MS)
}

/// Encodes a TAT.
pub fn encode(tat: u64) -> StoredBucket {
    let expire_at_ms = expire_at_ms(tat);
    // Below TICKS_PER_MS by construction of the ceiling.
    let sub_ms = (expire_at_ms * TICKS_PER_MS - tat) as u16;
    StoredBucket {
        expire_at_ms,
        sub_ms,
    }
}

/// Decodes a stored bucket read from a key with absolute expiry `expire_at_ms` (as Redis
/// reports it: negative when the key has none) and string value `value`.
pub fn decode(expire_at_ms: i64, value: &[u8]) -> Result<u64, FormatError> {
    let sub_ms = parse_value(value).ok_or(FormatError::Value)?;
    let expire_at_ms = u64::try_from(expire_at_ms).map_err(|_| FormatError::NoExpiry)?;
    expire_at_ms
        .checked_mul(TICKS_PER_MS)
        .map(|t| t - u64::from(sub_ms))
        .ok_or(FormatError::Expiry)
}

/// Parses a stored value: canonical decimal `0..=9999`.
pub fn parse_value(value: &[u8]) -> Option<u16> {
    let canonical = match value {
        [b'0'] => true,
        [first, ..] => *first != b'0' && value.len() <= 4,
        [] => false,
    };
    if !canonical {
        return None;
    }
    value.iter().try_fold(0u16, |acc, b| match b {
        b'0'..=b'9' => Some(acc * 10 + u16::from(b - b'0')),
        _ => None,
    })
}

/// Why a key could not be read as a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// The value is not a decimal integer in `0..=9999`.
    Value,
    /// The key has no expiry.
    NoExpiry,
    /// The expiry is out of range.
    Expiry,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Value => "its value is not an integer in 0..9999",
            Self::NoExpiry => "it has no expiry",
            Self::Expiry => "its expiry is out of range",
        })
    }
}

impl std::error::Error for FormatError {}
