//! The prefix index split by key into shards, each a [`PrefixIndex`] behind
//! its own lock, so requests on different worker threads rarely wait for one
//! another: every operation takes one shard's lock for one key.
//!
//! Keys are xxh3 outputs; a multiply-shift of the key picks the shard, so the
//! bits each shard's hash map uses (low for the bucket, top seven for its
//! control bytes) stay uniform. Each shard holds its share of the cap and
//! evicts by its own segmented LRU, which over uniform keys approximates one
//! LRU over all. A small index (under [`SHARDED_FROM`] entries, as in tests)
//! is one shard: exactly one LRU.

use std::sync::{Mutex, MutexGuard};

use super::index::{Entry, PrefixIndex};

/// Shards of a large index.
const SHARDS: usize = 16;
/// Caps from which the index is sharded.
pub(crate) const SHARDED_FROM: usize = 1 << 16;

#[derive(Debug)]
pub(crate) struct Shards {
    shards: Box<[Mutex<PrefixIndex>]>,
}

impl Shards {
    /// At most `cap` entries in all.
    pub fn new(cap: usize) -> Self {
        let n = if cap >= SHARDED_FROM { SHARDS } else { 1 };
        let shards = (0..n).map(|_| Mutex::new(PrefixIndex::new(cap.div_ceil(n))));
        Self {
            shards: shards.collect(),
        }
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, PrefixIndex> {
        let n = self.shards.len() as u64;
        let i = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % n;
        lock(&self.shards[i as usize])
    }

    fn all(&self) -> impl Iterator<Item = MutexGuard<'_, PrefixIndex>> {
        self.shards.iter().map(lock)
    }

    /// Looks a prefix up without changing its recency.
    pub fn get(&self, key: u64) -> Option<Entry> {
        self.shard(key).get(key).copied()
    }

    /// Records `key` as served by `replica`; `tail`, when given, is a prompt
    /// end past this block (see [`PrefixIndex::upsert`]).
    pub fn upsert(&self, key: u64, replica: u32, now_s: u32, block: bool, tail: Option<u16>) {
        let mut shard = self.shard(key);
        let entry = shard.upsert(key, replica, now_s, block);
        if let Some(t) = tail {
            entry.add_tail(t);
        }
    }

    pub fn len(&self) -> usize {
        self.all().map(|s| s.len()).sum()
    }

    pub fn heap_bytes(&self) -> usize {
        self.all().map(|s| s.heap_bytes()).sum()
    }

    /// `f` of the replica of each block entry touched at or after `since_s`.
    pub fn recent_blocks(&self, since_s: u32, mut f: impl FnMut(u32)) {
        for shard in self.all() {
            shard.recent_blocks(since_s).for_each(&mut f);
        }
    }

    pub fn forget_replica(&self, replica: u32) {
        for mut shard in self.all() {
            shard.forget_replica(replica);
        }
    }
}

/// A shard's lock; a panic elsewhere while holding it leaves an index that is
/// still consistent per operation, so it is used as it stands.
fn lock(m: &Mutex<PrefixIndex>) -> MutexGuard<'_, PrefixIndex> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_index_spreads_its_keys_over_every_shard_within_its_cap() {
        let s = Shards::new(SHARDED_FROM);
        for k in 0..2 * SHARDED_FROM as u64 {
            let key = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            s.upsert(key, 1, 0, true, None);
        }
        assert!(s.len() <= SHARDED_FROM);
        assert!(s.len() >= SHARDED_FROM - SHARDS);
        for shard in s.all() {
            assert_eq!(shard.len(), SHARDED_FROM / SHARDS);
        }
    }

    #[test]
    fn a_small_index_is_one_lru() {
        let s = Shards::new(4);
        for k in 1..=5u64 {
            s.upsert(k, 1, 0, false, None);
        }
        assert_eq!(s.len(), 4);
        assert!(s.get(1).is_none() && s.get(5).is_some());
    }
}
