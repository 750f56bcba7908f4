//! The metrics listener: Prometheus text on `/metrics` (and, as before, on
//! any other path), plus the probes an orchestrator polls: `/healthz`
//! (liveness: the process serves) and `/ready` (readiness: the configuration
//! loaded and at least one replica is live; 503 otherwise). Also the client
//! side, [`probe`], for `prefix-router --probe URL` (a container's health
//! check, where slim images have no curl), and [`ReadyGate`], which holds the
//! proxy's listener until every replica has had its first health check.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use http::{header, HeaderValue, Response, StatusCode};
use pingora_core::apps::http_app::{HttpServer, ServeHttp};
use pingora_core::modules::http::compression::ResponseCompressionBuilder;
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::services::listening::Service;
use pingora_core::services::ServiceReadyNotifier;
use prometheus::{Encoder, TextEncoder, TEXT_FORMAT};

use crate::metrics::Metrics;
use crate::replicas::Replicas;

/// Serves metrics and probes.
pub struct MetricsApp {
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
}

/// The metrics listener's service (gzip when the client accepts it).
pub fn service(replicas: Arc<Replicas>, metrics: Arc<Metrics>) -> Service<HttpServer<MetricsApp>> {
    let mut server = HttpServer::new_app(MetricsApp { replicas, metrics });
    server.add_module(ResponseCompressionBuilder::enable(7));
    Service::new("metrics and probes".to_owned(), server)
}

fn answer(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<Vec<u8>> {
    let len = body.len();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

#[async_trait]
impl ServeHttp for MetricsApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/healthz" => answer(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/ready" => {
                let list = self.replicas.snapshot();
                let live = list.iter().filter(|r| r.live()).count();
                let status = if live > 0 {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let body = format!("{live} of {} replicas live\n", list.len());
                answer(status, "text/plain", body.into_bytes())
            }
            _ => {
                let mut buffer = Vec::new();
                match TextEncoder::new().encode(&self.metrics.registry().gather(), &mut buffer) {
                    Ok(()) => answer(StatusCode::OK, TEXT_FORMAT, buffer),
                    Err(e) => answer(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        format!("{e}\n").into_bytes(),
                    ),
                }
            }
        }
    }
}

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("not an http://host:port/path URL: {0}")]
    Url(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not an HTTP answer: {0:?}")]
    Answer(String),
    #[error("{0}")]
    Status(String),
}

/// GETs `url` (plain `http://host:port/path`) within `timeout`; `Ok` with the
/// status line when the answer is 2xx.
pub fn probe(url: &str, timeout: Duration) -> Result<String, ProbeError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| ProbeError::Url(url.to_owned()))?;
    let (authority, path) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let path = match path {
        "" => "/".to_owned(),
        p if p.starts_with('?') => format!("/{p}"),
        p => p.to_owned(),
    };
    let addrs: Vec<_> = authority
        .to_socket_addrs()
        .map_err(|_| ProbeError::Url(url.to_owned()))?
        .collect();
    let deadline = Instant::now() + timeout;
    // Every address a name resolves to (`localhost`: ::1, then 127.0.0.1).
    let mut last = None;
    let mut stream = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = match (stream, last) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(e.into()),
        (None, None) => return Err(ProbeError::Url(url.to_owned())),
    };
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    stream.set_write_timeout(Some(left()))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = Vec::new();
    let mut buf = [0u8; 512];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 4096 {
        stream.set_read_timeout(Some(left()))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let line = text.lines().next().unwrap_or_default().to_owned();
    match line.split(' ').nth(1).map(|c| c.as_bytes()) {
        Some([b'2', b'0'..=b'9', b'0'..=b'9']) if line.starts_with("HTTP/1.") => Ok(line),
        Some(_) if line.starts_with("HTTP/1.") => Err(ProbeError::Status(line)),
        _ => Err(ProbeError::Answer(line)),
    }
}

/// How long the proxy's listener may wait for the first health checks: under
/// Pingora's 5 s in which an old router (`-u`) still accepts beside the new.
pub const READY_GATE_MAX_WAIT: Duration = Duration::from_secs(4);

/// Holds the proxy's listener (a Pingora dependency) until every replica has
/// had its first health check, or `max_wait` passes: a router that has just
/// started, or taken over the listener from an old one (`-u`), would
/// otherwise answer 503 `no_replica` until the first round ends.
pub struct ReadyGate {
    pub replicas: Arc<Replicas>,
    pub max_wait: Duration,
}

#[async_trait]
impl BackgroundService for ReadyGate {
    async fn start_with_ready_notifier(&self, _: ShutdownWatch, ready: ServiceReadyNotifier) {
        let until = Instant::now() + self.max_wait;
        while Instant::now() < until
            && !self
                .replicas
                .snapshot()
                .iter()
                .all(|r| r.has_been_checked())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ready.notify_ready();
    }
}
