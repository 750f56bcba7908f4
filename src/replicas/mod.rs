//! The live replica set: names, addresses, health as the router sees it,
//! ejections from the request path, and in-flight counts. Swapped whole on reload;
//! a replica kept across a reload (same name and address) keeps its state.
//!
//! Ejection, in the style of Envoy's outlier detection:
//! - a refused or reset connection ejects at once (the engine is gone); the
//!   next passing health check readmits it;
//! - connect timeouts, response timeouts and 502/503/504 answers are counted; after
//!   `consecutive_failures` in a row the replica is ejected for
//!   `base_ejection` × 2^(earlier ejections in a row), at most `max_ejection`,
//!   and readmitted by the first passing health check after that; a success
//!   resets both counts;
//! - at most `max_ejection_percent` of the set is ejected at once (always at
//!   least one replica may be), and at most one by one client's failed
//!   responses (the failure that ejects is attributed to its request's
//!   source: its API key, else its address), since a client's requests may
//!   be what fails (connect failures are nobody's: nothing was sent);
//! - a response timeout of a generation answered whole (no `stream: true`)
//!   does not count: its head comes only when the generation ends;
//! - when no replica is live, the ejected ones that pass their health checks
//!   are routed to anyway; when none passes its checks either, every replica
//!   the checks had brought up is (panic mode, as Envoy's panic threshold):
//!   the router never refuses on its own say-so. Health itself: `health`.

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::config;
use crate::metrics::{Ejection, Metrics, ReplicaCounters};
use crate::policy::{ReplicaId, ReplicaState};

mod health;
pub mod probes;
mod replica;
mod view;

pub use health::{HealthRules, CHECK_DEADLINE};
pub use replica::{InFlight, Replica, RECHECK_EVERY};
pub use view::View;

/// How a request to a replica failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Connection refused or reset, no route: the engine is not there.
    Dead,
    /// The connect timed out: an overloaded accept queue as often as a dead host.
    ConnectTimeout,
    /// A response timeout, a broken response, or a 502/503/504 answer.
    Response,
}

/// Outlier detection parameters (config `outlier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierRules {
    pub consecutive_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    pub max_ejection_percent: u32,
}

impl From<&config::Outlier> for OutlierRules {
    fn from(o: &config::Outlier) -> Self {
        Self {
            consecutive_failures: o.consecutive_failures,
            base_ejection: config::ms(o.base_ejection_ms),
            max_ejection: config::ms(o.max_ejection_ms),
            max_ejection_percent: o.max_ejection_percent,
        }
    }
}

/// What a reload changed.
#[derive(Debug, Default)]
pub struct Change {
    pub added: Vec<Arc<Replica>>,
    pub removed: Vec<Arc<Replica>>,
    /// Renamed at the same address: the old name, and the replica now.
    pub renamed: Vec<(String, Arc<Replica>)>,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.renamed.is_empty()
    }
}

/// The current replica set, published whole ([`View`]): readers take it
/// without a lock; a change builds a new one and swaps it in.
#[derive(Debug)]
pub struct Replicas {
    current: ArcSwap<View>,
    /// Serialises publishing, so a models refresh never undoes a reload.
    publishing: Mutex<()>,
    next_id: AtomicU32,
    /// Serialises ejections so two at once cannot both pass the bound.
    ejecting: Mutex<()>,
    /// Where a joining replica's series are created.
    metrics: Arc<Metrics>,
    /// No replica was live at the last [`Replicas::panic_changed`].
    panic: AtomicBool,
    /// Names drained through the admin API: a replica that joins under one
    /// (its address changed) is drained too. Changed while publishing.
    drained: Mutex<HashSet<String>>,
}

impl Replicas {
    /// A set from configuration; every replica starts not live (unchecked).
    pub fn new(cfg: &[config::Replica], metrics: Arc<Metrics>) -> Self {
        let set = Self {
            current: ArcSwap::default(),
            publishing: Mutex::new(()),
            next_id: AtomicU32::new(0),
            ejecting: Mutex::new(()),
            metrics,
            panic: AtomicBool::new(false),
            drained: Mutex::new(HashSet::new()),
        };
        set.apply(cfg);
        set
    }

    /// The replicas now, in configuration order, with the models each serves.
    pub fn snapshot(&self) -> Arc<View> {
        self.current.load_full()
    }

    /// Drains the replica named `name` (`true`) or puts it back in service;
    /// `None` when no replica has that name, else it and whether that
    /// changed. The name stays drained across reloads while the file keeps
    /// it, whatever its address.
    pub fn set_drained(&self, name: &str, drained: bool) -> Option<(Arc<Replica>, bool)> {
        let _one = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
        let replica = self.snapshot().iter().find(|r| r.name == name).cloned()?;
        let changed = replica.drained.swap(drained, Relaxed) != drained;
        let mut names = self.drained.lock().unwrap_or_else(|p| p.into_inner());
        if drained {
            names.insert(name.to_owned());
        } else {
            names.remove(name);
        }
        Some((replica, changed))
    }

