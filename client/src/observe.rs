//! The metrics of every decision, recorded without allocating: the `metrics` macros build a
//! key (a `Vec` of labels) on every call, even with no recorder installed, which was 2 of a
//! store check's 16 allocations. The keys are built once instead: per policy for the
//! decisions counter (its `policy` label), statically for the duration histogram.

use crate::{Decision, Error, Source};
use metrics::{Key, Label, Level, Metadata};
use std::time::Instant;

/// Every [`Source`], in [`index`] order.
const SOURCES: [Source; 6] = [
    Source::Store,
    Source::DenyCache,
    Source::LocalFallback,
    Source::FailOpen,
    Source::FailClosed,
    Source::Local,
];

fn index(s: Source) -> usize {
    match s {
        Source::Store => 0,
        Source::DenyCache => 1,
        Source::LocalFallback => 2,
        Source::FailOpen => 3,
        Source::FailClosed => 4,
        Source::Local => 5,
    }
}

const DECISIONS: &str = "ratelimit_decisions_total";
const DURATION: &str = "ratelimit_check_duration_seconds";

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

static DURATION_LABELS: [[Label; 1]; 6] = [
    [Label::from_static_parts("source", "store")],
    [Label::from_static_parts("source", "deny_cache")],
    [Label::from_static_parts("source", "local_fallback")],
    [Label::from_static_parts("source", "fail_open")],
    [Label::from_static_parts("source", "fail_closed")],
    [Label::from_static_parts("source", "local")],
];

/// A policy's `ratelimit_decisions_total` keys, one per source and verdict.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DecisionKeys(Box<[Key]>);

impl DecisionKeys {
    pub(crate) fn new(policy: &str) -> Self {
        let keys = SOURCES
            .iter()
            .flat_map(|s| {
                ["true", "false"].map(|allowed| {
                    Key::from_parts(
                        DECISIONS,
                        vec![
                            Label::from_static_parts("source", s.as_str()),
                            Label::from_static_parts("allowed", allowed),
                            Label::new("policy", policy.to_owned()),
                        ],
                    )
                })
            })
            .collect();
        Self(keys)
    }

    fn get(&self, source: Source, allowed: bool) -> Option<&Key> {
        self.0.get(index(source) * 2 + usize::from(!allowed))
    }
}

/// Counts a decision (by source, verdict and deciding policy) and its duration.
pub(crate) fn observe(started: Instant, d: &Result<Decision, Error>) {
    let Ok(d) = d else { return };
    let seconds = started.elapsed().as_secs_f64();
    metrics::with_recorder(|r| {
        if let Some(key) = d.policy.decision_keys().get(d.source, d.is_allowed()) {
            r.register_counter(key, &METADATA).increment(1);
        }
        if let Some(labels) = DURATION_LABELS.get(index(d.source)) {
            r.register_histogram(&Key::from_static_parts(DURATION, labels), &METADATA)
                .record(seconds);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_labels_the_macros_did() {
        let keys = DecisionKeys::new("api");
        for s in SOURCES {
            for allowed in [true, false] {
                let key = keys.get(s, allowed).unwrap();
                let labels: Vec<(&str, &str)> =
                    key.labels().map(|l| (l.key(), l.value())).collect();
                let allowed = if allowed { "true" } else { "false" };
                assert_eq!(
                    labels,
                    [
                        ("source", s.as_str()),
                        ("allowed", allowed),
                        ("policy", "api")
                    ]
                );
            }
            let labels = DURATION_LABELS.get(index(s)).unwrap();
            assert_eq!(labels[0].value(), s.as_str());
        }
    }
}
