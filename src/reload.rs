//! Hot reload: file -> parse -> validate -> apply. Every key that can change
//! safely applies at once: the replica set, the policy and its parameters,
//! the proxy's timeouts and limits, the health check's path, outlier rules.
//! The others (listeners, threads, the index's shape, services started once;
//! [`Config::reloaded`]) keep their running values and are logged as needing
//! a restart, by name, and shown by `prefix_router_config_restart_pending`.
//! An invalid file (an emptied one too: it lists no replica) is logged and
//! counted, and the previous configuration stays in force. The file is read
//! by path every tick, so a symlink swapped atomically (a Kubernetes
//! ConfigMap) is followed. A changed file is read twice, [`SETTLE`] apart,
//! and judged only when both reads agree, so a writer caught mid-write (`cat
//! new > file` truncates first) is judged once it has finished. Policy state
//! (pins, counter) survives; pins to removed replicas are dropped so they move.
//! The API keys file, when configured, is re-read on the same tick.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::admission::Admission;
use crate::auth::{self, KeyFile, KeysError};
use crate::config::{Config, ConfigError};
use crate::health_checks::HealthProbe;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::replicas::{Change, Replica, Replicas};
use crate::resolve::Resolver;
use crate::settings::Settings;

/// How often the series of replica names that left the set are looked for
/// (a request or a check in flight at a removal may record under one again).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// What a reload changes in the running router.
pub struct Live {
    pub replicas: Arc<Replicas>,
    pub policy: Arc<Policy>,
    pub settings: Arc<ArcSwap<Settings>>,
    pub admission: Arc<Admission>,
    pub probe: Arc<HealthProbe>,
    pub keys: Option<Arc<KeyFile>>,
    /// The admin API's keys, when `admin_keys_file` is set.
    pub admin_keys: Option<Arc<KeyFile>>,
    /// Replica names to addresses, the last good ones kept.
    pub resolver: Arc<Resolver>,
    pub metrics: Arc<Metrics>,
}

/// Watches one config file.
pub struct Reloader {
    pub path: PathBuf,
    pub interval: Duration,
    pub env_policy: Option<String>,
    live: Live,
    /// The text last seen (applied or rejected), so a file is judged once.
    last: Mutex<Option<String>>,
    /// The replicas' key files (`api_key_file`) that text names, and a hash
    /// of what they held when it was judged: a key rotated in place (or a
    /// missing file created) has the text judged again.
    key_files: Mutex<(u64, Vec<String>)>,
    /// The configuration in force.
    running: Mutex<Config>,
    /// The last error reading each keys file (API, admin), so it is logged once.
    keys_error: [Mutex<Option<String>>; 2],
    /// When replica names were last looked up.
    resolved_at: Mutex<Instant>,
}

/// Time between the two reads of a changed file.
pub const SETTLE: Duration = Duration::from_millis(100);

/// Reads a file twice, [`SETTLE`] apart, when `changed` says the first read
/// is new. `None`: nothing new, or the reads disagree (a writer is at work;
/// the file is judged on a later tick).
async fn settled<E>(
    read: impl Fn() -> Result<String, E>,
    changed: impl Fn(&Result<String, E>) -> bool,
) -> Option<Result<String, E>> {
    let first = read();
    if !changed(&first) {
        return None;
    }
    tokio::time::sleep(SETTLE).await;
    let second = read();
    match (&first, &second) {
        (Ok(a), Ok(b)) if a == b => Some(second),
        (Err(_), Err(_)) => Some(second),
        _ => None,
    }
}

impl Reloader {
    /// `loaded`: the text `running` was parsed from. Not the file read
    /// again here: an edit made while the router started (its names looked
    /// up, its tokenizers loaded) would then read as judged, and wait for
    /// the next edit.
    pub fn new(
        path: PathBuf,
        running: Config,
        loaded: String,
        env_policy: Option<String>,
        live: Live,
    ) -> Self {
        let last = Some(loaded);
        live.metrics.restart_pending.set(0);
        let paths = running.replica_key_files();
        // Likewise a key file rewritten since `running` read it: no hash
        // matches 0, so the first check reads the keys again.
        let seen = if keys_as_read(&running) {
            key_files_hash(&paths)
        } else {
            0
        };
        let key_files = Mutex::new((seen, paths));
        Self {
            interval: crate::config::ms(running.reload_interval_ms),
            path,
            env_policy,
            live,
            last: Mutex::new(last),
            key_files,
            running: Mutex::new(running),
            keys_error: Default::default(),
            resolved_at: Mutex::new(Instant::now()),
        }
    }

