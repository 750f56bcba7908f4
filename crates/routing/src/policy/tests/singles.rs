//! Singles placed by a shared prefix.

use super::*;

/// Singles by their prefix, with a bound of `bound` and a minimum of one block.
fn by_prefix(bound: u32) -> Policy {
    Policy::new(PolicyConfig {
        singles: Some(SinglesByPrefix {
            min_bytes: B,
            min_percent: 75,
            bound,
            spread_while_all_fit: false,
        }),
        ..cfg(Mode::Shape)
    })
}

/// Live replicas that declare a KV capacity with room for anything.
fn roomy(n: usize) -> Vec<ReplicaState> {
    let mut rs = replicas(&vec![true; n]);
    for s in &mut rs {
        s.room = Some(Room {
            free: 1 << 30,
            cold: 0,
            pinned: 0,
            capacity: 1 << 30,
        });
    }
    rs
}

/// A one-shot question behind a shared application prompt of a few blocks.
fn question(app: &str, n: usize) -> Request {
    let prompt = format!("{app}: the long shared system prompt. ").repeat(3);
    req(&format!("{prompt}q{n}"), false)
}

/// Places the app's first question (the counter: no prefix is held yet);
/// returns the replica that holds its prompt now, and its index in `rs`.
fn first_sight(p: &Policy, rs: &[ReplicaState]) -> (ReplicaId, usize) {
    let holder = p.place(&question("app", 0), rs).replica.unwrap();
    (holder, holder.0 as usize)
}

#[test]
fn singles_holding_most_of_their_prompt_return_to_its_replica() {
    let p = by_prefix(2);
    let rs = roomy(2);
    let a = p.place(&question("app A", 0), &rs);
    let b = p.place(&question("app B", 0), &rs);
    assert_eq!((a.reason, b.reason), (Reason::Spread, Reason::Spread));
    assert_ne!(a.replica, b.replica, "first sight: the counter");
    for n in 1..6 {
        for (app, first) in [("app A", a), ("app B", b)] {
            let d = p.place(&question(app, n), &rs);
            assert_eq!((d.replica, d.reason), (first.replica, Reason::Prefix));
            assert_eq!(d.shape, Shape::Single);
            assert!(d.matched_bytes >= 3 * B);
        }
    }
}

#[test]
fn a_single_sharing_under_the_minimum_share_keeps_the_counter() {
    let p = by_prefix(2);
    let rs = roomy(2);
    let system = "house rules, three blocks long........";
    let picks: Vec<_> = (0..6)
        .map(|n| {
            // Half the prompt is its own document: under 75 % is shared.
            let doc = format!("document {n} ").repeat(4);
            p.place(&req(&format!("{system}{doc}"), false), &rs)
        })
        .collect();
    for w in picks.windows(2) {
        assert_ne!(w[0].replica, w[1].replica);
        assert_eq!(w[1].reason, Reason::Spread);
    }
}

#[test]
fn a_holder_over_the_bound_is_passed_over_for_a_cold_placement_within_it() {
    let p = by_prefix(1);
    let mut rs = roomy(3);
    let (holder, h) = first_sight(&p, &rs);
    rs[h].waiting = 1;
    let d = p.place(&question("app", 1), &rs);
    assert_eq!((d.replica, d.reason), (Some(holder), Reason::Prefix));
    rs[h].waiting = 3;
    rs[(h + 1) % 3].waiting = 2;
    let d = p.place(&question("app", 2), &rs);
    assert_eq!(d.reason, Reason::Spread);
    assert_eq!(d.matched_bytes, 0);
    let moved = ReplicaId(((h + 2) % 3) as u32);
    assert_eq!(
        d.replica,
        Some(moved),
        "the only one within 1 of the least loaded"
    );
    // The prompt is now held there, and that is where the next one goes.
    rs[moved.0 as usize].waiting = 2;
    let d = p.place(&question("app", 3), &rs);
    assert_eq!((d.replica, d.reason), (Some(moved), Reason::Prefix));
    rs[moved.0 as usize].waiting = 4;
    let d = p.place(&question("app", 4), &rs);
    assert_eq!(d.reason, Reason::Spread, "its holder over the bound again");
    assert_ne!(d.replica, Some(moved));
}

#[test]
fn a_burst_of_singles_behind_one_prompt_still_uses_every_replica() {
    let p = by_prefix(1);
    let mut rs = roomy(2);
    let mut by_prefix = 0;
    for n in 0..8 {
        let d = p.place(&question("app", n), &rs);
        by_prefix += usize::from(d.reason == Reason::Prefix);
        let r = d.replica.unwrap();
        rs[r.0 as usize].waiting += 1; // the caller counts it until it answers
    }
    let (a, b) = (rs[0].waiting, rs[1].waiting);
    assert!(a.abs_diff(b) <= 2, "{a} / {b}");
    assert!(by_prefix >= 4, "{by_prefix} of 8 placed by their prefix");
}

#[test]
fn a_down_holder_sends_its_singles_to_a_cold_placement() {
    let p = by_prefix(2);
    let mut rs = roomy(2);
    let (holder, h) = first_sight(&p, &rs);
    rs[h].live = false;
    let d = p.place(&question("app", 1), &rs);
    assert_eq!(d.reason, Reason::Spread);
    assert_ne!(d.replica, Some(holder));
}

#[test]
fn requests_decoding_at_the_holder_count_only_loosely_against_it() {
    let p = by_prefix(1);
    let mut rs = roomy(2);
    let (holder, h) = first_sight(&p, &rs);
    rs[h].in_flight = 4; // all answering already: within the in-flight bound
    let d = p.place(&question("app", 1), &rs);
    assert_eq!((d.replica, d.reason), (Some(holder), Reason::Prefix));
    rs[h].waiting = 2;
    let d = p.place(&question("app", 2), &rs);
    assert_eq!(d.reason, Reason::Spread, "two queued ahead: over the bound");
}

