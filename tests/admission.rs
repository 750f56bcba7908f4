//! Admission, black-box: a slot is a request in flight to a replica, not a
//! client still sending its body; every body has a whole-body deadline; one
//! client address can be held to its share; identifiers have caps.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{http, single, wait_for, Router, Sim};

/// Starts a POST declaring `declared` body bytes and sends only `partial`;
/// the upload stays open while the stream lives.
fn start_upload(addr: SocketAddr, path: &str, declared: usize, partial: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).expect("head");
    s.write_all(partial).expect("partial body");
    s
}

/// Waits until the router buffers at least `n` body bytes.
fn wait_buffered(router: &Router, n: f64) {
    wait_for("bodies to be buffered", Duration::from_secs(10), || {
        (router.metric("prefix_router_buffered_body_bytes") >= n).then_some(())
    });
}

#[test]
fn clients_trickling_their_uploads_hold_no_slot() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "limits: {max_requests: 2}\n");
    let partial = b"{\"messages\": [";
    let _uploads: Vec<TcpStream> = (0..2)
        .map(|_| start_upload(router.addr, "/v1/chat/completions", 4096, partial))
        .collect();
    wait_buffered(&router, (2 * partial.len()) as f64);
    let r = router.post("/v1/chat/completions", &single("not starved"));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_body_on_a_path_the_router_does_not_route_that_stops_arriving_gets_a_408() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "body_read_timeout_ms: 1000\n");
    let started = Instant::now();
    // A path the router does not route: its body is read whole all the same.
    let r = http::send_stalled(router.addr, "/v1/files", 4096, b"--part");
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "body_timeout");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn one_client_address_is_held_to_its_share_of_requests() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "limits: {max_requests_per_client: 1}\n");
    let upload = start_upload(router.addr, "/v1/chat/completions", 4096, b"{");
    wait_buffered(&router, 1.0);
    let r = router.post("/v1/chat/completions", &single("a second at once"));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(upload);
    wait_for(
        "the client's request to end",
        Duration::from_secs(10),
        || {
            let r = router.post("/v1/chat/completions", &single("after"));
            (r.status == 200).then_some(())
        },
    );
}

#[test]
fn a_body_on_another_path_is_forwarded_whole_and_resent_once_after_a_failed_write() {
    // a never reads a body over 1 MiB; the router reads every body whole, so
    // one on a path it does not route can go to b once the write to a fails
    // (streamed, only Pingora's 64 KiB retry buffer could have been re-sent).
    let a = Sim::start("a", &["--stall-bodies-over", "1048576"]);
    let b = Sim::start("b", &[]);
    let router = Router::start(
        &[&a, &b],
        "health_check: {interval_ms: 60000}\nmax_body_bytes: 33554432\ntimeouts: {write_ms: 3000}\n",
    );
    // Larger than loopback's socket buffers together, so the write blocks.
    let names: Vec<String> = (0..800_000).map(|i| format!("m{i:07}")).collect();
    let body = serde_json::to_vec(&names).unwrap();
    for _ in 0..2 {
        let r = http::request(router.addr, "POST", "/sim/models", &[], &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.json()["models"].as_array().map(Vec::len),
            Some(names.len())
        );
    }
    assert!(
        a.stats()["stalled"].as_u64().unwrap() >= 1,
        "the counter never chose a"
    );
}

#[test]
fn identifiers_past_their_caps_get_a_400_and_never_reach_a_replica() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    for (field, len) in [("prompt_cache_key", 4096), ("model", 300)] {
        let mut body = single("capped");
        body[field] = serde_json::json!("x".repeat(len));
        let r = router.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{field}: {}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["code"], "string_above_max_length");
        assert_eq!(error["type"], "invalid_request_error");
        assert!(
            error["message"].as_str().unwrap().contains(field),
            "{error}"
        );
    }
    assert_eq!(a.stats()["requests"], 0, "nothing reached the engine");
    let mut body = single("within");
    body["prompt_cache_key"] = serde_json::json!("k".repeat(1024));
    assert_eq!(router.post("/v1/chat/completions", &body).status, 200);
}

#[test]
fn request_heads_count_in_the_byte_budget() {
    // A head is held until its request ends: 4,000 connections with 1 MiB
    // heads were 4 GiB nobody counted.
    let a = Sim::start("a", &[]);
    let router = Router::start(
        &[&a],
        "max_body_bytes: 8192\nlimits: {max_buffered_bytes: 16384}\n",
    );
    let pad = "x".repeat(20_000);
    let body = serde_json::to_vec(&single("big head")).expect("json");
    let headers = [
        ("content-type", "application/json"),
        ("x-pad", pad.as_str()),
    ];
    let r = http::request(router.addr, "POST", "/v1/chat/completions", &headers, &body);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("overloaded"), "{}", r.text());
    assert_eq!(a.received(), 0);
    // A head that fits is served, and the budget is whole again after it.
    assert_eq!(
        router
            .post("/v1/chat/completions", &single("small head"))
            .status,
        200
    );
    wait_for("the budget back to empty", Duration::from_secs(5), || {
        (router.metric("prefix_router_buffered_body_bytes") == 0.0).then_some(())
    });
}