    fn read(&self) -> Result<String, ConfigError> {
        std::fs::read_to_string(&self.path).map_err(|source| ConfigError::Read {
            path: self.path.display().to_string(),
            source,
        })
    }

    /// Whether `text` differs from the text last judged.
    fn changed(&self, text: &Result<String, ConfigError>) -> bool {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match text {
            Ok(t) => last.as_deref() != Some(t.as_str()),
            Err(_) => true,
        }
    }

    /// Re-reads the file if it changed, waiting [`SETTLE`] for a writer to
    /// finish. `Ok(None)`: unchanged, or still being written.
    pub async fn check_settled(&self) -> Result<Option<Change>, ConfigError> {
        if let Some(text) = settled(|| self.read(), |t| self.changed(t)).await {
            return self.judge(text, false).await;
        }
        // The text is unchanged: its key files may not be.
        let (seen, paths) = self
            .key_files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let first = key_files_hash(&paths);
        if paths.is_empty() || first == seen {
            return Ok(None);
        }
        // Read twice, as the file: a key being written is judged once whole.
        tokio::time::sleep(SETTLE).await;
        if key_files_hash(&paths) != first {
            return Ok(None);
        }
        self.judge(self.read(), true).await
    }

    /// Re-reads the file if it changed (no settling). `Ok(None)`: unchanged.
    #[cfg(test)]
    async fn check(&self) -> Result<Option<Change>, ConfigError> {
        self.judge(self.read(), false).await
    }

    /// Judges `text` once (again with `again`: its key files changed).
    async fn judge(
        &self,
        text: Result<String, ConfigError>,
        again: bool,
    ) -> Result<Option<Change>, ConfigError> {
        {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if let Ok(t) = &text {
                if !again && last.as_deref() == Some(t.as_str()) {
                    return Ok(None);
                }
                *last = Some(t.clone());
            }
        }
        let mut cfg = Config::parse(&text?, self.env_policy.as_deref())?;
        let paths = cfg.replica_key_files();
        *self.key_files.lock().unwrap_or_else(|p| p.into_inner()) = (key_files_hash(&paths), paths);
        cfg.read_replica_keys()?;
        if let Some(warning) = cfg.key_warning() {
            log::warn!("config: {warning}");
        }
        self.live
            .resolver
            .refresh(&cfg, crate::resolve::LOOKUP_DEADLINE)
            .await;
        self.removes_too_many(&cfg)?;
        Ok(Some(self.apply(cfg)))
    }

    /// Refuses a file that would remove more than `reload_max_removed_percent`
    /// of the running replicas at once (a writer that paused at a line
    /// boundary for longer than [`SETTLE`] leaves such a file).
    fn removes_too_many(&self, cfg: &Config) -> Result<(), ConfigError> {
        let running = self.live.replicas.snapshot();
        let next = self.live.resolver.expand(cfg, |name| {
            running.iter().find(|r| r.name == name).map(|r| r.addr)
        });
        // A replica that moves keeps its name, one renamed its address:
        // only replicas that go count.
        let kept = |r: &Replica| {
            next.iter()
                .any(|n| n.name == r.name || n.addr.parse().ok() == Some(r.addr))
        };
        let removed = running.iter().filter(|r| !kept(r)).count();
        let percent = cfg.reload_max_removed_percent;
        if removed * 100 > running.len() * percent as usize {
            return Err(ConfigError::MassRemoval {
                removed,
                running: running.len(),
                percent,
            });
        }
        Ok(())
    }

