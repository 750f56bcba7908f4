//! Placement in a large fleet: the windows `Replicas::sample_into` reads.

use super::*;

#[test]
fn a_sample_is_the_next_window_in_turn_its_least_loaded_and_the_holders() {
    let names: Vec<(String, String)> = (0..10)
        .map(|i| (format!("r{i}"), format!("127.0.0.1:{}", i + 1)))
        .collect();
    let names: Vec<(&str, &str)> = names
        .iter()
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect();
    let (_set, list) = checked_set(&names, Instant::now());
    let mut states = Vec::new();
    let ids = |states: &[ReplicaState]| -> Vec<u32> {
        let mut ids: Vec<u32> = states.iter().filter(|s| s.live).map(|s| s.id.0).collect();
        ids.sort_unstable();
        ids
    };
    let sample = |holders: &[ReplicaId], states: &mut Vec<ReplicaState>| {
        Replicas::sample_into(&list, &[], None, holders, 4, states)
    };
    // Every replica busy alike: each window is read whole. Windows of at
    // most 4 over 10: three of 3, 3 and 4, in turn (the first at random).
    let busy: Vec<_> = list.iter().map(|r| r.begin(0, 0)).collect();
    let mut seen = Vec::new();
    for _ in 0..3 {
        assert!(sample(&[], &mut states));
        seen.push(ids(&states));
    }
    while seen[0][0] != 0 {
        seen.rotate_left(1);
    }
    assert_eq!(seen, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8, 9]]);
    // Idle: a window is read up to its first idle replica, each of its
    // reads from one past the last, so four turns of each offer every
    // replica.
    drop(busy);
    let mut offered = Vec::new();
    for _ in 0..12 {
        assert!(sample(&[], &mut states));
        assert_eq!(states.len(), 1, "{states:?}");
        offered.extend(ids(&states));
    }
    offered.sort_unstable();
    offered.dedup();
    assert_eq!(offered, (0..10).collect::<Vec<u32>>());
    // Turn to the first window's read that starts at replica 0: its next
    // starts at 1.
    let at_0 = (0..9).any(|_| sample(&[], &mut states) && states[0].id == list[0].id);
    assert!(
        at_0,
        "no read of the first window started at its first replica"
    );
    for _ in 0..2 {
        assert!(sample(&[], &mut states));
    }
    // A busy replica is passed over for the next; a holder is offered,
    // busy or not read, for its prefix only (not `spread`: no cold
    // placement goes to it while another can).
    let _busy = [
        list[1].begin(0, 0),
        list[2].begin(0, 0),
        list[7].begin(0, 0),
    ];
    let holders = [list[1].id, list[7].id];
    assert!(sample(&holders, &mut states));
    let read: Vec<u32> = states.iter().map(|s| s.id.0).collect();
    assert_eq!(read, vec![1, 2, 0, 7], "from 1 to its first idle, then 7");
    assert_eq!(ids(&states), vec![0, 1, 7]);
    let spread: Vec<u32> = (states.iter().filter(|s| s.live && s.spread))
        .map(|s| s.id.0)
        .collect();
    assert_eq!(spread, vec![0]);
    // Every replica of the window tried already: the caller reads all.
    let tried: Vec<ReplicaId> = list[3..6].iter().map(|r| r.id).collect();
    assert!(!Replicas::sample_into(
        &list,
        &tried,
        None,
        &holders,
        4,
        &mut states
    ));
    assert!(sample(&[], &mut states));
    // The first window's next read starts past where the last stopped (0),
    // at 1: an idle holder read there is as good as any for a cold
    // placement, and the read goes on past it.
    drop(_busy);
    assert!(sample(&[list[1].id], &mut states));
    let read: Vec<u32> = states.iter().map(|s| s.id.0).collect();
    assert_eq!(read, vec![1, 2], "{states:?}");
    assert!(states.iter().all(|s| s.live && s.spread));
}

