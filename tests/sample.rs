//! Placement in a large fleet (`sample`): a placement reads one window of
//! the replicas and those holding the prompt's prefix, not every replica.
//! Nine simulated replicas stand for a large fleet (`above: 4`, windows of
//! three); one worker thread places the requests one after another.

mod common;

use std::collections::HashMap;

use common::http::EventStream;
use common::{conversation, streaming, Router, Sim};

const SAMPLED: &str = "threads: 1\nsample: {above: 4, replicas: 3}\n";

fn fleet(n: usize, args: &[&str]) -> Vec<Sim> {
    (0..n).map(|i| Sim::start(&format!("s{i}"), args)).collect()
}

fn open(router: &Router, text: &str, max_tokens: u64) -> (EventStream, String) {
    open_body(router, &streaming(text, max_tokens))
}

fn open_body(router: &Router, body: &serde_json::Value) -> (EventStream, String) {
    let path = "/v1/chat/completions";
    let s = EventStream::open(router.addr, path, body);
    assert_eq!(s.status, 200);
    let replica = s
        .header("x-prefix-router-replica")
        .expect("placed")
        .to_owned();
    (s, replica)
}

#[test]
fn a_busy_replica_is_passed_over_while_its_window_has_an_idle_one() {
    // Slow decoding: the held stream stays in flight for the whole test.
    let sims = fleet(9, &["--decode-tps", "5"]);
    let router = Router::start(&sims.iter().collect::<Vec<_>>(), SAMPLED);
    let (_held, busy) = open(&router, "a long answer", 1000);
    // The counter over all nine would reach the busy one twice in 18.
    let mut placed: HashMap<String, usize> = HashMap::new();
    for replica in router.singles(18, "quick") {
        *placed.entry(replica).or_default() += 1;
    }
    assert!(!placed.contains_key(&busy), "{busy} is busy: {placed:?}");
    assert_eq!(
        placed.len(),
        8,
        "every idle replica takes a share: {placed:?}"
    );
    assert!(placed.values().all(|n| *n >= 2), "{placed:?}");
}

#[test]
fn a_burst_behind_one_system_prompt_reaches_every_replica_once() {
    let sims = fleet(9, &["--decode-tps", "5"]);
    let router = Router::start(&sims.iter().collect::<Vec<_>>(), SAMPLED);
    // One long system prompt: each request's prefix is held by the replica
    // of the one before, busy, which a cold placement must not be offered.
    let system = "You answer questions about the product manual. ".repeat(100);
    // Each stream stays open while the next is placed.
    let streams: Vec<_> = (0..9)
        .map(|i| {
            let mut body = streaming(&format!("burst question {i}"), 1000);
            body["messages"][0]["content"] = serde_json::json!(system);
            open_body(&router, &body)
        })
        .collect();
    let mut replicas: Vec<&str> = streams.iter().map(|(_, r)| r.as_str()).collect();
    replicas.sort_unstable();
    replicas.dedup();
    assert_eq!(replicas.len(), 9, "{replicas:?}");
}

#[test]
fn a_conversation_stays_on_its_replica_whichever_window_is_read() {
    let sims = fleet(9, &[]);
    let router = Router::start(&sims.iter().collect::<Vec<_>>(), SAMPLED);
    let mut home = None;
    // Windows take turns, so most turns are placed with their replica
    // outside the window: it is offered as the prefix's holder.
    for turn in 0..7 {
        let r = router.post("/v1/chat/completions", &conversation("sampled", turn));
        assert_eq!(r.status, 200, "{}", r.text());
        let home = home.get_or_insert_with(|| r.replica().to_owned());
        assert_eq!(r.replica(), home, "turn {turn}");
        if turn > 0 {
            assert_eq!(r.decision(), "pin", "turn {turn}");
        }
    }
}
