//! For Rust callers of a limited API: how long to wait before retrying.

use http::header::{HeaderMap, RETRY_AFTER};
use std::time::{Duration, SystemTime};

/// The wait a response asks for: `Retry-After` (seconds, or an HTTP-date: the time left
/// until it, zero once past), or else the reset time `t` of an exhausted (`r=0`) policy in
/// the `RateLimit` header. `None` when neither says to wait.
pub fn retry_delay(headers: &HeaderMap) -> Option<Duration> {
    retry_delay_at(headers, SystemTime::now())
}

/// [`retry_delay`] with the clock passed in (an HTTP-date counts from `now`).
fn retry_delay_at(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    if let Some(v) = headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    {
        if let Ok(secs) = v.parse::<u64>() {
            return Some(Duration::from_secs(secs));
        }
        if let Ok(at) = httpdate::parse_http_date(v) {
            return Some(at.duration_since(now).unwrap_or(Duration::ZERO));
        }
    }
    let value = headers.get("ratelimit")?.to_str().ok()?;
    // Items look like `"name";r=0;t=12`: the longest wait among exhausted policies.
    value
        .split(',')
        .filter_map(|item| {
            let mut r = None;
            let mut t = None;
            for param in item.split(';').skip(1) {
                match param.trim().split_once('=') {
                    Some(("r", v)) => r = v.parse::<u64>().ok(),
                    Some(("t", v)) => t = v.parse::<u64>().ok(),
                    _ => {}
                }
            }
            (r == Some(0)).then_some(t?)
        })
        .max()
        .map(Duration::from_secs)
}

/// [`retry_delay`] plus random jitter, so a thousand clients told "3 s" do not all return in
/// the same millisecond: uniformly within `[delay, delay + max(delay / 2, 1 s)]`. Never
/// early.
pub fn retry_delay_with_jitter(headers: &HeaderMap) -> Option<Duration> {
    let base = retry_delay(headers)?;
    let spread = (base / 2).max(Duration::from_secs(1));
    // Saturating: an upstream may send any number (`Retry-After: 18446744073709551615`).
    Some(base.saturating_add(spread.mul_f64(rand::random::<f64>())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn reads_retry_after_then_ratelimit() {
        assert_eq!(
            retry_delay(&headers(&[("retry-after", "3")])),
            Some(Duration::from_secs(3))
        );
        let h = headers(&[("ratelimit", "\"api\";r=0;t=7, \"day\";r=5;t=900")]);
        assert_eq!(retry_delay(&h), Some(Duration::from_secs(7)));
        assert_eq!(
            retry_delay(&headers(&[("ratelimit", "\"api\";r=4;t=7")])),
            None
        );
        assert_eq!(retry_delay(&HeaderMap::new()), None);
    }

    #[test]
    fn reads_the_http_date_form() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        let h = headers(&[("retry-after", "Sun, 06 Nov 1994 08:50:07 GMT")]);
        assert_eq!(retry_delay_at(&h, now), Some(Duration::from_secs(30)));
        // A date already past: retry now.
        let h = headers(&[("retry-after", "Sun, 06 Nov 1994 08:49:00 GMT")]);
        assert_eq!(retry_delay_at(&h, now), Some(Duration::ZERO));
        // Neither form: fall through to RateLimit.
        let h = headers(&[("retry-after", "soon"), ("ratelimit", "\"api\";r=0;t=4")]);
        assert_eq!(retry_delay_at(&h, now), Some(Duration::from_secs(4)));
    }

    #[test]
    fn huge_retry_after_saturates_instead_of_panicking() {
        let h = headers(&[("retry-after", "18446744073709551615")]);
        assert_eq!(retry_delay(&h), Some(Duration::from_secs(u64::MAX)));
        assert!(retry_delay_with_jitter(&h).unwrap() >= Duration::from_secs(u64::MAX));
    }

    #[test]
    fn jitter_spreads_but_is_never_early() {
        let h = headers(&[("retry-after", "3")]);
        let delays: Vec<Duration> = (0..1000)
            .map(|_| retry_delay_with_jitter(&h).unwrap())
            .collect();
        assert!(delays
            .iter()
            .all(|d| *d >= Duration::from_secs(3) && *d <= Duration::from_millis(4_500)));
        let distinct_ms: std::collections::HashSet<u128> =
            delays.iter().map(|d| d.as_millis()).collect();
        assert!(
            distinct_ms.len() > 500,
            "only {} distinct ms",
            distinct_ms.len()
        );
    }
}
