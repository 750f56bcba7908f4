//! What the engines report reusing, read from their responses as they stream
//! past, counted against what the router predicted: real router, real
//! simulators (which report `usage.prompt_tokens_details.cached_tokens`).

mod common;

use std::time::Duration;

use common::http::{self, EventStream, Response};
use common::{agent, get, wait_for, Router, Sim};
use serde_json::json;

/// A series of the router's metrics, which must exist (a misspelt name
/// would otherwise read as 0).
fn series(router: &Router, name: &str, labels: &str) -> f64 {
    let series = format!("prefix_router_{name}{{{labels}}}");
    let text = get(router.metrics_addr, "/metrics").text();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(&series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| {
            // The counters by replica and decision appear with their first
            // count; every other series exists from the start.
            assert!(BY_DECISION.contains(&name), "no series {series}");
            0.0
        })
}

const BY_DECISION: [&str; 4] = [
    "requests_total",
    "predicted_cached_tokens_total",
    "delivered_cached_tokens_total",
    "reported_prompt_tokens_total",
];

/// `(hit, miss)` pin outcomes counted for replica `a`.
fn outcomes(router: &Router) -> (f64, f64) {
    let on_a = |o: &str| {
        let labels = format!("outcome=\"{o}\",replica=\"a\"");
        series(router, "pin_outcomes_total", &labels)
    };
    (on_a("hit"), on_a("miss"))
}

/// Index repairs of replica `a` for `cause`.
fn repairs(router: &Router, cause: &str) -> f64 {
    let labels = format!("cause=\"{cause}\",replica=\"a\"");
    series(router, "index_repairs_total", &labels)
}

/// The index's clock counts whole seconds: wait past the next tick.
fn next_clock_second() {
    std::thread::sleep(Duration::from_millis(1_600));
}

#[test]
fn a_pin_is_checked_against_the_cache_the_engine_reports() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    for turns in 1..=3 {
        let r = router.post("/v1/chat/completions", &agent(turns));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let pin = "decision=\"pin\",replica=\"a\"";
    let predicted = series(&router, "predicted_cached_tokens_total", pin);
    let delivered = series(&router, "delivered_cached_tokens_total", pin);
    let prompt = series(&router, "reported_prompt_tokens_total", pin);
    // Two pinned turns, each reusing the ~1,500-token context.
    assert!(predicted > 3_000.0, "predicted {predicted}");
    // The router counts bytes / 4, the simulator whole 16-token blocks of
    // the same text: within a block per turn of each other.
    assert!(
        (predicted - delivered).abs() <= 2.0 * 16.0 + 8.0,
        "predicted {predicted}, delivered {delivered}"
    );
    assert!(prompt > delivered, "prompt {prompt}, delivered {delivered}");
    assert_eq!(outcomes(&router), (2.0, 0.0));
    // The first turn predicted nothing and reported nothing cached.
    let spread = "decision=\"spread\",replica=\"a\"";
    assert_eq!(
        series(&router, "predicted_cached_tokens_total", spread),
        0.0
    );
    assert_eq!(
        series(&router, "delivered_cached_tokens_total", spread),
        0.0
    );
    assert!(series(&router, "reported_prompt_tokens_total", spread) > 1_000.0);
}

#[test]
fn a_stream_is_counted_from_its_usage_chunk_and_only_when_it_has_one() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let first = router.post("/v1/chat/completions", &agent(1));
    assert_eq!(first.status, 200);
    let pin = "decision=\"pin\",replica=\"a\"";
    let read_all = |body: &serde_json::Value| {
        let mut s = EventStream::open(router.addr, "/v1/chat/completions", body);
        let mut last = String::new();
        while let Some(e) = s.next_event() {
            last = e;
        }
        last
    };
    // Without `stream_options.include_usage` the engine reports nothing,
    // and the router adds nothing to the request.
    let mut quiet = agent(2);
    quiet["stream"] = json!(true);
    assert_eq!(read_all(&quiet), "data: [DONE]");
    assert_eq!(series(&router, "delivered_cached_tokens_total", pin), 0.0);
    assert_eq!(series(&router, "predicted_cached_tokens_total", pin), 0.0);
    let mut asked = agent(3);
    asked["stream"] = json!(true);
    asked["stream_options"] = json!({"include_usage": true});
    assert_eq!(read_all(&asked), "data: [DONE]");
    assert!(series(&router, "delivered_cached_tokens_total", pin) > 1_000.0);
    assert_eq!(outcomes(&router).0, 1.0);
}

