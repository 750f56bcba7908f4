//! Black-box tests of the proxy path: the real binary, real replica-sim
//! processes, real HTTP. Placement, bodies byte for byte, SSE, bad input.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::http::{self, EventStream, Framing};
use common::{conversation, single, streaming, wait_for, RawReplica, Router, Sim};
use serde_json::json;

#[test]
fn a_response_whose_chunk_head_spans_reads_and_whose_chunks_outgrow_the_buffer_arrives_whole() {
    // A response body is read 2 KiB at a time at first, more as reads fill
    // the buffer: a 6,000-byte chunk extension is a chunk head no first read
    // holds whole, and 100 KB chunks make the buffer grow, twice over one
    // kept connection.
    let content = "0123456789".repeat(30_000);
    let body = json!({"id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
    .to_string();
    let (first, rest) = body.split_at(10);
    let mut wire = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
         {:x};ext={}\r\n{first}\r\n",
        first.len(),
        "e".repeat(6_000)
    )
    .into_bytes();
    for piece in rest.as_bytes().chunks(100_000) {
        wire.extend(format!("{:x}\r\n", piece.len()).bytes());
        wire.extend(piece);
        wire.extend(b"\r\n");
    }
    wire.extend(b"0\r\n\r\n");
    let replica = RawReplica::start(wire);
    let router = Router::spawn(&format!("replicas:\n{}", replica.yaml("raw")), &[]);
    router.wait_replica_up("raw", true);
    for i in 0..2 {
        let r = router.post("/v1/chat/completions", &single(&format!("long head {i}")));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.text() == body,
            "the body differs ({} bytes of {})",
            r.body.len(),
            body.len()
        );
    }
}

#[test]
fn multi_turn_conversations_stay_on_their_replica() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let mut homes: HashMap<&str, String> = HashMap::new();
    for turn in 0..6 {
        for topic in ["alpha", "beta", "gamma"] {
            router.post(
                "/v1/chat/completions",
                &single(&format!("noise {topic} {turn}")),
            );
            let r = router.post("/v1/chat/completions", &conversation(topic, turn));
            assert_eq!(r.status, 200, "{}", r.text());
            let home = homes.entry(topic).or_insert_with(|| r.replica().to_owned());
            assert_eq!(r.replica(), home, "{topic} moved at turn {turn}");
            if turn > 0 {
                assert_eq!(r.decision(), "pin");
            }
            assert_eq!(r.header("x-sim-replica"), Some(home.as_str()));
        }
    }
}

#[test]
fn a_burst_of_singles_is_spread_over_both_replicas() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let addr = router.addr;
    let replicas: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                s.spawn(move || {
                    let r = http::post_json(
                        addr,
                        "/v1/chat/completions",
                        &single(&format!("burst question {i}")),
                    );
                    assert_eq!(r.status, 200);
                    assert_eq!(r.decision(), "spread");
                    r.replica().to_owned()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let on_a = replicas.iter().filter(|r| *r == "a").count();
    assert_eq!(
        on_a, 4,
        "counter spread should split 8 singles 4/4: {replicas:?}"
    );
}

#[test]
fn bodies_reach_the_replica_byte_for_byte_at_every_size_and_framing() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 16777216\n");
    for size in [70 * 1024, 1 << 20, 8 << 20] {
        let filler = "x".repeat(size);
        let body = serde_json::to_vec(&json!({"model": "sim", "max_tokens": 1, "prompt": filler}))
            .unwrap();
        let want = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&body));
        for framing in [Framing::ContentLength, Framing::Chunked(64 * 1024 + 7)] {
            let r = http::send(router.addr, "POST", "/v1/completions", &[], &body, framing)
                .unwrap_or_else(|e| panic!("{size} {framing:?}: {e}"));
            assert_eq!(r.status, 200, "{size} {framing:?}: {}", r.text());
            assert_eq!(
                r.header("x-sim-body-bytes"),
                Some(body.len().to_string().as_str()),
                "{size} {framing:?}"
            );
            assert_eq!(
                r.header("x-sim-body-xxh3"),
                Some(want.as_str()),
                "{size} {framing:?}"
            );
        }
    }
}

#[test]
fn expect_100_continue_is_answered_and_the_body_forwarded() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let body = serde_json::to_vec(&single("continue please")).unwrap();
    let r = http::request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[("expect", "100-continue")],
        &body,
    );
    assert!(r.continued, "no 100 Continue before the body");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-sim-body-bytes"),
        Some(body.len().to_string().as_str())
    );
}

