//! The seed's test shapes, driven through the routing function with synthetic
//! request bodies (no HTTP): `request::Prompt` -> `policy::Policy::place`.

use prefix_router::policy::{
    ContinuationRule, Fleet, KvRoom, Mode, Policy, PolicyConfig, Reason, ReplicaId, ReplicaState,
    Shape,
};
use prefix_router::request::Prompt;
use proptest::prelude::*;
use serde_json::json;

const BLOCK: usize = 1024;

fn config(mode: Mode) -> PolicyConfig {
    PolicyConfig {
        mode,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: BLOCK,
        max_entries: 100_000,
        kv_room: KvRoom::Off,
        load_guard: None,
        least_loaded: false,
        singles: None,
        queued_step: 16_384,
        fleet: Fleet::Local,
    }
}

fn policy(mode: Mode) -> Policy {
    Policy::new(config(mode))
}

/// One router instance of a fleet in `rendezvous` mode.
fn rendezvous(singles: bool) -> Policy {
    Policy::new(PolicyConfig {
        fleet: Fleet::Rendezvous { singles },
        ..config(Mode::Shape)
    })
}

fn fleet(live: &[bool]) -> Vec<ReplicaState> {
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

fn place(p: &Policy, body: &serde_json::Value, rs: &[ReplicaState]) -> Option<u32> {
    decide(p, body, rs).replica.map(|r| r.0)
}

fn decide(
    p: &Policy,
    body: &serde_json::Value,
    rs: &[ReplicaState],
) -> prefix_router::policy::Decision {
    let prompt = Prompt::parse(body.to_string().as_bytes(), usize::MAX).expect("valid body");
    p.place(&prompt.into_request(BLOCK, None), rs)
}

fn one_shot(system: &str, question: &str) -> serde_json::Value {
    json!({"model": "sim", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}]})
}

/// A conversation after `turns` turns: system, then user/assistant pairs, then a user turn.
fn conversation(system: &str, topic: &str, turns: usize) -> serde_json::Value {
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("{topic}: question {t}")}));
        messages.push(
            json!({"role": "assistant", "content": format!("{topic}: answer {t} ").repeat(20)}),
        );
    }
    messages.push(json!({"role": "user", "content": format!("{topic}: question {turns}")}));
    json!({"model": "sim", "messages": messages})
}

#[test]
fn batch_of_singles_uses_both_replicas_and_alternates() {
    let p = policy(Mode::Shape);
    let rs = fleet(&[true, true]);
    let picks: Vec<u32> = (0..16)
        .map(|i| place(&p, &one_shot("You are helpful.", &format!("q{i}")), &rs).unwrap())
        .collect();
    assert!(picks.contains(&0) && picks.contains(&1));
    for w in picks.windows(2) {
        assert_ne!(w[0], w[1], "consecutive singles must alternate: {picks:?}");
    }
}

#[test]
fn growing_conversation_stays_on_its_first_replica() {
    let p = policy(Mode::Shape);
    let rs = fleet(&[true, true]);
    let system = "You are an agent. ".repeat(300); // ~5 KiB, several blocks
    let first = place(&p, &conversation(&system, "task", 0), &rs);
    for turn in 1..12 {
        let d = decide(&p, &conversation(&system, "task", turn), &rs);
        assert_eq!(d.replica.map(|r| r.0), first, "turn {turn} moved");
        assert_eq!(d.shape, Shape::Continuation);
    }
}

#[test]
fn conversation_shorter_than_one_block_stays_on_its_first_replica() {
    let p = policy(Mode::Shape);
    let rs = fleet(&[true, true]);
    let first = json!({"messages": [{"role": "user", "content": "hi"}]});
    let r = place(&p, &first, &rs);
    let second = json!({"messages": [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]});
    assert!(serde_json::to_vec(&second).unwrap().len() < BLOCK);
    assert_eq!(place(&p, &second, &rs), r);
}