#[test]
fn a_restarted_engine_reports_the_pin_missed() {
    let mut a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    for turns in 1..=2 {
        assert_eq!(
            router.post("/v1/chat/completions", &agent(turns)).status,
            200
        );
    }
    // The engine restarts on the same port between health checks: its cache
    // is empty, the router's index still points at it.
    let listen = a.addr.to_string();
    a.kill();
    let _a = Sim::start_on(&listen, "a", &[]);
    let r = router.post("/v1/chat/completions", &agent(3));
    assert_eq!((r.status, r.decision()), (200, "pin"), "{}", r.text());
    assert_eq!(outcomes(&router), (1.0, 1.0));
    // The prefix was placed well under `repair_on_miss_s` (10 s) before: it
    // may have been in its first prefill, so the index is not repaired.
    assert_eq!(repairs(&router, "miss"), 0.0);
}

/// `agent(turns)` with its own system prompt.
fn named(name: &str, turns: usize) -> serde_json::Value {
    let mut body = agent(turns);
    let context = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    body["messages"][0]["content"] = json!(format!("{name}. {context}"));
    body
}

/// Opens conversations named `base 0`, `base 1`, ... until one's first turn
/// lands on `replica` (the counter alternates); returns its name.
fn opened_on(router: &Router, base: &str, replica: &str) -> String {
    opened_as(router, None, base, replica)
}

/// As [`opened_on`], sent with API key `key`.
fn opened_as(router: &Router, key: Option<&str>, base: &str, replica: &str) -> String {
    (0..8)
        .map(|i| format!("{base} {i}"))
        .find(|name| {
            let r = post_as(router, key, &named(name, 1));
            assert_eq!(r.status, 200, "{}", r.text());
            r.replica() == replica
        })
        .expect("the counter reaches every replica")
}

/// A chat request sent with API key `key` (none: as `Router::post`).
fn post_as(router: &Router, key: Option<&str>, body: &serde_json::Value) -> Response {
    let Some(key) = key else {
        return router.post("/v1/chat/completions", body);
    };
    let auth = format!("Bearer {key}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    let bytes = serde_json::to_vec(body).expect("json");
    http::request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &bytes,
    )
}

