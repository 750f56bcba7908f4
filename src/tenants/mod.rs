//! Tenants: who a request belongs to (its API key's `tenant=`; a gateway
//! key's requests, or any request when keys are not checked, by the
//! configured header; an unnamed key is its own tenant; else `anonymous`)
//! and what each tenant holds of its limits: requests in progress, and two
//! per-minute buckets, requests and prompt tokens. A request is admitted at
//! its head (in progress, requests and token debt checked before its body
//! is read), charged its estimated prompt tokens once its body is read,
//! and corrected by the engine's reported count at its end; a request the
//! router itself refuses later is given back.
//!
//! Counts are kept per tenant name, sharded; an idle tenant whose buckets
//! are full is let go when `max_tracked` is reached (it is then the same
//! as a new one; looked for at most once a second), and past that, names
//! only a header gave share `other`. Time is passed in.

mod bucket;
pub mod queue;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
            default: unlimited_zero(c.default.clone()),
            named: (c.named.iter())
                .map(|(n, l)| (n.clone(), unlimited_zero(l.over(&c.default))))
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
    /// this value of the tenant header (trusted without keys, or from a
    /// gateway's key); `None`: the header cannot name a tenant.
    pub fn identify(&self, key: Option<&Key>, header: Option<&[u8]>) -> Option<Tenant> {
        let from_header = || -> Option<Option<(Arc<str>, Label)>> {
            let Some(h) = header.filter(|_| self.header.is_some()) else {
                return Some(None);
            };
            let name = std::str::from_utf8(h)
                .ok()
                .filter(|n| valid_tenant_name(n) && *n != OTHER)?;
            let label = if self.named.contains_key(name) {
                Label::Own
            } else {
                Label::Other
            };
            Some(Some((Arc::from(name), label)))
        };
        let (name, label) = match key {
            Some(k) if k.named => (Arc::clone(&k.tenant), Label::Own),
            Some(k) if k.gateway => from_header()?.unwrap_or((Arc::clone(&k.tenant), Label::Key)),
            Some(k) => (Arc::clone(&k.tenant), Label::Key),
            None => from_header()?.unwrap_or((Arc::from(ANONYMOUS), Label::Own)),
        };
        let class = (key.and_then(|k| k.class))
            .or(self.limits(&name).class)
            .unwrap_or_default();
        Some(Tenant { name, class, label })
    }
}

/// A limit of 0 is no limit.
fn unlimited_zero(mut l: TenantLimits) -> TenantLimits {
    l.max_concurrent = l.max_concurrent.filter(|n| *n > 0);
    l.requests_per_minute = l.requests_per_minute.filter(|n| *n > 0);
    l.prompt_tokens_per_minute = l.prompt_tokens_per_minute.filter(|n| *n > 0);
    l
}

/// How a tenant is shown (metrics, errors): by name, as `other` (a name
/// only a header gave), or as an unnamed key (its name holds the digest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    Own,
    Other,
    Key,
}

/// The metric label of unnamed keys.
pub const UNNAMED_KEY: &str = "unnamed-key";

/// Who a request belongs to.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    pub class: Class,
    label: Label,
}

impl Tenant {
    /// Its metric label.
    fn label(&self) -> &str {
        match self.label {
            Label::Own => &self.name,
            Label::Other => OTHER,
            Label::Key => UNNAMED_KEY,
        }
    }

    /// How a refusal names it.
    fn shown(&self) -> String {
        Self::shown_as(&self.name, self.label)
    }

    fn shown_as(name: &str, label: Label) -> String {
        match label {
            Label::Key => "this API key".to_owned(),
            _ => format!("tenant `{name}`"),
        }
    }
}

/// One tenant's counts.
struct State {
    in_progress: u32,
    requests: Bucket,
    tokens: Bucket,
    /// Its metric label, and the handles under it.
    label: String,
    counters: TenantCounters,
}

impl State {
    fn new(limits: &TenantLimits, label: &str, counters: TenantCounters, now: Instant) -> Self {
        Self {
            in_progress: 0,
            requests: Bucket::full(limits.requests_per_minute.unwrap_or(0), now),
            tokens: Bucket::full(limits.prompt_tokens_per_minute.unwrap_or(0), now),
            label: label.to_owned(),
            counters,
        }
    }

    /// Refills both buckets (a limit unset counts as 0: set again later,
    /// its bucket is given the whole of it).
    fn refill(&mut self, l: &TenantLimits, now: Instant) {
        self.requests
            .refill(l.requests_per_minute.unwrap_or(0), now);
        self.tokens
            .refill(l.prompt_tokens_per_minute.unwrap_or(0), now);
    }

