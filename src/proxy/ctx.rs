//! A request's state through the proxy's phases, one part per phase: what
//! was read ([`Read`]), the attempts to place it ([`Attempts`]) and what its
//! answer showed ([`Answer`]). Each part is written in its phase and only
//! read after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::admission::{Arrival, Ticket};
use crate::errors::RouterError;
use crate::exact::Chat;
use crate::paths::Route;
use crate::policy::{Decision, ReplicaId, Request};
use crate::replicas::InFlight;
use crate::request::Turns;
use crate::response_ids::IdScan;
use crate::tenants::queue::Pass;
use crate::tenants::Admitted;
use crate::traces::RequestTrace;
use crate::usage::UsageScan;

/// Per-request state.
pub struct Ctx {
    pub(super) started: Instant,
    /// Received: written by `request_filter`.
    pub(super) read: Read,
    /// A Responses API response this request needs (`previous_response_id`,
    /// `/v1/responses/{id}` of any method), and the replica holding it when
    /// known: only that one is offered.
    pub(super) response: Option<(String, Option<ReplicaId>)>,
    /// Placed: written by `upstream_peer` and the failure hooks.
    pub(super) attempts: Attempts,
    /// Streaming: written as the answer passes.
    pub(super) answer: Answer,
    /// An error the router answers itself.
    pub(super) error: Option<RouterError>,
    /// Its spans, when `traces` is set.
    pub(super) trace: Option<Box<RequestTrace>>,
}

/// What the request brought, read before it is placed.
#[derive(Default)]
pub struct Read {
    /// Counted in progress (and against its client address) until it ends.
    pub(super) arrival: Option<Arrival>,
    /// Counted against its tenant's limits (with `tenants`) until it ends.
    pub(super) tenant: Option<Admitted>,
    /// Let through by the queue (`queue`): counted in its tenant's share
    /// until it ends.
    pub(super) pass: Option<Pass>,
    /// The route the request was recognised as (forwarded as its path).
    pub(super) route: Option<Route>,
    /// Its body bytes under `limits`, and its slot once placed; released
    /// when the request ends.
    pub(super) ticket: Option<Ticket>,
    /// The body, read whole before placement (routed paths only); dropped
    /// when a response arrives (nothing is re-sent after that).
    pub(super) body: Option<Bytes>,
    /// The policy's view of the prompt (see [`Prompt`]).
    pub(super) prompt: Prompt,
    /// The body's `model`: only replicas serving it are offered.
    pub(super) model: Option<String>,
    /// A chat prompt's tokens, when some engine's KV state is known (see
    /// `exact`); read with the prompt, dropped with it once placed.
    pub(super) chat: Option<Arc<Chat>>,
    /// The checkpoints its body was read from and left (see
    /// `request::Turn`): a chat turn's tokens continue from the one and are
    /// kept with the other. Dropped with the prompt.
    pub(super) turns: Turns,
    /// A generation answered whole (no `stream: true`): its head comes at
    /// the end of the generation, so waiting for it long is no fault of the
    /// replica's.
    pub(super) whole_answer: bool,
    /// Who sent it, as a hash: its API key when keys are checked, else its
    /// client address (a lost pin repairs others' only when two agree).
    pub(super) source: u64,
}

/// The attempts to place the request: the current one and those before it.
#[derive(Default)]
pub struct Attempts {
    /// The decision of the latest attempt.
    pub(super) decision: Option<Decision>,
    /// The replica of the current attempt, counted in flight while held.
    pub(super) current: Option<InFlight>,
    /// The engine was not told to skip its cache: what it reports reusing
    /// is evidence of what the replica holds.
    pub(super) evidence: bool,
    /// Replicas already tried for this request.
    pub(super) tried: Vec<ReplicaId>,
    /// When the first attempt began: the response head is due within
    /// `timeouts.response_header_ms` of it, over all attempts.
    pub(super) first: Option<Instant>,
}

/// What the answer is read for as it passes, and what it showed.
#[derive(Default)]
pub struct Answer {
    /// Learn the id of the response this request produces (`store` not false).
    pub(super) learn_id: Option<IdScan>,
    /// The cache figures of a routed request's successful response.
    pub(super) usage: Option<UsageScan>,
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

impl Read {
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
        self.turns = Turns::default();
        if let Some(p) = self.pass.as_mut() {
            p.placed();
        }
        if let Prompt::Parsed(r) = std::mem::replace(&mut self.prompt, Prompt::Placed) {
            let chat = self.chat.take().map_or(0, |c| c.heap_bytes());
            if let Some(t) = self.ticket.as_mut() {
                t.release(r.chain.heap_bytes() + chat);
            }
        } else {
            self.prompt = Prompt::None;
        }
    }

    /// Nothing is re-sent once a response arrived: drops the body and the
    /// prompt and returns their bytes to the budget.
    pub(super) fn answered(&mut self) {
        self.body = None;
        self.prompt = Prompt::None;
        self.turns = Turns::default();
        if let Some(t) = self.ticket.as_mut() {
            t.release_bytes();
        }
    }
}

impl Ctx {
    /// A request's state when its head arrives.
    pub(super) fn new() -> Self {
        Self {
            started: Instant::now(),
            read: Read::default(),
            response: None,
            attempts: Attempts::default(),
            answer: Answer::default(),
            error: None,
            trace: None,
        }
    }
}
