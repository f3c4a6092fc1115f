//! Rate-limit response headers.

use crate::{Decision, Source, Verdict};
use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use std::fmt::Write;
use std::time::Duration;

/// Which headers to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` per draft-ietf-httpapi-ratelimit-headers-11.
    #[default]
    Draft11,
    /// The draft's headers plus the widespread `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
    /// `X-RateLimit-Reset` of the deciding policy.
    Draft11AndXRateLimit,
    /// Only the older combined form `RateLimit: limit=100, remaining=0, reset=3` and the
    /// `X-RateLimit-*` headers, for clients written against them.
    Legacy,
}

pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Whole seconds, rounded up: a client waiting that long is never early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    // `Duration::MAX` rounds up to 2^64: saturate, not wrap to 0.
    u64::try_from(d.as_nanos().div_ceil(1_000_000_000)).unwrap_or(u64::MAX)
}

/// Writes the headers describing `d` (and `Retry-After` when it is a refusal that can pass
/// later).
pub(crate) fn write(headers: &mut HeaderMap, d: &Decision, style: HeaderStyle) {
    if style != HeaderStyle::Legacy {
        // Structured-field lists: a quoted policy name (names are [A-Za-z0-9_.-]) with
        // integer parameters. `burst` is this limiter's extra parameter; clients ignore
        // parameters they do not know.
        let (mut policy, mut state) = (String::new(), String::new());
        for o in &d.outcomes {
            let p = &o.policy;
            let sep = if policy.is_empty() { "" } else { ", " };
            let _ = write!(
                policy,
                "{sep}\"{}\";q={};w={};burst={}",
                p.name(),
                sf_int(p.count()),
                sf_int(ceil_secs(p.period()).max(1)),
                sf_int(p.burst())
            );
            // The deny cache knows only the buckets it refuses: the state of a policy it
            // did not find refused is unknown, and left out rather than reported full.
            if d.source == Source::DenyCache && o.verdict.is_allowed() {
                continue;
            }
            let sep = if state.is_empty() { "" } else { ", " };
            let _ = write!(
                state,
                "{sep}\"{}\";r={};t={}",
                p.name(),
                sf_int(o.remaining),
                sf_int(ceil_secs(o.reset_after))
            );
        }
        // Another limit layer around or inside this one (a guard's beside the global one)
        // adds its policies to the same lists rather than hiding these.
        append(headers, &RATELIMIT_POLICY, policy);
        append(headers, &RATELIMIT, state);
    }
    let tighter = number(headers, &X_REMAINING).is_none_or(|theirs| d.remaining < theirs);
    // The single-policy forms name one policy: another layer's with fewer left stays.
    if style != HeaderStyle::Draft11 && tighter {
        let (limit, remaining, reset) = (d.policy.count(), d.remaining, ceil_secs(d.reset_after));
        insert(headers, &X_LIMIT, limit.to_string());
        insert(headers, &X_REMAINING, remaining.to_string());
        insert(headers, &X_RESET, reset.to_string());
        if style == HeaderStyle::Legacy {
            insert(
                headers,
                &RATELIMIT,
                format!("limit={limit}, remaining={remaining}, reset={reset}"),
            );
        }
    }
    if let Verdict::Denied { retry_after } = d.verdict {
        let ours = ceil_secs(retry_after).max(1);
        // Another layer's longer wait stays: retrying earlier would be refused there.
        let longer = number(headers, &RETRY_AFTER).is_some_and(|theirs| theirs >= ours);
        if !longer {
            insert(headers, &RETRY_AFTER, ours.to_string());
        }
    }
}

/// A structured-field integer has at most 15 digits (RFC 9651): a larger value (only a
/// policy of absurd size has one) is written as the largest, so the header still parses.
fn sf_int(n: u64) -> u64 {
    n.min(999_999_999_999_999)
}