#[test]
fn conversation_returns_to_its_replica_after_unrelated_traffic() {
    let p = policy(Mode::Shape);
    let rs = fleet(&[true, true, true]);
    let system = "Shared system prompt for everyone. ".repeat(100);
    let mut home = None;
    for turn in 0..8 {
        // Unrelated one-shots (same system prompt) and another conversation interleave.
        for i in 0..3 {
            place(&p, &one_shot(&system, &format!("noise {turn} {i}")), &rs);
        }
        place(&p, &conversation(&system, "other", turn), &rs);
        let r = place(&p, &conversation(&system, "mine", turn), &rs);
        assert_eq!(*home.get_or_insert(r), r, "turn {turn} moved");
    }
}

#[test]
fn one_shots_sharing_a_long_system_prompt_spread_in_shape_and_pin_in_affinity() {
    let system = "A very long shared system prompt. ".repeat(400); // ~13 KiB
    let run = |mode| {
        let p = policy(mode);
        let rs = fleet(&[true, true]);
        (0..8)
            .map(|i| place(&p, &one_shot(&system, &format!("question {i}")), &rs).unwrap())
            .collect::<Vec<_>>()
    };
    let shape = run(Mode::Shape);
    assert!(
        shape.contains(&0) && shape.contains(&1),
        "shape pinned: {shape:?}"
    );
    let affinity = run(Mode::Affinity);
    assert!(
        affinity.iter().all(|r| *r == affinity[0]),
        "affinity spread: {affinity:?}"
    );
}

#[test]
fn multi_message_rule_pins_shared_system_prompt_one_shots() {
    let system = "A very long shared system prompt. ".repeat(400);
    let p = Policy::new(PolicyConfig {
        continuation: ContinuationRule::MultiMessage,
        ..policy(Mode::Shape).config()
    });
    let rs = fleet(&[true, true]);
    let picks: Vec<_> = (0..6)
        .map(|i| place(&p, &one_shot(&system, &format!("q{i}")), &rs).unwrap())
        .collect();
    // The seed's literal rule: every one-shot after the first follows the shared prefix.
    assert!(picks[1..].iter().all(|r| *r == picks[0]), "{picks:?}");
}

#[test]
fn every_mode_with_a_replica_down_chooses_the_live_one_and_none_when_none() {
    for mode in [Mode::Shape, Mode::RoundRobin, Mode::Affinity] {
        let p = policy(mode);
        for body in [one_shot("s", "q"), conversation("s", "c", 3)] {
            for _ in 0..4 {
                assert_eq!(
                    place(&p, &body, &fleet(&[false, true])),
                    Some(1),
                    "{mode:?}"
                );
                assert_eq!(
                    place(&p, &body, &fleet(&[true, false])),
                    Some(0),
                    "{mode:?}"
                );
                assert_eq!(place(&p, &body, &fleet(&[false, false])), None, "{mode:?}");
            }
        }
    }
}

#[test]
fn completions_prompts_that_extend_earlier_prompts_are_pinned() {
    let p = policy(Mode::Shape);
    let rs = fleet(&[true, true]);
    let mut prompt = String::from("### Agent transcript\n");
    let mut home = None;
    for turn in 0..10 {
        prompt.push_str(&format!(
            "Observation {turn}: {}\nAction: ",
            "data ".repeat(turn * 37)
        ));
        let d = decide(&p, &json!({"prompt": prompt}), &rs);
        // Unrelated completions between turns.
        place(&p, &json!({"prompt": format!("unrelated {turn}")}), &rs);
        let r = d.replica.unwrap().0;
        assert_eq!(*home.get_or_insert(r), r, "turn {turn} moved");
        if turn > 0 {
            assert_eq!(d.shape, Shape::Continuation);
        }
        prompt.push_str("some model completion\n");
    }
}