#[test]
fn sse_events_arrive_as_they_are_generated() {
    // 10 tokens at 5 tokens/s: the replica spends ~2 s generating.
    let a = Sim::start("a", &["--decode-tps", "5"]);
    let router = Router::start(&[&a], "");
    let body = streaming("stream please", 10);
    let mut s = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    let mut arrivals = Vec::new();
    let start = Instant::now();
    while let Some(ev) = s.next_event() {
        arrivals.push((start.elapsed(), ev));
    }
    assert_eq!(
        arrivals.last().map(|(_, e)| e.as_str()),
        Some("data: [DONE]")
    );
    assert_eq!(arrivals.len(), 12, "role, 10 tokens, [DONE]");
    // Buffering would deliver everything at once, after generation ended.
    let first = arrivals[1].0;
    let last = arrivals[arrivals.len() - 1].0;
    assert!(
        last - first >= Duration::from_millis(1200),
        "events bunched: {arrivals:?}"
    );
}

#[test]
fn a_client_that_disconnects_cancels_the_replica_request() {
    let a = Sim::start("a", &["--decode-tps", "5"]);
    let router = Router::start(&[&a], "");
    let body = streaming("long stream", 1000);
    let mut s = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert!(s.next_event().is_some());
    assert!(s.next_event().is_some());
    let in_flight = || router.metric("prefix_router_in_flight_requests{replica=\"a\"}");
    let wait_in_flight = |n: f64| {
        wait_for(&format!("{n} in flight"), Duration::from_secs(5), || {
            (in_flight() == n).then_some(())
        })
    };
    wait_in_flight(1.0);
    drop(s);
    wait_for(
        "the replica to see the cancellation",
        Duration::from_secs(10),
        || {
            let st = a.stats();
            (st["cancelled"] == 1 && st["running"] == 0).then_some(())
        },
    );
    wait_in_flight(0.0);
}

#[test]
fn invalid_json_is_forwarded_and_answered_by_the_engine() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let r = http::request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        b"{not json",
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.decision(), "spread");
    assert!(r.json()["error"]["message"].is_string());
    // The router is unaffected.
    assert_eq!(
        router.post("/v1/chat/completions", &single("fine")).status,
        200
    );
}

#[test]
fn a_body_over_the_limit_gets_413_as_openai_json() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 1000\n");
    let big = serde_json::to_vec(&single(&"y".repeat(5000))).unwrap();
    for framing in [Framing::ContentLength, Framing::Chunked(100)] {
        let r = http::send(
            router.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            &big,
            framing,
        )
        .expect("response");
        assert_eq!(r.status, 413, "{framing:?}");
        let e = r.json();
        assert_eq!(e["error"]["code"], "body_too_large");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    assert_eq!(a.stats()["requests"], 0, "nothing reached the replica");
    assert_eq!(
        router.post("/v1/chat/completions", &single("small")).status,
        200
    );
}

#[test]
fn a_body_that_stalls_gets_408_and_other_requests_are_unaffected() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "body_read_timeout_ms: 300\n");
    let addr = router.addr;
    let stalled = std::thread::spawn(move || {
        http::send_stalled(addr, "/v1/chat/completions", 1000, b"{\"messages\"")
    });
    assert_eq!(
        router
            .post("/v1/chat/completions", &single("meanwhile"))
            .status,
        200
    );
    let r = stalled.join().expect("thread");
    assert_eq!(r.status, 408);
    assert_eq!(r.json()["error"]["code"], "body_timeout");
}

#[test]
fn other_paths_are_proxied_with_the_counter() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let r1 = http::get(router.addr, "/metrics");
    let r2 = http::get(router.addr, "/metrics");
    assert_eq!((r1.status, r2.status), (200, 200));
    assert_ne!(r1.replica(), r2.replica());
    assert!(r1.text().contains("vllm:num_requests_running"));
    let models = http::get(router.addr, "/v1/models");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "sim");
    let emb = router.post("/v1/embeddings", &json!({"input": "x".repeat(100_000)}));
    assert_eq!(emb.status, 200);
    assert!(emb.json()["x_body_bytes"].as_u64().unwrap() > 100_000);
}