#[test]
fn a_window_read_to_its_first_idle_replica_offers_only_what_a_whole_read_may_choose() {
    use crate::policy::{KvRoom, Policy};
    use crate::request::Prompt;
    use std::collections::HashSet;
    let mut seed = 0x5EED_u64;
    // SplitMix64: 0..n, seeded.
    let mut draw = move |n: u64| {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    };
    let question = |t: u64| {
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user",
            "content": format!("question {t}: please summarise these notes.")}]});
        let body = serde_json::to_vec(&body).expect("json");
        (Prompt::parse(&body, 1 << 20).expect("a prompt")).into_request(64, None)
    };
    let mut asked = 0;
    let mut stopped = 0;
    for _ in 0..300 {
        // Eight replicas, one window: loads, engine reports and declared
        // capacities drawn at random, and the policy's cold rules.
        let declared = draw(3);
        let mut c: Vec<config::Replica> = (0..8)
            .map(|i| config::Replica::at(format!("r{i}"), format!("127.0.0.1:{}", i + 1)))
            .collect();
        for r in &mut c {
            if declared == 1 || (declared == 2 && draw(2) == 0) {
                r.kv_tokens = Some(1_000 * (1 + draw(100)));
            }
        }
        let (_set, list) = {
            let set = Replicas::new(&c, Metrics::standalone());
            let list = set.snapshot();
            (set, list)
        };
        let mut busy = Vec::new();
        let mut tried = Vec::new();
        for r in list.iter() {
            r.on_check(draw(8) > 0, false, Instant::now(), &CHECKS);
            if draw(8) == 0 {
                tried.push(r.id);
            }
            // Pinned contexts, often filling the capacity declared: an idle
            // replica may have no room.
            r.set_pinned_bytes(if draw(2) == 0 { 400_000 } else { draw(400_000) });
            for _ in 0..draw(3) {
                busy.push(r.begin(0, 0));
            }
            if draw(2) == 0 {
                let kv = (draw(3) > 0).then(|| draw(1001) as u16);
                r.set_engine(Some(EngineLoad {
                    unseen: draw(2) as u32,
                    kv_used_permille: kv,
                }));
            }
        }
        let mut cfg = crate::policy_config::policy_config(&config::Config::default());
        cfg.least_loaded = draw(2) == 0;
        cfg.kv_room = [KvRoom::Off, KvRoom::Spread, KvRoom::Pack][draw(3) as usize];
        let policy = Policy::new(cfg);
        // The whole window read, its least loaded offered (the rule
        // before a read stopped at an idle replica).
        let mut whole = Vec::new();
        Replicas::states_into(&list, &tried, None, None, &mut whole);
        let least = whole.iter().filter(|s| s.live).map(|s| s.load()).min();
        let undeclared = whole.iter().any(|s| s.live && s.room.is_none());
        if let Some(least) = least.filter(|_| undeclared) {
            for s in &mut whole {
                s.live &= s.load() <= least;
            }
        }
        let mut may = HashSet::new();
        for _ in 0..16 {
            asked += 1;
            may.extend(policy.place(&question(asked), &whole).replica);
        }
        let mut read = Vec::new();
        for _ in 0..8 {
            if !Replicas::sample_into(&list, &tried, None, &[], 8, &mut read) {
                assert!(may.is_empty(), "{whole:?}");
                continue;
            }
            stopped += usize::from(read.len() < 8);
            asked += 1;
            let chosen = policy.place(&question(asked), &read).replica;
            assert!(
                chosen.is_some_and(|r| may.contains(&r)),
                "{chosen:?} not among {may:?}: {read:?} of {whole:?} ({cfg:?})"
            );
        }
    }
    // The reads did stop short, often.
    assert!(stopped > 300, "{stopped} of 2,400 reads stopped short");
}

