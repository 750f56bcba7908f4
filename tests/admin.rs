//! The admin API on the metrics listener: behind its own keys, replicas
//! listed, drained and put back; a rolling engine restart driven through
//! it under steady load loses no request.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::http::{self, Response};
use common::{conversation, sha256_hex, single, wait_for, Router, Sim};

const KEY: &str = "admin-k1";

/// A keys file holding `key`'s digest, in a directory of its own.
fn keys_file(tag: &str, key: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("prefix-router-admin-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("admin-keys");
    std::fs::write(&file, format!("# operators\n{}\n", sha256_hex(key))).unwrap();
    file
}

/// The router in front of `sims` with `extra` config and admin keys
/// (`KEY`), and the keys file.
fn start(sims: &[&Sim], tag: &str, extra: &str) -> (Router, std::path::PathBuf) {
    let file = keys_file(tag, KEY);
    let yaml = format!("admin_keys_file: \"{}\"\n{extra}", file.display());
    (Router::start(sims, &yaml), file)
}

fn admin(router: &Router, method: &str, path: &str, key: Option<&str>) -> Response {
    let bearer = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer
        .iter()
        .map(|b| ("authorization", b.as_str()))
        .collect();
    http::request(router.metrics_addr, method, path, &headers, b"")
}

fn replica(router: &Router, name: &str) -> serde_json::Value {
    let r = admin(router, "GET", &format!("/admin/replicas/{name}"), Some(KEY));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn the_admin_api_takes_only_its_own_keys_and_answers_json() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let (router, file) = start(&[&a, &b], "keys", "");
    for key in [None, Some("wrong")] {
        let r = admin(&router, "POST", "/admin/replicas/a/drain", key);
        assert_eq!(r.status, 401, "{key:?}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(
        replica(&router, "a")["drained"],
        false,
        "drained without a key"
    );
    let list = admin(&router, "GET", "/admin/replicas", Some(KEY)).json();
    let names: Vec<_> = list["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].clone())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(list["replicas"][0]["health"], "up");
    assert_eq!(list["replicas"][0]["addr"], a.addr.to_string());
    for (method, path, status, code) in [
        ("GET", "/admin/replicas/zz", 404, "replica_not_found"),
        ("POST", "/admin/replicas/zz/drain", 404, "replica_not_found"),
        ("GET", "/admin/replicas/a/drain", 405, "method_not_allowed"),
        ("POST", "/admin/replicas/a/reboot", 404, "not_found"),
    ] {
        let r = admin(&router, method, path, Some(KEY));
        assert_eq!(
            (r.status, r.json()["error"]["code"].as_str()),
            (status, Some(code)),
            "{method} {path}"
        );
    }
    // A new key file takes over without a restart; the old key is refused.
    std::fs::write(&file, format!("{}\n", sha256_hex("admin-k2"))).unwrap();
    wait_for("the new admin key", Duration::from_secs(10), || {
        (admin(&router, "GET", "/admin/replicas", Some("admin-k2")).status == 200).then_some(())
    });
    assert_eq!(
        admin(&router, "GET", "/admin/replicas", Some(KEY)).status,
        401
    );
    // The client port knows nothing of it, and the API keys do not open it.
    let r = http::request(
        router.addr,
        "GET",
        "/admin/replicas",
        &[("authorization", "Bearer admin-k2")],
        b"",
    );
    assert_ne!(r.status, 200);
    std::fs::remove_dir_all(file.parent().unwrap()).unwrap();

    // Without admin_keys_file there is no admin API.
    let plain = Router::start(&[&a], "");
    assert_eq!(
        admin(&plain, "GET", "/admin/replicas", Some(KEY)).status,
        404
    );
}

#[test]
fn a_rolling_engine_restart_driven_through_the_admin_api_loses_no_request() {
    let mut sims = [Sim::start("a", &[]), Sim::start("b", &[])];
    let (router, file) = start(
        &sims.iter().collect::<Vec<_>>(),
        "rolling",
        "health_check: {interval_ms: 100}\n",
    );
    let router = Arc::new(router);
    // Steady load: agent conversations (pinned to either replica) and singles.
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(Mutex::new(Vec::new()));
    let load: Vec<_> = (0..4)
        .map(|client| {
            let (router, stop, answers) =
                (Arc::clone(&router), Arc::clone(&stop), Arc::clone(&answers));
            std::thread::spawn(move || {
                let mut turn = 0;
                while !stop.load(Ordering::Relaxed) {
                    let body = if turn % 3 == 2 {
                        single(&format!("one-shot {client} {turn}"))
                    } else {
                        conversation(&format!("agent {client}"), turn % 12)
                    };
                    let r = router.post("/v1/chat/completions", &body);
                    answers.lock().unwrap().push((r.status, r.text()));
                    turn += 1;
                }
            })
        })
        .collect();
    let served = |sim: &Sim| sim.received();
    for i in 0..sims.len() {
        let name = sims[i].name.clone();
        let r = admin(
            &router,
            "POST",
            &format!("/admin/replicas/{name}/drain"),
            Some(KEY),
        );
        assert_eq!(
            (r.status, &r.json()["drained"]),
            (200, &serde_json::json!(true))
        );
        assert_eq!(
            router.metric(&format!(
                "prefix_router_replica_drained{{replica=\"{name}\"}}"
            )),
            1.0
        );
        // Its requests in flight run to their end; then nothing reaches it.
        wait_for(
            "the drained replica to empty",
            Duration::from_secs(20),
            || (replica(&router, &name)["in_flight"] == 0).then_some(()),
        );
        let before = served(&sims[i]);
        let others: u64 = sims.iter().filter(|s| s.name != name).map(served).sum();
        wait_for(
            "requests to reach the others",
            Duration::from_secs(20),
            || {
                (sims
                    .iter()
                    .filter(|s| s.name != name)
                    .map(served)
                    .sum::<u64>()
                    > others + 20)
                    .then_some(())
            },
        );
        assert_eq!(
            served(&sims[i]),
            before,
            "a drained replica was sent a request"
        );
        // The engine stops (its checks fail: it is down), then a new
        // process starts on the same port.
        let addr = sims[i].addr.to_string();
        sims[i].kill();
        wait_for(
            "the stopped engine to be down",
            Duration::from_secs(20),
            || (replica(&router, &name)["health"] == "down").then_some(()),
        );
        sims[i] = Sim::start_on(&addr, &name, &[]);
        wait_for(
            "the restarted engine to pass its checks",
            Duration::from_secs(20),
            || (replica(&router, &name)["health"] == "up").then_some(()),
        );
        let r = admin(
            &router,
            "POST",
            &format!("/admin/replicas/{name}/undrain"),
            Some(KEY),
        );
        assert_eq!(
            (r.status, &r.json()["drained"]),
            (200, &serde_json::json!(false))
        );
        wait_for(
            "requests to reach it again",
            Duration::from_secs(20),
            || (served(&sims[i]) > 0).then_some(()),
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    let answers = answers.lock().unwrap();
    let failed: Vec<_> = answers.iter().filter(|(s, _)| *s != 200).collect();
    assert!(answers.len() > 100, "only {} requests ran", answers.len());
    assert!(
        failed.is_empty(),
        "{} of {} failed: {:?}",
        failed.len(),
        answers.len(),
        &failed[..failed.len().min(3)]
    );
    std::fs::remove_dir_all(file.parent().unwrap()).unwrap();
}

#[test]
fn a_drained_replica_still_answers_the_responses_only_its_engine_holds() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let (router, file) = start(&[&a, &b], "responses", "");
    let turn = |input: &str, previous: Option<&str>| {
        let mut body = serde_json::json!({"model": "sim", "input": input, "max_output_tokens": 2});
        if let Some(id) = previous {
            body["previous_response_id"] = serde_json::json!(id);
        }
        body
    };
    let first = router.post("/v1/responses", &turn("a stored conversation", None));
    assert_eq!(first.status, 200, "{}", first.text());
    let (id, holder) = (
        first.json()["id"].as_str().unwrap().to_owned(),
        first.replica().to_owned(),
    );
    let r = admin(
        &router,
        "POST",
        &format!("/admin/replicas/{holder}/drain"),
        Some(KEY),
    );
    assert_eq!(r.status, 200);
    // New work goes elsewhere; the turn that needs the stored response goes
    // to the engine that has it.
    for i in 0..4 {
        let r = router.post("/v1/responses", &turn(&format!("new {i}"), None));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_ne!(r.replica(), holder, "new work reached the drained replica");
    }
    let next = router.post("/v1/responses", &turn("and then?", Some(&id)));
    assert_eq!(next.status, 200, "{}", next.text());
    assert_eq!(next.replica(), holder);
    std::fs::remove_dir_all(file.parent().unwrap()).unwrap();
}
