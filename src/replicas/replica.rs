//! One replica as the router sees it: identity, health and ejection
//! state, in-flight counts, what its engine last reported, and the
//! [`ReplicaState`] the policy reads. All atomics on the path of a request
//! that succeeds; a lock only for an ejection or a lost pin's witness.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwapOption;

use crate::config::{self, PromptCache};
use crate::kv::EngineBlocks;
use crate::metrics::ReplicaCounters;
use crate::policy::{EngineLoad, ReplicaId, ReplicaState, Room, BYTES_PER_TOKEN};

/// Passing health checks in a row between two reads of a replica's
/// `/v1/models`, and between two checks on a new connection rather than the
/// kept one (10 s at the default interval: a fleet of a thousand replicas is
/// not asked for a thousand model lists and handshakes a second).
pub const RECHECK_EVERY: u32 = 10;

/// Seconds a lost pin waits for another client's to corroborate it.
pub const WITNESS_S: u32 = 300;

/// A lost pin: who sent it, when its prefix was recorded, when it was seen.
#[derive(Debug, Clone, Copy)]
struct Witness {
    source: u64,
    matched_at: u32,
    at_s: u32,
}

/// One replica. The fields a placement reads of every replica come first,
/// in one cache line (`repr(C)` keeps the order, the alignment the line):
/// a placement over a thousand replicas reads a thousand of them.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Replica {
    pub id: ReplicaId,
    /// KV capacity in tokens (at most `u32::MAX`); 0 when not declared.
    /// Reloadable.
    pub(super) kv_tokens: AtomicU32,
    /// Its name hashed alike in every router instance (rendezvous hashing).
    pub(super) name_hash: u64,
    /// Pinned working set, bytes (the capacity watch refreshes it).
    pub(super) pinned_bytes: AtomicU64,
    /// Canonical bytes of the singles' prompts in flight.
    pub(super) cold_bytes: AtomicU64,
    /// Bytes of prompt the `waiting` requests have yet to prefill there.
    pub(super) queued_bytes: AtomicU64,
    /// Requests the router has in flight there.
    pub(super) in_flight: AtomicU32,
    /// Of those, the ones that have not answered a body byte yet: queued or
    /// in their prefill at the engine.
    pub(super) waiting: AtomicU32,
    /// Requests the engine last reported beyond the router's own, and KV
    /// use per mille; `UNKNOWN` while not read (or reads keep failing).
    pub(super) engine_unseen: AtomicU32,
    pub(super) engine_kv_permille: AtomicU32,
    /// Up by the active checks (see `health`): false until they bring it up.
    pub(super) checked: AtomicBool,
    /// Ejected by the request path; see the module header.
    pub(super) ejected: AtomicBool,
    /// Its engine keeps only its last prompt (`prompt_cache: last`). Reloadable.
    pub(super) last_prompt: AtomicBool,
    /// Drained through the admin API: offered no request, health checked
    /// as before. Kept across reloads, as the rest of its state.
    pub(super) drained: AtomicBool,
    pub name: String,
    pub addr: SocketAddr,
    /// The models it serves; `None`: unknown, any model.
    pub(super) models: ArcSwapOption<Vec<String>>,
    /// `models` comes from the config (else from the replica's /v1/models).
    pub(super) declared_models: AtomicBool,
    /// Where its engine's KV events come from. Reloadable.
    pub(super) kv_events: ArcSwapOption<config::KvEvents>,
    /// The API key its engine takes (`api_key_file`). Reloadable.
    api_key: ArcSwapOption<config::Secret>,
    /// Its engine answered the router's own model-list read 401 or 403.
    key_refused: AtomicBool,
    /// What its engine holds, as its events say, while they are followed.
    pub(super) engine_blocks: ArcSwapOption<Mutex<EngineBlocks>>,
    /// Checks failed in a row (counted ones) and passed in a row.
    pub(super) checks_failed: AtomicU32,
    pub(super) checks_passed: AtomicU32,
    /// Health-check rounds that came to it (checked or, past the probes'
    /// budget, not).
    pub(super) check_rounds: AtomicU32,
    /// The checks have brought it up at least once since it joined.
    pub(super) up_once: AtomicBool,
    /// When it joined; `answered_ms` is counted from here.
    pub(super) joined: Instant,
    /// Milliseconds after `joined` of its last whole successful answer to a
    /// prompt (a 2xx body to its end), plus one; 0: none yet.
    pub(super) answered_ms: AtomicU64,
    /// The checks have decided: it came up, or a check failed (the
    /// readiness gate waits for it).
    pub(super) judged: AtomicBool,
    /// A health check failed other than by timing out since the last pass:
    /// the engine went away (a busy one times out instead).
    pub(super) went_away: AtomicBool,
    /// Clock (seconds) of the last index repair after a lost pin; MAX: none.
    pub(super) last_repair: AtomicU32,
    /// A lost pin waiting for another client's to corroborate it.
    witness: Mutex<Option<Witness>>,
    /// The source (client) whose failed request ejected it; 0: none.
    pub(super) ejected_by: AtomicU64,
    /// Failures in a row (timeouts, 5xx) since the last success.
    pub(super) consecutive: AtomicU32,
    /// Outlier ejections in a row, and the end of the current one.
    pub(super) ejection: Mutex<(u32, Option<Instant>)>,
    pub counters: ReplicaCounters,
}

