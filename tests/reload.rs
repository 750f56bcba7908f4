//! Hot reload, black-box: the config file is edited under a running router.

mod common;

use std::time::Duration;

use common::http::EventStream;
use common::{conversation, wait_for, Router, Sim};
use serde_json::json;

const FAST_HEALTH: &str = "health_check: {interval_ms: 200}\n";

fn wait_reloads(router: &Router, result: &str, n: f64) {
    let series = format!("prefix_router_config_reloads_total{{result=\"{result}\"}}");
    wait_for(&format!("{series} == {n}"), Duration::from_secs(10), || {
        (router.metric(&series) == n).then_some(())
    });
}

#[test]
fn an_added_replica_joins_only_after_its_first_passing_check() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &["--loading-ms", "600000"]);
    let router = Router::start(&[&a], FAST_HEALTH);
    router.rewrite(&Router::yaml(&[&a, &b], FAST_HEALTH));
    wait_reloads(&router, "ok", 1.0);
    let picks = router.singles(6, "q");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
    assert_eq!(b.stats()["requests"], 0, "a loading replica got traffic");
    b.set_healthy(true);
    router.wait_replica_up("b", true);
    let picks = router.singles(4, "r");
    assert_eq!(picks.iter().filter(|p| *p == "b").count(), 2, "{picks:?}");
}

#[test]
fn a_removed_replica_drains_and_its_pins_move() {
    let (a, b) = (
        Sim::start("a", &["--decode-tps", "10"]),
        Sim::start("b", &["--decode-tps", "10"]),
    );
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    // Find a conversation pinned to b.
    let topic = (0..10)
        .map(|i| format!("topic{i}"))
        .find(|t| {
            router
                .post("/v1/chat/completions", &conversation(t, 0))
                .replica()
                == "b"
        })
        .expect("the counter reaches b");
    // A stream in flight on b while b is removed.
    let mut body = conversation(&topic, 1);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(20);
    let mut stream = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert_eq!(stream.header("x-prefix-router-replica"), Some("b"));
    router.rewrite(&Router::yaml(&[&a], FAST_HEALTH));
    wait_reloads(&router, "ok", 1.0);
    let mut events = 0;
    let mut last = String::new();
    while let Some(ev) = stream.next_event() {
        events += 1;
        last = ev;
    }
    assert_eq!(
        (events, last.as_str()),
        (22, "data: [DONE]"),
        "the in-flight stream was cut"
    );
    let moved = router.post("/v1/chat/completions", &conversation(&topic, 2));
    assert_eq!(moved.status, 200);
    assert_eq!(moved.replica(), "a");
    let again = router.post("/v1/chat/completions", &conversation(&topic, 3));
    assert_eq!((again.replica(), again.decision()), ("a", "pin"));
}

#[test]
fn an_invalid_file_is_rejected_and_the_previous_list_stays() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    router.write_raw("replicas:\n  - {name: a, adress: \"127.0.0.1:1\"}\n");
    wait_reloads(&router, "error", 1.0);
    router.write_raw("replicas: [[[\n");
    wait_reloads(&router, "error", 2.0);
    let picks = router.singles(4, "q");
    assert_eq!(picks.iter().filter(|p| *p == "a").count(), 2, "{picks:?}");
    assert_eq!(
        router.metric("prefix_router_config_reloads_total{result=\"ok\"}"),
        0.0
    );
}
