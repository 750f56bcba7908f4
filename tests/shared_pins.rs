//! The shared pins' Redis connection (`fleet: {mode: redis}`), black-box:
//! an ACL user, TLS (`rediss://`), and a connection that goes silent
//! without closing, which must be replaced rather than waited on for ever.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{conversation, wait_for, RedisServer, Router, Sim};

/// `prefix_router_shared_pins_total{op, result}` of a router.
fn shared(router: &Router, op: &str, result: &str) -> f64 {
    router.metric(&format!(
        "prefix_router_shared_pins_total{{op=\"{op}\",result=\"{result}\"}}"
    ))
}

fn fleet(url: &str, more: &str) -> String {
    format!("fleet: {{mode: redis, redis_url: \"{url}\", redis_budget_ms: 200{more}}}\n")
}

/// Whether a conversation's first turn through `one`, once written, pins
/// its second turn through `other` to the same replica.
fn pins_shared(one: &Router, other: &Router, topic: &str) -> bool {
    let written = shared(one, "write", "ok");
    let first = one.post("/v1/chat/completions", &conversation(topic, 1));
    assert_eq!(first.status, 200, "{}", first.text());
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while shared(one, "write", "ok") <= written {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = other.post("/v1/chat/completions", &conversation(topic, 2));
    assert_eq!(second.status, 200, "{}", second.text());
    second.decision() == "pin" && second.replica() == first.replica()
}

/// Two routers on replicas `a` and `b` (listed in opposite orders) sharing
/// pins through `fleet`.
fn two_routers(sims: &[Sim], fleet: &str) -> [Router; 2] {
    let list: Vec<&Sim> = sims.iter().collect();
    let reversed: Vec<&Sim> = list.iter().rev().copied().collect();
    [Router::start(&list, fleet), Router::start(&reversed, fleet)]
}

fn sims() -> Vec<Sim> {
    ["a", "b"].iter().map(|n| Sim::start(n, &[])).collect()
}

#[test]
fn instances_authenticate_as_an_acl_user_and_a_wrong_password_costs_no_request() {
    let port = common::free_addr().port();
    let _redis = RedisServer::start_args(
        port,
        &[
            "--port",
            &port.to_string(),
            "--user",
            "default",
            "off",
            "--user",
            "router",
            "on",
            ">s3cret",
            "~prefix-router:*",
            "+@all",
            "--user",
            "reader",
            "on",
            ">r3ad",
            "~prefix-router:*",
            "+@all",
            "-set",
        ],
    );
    let sims = sims();
    let routers = two_routers(
        &sims,
        &fleet(&format!("redis://router:s3cret@127.0.0.1:{port}/0"), ""),
    );
    for c in 0..4 {
        assert!(pins_shared(&routers[0], &routers[1], &format!("acl {c}")));
    }
    // A wrong password: Redis refuses the connection; clients see nothing.
    let wrong = Router::start(
        &[&sims[0]],
        &fleet(&format!("redis://router:wrong@127.0.0.1:{port}/0"), ""),
    );
    for turn in 1..4 {
        let r = wrong.post("/v1/chat/completions", &conversation("refused", turn));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    wait_for("the refusal logged", Duration::from_secs(5), || {
        wrong.log().contains("redis 127.0.0.1").then_some(())
    });
    let log = wrong.log();
    assert!(
        log.contains("unavailable") && log.contains("AuthenticationFailed"),
        "{log}"
    );
    // A user Redis refuses `SET`: each write is counted an error, and the
    // connection is kept (an answer is not a broken connection).
    let refused = Router::start(
        &[&sims[0]],
        &fleet(&format!("redis://reader:r3ad@127.0.0.1:{port}/0"), ""),
    );
    for turn in 1..6 {
        let r = refused.post("/v1/chat/completions", &conversation("no set", turn));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    wait_for("writes counted as refused", Duration::from_secs(5), || {
        (shared(&refused, "write", "error") >= 3.0).then_some(())
    });
    let log = refused.wait_log("redis answered an error");
    assert!(!log.contains("unavailable"), "{log}");
}

/// A CA and a `localhost` certificate it signed, in `dir`: (ca, cert, key).
fn ca_and_certificate(dir: &Path) -> (String, String, String) {
    let file = |name: &str| dir.join(name).display().to_string();
    let (ca, ca_key) = (file("ca.pem"), file("ca-key.pem"));
    let (cert, key, csr, ext) = (
        file("cert.pem"),
        file("key.pem"),
        file("cert.csr"),
        file("ext.cnf"),
    );
    common::openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        "-keyout",
        &ca_key,
        "-out",
        &ca,
    ]);
    common::openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        &key,
        "-out",
        &csr,
    ]);
    std::fs::write(
        &ext,
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    common::openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &ext,
        "-out",
        &cert,
    ]);
    (ca, cert, key)
}

