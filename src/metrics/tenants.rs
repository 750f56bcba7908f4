//! Per tenant (see `tenants`): requests admitted, refused by which limit,
//! in progress, prompt tokens charged, time waited in the queue. The `tenant` label is a name the
//! config or the API keys file gives (or `anonymous`); names only a request
//! header gave are counted as `other`.

use super::family::{
    Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Register,
};

/// The limits a request can be refused by, as the `limit` label (`queue`:
/// the queue was full, or its deadline passed).
pub const TENANT_LIMITS: [&str; 4] = ["concurrency", "requests", "tokens", "queue"];

/// Seconds waited in the queue: a turn (milliseconds) to a deadline.
const WAIT_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
];

pub struct TenantMetrics {
    requests: IntCounterVec,
    refused: IntCounterVec,
    in_flight: IntGaugeVec,
    prompt_tokens: IntCounterVec,
    pub queue_wait: HistogramVec,
    /// Requests waiting in the queue now (all tenants).
    pub queue_waiting: IntGauge,
}

/// One tenant's handles, resolved once per tenant.
#[derive(Clone)]
pub struct TenantCounters {
    pub requests: IntCounter,
    /// By `TENANT_LIMITS`.
    pub refused: [IntCounter; 4],
    pub in_flight: IntGauge,
    pub prompt_tokens: IntCounter,
    pub queue_wait: Histogram,
}

impl TenantMetrics {
    pub fn new(r: &mut Register) -> Self {
        Self {
            requests: r.counter_vec("prefix_router_tenant_requests_total", "Requests admitted, by tenant", &["tenant"]),
            refused: r.counter_vec("prefix_router_tenant_refused_total", "Requests answered 429 by a tenant's limit, by tenant and limit (concurrency, requests, tokens)", &["tenant", "limit"]),
            in_flight: r.gauge_vec("prefix_router_tenant_in_progress_requests", "Requests in progress (head to end), by tenant", &["tenant"]),
            prompt_tokens: r.counter_vec("prefix_router_tenant_prompt_tokens_total", "Prompt tokens charged to tenants' limits: the engine's reported count, else the router's estimate (canonical bytes / 4)", &["tenant"]),
            queue_wait: r.histogram_vec("prefix_router_tenant_queue_wait_seconds", "Time routed requests waited for a place under shed_in_flight (queue), by tenant: 0 for those that went on at once", &["tenant"], &WAIT_BUCKETS),
            queue_waiting: r.gauge("prefix_router_queue_waiting_requests", "Requests waiting in the queue for a replica under shed_in_flight"),
        }
    }

    /// The handles of the tenant labelled `label`.
    pub fn of(&self, label: &str) -> TenantCounters {
        TenantCounters {
            requests: self.requests.with_label_values(&[label]),
            refused: TENANT_LIMITS.map(|l| self.refused.with_label_values(&[label, l])),
            in_flight: self.in_flight.with_label_values(&[label]),
            prompt_tokens: self.prompt_tokens.with_label_values(&[label]),
            queue_wait: self.queue_wait.with_label_values(&[label]),
        }
    }
}
