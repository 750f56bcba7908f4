//! The Responses API through the router: bodies are read like chat (a
//! stateless loop that re-sends its items is pinned by prefix), and a turn
//! naming `previous_response_id` goes to the replica that produced that
//! response, learned from the response as it passed (JSON or SSE); `GET` and
//! `DELETE /v1/responses/{id}` too. The simulator keeps responses like an
//! engine, so a turn sent elsewhere fails with its 404. Real processes.

mod common;

use std::time::Duration;

use common::http::{request, EventStream};
use common::{get, wait_for, Router, Sim};
use serde_json::{json, Value};

const FAST_HEALTH: &str = "health_check: {interval_ms: 100}\n";

fn turn(input: &str, previous: Option<&str>) -> Value {
    let mut body = json!({"model": "sim", "input": input, "max_output_tokens": 2});
    if let Some(id) = previous {
        body["previous_response_id"] = json!(id);
    }
    body
}

#[test]
fn turns_naming_a_previous_response_go_to_the_replica_that_holds_it() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    // Four conversations, interleaved, five turns each: the counter puts
    // their first turns on both replicas; a later turn anywhere else is a 404.
    let mut last: Vec<(String, String)> = (0..4)
        .map(|c| {
            let r = router.post("/v1/responses", &turn(&format!("conversation {c}"), None));
            assert_eq!(r.status, 200, "{}", r.text());
            let id = r.json()["id"].as_str().expect("id").to_owned();
            (id, r.replica().to_owned())
        })
        .collect();
    let homes: std::collections::BTreeSet<_> = last.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(homes.len(), 2, "first turns spread: {last:?}");
    for step in 1..5 {
        for (c, (id, home)) in last.iter_mut().enumerate() {
            let r = router.post(
                "/v1/responses",
                &turn(&format!("c{c} step {step}"), Some(id)),
            );
            assert_eq!(r.status, 200, "conversation {c} step {step}: {}", r.text());
            assert_eq!(r.replica(), home.as_str());
            assert_eq!(r.decision(), "key");
            *id = r.json()["id"].as_str().expect("id").to_owned();
        }
    }
    assert_eq!(router.metric("prefix_router_response_ids"), 20.0);

    // GET and DELETE reach the holder too.
    let (id, _) = &last[0];
    assert_eq!(get(router.addr, &format!("/v1/responses/{id}")).status, 200);
    let deleted = request(
        router.addr,
        "DELETE",
        &format!("/v1/responses/{id}"),
        &[],
        b"",
    );
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    assert_eq!(deleted.json()["deleted"], true);
    assert_eq!(router.metric("prefix_router_response_ids"), 19.0);
}

#[test]
fn a_streamed_response_is_learned_from_its_first_event() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    let mut homes = Vec::new();
    for c in 0..2 {
        let mut body = turn(&format!("streamed {c}"), None);
        body["stream"] = json!(true);
        let mut s = EventStream::open(router.addr, "/v1/responses", &body);
        assert_eq!(s.status, 200);
        let home = s
            .header("x-prefix-router-replica")
            .expect("replica")
            .to_owned();
        let first = s.next_event().expect("response.created");
        let data: Value = serde_json::from_str(
            first
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .expect("data"),
        )
        .expect("json");
        let id = data["response"]["id"].as_str().expect("id").to_owned();
        let mut last = String::new();
        while let Some(e) = s.next_event() {
            last = e;
        }
        assert!(last.contains("response.completed"), "{last}");
        homes.push((id, home));
    }
    for (id, home) in &homes {
        let r = router.post("/v1/responses", &turn("next", Some(id)));
        assert_eq!(
            (r.status, r.replica()),
            (200, home.as_str()),
            "{}",
            r.text()
        );
    }
}

#[test]
fn a_turn_whose_replica_is_down_is_told_so_not_sent_elsewhere() {
    let mut a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    let (mut on_a, mut sent) = (None, 0);
    while on_a.is_none() {
        let r = router.post("/v1/responses", &turn("where am I", None));
        assert_eq!(r.status, 200);
        if r.replica() == "a" {
            on_a = r.json()["id"].as_str().map(str::to_owned);
        }
        sent += 1;
        assert!(sent < 10);
    }
    a.kill();
    router.wait_replica_up("a", false);
    let before = b.received();
    let r = router.post("/v1/responses", &turn("still there?", on_a.as_deref()));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "response_unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        b.received(),
        before,
        "not sent to a replica without its state"
    );
}

#[test]
fn stateless_loops_are_pinned_by_prefix_and_store_false_is_not_learned() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    let mut items = vec![json!({"role": "user", "content": "list the files"})];
    let mut home = String::new();
    for step in 0..4 {
        let body = json!({"model": "sim", "store": false, "max_output_tokens": 2,
            "instructions": "You are an agent.", "input": items});
        let r = router.post("/v1/responses", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        if step == 0 {
            home = r.replica().to_owned();
        } else {
            assert_eq!(
                (r.replica(), r.decision()),
                (home.as_str(), "pin"),
                "step {step}"
            );
        }
        items.push(json!({"type": "function_call", "call_id": format!("c{step}"), "name": "ls", "arguments": "{}"}));
        items.push(json!({"type": "function_call_output", "call_id": format!("c{step}"), "output": format!("file{step}.txt")}));
    }
    assert_eq!(
        router.metric("prefix_router_response_ids"),
        0.0,
        "store: false keeps nothing"
    );
    wait_for("usage counted", Duration::from_secs(5), || {
        (router.metric(&format!(
            "prefix_router_delivered_cached_tokens_total{{decision=\"pin\",replica=\"{home}\"}}"
        )) > 0.0)
            .then_some(())
    });
}
