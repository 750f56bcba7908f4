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
        queued_step: 16_384,
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
            queued_bytes: 0,
            engine: None,
            room: None,
            engine_held: None,
            spread: true,
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
        stream: false,
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
fn forgetting_removed_replicas_drops_their_pins_in_one_pass_and_keeps_the_rest() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true, true]);
    let on: Vec<_> = (0..3)
        .map(|i| {
            let text = format!("conversation {i}");
            (p.place(&req(&text, false), &rs).replica, text)
        })
        .collect();
    let gone: Vec<ReplicaId> = on.iter().filter_map(|(r, _)| *r).take(2).collect();
    assert!(p.forget_replicas(&gone) > 0);
    for (r, text) in &on {
        let d = p.place(&req(&format!("{text}, continued"), true), &rs);
        let kept = !r.is_some_and(|r| gone.contains(&r));
        assert_eq!(d.reason == Reason::Pin, kept, "{text} on {r:?}");
    }
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
    assert!(p.forget_before(d.replica.unwrap(), d.matched_at) > 0);
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

/// Two replicas, 4 blocks placed on one at clock 100 and 2 on the other at
/// `then`: the policy, the replicas and where each went.
fn two_placements(
    then: u32,
) -> (
    Policy,
    Vec<ReplicaState>,
    Option<ReplicaId>,
    Option<ReplicaId>,
) {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true]);
    p.set_clock(100);
    let first = p.place(&req(&"a".repeat(B * 4), false), &rs).replica;
    p.set_clock(then);
    let second = p.place(&req(&"b".repeat(B * 2), false), &rs).replica;
    assert_ne!(first, second);
    (p, rs, first, second)
}

#[test]
fn an_unchanged_index_ages_its_working_set_without_another_pass() {
    let (p, rs, old, new) = two_placements(110);
    let bytes = |ws: &[(ReplicaId, WorkingSet)], r| {
        ws.iter()
            .find(|(id, _)| Some(*id) == r)
            .map_or(0, |(_, s)| s.all)
    };
    // A window of 100 s from 190: since 90. Asked again in the same
    // second, with nothing written: no pass.
    p.set_clock(190);
    let ws = p.working_set(100);
    assert_eq!(
        (bytes(&ws, old), bytes(&ws, new)),
        ((B * 4) as u64, (B * 2) as u64)
    );
    assert_eq!(p.working_set(100), ws);
    assert_eq!(p.working_set_passes(), 1);
    // A second later, aged but unwritten: idle. One pass keeps the window's
    // oldest seconds (91 to 91 + DETAIL_S) apart...
    p.set_clock(191);
    assert_eq!(p.working_set(100), ws);
    assert_eq!(p.working_set_passes(), 2);
    // ...so the first placement ages out with no pass.
    p.set_clock(205);
    let ws = p.working_set(100);
    assert_eq!((bytes(&ws, old), bytes(&ws, new)), (0, (B * 2) as u64));
    assert_eq!(ws.len(), 1);
    assert_eq!(p.working_set_passes(), 2, "no write: no pass");
    // A second past those kept apart, a pass.
    p.set_clock(91 + working::DETAIL_S + 1 + 100);
    assert_eq!(p.working_set(100), vec![]);
    assert_eq!(p.working_set_passes(), 3);
    // A longer window than was read, or a write, passes again.
    assert_eq!(p.working_set(1000).len(), 2);
    assert_eq!(p.working_set_passes(), 4);
    p.place(&req(&"c".repeat(B * 3), false), &rs);
    let ws = p.working_set(1000);
    assert_eq!(ws.iter().map(|(_, s)| s.all).sum::<u64>(), (B * 9) as u64);
    assert_eq!(p.working_set_passes(), 5);
}

