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
//!   least one replica may be), and at most one by one client's failures
//!   (the failure that ejects is attributed to its request's source: its
//!   API key, else its address), since a client's requests may be what fails;
//! - a response timeout of a generation answered whole (no `stream: true`)
//!   does not count: its head comes only when the generation ends;
//! - when no replica is live, the ejected ones that pass their health checks
//!   are routed to anyway; when none passes its checks either, every replica
//!   the checks had brought up is (panic mode, as Envoy's panic threshold):
//!   the router never refuses on its own say-so. Health itself: `health`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::config;
use crate::metrics::{Ejection, Metrics, ReplicaCounters};
use crate::policy::{ReplicaId, ReplicaState};

mod health;
mod replica;
mod view;

pub use health::{HealthRules, CHECK_DEADLINE};
pub use replica::{InFlight, Replica};
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
        };
        set.apply(cfg);
        set
    }

    /// The replicas now, in configuration order, with the models each serves.
    pub fn snapshot(&self) -> Arc<View> {
        self.current.load_full()
    }

    /// Publishes the set again after a replica's served models changed.
    pub fn models_changed(&self) {
        let _one = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
        let list = self.current.load().to_vec();
        self.current.store(Arc::new(View::new(list)));
    }

    /// The policy's view of the set, excluding replicas in `tried` and those
    /// that do not serve `model`. When none of those is live, the ejected ones
    /// that pass their health checks count as live; when none does and no
    /// replica of the set is live, every replica the checks brought up once
    /// (panic mode, reported by the `bool`).
    pub fn states(
        view: &View,
        tried: &[ReplicaId],
        model: Option<&str>,
    ) -> (Vec<ReplicaState>, bool) {
        let serves = model.map(|m| view.offers(m));
        let offered = |i: usize, r: &Replica| !tried.contains(&r.id) && serves.is_none_or(|s| s[i]);
        let mut states: Vec<ReplicaState> = (view.iter().enumerate())
            .map(|(i, r)| {
                let mut s = r.state();
                s.live &= offered(i, r);
                s
            })
            .collect();
        if states.iter().any(|s| s.live) {
            return (states, false);
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
                return (states, true);
            }
        }
        (states, false)
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

    /// Every live replica has at least `in_flight` requests at it (the
    /// router's, plus those its engine reported beyond them; and one is
    /// live: with none, the request is answered `no_replica`).
    pub fn saturated(&self, in_flight: u32) -> bool {
        let list = self.snapshot();
        let mut live = list.iter().filter(|r| r.live()).peekable();
        live.peek().is_some() && live.all(|r| r.state().load() >= in_flight)
    }

    /// Whether `replica` is in the set (not one that left or moved since it
    /// was looked up).
    pub fn is_current(&self, replica: &Replica) -> bool {
        self.snapshot()
            .iter()
            .any(|r| std::ptr::eq(r.as_ref(), replica))
    }

    pub fn by_addr(&self, addr: &SocketAddr) -> Option<Arc<Replica>> {
        self.snapshot().iter().find(|r| r.addr == *addr).cloned()
    }

    /// Replaces the set. Replicas whose name and address are unchanged keep their
    /// id, health and counters; others are added (unchecked) or removed.
    pub fn apply(&self, cfg: &[config::Replica]) -> Change {
        let _one = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
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
                    r.reconfigure(c);
                    Arc::clone(r)
                }
                None => {
                    let id = ReplicaId(self.next_id.fetch_add(1, Relaxed));
                    let counters = ReplicaCounters::new(&self.metrics, &c.name);
                    let r = Arc::new(Replica::new(id, c, addr, counters));
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
        self.current.store(Arc::new(View::new(next)));
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PromptCache;
    use crate::policy::EngineLoad;

    pub(super) fn cfg(list: &[(&str, &str)]) -> Vec<config::Replica> {
        list.iter()
            .map(|(n, a)| config::Replica {
                name: n.to_string(),
                addr: a.to_string(),
                kv_tokens: None,
                prompt_cache: PromptCache::Shared,
                models: None,
            })
            .collect()
    }

    #[test]
    fn saturation_counts_what_the_engines_report_beyond_the_routers_requests() {
        let now = Instant::now();
        let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], now);
        let _own = [list[0].begin(0), list[1].begin(0)];
        assert!(!set.saturated(3));
        let unseen = |unseen| {
            Some(EngineLoad {
                unseen,
                kv_used_permille: None,
            })
        };
        list[0].set_engine(unseen(2));
        assert!(!set.saturated(3), "b has one request");
        list[1].set_engine(unseen(5));
        assert!(set.saturated(3));
    }

    #[test]
    fn only_a_pass_after_the_engine_went_away_says_it_came_back() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
        let a = Arc::clone(&set.snapshot()[0]);
        // The first pass at start, and passes after it: nothing to forget.
        assert!(!a.came_back(true, false));
        assert!(!a.came_back(true, false));
        // A busy engine times out and passes again: its cache is intact.
        assert!(!a.came_back(false, true));
        assert!(!a.came_back(true, false));
        // Refused (or an error status), then a pass: it restarted, once.
        assert!(!a.came_back(false, false));
        assert!(!a.came_back(false, true));
        assert!(a.came_back(true, false));
        assert!(!a.came_back(true, false));
    }

    #[test]
    fn a_lost_pin_repairs_only_when_another_client_corroborates_it() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
        let a = Arc::clone(&set.snapshot()[0]);
        // One client, however often: no repair.
        assert_eq!(a.lost_pin(1, 5, 10, 10), None);
        assert_eq!(a.lost_pin(1, 6, 11, 10), None);
        // Another client: repair, bounded by the older prefix.
        assert_eq!(a.lost_pin(2, 8, 12, 10), Some(6));
        // Spaced per replica: a second pair within 10 s does not repair.
        assert_eq!(a.lost_pin(3, 9, 13, 10), None);
        assert_eq!(a.lost_pin(4, 9, 14, 10), None);
        assert_eq!(a.lost_pin(5, 9, 24, 10), Some(9));
        // A pin held in between, or a witness too old, corroborates nothing.
        assert_eq!(a.lost_pin(6, 30, 40, 10), None);
        a.pin_held();
        assert_eq!(a.lost_pin(7, 30, 41, 10), None);
        assert_eq!(a.lost_pin(8, 30, 41 + replica::WITNESS_S + 1, 10), None);
    }

    #[test]
    fn new_replicas_are_not_live_until_a_check_passes() {
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
        let a = Arc::clone(&set.snapshot()[0]);
        assert!(!a.live());
        assert!(a.on_check(true, false, Instant::now(), &CHECKS));
        assert!(a.live());
    }

    /// Every check result counts at once.
    const CHECKS: HealthRules = HealthRules {
        fall: 1,
        rise: 1,
        serving: Duration::ZERO,
    };

    const RULES: OutlierRules = OutlierRules {
        consecutive_failures: 3,
        base_ejection: Duration::from_secs(10),
        max_ejection: Duration::from_secs(25),
        max_ejection_percent: 50,
    };

    fn checked_set(names: &[(&str, &str)], now: Instant) -> (Replicas, Arc<View>) {
        let set = Replicas::new(&cfg(names), Metrics::standalone());
        let list = set.snapshot();
        for r in list.iter() {
            r.on_check(true, false, now, &CHECKS);
        }
        (set, list)
    }

    #[test]
    fn the_view_offers_each_model_to_the_replicas_serving_it_and_follows_learned_lists() {
        let mut c = cfg(&[
            ("a", "127.0.0.1:1"),
            ("b", "127.0.0.1:2"),
            ("c", "127.0.0.1:3"),
        ]);
        c[0].models = Some(vec!["m1".into()]);
        c[1].models = Some(vec!["m2".into(), "m1".into()]);
        let set = Replicas::new(&c, Metrics::standalone());
        let view = set.snapshot();
        assert_eq!(
            view.offers("m1"),
            [true, true, true],
            "c's models are unknown: any"
        );
        assert_eq!(view.offers("m2"), [false, true, true]);
        assert_eq!(view.offers("other"), [false, false, true]);
        assert!(set.lists("m2") && !set.lists("other") && !set.nobody_serves("other"));
        // c lists its models: the set is published again with them.
        assert!(view[2].learn_models(vec!["m3".into()]));
        set.models_changed();
        assert_eq!(set.snapshot().offers("m3"), [false, false, true]);
        assert!(set.nobody_serves("other"));
        let tried = [];
        let (states, _) = Replicas::states(&set.snapshot(), &tried, Some("m1"));
        assert_eq!(
            states.iter().map(|s| s.id).collect::<Vec<_>>(),
            [view[0].id, view[1].id, view[2].id]
        );
    }

    #[test]
    fn a_dead_replica_is_ejected_until_the_next_passing_check() {
        let now = Instant::now();
        let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], now);
        let a = &list[0];
        assert_eq!(
            set.on_failure(a, Failure::Dead, 0, &RULES, now),
            Some(Ejection::Dead)
        );
        assert_eq!(
            set.on_failure(a, Failure::Dead, 0, &RULES, now),
            None,
            "same outage"
        );
        assert!(!a.live());
        a.on_check(true, false, now, &CHECKS);
        assert!(a.live());
    }

    #[test]
    fn timeouts_eject_only_after_consecutive_failures_for_a_growing_time() {
        let t0 = Instant::now();
        let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], t0);
        let a = &list[0];
        let fail = |n: u32, at: Instant| {
            (0..n)
                .filter_map(|_| set.on_failure(a, Failure::ConnectTimeout, 0, &RULES, at))
                .collect::<Vec<_>>()
        };
        assert!(fail(2, t0).is_empty());
        assert!(a.live(), "two timeouts are overload, not death");
        a.on_success();
        assert!(fail(2, t0).is_empty(), "a success resets the streak");
        assert_eq!(fail(1, t0), [Ejection::Outlier]);
        assert!(!a.live());
        a.on_check(true, false, t0 + Duration::from_secs(9), &CHECKS);
        assert!(
            !a.live(),
            "a check inside the ejection time does not readmit"
        );
        a.on_check(true, false, t0 + Duration::from_secs(10), &CHECKS);
        assert!(a.live());
        // The second ejection in a row lasts twice as long, the third is capped.
        let t1 = t0 + Duration::from_secs(100);
        assert_eq!(fail(3, t1), [Ejection::Outlier]);
        a.on_check(true, false, t1 + Duration::from_secs(19), &CHECKS);
        assert!(!a.live());
        a.on_check(true, false, t1 + Duration::from_secs(20), &CHECKS);
        assert!(a.live());
        let t2 = t1 + Duration::from_secs(100);
        assert_eq!(fail(3, t2), [Ejection::Outlier]);
        a.on_check(true, false, t2 + Duration::from_secs(25), &CHECKS);
        assert!(a.live(), "capped at max_ejection");
    }

    #[test]
    fn ejection_stops_at_the_bound_and_panic_mode_routes_to_the_ejected() {
        let now = Instant::now();
        let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], now);
        assert!(set
            .on_failure(&list[0], Failure::Dead, 0, &RULES, now)
            .is_some());
        assert!(
            set.on_failure(&list[1], Failure::Dead, 0, &RULES, now)
                .is_none(),
            "50 % of two replicas is one"
        );
        assert!(list[1].live());
        let (states, panic) = Replicas::states(&list, &[list[1].id], None);
        assert!(panic, "only the ejected replica is left");
        assert!(states[0].live && !states[1].live);
        let (states, panic) = Replicas::states(&list, &[], None);
        assert!(!panic);
        assert!(!states[0].live && states[1].live);
        // Failing its checks too, while b is live: not routed to.
        list[0].on_check(false, false, now, &CHECKS);
        let (states, _) = Replicas::states(&list, &[list[1].id], None);
        assert!(states.iter().all(|s| !s.live));
        // With no replica of the set live: routed to, as the checks had it up once.
        list[1].on_check(false, false, now, &CHECKS);
        let (states, panic) = Replicas::states(&list, &[list[1].id], None);
        assert!(panic && states[0].live);
        // A replica the checks never brought up is not.
        set.apply(&cfg(&[
            ("a", "127.0.0.1:1"),
            ("b", "127.0.0.1:2"),
            ("c", "127.0.0.1:3"),
        ]));
        let list = set.snapshot();
        let (states, _) = Replicas::states(&list, &[list[0].id, list[1].id], None);
        assert!(states.iter().all(|s| !s.live));
    }

    #[test]
    fn reload_keeps_state_of_unchanged_replicas_and_reports_changes() {
        let set = Replicas::new(
            &cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]),
            Metrics::standalone(),
        );
        let a = Arc::clone(&set.snapshot()[0]);
        a.on_check(true, false, Instant::now(), &CHECKS);
        let _guard = a.begin(0);
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
        let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
        let a = Arc::clone(&set.snapshot()[0]);
        let g1 = a.begin(0);
        let g2 = a.begin(0);
        assert_eq!(a.in_flight(), 2);
        drop(g1);
        drop(g2);
        assert_eq!(a.in_flight(), 0);
        let tried = [a.id];
        a.on_check(true, false, Instant::now(), &CHECKS);
        assert!(!Replicas::states(&set.snapshot(), &tried, None).0[0].live);
    }
}
