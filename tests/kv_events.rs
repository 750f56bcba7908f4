//! The engines' KV events, from a real ZMQ publisher (pyzmq, msgspec) as
//! vLLM's: what each replica holds, a lost batch asked for at the replay
//! socket, and an emptied or restarted engine seen at once. Real router,
//! real simulators.

mod common;

use std::time::Duration;

use common::kv::{stored, Publisher};
use common::{agent, tokenizer_dir, wait_for, Router, Sim};
use serde_json::json;

/// Sims `a` (its engine's events from `publisher`; `replay`: with its
/// replay socket) and `b`.
fn start(publisher: &Publisher, replay: bool) -> (Sim, Sim, Router) {
    start_with(publisher, replay, "")
}

/// As [`start`], with `extra` top-level YAML.
fn start_with(publisher: &Publisher, replay: bool, extra: &str) -> (Sim, Sim, Router) {
    let replay = replay.then_some(publisher.replay_port);
    start_at(publisher.port, replay, extra)
}

/// Sims `a` (its engine's events from port `port`, its replay socket at
/// `replay`) and `b`, behind a router with `extra` top-level YAML.
fn start_at(port: u16, replay: Option<u16>, extra: &str) -> (Sim, Sim, Router) {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let replay = replay.map_or(String::new(), |r| {
        format!(", replay_endpoint: \"tcp://127.0.0.1:{r}\"")
    });
    let yaml = format!(
        "{extra}replicas:\n  - {{name: a, addr: \"{}\", kv_events: {{endpoint: \"tcp://127.0.0.1:{port}\", \
         topic: kv-events{replay}}}}}\n{}",
        a.addr,
        b.yaml()
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("a", true);
    router.wait_replica_up("b", true);
    (a, b, router)
}

/// As [`start`], in front of our publisher, once the router has subscribed.
fn subscribed(replay: bool) -> (Publisher, (Sim, Sim), Router) {
    let mut p = Publisher::start();
    let (a, b, router) = start(&p, replay);
    p.wait_ready();
    (p, (a, b), router)
}

fn kv(router: &Router, name: &str, labels: &str) -> f64 {
    router.metric(&format!("prefix_router_{name}{{{labels}}}"))
}

/// Waits until series `name{labels}` reads `want`.
fn wait_kv(router: &Router, name: &str, labels: &str, want: f64) {
    wait_for(
        &format!("{name}{{{labels}}} = {want}"),
        Duration::from_secs(10),
        || (kv(router, name, labels) == want).then_some(()),
    );
}

#[test]
fn blocks_follow_the_events_in_both_encodings_and_a_lost_batch_is_replayed() {
    let (mut p, _sims, router) = subscribed(true);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 0.0);
    // Batch 0: the engine's first, so its whole cache is known.
    p.publish(json!([stored(1, 3, None)]), "map", false);
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 3.0);
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
    // Older vLLM's positional arrays read alike.
    p.publish(json!([stored(4, 2, Some(3))]), "array", false);
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 5.0);
    // Batch 2 never arrives; batch 3 shows the gap: 2 comes from replay.
    p.publish(json!([stored(6, 1, Some(5))]), "map", true);
    p.publish(
        json!([{"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}]),
        "map",
        false,
    );
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 4.0);
    assert_eq!(
        kv(
            &router,
            "kv_event_batches_total",
            "outcome=\"replayed\",replica=\"a\""
        ),
        1.0
    );
    assert_eq!(
        kv(
            &router,
            "kv_event_batches_total",
            "outcome=\"applied\",replica=\"a\""
        ),
        3.0
    );
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
    assert_eq!(
        kv(
            &router,
            "kv_event_blocks_total",
            "change=\"stored\",replica=\"a\""
        ),
        6.0
    );
    assert_eq!(
        kv(
            &router,
            "kv_event_blocks_total",
            "change=\"removed\",replica=\"a\""
        ),
        2.0
    );
}

#[test]
fn a_lost_batch_without_a_replay_socket_leaves_the_state_unknown_until_the_cache_is_emptied() {
    let (mut p, _sims, router) = subscribed(false);
    p.publish(json!([stored(1, 2, None)]), "map", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    p.publish(json!([stored(3, 1, Some(2))]), "map", true);
    p.publish(json!([stored(4, 1, Some(3))]), "map", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 0.0);
    assert_eq!(
        kv(
            &router,
            "kv_event_batches_total",
            "outcome=\"lost\",replica=\"a\""
        ),
        1.0
    );
    assert_eq!(kv(&router, "kv_blocks", "replica=\"a\""), 0.0);
    p.publish(json!([{"type": "AllBlocksCleared"}]), "array", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    assert_eq!(
        kv(
            &router,
            "kv_engine_resets_total",
            "cause=\"cleared\",replica=\"a\""
        ),
        1.0
    );
}

/// Before, an engine restarted between health checks kept its pins: the
/// next turn went to an empty cache as a `pin` (tests/cache_report.rs). Its
/// events say so at once: the index forgets what it placed there.
#[test]
fn an_engine_restart_its_events_announce_unpins_its_conversations_at_once() {
    let (mut p, _sims, router) = subscribed(true);
    p.publish(json!([stored(1, 1, None)]), "map", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    // A conversation pinned to `a` (its first turn may land on either).
    let on_a = (0..8)
        .map(|i| {
            let mut body = agent(1);
            body["messages"][0]["content"] = json!(format!(
                "conversation {i}. {}",
                body["messages"][0]["content"].as_str().unwrap_or("")
            ));
            body
        })
        .find(|body| router.post("/v1/chat/completions", body).replica() == "a")
        .expect("the counter reaches a");
    let mut next = on_a.clone();
    let messages = next["messages"].as_array_mut().expect("messages");
    messages.push(json!({"role": "assistant", "content": "result 1"}));
    messages.push(json!({"role": "user", "content": "step 2"}));
    let r = router.post("/v1/chat/completions", &next);
    assert_eq!(
        (r.status, r.replica(), r.decision()),
        (200, "a", "pin"),
        "{}",
        r.text()
    );
    // The engine restarts: its events start again from batch 0.
    p.restart();
    p.publish(json!([stored(1, 1, None)]), "map", false);
    wait_kv(
        &router,
        "kv_engine_resets_total",
        "cause=\"restart\",replica=\"a\"",
        1.0,
    );
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
    let messages = next["messages"].as_array_mut().expect("messages");
    messages.push(json!({"role": "assistant", "content": "result 2"}));
    messages.push(json!({"role": "user", "content": "step 3"}));
    let r = router.post("/v1/chat/completions", &next);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(
        r.decision(),
        "pin",
        "pinned to an engine that restarted empty"
    );
    assert!(
        kv(
            &router,
            "index_repairs_total",
            "cause=\"events\",replica=\"a\""
        ) >= 1.0
    );
}

/// SGLang's own publisher code (read from its wheel; nobody here wrote it)
/// on the wire: batches the router missed before it subscribed come from the
/// replay socket, the blocks follow, and a restart is seen.
#[test]
fn sglang_s_own_publisher_is_read_replayed_and_its_restart_seen() {
    let mut p = Publisher::sglang();
    // Published before the router runs: only the replay socket has them.
    p.publish(json!([stored(1, 2, None)]), "map", false);
    p.publish(
        json!([stored(3, 1, Some(2)), {"type": "BlockRemoved", "block_hashes": [3]}]),
        "map",
        false,
    );
    let (_a, _b, router) = start(&p, true);
    let heard = || {
        kv(
            &router,
            "kv_event_batches_total",
            "outcome=\"applied\",replica=\"a\"",
        ) >= 1.0
    };
    let probes = p.probe(heard);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    // Two blocks in the end (CI once read 3 right after kv_synced turned 1,
    // cause not found; what the router settles on is what is checked).
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 2.0);
    // Each batch counted once: from the replay socket those before the
    // first one heard (the two published before the router ran, and the
    // probes sent before its subscription took), the rest as they came.
    let batches = |outcome: &str| {
        kv(
            &router,
            "kv_event_batches_total",
            &format!("outcome=\"{outcome}\",replica=\"a\""),
        )
    };
    wait_for("every batch counted once", Duration::from_secs(10), || {
        (batches("replayed") + batches("applied") == (2 + probes) as f64).then_some(())
    });
    assert!(batches("replayed") >= 2.0);
    assert_eq!(batches("undecodable"), 0.0);
    p.restart();
    p.publish(json!([stored(7, 1, None)]), "map", false);
    let restarted = || {
        kv(
            &router,
            "kv_engine_resets_total",
            "cause=\"restart\",replica=\"a\"",
        ) == 1.0
    };
    p.probe(restarted);
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 1.0);
}

/// An engine that restarted while the router was not reading, and got past
/// the last batch number read: the batch asked for again comes back other
/// than it was read, so it is a restart, not a gap.
#[test]
fn a_restart_past_the_last_batch_read_is_told_from_a_gap() {
    let (mut p, _sims, router) = subscribed(true);
    for first in [1, 3, 5] {
        let parent = (first > 1).then_some(first - 1);
        p.publish(json!([stored(first, 2, parent)]), "map", false);
    }
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 6.0);
    // The new process publishes 0..=4; only 4 reaches the router (after 2).
    p.restart();
    for (i, first) in [10, 11, 12, 13, 14].into_iter().enumerate() {
        p.publish(json!([stored(first, 1, None)]), "map", i < 4);
    }
    wait_kv(
        &router,
        "kv_engine_resets_total",
        "cause=\"restart\",replica=\"a\"",
        1.0,
    );
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 5.0);
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
}

