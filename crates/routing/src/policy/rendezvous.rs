//! `fleet: rendezvous`: the hash a request is placed by, and the replica
//! every router instance ranks first for it.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Fleet, Mode, Policy, ReplicaId, ReplicaState, Request, Shape};

impl Policy {
    /// With `fleet: rendezvous`, the hash a request is placed by (see FLEET).
    pub(super) fn rendezvous_root(&self, req: &Request, shape: Shape) -> Option<u64> {
        let cfg = self.config();
        let Fleet::Rendezvous { singles } = cfg.fleet else {
            return None;
        };
        if cfg.mode != Mode::Shape || (shape == Shape::Single && !singles) {
            return None;
        }
        let chain = &req.chain;
        let root = req.root_end.filter(|e| *e > 0 && *e <= chain.len());
        let ends = &chain.message_ends;
        Some(match (&req.key, root) {
            (Some(k), _) => chain.key_hash(k),
            (None, Some(end)) => chain.end_hash(end),
            // A single (a conversation's first turn): all of it is its
            // later turns' root.
            (None, None) if shape == Shape::Single && !ends.is_empty() => {
                chain.end_hash(chain.len())
            }
            // A continuation without a model turn: its first two messages
            // (a system prompt shared by many conversations is not enough).
            (None, None) => match ends.get(1).or(ends.first()) {
                Some(end) => chain.end_hash(*end),
                None => chain.head_hash(),
            },
        })
    }

    /// The live replica ranked first for `root`, or with a load guard the
    /// first not over it (ranked as every instance ranks them).
    pub(super) fn by_root(&self, root: u64, live: &[ReplicaState]) -> Option<ReplicaId> {
        let Some(limit) = self.config().load_guard else {
            return rendezvous(root, live);
        };
        let floor = live.iter().map(ReplicaState::load).min().unwrap_or(0);
        let mut ranked: Vec<&ReplicaState> = live.iter().collect();
        ranked.sort_by_key(|s| std::cmp::Reverse(score(root, s)));
        ranked
            .iter()
            .find(|s| s.load() <= floor.saturating_add(limit))
            .or(ranked.first())
            .map(|s| s.id)
    }
}

/// Highest-random-weight choice: stable per key, and only the keys of a
/// replica that leaves move.
pub(super) fn rendezvous(key: u64, live: &[ReplicaState]) -> Option<ReplicaId> {
    live.iter().max_by_key(|s| score(key, s)).map(|s| s.id)
}

/// A replica's rendezvous score for `key`, alike in every router instance.
fn score(key: u64, s: &ReplicaState) -> u64 {
    xxh3_64_with_seed(&s.name_hash.to_le_bytes(), key)
}
