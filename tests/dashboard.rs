//! Every metric the Grafana dashboard queries exists on the live endpoints
//! (router and simulated vLLM replica): a guessed name would be invisible
//! until someone needs the graph.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{get, single, wait_for, Router, Sim};

/// Metric names referenced by the dashboard's queries.
fn dashboard_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/grafana/prefix-router.json"
    ))
    .expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let mut names = BTreeSet::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            for (i, _) in expr
                .match_indices("prefix_router_")
                .chain(expr.match_indices("vllm:"))
            {
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                names.insert(name);
            }
        }
    }
    names
}

/// Series names exposed by a Prometheus text endpoint.
fn exposed(addr: std::net::SocketAddr) -> BTreeSet<String> {
    get(addr, "/metrics")
        .text()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn every_dashboard_metric_exists_on_a_live_endpoint() {
    let a = Sim::start("a", &[]);
    // engine_load on, so the engine figures it reads are exported too.
    let router = Router::start(&[&a], "engine_load: {interval_ms: 100}\n");
    assert_eq!(
        router.post("/v1/chat/completions", &single("hello")).status,
        200
    );
    wait_for("the engine's load read", Duration::from_secs(10), || {
        exposed(router.metrics_addr)
            .contains("prefix_router_engine_kv_used_ratio")
            .then_some(())
    });
    let live: BTreeSet<String> = exposed(router.metrics_addr)
        .union(&exposed(a.addr))
        .cloned()
        .collect();
    let wanted = dashboard_metrics();
    assert!(wanted.len() > 10, "{wanted:?}");
    let missing: Vec<_> = wanted.difference(&live).collect();
    assert!(
        missing.is_empty(),
        "dashboard queries metrics nobody exports: {missing:?}"
    );
}
