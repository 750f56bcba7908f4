//! Every Prometheus metric the router exports, declared once in the
//! registry `Metrics::new` makes (`page` writes it in the OpenMetrics text
//! format, which `status` serves on `metrics_listen`). One `Metrics` is
//! built at start and handed to each part that counts; nothing reaches it
//! through a global. Label values come from config (replica names), the
//! replicas' model lists or enums, never from requests.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::registry::Registry;

mod family;
mod kv_events;
mod log_drops;
mod prompts;
mod replica;
mod tenants;

use family::Register;
pub use family::{
    GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
};
pub use kv_events::{KvEventMetrics, KvOutcome};
pub use prompts::PromptMetrics;
pub use replica::{Ejection, Repair, ReplicaCounters};
pub use tenants::{TenantCounters, TenantMetrics, TENANT_LIMITS};

use crate::policy::Reason;

/// The router's metric handles.
pub struct Metrics {
    /// Routed requests by replica, decision reason and shape.
    pub requests: IntCounterVec,
    /// Connection failures that moved a request to another replica, by failed replica.
    pub failovers: IntCounterVec,
    /// 1 when the replica is live (health check passing, not ejected).
    pub replica_up: IntGaugeVec,
    pub replica_drained: IntGaugeVec,
    /// Requests in flight per replica.
    pub in_flight: IntGaugeVec,
    pub queued_prefill: IntGaugeVec,
    /// Declared KV capacity per replica, tokens.
    pub kv_tokens: IntGaugeVec,
    /// Estimated prefix working set placed on each replica, tokens.
    pub working_set: IntGaugeVec,
    /// Of which continuations placed (the contexts `kv_room` protects).
    pub pinned_working_set: IntGaugeVec,
    /// Errors the router itself answered, by kind.
    pub errors: IntCounterVec,
    /// Config reloads by result (`ok`, `error`).
    pub reloads: IntCounterVec,
    /// API keys file reloads by result (`ok`, `error`).
    pub key_reloads: IntCounterVec,
    /// 1 while the config file changes keys that need a restart.
    pub restart_pending: IntGauge,
    /// Responses API ids whose replica the router knows.
    pub response_ids: IntGauge,
    /// Routed requests by model and decision.
    pub model_requests: IntCounterVec,
    /// `model_requests` handles by model, resolved once per model.
    /// Read without a lock; a model seen for the first time publishes a
    /// new map (under `models_adding`).
    models: arc_swap::ArcSwap<std::collections::HashMap<String, Vec<IntCounter>>>,
    models_adding: std::sync::Mutex<()>,
    /// Entries and heap bytes of the prefix index.
    pub index_entries: IntGauge,
    pub index_bytes: IntGauge,
    /// Time from request start to the replica's response header.
    pub upstream_header_seconds: Histogram,
    /// By replica and decision: time from request start to the first
    /// response body bytes from the replica (the router's view of TTFT), and
    /// to the end of the response.
    pub first_byte_seconds: HistogramVec,
    pub duration_seconds: HistogramVec,
    /// Body bytes of routed requests.
    pub request_body_bytes: Histogram,
    /// Requests that arrived with no live replica at all.
    pub no_replica: IntCounter,
    /// Ejections from the request path, by replica and reason.
    pub ejections: IntCounterVec,
    /// Active health checks by replica and result (`HEALTH_CHECK_RESULTS`).
    pub health_checks: IntCounterVec,
    /// Placements made in panic mode (every healthy replica ejected).
    pub panic_routed: IntCounter,
    /// 1 while no replica is live and requests go to them anyway.
    pub panic_mode: IntGauge,
    /// Requests and body bytes held under `limits`.
    pub admitted_requests: IntGauge,
    pub buffered_body_bytes: IntGauge,
    /// Over responses that reported their usage, by replica and decision:
    /// cached tokens the router predicted, cached tokens the engine reported,
    /// and prompt tokens the engine reported.
    pub predicted_cached: IntCounterVec,
    pub delivered_cached: IntCounterVec,
    pub reported_prompt: IntCounterVec,
    /// Placements that predicted reuse, by replica and `hit` / `miss`.
    pub pin_outcomes: IntCounterVec,
    /// Prefix index repairs, by replica and cause.
    pub index_repairs: IntCounterVec,
    /// Reads of engines' metrics, by replica and result.
    pub engine_reads: IntCounterVec,
    /// What each engine last reported (absent while unknown): requests
    /// running plus waiting, and the share of its KV cache in use.
    pub engine_requests: IntGaugeVec,
    pub engine_kv_used: GaugeVec,
    /// Shared pins (`fleet: redis`): lookups and writes by result.
    pub shared_pins: IntCounterVec,
    /// Long bodies' parses, checkpoints and tokenized chat prompts.
    pub prompts: PromptMetrics,
    /// The engines' KV events, by replica.
    pub kv: KvEventMetrics,
    /// Per tenant.
    pub tenants: TenantMetrics,
    /// The log writer's count of dropped lines, once it is watched.
    log_drops: Arc<std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter>>,
    registry: Registry,
    /// Replica names with series, and the sweeps each has been gone
    /// (`sweep_replicas`).
    replica_names: Arc<replica::ReplicaNames>,
    /// The last page's length: the next one's buffer.
    page_size: AtomicUsize,
}

