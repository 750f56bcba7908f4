//! prefix-router: a Pingora load balancer for single-GPU LLM replicas that pins a
//! conversation's continuations to the replica holding its prefix in KV cache and
//! spreads everything else with a counter.
//!
//! - [`policy`], [`request`]: the pure routing core, the `routing` crate
//!   (`crates/routing`), re-exported: the rule, and request body -> canonical
//!   prompt text and shape signals.
//! - [`config`]: the YAML file; [`reload`]: hot reload of its replica list.
//! - [`replicas`]: the live set; [`fleet`]: Pingora discovery, health checks, selection.
//! - [`proxy`]: the Pingora `ProxyHttp`; [`errors`]: OpenAI-style error bodies;
//!   [`metrics`]: every Prometheus metric; [`capacity`]: working set vs KV capacity;
//!   [`usage`]: the cache figures engines report in their responses.
#![forbid(unsafe_code)]

pub use routing::{policy, request};

pub mod access_log;
pub mod admission;
pub mod auth;
pub mod body;
pub mod capacity;
pub mod config;
pub mod drain;
pub mod engine_load;
pub mod errors;
pub mod fleet;
#[cfg(feature = "tls")]
pub mod listen_tls;
pub mod metrics;
pub mod paths;
pub mod probes;
pub mod proxy;
pub mod reload;
pub mod replicas;
pub mod resolve;
pub mod responses;
pub mod settings;
pub mod shared;
pub mod upgrade;
pub mod usage;
