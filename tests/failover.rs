//! Failover and health, black-box: replicas stopped, restarted, not yet loaded.

mod common;

use std::time::Duration;

use common::{conversation, single, wait_for, Router, Sim};

/// Health checks every minute: only the request path can notice an outage in time.
const SLOW_HEALTH: &str = "health_check: {interval_ms: 60000}\n";

#[test]
fn six_requests_during_a_replica_stop_all_succeed_with_one_failover() {
    let (a, mut b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], SLOW_HEALTH);
    b.kill();
    let picks = router.singles(6, "during stop");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
    assert_eq!(
        router.metric("prefix_router_failovers_total{replica=\"b\"}"),
        1.0
    );
    assert_eq!(
        router.metric("prefix_router_replica_up{replica=\"b\"}"),
        0.0
    );
}

#[test]
fn a_pinned_conversation_moves_when_its_replica_dies_and_stays_moved() {
    let (mut a, mut b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], SLOW_HEALTH);
    let first = router.post("/v1/chat/completions", &conversation("moving", 0));
    let home = first.replica().to_owned();
    let (dead, other) = if home == "a" {
        (&mut a, "b")
    } else {
        (&mut b, "a")
    };
    dead.kill();
    let moved = router.post("/v1/chat/completions", &conversation("moving", 1));
    assert_eq!(moved.status, 200);
    assert_eq!(moved.replica(), other);
    assert_eq!(moved.decision(), "fallback");
    let next = router.post("/v1/chat/completions", &conversation("moving", 2));
    assert_eq!((next.replica(), next.decision()), (other, "pin"));
}

#[test]
fn all_replicas_down_is_an_immediate_503_in_openai_json() {
    let (mut a, mut b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], SLOW_HEALTH);
    a.kill();
    b.kill();
    for _ in 0..3 {
        let r = router.post("/v1/chat/completions", &single("anyone?"));
        assert_eq!(r.status, 503);
        let e = r.json();
        assert_eq!(e["error"]["code"], "no_replica");
        assert_eq!(e["error"]["type"], "server_error");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no replica"));
    }
    // A forwarded GET too (`/v1/models` is answered by the router from the
    // model lists it last read).
    let r = common::get(router.addr, "/version");
    assert_eq!(r.status, 503);
}

#[test]
fn a_reused_connection_closed_unanswered_is_answered_502_and_never_resent() {
    // The replica reads the second request on each keep-alive connection and
    // closes without answering. It had the request: the router cannot know
    // whether the engine started on it, so it must not send it again.
    let a = Sim::start("a", &["--close-after-requests", "1"]);
    let router = Router::start(&[&a], SLOW_HEALTH);
    let statuses: Vec<u16> = (0..4)
        .map(|i| {
            router
                .post("/v1/chat/completions", &single(&format!("reuse {i}")))
                .status
        })
        .collect();
    assert_eq!(statuses, [200, 502, 200, 502]);
    assert_eq!(
        a.received(),
        4,
        "every request reached the replica exactly once"
    );
    let r = {
        router.post("/v1/chat/completions", &single("reuse 4"));
        router.post("/v1/chat/completions", &single("reuse 5"))
    };
    assert_eq!(r.json()["error"]["code"], "upstream_error");
    assert!(r.text().contains("replica a"), "{}", r.text());
}

#[test]
fn a_replica_rejoins_after_its_health_check_passes() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "health_check: {interval_ms: 200}\n");
    b.set_healthy(false);
    router.wait_replica_up("b", false);
    let picks = router.singles(4, "q");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
    b.set_healthy(true);
    router.wait_replica_up("b", true);
    let picks = router.singles(4, "r");
    assert!(picks.contains(&"b".to_owned()), "{picks:?}");
}

#[test]
fn a_replica_still_loading_gets_no_traffic() {
    let a = Sim::start("a", &[]);
    let loading = Sim::start("loading", &["--loading-ms", "600000"]);
    let router = Router::spawn(
        &Router::yaml(&[&a, &loading], "health_check: {interval_ms: 200}\n"),
        &[],
    );
    router.wait_replica_up("a", true);
    // Let at least one health check of the loading replica complete.
    wait_for(
        "a failed check of the loading replica",
        Duration::from_secs(10),
        || {
            (router.metric("prefix_router_replica_up{replica=\"loading\"}") == 0.0
                && common::get(router.metrics_addr, "/metrics")
                    .text()
                    .contains("replica=\"loading\""))
            .then_some(())
        },
    );
    let picks = router.singles(6, "q");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
    assert_eq!(loading.stats()["requests"], 0);
}

fn health_failed(sim: &Sim) -> u64 {
    sim.stats()["health_failed"].as_u64().unwrap_or(0)
}

#[test]
fn a_replica_goes_down_after_three_failed_checks_in_a_row_not_one() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "health_check: {interval_ms: 500}\n");
    b.set_healthy(false);
    router.wait_replica_up("b", false);
    let failed = health_failed(&b);
    assert!(failed >= 3, "down after {failed} failed check(s)");
}

