//! Receiving a request (`request_filter`): the count of requests in progress
//! (per client address when capped), the API key, the tenant's limits, the router's own
//! `/v1/models` answers, any body read whole within its limits (a routed
//! POST's parsed into the policy's view of the prompt), and the refusals on
//! the way, each answered at once and the connection closed.

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use pingora_core::Result;
use pingora_proxy::Session;

use super::answer::{expects_continue, header, respond, respond_json};
use super::{Ctx, Prompt, Router, SESSION_HEADER};
use crate::body;
use crate::errors::RouterError;
use crate::paths::{response_id, route, Route};
use crate::policy::{Request, BYTES_PER_TOKEN};
use crate::response_ids::IdScan;

impl Router {
    /// `request_filter`: `true` when the router answered the request itself.
    pub(super) async fn receive(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let client = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        match self.admission.arrive(client) {
            Ok(arrival) => ctx.read.arrival = Some(arrival),
            Err(max) => {
                let err = RouterError::ClientLimit { max };
                return self.refuse(session, ctx, &err, true).await;
            }
        }
        match self.identify(session, ctx, client) {
            Ok(source) => ctx.read.source = source,
            Err(err) => return self.refuse(session, ctx, &err, true).await,
        }
        // Traced once its key is checked: a client that is refused makes no
        // span (and cannot ask for one to be kept).
        if let Some(t) = &self.traces {
            let started = SystemTime::now() - ctx.started.elapsed();
            ctx.trace = Some(Box::new(t.begin(session.req_header(), started)));
        }
        let admission = ctx.trace.as_ref().map(|t| t.step("admission"));
        // The head is held until the request ends: its bytes count too.
        let head = head_bytes(session.req_header());
        let ticket = ctx.read.ticket.insert(self.admission.receive());
        if !ticket.hold_head(head) {
            return self
                .refuse(session, ctx, &RouterError::OVER_BUDGET, true)
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
        // Every body, any method or path, is read whole before placement
        // (bounded by the limits below); routed POSTs' bodies are also read
        // as prompts. A request without a body goes on as it is.
        let post = req.method == http::Method::POST;
        if !post && session.is_body_empty() {
            return Ok(false);
        }
        let routed = post
            .then(|| route(session.req_header().uri.path()))
            .flatten();
        // Refused before any upload while every slot is taken (the slot
        // itself is taken when the request is placed).
        if self.admission.full() {
            return self
                .refuse(session, ctx, &RouterError::AT_CAPACITY, true)
                .await;
        }
        let limit = self.settings.load().max_body_bytes;
        let declared = header(session, "content-length").and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            let err = RouterError::BodyTooLarge { limit };
            return self.refuse(session, ctx, &err, true).await;
        }
        ctx.read.route = routed;
        // Shed (or wait, with `queue`) when every replica is saturated,
        // before reading anything.
        if let (Some(bound), Some(_)) = (self.settings.load().shed_in_flight, routed) {
            if let Err(err) = self.wait_for_room(ctx, bound).await {
                return self.refuse(session, ctx, &err, true).await;
            }
        }
        // Refuse before `100 Continue` a body that cannot fit the budget now.
        if !self.admission.has_room(declared.unwrap_or(0)) {
            return self
                .refuse(session, ctx, &RouterError::OVER_BUDGET, true)
                .await;
        }
        drop(admission);
        if expects_continue(session) {
            session.write_continue_response().await?;
        }
        let read_body = ctx.trace.as_ref().map(|t| t.step("read body"));
        let deadline = self.settings.load().body_read_timeout;
        let ticket = (ctx.read.ticket).get_or_insert_with(|| self.admission.receive());
        let read = body::read(session, limit, declared, ticket);
        let body = match tokio::time::timeout(deadline, read).await {
            Ok(Ok(read)) => read,
            Ok(Err(gone)) => {
                // The client's connection failed: nothing to answer, and
                // nothing reached an engine.
                if let Some(t) = ctx.read.tenant.as_mut() {
                    t.refund();
                }
                return Err(gone);
            }
            Err(_) => Err(RouterError::BodyTimeout {
                ms: deadline.as_millis() as u64,
            }),
        };
        let body = match body {
            Ok(b) => b,
            Err(err) => {
                // Only a body still framed as declared can be read on.
                let drain = !matches!(
                    err,
                    RouterError::BodyTimeout { .. } | RouterError::BadBody { .. }
                );
                return self.refuse(session, ctx, &err, drain).await;
            }
        };
        drop(read_body);
        if routed.is_some() {
            self.metrics.request_body_bytes.observe(body.len() as f64);
        }
        let _parse = ctx.trace.as_ref().map(|t| t.step("parse"));
        ctx.read.body = Some(body);
        if let Err(err) = self.read_prompt(session, ctx).await {
            return self.refuse(session, ctx, &err, false).await;
        }
        if let Err(err) = self.charge_tokens(ctx) {
            return self.refuse(session, ctx, &err, false).await;
        }
        if let Some(model) = ctx.read.model.as_deref() {
            if self.replicas.nobody_serves(model) {
                let err = RouterError::ModelNotFound {
                    model: model.chars().take(crate::config::MAX_MODEL_NAME).collect(),
                };
                return self.refuse(session, ctx, &err, false).await;
            }
        }
        Ok(false)
    }

