//! Who may use the listener and what a client can learn or smuggle: API
//! keys checked before any body is read, placement headers off, path
//! variants, request smuggling.

mod common;

use std::time::Duration;

use common::http;
use common::{conversation, single, wait_for, Router, Sim};

#[test]
fn placement_headers_off_hides_replicas_from_clients() {
    let a = Sim::start("a", &["--hang-after-requests", "1"]);
    let router = Router::start(
        &[&a],
        "placement_headers: false\ntimeouts: {read_ms: 300}\n",
    );
    let r = router.post("/v1/chat/completions", &conversation("quiet", 0));
    assert_eq!(r.status, 200);
    assert_eq!(
        (
            r.header("x-prefix-router-replica"),
            r.header("x-prefix-router-decision")
        ),
        (None, None)
    );
    let r = router.post("/v1/chat/completions", &conversation("quiet", 1));
    assert_eq!(r.status, 504);
    assert!(!r.text().contains("replica a"), "{}", r.text());
}

#[test]
fn path_variants_are_limited_and_routed_as_the_canonical_path() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 1000\n");
    let big = serde_json::to_vec(&single(&"y".repeat(5000))).unwrap();
    let small = serde_json::to_vec(&conversation("path", 1)).unwrap();
    router.post("/v1/chat/completions", &conversation("path", 0));
    for path in [
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/chat/%63ompletions",
        "/v1/chat/./completions?x=1",
    ] {
        let r = http::request(router.addr, "POST", path, &[], &big);
        assert_eq!(r.status, 413, "{path} skipped the body limit");
        let r = http::request(router.addr, "POST", path, &[], &small);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.decision(), "pin", "{path} was not routed by prompt");
    }
}

fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn api_keys_gate_the_listener_before_any_body_is_read_and_reload() {
    let a = Sim::start("a", &[]);
    let dir = std::env::temp_dir().join(format!("prefix-router-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("# clients\n{}\n", sha256_hex("k1"))).unwrap();
    // At `info` a request line is logged per request: it must not carry a key.
    let router = Router::start_with_env(
        &[&a],
        &format!("api_keys_file: \"{}\"\n", keys.display()),
        &[("RUST_LOG", "info")],
    );
    let body = serde_json::to_vec(&single("who?")).unwrap();
    let post = |auth: &[(&str, &str)]| {
        http::request(router.addr, "POST", "/v1/chat/completions", auth, &body)
    };
    for auth in [
        &[][..],
        &[("authorization", "Bearer k2")],
        &[("authorization", "k1")],
    ] {
        let r = post(auth);
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(post(&[("authorization", "Bearer k1")]).status, 200);
    assert_eq!(post(&[("x-api-key", "k1")]).status, 200);
    assert_eq!(http::get(router.addr, "/v1/models").status, 401);
    // Refused before the body is read: a declared 1 GiB body is not awaited.
    let r = http::send_stalled(router.addr, "/v1/chat/completions", 1 << 30, b"{");
    assert_eq!(r.status, 401);
    assert_eq!(a.received(), 2);
    std::fs::write(&keys, format!("{}\n", sha256_hex("k2"))).unwrap();
    wait_for("the new keys", Duration::from_secs(10), || {
        (post(&[("authorization", "Bearer k2")]).status == 200).then_some(())
    });
    assert_eq!(post(&[("authorization", "Bearer k1")]).status, 401);
    assert!(router.metric("prefix_router_errors_total{kind=\"invalid_api_key\"}") >= 6.0);
    assert_eq!(
        router.metric("prefix_router_api_keys_reloads_total{file=\"api_keys_file\",result=\"ok\"}"),
        1.0
    );
    let log = router.wait_log("POST /v1/chat/completions status=200");
    assert!(
        !log.contains("k1") && !log.contains("k2"),
        "a key reached the log"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Request-smuggling probes: conflicting or obfuscated framing must never let
/// a second request reach a replica.
#[test]
fn smuggling_probes_never_deliver_a_second_request() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let inner =
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 14\r\n\r\n{\"prompt\":\"x\"}";
    let chunked_inner = format!("0\r\n\r\n{inner}");
    let probes = [
        // CL.TE: a front end that reads Content-Length forwards the rest.
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\ntransfer-encoding: chunked\r\n\r\n{chunked_inner}",
            chunked_inner.len()
        ),
        // TE.CL
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{inner}\r\n0\r\n\r\n",
            inner.len()
        ),
        // Two different Content-Lengths.
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 14\r\ncontent-length: {}\r\n\r\n{{\"prompt\":\"x\"}}{inner}",
            14 + inner.len()
        ),
        // Obfuscated Transfer-Encoding.
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: xchunked\r\ncontent-length: 14\r\n\r\n{{\"prompt\":\"x\"}}{inner}"),
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding : chunked\r\n\r\n{chunked_inner}"),
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked, identity\r\n\r\n{chunked_inner}"),
    ];
    for (i, probe) in probes.iter().enumerate() {
        let before = a.received();
        let answer = http::raw(router.addr, probe.as_bytes());
        let delivered = a.received() - before;
        assert!(
            delivered <= 1,
            "probe {i}: {delivered} requests reached the replica: {answer}"
        );
        let responses = answer.matches("HTTP/1.1 ").count();
        assert!(responses <= 1, "probe {i}: {responses} responses: {answer}");
    }
    assert_eq!(
        router.post("/v1/chat/completions", &single("after")).status,
        200
    );
}
