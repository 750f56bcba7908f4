//! The worst day, black-box: hostile bodies, hung and failing replicas,
//! overloaded accept queues, truncated configs, clients that send before they
//! read or stop reading. Each test is named for the fault it survives.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::http::{self, EventStream};
use common::{conversation, single, streaming, wait_for, Router, Sim, TricklingReplica};
use serde_json::json;

/// Health checks every minute: only the request path acts during a test.
const SLOW_HEALTH: &str = "health_check: {interval_ms: 60000}\n";

#[test]
fn a_body_repeating_a_top_level_key_parses_in_linear_time() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 8388608\n");
    // ~2 MiB either way: one long system prompt, or 87k repeats of a short one
    // (the quadratic parser spent seconds on the second).
    let repeated: String = (0..87_000)
        .map(|i| format!("\"system\":\"s{i:05}\","))
        .collect();
    let hostile = format!(
        "{{{repeated}\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":1}}"
    );
    let plain = serde_json::to_vec(&json!({"system": "s".repeat(hostile.len()),
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
    .unwrap();
    let timed = |body: &[u8]| {
        let t = Instant::now();
        let r = http::request(router.addr, "POST", "/v1/messages", &[], body);
        assert_eq!(r.status, 200, "{}", r.text());
        t.elapsed()
    };
    let plain_time = timed(&plain);
    let hostile_time = timed(hostile.as_bytes());
    // Generous: linear parsing is within a small factor; quadratic was ~300x.
    assert!(
        hostile_time < plain_time * 20 + Duration::from_secs(1),
        "repeated keys took {hostile_time:?}, a plain body of the same size {plain_time:?}"
    );
    // A 4 MiB system prompt, then 100k empty message lists: each list once
    // copied the fields before it (400 GB of copies).
    let lists = "\"messages\":[],".repeat(100_000);
    let hostile = format!(
        "{{\"system\":\"{}\",{lists}\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":1}}",
        "s".repeat(4 << 20)
    );
    let plain = serde_json::to_vec(&json!({"system": "s".repeat(hostile.len()),
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
    .unwrap();
    let plain_time = timed(&plain);
    let hostile_time = timed(hostile.as_bytes());
    // Measured here (debug build): 0.74 s against 0.76 s, and 12.6 s before.
    assert!(
        hostile_time < plain_time * 5 + Duration::from_secs(1),
        "repeated lists took {hostile_time:?}, a plain body of the same size {plain_time:?}"
    );
}

#[test]
fn expect_100_continue_with_every_replica_down_still_gets_the_503_json() {
    let (mut a, mut b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], SLOW_HEALTH);
    a.kill();
    b.kill();
    let body = serde_json::to_vec(&single("anyone?")).unwrap();
    for _ in 0..2 {
        let r = http::request(
            router.addr,
            "POST",
            "/v1/chat/completions",
            &[("expect", "100-continue")],
            &body,
        );
        assert!(r.continued);
        assert_eq!(r.status, 503);
        assert_eq!(r.json()["error"]["code"], "no_replica");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
}

#[test]
fn a_hung_replica_gets_each_request_once_and_the_client_a_504() {
    // The replica answers one request, then takes requests and never answers.
    let a = Sim::start("a", &["--hang-after-requests", "1"]);
    let router = Router::start(&[&a], &format!("{SLOW_HEALTH}timeouts: {{read_ms: 300}}\n"));
    assert_eq!(
        router.post("/v1/chat/completions", &single("warm")).status,
        200
    );
    for i in 0..2 {
        // The pooled connection from the first request is reused here.
        let r = router.post("/v1/chat/completions", &single(&format!("hang {i}")));
        assert_eq!(r.status, 504, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "upstream_timeout");
    }
    assert_eq!(a.received(), 3, "a request was delivered twice");
    // A keep-alive client: the error answer must not offer a connection the
    // router then closes (the client's next request would fail to send).
    let bodies: Vec<Vec<u8>> = (0..2)
        .map(|i| serde_json::to_vec(&single(&format!("keep-alive {i}"))).unwrap())
        .collect();
    for r in http::keepalive_posts(router.addr, "/v1/chat/completions", &bodies) {
        assert_eq!(
            r.expect("transport error on a reused connection").status,
            504
        );
    }
}

#[test]
fn a_replica_trickling_its_response_head_gets_a_504_at_the_total_deadline() {
    // One head byte per 50 ms: the 2 s per-read timeout never fires.
    let t = TricklingReplica::start();
    let router = Router::spawn(
        &format!(
            "{SLOW_HEALTH}timeouts: {{read_ms: 2000, response_header_ms: 1000}}\nreplicas:\n{}",
            t.yaml("t")
        ),
        &[],
    );
    router.wait_replica_up("t", true);
    let started = Instant::now();
    let r = router.post("/v1/chat/completions", &single("trickle"));
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_timeout");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the deadline did not cut the wait: {:?}",
        started.elapsed()
    );
    assert_eq!(t.received(), 1, "a request was delivered twice");
}

#[test]
fn no_attempt_starts_after_the_response_head_deadline() {
    // A write to a fails at 2 s, after the 1.5 s deadline: the request must
    // not go on to b, whose attempt would start already late.
    let a = Sim::start("a", &["--stall-bodies-over", "1048576"]);
    let b = Sim::start("b", &[]);
    let router = Router::start(
        &[&a, &b],
        &format!(
            "{SLOW_HEALTH}max_body_bytes: 33554432\n\
             timeouts: {{write_ms: 2000, read_ms: 60000, response_header_ms: 1500}}\n"
        ),
    );
    let big = serde_json::to_vec(&single(&"d".repeat(24 << 20))).unwrap();
    let (mut ok_from_b, mut timed_out) = (0, 0);
    for _ in 0..2 {
        let r = http::request(router.addr, "POST", "/v1/chat/completions", &[], &big);
        match r.status {
            200 => {
                assert_eq!(r.replica(), "b");
                ok_from_b += 1;
            }
            504 => timed_out += 1,
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    let stalled = a.stats()["stalled"].as_u64().unwrap();
    assert!(stalled >= 1, "the counter never chose a");
    assert_eq!(
        timed_out, stalled,
        "a request a never read was answered by b"
    );
    assert_eq!(
        b.received(),
        ok_from_b,
        "b got a request after its deadline"
    );
}

#[test]
fn a_client_trickling_its_request_head_is_disconnected() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "client_timeouts: {header_ms: 500}\n");
    let mut s = std::net::TcpStream::connect(router.addr).unwrap();
    let mut reader = s.try_clone().unwrap();
    reader
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // The router sends nothing for an unfinished head: it closes (or resets).
    let closed = std::thread::spawn(move || match reader.read(&mut [0u8; 256]) {
        Ok(n) => n == 0,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    });
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n")
        .unwrap();
    let started = Instant::now();
    // Everyone else is served meanwhile.
    assert_eq!(
        router
            .post("/v1/chat/completions", &single("meanwhile"))
            .status,
        200
    );
    // A header byte every 100 ms (Pingora's own per-read timeout is 60 s).
    while !closed.is_finished() && started.elapsed() < Duration::from_secs(30) {
        if s.write_all(b"x").is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        closed.join().unwrap(),
        "the slow head was neither closed nor reset"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the slow head was kept for {:?}",
        started.elapsed()
    );
    // Idle is not slow: a head's deadline starts at its first byte, so a
    // keep-alive connection idle past header_ms is still served.
    let mut k = std::net::TcpStream::connect(router.addr).unwrap();
    http::keepalive_post(&mut k, "/v1/embeddings");
    std::thread::sleep(Duration::from_millis(1200));
    http::keepalive_post(&mut k, "/v1/embeddings");
}

#[test]
fn a_request_whose_write_failed_is_resent_once_to_another_replica() {
    // a never reads a body over 1 MiB: the router's write times out, so the
    // engine never had the request whole, and b may take it.
    let a = Sim::start("a", &["--stall-bodies-over", "1048576"]);
    let b = Sim::start("b", &[]);
    // The read and response-head timeouts keep their defaults (600 s): the
    // retry comes within write_ms and a short wait for an early answer. The
    // body goes out as one write under one write_ms: b must take 24 MiB
    // within it, on a loaded machine too.
    let router = Router::start(
        &[&a, &b],
        &format!("{SLOW_HEALTH}max_body_bytes: 33554432\ntimeouts: {{write_ms: 3000}}\n"),
    );
    let started = Instant::now();
    // Larger than loopback's socket buffers together, so the write blocks.
    let big = serde_json::to_vec(&single(&"w".repeat(24 << 20))).unwrap();
    for _ in 0..2 {
        let r = http::request(router.addr, "POST", "/v1/chat/completions", &[], &big);
        assert_eq!((r.status, r.replica()), (200, "b"), "{}", r.text());
    }
    assert!(
        a.stats()["stalled"].as_u64().unwrap() >= 1,
        "the counter never chose a"
    );
    assert_eq!((a.received(), b.received()), (0, 2));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn connect_timeouts_are_overload_not_death_and_never_refuse_every_request() {
    let a = Sim::start("a", &["--backlog", "1"]);
    let b = Sim::start("b", &["--backlog", "1"]);
    // No pooling: every request connects, as a burst of new connections does.
    let router = Router::start(
        &[&a, &b],
        &format!(
            "{SLOW_HEALTH}timeouts: {{connect_ms: 200, idle_ms: 0}}\noutlier: {{consecutive_failures: 3, base_ejection_ms: 600000}}\n"
        ),
    );
    let paused_b = b.pause_accept();
    let r = router.post("/v1/chat/completions", &single("first"));
    assert_eq!((r.status, r.replica()), (200, "a"));
    assert_eq!(
        router.metric("prefix_router_replica_up{replica=\"b\"}"),
        1.0,
        "one connect timeout ejected b"
    );
    let picks = router.singles(6, "b is slow");
    assert!(picks.iter().all(|p| p == "a"), "{picks:?}");
    assert_eq!(
        router.metric("prefix_router_replica_up{replica=\"b\"}"),
        0.0
    );
    // Now a is the slow one and b (ejected, accepting again) is all there is:
    // the router must not refuse on its own say-so.
    paused_b.resume();
    let paused_a = a.pause_accept();
    let picks = router.singles(4, "a is slow");
    assert!(picks.iter().all(|p| p == "b"), "{picks:?}");
    assert!(router.metric("prefix_router_panic_routed_total") >= 4.0);
    assert_eq!(
        router
            .metric("prefix_router_ejections_total{reason=\"consecutive_failures\",replica=\"a\"}"),
        0.0,
        "both replicas ejected: past max_ejection_percent"
    );
    paused_a.resume();
}

#[test]
fn an_emptied_config_file_keeps_the_fleet_and_its_pins() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let home = router
        .post("/v1/chat/completions", &conversation("kept", 0))
        .replica()
        .to_owned();
    let errors = "prefix_router_config_reloads_total{result=\"error\"}";
    for (n, text) in ["", "policy: shape\n", "replicas: []\n"].iter().enumerate() {
        router.write_raw(text);
        wait_for("the reload to be rejected", Duration::from_secs(10), || {
            (router.metric(errors) == (n + 1) as f64).then_some(())
        });
    }
    let r = router.post("/v1/chat/completions", &conversation("kept", 1));
    assert_eq!(
        (r.status, r.replica(), r.decision()),
        (200, home.as_str(), "pin")
    );
    assert_eq!(router.singles(2, "fleet").len(), 2);
}

#[test]
fn a_config_caught_mid_write_is_judged_only_when_complete() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    // A slow writer truncates the file, then writes it line by line; every
    // prefix of it is valid YAML, most of them with fewer replicas.
    let full = format!(
        "listen: \"{}\"\nmetrics_listen: \"{}\"\nreload_interval_ms: 100\n# edited\n{}",
        router.addr,
        router.metrics_addr,
        Router::yaml(&[&a, &b], "")
    );
    let mut f = std::fs::File::create(&router.config).unwrap();
    for line in full.split_inclusive('\n') {
        f.write_all(line.as_bytes()).unwrap();
        f.flush().unwrap();
        std::thread::sleep(Duration::from_millis(15)); // the writer's pace, not a sync
    }
    drop(f);
    wait_for(
        "the finished file to apply",
        Duration::from_secs(10),
        || {
            (router.metric("prefix_router_config_reloads_total{result=\"ok\"}") == 1.0)
                .then_some(())
        },
    );
    assert_eq!(
        router.metric("prefix_router_config_reloads_total{result=\"error\"}"),
        0.0,
        "a partial file was judged"
    );
    let picks = router.singles(4, "both");
    assert_eq!(picks.iter().filter(|p| *p == "b").count(), 2, "{picks:?}");
}

#[test]
fn requests_past_the_limits_get_503_with_retry_after_and_the_rest_proceed() {
    let a = Sim::start("a", &["--decode-tps", "20"]);
    let router = Router::start(&[&a], "limits: {max_requests: 1}\n");
    let body = streaming("hold the slot", 40);
    let mut held = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert!(held.next_event().is_some());
    let r = router.post("/v1/chat/completions", &single("one too many"));
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("x-should-retry"), Some("true"));
    while held.next_event().is_some() {}
    drop(held);
    wait_for("the slot to free", Duration::from_secs(10), || {
        let r = router.post("/v1/chat/completions", &single("after"));
        (r.status == 200).then_some(())
    });
}

