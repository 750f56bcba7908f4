//! Replica addresses by name. A replica's `addr` may be `host:port` (a
//! Kubernetes Service, a compose service name), and each `replicas_dns` entry
//! stands for every address behind its name (a headless Service). Names are
//! looked up at load and again every `dns_refresh_ms`; an address that changes
//! is a replica change (the new one joins through the health gate, the old one
//! drains); a lookup that fails, finds nothing or takes longer than
//! [`LOOKUP_DEADLINE`] keeps the last good addresses, logged once until the
//! name resolves again. Lookups run on the blocking pool, every name at once,
//! before a reload applies ([`Resolver::refresh`]); building the replica list
//! ([`Resolver::expand`]) only reads what they found, so a DNS outage holds
//! no reload (and no API-key revocation) for longer than the deadline.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::{Config, Replica};

/// The last good addresses of every name looked up.
#[derive(Debug, Default)]
pub struct Resolver {
    /// Per `host:port`: its addresses, and whether its last lookup failed.
    last: Mutex<HashMap<String, (Vec<SocketAddr>, bool)>>,
    /// Names whose lookup still runs (past its deadline, on a blocking
    /// thread the system resolver holds): not looked up again meanwhile.
    running: Arc<Mutex<HashSet<String>>>,
}

impl Resolver {
    /// The replica list with every `addr` an `IP:port`: `replicas` as listed
    /// (a name by its first address; one that never resolved keeps the
    /// address `running` gives its replica, else is left out until it
    /// resolves), then one replica per address behind each `replicas_dns`
    /// name, named `<name>-<IP>-<port>` (the same in every router instance).
    /// An address listed twice keeps its first entry. Names resolve as the
    /// last [`Resolver::refresh`] found them.
    pub fn expand(
        &self,
        cfg: &Config,
        running: impl Fn(&str) -> Option<SocketAddr>,
    ) -> Vec<Replica> {
        let mut out = Vec::with_capacity(cfg.replicas.len());
        for r in &cfg.replicas {
            let addr = match r.addr.parse::<SocketAddr>() {
                Ok(a) => Some(a),
                Err(_) => self
                    .cached(&r.addr)
                    .first()
                    .copied()
                    .or_else(|| running(&r.name)),
            };
            if let Some(a) = addr {
                out.push(Replica {
                    addr: a.to_string(),
                    ..r.clone()
                });
            }
        }
        for d in &cfg.replicas_dns {
            for a in self.cached(&d.addr) {
                let id = a.to_string().replace([':', '[', ']'], "-");
                out.push(Replica {
                    name: format!("{}-{}", d.name, id.trim_matches('-').replace("--", "-")),
                    addr: a.to_string(),
                    ..d.clone()
                });
            }
        }
        let mut seen = HashSet::new();
        out.retain(|r| {
            let first = seen.insert(r.addr.clone());
            if !first {
                log::debug!(
                    "replica {} at {}: that address is listed already",
                    r.name,
                    r.addr
                );
            }
            first
        });
        out
    }

    /// Forgets the names `cfg` (the config now applied) no longer lists: an
    /// address kept for one must not come back with it later.
    pub fn forget_others(&self, cfg: &Config) {
        let names: HashSet<&str> = cfg
            .replicas
            .iter()
            .chain(&cfg.replicas_dns)
            .map(|r| r.addr.as_str())
            .collect();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.retain(|name, _| names.contains(name.as_str()));
    }

    /// Sets what a name last resolved to (tests: no DNS to change here).
    #[cfg(test)]
    pub(crate) fn remember(&self, name: &str, addrs: Vec<SocketAddr>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.insert(name.to_owned(), (addrs, false));
    }

    /// Names whose last lookup failed.
    pub fn failing(&self) -> Vec<String> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let mut names: Vec<String> = last
            .iter()
            .filter(|(_, (_, failing))| *failing)
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// Looks every name of `cfg` up again, all at once on the blocking pool
    /// (the system resolver), each within `deadline` ([`LOOKUP_DEADLINE`] on
    /// reloads). A name whose last lookup still runs is not looked up again.
    pub async fn refresh(&self, cfg: &Config, deadline: Duration) {
        self.refresh_with(cfg, deadline, |name| async move {
            tokio::net::lookup_host(name).await.map(Iterator::collect)
        })
        .await;
    }

    async fn refresh_with<F, L>(&self, cfg: &Config, deadline: Duration, lookup: L)
    where
        L: Fn(String) -> F,
        F: Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'static,
    {
        let names: BTreeSet<&str> = (cfg.replicas.iter())
            .chain(&cfg.replicas_dns)
            .map(|r| r.addr.as_str())
            .filter(|a| a.parse::<SocketAddr>().is_err())
            .collect();
        let mut lookups = tokio::task::JoinSet::new();
        for name in names {
            let name = name.to_owned();
            if !lock(&self.running).insert(name.clone()) {
                continue;
            }
            // The lookup runs to its end in its own task; the refresh waits
            // for it until the deadline only.
            let running = Arc::clone(&self.running);
            let found = lookup(name.clone());
            let key = name.clone();
            let lookup = tokio::spawn(async move {
                let found = found.await;
                lock(&running).remove(&key);
                found
            });
            lookups.spawn(async move { (name, tokio::time::timeout(deadline, lookup).await) });
        }
        while let Some(done) = lookups.join_next().await {
            let Ok((name, found)) = done else { continue };
            let found = match found {
                Ok(Ok(Ok(v))) => Ok(v),
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {deadline:?}")),
            };
            self.record(&name, found);
        }
    }

