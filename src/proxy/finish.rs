//! The end of a request: the error answered when proxying failed
//! (`fail_to_proxy`) and the access line and duration counted when it is
//! done (`logging`).

use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_proxy::{FailToProxy, Session};

use super::answer::{respond, response_started};
use super::{Ctx, Router};
use opentelemetry::KeyValue;

use crate::access_log;
use crate::body;
use crate::errors::RouterError;
use crate::replicas::Replica;

impl Router {
    /// `fail_to_proxy`: the OpenAI-style error for a failure, unless the
    /// client is gone or already saw a response.
    pub(super) async fn answer_failure(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Ctx,
    ) -> FailToProxy {
        let current = ctx.attempts.current.as_ref();
        let replica = current.and_then(|a| self.shown(a.replica()));
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

    /// `logging`: the request's duration counted and its access line written;
    /// the in-flight attempt ends here.
    pub(super) fn finish(&self, session: &Session, e: Option<&Error>, ctx: &mut Ctx) {
        let status = session
            .response_written()
            .filter(|r| !r.status.is_informational())
            .map_or(0, |r| r.status.as_u16());
        let current = ctx.attempts.current.take();
        let d = ctx.attempts.decision.as_ref();
        let first_byte = ctx.answer.first_byte;
        let duration = ctx.started.elapsed();
        if let (Some(a), Some(d), Some(_)) = (&current, d, first_byte) {
            a.replica().counters.duration(d.reason, duration);
        }
        let req = session.req_header();
        access_log::write(&access_log::Entry {
            method: req.method.as_str(),
            path: req.uri.path(),
            status,
            replica: current.as_ref().map(|a| a.replica().name.as_str()),
            decision: d.map(|d| d.reason.as_str()),
            shape: d.map(|d| d.shape.as_str()),
            matched_bytes: d.map_or(0, |d| d.matched_bytes),
            tried: ctx.attempts.tried.len(),
            first_byte,
            duration,
            error: e.map(|e| e as &dyn std::fmt::Display),
        });
        if let Some(t) = ctx.trace.take() {
            let mut attributes = Vec::new();
            let mut name = None;
            // What an unsampled span would drop is not made.
            if t.sampled() {
                if let (Some(a), Some(d)) = (&current, d) {
                    attributes.push(KeyValue::new("replica", a.replica().name.clone()));
                    attributes.push(KeyValue::new("decision", d.reason.as_str()));
                }
                name = (ctx.read.route).map(|r| format!("{} {}", req.method, r.path()));
            }
            t.end(name, status, e.map(|e| e.to_string()), attributes);
        }
        // Its place is free: the next waiter's turn.
        drop(current);
        ctx.read.pass = None;
        self.let_waiters_in();
    }

    /// The replica's name for error bodies, unless placement is hidden.
    fn shown(&self, replica: &Replica) -> Option<String> {
        self.settings
            .load()
            .placement_headers
            .then(|| replica.name.clone())
    }
}
