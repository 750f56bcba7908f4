//! The YAML configuration: serde types, the one set of defaults, and
//! `validate()`, which names the offending field. Unknown keys are errors.
//! A leaf: it imports nothing of the router; each part converts the
//! sections it consumes.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

pub mod redis_url;
mod replica;
mod sections;
mod tenants;
mod traces;
mod validate;

pub use redis_url::parse_url as parse_redis_url;
pub use replica::{KvEvents, Replica, Secret};
pub use sections::*;
pub use tenants::{valid_tenant_name, Class, Queue, TenantLimits, Tenants, MAX_TENANT_NAME, OTHER};
pub use traces::Traces;

/// The configuration the router runs on when no `--config` is given: two
/// simulated replicas on localhost (see the README).
pub const EMBEDDED_DEFAULT: &str = include_str!("../../conf/default.yaml");

/// Environment variable that overrides `policy`.
pub const POLICY_ENV: &str = "PREFIX_ROUTER_POLICY";

/// A configuration error, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("it would remove {removed} of the {running} replicas at once, more than reload_max_removed_percent ({percent} %); a file that means it sets reload_max_removed_percent: 100")]
    MassRemoval {
        removed: usize,
        running: usize,
        percent: u32,
    },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The OpenAI-compatible endpoint.
    pub listen: String,
    /// `GET /metrics` in Prometheus text format.
    pub metrics_listen: String,
    /// A second, TLS listener for clients (requires `--features tls`).
    pub listen_tls: Option<ListenTls>,
    pub policy: PolicyName,
    /// Which requests are continuations without a prefix match.
    pub continuation: ContinuationName,
    /// Requests with a larger body get 413.
    pub max_body_bytes: usize,
    /// Total time allowed to receive a request body; slower clients get 408.
    pub body_read_timeout_ms: u64,
    pub health_check: HealthCheck,
    pub timeouts: Timeouts,
    pub prefix_index: PrefixIndex,
    /// Cold placements prefer replicas with KV room for them (`off`, `spread`,
    /// `pack`; see the policy module). Acts only when every replica declares
    /// `kv_tokens`.
    pub kv_room: KvRoomName,
    /// A continuation whose replica has more requests in flight (with
    /// `engine_load`: at its engine) than the least loaded live replica plus
    /// this moves within that bound: to the best-cached replica there, else a
    /// cold placement there. Off (`null`) until measurements say otherwise.
    pub load_guard_in_flight: Option<u32>,
    /// Read each replica's own load from its Prometheus endpoint, and place
    /// cold requests on the least-loaded replicas (see the policy module).
    /// Off (`null`) until measured; `{}` turns it on with the defaults.
    pub engine_load: Option<EngineLoad>,
    /// When every live replica has at least this many requests in flight, a
    /// new routed request is answered 429 with `Retry-After` at once instead
    /// of queueing at an engine. Off (`null`) until measured.
    pub shed_in_flight: Option<u32>,
    /// With `shed_in_flight`: requests wait for a free place, tenants
    /// taking turns, instead of 429 (see `tenants::queue`). Off (`null`).
    pub queue: Option<Queue>,
    /// After SIGTERM the router stops accepting and lets requests and streams
    /// in flight run for up to this long, then ends what is left and exits 0
    /// (at once when nothing is in flight). Keep it under the orchestrator's
    /// own (Kubernetes: 30 s).
    pub shutdown_grace_s: u64,
    /// Unix socket over which a running router hands its listeners to a new
    /// one started with `-u` (zero-downtime upgrade); its directory must be
    /// private to the router's user. Default: `upgrade-<listen>.sock` in
    /// `$RUNTIME_DIRECTORY`, else in `/tmp/prefix-router-<uid>/` (see `upgrade`).
    pub upgrade_sock: Option<String>,
    /// How often the config file is checked for changes.
    pub reload_interval_ms: u64,
    /// A reload that would remove more than this share of the replicas at
    /// once is refused (a file cut short by its writer looks like one); the
    /// file that means it says so by setting this to 100.
    pub reload_max_removed_percent: u32,
    /// Window of the per-replica working-set estimate (capacity gauges and warning).
    pub working_set_window_s: u32,
    /// Pingora worker threads for the proxy (default: the cores available);
    /// one runs as a current-thread runtime, more as a work-stealing one.
    pub threads: usize,
    /// TLS to every replica (requires a build with `--features tls`).
    pub replica_tls: ReplicaTls,
    pub outlier: Outlier,
    pub limits: Limits,
    pub client_timeouts: ClientTimeouts,
    /// Send `x-prefix-router-replica` / `-decision` and name replicas in error
    /// bodies. Turn off when clients must not learn placement (a `pin` tells a
    /// client that someone recently sent the same prompt prefix).
    pub placement_headers: bool,
    /// File of accepted client API keys, one SHA-256 hex digest per line
    /// (hot-reloaded). Unset: the listener accepts every client.
    pub api_keys_file: Option<String>,
    /// File of admin API keys, in the same form (hot-reloaded): the admin
    /// API (`/admin/`, see `admin`) on the metrics listener. Unset: none.
    pub admin_keys_file: Option<String>,
    /// With `api_keys_file`, the client's key (`Authorization`,
    /// `x-api-key`) stays at the router unless this is true; a replica with
    /// its own `api_key_file` gets that key instead in any case.
    pub forward_client_keys: bool,
    /// Per-tenant limits and shares (see `tenants`); unset: requests are
    /// not told apart by tenant.
    pub tenants: Option<Tenants>,
    /// OpenTelemetry traces of requests (see `traces`); unset: none.
    pub traces: Option<Traces>,
    /// `text` (default) or `json`: every log line one JSON object.
    pub log_format: LogFormat,
    /// How a single (a one-shot prompt) is placed (see the policy module).
    pub singles: Singles,
    /// Cold placements go to the replicas with at most this many bytes more
    /// prompt queued for prefill than the least queued (streams sent there
    /// and not answering yet, each less what was expected cached), and a
    /// single leaves its prefix's holder queued more than the prefix saves
    /// (see the policy module); 0: not compared.
    pub queued_prefill_step_bytes: usize,
    /// How many replicas of a large fleet a placement reads.
    pub sample: Sample,
    /// How several router instances in front of these replicas agree on
    /// where each conversation lives.
    pub fleet: Fleet,
    pub replicas: Vec<Replica>,
    /// Replicas discovered by DNS (a headless Service): every address behind
    /// each entry's `addr` name is a replica named `<name>-<IP>-<port>`, with
    /// the entry's other fields.
    pub replicas_dns: Vec<Replica>,
    /// How often replica names (`host:port` addresses, `replicas_dns`) are
    /// looked up again.
    pub dns_refresh_ms: u64,
    /// Per model, the directory of its `tokenizer.json` and
    /// `tokenizer_config.json`: its chat requests are matched token for
    /// token against the KV events of the replicas that publish them.
    pub tokenizers: BTreeMap<String, String>,
}

