//! TLS (`--features tls`). To replicas: the router talks HTTPS to a replica
//! behind a TLS terminator (socat) and verifies its certificate against
//! `replica_tls.ca_file`; a wrong server name fails verification. At the
//! edge: `listen_tls` serves clients (curl) over HTTP/2 and HTTP/1.1, and a
//! renewed certificate is served without a restart.
#![cfg(feature = "tls")]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_addr, single, wait_for, Router, Sim};

/// A self-signed certificate for `localhost` in `dir`: (cert, key).
fn certificate(dir: &Path) -> (String, String) {
    certificate_named(dir, "")
}

/// Another self-signed `localhost` certificate, files named with `tag`.
fn certificate_named(dir: &Path, tag: &str) -> (String, String) {
    let (cert, key) = (
        dir.join(format!("cert{tag}.pem")),
        dir.join(format!("key{tag}.pem")),
    );
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    common::openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=localhost",
        "-addext",
        "subjectAltName=DNS:localhost",
        "-keyout",
        &key,
        "-out",
        &cert,
    ]);
    (cert, key)
}

/// socat terminating TLS in front of `sim`.
struct Terminator(Child, std::net::SocketAddr);

impl Terminator {
    fn start(sim: &Sim, cert: &str, key: &str) -> Terminator {
        let addr = free_addr();
        let child = Command::new("socat")
            .arg(format!(
                "OPENSSL-LISTEN:{},bind=127.0.0.1,reuseaddr,fork,cert={cert},key={key},verify=0",
                addr.port()
            ))
            .arg(format!("TCP:{}", sim.addr))
            .stderr(Stdio::null())
            .spawn()
            .expect("socat (scripts/prepare.sh installs it)");
        wait_for("socat listening", Duration::from_secs(10), || {
            std::net::TcpStream::connect(addr).ok()
        });
        Terminator(child, addr)
    }
}

impl Drop for Terminator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn yaml(t: &Terminator, sni: &str, ca: &str) -> String {
    format!(
        "health_check: {{interval_ms: 200}}\nreplica_tls: {{enabled: true, sni: {sni}, ca_file: \"{ca}\"}}\n\
         replicas:\n  - {{name: secure, addr: \"{}\"}}\n",
        t.1
    )
}