#[test]
fn late_health_checks_do_not_take_down_replicas_that_complete_requests() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "health_check: {interval_ms: 200}\n");
    // Engines busy with a burst answer /health after the check's 3 s deadline.
    for sim in [&a, &b] {
        let r = common::http::request(sim.addr, "POST", "/sim/health?delay_ms=5000", &[], b"");
        assert_eq!(r.status, 200);
    }
    // Until the router has seen four checks of each time out.
    let timeouts = |name: &str| {
        router.metric(&format!(
            "prefix_router_health_checks_total{{replica=\"{name}\",result=\"timeout\"}}"
        ))
    };
    let mut picks = Vec::new();
    while timeouts("a") < 4.0 || timeouts("b") < 4.0 {
        let tag = format!("while late {}", picks.len());
        let r = router.post("/v1/chat/completions", &single(&tag));
        assert_eq!(r.status, 200, "{}", r.text());
        picks.push(r.replica().to_owned());
    }
    assert!(picks.contains(&"a".into()) && picks.contains(&"b".into()));
    for name in ["a", "b"] {
        let up = format!("prefix_router_replica_up{{replica=\"{name}\"}}");
        assert_eq!(
            router.metric(&up),
            1.0,
            "{name} completed requests all along"
        );
    }
}

#[test]
fn with_every_replica_failing_its_checks_panic_mode_routes_to_them() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "health_check: {interval_ms: 200}\n");
    // A reload to a health path the engines answer 404 looks the same.
    a.set_healthy(false);
    b.set_healthy(false);
    router.wait_replica_up("a", false);
    router.wait_replica_up("b", false);
    // Requests still go to them, said in a metric and the log.
    for i in 0..4 {
        let r = router.post("/v1/chat/completions", &single(&format!("panic {i}")));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(router.metric("prefix_router_panic_mode"), 1.0);
    assert!(router.metric("prefix_router_panic_routed_total") >= 4.0);
    router.wait_log("panic mode");
    // The router serves, so it stays ready.
    let ready = common::get(router.metrics_addr, "/ready");
    assert_eq!(ready.status, 200, "{}", ready.text());
    a.set_healthy(true);
    router.wait_replica_up("a", true);
    wait_for("panic mode to end", Duration::from_secs(10), || {
        (router.metric("prefix_router_panic_mode") == 0.0).then_some(())
    });
    let picks = router.singles(4, "after");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
}

#[test]
fn past_the_probe_budget_live_replicas_take_turns_and_a_down_one_is_checked_every_round() {
    let sims: Vec<Sim> = ["a", "b", "c", "d", "e"]
        .into_iter()
        .map(|name| Sim::start(name, &[]))
        .collect();
    let all: Vec<&Sim> = sims.iter().collect();
    // Five replicas, rounds every 100 ms, at most 5 checks (and engine
    // reads) a second: half a probe a round, so each live replica's turn
    // comes one round in ten (a read: once a second).
    let router = Router::start(
        &all,
        "health_check: {interval_ms: 100, max_per_second: 5}\n\
         engine_load: {interval_ms: 100, max_per_second: 5}\n",
    );
    for name in ["a", "b", "c", "d", "e"] {
        router.wait_replica_up(name, true);
    }
    sims[4].set_healthy(false);
    router.wait_replica_up("e", false);
    let checks = |name: &str, result: &str| {
        router.metric(&format!(
            "prefix_router_health_checks_total{{replica=\"{name}\",result=\"{result}\"}}"
        ))
    };
    let reads = |name: &str| {
        router.metric(&format!(
            "prefix_router_engine_reads_total{{replica=\"{name}\",result=\"ok\"}}"
        ))
    };
    let live = ["a", "b", "c", "d"];
    let before: Vec<(f64, f64)> = live.iter().map(|n| (checks(n, "pass"), reads(n))).collect();
    // Twenty rounds, counted by the down replica's checks: it is checked in
    // every one (it must be seen to come back at once).
    let failed = checks("e", "fail");
    let started = std::time::Instant::now();
    wait_for(
        "twenty checks of the down replica",
        Duration::from_secs(30),
        || (checks("e", "fail") >= failed + 20.0).then_some(()),
    );
    let seconds = started.elapsed().as_secs_f64();
    for (name, (passed, read)) in live.iter().zip(before) {
        // Two turns in twenty rounds (every round: twenty).
        let passed = checks(name, "pass") - passed;
        assert!(
            (1.0..=5.0).contains(&passed),
            "{name} checked {passed} times in 20 rounds"
        );
        // About once a second (every round: ten times a second); rounds
        // only slow down under load.
        let read = reads(name) - read;
        assert!(
            read <= 2.0 * seconds + 2.0,
            "{name}'s engine read {read} times in {seconds:.1} s"
        );
    }
    sims[4].set_healthy(true);
    router.wait_replica_up("e", true);
}
