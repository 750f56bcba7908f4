//! The prefix index split by key into shards, each a [`PrefixIndex`] behind
//! its own lock, so requests on different worker threads rarely wait for one
//! another: every operation takes one shard's lock for one key, and a pass
//! over every entry one shard's lock for a chunk of its slab at a time.
//!
//! Keys are xxh3 outputs; a multiply-shift of the key picks the shard, so the
//! bits each shard's hash map uses (low for the bucket, top seven for its
//! control bytes) stay uniform. Each shard holds its share of the cap and
//! evicts by its own segmented LRU, which over uniform keys approximates one
//! LRU over all. A small index (under [`SHARDED_FROM`] entries, as in tests)
//! is one shard: exactly one LRU.

use std::sync::{Mutex, MutexGuard};

use super::index::{Entry, PrefixIndex, RecentBlock};

/// Shards of a large index.
const SHARDS: usize = 16;
/// Caps from which the index is sharded.
pub(crate) const SHARDED_FROM: usize = 1 << 16;

/// One entry to record: see [`PrefixIndex::upsert`]; `tail`, when given, is
/// a prompt end past this block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Upsert {
    pub key: u64,
    pub block: bool,
    pub tail: Option<u16>,
}

#[derive(Debug)]
pub(crate) struct Shards {
    shards: Box<[Mutex<PrefixIndex>]>,
    /// Held by a pass over every entry: one at a time (lost pins on many
    /// replicas at once queue their repairs instead of contending with
    /// requests for the shards together).
    pass: Mutex<()>,
}

impl Shards {
    /// At most `cap` entries in all.
    pub fn new(cap: usize) -> Self {
        let n = if cap >= SHARDED_FROM { SHARDS } else { 1 };
        let shards = (0..n).map(|_| Mutex::new(PrefixIndex::new(cap.div_ceil(n))));
        Self {
            shards: shards.collect(),
            pass: Mutex::new(()),
        }
    }

