//! A hand-made replica that trickles its answers (see [`TricklingReplica`]).

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::http;

/// A replica that passes `/health` and answers every other request with a
/// response head sent one byte per 50 ms, forever: per-read timeouts never
/// fire. Not the simulator: hyper cannot write a head byte by byte.
pub struct TricklingReplica {
    pub addr: SocketAddr,
    received: Arc<AtomicU64>,
}

/// What a [`TricklingReplica`] holds besides the answers to routed requests.
#[derive(Clone)]
enum Holds {
    Nothing,
    /// `GET /v1/models`, answered (one model, `m`) once the flag is set.
    Models(Arc<AtomicBool>),
    /// `GET /health` too, trickled like the rest: a check runs to its deadline.
    Health,
}

impl TricklingReplica {
    pub fn start() -> TricklingReplica {
        Self::start_with(Holds::Nothing)
    }

    /// One whose `GET /v1/models` is answered only once `release` is set.
    pub fn start_holding_models(release: Arc<AtomicBool>) -> TricklingReplica {
        Self::start_with(Holds::Models(release))
    }

    /// One whose health checks never end before their deadline.
    pub fn start_trickling_health() -> TricklingReplica {
        Self::start_with(Holds::Health)
    }

    fn start_with(holds: Holds) -> TricklingReplica {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(AtomicU64::new(0));
        let count = received.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (count, holds) = (count.clone(), holds.clone());
                std::thread::spawn(move || Self::serve(conn, &count, &holds));
            }
        });
        TricklingReplica { addr, received }
    }

    fn serve(mut conn: std::net::TcpStream, received: &AtomicU64, holds: &Holds) {
        use std::io::Write;
        let Ok(clone) = conn.try_clone() else { return };
        let mut reader = BufReader::new(clone);
        while let Some(line) = http::read_request(&mut reader) {
            let health = line.starts_with("GET /health");
            let models = line.starts_with("GET /v1/models");
            if let (Holds::Models(release), true) = (holds, models) {
                while !release.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let list = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{list}",
                    list.len()
                );
                if conn.write_all(answer.as_bytes()).is_err() {
                    return;
                }
                continue;
            }
            if (health && !matches!(holds, Holds::Health)) || models {
                // Healthy; no model list (it serves any model).
                let answer = if health {
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                } else {
                    "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
                };
                if conn.write_all(answer.as_bytes()).is_err() {
                    return;
                }
                continue;
            }
            if !health {
                received.fetch_add(1, Ordering::Relaxed);
            }
            for b in b"HTTP/1.1 200 OK\r\nx-trickle: "
                .iter()
                .chain(std::iter::repeat(&b'a'))
            {
                if conn.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Requests other than health checks (and model lists) that arrived.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    pub fn yaml(&self, name: &str) -> String {
        format!("  - {{name: {name}, addr: \"{}\"}}\n", self.addr)
    }
}
