//! The proxy's steps other than placement, each a method the seam calls:
//! reading the prompt, Responses API holders, shared pins, the usage
//! verdict, failures and ejection, refusals, `/v1/models`, API keys.

use super::*;

impl Router {
    /// Parses the body in `ctx` into the policy's view of its prompt, its
    /// canonical text reserved on the request's ticket; `false` (nothing kept)
    /// when the budget cannot hold it. A body that is not a prompt is still
    /// forwarded, spread: the engine answers it.
    pub(super) async fn read_prompt(&self, session: &Session, ctx: &mut Ctx) -> bool {
        let (Some(body), Some(route)) = (ctx.body.clone(), ctx.routed) else {
            return true;
        };
        let key = header(session, SESSION_HEADER).map(str::to_owned);
        let s = self.settings.load();
        let checkpoints = Arc::clone(&self.checkpoints);
        let request = body::parse(body, route, &s, checkpoints, key, &self.metrics).await;
        let parsed_bytes = request.as_ref().map_or(0, |r| r.chain.heap_bytes());
        if !ctx.ticket.as_mut().is_some_and(|t| t.reserve(parsed_bytes)) {
            return false;
        }
        if let Some(r) = &request {
            ctx.model.clone_from(&r.model);
            // Looked up once per request, not again on a retry's re-read.
            if let (Some(id), None) = (&r.previous_response_id, &ctx.response) {
                ctx.response = Some((id.clone(), self.response_holder(id).await));
            }
            if route == Route::Responses && r.store {
                ctx.learn_id = Some(IdScan::default());
            }
        }
        ctx.prompt = request.map_or(Prompt::None, Prompt::Parsed);
        // A response's holder places the request alone: no pins to look up
        // (and no second wait on Redis).
        if ctx.response.is_none() {
            self.ask_shared(ctx).await;
        }
        true
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
        let (Some(shared), Some(r)) = (&self.shared, ctx.request_mut()) else {
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

    /// Counts what the engine reported reusing against what the placement
    /// predicted (responses that report no usage are left out, so the
    /// counters stay comparable), and repairs the index after a lost pin.
    pub(super) fn reported(&self, replica: &Replica, d: &Decision, u: &UsageScan) {
        let Some((cached, prompt)) = u.figures() else {
            return;
        };
        let predicted = d.matched_bytes as u64 / BYTES_PER_TOKEN;
        replica.counters.usage(d.reason, predicted, cached, prompt);
        // The verdict and the repair are about conversations: a shared prompt
        // the engine's LRU let go says nothing of what else it holds.
        if d.reason == Reason::Prefix {
            return;
        }
        let Some(outcome) = Outcome::of(predicted, cached) else {
            return;
        };
        replica.counters.outcome(outcome);
        let Some(every) = self.settings.load().repair_on_miss_s else {
            return;
        };
        // A prefix recorded moments before may still be in its first prefill.
        let old_enough = d.matched_age_s() >= every;
        if outcome == Outcome::Lost && old_enough && replica.may_repair(self.policy.clock(), every)
        {
            let forgotten = self.policy.forget_stale(d);
            if forgotten > 0 {
                self.metrics
                    .repaired(&replica.name, Repair::Miss, forgotten);
            }
        }
    }

    /// The replica's name for error bodies, unless placement is hidden.
    pub(super) fn shown(&self, replica: &Replica) -> Option<String> {
        self.settings
            .load()
            .placement_headers
            .then(|| replica.name.clone())
    }

    /// Records a failed attempt; logs and counts an ejection it causes.
    pub(super) fn failed(&self, replica: &Replica, failure: Failure, why: &dyn std::fmt::Display) {
        let ejected = self.replicas.on_failure(
            replica,
            failure,
            &self.settings.load().outlier,
            Instant::now(),
        );
        if let Some(kind) = ejected {
            log::warn!(
                "replica {} ejected ({}): {why}",
                replica.name,
                kind.as_str()
            );
            // A replica replaced meanwhile is no longer the name's.
            if self.replicas.is_current(replica) {
                self.metrics.show_live(&replica.name, replica.live());
                self.metrics.ejected(&replica.name, kind);
            }
        }
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
        ctx.ticket = None;
        session.set_keepalive(None);
        respond(session, err, &self.metrics).await?;
        let waits_for_continue =
            expects_continue(session) && session.response_written().is_none_or(|r| r.status != 100);
        if drain && !waits_for_continue {
            body::drain(session, self.drain_bytes()).await;
        }
        Ok(true)
    }

    /// The router's own answer to `GET /v1/models` (the union of the live
    /// replicas' models, in OpenAI's list format) and `GET /v1/models/{id}`,
    /// when every live replica's list is known; `None`: forward it.
    pub(super) fn models_answer(
        &self,
        path: &str,
    ) -> Option<std::result::Result<Vec<u8>, RouterError>> {
        let id = match path.strip_prefix("/v1/models") {
            Some("" | "/") => None,
            Some(rest) => Some(rest.strip_prefix('/')?),
            None => return None,
        };
        let list = self.replicas.snapshot();
        let mut models = std::collections::BTreeSet::new();
        let mut any_live = false;
        for r in list.iter().filter(|r| r.live()) {
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

    /// How much of a refused body is read and discarded at most.
    pub(super) fn drain_bytes(&self) -> usize {
        self.settings
            .load()
            .max_body_bytes
            .saturating_mul(2)
            .max(64 << 20)
    }

    /// The API key check; `true` when the client may go on.
    pub(super) fn authorised(&self, session: &Session) -> bool {
        let Some(keys) = &self.keys else {
            return true;
        };
        let h = &session.req_header().headers;
        let key = crate::auth::presented(
            h.get("authorization").map(|v| v.as_bytes()),
            h.get("x-api-key").map(|v| v.as_bytes()),
        );
        key.is_some_and(|k| keys.keys().accepts(k))
    }
}
