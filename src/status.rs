//! The metrics listener: Prometheus text on `/metrics` (404 on any path it
//! does not know), plus the probes an orchestrator polls: `/healthz`
//! (liveness: the process serves) and `/ready` (readiness: the configuration
//! loaded and a replica is live, or, with none live, one completed a prompt
//! lately (panic mode serves); 503 otherwise). Also the client
//! side, [`probe`], for `prefix-router --probe URL` (a container's health
//! check, where slim images have no curl), and [`ReadyGate`], which holds the
//! proxy's listener until every replica has had its first health check.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use http::{header, HeaderValue, Response, StatusCode};
use pingora_core::apps::http_app::{HttpServer, ServeHttp};
use pingora_core::connectors::http::Connector as HttpConnector;
use pingora_core::modules::http::compression::ResponseCompressionBuilder;
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::services::listening::Service;
use pingora_core::services::ServiceReadyNotifier;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::RequestHeader;
use prometheus::{Encoder, TextEncoder, TEXT_FORMAT};

use crate::metrics::Metrics;
use crate::replicas::Replicas;

/// Serves metrics and probes.
pub struct MetricsApp {
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
    /// A replica that completed a prompt this recently serves.
    serving: Duration,
}

/// The metrics listener's service (gzip when the client accepts it).
pub fn service(
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
    serving: Duration,
) -> Service<HttpServer<MetricsApp>> {
    let mut server = HttpServer::new_app(MetricsApp {
        replicas,
        metrics,
        serving,
    });
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
                let now = Instant::now();
                let serving = list.iter().filter(|r| r.serving(now, self.serving)).count();
                let status = if live > 0 || serving > 0 {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let mut body = format!("{live} of {} replicas live\n", list.len());
                if live == 0 && serving > 0 {
                    body += &format!("panic mode: {serving} completed prompts lately\n");
                }
                answer(status, "text/plain", body.into_bytes())
            }
            "/metrics" => {
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
            // Only the known paths: a scanner gets no page to compress.
            _ => answer(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
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
    #[error("{0}")]
    Http(#[from] Box<pingora_core::Error>),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Status(String),
}

/// GETs `url` (plain `http://host:port/path`) within `timeout`, with
/// Pingora's HTTP/1 client; `Ok` with the status line when the answer is 2xx.
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
    let addrs: Vec<SocketAddr> = authority
        .to_socket_addrs()
        .map_err(|_| ProbeError::Url(url.to_owned()))?
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        tokio::time::timeout(timeout, status_line(&addrs, authority, &path, timeout))
            .await
            .unwrap_or(Err(ProbeError::Timeout(timeout)))
    })
}

/// The status line of `GET path` at the first of `addrs` that connects
/// (`localhost`: ::1, then 127.0.0.1); an error unless it is 2xx.
async fn status_line(
    addrs: &[SocketAddr],
    host: &str,
    path: &str,
    timeout: Duration,
) -> Result<String, ProbeError> {
    let per_address = timeout / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
    let connector = HttpConnector::new(None);
    let mut last = None;
    for addr in addrs {
        let mut peer = HttpPeer::new(*addr, false, String::new());
        // Each address its share of the time: a blackholed first one leaves
        // time for the next.
        peer.options.connection_timeout = Some(per_address);
        let mut session = match connector.get_http_session(&peer).await {
            Ok((session, _)) => session,
            Err(e) => {
                last = Some(e);
                continue;
            }
        };
        let mut request = RequestHeader::build("GET", path.as_bytes(), None)?;
        request.insert_header("Host", host)?;
        session.write_request_header(Box::new(request)).await?;
        session.finish_request_body().await?;
        session.read_response_header().await?;
        let head = session
            .response_header()
            .ok_or_else(|| ProbeError::Status("no response head".into()))?;
        let line = format!("{:?} {}", head.version, head.status);
        return if head.status.is_success() {
            Ok(line)
        } else {
            Err(ProbeError::Status(line))
        };
    }
    Err(last.map_or_else(|| ProbeError::Status("no address".into()), ProbeError::Http))
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
