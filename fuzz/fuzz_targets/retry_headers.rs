//! The HTTP parsers a client runs on an upstream's answer: `Retry-After` (seconds or an
//! HTTP-date) and `RateLimit` (structured fields), on any header bytes: never a panic, and a
//! plain number of seconds is read as exactly that.
#![no_main]

use http::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use libfuzzer_sys::fuzz_target;
use redis_ratelimit_client::http::{retry_delay, retry_delay_with_jitter};
use std::time::Duration;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|b| *b == b'\n').unwrap_or(data.len());
    let (retry_after, ratelimit) = data.split_at(split);
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(retry_after) {
        headers.insert(RETRY_AFTER, v);
    }
    if let Ok(v) = HeaderValue::from_bytes(ratelimit.get(1..).unwrap_or_default()) {
        headers.insert("ratelimit", v);
    }
    let delay = retry_delay(&headers);
    if let Some(jittered) = retry_delay_with_jitter(&headers) {
        assert!(
            jittered >= delay.unwrap_or_default(),
            "jitter made it early"
        );
    }
    // Header values are ASCII; only spaces and tabs surround a value.
    let seconds = std::str::from_utf8(retry_after)
        .ok()
        .filter(|s| s.is_ascii())
        .and_then(|s| s.trim_matches([' ', '\t']).parse::<u64>().ok());
    if let (Some(s), true) = (seconds, headers.contains_key(RETRY_AFTER)) {
        assert_eq!(delay, Some(Duration::from_secs(s)));
    }
});