// The placement's fields stay in the first cache line.
const _: () = assert!(std::mem::offset_of!(Replica, drained) < 64);

/// What the engine figures hold while none is known.
pub(super) const UNKNOWN: u32 = u32::MAX;

/// A declared KV capacity as kept (0: not declared).
fn tokens(kv_tokens: Option<u64>) -> u32 {
    kv_tokens.map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX))
}

impl Replica {
    /// A replica joining the set: not live until its first health check.
    pub(super) fn new(
        id: ReplicaId,
        c: &config::Replica,
        addr: SocketAddr,
        counters: ReplicaCounters,
    ) -> Self {
        Self {
            id,
            name: c.name.clone(),
            name_hash: xxhash_rust::xxh3::xxh3_64(c.name.as_bytes()),
            addr,
            kv_tokens: AtomicU32::new(tokens(c.kv_tokens)),
            last_prompt: AtomicBool::new(c.prompt_cache == PromptCache::Last),
            drained: AtomicBool::new(false),
            models: ArcSwapOption::new(c.models.clone().map(Arc::new)),
            declared_models: AtomicBool::new(c.models.is_some()),
            kv_events: ArcSwapOption::new(c.kv_events.clone().map(Arc::new)),
            api_key: ArcSwapOption::new(c.api_key.clone().map(Arc::new)),
            key_refused: AtomicBool::new(false),
            engine_blocks: ArcSwapOption::empty(),
            in_flight: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            pinned_bytes: AtomicU64::new(0),
            cold_bytes: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            engine_unseen: AtomicU32::new(UNKNOWN),
            engine_kv_permille: AtomicU32::new(UNKNOWN),
            checked: AtomicBool::new(false),
            checks_failed: AtomicU32::new(0),
            checks_passed: AtomicU32::new(0),
            check_rounds: AtomicU32::new(0),
            up_once: AtomicBool::new(false),
            joined: Instant::now(),
            answered_ms: AtomicU64::new(0),
            judged: AtomicBool::new(false),
            went_away: AtomicBool::new(false),
            last_repair: AtomicU32::new(u32::MAX),
            witness: Mutex::new(None),
            ejected: AtomicBool::new(false),
            ejected_by: AtomicU64::new(0),
            consecutive: AtomicU32::new(0),
            ejection: Mutex::new((0, None)),
            counters,
        }
    }

    /// Takes a reload's settings for a replica kept across it.
    /// This replica under the name `c` gives it (a rename in the config, same
    /// address): the same id, so the index's pins stay, and the same health,
    /// ejection and engine figures; counters start under the new name.
    /// Requests in flight finish on the old entry's counts.
    pub(super) fn renamed(&self, c: &config::Replica, counters: ReplicaCounters) -> Self {
        let r = Self {
            joined: self.joined,
            ..Self::new(self.id, c, self.addr, counters)
        };
        let flags = [
            (&r.checked, &self.checked),
            (&r.up_once, &self.up_once),
            (&r.judged, &self.judged),
            (&r.went_away, &self.went_away),
            (&r.ejected, &self.ejected),
            (&r.drained, &self.drained),
        ];
        for (to, from) in flags {
            to.store(from.load(Relaxed), Relaxed);
        }
        let counts = [
            (&r.checks_failed, &self.checks_failed),
            (&r.checks_passed, &self.checks_passed),
            (&r.check_rounds, &self.check_rounds),
            (&r.consecutive, &self.consecutive),
            (&r.engine_unseen, &self.engine_unseen),
            (&r.engine_kv_permille, &self.engine_kv_permille),
            (&r.last_repair, &self.last_repair),
        ];
        for (to, from) in counts {
            to.store(from.load(Relaxed), Relaxed);
        }
        for (to, from) in [
            (&r.answered_ms, &self.answered_ms),
            (&r.ejected_by, &self.ejected_by),
            (&r.pinned_bytes, &self.pinned_bytes),
        ] {
            to.store(from.load(Relaxed), Relaxed);
        }
        if c.models.is_none() {
            r.models.store(self.models.load_full());
        }
        let ejection = *self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        *r.ejection.lock().unwrap_or_else(|p| p.into_inner()) = ejection;
        r
    }

