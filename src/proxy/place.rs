//! Placement of one attempt (`upstream_peer`, again on every retry): the
//! policy's choice among the replicas not yet tried (a Responses API id's
//! holder only), still in the set (a replica removed by a reload since
//! is passed over); the peer it is sent to; the
//! answer when no replica is left; and what other state names a replica for
//! a request (a response's holder, shared pins).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_proxy::Session;

use super::{Ctx, Prompt, Router};
use crate::errors::RouterError;
use crate::exact::{self, Chat, Continuity};
use crate::paths::Route;
use crate::policy::{Decision, Hint, Reason, ReplicaId, ReplicaState, Shape, BYTES_PER_TOKEN};
use crate::replicas::{Replica, Replicas, View};
use crate::shared_pins::LOOKUP_ENDS;

thread_local! {
    /// Each worker's buffer for the replicas' states a placement reads.
    static STATES: RefCell<Vec<ReplicaState>> = const { RefCell::new(Vec::new()) };
}

impl Router {
    /// `upstream_peer`: the peer for this attempt, or the error answered
    /// when none is left (or the response head's deadline has passed).
    pub(super) async fn place(&self, session: &Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        ctx.attempts.current = None;
        let mut step = ctx.trace.as_ref().map(|t| t.step("place"));
        // A retry after the response-head deadline would start already late.
        if (ctx.attempts.first)
            .is_some_and(|t| t.elapsed() >= self.settings.load().response_header_timeout)
        {
            ctx.error = Some(RouterError::UpstreamTimeout { replica: None });
            return Error::e_explain(ErrorType::HTTPStatus(504), "response head deadline passed");
        }
        // A slot under `limits.max_requests`, taken once (kept over retries).
        let ticket = (ctx.read.ticket).get_or_insert_with(|| self.admission.receive());
        if !ticket.take_slot() {
            ctx.error = Some(RouterError::AT_CAPACITY);
            return Error::e_explain(ErrorType::HTTPStatus(503), "every slot taken");
        }
        // Placed again (a retry): the prompt as the first placement saw it,
        // or spread if the budget cannot hold it now.
        if matches!(ctx.read.prompt, Prompt::Placed) {
            let _ = self.read_prompt(session, ctx).await;
        }
        let mut list = self.replicas.snapshot();
        ctx.read.chat = self.chat_tokens(ctx, &list).await;
        if ctx.read.chat.is_some() {
            // Placed over the set as it is after the wait.
            list = self.replicas.snapshot();
        }
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
        let request = ctx.read.request();
        let cold = match (request, decision.shape) {
            (Some(r), Shape::Single) => r.chain.len() as u64,
            _ => 0,
        };
        // What the engine has to prefill before its first token: the prompt
        // less what the placement expected cached there. Only for a stream,
        // whose first body byte ends it; a whole answer's comes only after
        // its generation (0 too when the router did not read a prompt).
        let prefill = request
            .filter(|r| r.stream)
            .map_or(0, |r| r.chain.len().saturating_sub(decision.matched_bytes));
        if let (Some(shared), Some(r)) = (&self.shared, request) {
            let keys: Vec<u64> = r
                .chain
                .shared_keys(r.key.as_deref(), 0)
                .into_iter()
                .map(|(_, k)| k)
                .collect();
            shared.record(&keys, &replica.name);
        }
        if let (Some(step), Some(t)) = (step.as_mut(), ctx.trace.as_mut()) {
            step.set("replica", replica.name.clone());
            step.set("decision", decision.reason.as_str());
            step.set(
                "matched_tokens",
                (decision.matched_bytes as u64 / BYTES_PER_TOKEN) as i64,
            );
            if let Some(m) = &ctx.read.model {
                step.set("model", m.clone());
            }
            t.attempt(&replica.name);
        }
        let a = &mut ctx.attempts;
        a.evidence = request.is_some_and(|r| !r.cache_bypass);
        a.current = Some(replica.begin(cold, prefill as u64));
        a.decision = Some(decision);
        a.first.get_or_insert_with(Instant::now);
        ctx.read.placed();
        Ok(Box::new(peer))
    }

    /// A chat prompt's tokens as far as some engine may hold them (see
    /// `exact`), their bytes reserved on the request's budget (none when
    /// the budget cannot hold them: placed by the index then).
    async fn chat_tokens(&self, ctx: &mut Ctx, list: &View) -> Option<Arc<Chat>> {
        if self.exact.is_empty() || ctx.read.request().is_none() {
            return None;
        }
        let chat =
            matches!(ctx.read.route, Some(Route::Prompt(p)) if p.ends_with("chat/completions"));
        let body = ctx.read.body.clone().filter(|_| chat)?;
        let settings = self.settings.load();
        let continuity = Continuity {
            turns: std::mem::take(&mut ctx.read.turns),
            checkpoints: Arc::clone(&self.checkpoints),
            budget: settings.max_checkpoint_bytes,
        };
        let (max, model) = (settings.max_prompt_bytes, ctx.read.model.as_deref());
        let chat = (self.exact)
            .chat(&body, model, list, max, continuity)
            .await?;
        self.metrics.prompts.chat_prompt(chat.continued);
        let ticket = ctx.read.ticket.as_mut()?;
        ticket.reserve(chat.heap_bytes()).then_some(chat)
    }

