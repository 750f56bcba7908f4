//! The probes on the metrics listener: `/healthz` while the process serves,
//! `/ready` only while a replica is live (an orchestrator holds traffic back
//! otherwise), `/metrics` as before; and the router's own probes of its
//! replicas: their pace, and its wake-ups between them. Real processes.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{get, wait_for, Router, Sim};

#[test]
fn ready_follows_the_live_replicas_and_healthz_the_process() {
    let mut a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let probe = |path: &str| get(router.metrics_addr, path);
    assert_eq!(probe("/healthz").status, 200);
    let ready = probe("/ready");
    assert_eq!(
        (ready.status, ready.text()),
        (200, "1 of 1 replicas live\n".to_owned())
    );
    assert!(probe("/metrics")
        .text()
        .contains("prefix_router_replica_up"));
    // Other paths: nothing (before: the whole page, on any path).
    let other = probe("/admin/../metrics?x");
    assert_eq!(
        (other.status, other.text()),
        (404, "not found\n".to_owned())
    );
    a.kill();
    router.wait_replica_up("a", false);
    wait_for("/ready to say 503", Duration::from_secs(10), || {
        (probe("/ready").status == 503).then_some(())
    });
    assert_eq!(probe("/healthz").status, 200, "alive, not ready");
}

#[test]
fn a_router_whose_replicas_never_came_up_is_not_ready() {
    let dead = common::free_addr();
    let router = Router::spawn(
        &format!("replicas:\n  - {{name: a, addr: \"{dead}\"}}\n"),
        &[],
    );
    assert_eq!(get(router.metrics_addr, "/healthz").status, 200);
    let ready = get(router.metrics_addr, "/ready");
    assert_eq!(
        (ready.status, ready.text()),
        (503, "0 of 1 replicas live\n".to_owned())
    );
}

fn probe(url: &str) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_prefix-router"))
        .args(["--probe", url])
        .output()
        .expect("run prefix-router --probe");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn the_probe_mode_exits_zero_only_on_a_2xx_answer() {
    let mut a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let ready = format!("http://{}/ready", router.metrics_addr);
    let (ok, text) = probe(&ready);
    assert!(ok && text.starts_with("HTTP/1.1 200"), "{text}");
    a.kill();
    router.wait_replica_up("a", false);
    let (ok, text) = probe(&ready);
    assert!(!ok && text.contains("503"), "{text}");
    let (ok, _) = probe(&format!("http://{}/healthz", router.metrics_addr));
    assert!(ok, "alive while not ready");
    let (ok, text) = probe(&format!("http://{}/healthz", common::free_addr()));
    assert!(!ok, "nothing listening: {text}");
    let (ok, text) = probe("https://example.invalid/");
    assert!(!ok && text.contains("http://"), "{text}");
}

