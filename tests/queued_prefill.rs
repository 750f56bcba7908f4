//! Cold placements pass over a replica with a long prompt still queued for
//! prefill there (`queued_prefill_step_bytes`): the counter alone would send
//! every third one-shot behind it. Real processes: simulators, the router.

mod common;

use std::thread::{self, JoinHandle};
use std::time::Duration;

use common::http::EventStream;
use common::{streaming, wait_for, Router, Sim};

/// Three cards that prefill 1,000 tokens a second: a 10,000-token prompt
/// keeps one busy for ten seconds, a short question takes milliseconds.
fn cards() -> [Sim; 3] {
    ["a", "b", "c"].map(|n| Sim::start(n, &["--prefill-tps", "1000"]))
}

/// Streams a ~40 KB one-shot (10,000 tokens) from another thread (an engine
/// sends nothing, not even the head, before its first token) and waits
/// until a replica has it in flight; returns that replica and the thread,
/// which ends with the stream's status once its first event came.
fn long_prompt(router: &Router) -> (String, JoinHandle<u16>) {
    let doc = "A long document to summarise, one of its many lines. ".repeat(760);
    let addr = router.addr;
    let stream = thread::spawn(move || {
        let mut s = EventStream::open(addr, "/v1/chat/completions", &streaming(&doc, 2));
        s.next_event().map_or(0, |_| s.status)
    });
    let busy = wait_for("the long prompt in flight", Duration::from_secs(10), || {
        ["a", "b", "c"].into_iter().find(|n| {
            router.metric(&format!(
                "prefix_router_in_flight_requests{{replica=\"{n}\"}}"
            )) == 1.0
        })
    });
    (busy.to_owned(), stream)
}

#[test]
fn one_shots_pass_over_a_replica_still_prefilling_a_long_prompt() {
    let [a, b, c] = cards();
    let router = Router::start(&[&a, &b, &c], "");
    let (busy, long) = long_prompt(&router);
    // Three cards: the counter alone would send one of these to the busy one.
    let picks = router.singles(6, "short question");
    assert!(
        !picks.contains(&busy),
        "{busy} is prefilling, yet: {picks:?}"
    );
    let queued = format!("prefix_router_queued_prefill_tokens{{replica=\"{busy}\"}}");
    wait_for("the queued prompt shown", Duration::from_secs(5), || {
        (router.metric(&queued) > 9_000.0).then_some(())
    });
    let others: Vec<_> = ["a", "b", "c"].into_iter().filter(|n| *n != busy).collect();
    assert!(
        others.iter().all(|n| picks.iter().any(|p| p == n)),
        "the counter among the idle ones: {picks:?}"
    );
    assert_eq!(long.join().ok(), Some(200), "prefilled");
    // Answering: nothing is queued there any more, and it takes its turn again.
    let picks = router.singles(3, "later question");
    assert!(picks.contains(&busy), "{picks:?}");
}

#[test]
fn with_queued_prefill_off_the_counter_alone_places_one_shots() {
    let [a, b, c] = cards();
    let router = Router::start(&[&a, &b, &c], "queued_prefill_step_bytes: 0\n");
    let (busy, long) = long_prompt(&router);
    let picks = router.singles(3, "short question");
    assert!(picks.contains(&busy), "the counter's turn: {picks:?}");
    assert_eq!(long.join().ok(), Some(200));
}
