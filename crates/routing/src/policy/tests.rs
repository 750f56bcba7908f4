//! Unit tests of the policy's mechanics on canonical texts (bodies: `tests/routing.rs`).

use super::*;

const B: usize = 16;

fn cfg(mode: Mode) -> PolicyConfig {
    PolicyConfig {
        mode,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: B,
        max_entries: 10_000,
        kv_room: KvRoom::Off,
        load_guard: None,
        least_loaded: false,
        singles: None,
        fleet: Fleet::Local,
    }
}

fn replicas(live: &[bool]) -> Vec<ReplicaState> {
    live.iter()
        .enumerate()
        .map(|(i, l)| ReplicaState {
            id: ReplicaId(i as u32),
            name_hash: u64::from(i as u32) << 8,
            live: *l,
            in_flight: 0,
            waiting: 0,
            engine: None,
            room: None,
        })
        .collect()
}

/// A request whose text is `text`, one message ending at its end.
fn req(text: &str, model_turn: bool) -> Request {
    Request {
        chain: PrefixChain::new(text.as_bytes().to_vec(), vec![text.len()], B),
        model_turn,
        root_end: None,
        hint: None,
        messages: 1,
        key: None,
        cache_bypass: false,
        model: None,
        previous_response_id: None,
        store: true,
    }
}

#[test]
fn singles_alternate_and_continuations_follow_their_prefix() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    let first = p.place(&req("conversation A: hello", false), &rs);
    let other = p.place(&req("unrelated one-shot", false), &rs);
    assert_ne!(first.replica, other.replica);
    let next = p.place(&req("conversation A: hello / reply / more", true), &rs);
    assert_eq!(next.replica, first.replica);
    assert_eq!(next.reason, Reason::Pin);
    assert_eq!(next.matched_bytes, "conversation A: hello".len());
}

#[test]
fn extending_an_earlier_prompt_is_a_continuation_without_a_model_turn() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    let a = p.place(
        &req("a prompt of some length that spans blocks", false),
        &rs,
    );
    p.place(&req("filler", false), &rs);
    let b = p.place(
        &req("a prompt of some length that spans blocks, extended", false),
        &rs,
    );
    assert_eq!(b.shape, Shape::Continuation);
    assert_eq!(b.replica, a.replica);
}

#[test]
fn shared_blocks_alone_do_not_make_a_continuation() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    let system = "a long shared system prompt, several blocks long. ";
    let a = p.place(&req(&format!("{system}question one"), false), &rs);
    let b = p.place(&req(&format!("{system}question two"), false), &rs);
    assert_eq!(b.shape, Shape::Single);
    assert_ne!(a.replica, b.replica);
}

#[test]
fn pinned_replica_down_falls_back_and_the_pin_moves() {
    let p = Policy::new(cfg(Mode::Shape));
    let both = replicas(&[true, true]);
    p.place(&req("x", false), &both); // advance the counter
    let first = p.place(&req("the conversation", false), &both);
    assert_eq!(first.replica, Some(ReplicaId(1)));
    let down = replicas(&[true, false]);
    let moved = p.place(&req("the conversation and more", true), &down);
    assert_eq!(moved.replica, Some(ReplicaId(0)));
    assert_eq!(moved.reason, Reason::Fallback);
    // Replica 1 comes back: the conversation stays where it moved.
    let after = p.place(&req("the conversation and more and more", true), &both);
    assert_eq!(after.replica, Some(ReplicaId(0)));
    assert_eq!(after.reason, Reason::Pin);
}

#[test]
fn a_replica_that_comes_back_keeps_its_pins() {
    let p = Policy::new(cfg(Mode::Shape));
    let both = replicas(&[true, true]);
    let a = p.place(&req("conversation one", false), &both);
    let b = p.place(&req("conversation two", false), &both);
    assert_ne!(a.replica, b.replica);
    // An unrelated request while b's replica is down does not touch b's pin.
    let mut down = both.clone();
    down[b.replica.unwrap().0 as usize].live = false;
    p.place(&req("something else", false), &down);
    let again = p.place(&req("conversation two, turn two", true), &both);
    assert_eq!(again.replica, b.replica);
}

