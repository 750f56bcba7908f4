//! Admission, black-box: a slot is a request in flight to a replica, not a
//! client still sending its body; bodies streamed unread have a whole-body
//! deadline; one client address can be held to its share.

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
fn a_body_streamed_unread_that_stops_arriving_gets_a_408() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "body_read_timeout_ms: 1000\n");
    let started = Instant::now();
    // A path the router does not read: the body goes to the replica as it comes.
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