    fn shard_of(&self, key: u64) -> usize {
        let n = self.shards.len() as u64;
        ((key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % n) as usize
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, PrefixIndex> {
        lock(&self.shards[self.shard_of(key)])
    }

    fn all(&self) -> impl Iterator<Item = MutexGuard<'_, PrefixIndex>> {
        self.shards.iter().map(lock)
    }

    /// Looks a prefix up without changing its recency.
    pub fn get(&self, key: u64) -> Option<Entry> {
        self.shard(key).get(key).copied()
    }

    /// Looks each of `keys` up (without changing recency), taking each
    /// shard's lock once.
    pub fn get_all(&self, keys: &[u64]) -> Vec<Option<Entry>> {
        let mut out = vec![None; keys.len()];
        self.grouped(
            keys.len(),
            |i| keys[i],
            |shard, i| {
                out[i] = shard.get(keys[i]).copied();
            },
        );
        out
    }

    /// Records each upsert, in order within each shard (so LRU order is kept),
    /// taking each shard's lock once.
    pub fn upsert_all(&self, ops: &[Upsert], replica: u32, now_s: u32, pinned: bool) {
        self.grouped(
            ops.len(),
            |i| ops[i].key,
            |shard, i| {
                let o = &ops[i];
                let entry = shard.upsert(o.key, replica, now_s, o.block, pinned);
                if let Some(t) = o.tail {
                    entry.add_tail(t);
                }
            },
        );
    }

    /// Calls `f` with each of `n` items (keyed by `key`) under its shard's
    /// lock: shard by shard, each shard's items in their order.
    fn grouped(
        &self,
        n: usize,
        key: impl Fn(usize) -> u64,
        mut f: impl FnMut(&mut PrefixIndex, usize),
    ) {
        if let [only] = &*self.shards {
            let mut shard = lock(only);
            (0..n).for_each(|i| f(&mut shard, i));
            return;
        }
        // A counting sort of the items by shard.
        let of: Vec<u8> = (0..n).map(|i| self.shard_of(key(i)) as u8).collect();
        let mut start = [0; SHARDS + 1];
        for s in &of {
            start[usize::from(*s) + 1] += 1;
        }
        for s in 1..start.len() {
            start[s] += start[s - 1];
        }
        let mut order = vec![0; n];
        let mut next = start;
        for (i, s) in of.iter().enumerate() {
            let s = usize::from(*s);
            order[next[s]] = i;
            next[s] += 1;
        }
        for (s, m) in self.shards.iter().enumerate() {
            let group = &order[start[s]..start[s + 1]];
            if !group.is_empty() {
                let mut shard = lock(m);
                group.iter().for_each(|&i| f(&mut shard, i));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.all().map(|s| s.len()).sum()
    }

    pub fn heap_bytes(&self) -> usize {
        self.all().map(|s| s.heap_bytes()).sum()
    }

    /// Entries recorded and removed so far, in all shards: unchanged, the
    /// index reads as a pass last read it.
    pub fn writes(&self) -> u64 {
        self.all().map(|s| s.writes()).sum()
    }

    /// Each block entry touched at or after `since_s` (see
    /// [`PrefixIndex::recent_blocks`]), handed to `f` a chunk at a time with
    /// no lock held.
    pub fn recent_blocks(&self, since_s: u32, mut f: impl FnMut(&[RecentBlock])) {
        self.by_chunks(
            |shard, from| {
                let mut out = Vec::new();
                let next = shard.recent_blocks(from, since_s, &mut out);
                (out, next)
            },
            |chunk| f(&chunk),
        );
    }

    /// Drops every entry `doomed` picks (see [`PrefixIndex::forget`]);
    /// returns how many.
    pub fn forget(&self, doomed: impl Fn(u32, u32) -> bool) -> usize {
        let mut dropped = 0;
        self.by_chunks(|shard, from| shard.forget(from, &doomed), |n| dropped += n);
        dropped
    }

    /// A pass over every shard's slab a chunk at a time, one pass at a time:
    /// `step` from slot 0 while it returns where the next chunk starts, each
    /// call under the shard's lock, then `then` with what it returned, the
    /// lock released; the thread yields before each chunk but the first. A
    /// pass over a full index takes milliseconds: a request's thread on the
    /// same core (or waiting for the shard) runs between its chunks, and a
    /// pass on a busy core gets what the requests leave (yielding every 8
    /// chunks instead: p99 at saturation 1.5–3.6 ms against 1.1–1.75,
    /// `docs/performance.md`).
    fn by_chunks<T>(
        &self,
        mut step: impl FnMut(&mut PrefixIndex, usize) -> (T, Option<usize>),
        mut then: impl FnMut(T),
    ) {
        let _one = self.pass.lock().unwrap_or_else(|p| p.into_inner());
        let mut first = true;
        for shard in self.shards.iter() {
            let mut from = Some(0);
            while let Some(at) = from {
                if !std::mem::take(&mut first) {
                    std::thread::yield_now();
                }
                let (got, next) = step(&mut lock(shard), at);
                then(got);
                from = next;
            }
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
    use crate::policy::index::CHUNK;

    #[test]
    fn a_large_index_spreads_its_keys_over_every_shard_within_its_cap() {
        let s = Shards::new(SHARDED_FROM);
        for k in 0..2 * SHARDED_FROM as u64 {
            let key = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            s.upsert_all(
                &[Upsert {
                    key,
                    block: true,
                    tail: None,
                }],
                1,
                0,
                false,
            );
        }
        assert!(s.len() <= SHARDED_FROM);
        assert!(s.len() >= SHARDED_FROM - SHARDS);
        for shard in s.all() {
            assert_eq!(shard.len(), SHARDED_FROM / SHARDS);
        }
    }

    #[test]
    fn writes_are_counted_in_every_shard() {
        let s = Shards::new(SHARDED_FROM);
        let ops: Vec<Upsert> = (0..64u64)
            .map(|k| Upsert {
                key: xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes()),
                block: true,
                tail: None,
            })
            .collect();
        s.upsert_all(&ops, 1, 0, false);
        assert_eq!(s.writes(), 64);
        assert_eq!(s.forget(|_, _| true), 64);
        assert_eq!(s.writes(), 128);
    }

    #[test]
    fn grouped_operations_keep_their_order_within_each_shard() {
        let s = Shards::new(SHARDED_FROM);
        let keys: Vec<u64> = (0..500)
            .map(|k| xxhash_rust::xxh3::xxh3_64(&[k as u8, 7]))
            .collect();
        let mut seen = Vec::new();
        s.grouped(keys.len(), |i| keys[i], |_, i| seen.push(i));
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..500).collect::<Vec<_>>());
        for pair in seen.windows(2) {
            let same = s.shard_of(keys[pair[0]]) == s.shard_of(keys[pair[1]]);
            assert!(!same || pair[0] < pair[1]);
        }
        let got = s.get_all(&keys);
        assert!(got.iter().all(Option::is_none));
    }

    #[test]
    fn a_small_index_is_one_lru() {
        let s = Shards::new(4);
        let ops: Vec<_> = (1..=5u64)
            .map(|key| Upsert {
                key,
                block: false,
                tail: None,
            })
            .collect();
        s.upsert_all(&ops, 1, 0, false);
        assert_eq!(s.len(), 4);
        assert!(s.get(1).is_none() && s.get(5).is_some());
    }

    #[test]
    fn a_pass_over_a_large_index_hands_it_over_in_chunks_with_no_lock_held() {
        let s = Shards::new(4 * SHARDED_FROM);
        let keys = 2 * SHARDED_FROM as u64;
        let ops: Vec<Upsert> = (0..keys)
            .map(|k| Upsert {
                key: k.wrapping_mul(0x2545_F491_4F6C_DD1D),
                block: true,
                tail: None,
            })
            .collect();
        s.upsert_all(&ops, 1, 5, false);
        let (mut chunks, mut seen) = (0, 0);
        s.recent_blocks(0, |chunk| {
            (chunks, seen) = (chunks + 1, seen + chunk.len());
            assert!(chunk.len() <= CHUNK);
            // A request may record meanwhile: no shard is locked.
            assert!(s.shards.iter().all(|m| m.try_lock().is_ok()));
        });
        assert_eq!(seen, s.len());
        assert!(
            chunks >= seen.div_ceil(CHUNK) && chunks > SHARDS,
            "{chunks} chunks"
        );
        assert_eq!(s.forget(|r, t| r == 1 && t < 5), 0, "recorded at 5: kept");
        assert_eq!(s.forget(|r, t| r == 1 && t < 6), seen);
        assert_eq!(s.len(), 0);
    }
}