    fn apply(&self, cfg: Config) -> Change {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let (cfg, pending) = running.reloaded(cfg);
        if pending.is_empty() {
            self.live.metrics.restart_pending.set(0);
        } else {
            self.live.metrics.restart_pending.set(1);
            log::warn!(
                "config: {} changed: needs restart (the running value stays in force until then)",
                pending.join(", ")
            );
        }
        if let Some(why) = cfg.kv_room_inactive() {
            log::info!("{why}");
        }
        let live = &self.live;
        let change = self.apply_replicas(&cfg);
        live.replicas.note_panic();
        live.policy
            .set_config(crate::policy_config::policy_config(&cfg));
        crate::access_log::set_format(cfg.log_format);
        live.settings.store(Arc::new(Settings::from_config(&cfg)));
        live.admission.set_limits(&cfg.limits);
        // Validated by Config::parse: a path that is not a URI path is refused there.
        if let Err(e) = live.probe.configure(&cfg.health_check) {
            log::error!("config: health_check.path: {e}");
        }
        *running = cfg;
        change
    }

    /// Resolves `cfg`'s replica names and applies the set: pins to replicas
    /// that left are dropped, so their conversations move.
    fn apply_replicas(&self, cfg: &Config) -> Change {
        let live = &self.live;
        let running = live.replicas.snapshot();
        let list = live.resolver.expand(cfg, |name| {
            running.iter().find(|r| r.name == name).map(|r| r.addr)
        });
        live.resolver.forget_others(cfg);
        *self.resolved_at.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        if list.is_empty() && !running.is_empty() {
            // Every name failed (a DNS outage; the resolver logged each name
            // once): keep serving the replicas known.
            log::debug!("no replica address resolves: the current replicas stay in force");
            return Change::default();
        }
        // Only a name the file gives may be a rename (see `apply_renaming`).
        let named = |name: &str| cfg.replicas.iter().any(|r| r.name == name);
        let change = live.replicas.apply_renaming(&list, named);
        let now = live.replicas.snapshot();
        let removed: Vec<_> = change.removed.iter().map(|r| r.id).collect();
        // What a replica that left (or moved) counted since the last scrape,
        // into its series before they are swept or shared with its new
        // address; its requests still in flight count when its last ends.
        for r in &change.removed {
            r.counters.flush();
        }
        if !removed.is_empty() {
            live.policy.forget_replicas(&removed);
        }
        // The series of names no longer in the set go; a name still there
        // (an address change, a name another replica took) keeps them: its
        // new replica counts in them.
        if !change.removed.is_empty() || !change.renamed.is_empty() {
            sweep(&live.metrics, &now);
        }
        for r in now.iter() {
            self.live.metrics.add_replica(
                &r.name,
                (r.live(), r.drained()),
                r.in_flight(),
                r.kv_tokens(),
            );
        }
        change
    }

    /// Looks replica names up again once `dns_refresh_ms` has passed (only
    /// when the config has names); an address that changed is a replica
    /// change, logged as a reload's.
    async fn refresh_names(&self) -> Option<Change> {
        let cfg = {
            let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            let named = !running.replicas_dns.is_empty()
                || running
                    .replicas
                    .iter()
                    .any(|r| r.addr.parse::<std::net::SocketAddr>().is_err());
            let due = self
                .resolved_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed()
                >= crate::config::ms(running.dns_refresh_ms);
            if !named || !due {
                return None;
            }
            running.clone()
        };
        self.live
            .resolver
            .refresh(&cfg, crate::resolve::LOOKUP_DEADLINE)
            .await;
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let change = self.apply_replicas(&running);
        (!change.is_empty()).then_some(change)
    }

    fn report(&self, result: Result<Option<Change>, ConfigError>) {
        match result {
            Ok(None) => {}
            Ok(Some(change)) => {
                self.live.metrics.reloads.with_label_values(&["ok"]).inc();
                log::info!(
                    "config reloaded from {}: settings applied; replicas added [{}] (join after a passing health check), removed [{}] (draining), renamed [{}] (health and pins kept)",
                    self.path.display(),
                    names(&change.added),
                    names(&change.removed),
                    renames(&change.renamed)
                );
            }
            Err(e) => {
                self.live
                    .metrics
                    .reloads
                    .with_label_values(&["error"])
                    .inc();
                log::error!(
                    "config reload rejected, the previous configuration stays in force: {}: {e}",
                    self.path.display()
                );
            }
        }
    }
}

