//! TLS to replicas (`--features tls`): the router talks HTTPS to a replica
//! behind a TLS terminator (socat) and verifies its certificate against
//! `replica_tls.ca_file`; a wrong server name fails verification.
#![cfg(feature = "tls")]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_addr, single, wait_for, Router, Sim};

/// A self-signed certificate for `localhost` in `dir`: (cert, key).
fn certificate(dir: &Path) -> (String, String) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=DNS:localhost"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(Stdio::null())
        .status()
        .expect("openssl CLI (scripts/prepare.sh installs it)");
    assert!(status.success());
    (cert.display().to_string(), key.display().to_string())
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
