//! Tenants on one fleet: who a request belongs to (its key's line, or a
//! header), and each tenant's limits answered 429 with `Retry-After` and
//! OpenAI's `x-ratelimit-*` headers, before the body is read, others
//! unaffected, limits reloaded.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::http::{self, Response};
use common::{sha256_hex, single, wait_for, Router, Sim};

fn post_as(router: &Router, headers: &[(&str, &str)], text: &str) -> Response {
    let body = serde_json::to_vec(&single(text)).unwrap();
    http::request(router.addr, "POST", "/v1/chat/completions", headers, &body)
}

fn refused_by(r: &Response, limit: &str) {
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("tenant `"), "{message}");
    assert!(message.contains(limit), "{message}");
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    let after_ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(
        after >= 1 && after * 1000 >= after_ms,
        "{after} s, {after_ms} ms"
    );
}

#[test]
fn a_tenant_past_its_requests_per_minute_is_refused_before_its_body_and_others_go_on() {
    let a = Sim::start("a", &[]);
    let keys = format!(
        "{} tenant=acme\n{} tenant=beta\n",
        sha256_hex("k-acme"),
        sha256_hex("k-beta")
    );
    let dir = std::env::temp_dir().join(format!("prefix-router-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys_file = dir.join("keys");
    std::fs::write(&keys_file, keys).unwrap();
    let extra = |beta: &str| {
        format!(
            "api_keys_file: \"{}\"\ntenants:\n  named:\n    acme: {{requests_per_minute: 3}}\n{beta}",
            keys_file.display()
        )
    };
    let router = Router::start(&[&a], &extra(""));
    let acme = [("authorization", "Bearer k-acme")];
    let beta = [("authorization", "Bearer k-beta")];
    for left in ["2", "1", "0"] {
        let r = post_as(&router, &acme, "acme asks");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("3"));
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some(left));
        assert!(r.header("x-ratelimit-reset-requests").is_some());
    }
    // The fourth is answered at its head: a 1 MB body it never sends.
    let received = a.received();
    refused_at_head(&router, "authorization: Bearer k-acme\r\n", "requests");
    let r = post_as(&router, &acme, "acme again");
    refused_by(&r, "3 requests per minute");
    // A minute of 3 refills one request in 20 s.
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!((15_000..=20_000).contains(&ms), "{ms}");
    assert_eq!(
        a.received(),
        received,
        "a refused request reached the engine"
    );
    // Another tenant is not held back and carries no limit headers.
    for _ in 0..10 {
        let r = post_as(&router, &beta, "beta asks");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit-requests"), None);
    }
    assert_eq!(
        router.metric("prefix_router_tenant_refused_total{limit=\"requests\",tenant=\"acme\"}"),
        2.0
    );
    assert_eq!(
        router.metric("prefix_router_tenant_requests_total{tenant=\"beta\"}"),
        10.0
    );
    // Limits reload: beta gets one request per minute.
    router.rewrite(&Router::yaml(
        &[&a],
        &extra("    beta: {requests_per_minute: 1}\n"),
    ));
    wait_for("beta's limit", Duration::from_secs(10), || {
        let r = post_as(&router, &beta, "beta asks");
        (r.header("x-ratelimit-limit-requests") == Some("1")).then_some(())
    });
    // Its one request this minute was that one: the next is refused.
    refused_by(
        &post_as(&router, &beta, "beta asks"),
        "1 requests per minute",
    );
}

