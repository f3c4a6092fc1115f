//! The limits recently parsed, by the bytes of their `rate burst` arguments.
//!
//! A deployment sends the same few policies millions of times. Parsing `1.6666666666666667`
//! as a float, checking the limit and finding its linger class costs about 700 instructions, a
//! tenth of a whole `RL.CHECK`; comparing the bytes with a remembered pair costs a few dozen.
//! Equal bytes parse to equal limits, so a hit answers exactly what parsing would.
//!
//! Direct-mapped: a pair goes to one of [`SLOTS`] slots by a hash of its bytes and replaces
//! whatever was there; arguments longer than [`MAX_ARG`] bytes are parsed every time. Errors
//! are never remembered. Commands run on the server's main thread, so the cache is a
//! thread-local without locking.

use redis_ratelimit_core::args::{self, ArgError};
use redis_ratelimit_core::stored::linger_class;
use redis_ratelimit_core::Limit;
use std::cell::RefCell;

/// How many pairs are remembered: more than the policies of any one deployment we know of.
const SLOTS: usize = 32;
/// The longest argument remembered (`0.0002777777777777778`, one per hour, is 21 bytes).
const MAX_ARG: usize = 24;

/// A parsed limit and its linger class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) limit: Limit,
    pub(crate) class: u8,
}

/// One remembered pair: both arguments' bytes (zero-padded) and lengths, and their limit.
#[derive(Clone, Copy)]
struct Slot {
    rate: [u8; MAX_ARG],
    burst: [u8; MAX_ARG],
    lens: (u8, u8),
    parsed: Parsed,
}

impl Slot {
    fn holds(&self, rate: &[u8], burst: &[u8]) -> bool {
        let (r, b) = (usize::from(self.lens.0), usize::from(self.lens.1));
        self.rate.get(..r) == Some(rate) && self.burst.get(..b) == Some(burst)
    }
}

thread_local! {
    static CACHE: RefCell<[Option<Slot>; SLOTS]> = const { RefCell::new([None; SLOTS]) };
}

/// The limit `rate burst` stands for, as [`args::limit`] parses it, with its linger class.
pub(crate) fn limit(rate: &[u8], burst: &[u8]) -> Result<Parsed, ArgError> {
    let parse = || {
        let limit = args::limit(rate, burst)?;
        Ok(Parsed {
            limit,
            class: linger_class(&limit),
        })
    };
    let (Ok(rate_len), Ok(burst_len)) = (u8::try_from(rate.len()), u8::try_from(burst.len()))
    else {
        return parse();
    };
    let index = slot_of(rate, burst);
    let hit = CACHE.with(|c| match c.borrow().get(index) {
        Some(Some(slot)) if slot.holds(rate, burst) => Some(slot.parsed),
        _ => None,
    });
    if let Some(parsed) = hit {
        return Ok(parsed);
    }
    let parsed = parse()?;
    let mut slot = Slot {
        rate: [0; MAX_ARG],
        burst: [0; MAX_ARG],
        lens: (rate_len, burst_len),
        parsed,
    };
    // Pairs longer than a slot holds are parsed each time.
    if let (Some(r), Some(b)) = (
        slot.rate.get_mut(..rate.len()),
        slot.burst.get_mut(..burst.len()),
    ) {
        r.copy_from_slice(rate);
        b.copy_from_slice(burst);
        CACHE.with(|c| {
            if let Some(s) = c.borrow_mut().get_mut(index) {
                *s = Some(slot);
            }
        });
    }
    Ok(parsed)
}

/// A slot from the lengths and the last (up to) 8 bytes of each argument: where policies'
/// rates differ (`1.6666666666666667`, `3.3333333333333335`, `100`). Pairs that collide only
/// take turns in the slot.
fn slot_of(rate: &[u8], burst: &[u8]) -> usize {
    let mut h = (rate.len() as u64) << 8 | burst.len() as u64;
    for word in [tail(rate), tail(burst)] {
        h = (h ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    (h >> 59) as usize % SLOTS
}

/// The last 8 bytes of `bytes` as a word (all of them, zero-extended, if fewer).
fn tail(bytes: &[u8]) -> u64 {
    match bytes.last_chunk::<8>() {
        Some(last) => u64::from_le_bytes(*last),
        None => bytes.iter().fold(0, |w, &b| w << 8 | u64::from(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(rate: &[u8], burst: &[u8]) -> Result<Parsed, ArgError> {
        let limit = args::limit(rate, burst)?;
        Ok(Parsed {
            limit,
            class: linger_class(&limit),
        })
    }

    proptest::proptest! {
        /// Whatever was asked before, and however pairs collide in a slot, the answer is the
        /// parser's.
        #[test]
        fn answers_what_parsing_answers(
            pairs in proptest::collection::vec(("[0-9.e]{1,26}", "[0-9]{1,3}"), 1..200),
            picks in proptest::collection::vec(0usize..200, 1..400),
        ) {
            for i in picks {
                let (rate, burst) = &pairs[i % pairs.len()];
                let (rate, burst) = (rate.as_bytes(), burst.as_bytes());
                proptest::prop_assert_eq!(limit(rate, burst), parse(rate, burst));
            }
        }
    }

    #[test]
    fn a_hit_is_the_remembered_pair_only() {
        let a = limit(b"1.6666666666666667", b"20");
        assert_eq!(a, parse(b"1.6666666666666667", b"20"));
        assert_eq!(limit(b"1.6666666666666667", b"20"), a);
        // Same bytes split differently, a prefix, and an error are each their own answer.
        assert_eq!(
            limit(b"1.666666666666666", b"720"),
            parse(b"1.666666666666666", b"720")
        );
        assert_eq!(
            limit(b"1.6666666666666667", b"2"),
            parse(b"1.6666666666666667", b"2")
        );
        assert_eq!(limit(b"1.6666666666666667", b"0"), Err(ArgError::Burst));
        assert_eq!(limit(b"1.6666666666666667", b"20"), a);
    }
}
