//! The only `impl ProxyHttp`: read the body whole, ask the policy, forward the
//! same bytes, stream the answer, fail over on connection failure.
//!
//! Phase by phase:
//! - `early_request_filter`: client keep-alive and write timeouts.
//! - `request_filter`: the API key (when configured), then for `POST` to a
//!   routed path (normalised): a slot under `limits`, answer `Expect:
//!   100-continue`, read the body within `max_body_bytes`,
//!   `body_read_timeout_ms` and the byte budget, parse it (off the async
//!   workers when large). A request refused before its body was read has the
//!   body drained, so a client that sends before it reads gets the answer.
//! - `upstream_peer` (again on every retry): the policy places the request among
//!   live replicas not yet tried; Pingora's selection confirms membership and health.
//! - `request_body_filter`: hands the buffered body to Pingora at end of stream.
//!   With `patches/pingora-proxy-0.9.1.diff` this happens on every attempt and
//!   for any size (stock Pingora forwards only from its 64 KiB retry buffer).
//! - `fail_to_connect`: nothing reached the engine: record the failure (see
//!   `replicas` for ejection) and retry elsewhere.
//! - `error_while_proxy`: retry only when the request cannot have reached the
//!   engine whole (writing it failed) and nothing went to the client; a read
//!   error or timeout after the request was sent is answered 502/504, never
//!   re-sent: a second delivery is a second prefill and maybe a second tool call.
//! - `response_filter`: outlier bookkeeping (5xx), placement headers, metrics.
//! - `response_body_filter`: reads the engine's cache figures as the body
//!   passes (`usage`), counted against the placement's prediction at its end.
//!
//! A `100 Continue` is not "a response": every check of whether the client has
//! seen a response looks past 1xx ([`response_started`]).
//!
//! One module per concern beside this seam: `place` (the attempt's
//! replica and peer), `steps` (prompt, Responses API ids, shared pins,
//! usage verdicts, failures, refusals, `/v1/models`, keys), `answer` (the
//! router's own answers).

mod answer;
mod ctx;
mod place;
mod steps;

pub use ctx::{Ctx, Prompt};

pub use answer::response_started;
use answer::{expects_continue, failed_writing_request, header, respond, respond_json};

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use arc_swap::ArcSwap;

use crate::access_log;
use crate::admission::Admission;
use crate::auth::KeyFile;
use crate::balancer::Balancer;
use crate::body;
use crate::errors::RouterError;
use crate::metrics::{Metrics, Repair};
use crate::paths::{response_id, route, Route};
use crate::policy::{Decision, Hint, Policy, Reason, ReplicaId, Shape, BYTES_PER_TOKEN};
use crate::replicas::{Failure, InFlight, Replica, Replicas};
use crate::request::Checkpoints;
use crate::response_ids::{IdScan, ResponseIds};
use crate::settings::Settings;
use crate::shared_pins::{SharedPins, LOOKUP_ENDS};
use crate::usage::{Outcome, UsageScan};

/// Response header naming the replica that served the request.
pub const REPLICA_HEADER: &str = "x-prefix-router-replica";
/// Response header with the decision reason (`pin`, `spread`, ...).
pub const DECISION_HEADER: &str = "x-prefix-router-decision";
/// Request header carrying an explicit conversation key.
pub const SESSION_HEADER: &str = "x-session-id";

/// The proxy: settings plus the state shared with reload and health checks.
pub struct Router {
    /// Swapped by reload; each use reads the current ones.
    pub settings: Arc<ArcSwap<Settings>>,
    pub policy: Arc<Policy>,
    pub replicas: Arc<Replicas>,
    pub balancer: Arc<Balancer>,
    pub admission: Arc<Admission>,
    /// Client API keys, when `api_keys_file` is set.
    pub keys: Option<Arc<KeyFile>>,
    /// Which replica holds each Responses API response.
    pub responses: Arc<ResponseIds>,
    /// Pins shared with other router instances (`fleet: redis`).
    pub shared: Option<Arc<SharedPins>>,
    /// Where long conversations' last turns were read to.
    pub checkpoints: Arc<Checkpoints>,
    pub metrics: Arc<Metrics>,
}

#[async_trait]
impl ProxyHttp for Router {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    fn request_header_timeout(&self) -> Option<Duration> {
        Some(self.settings.load().client_header_timeout)
    }

