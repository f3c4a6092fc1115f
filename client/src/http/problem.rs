//! `application/problem+json` answers (RFC 9457).

use super::headers::{self, ceil_secs, HeaderStyle};
use crate::{Decision, Source, Verdict};
use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use http_body_util::Full;
use std::fmt::Write;

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");
/// The problem type registered by the rate-limit headers draft for exceeded quotas.
const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

fn response(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    r
}

/// `429 Too Many Requests` for a refused decision, with the rate-limit headers.
pub(crate) fn too_many_requests(d: &Decision, style: HeaderStyle) -> Response<Full<Bytes>> {
    // Policy names are [A-Za-z0-9_.-]: they need no JSON escaping.
    let violated: Vec<&str> = d
        .outcomes
        .iter()
        .filter(|o| !o.verdict.is_allowed())
        .map(|o| o.policy.name())
        .collect();
    let (detail, retry) = detail(d);
    let list = violated
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(",");
    let body = format!(
        "{{\"type\":\"{QUOTA_EXCEEDED}\",\"title\":\"Too Many Requests\",\"status\":429,\
         \"detail\":\"{detail}\",\"retry_after\":{retry},\"violated-policies\":[{list}]}}"
    );
    let mut r = response(StatusCode::TOO_MANY_REQUESTS, body);
    headers::write(r.headers_mut(), d, style);
    r
}

/// The 429's `detail` and `retry_after` (JSON: seconds, or `null` for never).
fn detail(d: &Decision) -> (String, String) {
    let p = &d.policy;
    let mut detail = format!(
        "Rate limit '{}' exceeded: {} per {} s, burst {}.",
        p.name(),
        p.count(),
        ceil_secs(p.period()).max(1),
        p.burst()
    );
    let retry = match d.verdict {
        Verdict::Denied { retry_after } => {
            let s = ceil_secs(retry_after).max(1);
            let _ = write!(detail, " Retry after {s} s.");
            s.to_string()
        }
        _ => {
            // One request takes from one bucket: a sub-bucket, for a sharded policy checked
            // on the store; a guard's local limiter does not shard.
            let most = match d.source {
                Source::Local => p.limit().burst(),
                _ => p.bucket_limit().burst(),
            };
            let _ = write!(
                detail,
                " This request costs more than the {most} tokens one request can take and \
                 can never pass."
            );
            "null".to_string()
        }
    };
    (detail, retry)
}

/// `401 Unauthorized` for a request without an API key.
pub(crate) fn unauthorized(header: &str) -> Response<Full<Bytes>> {
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"Unauthorized\",\"status\":401,\
         \"detail\":\"This endpoint needs an API key in the {header} header.\"}}"
    );
    let mut r = response(StatusCode::UNAUTHORIZED, body);
    if let Ok(v) = HeaderValue::try_from(format!("ApiKey header=\"{header}\"")) {
        r.headers_mut().insert(WWW_AUTHENTICATE, v);
    }
    r
}

/// `503 Service Unavailable`: a fail-closed limit could not be checked (the store is out,
/// or answered with an error), with `Retry-After` when known.
pub(crate) fn unavailable(retry_after: Option<std::time::Duration>) -> Response<Full<Bytes>> {
    let mut r = response(
        StatusCode::SERVICE_UNAVAILABLE,
        "{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\
         \"detail\":\"The rate limit for this endpoint cannot be checked right now.\"}"
            .to_string(),
    );
    if let Some(retry) = retry_after {
        if let Ok(v) = HeaderValue::try_from(ceil_secs(retry).max(1).to_string()) {
            r.headers_mut().insert(http::header::RETRY_AFTER, v);
        }
    }
    r
}

/// `503 Service Unavailable`: a concurrency limit refused the request at once rather than
/// queueing it; `Retry-After` in whole seconds (at least 1).
#[cfg(feature = "guard")]
pub(crate) fn overloaded(retry_after: std::time::Duration) -> Response<Full<Bytes>> {
    let mut r = response(
        StatusCode::SERVICE_UNAVAILABLE,
        "{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\
         \"detail\":\"Too many requests in progress for this endpoint; retry shortly.\"}"
            .to_string(),
    );
    if let Ok(v) = HeaderValue::try_from(ceil_secs(retry_after).max(1).to_string()) {
        r.headers_mut().insert(http::header::RETRY_AFTER, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Policy, PolicyOutcome};
    use std::time::Duration;

    fn refused(policy: Policy, verdict: Verdict) -> Decision {
        refused_by(policy, verdict, Source::Store)
    }

    fn refused_by(policy: Policy, verdict: Verdict, source: Source) -> Decision {
        let o = PolicyOutcome {
            policy,
            verdict,
            remaining: 0,
            reset_after: Duration::ZERO,
        };
        Decision::from_outcomes(vec![o], source).unwrap()
    }

    #[test]
    fn a_cost_that_can_never_pass_is_told_the_most_one_request_can_take() {
        let whole = Policy::builder("api").per_second(800).burst(160);
        let d = refused(whole.clone().build().unwrap(), Verdict::ExceedsBurst);
        let (text, retry) = detail(&d);
        assert!(text.contains("more than the 160 tokens"), "{text}");
        assert_eq!(retry, "null");
        // Split in 8, one request takes from one sub-bucket of 20.
        let sharded = whole.shards(8).build().unwrap();
        let d = refused(sharded.clone(), Verdict::ExceedsBurst);
        let (text, _) = detail(&d);
        assert!(
            text.contains("burst 160. This request costs more than the 20 tokens"),
            "{text}"
        );
        // A guard's local limiter checks the whole bucket, sharded or not.
        let d = refused_by(sharded, Verdict::ExceedsBurst, Source::Local);
        let (text, _) = detail(&d);
        assert!(text.contains("more than the 160 tokens"), "{text}");
    }

    #[test]
    fn a_refusal_that_can_pass_later_says_when() {
        let p = Policy::builder("api")
            .per_minute(100)
            .burst(20)
            .build()
            .unwrap();
        let retry_after = Duration::from_millis(1_200);
        let (text, retry) = detail(&refused(p, Verdict::Denied { retry_after }));
        assert!(text.ends_with("Retry after 2 s."), "{text}");
        assert_eq!(retry, "2");
    }
}
