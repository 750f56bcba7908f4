//! The active health checks: a round at start and every
//! `health_check.interval_ms`, each due replica checked with Pingora's HTTP
//! check, the round's checks paced over half the interval
//! ([`probes::run_paced`]). Every result updates the replica's own liveness
//! and model list, the one health record, on the [`Replica`]; placement
//! reads the replica set itself, and Pingora keeps no copy of it.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::{ErrorType, Result};
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::Backend;

use crate::config::{self, ReplicaTls};
use crate::engine_client::{own_host, own_requests, OwnGet, KEEP_IDLE};
use crate::metrics::{Metrics, Repair};
use crate::policy::Policy;
use crate::replicas::{probes, HealthRules, Replica, Replicas, CHECK_DEADLINE};

/// The health check's request (`health_check.path` is swapped on reload),
/// and the `GET /v1/models` that follows some passes
/// ([`Replica::models_due`](crate::replicas::Replica::models_due)), from which
/// a replica's models are learned (unless the config declares them).
pub struct HealthProbe {
    /// Checks on a kept connection, and on a new one each time.
    check: ArcSwap<Checks>,
    /// How results become up and down (`health_check`'s thresholds).
    rules: ArcSwap<HealthRules>,
    models: OwnGet,
    tls: ReplicaTls,
}

/// A check that failed on a kept connection is tried again on a new one
/// only with this much of its deadline left (else it stands).
const RETRY_LEFT: Duration = Duration::from_secs(1);

/// Model lists are small; a larger answer is not taken.
const MAX_MODELS_BYTES: usize = 1 << 20;
const MAX_MODELS: usize = 256;

/// The check on a kept connection and on a new one.
struct Checks {
    kept: HttpHealthCheck,
    fresh: HttpHealthCheck,
}

impl Checks {
    fn new(path: &str, tls: &ReplicaTls) -> Result<Self> {
        Ok(Self {
            kept: http_check(path, tls, true)?,
            fresh: http_check(path, tls, false)?,
        })
    }
}

impl HealthProbe {
    pub fn new(health: &config::HealthCheck, tls: &ReplicaTls) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            check: ArcSwap::from_pointee(Checks::new(&health.path, tls)?),
            rules: ArcSwap::from_pointee(HealthRules::from(health)),
            models: OwnGet::new(
                "/v1/models",
                own_host(tls),
                own_requests(tls),
                KEEP_IDLE,
                MAX_MODELS_BYTES,
            )?,
            tls: tls.clone(),
        }))
    }

    /// The ids a replica's `/v1/models` lists (OpenAI's list format; the
    /// first `MAX_MODELS`); `None` when it does not answer one within `within`.
    async fn models_of(&self, r: &Replica, within: Duration) -> Option<Vec<String>> {
        let key = r.api_key();
        let read = tokio::time::timeout(within, self.models.get(r.addr, key.as_deref()))
            .await
            .ok()?;
        // An engine that refuses the router's key refuses every request it
        // forwards there too: said once, when that starts and ends.
        let refused = match &read {
            Ok(_) => Some(false),
            Err(e) => matches!(e.etype(), ErrorType::HTTPStatus(401 | 403)).then_some(true),
        };
        if let Some(refused) = refused.filter(|now| r.set_key_refused(*now)) {
            if refused {
                log::warn!(
                    "replica {} refuses the router's requests (401/403 on /v1/models): give it an api_key_file with its engine's --api-key, or set forward_client_keys",
                    r.name
                );
            } else {
                log::info!("replica {} accepts the router's requests again", r.name);
            }
        }
        let body = read.ok()?;
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
        if self.check.load().kept.req.uri.path() != health.path {
            self.check
                .store(Arc::new(Checks::new(&health.path, &self.tls)?));
        }
        Ok(())
    }
}

/// A check on a connection kept between checks (`reuse`), or a new one each
/// time. A new TCP (and TLS) handshake per check and replica cost a fleet of
/// a thousand replicas most of a core; a kept connection, though, can pass
/// while new ones fail (refused, a rotated certificate), so a replica that is
/// not live, and every [`RECHECK_EVERY`](crate::replicas::RECHECK_EVERY)th
/// pass, is checked on a new one.
fn http_check(path: &str, tls: &ReplicaTls, reuse: bool) -> Result<HttpHealthCheck> {
    let mut http = HttpHealthCheck::new(own_host(tls), tls.enabled);
    let (mut peer, connector) = own_requests(tls);
    peer.options.idle_timeout = Some(KEEP_IDLE);
    http.reuse_connection = reuse;
    http.peer_template = peer;
    http.set_connector(connector);
    http.req.set_uri(
        path.parse()
            .map_err(|_| pingora_core::Error::new_str("invalid health_check.path"))?,
    );
    Ok(http)
}