/// Longest model name the router keeps (names are metric label values).
pub use crate::request::MAX_MODEL_NAME;

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8080".into(),
            metrics_listen: "0.0.0.0:9091".into(),
            listen_tls: None,
            policy: PolicyName::Shape,
            continuation: ContinuationName::ModelTurn,
            max_body_bytes: 32 << 20,
            body_read_timeout_ms: 60_000,
            health_check: HealthCheck::default(),
            timeouts: Timeouts::default(),
            prefix_index: PrefixIndex::default(),
            kv_room: KvRoomName::Pack,
            load_guard_in_flight: None,
            engine_load: None,
            shed_in_flight: None,
            queue: None,
            shutdown_grace_s: 20,
            upgrade_sock: None,
            reload_interval_ms: 1_000,
            reload_max_removed_percent: 50,
            working_set_window_s: 300,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            replica_tls: ReplicaTls::default(),
            outlier: Outlier::default(),
            limits: Limits::default(),
            client_timeouts: ClientTimeouts::default(),
            placement_headers: true,
            api_keys_file: None,
            admin_keys_file: None,
            forward_client_keys: false,
            tenants: None,
            traces: None,
            log_format: LogFormat::Text,
            singles: Singles::default(),
            queued_prefill_step_bytes: 16_384,
            sample: Sample::default(),
            fleet: Fleet::default(),
            replicas: Vec::new(),
            replicas_dns: Vec::new(),
            dns_refresh_ms: 5_000,
            tokenizers: BTreeMap::new(),
        }
    }
}