    /// Moves its counts to `label` (a reload named or unnamed the tenant).
    fn relabel(&mut self, label: &str, metrics: &Metrics) {
        if self.label != label {
            let counters = metrics.tenants.of(label);
            self.counters.in_flight.dec_by(i64::from(self.in_progress));
            counters.in_flight.inc_by(i64::from(self.in_progress));
            (self.label, self.counters) = (label.to_owned(), counters);
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
    /// When idle tenants were last looked for (at `max_tracked`).
    swept: Mutex<Option<Instant>>,
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
            swept: Mutex::new(None),
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
        let mut label = tenant.label();
        if self.tracked() >= rules.max_tracked && !self.shard(&name).contains_key(&name) {
            self.let_go_idle(rules, now);
            if self.tracked() >= rules.max_tracked && tenant.label == Label::Other {
                (name, label) = (Arc::from(OTHER), OTHER);
            }
        }
        let limits = rules.limits(&name);
        let mut shard = self.shard(&name);
        let state = shard.entry(Arc::clone(&name)).or_insert_with(|| {
            self.tracked.fetch_add(1, Relaxed);
            State::new(limits, label, self.metrics.tenants.of(label), now)
        });
        state.relabel(label, &self.metrics);
        state.refill(limits, now);
        let refuse = |state: &State, what: String, wait: Duration, i: usize| {
            state.counters.refused[i].inc();
            RouterError::RateLimited {
                who: tenant.shown(),
                what,
                retry_after_ms: whole_ms(wait),
                headers: state.headers(limits),
            }
        };
        if let Some(max) = limits.max_concurrent.filter(|m| state.in_progress >= *m) {
            let what = format!("{max} requests in progress (max_concurrent)");
            return Err(refuse(state, what, Duration::from_secs(1), 0));
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
            label: tenant.label,
            class: tenant.class,
            charged: 0,
            refunded: false,
            headers: state.headers(limits),
        })
    }

    /// Lets go of every idle tenant (at `max_tracked`), at most once a
    /// second.
    fn let_go_idle(&self, rules: &Rules, now: Instant) {
        {
            let mut swept = self.swept.lock().unwrap_or_else(|p| p.into_inner());
            if swept.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1)) {
                return;
            }
            *swept = Some(now);
        }
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

/// A wait in whole milliseconds, rounded up (at least 1: the OpenAI SDKs
/// ignore a `retry-after-ms` of 0).
fn whole_ms(d: Duration) -> u64 {
    (d.as_micros().div_ceil(1000) as u64).max(1)
}

/// An admitted request's hold on its tenant's counts, released when it drops.
pub struct Admitted {
    tenants: Arc<Tenants>,
    rules: Arc<Rules>,
    name: Arc<str>,
    /// How its tenant is shown.
    label: Label,
    pub class: Class,
    /// Prompt tokens charged so far.
    charged: u64,
    refunded: bool,
    /// The limits as they stood when it was admitted or charged.
    headers: RateHeaders,
}

impl Admitted {
    pub fn tenant(&self) -> &str {
        &self.name
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// Its tenant's share when requests wait (`weight`, default 1).
    pub fn weight(&self) -> u32 {
        self.rules.limits(&self.name).weight.unwrap_or(1)
    }

    /// Counts a refusal by the queue (full, or its deadline passed).
    pub fn turned_away(&self) {
        if let Some(state) = self.tenants.shard(&self.name).get(&self.name) {
            state.counters.refused[3].inc();
        }
    }

    /// Observes the time it waited in the queue.
    pub fn waited(&self, d: std::time::Duration) {
        if let Some(state) = self.tenants.shard(&self.name).get(&self.name) {
            state.counters.queue_wait.observe(d.as_secs_f64());
        }
    }

    /// The `x-ratelimit-*` headers for its answer (empty without limits).
    pub fn headers(&self) -> &RateHeaders {
        &self.headers
    }

    /// Charges the request's estimated prompt tokens: refused (429) when
    /// fewer are left and the bucket is not full (a prompt larger than the
    /// whole limit passes alone; the refusal's `refund` gives its request
    /// back).
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
                state.counters.refused[2].inc();
                Err(RouterError::RateLimited {
                    who: Tenant::shown_as(&self.name, self.label),
                    what: format!("{tpm} prompt tokens per minute"),
                    retry_after_ms: whole_ms(wait),
                    headers: state.headers(limits),
                })
            }
        }
    }

    /// The router refused the request after its head (nothing reached an
    /// engine): its request and the tokens charged are given back.
    pub fn refund(&mut self) {
        if std::mem::replace(&mut self.refunded, true) {
            return;
        }
        let limits = self.rules.limits(&self.name);
        let mut shard = self.tenants.shard(&self.name);
        if let Some(state) = shard.get_mut(&self.name) {
            if let Some(rpm) = limits.requests_per_minute {
                state.requests.give(rpm, 1);
            }
            if let Some(tpm) = limits.prompt_tokens_per_minute {
                state.tokens.give(tpm, self.charged);
            }
        }
        self.charged = 0;
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
