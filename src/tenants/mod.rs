//! Tenants: who a request belongs to (its API key's line, else the
//! configured header, else its key, else `anonymous`) and what each tenant
//! holds of its limits: requests in progress, and two per-minute buckets,
//! requests and prompt tokens. A request is admitted at its head (all three
//! checked before its body is read; a tenant in token debt waits), charged
//! its estimated prompt tokens once parsed, and corrected by the engine's
//! reported count at its end.
//!
//! Counts are kept per tenant name, sharded; an idle tenant whose buckets
//! are full is let go when `max_tracked` is reached (it is then the same
//! as a new one), and past that, names only a header gave share `other`.
//! Time is passed in.

mod bucket;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bucket::Bucket;

use crate::auth::Key;
use crate::config::{self, valid_tenant_name, Class, TenantLimits, OTHER};
use crate::errors::{RateHeaders, RouterError};
use crate::metrics::{Metrics, TenantCounters};

/// The tenant of requests nothing names.
pub const ANONYMOUS: &str = "anonymous";

/// The tenants section as the proxy uses it; swapped whole on reload.
#[derive(Debug)]
pub struct Rules {
    header: Option<http::HeaderName>,
    default: TenantLimits,
    /// Each named tenant's limits, merged over `default`.
    named: HashMap<String, TenantLimits>,
    max_tracked: usize,
}

impl Rules {
    pub fn new(c: &config::Tenants) -> Self {
        Self {
            header: c
                .header
                .as_deref()
                .and_then(|h| http::HeaderName::from_bytes(h.as_bytes()).ok()),
            default: c.default.clone(),
            named: (c.named.iter())
                .map(|(n, l)| (n.clone(), l.over(&c.default)))
                .collect(),
            max_tracked: c.max_tracked,
        }
    }

    /// The header naming a tenant, if configured.
    pub fn header(&self) -> Option<&http::HeaderName> {
        self.header.as_ref()
    }

    fn limits(&self, name: &str) -> &TenantLimits {
        self.named.get(name).unwrap_or(&self.default)
    }

    /// The tenant of a request with this `key` (when keys are checked) and
    /// this value of the tenant header; `None`: the header value cannot
    /// name a tenant.
    pub fn identify(&self, key: Option<&Key>, header: Option<&[u8]>) -> Option<Tenant> {
        let (name, labelled) = match (key, header) {
            (Some(k), _) if k.named => (Arc::clone(&k.tenant), true),
            (_, Some(h)) => {
                let name = std::str::from_utf8(h)
                    .ok()
                    .filter(|n| valid_tenant_name(n))?;
                (Arc::from(name), self.named.contains_key(name))
            }
            (Some(k), None) => (Arc::clone(&k.tenant), true),
            (None, None) => (Arc::from(ANONYMOUS), true),
        };
        let class = (self.limits(&name).class)
            .or(key.and_then(|k| k.class))
            .unwrap_or_default();
        Some(Tenant {
            name,
            class,
            labelled,
        })
    }
}

/// Who a request belongs to.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    pub class: Class,
    /// Counted under its own name in the metrics (else as `other`).
    labelled: bool,
}

/// One tenant's counts.
struct State {
    in_progress: u32,
    requests: Bucket,
    tokens: Bucket,
    counters: TenantCounters,
}

impl State {
    fn new(limits: &TenantLimits, counters: TenantCounters, now: Instant) -> Self {
        Self {
            in_progress: 0,
            requests: Bucket::full(limits.requests_per_minute.unwrap_or(0), now),
            tokens: Bucket::full(limits.prompt_tokens_per_minute.unwrap_or(0), now),
            counters,
        }
    }

    fn refill(&mut self, l: &TenantLimits, now: Instant) {
        if let Some(rpm) = l.requests_per_minute {
            self.requests.refill(rpm, now);
        }
        if let Some(tpm) = l.prompt_tokens_per_minute {
            self.tokens.refill(tpm, now);
        }
    }

    /// Nothing held: letting it go loses nothing.
    fn idle(&self, l: &TenantLimits) -> bool {
        self.in_progress == 0
            && l.requests_per_minute
                .is_none_or(|n| self.requests.is_full(n))
            && l.prompt_tokens_per_minute
                .is_none_or(|n| self.tokens.is_full(n))
    }

    fn headers(&self, l: &TenantLimits) -> RateHeaders {
        RateHeaders {
            requests: (l.requests_per_minute).map(|n| self.requests.rate(n)),
            tokens: (l.prompt_tokens_per_minute).map(|n| self.tokens.rate(n)),
        }
    }
}

const SHARDS: usize = 16;

/// Every tenant's counts.
pub struct Tenants {
    shards: [Mutex<HashMap<Arc<str>, State>>; SHARDS],
    tracked: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("tracked", &self.tracked.load(Relaxed))
            .finish()
    }
}

