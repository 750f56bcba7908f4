//! The YAML configuration: serde types, the one set of defaults, and
//! `validate()`, which names the offending field. Unknown keys are errors.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::access_log::LogFormat;

use crate::policy::{self, ContinuationRule, KvRoom, Mode, PolicyConfig};

/// The configuration the router runs on when no `--config` is given: two
/// simulated replicas on localhost (see the README).
pub const EMBEDDED_DEFAULT: &str = include_str!("../conf/default.yaml");

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
    /// Window of the per-replica working-set estimate (capacity gauges and warning).
    pub working_set_window_s: u32,
    /// Pingora worker threads for the proxy (default: the cores available).
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
    /// `text` (default) or `json`: every log line one JSON object.
    pub log_format: LogFormat,
    /// How a single (a one-shot prompt) is placed (see the policy module).
    pub singles: Singles,
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
}

/// `fleet:` — router instances sharing one set of replicas.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fleet {
    pub mode: FleetMode,
    /// `rendezvous`: singles too go by the hash of their prompt (`root`),
    /// not by the counter (`counter`).
    pub singles: FleetSingles,
    /// `redis`: `redis://[:PASSWORD@]HOST:PORT[/DB]`.
    pub redis_url: Option<String>,
    /// `redis`: a request waits at most this long for shared pins, then is
    /// placed on this instance's own index.
    pub redis_budget_ms: u64,
    /// `redis`: how long a shared pin lives after its last write.
    pub redis_ttl_s: u64,
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            mode: FleetMode::Local,
            singles: FleetSingles::Counter,
            redis_url: None,
            redis_budget_ms: 5,
            redis_ttl_s: 3_600,
        }
    }
}

/// `singles:` — where one-shot prompts go.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Singles {
    /// `prefix`: a single goes to the replica holding most of its prompt (a
    /// long shared system prompt) while that replica has at most
    /// `bound_queued` more requests queued than the least-queued one;
    /// `spread`: the counter for every single (the seed's rule).
    pub by: SinglesBy,
    /// The held prefix must be at least this long (canonical prompt bytes)...
    pub min_prefix_bytes: usize,
    /// ...and at least this share of the prompt.
    pub min_prefix_percent: u8,
    /// Requests sent and not yet answering (queued or in prefill; with
    /// `engine_load`, plus those the engine runs beyond the router's) the
    /// holder may have beyond the least-queued live replica.
    pub bound_queued: u32,
    /// While every replica's KV (`kv_tokens`, declared on all) could hold
    /// every prompt placed within `working_set_window_s`, singles keep the
    /// counter: each card keeps every shared prefix, and the counter
    /// balances them better.
    pub spread_while_all_fit: bool,
}

impl Default for Singles {
    fn default() -> Self {
        Self {
            by: SinglesBy::Prefix,
            min_prefix_bytes: 4_096,
            min_prefix_percent: 75,
            bound_queued: 2,
            spread_while_all_fit: true,
        }
    }
}

/// `singles.by:` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SinglesBy {
    Prefix,
    Spread,
}

/// `fleet.mode:` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetMode {
    /// Each instance places by what it has seen.
    #[default]
    Local,
    /// Continuations by a rendezvous hash of their conversation root: every
    /// instance places them alike, with no shared state.
    Rendezvous,
    /// Each instance by its own index, and what other instances placed,
    /// read from Redis on a local miss.
    Redis,
}

/// `fleet.singles:` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetSingles {
    #[default]
    Counter,
    Root,
}

/// `outlier:` — ejection of replicas that fail on the request path.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Outlier {
    /// Connect timeouts, response timeouts and 5xx in a row that eject.
    pub consecutive_failures: u32,
    /// First ejection time; doubles with each ejection in a row.
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// At most this share of the replicas is ejected at once (at least one may be).
    pub max_ejection_percent: u32,
}