#[test]
fn policy_env_var_overrides_the_config() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let rr = Router::start_with_env(
        &[&a, &b],
        "policy: shape\n",
        &[("PREFIX_ROUTER_POLICY", "roundrobin")],
    );
    let picks: Vec<String> = (0..4)
        .map(|t| {
            rr.post("/v1/chat/completions", &conversation("rr", t))
                .replica()
                .to_owned()
        })
        .collect();
    assert_ne!(picks[0], picks[1], "roundrobin must not pin: {picks:?}");
    assert_ne!(picks[1], picks[2], "roundrobin must not pin: {picks:?}");
    drop(rr);
    let aff = Router::start_with_env(
        &[&a, &b],
        "policy: shape\n",
        &[("PREFIX_ROUTER_POLICY", "affinity")],
    );
    let system = "shared system prompt ".repeat(200);
    let answers: Vec<(u16, String, String)> = (0..4)
        .map(|i| {
            let body = json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("q{i}")}]});
            let r = aff.post("/v1/chat/completions", &body);
            (r.status, r.replica().to_owned(), r.text())
        })
        .collect();
    assert!(
        answers
            .iter()
            .all(|(s, p, _)| *s == 200 && *p == answers[0].1),
        "affinity must pin shared prefixes: {answers:?}\nrouter log: {}",
        aff.log()
    );
}

#[test]
fn metrics_count_requests_by_replica_and_decision() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    router.post("/v1/chat/completions", &conversation("m", 0));
    router.post("/v1/chat/completions", &conversation("m", 1));
    let pin = router.metric(
        "prefix_router_requests_total{decision=\"pin\",replica=\"a\",shape=\"continuation\"}",
    );
    let spread = router
        .metric("prefix_router_requests_total{decision=\"spread\",replica=\"a\",shape=\"single\"}");
    assert_eq!((pin, spread), (1.0, 1.0));
    wait_for("the prefix index gauges", Duration::from_secs(5), || {
        (router.metric("prefix_router_prefix_index_entries") > 0.0
            && router.metric("prefix_router_prefix_index_bytes") > 0.0)
            .then_some(())
    });
}

#[test]
fn a_long_conversation_is_read_from_where_its_last_turn_ended() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    // An agent whose tool results make every turn's body 40 KiB and more.
    let mut messages = vec![json!({"role": "system", "content": "You are an agent."})];
    let body = |turn: usize, messages: &mut Vec<serde_json::Value>| {
        messages.push(json!({"role": "user", "content": format!("step {turn}")}));
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}")}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": format!("line {turn}\n\"quoted\"\n").repeat(3000)}));
        serde_json::to_vec(
            &json!({"model": "sim", "max_tokens": 1, "messages": messages, "stream": false}),
        )
        .unwrap()
    };
    let send = |body: &[u8]| {
        let r = http::request(router.addr, "POST", "/v1/chat/completions", &[], body);
        let want = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(body));
        assert_eq!(
            r.header("x-sim-body-xxh3"),
            Some(want.as_str()),
            "forwarded as sent"
        );
        r
    };
    let from = |how: &str| {
        router.metric(&format!(
            "prefix_router_long_body_parses_total{{from=\"{how}\"}}"
        ))
    };
    let mut home = None;
    let mut last = Vec::new();
    for turn in 0..4 {
        router.post("/v1/chat/completions", &single(&format!("noise {turn}")));
        last = body(turn, &mut messages);
        assert!(last.len() > 40 << 10);
        let r = send(&last);
        assert_eq!(r.status, 200, "{}", r.text());
        let home = home.get_or_insert_with(|| r.replica().to_owned());
        assert_eq!(r.replica(), home, "turn {turn}");
        if turn > 0 {
            assert_eq!(r.decision(), "pin", "turn {turn}");
        }
    }
    // The first turn read whole, each later one from the turn before.
    assert_eq!((from("start"), from("checkpoint")), (1.0, 3.0));
    assert!(router.metric("prefix_router_checkpoint_bytes") > 0.0);
    // The same prefix with a broken tail: forwarded, spread, answered by the
    // engine; the conversation's next turn still resumes and pins.
    let mut broken = last[..last.len() - 2].to_vec();
    broken.extend_from_slice(b",{\"role\":}]}");
    let r = send(&broken);
    assert_eq!((r.status, r.decision()), (400, "spread"));
    let next = body(4, &mut messages);
    let r = send(&next);
    assert_eq!((r.status, r.decision()), (200, "pin"));
    assert_eq!(r.replica(), home.as_deref().unwrap());
    assert_eq!(from("checkpoint"), 4.0);
}