impl Tenants {
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            shards: Default::default(),
            tracked: AtomicUsize::new(0),
            metrics,
        })
    }

    fn shard(&self, name: &str) -> MutexGuard<'_, HashMap<Arc<str>, State>> {
        let i = xxhash_rust::xxh3::xxh3_64(name.as_bytes()) as usize % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tenants whose counts are held now.
    pub fn tracked(&self) -> usize {
        self.tracked.load(Relaxed)
    }

    /// A request's head arrived: counted in progress and against its
    /// requests per minute until the returned guard drops, or refused (429)
    /// by the first limit it is at: in progress, requests, token debt.
    pub fn arrive(
        self: &Arc<Self>,
        rules: &Arc<Rules>,
        tenant: &Tenant,
        now: Instant,
    ) -> Result<Admitted, RouterError> {
        let mut name = Arc::clone(&tenant.name);
        if self.tracked() >= rules.max_tracked && !self.shard(&name).contains_key(&name) {
            self.let_go_idle(rules, now);
            if self.tracked() >= rules.max_tracked && !tenant.labelled {
                name = Arc::from(OTHER);
            }
        }
        let limits = rules.limits(&name);
        let mut shard = self.shard(&name);
        let state = shard.entry(Arc::clone(&name)).or_insert_with(|| {
            self.tracked.fetch_add(1, Relaxed);
            let label = if tenant.labelled { &*name } else { OTHER };
            State::new(limits, self.metrics.tenants.of(label), now)
        });
        state.refill(limits, now);
        let refuse = |state: &State, what: String, wait: std::time::Duration, i: usize| {
            state.counters.refused[i].inc();
            RouterError::RateLimited {
                tenant: name.to_string(),
                what,
                retry_after_ms: wait.as_millis() as u64,
                headers: state.headers(limits),
            }
        };
        if let Some(max) = limits.max_concurrent.filter(|m| state.in_progress >= *m) {
            let what = format!("{max} requests in progress (max_concurrent)");
            return Err(refuse(state, what, std::time::Duration::from_secs(1), 0));
        }
        if let Some(rpm) = limits.requests_per_minute {
            if let Err(wait) = state.requests.take(rpm, 1) {
                let what = format!("{rpm} requests per minute");
                return Err(refuse(state, what, wait, 1));
            }
        }
        if let Some(tpm) = limits.prompt_tokens_per_minute {
            if !state.tokens.positive() {
                if let Some(rpm) = limits.requests_per_minute {
                    state.requests.give(rpm, 1);
                }
                let what = format!("{tpm} prompt tokens per minute");
                return Err(refuse(state, what, state.tokens.wait_for(tpm, 1), 2));
            }
        }
        state.in_progress += 1;
        state.counters.requests.inc();
        state.counters.in_flight.inc();
        Ok(Admitted {
            tenants: Arc::clone(self),
            rules: Arc::clone(rules),
            name,
            class: tenant.class,
            charged: 0,
            headers: state.headers(limits),
        })
    }

    /// Lets go of every idle tenant (at `max_tracked`).
    fn let_go_idle(&self, rules: &Rules, now: Instant) {
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.retain(|name, state| {
                let limits = rules.limits(name);
                state.refill(limits, now);
                let keep = !state.idle(limits);
                if !keep {
                    self.tracked.fetch_sub(1, Relaxed);
                }
                keep
            });
        }
    }
}

/// An admitted request's hold on its tenant's counts, released when it drops.
pub struct Admitted {
    tenants: Arc<Tenants>,
    rules: Arc<Rules>,
    name: Arc<str>,
    pub class: Class,
    /// Prompt tokens charged so far.
    charged: u64,
    /// The limits as they stood when it was admitted or charged.
    headers: RateHeaders,
}

impl Admitted {
    pub fn tenant(&self) -> &str {
        &self.name
    }

    /// The `x-ratelimit-*` headers for its answer (empty without limits).
    pub fn headers(&self) -> &RateHeaders {
        &self.headers
    }

    /// Charges the request's estimated prompt tokens: refused (429) when
    /// fewer are left and the bucket is not full (a prompt larger than the
    /// whole limit passes alone); its request is then given back.
    pub fn charge(&mut self, tokens: u64, now: Instant) -> Result<(), RouterError> {
        let limits = self.rules.limits(&self.name);
        let Some(tpm) = limits.prompt_tokens_per_minute else {
            self.charged = tokens;
            return Ok(());
        };
        let mut shard = self.tenants.shard(&self.name);
        let Some(state) = shard.get_mut(&self.name) else {
            return Ok(());
        };
        state.refill(limits, now);
        match state.tokens.take(tpm, tokens) {
            Ok(()) => {
                self.charged = tokens;
                self.headers = state.headers(limits);
                Ok(())
            }
            Err(wait) => {
                if let Some(rpm) = limits.requests_per_minute {
                    state.requests.give(rpm, 1);
                }
                state.counters.refused[2].inc();
                Err(RouterError::RateLimited {
                    tenant: self.name.to_string(),
                    what: format!("{tpm} prompt tokens per minute"),
                    retry_after_ms: wait.as_millis() as u64,
                    headers: state.headers(limits),
                })
            }
        }
    }

    /// The engine reported `tokens` prompt tokens: the estimate charged is
    /// replaced by it (a debt when it was low, a refund when high).
    pub fn correct(&mut self, tokens: u64) {
        let limits = self.rules.limits(&self.name);
        if let Some(tpm) = limits.prompt_tokens_per_minute {
            let mut shard = self.tenants.shard(&self.name);
            if let Some(state) = shard.get_mut(&self.name) {
                match tokens.checked_sub(self.charged) {
                    Some(more) => state.tokens.charge(more),
                    None => state.tokens.give(tpm, self.charged - tokens),
                }
            }
        }
        self.charged = tokens;
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut shard = self.tenants.shard(&self.name);
        if let Some(state) = shard.get_mut(&self.name) {
            state.in_progress = state.in_progress.saturating_sub(1);
            state.counters.in_flight.dec();
            state.counters.prompt_tokens.inc_by(self.charged);
        }
    }
}

#[cfg(test)]
mod tests;