/// `limits:` — what the router holds at once before it answers 503.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Routed requests (body read, in flight to a replica) at once.
    pub max_requests: usize,
    /// Request body bytes buffered at once, all requests together.
    pub max_buffered_bytes: usize,
    /// Canonical prompt bytes hashed per request; the rest of a longer prompt
    /// does not change its placement.
    pub max_prompt_bytes: usize,
    /// Bytes kept of long conversations' latest turns (bodies of 32 KiB and
    /// more, their canonical text and hashes), so that a next turn's body is
    /// read from where the last one ended; 0: none kept.
    pub max_checkpoint_bytes: usize,
}

/// `client_timeouts:` — towards clients (downstream).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientTimeouts {
    /// An idle keep-alive connection is closed after this (whole seconds).
    pub keepalive_idle_s: u64,
    /// A request head must arrive whole within this of its first byte
    /// (slowloris); past it the connection is closed.
    pub header_ms: u64,
    /// Longest wait for a client to accept response bytes; a client that
    /// stopped reading a stream is dropped and its replica request cancelled.
    pub write_ms: u64,
}

/// `listen_tls:` — client TLS, HTTP/2 by ALPN; the files are re-read when
/// they change (renewals need no restart).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenTls {
    pub addr: String,
    /// PEM: the certificate, then its intermediates.
    pub cert_file: String,
    /// PEM private key of the certificate.
    pub key_file: String,
}

/// `replica_tls:` — one setting for the whole fleet.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaTls {
    pub enabled: bool,
    /// Server name sent and verified; empty: none (IP-only certificates).
    pub sni: String,
    /// Verify the replica's certificate and host name.
    pub verify: bool,
    /// PEM file of CAs to trust instead of the system's.
    pub ca_file: Option<String>,
}

impl ReplicaTls {
    /// Whether the replica's host name is verified (needs a name to verify).
    pub fn verify_hostname(&self) -> bool {
        self.verify && !self.sni.is_empty()
    }
}

impl Default for ReplicaTls {
    fn default() -> Self {
        Self {
            enabled: false,
            sni: String::new(),
            verify: true,
            ca_file: None,
        }
    }
}

/// `policy:` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyName {
    Shape,
    Roundrobin,
    Affinity,
}

impl PolicyName {
    /// As written in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Shape => "shape",
            PolicyName::Roundrobin => "roundrobin",
            PolicyName::Affinity => "affinity",
        }
    }
}

/// `kv_room:` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRoomName {
    Off,
    Spread,
    Pack,
}

/// A replica's `prompt_cache:`: which prompts its engine keeps for reuse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptCache {
    /// Prefixes of many prompts share the KV up to `kv_tokens` (vLLM, SGLang,
    /// llama.cpp with its host-memory prompt cache).
    #[default]
    Shared,
    /// Only the last prompt it ran (llama.cpp with one slot and
    /// `--cache-ram 0`): any other prompt displaces the context pinned there,
    /// whatever room `kv_tokens` leaves.
    Last,
}

/// `continuation:` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContinuationName {
    ModelTurn,
    MultiMessage,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheck {
    /// vLLM, SGLang and llama.cpp all answer `/health` (503 while loading).
    pub path: String,
    pub interval_ms: u64,
}

/// `engine_load:` — where and how often engines' own metrics are read.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineLoad {
    /// vLLM, SGLang and llama.cpp (`--metrics`) serve `/metrics`.
    pub path: String,
    /// Each replica is read this often (at least 50 ms); after three reads in
    /// a row that take longer, fail or name none of the known series, the
    /// router's own counts are in force until one works.
    pub interval_ms: u64,
}