    /// Publishes the set again after a replica's served models changed.
    pub fn models_changed(&self) {
        let _one = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
        let list = self.current.load().to_vec();
        self.current.store(Arc::new(View::new(list)));
    }

    /// As [`Replicas::states_into`] (no `holder`), for a sample of the set:
    /// one window of the replicas that may get a request for `model` (cut
    /// in order into windows of at most `size`, their sizes within one of
    /// each other; each model's next window at each call), and the replicas
    /// in `holders` (those holding the request's prefix that its placement
    /// may use) wherever they are, those for their prefix only (not
    /// `spread`) unless least loaded in the window. The window is read
    /// round from its cursor up to its first idle replica but holders
    /// ([`ReplicaState::idle`]: a cold placement could only choose another
    /// like it, once a live replica read declares no KV capacity, so room
    /// is not weighed), else whole; its next read starts past where this one
    /// stopped, so idle replicas take turns. Of what is read only the
    /// least loaded are offered (all of them when each declares its KV
    /// capacity: `kv_room` chooses by room then): the windows take turns,
    /// so a burst of up to the set's size finds an idle replica in each
    /// window it reaches, and no replica gets two of its cold placements
    /// while another is idle there. `false` when no replica read but
    /// holders is offered and live: the caller reads the whole set then
    /// (and its fallbacks).
    pub fn sample_into(
        view: &View,
        tried: &[ReplicaId],
        model: Option<&str>,
        holders: &[ReplicaId],
        size: usize,
        states: &mut Vec<ReplicaState>,
    ) -> bool {
        let members = view.members(model);
        let n = members.at.len();
        states.clear();
        if n == 0 || size == 0 {
            return false;
        }
        let windows = n.div_ceil(size);
        let w = members.next_window() % windows;
        let window = &members.at[w * n / windows..(w + 1) * n / windows];
        let start = members.start(w);
        let serves = model.map(|m| view.offers(m));
        let offered = |i: usize| {
            let r = &view[i];
            let mut s = r.state();
            s.live &= !r.drained() && !tried.contains(&r.id) && serves.is_none_or(|o| o[i]);
            s
        };
        // Room is weighed only when every live replica read declares it.
        let mut undeclared = false;
        for at in start..start + window.len() {
            let s = offered(window[at % window.len()]);
            states.push(s);
            undeclared |= s.live && s.room.is_none();
            if undeclared && s.idle() && !holders.contains(&s.id) {
                members.stopped(w, at);
                break;
            }
        }
        let cold = || states.iter().filter(|s| s.live && !holders.contains(&s.id));
        let Some(least) = cold().map(ReplicaState::load).min() else {
            return false;
        };
        // With every capacity declared, `kv_room` chooses by room among
        // them all, as in a small fleet (an idle replica may be full of
        // pinned contexts).
        if undeclared {
            for s in states.iter_mut() {
                let spread = s.load() <= least;
                match holders.contains(&s.id) {
                    true => s.spread = spread,
                    false => s.live &= spread,
                }
            }
        }
        let read = states.len();
        for id in holders {
            if states[..read].iter().any(|s| s.id == *id) {
                continue;
            }
            if let Some(i) = view.position(*id) {
                let s = offered(i);
                states.push(ReplicaState { spread: false, ..s });
            }
        }
        true
    }

    /// [`Replicas::states_into`] a new vector (tests).
    #[cfg(test)]
    pub fn states(
        view: &View,
        tried: &[ReplicaId],
        model: Option<&str>,
    ) -> (Vec<ReplicaState>, bool) {
        let mut states = Vec::new();
        let panic = Self::states_into(view, tried, model, None, &mut states);
        (states, panic)
    }

