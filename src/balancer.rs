//! Pingora's side of the replica set: service discovery from [`Replicas`]
//! and active HTTP health checks that feed each replica's liveness.
//!
//! Pingora runs both loops as one background service (`LoadBalancer`);
//! placement does not ask it (the policy places over the router's own view).
//! A replica's health is recorded once, on the [`Replica`](crate::replicas::Replica)
//! (active checks and the request path's ejections together): Pingora is told
//! every backend is healthy.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::{ErrorType, Result};
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backend, LoadBalancer};

use crate::config::{self, ReplicaTls};
use crate::engine_client::{own_host, own_requests, OwnGet};
use crate::metrics::{Metrics, Repair};
use crate::policy::Policy;
use crate::replicas::{HealthRules, Replicas, CHECK_DEADLINE};

/// The load balancer type the router runs.
/// Pingora's own selection is never asked: the policy places over the
/// router's view of the set (`proxy/place`); the type is only what
/// `LoadBalancer` needs to run discovery and the health checks.
pub type Balancer = LoadBalancer<RoundRobin>;

/// Builds the background service: discovery every 200 ms (so reloads join fast)
/// and a health check of every replica every `interval`, by `probe`.
pub fn balancer(
    replicas: Arc<Replicas>,
    policy: Arc<Policy>,
    probe: Arc<HealthProbe>,
    interval: Duration,
    metrics: Arc<Metrics>,
) -> Balancer {
    let backends =
        pingora_load_balancing::Backends::new(Box::new(Discovery(Arc::clone(&replicas))));
    let mut lb = LoadBalancer::from_backends(backends);
    lb.set_health_check(Box::new(ReplicaHealth {
        probe,
        replicas,
        policy,
        metrics,
    }));
    lb.health_check_frequency = Some(interval);
    lb.update_frequency = Some(Duration::from_millis(200));
    lb.parallel_health_check = true;
    lb
}

/// The health check's request (`health_check.path` is swapped on reload),
/// and the `GET /v1/models` that follows each pass, from which a replica's
/// models are learned (unless the config declares them).
pub struct HealthProbe {
    check: ArcSwap<HttpHealthCheck>,
    /// How results become up and down (`health_check`'s thresholds).
    rules: ArcSwap<HealthRules>,
    models: OwnGet,
    tls: ReplicaTls,
}

/// Model lists are small; a larger answer is not taken.
const MAX_MODELS_BYTES: usize = 1 << 20;
const MAX_MODELS: usize = 256;

impl HealthProbe {
    pub fn new(health: &config::HealthCheck, tls: &ReplicaTls) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            check: ArcSwap::from_pointee(http_check(&health.path, tls)?),
            rules: ArcSwap::from_pointee(HealthRules::from(health)),
            models: OwnGet::new(
                "/v1/models",
                own_host(tls),
                own_requests(tls),
                Duration::from_secs(4),
                MAX_MODELS_BYTES,
            )?,
            tls: tls.clone(),
        }))
    }

    /// The ids a replica's `/v1/models` lists (OpenAI's list format; the
    /// first `MAX_MODELS`); `None` when it does not answer one within `within`.
    async fn models_of(&self, addr: std::net::SocketAddr, within: Duration) -> Option<Vec<String>> {
        let body = tokio::time::timeout(within, self.models.get(addr))
            .await
            .ok()?
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        let ids = v
            .get("data")?
            .as_array()?
            .iter()
            .filter_map(|m| m.get("id")?.as_str());
        Some(
            ids.filter(|id| !id.is_empty() && id.len() <= crate::config::MAX_MODEL_NAME)
                .take(MAX_MODELS)
                .map(str::to_owned)
                .collect(),
        )
    }

    /// Takes a reload's `health_check` (path and thresholds) from the next
    /// round on; the interval needs a restart.
    pub fn configure(&self, health: &config::HealthCheck) -> Result<()> {
        self.rules.store(Arc::new(HealthRules::from(health)));
        if self.check.load().req.uri.path() != health.path {
            self.check
                .store(Arc::new(http_check(&health.path, &self.tls)?));
        }
        Ok(())
    }
}

