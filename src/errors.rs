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
    #[error("the replica {replica} failed: {detail}")]
    Upstream { replica: String, detail: String },
    #[error("the replica {replica} did not answer in time")]
    UpstreamTimeout { replica: String },
    #[error("internal error: {0}")]
    Internal(String),
}

impl RouterError {
    /// Every `code`, for pre-registering metric labels.
    pub const CODES: [&'static str; 6] = [
        "no_replica",
        "body_too_large",
        "body_timeout",
        "upstream_error",
        "upstream_timeout",
        "internal_error",
    ];

    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            RouterError::NoReplica => 503,
            RouterError::BodyTooLarge { .. } => 413,
            RouterError::BodyTimeout { .. } => 408,
            RouterError::Upstream { .. } => 502,
            RouterError::UpstreamTimeout { .. } => 504,
            RouterError::Internal(_) => 500,
        }
    }

    /// The `code` field and the `kind` label of `prefix_router_errors_total`.
    pub fn code(&self) -> &'static str {
        match self {
            RouterError::NoReplica => "no_replica",
            RouterError::BodyTooLarge { .. } => "body_too_large",
            RouterError::BodyTimeout { .. } => "body_timeout",
            RouterError::Upstream { .. } => "upstream_error",
            RouterError::UpstreamTimeout { .. } => "upstream_timeout",
            RouterError::Internal(_) => "internal_error",
        }
    }

    fn kind(&self) -> &'static str {
        match self.status() {
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
        for e in [
            RouterError::NoReplica,
            RouterError::BodyTooLarge { limit: 1 },
            RouterError::BodyTimeout { ms: 1 },
            RouterError::Upstream {
                replica: "a".into(),
                detail: "x".into(),
            },
            RouterError::UpstreamTimeout {
                replica: "a".into(),
            },
            RouterError::Internal("x".into()),
        ] {
            assert!(RouterError::CODES.contains(&e.code()), "{e:?}");
        }
    }
}
