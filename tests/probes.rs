//! The probes on the metrics listener: `/healthz` while the process serves,
//! `/ready` only while a replica is live (an orchestrator holds traffic back
//! otherwise), `/metrics` as before. Real processes.

mod common;

use std::time::Duration;

use common::{get, wait_for, Router, Sim};

#[test]
fn ready_follows_the_live_replicas_and_healthz_the_process() {
    let mut a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let probe = |path: &str| get(router.metrics_addr, path);
    assert_eq!(probe("/healthz").status, 200);
    let ready = probe("/ready");
    assert_eq!(
        (ready.status, ready.text()),
        (200, "1 of 1 replicas live\n".to_owned())
    );
    assert!(probe("/metrics")
        .text()
        .contains("prefix_router_replica_up"));
    a.kill();
    router.wait_replica_up("a", false);
    wait_for("/ready to say 503", Duration::from_secs(10), || {
        (probe("/ready").status == 503).then_some(())
    });
    assert_eq!(probe("/healthz").status, 200, "alive, not ready");
}

#[test]
fn a_router_whose_replicas_never_came_up_is_not_ready() {
    let dead = common::free_addr();
    let router = Router::spawn(
        &format!("replicas:\n  - {{name: a, addr: \"{dead}\"}}\n"),
        &[],
    );
    assert_eq!(get(router.metrics_addr, "/healthz").status, 200);
    let ready = get(router.metrics_addr, "/ready");
    assert_eq!(
        (ready.status, ready.text()),
        (503, "0 of 1 replicas live\n".to_owned())
    );
}
