//! The routing policy, pure: request shape and prefix in, replica out.
//!
//! ```text
//! RULE (mode `shape`, the default)
//!   shape   = continuation  if an explicit key is given (prompt_cache_key, x-session-id)
//!                           or the prompt extends a prompt routed before (its exact end matches)
//!                           or the continuation rule holds:
//!                             model_turn     (default) an assistant / tool / function turn is present
//!                             multi_message  (the seed's literal rule) more than one message
//!             = single      otherwise
//!   single        with `singles` (default) and every replica's KV capacity declared:
//!                 -> while every live replica could hold every prompt placed within the
//!                    window beside its singles in flight (`spread_while_all_fit`): a
//!                    cold placement                                      reason `spread`
//!                 -> else the live replica holding its longest prefix, when that
//!                    prefix is at least `min_bytes` and `min_percent` of the prompt,
//!                    the replica has room for the whole prompt (see kv room: a single
//!                    may be a conversation's first turn), at most `bound` more requests
//!                    queued (sent, no body byte yet: queued or in prefill, or a whole
//!                    non-streamed answer; with `engine_load`, plus those its engine
//!                    runs beyond the router's) than the least-queued live replica,
//!                    and in flight at most twice the least loaded's plus four (else
//!                    the next such match)                                reason `prefix`
//!                 -> else a cold placement (see kv room), among the replicas within
//!                    the bounds when a held prefix was refused for load  reason `spread`
//!                    Otherwise (`singles: {by: spread}`, the seed's rule, or a replica
//!                    without a declared capacity): every single is a cold placement.
//!   continuation  -> known explicit key on a live replica                reason `key`
//!                 -> else the live replica holding the longest prefix    reason `pin`
//!                    (`fallback` when a longer match sat on a down replica)
//!                 -> else counter                                        reason `spread`
//!   kv room       (`pack` by default; needs every replica's KV capacity, else the counter)
//!                 a cold placement (a single, or a continuation with no known prefix)
//!                 goes by the counter over the live replicas with room for its prompt:
//!                 declared KV capacity less the pinned working set (blocks a
//!                 continuation recorded within the window) and the singles in flight
//!                 there (the caller counts them). All or none with room: the plain
//!                 counter (`spread`), or, when none has room but some lost it only to
//!                 singles in flight and some replica holds pinned contexts, the
//!                 one already displaced most (`pack`), so one card's contexts give way
//!                 instead of every card's, while its load is at most twice the least
//!                 loaded replica's plus two (with none pinned anywhere
//!                 there is nothing to protect: a pure burst keeps the plain counter).
//!                 A replica whose engine keeps only its last prompt (`prompt_cache: last`:
//!                 one llama.cpp slot) has room for nothing beside a pinned context until
//!                 a single runs there, then room beside that single (the caller computes
//!                 it), so a burst's singles follow each other and displace one context
//!                 per burst, not one per card.
//!   least loaded  (with `engine_load`; off by default) wherever a cold placement uses
//!                 the counter, it runs over the least-loaded of its replicas only, and
//!                 of equals over those whose engines report the least KV in use (10 %
//!                 steps, when all of them report it). Load is the router's own requests in
//!                 flight there plus those the engine last reported running or waiting
//!                 beyond them (requests the router never saw: other router instances,
//!                 clients sent straight to the engine); the room above is also at most the KV
//!                 the engine reports free (the caller computes both).
//!   queued prefill (`queued_step` bytes, 16 KiB by default; 0: off) wherever a cold
//!                 placement uses the counter, it runs over the replicas with at most a
//!                 step more prompt queued for prefill than the least queued (with
//!                 `least_loaded`: of the least loaded): bytes of prompt of the router's
//!                 streams there that have not answered yet, each less what its
//!                 placement expected cached (the caller counts them; a whole answer's
//!                 first byte comes after its generation, so it counts none), so a
//!                 question does not wait behind one replica's long prefill while
//!                 another is idle; and a single leaves its prefix's holder while more
//!                 is queued there than at the least queued replica a cold placement
//!                 may take by more than the prefix saves, plus a step.
//!   load guard    (off by default) a prefix placement whose replica has a load more
//!                 than `load_guard` above the least-loaded live replica's moves
//!                 inside that window: to the best-cached replica there, else a cold
//!                 placement among them (a cached replica first, not the least loaded:
//!                 SGLang users report losing all affinity to a shortest-queue
//!                 fallback)                                          reason `guard`
//!   shared prefix why singles go by their prefix: steady one-shot traffic (chat
//!                 front-ends, RAG, agent platforms: every conversation's first turn)
//!                 shares long per-application prompts; spread over every card, each
//!                 card must hold every such prompt, and once they outgrow one card's KV
//!                 its LRU thrashes. The bound keeps the seed's spread where it pays: a
//!                 burst's later members see the earlier ones in flight at the holder and
//!                 go to the others (a prefix held there moves with them); the share
//!                 keeps a burst of distinct documents behind a short shared system
//!                 prompt on the counter, where its cold prefill is the cost. While every
//!                 card could hold every recent prompt, spreading costs no cache and
//!                 balances the cards better, so the counter stays. The bound
//!                 counts queued requests, not requests in flight: on a batching engine
//!                 steady traffic keeps several decoding on the holder, which delay a
//!                 cached prefill little, while each miss costs a whole cold prefill.
//!   held          a replica's prefix of the prompt is what this index recorded there,
//!                 except on a replica whose engine reports its cache (KV events read, its
//!                 state known: the replica's `engine_held`, tokens turned into bytes of
//!                 text): there it is what the engine holds, and only that, but for
//!                 prefixes placed there in the last `UNREPORTED_S` (10) seconds while
//!                 requests still wait there (queued, in prefill: not reported yet).
//!                 Replicas holding a prefix alike rank least queued, then least loaded,
//!                 first.
//! MODES
//!   roundrobin    counter for everything
//!   affinity      everything by prefix: longest live match, else a rendezvous
//!                 hash of the first block over live replicas             reason `hash`
//! FLEET           (several router instances in front of the same replicas)
//!   local         (default) each instance by its own index, as above; with shared pins
//!                 (`redis`, the caller's) a prompt this index knows nothing of gets a
//!                 `hint`: the replica another instance placed an earlier prompt it
//!                 extends on, which then counts as that prompt's end here
//!   rendezvous    in `shape`, a continuation goes to the live replica ranked first by a
//!                 rendezvous hash of its conversation root (the text before its first
//!                 model turn; its explicit key; else its first block) and of each
//!                 replica's name: every instance computes the same replica, with no
//!                 shared state, and only a leaving replica's conversations move.
//!                 A continuation without a model turn hashes its first two messages.
//!                 With a load guard, the first-ranked replica within its bound.
//!                 Singles keep the counter, or with `singles` go by the same hash of
//!                 their whole prompt, which is their conversation's root if it goes
//!                 on.                                                    reason `hash`
//! PARAMETERS      PolicyConfig: mode, continuation, block_bytes, max_entries, kv_room,
//!                 load_guard, least_loaded, singles, queued_step, fleet
//! MODELS          the caller offers (as live) only the replicas serving the request's
//!                 `model`; every rule above runs within them. The counter is one per
//!                 set of replicas counted over, so one model's replicas take turns
//!                 whatever another model's traffic does in between.
//! STATE           the prefix index (capped LRU, sharded by key, a lock per shard)
//!                 and the counters; every placement is recorded, so a failover's
//!                 re-placement moves the pin with it.
//! REPAIR          the caller reports what engines say: pins whose predicted prefixes
//!                 the engine reports (almost) all gone, for two clients, forget what
//!                 that replica held from before the older prefix was last recorded
//!                 (under the engine's LRU the older is gone too; each miss itself
//!                 re-recorded its prompt), unless a prefix was recorded only moments
//!                 before (it may still be in its first prefill). One client's misses
//!                 repair nothing beyond its own prompt (the caller keeps the witnesses:
//!                 a request can make the engine render its prompt otherwise). A
//!                 replica back from a failed health check forgets
//!                 everything (a restarted engine starts empty). Later turns are then
//!                 placed on merit. It covers an engine that lost its cache between
//!                 checks. Singles placed by a shared prompt (`prefix`) never repair.
//! ```
//!
//! What each lever measured, and why its default is what it is:
//! `docs/results.md` (regenerated by `make results`).
//!
//! No I/O, no clock, no threads of its own: replica liveness and load are
//! passed in; worker threads share one `Policy` (`&self` throughout).