    /// The last good addresses of `name` (none if it never resolved).
    fn cached(&self, name: &str) -> Vec<SocketAddr> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.get(name)
            .map(|(good, _)| good.clone())
            .unwrap_or_default()
    }

    /// Records a lookup of `name`: its addresses (sorted, one family), or
    /// why it failed (the last good ones stay).
    fn record(&self, name: &str, found: Result<Vec<SocketAddr>, String>) {
        // One address family per name (IPv4 when it has any): a dual-stack
        // engine is one replica, not two.
        let found = found.map(|mut v| {
            let v4 = v.iter().any(SocketAddr::is_ipv4);
            v.retain(|a| a.is_ipv4() == v4);
            v.sort();
            v.dedup();
            v
        });
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let (good, failing) = last.entry(name.to_owned()).or_default();
        match found {
            Ok(v) if !v.is_empty() => {
                if *failing {
                    log::info!("replica address {name} resolves again: {v:?}");
                }
                *good = v;
                *failing = false;
            }
            other => {
                if !*failing {
                    let why = other.map_or_else(|e| e, |_| "no address".into());
                    log::warn!(
                        "replica address {name}: lookup failed ({why}); keeping its last addresses {good:?}"
                    );
                }
                *failing = true;
            }
        }
    }
}

/// The longest wait for one name's lookup on a reload.
pub const LOOKUP_DEADLINE: Duration = Duration::from_secs(2);

/// At start-up, where a name left out would start the router without it.
pub const STARTUP_LOOKUP_DEADLINE: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(yaml: &str) -> Config {
        serde_yaml::from_str(yaml).expect("yaml")
    }

    #[tokio::test]
    async fn names_resolve_and_dns_entries_stand_for_every_address_behind_them() {
        let c = cfg(
            "replicas:\n- {name: a, addr: \"127.0.0.1:1\"}\n- {name: b, addr: \"localhost:2\"}\n\
             replicas_dns:\n- {name: pool, addr: \"localhost:3\", kv_tokens: 7}\n",
        );
        let r = Resolver::default();
        assert_eq!(r.expand(&c, |_| None).len(), 1, "nothing looked up yet");
        r.refresh(&c, LOOKUP_DEADLINE).await;
        let list = r.expand(&c, |_| None);
        let b = list.iter().find(|r| r.name == "b").expect("b");
        assert!(b
            .addr
            .parse::<SocketAddr>()
            .is_ok_and(|a| a.port() == 2 && a.ip().is_loopback()));
        let pool: Vec<&Replica> = list
            .iter()
            .filter(|r| r.name.starts_with("pool-"))
            .collect();
        assert!(!pool.is_empty());
        assert_eq!(pool.len(), 1, "one family: {pool:?}");
        assert_eq!(pool[0].name, "pool-127.0.0.1-3");
        assert_eq!(pool[0].kv_tokens, Some(7));
    }

    #[tokio::test]
    async fn a_name_that_stops_resolving_or_answering_keeps_its_last_addresses() {
        let r = Resolver::default();
        let name = "engine.example:80";
        let c = cfg(&format!("replicas:\n- {{name: a, addr: \"{name}\"}}\n"));
        let good: Vec<SocketAddr> = vec!["10.0.0.9:80".parse().expect("addr")];
        let answer = good.clone();
        r.refresh_with(&c, LOOKUP_DEADLINE, move |_| {
            let v = answer.clone();
            async move { Ok(v) }
        })
        .await;
        assert_eq!(r.cached(name), good);
        r.refresh_with(&c, LOOKUP_DEADLINE, |_| async {
            Err(std::io::Error::other("SERVFAIL"))
        })
        .await;
        assert_eq!(
            (r.cached(name), r.failing()),
            (good.clone(), vec![name.to_owned()])
        );
        // A resolver that never answers holds the refresh for the deadline only.
        let started = std::time::Instant::now();
        r.refresh_with(&c, Duration::from_millis(50), |_| std::future::pending())
            .await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(r.cached(name), good);
        // Still blocked: not looked up again (no pile of blocked lookups).
        let asked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = Arc::clone(&asked);
        r.refresh_with(&c, Duration::from_millis(50), move |_| {
            seen.store(true, std::sync::atomic::Ordering::Relaxed);
            std::future::pending()
        })
        .await;
        assert!(!asked.load(std::sync::atomic::Ordering::Relaxed));
    }

    #[test]
    fn a_listed_name_never_resolved_keeps_its_running_address_and_dropped_names_are_forgotten() {
        let r = Resolver::default();
        let c = cfg("replicas:\n- {name: a, addr: \"no-such-host.invalid:80\"}\n");
        let kept = "10.0.0.3:80".parse().expect("addr");
        let list = r.expand(&c, |name| (name == "a").then_some(kept));
        assert_eq!(list[0].addr, "10.0.0.3:80");
        assert!(r.expand(&c, |_| None).is_empty());
        r.remember("no-such-host.invalid:80", vec![kept]);
        let other = cfg("replicas:\n- {name: b, addr: \"127.0.0.1:1\"}\n");
        r.forget_others(&other);
        assert!(r.expand(&c, |_| None).is_empty(), "forgotten with its name");
    }
}