#[test]
fn roundrobin_alternates_even_a_conversation() {
    let p = policy(Mode::RoundRobin);
    let rs = fleet(&[true, true]);
    let picks: Vec<_> = (0..6)
        .map(|t| place(&p, &conversation("s", "c", t), &rs).unwrap())
        .collect();
    assert_eq!(picks, vec![0, 1, 0, 1, 0, 1]);
}

proptest! {
    #[test]
    fn never_picks_a_down_replica_and_the_index_stays_capped(
        ops in prop::collection::vec((0usize..6, 0usize..40, prop::collection::vec(any::<bool>(), 1..5), any::<bool>()), 1..200),
        cap in 1usize..64,
        mode in prop::sample::select(vec![Mode::Shape, Mode::RoundRobin, Mode::Affinity]),
    ) {
        let p = Policy::new(PolicyConfig {
            mode,
            continuation: ContinuationRule::ModelTurn,
            block_bytes: 8,
            max_entries: cap,
            kv_room: KvRoom::Off,
            load_guard: Some(1),
            least_loaded: false,
            singles: None,
            queued_step: 16_384,
            fleet: Fleet::Local,
        });
        for (conv, len, live, model_turn) in ops {
            let text = format!("conversation {conv} ").repeat(len + 1);
            let messages = vec![json!({"role": "user", "content": text})];
            let mut body = json!({"messages": messages});
            if model_turn {
                body["messages"].as_array_mut().unwrap().push(json!({"role": "assistant", "content": "a"}));
            }
            let prompt = Prompt::parse(body.to_string().as_bytes(), usize::MAX).unwrap();
            let mut rs = fleet(&live);
            for (i, r) in rs.iter_mut().enumerate() { r.in_flight = (i * 3) as u32; }
            let d = p.place(&prompt.into_request(8, None), &rs);
            match d.replica {
                Some(r) => prop_assert!(live[r.0 as usize], "picked down replica {}", r.0),
                None => prop_assert!(live.iter().all(|l| !l)),
            }
            prop_assert!(p.tracked_entries() <= cap);
        }
    }
}

#[test]
fn a_flood_of_singles_larger_than_the_index_leaves_a_live_conversation_pinned() {
    let p = Policy::new(PolicyConfig {
        mode: Mode::Shape,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: BLOCK,
        max_entries: 2_000,
        kv_room: KvRoom::Off,
        load_guard: None,
        least_loaded: false,
        singles: None,
        queued_step: 16_384,
        fleet: Fleet::Local,
    });
    let rs = fleet(&[true, true]);
    let system = "You are a coding agent. ".repeat(200); // ~4.6 KiB
    let home = place(&p, &conversation(&system, "live", 0), &rs).unwrap();
    let turn1 = decide(&p, &conversation(&system, "live", 1), &rs);
    assert_eq!(turn1.replica, Some(ReplicaId(home)));
    // 100 one-shot prompts of 64 KiB each: ~6,400 blocks through a 2,000-entry index.
    for i in 0..100 {
        let filler = format!("{i} ").repeat(22_000);
        place(&p, &one_shot(&filler, "summarise"), &rs);
    }
    assert!(p.tracked_entries() <= 2_000);
    let turn2 = decide(&p, &conversation(&system, "live", 2), &rs);
    assert_eq!(
        (turn2.replica, turn2.reason.as_str()),
        (Some(ReplicaId(home)), "pin"),
        "the flood evicted the conversation"
    );
}

/// The replica a decision chose, by name hash (what instances share).
fn chosen_name(p: &Policy, body: &serde_json::Value, rs: &[ReplicaState]) -> u64 {
    let id = place(p, body, rs).expect("a live replica");
    rs.iter()
        .find(|s| s.id.0 == id)
        .map(|s| s.name_hash)
        .expect("chosen from the list")
}

