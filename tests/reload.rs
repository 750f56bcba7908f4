//! Hot reload, black-box: the config file is edited under a running router.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::EventStream;
use common::{conversation, get, wait_for, Router, Sim, TricklingReplica};
use serde_json::json;

const FAST_HEALTH: &str = "health_check: {interval_ms: 200}\n";

fn wait_reloads(router: &Router, result: &str, n: f64) {
    let series = format!("prefix_router_config_reloads_total{{result=\"{result}\"}}");
    wait_for(&format!("{series} == {n}"), Duration::from_secs(10), || {
        (router.metric(&series) == n).then_some(())
    });
}

/// Opens conversations `topic0`, `topic1`, ... until one lands on
/// `replica` (the counter alternates); its topic.
fn opened_on(router: &Router, replica: &str) -> String {
    (0..10)
        .map(|i| format!("topic{i}"))
        .find(|t| {
            router
                .post("/v1/chat/completions", &conversation(t, 0))
                .replica()
                == replica
        })
        .expect("the counter reaches every replica")
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
    let topic = opened_on(&router, "b");
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
fn a_replica_that_leaves_takes_its_series_along_and_one_that_moves_keeps_them() {
    let (a, b, c) = (
        Sim::start("a", &[]),
        Sim::start("b", &[]),
        Sim::start("c", &["--decode-tps", "20"]),
    );
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    router.singles(4, "before");
    let spread = |name: &str| {
        router.metric(&format!(
            "prefix_router_requests_total{{decision=\"spread\",replica=\"{name}\",shape=\"single\"}}"
        ))
    };
    assert_eq!((spread("a"), spread("b")), (2.0, 2.0));
    // b leaves for good (a pod gone from the DNS name); the name `a` now
    // stands for another address (a pod's name kept across a move).
    router.rewrite(&format!(
        "{FAST_HEALTH}replicas:\n  - {{name: a, addr: \"{}\"}}\n",
        c.addr
    ));
    wait_reloads(&router, "ok", 1.0);
    // The new address joins after its first passing check: wait for it to
    // answer one single (refusals reach no replica).
    wait_for("a at its new address", Duration::from_secs(10), || {
        let r = router.post("/v1/chat/completions", &common::single("probe"));
        (r.status == 200).then_some(())
    });
    // Gone at once, or (a health check of b in flight at the removal sets
    // its gauge again) at the next sweep, within seconds.
    wait_for("b's series gone", Duration::from_secs(15), || {
        let text = get(router.metrics_addr, "/metrics").text();
        (!text.contains("replica=\"b\"")).then_some(())
    });
    router.singles(2, "after");
    assert_eq!(spread("a"), 5.0, "a moved replica counts on in its series");
    assert_eq!(c.received(), 3);
    // Its gauges too: the capacity watch sets its requests in flight.
    let body = common::streaming("held at the new address", 1000);
    let mut held = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert!(held.next_event().is_some());
    wait_for("a's in-flight gauge at 1", Duration::from_secs(5), || {
        (router.metric("prefix_router_in_flight_requests{replica=\"a\"}") == 1.0).then_some(())
    });
}

#[test]
fn a_renamed_replica_keeps_its_health_and_its_pins() {
    // Checks a minute apart: a rename that made a new, unchecked replica
    // would leave it out for that long and forget its conversations.
    let slow = "health_check: {interval_ms: 60000}\n";
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start_with_env(&[&a, &b], slow, &[("RUST_LOG", "info")]);
    let topic = opened_on(&router, "b");
    router.rewrite(&format!(
        "{slow}replicas:\n  - {{name: a, addr: \"{}\"}}\n  - {{name: b2, addr: \"{}\"}}\n",
        a.addr, b.addr
    ));
    wait_reloads(&router, "ok", 1.0);
    let next = router.post("/v1/chat/completions", &conversation(&topic, 1));
    assert_eq!((next.replica(), next.decision()), ("b2", "pin"));
    let picks = router.singles(4, "after the rename");
    assert_eq!(picks.iter().filter(|p| *p == "b2").count(), 2, "{picks:?}");
    wait_for("b's series gone", Duration::from_secs(15), || {
        let text = get(router.metrics_addr, "/metrics").text();
        (!text.contains("replica=\"b\"")).then_some(())
    });
    router.wait_log("renamed [b -> b2]");
}

#[test]
fn a_health_check_that_ends_after_its_replica_moved_does_not_show_the_new_address_up() {
    // Each check of `a` passes /health, then waits for its model list until
    // the test releases it; `b`'s checks trickle to their 3 s deadline, so a
    // round of checks ends (and the next, of a's new address, starts) then.
    let release = Arc::new(AtomicBool::new(false));
    let old = TricklingReplica::start_holding_models(Arc::clone(&release));
    let slow = TricklingReplica::start_trickling_health();
    let b = slow.yaml("b");
    let router = Router::spawn(
        &format!("{FAST_HEALTH}replicas:\n{}{b}", old.yaml("a")),
        &[],
    );
    router.wait_replica_up("a", true);
    // `a` moves to where nothing listens while its next check waits.
    router.rewrite(&format!(
        "{FAST_HEALTH}replicas:\n  - {{name: a, addr: \"{}\"}}\n{b}",
        common::free_addr()
    ));
    wait_reloads(&router, "ok", 1.0);
    release.store(true, Ordering::Relaxed);
    let series = "prefix_router_replica_up{replica=\"a\"}";
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        assert_eq!(
            router.metric(series),
            0.0,
            "the old address's check showed `a` up"
        );
        std::thread::sleep(Duration::from_millis(20)); // pacing, not waiting for anything
    }
}