    /// The policy's view of the set, in its order, into `states` (cleared
    /// first: a caller keeps one buffer; at a thousand replicas a new one
    /// per request cost more than the placement), excluding replicas in
    /// `tried`, those that do not serve `model` and drained ones (not even
    /// in panic mode), but for `holder`, the replica holding a request's
    /// stored response (its engine still answers while drained). When none
    /// of those is
    /// live, the ejected ones that pass their health checks count as live;
    /// when none does and no replica of the set is live, every replica the
    /// checks brought up once (panic mode: true is returned).
    pub fn states_into(
        view: &View,
        tried: &[ReplicaId],
        model: Option<&str>,
        holder: Option<ReplicaId>,
        states: &mut Vec<ReplicaState>,
    ) -> bool {
        let serves = model.map(|m| view.offers(m));
        let offered = |i: usize, r: &Replica| {
            (!r.drained() || holder == Some(r.id))
                && !tried.contains(&r.id)
                && serves.is_none_or(|s| s[i])
        };
        states.clear();
        states.extend(view.iter().enumerate().map(|(i, r)| {
            let mut s = r.state();
            s.live &= offered(i, r);
            s
        }));
        if states.iter().any(|s| s.live) {
            return false;
        }
        // Past failing checks only when no replica of the whole set is live:
        // not for a retry or a model whose replicas are down while others serve.
        let fleet_down = !view.iter().any(|r| r.live());
        let fallbacks: &[fn(&Replica) -> bool] = if fleet_down {
            &[Replica::checked, Replica::was_up]
        } else {
            &[Replica::checked]
        };
        for fallback in fallbacks {
            let mut panic = false;
            for (i, (s, r)) in states.iter_mut().zip(view.iter()).enumerate() {
                s.live = fallback(r) && offered(i, r);
                panic |= s.live;
            }
            if panic {
                return true;
            }
        }
        false
    }

    /// After a replica's liveness changed: whether no replica of the set is
    /// live now (an empty set is not panic mode), shown in the metrics and
    /// logged when that changed.
    pub fn note_panic(&self) {
        let view = self.current.load();
        let now = !view.is_empty() && !view.iter().any(|r| r.live());
        if self.panic.swap(now, Relaxed) == now {
            return;
        }
        self.metrics.panic_mode.set(i64::from(now));
        if now {
            log::warn!(
                "no replica is live: requests go to the {} replicas anyway (panic mode), those passing health checks first",
                view.len()
            );
        } else {
            log::info!("a replica is live again: panic mode is over");
        }
    }

    /// Some replica's model list names `model`.
    pub fn lists(&self, model: &str) -> bool {
        self.current.load().lists(model)
    }

    /// No replica in the set serves `model` (each lists its models, and none
    /// names it): a request for it is answered 404 at once.
    pub fn nobody_serves(&self, model: &str) -> bool {
        self.current.load().nobody_serves(model)
    }

    /// Records a failed request to `replica` at `now`, sent by `source` (a
    /// client, hashed; 0: not a client's doing); returns the ejection it
    /// caused, if any (see the module header for the rules).
    pub fn on_failure(
        &self,
        replica: &Replica,
        failure: Failure,
        source: u64,
        rules: &OutlierRules,
        now: Instant,
    ) -> Option<Ejection> {
        let (kind, until) = match failure {
            Failure::Dead => (Ejection::Dead, None),
            Failure::ConnectTimeout | Failure::Response => {
                let n = replica.consecutive.fetch_add(1, Relaxed) + 1;
                if n < rules.consecutive_failures.max(1) {
                    return None;
                }
                (Ejection::Outlier, Some(()))
            }
        };
        let _one_at_a_time = self.ejecting.lock().unwrap_or_else(|p| p.into_inner());
        if replica.is_ejected() {
            return None;
        }
        let list = self.snapshot();
        let ejected = list.iter().filter(|r| r.is_ejected()).count();
        let allowed = (list.len() * rules.max_ejection_percent as usize / 100).max(1);
        // One client's failures keep at most one replica ejected: its
        // requests may be what fails.
        let holds_one = |r: &Arc<Replica>| r.is_ejected() && r.ejected_by.load(Relaxed) == source;
        if ejected >= allowed || (source != 0 && list.iter().any(holds_one)) {
            return None;
        }
        let mut e = replica.ejection.lock().unwrap_or_else(|p| p.into_inner());
        e.1 = until.map(|()| {
            let factor = 1u32 << e.0.min(16);
            e.0 += 1;
            now + rules
                .base_ejection
                .saturating_mul(factor)
                .min(rules.max_ejection)
        });
        replica.consecutive.store(0, Relaxed);
        replica.ejected_by.store(source, Relaxed);
        replica.ejected.store(true, Relaxed);
        Some(kind)
    }

    /// In-flight places under `in_flight` over the live, undrained
    /// replicas: free ones and all; `None` when none is live.
    pub fn places(&self, in_flight: u32) -> Option<(usize, usize)> {
        let list = self.snapshot();
        let live = list.iter().filter(|r| r.live() && !r.drained());
        live.fold(None, |places, r| {
            let (free, total) = places.unwrap_or((0, 0));
            let idle = in_flight.saturating_sub(r.state().load()) as usize;
            Some((free + idle, total + in_flight as usize))
        })
    }

    /// Every live replica in service (not drained) has at least
    /// `in_flight` requests at it (the router's, plus those its engine
    /// reported beyond them; and one is: with none, the request is answered
    /// `no_replica`).
    pub fn saturated(&self, in_flight: u32) -> bool {
        let list = self.snapshot();
        let mut live = list.iter().filter(|r| r.live() && !r.drained()).peekable();
        live.peek().is_some() && live.all(|r| r.state().load() >= in_flight)
    }

