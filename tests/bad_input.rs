//! What a broken or hostile client sends, black-box: request heads and
//! bodies that do not parse, and uploads refused part-way. Each is answered
//! in the OpenAI error shape with a client error, blames no replica, and
//! leaves the router serving.

mod common;

use common::http::{self, Framing};
use common::{single, Router, Sim};

/// Health checks every minute: only the request path acts during a test.
const SLOW_HEALTH: &str = "health_check: {interval_ms: 60000}\n";

#[test]
fn a_client_that_sends_the_whole_body_before_reading_gets_the_413() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 1000\n");
    let big = serde_json::to_vec(&single(&"y".repeat(4 << 20))).unwrap();
    for framing in [Framing::ContentLength, Framing::Chunked(64 << 10)] {
        let r = http::send_then_read(router.addr, "/v1/chat/completions", &[], &big, framing)
            .unwrap_or_else(|e| panic!("{framing:?}: {e}"));
        assert_eq!(r.status, 413, "{framing:?}");
        assert!(r.text().contains("1000 bytes"), "{}", r.text());
    }
    assert_eq!(a.received(), 0);
}

#[test]
fn a_client_that_sends_the_whole_body_after_100_continue_gets_the_413() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 1000\n");
    // Chunked, so nothing is refused before `100 Continue`; far more than
    // the sockets buffer, so a router that closes without reading the rest
    // resets the connection under the client's writes.
    let big = serde_json::to_vec(&single(&"y".repeat(16 << 20))).unwrap();
    let r = http::send_then_read(
        router.addr,
        "/v1/chat/completions",
        &[("expect", "100-continue")],
        &big,
        Framing::Chunked(64 << 10),
    )
    .expect("the client could not send its body or read the answer");
    assert!(r.continued);
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "body_too_large");
    assert_eq!(a.received(), 0);
}

#[test]
fn a_body_with_broken_framing_gets_a_400_and_no_replica_is_blamed() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], SLOW_HEALTH);
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-type: application/json\r\n";
    for (what, rest) in [
        (
            "a chunk size that is not hex",
            "transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        ),
        (
            "a body cut short of its length",
            "content-length: 100\r\n\r\n{\"model\":",
        ),
    ] {
        // Written whole, then the sending half closed: the answer is read.
        let out = http::raw(router.addr, format!("{head}{rest}").as_bytes());
        assert_400_json(&out, "invalid_body", what);
    }
    // The client's fault is not counted as a replica's.
    assert_eq!(
        router.metric("prefix_router_errors_total{kind=\"upstream_error\"}"),
        0.0
    );
    assert_eq!(
        router.metric("prefix_router_errors_total{kind=\"invalid_body\"}"),
        2.0
    );
    assert_eq!(a.received(), 0);
    assert_eq!(
        router.post("/v1/chat/completions", &single("after")).status,
        200
    );
}

#[test]
fn a_malformed_request_head_gets_a_400_in_json() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], SLOW_HEALTH);
    for (what, head) in [
        (
            "a length that is not a number",
            "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\ncontent-length: abc\r\n\r\n",
        ),
        ("a request line that is not one", "GARBAGE\r\n\r\n"),
        (
            "an HTTP/1.0 body in chunks",
            "POST /v1/chat/completions HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
    ] {
        let out = http::raw(router.addr, head.as_bytes());
        assert_400_json(&out, "invalid_head", what);
    }
    assert_eq!(a.received(), 0);
    assert_eq!(
        router.post("/v1/chat/completions", &single("after")).status,
        200
    );
}

/// `out` (all a raw exchange read) is a 400 in the OpenAI error shape, JSON,
/// with `code`.
fn assert_400_json(out: &str, code: &str, what: &str) {
    assert!(out.starts_with("HTTP/1.1 400"), "{what}: {out}");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((out, ""));
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{what}: {out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: {out}"));
    assert_eq!(v["error"]["code"], code, "{what}: {out}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{what}");
}