#[test]
fn a_file_that_would_remove_most_replicas_is_refused_unless_it_says_so() {
    let (a, b, c) = (
        Sim::start("a", &[]),
        Sim::start("b", &[]),
        Sim::start("c", &[]),
    );
    let router = Router::start(&[&a, &b, &c], FAST_HEALTH);
    // A writer that paused at a line boundary: one replica of three left.
    router.rewrite(&Router::yaml(&[&a], FAST_HEALTH));
    wait_reloads(&router, "error", 1.0);
    router.wait_log("reload_max_removed_percent");
    let mut picks = router.singles(6, "kept");
    picks.sort();
    picks.dedup();
    assert_eq!(picks, ["a", "b", "c"]);
    // A file that means it says so.
    let meant = format!("{FAST_HEALTH}reload_max_removed_percent: 100\n");
    router.rewrite(&Router::yaml(&[&a], &meant));
    wait_reloads(&router, "ok", 1.0);
    let picks = router.singles(4, "meant");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
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

/// Sends a two-turn conversation on `topic`; the decision of its second turn.
fn second_turn(router: &Router, topic: &str) -> String {
    let first = router.post("/v1/chat/completions", &conversation(topic, 1));
    assert_eq!(first.status, 200, "{}", first.text());
    let second = router.post("/v1/chat/completions", &conversation(topic, 2));
    assert_eq!(second.status, 200, "{}", second.text());
    second.decision().to_owned()
}

#[test]
fn policy_limits_headers_and_health_path_apply_without_a_restart() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let sims = [&a, &b];
    let router = Router::start(&sims, &format!("{FAST_HEALTH}policy: roundrobin\n"));
    assert_eq!(second_turn(&router, "before"), "spread");

    router.rewrite(&Router::yaml(
        &sims,
        &format!("{FAST_HEALTH}policy: shape\n"),
    ));
    wait_reloads(&router, "ok", 1.0);
    assert_eq!(
        second_turn(&router, "after"),
        "pin",
        "the new policy is in force"
    );

    let big = json!({"model": "sim", "messages": [{"role": "user", "content": "x".repeat(2000)}]});
    assert_eq!(router.post("/v1/chat/completions", &big).status, 200);
    router.rewrite(&Router::yaml(
        &sims,
        &format!("{FAST_HEALTH}policy: shape\nmax_body_bytes: 1000\nplacement_headers: false\n"),
    ));
    wait_reloads(&router, "ok", 2.0);
    assert_eq!(router.post("/v1/chat/completions", &big).status, 413);
    let small = router.post("/v1/chat/completions", &common::single("small"));
    assert_eq!(small.status, 200);
    assert_eq!(
        small.header("x-prefix-router-replica"),
        None,
        "placement hidden"
    );

    // A health check path the replicas do not serve takes them down.
    router.rewrite(&Router::yaml(
        &sims,
        "health_check: {interval_ms: 200, path: /not-served}\n",
    ));
    wait_reloads(&router, "ok", 3.0);
    router.wait_replica_up("a", false);
    router.wait_replica_up("b", false);
    assert_eq!(router.metric("prefix_router_config_restart_pending"), 0.0);
}

#[test]
fn keys_that_need_a_restart_are_named_and_the_rest_applies() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "policy: shape\nthreads: 2\n");
    router.rewrite(&Router::yaml(
        &[&a],
        "policy: roundrobin\nthreads: 1\nprefix_index: {block_bytes: 512}\nlimits: {max_metrics_connections: 2}\n",
    ));
    wait_reloads(&router, "ok", 1.0);
    assert_eq!(router.metric("prefix_router_config_restart_pending"), 1.0);
    // The metrics listener's limit is set once, at start: named too.
    router.wait_log(
        "threads, prefix_index.block_bytes, limits.max_metrics_connections changed: needs restart",
    );
    assert_eq!(
        second_turn(&router, "t"),
        "spread",
        "policy applied regardless"
    );
    router.rewrite(&Router::yaml(&[&a], "policy: shape\nthreads: 2\n"));
    wait_reloads(&router, "ok", 2.0);
    assert_eq!(router.metric("prefix_router_config_restart_pending"), 0.0);
    assert_eq!(second_turn(&router, "u"), "pin");
}

#[test]
fn a_config_symlink_swapped_atomically_is_followed() {
    // Kubernetes mounts a ConfigMap as `file -> ..data/file`, `..data ->
    // ..<timestamp>/`, and updates it by renaming a new `..data` link over
    // the old one.
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a], FAST_HEALTH);
    let dir = router.config.parent().expect("config dir").to_owned();
    let text = |sims: &[&Sim]| {
        format!(
            "listen: \"{}\"\nmetrics_listen: \"{}\"\nreload_interval_ms: 100\n{}",
            router.addr,
            router.metrics_addr,
            Router::yaml(sims, FAST_HEALTH)
        )
    };
    let version = |name: &str, body: String| {
        std::fs::create_dir_all(dir.join(name)).expect("version dir");
        std::fs::write(dir.join(name).join("router.yaml"), body).expect("write");
    };
    let link = |target: &str, at: &str| {
        let tmp = dir.join(format!("{at}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(target, &tmp).expect("symlink");
        std::fs::rename(&tmp, dir.join(at)).expect("rename link");
    };
    version(
        "..v1",
        std::fs::read_to_string(&router.config).expect("config"),
    );
    link("..v1", "..data");
    link("..data/router.yaml", "router.yaml");
    version("..v2", text(&[&a, &b]));
    link("..v2", "..data");
    wait_reloads(&router, "ok", 1.0);
    router.wait_replica_up("b", true);
    assert!(router.singles(4, "after swap").contains(&"b".to_owned()));
}