/// The integer another layer already wrote in `name`, if any.
fn number(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

/// Adds `value`'s list members after those already in the field, if any.
fn append(headers: &mut HeaderMap, name: &HeaderName, value: String) {
    if value.is_empty() {
        return;
    }
    let value = match headers.get(name).and_then(|v| v.to_str().ok()) {
        Some(old) if !old.is_empty() => format!("{old}, {value}"),
        _ => value,
    };
    insert(headers, name, value);
}

fn insert(headers: &mut HeaderMap, name: &HeaderName, value: String) {
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(name.clone(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Policy, PolicyOutcome};

    fn decision(verdict: Verdict, remaining: u64) -> Decision {
        let p = Policy::builder("api")
            .per_minute(100)
            .burst(20)
            .build()
            .unwrap();
        let o = PolicyOutcome {
            policy: p.clone(),
            verdict,
            remaining,
            reset_after: Duration::from_millis(2_500),
        };
        Decision {
            verdict,
            source: Source::Store,
            policy: p,
            remaining,
            reset_after: o.reset_after,
            outcomes: vec![o],
        }
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn integers_past_fifteen_digits_are_capped_so_the_headers_still_parse() {
        // Valid, if absurd: 10^7 per second, a burst of 10^15 (16 digits).
        let p = Policy::builder("huge")
            .per_second(10_000_000)
            .burst(1_000_000_000_000_000)
            .build()
            .unwrap();
        let mut d = decision(Verdict::Allowed, 0);
        d.outcomes[0].policy = p;
        d.outcomes[0].remaining = 1_000_000_000_000_000;
        let mut h = HeaderMap::new();
        write(&mut h, &d, HeaderStyle::Draft11);
        for name in ["ratelimit-policy", "ratelimit"] {
            let v = get(&h, name).unwrap();
            let parsed = sfv::Parser::new(v).parse::<sfv::List>();
            assert!(parsed.is_ok(), "{name}: {v}");
            assert!(v.contains("=999999999999999"), "{name}: {v}");
        }
    }

    #[test]
    fn a_deny_cache_answer_reports_only_the_buckets_it_knows() {
        // Refused from the deny cache by "api"; "day" was not looked up.
        let mut d = decision(
            Verdict::Denied {
                retry_after: Duration::from_millis(1_500),
            },
            0,
        );
        d.source = Source::DenyCache;
        let day = Policy::builder("day")
            .per_hour(1_000)
            .burst(1_000)
            .build()
            .unwrap();
        d.outcomes.push(PolicyOutcome {
            policy: day,
            verdict: Verdict::Allowed,
            remaining: 1_000,
            reset_after: Duration::ZERO,
        });
        let mut h = HeaderMap::new();
        write(&mut h, &d, HeaderStyle::Draft11);
        assert_eq!(
            get(&h, "ratelimit-policy"),
            Some("\"api\";q=100;w=60;burst=20, \"day\";q=1000;w=3600;burst=1000")
        );
        assert_eq!(get(&h, "ratelimit"), Some("\"api\";r=0;t=3"));

        // The same outcomes from the store are all known.
        d.source = Source::Store;
        let mut h = HeaderMap::new();
        write(&mut h, &d, HeaderStyle::Draft11);
        assert_eq!(
            get(&h, "ratelimit"),
            Some("\"api\";r=0;t=3, \"day\";r=1000;t=0")
        );
    }

    #[test]
    fn nested_layers_add_to_the_lists_and_keep_the_tighter_single_values() {
        // The inner layer ("api") refused; the outer one ("sms") had room.
        let mut inner = decision(
            Verdict::Denied {
                retry_after: Duration::from_millis(4_500),
            },
            0,
        );
        let sms = Policy::builder("sms").per_second(10).build().unwrap();
        inner.outcomes[0].reset_after = Duration::from_secs(5);
        let mut outer = decision(Verdict::Allowed, 9);
        outer.policy = sms.clone();
        outer.outcomes[0].policy = sms;
        let mut h = HeaderMap::new();
        write(&mut h, &inner, HeaderStyle::Draft11AndXRateLimit);
        write(&mut h, &outer, HeaderStyle::Draft11AndXRateLimit);
        assert_eq!(
            get(&h, "ratelimit-policy"),
            Some("\"api\";q=100;w=60;burst=20, \"sms\";q=10;w=1;burst=10")
        );
        assert_eq!(
            get(&h, "ratelimit"),
            Some("\"api\";r=0;t=5, \"sms\";r=9;t=3")
        );
        assert_eq!(h.get_all("ratelimit").iter().count(), 1, "one field line");
        assert_eq!(
            get(&h, "x-ratelimit-remaining"),
            Some("0"),
            "the tighter one"
        );
        assert_eq!(get(&h, "x-ratelimit-limit"), Some("100"));
        assert_eq!(get(&h, "retry-after"), Some("5"));
        // A shorter refusal outside does not shorten the wait.
        let mut shorter = decision(
            Verdict::Denied {
                retry_after: Duration::from_secs(1),
            },
            0,
        );
        shorter.outcomes[0].policy = Policy::builder("b").per_second(1).build().unwrap();
        write(&mut h, &shorter, HeaderStyle::Draft11);
        assert_eq!(get(&h, "retry-after"), Some("5"));
        assert!(get(&h, "ratelimit").unwrap().ends_with(", \"b\";r=0;t=3"));
    }

    #[test]
    fn the_longest_wait_rounds_up_without_wrapping() {
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
        assert_eq!(ceil_secs(Duration::from_nanos(1)), 1);
    }

    #[test]
    fn styles() {
        let denied = decision(
            Verdict::Denied {
                retry_after: Duration::from_millis(1_001),
            },
            0,
        );
        let mut h = HeaderMap::new();
        write(&mut h, &denied, HeaderStyle::Draft11);
        assert_eq!(
            get(&h, "ratelimit-policy"),
            Some("\"api\";q=100;w=60;burst=20")
        );
        assert_eq!(get(&h, "ratelimit"), Some("\"api\";r=0;t=3"));
        assert_eq!(get(&h, "retry-after"), Some("2"), "rounded up, never early");
        assert_eq!(get(&h, "x-ratelimit-limit"), None);

        let mut h = HeaderMap::new();
        write(
            &mut h,
            &decision(Verdict::Allowed, 7),
            HeaderStyle::Draft11AndXRateLimit,
        );
        assert_eq!(get(&h, "ratelimit"), Some("\"api\";r=7;t=3"));
        assert_eq!(get(&h, "x-ratelimit-remaining"), Some("7"));
        assert_eq!(get(&h, "retry-after"), None);

        let mut h = HeaderMap::new();
        write(&mut h, &decision(Verdict::Allowed, 7), HeaderStyle::Legacy);
        assert_eq!(
            get(&h, "ratelimit"),
            Some("limit=100, remaining=7, reset=3")
        );
        assert_eq!(get(&h, "ratelimit-policy"), None);
        assert_eq!(get(&h, "x-ratelimit-limit"), Some("100"));
        assert_eq!(get(&h, "x-ratelimit-reset"), Some("3"));
    }
}