/// An engine that restarted while the router reconnected, and whose first
/// batch heard afterwards is numbered just after the last one read: the
/// connection was lost, so that batch is not taken as the next. With a
/// replay socket the last batch read is asked for again and comes back
/// other than it was (a restart); without one the replica's state is
/// unknown rather than wrong.
#[test]
fn a_restart_heard_after_a_reconnect_is_seen_even_when_its_numbers_follow_on() {
    for replay in [true, false] {
        let mut p = Publisher::start();
        let (_a, _b, router) = start(&p, replay);
        p.wait_ready();
        p.publish(json!([stored(1, 2, None)]), "map", false);
        let last = p.publish(json!([stored(3, 2, Some(2))]), "map", false);
        wait_kv(&router, "kv_blocks", "replica=\"a\"", 4.0);
        wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
        // The new process publishes batches 0..=last before the router is
        // subscribed again, so its first batch heard is last + 1.
        p.restart_rebound();
        for first in 10..=10 + last {
            p.publish(json!([stored(first, 1, None)]), "map", true);
        }
        p.wait_subscribed();
        let next = p.publish(json!([stored(20, 1, None)]), "map", false);
        assert_eq!(next, last + 1);
        if replay {
            wait_kv(
                &router,
                "kv_engine_resets_total",
                "cause=\"restart\",replica=\"a\"",
                1.0,
            );
            // The new process's blocks only: 0..=last replayed, then 20.
            wait_kv(&router, "kv_blocks", "replica=\"a\"", last as f64 + 2.0);
            assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
        } else {
            wait_kv(&router, "kv_synced", "replica=\"a\"", 0.0);
        }
    }
}