impl Default for EngineLoad {
    fn default() -> Self {
        Self {
            path: "/metrics".into(),
            interval_ms: 500,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    pub connect_ms: u64,
    /// Longest wait for any byte from a replica: must cover a long prefill.
    pub read_ms: u64,
    /// Longest total wait for a replica's response head, from when a replica is
    /// first chosen for the request, over all attempts (a non-streaming
    /// answer's head comes after the whole generation). Unlike `read_ms`, a
    /// replica trickling bytes cannot stretch it.
    pub response_header_ms: u64,
    /// Longest wait to write the request head, then the whole buffered body
    /// (one write, so it must cover the largest body at the replica's pace).
    pub write_ms: u64,
    /// Idle pooled connections to replicas are closed after this. Keep it below
    /// the engines' own keep-alive timeout (uvicorn, under vLLM and SGLang: 5 s)
    /// so the router never reuses a connection the engine is closing: a request
    /// lost that way cannot be re-sent safely.
    pub idle_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixIndex {
    /// Block size of the prefix hash chain.
    pub block_bytes: usize,
    /// Cap on tracked prefix entries (segmented LRU beyond it: scan-resistant).
    pub max_entries: usize,
    /// A pin whose engine reports (almost) nothing of it cached makes the
    /// index forget what that replica held from before, when the prefix was
    /// placed at least this many seconds before the request (a younger one
    /// may still be in its first prefill), at most once per this many seconds
    /// per replica. `null`: never.
    pub repair_on_miss_s: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replica {
    pub name: String,
    /// `IP:port` or `host:port` of an OpenAI-compatible server.
    pub addr: String,
    /// KV cache capacity in tokens, for the capacity gauges.
    #[serde(default)]
    pub kv_tokens: Option<u64>,
    /// What the engine's prefix cache keeps (see [`PromptCache`]).
    #[serde(default)]
    pub prompt_cache: PromptCache,
    /// The models it serves (the `model` of requests it may get). Unset: as
    /// its own `GET /v1/models` lists them, read at each passing health check
    /// (until read, or when it lists none: any model).
    #[serde(default)]
    pub models: Option<Vec<String>>,
}

impl Replica {
    /// Checks one entry; `names` and `addrs` collect those seen before it.
    fn validate<'a>(
        &'a self,
        field: impl Fn(&str) -> String,
        names: &mut HashSet<&'a str>,
        addrs: &mut HashSet<String>,
    ) -> Result<(), ConfigError> {
        let name_char = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if self.name.is_empty() || !self.name.chars().all(name_char) {
            return Err(invalid(
                field("name"),
                format!("`{}` must be non-empty [A-Za-z0-9._-]", self.name),
            ));
        }
        if !names.insert(&self.name) {
            return Err(invalid(
                field("name"),
                format!("`{}` is used twice", self.name),
            ));
        }
        let addr = host_port(&self.addr)
            .map_err(|why| invalid(field("addr"), format!("`{}` {why}", self.addr)))?;
        if !addrs.insert(addr) {
            return Err(invalid(
                field("addr"),
                format!("`{}` is used twice", self.addr),
            ));
        }
        if self.models.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid(
                field("models"),
                "lists no model (leave it out to read the replica's own list)",
            ));
        }
        for m in self.models.iter().flatten() {
            if m.is_empty() || m.len() > MAX_MODEL_NAME {
                return Err(invalid(
                    field("models"),
                    format!("model names are 1 to {MAX_MODEL_NAME} bytes"),
                ));
            }
        }
        Ok(())
    }
}

/// `IP:port`, or `host:port` with a DNS name (resolved by `resolve`); the
/// address in one spelling (to find one listed twice).
fn host_port(addr: &str) -> Result<String, &'static str> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return match a.port() {
            0 => Err("has no valid port (1-65535)"),
            _ => Ok(a.to_string()),
        };
    }
    let (host, port) = addr.rsplit_once(':').ok_or("is not IP:port or host:port")?;
    if !port.parse::<u16>().is_ok_and(|p| p > 0) {
        return Err("has no valid port (1-65535)");
    }
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    let name = host.strip_suffix('.').unwrap_or(host);
    // A last label of digits only is an IP address the resolver would read
    // loosely (`10.0.0` is 10.0.0.0), not a name.
    let numeric = name
        .rsplit('.')
        .next()
        .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()));
    if name.len() > 253 || !name.split('.').all(label) || numeric {
        return Err("is not IP:port or host:port (a DNS name)");
    }
    Ok(format!("{}:{port}", name.to_ascii_lowercase()))
}

