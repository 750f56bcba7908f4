//! Cold placements by KV room and engine load.

use super::*;

/// Where `n` distinct 500-byte one-shot prompts go.
fn singles_on(p: &Policy, rs: &[ReplicaState], n: usize) -> Vec<u32> {
    let first = p.tracked_entries();
    (0..n)
        .map(|i| {
            let text = format!("single {first} {i}: {}", "x".repeat(480));
            p.place(&req(&text, false), rs).replica.map_or(99, |r| r.0)
        })
        .collect()
}

#[test]
fn kv_room_spreads_cold_prompts_over_the_replicas_with_room_for_them() {
    for kv_room in [KvRoom::Spread, KvRoom::Pack] {
        let p = Policy::new(PolicyConfig {
            kv_room,
            ..cfg(Mode::Shape)
        });
        // Only replica 1 has room for a 500-byte prompt.
        assert_eq!(
            singles_on(&p, &with_room(&[(100, 0), (10_000, 0)]), 4),
            [1; 4]
        );
        // Both have: the counter alternates.
        let both = singles_on(&p, &with_room(&[(5_000, 0), (10_000, 0)]), 4);
        assert_eq!(both.iter().filter(|r| **r == 0).count(), 2, "{both:?}");
        // A replica with no declared capacity: room is not comparable, the
        // plain counter.
        let mut rs = with_room(&[(10_000, 0), (0, 0)]);
        rs[1].room = None;
        let counted = singles_on(&p, &rs, 4);
        assert_eq!(
            counted.iter().filter(|r| **r == 0).count(),
            2,
            "{counted:?}"
        );
    }
    // Off: the counter, room or not.
    let p = Policy::new(cfg(Mode::Shape));
    let off = singles_on(&p, &with_room(&[(100, 0), (10_000, 0)]), 4);
    assert_eq!(off.iter().filter(|r| **r == 0).count(), 2, "{off:?}");
}

#[test]
fn with_no_room_anywhere_spread_alternates_and_pack_displaces_one_replica() {
    // Replica 0's room went to cold prompts in flight (its pinned contexts are
    // displaced now); replica 1 still holds its own, with too little room.
    let rs = with_room(&[(-200, 1_000), (300, 400)]);
    let spread = Policy::new(PolicyConfig {
        kv_room: KvRoom::Spread,
        ..cfg(Mode::Shape)
    });
    let s = singles_on(&spread, &rs, 4);
    assert_eq!(s.iter().filter(|r| **r == 0).count(), 2, "{s:?}");
    let pack = Policy::new(PolicyConfig {
        kv_room: KvRoom::Pack,
        ..cfg(Mode::Shape)
    });
    assert_eq!(singles_on(&pack, &rs, 4), [0; 4]);
    // The capacity wall (pinned sets alone leave no room): packing rescues
    // nothing, the counter spreads.
    let wall = with_room(&[(-200, 0), (300, 0)]);
    let w = singles_on(&pack, &wall, 4);
    assert_eq!(w.iter().filter(|r| **r == 0).count(), 2, "{w:?}");
    // Not onto a replica far busier than the least busy one.
    let mut busy = rs.clone();
    busy[0].in_flight = 10;
    busy[1].in_flight = 1;
    assert_eq!(singles_on(&pack, &busy, 2), [1, 1]);
    // A pure burst (nothing pinned anywhere): nothing to protect, the counter.
    let mut burst = rs.clone();
    for s in &mut burst {
        s.room = s.room.map(|r| Room { pinned: 0, ..r });
    }
    let b = singles_on(&pack, &burst, 4);
    assert_eq!(b.iter().filter(|r| **r == 0).count(), 2, "{b:?}");
}