impl Config {
    /// Parses and validates YAML text, then applies `PREFIX_ROUTER_POLICY`
    /// from `env_policy` when given.
    pub fn parse(yaml: &str, env_policy: Option<&str>) -> Result<Self, ConfigError> {
        let mut cfg: Config = serde_yaml::from_str(yaml)?;
        if let Some(p) = env_policy {
            cfg.policy = serde_yaml::from_str(p).map_err(|_| {
                invalid(
                    POLICY_ENV,
                    format!("`{p}` is not shape, roundrobin or affinity"),
                )
            })?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a file (see [`Config::parse`]) and the replicas' key files.
    pub fn load(path: &Path, env_policy: Option<&str>) -> Result<Self, ConfigError> {
        Self::load_text(path, env_policy).map(|(cfg, _)| cfg)
    }

    /// [`Config::load`], with the text it was parsed from.
    pub fn load_text(path: &Path, env_policy: Option<&str>) -> Result<(Self, String), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg = Self::parse(&text, env_policy)?;
        cfg.read_replica_keys()?;
        Ok((cfg, text))
    }

    /// The replicas' `api_key_file`s (entries of `replicas` and `replicas_dns`).
    pub fn replica_key_files(&self) -> Vec<String> {
        (self.replicas.iter().chain(&self.replicas_dns))
            .filter_map(|r| r.api_key_file.clone())
            .collect()
    }

    /// What an operator should hear about the keys as configured: an
    /// engine's key the router sends for any client (no `api_keys_file`).
    pub fn key_warning(&self) -> Option<String> {
        let keyed = self.replica_key_files();
        (self.api_keys_file.is_none() && !keyed.is_empty()).then(|| {
            "replicas have an api_key_file but api_keys_file is unset: any client that reaches \
             the router is sent on with the engines' keys"
                .to_owned()
        })
    }

    /// Reads each replica's `api_key_file` (entries of `replicas` and
    /// `replicas_dns`); an unreadable one is an error naming the entry.
    pub fn read_replica_keys(&mut self) -> Result<(), ConfigError> {
        let lists = [
            ("replicas", &mut self.replicas),
            ("replicas_dns", &mut self.replicas_dns),
        ];
        for (list, replicas) in lists {
            for (i, r) in replicas.iter_mut().enumerate() {
                r.api_key = match &r.api_key_file {
                    Some(f) => Some(
                        Secret::read(f)
                            .map_err(|why| invalid(format!("{list}[{i}].api_key_file"), why))?,
                    ),
                    None => None,
                };
            }
        }
        Ok(())
    }

    /// The configuration a reload to `new` runs on: `new`, except the keys a
    /// running router cannot change (listeners, threads, the index's shape,
    /// services started once), which keep their running values; those that
    /// `new` changes are named, in config-file spelling.
    pub fn reloaded(&self, new: Config) -> (Config, Vec<&'static str>) {
        let mut next = new;
        let mut pending = Vec::new();
        macro_rules! keep {
            ($($name:literal => $($field:ident).+;)*) => {$(
                if next.$($field).+ != self.$($field).+ {
                    pending.push($name);
                    next.$($field).+ = self.$($field).+.clone();
                }
            )*};
        }
        keep! {
            "listen" => listen;
            "metrics_listen" => metrics_listen;
            "threads" => threads;
            "upgrade_sock" => upgrade_sock;
            "shutdown_grace_s" => shutdown_grace_s;
            "reload_interval_ms" => reload_interval_ms;
            "working_set_window_s" => working_set_window_s;
            "health_check.interval_ms" => health_check.interval_ms;
            "engine_load" => engine_load;
            "prefix_index.block_bytes" => prefix_index.block_bytes;
            "prefix_index.max_entries" => prefix_index.max_entries;
            "limits.max_streams_per_connection" => limits.max_streams_per_connection;
            "limits.max_metrics_connections" => limits.max_metrics_connections;
            "replica_tls" => replica_tls;
            "listen_tls" => listen_tls;
            "api_keys_file" => api_keys_file;
            "admin_keys_file" => admin_keys_file;
            "fleet.redis_url" => fleet.redis_url;
            "fleet.redis_ca_file" => fleet.redis_ca_file;
            "fleet.redis_budget_ms" => fleet.redis_budget_ms;
            "fleet.redis_ttl_s" => fleet.redis_ttl_s;
            "tokenizers" => tokenizers;
            "traces" => traces;
        }
        // The shared pins' connection is started once: into or out of
        // `redis` needs a restart (between local and rendezvous does not).
        let redis = |c: &Config| c.fleet.mode == FleetMode::Redis;
        if redis(&next) != redis(self) {
            pending.push("fleet.mode");
            next.fleet.mode = self.fleet.mode;
        }
        (next, pending)
    }

    /// Why `kv_room` cannot act with this replica list, if it cannot: it
    /// needs every replica's `kv_tokens`.
    pub fn kv_room_inactive(&self) -> Option<String> {
        let missing: Vec<&str> = self
            .replicas
            .iter()
            .chain(&self.replicas_dns)
            .filter(|r| r.kv_tokens.is_none_or(|t| t == 0))
            .map(|r| r.name.as_str())
            .collect();
        (self.kv_room != KvRoomName::Off && !missing.is_empty()).then(|| {
            format!(
                "kv_room is inactive: replicas {} declare no kv_tokens, so cold prompts are \
                 spread by the plain counter",
                missing.join(", ")
            )
        })
    }
}

/// Milliseconds to a `Duration`.
pub fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "replicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";

