//! The seed's test shapes, driven through the routing function with synthetic
//! request bodies (no HTTP): `request::Prompt` -> `policy::Policy::place`.

use prefix_router::policy::{
    ContinuationRule, KvRoom, Mode, Policy, PolicyConfig, ReplicaId, ReplicaState, Shape,
};
use prefix_router::request::Prompt;
use proptest::prelude::*;
use serde_json::json;

const BLOCK: usize = 1024;

fn policy(mode: Mode) -> Policy {
    Policy::new(PolicyConfig {
        mode,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: BLOCK,
        max_entries: 100_000,
        kv_room: KvRoom::Off,
        load_guard: None,
        least_loaded: false,
    })
}

fn fleet(live: &[bool]) -> Vec<ReplicaState> {
    live.iter()
        .enumerate()
        .map(|(i, l)| ReplicaState {
            id: ReplicaId(i as u32),
            live: *l,
            in_flight: 0,
            engine: None,
            room: None,
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
