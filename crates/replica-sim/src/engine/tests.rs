use super::*;

/// The calibrated card (the binary's defaults).
fn card(kv_tokens: u64) -> Engine {
    Engine::new(EngineConfig {
        kv_tokens,
        block_tokens: 16,
        bytes_per_token: 4,
        prefill_tps: 33_300.0,
        decode_tps: 50.0,
        reuse_s_per_token: 1.2e-5,
        chunk_tokens: 8192,
        max_num_seqs: None,
    })
}

/// Runs until idle; returns (model time, TTFT and finish time per sequence).
fn run(e: &mut Engine) -> (f64, HashMap<SeqId, (f64, f64, u64)>) {
    let mut t = 0.0;
    let mut out: HashMap<SeqId, (f64, f64, u64)> = HashMap::new();
    while !e.idle() {
        let (dt, events) = e.step();
        t += dt;
        for (id, ev) in events {
            match ev {
                Event::First { cached_tokens, .. } => {
                    out.insert(id, (t, 0.0, cached_tokens));
                }
                Event::Done => out.get_mut(&id).expect("first").1 = t,
                Event::Token => {}
            }
        }
    }
    (t, out)
}

fn text(salt: u64, tokens: u64) -> Vec<u8> {
    let line = format!("document {salt}: some words about the topic at hand. ");
    line.repeat((tokens * 4) as usize / line.len() + 1)
        .into_bytes()[..(tokens * 4) as usize]
        .to_vec()
}

#[test]
fn ninety_k_tokens_prefill_cold_in_2_7_s_and_warm_in_about_1_1_s() {
    let mut e = card(122_636);
    let prompt = text(1, 90_000);
    e.submit(1, &prompt, 0, 1).unwrap();
    let (_, cold) = run(&mut e);
    let mut longer = prompt.clone();
    longer.extend_from_slice(&text(2, 1_000));
    e.submit(2, &longer, 0, 1).unwrap();
    let (_, warm) = run(&mut e);
    let (cold, warm) = (cold[&1].0, warm[&2].0);
    assert!((cold - 2.7).abs() < 0.1, "cold {cold}");
    assert!((warm - 1.1).abs() < 0.1, "warm {warm}");
}

#[test]
fn max_num_seqs_admits_the_next_request_when_one_finishes() {
    // 30k-token prompts (~0.9 s of prefill each), 100 output tokens (2 s).
    let pair = |max_num_seqs| {
        let mut e = card(122_636);
        e.cfg.max_num_seqs = max_num_seqs;
        e.submit(1, &text(1, 30_000), 0, 100).unwrap();
        e.submit(2, &text(2, 30_000), 0, 100).unwrap();
        let (_, out) = run(&mut e);
        (out[&1], out[&2])
    };
    let (first, second) = pair(Some(1));
    assert!(
        second.0 > first.1,
        "started after the first ended: {first:?} {second:?}"
    );
    let (first, second) = pair(None);
    assert!(second.0 < first.1, "ran beside it: {first:?} {second:?}");
}

#[test]
fn a_running_sequence_and_cached_prefixes_share_the_pool() {
    let mut e = card(16 * 100); // 100 blocks
    e.submit(1, &text(1, 16 * 60), 0, 1).unwrap();
    run(&mut e);
    e.submit(2, &text(2, 16 * 60), 0, 1).unwrap();
    run(&mut e);
    // Only 100 blocks: the second prompt (60 blocks and one for its
    // output) evicted 21 of the first's; as in vLLM, a prefix loses its
    // tail first, so its first 39 blocks still hit.
    e.submit(3, &text(1, 16 * 60), 0, 1).unwrap();
    let (_, out) = run(&mut e);
    assert_eq!(out[&3].2, 16 * 39);
}

#[test]
fn decode_waits_for_nothing_but_its_batch() {
    let mut e = card(122_636);
    e.submit(1, &text(1, 100), 0, 50).unwrap();
    let (t, out) = run(&mut e);
    // 49 decode steps at 50 steps/s after a tiny prefill.
    assert!((out[&1].1 - 0.98).abs() < 0.02 && t == out[&1].1, "{out:?}");
}

/// Makespan of `n` distinct cold prompts of `tokens` tokens submitted at once.
fn burst(n: u64, tokens: u64, max_tokens: u64) -> f64 {
    let mut e = card(122_636);
    for i in 0..n {
        e.submit(i, &text(i + 100, tokens), 0, max_tokens).unwrap();
    }
    run(&mut e).0
}

#[test]
fn sixteen_cold_20k_prompts_take_about_30_s_on_one_card_and_18_6_on_two() {
    let one_card = burst(16, 20_000, 350);
    let two_cards = burst(8, 20_000, 350); // each card takes half
    assert!((one_card - 30.1).abs() < 1.5, "one card {one_card}");
    assert!((two_cards - 18.6).abs() < 1.0, "two cards {two_cards}");
}