#[test]
fn with_every_replica_saturated_a_request_is_shed_at_once_with_429() {
    let (a, b) = (
        Sim::start("a", &["--decode-tps", "20"]),
        Sim::start("b", &["--decode-tps", "20"]),
    );
    let router = Router::start(&[&a, &b], "shed_in_flight: 1\n");
    // One stream held on each replica (the counter alternates).
    let mut held: Vec<EventStream> = (0..2)
        .map(|i| {
            let body = streaming(&format!("hold {i}"), 40);
            let mut s = EventStream::open(router.addr, "/v1/chat/completions", &body);
            assert!(s.next_event().is_some());
            s
        })
        .collect();
    let replicas: Vec<_> = held
        .iter()
        .filter_map(|s| s.header("x-prefix-router-replica"))
        .collect();
    assert_eq!(replicas.len(), 2);
    assert_ne!(replicas[0], replicas[1]);
    let r = router.post("/v1/chat/completions", &single("one too many"));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "replicas_saturated");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        router.metric("prefix_router_errors_total{kind=\"replicas_saturated\"}"),
        1.0
    );
    // Nothing reached an engine but the two held streams.
    assert_eq!(a.received() + b.received(), 2);
    // One replica frees up: requests flow again.
    while held[0].next_event().is_some() {}
    held.remove(0);
    wait_for("a replica to free", Duration::from_secs(10), || {
        let r = router.post("/v1/chat/completions", &single("after"));
        (r.status == 200).then_some(())
    });
}

