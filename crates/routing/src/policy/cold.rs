//! Cold placements (see `kv room` and `least loaded` in the policy's
//! rule): the counter over the replicas with room for the prompt, `pack`'s
//! displaced replica, and the least-loaded filter before the counter.

use std::sync::atomic::Ordering::Relaxed;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{KvRoom, Policy, ReplicaId, ReplicaState, COUNTERS};

/// `pack` sends overflow to a replica only while it has at most this many
/// times the least busy live replica's requests in flight, plus the slack: a
/// long burst is then shared again instead of queueing on one card.
const PACK_LOAD_FACTOR: u32 = 2;
const PACK_LOAD_SLACK: u32 = 2;

/// `least_loaded` compares engines' KV use in steps this wide (10 %), so a
/// stale scrape's small differences do not decide placements.
const KV_STEP_PERMILLE: u16 = 100;

impl Policy {
    /// A cold placement of a prompt of `bytes` (see `kv room`).
    pub(super) fn cold(&self, live: &[ReplicaState], bytes: usize) -> Option<ReplicaId> {
        // Room is only comparable when every replica declares its capacity.
        if self.config().kv_room == KvRoom::Off || live.iter().any(|s| s.room.is_none()) {
            return self.balance(live);
        }
        let bytes = bytes as i64;
        let fits: Vec<ReplicaState> = live
            .iter()
            .filter(|s| s.room.is_some_and(|r| r.free >= bytes))
            .copied()
            .collect();
        if !fits.is_empty() {
            return self.balance(&fits);
        }
        let protects = || live.iter().any(|s| s.room.is_some_and(|r| r.pinned > 0));
        if self.config().kv_room == KvRoom::Pack && protects() {
            // Room taken by singles in flight, not by the pinned set alone
            // (that is the capacity wall, where packing rescues nothing), on a
            // replica not already far busier than the least busy one.
            let least = live.iter().map(ReplicaState::load).min().unwrap_or(0);
            let bound = least
                .saturating_mul(PACK_LOAD_FACTOR)
                .saturating_add(PACK_LOAD_SLACK);
            let displaced = live
                .iter()
                .filter(|s| s.load() <= bound)
                .filter_map(|s| s.room.map(|r| (s.id, r)))
                .filter(|(_, r)| r.free.saturating_add(r.cold as i64) >= bytes)
                .min_by_key(|(id, r)| (r.free, *id));
            if let Some((id, _)) = displaced {
                return Some(id);
            }
        }
        self.balance(live)
    }

    /// The counter over `live`; with `least_loaded`, over the least loaded
    /// of them, and of those the ones whose engines report the least KV in
    /// use (in steps of `KV_STEP_PERMILLE`, when all of them report it).
    pub(super) fn balance(&self, live: &[ReplicaState]) -> Option<ReplicaId> {
        if !self.config().least_loaded {
            return self.count(live);
        }
        let least = live.iter().map(ReplicaState::load).min()?;
        let mut idle: Vec<ReplicaState> =
            live.iter().filter(|s| s.load() == least).copied().collect();
        let kv_step = |s: &ReplicaState| {
            s.engine
                .and_then(|e| e.kv_used_permille)
                .map(|k| k / KV_STEP_PERMILLE)
        };
        let steps: Option<Vec<u16>> = idle.iter().map(kv_step).collect();
        if let Some(low) = steps.and_then(|v| v.into_iter().min()) {
            idle.retain(|s| kv_step(s) == Some(low));
        }
        self.count(&idle)
    }

    /// The counter of this set of replicas: each set its own, so the
    /// replicas of one model (the caller offers only those) take turns
    /// whatever other models' traffic does between.
    pub(super) fn count(&self, live: &[ReplicaState]) -> Option<ReplicaId> {
        if live.is_empty() {
            return None;
        }
        let mut set = 0u64;
        for s in live {
            set = xxh3_64_with_seed(&s.id.0.to_le_bytes(), set);
        }
        let counter = &self.counters[(set % COUNTERS as u64) as usize];
        let i = (counter.fetch_add(1, Relaxed) % live.len() as u64) as usize;
        Some(live[i].id)
    }
}