/// The `/metrics` page's content type.
pub const PAGE_FORMAT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Seconds: a cached turn's first token (tens of ms) to a long generation.
const LATENCY_BUCKETS: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The `result` values of `engine_reads`.
pub const ENGINE_READ_RESULTS: [&str; 3] = ["ok", "failed", "unrecognised"];

/// Results of an active health check.
pub const HEALTH_CHECK_RESULTS: [&str; 3] = ["pass", "fail", "timeout"];

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, in a registry of its own (`registry`).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let log_drops = Arc::default();
        registry.register_collector(Box::new(log_drops::LogDrops(Arc::clone(&log_drops))));
        let r = &mut Register(&mut registry);
        let metrics = Metrics {
            requests: r.counter_vec(
                "prefix_router_requests_total", "Requests routed, by replica, decision and shape", &["replica", "decision", "shape"]
            ),
            failovers: r.counter_vec(
                "prefix_router_failovers_total", "Connection failures to a replica that were retried on another", &["replica"]
            ),
            replica_up: r.gauge_vec(
                "prefix_router_replica_up", "1 when the replica's health check passes and it is not ejected", &["replica"]
            ),
            replica_drained: r.gauge_vec(
                "prefix_router_replica_drained", "1 while the replica is drained through the admin API", &["replica"]
            ),
            in_flight: r.gauge_vec(
                "prefix_router_in_flight_requests", "Requests in flight per replica", &["replica"]
            ),
            queued_prefill: r.gauge_vec(
                "prefix_router_queued_prefill_tokens", "Prompt tokens (bytes / 4) of the streams sent to the replica and not answering yet, less what their placement expected cached (queued_prefill_step_bytes; refreshed every 500 ms)", &["replica"]
            ),
            kv_tokens: r.gauge_vec(
                "prefix_router_replica_kv_capacity_tokens", "Declared KV cache capacity per replica (config kv_tokens)", &["replica"]
            ),
            working_set: r.gauge_vec(
                "prefix_router_replica_working_set_tokens", "Distinct prompt tokens placed on the replica within working_set_window_s (estimate, bytes/4)", &["replica"]
            ),
            pinned_working_set: r.gauge_vec(
                "prefix_router_replica_pinned_working_set_tokens", "Of the working set, the tokens continuations placed (contexts expected back; kv_room keeps cold prompts off them)", &["replica"]
            ),
            errors: r.counter_vec(
                "prefix_router_errors_total", "Errors answered by the router, by kind", &["kind"]
            ),
            reloads: r.counter_vec(
                "prefix_router_config_reloads_total", "Config file reloads, by result", &["result"]
            ),
            key_reloads: r.counter_vec(
                "prefix_router_api_keys_reloads_total", "Keys file reloads (api_keys_file, admin_keys_file), by result", &["file", "result"]
            ),
            model_requests: r.counter_vec(
                "prefix_router_model_requests_total", "Routed requests by model (as a replica lists it; `unlisted` for a model no replica lists, `none` without one) and decision", &["model", "decision"]
            ),
            models: arc_swap::ArcSwap::default(),
            models_adding: std::sync::Mutex::new(()),
            response_ids: r.gauge(
                "prefix_router_response_ids", "Responses API response ids whose replica the router knows (bounded, least recently used evicted)"
            ),
            restart_pending: r.gauge(
                "prefix_router_config_restart_pending", "1 while the config file changes keys a reload cannot apply (logged by name); they take effect at the next restart"
            ),
            index_entries: r.gauge(
                "prefix_router_prefix_index_entries", "Entries in the prefix index"
            ),
            index_bytes: r.gauge(
                "prefix_router_prefix_index_bytes", "Heap bytes of the prefix index"
            ),
            upstream_header_seconds: r.histogram(
                "prefix_router_upstream_header_seconds", "Time from request arrival to the replica's response header (TTFB incl. body read)", &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
            ),
            first_byte_seconds: r.histogram_vec(
                "prefix_router_first_byte_seconds", "Time from request arrival to the first response body bytes from the replica (the router's view of time to first token), by decision (not by replica too: a fleet of a thousand would export a quarter of a million series)", &["decision"], &LATENCY_BUCKETS
            ),
            duration_seconds: r.histogram_vec(
                "prefix_router_request_duration_seconds", "Time from request arrival to the end of the replica's response, by decision", &["decision"], &LATENCY_BUCKETS
            ),
            request_body_bytes: r.histogram(
                "prefix_router_request_body_bytes", "Body bytes of routed requests (the prompt the router reads and forwards)", &[1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0]
            ),
            no_replica: r.counter(
                "prefix_router_no_replica_total", "Requests answered 503 because no replica was live"
            ),
            ejections: r.counter_vec(
                "prefix_router_ejections_total", "Replicas ejected by the request path, by reason (connect_failed, consecutive_failures)", &["replica", "reason"]
            ),
            health_checks: r.counter_vec(
                "prefix_router_health_checks_total", "Active health checks by replica and result (pass; fail: an error status or a connection failure; timeout: no answer within the check's deadline)", &["replica", "result"]
            ),
            panic_routed: r.counter(
                "prefix_router_panic_routed_total", "Placements on a replica that is not live (ejected, or failing its health checks) because no replica was live (panic mode)"
            ),
            panic_mode: r.gauge(
                "prefix_router_panic_mode", "1 while no replica is live and requests are routed to them anyway (panic mode)"
            ),
            admitted_requests: r.gauge(
                "prefix_router_admitted_requests", "Requests in flight to replicas now (limits.max_requests; taken when placed)"
            ),
            buffered_body_bytes: r.gauge(
                "prefix_router_buffered_body_bytes", "Request bytes held now: bodies, parsed prompts and the heads of requests in progress (limits.max_buffered_bytes)"
            ),
            predicted_cached: r.counter_vec(
                "prefix_router_predicted_cached_tokens_total", "Prompt tokens the router expected the replica to have cached (matched bytes / 4), over responses that reported usage", &["replica", "decision"]
            ),
            delivered_cached: r.counter_vec(
                "prefix_router_delivered_cached_tokens_total", "Prompt tokens the replica reported reused from its cache, over responses that reported usage", &["replica", "decision"]
            ),
            reported_prompt: r.counter_vec(
                "prefix_router_reported_prompt_tokens_total", "Prompt tokens the replica reported, over responses that reported usage", &["replica", "decision"]
            ),
            index_repairs: r.counter_vec(
                "prefix_router_index_repairs_total", "Times the prefix index forgot what a replica held, by cause (miss: the engine reported a predicted prefix gone; restart: the replica came back from a failed health check)", &["replica", "cause"]
            ),
            engine_reads: r.counter_vec(
                "prefix_router_engine_reads_total", "Reads of replicas' own metrics (engine_load), by result (ok; failed: no answer in time or an error status; unrecognised: none of the known series)", &["replica", "result"]
            ),
            engine_requests: r.gauge_vec(
                "prefix_router_engine_requests", "Requests running plus waiting as the replica's engine last reported them (absent while unknown)", &["replica"]
            ),
            engine_kv_used: r.float_gauge_vec(
                "prefix_router_engine_kv_used_ratio", "Share of its KV cache the replica's engine last reported in use, 0..1 (absent while unknown; llama.cpp reports none)", &["replica"]
            ),
            pin_outcomes: r.counter_vec(
                "prefix_router_pin_outcomes_total", "Placements that predicted cached tokens (not singles placed by a shared prompt), by whether the replica reported at least half of them cached", &["replica", "outcome"]
            ),
            shared_pins: r.counter_vec(
                "prefix_router_shared_pins_total", "Shared pins in Redis (fleet: redis): lookups on a local miss (hit, miss, timeout: over redis_budget_ms, unavailable: Redis down or too many waiting) and placements written (ok, dropped: queue full, unavailable, error: Redis answered an error); response_lookup and response_write: the same for Responses API ids", &["op", "result"]
            ),
            prompts: PromptMetrics::new(r),
            kv: KvEventMetrics::new(r),
            tenants: TenantMetrics::new(r),
            log_drops,
            registry: Registry::default(),
            replica_names: Default::default(),
            page_size: AtomicUsize::new(0),
        };
        Metrics {
            registry,
            ..metrics
        }
    }

    /// Every metric, shared (tests, and tools that run parts of the router).
    pub fn standalone() -> Arc<Self> {
        Arc::new(Self::new())
    }

    /// The `/metrics` page, in the OpenMetrics text format.
    pub fn page(&self) -> Result<String, std::fmt::Error> {
        let mut page = String::with_capacity(self.page_size.load(Relaxed));
        prometheus_client::encoding::text::encode(&mut page, &self.registry)?;
        self.page_size.store(page.len(), Relaxed);
        Ok(page)
    }

    /// Exports the log writer's count of dropped lines (from the next
    /// scrape on; a second writer is not watched).
    pub fn watch_log_drops(&self, dropped: tracing_appender::non_blocking::ErrorCounter) {
        let _ = self.log_drops.set(dropped);
    }
    /// Creates every label-free series and the error and reload series at 0,
    /// so dashboards and alerts see them before the first event.
    pub fn init(&self) {
        for kind in crate::errors::RouterError::CODES {
            self.errors.with_label_values(&[kind]);
        }
        for result in ["ok", "error"] {
            self.reloads.with_label_values(&[result]);
            for file in ["api_keys_file", "admin_keys_file"] {
                self.key_reloads.with_label_values(&[file, result]);
            }
        }
        for op in ["lookup", "response_lookup"] {
            for result in ["hit", "miss", "timeout", "unavailable"] {
                self.shared_pins.with_label_values(&[op, result]);
            }
        }
        for op in ["write", "response_write"] {
            for result in ["ok", "dropped", "unavailable", "error"] {
                self.shared_pins.with_label_values(&[op, result]);
            }
        }
    }

    /// Sets `replica_up` from the replica's liveness. Only for a replica in the
    /// set (`Replicas::is_current`): one that left, or moved, may share its
    /// name with a new one.
    pub fn show_live(&self, replica: &str, live: bool) {
        self.replica_up
            .with_label_values(&[replica])
            .set(i64::from(live));
    }

    /// Sets `replica_drained` (see `admin`).
    pub fn show_drained(&self, replica: &str, drained: bool) {
        self.replica_drained
            .with_label_values(&[replica])
            .set(i64::from(drained));
    }

    /// Creates a replica's series at their current values (0 for counters).
    pub fn add_replica(
        &self,
        name: &str,
        (live, drained): (bool, bool),
        in_flight: u32,
        kv_tokens: Option<u64>,
    ) {
        self.remember_replica(name);
        self.show_live(name, live);
        self.show_drained(name, drained);
        self.in_flight
            .with_label_values(&[name])
            .set(i64::from(in_flight));
        self.queued_prefill.with_label_values(&[name]);
        self.kv_tokens
            .with_label_values(&[name])
            .set(i64::try_from(kv_tokens.unwrap_or(0)).unwrap_or(i64::MAX));
        for kind in Ejection::ALL {
            self.ejections.with_label_values(&[name, kind.as_str()]);
        }
        for cause in Repair::ALL {
            self.index_repairs
                .with_label_values(&[name, cause.as_str()]);
        }
        self.working_set.with_label_values(&[name]);
        self.pinned_working_set.with_label_values(&[name]);
        for result in ENGINE_READ_RESULTS {
            self.engine_reads.with_label_values(&[name, result]);
        }
        for result in HEALTH_CHECK_RESULTS {
            self.health_checks.with_label_values(&[name, result]);
        }
    }

    /// Shows what a replica's engine last reported (requests running plus
    /// waiting, KV in use per mille), or drops the series while nothing
    /// usable is known.
    pub fn engine_load(&self, replica: &str, load: Option<(u32, Option<u16>)>) {
        let kv = load.and_then(|(_, kv)| kv);
        match load {
            Some((requests, _)) => {
                (self.engine_requests.with_label_values(&[replica])).set(i64::from(requests));
            }
            None => {
                self.engine_requests.remove_label_values(&[replica]);
            }
        }
        match kv {
            Some(k) => {
                (self.engine_kv_used.with_label_values(&[replica])).set(f64::from(k) / 1000.0);
            }
            None => {
                self.engine_kv_used.remove_label_values(&[replica]);
            }
        }
    }

    /// Counts and logs one repair of the prefix index (one that forgot
    /// nothing is none).
    pub fn repaired(&self, replica: &str, cause: Repair, forgotten: usize) {
        if forgotten == 0 {
            return;
        }
        self.remember_replica(replica);
        self.index_repairs
            .with_label_values(&[replica, cause.as_str()])
            .inc();
        let why = match cause {
            Repair::Miss => "it reported a pinned prefix gone from its cache",
            Repair::Restart => {
                "it is back after a failed health check (a restarted engine starts empty)"
            }
            Repair::Events => "its KV events said its cache was emptied (a reset or a restart)",
        };
        log::info!("replica {replica}: forgot {forgotten} prefix index entries: {why}");
    }

    /// Counts a routed request under its model: `listed` when a replica's
    /// model list names it (other values never become labels).
    pub fn model_routed(&self, model: Option<&str>, listed: bool, reason: Reason) {
        let label = match model {
            None => "none",
            Some(m) if listed => m,
            Some(_) => "unlisted",
        };
        let Some(i) = Reason::ALL.iter().position(|&r| r == reason) else {
            return;
        };
        if let Some(c) = self.models.load().get(label).and_then(|v| v.get(i)) {
            c.inc();
            return;
        }
        let _one = self.models_adding.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = std::collections::HashMap::clone(&self.models.load());
        let counters = next.entry(label.to_owned()).or_insert_with(|| {
            Reason::ALL
                .iter()
                .map(|r| self.model_requests.with_label_values(&[label, r.as_str()]))
                .collect()
        });
        if let Some(c) = counters.get(i) {
            c.inc();
        }
        self.models.store(std::sync::Arc::new(next));
    }

    /// Counts one ejection.
    pub fn ejected(&self, replica: &str, kind: Ejection) {
        self.remember_replica(replica);
        self.ejections
            .with_label_values(&[replica, kind.as_str()])
            .inc();
    }

    /// Drops a replica's gauges (with its counters, when its name left the
    /// set: `sweep_replicas`).
    fn forget_replica(&self, replica: &str) {
        for g in [
            &self.replica_up,
            &self.replica_drained,
            &self.in_flight,
            &self.queued_prefill,
            &self.kv_tokens,
            &self.working_set,
            &self.pinned_working_set,
        ] {
            g.remove_label_values(&[replica]);
        }
        self.engine_load(replica, None);
    }
}