#[cfg(test)]
mod host_port_tests {
    use super::host_port;

    #[test]
    fn addresses_are_ip_port_or_dns_name_port() {
        for ok in [
            "127.0.0.1:8000",
            "[::1]:80",
            "vllm-0.vllm:8000",
            "vllm-headless.default.svc.cluster.local.:8000",
            "engine_1:80",
            "localhost:1",
        ] {
            assert!(host_port(ok).is_ok(), "{ok}");
        }
        for bad in [
            "nowhere",
            "host:0",
            "127.0.0.1:0",
            "host:65536",
            "10.0.0:8000",
            "123:80",
            "-x:80",
            "a..b:80",
            "a b:80",
            "::1:80",
            ":80",
        ] {
            assert!(host_port(bad).is_err(), "{bad}");
        }
        assert_eq!(host_port("Engine.Local.:80"), host_port("engine.local:80"));
        assert_eq!(host_port("[0::1]:80"), host_port("[::1]:80"));
    }
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
            shutdown_grace_s: 20,
            upgrade_sock: None,
            reload_interval_ms: 1_000,
            working_set_window_s: 300,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            replica_tls: ReplicaTls::default(),
            outlier: Outlier::default(),
            limits: Limits::default(),
            client_timeouts: ClientTimeouts::default(),
            placement_headers: true,
            api_keys_file: None,
            log_format: LogFormat::Text,
            singles: Singles::default(),
            fleet: Fleet::default(),
            replicas: Vec::new(),
            replicas_dns: Vec::new(),
            dns_refresh_ms: 5_000,
        }
    }
}

impl Default for Outlier {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_requests: 4096,
            max_buffered_bytes: 2 << 30,
            max_prompt_bytes: 8 << 20,
            max_checkpoint_bytes: 128 << 20,
        }
    }
}

