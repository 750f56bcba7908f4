//! `engine_load`: the router reads each engine's own queue from its
//! `/metrics` and places cold requests on the least-loaded replicas, so load
//! it never saw (clients sent straight to an engine, other router
//! instances) counts; an engine whose metrics cannot be read leaves the
//! router's own counts in force. Real processes: simulators, the router.

mod common;

use std::time::Duration;

use common::http::EventStream;
use common::{streaming, wait_for, Router, Sim, TricklingReplica};

/// A small, slow card: streams sent to it last, and their KV shows.
fn slow_card(name: &str) -> Sim {
    Sim::start(name, &["--kv-tokens", "1000", "--decode-tps", "10"])
}

/// Opens `n` long streams straight to `sim` (not through the router) and
/// waits for their first events, so the engine counts them running.
fn outside_load(sim: &Sim, n: usize) -> Vec<EventStream> {
    (0..n)
        .map(|i| {
            let mut s = EventStream::open(
                sim.addr,
                "/v1/chat/completions",
                &streaming(&format!("outside work {i}"), 250),
            );
            assert_eq!(s.status, 200);
            assert!(s.next_event().is_some(), "the stream started");
            s
        })
        .collect()
}

fn placements(router: &Router, n: usize, tag: &str) -> (usize, usize) {
    let replicas = router.singles(n, tag);
    let on = |name: &str| replicas.iter().filter(|r| *r == name).count();
    (on("a"), on("b"))
}

#[test]
fn singles_keep_off_a_replica_busy_with_requests_the_router_never_saw() {
    let (a, b) = (slow_card("a"), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "engine_load: {interval_ms: 100}\n");
    let _held = outside_load(&a, 3);
    wait_for(
        "the router to read a's engine queue",
        Duration::from_secs(10),
        || (router.metric("prefix_router_engine_requests{replica=\"a\"}") >= 3.0).then_some(()),
    );
    assert_eq!(
        placements(&router, 8, "while a is busy"),
        (0, 8),
        "every single goes to the idle replica"
    );
    let kv = router.metric("prefix_router_engine_kv_used_ratio{replica=\"a\"}");
    assert!(kv > 0.0, "the engine's KV use is shown: {kv}");
}

#[test]
fn an_engine_whose_metrics_cannot_be_read_leaves_the_routers_own_counts() {
    let (a, b) = (slow_card("a"), Sim::start("b", &[]));
    let router = Router::start(
        &[&a, &b],
        "engine_load: {path: /not-metrics, interval_ms: 100}\n",
    );
    let _held = outside_load(&a, 3);
    wait_for("failed reads counted", Duration::from_secs(10), || {
        (router.metric("prefix_router_engine_reads_total{replica=\"a\",result=\"failed\"}") >= 4.0)
            .then_some(())
    });
    assert_eq!(
        placements(&router, 8, "unread"),
        (4, 4),
        "the router's own counts: the plain counter"
    );
    assert_eq!(
        router.metric("prefix_router_engine_requests{replica=\"a\"}"),
        0.0,
        "no figure is shown while none is known"
    );
    let log = router.wait_log("replica a: engine load not readable");
    assert_eq!(
        log.matches("replica a: engine load not readable").count(),
        1,
        "logged once, not per read: {log}"
    );
}

#[test]
fn a_replica_whose_metrics_hang_does_not_stall_reads_of_the_others() {
    let b = Sim::start("b", &[]);
    let hung = TricklingReplica::start();
    let yaml = format!(
        "engine_load: {{interval_ms: 200}}\nreplicas:\n{}{}",
        b.yaml(),
        hung.yaml("a")
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("b", true);
    let reads = |replica: &str, result: &str| {
        router.metric(&format!(
            "prefix_router_engine_reads_total{{replica=\"{replica}\",result=\"{result}\"}}"
        ))
    };
    wait_for("hung reads given up", Duration::from_secs(10), || {
        (reads("a", "failed") >= 4.0).then_some(())
    });
    let before = reads("b", "ok");
    wait_for("b read on while a hangs", Duration::from_secs(10), || {
        (reads("b", "ok") >= before + 3.0).then_some(())
    });
    assert_eq!(
        router.metric("prefix_router_engine_requests{replica=\"b\"}"),
        0.0
    );
    router.wait_log("replica a: engine load not readable");
}
