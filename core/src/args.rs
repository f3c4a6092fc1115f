//! The commands' numeric arguments, read from the bytes a client sent (`rate burst cost` or
//! `rate burst delta`). Pure, so the module and its fuzz targets share one parser; every
//! failure is an error whose text the module replies after `ERR `.

use crate::{Limit, LimitError};
use std::fmt;

/// Why an argument was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArgError {
    /// The rate is not a decimal number.
    Rate,
    /// The burst is not an integer of at least 1.
    Burst,
    /// The cost is not an integer of at least 0.
    Cost,
    /// The delta is not a 64-bit signed integer.
    Delta,
    /// Rate and burst parse but make no valid limit.
    Limit(LimitError),
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rate => f.write_str("rate must be a number (tokens per second)"),
            Self::Burst => f.write_str("burst must be an integer >= 1"),
            Self::Cost => f.write_str("cost must be an integer >= 0"),
            Self::Delta => f.write_str("delta must be an integer (tokens; negative refunds)"),
            Self::Limit(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ArgError {}

/// A limit from `rate` (tokens per second, any decimal `f64` syntax) and `burst`.
pub fn limit(rate: &[u8], burst: &[u8]) -> Result<Limit, ArgError> {
    let rate = std::str::from_utf8(rate)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or(ArgError::Rate)?;
    let burst = int(burst)
        .and_then(|b| u64::try_from(b).ok())
        .filter(|b| *b >= 1)
        .ok_or(ArgError::Burst)?;
    Limit::new(rate, burst).map_err(ArgError::Limit)
}

/// A cost: tokens to take, 0 for a peek.
pub fn cost(cost: &[u8]) -> Result<u64, ArgError> {
    int(cost)
        .and_then(|c| u64::try_from(c).ok())
        .ok_or(ArgError::Cost)
}

/// A delta: tokens to charge (> 0) or refund (< 0).
pub fn delta(delta: &[u8]) -> Result<i64, ArgError> {
    int(delta).ok_or(ArgError::Delta)
}

/// A 64-bit signed decimal integer (an optional sign, then digits; leading zeros allowed):
/// what `str::parse::<i64>` accepts, read from the bytes without a UTF-8 pass (this runs on
/// every call of the module's commands).
fn int(s: &[u8]) -> Option<i64> {
    let (negative, digits) = match s {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        _ => (false, s),
    };
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0i64, |v, &b| {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            return None;
        }
        let v = v.checked_mul(10)?;
        // Accumulating towards the sign reaches i64::MIN, whose magnitude i64 lacks.
        if negative {
            v.checked_sub(i64::from(digit))
        } else {
            v.checked_add(i64::from(digit))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_clients_send() {
        assert_eq!(
            limit(b"100", b"20"),
            Limit::new(100.0, 20).map_err(ArgError::Limit)
        );
        assert_eq!(cost(b"+3"), Ok(3));
        assert_eq!(cost(b"007"), Ok(7));
        assert_eq!(delta(b"-9223372036854775808"), Ok(i64::MIN));
    }

    proptest::proptest! {
        #[test]
        fn integers_read_as_str_parse_reads_them(s in "[-+]?[0-9a+ -]{0,21}") {
            proptest::prop_assert_eq!(int(s.as_bytes()), s.parse::<i64>().ok());
        }
    }

    #[test]
    fn integers_at_the_edges() {
        for s in [
            "9223372036854775807",
            "-9223372036854775808",
            "+0",
            "-0",
            "007",
        ] {
            assert_eq!(int(s.as_bytes()), s.parse().ok(), "{s}");
        }
        for s in [
            "",
            "+",
            "-",
            "9223372036854775808",
            "-9223372036854775809",
            "1 ",
            "--1",
        ] {
            assert_eq!(int(s.as_bytes()), None, "{s}");
        }
    }

    #[test]
    fn refuses_with_the_reply_text() {
        let cases: [(Result<(), ArgError>, &str); 7] = [
            (
                limit(b"x", b"1").map(drop),
                "rate must be a number (tokens per second)",
            ),
            (limit(b"1", b"0").map(drop), "burst must be an integer >= 1"),
            (
                limit(b"1", b"1.5").map(drop),
                "burst must be an integer >= 1",
            ),
            (
                limit(b"nan", b"1").map(drop),
                "rate must be a finite number",
            ),
            (
                limit(b"\xff", b"1").map(drop),
                "rate must be a number (tokens per second)",
            ),
            (cost(b"-1").map(drop), "cost must be an integer >= 0"),
            (
                delta(b"9223372036854775808").map(drop),
                "delta must be an integer (tokens; negative refunds)",
            ),
        ];
        for (got, text) in cases {
            assert_eq!(got.unwrap_err().to_string(), text);
        }
    }
}