mod cold;
mod index;
mod known;
mod prefix;
mod rendezvous;
mod shards;
mod singles;
mod text;
mod types;
mod working;

pub use prefix::PrefixChain;
pub use singles::SinglesByPrefix;
pub use types::*;

/// Bytes of canonical prompt text per token: the estimate used everywhere
/// bytes meet tokens (close to BPE tokenizers on English and code).
pub const BYTES_PER_TOKEN: u64 = 4;

use std::borrow::Cow;
use std::collections::HashSet;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use index::IdHash;
use shards::{Shards, Upsert};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use rendezvous::rendezvous;

/// A prefix the index knows: where it ends and who served it.
#[derive(Debug, Clone, Copy)]
struct Match {
    pos: usize,
    replica: ReplicaId,
    /// An exact earlier prompt end (not only a shared block).
    end: bool,
    /// Clock of its last record.
    touched: u32,
}

/// The routing state: prefix index, counter, and the clock the caller sets.
/// Shared by every worker thread without a lock of its own: the index locks
/// one shard per operation, the counter and clock are atomics. A request's
/// lookup and its recording are separate steps, so two turns of one
/// conversation racing each other may both place as if the other had not
/// happened yet, as they would a moment apart in the other order.
#[derive(Debug)]
pub struct Policy {
    /// Swapped whole on reload ([`Policy::set_config`]).
    cfg: ArcSwap<PolicyConfig>,
    index: Shards,
    /// Spread counters, one per set of replicas (hashed; see `count`).
    counters: [AtomicU64; COUNTERS],
    clock_s: AtomicU32,
    /// Distinct prompt bytes placed recently, on all replicas together.
    recent_bytes: AtomicU64,
    /// The working set's last pass, kept while the index takes no write.
    reading: Mutex<Option<working::Reading>>,
}

