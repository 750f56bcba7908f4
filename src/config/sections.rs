//! The config file's sections other than the replica list: their types,
//! what each key means, and their defaults.

use serde::Deserialize;

/// `fleet:` — router instances sharing one set of replicas.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fleet {
    pub mode: FleetMode,
    /// `rendezvous`: singles too go by the hash of their prompt (`root`),
    /// not by the counter (`counter`).
    pub singles: FleetSingles,
    /// `redis`: `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`, or `rediss://`
    /// for TLS.
    pub redis_url: Option<String>,
    /// `rediss://`: a PEM file of CAs to trust instead of the system's.
    pub redis_ca_file: Option<String>,
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
            redis_ca_file: None,
            redis_budget_ms: 5,
            redis_ttl_s: 3_600,
        }
    }
}

/// `sample:` — placement in a large fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sample {
    /// With more replicas than this, a placement reads at most `replicas`
    /// of them (a window turning over the fleet, up to its first idle
    /// replica) and those holding the request's prefix, not all: its cost
    /// stays flat as the fleet grows. 0: always all.
    pub above: usize,
    pub replicas: usize,
}

impl Default for Sample {
    fn default() -> Self {
        Self {
            above: 64,
            replicas: 32,
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
    /// Requests in flight to replicas at once (a slot is taken when a
    /// request is placed: a client still sending its body holds none).
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
    /// Requests in progress (head to end) per client address; 0: no cap.
    pub max_requests_per_client: usize,
    /// Concurrent streams per HTTP/2 client connection (`listen_tls`),
    /// announced in its SETTINGS; read at start.
    pub max_streams_per_connection: u32,
    /// Connections the metrics listener holds at once; more are closed as
    /// they arrive (read at start).
    pub max_metrics_connections: usize,
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
    /// Failed checks in a row that take a replica down (Kubernetes'
    /// `failureThreshold`); a check failing while the replica answers routed
    /// requests does not count.
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that bring it up.
    pub healthy_threshold: u32,
    /// Checks a second at most: past it a live replica is checked in its
    /// turn of every few rounds (a replica that is not live, every round);
    /// 0: every replica every round.
    pub max_per_second: u32,
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
    /// Reads a second at most: past it each replica is read in its turn of
    /// every few rounds; 0: every replica every round.
    pub max_per_second: u32,
}

impl Default for EngineLoad {
    fn default() -> Self {
        Self {
            path: "/metrics".into(),
            interval_ms: 500,
            max_per_second: 500,
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
            max_requests_per_client: 0,
            max_streams_per_connection: 100,
            max_metrics_connections: 1024,
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
            unhealthy_threshold: 3,
            healthy_threshold: 1,
            max_per_second: 250,
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

/// `log_format:` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}