#[test]
fn instances_share_pins_over_tls_with_the_configured_ca_and_refuse_an_untrusted_certificate() {
    let dir = std::env::temp_dir().join(format!("prefix-router-redis-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, cert, key) = ca_and_certificate(&dir);
    let port = common::free_addr().port();
    let _redis = RedisServer::start_args(
        port,
        &[
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "no",
        ],
    );
    let sims = sims();
    let url = format!("rediss://localhost:{port}/0");
    let routers = two_routers(&sims, &fleet(&url, &format!(", redis_ca_file: \"{ca}\"")));
    for c in 0..4 {
        assert!(pins_shared(&routers[0], &routers[1], &format!("tls {c}")));
    }
    // Without the CA (the system's roots do not know it): no connection,
    // and no client sees an error.
    let untrusting = Router::start(&[&sims[0]], &fleet(&url, ""));
    let r = untrusting.post("/v1/chat/completions", &conversation("untrusted", 1));
    assert_eq!(r.status, 200, "{}", r.text());
    wait_for("the TLS refusal logged", Duration::from_secs(5), || {
        let log = untrusting.log();
        (log.contains("unavailable") && log.contains("TLS")).then_some(())
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TCP relay in front of Redis whose connections can be made silent:
/// bytes are read and dropped, the connection stays open (a peer gone
/// behind a dead link, or a hung Redis). Connections opened later relay.
struct Relay {
    addr: SocketAddr,
    silenced: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

impl Relay {
    fn start(to: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let silenced: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let flags = Arc::clone(&silenced);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(to) else {
                    continue;
                };
                let silent = Arc::new(AtomicBool::new(false));
                flags.lock().unwrap().push(Arc::clone(&silent));
                for (mut from, mut into) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let silent = Arc::clone(&silent);
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 << 10];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            if !silent.load(Relaxed) && into.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    });
                }
            }
        });
        Relay { addr, silenced }
    }

    /// Every connection open now goes silent for good.
    fn silence(&self) {
        for s in self.silenced.lock().unwrap().iter() {
            s.store(true, Relaxed);
        }
    }
}

#[test]
fn a_connection_gone_silent_is_replaced_and_pins_are_shared_again() {
    let port = common::free_addr().port();
    let _redis = RedisServer::start(port);
    let relay = Relay::start(SocketAddr::from(([127, 0, 0, 1], port)));
    let sims = sims();
    let routers = two_routers(&sims, &fleet(&format!("redis://{}/0", relay.addr), ""));
    assert!(pins_shared(&routers[0], &routers[1], "before"));
    relay.silence();
    // Requests go on within their budget while the connection says nothing;
    // after a few failures in a row each instance opens a new one.
    let mut round = 0;
    wait_for(
        "pins shared over a new connection",
        Duration::from_secs(30),
        || {
            round += 1;
            pins_shared(&routers[0], &routers[1], &format!("after {round}")).then_some(())
        },
    );
    assert!(shared(&routers[1], "lookup", "timeout") >= 1.0);
    for r in &routers {
        assert!(
            r.log().contains("in a row failed or timed out"),
            "{}",
            r.log()
        );
    }
}

/// A fake Redis that answers the client's handshake, then answers its
/// first command with a bulk string of a gigabyte and writes bytes until
/// the router hangs up. Returns its address and the bytes each connection
/// managed to write before the router closed it.
fn flooding_redis() -> (SocketAddr, Arc<Mutex<Vec<usize>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let cut: Arc<Mutex<Vec<usize>>> = Arc::default();
    let record = Arc::clone(&cut);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().map_while(Result::ok) {
            let record = Arc::clone(&record);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n @ 1..) = conn.read(&mut buf) else {
                        return;
                    };
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let asks = text.contains("MGET") || text.contains("SET\r\n");
                    for _ in 0..text.matches("CLIENT").count() {
                        let _ = conn.write_all(b"+OK\r\n");
                    }
                    if asks {
                        break;
                    }
                }
                let mut sent = 0;
                let chunk = vec![b'x'; 64 << 10];
                if conn.write_all(b"$1000000000\r\n").is_ok() {
                    while conn.write_all(&chunk).is_ok() && sent < (1 << 30) {
                        sent += chunk.len();
                    }
                }
                record.lock().unwrap().push(sent);
            });
        }
    });
    (addr, cut)
}

#[test]
fn a_reply_past_the_bounds_closes_the_connection_and_costs_no_request() {
    let (addr, cut) = flooding_redis();
    let sim = Sim::start("a", &[]);
    let router = Router::start(&[&sim], &fleet(&format!("redis://{addr}/0"), ""));
    for turn in 1..4 {
        let r = router.post("/v1/chat/completions", &conversation("flood", turn));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let sent = wait_for("the router hanging up", Duration::from_secs(10), || {
        cut.lock().unwrap().first().copied()
    });
    // What the socket buffers held, not the gigabyte announced.
    assert!(
        sent < 64 << 20,
        "{sent} bytes written before the router hung up"
    );
    wait_for("the cut logged", Duration::from_secs(5), || {
        router.log().contains("unavailable").then_some(())
    });
    let log = router.log();
    assert!(log.contains("past the router's bound"), "{log}");
}