/// One malformed event (EAGLE's token pairs) costs only itself; a message
/// of another topic that the subscription's prefix lets through is
/// skipped; neither makes the state unknown.
#[test]
fn a_malformed_event_or_another_topic_costs_nothing_else() {
    let (mut p, _sims, router) = subscribed(true);
    let pairs = json!({"type": "BlockStored", "block_hashes": [9], "parent_block_hash": null,
        "token_ids": [[1, 2], [3, 4]], "block_size": 2});
    p.publish(json!([stored(1, 2, None), pairs]), "map", false);
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 2.0);
    assert_eq!(
        kv(
            &router,
            "kv_event_blocks_total",
            "change=\"unreadable\",replica=\"a\""
        ),
        1.0
    );
    p.publish_to("kv-events-other", json!([{"type": "AllBlocksCleared"}]));
    p.publish(json!([stored(3, 1, Some(2))]), "array", false);
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 3.0);
    assert_eq!(
        kv(
            &router,
            "kv_event_batches_total",
            "outcome=\"skipped\",replica=\"a\""
        ),
        1.0
    );
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 1.0);
}

/// `BlockStored` of the whole 16-token blocks of `ids`, hashed `1..`.
fn stored_ids(ids: &[u32]) -> serde_json::Value {
    let n = ids.len() / 16;
    json!({"type": "BlockStored", "block_hashes": (1..=n).collect::<Vec<_>>(),
        "parent_block_hash": null, "token_ids": &ids[..n * 16], "block_size": 16, "medium": "GPU"})
}