#[test]
fn requests_reach_a_tls_replica_with_a_verified_certificate() {
    let dir = std::env::temp_dir().join(format!("prefix-router-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = certificate(&dir);
    let sim = Sim::start("secure", &[]);
    let t = Terminator::start(&sim, &cert, &key);

    let router = Router::spawn(&yaml(&t, "localhost", &cert), &[]);
    router.wait_replica_up("secure", true);
    let r = router.post("/v1/chat/completions", &single("over TLS"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sim-replica"), Some("secure"));
    drop(router);

    // A name the certificate does not carry: verification fails, nothing is sent.
    let wrong = Router::spawn(&yaml(&t, "wrong.example", &cert), &[]);
    let r = wrong.post("/v1/chat/completions", &single("should not pass"));
    assert_eq!(r.status, 503);
    assert_eq!(sim.stats()["requests"], 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `curl` over TLS to `localhost:port` trusting `ca`; (HTTP version, status)
/// or curl's error.
fn curl(port: u16, ca: &str, version: &str) -> Result<(String, String), String> {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", version, "--cacert", ca])
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1")])
        .args(["-o", "/dev/null", "-w", "%{http_version} %{http_code}"])
        .args(["-H", "content-type: application/json", "--data"])
        .arg(serde_json::to_string(&single("over tls")).expect("json"))
        .arg(format!("https://localhost:{port}/v1/chat/completions"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let (v, s) = text.split_once(' ').unwrap_or((&text, ""));
    Ok((v.to_owned(), s.to_owned()))
}

#[test]
fn clients_speak_h2_and_http1_over_listen_tls_and_a_renewal_needs_no_restart() {
    let dir = std::env::temp_dir().join(format!("prefix-router-edge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = certificate(&dir);
    let (renewed_cert, renewed_key) = certificate_named(&dir, "-renewed");
    let (_, stranger_key) = certificate_named(&dir, "-stranger");
    let live_cert = dir.join("live-cert.pem");
    let live_key = dir.join("live-key.pem");
    std::fs::copy(&cert, &live_cert).unwrap();
    std::fs::copy(&key, &live_key).unwrap();
    let a = Sim::start("a", &[]);
    let tls_addr = free_addr();
    let router = Router::start(
        &[&a],
        &format!(
            "listen_tls: {{addr: \"{tls_addr}\", cert_file: \"{}\", key_file: \"{}\"}}\n",
            live_cert.display(),
            live_key.display()
        ),
    );
    let port = tls_addr.port();
    assert_eq!(curl(port, &cert, "--http2"), Ok(("2".into(), "200".into())));
    assert_eq!(
        curl(port, &cert, "--http1.1"),
        Ok(("1.1".into(), "200".into()))
    );
    assert!(
        curl(port, &renewed_cert, "--http2").is_err(),
        "not renewed yet"
    );

    // A renewal half done (a key that is not the certificate's) is not used.
    let replace = |from: &str, to: &Path| {
        let tmp = to.with_extension("tmp");
        std::fs::copy(from, &tmp).unwrap();
        std::fs::rename(&tmp, to).unwrap();
    };
    replace(&renewed_cert, &live_cert);
    replace(&stranger_key, &live_key);
    // The router looks at the files once a second.
    wait_for(
        "the half renewal to be refused",
        Duration::from_secs(10),
        || {
            let _ = curl(port, &cert, "--http2");
            router
                .log()
                .contains("keeping the previous certificate")
                .then_some(())
        },
    );
    assert_eq!(curl(port, &cert, "--http2"), Ok(("2".into(), "200".into())));
    // Complete: the renewed certificate is served, no restart.
    replace(&renewed_key, &live_key);
    wait_for("the renewed certificate", Duration::from_secs(10), || {
        curl(port, &renewed_cert, "--http2").ok()
    });
    assert_eq!(
        curl(port, &renewed_cert, "--http1.1"),
        Ok(("1.1".into(), "200".into()))
    );
    assert!(
        curl(port, &cert, "--http2").is_err(),
        "the old certificate is gone"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// TLS to `listen_tls` with ALPN `h2` (the certificate is not checked here).
fn h2_connection(port: u16) -> pingora_core::tls::ssl::SslStream<std::net::TcpStream> {
    use pingora_core::tls::ssl::{SslConnector, SslMethod, SslVerifyMode};
    let mut b = SslConnector::builder(SslMethod::tls()).expect("connector");
    b.set_verify(SslVerifyMode::NONE);
    b.set_alpn_protos(b"\x02h2").expect("alpn");
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let s = b.build().connect("localhost", tcp).expect("handshake");
    assert_eq!(s.ssl().selected_alpn_protocol(), Some(&b"h2"[..]));
    s
}

/// Reads until the router closes the connection: what it sent, and how long
/// that took; panics if it is still open after `limit`.
fn read_until_closed(
    s: &mut pingora_core::tls::ssl::SslStream<std::net::TcpStream>,
    limit: Duration,
) -> (Vec<u8>, Duration) {
    use std::io::Read;
    let start = std::time::Instant::now();
    s.get_ref().set_read_timeout(Some(limit)).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the connection is still open after {limit:?}")
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("the connection is still open after {limit:?}")
            }
            Err(_) => break,
        }
        assert!(start.elapsed() < limit, "still open after {limit:?}");
    }
    (got, start.elapsed())
}

/// The value of setting `id` in the first SETTINGS frame of `frames`.
fn setting(frames: &[u8], id: u16) -> Option<u32> {
    let len = u32::from_be_bytes([0, frames[0], frames[1], frames[2]]) as usize;
    assert_eq!(frames[3], 4, "the server speaks first with SETTINGS");
    frames[9..9 + len].chunks_exact(6).find_map(|e| {
        (u16::from_be_bytes([e[0], e[1]]) == id)
            .then(|| u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
    })
}

#[test]
fn http2_clients_get_the_http1_deadlines_and_a_stream_cap() {
    let dir = std::env::temp_dir().join(format!("prefix-router-h2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = certificate(&dir);
    let a = Sim::start("a", &[]);
    let tls_addr = free_addr();
    let router = Router::start(
        &[&a],
        &format!(
            "listen_tls: {{addr: \"{tls_addr}\", cert_file: \"{cert}\", key_file: \"{key}\"}}\n\
             client_timeouts: {{header_ms: 1000, keepalive_idle_s: 1}}\n\
             limits: {{max_streams_per_connection: 7}}\n"
        ),
    );
    let port = tls_addr.port();
    let limit = Duration::from_secs(15);
    // A client that completes TLS and never sends its preface is closed
    // after `header_ms`, as an HTTP/1 head would be; the server's SETTINGS
    // announced the stream cap.
    let mut silent = h2_connection(port);
    let (frames, took) = read_until_closed(&mut silent, limit);
    assert_eq!(
        setting(&frames, 3),
        Some(7),
        "SETTINGS_MAX_CONCURRENT_STREAMS"
    );
    assert!(took >= Duration::from_millis(900), "{took:?}");
    // One that sends its preface and then nothing is idle: closed after
    // `keepalive_idle_s`.
    let mut idle = h2_connection(port);
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
    std::io::Write::write_all(&mut idle, preface).expect("preface");
    read_until_closed(&mut idle, limit);
    // Requests are served meanwhile.
    assert_eq!(curl(port, &cert, "--http2"), Ok(("2".into(), "200".into())));
    drop(router);
    std::fs::remove_dir_all(&dir).unwrap();
}