#[test]
fn singles_keep_the_counter_while_every_replica_could_hold_every_recent_prompt() {
    let p = by_prefix(2);
    p.set_config(PolicyConfig {
        singles: p.config().singles.map(|r| SinglesByPrefix {
            spread_while_all_fit: true,
            ..r
        }),
        ..p.config()
    });
    let mut rs = with_room(&[(5_000, 0), (5_000, 0)]);
    let first = p.place(&question("app", 0), &rs).replica;
    p.set_recent_bytes(9_000);
    let d = p.place(&question("app", 1), &rs);
    assert_eq!(
        d.reason,
        Reason::Spread,
        "9,000 bytes fit in 10,000 on each"
    );
    assert_ne!(d.replica, first);
    rs[0].room = rs[0].room.map(|r| Room { cold: 2_000, ..r });
    let d = p.place(&question("app", 2), &rs);
    assert_eq!(
        d.reason,
        Reason::Prefix,
        "not beside the singles in flight on one"
    );
    p.set_recent_bytes(10_001);
    rs[0].room = rs[0].room.map(|r| Room { cold: 0, ..r });
    assert_eq!(p.place(&question("app", 3), &rs).reason, Reason::Prefix);
}

#[test]
fn singles_follow_their_prefix_only_where_every_replica_declares_its_capacity() {
    let p = by_prefix(2);
    let mut rs = roomy(2);
    rs[1].room = None;
    let first = p.place(&question("app", 0), &rs).replica;
    let d = p.place(&question("app", 1), &rs);
    assert_eq!(d.reason, Reason::Spread);
    assert_ne!(d.replica, first, "the counter, as the seed's rule");
}

#[test]
fn a_holder_without_room_for_the_whole_prompt_is_passed_over() {
    let p = by_prefix(2);
    let mut rs = roomy(2);
    let (holder, h) = first_sight(&p, &rs);
    // A conversation that began on this prompt fills its KV now.
    rs[h].room = rs[h].room.map(|r| Room { free: 40, ..r });
    let d = p.place(&question("app", 1), &rs);
    assert_eq!(d.reason, Reason::Spread);
    assert_ne!(d.replica, Some(holder));
}

#[test]
fn a_pile_of_decoding_requests_bounds_the_holder_too() {
    let p = by_prefix(2);
    let mut rs = roomy(2);
    let (_, h) = first_sight(&p, &rs);
    let o = 1 - h;
    rs[o].in_flight = 1;
    rs[h].in_flight = 6; // twice the other's plus four: still within
    assert_eq!(p.place(&question("app", 1), &rs).reason, Reason::Prefix);
    rs[h].in_flight = 7;
    let d = p.place(&question("app", 2), &rs);
    assert_eq!(
        (d.replica, d.reason),
        (Some(ReplicaId(o as u32)), Reason::Spread)
    );
}

#[test]
fn a_single_is_placed_even_when_no_replica_is_within_both_bounds() {
    let p = by_prefix(2);
    let mut rs = roomy(2);
    let (_, h) = first_sight(&p, &rs);
    let o = 1 - h;
    // The holder: nothing queued, a pile decoding; the other: a queue.
    rs[h].in_flight = 20;
    rs[o].in_flight = 5;
    rs[o].waiting = 5;
    let d = p.place(&question("app", 1), &rs);
    assert!(d.replica.is_some(), "{d:?}");
    assert_eq!(d.reason, Reason::Spread);
}

#[test]
fn a_single_s_holders_are_offered_when_the_rule_may_take_its_prefix_there() {
    let rs = roomy(2);
    let mut asked = Vec::new();
    let p = by_prefix(2);
    let (holder, _) = first_sight(&p, &rs);
    p.place_offered(&question("app", 1), |holders| {
        asked = holders.to_vec();
        &rs
    });
    assert_eq!(asked, vec![holder]);
    // Not when the rule may not take it (no rule: a cold placement).
    let p = Policy::new(cfg(Mode::Shape));
    first_sight(&p, &rs);
    p.place_offered(&question("app", 1), |holders| {
        asked = holders.to_vec();
        &rs
    });
    assert!(asked.is_empty());
}

#[test]
fn a_single_leaves_its_holder_while_more_prompt_waits_there_than_its_prefix_saves() {
    let p = by_prefix(100);
    p.set_config(PolicyConfig {
        queued_step: 16,
        ..p.config()
    });
    let mut rs = roomy(2);
    let (holder, at) = first_sight(&p, &rs);
    let d = p.place(&question("app", 1), &rs);
    assert_eq!((d.replica, d.reason), (Some(holder), Reason::Prefix));
    let saved = d.matched_bytes as u64;
    // Queued there: as much as the prefix saves, and a step. It stays.
    rs[at].queued_bytes = saved + 16;
    let d = p.place(&question("app", 2), &rs);
    assert_eq!((d.replica, d.reason), (Some(holder), Reason::Prefix));
    // A byte more: a cold prefill elsewhere starts sooner.
    rs[at].queued_bytes = saved + 17;
    let d = p.place(&question("app", 3), &rs);
    assert_eq!(d.reason, Reason::Spread);
    assert_ne!(d.replica, Some(holder));
    // As much queued on the other: no sooner there.
    rs[1 - at].queued_bytes = saved + 17;
    let d = p.place(&question("app", 4), &rs);
    assert_eq!(d.reason, Reason::Prefix);
}