/// Sends a request's head, declaring `declared` body bytes, and only the
/// first of them: the request is in progress until the connection closes.
fn partial(router: &Router, headers: &str, declared: usize) -> TcpStream {
    let mut s = TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{headers}content-length: {declared}\r\n\r\n{{"
    )
    .unwrap();
    s
}

fn hold(router: &Router, tenant: &str) -> TcpStream {
    partial(router, &format!("x-tenant: {tenant}\r\n"), 100)
}

#[test]
fn a_header_named_tenant_holds_at_most_max_concurrent_requests_until_one_ends() {
    let a = Sim::start("a", &[]);
    let router = Router::start(
        &[&a],
        "tenants:\n  header: x-tenant\n  default: {max_concurrent: 2}\n",
    );
    let team = [("x-tenant", "team-a")];
    let held = [hold(&router, "team-a"), hold(&router, "team-a")];
    wait_for("two in progress", Duration::from_secs(10), || {
        let series = "prefix_router_tenant_in_progress_requests{tenant=\"other\"}";
        (router.metric(series) == 2.0).then_some(())
    });
    refused_by(
        &post_as(&router, &team, "one more"),
        "2 requests in progress",
    );
    // Another tenant, and requests naming none (`anonymous`), go on.
    assert_eq!(post_as(&router, &[("x-tenant", "team-b")], "b").status, 200);
    assert_eq!(post_as(&router, &[], "nobody").status, 200);
    // A header that cannot name a tenant is the client's error.
    let r = post_as(&router, &[("x-tenant", "a/b")], "bad");
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (400, Some("invalid_tenant"))
    );
    drop(held);
    wait_for("a slot back", Duration::from_secs(10), || {
        (post_as(&router, &team, "again").status == 200).then_some(())
    });
}

/// Asserts that a request sent with only part of a 1 MB body is answered
/// 429 at its head, `limit` (`requests`, `tokens`) at 0 left.
fn refused_at_head(router: &Router, headers: &str, limit: &str) {
    let mut s = partial(router, headers, 1_000_000);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = String::new();
    let mut buf = [0u8; 4096];
    while !answer.contains("\r\n\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed without an answer: {answer}");
        answer.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    let left = format!("x-ratelimit-remaining-{limit}: 0");
    assert!(answer.contains(&left), "{answer}");
}

#[test]
fn prompt_tokens_are_charged_as_the_engine_counts_them_and_a_debt_waits_at_the_head() {
    // The engine counts a token per byte; the router estimates 4 bytes each.
    let a = Sim::start("a", &["--bytes-per-token", "1"]);
    let router = Router::start(
        &[&a],
        "tenants:\n  header: x-tenant\n  default: {prompt_tokens_per_minute: 3000}\n  named: {t1: {}, t2: {}}\n",
    );
    let (t1, t2) = ([("x-tenant", "t1")], [("x-tenant", "t2")]);
    // t1: about 2,000 tokens estimated, 8,000 counted: a debt.
    let r = post_as(&router, &t1, &"word ".repeat(1600));
    assert_eq!(r.status, 200, "{}", r.text());
    let reported = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(reported > 8000, "{reported}");
    let remaining: u64 = r
        .header("x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (900..1100).contains(&remaining),
        "the estimate is charged at the body: {remaining}"
    );
    wait_for(
        "the reported count charged",
        Duration::from_secs(10),
        || {
            let series = "prefix_router_tenant_prompt_tokens_total{tenant=\"t1\"}";
            (router.metric(series) == reported as f64).then_some(())
        },
    );
    // In debt, its next request is answered at its head, before its body.
    let received = a.received();
    refused_at_head(&router, "x-tenant: t1\r\n", "tokens");
    let r = post_as(&router, &t1, "short");
    refused_by(&r, "3000 prompt tokens per minute");
    // The debt (about 5,000) and one token refill in about 100 s.
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!((90_000..=110_000).contains(&ms), "{ms}");
    // t2 is not held back by t1's debt; a prompt larger than what it has
    // left is refused once its body is read, and reaches no engine.
    assert_eq!(post_as(&router, &t2, "a short question").status, 200);
    let after_one = a.received();
    refused_by(
        &post_as(&router, &t2, &"word ".repeat(2500)),
        "3000 prompt tokens per minute",
    );
    assert_eq!(
        a.received(),
        after_one,
        "a refused request reached the engine"
    );
    assert_eq!(after_one, received + 1);
    // The refusal cost t2 nothing: a prompt that fits goes on.
    assert_eq!(post_as(&router, &t2, &"word ".repeat(300)).status, 200);
}