#[test]
fn pins_two_clients_found_lost_unpin_what_their_replica_held_before_them() {
    // Health checks far apart: the restart below goes unseen by them. A lost
    // pin counts when its prefix is at least a second old. Clients are told
    // apart by their API keys.
    let mut a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let dir = std::env::temp_dir().join(format!("prefix-router-witness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let keys = dir.join("keys");
    let digest = |k: &str| -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(k.as_bytes());
        d.iter().map(|b| format!("{b:02x}")).collect()
    };
    std::fs::write(&keys, format!("{}\n{}\n", digest("k1"), digest("k2"))).expect("keys");
    let extra = format!(
        "health_check: {{interval_ms: 600000}}\nprefix_index: {{repair_on_miss_s: 1}}\napi_keys_file: \"{}\"\n",
        keys.display()
    );
    let router = Router::start(&[&a, &b], &extra);
    let (k1, k2) = (Some("k1"), Some("k2"));
    // Three conversations on `a`: "older", then, later, "lost" and "also"
    // of two clients, whose second turns hit.
    let older = opened_as(&router, k1, "older", "a");
    next_clock_second();
    let lost = opened_as(&router, k1, "lost", "a");
    let also = opened_as(&router, k2, "also", "a");
    for (key, name) in [(k1, &lost), (k2, &also)] {
        let hit = post_as(&router, key, &named(name, 2));
        assert_eq!((hit.replica(), hit.decision()), ("a", "pin"));
    }
    next_clock_second();
    // `a` restarts with an empty cache; the next turns are pinned there and
    // the engine reports nothing reused.
    let listen = a.addr.to_string();
    a.kill();
    let _a = Sim::start_on(&listen, "a", &[]);
    let missed = post_as(&router, k1, &named(&lost, 3));
    assert_eq!((missed.replica(), missed.decision()), ("a", "pin"));
    // One client's lost pin proves its own prompt gone, nothing else.
    assert_eq!(repairs(&router, "miss"), 0.0);
    let missed = post_as(&router, k2, &named(&also, 3));
    assert_eq!((missed.replica(), missed.decision()), ("a", "pin"));
    // The repair runs off the request's thread, just after the answer.
    wait_for(
        "the repair after two lost pins",
        Duration::from_secs(10),
        || (repairs(&router, "miss") > 0.0).then_some(()),
    );
    assert_eq!(
        (repairs(&router, "miss"), repairs(&router, "restart")),
        (1.0, 0.0)
    );
    // "older" sat on `a` from before: forgotten, its next turn is placed on
    // merit (the counter), not sent to a cache that is gone.
    let next = post_as(&router, k1, &named(&older, 2));
    assert_eq!(next.decision(), "spread", "{}", next.replica());
    // "lost" was prefilled again by the turn that missed: it stays.
    let again = post_as(&router, k1, &named(&lost, 4));
    assert_eq!((again.replica(), again.decision()), ("a", "pin"));
}

#[test]
fn a_client_resending_a_prefix_with_other_tools_is_not_pinned_and_wipes_nothing() {
    // The chat template renders the tool list before the messages: the same
    // messages with another tool list share no cached tokens. Were it pinned
    // by its text, the engine would report ~0 cached and the repair would
    // forget what `a` held from before, other clients' conversations too.
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let extra = "health_check: {interval_ms: 600000}\nprefix_index: {repair_on_miss_s: 1}\n";
    let router = Router::start(&[&a, &b], extra);
    let victim = opened_on(&router, "victim", "a");
    next_clock_second();
    let hostile = opened_on(&router, "hostile", "a");
    next_clock_second();
    let mut other_tools = named(&hostile, 1);
    other_tools["tools"] = json!([{"type": "function", "function": {"name": "wipe"}}]);
    let r = router.post("/v1/chat/completions", &other_tools);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(r.decision(), "pin", "{}", r.replica());
    assert_eq!(repairs(&router, "miss"), 0.0);
    // Its own tool list, resent, is a conversation of its own.
    let again = router.post("/v1/chat/completions", &other_tools);
    assert_eq!((again.replica(), again.decision()), (r.replica(), "pin"));
    let next = router.post("/v1/chat/completions", &named(&victim, 2));
    assert_eq!((next.replica(), next.decision()), ("a", "pin"));
    assert_eq!(outcomes(&router).1, 0.0, "no pin missed");
}

#[test]
fn a_replica_back_from_a_failed_health_check_starts_with_no_pins() {
    let mut a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    let name = opened_on(&router, "conversation", "a");
    let listen = a.addr.to_string();
    a.kill();
    router.wait_replica_up("a", false);
    let _a = Sim::start_on(&listen, "a", &[]);
    router.wait_replica_up("a", true);
    assert_eq!(repairs(&router, "restart"), 1.0);
    let next = router.post("/v1/chat/completions", &named(&name, 2));
    assert_eq!(next.decision(), "spread");
}

#[test]
fn a_request_that_tells_the_engine_to_skip_its_cache_is_no_evidence() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    assert_eq!(router.post("/v1/chat/completions", &agent(1)).status, 200);
    for (key, value) in [
        ("cache_prompt", json!(false)),
        ("prompt_logprobs", json!(1)),
    ] {
        let mut body = agent(2);
        body[key] = value;
        let r = router.post("/v1/chat/completions", &body);
        assert_eq!((r.status, r.decision()), (200, "pin"), "{key}");
    }
    // None counted: the engine may well report nothing cached for them.
    let pin = "decision=\"pin\",replica=\"a\"";
    assert_eq!(series(&router, "predicted_cached_tokens_total", pin), 0.0);
    assert_eq!(outcomes(&router).0, 0.0);
    // `cache_prompt: true` asks for the cache: counted.
    let mut body = agent(3);
    body["cache_prompt"] = json!(true);
    assert_eq!(router.post("/v1/chat/completions", &body).status, 200);
    assert_eq!(outcomes(&router).0, 1.0);
}

#[test]
fn a_cache_salt_keeps_a_prefix_within_its_salt_and_its_reuse_counts() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let salted = |turn, salt: &str| {
        let mut body = agent(turn);
        body["cache_salt"] = json!(salt);
        body
    };
    let first = router.post("/v1/chat/completions", &salted(1, "tenant-7"));
    assert_eq!(first.status, 200);
    // The same conversation under another salt, or none, shares nothing with
    // it (the engine keeps salts apart): placed cold, and its decision tells
    // its sender nothing about tenant 7's prompts.
    for other in [salted(2, "tenant-8"), agent(2)] {
        let r = router.post("/v1/chat/completions", &other);
        assert_eq!((r.status, r.decision()), (200, "spread"));
    }
    // Tenant 7's next turn pins, and what its engine reports is evidence.
    let next = router.post("/v1/chat/completions", &salted(2, "tenant-7"));
    assert_eq!((next.replica(), next.decision()), (first.replica(), "pin"));
    assert_eq!(outcomes(&router), (1.0, 0.0), "a hit");
    // An explicit conversation key is kept within its salt too.
    let keyed = |salt: &str| {
        let mut body = salted(1, salt);
        body["prompt_cache_key"] = json!("session-1");
        body["messages"][1]["content"] = json!(format!("{salt}: something else"));
        body
    };
    let r = router.post("/v1/chat/completions", &keyed("tenant-7"));
    assert_eq!(r.status, 200);
    let r = router.post("/v1/chat/completions", &keyed("tenant-9"));
    assert_eq!((r.status, r.decision()), (200, "spread"), "not `key`");
    let r = router.post("/v1/chat/completions", &keyed("tenant-7"));
    assert_eq!(r.decision(), "key");
}
