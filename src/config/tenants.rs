//! `tenants:` — who a request belongs to and what each tenant may use:
//! concurrent requests, requests and prompt tokens per minute, and its
//! share when requests wait for a replica (weight, class).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{invalid, ConfigError};

/// `tenants:`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tenants {
    /// A request header naming the tenant when the client's API key does
    /// not (a key file line's `tenant=` always wins). Set it only behind a
    /// gateway that sets it: clients could name any tenant.
    pub header: Option<String>,
    /// Limits of every tenant without its own entry under `named`.
    pub default: TenantLimits,
    /// Per tenant name: its limits; a field left out is `default`'s.
    pub named: BTreeMap<String, TenantLimits>,
    /// Tenants whose counts are held at once; more (names from `header`
    /// only) share one count, `other`, until idle ones are let go.
    pub max_tracked: usize,
}

impl Default for Tenants {
    fn default() -> Self {
        Self {
            header: None,
            default: TenantLimits::default(),
            named: BTreeMap::new(),
            max_tracked: 10_000,
        }
    }
}

/// `queue:` — with `shed_in_flight`, the replicas' in-flight places are
/// shared fairly: a routed request waits here (before its body is read)
/// while every place is taken or its tenant holds its share, instead of
/// being answered 429; tenants take turns by `weight`, `priority` first.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Queue {
    /// Requests waiting at once; past it, the newest waiter of the tenant
    /// with the most waiting is answered 429 (or the newcomer, when that is
    /// its own tenant).
    pub max_waiting: usize,
    /// A request waiting this long is answered 503 `queue_timeout`.
    pub deadline_ms: u64,
    /// A tenant that held places within this long keeps as many in its
    /// share (an agent between turns finds its place free when it comes
    /// back); the others share the rest by weight.
    pub share_window_ms: u64,
}

impl Default for Queue {
    fn default() -> Self {
        Self {
            max_waiting: 1024,
            deadline_ms: 30_000,
            share_window_ms: 10_000,
        }
    }
}

/// One tenant's limits; unset (or 0): no limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantLimits {
    /// Requests in progress at once (head to end).
    pub max_concurrent: Option<u32>,
    /// Requests admitted per minute (a bucket refilled continuously).
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens per minute: estimated from the canonical prompt when
    /// a request is admitted, corrected by the engine's reported usage.
    pub prompt_tokens_per_minute: Option<u64>,
    /// Share of the replicas when requests wait for one (see `queue`).
    pub weight: Option<u32>,
    /// `priority` waits ahead of `standard`.
    pub class: Option<Class>,
}

/// A tenant's admission class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Priority,
    #[default]
    Standard,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Priority => "priority",
            Class::Standard => "standard",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        match s {
            "priority" => Some(Class::Priority),
            "standard" => Some(Class::Standard),
            _ => None,
        }
    }
}

/// Longest tenant name (names are metric label values).
pub const MAX_TENANT_NAME: usize = 64;

/// Whether `name` can name a tenant: 1 to 64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_tenant_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TENANT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl TenantLimits {
    /// `self` with the fields it leaves out taken from `default`.
    pub fn over(&self, default: &TenantLimits) -> TenantLimits {
        TenantLimits {
            max_concurrent: self.max_concurrent.or(default.max_concurrent),
            requests_per_minute: self.requests_per_minute.or(default.requests_per_minute),
            prompt_tokens_per_minute: self
                .prompt_tokens_per_minute
                .or(default.prompt_tokens_per_minute),
            weight: self.weight.or(default.weight),
            class: self.class.or(default.class),
        }
    }
}

impl Tenants {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(h) = &self.header {
            if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err(invalid(
                    "tenants.header",
                    format!("`{h}` is not a header name"),
                ));
            }
        }
        if self.max_tracked == 0 {
            return Err(invalid("tenants.max_tracked", "must be positive"));
        }
        let all = std::iter::once(("default".to_owned(), &self.default)).chain(
            self.named
                .iter()
                .map(|(name, l)| (format!("named.{name}"), l)),
        );
        for (field, limits) in all {
            if let Some(name) = field.strip_prefix("named.") {
                if !valid_tenant_name(name) || name == OTHER {
                    return Err(invalid(
                        "tenants.named",
                        format!("`{name}` is not a tenant name (1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 . _ -, not `{OTHER}`)"),
                    ));
                }
            }
            if limits.weight == Some(0) {
                return Err(invalid(
                    format!("tenants.{field}.weight"),
                    "must be positive",
                ));
            }
        }
        Ok(())
    }
}

/// The tenant name counts fall back to past `max_tracked`, and the metric
/// label of tenants nobody configured.
pub const OTHER: &str = "other";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const ONE: &str = "replicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";

    #[test]
    fn named_limits_fall_back_to_the_default_field_by_field() {
        let cfg = Config::parse(
            &format!("{ONE}tenants:\n  default: {{requests_per_minute: 60, weight: 2}}\n  named:\n    acme: {{max_concurrent: 4, class: priority}}\n"),
            None,
        )
        .unwrap();
        let t = cfg.tenants.as_ref().unwrap();
        let acme = t.named["acme"].over(&t.default);
        assert_eq!(acme.max_concurrent, Some(4));
        assert_eq!(acme.requests_per_minute, Some(60));
        assert_eq!(acme.weight, Some(2));
        assert_eq!(acme.class, Some(Class::Priority));
    }

    #[test]
    fn bad_names_weights_and_headers_are_named() {
        for (yaml, field) in [
            ("tenants: {named: {\"a b\": {}}}", "tenants.named"),
            ("tenants: {named: {other: {}}}", "tenants.named"),
            (
                "tenants: {named: {acme: {weight: 0}}}",
                "tenants.named.acme.weight",
            ),
            ("tenants: {header: \"x tenant\"}", "tenants.header"),
            ("tenants: {default: {class: gold}}", "class"),
        ] {
            let e = Config::parse(&format!("{ONE}{yaml}\n"), None).unwrap_err();
            assert!(e.to_string().contains(field), "{yaml}: {e}");
        }
    }

    #[test]
    fn tenant_names_are_label_safe() {
        assert!(valid_tenant_name("team-a.prod_1"));
        assert!(!valid_tenant_name(""));
        assert!(!valid_tenant_name("a/b"));
        assert!(!valid_tenant_name(&"a".repeat(65)));
    }
}