    /// Parses the body in `ctx` into the policy's view of its prompt, its
    /// canonical text reserved on the request's ticket; an error (nothing
    /// kept) when an identifier is longer than its cap or the budget cannot
    /// hold the text. A body that is not a prompt is still forwarded,
    /// spread: the engine answers it.
    pub(super) async fn read_prompt(
        &self,
        session: &Session,
        ctx: &mut Ctx,
    ) -> std::result::Result<(), RouterError> {
        let (Some(body), Some(route)) = (ctx.read.body.clone(), ctx.read.route) else {
            return Ok(());
        };
        let key = header(session, SESSION_HEADER).map(str::to_owned);
        let s = self.settings.load();
        let checkpoints = Arc::clone(&self.checkpoints);
        let parsed = body::parse(body, route, &s, checkpoints, key, &self.metrics).await;
        let (request, turns) = parsed.unzip();
        ctx.read.turns = turns.unwrap_or_default();
        if let Some(err) = request.as_ref().and_then(too_long) {
            return Err(err);
        }
        let parsed_bytes = request.as_ref().map_or(0, |r| r.chain.heap_bytes());
        if !ctx
            .read
            .ticket
            .as_mut()
            .is_some_and(|t| t.reserve(parsed_bytes))
        {
            return Err(RouterError::OVER_BUDGET);
        }
        if let Some(r) = &request {
            ctx.read.model.clone_from(&r.model);
            ctx.read.whole_answer =
                matches!(route, Route::Prompt(_) | Route::Responses) && !r.stream;
            // Looked up once per request, not again on a retry's re-read.
            if let (Some(id), None) = (&r.previous_response_id, &ctx.response) {
                ctx.response = Some((id.clone(), self.response_holder(id).await));
            }
            if route == Route::Responses && r.store {
                ctx.answer.learn_id = Some(IdScan::default());
            }
        }
        ctx.read.prompt = request.map_or(Prompt::None, Prompt::Parsed);
        // A response's holder places the request alone: no pins to look up
        // (and no second wait on Redis).
        if ctx.response.is_none() {
            self.ask_shared(ctx).await;
        }
        Ok(())
    }

    /// Answers `err` and closes the connection. With `drain`, the unread rest
    /// of the body is read and discarded first (bounded), so a client that
    /// sends before it reads gets the answer; not when the client waits for a
    /// `100 Continue` it never got. The request's slot is released first.
    pub(super) async fn refuse(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        err: &RouterError,
        drain: bool,
    ) -> Result<bool> {
        ctx.read.ticket = None;
        // Nothing reached an engine: the tenant gets its request back.
        if let Some(t) = ctx.read.tenant.as_mut() {
            t.refund();
        }
        session.set_keepalive(None);
        // Read before the answer is written: after it, the last response
        // written is the answer, not the `100 Continue`.
        let waits_for_continue =
            expects_continue(session) && session.response_written().is_none_or(|r| r.status != 100);
        respond(session, err, &self.metrics).await?;
        if drain && !waits_for_continue {
            body::drain(session, self.drain_bytes()).await;
        }
        Ok(true)
    }

    /// How much of a refused body is read and discarded at most.
    pub(super) fn drain_bytes(&self) -> usize {
        self.settings
            .load()
            .max_body_bytes
            .saturating_mul(2)
            .max(64 << 20)
    }

