//! The proxy's settings, read from the config and swapped whole on reload:
//! body limits, timeouts, placement headers, outlier rules.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{ms, Config, ReplicaTls};
use crate::replicas::OutlierRules;
use crate::tenants::Rules;

/// Proxy settings; a reload swaps them whole (`block_bytes` and `tls` stay
/// as started).
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub block_bytes: usize,
    pub max_prompt_bytes: usize,
    pub max_checkpoint_bytes: usize,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub response_header_timeout: Duration,
    pub write_timeout: Duration,
    pub idle_timeout: Duration,
    pub client_keepalive_s: u64,
    pub client_header_timeout: Duration,
    pub client_write_timeout: Duration,
    pub placement_headers: bool,
    /// Forward the client's key headers when the router checks keys.
    pub forward_client_keys: bool,
    /// `prefix_index.repair_on_miss_s`.
    pub repair_on_miss_s: Option<u32>,
    /// `shed_in_flight`.
    pub shed_in_flight: Option<u32>,
    pub queue: Option<crate::config::Queue>,
    pub outlier: OutlierRules,
    pub tls: ReplicaTls,
    /// `tenants`, when set.
    pub tenants: Option<Arc<Rules>>,
    pub sample: crate::config::Sample,
}

impl Settings {
    pub fn from_config(c: &Config) -> Self {
        Self {
            max_body_bytes: c.max_body_bytes,
            body_read_timeout: ms(c.body_read_timeout_ms),
            block_bytes: c.prefix_index.block_bytes,
            max_prompt_bytes: c.limits.max_prompt_bytes,
            max_checkpoint_bytes: c.limits.max_checkpoint_bytes,
            connect_timeout: ms(c.timeouts.connect_ms),
            read_timeout: ms(c.timeouts.read_ms),
            response_header_timeout: ms(c.timeouts.response_header_ms),
            write_timeout: ms(c.timeouts.write_ms),
            idle_timeout: ms(c.timeouts.idle_ms),
            client_keepalive_s: c.client_timeouts.keepalive_idle_s,
            client_header_timeout: ms(c.client_timeouts.header_ms),
            client_write_timeout: ms(c.client_timeouts.write_ms),
            placement_headers: c.placement_headers,
            forward_client_keys: c.forward_client_keys,
            repair_on_miss_s: c.prefix_index.repair_on_miss_s,
            shed_in_flight: c.shed_in_flight,
            queue: c.queue.clone(),
            outlier: OutlierRules::from(&c.outlier),
            tls: c.replica_tls.clone(),
            tenants: c.tenants.as_ref().map(|t| Arc::new(Rules::new(t))),
            sample: c.sample,
        }
    }
}