    /// The replica for this attempt, the decision that chose it and whether
    /// it was chosen in panic mode; `None` when no replica is left. A replica
    /// a reload removed since `list` was read is added to the tried ones and
    /// passed over.
    fn choose(
        &self,
        ctx: &mut Ctx,
        list: &Arc<View>,
        holder: Option<ReplicaId>,
    ) -> Option<(Arc<Replica>, Decision, bool)> {
        let tried = &mut ctx.attempts.tried;
        // The holder is offered whatever `model` says: the engine answers.
        let model = ctx.read.model.as_deref().filter(|_| holder.is_none());
        let sampling = self.settings.load().sample;
        let sample = (sampling.above > 0
            && list.len() > sampling.above
            && holder.is_none()
            && ctx.read.chat.is_none()
            && self.policy.may_sample())
        .then_some(sampling.replicas);
        for _ in 0..=list.len() {
            // Only a response's holder is offered; other requests exclude
            // just the replicas tried (no copy of the list on that path).
            let others: Vec<ReplicaId>;
            let excluded = match holder {
                Some(h) => {
                    others = (tried.iter().copied())
                        .chain(list.iter().map(|r| r.id).filter(|id| *id != h))
                        .collect();
                    &others
                }
                None => &*tried,
            };
            let (mut decision, panic, at) = STATES.with_borrow_mut(|states| {
                let mut panic = false;
                // The whole set, or in a large one a sample of it and the
                // replicas holding the prompt's prefix (token-exact reports
                // and a response's holder read the whole set).
                let mut fill = |holders: &[ReplicaId], states: &mut Vec<ReplicaState>| {
                    let sampled = sample.is_some_and(|size| {
                        Replicas::sample_into(list, excluded, model, holders, size, states)
                    });
                    if !sampled {
                        panic = Replicas::states_into(list, excluded, model, holder, states);
                        if let (Some(chat), Some(r)) = (&ctx.read.chat, ctx.read.request()) {
                            exact::report(chat, r.chain.len(), list, states);
                        }
                    }
                };
                let decision = match ctx.read.request() {
                    Some(r) => self.policy.place_offered(r, move |holders| {
                        fill(holders, states);
                        states
                    }),
                    None => {
                        fill(&[], states);
                        self.policy.spread(states)
                    }
                };
                (
                    decision,
                    panic,
                    decision.replica.and_then(|id| list.position(id)),
                )
            });
            if holder.is_some() && decision.replica.is_some() {
                decision.reason = Reason::Key;
                decision.shape = Shape::Continuation;
            }
            let chosen = list.get(at?)?;
            // Still in the set (not removed by a reload since `list`).
            let Some(replica) = self.replicas.current_of(list, chosen) else {
                tried.push(chosen.id);
                continue;
            };
            return Some((replica, decision, panic));
        }
        None
    }

    /// The peer for a replica at `addr`, with the settings in force.
    fn peer(&self, addr: &SocketAddr) -> HttpPeer {
        let s = self.settings.load();
        let tls = &s.tls;
        let mut peer = HttpPeer::new(*addr, tls.enabled, tls.sni.clone());
        let o = &mut peer.options;
        o.verify_cert = tls.verify;
        o.verify_hostname = tls.verify_hostname();
        o.connection_timeout = Some(s.connect_timeout);
        o.total_connection_timeout = Some(s.connect_timeout);
        o.read_timeout = Some(s.read_timeout);
        o.write_timeout = Some(s.write_timeout);
        o.idle_timeout = Some(s.idle_timeout);
        peer
    }

    /// The error when no replica could be chosen: the response's holder is
    /// down (`held`), or no replica is live.
    fn unplaced(&self, ctx: &mut Ctx, held: bool) -> Result<Box<HttpPeer>> {
        if let (Some((id, Some(_))), true) = (&ctx.response, held) {
            ctx.error = Some(RouterError::ResponseUnavailable {
                id: id.chars().take(crate::response_ids::MAX_ID).collect(),
            });
            return Error::e_explain(ErrorType::HTTPStatus(503), "response's replica down");
        }
        self.metrics.no_replica.inc();
        ctx.error = Some(RouterError::NoReplica);
        Error::e_explain(ErrorType::HTTPStatus(503), "no live replica")
    }

    /// The replica holding response `id`. With shared pins, as Redis names
    /// it (the first instance to record an id names its holder for the
    /// fleet), kept here too; this instance's own record when Redis does not
    /// answer or names no replica of this set.
    pub(super) async fn response_holder(&self, id: &str) -> Option<ReplicaId> {
        let Some(shared) = &self.shared else {
            return self.responses.get(id);
        };
        let name = shared.response_holder(id).await;
        let list = self.replicas.snapshot();
        match name.and_then(|name| list.iter().find(|x| x.name == name)) {
            Some(r) => {
                self.responses.insert(id, r.id);
                self.metrics.response_ids.set(self.responses.len() as i64);
                Some(r.id)
            }
            None => self.responses.get(id),
        }
    }

    /// With shared pins, a prompt this instance knows nothing of is looked
    /// up in what other instances placed (within the budget).
    pub(super) async fn ask_shared(&self, ctx: &mut Ctx) {
        let (Some(shared), Some(r)) = (&self.shared, ctx.read.request_mut()) else {
            return;
        };
        if r.chain.is_empty() || self.policy.knows(r) {
            return;
        }
        let keys = r.chain.shared_keys(r.key.as_deref(), LOOKUP_ENDS);
        if let Some((pos, name)) = shared.lookup(keys).await {
            let list = self.replicas.snapshot();
            r.hint = list
                .iter()
                .find(|x| x.name == name)
                .map(|x| Hint { replica: x.id, pos });
        }
    }
}