#[test]
fn a_chat_request_goes_where_the_engine_holds_its_tokens_and_not_where_it_evicted_them() {
    let dir = tokenizer_dir();
    let model = tokens::ModelTokens::load(std::path::Path::new(&dir), 1 << 20)
        .expect("scripts/real-engine.sh prepare makes .real-engine/tokenizer");
    let mut p = Publisher::start();
    let extra = format!("tokenizers: {{sim: \"{dir}\"}}\n");
    let (_a, _b, router) = start_with(&p, true, &extra);
    p.wait_ready();
    p.publish(json!([]), "map", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    let placed = |body: &serde_json::Value| {
        let r = router.post("/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.text());
        let h = |n| r.header(n).map(str::to_owned).expect(n);
        (h("x-prefix-router-replica"), h("x-prefix-router-decision"))
    };
    // Engine a says it holds a conversation the router never placed: its
    // tokens, as the chat template and tokenizer make them.
    let first = agent(3);
    let ids = model.chat_ids(first.to_string().as_bytes()).expect("ids");
    p.publish(json!([stored_ids(&ids)]), "map", false);
    let blocks = (ids.len() / 16) as f64;
    wait_kv(&router, "kv_blocks", "replica=\"a\"", blocks);
    assert_eq!(placed(&first), ("a".to_owned(), "pin".to_owned()));
    // It evicts them: the next turn is no pin, though the router placed the
    // last one there (its own index guesses a).
    let removed: Vec<usize> = (1..=ids.len() / 16).collect();
    p.publish(
        json!([{"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"}]),
        "map",
        false,
    );
    wait_kv(&router, "kv_blocks", "replica=\"a\"", 0.0);
    assert_eq!(
        placed(&agent(4)).1,
        "spread",
        "held nowhere: a cold placement"
    );
}

#[test]
fn a_cards_own_events_draw_a_conversation_sent_straight_to_it_and_release_it_when_emptied() {
    let dir = tokenizer_dir();
    let args = ["--tokenizer", dir.as_str(), "--kv-events-port", "0"];
    let (a, b) = (Sim::start("a", &args), Sim::start("b", &args));
    let router = Router::start(&[&a, &b], &format!("tokenizers: {{sim: \"{dir}\"}}\n"));
    // A client sends a conversation straight to card b: the router never
    // sees it, b's events say what b now holds.
    let straight = common::http::post_json(b.addr, "/v1/chat/completions", &agent(3));
    assert_eq!(straight.status, 200, "{}", straight.text());
    wait_kv(&router, "kv_synced", "replica=\"b\"", 1.0);
    wait_for("b's blocks", Duration::from_secs(10), || {
        (kv(&router, "kv_blocks", "replica=\"b\"") > 0.0).then_some(())
    });
    let next = router.post("/v1/chat/completions", &agent(4));
    assert_eq!((next.replica(), next.decision()), ("b", "pin"));
    // Card b's cache is emptied (its events remove every block): the next
    // turn is placed cold, though the router placed the last one on b.
    let reset = common::http::post_json(b.addr, "/sim/reset", &json!({}));
    assert_eq!(reset.status, 200);
    wait_kv(&router, "kv_blocks", "replica=\"b\"", 0.0);
    // Told as vLLM tells an emptied cache: AllBlocksCleared.
    let resets = "kv_engine_resets_total";
    assert_eq!(kv(&router, resets, "cause=\"cleared\",replica=\"b\""), 1.0);
    assert_eq!(
        router.post("/v1/chat/completions", &agent(5)).decision(),
        "spread"
    );
}

/// A long agent conversation (past the checkpoints' 32 KiB) of short
/// messages, `turns` tool rounds in: each turn's body is the last one's
/// and two more messages.
fn long_agent(turns: usize) -> serde_json::Value {
    let mut m = vec![json!({"role": "system", "content": "You are a coding agent."})];
    let output = |t: usize| format!("test_{t} FAILED: expected {t}, got {}\n", t + 1).repeat(20);
    for t in 0..60 + turns {
        m.push(json!({"role": "user", "content": format!("step {t}: run the tests")}));
        m.push(json!({"role": "assistant", "content": output(t)}));
    }
    m.push(json!({"role": "user", "content": format!("step {}: run the tests", 60 + turns)}));
    json!({"model": "sim", "max_tokens": 2, "messages": m, "stream": false})
}

#[test]
fn a_long_conversation_s_turns_are_tokenized_from_the_turn_before_and_stay_where_the_engine_holds_them(
) {
    let dir = tokenizer_dir();
    let args = ["--tokenizer", dir.as_str(), "--kv-events-port", "0"];
    let (a, b) = (Sim::start("a", &args), Sim::start("b", &args));
    let router = Router::start(&[&a, &b], &format!("tokenizers: {{sim: \"{dir}\"}}\n"));
    let tokenized = |from: &str| {
        kv(
            &router,
            "chat_prompts_tokenized_total",
            &format!("from=\"{from}\""),
        )
    };
    let blocks = |replica: &str| kv(&router, "kv_blocks", &format!("replica=\"{replica}\""));
    let mut on: Option<String> = None;
    for turn in 0..4 {
        let body = long_agent(turn);
        assert!(body.to_string().len() > 40 << 10);
        let before = [blocks("a"), blocks("b")];
        let r = router.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        if let Some(on) = &on {
            assert_eq!(
                (r.replica(), r.decision()),
                (on.as_str(), "pin"),
                "turn {turn}"
            );
        }
        // Its engine's events say it holds the turn before the next comes.
        let held = before[usize::from(r.replica() == "b")];
        wait_for(
            &format!("turn {turn}: blocks past {held}"),
            Duration::from_secs(10),
            || (blocks(r.replica()) > held).then_some(()),
        );
        on = Some(r.replica().to_owned());
    }
    // The first turn: no engine's state known yet (none has told what it
    // holds), nothing tokenized. The second rendered and tokenized whole,
    // each later one from the turn before: only its new messages.
    assert_eq!((tokenized("start"), tokenized("turn")), (1.0, 2.0));
}

/// A tokenizer that panics on every text (a damaged `tokenizer.json`: an
/// empty precompiled normalizer) costs only the exact placement: the
/// router starts (the load's probes panic: the text is tokenized whole),
/// and the requests are placed by their text and answered, short and long
/// alike.
#[test]
fn a_tokenizer_that_panics_costs_only_the_exact_placement() {
    let real = std::path::PathBuf::from(tokenizer_dir());
    let dir = std::env::temp_dir().join(format!("prefix-router-panicking-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::copy(
        real.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .expect("scripts/real-engine.sh prepare makes .real-engine/tokenizer");
    let json = std::fs::read_to_string(real.join("tokenizer.json")).expect("tokenizer.json");
    let mut tokenizer: serde_json::Value = serde_json::from_str(&json).expect("json");
    tokenizer["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="});
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write");
    let mut p = Publisher::start();
    let extra = format!("tokenizers: {{sim: \"{}\"}}\n", dir.display());
    let (_a, _b, router) = start_with(&p, true, &extra);
    p.wait_ready();
    p.publish(json!([]), "map", false);
    wait_kv(&router, "kv_synced", "replica=\"a\"", 1.0);
    // Tokenized on the async worker (short) and on the blocking pool.
    for turns in [1, 80] {
        let r = router.post("/v1/chat/completions", &agent(turns));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    router.wait_log("tokenizing a prompt panicked");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A publisher that announces a frame of a terabyte, then one just over
/// the 16 MiB a message may hold, then sends empty frames without end (a
/// hostile or broken engine) is disconnected each time before the bytes
/// are buffered: the router keeps serving, the replica's state stays
/// unknown, and it is tried again.
#[test]
fn a_publisher_announcing_a_huge_message_is_disconnected_and_the_router_serves_on() {
    use common::kv::Hostile;
    let what = vec![
        Hostile::Frame(1 << 40),
        Hostile::Frame(17 << 20),
        Hostile::EmptyFrames,
    ];
    let (port, ended) = common::kv::hostile_publisher(what.clone());
    let (_a, _b, router) = start_at(port, None, "");
    for _ in 0..what.len() {
        // Connected, sent its frames, and dropped by the router.
        ended
            .recv_timeout(Duration::from_secs(30))
            .expect("the router closes the connection");
        let r = router.post("/v1/chat/completions", &agent(1));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(kv(&router, "kv_synced", "replica=\"a\""), 0.0);
}