    pub(super) fn reconfigure(&self, c: &config::Replica) {
        self.kv_tokens.store(tokens(c.kv_tokens), Relaxed);
        self.last_prompt
            .store(c.prompt_cache == PromptCache::Last, Relaxed);
        self.declare_models(&c.models);
        if self.kv_events.load().as_deref() != c.kv_events.as_ref() {
            self.kv_events.store(c.kv_events.clone().map(Arc::new));
        }
        if self.api_key.load().as_deref() != c.api_key.as_ref() {
            self.api_key.store(c.api_key.clone().map(Arc::new));
        }
    }

    /// The API key its engine takes, when configured.
    pub fn api_key(&self) -> Option<Arc<config::Secret>> {
        self.api_key.load_full()
    }

    /// Its engine refuses the router's key (or the lack of one).
    pub fn key_refused(&self) -> bool {
        self.key_refused.load(Relaxed)
    }

    /// Records whether its engine refused the router's model-list read;
    /// whether that changed.
    pub fn set_key_refused(&self, refused: bool) -> bool {
        self.key_refused.swap(refused, Relaxed) != refused
    }

    /// Where its engine's KV events come from, if configured.
    pub fn kv_events(&self) -> Option<Arc<config::KvEvents>> {
        self.kv_events.load_full()
    }

    /// What its engine holds, while its KV events are followed.
    pub fn engine_blocks(&self) -> Option<Arc<Mutex<EngineBlocks>>> {
        self.engine_blocks.load_full()
    }

    /// Starts (`Some`) or stops (`None`) following its engine's blocks.
    pub fn follow_blocks(&self, blocks: Option<Arc<Mutex<EngineBlocks>>>) {
        self.engine_blocks.store(blocks);
    }

    /// Live: up by its health checks and not ejected.
    pub fn live(&self) -> bool {
        self.checked.load(Relaxed) && !self.ejected.load(Relaxed)
    }

    /// Drained through the admin API: no request is placed there.
    pub fn drained(&self) -> bool {
        self.drained.load(Relaxed)
    }

    /// Up by its health checks (ejected or not).
    pub fn checked(&self) -> bool {
        self.checked.load(Relaxed)
    }

    /// Its models come from the config, not its `/v1/models`.
    pub fn declares_models(&self) -> bool {
        self.declared_models.load(Relaxed)
    }

    /// The models it serves, when known.
    pub fn models(&self) -> Option<Arc<Vec<String>>> {
        self.models.load_full()
    }

    /// Whether a passing health check reads its `/v1/models` again: on the
    /// first pass in a row, while none is known, and every [`RECHECK_EVERY`]
    /// passes after (an engine may load a model, such as a LoRA adapter,
    /// while up). Read before the pass is counted.
    pub fn models_due(&self) -> bool {
        self.models.load().is_none() || self.nth_pass()
    }

    /// Whether its next health check goes on a new connection: while it is
    /// not live (down, or ejected by the request path: a kept connection
    /// could pass while new ones are refused), and on the first of every
    /// [`RECHECK_EVERY`] passes in a row.
    pub fn fresh_check_due(&self) -> bool {
        !self.live() || self.nth_pass()
    }

    fn nth_pass(&self) -> bool {
        self.checks_passed
            .load(Relaxed)
            .is_multiple_of(RECHECK_EVERY)
    }

