//! Cold placements (see `kv room` and `least loaded` in the policy's
//! rule): the counter over the replicas with room for the prompt, `pack`'s
//! displaced replica, and the least-loaded filter before the counter.

use std::sync::atomic::Ordering::Relaxed;

use super::{KvRoom, Policy, ReplicaId, ReplicaState, COUNTERS};

/// `pack` sends overflow to a replica only while it has at most this many
/// times the least busy live replica's requests in flight, plus the slack: a
/// long burst is then shared again instead of queueing on one card.
const PACK_LOAD_FACTOR: u32 = 2;
const PACK_LOAD_SLACK: u32 = 2;

/// `least_loaded` compares engines' KV use in steps this wide (10 %), so a
/// stale scrape's small differences do not decide placements.
const KV_STEP_PERMILLE: u16 = 100;

impl ReplicaState {
    /// Live, nothing there (no request in flight, its engine's included,
    /// so none queued), and its engine's KV in use, when reported, in the
    /// lowest step: unless every replica offered declares its capacity
    /// (`kv_room` compares room then), a cold placement could prefer no
    /// other replica to it. A window of a large fleet is read up to the
    /// first one (`sample`).
    pub fn idle(&self) -> bool {
        self.live && self.load() == 0 && self.kv_step().is_none_or(|k| k == 0)
    }

    /// Its engine's KV in use in steps of `KV_STEP_PERMILLE`, when reported.
    fn kv_step(&self) -> Option<u16> {
        (self.engine?.kv_used_permille).map(|k| k / KV_STEP_PERMILLE)
    }
}

impl Policy {
    /// A cold placement of a prompt of `bytes` among the replicas of `live`
    /// that `among` keeps (see `kv room`), of those the ones it may spread
    /// to while there are any ([`ReplicaState::spread`]). A filter, not a
    /// copy: a fleet of a thousand replicas is not copied per request.
    pub(super) fn cold(
        &self,
        live: &[ReplicaState],
        among: impl Fn(&ReplicaState) -> bool + Copy,
        bytes: usize,
    ) -> Option<ReplicaId> {
        let spread = move |s: &ReplicaState| s.spread && among(s);
        match live.iter().any(spread) {
            true => self.cold_among(live, spread, bytes),
            false => self.cold_among(live, among, bytes),
        }
    }

    fn cold_among(
        &self,
        live: &[ReplicaState],
        among: impl Fn(&ReplicaState) -> bool + Copy,
        bytes: usize,
    ) -> Option<ReplicaId> {
        let set = || live.iter().filter(move |s| among(s));
        // Room is only comparable when every replica declares its capacity.
        if self.config().kv_room == KvRoom::Off || set().any(|s| s.room.is_none()) {
            return self.balance(live, among);
        }
        let bytes = bytes as i64;
        let fits = move |s: &ReplicaState| among(s) && s.room.is_some_and(|r| r.free >= bytes);
        if live.iter().any(fits) {
            return self.balance(live, fits);
        }
        let protects = || set().any(|s| s.room.is_some_and(|r| r.pinned > 0));
        if self.config().kv_room == KvRoom::Pack && protects() {
            // Room taken by singles in flight, not by the pinned set alone
            // (that is the capacity wall, where packing rescues nothing), on a
            // replica not already far busier than the least busy one.
            let least = set().map(ReplicaState::load).min().unwrap_or(0);
            let bound = least
                .saturating_mul(PACK_LOAD_FACTOR)
                .saturating_add(PACK_LOAD_SLACK);
            let displaced = set()
                .filter(|s| s.load() <= bound)
                .filter_map(|s| s.room.map(|r| (s.id, r)))
                .filter(|(_, r)| r.free.saturating_add(r.cold as i64) >= bytes)
                .min_by_key(|(id, r)| (r.free, *id));
            if let Some((id, _)) = displaced {
                return Some(id);
            }
        }
        self.balance(live, among)
    }

    /// The counter over the replicas of `live` that `among` keeps with the
    /// least prompt queued for prefill (see `queued prefill`); with
    /// `least_loaded`, over the least loaded of them, of those the least
    /// queued, and of those the ones whose engines report the least KV in
    /// use (in steps of `KV_STEP_PERMILLE`, when all of them report it).
    pub(super) fn balance(
        &self,
        live: &[ReplicaState],
        among: impl Fn(&ReplicaState) -> bool,
    ) -> Option<ReplicaId> {
        let mut ids = Vec::with_capacity(live.len());
        if !self.config().least_loaded {
            let bound = self.queued_bound(live.iter().filter(|s| among(s)).map(|s| s.queued_bytes));
            let kept = |s: &&ReplicaState| among(s) && s.queued_bytes <= bound;
            ids.extend(live.iter().filter(kept).map(|s| s.id));
            return self.count(&ids);
        }
        // One pass: the least loaded, with their KV steps.
        let mut least = u32::MAX;
        let mut idle: Vec<(ReplicaId, Option<u16>, u64)> = Vec::with_capacity(live.len());
        for s in live.iter().filter(|s| among(s)) {
            let load = s.load();
            if load < least {
                least = load;
                idle.clear();
            }
            if load == least {
                idle.push((s.id, s.kv_step(), s.queued_bytes));
            }
        }
        // Of those, the least queued, and of those the least KV step, when
        // every one reports one.
        let bound = self.queued_bound(idle.iter().map(|(_, _, q)| *q));
        idle.retain(|(_, _, q)| *q <= bound);
        let low = idle
            .iter()
            .try_fold(u16::MAX, |low, (_, k, _)| k.map(|k| low.min(k)));
        let kept =
            |(_, k, _): &&(ReplicaId, Option<u16>, u64)| low.is_none_or(|low| *k == Some(low));
        ids.extend(idle.iter().filter(kept).map(|(id, _, _)| *id));
        self.count(&ids)
    }

    /// The most prompt a replica may have queued for prefill and count as
    /// least queued: a step over the least of `queued` (see `queued
    /// prefill`); no bound when the step is 0.
    pub(super) fn queued_bound(&self, queued: impl Iterator<Item = u64>) -> u64 {
        match self.config().queued_step as u64 {
            0 => u64::MAX,
            step => queued.min().unwrap_or(0).saturating_add(step),
        }
    }

    /// The counter of this set of replicas: each set its own, so the
    /// replicas of one model (the caller offers only those) take turns
    /// whatever other models' traffic does between.
    pub(super) fn count(&self, ids: &[ReplicaId]) -> Option<ReplicaId> {
        if ids.is_empty() {
            return None;
        }
        // The set's hash: a sum of each id mixed (order-free, and a few
        // cycles an id where a hash call per id cost microseconds a request
        // at a thousand replicas).
        let set = ids.iter().fold(0u64, |set, id| set.wrapping_add(mix(id.0)));
        let counter = &self.counters[(set % COUNTERS as u64) as usize];
        let i = (counter.fetch_add(1, Relaxed) % ids.len() as u64) as usize;
        Some(ids[i])
    }
}

/// SplitMix64's finalizer: one id's bits spread over the word.
fn mix(id: u32) -> u64 {
    let mut z = u64::from(id).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