    fn upstream_response_header_deadline(&self, ctx: &Ctx) -> Option<Instant> {
        ctx.first_attempt
            .map(|t| t + self.settings.load().response_header_timeout)
    }

    async fn early_request_filter(&self, session: &mut Session, _ctx: &mut Ctx) -> Result<()> {
        // Pingora keeps an HTTP/1.1 connection open without limit by default.
        if session.get_keepalive().is_some() {
            session.set_keepalive(Some(self.settings.load().client_keepalive_s));
        }
        session.set_write_timeout(Some(self.settings.load().client_write_timeout));
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        if !self.authorised(session) {
            return self
                .refuse(session, ctx, &RouterError::Unauthorized, true)
                .await;
        }
        if let Some(id) = response_id(session.req_header().uri.path()).map(str::to_owned) {
            let holder = self.response_holder(&id).await;
            ctx.response = Some((id, holder));
        }
        let req = session.req_header();
        if req.method == http::Method::GET {
            if let Some(answer) = self.models_answer(req.uri.path()) {
                return match answer {
                    Ok(body) => {
                        respond_json(session, 200, body).await?;
                        Ok(true)
                    }
                    Err(err) => self.refuse(session, ctx, &err, false).await,
                };
            }
        }
        if req.method != http::Method::POST {
            return Ok(false);
        }
        let routed = route(req.uri.path());
        // Every POST holds a slot; only routed ones buffer their body.
        let Some(ticket) = self.admission.admit() else {
            let err = RouterError::Overloaded {
                what: "requests in flight",
            };
            return self.refuse(session, ctx, &err, true).await;
        };
        let ticket = ctx.ticket.insert(ticket);
        let limit = self.settings.load().max_body_bytes;
        let declared = header(session, "content-length").and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            let err = RouterError::BodyTooLarge { limit };
            return self.refuse(session, ctx, &err, true).await;
        }
        let Some(routed) = routed else {
            return Ok(false); // streamed to the replica unread
        };
        ctx.routed = Some(routed);
        // Shed at once when every replica is saturated, before reading anything.
        if let Some(in_flight) = self.settings.load().shed_in_flight {
            if self.replicas.saturated(in_flight) {
                let err = RouterError::Saturated { in_flight };
                return self.refuse(session, ctx, &err, true).await;
            }
        }
        // Refuse before `100 Continue` a body that cannot fit the budget now.
        if !self.admission.has_room(declared.unwrap_or(0)) {
            return self
                .refuse(session, ctx, &RouterError::OVER_BUDGET, true)
                .await;
        }
        if expects_continue(session) {
            session.write_continue_response().await?;
        }
        let deadline = self.settings.load().body_read_timeout;
        let read = body::read(session, limit, declared, ticket);
        let body = match tokio::time::timeout(deadline, read).await {
            Ok(read) => read?,
            Err(_) => Err(RouterError::BodyTimeout {
                ms: deadline.as_millis() as u64,
            }),
        };
        let body = match body {
            Ok(b) => b,
            Err(err) => {
                let drain = !matches!(err, RouterError::BodyTimeout { .. });
                return self.refuse(session, ctx, &err, drain).await;
            }
        };
        self.metrics.request_body_bytes.observe(body.len() as f64);
        ctx.body = Some(body);
        if !self.read_prompt(session, ctx).await {
            return self
                .refuse(session, ctx, &RouterError::OVER_BUDGET, false)
                .await;
        }
        if let Some(model) = ctx.model.as_deref() {
            if self.replicas.nobody_serves(model) {
                let err = RouterError::ModelNotFound {
                    model: model.chars().take(crate::config::MAX_MODEL_NAME).collect(),
                };
                return self.refuse(session, ctx, &err, false).await;
            }
        }
        Ok(false)
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        ctx.attempt = None;
        // A retry after the response-head deadline would start already late.
        if ctx
            .first_attempt
            .is_some_and(|t| t.elapsed() >= self.settings.load().response_header_timeout)
        {
            ctx.error = Some(RouterError::UpstreamTimeout { replica: None });
            return Error::e_explain(ErrorType::HTTPStatus(504), "response head deadline passed");
        }
        // Placed again (a retry): the prompt as the first placement saw it,
        // or spread if the budget cannot hold it now.
        if matches!(ctx.prompt, Prompt::Placed) {
            self.read_prompt(session, ctx).await;
        }
        let list = self.replicas.snapshot();
        // A known response's replica, and no other: the state is there (a
        // replica that left the set took it along: the id is forgotten).
        let mut holder = ctx.response.as_ref().and_then(|(_, h)| *h);
        if let (Some(h), Some((id, _))) = (holder, &ctx.response) {
            if !list.iter().any(|r| r.id == h) {
                self.responses.remove(id);
                holder = None;
            }
        }
        let Some((replica, decision, panic)) = self.choose(ctx, &list, holder) else {
            return self.unplaced(ctx, holder.is_some());
        };
        let peer = self.peer(&replica.addr);
        if panic {
            self.metrics.panic_routed.inc();
        }
        // A single's prompt takes KV room on its replica while it runs (a
        // continuation's counts in the pinned working set instead).
        let cold = match (ctx.request(), decision.shape) {
            (Some(r), Shape::Single) => r.chain.len() as u64,
            _ => 0,
        };
        ctx.evidence = ctx.request().is_some_and(|r| !r.cache_bypass);
        ctx.attempt = Some(replica.begin(cold));
        ctx.decision = Some(decision);
        if let (Some(shared), Some(r)) = (&self.shared, ctx.request()) {
            let keys: Vec<u64> = r
                .chain
                .shared_keys(r.key.as_deref(), 0)
                .into_iter()
                .map(|(_, k)| k)
                .collect();
            shared.record(&keys, &replica.name);
        }
        ctx.placed();
        ctx.first_attempt.get_or_insert_with(Instant::now);
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut pingora_http::RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // Answered by the router already; the replica gets the body at once.
        upstream_request.remove_header("expect");
        // The engine gets the path the router classified, not a variant of it.
        if let Some(path) = ctx.routed.map(Route::path) {
            if session.req_header().uri.path() != path {
                let uri = match session.req_header().uri.query() {
                    Some(q) => format!("{path}?{q}"),
                    None => path.to_owned(),
                };
                // Parts of a URI that parsed already: this parses too.
                if let Ok(uri) = uri.parse() {
                    upstream_request.set_uri(uri);
                }
            }
        }
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
            let failure = match e.etype() {
                ErrorType::ConnectRefused | ErrorType::ConnectNoRoute => Some(Failure::Dead),
                // The router's own trouble (no sockets, no ports): not the replica's.
                ErrorType::SocketError | ErrorType::BindError | ErrorType::InternalError => None,
                // Timeouts, TLS handshakes, anything else on the way: overload or worse.
                _ => Some(Failure::ConnectTimeout),
            };
            if let Some(failure) = failure {
                self.failed(r, failure, &e);
            }
            ctx.tried.push(r.id);
            // Nothing reached the engine: another replica may take it.
            if !response_started(session) {
                r.counters.failover();
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
        let writing = failed_writing_request(&e);
        if let Some(r) = ctx.attempt.as_ref().map(InFlight::replica) {
            // A pooled connection the engine had closed is not the engine
            // failing (it is answered, not re-sent, when the request went out).
            let stale =
                client_reused && (writing || matches!(e.etype(), ErrorType::ConnectionClosed));
            // A timeout while the client still trickles its body (paths streamed
            // unread) is the client's doing: it must not eject the replica.
            let client_slow = e.etype() == &ErrorType::ReadTimedout && !session.is_body_done();
            if e.esource() == &ErrorSource::Upstream && !stale && !client_slow {
                self.failed(r, Failure::Response, &e);
            }
            if writing && !client_reused {
                ctx.tried.push(r.id);
            }
        }
        // Re-sent only if the engine never had it whole and the client saw
        // nothing. The body comes from ctx (or Pingora's retry buffer for
        // paths the router does not read).
        let body_kept = ctx.body.is_some() || !session.as_ref().retry_buffer_truncated();
        e.set_retry(writing && body_kept && !response_started(session));
        e
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let (Some(d), Some(a)) = (&ctx.decision, &ctx.attempt) {
            let r = a.replica();
            if upstream_response.status.is_server_error() {
                let why = format!("answered {}", upstream_response.status);
                self.failed(r, Failure::Response, &why);
            } else {
                r.on_success();
            }
            // Nothing is re-sent once a response arrived: drop the copies.
            ctx.body = None;
            ctx.prompt = Prompt::None;
            if let Some(t) = ctx.ticket.as_mut() {
                t.release_bytes();
            }
            if self.settings.load().placement_headers {
                upstream_response.insert_header(REPLICA_HEADER, r.name.as_str())?;
                upstream_response.insert_header(DECISION_HEADER, d.reason.as_str())?;
            }
            r.counters.routed(d.reason, d.shape);
            let model = ctx.model.as_deref();
            let listed = model.is_some_and(|m| self.replicas.lists(m));
            self.metrics.model_routed(model, listed, d.reason);
            self.metrics
                .upstream_header_seconds
                .observe(ctx.started.elapsed().as_secs_f64());
            if upstream_response.status.is_success()
                && ctx.routed.is_some_and(Route::carries_prompt)
            {
                ctx.usage = Some(UsageScan::default());
            } else {
                ctx.learn_id = None;
            }
            if upstream_response.status.is_success()
                && session.req_header().method == http::Method::DELETE
            {
                if let Some((id, _)) = &ctx.response {
                    self.responses.remove(id);
                    self.metrics.response_ids.set(self.responses.len() as i64);
                    if let Some(shared) = &self.shared {
                        shared.forget_response(id);
                    }
                }
            }
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        if ctx.first_byte.is_none()
            && (end_of_stream || body.as_ref().is_some_and(|b| !b.is_empty()))
        {
            if let (Some(a), Some(d)) = (ctx.attempt.as_mut(), &ctx.decision) {
                let at = ctx.started.elapsed();
                ctx.first_byte = Some(at);
                a.answered();
                a.replica().counters.first_byte(d.reason, at);
            }
        }
        if let (Some(scan), Some(b), Some(a)) = (ctx.learn_id.as_mut(), body.as_ref(), &ctx.attempt)
        {
            if let Some(id) = scan.feed(b) {
                self.responses.insert(&id, a.replica().id);
                self.metrics.response_ids.set(self.responses.len() as i64);
                if let Some(shared) = &self.shared {
                    shared.record_response(&id, &a.replica().name);
                }
            }
        }
        if let Some(u) = ctx.usage.as_mut() {
            if let Some(b) = body {
                u.feed(b);
            }
            // Counted before the last bytes go out: a client that has read
            // the whole answer finds it in the metrics.
            if end_of_stream {
                u.finish();
                if let (Some(a), Some(d), true) = (&ctx.attempt, &ctx.decision, ctx.evidence) {
                    self.reported(a.replica(), d, u);
                }
            }
        }
        Ok(None)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let replica = ctx.attempt.as_ref().and_then(|a| self.shown(a.replica()));
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
        ) && e.esource() == &ErrorSource::Downstream;
        let code = if client_gone || response_started(session) {
            0
        } else {
            // The connection is not reused after a failure: say so, or a
            // keep-alive client sends its next request into a closed socket.
            session.set_keepalive(None);
            if let Err(we) = respond(session, &err, &self.metrics).await {
                log::debug!("could not send error response: {we}");
            }
            // A body the router did not read (other paths): drain it too.
            if !session.is_body_done() {
                body::drain(session, self.drain_bytes()).await;
            }
            err.status()
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// Pingora's failure log lines name the request with this: method and
    /// path only, never the query string (it may carry a key).
    fn request_summary(&self, session: &Session, _ctx: &Ctx) -> String {
        let req = session.req_header();
        format!("{} {}", req.method, req.uri.path())
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session
            .response_written()
            .filter(|r| !r.status.is_informational())
            .map_or(0, |r| r.status.as_u16());
        let attempt = ctx.attempt.take();
        let d = ctx.decision.as_ref();
        let duration = ctx.started.elapsed();
        if let (Some(a), Some(d), Some(_)) = (&attempt, d, ctx.first_byte) {
            a.replica().counters.duration(d.reason, duration);
        }
        let req = session.req_header();
        access_log::write(&access_log::Entry {
            method: req.method.as_str(),
            path: req.uri.path(),
            status,
            replica: attempt.as_ref().map(|a| a.replica().name.as_str()),
            decision: d.map(|d| d.reason.as_str()),
            shape: d.map(|d| d.shape.as_str()),
            matched_bytes: d.map_or(0, |d| d.matched_bytes),
            tried: ctx.tried.len(),
            first_byte: ctx.first_byte,
            duration,
            error: e.map(|e| e as &dyn std::fmt::Display),
        });
    }
}
