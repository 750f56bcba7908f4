//! Singles behind a shared prompt: when a one-shot request goes to the
//! replica holding most of its prompt rather than by the counter (the rule is
//! `single` in the policy's header; why, under `shared prefix` there).

use std::sync::atomic::Ordering::Relaxed;

use super::{Decision, Match, Policy, PrefixChain, Reason, ReplicaState};

/// A single follows its prefix only to a replica with at most this many
/// times the least busy live replica's requests in flight, plus the slack
/// (besides `bound` on queued ones): decoding requests cost a batching
/// engine little each, but not nothing.
const SINGLE_LOAD_FACTOR: u32 = 2;
const SINGLE_LOAD_SLACK: u32 = 4;

/// When a single goes to the replica holding its prefix (see `single`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinglesByPrefix {
    /// The held prefix is at least this many bytes of canonical prompt...
    pub min_bytes: usize,
    /// ...and at least this share of the prompt, in percent.
    pub min_percent: u8,
    /// The holder may have this many more requests queued than the
    /// least-queued live replica ([`ReplicaState::queued`]).
    pub bound: u32,
    /// While every live replica could hold every prompt placed recently
    /// ([`Policy::set_recent_bytes`]), singles keep the counter anyway.
    pub spread_while_all_fit: bool,
}

impl SinglesByPrefix {
    /// Whether a prefix held up to `pos` of a `len`-byte prompt may take
    /// the single (long enough, and a large enough share of it).
    pub(super) fn takes(&self, pos: usize, len: usize) -> bool {
        pos >= self.min_bytes && pos as u128 * 100 >= len as u128 * u128::from(self.min_percent)
    }
}

impl Policy {
    /// A single: the replica holding most of its prompt within the load
    /// bound, else a cold placement (see `single` and `shared prefix`).
    pub(super) fn single(
        &self,
        chain: &PrefixChain,
        matches: &[Match],
        live: &[ReplicaState],
        d: &mut Decision,
    ) {
        d.reason = Reason::Spread;
        // Room is only comparable when every replica declares its capacity.
        let rule = self
            .config()
            .singles
            .filter(|r| live.iter().all(|s| s.room.is_some()) && !self.all_fit(r, live));
        let Some(rule) = rule else {
            d.replica = self.cold(live, |_| true, chain.len());
            return;
        };
        // Queued, not in flight: a request decoding there barely delays a
        // new prefill on a batching engine; one queued ahead delays it whole.
        // In flight too, loosely: a pile of decoding requests is still a pile.
        let least_queued = live.iter().map(ReplicaState::queued).min().unwrap_or(0);
        let least_load = live.iter().map(ReplicaState::load).min().unwrap_or(0);
        let within = |s: &ReplicaState| {
            s.queued() <= least_queued.saturating_add(rule.bound)
                && s.load()
                    <= least_load
                        .saturating_mul(SINGLE_LOAD_FACTOR)
                        .saturating_add(SINGLE_LOAD_SLACK)
        };
        // Prompt queued for prefill there beyond the least queued replica a
        // cold placement may take (see `queued prefill`) by at most what the
        // held prefix saves, and a step.
        let cold = live.iter().filter(|s| s.spread && within(s));
        let bound = self.queued_bound(cold.map(|s| s.queued_bytes));
        let worth =
            |s: &ReplicaState, pos: usize| s.queued_bytes <= bound.saturating_add(pos as u64);
        let bytes = i64::try_from(chain.len()).unwrap_or(i64::MAX);
        let held = |m: &&Match| rule.takes(m.pos, chain.len());
        let mut refused = false;
        for m in matches.iter().filter(held) {
            let Some(s) = live.iter().find(|s| s.id == m.replica) else {
                continue;
            };
            // Room for the whole prompt beside the contexts pinned there and
            // the singles in flight: a single may be a conversation's first turn.
            let room = s.room.is_some_and(|r| r.free >= bytes);
            let in_bounds = within(s) && worth(s, m.pos);
            if in_bounds && room {
                d.replica = Some(m.replica);
                d.reason = Reason::Prefix;
                d.matched_bytes = m.pos;
                d.matched_at = m.touched;
                return;
            }
            refused |= !in_bounds;
        }
        // Held where the load is over the bounds: cold within them, when
        // any replica is within both (the least queued and the least loaded
        // need not be one replica).
        let bounded = refused && live.iter().any(|s| s.spread && within(s));
        d.replica = self.cold(live, |s| !bounded || within(s), chain.len());
    }

    /// Whether, with `spread_while_all_fit`, every live replica's KV could
    /// hold every prompt placed recently beside its singles in flight: then
    /// spreading costs no cache (each keeps every shared prefix) and
    /// balances better than following prefixes.
    fn all_fit(&self, rule: &SinglesByPrefix, live: &[ReplicaState]) -> bool {
        let recent = self.recent_bytes.load(Relaxed);
        rule.spread_while_all_fit
            && !live.is_empty()
            && live.iter().all(|s| {
                s.room
                    .is_some_and(|r| recent.saturating_add(r.cold) <= r.capacity)
            })
    }
}