    /// Takes the list its `/v1/models` gave, unless the config declares its
    /// models; an empty list counts as unknown. Returns whether it changed.
    pub fn learn_models(&self, list: Vec<String>) -> bool {
        if self.declared_models.load(Relaxed) {
            return false;
        }
        let next = Some(list).filter(|l| !l.is_empty());
        if self.models.load().as_deref() == next.as_ref() {
            return false;
        }
        self.models.store(next.map(Arc::new));
        true
    }

    pub(super) fn declare_models(&self, declared: &Option<Vec<String>>) {
        let was = self.declared_models.swap(declared.is_some(), Relaxed);
        if declared.is_some() || was {
            self.models.store(declared.clone().map(Arc::new));
        }
    }

    /// A health check has run since the replica joined, passed or not.
    pub fn has_been_checked(&self) -> bool {
        self.judged.load(Relaxed)
    }

    pub(super) fn is_ejected(&self) -> bool {
        self.ejected.load(Relaxed)
    }

    /// A response below 500 arrived: the failure streak ends.
    pub fn on_success(&self) {
        if self.consecutive.load(Relaxed) != 0 {
            self.consecutive.store(0, Relaxed);
        }
        // Under the lock, so an ejection landing now keeps its count.
        if let Ok(mut e) = self.ejection.try_lock() {
            if !self.is_ejected() {
                e.0 = 0;
            }
        }
    }

    /// Declared KV capacity in tokens.
    pub fn kv_tokens(&self) -> Option<u64> {
        Some(u64::from(self.kv_tokens.load(Relaxed))).filter(|t| *t > 0)
    }