#[test]
fn continuations_mark_their_blocks_pinned_and_singles_do_not() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true]);
    let context = "c".repeat(B * 8);
    p.place(&req(&context, false), &rs);
    let ws = |p: &Policy| p.working_set(1000)[0].1;
    assert_eq!(
        ws(&p),
        WorkingSet {
            all: (B * 8) as u64,
            pinned: 0
        }
    );
    p.place(&req(&format!("{context}{}", "d".repeat(B * 2)), true), &rs);
    assert_eq!(
        ws(&p),
        WorkingSet {
            all: (B * 10) as u64,
            pinned: (B * 10) as u64
        }
    );
}

/// A policy of `mode` that places cold requests on the least loaded.
fn least_loaded(mode: Mode) -> Policy {
    Policy::new(PolicyConfig {
        least_loaded: true,
        fleet: Fleet::Local,
        ..cfg(mode)
    })
}

fn engine(unseen: u32, kv_used_permille: Option<u16>) -> Option<EngineLoad> {
    Some(EngineLoad {
        unseen,
        kv_used_permille,
    })
}

#[test]
fn least_loaded_sends_cold_requests_to_the_least_loaded_the_counter_among_equals() {
    let p = least_loaded(Mode::Shape);
    let mut rs = replicas(&[true, true, true]);
    // Replica 0's engine has work the router never sent (another client).
    rs[0].engine = engine(5, None);
    rs[1].in_flight = 1;
    assert_eq!(singles_on(&p, &rs, 3), [2, 2, 2]);
    rs[2].in_flight = 1;
    let even = singles_on(&p, &rs, 4);
    assert_eq!(even.iter().filter(|r| **r == 1).count(), 2, "{even:?}");
    assert!(!even.contains(&0), "{even:?}");
    // The router's own requests and the engine's others add up.
    rs[1].engine = engine(1, None);
    rs[2].in_flight = 3;
    assert_eq!(singles_on(&p, &rs, 2), [1, 1]);
    // Continuations still follow their prefix, and roundrobin ignores load.
    let conversation = "an agent's context, a few blocks long....";
    let first = p.place(&req(conversation, false), &rs).replica;
    let next = p.place(&req(&format!("{conversation} more"), true), &rs);
    assert_eq!((next.replica, next.reason), (first, Reason::Pin));
    let rr = least_loaded(Mode::RoundRobin);
    assert_eq!(singles_on(&rr, &rs, 3), [0, 1, 2]);
}

#[test]
fn least_loaded_breaks_ties_by_kv_in_use_in_steps_when_every_engine_reports_it() {
    let p = least_loaded(Mode::Shape);
    let mut rs = replicas(&[true, true]);
    rs[0].engine = engine(2, Some(900));
    rs[1].engine = engine(2, Some(300));
    assert_eq!(singles_on(&p, &rs, 2), [1, 1]);
    // Within one 10 % step: equals.
    rs[0].engine = engine(2, Some(349));
    let within = singles_on(&p, &rs, 4);
    assert_eq!(within.iter().filter(|r| **r == 0).count(), 2, "{within:?}");
    // One engine silent on KV (llama.cpp): no comparison, the counter.
    rs[0].engine = engine(2, None);
    rs[1].engine = engine(2, Some(0));
    let silent = singles_on(&p, &rs, 4);
    assert_eq!(silent.iter().filter(|r| **r == 0).count(), 2, "{silent:?}");
}

#[test]
fn least_loaded_may_choose_an_idle_replica_whatever_the_others_and_passes_over_a_busier() {
    let p = least_loaded(Mode::Shape);
    let mut rs = replicas(&[true, true]);
    // Every engine reports KV in use (in 10 % steps: 99 is the lowest).
    rs[0].engine = engine(0, Some(0));
    rs[1].engine = engine(0, Some(99));
    assert!(rs[0].idle() && rs[1].idle());
    let busier = [
        ReplicaState {
            in_flight: 1,
            ..rs[1]
        },
        ReplicaState {
            engine: engine(1, Some(0)),
            ..rs[1]
        },
        ReplicaState {
            engine: engine(0, Some(100)),
            ..rs[1]
        },
        ReplicaState {
            live: false,
            ..rs[1]
        },
    ];
    for other in busier {
        assert!(!other.idle(), "{other:?}");
        let placed = singles_on(&p, &[rs[0], other], 4);
        assert_eq!(placed, [0, 0, 0, 0], "{other:?}");
    }
    let placed = singles_on(&p, &rs, 4);
    assert_eq!(placed.iter().filter(|r| **r == 0).count(), 2, "{placed:?}");
}