/// Posts as `tenant` on a thread; the answer comes on `done` with the tenant.
fn post_in_background(
    router: &Router,
    tenant: &'static str,
    done: &std::sync::mpsc::Sender<(&'static str, Response)>,
) {
    let (addr, done) = (router.addr, done.clone());
    std::thread::spawn(move || {
        let body = serde_json::to_vec(&single(tenant)).unwrap();
        let headers = [("x-tenant", tenant)];
        let r = http::request(addr, "POST", "/v1/chat/completions", &headers, &body);
        let _ = done.send((tenant, r));
    });
}

#[test]
fn a_flooding_tenant_waits_its_turn_and_a_quiet_one_gets_the_next_place() {
    // Streams hold their places while they decode (10 tokens a second).
    let a = Sim::start("a", &["--decode-tps", "10"]);
    let router = Router::start(
        &[&a],
        "shed_in_flight: 2\nqueue: {max_waiting: 3, share_window_ms: 1000}\ntenants: {header: x-tenant}\n",
    );
    let flood = [("x-tenant", "flood")];
    let long = common::streaming("flood holds a place", 1000);
    let mut streams: Vec<_> = (0..2)
        .map(|_| http::EventStream::open_with(router.addr, "/v1/chat/completions", &flood, &long))
        .collect();
    assert!(streams.iter().all(|s| s.status == 200));
    let waiting = || router.metric("prefix_router_queue_waiting_requests");
    let (done, answers) = std::sync::mpsc::channel();
    for _ in 0..3 {
        post_in_background(&router, "flood", &done);
    }
    wait_for("3 waiting", Duration::from_secs(10), || {
        (waiting() == 3.0).then_some(())
    });
    // The queue is full: a quiet tenant's request takes the flood's newest
    // place in line, which is answered 429.
    post_in_background(&router, "quiet", &done);
    let (who, r) = answers.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((who, r.status), ("flood", 429), "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "queue_full");
    // A flood stream ends: its place goes to the quiet tenant, not to the
    // flood's two waiting ahead of it (the flood holds its share).
    drop(streams.pop());
    let (who, r) = answers.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((who, r.status), ("quiet", 200), "{}", r.text());
    assert_eq!(waiting(), 2.0);
    // Alone again, the flood gets every place.
    drop(streams);
    for _ in 0..2 {
        let (who, r) = answers.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!((who, r.status), ("flood", 200), "{}", r.text());
    }
    let series = "prefix_router_tenant_refused_total{limit=\"queue\",tenant=\"other\"}";
    assert_eq!(router.metric(series), 1.0);
}

#[test]
fn a_request_waiting_past_the_queue_deadline_is_answered_503() {
    let a = Sim::start("a", &["--decode-tps", "10"]);
    let router = Router::start(&[&a], "shed_in_flight: 1\nqueue: {deadline_ms: 300}\n");
    let held = http::EventStream::open(
        router.addr,
        "/v1/chat/completions",
        &common::streaming("holds the place", 1000),
    );
    assert_eq!(held.status, 200);
    let r = router.post("/v1/chat/completions", &single("waits"));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "queue_timeout");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(held);
    wait_for("the place back", Duration::from_secs(10), || {
        (router.post("/v1/chat/completions", &single("again")).status == 200).then_some(())
    });
}

#[test]
fn a_reload_that_turns_the_queue_off_lets_its_waiters_go_on() {
    let a = Sim::start("a", &["--decode-tps", "10"]);
    let router = Router::start(&[&a], "shed_in_flight: 1\nqueue: {deadline_ms: 60000}\n");
    let held = http::EventStream::open(
        router.addr,
        "/v1/chat/completions",
        &common::streaming("holds the place", 1000),
    );
    assert_eq!(held.status, 200);
    let (done, answers) = std::sync::mpsc::channel();
    post_in_background(&router, "waiter", &done);
    wait_for("one waiting", Duration::from_secs(10), || {
        (router.metric("prefix_router_queue_waiting_requests") == 1.0).then_some(())
    });
    router.rewrite(&Router::yaml(&[&a], ""));
    let (_, r) = answers.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    drop(held);
}
