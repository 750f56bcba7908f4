//! A request's state through the proxy's phases: what was read, the
//! placement and its attempts, and what the answer showed.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::admission::Ticket;
use crate::errors::RouterError;
use crate::paths::Route;
use crate::policy::{Decision, ReplicaId, Request};
use crate::replicas::InFlight;
use crate::response_ids::IdScan;
use crate::usage::UsageScan;

/// Per-request state.
pub struct Ctx {
    pub(super) started: Instant,
    /// The route the request was recognised as (forwarded as its path).
    pub(super) routed: Option<Route>,
    /// Its place under `limits`, released when the request ends.
    pub(super) ticket: Option<Ticket>,
    /// The body, read whole before placement (routed paths only).
    pub(super) body: Option<Bytes>,
    /// The policy's view of the prompt (see [`Prompt`]).
    pub(super) prompt: Prompt,
    /// The body's `model`: only replicas serving it are offered.
    pub(super) model: Option<String>,
    /// A Responses API response this request needs (`previous_response_id`,
    /// `/v1/responses/{id}`), and the replica holding it when known: only
    /// that one is offered.
    pub(super) response: Option<(String, Option<ReplicaId>)>,
    /// Learn the id of the response this request produces (`store` not false).
    pub(super) learn_id: Option<IdScan>,
    pub(super) decision: Option<Decision>,
    /// The replica of the current attempt.
    pub(super) attempt: Option<InFlight>,
    /// Replicas already tried for this request.
    pub(super) tried: Vec<ReplicaId>,
    /// When the first attempt began: the response head is due within
    /// `timeouts.response_header_ms` of it, over all attempts.
    pub(super) first_attempt: Option<Instant>,
    /// An error the router answers itself.
    pub(super) error: Option<RouterError>,
    /// The cache figures of a routed request's successful response, read as
    /// its body passes.
    pub(super) usage: Option<UsageScan>,
    /// The engine was not told to skip its cache: what it reports reusing
    /// is evidence of what the replica holds.
    pub(super) evidence: bool,
    /// When the routed attempt's first response body bytes came (from `started`).
    pub(super) first_byte: Option<Duration>,
}

/// The policy's view of a request's prompt through its life.
#[derive(Debug, Default)]
pub enum Prompt {
    /// None: not a routed body, or not a prompt (placed by the counter).
    #[default]
    None,
    /// Read, and not placed yet.
    Parsed(Request),
    /// Placed: the view was dropped (it holds a canonical copy of the
    /// prompt); a retry reads it again from the body.
    Placed,
}

impl Ctx {
    /// The prompt as the policy sees it, while it is held.
    pub(super) fn request(&self) -> Option<&Request> {
        match &self.prompt {
            Prompt::Parsed(r) => Some(r),
            _ => None,
        }
    }

    pub(super) fn request_mut(&mut self) -> Option<&mut Request> {
        match &mut self.prompt {
            Prompt::Parsed(r) => Some(r),
            _ => None,
        }
    }

    /// Drops the view once it is placed; the bytes it held are returned to
    /// the request's budget.
    pub(super) fn placed(&mut self) {
        if let Prompt::Parsed(r) = std::mem::replace(&mut self.prompt, Prompt::Placed) {
            if let Some(t) = self.ticket.as_mut() {
                t.release(r.chain.heap_bytes());
            }
        } else {
            self.prompt = Prompt::None;
        }
    }

    /// A request's state when its head arrives.
    pub(super) fn new() -> Self {
        Self {
            started: Instant::now(),
            routed: None,
            ticket: None,
            body: None,
            prompt: Prompt::None,
            model: None,
            response: None,
            learn_id: None,
            decision: None,
            attempt: None,
            tried: Vec::new(),
            first_attempt: None,
            error: None,
            usage: None,
            evidence: false,
            first_byte: None,
        }
    }
}