#[test]
fn explicit_key_wins_over_the_prefix() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    let mut first = req("turn one", false);
    first.key = Some("session-9".into());
    let d1 = p.place(&first, &rs);
    assert_eq!(d1.shape, Shape::Continuation);
    let mut unrelated = req("completely different text", false);
    unrelated.key = Some("session-9".into());
    for _ in 0..3 {
        let d = p.place(&unrelated, &rs);
        assert_eq!((d.replica, d.reason), (d1.replica, Reason::Key));
    }
}

#[test]
fn load_guard_moves_to_the_next_best_cached_replica_not_the_least_loaded() {
    let p = Policy::new(PolicyConfig {
        load_guard: Some(2),
        ..cfg(Mode::Affinity)
    });
    let mut rs = replicas(&[true, true, true]);
    let shared = "a shared prefix of two blocks.."; // 30 bytes: one full block
    p.place(&req(shared, false), &rs); // affinity: hash placement
    let long = format!("{shared} then a longer conversation");
    let owner_of_long = p.place(&req(&long, false), &rs).replica.unwrap();
    // Make the short prefix live elsewhere: re-place it with the long owner down.
    rs[owner_of_long.0 as usize].live = false;
    let short_owner = p.place(&req(shared, false), &rs).replica.unwrap();
    rs[owner_of_long.0 as usize].live = true;
    assert_ne!(short_owner, owner_of_long);
    rs[owner_of_long.0 as usize].in_flight = 10;
    let d = p.place(&req(&format!("{long}!"), true), &rs);
    assert_eq!(d.reason, Reason::Guard);
    assert_eq!(d.replica, Some(short_owner));
}

#[test]
fn load_guard_with_nothing_cached_in_its_window_places_cold_there() {
    let p = Policy::new(PolicyConfig {
        load_guard: Some(2),
        least_loaded: true,
        fleet: Fleet::Local,
        ..cfg(Mode::Shape)
    });
    let mut rs = replicas(&[true, true, true]);
    let context = "an agent's context, several blocks long: ".repeat(3);
    let owner = p.place(&req(&context, false), &rs).replica.unwrap();
    let turn = |p: &Policy, rs: &[ReplicaState], n: usize| {
        p.place(&req(&format!("{context} turn {n}"), true), rs)
    };
    let o = owner.0 as usize;
    rs[o].in_flight = 2;
    let d = turn(&p, &rs, 1);
    assert_eq!(
        (d.replica, d.reason),
        (Some(owner), Reason::Pin),
        "within the bound"
    );
    rs[o].in_flight = 3;
    rs[(o + 1) % 3].in_flight = 1;
    let d = turn(&p, &rs, 2);
    assert_eq!(d.reason, Reason::Guard);
    assert_eq!(d.matched_bytes, 0);
    assert_eq!(
        d.replica,
        Some(ReplicaId(((o + 2) % 3) as u32)),
        "the least loaded in the window"
    );
}

#[test]
fn no_live_replica_is_no_decision() {
    let p = Policy::new(cfg(Mode::Shape));
    let d = p.place(&req("hello", true), &replicas(&[false, false]));
    assert_eq!((d.replica, d.reason), (None, Reason::NoReplica));
    let d = p.spread(&[]);
    assert_eq!((d.replica, d.reason), (None, Reason::NoReplica));
}

#[test]
fn forgetting_a_replica_drops_its_pins() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    let a = p.place(&req("conversation", false), &rs);
    p.forget_replica(a.replica.unwrap());
    let d = p.place(&req("conversation, continued", true), &rs);
    assert_eq!(d.reason, Reason::Spread);
}

