//! The metrics listener: Prometheus text on `/metrics` (404 on any path it
//! does not know; gzip when the client accepts it), with the proxy port's
//! client deadlines (`client_timeouts`: the whole head within `header_ms`, an
//! idle connection closed after `keepalive_idle_s`, a client that stops
//! reading dropped after `write_ms`), at most `limits.max_metrics_connections`
//! connections (a scanner cannot spend the process's descriptors, which the proxy port
//! shares) and a failed read logged at `debug`, not once per connection at
//! `error`; plus the probes an orchestrator polls: `/healthz`
//! (liveness: the process serves) and `/ready` (readiness: the configuration
//! loaded and a replica is live, or, with none live, one completed a prompt
//! lately (panic mode serves); 503 otherwise). Also the client
//! side, [`probe`], for `prefix-router --probe URL` (a container's health
//! check, where slim images have no curl), and [`ReadyGate`], which holds the
//! proxy's listener until every replica has had its first health check.
//! With `admin_keys_file`, the admin API too (`/admin/`, see [`admin`]).

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use http::{header, HeaderValue, Response, StatusCode};
use log::debug;
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream, ServerApp};
use pingora_core::connectors::http::Connector as HttpConnector;
use pingora_core::modules::http::compression::ResponseCompressionBuilder;
use pingora_core::modules::http::HttpModules;
use pingora_core::protocols::http::{HttpTask, ServerSession};
use pingora_core::protocols::Stream;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::services::listening::Service;
use pingora_core::services::ServiceReadyNotifier;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::{RequestHeader, ResponseHeader};

use crate::admin;
use crate::auth::KeyFile;
use crate::metrics::{Metrics, PAGE_FORMAT};
use crate::replicas::Replicas;

/// Serves metrics, probes and the admin API.
pub struct MetricsApp {
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
    /// The admin API's keys; `None`: no admin API.
    admin_keys: Option<Arc<KeyFile>>,
    /// A replica that completed a prompt this recently serves.
    serving: Duration,
}

/// The metrics listener's client deadlines (the proxy port's) and cap.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub header: Duration,
    pub keepalive_s: u64,
    pub write: Duration,
    /// Connections held at once; more are closed as they arrive.
    pub max_connections: usize,
}

/// The metrics listener: [`MetricsApp`] over HTTP/1 with its deadlines.
pub struct MetricsServer {
    app: MetricsApp,
    modules: HttpModules,
    deadlines: Deadlines,
}

/// [`MetricsServer`] behind its connection cap.
pub struct Capped {
    server: Arc<MetricsServer>,
    open: AtomicUsize,
}

/// The metrics listener's service.
pub fn service(
    replicas: Arc<Replicas>,
    metrics: Arc<Metrics>,
    admin_keys: Option<Arc<KeyFile>>,
    serving: Duration,
    deadlines: Deadlines,
) -> Service<Capped> {
    let mut modules = HttpModules::new();
    modules.add_module(ResponseCompressionBuilder::enable(7));
    let app = MetricsApp {
        replicas,
        metrics,
        admin_keys,
        serving,
    };
    let server = Arc::new(MetricsServer {
        app,
        modules,
        deadlines,
    });
    let capped = Capped {
        server,
        open: AtomicUsize::new(0),
    };
    Service::new("metrics and probes".to_owned(), capped)
}

/// Counts a connection open until dropped.
struct Open<'a>(&'a AtomicUsize);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[async_trait]
impl ServerApp for Capped {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let max = self.server.deadlines.max_connections;
        if self.open.fetch_add(1, Relaxed) >= max {
            self.open.fetch_sub(1, Relaxed);
            debug!("metrics listener: {max} connections open, one more closed");
            return None;
        }
        let _open = Open(&self.open);
        // Every request of the connection, kept alive, is served in here.
        self.server.process_new(stream, shutdown).await
    }
}

#[async_trait]
impl HttpServerApp for MetricsServer {
    async fn process_new_http(
        self: &Arc<Self>,
        mut http: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let d = self.deadlines;
        // A new connection's first head is awaited as long as a kept-alive
        // one's; once it starts, it must be whole within `header`.
        http.set_keepalive(Some(d.keepalive_s));
        http.set_request_header_timeout(Some(d.header));
        http.set_write_timeout(Some(d.write));
        match http.read_request().await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                debug!("metrics listener: {e}");
                return None;
            }
        }
        // A request with a body (none is asked for here) is answered and its
        // connection closed: its body is never waited for.
        let reuse = !*shutdown.borrow() && http.is_body_empty();
        http.set_keepalive(reuse.then_some(d.keepalive_s));
        let mut modules = self.modules.build_ctx();
        modules
            .request_header_filter(http.req_header_mut())
            .await
            .ok()?;
        let (parts, body) = self.app.response(&mut http).await.into_parts();
        let mut head: ResponseHeader = parts.into();
        let end = body.is_empty();
        modules.response_header_filter(&mut head, end).await.ok()?;
        let mut body = Some(body.into());
        modules.response_body_filter(&mut body, true).ok()?;
        let tasks = vec![
            HttpTask::Header(Box::new(head), end),
            HttpTask::Body(body, true),
        ];
        if let Err(e) = http.response_duplex_vec(tasks).await {
            debug!("metrics listener: {e}");
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&http);
        match http.finish().await {
            Ok(reused) => reused.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(e) => {
                debug!("metrics listener: {e}");
                None
            }
        }
    }
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
        let head = session.req_header();
        // Without admin keys, `/admin/` is as any unknown path.
        if let (Some(keys), true) = (&self.admin_keys, head.uri.path().starts_with(admin::PREFIX)) {
            return admin::answer(
                &self.replicas,
                &self.metrics,
                &keys.keys(),
                &head.method,
                head.uri.path(),
                head.headers
                    .get(header::AUTHORIZATION)
                    .map(HeaderValue::as_bytes),
            );
        }
        match session.req_header().uri.path() {
            "/healthz" => answer(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/ready" => {
                let list = self.replicas.snapshot();
                // Drained replicas serve no request: not counted.
                let live = list.iter().filter(|r| r.live() && !r.drained()).count();
                let now = Instant::now();
                let serving = (list.iter())
                    .filter(|r| !r.drained() && r.serving(now, self.serving))
                    .count();
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
                // The replicas' counts since the last scrape, into their series.
                for r in self.replicas.snapshot().iter() {
                    r.counters.flush();
                }
                match self.metrics.page() {
                    Ok(page) => answer(StatusCode::OK, PAGE_FORMAT, page.into_bytes()),
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
