//! The exporter's HTTP client: one blocking HTTP/1.1 POST per batch over a
//! plain TCP connection, within the export timeout. The SDK exports from its
//! own thread (not on the proxy's runtime), where blocking is what it does.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

/// Answers larger than this are cut (a collector's answer is a few bytes).
const MAX_ANSWER: u64 = 64 << 10;

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
    let uri = request.uri();
    let host = uri.host().ok_or("the endpoint has no host")?;
    let port = uri.port_u16().unwrap_or(80);
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))?
        .next()
        .ok_or("the endpoint's host resolves to no address")?;
    let mut conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
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
    let mut reader = BufReader::new(conn.take(MAX_ANSWER));
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("the collector's answer is not HTTP")?;
    let mut length = None;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse::<usize>().ok();
            }
        }
    }
    let mut body = Vec::new();
    match length {
        Some(n) => {
            body.resize(n.min(MAX_ANSWER as usize), 0);
            reader.read_exact(&mut body)?;
        }
        None => {
            reader.read_to_end(&mut body)?;
        }
    }
    Ok(Response::builder().status(status).body(Bytes::from(body))?)
}