impl Reloader {
    /// Re-reads the keys files (API, admin) the same way; a bad file keeps
    /// the old keys.
    async fn reload_keys(&self) {
        let files = [
            ("api_keys_file", &self.live.keys),
            ("admin_keys_file", &self.live.admin_keys),
        ];
        for ((file, keys), last_error) in files.into_iter().zip(&self.keys_error) {
            if let Some(keys) = keys {
                self.reload_key_file(file, keys, last_error).await;
            }
        }
    }

    async fn reload_key_file(
        &self,
        file: &str,
        keys: &KeyFile,
        last_error: &Mutex<Option<String>>,
    ) {
        let last_error = || last_error.lock().unwrap_or_else(|p| p.into_inner());
        let changed = |r: &Result<String, KeysError>| match r {
            Ok(t) => keys.changed(t),
            Err(e) => last_error().as_deref() != Some(e.to_string().as_str()),
        };
        let Some(text) = settled(|| auth::read(&keys.path), changed).await else {
            return;
        };
        let result = text.and_then(|t| keys.apply(t));
        let label = if result.is_ok() { "ok" } else { "error" };
        self.live
            .metrics
            .key_reloads
            .with_label_values(&[file, label])
            .inc();
        match result {
            Ok(()) => {
                *last_error() = None;
                log::info!("{file} reloaded from {}", keys.path.display());
            }
            Err(e) => {
                *last_error() = Some(e.to_string());
                log::error!(
                    "{file} reload rejected, previous keys stay in force: {}: {e}",
                    keys.path.display()
                );
            }
        }
    }
}

/// A hash of what the files at `paths` hold (or of how reading one failed).
fn key_files_hash(paths: &[String]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in paths {
        h.update(p.as_bytes());
        match std::fs::read(p) {
            Ok(bytes) => h.update(&bytes),
            Err(e) => h.update(e.kind().to_string().as_bytes()),
        }
        h.update(b"\0");
    }
    h.digest()
}

/// Whether every replica's key file still holds the key `cfg` read from it.
fn keys_as_read(cfg: &Config) -> bool {
    (cfg.replicas.iter().chain(&cfg.replicas_dns)).all(|r| {
        r.api_key_file
            .as_deref()
            .is_none_or(|f| crate::config::Secret::read(f).ok() == r.api_key)
    })
}

/// Replica names for a log line.
fn names(v: &[Arc<crate::replicas::Replica>]) -> String {
    v.iter()
        .map(|r| r.name.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// Renamed replicas for a log line: `old -> new`.
fn renames(v: &[(String, Arc<crate::replicas::Replica>)]) -> String {
    v.iter()
        .map(|(old, r)| format!("{old} -> {}", r.name))
        .collect::<Vec<_>>()
        .join(",")
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        let mut swept = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {
                    // Keys first: a revocation never waits on DNS.
                    self.reload_keys().await;
                    self.report(self.check_settled().await);
                    if let Some(change) = self.refresh_names().await {
                        log::info!(
                            "replica names resolved to new addresses: added [{}] (join after a passing health check), removed [{}] (draining)",
                            names(&change.added),
                            names(&change.removed)
                        );
                    }
                    // Here, where replicas are applied, so a sweep never
                    // meets a replica half added.
                    if swept.elapsed() >= SWEEP_EVERY {
                        swept = Instant::now();
                        sweep(&self.live.metrics, &self.live.replicas.snapshot());
                    }
                }
            }
        }
    }
}

/// Drops the series of replica names no longer in `now` (a name set, not a
/// scan of the list per series: a thousand replicas export tens of
/// thousands of series).
fn sweep(metrics: &crate::metrics::Metrics, now: &crate::replicas::View) {
    let names: HashSet<&str> = now.iter().map(|r| r.name.as_str()).collect();
    metrics.sweep_replicas(|name| names.contains(name));
}

#[cfg(test)]
mod tests;