#[test]
fn only_requests_of_one_salt_share_cached_blocks() {
    let mut e = card(122_636);
    let prompt = text(1, 10_000);
    e.submit(1, &prompt, 7, 1).unwrap();
    run(&mut e);
    e.submit(2, &prompt, 8, 1).unwrap();
    e.submit(3, &prompt, 0, 1).unwrap();
    let (_, other) = run(&mut e);
    assert_eq!((other[&2].2, other[&3].2), (0, 0), "other salts, or none");
    e.submit(4, &prompt, 7, 1).unwrap();
    let (_, same) = run(&mut e);
    assert!(same[&4].2 > 9_000, "same salt: {same:?}");
}

#[test]
fn a_request_larger_than_the_card_is_refused() {
    let mut e = card(1_000);
    assert!(e
        .submit(1, &text(1, 2_000), 0, 1)
        .unwrap_err()
        .contains("maximum context length"));
}

#[test]
fn preemption_frees_room_and_everything_still_finishes() {
    let mut e = card(16 * 40);
    for i in 0..3 {
        e.submit(i, &text(i + 10, 16 * 10), 0, 200).unwrap();
    }
    let (_, out) = run(&mut e);
    assert_eq!(out.len(), 3);
    assert!(out.values().all(|(_, done, _)| *done > 0.0));
    assert!(e.counters.preemptions > 0);
}

#[test]
fn the_kv_log_says_what_is_cached_and_what_is_evicted() {
    // Room for 8 blocks of 16 tokens.
    let mut e = card(128);
    e.record_kv();
    let ids = |from: u32, n: u32| -> Arc<[u32]> { (from..from + n).collect() };
    // 40 tokens: 2 whole blocks cached, the tail is no block.
    e.submit_ids(1, ids(0, 40), 0, 1).unwrap();
    run(&mut e);
    let log = e.take_kv();
    let [KvChange::Stored {
        hashes,
        parent: None,
        tokens,
    }] = log.as_slice()
    else {
        panic!("{log:?}");
    };
    assert_eq!((hashes.len(), tokens.as_slice()), (2, &ids(0, 32)[..]));
    let first = hashes.clone();
    // The same first block, then others: stored after the shared parent.
    let mut other: Vec<u32> = (0..16).collect();
    other.extend(500..548);
    e.submit_ids(2, other.into(), 0, 1).unwrap();
    run(&mut e);
    let log = e.take_kv();
    let [KvChange::Stored { hashes, parent, .. }] = log.as_slice() else {
        panic!("{log:?}");
    };
    assert_eq!((hashes.len(), *parent), (3, Some(first[0])));
    // A third prompt needs room: the least recent blocks are evicted.
    e.submit_ids(3, ids(1000, 80), 0, 1).unwrap();
    run(&mut e);
    let removed: Vec<u64> = (e.take_kv().iter())
        .flat_map(|c| match c {
            KvChange::Removed(h) => h.clone(),
            KvChange::Stored { .. } | KvChange::Cleared => Vec::new(),
        })
        .collect();
    // Least recent first: the first prompt's tail, then the second's.
    assert_eq!(removed.len(), 3, "{removed:?}");
    assert!(removed.contains(&first[1]) && !removed.contains(&first[0]));
    assert_eq!(e.cached_tokens(&[], Some(&ids(1000, 80)), 0), 80);
    // A reset with nothing running drops every block, and says so as vLLM
    // does.
    let dropped = e.reset_cache();
    assert!(dropped > 0);
    assert!(matches!(e.take_kv().as_slice(), [KvChange::Cleared]));
    // With a request running its blocks stay: the others are told removed.
    e.submit_ids(4, ids(2000, 48), 0, 1).unwrap();
    run(&mut e);
    e.submit_ids(5, ids(3000, 48), 0, 8).unwrap();
    e.step();
    e.take_kv();
    let dropped = e.reset_cache();
    let log = e.take_kv();
    assert!(
        matches!(log.as_slice(), [KvChange::Removed(h)] if h.len() == dropped && dropped > 0),
        "{log:?}"
    );
}

#[test]
fn queued_prefill_counts_what_waits_less_its_cached_prefix_and_what_is_left_in_prefill() {
    let mut e = card(122_636);
    let prompt = text(1, 20_000);
    e.submit(1, &prompt, 0, 1).unwrap();
    assert_eq!(e.queued_prefill_tokens(), 20_000);
    // One step of 8,192 tokens: the rest is still to prefill.
    e.step();
    assert_eq!(e.queued_prefill_tokens(), 20_000 - 8_192);
    run(&mut e);
    assert_eq!(e.queued_prefill_tokens(), 0);
    // Waiting again, now held but its last partial block.
    e.submit(2, &prompt, 0, 1).unwrap();
    assert_eq!(e.queued_prefill_tokens(), 20_000 % 16);
}
