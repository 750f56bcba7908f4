//! The capacity wall, said out loud: the working set the router has placed on
//! each replica (distinct prompt blocks of recent requests, in tokens) beside
//! the replica's declared `kv_tokens`, exported as gauges; a warning naming the
//! levers when it does not fit. No placement changes: routing cannot rescue
//! arithmetic (the seed's capacity section). It also hands each replica its
//! pinned working set, which the policy's `kv_room` weighs cold placements by.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::admission::Admission;
use crate::metrics::Metrics;
use crate::policy::{Policy, ReplicaId, WorkingSet, BYTES_PER_TOKEN};
use crate::replicas::Replicas;

/// How often the working set is recomputed, and how often a warning repeats
/// while a replica stays over its capacity.
const CHECK_EVERY: Duration = Duration::from_millis(500);
const REWARN_EVERY_S: u32 = 60;

/// Watches working sets against capacities (a background service).
pub struct CapacityWatch {
    /// The policy's clock counts seconds from here; the watch advances it, so
    /// the request path never reads the time (stamps lag by under a tick and
    /// the index's pass, which on a saturated core yields to the requests:
    /// about 0.3 s at a million entries, docs/performance.md).
    started: Instant,
    pub window_s: u32,
    pub policy: Arc<Policy>,
    pub replicas: Arc<Replicas>,
    pub admission: Arc<Admission>,
    metrics: Arc<Metrics>,
    /// Replicas now over capacity, with the clock of their last warning.
    over: Mutex<Vec<(ReplicaId, u32)>>,
}

impl CapacityWatch {
    pub fn new(
        window_s: u32,
        policy: Arc<Policy>,
        replicas: Arc<Replicas>,
        admission: Arc<Admission>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            started: Instant::now(),
            window_s,
            policy,
            replicas,
            admission,
            metrics,
            over: Mutex::new(Vec::new()),
        }
    }

    /// Recomputes working sets, refreshes the gauges (in-flight requests,
    /// admission and index size too, off the request path), and warns on overflow.
    pub fn check(&self) {
        let now = self.started.elapsed().as_secs() as u32;
        let policy = &self.policy;
        policy.set_clock(now);
        self.metrics
            .index_entries
            .set(policy.tracked_entries() as i64);
        self.metrics.index_bytes.set(policy.index_bytes() as i64);
        let ws = policy.working_set(self.window_s);
        policy.set_recent_bytes(ws.iter().map(|(_, set)| set.all).sum());
        self.metrics
            .admitted_requests
            .set(self.admission.requests() as i64);
        self.metrics
            .buffered_body_bytes
            .set(self.admission.bytes() as i64);
        let mut over = self.over.lock().unwrap_or_else(|p| p.into_inner());
        for r in self.replicas.snapshot().iter() {
            let gauges = &r.counters.gauges;
            gauges.in_flight.set(i64::from(r.in_flight()));
            (gauges.queued_prefill).set((r.queued_bytes() / BYTES_PER_TOKEN) as i64);
            let set = ws
                .binary_search_by_key(&r.id.0, |(id, _)| id.0)
                .map_or(WorkingSet::default(), |i| ws[i].1);
            r.set_pinned_bytes(set.pinned);
            (gauges.pinned_working_set).set((set.pinned / BYTES_PER_TOKEN) as i64);
            let tokens = set.all / BYTES_PER_TOKEN;
            gauges.working_set.set(tokens as i64);
            let Some(kv) = r.kv_tokens().filter(|kv| tokens > *kv) else {
                over.retain(|(id, _)| *id != r.id);
                continue;
            };
            // Warn when a replica goes over, then once a minute while it stays over.
            let due = match over.iter_mut().find(|(id, _)| *id == r.id) {
                Some((_, at)) if now < *at + REWARN_EVERY_S => false,
                Some((_, at)) => {
                    *at = now;
                    true
                }
                None => {
                    over.push((r.id, now));
                    true
                }
            };
            if due {
                log::warn!(
                    "replica {}: working set ~{tokens} tokens (prompts placed in the last {} s) exceeds its KV capacity \
                     of {kv} tokens; expect cache thrash under any policy. Levers: another card, fewer concurrent \
                     large contexts, client-side context compaction",
                    r.name,
                    self.window_s
                );
            }
        }
    }
}

#[async_trait]
impl BackgroundService for CapacityWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => self.check(),
            }
        }
    }
}