#[test]
fn a_checkpoint_too_large_for_what_the_store_keeps_displaces_no_other() {
    let sim = Sim::start("a", &[]);
    // A conversation `tag` whose first message is `size` bytes, at turn `turn`.
    let body = |tag: &str, size: usize, turn: usize| {
        let mut messages = vec![
            json!({"role": "user", "content": format!("{tag} {}", "notes ".repeat(size / 6))}),
        ];
        for t in 0..turn {
            messages.push(json!({"role": "assistant", "content": format!("done {t}")}));
            messages.push(json!({"role": "user", "content": format!("next {t}")}));
        }
        serde_json::to_vec(&json!({"model": "sim", "max_tokens": 1, "messages": messages})).unwrap()
    };
    let (small, large) = (body("small", 40 << 10, 0), body("large", 160 << 10, 0));
    let from = |router: &Router, how: &str| {
        router.metric(&format!(
            "prefix_router_long_body_parses_total{{from=\"{how}\"}}"
        ))
    };
    let send = |router: &Router, body: &[u8]| {
        http::request(router.addr, "POST", "/v1/chat/completions", &[], body).status
    };
    // What the large turn's checkpoint holds, in a store with room.
    let probe = Router::start(&[&sim], "");
    assert_eq!(send(&probe, &large), 200);
    let held = probe.metric("prefix_router_checkpoint_bytes") as usize;
    drop(probe);
    // A budget it fits, but not what a trim leaves (15/16 of it).
    let budget = held + held / 32;
    let router = Router::start(
        &[&sim],
        &format!("limits: {{max_checkpoint_bytes: {budget}}}\n"),
    );
    for b in [&small, &large] {
        assert_eq!(send(&router, b), 200);
    }
    // The small conversation's checkpoint is still there: its next turn resumes.
    let next = body("small", 40 << 10, 1);
    assert_eq!(send(&router, &next), 200);
    assert_eq!(
        (from(&router, "start"), from(&router, "checkpoint")),
        (2.0, 1.0)
    );
    let kept = router.metric("prefix_router_checkpoint_bytes") as usize;
    assert!(kept > 0 && kept < held, "{kept} bytes held");
}

#[test]
fn a_full_checkpoint_store_is_trimmed_below_its_budget() {
    let sim = Sim::start("a", &[]);
    // Conversations of one size (40 KiB first turns), told apart by a digit.
    let body = |i: usize| {
        let text = format!("c{i} {}", "notes ".repeat((40 << 10) / 6));
        serde_json::to_vec(&json!({"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}))
            .unwrap()
    };
    let send = |router: &Router, body: &[u8]| {
        http::request(router.addr, "POST", "/v1/chat/completions", &[], body).status
    };
    let held = |router: &Router| router.metric("prefix_router_checkpoint_bytes") as usize;
    let probe = Router::start(&[&sim], "");
    assert_eq!(send(&probe, &body(0)), 200);
    let one = held(&probe);
    drop(probe);
    // Room for five and a little: the sixth is over, and trimmed to the
    // budget exactly the store would keep five, over 15/16 of it.
    let budget = 5 * one + one / 20;
    let router = Router::start(
        &[&sim],
        &format!("limits: {{max_checkpoint_bytes: {budget}}}\n"),
    );
    for i in 0..6 {
        assert_eq!(send(&router, &body(i)), 200);
    }
    assert!(
        held(&router) <= budget - budget / 16,
        "{} of {budget} bytes held",
        held(&router)
    );
    assert!(
        held(&router) >= 3 * one,
        "only the oldest dropped: {} bytes",
        held(&router)
    );
}

#[test]
fn the_engines_native_generation_paths_are_placed_by_prompt() {
    // llama.cpp's `/completion`, SGLang's `/generate` (`text`), vLLM's
    // `/invocations`: a prompt that extends one sent before goes back to its
    // replica, as on `/v1/completions` (the simulators answer these paths
    // 404; the placement is what is looked at).
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let context = "A long shared document about the topic at hand. ".repeat(40);
    for (path, field) in [
        ("/completion", "prompt"),
        ("/generate", "text"),
        ("/invocations", "prompt"),
    ] {
        let first = router.post(path, &json!({field: format!("{path} {context}")}));
        let more = json!({field: format!("{path} {context} and a follow-up")});
        let next = router.post(path, &more);
        assert_eq!(
            (next.replica(), next.decision()),
            (first.replica(), "pin"),
            "{path}"
        );
    }
}
