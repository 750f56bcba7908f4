//! The engine's answer as it passes: outlier bookkeeping (502-504), placement
//! headers and counters at its head; its first byte, the Responses API id it
//! names and its cache figures in its body, the figures counted against the
//! placement's prediction at its end (and the index repaired after a lost
//! pin).

use std::sync::Arc;

use bytes::Bytes;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use super::answer::rate_headers;
use super::{Ctx, Router, DECISION_HEADER, REPLICA_HEADER};
use crate::metrics::Repair;
use crate::paths::Route;
use crate::policy::{Decision, Reason, BYTES_PER_TOKEN};
use crate::replicas::{Failure, Replica};
use crate::usage::{Outcome, UsageScan};

impl Router {
    /// `response_filter`: the head of a routed attempt's answer.
    pub(super) fn answer_head(
        &self,
        session: &Session,
        head: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let (Some(d), Some(a)) = (&ctx.attempts.decision, &ctx.attempts.current) else {
            return Ok(());
        };
        let r = a.replica();
        // Only gateway-class answers say the replica is unwell (Envoy's
        // `consecutive_gateway_failure`): a 500 is as often the request's
        // doing (a prompt the engine cannot take) and must not let a client
        // eject replicas.
        if matches!(head.status.as_u16(), 502..=504) {
            let why = format!("answered {}", head.status);
            self.failed(r, Failure::Response, ctx.read.source, &why);
        } else if !head.status.is_server_error() {
            r.on_success();
        }
        ctx.read.answered();
        if self.settings.load().placement_headers {
            head.insert_header(REPLICA_HEADER, r.name.as_str())?;
            let reason = http::HeaderValue::from_static(d.reason.as_str());
            head.insert_header(DECISION_HEADER, reason)?;
        }
        if let Some(t) = &ctx.read.tenant {
            rate_headers(head, t.headers())?;
        }
        r.counters.routed(d.reason, d.shape);
        let model = ctx.read.model.as_deref();
        let listed = model.is_some_and(|m| self.replicas.lists(m));
        self.metrics.model_routed(model, listed, d.reason);
        self.metrics
            .upstream_header_seconds
            .observe(ctx.started.elapsed().as_secs_f64());
        let ok = head.status.is_success();
        if ok && ctx.read.route.is_some_and(Route::carries_prompt) {
            ctx.answer.usage = Some(UsageScan::default());
        } else {
            ctx.answer.learn_id = None;
        }
        if ok && session.req_header().method == http::Method::DELETE {
            if let Some((id, _)) = &ctx.response {
                self.responses.remove(id);
                self.metrics.response_ids.set(self.responses.len() as i64);
                if let Some(shared) = &self.shared {
                    shared.forget_response(id);
                }
            }
        }
        Ok(())
    }

    /// `response_body_filter`: a chunk of the answer (`end`: its last).
    pub(super) fn answer_body(&self, body: &Option<Bytes>, end: bool, ctx: &mut Ctx) {
        let (Some(a), Some(d)) = (ctx.attempts.current.as_mut(), &ctx.attempts.decision) else {
            return;
        };
        let answer = &mut ctx.answer;
        if answer.first_byte.is_none() && (end || body.as_ref().is_some_and(|b| !b.is_empty())) {
            let at = ctx.started.elapsed();
            answer.first_byte = Some(at);
            a.answered();
            a.replica().counters.first_byte(d.reason, at);
        }
        let r = a.replica();
        if let (Some(scan), Some(b)) = (answer.learn_id.as_mut(), body) {
            if let Some(id) = scan.feed(b) {
                self.responses.insert(&id, r.id);
                self.metrics.response_ids.set(self.responses.len() as i64);
                if let Some(shared) = &self.shared {
                    shared.record_response(&id, &r.name);
                }
            }
        }
        if let Some(u) = answer.usage.as_mut() {
            if let Some(b) = body {
                u.feed(b);
            }
            // Counted before the last bytes go out: a client that has read
            // the whole answer finds it in the metrics (of a replica that
            // has left the set since, once its last request ends).
            if end {
                u.finish();
                if let (Some(t), Some(p)) = (ctx.read.tenant.as_mut(), u.prompt_tokens()) {
                    t.correct(p);
                }
                // A whole answer to a prompt: the replica is serving (see
                // `replicas::health`).
                r.answered(std::time::Instant::now());
                if ctx.attempts.evidence {
                    self.reported(r, d, u, ctx.read.source);
                }
            }
        }
    }

    /// Counts what the engine reported reusing against what the placement
    /// predicted (responses that report no usage are left out, so the
    /// counters stay comparable), and repairs the index after lost pins of
    /// two sources (`source`: who sent this request, see `Read::source`).
    fn reported(&self, replica: &Replica, d: &Decision, u: &UsageScan, source: u64) {
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
        match outcome {
            Outcome::Hit => replica.pin_held(),
            Outcome::Miss => {}
            // A prefix recorded moments before may still be in its first
            // prefill; another client must corroborate (see `lost_pin`).
            Outcome::Lost if d.matched_age_s() >= every => {
                let now = self.policy.clock();
                let Some(before) = replica.lost_pin(source, d.matched_at, now, every) else {
                    return;
                };
                // A pass over the whole index (milliseconds when it is full):
                // on the blocking pool, not the thread serving requests.
                let (policy, metrics) = (Arc::clone(&self.policy), Arc::clone(&self.metrics));
                let (id, name) = (replica.id, replica.name.clone());
                tokio::task::spawn_blocking(move || {
                    let forgotten = policy.forget_before(id, before);
                    metrics.repaired(&name, Repair::Miss, forgotten);
                });
            }
            Outcome::Lost => {}
        }
    }
}
