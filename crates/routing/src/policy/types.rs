//! The policy's vocabulary: its parameters, the replica and request views
//! it is given, and the decision it returns.

use super::{PrefixChain, SinglesByPrefix};

/// Which rule places requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Pin continuations, spread singles (the product's rule).
    Shape,
    /// Counter for everything (comparison arm).
    RoundRobin,
    /// Prefix for everything (comparison arm).
    Affinity,
}

/// Which requests count as continuations on their own (without a prefix match).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContinuationRule {
    /// An earlier model turn is present: an assistant message or a tool result.
    ModelTurn,
    /// More than one message (the seed's literal rule; pins shared-system-prompt one-shots).
    MultiMessage,
}

/// How cold placements use KV headroom (see `kv room` above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRoom {
    /// The plain counter.
    Off,
    /// Counter over replicas with room; all or none: plain counter.
    Spread,
    /// As `Spread`, but overflow goes to the replica already displaced most.
    Pack,
}

/// Policy parameters; defaults live in the config module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    pub mode: Mode,
    pub continuation: ContinuationRule,
    /// Block size of the prefix hash chain, 1..=65535 bytes.
    pub block_bytes: usize,
    /// Cap on prefix index entries (blocks plus prompt ends plus explicit keys).
    pub max_entries: usize,
    pub kv_room: KvRoom,
    /// Load excess over the least-loaded live replica that moves a pinned
    /// request within that window (see `load guard`); `None` disables it.
    pub load_guard: Option<u32>,
    /// Cold placements go to the least-loaded live replicas (see `load`),
    /// the counter only among equals; off: the counter over all.
    pub least_loaded: bool,
    /// Singles by their held prefix (see `single`); `None`: every single
    /// is a cold placement (the seed's rule).
    pub singles: Option<SinglesByPrefix>,
    /// Replicas with at most this many bytes more prompt queued for prefill
    /// than the least queued count as least queued (see `queued prefill`);
    /// 0: not compared.
    pub queued_step: usize,
    /// How router instances sharing the replicas agree (see FLEET).
    pub fleet: Fleet,
}

/// How several router instances in front of the same replicas agree on
/// where a conversation lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fleet {
    /// Each instance by what it has seen (its own index).
    #[default]
    Local,
    /// Continuations by a rendezvous hash of their conversation root, which
    /// every instance computes alike; singles too when `singles`.
    Rendezvous { singles: bool },
}

/// A replica as the policy sees it; the id is stable across reloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplicaId(pub u32);

/// Liveness and load of one replica at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaState {
    pub id: ReplicaId,
    /// A hash of the replica's name: the same in every router instance, so
    /// rendezvous hashing agrees between them (ids are per instance).
    pub name_hash: u64,
    pub live: bool,
    /// Requests the router has in flight there.
    pub in_flight: u32,
    /// Of those, the ones that have not answered a body byte yet (queued,
    /// or in their prefill).
    pub waiting: u32,
    /// Bytes of prompt those waiting requests have yet to prefill there:
    /// each one's canonical prompt less what its placement expected cached
    /// (streams only: a whole answer's first byte ends no prefill).
    pub queued_bytes: u64,
    /// What the engine itself last reported, when it is read.
    pub engine: Option<EngineLoad>,
    /// KV headroom in bytes of canonical prompt, when its capacity is declared.
    pub room: Option<Room>,
    /// What its engine reports holding of this request's prompt (its KV
    /// events read, its state known), in bytes of canonical text; it
    /// replaces the index's guess. `None`: not reported.
    pub engine_held: Option<usize>,
    /// A cold placement (the counter) may choose it; false for a replica
    /// offered only as the holder of the request's prefix (a sample of a
    /// large fleet offers a busy holder for its prefix, not for a cold
    /// placement).
    pub spread: bool,
}

impl ReplicaState {
    /// Requests at the replica: the router's own, plus those its engine
    /// last reported beyond them (traffic the router does not see: other
    /// router instances, clients sent straight to the engine).
    pub fn load(&self) -> u32 {
        self.in_flight
            .saturating_add(self.engine.map_or(0, |e| e.unseen))
    }

    /// Requests queued before a new one's prefill: the router's that have not
    /// started answering, plus those its engine reported beyond the router's
    /// (running or waiting: the report does not tell them apart).
    pub fn queued(&self) -> u32 {
        self.waiting
            .saturating_add(self.engine.map_or(0, |e| e.unseen))
    }
}

