//! A hand-made replica that answers routed requests with given bytes (see
//! [`RawReplica`]).

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use super::http;

/// A replica that passes `/health`, has no model list, and answers every
/// other request with `answer`, byte for byte, keeping the connection: a
/// framing the simulator (hyper) would not write, such as a chunk head
/// longer than a read.
pub struct RawReplica {
    pub addr: SocketAddr,
    /// The heads of the requests it answered with `answer`.
    pub heads: Arc<Mutex<Vec<String>>>,
}

impl RawReplica {
    pub fn start(answer: Vec<u8>) -> RawReplica {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let answer = Arc::new(answer);
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&heads);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (answer, seen) = (Arc::clone(&answer), Arc::clone(&seen));
                std::thread::spawn(move || Self::serve(conn, &answer, &seen));
            }
        });
        RawReplica { addr, heads }
    }

    fn serve(mut conn: TcpStream, answer: &[u8], seen: &Mutex<Vec<String>>) {
        let Ok(clone) = conn.try_clone() else { return };
        let mut reader = BufReader::new(clone);
        while let Some(line) = http::read_request_head(&mut reader) {
            let written = if line.starts_with("GET /health") {
                conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            } else if line.starts_with("GET /v1/models") {
                conn.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            } else {
                seen.lock().unwrap().push(line);
                conn.write_all(answer)
            };
            if written.is_err() {
                return;
            }
        }
    }

    pub fn yaml(&self, name: &str) -> String {
        format!("  - {{name: {name}, addr: \"{}\"}}\n", self.addr)
    }
}
