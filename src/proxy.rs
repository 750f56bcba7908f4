//! The only `impl ProxyHttp`: read the body whole, ask the policy, forward the
//! same bytes, stream the answer, fail over on connection failure.
//!
//! Phase by phase:
//! - `request_filter`: for `POST` to a routed path, answer `Expect: 100-continue`,
//!   read the body within `max_body_bytes` and `body_read_timeout_ms`, parse it.
//! - `upstream_peer` (again on every retry): the policy places the request among
//!   live replicas not yet tried; Pingora's selection confirms membership and health.
//! - `request_body_filter`: hands the buffered body to Pingora at end of stream.
//!   With `patches/pingora-proxy-0.9.1.diff` this happens on every attempt and
//!   for any size (stock Pingora forwards only from its 64 KiB retry buffer).
//! - `fail_to_connect`: eject the replica until its next passing check, retry
//!   elsewhere; `error_while_proxy`: retry a stale pooled connection, but never
//!   once a response byte went to the client.
//! - `response_filter`: `x-prefix-router-replica` / `-decision` headers, metrics.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use crate::config::{ms, Config};
use crate::errors::RouterError;
use crate::fleet::Fleet;
use crate::metrics::METRICS;
use crate::policy::{Decision, Policy, ReplicaId, Request};
use crate::replicas::{InFlight, Replicas};
use crate::request::{is_routed_path, Prompt};

/// Response header naming the replica that served the request.
pub const REPLICA_HEADER: &str = "x-prefix-router-replica";
/// Response header with the decision reason (`pin`, `spread`, ...).
pub const DECISION_HEADER: &str = "x-prefix-router-decision";
/// Request header carrying an explicit conversation key.
pub const SESSION_HEADER: &str = "x-session-id";

/// Proxy settings fixed at start.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    pub block_bytes: usize,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub idle_timeout: Duration,
    pub tls: crate::config::ReplicaTls,
}

impl Settings {
    pub fn from_config(c: &Config) -> Self {
        Self {
            max_body_bytes: c.max_body_bytes,
            body_read_timeout: ms(c.body_read_timeout_ms),
            block_bytes: c.prefix_index.block_bytes,
            connect_timeout: ms(c.timeouts.connect_ms),
            read_timeout: ms(c.timeouts.read_ms),
            write_timeout: ms(c.timeouts.write_ms),
            idle_timeout: ms(c.timeouts.idle_ms),
            tls: c.replica_tls.clone(),
        }
    }
}

/// The proxy: settings plus the state shared with reload and health checks.
pub struct Router {
    pub settings: Settings,
    pub policy: Arc<Mutex<Policy>>,
    pub replicas: Arc<Replicas>,
    pub fleet: Arc<Fleet>,
}

/// Per-request state.
pub struct Ctx {
    started: Instant,
    /// The body, read whole before placement (routed paths only).
    body: Option<Bytes>,
    /// The policy's view of the prompt; `None` spreads.
    request: Option<Request>,
    decision: Option<Decision>,
    /// The replica of the current attempt.
    attempt: Option<InFlight>,
    /// Replicas whose connection failed for this request.
    tried: Vec<ReplicaId>,
    /// An error the router answers itself.
    error: Option<RouterError>,
}