/// A replica's load as its engine reports it (its `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLoad {
    /// Requests running or waiting there that the router did not send (its
    /// count less the router's own in flight when it was read).
    pub unseen: u32,
    /// KV cache in use by running requests, per mille, when the engine says.
    pub kv_used_permille: Option<u16>,
}

/// What a replica's KV cache can still take without displacing the contexts
/// pinned to it, in bytes of canonical prompt text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Capacity less the pinned working set and the singles in flight
    /// (negative: those singles displace pinned contexts now).
    pub free: i64,
    /// Bytes of the singles' prompts in flight there.
    pub cold: u64,
    /// Bytes of its pinned working set.
    pub pinned: u64,
    /// Bytes of prompt its KV holds for reuse beside what runs (0 for an
    /// engine that keeps only its last prompt).
    pub capacity: u64,
}

/// The pinned and the whole working set of one replica, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkingSet {
    /// Distinct blocks placed within the window.
    pub all: u64,
    /// Of which a continuation recorded last (contexts expected back).
    pub pinned: u64,
}

/// What the policy needs of a request: its prefix chain and shape signals.
#[derive(Debug, Clone)]
pub struct Request {
    pub chain: PrefixChain,
    /// An assistant / tool / function turn is present.
    pub model_turn: bool,
    /// Where its conversation's root ends in the text: the messages before
    /// its first model turn (none without a model turn).
    pub root_end: Option<usize>,
    /// A prefix of it that another router instance placed (shared pins),
    /// used when this instance's own index knows nothing of the prompt.
    pub hint: Option<Hint>,
    /// Number of messages (1 for a completions prompt).
    pub messages: usize,
    /// Explicit conversation key (`prompt_cache_key`, then `x-session-id`).
    pub key: Option<String>,
    /// The request tells the engine not to reuse its prefix cache: its
    /// placement is as usual, but its reported reuse is no evidence.
    pub cache_bypass: bool,
    /// The body's `model`: the caller offers only replicas serving it.
    pub model: Option<String>,
    /// Responses API, for the caller: the response this request continues
    /// (the caller offers only the replica holding it), and whether the
    /// engine keeps this one (`store`).
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// For the caller: the answer streams as it is generated (`stream:
    /// true`); else it comes whole, at the end of the generation.
    pub stream: bool,
}

/// A placement another router instance recorded: the replica that holds the
/// first `pos` bytes of the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    pub replica: ReplicaId,
    pub pos: usize,
}

/// The request's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Continuation,
    Single,
}

/// Why a replica was chosen; `as_str` is the header and metric label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The live replica holding the longest matching prefix.
    Pin,
    /// The counter (singles, unmatched continuations, roundrobin mode).
    Spread,
    /// A single on the live replica holding most of its prompt (see `single`).
    Prefix,
    /// The replica that served this explicit conversation key.
    Key,
    /// The replica holding a longer prefix is down; placed on the best live one.
    Fallback,
    /// The load guard moved the request off an overloaded cached replica.
    Guard,
    /// A rendezvous hash: of the first block (affinity mode, no match), or
    /// of the conversation root (`fleet: rendezvous`).
    Hash,
    /// No replica is live.
    NoReplica,
}

impl Reason {
    /// Every reason, for pre-registering metric labels.
    pub const ALL: [Reason; 8] = [
        Reason::Pin,
        Reason::Spread,
        Reason::Prefix,
        Reason::Key,
        Reason::Fallback,
        Reason::Guard,
        Reason::Hash,
        Reason::NoReplica,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Pin => "pin",
            Reason::Spread => "spread",
            Reason::Prefix => "prefix",
            Reason::Key => "key",
            Reason::Fallback => "fallback",
            Reason::Guard => "guard",
            Reason::Hash => "hash",
            Reason::NoReplica => "none",
        }
    }
}

impl Shape {
    pub fn as_str(self) -> &'static str {
        match self {
            Shape::Continuation => "continuation",
            Shape::Single => "single",
        }
    }
}

/// One placement and its explanation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// `None` when no replica is live.
    pub replica: Option<ReplicaId>,
    pub shape: Shape,
    pub reason: Reason,
    /// Bytes of canonical prompt already seen on the chosen replica.
    pub matched_bytes: usize,
    /// Clock (seconds) at which that prefix was last recorded (0 without one).
    pub matched_at: u32,
    /// Clock (seconds) of this placement.
    pub placed_at: u32,
}

impl Decision {
    /// Seconds between the matched prefix's last record and this placement.
    pub fn matched_age_s(&self) -> u32 {
        self.placed_at.saturating_sub(self.matched_at)
    }
}
