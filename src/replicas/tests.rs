//! The replica set's rules: health, ejection, panic mode, reload.

use super::*;
use crate::policy::EngineLoad;

mod sample;

pub(super) fn cfg(list: &[(&str, &str)]) -> Vec<config::Replica> {
    list.iter()
        .map(|(n, a)| config::Replica::at(*n, *a))
        .collect()
}

#[test]
fn saturation_counts_what_the_engines_report_beyond_the_routers_requests() {
    let now = Instant::now();
    let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], now);
    let _own = [list[0].begin(0, 0), list[1].begin(0, 0)];
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
fn model_lists_and_new_connections_come_when_unknown_after_a_failure_and_every_tenth_pass() {
    let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
    let a = Arc::clone(&set.snapshot()[0]);
    let now = Instant::now();
    // Not live yet: checked on a new connection.
    assert!(a.fresh_check_due());
    // Unknown: every pass asks.
    for _ in 0..3 {
        assert!(a.models_due());
        a.on_check(true, false, now, &CHECKS);
    }
    a.learn_models(vec!["m".into()]);
    let due: Vec<bool> = (0..2 * RECHECK_EVERY)
        .map(|_| {
            let due = a.models_due();
            // Live now: a new connection on the same passes as the models.
            assert_eq!(a.fresh_check_due(), due);
            a.on_check(true, false, now, &CHECKS);
            due
        })
        .collect();
    // Passes 3..23 in a row: due at the 10th and the 20th.
    let at: Vec<usize> = (due.iter().enumerate())
        .filter(|(_, d)| **d)
        .map(|(i, _)| i + 3)
        .collect();
    assert_eq!(at, [10, 20]);
    // A failed check: the next pass asks again (the engine may have
    // restarted with another model).
    a.on_check(false, false, now, &CHECKS);
    assert!(a.models_due());
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
    interval: Duration::from_secs(1),
    per_second: 0,
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
    let _guard = a.begin(0, 0);
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
    let g1 = a.begin(0, 0);
    let g2 = a.begin(0, 0);
    assert_eq!(a.in_flight(), 2);
    drop(g1);
    drop(g2);
    assert_eq!(a.in_flight(), 0);
    let tried = [a.id];
    a.on_check(true, false, Instant::now(), &CHECKS);
    assert!(!Replicas::states(&set.snapshot(), &tried, None).0[0].live);
}

#[test]
fn only_a_name_the_file_gives_is_a_rename() {
    let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
    let was = set.snapshot()[0].id;
    // A pool's name at a recycled address: another engine.
    let change = set.apply_renaming(&cfg(&[("pool-127.0.0.1-1", "127.0.0.1:1")]), |_| false);
    assert_eq!((change.added.len(), change.removed.len()), (1, 1));
    assert_ne!(set.snapshot()[0].id, was);
    let now = set.snapshot()[0].id;
    let change = set.apply_renaming(&cfg(&[("b", "127.0.0.1:1")]), |n| n == "b");
    assert_eq!(change.renamed.len(), 1);
    assert!(change.added.is_empty() && change.removed.is_empty());
    assert_eq!(set.snapshot()[0].id, now, "the same id: its pins stay");
}

#[test]
fn a_chosen_replica_is_found_in_the_set_as_it_is_now() {
    let set = Replicas::new(
        &cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]),
        Metrics::standalone(),
    );
    let seen = set.snapshot();
    let (a, b) = (&seen[0], &seen[1]);
    // Unchanged: itself.
    assert!(Arc::ptr_eq(&set.current_of(&seen, a).expect("held"), a));
    // Renamed since (same address, same id): found anew; removed: gone.
    set.apply_renaming(&cfg(&[("a2", "127.0.0.1:1")]), |n| n == "a2");
    let now = set.current_of(&seen, a).expect("renamed, still held");
    assert_eq!((now.id, now.name.as_str()), (a.id, "a2"));
    assert!(set.current_of(&seen, b).is_none());
}

#[test]
fn a_drained_replica_is_offered_nothing_not_even_in_panic_mode() {
    let now = Instant::now();
    let (set, list) = checked_set(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")], now);
    assert!(set.set_drained("a", true).unwrap().1);
    assert!(
        !set.set_drained("a", true).unwrap().1,
        "draining twice changed it"
    );
    assert!(set.set_drained("zz", true).is_none());
    let (states, panic) = Replicas::states(&list, &[], None);
    assert_eq!(
        states.iter().map(|s| s.live).collect::<Vec<_>>(),
        [false, true]
    );
    assert!(!panic);
    // The other down: panic mode offers every replica once up, not this one.
    list[1].on_check(false, false, now, &CHECKS);
    assert!(!list[1].live());
    let (states, _) = Replicas::states(&list, &[], None);
    assert!(
        !states[0].live,
        "a drained replica was offered in panic mode"
    );
    // The replica holding a request's stored response is offered anyway.
    let mut states = Vec::new();
    Replicas::states_into(&list, &[], None, Some(list[0].id), &mut states);
    assert!(states[0].live, "a drained response holder was not offered");
    assert!(set.set_drained("a", false).unwrap().1);
    assert!(Replicas::states(&list, &[], None).0[0].live);
}

#[test]
fn a_drain_goes_by_name_across_reloads_and_address_changes() {
    let set = Replicas::new(
        &cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]),
        Metrics::standalone(),
    );
    set.set_drained("a", true);
    set.apply(&cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]));
    assert!(set.snapshot()[0].drained(), "a reload undid the drain");
    // A new address is a new replica under the same name: still drained.
    set.apply(&cfg(&[("a", "127.0.0.1:9"), ("b", "127.0.0.1:2")]));
    assert!(
        set.snapshot()[0].drained(),
        "an address change undid the drain"
    );
    assert!(!set.snapshot()[1].drained());
    // A name that leaves the file leaves its drain behind.
    set.apply(&cfg(&[("b", "127.0.0.1:2")]));
    set.apply(&cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]));
    assert!(!set.snapshot()[0].drained());
}
