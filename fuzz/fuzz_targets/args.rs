//! The module's argument parsing (`rate burst cost|delta`, as bytes a client sent), then a
//! check and a settle with whatever parsed, from any stored state: never a panic, and every
//! limit that parses is within the format's bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use redis_ratelimit_core::{args, check, settle, Limit, MAX_LEAD_TICKS};

fuzz_target!(|data: &[u8]| {
    // Fields separated by spaces, as redis-cli would split them; then 16 bytes of state.
    let (text, state) = data.split_at(data.len().saturating_sub(16));
    let mut fields = text.split(|b| *b == b' ');
    let (rate, burst, amount) = (
        fields.next().unwrap_or_default(),
        fields.next().unwrap_or_default(),
        fields.next().unwrap_or_default(),
    );
    let mut word = [0u8; 8];
    let tat = {
        word.copy_from_slice(state.get(..8).unwrap_or(&[0; 8]));
        u64::from_le_bytes(word)
    };
    let now = {
        word.copy_from_slice(state.get(8..16).unwrap_or(&[0; 8]));
        // The server's clock in ticks: far from overflow for thousands of years.
        u64::from_le_bytes(word) >> 1
    };
    // The integer parser reads bytes as `str::parse` reads text.
    let parsed = std::str::from_utf8(amount)
        .ok()
        .and_then(|s| s.parse::<i64>().ok());
    assert_eq!(args::delta(amount).ok(), parsed);
    // A cost is a delta that is not negative.
    assert_eq!(
        args::cost(amount).ok(),
        parsed.and_then(|v| u64::try_from(v).ok())
    );
    let Ok(limit) = args::limit(rate, burst) else {
        return;
    };
    assert!(limit.refill_ticks() <= Limit::MAX_REFILL_TICKS);
    if let Ok(cost) = args::cost(amount) {
        let d = check(&limit, cost, tat, now);
        assert!(!d.changed || d.tat - now.max(tat.min(d.tat)) <= limit.refill_ticks());
    }
    if let Ok(delta) = args::delta(amount) {
        if let Ok(d) = settle(&limit, delta, tat, now) {
            assert!(d.tat.saturating_sub(now) <= MAX_LEAD_TICKS.max(tat.saturating_sub(now)));
        }
    }
});