#[test]
fn a_lost_pin_forgets_what_its_replica_held_before_it_and_keeps_the_rest() {
    let p = Policy::new(cfg(Mode::Shape));
    let one = replicas(&[true]);
    let text = |name: &str, turn: usize| format!("{name}: {}", "turn. ".repeat(4 * (turn + 1)));
    p.set_clock(5);
    p.place(&req(&text("older", 0), false), &one);
    p.set_clock(10);
    p.place(&req(&text("lost", 0), false), &one);
    p.set_clock(15);
    p.place(&req(&text("newer", 0), false), &one);
    p.set_clock(20);
    let d = p.place(&req(&text("lost", 1), true), &one);
    assert_eq!((d.reason, d.matched_at), (Reason::Pin, 10));
    assert_eq!(d.matched_age_s(), 10);
    // The engine reported it all gone: "older" went before it, "newer" came
    // after it (an LRU keeps it), and the turn just placed is held now.
    assert!(p.forget_stale(&d) > 0);
    let two = replicas(&[true, true]);
    let placed = |name, turn| p.place(&req(&text(name, turn), true), &two).reason;
    assert_eq!(placed("lost", 2), Reason::Pin);
    assert_eq!(placed("newer", 1), Reason::Pin);
    assert_eq!(placed("older", 1), Reason::Spread);
}

#[test]
fn working_set_counts_distinct_recent_blocks_per_replica() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    p.set_clock(100);
    let a = "a".repeat(B * 10);
    let first = p.place(&req(&a, false), &rs).replica.unwrap();
    // The same conversation grown: its blocks count once.
    p.place(&req(&format!("{a}{}", "b".repeat(B * 5)), true), &rs);
    p.set_clock(200);
    let other = p
        .place(&req(&"c".repeat(B * 3), false), &rs)
        .replica
        .unwrap();
    assert_ne!(first, other);
    let ws = p.working_set(1000);
    let bytes = |r: ReplicaId| ws.iter().find(|(id, _)| *id == r).map_or(0, |(_, b)| b.all);
    assert_eq!(bytes(first), (B * 15) as u64);
    assert_eq!(bytes(other), (B * 3) as u64);
    // Only the last 50 seconds: the first conversation has aged out.
    assert_eq!(p.working_set(50).len(), 1);
}

#[test]
fn threads_sharing_a_sharded_policy_keep_every_conversation_pinned() {
    let p = Policy::new(PolicyConfig {
        max_entries: shards::SHARDED_FROM,
        ..cfg(Mode::Shape)
    });
    let rs = replicas(&[true, true, true, true]);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (p, rs) = (&p, &rs);
            s.spawn(move || {
                for c in 0..50 {
                    let mut text = format!("thread {t} conversation {c}: the task is");
                    let first = p.place(&req(&text, false), rs).replica;
                    for turn in 0..5 {
                        text.push_str(&format!(" / turn {turn} of a growing context"));
                        let d = p.place(&req(&text, true), rs);
                        assert_eq!((d.replica, d.reason), (first, Reason::Pin));
                    }
                }
            });
        }
    });
    assert!(p.tracked_entries() > 4 * 50 * 6);
}

/// Replicas with `(free, cold)` room, each holding 1,000 pinned bytes.
fn with_room(free: &[(i64, u64)]) -> Vec<ReplicaState> {
    let mut rs = replicas(&vec![true; free.len()]);
    for (s, (free, cold)) in rs.iter_mut().zip(free) {
        s.room = Some(Room {
            free: *free,
            cold: *cold,
            pinned: 1_000,
            capacity: 10_000,
        });
    }
    rs
}

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

fn engine(unseen: u32, kv_used_permille: Option<u16>) -> Option<EngineLoad> {
    Some(EngineLoad {
        unseen,
        kv_used_permille,
    })
}

#[test]
fn least_loaded_sends_cold_requests_to_the_least_loaded_the_counter_among_equals() {
    let p = Policy::new(PolicyConfig {
        least_loaded: true,
        fleet: Fleet::Local,
        ..cfg(Mode::Shape)
    });
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
    let rr = Policy::new(PolicyConfig {
        least_loaded: true,
        fleet: Fleet::Local,
        ..cfg(Mode::RoundRobin)
    });
    assert_eq!(singles_on(&rr, &rs, 3), [0, 1, 2]);
}

#[test]
fn least_loaded_breaks_ties_by_kv_in_use_in_steps_when_every_engine_reports_it() {
    let p = Policy::new(PolicyConfig {
        least_loaded: true,
        fleet: Fleet::Local,
        ..cfg(Mode::Shape)
    });
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
