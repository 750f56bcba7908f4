//! Errors the router answers itself, as OpenAI-style JSON:
//! `{"error": {"message", "type", "code"}}` with the matching HTTP status.

/// An error response of the router's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    #[error("no replica is available: every replica is down or failing its health check")]
    NoReplica,
    #[error("request body exceeds max_body_bytes ({limit} bytes)")]
    BodyTooLarge { limit: usize },
    #[error("request body was not received within {ms} ms")]
    BodyTimeout { ms: u64 },
    /// The body's framing is broken: a bad chunk, or the connection ended
    /// before the declared length.
    #[error("the request body is malformed: {detail}")]
    BadBody { detail: String },
    #[error("the replica{} failed: {detail}", named(replica))]
    Upstream {
        replica: Option<String>,
        detail: String,
    },
    #[error("the replica{} did not answer in time", named(replica))]
    UpstreamTimeout { replica: Option<String> },
    #[error("the router is at its limit of {what}; retry shortly")]
    Overloaded { what: &'static str },
    #[error(
        "every replica has {in_flight} or more requests in flight (shed_in_flight); retry shortly"
    )]
    Saturated { in_flight: u32 },
    #[error("this client address has {max} requests in progress (limits.max_requests_per_client); retry shortly")]
    ClientLimit { max: usize },
    #[error("{who} is at its limit of {what}; retry after {} s", retry_s(*retry_after_ms))]
    RateLimited {
        /// `tenant `acme``, or `this API key`.
        who: String,
        what: String,
        retry_after_ms: u64,
        headers: RateHeaders,
    },
    #[error("every replica is busy and the queue is full ({max_waiting} waiting); retry shortly")]
    QueueFull { max_waiting: usize },
    #[error("no replica had room within {ms} ms (queue.deadline_ms); retry shortly")]
    QueueTimeout { ms: u64 },
    #[error("`{field}` is longer than {max} bytes")]
    TooLong { field: &'static str, max: usize },
    #[error("invalid API key: send `Authorization: Bearer <key>` with a key this router accepts")]
    Unauthorized,
    #[error("the tenant header does not name a tenant (1 to 64 of A-Z a-z 0-9 . _ -)")]
    BadTenant,
    #[error("the model `{model}` is not served by any replica")]
    ModelNotFound { model: String },
    #[error("the replica holding response `{id}` is unavailable; retry shortly, or start a new response")]
    ResponseUnavailable { id: String },
    #[error("internal error: {0}")]
    Internal(String),
}

/// ` name` when the replica may be named in error bodies.
fn named(replica: &Option<String>) -> String {
    replica
        .as_ref()
        .map(|r| format!(" {r}"))
        .unwrap_or_default()
}

impl RouterError {
    /// Every `code`, for pre-registering metric labels.
    pub const CODES: [&'static str; 17] = [
        "no_replica",
        "body_too_large",
        "body_timeout",
        "invalid_body",
        "upstream_error",
        "upstream_timeout",
        "overloaded",
        "replicas_saturated",
        "queue_full",
        "queue_timeout",
        "rate_limit_exceeded",
        "string_above_max_length",
        "invalid_api_key",
        "invalid_tenant",
        "model_not_found",
        "response_unavailable",
        "internal_error",
    ];

    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            RouterError::NoReplica => 503,
            RouterError::BodyTooLarge { .. } => 413,
            RouterError::BodyTimeout { .. } => 408,
            RouterError::BadBody { .. } => 400,
            RouterError::Upstream { .. } => 502,
            RouterError::UpstreamTimeout { .. } => 504,
            RouterError::Overloaded { .. } => 503,
            RouterError::Saturated { .. } => 429,
            RouterError::ClientLimit { .. } => 429,
            RouterError::RateLimited { .. } => 429,
            RouterError::QueueFull { .. } => 429,
            RouterError::QueueTimeout { .. } => 503,
            RouterError::TooLong { .. } => 400,
            RouterError::Unauthorized => 401,
            RouterError::BadTenant => 400,
            RouterError::ModelNotFound { .. } => 404,
            RouterError::ResponseUnavailable { .. } => 503,
            RouterError::Internal(_) => 500,
        }
    }

    /// The `code` field and the `kind` label of `prefix_router_errors_total`.
    pub fn code(&self) -> &'static str {
        match self {
            RouterError::NoReplica => "no_replica",
            RouterError::BodyTooLarge { .. } => "body_too_large",
            RouterError::BodyTimeout { .. } => "body_timeout",
            RouterError::BadBody { .. } => "invalid_body",
            RouterError::Upstream { .. } => "upstream_error",
            RouterError::UpstreamTimeout { .. } => "upstream_timeout",
            RouterError::Overloaded { .. } => "overloaded",
            RouterError::Saturated { .. } => "replicas_saturated",
            RouterError::ClientLimit { .. } | RouterError::RateLimited { .. } => {
                "rate_limit_exceeded"
            }
            RouterError::QueueFull { .. } => "queue_full",
            RouterError::QueueTimeout { .. } => "queue_timeout",
            RouterError::TooLong { .. } => "string_above_max_length",
            RouterError::Unauthorized => "invalid_api_key",
            RouterError::BadTenant => "invalid_tenant",
            RouterError::ModelNotFound { .. } => "model_not_found",
            RouterError::ResponseUnavailable { .. } => "response_unavailable",
            RouterError::Internal(_) => "internal_error",
        }
    }

    /// Every slot (`limits.max_requests`) is taken.
    pub const AT_CAPACITY: RouterError = RouterError::Overloaded {
        what: "requests in flight",
    };

    /// The byte budget (`limits.max_buffered_bytes`) is spent.
    pub const OVER_BUDGET: RouterError = RouterError::Overloaded {
        what: "buffered request bytes",
    };

    /// Seconds a client should wait before retrying, for `Retry-After`.
    pub fn retry_after_s(&self) -> Option<u64> {
        if let RouterError::RateLimited { retry_after_ms, .. } = self {
            return Some(retry_s(*retry_after_ms));
        }
        matches!(
            self,
            RouterError::Overloaded { .. }
                | RouterError::Saturated { .. }
                | RouterError::ClientLimit { .. }
                | RouterError::QueueFull { .. }
                | RouterError::QueueTimeout { .. }
                | RouterError::NoReplica
                | RouterError::ResponseUnavailable { .. }
        )
        .then_some(1)
    }

    /// `x-should-retry`, which the OpenAI and Anthropic SDKs obey over their
    /// own rule (they retry 502/504 by default): an engine may have had the
    /// request, so a client retry could be a second prefill or tool call.
    pub fn should_retry(&self) -> Option<bool> {
        match self {
            RouterError::Upstream { .. } | RouterError::UpstreamTimeout { .. } => Some(false),
            RouterError::Overloaded { .. }
            | RouterError::Saturated { .. }
            | RouterError::ClientLimit { .. }
            | RouterError::RateLimited { .. }
            | RouterError::QueueFull { .. }
            | RouterError::QueueTimeout { .. }
            | RouterError::NoReplica => Some(true),
            _ => None,
        }
    }

    fn kind(&self) -> &'static str {
        match self.status() {
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Vec<u8> {
        serde_json::json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "code": self.code(),
        }})
        .to_string()
        .into_bytes()
    }
}