/// A replica whose health check takes `delay` to pass and that answers
/// every other request at once.
fn slow_to_check(delay: Duration) -> std::net::SocketAddr {
    use std::io::{BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                // The whole request, so closing after the answer resets nothing.
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let line = common::http::read_request(&mut reader).unwrap_or_default();
                if line.contains("/health") {
                    std::thread::sleep(delay);
                }
                let body = r#"{"choices":[]}"#;
                let _ = write!(
                    &conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    addr
}

#[test]
fn the_proxy_opens_after_the_first_health_checks_so_its_first_request_is_served() {
    let addr = slow_to_check(Duration::from_millis(500));
    // Spawn returns as soon as the proxy port accepts; no wait for `replica_up`.
    let router = Router::spawn(
        &format!("replicas:\n  - {{name: a, addr: \"{addr}\"}}\n"),
        &[],
    );
    let r = router.post("/v1/chat/completions", &common::single("first"));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Whether the router closes (or resets) `s` within `limit` while nothing
/// more is sent.
fn closed_within(s: &std::net::TcpStream, limit: Duration) -> bool {
    use std::io::Read;
    let mut s = s.try_clone().expect("clone");
    s.set_read_timeout(Some(limit)).expect("timeout");
    match s.read(&mut [0u8; 256]) {
        Ok(n) => n == 0,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn the_metrics_port_has_the_proxy_ports_deadlines_and_a_connection_cap() {
    use std::io::{Read, Write};
    let a = Sim::start("a", &[]);
    let router = Router::start(
        &[&a],
        "client_timeouts: {header_ms: 500, keepalive_idle_s: 2}\nlimits: {max_metrics_connections: 4}\n",
    );
    let connect = || std::net::TcpStream::connect(router.metrics_addr).expect("connect");
    // A head that never ends is closed after `header_ms` (before: each read
    // had 60 s, for ever).
    let mut slow = connect();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nhost: t\r\n")
        .expect("write");
    assert!(
        closed_within(&slow, Duration::from_secs(10)),
        "slow head kept"
    );
    // A connection that says nothing is closed after `keepalive_idle_s`.
    let silent = connect();
    assert!(
        closed_within(&silent, Duration::from_secs(10)),
        "silent kept"
    );
    // A request with a body (a trickle that would hold a slot) is answered
    // and closed, its body never waited for.
    let mut post = connect();
    post.write_all(b"POST /metrics HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\nab")
        .expect("write");
    post.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut answer = Vec::new();
    let _ = post.read_to_end(&mut answer);
    let head = String::from_utf8_lossy(&answer[..answer.len().min(100)]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Four held open at once (each answered once, kept alive): a fifth is
    // closed at once, and the port serves again as soon as one goes. The
    // connection closed above gives its place back as its task ends, a
    // moment after the client reads its end: each is tried until answered.
    let hold = || {
        let mut s = connect();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
            .ok()?;
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        while !got.ends_with(b"ok\n") {
            let n = s.read(&mut buf).ok().filter(|n| *n > 0)?;
            got.extend_from_slice(&buf[..n]);
        }
        Some(s)
    };
    let held: Vec<_> = (0..4)
        .map(|_| wait_for("a held connection answered", Duration::from_secs(5), hold))
        .collect();
    assert!(
        closed_within(&connect(), Duration::from_millis(1500)),
        "a fifth was kept"
    );
    drop(held);
    wait_for("the port to serve again", Duration::from_secs(5), || {
        common::http::try_request(router.metrics_addr, "GET", "/healthz", &[], b"")
            .ok()
            .filter(|r| r.status == 200)
    });
    // The proxy port was served throughout.
    assert_eq!(
        router
            .post("/v1/chat/completions", &common::single("q"))
            .status,
        200
    );
}

#[test]
fn an_idle_router_sleeps_between_its_probes() {
    // Health checks every second, nothing else to do: its threads wake for
    // the checks and their timers, not every 10 or 20 ms (Pingora's timer
    // thread and the log's flusher did: some 150 wake-ups a second).
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    // The measuring window is the measurement, not a wait for an event.
    let rate = router.wakeups_per_second(Duration::from_secs(3));
    assert!(rate < 100.0, "{rate:.0} wake-ups a second while idle");
}

/// Replicas that answer everything at once (`Connection: close`) and
/// record when each health check arrived.
fn recording_replicas(n: usize) -> (Vec<std::net::SocketAddr>, Arc<Mutex<Vec<Instant>>>) {
    use std::io::{BufReader, Write};
    let checks = Arc::new(Mutex::new(Vec::new()));
    let addrs = (0..n)
        .map(|_| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let checks = Arc::clone(&checks);
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let checks = Arc::clone(&checks);
                    std::thread::spawn(move || {
                        let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                        let line = common::http::read_request(&mut reader).unwrap_or_default();
                        if line.contains("/health") {
                            checks.lock().unwrap().push(Instant::now());
                        }
                        let body = r#"{"object":"list","data":[]}"#;
                        let _ = write!(
                            &conn,
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    });
                }
            });
            addr
        })
        .collect();
    (addrs, checks)
}

/// Starts the router in front of `addrs` with `health_check` as given.
fn router_before(addrs: &[std::net::SocketAddr], health_check: &str) -> Router {
    let mut yaml = format!("health_check: {health_check}\nreplicas:\n");
    for (i, addr) in addrs.iter().enumerate() {
        yaml += &format!("  - {{name: r{i}, addr: \"{addr}\"}}\n");
    }
    Router::spawn(&yaml, &[])
}

#[test]
fn a_round_of_many_health_checks_is_spread_over_half_its_interval() {
    // 40 replicas, checked every 2 s: a round starts them in groups of 8
    // a fifth of a second apart, not at once (a round of hundreds at once
    // kept requests beside it waiting milliseconds).
    let (addrs, checks) = recording_replicas(40);
    let _router = router_before(&addrs, "{interval_ms: 2000}");
    let round = wait_for("a whole round of checks", Duration::from_secs(20), || {
        let checks = checks.lock().unwrap();
        (checks.len() >= 40).then(|| checks[..40].to_vec())
    });
    let took = round[round.len() - 1] - round[0];
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(2),
        "40 checks arrived within {took:?}"
    );
}

#[test]
fn a_large_fleet_checked_once_a_minute_is_all_live_when_the_proxy_opens() {
    // Its first round is paced over a second, not half a minute: the proxy
    // waits for every replica's first check (at most 4 s), so none is left
    // out of the first requests, or of an upgrade's.
    let (addrs, _) = recording_replicas(40);
    let router = router_before(&addrs, "{interval_ms: 60000}");
    let ready = get(router.metrics_addr, "/ready");
    assert_eq!(
        (ready.status, ready.text()),
        (200, "40 of 40 replicas live\n".to_owned())
    );
}