/// Seconds a placement may go unreported by its engine's KV events (queued,
/// or in its prefill): the router's own record of it stands meanwhile, while
/// requests wait there.
pub const UNREPORTED_S: u32 = 10;

/// Spread counters kept (sets hashing alike share one).
const COUNTERS: usize = 1024;

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Self {
        let cfg = PolicyConfig {
            block_bytes: cfg.block_bytes.clamp(1, u16::MAX as usize),
            ..cfg
        };
        Self {
            index: Shards::new(cfg.max_entries),
            cfg: ArcSwap::from_pointee(cfg),
            counters: std::array::from_fn(|_| AtomicU64::new(0)),
            clock_s: AtomicU32::new(0),
            recent_bytes: AtomicU64::new(0),
            reading: Mutex::new(None),
        }
    }

    /// Starts every spread counter at a point drawn from `seed`: router
    /// instances in one fleet, seeded apart, do not all send their first
    /// single to the same replica.
    pub fn seed_counters(&self, seed: u64) {
        for (i, c) in self.counters.iter().enumerate() {
            c.store(xxh3_64_with_seed(&(i as u64).to_le_bytes(), seed), Relaxed);
        }
    }

    /// Sets the clock (seconds, monotonic) that stamps what is recorded next.
    pub fn set_clock(&self, now_s: u32) {
        self.clock_s.fetch_max(now_s, Relaxed);
    }

    /// The clock, as last set.
    pub fn clock(&self) -> u32 {
        self.clock_s.load(Relaxed)
    }

    /// Sets the distinct prompt bytes placed recently on all replicas
    /// together (the sum of [`Policy::working_set`]'s, which counts each
    /// block on the replica it was placed on last): what each replica would
    /// hold if singles kept spreading.
    pub fn set_recent_bytes(&self, bytes: u64) {
        self.recent_bytes.store(bytes, Relaxed);
    }

    /// The parameters in force.
    pub fn config(&self) -> PolicyConfig {
        **self.cfg.load()
    }

    /// New parameters from a reload. The index keeps its shape: its block
    /// size and cap stay as they were (they need a restart).
    pub fn set_config(&self, cfg: PolicyConfig) {
        let running = self.config();
        self.cfg.store(Arc::new(PolicyConfig {
            block_bytes: running.block_bytes,
            max_entries: running.max_entries,
            ..cfg
        }));
    }

    /// Whether this instance's index knows the prompt (an earlier prompt it
    /// extends, or its explicit key): if not, shared pins are asked.
    pub fn knows(&self, req: &Request) -> bool {
        let keyed = req
            .key
            .as_deref()
            .is_some_and(|k| self.index.get(req.chain.key_hash(k)).is_some());
        keyed || self.matches(&req.chain).iter().any(|m| m.end)
    }

    /// Entries in the prefix index.
    pub fn tracked_entries(&self) -> usize {
        self.index.len()
    }

    /// Heap bytes held by the prefix index.
    pub fn index_bytes(&self) -> usize {
        self.index.heap_bytes()
    }

    /// Places a request that has no prompt (other paths, unparsable bodies):
    /// the counter (over the least loaded, with `least_loaded`).
    pub fn spread(&self, replicas: &[ReplicaState]) -> Decision {
        let live = live_sorted(replicas);
        let replica = match self.config().mode {
            Mode::RoundRobin => self.count(&live.iter().map(|s| s.id).collect::<Vec<_>>()),
            _ => self.balance(&live, |s| s.spread),
        };
        Decision {
            replica,
            shape: Shape::Single,
            reason: reason_or_none(&live, Reason::Spread),
            matched_bytes: 0,
            matched_at: 0,
            placed_at: self.clock(),
        }
    }

    /// Places a request and records the placement (so later turns, and a
    /// re-placement after failover, see it).
    pub fn place(&self, req: &Request, replicas: &[ReplicaState]) -> Decision {
        self.place_offered(req, |_| replicas)
    }

    /// Whether a caller may offer [`Policy::place_offered`] a sample of a
    /// large fleet: not when a placement may rank every replica (a
    /// rendezvous hash: `affinity`, a rendezvous fleet) or take strict
    /// turns over all of them (`roundrobin`).
    pub fn may_sample(&self) -> bool {
        let cfg = self.config();
        cfg.mode == Mode::Shape && cfg.fleet == Fleet::Local
    }

    /// As [`Policy::place`], the replicas' states asked for once the index
    /// has named the replicas holding this prompt's prefix (or its key) that
    /// its placement may use: `offer(holders)` gives the states to choose
    /// among. A caller sampling a large fleet offers those holders and a
    /// sample of the rest, so a placement reads a bounded number of
    /// replicas whatever the fleet's size (see [`Policy::may_sample`]).
    pub fn place_offered<'s>(
        &self,
        req: &Request,
        offer: impl FnOnce(&[ReplicaId]) -> &'s [ReplicaState],
    ) -> Decision {
        if req.chain.is_empty() && req.key.is_none() {
            return self.spread(offer(&[]));
        }
        if self.config().mode == Mode::RoundRobin {
            let shape = self.shape_of(req, false);
            return Decision {
                shape,
                ..self.spread(offer(&[]))
            };
        }
        let mut matches = self.matches(&req.chain);
        if let Some(h) = req.hint.filter(|h| h.pos <= req.chain.len()) {
            if !matches.iter().any(|m| m.end) {
                // Another instance's placement: an exact earlier prompt end.
                let touched = self.clock();
                matches.push(Match {
                    pos: h.pos,
                    replica: h.replica,
                    end: true,
                    touched,
                });
                matches.sort_by_key(|m| std::cmp::Reverse(m.pos));
            }
        }
        let shape = self.shape_of(req, matches.iter().any(|m| m.end));
        let key = req.key.as_deref().map(|k| req.chain.key_hash(k));
        let root = self.rendezvous_root(req, shape);
        let keyed = key
            .filter(|_| root.is_none())
            .and_then(|k| self.index.get(k))
            .map(|e| ReplicaId(e.replica));
        // The holders a placement of this shape may use: a single's only
        // when the singles rule may take its prefix there (else it is a
        // cold placement, which a busy holder must not join).
        let cfg = self.config();
        let usable = |m: &&Match| {
            shape == Shape::Continuation
                || cfg.mode == Mode::Affinity
                || cfg.singles.is_some_and(|r| r.takes(m.pos, req.chain.len()))
        };
        let mut holders: Vec<ReplicaId> = (matches.iter().filter(usable))
            .map(|m| m.replica)
            .chain(keyed)
            .collect();
        holders.sort_unstable();
        holders.dedup();
        let live = live_sorted(offer(&holders));
        self.apply_reports(req, &live, &mut matches);
        let mut d = Decision {
            replica: None,
            shape,
            reason: Reason::NoReplica,
            matched_bytes: 0,
            matched_at: 0,
            placed_at: self.clock(),
        };
        if live.is_empty() {
            return d;
        }
        if let Some(root) = root {
            d.replica = self.by_root(root, &live);
            d.reason = Reason::Hash;
            if let Some(m) = matches.iter().find(|m| Some(m.replica) == d.replica) {
                d.matched_bytes = m.pos;
                d.matched_at = m.touched;
            }
        } else if let Some(r) = keyed.filter(|r| live.iter().any(|s| s.id == *r)) {
            d.replica = Some(r);
            d.reason = Reason::Key;
            if let Some(m) = matches.iter().find(|m| m.replica == r) {
                d.matched_bytes = m.pos;
                d.matched_at = m.touched;
            }
        } else if shape == Shape::Continuation || self.config().mode == Mode::Affinity {
            self.by_prefix(&req.chain, &matches, &live, &mut d);
            if keyed.is_some() {
                d.reason = Reason::Fallback;
            }
        } else {
            self.single(&req.chain, &matches, &live, &mut d);
        }
        if let Some(r) = d.replica {
            self.record(&req.chain, key, r, shape == Shape::Continuation);
        }
        d
    }

    /// What an engine says it holds (`engine_held`) replaces the index's
    /// guesses for its replica, but for prefixes placed there in the last
    /// [`UNREPORTED_S`] while requests wait there (queued, in prefill: not
    /// reported yet). Equal prefixes go least loaded first.
    fn apply_reports(&self, req: &Request, live: &[ReplicaState], matches: &mut Vec<Match>) {
        if live.iter().all(|s| s.engine_held.is_none()) {
            return;
        }
        let now = self.clock();
        let state = |r: ReplicaId| live.iter().find(|s| s.id == r);
        let guess_stands = |m: &Match| {
            state(m.replica).is_none_or(|s| {
                s.engine_held.is_none()
                    || (s.waiting > 0 && m.touched.saturating_add(UNREPORTED_S) >= now)
            })
        };
        matches.retain(guess_stands);
        for s in live {
            if let Some(pos) = s.engine_held.filter(|p| *p > 0) {
                matches.push(Match {
                    pos: pos.min(req.chain.len()),
                    replica: s.id,
                    end: false,
                    touched: now,
                });
            }
        }
        // Engines holding a prefix alike (a shared prompt on several
        // cards): the least loaded first, not always the same card.
        let load = |m: &Match| state(m.replica).map_or((0, 0), |s| (s.queued(), s.load()));
        matches.sort_by_key(|m| (std::cmp::Reverse(m.pos), load(m)));
    }

    /// Drops everything the index holds for a replica (it left the set, or
    /// came back with an empty cache); returns the entries dropped. A pass
    /// over the index as [`Policy::working_set`]'s: milliseconds when it is
    /// full, so not on a request's thread.
    pub fn forget_replica(&self, id: ReplicaId) -> usize {
        self.index.forget(|r, _| r == id.0)
    }

    /// As [`Policy::forget_replica`] for several replicas (those a reload
    /// removed), in one pass.
    pub fn forget_replicas(&self, ids: &[ReplicaId]) -> usize {
        let ids: HashSet<u32, BuildHasherDefault<IdHash>> = ids.iter().map(|id| id.0).collect();
        self.index.forget(|r, _| ids.contains(&r))
    }

    /// The engines reported prefixes of `id` (almost) all gone, the older
    /// recorded at clock second `before_s`: drops what the replica held from
    /// before it (see REPAIR); returns the entries dropped.
    pub fn forget_before(&self, id: ReplicaId, before_s: u32) -> usize {
        self.index
            .forget(|r, touched| r == id.0 && touched < before_s)
    }

    fn shape_of(&self, req: &Request, extends: bool) -> Shape {
        let rule = match self.config().continuation {
            ContinuationRule::ModelTurn => req.model_turn,
            ContinuationRule::MultiMessage => req.messages > 1,
        };
        if rule || extends || req.key.is_some() {
            Shape::Continuation
        } else {
            Shape::Single
        }
    }

    /// Prefix placement: the longest live match (guarded), else the counter
    /// (`shape`) or a rendezvous hash (`affinity`).
    fn by_prefix(
        &self,
        chain: &PrefixChain,
        matches: &[Match],
        live: &[ReplicaState],
        d: &mut Decision,
    ) {
        let (head, bytes) = (chain.head_hash(), chain.len());
        let first_live = matches
            .iter()
            .position(|m| live.iter().any(|s| s.id == m.replica));
        let Some(i) = first_live else {
            if self.config().mode == Mode::Affinity {
                d.replica = rendezvous(head, live);
                d.reason = Reason::Hash;
            } else {
                d.replica = self.cold(live, |_| true, bytes);
                d.reason = Reason::Spread;
            }
            if !matches.is_empty() {
                d.reason = Reason::Fallback;
            }
            return;
        };
        let mut chosen = matches[i];
        d.reason = if i == 0 {
            Reason::Pin
        } else {
            Reason::Fallback
        };
        if let Some(limit) = self.config().load_guard {
            let floor = live.iter().map(ReplicaState::load).min().unwrap_or(0);
            let within = |s: &ReplicaState| s.load() <= floor.saturating_add(limit);
            let state = |r: ReplicaId| live.iter().find(|s| s.id == r);
            if !state(chosen.replica).is_none_or(within) {
                d.reason = Reason::Guard;
                let next = matches[i..]
                    .iter()
                    .find(|m| m.replica != chosen.replica && state(m.replica).is_some_and(within));
                match next {
                    Some(m) => chosen = *m,
                    None => {
                        // Nothing cached within the window: a cold placement there.
                        d.replica = self.cold(live, within, chain.len());
                        return;
                    }
                }
            }
        }
        d.replica = Some(chosen.replica);
        d.matched_bytes = chosen.pos;
        d.matched_at = chosen.touched;
    }
}

/// The live replicas in id order: `replicas` itself when all are live and
/// in that order (the caller's usual case), else a copy.
fn live_sorted(replicas: &[ReplicaState]) -> Cow<'_, [ReplicaState]> {
    let in_order = |(a, b): (&ReplicaState, &ReplicaState)| b.live && a.id < b.id;
    let first_live = replicas.first().is_none_or(|r| r.live);
    if first_live && replicas.iter().zip(replicas.iter().skip(1)).all(in_order) {
        return Cow::Borrowed(replicas);
    }
    let mut live: Vec<ReplicaState> = replicas.iter().filter(|r| r.live).copied().collect();
    live.sort_by_key(|r| r.id);
    Cow::Owned(live)
}

fn reason_or_none(live: &[ReplicaState], reason: Reason) -> Reason {
    if live.is_empty() {
        Reason::NoReplica
    } else {
        reason
    }
}

#[cfg(test)]
mod tests;