#[test]
fn a_kept_working_set_answers_a_longer_window_or_a_forgotten_replica_afresh() {
    let (p, _, first, _) = two_placements(140);
    // A short window ages the reading past the first placement; a longer
    // one in the same second still counts it.
    assert_eq!(p.working_set(10).len(), 1);
    assert_eq!(p.working_set(50).len(), 2);
    assert_eq!(p.working_set(50), p.working_set(50));
    let passes = p.working_set_passes();
    // Forgetting a replica is a write: its blocks leave the working set.
    assert!(p.forget_replica(first.unwrap()) > 0);
    let ws = p.working_set(50);
    assert_eq!(ws.len(), 1);
    assert!(ws.iter().all(|(r, _)| Some(*r) != first));
    assert_eq!(p.working_set_passes(), passes + 1);
}

#[test]
fn working_set_lists_each_replica_once_in_id_order() {
    // The capacity watch finds each replica's set by binary search.
    let p = Policy::new(cfg(Mode::Shape));
    let mut rs = replicas(&[true; 40]);
    // Ids far apart and out of order, as reloads leave them.
    for (i, r) in rs.iter_mut().enumerate() {
        r.id = ReplicaId(((i as u32) * 7_919 + 13) % 1_000);
    }
    for i in 0..400 {
        p.place(&req(&format!("single {i} ").repeat(B / 4), false), &rs);
    }
    let ws = p.working_set(1000);
    assert!(ws.windows(2).all(|w| w[0].0 .0 < w[1].0 .0), "{ws:?}");
    assert_eq!(ws.len(), 40, "the counter spreads 400 singles over all 40");
    let blocks: u64 = ws.iter().map(|(_, s)| s.all).sum();
    assert!(blocks >= (400 * B) as u64, "{blocks}");
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

mod kv_room;
mod singles;

#[test]
fn an_engines_report_replaces_the_index_guess_for_its_replica() {
    let p = Policy::new(cfg(Mode::Shape));
    let rs = replicas(&[true, true, true]);
    let told = |reports: &[(u32, usize)]| {
        let mut rs = rs.clone();
        for (i, pos) in reports {
            rs[*i as usize].engine_held = Some(*pos);
        }
        rs
    };
    let first = p.place(&req("conversation A: hello", true), &rs);
    let guessed = first.replica.expect("placed").0;
    let other = (guessed + 1) % 3;
    let next = req("conversation A: hello / reply / more", true);
    // Moments later, while a request waits there, its engine has not
    // reported it yet: the record stands.
    p.set_clock(UNREPORTED_S);
    let mut queued = told(&[(guessed, 0), (other, 20)]);
    queued[guessed as usize].waiting = 1;
    let d = p.place(&next, &queued);
    assert_eq!(
        (d.replica, d.reason),
        (Some(ReplicaId(guessed)), Reason::Pin)
    );
    // Nothing waits there, or later: the engine says it holds nothing
    // (evicted), and another's says it holds most of it.
    let d = p.place(&next, &told(&[(guessed, 0), (other, 20)]));
    assert_eq!((d.replica, d.reason), (Some(ReplicaId(other)), Reason::Pin));
    p.set_clock(2 * UNREPORTED_S + 1);
    let d = p.place(&next, &queued);
    assert_eq!((d.replica, d.reason), (Some(ReplicaId(other)), Reason::Pin));
    assert_eq!(d.matched_bytes, 20);
    // Held nowhere by every engine's report: no pin, a cold placement.
    p.set_clock(5 * UNREPORTED_S);
    let r = req("conversation A: hello / reply / more / and more", true);
    let d = p.place(&r, &told(&[(0, 0), (1, 0), (2, 0)]));
    assert_eq!((d.reason, d.matched_bytes), (Reason::Spread, 0));
    // A replica without a report keeps the index's guess.
    let b = p
        .place(&req("conversation B: hi", true), &rs)
        .replica
        .expect("placed")
        .0;
    p.set_clock(10 * UNREPORTED_S);
    let r = req("conversation B: hi / reply / more", true);
    let others: Vec<(u32, usize)> = (0..3).filter(|i| *i != b).map(|i| (i, 0)).collect();
    let d = p.place(&r, &told(&others));
    assert_eq!((d.replica, d.reason), (Some(ReplicaId(b)), Reason::Pin));
}

#[test]
fn engines_holding_a_prefix_alike_take_it_least_loaded_first() {
    let p = Policy::new(cfg(Mode::Shape));
    let mut rs = replicas(&[true, true, true]);
    for (i, s) in rs.iter_mut().enumerate() {
        s.engine_held = Some(20);
        s.waiting = [3, 1, 2][i];
        s.in_flight = s.waiting;
    }
    let d = p.place(&req("conversation C: hello / reply / more", true), &rs);
    assert_eq!((d.replica, d.reason), (Some(ReplicaId(1)), Reason::Pin));
}

#[test]
fn an_offer_is_asked_with_the_replicas_holding_the_prefix() {
    let p = Policy::new(cfg(Mode::Shape));
    let all = replicas(&[true; 8]);
    let first = p.place(&req("conversation S: hello", true), &all);
    let home = first.replica.expect("placed");
    // The next turn, offered only its holder and one other replica.
    let mut asked = Vec::new();
    let sample: Vec<ReplicaState> = all
        .iter()
        .filter(|s| s.id == home || s.id == ReplicaId((home.0 + 1) % 8))
        .copied()
        .collect();
    let next = p.place_offered(&req("conversation S: hello, and more", true), |holders| {
        asked = holders.to_vec();
        &sample
    });
    assert_eq!(asked, vec![home]);
    assert_eq!((next.replica, next.reason), (Some(home), Reason::Pin));
    // A prompt nobody holds names no holder; nor does a single sharing a
    // prefix while no singles rule may take it there (a cold placement).
    p.place_offered(&req("a new one-shot", false), |holders| {
        asked = holders.to_vec();
        &sample
    });
    assert!(asked.is_empty());
    p.place(&req("a shared system prompt: question one", false), &all);
    p.place_offered(
        &req("a shared system prompt: question two", false),
        |holders| {
            asked = holders.to_vec();
            &sample
        },
    );
    assert!(asked.is_empty());
    assert!(p.may_sample());
    assert!(!Policy::new(cfg(Mode::Affinity)).may_sample());
    assert!(!Policy::new(cfg(Mode::RoundRobin)).may_sample());
}

#[test]
fn a_cold_placement_passes_over_replicas_with_more_prompt_queued_for_prefill() {
    let p = Policy::new(PolicyConfig {
        queued_step: 1_000,
        ..cfg(Mode::Shape)
    });
    let mut rs = replicas(&[true, true, true]);
    rs[1].queued_bytes = 40_000;
    // Within the first step: as good as idle.
    rs[2].queued_bytes = 999;
    let picks: Vec<_> = (0..6)
        .map(|n| p.place(&req(&format!("question {n}"), false), &rs))
        .collect();
    assert!(picks.iter().all(|d| d.reason == Reason::Spread));
    let picks: Vec<_> = picks.iter().filter_map(|d| d.replica).collect();
    assert!(!picks.contains(&ReplicaId(1)), "{picks:?}");
    assert!(picks.contains(&ReplicaId(0)) && picks.contains(&ReplicaId(2)));
    // Not compared: the counter over all three.
    p.set_config(PolicyConfig {
        queued_step: 0,
        ..p.config()
    });
    let picks: Vec<_> = (0..3)
        .filter_map(|n| p.place(&req(&format!("later {n}"), false), &rs).replica)
        .collect();
    assert!(picks.contains(&ReplicaId(1)), "{picks:?}");
}

#[test]
fn with_least_loaded_the_load_comes_before_the_prompt_queued() {
    let p = Policy::new(PolicyConfig {
        least_loaded: true,
        queued_step: 1_000,
        ..cfg(Mode::Shape)
    });
    let mut rs = replicas(&[true, true, true]);
    // Requests another router sent (its engine reports them): the router's
    // own count of queued prompt does not see them.
    rs[0].engine = Some(EngineLoad {
        unseen: 3,
        kv_used_permille: None,
    });
    rs[1].queued_bytes = 40_000;
    rs[1].in_flight = 1;
    rs[1].waiting = 1;
    rs[2].in_flight = 1;
    rs[2].waiting = 1;
    for n in 0..4 {
        let d = p.place(&req(&format!("question {n}"), false), &rs);
        assert_eq!(
            d.replica,
            Some(ReplicaId(2)),
            "least loaded, then least queued"
        );
    }
}
