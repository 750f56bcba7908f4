//! `traces:` — OpenTelemetry traces of requests, exported as OTLP over
//! HTTP (see `traces`). Unset: none, at no cost.

use serde::Deserialize;

use super::{invalid, ConfigError};

/// `traces:`
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Traces {
    /// The collector's OTLP/HTTP traces URL (protobuf), `http://HOST:PORT/PATH`.
    pub endpoint: String,
    /// Share of the traces that start here that are kept (by trace id); a
    /// request that arrives with a `traceparent` keeps its sender's choice.
    pub sample_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
    /// An export (one batch) gives up after this long.
    pub export_timeout_ms: u64,
}

impl Default for Traces {
    fn default() -> Self {
        Self {
            endpoint: "http://127.0.0.1:4318/v1/traces".into(),
            sample_ratio: 0.01,
            service_name: "prefix-router".into(),
            export_timeout_ms: 5_000,
        }
    }
}

impl Traces {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let uri: http::Uri = self
            .endpoint
            .parse()
            .map_err(|e| invalid("traces.endpoint", format!("`{}`: {e}", self.endpoint)))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(invalid(
                "traces.endpoint",
                format!("`{}` is not http://HOST:PORT/PATH (https is not supported yet: export through a local collector)", self.endpoint),
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid("traces.sample_ratio", "must be 0 to 1"));
        }
        if self.export_timeout_ms == 0 {
            return Err(invalid("traces.export_timeout_ms", "must be positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const ONE: &str = "replicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";

    #[test]
    fn a_bad_endpoint_or_ratio_is_named() {
        for (yaml, field) in [
            (
                "traces: {endpoint: \"https://c:4318/v1/traces\"}",
                "traces.endpoint",
            ),
            ("traces: {endpoint: \"c:4318\"}", "traces.endpoint"),
            ("traces: {sample_ratio: 2}", "traces.sample_ratio"),
        ] {
            let e = Config::parse(&format!("{ONE}{yaml}\n"), None).unwrap_err();
            assert!(e.to_string().contains(field), "{yaml}: {e}");
        }
        let ok = Config::parse(&format!("{ONE}traces: {{}}\n"), None).unwrap();
        assert_eq!(ok.traces.unwrap().sample_ratio, 0.01);
    }
}