#[test]
fn a_sample_of_replicas_declaring_their_kv_offers_the_busy_ones_too() {
    let mut c = cfg(&[
        ("a", "127.0.0.1:1"),
        ("b", "127.0.0.1:2"),
        ("c", "127.0.0.1:3"),
    ]);
    for r in &mut c {
        r.kv_tokens = Some(10_000);
    }
    let set = Replicas::new(&c, Metrics::standalone());
    let list = set.snapshot();
    for r in list.iter() {
        r.on_check(true, false, Instant::now(), &CHECKS);
    }
    // An idle replica may be full of pinned contexts: `kv_room` chooses.
    let _busy = list[1].begin(0, 0);
    let mut states = Vec::new();
    assert!(Replicas::sample_into(&list, &[], None, &[], 3, &mut states));
    assert!(states.iter().all(|s| s.live && s.spread));
}

#[test]
fn each_model_s_windows_cut_its_own_replicas() {
    let names: Vec<(String, String)> = (0..6)
        .map(|i| (format!("r{i}"), format!("127.0.0.1:{}", i + 1)))
        .collect();
    let mut c = cfg(&(names.iter())
        .map(|(n, a)| (n.as_str(), a.as_str()))
        .collect::<Vec<_>>());
    for (i, r) in c.iter_mut().enumerate() {
        r.models = Some(vec![if i % 2 == 0 { "a" } else { "b" }.into()]);
    }
    let set = Replicas::new(&c, Metrics::standalone());
    let list = set.snapshot();
    for r in list.iter() {
        r.on_check(true, false, Instant::now(), &CHECKS);
    }
    // Busy alike: each window is read whole.
    let _busy: Vec<_> = list.iter().map(|r| r.begin(0, 0)).collect();
    let mut states = Vec::new();
    let sample_a = |states: &mut Vec<ReplicaState>| {
        assert!(Replicas::sample_into(&list, &[], Some("a"), &[], 2, states));
    };
    let mut seen = Vec::new();
    for _ in 0..4 {
        sample_a(&mut states);
        let mut live: Vec<_> = states.iter().filter(|s| s.live).map(|s| s.id.0).collect();
        live.sort_unstable();
        seen.push(live);
    }
    // Model a's three replicas in two windows (of one and two), in turn.
    seen.sort();
    seen.dedup();
    assert_eq!(seen, vec![vec![0], vec![2, 4]]);
    // Idle: each read stops at one, and the windows' reads go round them.
    drop(_busy);
    let mut offered = Vec::new();
    for _ in 0..4 {
        sample_a(&mut states);
        assert_eq!(states.len(), 1, "{states:?}");
        offered.push(states[0].id.0);
    }
    offered.sort_unstable();
    offered.dedup();
    assert_eq!(offered, vec![0, 2, 4]);
}

#[test]
fn a_replica_not_offered_does_not_cut_short_the_read_of_a_window_declaring_its_kv() {
    let mut c = cfg(&[
        ("a", "127.0.0.1:1"),
        ("b", "127.0.0.1:2"),
        ("c", "127.0.0.1:3"),
    ]);
    c[1].kv_tokens = Some(10_000);
    c[2].kv_tokens = Some(10_000);
    let set = Replicas::new(&c, Metrics::standalone());
    let list = set.snapshot();
    for r in list.iter() {
        r.on_check(true, false, Instant::now(), &CHECKS);
    }
    // b is idle but full of pinned contexts; c is busy with room. a, the
    // one declaring no capacity, was tried: `kv_room` weighs b and c.
    list[1].set_pinned_bytes(40_000);
    let _busy = list[2].begin(0, 0);
    let tried = [list[0].id];
    let mut states = Vec::new();
    for _ in 0..3 {
        assert!(Replicas::sample_into(
            &list,
            &tried,
            None,
            &[],
            3,
            &mut states
        ));
        let offered: Vec<u32> = (states.iter().filter(|s| s.live)).map(|s| s.id.0).collect();
        assert!(offered.contains(&2), "{states:?}");
    }
}
