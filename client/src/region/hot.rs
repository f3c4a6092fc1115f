//! A pod's count of its busiest subjects for one policy, in bounded memory, on the check
//! path: the Space-Saving algorithm (Metwally, Agrawal, El Abbadi, 2005).
//!
//! It keeps at most `capacity` subjects. A subject not kept replaces the one with the
//! least count and inherits that count as its possible overestimate (`error`), so every
//! subject whose true count exceeds `total / capacity` is kept, and `count − error` never
//! overstates a true count. Only that guaranteed part is reported: a pod under a spread of
//! many subjects reports nearly nothing, one with a busy subject reports it.

use super::split::Subject;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct HotCounter {
    capacity: usize,
    /// (subject, count, error): a short array, searched linearly (it fits in a few cache
    /// lines, and the subjects are hashes already).
    counts: Vec<(Subject, u64, u64)>,
    total: u64,
}

impl HotCounter {
    /// A counter keeping at most `capacity` subjects (at least 1).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            counts: Vec::with_capacity(capacity.max(1)),
            total: 0,
        }
    }

    /// Counts `n` for `subject`.
    pub(crate) fn add(&mut self, subject: Subject, n: u64) {
        self.total = self.total.saturating_add(n);
        if let Some(e) = self.counts.iter_mut().find(|e| e.0 == subject) {
            e.1 = e.1.saturating_add(n);
            return;
        }
        if self.counts.len() < self.capacity {
            self.counts.push((subject, n, 0));
            return;
        }
        if let Some(least) = self.counts.iter_mut().min_by_key(|e| e.1) {
            let min = least.1;
            *least = (subject, min.saturating_add(n), min);
        }
    }

    /// The subjects whose guaranteed count is at least `fraction` of everything counted,
    /// with that count, and starts afresh.
    pub(crate) fn take(&mut self, fraction: f64) -> Vec<(Subject, u64)> {
        let least = (self.total as f64 * fraction).max(1.0);
        let out = self
            .counts
            .drain(..)
            .map(|(x, count, error)| (x, count - error))
            .filter(|(_, n)| *n as f64 >= least)
            .collect();
        self.total = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_subjects_are_found_among_many_and_never_overstated() {
        let mut c = HotCounter::new(16);
        // Two busy subjects (30% and 10%) among 5 000 others seen once or twice.
        for i in 0..10_000u64 {
            match i % 10 {
                0 | 3 | 6 => c.add(1, 1),
                9 => c.add(2, 1),
                _ => c.add(1_000 + i % 5_000, 1),
            }
        }
        let mut got = c.take(0.02);
        got.sort();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, 1);
        assert!(got[0].1 <= 3_000 && got[0].1 >= 2_500, "{got:?}");
        assert_eq!(got[1].0, 2);
        assert!(got[1].1 <= 1_000 && got[1].1 >= 500, "{got:?}");
        assert!(c.take(0.0).is_empty(), "started afresh");
    }

    #[test]
    fn a_spread_reports_nothing() {
        let mut c = HotCounter::new(16);
        for i in 0..100_000u64 {
            c.add(i, 1);
        }
        assert!(c.take(0.02).is_empty());
    }

    #[test]
    fn costs_count() {
        let mut c = HotCounter::new(2);
        c.add(7, 500);
        c.add(8, 1);
        c.add(9, 1);
        assert_eq!(c.take(0.5), vec![(7, 500)]);
    }
}
