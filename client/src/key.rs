//! Bucket key layout.
//!
//! ```text
//! <prefix>:{<subject>}:<policy>          one bucket per subject (API key, IP...) and policy
//! <prefix>:{<subject>.<n>}:<policy>      sub-bucket of a sharded policy
//! ```
//!
//! `<subject>` is the caller's identifier hashed with XXH3-64 (seeded, stable across
//! processes, builds and platforms) and written as 11 base64url characters. Hashing keeps the
//! caller from choosing the cluster slot or breaking the layout with `{`, `}` or a huge key,
//! and keeps every key short: `rl:{…11…}:api` is 20 bytes, whatever the API key.
//!
//! The braces are a Redis Cluster hash tag: all of one subject's buckets share a slot, so
//! `RL.CHECKALL` can check them together. A sharded policy's sub-buckets instead get tags
//! `<subject>.<n>` with `n` chosen so that each sub-bucket lands on a different slot.

use xxhash_rust::xxh3::xxh3_64_with_seed;

const B64URL: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// Builds bucket keys.
#[derive(Debug, Clone)]
pub struct KeyLayout {
    prefix: String,
    seed: u64,
}

impl Default for KeyLayout {
    fn default() -> Self {
        Self::new("rl", 0)
    }
}

impl KeyLayout {
    /// A layout with its own key prefix and hash seed. Every pod of a deployment must use
    /// the same two, or they count in different buckets. A prefix with `{` or `}` would
    /// move the hash tag, so those are replaced by `_`.
    pub fn new(prefix: impl Into<String>, seed: u64) -> Self {
        let prefix = prefix.into().replace(['{', '}'], "_");
        Self { prefix, seed }
    }

    /// The hashed subject: 11 base64url characters.
    pub fn subject_tag(&self, subject: &[u8]) -> String {
        String::from_utf8_lossy(&self.tag(subject)).into_owned()
    }

    /// [`subject_tag`](Self::subject_tag) on the stack (the check path's form).
    pub(crate) fn tag(&self, subject: &[u8]) -> [u8; 11] {
        let h = xxh3_64_with_seed(subject, self.seed);
        std::array::from_fn(|i| B64URL[((h >> (6 * i)) & 63) as usize])
    }

    /// The key of `policy`'s bucket for the subject tagged `tag`.
    pub fn key(&self, tag: &str, policy: &str) -> String {
        // One allocation of the exact size: this runs on every check.
        let mut key = String::with_capacity(self.prefix.len() + tag.len() + policy.len() + 4);
        key.push_str(&self.prefix);
        key.push_str(":{");
        key.push_str(tag);
        key.push_str("}:");
        key.push_str(policy);
        key
    }

    /// The key of sub-bucket `shard` (of `shards`) of `policy` for the subject `tag`:
    /// sub-buckets `0..shards` are on `shards` different slots.
    pub fn shard_key(&self, tag: &str, policy: &str, shard: u32, shards: u32) -> String {
        let mut taken: Vec<u16> = Vec::with_capacity(shards as usize);
        let mut n = 0u32;
        loop {
            let candidate = format!("{tag}.{n}");
            let s = slot(candidate.as_bytes());
            n += 1;
            if taken.contains(&s) {
                continue;
            }
            if taken.len() == shard as usize {
                return self.key(&candidate, policy);
            }
            taken.push(s);
        }
    }
}

/// The Redis Cluster hash slot of a key (CRC16/XMODEM of its hash tag, or of the whole key).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag hashes the whole key; only the first `{` and the first `}` after it
        // count.
        let whole = crc16::State::<crc16::XMODEM>::calculate(b"foo{}{bar}") % 16384;
        assert_eq!(slot(b"foo{}{bar}"), whole);
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"foo{bar}{zap}"), slot(b"bar"));
        assert_eq!(slot(b"123456789"), 0x31C3); // the CRC16/XMODEM check value
    }

    #[test]
    fn subject_cannot_escape_its_tag() {
        let l = KeyLayout::default();
        let evil = l.subject_tag(b"}{admin");
        assert_eq!(evil.len(), 11);
        assert!(evil.bytes().all(|b| B64URL.contains(&b)));
        let k = l.key(&evil, "api");
        assert_eq!(k.len(), 20);
        assert_eq!(slot(k.as_bytes()), slot(evil.as_bytes()));
        let huge = l.subject_tag(&vec![b'x'; 1 << 20]);
        assert_eq!(huge.len(), 11);
        assert_ne!(l.subject_tag(b"a"), l.subject_tag(b"b"));
        assert_ne!(
            KeyLayout::new("rl", 1).subject_tag(b"a"),
            l.subject_tag(b"a")
        );
    }

    #[test]
    fn shard_keys_are_on_distinct_slots_and_stable() {
        let l = KeyLayout::default();
        let tag = l.subject_tag(b"tenant-7");
        let keys: Vec<String> = (0..16)
            .map(|i| l.shard_key(&tag, "search", i, 16))
            .collect();
        let mut slots: Vec<u16> = keys.iter().map(|k| slot(k.as_bytes())).collect();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 16);
        assert_eq!(keys[3], l.shard_key(&tag, "search", 3, 16));
    }
}
