//! The live replica set: names, addresses, health as the router sees it,
//! ejections from the request path, and in-flight counts. Swapped whole on reload;
//! a replica kept across a reload (same name and address) keeps its state.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use crate::config;
use crate::policy::{ReplicaId, ReplicaState};

/// One replica.
#[derive(Debug)]
pub struct Replica {
    pub id: ReplicaId,
    pub name: String,
    pub addr: SocketAddr,
    /// KV capacity in tokens; 0 when not declared. Reloadable.
    kv_tokens: AtomicU64,
    in_flight: AtomicU32,
    /// The last active health check passed (false until the first one does).
    checked: AtomicBool,
    /// A connection failed since the last passing check.
    ejected: AtomicBool,
}

impl Replica {
    /// Live: its last health check passed and no connection failed since.
    pub fn live(&self) -> bool {
        self.checked.load(Relaxed) && !self.ejected.load(Relaxed)
    }

    /// Declared KV capacity in tokens.
    pub fn kv_tokens(&self) -> Option<u64> {
        Some(self.kv_tokens.load(Relaxed)).filter(|t| *t > 0)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Demotes the replica until its next passing health check. Returns
    /// whether it was live before (so one outage counts one ejection).
    pub fn eject(&self) -> bool {
        let was_live = self.live();
        self.ejected.store(true, Relaxed);
        was_live
    }

    /// Records an active health check result; a pass also ends an ejection.
    /// Returns whether liveness changed.
    pub fn on_check(&self, passed: bool) -> bool {
        let before = self.live();
        self.checked.store(passed, Relaxed);
        if passed {
            self.ejected.store(false, Relaxed);
        }
        before != self.live()
    }

    /// Counts a request in flight until the guard drops.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Relaxed);
        InFlight(Arc::clone(self))
    }

    fn state(&self) -> ReplicaState {
        ReplicaState {
            id: self.id,
            live: self.live(),
            in_flight: self.in_flight(),
        }
    }
}

/// A request in flight on a replica; decrements the count when dropped.
#[derive(Debug)]
pub struct InFlight(Arc<Replica>);

impl InFlight {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

/// What a reload changed.
#[derive(Debug, Default)]
pub struct Change {
    pub added: Vec<Arc<Replica>>,
    pub removed: Vec<Arc<Replica>>,
}

/// The current replica set.
#[derive(Debug, Default)]
pub struct Replicas {
    current: RwLock<Arc<Vec<Arc<Replica>>>>,
    next_id: AtomicU32,
}

impl Replicas {
    /// A set from configuration; every replica starts not live (unchecked).
    pub fn new(cfg: &[config::Replica]) -> Self {
        let set = Self::default();
        set.apply(cfg);
        set
    }

    /// The replicas now, in configuration order.
    pub fn snapshot(&self) -> Arc<Vec<Arc<Replica>>> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The policy's view of the set, excluding replicas in `tried`.
    pub fn states(list: &[Arc<Replica>], tried: &[ReplicaId]) -> Vec<ReplicaState> {
        list.iter()
            .map(|r| {
                let mut s = r.state();
                s.live &= !tried.contains(&r.id);
                s
            })
            .collect()
    }

    pub fn by_addr(&self, addr: &SocketAddr) -> Option<Arc<Replica>> {
        self.snapshot().iter().find(|r| r.addr == *addr).cloned()
    }

    /// Replaces the set. Replicas whose name and address are unchanged keep their
    /// id, health and counters; others are added (unchecked) or removed.
    pub fn apply(&self, cfg: &[config::Replica]) -> Change {
        let old = self.snapshot();
        let mut change = Change::default();
        let mut next = Vec::with_capacity(cfg.len());
        for c in cfg {
            let Ok(addr) = c.addr.parse::<SocketAddr>() else {
                continue; // validate() rejects this before we get here
            };
            let kept = old.iter().find(|r| r.name == c.name && r.addr == addr);
            let replica = match kept {
                Some(r) => {
                    r.kv_tokens.store(c.kv_tokens.unwrap_or(0), Relaxed);
                    Arc::clone(r)
                }
                None => {
                    let r = Arc::new(Replica {
                        id: ReplicaId(self.next_id.fetch_add(1, Relaxed)),
                        name: c.name.clone(),
                        addr,
                        kv_tokens: AtomicU64::new(c.kv_tokens.unwrap_or(0)),
                        in_flight: AtomicU32::new(0),
                        checked: AtomicBool::new(false),
                        ejected: AtomicBool::new(false),
                    });
                    change.added.push(Arc::clone(&r));
                    r
                }
            };
            next.push(replica);
        }
        change.removed = old
            .iter()
            .filter(|r| !next.iter().any(|n| n.id == r.id))
            .cloned()
            .collect();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(list: &[(&str, &str)]) -> Vec<config::Replica> {
        list.iter()
            .map(|(n, a)| config::Replica {
                name: n.to_string(),
                addr: a.to_string(),
                kv_tokens: None,
            })
            .collect()
    }

    #[test]
    fn new_replicas_are_not_live_until_a_check_passes() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]));
        let a = Arc::clone(&set.snapshot()[0]);
        assert!(!a.live());
        assert!(a.on_check(true));
        assert!(a.live());
    }

    #[test]
    fn ejection_lasts_until_the_next_passing_check() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]));
        let a = Arc::clone(&set.snapshot()[0]);
        a.on_check(true);
        assert!(a.eject());
        assert!(!a.eject(), "second ejection of the same outage");
        assert!(!a.live());
        a.on_check(true);
        assert!(a.live());
    }

    #[test]
    fn reload_keeps_state_of_unchanged_replicas_and_reports_changes() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]));
        let a = Arc::clone(&set.snapshot()[0]);
        a.on_check(true);
        let _guard = a.begin();
        let change = set.apply(&cfg(&[("a", "127.0.0.1:1"), ("c", "127.0.0.1:3")]));
        assert_eq!(
            change
                .added
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>(),
            ["c"]
        );
        assert_eq!(
            change
                .removed
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>(),
            ["b"]
        );
        let now = set.snapshot();
        assert!(now[0].live());
        assert_eq!(now[0].id, a.id);
        assert_eq!(now[0].in_flight(), 1);
        assert_ne!(now[1].id, change.removed[0].id);
    }

    #[test]
    fn in_flight_counts_until_the_guard_drops() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]));
        let a = Arc::clone(&set.snapshot()[0]);
        let g1 = a.begin();
        let g2 = a.begin();
        assert_eq!(a.in_flight(), 2);
        drop(g1);
        drop(g2);
        assert_eq!(a.in_flight(), 0);
        let tried = [a.id];
        a.on_check(true);
        assert!(!Replicas::states(&set.snapshot(), &tried)[0].live);
    }
}
