//! prefix-router: a Pingora load balancer for single-GPU LLM replicas that pins a
//! conversation's continuations to the replica holding its prefix in KV cache and
//! spreads everything else with a counter.
//!
//! Layers, lowest first (`scripts/check-layers.py` keeps them; see
//! `docs/architecture.md`):
//! - [`policy`], [`request`]: the pure routing core, the `routing` crate
//!   (`crates/routing`), re-exported.
//! - Leaves: [`config`] (the YAML file's types and checks), [`errors`],
//!   [`paths`], [`usage`], [`admission`], [`auth`], [`response_ids`].
//! - Built from the config: [`metrics`] (handles, passed in), [`access_log`],
//!   [`resolve`], [`upgrade`], [`engine_client`], [`policy_config`], [`drain`].
//! - [`replicas`]: the live set, published whole; [`shared_pins`]: Redis.
//! - Over the set: [`health_checks`] (paced rounds of Pingora's HTTP
//!   check), [`engine_load`], [`capacity`], [`admin`] (the admin API),
//!   [`status`] (the metrics listener, serving it), [`settings`]; then
//!   [`body`] and [`exact`] (a prompt's tokens).
//! - [`proxy`]: the one `ProxyHttp`; [`reload`]: hot reload.
#![forbid(unsafe_code)]

pub use routing::{kv, policy, request};

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod auth;
pub mod body;
pub mod capacity;
pub mod config;
pub mod drain;
pub mod engine_client;
pub mod engine_load;
pub mod errors;
pub mod exact;
pub mod health_checks;
pub mod kv_events;
#[cfg(feature = "tls")]
pub mod listen_tls;
pub mod metrics;
pub mod paths;
pub mod policy_config;
pub mod proxy;
pub mod reload;
pub mod replicas;
pub mod resolve;
pub mod response_ids;
pub mod settings;
pub mod shared_pins;
pub mod status;
pub mod tenants;
pub mod traces;
pub mod upgrade;
pub mod usage;