/// Whole seconds to wait, at least 1 (`Retry-After` has no fractions).
fn retry_s(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// A tenant's limits and what is left of them, as OpenAI sends them
/// (`x-ratelimit-limit-requests`, `-remaining-`, `-reset-`, and the same for
/// tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<Rate>,
    pub tokens: Option<Rate>,
}

/// One per-minute limit: its size, what is left, and when it is whole again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub limit: u64,
    pub remaining: u64,
    pub reset_ms: u64,
}

impl RateHeaders {
    /// Each header's name and value.
    pub fn each(&self, mut f: impl FnMut(&'static str, String)) {
        for (rate, [limit, remaining, reset]) in [
            (
                self.requests,
                [
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ],
            ),
            (
                self.tokens,
                [
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ],
            ),
        ] {
            if let Some(r) = rate {
                f(limit, r.limit.to_string());
                f(remaining, r.remaining.to_string());
                f(reset, duration_text(r.reset_ms));
            }
        }
    }
}

/// A duration as OpenAI's reset headers write it: `20ms`, `1.5s`, `6m0s`.
pub fn duration_text(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (m, s, frac) = (ms / 60_000, ms / 1000 % 60, ms % 1000);
    let secs = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{frac:03}");
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    if m > 0 {
        format!("{m}m{secs}")
    } else {
        secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_openai_shaped() {
        let e = RouterError::BodyTooLarge { limit: 10 };
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(e.status(), 413);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "body_too_large");
        assert!(v["error"]["message"].as_str().unwrap().contains("10 bytes"));
        assert_eq!(RouterError::NoReplica.status(), 503);
        let hidden = RouterError::UpstreamTimeout { replica: None };
        assert_eq!(hidden.to_string(), "the replica did not answer in time");
        for e in [
            RouterError::NoReplica,
            RouterError::BodyTooLarge { limit: 1 },
            RouterError::BodyTimeout { ms: 1 },
            RouterError::BadBody { detail: "x".into() },
            RouterError::Upstream {
                replica: Some("a".into()),
                detail: "x".into(),
            },
            RouterError::UpstreamTimeout {
                replica: Some("a".into()),
            },
            RouterError::Overloaded { what: "requests" },
            RouterError::Saturated { in_flight: 4 },
            RouterError::Unauthorized,
            RouterError::ModelNotFound { model: "m".into() },
            RouterError::ResponseUnavailable { id: "r".into() },
            RouterError::Internal("x".into()),
        ] {
            assert!(RouterError::CODES.contains(&e.code()), "{e:?}");
        }
    }

    #[test]
    fn a_tenant_limit_says_when_to_retry_in_whole_seconds_and_resets_in_go_durations() {
        let e = RouterError::RateLimited {
            who: "tenant `acme`".into(),
            what: "600 requests per minute".into(),
            retry_after_ms: 1_100,
            headers: RateHeaders::default(),
        };
        assert_eq!(
            (e.status(), e.code(), e.retry_after_s()),
            (429, "rate_limit_exceeded", Some(2))
        );
        assert!(e.to_string().contains("retry after 2 s"), "{e}");
        let texts: Vec<_> = [0, 20, 1000, 1500, 60_000, 360_250]
            .map(duration_text)
            .into();
        assert_eq!(texts, ["0ms", "20ms", "1s", "1.5s", "1m0s", "6m0.25s"]);
        let mut names = Vec::new();
        let rate = Rate {
            limit: 60,
            remaining: 0,
            reset_ms: 1000,
        };
        RateHeaders {
            requests: Some(rate),
            tokens: None,
        }
        .each(|n, v| names.push((n, v)));
        assert_eq!(names[1], ("x-ratelimit-remaining-requests", "0".to_owned()));
        assert_eq!(names.len(), 3);
    }
}
