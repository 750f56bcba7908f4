//! The only `impl ProxyHttp`: read the body whole, ask the policy, forward the
//! same bytes, stream the answer, fail over on connection failure.
//!
//! Phase by phase:
//! - `early_request_filter`: client keep-alive and write timeouts.
//! - `request_filter`: the request counted in progress (per client address
//!   when capped), the API key (when configured), then any body: answer
//!   `Expect: 100-continue`, read it whole within `max_body_bytes`,
//!   `body_read_timeout_ms` and the byte budget, and for a routed `POST`
//!   parse it (off the async workers when large). A request refused before
//!   its body was read has the body drained, so a client that sends before
//!   it reads gets the answer.
//! - `upstream_peer` (again on every retry): the slot under `limits` (once),
//!   then the policy places the request among live replicas not yet tried
//!   (a replica a reload removed meanwhile is passed over).
//! - `request_body_filter`: hands the buffered body to Pingora at end of stream.
//!   With `patches/pingora-proxy-0.9.1.diff` this happens on every attempt and
//!   for any size (stock Pingora forwards only from its 64 KiB retry buffer).
//! - `fail_to_connect`: nothing reached the engine: record the failure (see
//!   `replicas` for ejection) and retry elsewhere.
//! - `error_while_proxy`: retry only when the request cannot have reached the
//!   engine whole (writing it failed; an early answer is waited for 1 s) and
//!   nothing went to the client; a read
//!   error or timeout after the request was sent is answered 502/504, never
//!   re-sent: a second delivery is a second prefill and maybe a second tool call.
//! - `response_filter`: outlier bookkeeping (502-504), placement headers, metrics.
//! - `response_body_filter`: reads the engine's cache figures as the body
//!   passes (`usage`), counted against the placement's prediction at its end.
//!
//! A `100 Continue` is not "a response": every check of whether the client has
//! seen a response looks past 1xx ([`response_started`]).
//!
//! This file is the seam only: each hook calls the module of its concern,
//! `receive` (`request_filter`), `place` (`upstream_peer`), `failover` (the
//! two failure hooks), `stream` (the answer's head and body), `finish`
//! (`fail_to_proxy`, `logging`); `answer` writes the router's own answers
//! and `ctx` holds the request's state, one part per phase.

mod admit;
mod answer;
mod ctx;
mod failover;
mod finish;
mod place;
mod receive;
mod stream;

pub use answer::response_started;
pub use ctx::{Ctx, Prompt};

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::modules::http::HttpModules;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use crate::admission::Admission;
use crate::auth::KeyFile;
use crate::exact::Exact;
use crate::metrics::Metrics;
use crate::paths::Route;
use crate::policy::Policy;
use crate::replicas::Replicas;
use crate::request::Checkpoints;
use crate::response_ids::ResponseIds;
use crate::settings::Settings;
use crate::shared_pins::SharedPins;
use crate::tenants::queue::Queue;
use crate::tenants::Tenants;
use crate::traces::Traces;

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
    pub admission: Arc<Admission>,
    /// Client API keys, when `api_keys_file` is set.
    pub keys: Option<Arc<KeyFile>>,
    /// Each tenant's counts against its limits (`tenants`).
    pub tenants: Arc<Tenants>,
    /// Requests waiting for a replica (`queue`).
    pub queue: Arc<Queue>,
    /// Spans of requests, when `traces` is set.
    pub traces: Option<Arc<Traces>>,
    /// Which replica holds each Responses API response.
    pub responses: Arc<ResponseIds>,
    /// Pins shared with other router instances (`fleet: redis`).
    pub shared: Option<Arc<SharedPins>>,
    /// Where long conversations' last turns were read to.
    pub checkpoints: Arc<Checkpoints>,
    /// The models' tokenizers: prompts matched against engines' KV events.
    pub exact: Arc<Exact>,
    pub metrics: Arc<Metrics>,
}

#[async_trait]
impl ProxyHttp for Router {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::new()
    }

    /// None: Pingora's default is its response compression, disabled, which
    /// still costs two boxed header filters and a done filter per request
    /// and a call per answer chunk (the router never compresses: engines'
    /// SSE must flush event by event).
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    fn request_header_timeout(&self) -> Option<Duration> {
        Some(self.settings.load().client_header_timeout)
    }

    fn upstream_response_header_deadline(&self, ctx: &Ctx) -> Option<Instant> {
        (ctx.attempts.first).map(|t| t + self.settings.load().response_header_timeout)
    }

    fn upstream_early_answer_grace(&self, _ctx: &Ctx) -> Option<Duration> {
        Some(failover::EARLY_ANSWER_GRACE)
    }

    async fn early_request_filter(&self, session: &mut Session, _ctx: &mut Ctx) -> Result<()> {
        let s = self.settings.load();
        // Pingora keeps an HTTP/1.1 connection open without limit by default.
        if session.get_keepalive().is_some() {
            session.set_keepalive(Some(s.client_keepalive_s));
        }
        session.set_write_timeout(Some(s.client_write_timeout));
        // A client may send its next request before reading this answer
        // (HTTP/1.1 pipelining): it is answered after this one, in order.
        // Off, Pingora took those bytes for a broken body and the request
        // in progress failed with 502.
        session.downstream_session.set_pipelining_enabled(true);
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        self.receive(session, ctx).await
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        self.place(session, ctx).await
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // Answered by the router already; the replica gets the body at once.
        upstream_request.remove_header("expect");
        // Keys stay at the edge: a replica with its own key gets that one;
        // a client's key checked here goes no further unless asked.
        let replica_key = ctx
            .attempts
            .current
            .as_ref()
            .and_then(|f| f.replica().api_key());
        if replica_key.is_some()
            || (self.keys.is_some() && !self.settings.load().forward_client_keys)
        {
            upstream_request.remove_header("authorization");
            upstream_request.remove_header("x-api-key");
        }
        if let Some(key) = replica_key {
            upstream_request.insert_header("authorization", key.bearer())?;
        }
        if let Some(t) = &ctx.trace {
            t.inject(upstream_request);
        }
        // A key sent on is not printed by Pingora's debug log of the head.
        for name in ["authorization", "x-api-key"] {
            if let Some(mut v) = upstream_request.headers.get(name).cloned() {
                v.set_sensitive(true);
                upstream_request.insert_header(name, v)?;
            }
        }
        // The engine gets the path the router classified, not a variant of it.
        if let Some(path) = ctx.read.route.map(Route::path) {
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
            if let Some(b) = &ctx.read.body {
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
        e: Box<Error>,
    ) -> Box<Error> {
        self.connect_failed(session, ctx, e)
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        self.proxy_failed(peer, session, e, ctx, client_reused)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.answer_head(session, upstream_response, ctx)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        self.answer_body(body, end_of_stream, ctx);
        Ok(None)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        self.answer_failure(session, e, ctx).await
    }

    /// Pingora's failure log lines name the request with this: method and
    /// path only, never the query string (it may carry a key).
    fn request_summary(&self, session: &Session, _ctx: &Ctx) -> String {
        let req = session.req_header();
        format!("{} {}", req.method, req.uri.path())
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        self.finish(session, e, ctx);
    }
}