    /// The API key check, then (with `tenants`) the request counted against
    /// its tenant's limits (in `ctx`); the request's source (see
    /// `Read::source`), or why it may not go on.
    fn identify(
        &self,
        session: &Session,
        ctx: &mut Ctx,
        client: Option<std::net::IpAddr>,
    ) -> std::result::Result<u64, RouterError> {
        let h = &session.req_header().headers;
        let keys = self.keys.as_ref().map(|k| k.keys());
        let key = match &keys {
            None => None,
            Some(keys) => {
                let presented = crate::auth::presented(
                    h.get("authorization").map(|v| v.as_bytes()),
                    h.get("x-api-key").map(|v| v.as_bytes()),
                );
                let key = presented.ok_or(RouterError::Unauthorized)?;
                let entry = keys.find(key).ok_or(RouterError::Unauthorized)?;
                Some((xxhash_rust::xxh3::xxh3_64(key), entry))
            }
        };
        if let Some(rules) = &self.settings.load().tenants {
            // One value: a second (a gateway that appends) is refused.
            let mut named = rules.header().map(|name| h.get_all(name).iter());
            let value = named.as_mut().and_then(Iterator::next);
            if named.and_then(|mut n| n.next()).is_some() {
                return Err(RouterError::BadTenant);
            }
            let tenant = rules
                .identify(key.map(|k| k.1), value.map(|v| v.as_bytes()))
                .ok_or(RouterError::BadTenant)?;
            let admitted = self.tenants.arrive(rules, &tenant, Instant::now())?;
            ctx.read.tenant = Some(admitted);
        }
        Ok(key.map_or_else(|| source_of_address(client), |k| k.0))
    }

    /// With `tenants`: charges the request's estimated prompt tokens (its
    /// body's bytes / 4: everything it sends the engine, tools and
    /// documents too) to its tenant.
    fn charge_tokens(&self, ctx: &mut Ctx) -> std::result::Result<(), RouterError> {
        let bytes = ctx.read.body.as_ref().map_or(0, |b| b.len()) as u64;
        match ctx.read.tenant.as_mut() {
            Some(t) => t.charge(bytes.div_ceil(BYTES_PER_TOKEN), Instant::now()),
            None => Ok(()),
        }
    }

    /// The router's own answer to `GET /v1/models` (the union of the live
    /// replicas' models, in OpenAI's list format) and `GET /v1/models/{id}`,
    /// when every live replica's list is known; `None`: forward it.
    fn models_answer(&self, path: &str) -> Option<std::result::Result<Vec<u8>, RouterError>> {
        let id = match path.strip_prefix("/v1/models") {
            Some("" | "/") => None,
            Some(rest) => Some(rest.strip_prefix('/')?),
            None => return None,
        };
        let list = self.replicas.snapshot();
        let mut models = std::collections::BTreeSet::new();
        let mut any_live = false;
        for r in list.iter().filter(|r| r.live() && !r.drained()) {
            any_live = true;
            // A list that cannot be read (an engine behind its own API key):
            // the union would be a guess.
            models.extend(r.models()?.iter().cloned());
        }
        if !any_live {
            return None;
        }
        let object = |m: &str| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": "prefix-router"});
        Some(match id {
            None => {
                let data: Vec<_> = models.iter().map(|m| object(m)).collect();
                Ok(serde_json::json!({"object": "list", "data": data})
                    .to_string()
                    .into_bytes())
            }
            Some(id) if models.contains(id) => Ok(object(id).to_string().into_bytes()),
            Some(id) => Err(RouterError::ModelNotFound {
                model: id.chars().take(crate::config::MAX_MODEL_NAME).collect(),
            }),
        })
    }
}

/// The longest conversation key (`prompt_cache_key`, `x-session-id`) held.
pub const MAX_KEY_BYTES: usize = 1024;

/// The first identifier of `r` longer than its cap: each is held for the
/// request's life (and may go to Redis), so none is taken unbounded.
fn too_long(r: &Request) -> Option<RouterError> {
    let caps = [
        ("model", r.model.as_deref(), crate::config::MAX_MODEL_NAME),
        (
            "prompt_cache_key or x-session-id",
            r.key.as_deref(),
            MAX_KEY_BYTES,
        ),
        (
            "previous_response_id",
            r.previous_response_id.as_deref(),
            crate::response_ids::MAX_ID,
        ),
    ];
    caps.into_iter()
        .find(|(_, v, max)| v.is_some_and(|v| v.len() > *max))
        .map(|(field, _, max)| RouterError::TooLong { field, max })
}

/// A request's source when no API key names it: its client (an address,
/// an IPv6 /64; behind a proxy that does not keep addresses, every client
/// is the proxy's).
fn source_of_address(client: Option<std::net::IpAddr>) -> u64 {
    match client.map(crate::admission::client_of) {
        Some(std::net::IpAddr::V4(ip)) => u64::from(ip.to_bits()) | 1 << 32,
        Some(std::net::IpAddr::V6(ip)) => xxhash_rust::xxh3::xxh3_64(&ip.octets()) | 1,
        None => 0,
    }
}

/// The bytes a request head holds: its path and its headers as sent.
fn head_bytes(head: &pingora_http::RequestHeader) -> usize {
    let headers: usize = head
        .headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    head.raw_path().len() + headers
}
