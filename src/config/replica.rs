//! One `replicas:` entry and its checks.

use std::collections::HashSet;
use std::net::SocketAddr;

use serde::Deserialize;

use super::sections::PromptCache;
use super::{invalid, ConfigError, MAX_MODEL_NAME};

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
    /// Its engine's KV events (see [`KvEvents`]); unset: none read.
    #[serde(default)]
    pub kv_events: Option<KvEvents>,
    /// A file holding the API key its engine was started with (`--api-key`):
    /// sent as `Authorization: Bearer` on every request to it, the client's
    /// own key headers removed. Read when the config is (re)loaded.
    #[serde(default)]
    pub api_key_file: Option<String>,
    /// That key, once read ([`super::Config::read_replica_keys`]).
    #[serde(skip)]
    pub api_key: Option<Secret>,
}

/// A secret read from a file (a replica's API key): sent, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(std::sync::Arc<str>);

impl Secret {
    /// Reads `path`: its text, trimmed, must be one non-empty line.
    pub fn read(path: &str) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        let key = text.trim_start_matches('\u{feff}').trim();
        if key.is_empty() || key.contains(['\r', '\n']) {
            return Err(format!("{path} must hold one key on one line"));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("{path}: a key is printable ASCII without spaces"));
        }
        Ok(Self(key.into()))
    }

    /// `Bearer <key>` as a header value marked sensitive (a log of the
    /// head prints it as such).
    pub fn bearer(&self) -> http::HeaderValue {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {}", self.0))
            .unwrap_or_else(|_| http::HeaderValue::from_static(""));
        v.set_sensitive(true);
        v
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Where a replica's engine publishes its KV-cache events (vLLM's and
/// SGLang's `--kv-events-config`: a ZMQ publisher and, optionally, its
/// replay socket).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEvents {
    /// `tcp://host:port`; host `*` is the replica's own address (as the
    /// engine's `tcp://*:5557`, for `replicas_dns` pools too).
    pub endpoint: String,
    /// The topic subscribed to; empty (the default): every topic.
    #[serde(default)]
    pub topic: String,
    /// The replay socket (`tcp://host:port`, host `*` as above): lost
    /// batches are asked for there; unset: a loss leaves the replica's
    /// cache state unknown until the engine's cache is next emptied.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Blocks kept for this replica at most (memory: about 60 bytes each);
    /// an engine that reports more is taken as unknown.
    #[serde(default = "default_max_blocks")]
    pub max_blocks: usize,
}

fn default_max_blocks() -> usize {
    262_144
}

/// The most `max_blocks` may be.
const MAX_BLOCKS: usize = 1 << 24;

impl KvEvents {
    /// `endpoint` or `replay_endpoint` as connected to for a replica at
    /// `addr`: host `*` is its IP.
    pub fn resolve(endpoint: &str, addr: SocketAddr) -> String {
        match endpoint.strip_prefix("tcp://*:") {
            Some(port) => match addr {
                SocketAddr::V4(a) => format!("tcp://{}:{port}", a.ip()),
                SocketAddr::V6(a) => format!("tcp://[{}]:{port}", a.ip()),
            },
            None => endpoint.to_owned(),
        }
    }

    fn validate(&self, field: impl Fn(&str) -> String) -> Result<(), ConfigError> {
        let endpoints = [
            ("endpoint", Some(&self.endpoint)),
            ("replay_endpoint", self.replay_endpoint.as_ref()),
        ];
        for (name, e) in endpoints {
            let Some(e) = e else { continue };
            let ok = e.strip_prefix("tcp://").is_some_and(|hp| {
                let hp = hp
                    .strip_prefix("*:")
                    .map_or(hp.to_owned(), |port| format!("x:{port}"));
                host_port(&hp).is_ok()
            });
            if !ok {
                return Err(invalid(
                    field(name),
                    format!("`{e}` is not tcp://host:port (host `*`: the replica's address)"),
                ));
            }
        }
        if self.max_blocks == 0 || self.max_blocks > MAX_BLOCKS {
            return Err(invalid(
                field("max_blocks"),
                format!("must be 1 to {MAX_BLOCKS}"),
            ));
        }
        Ok(())
    }
}

impl Replica {
    /// An entry named `name` at `addr`, every optional field unset.
    pub fn at(name: impl Into<String>, addr: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            addr: addr.into(),
            kv_tokens: None,
            prompt_cache: PromptCache::default(),
            models: None,
            kv_events: None,
            api_key_file: None,
            api_key: None,
        }
    }

    /// Checks one entry; `names` and `addrs` collect those seen before it.
    pub(super) fn validate<'a>(
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
        if let Some(k) = &self.kv_events {
            k.validate(|f| field(&format!("kv_events.{f}")))?;
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