#[test]
fn instances_in_rendezvous_mode_agree_on_every_conversation_without_shared_state() {
    // Three instances, each numbering the same four replicas its own way.
    let instances: Vec<(Policy, Vec<ReplicaState>)> = (0..3u32)
        .map(|k| {
            let mut rs = fleet(&[true; 4]);
            for s in &mut rs {
                s.id = ReplicaId((s.id.0 + k) % 4);
            }
            (rendezvous(false), rs)
        })
        .collect();
    let mut homes = std::collections::HashSet::new();
    for c in 0..40 {
        let topic = format!("conversation {c}");
        let first = &instances[c % 3];
        let home = chosen_name(
            &first.0,
            &conversation("You are helpful.", &topic, 1),
            &first.1,
        );
        for turn in 2..6 {
            let (p, rs) = &instances[(c + turn) % 3];
            let body = conversation("You are helpful.", &topic, turn);
            assert_eq!(chosen_name(p, &body, rs), home, "{topic}, turn {turn}");
        }
        homes.insert(home);
    }
    assert_eq!(homes.len(), 4, "conversations spread over every replica");
    // Singles keep the counter: a burst alternates.
    let (p, rs) = &instances[0];
    let picks: Vec<u32> = (0..8)
        .map(|i| place(p, &one_shot("You are helpful.", &format!("q{i}")), rs).unwrap())
        .collect();
    assert!(picks.windows(2).all(|w| w[0] != w[1]), "{picks:?}");
}

#[test]
fn rendezvous_moves_only_the_conversations_of_a_replica_that_leaves() {
    // Each placement by an instance that never saw the conversation.
    let (all, three) = (fleet(&[true; 4]), fleet(&[true, true, false, true]));
    for c in 0..60 {
        let body = conversation("S", &format!("conversation {c}"), 2);
        let before = decide(&rendezvous(false), &body, &all);
        assert_eq!(before.reason, Reason::Hash);
        let before = before.replica.unwrap().0;
        let after = place(&rendezvous(false), &body, &three).unwrap();
        if before == 2 {
            assert_ne!(after, 2);
        } else {
            assert_eq!(
                after, before,
                "conversation {c} moved though its replica stayed"
            );
        }
    }
}

#[test]
fn rendezvous_singles_by_root_meet_their_continuations() {
    // The first turn through one instance, the next through another.
    let (a, b) = (rendezvous(true), rendezvous(true));
    let rs = fleet(&[true; 4]);
    let mut used = std::collections::HashSet::new();
    for c in 0..20 {
        let topic = format!("conversation {c}");
        let single = decide(&a, &conversation("S", &topic, 0), &rs);
        assert_eq!(single.shape, Shape::Single);
        let next = place(&b, &conversation("S", &topic, 1), &rs);
        assert_eq!(next, single.replica.map(|r| r.0), "{topic}");
        used.insert(next);
    }
    assert!(used.len() > 1, "singles by root still spread");
}

#[test]
fn rendezvous_failover_goes_to_the_next_ranked_replica_and_the_guard_keeps_to_its_bound() {
    let body = conversation("S", "conversation", 2);
    let rs = fleet(&[true; 4]);
    let first = place(&rendezvous(false), &body, &rs).unwrap() as usize;
    // The first-ranked replica tried and failed: the next, as every instance ranks it.
    let mut tried = rs.clone();
    tried[first].live = false;
    let second = place(&rendezvous(false), &body, &tried).unwrap();
    assert_ne!(second as usize, first);
    assert_eq!(place(&rendezvous(false), &body, &tried), Some(second));
    // With a load guard, an overloaded first choice gives way to the next-ranked.
    let guarded = Policy::new(PolicyConfig {
        load_guard: Some(4),
        fleet: Fleet::Rendezvous { singles: false },
        ..config(Mode::Shape)
    });
    let mut busy = rs.clone();
    busy[first].in_flight = 10;
    assert_eq!(place(&guarded, &body, &busy), Some(second));
    assert_eq!(place(&guarded, &body, &rs), Some(first as u32));
}