    /// Bytes of prompt its requests not answering yet have to prefill.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Relaxed)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Its health as the admin API names it: `up` (live), `ejected` (by
    /// the request path, its checks passing) or `down` (by its checks).
    pub fn health(&self) -> &'static str {
        match (self.checked(), self.is_ejected()) {
            (true, false) => "up",
            (true, true) => "ejected",
            (false, _) => "down",
        }
    }

    /// The pinned working set's estimate, bytes of canonical prompt.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes.load(Relaxed)
    }

    /// Whether a health check result shows the engine back after it went
    /// away (a failure other than a timeout, then this pass): it restarted,
    /// and its cache is empty.
    pub fn came_back(&self, passed: bool, timed_out: bool) -> bool {
        if passed {
            self.went_away.swap(false, Relaxed)
        } else {
            if !timed_out {
                self.went_away.store(true, Relaxed);
            }
            false
        }
    }

    /// A pin whose prefix (recorded at clock second `matched_at`) the engine
    /// reported lost, for a request from `source` (its API key, else its
    /// address): the clock second before which the index may forget what
    /// this replica held, once a lost pin from another source corroborates
    /// it within [`WITNESS_S`], and at most once per `every_s` seconds. One
    /// client alone proves only that its own prefix is gone (which the miss
    /// re-recorded): the request may have told the engine to render it
    /// otherwise, so it cannot make the router forget other conversations.
    /// The older of the two prefixes bounds what is forgotten.
    pub fn lost_pin(&self, source: u64, matched_at: u32, now_s: u32, every_s: u32) -> Option<u32> {
        let mut witness = self.witness.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = |w: &Witness| now_s.saturating_sub(w.at_s) <= WITNESS_S;
        match *witness {
            Some(first)
                if first.source != source && fresh(&first) && self.may_repair(now_s, every_s) =>
            {
                *witness = None;
                Some(first.matched_at.min(matched_at))
            }
            _ => {
                *witness = Some(Witness {
                    source,
                    matched_at,
                    at_s: now_s,
                });
                None
            }
        }
    }

    /// The engine reported a pin's prefix cached: its cache is there, and a
    /// lost pin before this is no witness of a lost cache.
    pub fn pin_held(&self) {
        if let Ok(mut w) = self.witness.try_lock() {
            *w = None;
        }
    }

    /// Whether an index repair after a lost pin may run at `now_s`: at most
    /// one per `every_s` seconds per replica.
    fn may_repair(&self, now_s: u32, every_s: u32) -> bool {
        let last = self.last_repair.load(Relaxed);
        if last != u32::MAX && now_s.saturating_sub(last) < every_s {
            return false;
        }
        self.last_repair
            .compare_exchange(last, now_s, Relaxed, Relaxed)
            .is_ok()
    }

    /// Counts a request in flight until the guard drops; `cold` bytes of a
    /// single's prompt (0 for others), which take KV room while it runs;
    /// `prefill` bytes of its prompt the engine has to compute (queued until
    /// it answers).
    pub fn begin(self: &Arc<Self>, cold: u64, prefill: u64) -> InFlight {
        self.in_flight.fetch_add(1, Relaxed);
        self.waiting.fetch_add(1, Relaxed);
        self.queued_bytes.fetch_add(prefill, Relaxed);
        self.cold_bytes.fetch_add(cold, Relaxed);
        InFlight {
            replica: Arc::clone(self),
            cold,
            prefill,
            waiting: true,
        }
    }

    /// Sets what the engine last reported of its load (`None`: nothing usable).
    pub fn set_engine(&self, load: Option<EngineLoad>) {
        let (unseen, kv) = load.map_or((UNKNOWN, UNKNOWN), |l| {
            (
                l.unseen.min(UNKNOWN - 1),
                l.kv_used_permille.map_or(UNKNOWN, u32::from),
            )
        });
        // Two figures, two stores: a reader may pair one read's count with
        // the read before's KV; both are estimates a scrape old anyway.
        self.engine_kv_permille.store(kv, Relaxed);
        self.engine_unseen.store(unseen, Relaxed);
    }

    /// What the engine last reported, if anything.
    pub fn engine(&self) -> Option<EngineLoad> {
        let unseen = self.engine_unseen.load(Relaxed);
        (unseen != UNKNOWN).then(|| EngineLoad {
            unseen,
            kv_used_permille: u16::try_from(self.engine_kv_permille.load(Relaxed)).ok(),
        })
    }

    /// Sets the pinned working set (bytes) the KV room is computed from.
    pub fn set_pinned_bytes(&self, bytes: u64) {
        self.pinned_bytes.store(bytes, Relaxed);
    }

    #[inline]
    pub(super) fn state(&self) -> ReplicaState {
        let engine = self.engine();
        let room = self.kv_tokens().map(|kv| {
            let cold = self.cold_bytes.load(Relaxed);
            let pinned = self.pinned_bytes.load(Relaxed);
            let bytes = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            let capacity = kv.saturating_mul(BYTES_PER_TOKEN);
            let mut free = if !self.last_prompt.load(Relaxed) {
                bytes(capacity).saturating_sub(bytes(pinned.saturating_add(cold)))
            } else if cold > 0 || pinned == 0 {
                // An engine that keeps only its last prompt: a single running
                // there has displaced the pinned contexts already, so more
                // singles cost them nothing more.
                bytes(capacity).saturating_sub(bytes(cold))
            } else {
                // Any prompt would displace the contexts pinned there.
                0
            };
            // The KV its engine reports free bounds it too: requests the
            // router never sent hold KV there.
            if let Some(used) = engine.and_then(|e| e.kv_used_permille) {
                let left = capacity.saturating_mul(u64::from(1000 - used.min(1000))) / 1000;
                free = free.min(bytes(left));
            }
            // An engine that keeps its last prompt only holds no other.
            let capacity = if self.last_prompt.load(Relaxed) {
                0
            } else {
                capacity
            };
            Room {
                free,
                cold,
                pinned,
                capacity,
            }
        });
        ReplicaState {
            id: self.id,
            name_hash: self.name_hash,
            live: self.live(),
            in_flight: self.in_flight(),
            waiting: self.waiting.load(Relaxed),
            queued_bytes: self.queued_bytes(),
            engine,
            room,
            engine_held: None,
            spread: true,
        }
    }
}

/// A request in flight on a replica; undoes its counts when dropped.
#[derive(Debug)]
pub struct InFlight {
    pub(super) replica: Arc<Replica>,
    pub(super) cold: u64,
    pub(super) prefill: u64,
    /// Counted in the replica's `waiting` (no body byte yet).
    pub(super) waiting: bool,
}

impl InFlight {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }

    /// The replica has started answering (its first body bytes came).
    pub fn answered(&mut self) {
        if std::mem::take(&mut self.waiting) {
            self.replica.waiting.fetch_sub(1, Relaxed);
            self.replica.queued_bytes.fetch_sub(self.prefill, Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.answered();
        self.replica.in_flight.fetch_sub(1, Relaxed);
        self.replica.cold_bytes.fetch_sub(self.cold, Relaxed);
    }
}

#[cfg(test)]
mod tests;