/// The health checks' background service (thread `BG replicas`). A new
/// replica is live only after a pass, and a pass ends an ejection made on
/// the request path. A pass after a failed check (refused, reset, an error
/// status: not a timeout, which a busy engine gives) also empties the
/// replica's part of the prefix index: an engine that went away and came
/// back has an empty cache. Past `health_check.max_per_second` a live
/// replica is checked in its turn (`crate::replicas::probes`). A round
/// longer than the interval delays the next.
pub struct HealthChecks(Arc<Checker>);

struct Checker {
    probe: Arc<HealthProbe>,
    replicas: Arc<Replicas>,
    policy: Arc<Policy>,
    metrics: Arc<Metrics>,
    interval: Duration,
    /// Rounds between a live replica's checks, as last logged (0: none yet).
    spread: AtomicU32,
}

impl HealthChecks {
    pub fn new(
        replicas: Arc<Replicas>,
        policy: Arc<Policy>,
        probe: Arc<HealthProbe>,
        interval: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self(Arc::new(Checker {
            probe,
            replicas,
            policy,
            metrics,
            interval,
            spread: AtomicU32::new(0),
        }))
    }
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.0.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            // Shutdown ends a round too (its checks are dropped).
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = Arc::clone(&self.0).round() => {}
            }
        }
    }
}

impl Checker {
    /// Checks the replicas due this round, paced ([`probes::window`]).
    async fn round(self: Arc<Self>) {
        let list = self.replicas.snapshot();
        let count = list.len();
        let (spread, rules) = self.probe.rules.load().spread(count);
        let was = self.spread.swap(spread, Relaxed);
        if was != spread && (was != 0 || spread > 1) {
            log::info!(
                "health checks: {count} replicas under health_check.max_per_second {}: \
                 each live replica checked every {spread} round(s)",
                rules.per_second
            );
        }
        let this = Arc::clone(&self);
        let check = move |r: Arc<Replica>| {
            let this = Arc::clone(&this);
            async move { this.check(&r, &rules).await }
        };
        let window = probes::window(self.interval);
        (self.replicas)
            .probe_round(&list, |r| r.check_due(spread), window, check)
            .await;
    }

    /// One replica's check (and its model list when due), recorded on it.
    async fn check(&self, r: &Replica, rules: &HealthRules) {
        let started = Instant::now();
        let http = self.probe.check.load_full();
        let target = Backend {
            addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(r.addr),
            weight: 1,
            ext: Default::default(),
        };
        let target = &target;
        let fresh = r.fresh_check_due();
        let checks = &*http;
        // Pingora bounds each read, not the check: a replica trickling its
        // /health body would hold the whole round.
        let check = |fresh: bool, within| async move {
            let http = if fresh { &checks.fresh } else { &checks.kept };
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
        let mut result = check(fresh, CHECK_DEADLINE).await;
        let left = CHECK_DEADLINE.saturating_sub(started.elapsed());
        let stale = result.as_ref().err().is_some_and(|e| {
            matches!(
                e.etype(),
                ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError
            )
        });
        if !fresh && stale && left >= RETRY_LEFT {
            // The kept connection may be one the engine had just closed,
            // which says nothing of the engine: checked again on a new one.
            result = check(true, left).await;
        }
        let timed_out = timed_out(&result);
        if r.came_back(result.is_ok(), timed_out) {
            let forgotten = self.policy.forget_replica(r.id);
            self.metrics.repaired(&r.name, Repair::Restart, forgotten);
        }
        if result.is_ok() && !r.declares_models() && r.models_due() {
            let left = CHECK_DEADLINE.saturating_sub(started.elapsed());
            if let Some(list) = self.probe.models_of(r, left).await {
                let shown = list.join(", ");
                if r.learn_models(list) {
                    self.replicas.models_changed();
                    log::info!("replica {} serves models [{shown}]", r.name);
                }
            }
        }
        // The set may have changed while the check ran: a replica that
        // left, or moved, keeps no liveness and may share a name.
        if !self.replicas.is_current(r) {
            return;
        }
        let outcome = match (&result, timed_out) {
            (Ok(()), _) => "pass",
            (Err(_), false) => "fail",
            (Err(_), true) => "timeout",
        };
        (self.metrics.health_checks)
            .with_label_values(&[&r.name, outcome])
            .inc();
        if r.on_check(result.is_ok(), timed_out, Instant::now(), rules) {
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
}