#[test]
fn a_declared_body_that_never_arrives_holds_none_of_the_byte_budget() {
    let a = Sim::start("a", &[]);
    let router = Router::start(
        &[&a],
        "max_body_bytes: 100000\nbody_read_timeout_ms: 20000\nlimits: {max_buffered_bytes: 100000}\ntenants: {header: x-tenant, default: {max_concurrent: 10}}\n",
    );
    // Declares 90 kB and sends none of it: its buffer waits for its bytes.
    let _idle = http::stall_upload(
        router.addr,
        "/v1/chat/completions",
        &[("x-tenant", "t")],
        90_000,
        b"",
    );
    wait_for("the upload to be received", Duration::from_secs(10), || {
        let series = "prefix_router_tenant_in_progress_requests{tenant=\"other\"}";
        (router.metric(series) == 1.0).then_some(())
    });
    let held = router.metric("prefix_router_buffered_body_bytes");
    assert!(
        held < 1000.0,
        "an upload that sent nothing holds {held} bytes"
    );
    let big = serde_json::to_vec(&single(&"z".repeat(20_000))).unwrap();
    let r = http::request(router.addr, "POST", "/v1/chat/completions", &[], &big);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_body_past_the_shared_byte_budget_gets_503_before_any_upload() {
    let a = Sim::start("a", &[]);
    let router = Router::start(
        &[&a],
        "max_body_bytes: 100000\nbody_read_timeout_ms: 5000\nlimits: {max_buffered_bytes: 100000}\n",
    );
    // A slow upload declares 90 kB and holds its buffer.
    let addr = router.addr;
    let stalled = std::thread::spawn(move || {
        http::send_stalled(addr, "/v1/chat/completions", 90_000, b"{\"messages\"")
    });
    wait_for(
        "the slow upload to hold its buffer",
        Duration::from_secs(10),
        || (router.metric("prefix_router_buffered_body_bytes") >= 90_000.0).then_some(()),
    );
    let big = serde_json::to_vec(&single(&"z".repeat(20_000))).unwrap();
    let r = http::request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[("expect", "100-continue")],
        &big,
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        !r.continued,
        "a 100 Continue invited an upload that was then refused"
    );
    assert!(r.text().contains("buffered request bytes"), "{}", r.text());
    assert_eq!(stalled.join().unwrap().status, 408);
    wait_for("the budget to be returned", Duration::from_secs(10), || {
        let r = http::request(router.addr, "POST", "/v1/chat/completions", &[], &big);
        (r.status == 200).then_some(())
    });
}

#[test]
fn a_client_that_stops_reading_a_stream_is_dropped_and_its_request_cancelled() {
    let a = Sim::start("a", &["--decode-tps", "200000"]);
    let router = Router::start(&[&a], "client_timeouts: {write_ms: 300}\n");
    let body = streaming("a long stream nobody reads", 2_000_000);
    let mut s = EventStream::open(router.addr, "/v1/chat/completions", &body);
    assert!(s.next_event().is_some());
    // Stop reading; the router's writes back up, time out, and it lets go.
    wait_for(
        "the replica to see the cancellation",
        Duration::from_secs(30),
        || (a.stats()["cancelled"] == 1).then_some(()),
    );
    drop(s);
}

#[test]
fn an_idle_keepalive_client_connection_is_closed() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "client_timeouts: {keepalive_idle_s: 1}\n");
    let mut s = std::net::TcpStream::connect(router.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n")
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    assert!(closed, "the idle connection was kept open");
}
