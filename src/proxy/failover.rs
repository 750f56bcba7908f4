//! Failed attempts: what a failure says about the replica (recorded, and
//! ejection logged and counted) and whether the request may go to another
//! one. It may only when the engine cannot have had it whole and the client
//! saw nothing: a second delivery is a second prefill and maybe a second
//! tool call.

use std::time::{Duration, Instant};

use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_proxy::Session;

use super::answer::{failed_writing_request, response_started};
use super::{Ctx, Router};
use crate::replicas::{Failure, InFlight, Replica};

/// After writing a request to a replica failed (`timeouts.write_ms`, a reset),
/// how long an answer it sent early (a 413 before reading the body) is
/// waited for before the request goes to another replica. Such an answer is
/// in the socket's buffer by the time the write fails; without this bound,
/// Pingora waited for a response as long as `timeouts.read_ms` (600 s).
pub(super) const EARLY_ANSWER_GRACE: Duration = Duration::from_secs(1);

impl Router {
    /// `fail_to_connect`: nothing reached the engine, so another replica may
    /// take the request.
    pub(super) fn connect_failed(
        &self,
        session: &Session,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(t) = ctx.trace.as_mut() {
            t.end_attempt(Some(e.to_string()));
        }
        if let Some(attempt) = ctx.attempts.current.take() {
            let r = attempt.replica();
            let failure = match e.etype() {
                ErrorType::ConnectRefused | ErrorType::ConnectNoRoute => Some(Failure::Dead),
                // The router's own trouble (no sockets, no ports): not the replica's.
                ErrorType::SocketError | ErrorType::BindError | ErrorType::InternalError => None,
                // Timeouts, TLS handshakes, anything else on the way: overload or worse.
                _ => Some(Failure::ConnectTimeout),
            };
            if let Some(failure) = failure {
                // Nothing reached the engine: not the request's doing.
                self.failed(r, failure, 0, &e);
            }
            ctx.attempts.tried.push(r.id);
            if !response_started(session) {
                r.counters.failover();
                e.set_retry(true);
            }
        }
        e
    }

    /// `error_while_proxy`: re-sent only when writing the request failed (the
    /// engine never had it whole) and nothing went to the client; a read
    /// error or timeout after the request was sent is answered 502/504.
    pub(super) fn proxy_failed(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("replica {peer}"));
        if let Some(t) = ctx.trace.as_mut() {
            t.end_attempt(Some(e.to_string()));
        }
        let writing = failed_writing_request(&e);
        if let Some(r) = ctx.attempts.current.as_ref().map(InFlight::replica) {
            // A pooled connection the engine had closed is not the engine
            // failing (it is answered, not re-sent, when the request went out).
            let stale =
                client_reused && (writing || matches!(e.etype(), ErrorType::ConnectionClosed));
            // A timeout while the client still trickles its body (paths streamed
            // unread) is the client's doing, and so is one waiting for the head
            // of a generation answered whole (a long generation): neither may
            // eject the replica. A streamed generation's head comes with its
            // first token.
            let timeout = e.etype() == &ErrorType::ReadTimedout;
            let client_slow = timeout && !session.is_body_done();
            let long_generation = timeout && ctx.read.whole_answer && !response_started(session);
            if e.esource() == &ErrorSource::Upstream && !stale && !client_slow && !long_generation {
                self.failed(r, Failure::Response, ctx.read.source, &e);
            }
            if writing && !client_reused {
                ctx.attempts.tried.push(r.id);
            }
        }
        // The body comes from ctx (or Pingora's retry buffer for paths the
        // router does not read).
        let body_kept = ctx.read.body.is_some() || !session.as_ref().retry_buffer_truncated();
        e.set_retry(writing && body_kept && !response_started(session));
        e
    }

    /// Records a failed attempt of a request from `source`; logs and counts
    /// an ejection it causes.
    pub(super) fn failed(
        &self,
        replica: &Replica,
        failure: Failure,
        source: u64,
        why: &dyn std::fmt::Display,
    ) {
        let ejected = self.replicas.on_failure(
            replica,
            failure,
            source,
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
                self.replicas.note_panic();
            }
        }
    }
}