    #[test]
    fn a_file_without_replicas_is_rejected() {
        for yaml in ["", "\n", "policy: shape\n", "replicas: []\n", "replicas:\n"] {
            let e = Config::parse(yaml, None).unwrap_err().to_string();
            assert!(e.contains("replicas"), "{yaml:?}: {e}");
        }
    }

    #[test]
    fn embedded_default_and_examples_parse() {
        let d = Config::parse(EMBEDDED_DEFAULT, None).expect("embedded default");
        assert_eq!(d.replicas.len(), 2);
        for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/conf")).unwrap() {
            let path = entry.unwrap().path();
            // Router configs are `.yaml`; `.yml` are Prometheus rules.
            if path.extension().is_none_or(|e| e != "yaml") {
                continue;
            }
            Config::load(&path, None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = Config::parse("listen: \"127.0.0.1:1\"\nlisten_port: 3\n", None).unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
        let e = Config::parse("health_check:\n  interval: 3\n", None).unwrap_err();
        assert!(e.to_string().contains("interval"), "{e}");
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            ("replicas:\n- {name: a, addr: nowhere}\n", "replicas[0].addr"),
            ("replicas:\n- {name: a, addr: \"127.0.0.1:1\"}\n- {name: a, addr: \"127.0.0.1:2\"}\n", "replicas[1].name"),
            ("prefix_index: {block_bytes: 0}\n", "prefix_index.block_bytes"),
            ("limits: {max_buffered_bytes: 10}\n", "limits.max_buffered_bytes"),
            ("metrics_listen: x\n", "metrics_listen"),
            ("shed_in_flight: 0\n", "shed_in_flight"),
            ("prefix_index: {repair_on_miss_s: 0}\n", "prefix_index.repair_on_miss_s"),
            ("kv_room: sometimes\n", "kv_room"),
            ("singles: {min_prefix_percent: 101}\n", "singles.min_prefix_percent"),
            ("singles: {by: hash}\n", "singles.by"),
            ("sample: {replicas: 1}\n", "sample.replicas"),
            ("engine_load: {path: metrics}\n", "engine_load.path"),
            ("health_check: {path: \"/he alth\"}\n", "health_check.path"),
            ("engine_load: {interval_ms: 0}\n", "engine_load.interval_ms"),

        ];
        for (yaml, field) in cases {
            let e = Config::parse(yaml, None).unwrap_err().to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }

    #[test]
    fn tls_without_the_feature_is_a_clear_error() {
        let r = Config::parse(&format!("replica_tls: {{enabled: true}}\n{ONE}"), None);
        if cfg!(feature = "tls") {
            assert!(r.is_ok());
        } else {
            assert!(r.unwrap_err().to_string().contains("--features tls"));
        }
        let e = Config::parse("replica_tls: {ca_file: /nonexistent}\n", None).unwrap_err();
        assert!(e.to_string().contains("replica_tls.ca_file"), "{e}");
    }

    #[test]
    fn engine_load_is_off_unless_asked_for_and_an_empty_block_takes_the_defaults() {
        let off = Config::parse(ONE, None).unwrap();
        assert_eq!(off.engine_load, None);
        let on = Config::parse(&format!("engine_load: {{}}\n{ONE}"), None).unwrap();
        assert_eq!(on.engine_load, Some(EngineLoad::default()));
    }

    #[test]
    fn environment_overrides_the_policy() {
        let c = Config::parse(&format!("policy: shape\n{ONE}"), Some("affinity")).unwrap();
        assert_eq!(c.policy, PolicyName::Affinity);
        let e = Config::parse("", Some("random")).unwrap_err().to_string();
        assert!(e.contains(POLICY_ENV), "{e}");
    }
}
