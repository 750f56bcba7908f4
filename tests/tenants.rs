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
    let mut s = TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k-acme\r\ncontent-length: 1000000\r\n\r\n{{\"model\""
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = String::new();
    let mut buf = [0u8; 4096];
    while !answer.contains("\r\n\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed without an answer: {answer}");
        answer.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(
        answer.contains("x-ratelimit-remaining-requests: 0"),
        "{answer}"
    );
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
        (post_as(&router, &beta, "beta asks").status == 429).then_some(())
    });
    refused_by(
        &post_as(&router, &beta, "beta asks"),
        "1 requests per minute",
    );
}

/// Sends a request's head and part of its body: the request is in progress
/// until the connection closes.
fn hold(router: &Router, tenant: &str) -> TcpStream {
    let mut s = TcpStream::connect(router.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-tenant: {tenant}\r\ncontent-length: 100\r\n\r\n{{"
    )
    .unwrap();
    s
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

#[test]
fn prompt_tokens_are_charged_as_the_engine_counts_them_and_a_debt_waits() {
    // The engine counts a token per 2 bytes; the router estimates 4.
    let a = Sim::start("a", &["--bytes-per-token", "2"]);
    let router = Router::start(
        &[&a],
        "tenants:\n  default: {prompt_tokens_per_minute: 3000}\n",
    );
    let text = "word ".repeat(800);
    let r = post_as(&router, &[], &text);
    assert_eq!(r.status, 200, "{}", r.text());
    let reported = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(reported > 2000, "{reported}");
    // The estimate (about half) was charged first: the head says so.
    let remaining: u64 = r
        .header("x-ratelimit-remaining-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        remaining > 3000 - reported,
        "{remaining} left after {reported}"
    );
    wait_for(
        "the reported count charged",
        Duration::from_secs(10),
        || {
            let series = "prefix_router_tenant_prompt_tokens_total{tenant=\"anonymous\"}";
            (router.metric(series) == reported as f64).then_some(())
        },
    );
    // Corrected, fewer than a prompt's estimate (about 1000) is left.
    let r = post_as(&router, &[], &text);
    refused_by(&r, "3000 prompt tokens per minute");
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("3000"));
}
