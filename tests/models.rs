//! Multi-model fleets: each replica serves the models its `/v1/models` lists
//! (or the config declares); a request goes only to replicas serving its
//! `model`, spread by a counter of their own; a model nobody serves is a 404
//! at once; `GET /v1/models` is answered by the router. Real processes.

mod common;

use std::time::Duration;

use common::{get, wait_for, Router, Sim};
use serde_json::json;

const FAST_HEALTH: &str = "health_check: {interval_ms: 100}\n";

fn single(model: &str, text: &str) -> serde_json::Value {
    json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
}

fn models_listed(router: &Router) -> Vec<String> {
    let r = get(router.addr, "/v1/models");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_owned())
        .collect()
}

#[test]
fn requests_go_only_to_replicas_serving_their_model_each_model_spread_evenly() {
    let a = Sim::start("a", &["--models", "alpha"]);
    let b = Sim::start("b", &["--models", "beta"]);
    let c = Sim::start("c", &["--models", "alpha"]);
    let router = Router::start(&[&a, &b, &c], "");
    let mut alpha = Vec::new();
    for i in 0..8 {
        // Interleaved with beta, alpha's two replicas still take turns.
        let r = router.post("/v1/chat/completions", &single("alpha", &format!("a {i}")));
        assert_eq!(r.status, 200, "{}", r.text());
        alpha.push(r.replica().to_owned());
        let r = router.post("/v1/chat/completions", &single("beta", &format!("b {i}")));
        assert_eq!((r.status, r.replica()), (200, "b"));
    }
    let on = |name: &str| alpha.iter().filter(|r| *r == name).count();
    assert_eq!((on("a"), on("c")), (4, 4), "{alpha:?}");

    // A continuation stays with its model's replica that holds it.
    let mut turn = json!({"model": "alpha", "max_tokens": 2, "messages": [
        {"role": "user", "content": "remember this"}]});
    let first = router.post("/v1/chat/completions", &turn);
    turn["messages"].as_array_mut().expect("messages").extend([
        json!({"role": "assistant", "content": "ok"}),
        json!({"role": "user", "content": "and?"}),
    ]);
    let second = router.post("/v1/chat/completions", &turn);
    assert_eq!(second.decision(), "pin");
    assert_eq!(second.replica(), first.replica());

    // Nobody serves gamma: 404 from the router, no replica asked.
    let before: u64 = [&a, &b, &c].iter().map(|s| s.received()).sum();
    let r = router.post("/v1/chat/completions", &single("gamma", "hello"));
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("gamma")));
    let after: u64 = [&a, &b, &c].iter().map(|s| s.received()).sum();
    assert_eq!(after, before);
    assert_eq!(
        router.metric("prefix_router_errors_total{kind=\"model_not_found\"}"),
        1.0
    );

    // No model named: any replica, as before.
    let r = router.post(
        "/v1/chat/completions",
        &json!({"max_tokens": 2, "messages": [{"role": "user", "content": "whoever"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Counted by model: label values only from the replicas' lists.
    let by = |model: &str, decision: &str| {
        router.metric(&format!(
            "prefix_router_model_requests_total{{decision=\"{decision}\",model=\"{model}\"}}"
        ))
    };
    assert_eq!((by("alpha", "spread"), by("beta", "spread")), (9.0, 8.0));
    assert_eq!((by("alpha", "pin"), by("none", "spread")), (1.0, 1.0));
    assert_eq!(by("gamma", "spread"), 0.0, "refused, and not a label");
}

#[test]
fn the_router_lists_the_models_of_its_live_replicas() {
    let a = Sim::start("a", &["--models", "alpha,shared"]);
    let mut b = Sim::start("b", &["--models", "beta,shared"]);
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    assert_eq!(models_listed(&router), ["alpha", "beta", "shared"]);
    let one = get(router.addr, "/v1/models/beta");
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["id"], "beta");
    let none = get(router.addr, "/v1/models/gamma");
    assert_eq!(none.status, 404);
    assert_eq!(none.json()["error"]["code"], "model_not_found");
    b.kill();
    router.wait_replica_up("b", false);
    assert_eq!(models_listed(&router), ["alpha", "shared"]);
    // beta's only replica is down, not gone: 503, not 404.
    let r = router.post("/v1/chat/completions", &single("beta", "anyone?"));
    assert_eq!(r.status, 503, "{}", r.text());
}

#[test]
fn a_replica_that_loads_another_model_is_picked_up_without_a_reload() {
    let a = Sim::start("a", &["--models", "alpha"]);
    let b = Sim::start("b", &["--models", "beta"]);
    let router = Router::start(&[&a, &b], FAST_HEALTH);
    let switched = common::http::request(b.addr, "POST", "/sim/models", &[], br#"["gamma"]"#);
    assert_eq!(switched.status, 200);
    wait_for("gamma listed", Duration::from_secs(10), || {
        models_listed(&router)
            .contains(&"gamma".to_owned())
            .then_some(())
    });
    let r = router.post("/v1/chat/completions", &single("gamma", "new model"));
    assert_eq!((r.status, r.replica()), (200, "b"));
    let r = router.post("/v1/chat/completions", &single("beta", "old model"));
    assert_eq!(r.status, 404, "{}", r.text());
}

#[test]
fn models_declared_in_the_config_override_the_replicas_list() {
    // b lists alpha too, but the config says it serves only beta.
    let a = Sim::start("a", &["--models", "alpha"]);
    let b = Sim::start("b", &["--models", "alpha,beta"]);
    let yaml = Router::yaml(&[&a, &b], "").replace(
        &format!("addr: \"{}\"", b.addr),
        &format!("addr: \"{}\", models: [beta]", b.addr),
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("a", true);
    router.wait_replica_up("b", true);
    let replicas: Vec<String> = (0..6)
        .map(|i| {
            let r = router.post("/v1/chat/completions", &single("alpha", &format!("q {i}")));
            assert_eq!(r.status, 200, "{}", r.text());
            r.replica().to_owned()
        })
        .collect();
    assert!(replicas.iter().all(|r| r == "a"), "{replicas:?}");
    assert_eq!(models_listed(&router), ["alpha", "beta"]);
}

#[test]
fn a_one_model_fleet_refuses_other_names_itself_and_lists_its_model() {
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    let r = router.post("/v1/chat/completions", &single("other", "hello"));
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        r.json()["error"]["code"],
        "model_not_found",
        "the router's answer"
    );
    assert_eq!(a.received() + b.received(), 0);
    assert_eq!(models_listed(&router), ["sim"]);
    assert_eq!(
        get(router.addr, "/v1/models").header("x-prefix-router-replica"),
        None
    );
}

#[test]
fn embeddings_and_other_json_paths_go_to_their_models_replicas() {
    let a = Sim::start("a", &["--models", "chat-model"]);
    let b = Sim::start("b", &["--models", "embed-model"]);
    let router = Router::start(&[&a, &b], "");
    for i in 0..4 {
        let r = router.post(
            "/v1/embeddings",
            &json!({"model": "embed-model", "input": format!("text {i}")}),
        );
        assert_eq!((r.status, r.replica()), (200, "b"), "{}", r.text());
    }
    let r = router.post("/v1/embeddings", &json!({"model": "nobody", "input": "x"}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
}

#[test]
fn audio_forms_go_to_the_replicas_of_their_model() {
    let a = Sim::start("a", &["--models", "chat-model"]);
    let b = Sim::start("b", &["--models", "whisper"]);
    let router = Router::start(&[&a, &b], "");
    let form = |model: &str| {
        let mut body =
            b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
            Content-Type: audio/wav\r\n\r\n"
                .to_vec();
        body.extend(std::iter::repeat_n(7u8, 200_000));
        body.extend_from_slice(
            format!("\r\n--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--xyz--\r\n")
                .as_bytes(),
        );
        body
    };
    let headers = [("content-type", "multipart/form-data; boundary=xyz")];
    for _ in 0..3 {
        let r = common::http::request(
            router.addr,
            "POST",
            "/v1/audio/transcriptions",
            &headers,
            &form("whisper"),
        );
        assert_eq!((r.status, r.replica()), (200, "b"), "{}", r.text());
        assert_eq!(
            r.json()["x_body_bytes"].as_u64(),
            Some(form("whisper").len() as u64)
        );
    }
    let r = common::http::request(
        router.addr,
        "POST",
        "/v1/audio/transcriptions",
        &headers,
        &form("nobody"),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
}

#[test]
fn a_long_body_for_a_model_nobody_serves_leaves_no_checkpoint() {
    let a = Sim::start("a", &["--models", "alpha"]);
    let router = Router::start(&[&a], "");
    // Long enough to leave a checkpoint (32 KiB or more, one message list).
    let long = |model: &str| {
        json!({"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "read this file: ".repeat(4 << 10)},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "and now?"}]})
    };
    // Refused at once: it would only push other conversations' checkpoints out.
    let r = router.post("/v1/chat/completions", &long("gamma"));
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(router.metric("prefix_router_checkpoint_bytes"), 0.0);
    // The same body for a model a replica serves leaves one.
    let r = router.post("/v1/chat/completions", &long("alpha"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(router.metric("prefix_router_checkpoint_bytes") > 64.0 * 1024.0);
}

#[test]
fn a_model_id_with_a_quote_a_backslash_and_a_line_break_is_escaped_on_the_metrics_page() {
    let odd = "we\"ird\\model\nv2";
    let a = Sim::start("a", &["--models", odd]);
    let router = Router::start(&[&a], "");
    assert_eq!(models_listed(&router), [odd]);
    let r = router.post("/v1/chat/completions", &single(odd, "hello"));
    assert_eq!(r.status, 200, "{}", r.text());
    let page = get(router.metrics_addr, "/metrics").text();
    let series =
        r#"prefix_router_model_requests_total{decision="spread",model="we\"ird\\model\nv2"} 1"#;
    assert!(page.lines().any(|l| l == series), "{page}");
    // No label value breaks a line: each is a comment or a series of ours.
    for line in page.lines() {
        assert!(
            line.starts_with('#') || line.starts_with("prefix_router_"),
            "{line:?}"
        );
    }
}