impl Router {
    /// Reads the whole body within the size limit. `Ok(Err(_))` is the client's fault.
    async fn read_body(
        &self,
        session: &mut Session,
    ) -> Result<std::result::Result<Bytes, RouterError>> {
        let limit = self.settings.max_body_bytes;
        let mut buf = BytesMut::new();
        while let Some(chunk) = session.read_request_body().await? {
            if buf.len() + chunk.len() > limit {
                return Ok(Err(RouterError::BodyTooLarge { limit }));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Ok(buf.freeze()))
    }

    fn lock_policy(&self) -> std::sync::MutexGuard<'_, Policy> {
        self.policy.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Writes an OpenAI-style JSON error and counts it.
async fn respond(session: &mut Session, err: &RouterError) -> Result<()> {
    METRICS.errors.with_label_values(&[err.code()]).inc();
    let body = Bytes::from(err.body());
    let mut resp = ResponseHeader::build(err.status(), Some(3))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

fn header<'a>(session: &'a Session, name: &str) -> Option<&'a str> {
    session
        .req_header()
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
}

#[async_trait]
impl ProxyHttp for Router {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            started: Instant::now(),
            body: None,
            request: None,
            decision: None,
            attempt: None,
            tried: Vec::new(),
            error: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let req = session.req_header();
        if req.method != http::Method::POST || !is_routed_path(req.uri.path()) {
            return Ok(false);
        }
        let declared = header(session, "content-length").and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.settings.max_body_bytes) {
            // The body is never read: the connection cannot be reused.
            session.set_keepalive(None);
            let err = RouterError::BodyTooLarge {
                limit: self.settings.max_body_bytes,
            };
            respond(session, &err).await?;
            return Ok(true);
        }
        if header(session, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
            session.write_continue_response().await?;
        }
        let deadline = self.settings.body_read_timeout;
        let body = match tokio::time::timeout(deadline, self.read_body(session)).await {
            Ok(read) => read?,
            Err(_) => Err(RouterError::BodyTimeout {
                ms: deadline.as_millis() as u64,
            }),
        };
        let body = match body {
            Ok(b) => b,
            Err(err) => {
                session.set_keepalive(None);
                respond(session, &err).await?;
                return Ok(true);
            }
        };
        // A body that is not JSON is still forwarded (spread): the engine answers it.
        ctx.request = Prompt::parse(&body)
            .ok()
            .map(|p| p.into_request(self.settings.block_bytes, header(session, SESSION_HEADER)));
        ctx.body = Some(body);
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        ctx.attempt = None;
        let list = self.replicas.snapshot();
        for _ in 0..=list.len() {
            let states = Replicas::states(&list, &ctx.tried);
            let decision = {
                let mut policy = self.lock_policy();
                match &ctx.request {
                    Some(r) => policy.place(r, &states),
                    None => policy.spread(&states),
                }
            };
            let replica = decision
                .replica
                .and_then(|id| list.iter().find(|r| r.id == id));
            let Some(replica) = replica else {
                METRICS.no_replica.inc();
                ctx.error = Some(RouterError::NoReplica);
                return Error::e_explain(ErrorType::HTTPStatus(503), "no live replica");
            };
            // Pingora's own view: still a member (not removed by reload) and healthy.
            let key = replica.addr.to_string();
            if self
                .fleet
                .select_with(key.as_bytes(), 1, |_, healthy| healthy)
                .is_none()
            {
                ctx.tried.push(replica.id);
                continue;
            }
            let tls = &self.settings.tls;
            let mut peer = HttpPeer::new(replica.addr, tls.enabled, tls.sni.clone());
            let o = &mut peer.options;
            o.verify_cert = tls.verify;
            o.verify_hostname = tls.verify_hostname();
            o.connection_timeout = Some(self.settings.connect_timeout);
            o.total_connection_timeout = Some(self.settings.connect_timeout);
            o.read_timeout = Some(self.settings.read_timeout);
            o.write_timeout = Some(self.settings.write_timeout);
            o.idle_timeout = Some(self.settings.idle_timeout);
            ctx.attempt = Some(replica.begin());
            ctx.decision = Some(decision);
            return Ok(Box::new(peer));
        }
        ctx.error = Some(RouterError::NoReplica);
        Error::e_explain(ErrorType::HTTPStatus(503), "no live replica")
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut pingora_http::RequestHeader,
        _ctx: &mut Ctx,
    ) -> Result<()> {
        // Answered by the router already; the replica gets the body at once.
        upstream_request.remove_header("expect");
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if end_of_stream {
            if let Some(b) = &ctx.body {
                *body = Some(b.clone());
            }
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(attempt) = ctx.attempt.take() {
            let r = attempt.replica();
            if r.eject() {
                log::warn!("replica {} ejected: connection failed: {e}", r.name);
            }
            METRICS.replica_up.with_label_values(&[&r.name]).set(0);
            ctx.tried.push(r.id);
            if session.response_written().is_none() {
                METRICS.failovers.with_label_values(&[&r.name]).inc();
                e.set_retry(true);
            }
        }
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("replica {peer}"));
        // A pooled keep-alive connection the replica had already closed: nothing
        // reached the engine, so re-sending is safe while the client saw nothing.
        // The body is re-sent from ctx (or Pingora's retry buffer for unread paths).
        let body_kept = ctx.body.is_some() || !session.as_ref().retry_buffer_truncated();
        e.set_retry(client_reused && body_kept && session.response_written().is_none());
        ctx.attempt = None;
        e
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let (Some(d), Some(a)) = (&ctx.decision, &ctx.attempt) {
            let name = &a.replica().name;
            upstream_response.insert_header(REPLICA_HEADER, name.as_str())?;
            upstream_response.insert_header(DECISION_HEADER, d.reason.as_str())?;
            METRICS.routed(name, d.reason, d.shape);
            METRICS
                .upstream_header_seconds
                .observe(ctx.started.elapsed().as_secs_f64());
        }
        Ok(())
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let replica = ctx
            .attempt
            .as_ref()
            .map(|a| a.replica().name.clone())
            .unwrap_or_default();
        let err = ctx.error.take().unwrap_or_else(|| match e.etype() {
            ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
                RouterError::UpstreamTimeout { replica }
            }
            _ => RouterError::Upstream {
                replica,
                detail: e.etype().as_str().to_owned(),
            },
        });
        let client_gone = matches!(
            e.etype(),
            ErrorType::ReadError | ErrorType::WriteError | ErrorType::ConnectionClosed
        ) && e.esource() == &pingora_core::ErrorSource::Downstream;
        let code = if client_gone || session.response_written().is_some() {
            0
        } else {
            if let Err(we) = respond(session, &err).await {
                log::debug!("could not send error response: {we}");
            }
            err.status()
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let replica = ctx.attempt.take().map(|a| a.replica().name.clone());
        let d = ctx.decision.as_ref();
        log::info!(
            "{} {} status={} replica={} decision={} shape={} matched_bytes={} failovers={} ms={}{}",
            session.req_header().method,
            session.req_header().uri.path(),
            status,
            replica.as_deref().unwrap_or("-"),
            d.map_or("-", |d| d.reason.as_str()),
            d.map_or("-", |d| d.shape.as_str()),
            d.map_or(0, |d| d.matched_bytes),
            ctx.tried.len(),
            ctx.started.elapsed().as_millis(),
            e.map(|e| format!(" error=\"{e}\"")).unwrap_or_default()
        );
    }
}