#[test]
fn engine_reported_load_bounds_pack_and_the_load_guard() {
    let mut rs = with_room(&[(-200, 1_000), (300, 400)]);
    let pack = Policy::new(PolicyConfig {
        kv_room: KvRoom::Pack,
        ..cfg(Mode::Shape)
    });
    rs[0].engine = engine(10, None);
    rs[1].engine = engine(1, None);
    assert_eq!(singles_on(&pack, &rs, 2), [1, 1], "replica 0 is far busier");
    // A pin on a replica whose engine is busy with others' requests moves.
    let guarded = Policy::new(PolicyConfig {
        load_guard: Some(4),
        ..cfg(Mode::Shape)
    });
    let mut rs = replicas(&[true, true]);
    let context = "an agent's context, several blocks long: ".repeat(3);
    let owner = guarded.place(&req(&context, false), &rs).replica.unwrap();
    let o = owner.0 as usize;
    rs[o].engine = engine(5, None);
    let d = guarded.place(&req(&format!("{context} next"), true), &rs);
    assert_eq!(d.reason, Reason::Guard);
    assert_eq!(d.replica, Some(ReplicaId(1 - owner.0)));
    rs[o].engine = engine(4, None);
    let d = guarded.place(&req(&format!("{context} next, again"), true), &rs);
    assert_eq!(d.reason, Reason::Pin, "within the bound: {d:?}");
}

#[test]
fn seeded_counters_start_apart_and_still_alternate() {
    let rs = replicas(&[true, true]);
    let firsts: std::collections::HashSet<u32> = (0..16u64)
        .map(|seed| {
            let p = Policy::new(cfg(Mode::Shape));
            p.seed_counters(seed);
            let a = p.spread(&rs).replica.unwrap();
            assert_ne!(p.spread(&rs).replica.unwrap(), a, "still a counter");
            a.0
        })
        .collect();
    assert_eq!(
        firsts.len(),
        2,
        "instances seeded apart start on different replicas"
    );
}

#[test]
fn the_counter_goes_by_id_whatever_order_the_replicas_come_in_and_skips_the_down() {
    let mut least = cfg(Mode::Shape);
    least.least_loaded = true;
    for c in [cfg(Mode::Shape), least] {
        let sorted = replicas(&[true, true, true, true]);
        let mut shuffled = sorted.clone();
        shuffled.swap(0, 3);
        shuffled.swap(1, 2);
        let (a, b) = (Policy::new(c), Policy::new(c));
        let turns = |p: &Policy, rs: &[ReplicaState]| -> Vec<u32> {
            (0..8).map(|_| p.spread(rs).replica.unwrap().0).collect()
        };
        let in_order = turns(&a, &sorted);
        assert_eq!(in_order, [0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(turns(&b, &shuffled), in_order, "{c:?}");
        // A down replica is skipped, in either order, the first one too;
        // each live set is another set, with its own counter (these sets
        // hash to different counters of the 1,024).
        let mut down = sorted.clone();
        down[1].live = false;
        assert_eq!(turns(&a, &down), [0, 2, 3, 0, 2, 3, 0, 2]);
        shuffled[2].live = false; // id 1
        assert_eq!(turns(&b, &shuffled), [0, 2, 3, 0, 2, 3, 0, 2]);
        let mut first_down = sorted.clone();
        first_down[0].live = false;
        assert_eq!(turns(&a, &first_down), [1, 2, 3, 1, 2, 3, 1, 2]);
    }
}