impl Default for ClientTimeouts {
    fn default() -> Self {
        Self {
            keepalive_idle_s: 60,
            header_ms: 30_000,
            write_ms: 60_000,
        }
    }
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            interval_ms: 1_000,
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect_ms: 1_000,
            read_ms: 600_000,
            response_header_ms: 600_000,
            write_ms: 60_000,
            idle_ms: 4_000,
        }
    }
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self {
            block_bytes: 1024,
            max_entries: 1 << 20,
            repair_on_miss_s: Some(10),
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

    /// Reads a file (see [`Config::parse`]).
    pub fn load(path: &Path, env_policy: Option<&str>) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, env_policy)
    }

    /// Checks every field a typo could break; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("listen", &self.listen),
            ("metrics_listen", &self.metrics_listen),
        ] {
            value
                .parse::<SocketAddr>()
                .map_err(|e| invalid(field, format!("`{value}` is not IP:port ({e})")))?;
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.shed_in_flight == Some(0) {
            return Err(invalid(
                "shed_in_flight",
                "must be positive, or null for off",
            ));
        }
        if self.prefix_index.repair_on_miss_s == Some(0) {
            return Err(invalid(
                "prefix_index.repair_on_miss_s",
                "must be positive, or null for never",
            ));
        }
        let path = |field: &str, p: &str| {
            if p.starts_with('/') && p.parse::<http::uri::PathAndQuery>().is_ok() {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!("`{p}` is not a path starting with /"),
                ))
            }
        };
        path("health_check.path", &self.health_check.path)?;
        if let Some(e) = &self.engine_load {
            path("engine_load.path", &e.path)?;
            if e.interval_ms < 50 {
                return Err(invalid("engine_load.interval_ms", "must be at least 50"));
            }
        }
        for (field, v) in [
            ("body_read_timeout_ms", self.body_read_timeout_ms),
            ("health_check.interval_ms", self.health_check.interval_ms),
            ("timeouts.connect_ms", self.timeouts.connect_ms),
            ("timeouts.read_ms", self.timeouts.read_ms),
            (
                "timeouts.response_header_ms",
                self.timeouts.response_header_ms,
            ),
            ("timeouts.write_ms", self.timeouts.write_ms),
            ("reload_interval_ms", self.reload_interval_ms),
            ("working_set_window_s", u64::from(self.working_set_window_s)),
            ("outlier.base_ejection_ms", self.outlier.base_ejection_ms),
            ("outlier.max_ejection_ms", self.outlier.max_ejection_ms),
            ("limits.max_requests", self.limits.max_requests as u64),
            (
                "limits.max_buffered_bytes",
                self.limits.max_buffered_bytes as u64,
            ),
            (
                "limits.max_prompt_bytes",
                self.limits.max_prompt_bytes as u64,
            ),
            (
                "client_timeouts.keepalive_idle_s",
                self.client_timeouts.keepalive_idle_s,
            ),
            ("client_timeouts.header_ms", self.client_timeouts.header_ms),
            ("client_timeouts.write_ms", self.client_timeouts.write_ms),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        if !(1..=65_535).contains(&self.prefix_index.block_bytes) {
            return Err(invalid("prefix_index.block_bytes", "must be 1..=65535"));
        }
        if self.prefix_index.max_entries == 0 {
            return Err(invalid("prefix_index.max_entries", "must be positive"));
        }
        if self.singles.min_prefix_percent > 100 {
            return Err(invalid("singles.min_prefix_percent", "must be 0..=100"));
        }
        if self.outlier.max_ejection_percent > 100 {
            return Err(invalid("outlier.max_ejection_percent", "must be 0..=100"));
        }
        if self.limits.max_buffered_bytes < self.max_body_bytes {
            return Err(invalid(
                "limits.max_buffered_bytes",
                "must be at least max_body_bytes (a body between the two could never pass)",
            ));
        }
        if self.threads == 0 {
            return Err(invalid("threads", "must be positive"));
        }
        if self.replica_tls.enabled && !cfg!(feature = "tls") {
            return Err(invalid(
                "replica_tls.enabled",
                "this build has no TLS support; build with `cargo build --features tls`",
            ));
        }
        if let Some(t) = &self.listen_tls {
            if !cfg!(feature = "tls") {
                return Err(invalid(
                    "listen_tls",
                    "this build has no TLS support; build with `cargo build --features tls`",
                ));
            }
            if t.addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid("listen_tls.addr", "must be IP:port"));
            }
            if t.addr == self.listen || t.addr == self.metrics_listen {
                return Err(invalid("listen_tls.addr", "is another listener's address"));
            }
            for (field, file) in [
                ("listen_tls.cert_file", &t.cert_file),
                ("listen_tls.key_file", &t.key_file),
            ] {
                if !Path::new(file).is_file() {
                    return Err(invalid(field, format!("`{file}` is not a file")));
                }
            }
        }
        if let Some(ca) = &self.replica_tls.ca_file {
            if !Path::new(ca).is_file() {
                return Err(invalid(
                    "replica_tls.ca_file",
                    format!("`{ca}` is not a file"),
                ));
            }
        }
        if self.replicas.is_empty() && self.replicas_dns.is_empty() {
            // An emptied or truncated file must not take the whole fleet away.
            return Err(invalid(
                "replicas",
                "lists no replica (to take every replica out, stop the router)",
            ));
        }
        let f = &self.fleet;
        match (&f.mode, &f.redis_url) {
            (FleetMode::Redis, None) => {
                return Err(invalid("fleet.redis_url", "is needed by mode: redis"))
            }
            (_, Some(url)) => {
                crate::shared::parse_url(url).map_err(|why| invalid("fleet.redis_url", why))?;
            }
            _ => {}
        }
        if f.redis_budget_ms == 0 || f.redis_ttl_s == 0 {
            return Err(invalid(
                "fleet",
                "redis_budget_ms and redis_ttl_s must be positive",
            ));
        }
        if self.dns_refresh_ms < 100 {
            return Err(invalid("dns_refresh_ms", "must be at least 100"));
        }
        let (mut names, mut addrs) = (HashSet::new(), HashSet::new());
        let lists = [
            ("replicas", &self.replicas),
            ("replicas_dns", &self.replicas_dns),
        ];
        for (list, replicas) in lists {
            for (i, r) in replicas.iter().enumerate() {
                let field = |f: &str| format!("{list}[{i}].{f}");
                r.validate(field, &mut names, &mut addrs)?;
            }
        }
        Ok(())
    }

    /// The outlier detection rules.
    pub fn outlier_rules(&self) -> crate::replicas::OutlierRules {
        let o = &self.outlier;
        crate::replicas::OutlierRules {
            consecutive_failures: o.consecutive_failures,
            base_ejection: ms(o.base_ejection_ms),
            max_ejection: ms(o.max_ejection_ms),
            max_ejection_percent: o.max_ejection_percent,
        }
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
            "replica_tls" => replica_tls;
            "listen_tls" => listen_tls;
            "api_keys_file" => api_keys_file;
            "fleet.redis_url" => fleet.redis_url;
            "fleet.redis_budget_ms" => fleet.redis_budget_ms;
            "fleet.redis_ttl_s" => fleet.redis_ttl_s;
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

    /// The policy's parameters.
    pub fn policy_config(&self) -> PolicyConfig {
        PolicyConfig {
            mode: match self.policy {
                PolicyName::Shape => Mode::Shape,
                PolicyName::Roundrobin => Mode::RoundRobin,
                PolicyName::Affinity => Mode::Affinity,
            },
            continuation: match self.continuation {
                ContinuationName::ModelTurn => ContinuationRule::ModelTurn,
                ContinuationName::MultiMessage => ContinuationRule::MultiMessage,
            },
            block_bytes: self.prefix_index.block_bytes,
            max_entries: self.prefix_index.max_entries,
            kv_room: match self.kv_room {
                KvRoomName::Off => KvRoom::Off,
                KvRoomName::Spread => KvRoom::Spread,
                KvRoomName::Pack => KvRoom::Pack,
            },
            load_guard: self.load_guard_in_flight,
            least_loaded: self.engine_load.is_some(),
            singles: (self.singles.by == SinglesBy::Prefix).then_some(policy::SinglesByPrefix {
                min_bytes: self.singles.min_prefix_bytes,
                min_percent: self.singles.min_prefix_percent,
                bound: self.singles.bound_queued,
                spread_while_all_fit: self.singles.spread_while_all_fit,
            }),
            fleet: match self.fleet.mode {
                FleetMode::Local | FleetMode::Redis => policy::Fleet::Local,
                FleetMode::Rendezvous => policy::Fleet::Rendezvous {
                    singles: self.fleet.singles == FleetSingles::Root,
                },
            },
        }
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
        assert!(!off.policy_config().least_loaded);
        let on = Config::parse(&format!("engine_load: {{}}\n{ONE}"), None).unwrap();
        assert_eq!(on.engine_load, Some(EngineLoad::default()));
        assert!(on.policy_config().least_loaded);
    }

    #[test]
    fn environment_overrides_the_policy() {
        let c = Config::parse(&format!("policy: shape\n{ONE}"), Some("affinity")).unwrap();
        assert_eq!(c.policy_config().mode, Mode::Affinity);
        let e = Config::parse("", Some("random")).unwrap_err().to_string();
        assert!(e.contains(POLICY_ENV), "{e}");
    }
}
