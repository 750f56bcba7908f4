//! Per tenant (see `tenants`): requests admitted, refused by which limit,
//! in progress, prompt tokens charged. The `tenant` label is a name the
//! config or the API keys file gives (or `anonymous`); names only a request
//! header gave are counted as `other`.

use prometheus::{
    register_int_counter_vec_with_registry, register_int_gauge_vec_with_registry, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Registry,
};

/// The limits a request can be refused by, as the `limit` label.
pub const TENANT_LIMITS: [&str; 3] = ["concurrency", "requests", "tokens"];

pub struct TenantMetrics {
    requests: IntCounterVec,
    refused: IntCounterVec,
    in_flight: IntGaugeVec,
    prompt_tokens: IntCounterVec,
}

/// One tenant's handles, resolved once per tenant.
#[derive(Clone)]
pub struct TenantCounters {
    pub requests: IntCounter,
    /// By `TENANT_LIMITS`.
    pub refused: [IntCounter; 3],
    pub in_flight: IntGauge,
    pub prompt_tokens: IntCounter,
}

impl TenantMetrics {
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            requests: register_int_counter_vec_with_registry!(
                "prefix_router_tenant_requests_total",
                "Requests admitted, by tenant",
                &["tenant"],
                registry
            )?,
            refused: register_int_counter_vec_with_registry!(
                "prefix_router_tenant_refused_total",
                "Requests answered 429 by a tenant's limit, by tenant and limit (concurrency, requests, tokens)",
                &["tenant", "limit"],
                registry
            )?,
            in_flight: register_int_gauge_vec_with_registry!(
                "prefix_router_tenant_in_progress_requests",
                "Requests in progress (head to end), by tenant",
                &["tenant"],
                registry
            )?,
            prompt_tokens: register_int_counter_vec_with_registry!(
                "prefix_router_tenant_prompt_tokens_total",
                "Prompt tokens charged to tenants' limits: the engine's reported count, else the router's estimate (canonical bytes / 4)",
                &["tenant"],
                registry
            )?,
        })
    }

    /// The handles of the tenant labelled `label`.
    pub fn of(&self, label: &str) -> TenantCounters {
        TenantCounters {
            requests: self.requests.with_label_values(&[label]),
            refused: TENANT_LIMITS.map(|l| self.refused.with_label_values(&[label, l])),
            in_flight: self.in_flight.with_label_values(&[label]),
            prompt_tokens: self.prompt_tokens.with_label_values(&[label]),
        }
    }
}