fn http_check(path: &str, tls: &ReplicaTls) -> Result<HttpHealthCheck> {
    let mut http = HttpHealthCheck::new(own_host(tls), tls.enabled);
    let (mut peer, connector) = own_requests(tls);
    // One connection per replica, kept between checks: a new TCP (and TLS)
    // handshake per check and replica cost a thousand-replica fleet a core.
    // A replica that stops accepting new connections is still seen, by the
    // request path's connect failures (outlier ejection). Kept below
    // uvicorn's 5 s keep-alive, so the engine does not close it first.
    peer.options.idle_timeout = Some(Duration::from_secs(4));
    http.reuse_connection = true;
    http.peer_template = peer;
    http.set_connector(connector);
    http.req.set_uri(
        path.parse()
            .map_err(|_| pingora_core::Error::new_str("invalid health_check.path"))?,
    );
    Ok(http)
}

/// Discovery: the current replica set.
struct Discovery(Arc<Replicas>);

#[async_trait]
impl ServiceDiscovery for Discovery {
    async fn discover(&self) -> Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        let set = self
            .0
            .snapshot()
            .iter()
            .map(|r| Backend {
                addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(r.addr),
                weight: 1,
                ext: Default::default(),
            })
            .collect();
        Ok((set, HashMap::new()))
    }
}

/// Pingora's HTTP check, whose every result also updates the replica's own
/// liveness: a new replica is live only after a pass (Pingora starts new
/// backends healthy), and a pass ends an ejection made on the request path.
/// A pass after a failed check (refused, reset, an error status: not a
/// timeout, which a busy engine gives) also empties the replica's part of the
/// prefix index: an engine that went away and came back has an empty cache.
struct ReplicaHealth {
    probe: Arc<HealthProbe>,
    replicas: Arc<Replicas>,
    policy: Arc<Policy>,
    metrics: Arc<Metrics>,
}

#[async_trait]
impl HealthCheck for ReplicaHealth {
    async fn check(&self, target: &Backend) -> Result<()> {
        let started = Instant::now();
        let http = self.probe.check.load_full();
        // Pingora bounds each read, not the check: a replica trickling its
        // /health body would hold the whole (parallel) round.
        let http = &*http;
        let check = |within| async move {
            match tokio::time::timeout(within, http.check(target)).await {
                Ok(result) => result,
                Err(_) => {
                    pingora_core::Error::e_explain(ErrorType::ReadTimedout, "health check deadline")
                }
            }
        };
        let timed_out = |result: &Result<()>| {
            result.as_ref().err().is_some_and(|e| {
                matches!(
                    e.etype(),
                    ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout
                )
            })
        };
        let mut result = check(CHECK_DEADLINE).await;
        if result.is_err() && !timed_out(&result) {
            // The kept connection may be one the engine had just closed,
            // which says nothing of the engine: a failure is checked again
            // on a new connection (the failed one is not kept).
            result = check(CHECK_DEADLINE.saturating_sub(started.elapsed())).await;
        }
        if let Some(r) = target.addr.as_inet().and_then(|a| self.replicas.by_addr(a)) {
            let timed_out = timed_out(&result);
            if r.came_back(result.is_ok(), timed_out) {
                let forgotten = self.policy.forget_replica(r.id);
                if forgotten > 0 {
                    self.metrics.repaired(&r.name, Repair::Restart, forgotten);
                }
            }
            if result.is_ok() && !r.declares_models() && r.models_due() {
                let left = CHECK_DEADLINE.saturating_sub(started.elapsed());
                if let Some(list) = self.probe.models_of(r.addr, left).await {
                    let shown = list.join(", ");
                    if r.learn_models(list) {
                        self.replicas.models_changed();
                        log::info!("replica {} serves models [{shown}]", r.name);
                    }
                }
            }
            // The set may have changed while the check ran: a replica that
            // left, or moved, keeps no liveness and may share a name.
            if !self.replicas.is_current(&r) {
                return Ok(());
            }
            let outcome = match (&result, timed_out) {
                (Ok(()), _) => "pass",
                (Err(_), false) => "fail",
                (Err(_), true) => "timeout",
            };
            (self.metrics.health_checks)
                .with_label_values(&[&r.name, outcome])
                .inc();
            let rules = self.probe.rules.load();
            if r.on_check(result.is_ok(), timed_out, Instant::now(), &rules) {
                log::info!(
                    "replica {} is {} (health check{})",
                    r.name,
                    if r.live() { "up" } else { "down" },
                    result
                        .as_ref()
                        .err()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                );
                self.replicas.note_panic();
            }
            self.metrics.show_live(&r.name, r.live());
        }
        // The result is the replica's alone (above): Pingora keeps no second
        // record of it.
        Ok(())
    }

    /// Pingora's own record never changes (every check returns `Ok`).
    fn health_threshold(&self, _success: bool) -> usize {
        1
    }
}
