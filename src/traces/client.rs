//! The exporter's HTTP client: one blocking HTTP/1.1 POST per batch over a
//! plain TCP connection, all of it (name lookup, connect, write, the whole
//! answer) within the export timeout. The SDK exports from its own thread
//! (not on the proxy's runtime), where blocking is what it does.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

/// Answers larger than this are cut (a collector's answer is a few bytes).
const MAX_ANSWER: usize = 64 << 10;

#[derive(Debug)]
pub struct PlainHttp {
    pub timeout: Duration,
}

#[async_trait::async_trait]
impl HttpClient for PlainHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        post(&request, self.timeout)
    }
}

fn post(request: &Request<Bytes>, timeout: Duration) -> Result<Response<Bytes>, HttpError> {
    let deadline = Instant::now() + timeout;
    let left = || {
        let d = deadline.saturating_duration_since(Instant::now());
        if d.is_zero() {
            Err(HttpError::from("the export timed out"))
        } else {
            Ok(d)
        }
    };
    let uri = request.uri();
    let host = uri.host().ok_or("the endpoint has no host")?;
    let port = uri.port_u16().unwrap_or(80);
    let mut conn = connect(host.trim_matches(['[', ']']), port, left()?)?;
    conn.set_write_timeout(Some(left()?))?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut head = format!(
        "{} {path} HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\ncontent-length: {}\r\n",
        request.method(),
        request.body().len()
    );
    for (name, value) in request.headers() {
        if name != "content-length" && name != "host" && name != "connection" {
            head.push_str(&format!(
                "{name}: {}\r\n",
                value.to_str().unwrap_or_default()
            ));
        }
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes())?;
    conn.write_all(request.body())?;
    // The answer is read within what is left of the deadline, whole.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        conn.set_read_timeout(Some(left()?))?;
        let n = conn.read(&mut buf)?;
        if n == 0 || answer.len() + n > MAX_ANSWER {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        if complete(&answer) {
            break;
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("the collector's answer is not HTTP")?;
    let body = match text.find("\r\n\r\n") {
        Some(at) => Bytes::copy_from_slice(&answer[at + 4..]),
        None => Bytes::new(),
    };
    Ok(Response::builder().status(status).body(body)?)
}

/// Whether `answer` holds a whole head and a body of its Content-Length
/// (else it is read until the collector closes, as `connection: close` asks).
fn complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some(end) = text.find("\r\n\r\n") else {
        return false;
    };
    let length = text[..end].lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse::<usize>().ok())
            .flatten()
    });
    length.is_some_and(|n| answer.len() >= end + 4 + n)
}

/// Connects to every address of `host` in turn, the name resolved on a
/// thread of its own so that a slow resolver counts against `within` too.
fn connect(host: &str, port: u16, within: Duration) -> Result<TcpStream, HttpError> {
    let deadline = Instant::now() + within;
    let (tx, rx) = std::sync::mpsc::channel();
    let name = host.to_owned();
    std::thread::spawn(move || {
        let _ = tx.send((name.as_str(), port).to_socket_addrs().map(Vec::from_iter));
    });
    let addrs = rx
        .recv_timeout(within)
        .map_err(|_| "resolving the endpoint timed out")??;
    let mut last: HttpError = "the endpoint's host resolves to no address".into();
    for addr in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(conn) => return Ok(conn),
            Err(e) => last = e.into(),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_whole_at_its_length_and_a_bracketed_host_connects() {
        assert!(!complete(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nab"));
        assert!(complete(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nab"));
        assert!(!complete(b"HTTP/1.1 200 OK\r\n\r\nab"));
        let listener = std::net::TcpListener::bind("[::1]:0")
            .or_else(|_| std::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let host = addr.ip().to_string();
        assert!(connect(&host, addr.port(), Duration::from_secs(2)).is_ok());
        // Nothing listening: an error within the time given.
        drop(listener);
        let started = Instant::now();
        assert!(connect(&host, addr.port(), Duration::from_secs(2)).is_err());
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