    /// Whether `replica` is in the set (not one that left or moved since it
    /// was looked up).
    pub fn is_current(&self, replica: &Replica) -> bool {
        let now = self.current.load();
        (now.position(replica.id)).is_some_and(|i| std::ptr::eq(now[i].as_ref(), replica))
    }

    /// `replica`, looked up in `seen`, as the set holds it now (a rename
    /// since gives it anew, its id kept); `None` when it left. At once when
    /// the set has not changed since.
    pub fn current_of(&self, seen: &Arc<View>, replica: &Arc<Replica>) -> Option<Arc<Replica>> {
        let now = self.current.load();
        if Arc::ptr_eq(&now, seen) {
            return Some(Arc::clone(replica));
        }
        now.position(replica.id).map(|i| Arc::clone(&now[i]))
    }

    /// A probe round over `list` (a snapshot of this set): `probe` on each
    /// replica `due` picks, started in paced groups over `window`
    /// ([`probes::run_paced`]), each given the replica as the set holds it
    /// when its probe starts (up to a second into the round: renamed, or
    /// skipped when it left).
    pub async fn probe_round<F: Future<Output = ()> + Send + 'static>(
        &self,
        list: &Arc<View>,
        due: impl Fn(&Replica) -> bool,
        window: Duration,
        probe: impl Fn(Arc<Replica>) -> F,
    ) {
        let picked: Vec<Arc<Replica>> = list.iter().filter(|r| due(r)).cloned().collect();
        probes::run_paced(picked, window, |r| {
            let started = self.current_of(list, &r).map(&probe);
            async move {
                if let Some(probe) = started {
                    probe.await;
                }
            }
        })
        .await;
    }

    /// Replaces the set. Replicas whose name and address are unchanged keep their
    /// id, health and counters; others are added (unchecked) or removed.
    pub fn apply(&self, cfg: &[config::Replica]) -> Change {
        self.apply_renaming(cfg, |_| false)
    }

    /// As [`Replicas::apply`], and a replica whose new name is `renamable`
    /// (named in the config, not found in DNS: a pool's names carry the
    /// address, and another pool at a recycled address is another engine),
    /// its address unchanged and its old name gone from the list, keeps its
    /// id and health (see `Replica::renamed`).
    pub fn apply_renaming(
        &self,
        cfg: &[config::Replica],
        renamable: impl Fn(&str) -> bool,
    ) -> Change {
        let _one = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.snapshot();
        let mut change = Change::default();
        let mut next = Vec::with_capacity(cfg.len());
        for c in cfg {
            let Ok(addr) = c.addr.parse::<SocketAddr>() else {
                continue; // validate() rejects this before we get here
            };
            let kept = old.iter().find(|r| r.name == c.name && r.addr == addr);
            let renamed = || {
                let gone = |r: &&Arc<Replica>| !cfg.iter().any(|c| c.name == r.name);
                old.iter()
                    .filter(gone)
                    .find(|r| r.addr == addr && !next.iter().any(|n: &Arc<Replica>| n.id == r.id))
            };
            let rename = (kept.is_none() && renamable(&c.name)).then(renamed);
            let replica = match (kept, rename.flatten()) {
                (Some(r), _) => {
                    r.reconfigure(c);
                    Arc::clone(r)
                }
                (None, Some(was)) => {
                    let counters = ReplicaCounters::new(&self.metrics, &c.name);
                    let r = Arc::new(was.renamed(c, counters));
                    change.renamed.push((was.name.clone(), Arc::clone(&r)));
                    r
                }
                (None, None) => {
                    let id = ReplicaId(self.next_id.fetch_add(1, Relaxed));
                    let counters = ReplicaCounters::new(&self.metrics, &c.name);
                    let r = Arc::new(Replica::new(id, c, addr, counters));
                    change.added.push(Arc::clone(&r));
                    r
                }
            };
            next.push(replica);
        }
        // Drains go by name: a replica joining under a drained name is
        // drained; a renamed one keeps its own; names that left are dropped.
        let mut drained = self.drained.lock().unwrap_or_else(|p| p.into_inner());
        for r in &next {
            if drained.contains(&r.name) {
                r.drained.store(true, Relaxed);
            }
        }
        *drained = next
            .iter()
            .filter(|r| r.drained())
            .map(|r| r.name.clone())
            .collect();
        drop(drained);
        change.removed = old
            .iter()
            .filter(|r| !next.iter().any(|n| n.id == r.id))
            .cloned()
            .collect();
        self.current.store(Arc::new(View::new(next)));
        change
    }
}

#[cfg(test)]
mod tests;
