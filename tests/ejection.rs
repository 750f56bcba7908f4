//! Outlier ejection from the request path: which failures count (gateway
//! answers and hangs do; a 500, or a long generation answered whole, does
//! not) and how much of the fleet one client's failures can take out. Real
//! router, real simulators.

mod common;

use common::{single, streaming, Router, Sim};

const SLOW_HEALTH: &str = "health_check: {interval_ms: 60000}\n";

#[test]
fn a_replica_that_hangs_or_fails_is_ejected_after_consecutive_failures() {
    for fault in ["--hang-after-requests", "--fail-after-requests"] {
        // A streamed generation's head comes with its first token: a hang
        // before it is the replica's (see the next test for one answered whole).
        let body = |i| streaming(&format!("{fault} {i}"), 4);
        let a = Sim::start("a", &[]);
        // A failing engine answers 503 (gateway-class: counted).
        let b = Sim::start("b", &[fault, "0", "--fail-status", "503"]);
        let router = Router::start(
            &[&a, &b],
            &format!(
                "{SLOW_HEALTH}timeouts: {{read_ms: 300}}\noutlier: {{consecutive_failures: 2, base_ejection_ms: 600000}}\n"
            ),
        );
        let statuses: Vec<u16> = (0..4)
            .map(|i| router.post("/v1/chat/completions", &body(i)).status)
            .collect();
        let failed = statuses.iter().filter(|s| **s >= 500).count();
        assert_eq!(failed, 2, "{fault}: {statuses:?}");
        assert_eq!(
            router.metric(
                "prefix_router_ejections_total{reason=\"consecutive_failures\",replica=\"b\"}"
            ),
            1.0,
            "{fault}"
        );
        assert_eq!(
            router.metric("prefix_router_replica_up{replica=\"b\"}"),
            0.0
        );
        let picks = router.singles(4, fault);
        assert!(picks.iter().all(|p| p == "a"), "{fault}: {picks:?}");
        assert_eq!(b.received(), 2, "{fault}: b got traffic after its ejection");
    }
}

#[test]
fn answers_500_pass_to_the_client_and_never_eject_the_replica() {
    // A 500 is as often the request's doing (a prompt the engine rejects):
    // a client sending such prompts must not take replicas out.
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &["--fail-after-requests", "0"]);
    let router = Router::start(
        &[&a, &b],
        &format!("{SLOW_HEALTH}outlier: {{consecutive_failures: 2}}\n"),
    );
    let statuses: Vec<u16> = (0..8)
        .map(|i| {
            let r = router.post("/v1/chat/completions", &single(&format!("bad {i}")));
            r.status
        })
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 500).count(),
        4,
        "{statuses:?}"
    );
    assert_eq!(
        router
            .metric("prefix_router_ejections_total{reason=\"consecutive_failures\",replica=\"b\"}"),
        0.0
    );
    assert_eq!(b.received(), 4, "b kept its share");
}

#[test]
fn a_generation_answered_whole_that_outlasts_the_head_deadline_ejects_nothing() {
    // Without `stream: true` the head comes when the generation ends: a
    // client asking for long generations must not take replicas out.
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &["--hang-after-requests", "0"]);
    let router = Router::start(
        &[&a, &b],
        &format!(
            "{SLOW_HEALTH}timeouts: {{read_ms: 300}}\noutlier: {{consecutive_failures: 2, base_ejection_ms: 600000}}\n"
        ),
    );
    let statuses: Vec<u16> = (0..6)
        .map(|i| {
            router
                .post("/v1/chat/completions", &single(&format!("long {i}")))
                .status
        })
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 504).count(),
        3,
        "{statuses:?}"
    );
    let ejections = "prefix_router_ejections_total{reason=\"consecutive_failures\",replica=\"b\"}";
    assert_eq!(router.metric(ejections), 0.0);
    assert_eq!(b.received(), 3, "b kept its share");
}

#[test]
fn one_client_keeps_at_most_one_replica_ejected() {
    // Three replicas answer 503 to everything; every request comes from one
    // client address. Its failures may be its own doing: they eject one
    // replica, not the three that `max_ejection_percent: 100` would allow.
    let a = Sim::start("a", &[]);
    let failing: Vec<Sim> = ["b", "c", "d"]
        .iter()
        .map(|n| Sim::start(n, &["--fail-after-requests", "0", "--fail-status", "503"]))
        .collect();
    let mut all: Vec<&Sim> = vec![&a];
    all.extend(failing.iter());
    let router = Router::start(
        &all,
        &format!(
            "{SLOW_HEALTH}outlier: {{consecutive_failures: 1, base_ejection_ms: 600000, max_ejection_percent: 100}}\n"
        ),
    );
    for i in 0..16 {
        router.post("/v1/chat/completions", &single(&format!("one client {i}")));
    }
    let ejected: f64 = ["b", "c", "d"]
        .iter()
        .map(|n| {
            router.metric(&format!(
                "prefix_router_ejections_total{{reason=\"consecutive_failures\",replica=\"{n}\"}}"
            ))
        })
        .sum();
    assert_eq!(ejected, 1.0);
    let received: u64 = failing.iter().map(Sim::received).sum();
    assert!(received > 3, "the others kept their share: {received}");
}
