//! What one replica's engine holds on its GPU, block by block, as its KV
//! events say ([`EngineBlocks`]), and the keys those blocks and a request's
//! tokens are compared by ([`chain_keys`]).
//!
//! Engines seed their block hashes per process, so the router does not
//! recompute them: it keys a block by its own chain over the token ids the
//! `BlockStored` event carries (the parent's key, the block's tokens, the
//! adapter and salt), and keeps the engine's hash -> key map to follow
//! parents and drop what `BlockRemoved` names. A block whose parent it never
//! saw cannot be keyed and is left out (counted).
//!
//! The state is [`CacheState::Known`] only while every event since the engine's
//! cache was last empty has been read: from the engine's first batch (or a
//! replay of it), or since an `AllBlocksCleared`. A lost batch that could not
//! be replayed, or a router that joined a running engine, makes it
//! [`CacheState::Unknown`]: the blocks are dropped (what was removed meanwhile is
//! unknown) and the replica is placed by the router's own index until the
//! engine's cache is next emptied. At most `max_blocks` blocks are kept: an
//! engine that reports more is taken as unknown too, so memory is bounded
//! by design whatever a publisher sends.

use std::collections::HashMap;

use super::event::{EngineHash, Event};

/// The seed of every chain, mixed with the namespace.
const ROOT: u64 = 0x6b76_2d62_6c6f_636b;

/// The key of each whole block of `tokens` (`block_size` ids each; a
/// shorter tail is not a block), chained from `parent` (`None`: the
/// prompt's start) in `namespace` (adapter and salt, see [`Event`]).
pub fn chain_keys(
    namespace: u64,
    parent: Option<u64>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<u64> {
    let mut key = parent.unwrap_or(ROOT ^ namespace);
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut keys = Vec::with_capacity(tokens.len() / block_size.max(1));
    for block in tokens.chunks_exact(block_size.max(1)) {
        bytes.clear();
        for t in block {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        key = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, key);
        keys.push(key);
    }
    keys
}

/// Whether the blocks kept are all the engine holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// Every event since the cache was last empty was read.
    Known,
    /// Some were not: the router's own index places this replica.
    Unknown,
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub stored: usize,
    pub removed: usize,
    /// Blocks left out: their parent was never seen.
    pub orphans: usize,
    /// The cache was emptied (the event said so).
    pub cleared: bool,
    /// More than `max_blocks`: the state is unknown now.
    pub overflowed: bool,
}

/// One replica's blocks.
#[derive(Debug)]
pub struct EngineBlocks {
    keys: HashMap<EngineHash, u64>,
    /// Key -> how many of the engine's blocks have it.
    held: HashMap<u64, u32>,
    block_size: Option<u32>,
    sync: CacheState,
    max_blocks: usize,
}

impl EngineBlocks {
    /// An engine not heard from yet: unknown until its first batch, or an
    /// empty cache, says otherwise.
    pub fn new(max_blocks: usize) -> Self {
        Self {
            keys: HashMap::new(),
            held: HashMap::new(),
            block_size: None,
            sync: CacheState::Unknown,
            max_blocks,
        }
    }

    pub fn sync(&self) -> CacheState {
        self.sync
    }

    /// Blocks kept.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The engine's block size, once an event said.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// The engine's cache is empty and every event from now on will be
    /// read (its first batch since it started, or a cleared cache).
    pub fn start_empty(&mut self) {
        self.keys.clear();
        self.held.clear();
        self.sync = CacheState::Known;
    }

    /// Events were lost: what is kept can no longer be trusted.
    pub fn lose(&mut self) {
        self.keys.clear();
        self.held.clear();
        self.sync = CacheState::Unknown;
    }

    /// Applies one event (GPU blocks only; an offload tier's are not the
    /// engine's prefix cache on the card).
    pub fn apply(&mut self, event: &Event) -> Applied {
        let mut done = Applied::default();
        match event {
            Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                namespace,
                on_gpu: true,
            } => {
                self.block_size = Some(*block_size);
                let parent_key = match parent {
                    None => None,
                    Some(p) => match self.keys.get(p) {
                        Some(k) => Some(*k),
                        None => {
                            done.orphans = hashes.len();
                            return done;
                        }
                    },
                };
                let keys = chain_keys(*namespace, parent_key, tokens, *block_size as usize);
                for (hash, key) in hashes.iter().zip(keys) {
                    if let Some(old) = self.keys.insert(*hash, key) {
                        self.release(old);
                    }
                    *self.held.entry(key).or_insert(0) += 1;
                    done.stored += 1;
                }
                if self.keys.len() > self.max_blocks {
                    self.lose();
                    done.overflowed = true;
                }
            }
            Event::Removed {
                hashes,
                on_gpu: true,
            } => {
                for hash in hashes {
                    if let Some(key) = self.keys.remove(hash) {
                        self.release(key);
                        done.removed += 1;
                    }
                }
            }
            Event::Cleared => {
                self.start_empty();
                done.cleared = true;
            }
            _ => {}
        }
        done
    }

    fn release(&mut self, key: u64) {
        if let Some(n) = self.held.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&key);
            }
        }
    }

    /// How many leading keys of `keys` the engine holds, by binary search:
    /// engines evict a sequence's blocks from its end, so what is held of
    /// a chain is taken as a prefix of it.
    pub fn matched(&self, keys: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, keys.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.held.contains_key(&keys[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Bytes these maps take, about (their allocated slots).
    pub fn heap_bytes(&self) -> usize {
        // A hashbrown slot: the entry plus one control byte.
        self.keys.capacity() * (8 + 8 + 1) + self.held.capacity() * (8 + 4 + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Event {
        Event::Stored {
            hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent: parent.map(EngineHash),
            tokens: tokens.to_vec(),
            block_size: 2,
            namespace: 0,
            on_gpu: true,
        }
    }

    #[test]
    fn blocks_are_keyed_by_their_tokens_along_the_chain() {
        let mut b = EngineBlocks::new(100);
        b.start_empty();
        // Stored in two events: the second's parent is the first's last block.
        assert_eq!(b.apply(&stored(&[10, 11], None, &[1, 2, 3, 4])).stored, 2);
        assert_eq!(b.apply(&stored(&[12], Some(11), &[5, 6])).stored, 1);
        let request = chain_keys(0, None, &[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(request.len(), 3, "the tail of one token is not a block");
        assert_eq!(b.matched(&request), 3);
        // Another first block: nothing matches, though later tokens agree.
        assert_eq!(b.matched(&chain_keys(0, None, &[9, 2, 3, 4], 2)), 0);
        // Another adapter or salt: other blocks.
        assert_eq!(b.matched(&chain_keys(7, None, &[1, 2, 3, 4], 2)), 0);
        // Evicted from the end: the prefix before it still matches.
        assert_eq!(
            b.apply(&Event::Removed {
                hashes: vec![EngineHash(12)],
                on_gpu: true
            })
            .removed,
            1
        );
        assert_eq!(b.matched(&request), 2);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn an_unknown_parent_an_offload_tier_and_a_clear() {
        let mut b = EngineBlocks::new(100);
        b.start_empty();
        let orphan = b.apply(&stored(&[20], Some(99), &[1, 2]));
        assert_eq!((orphan.stored, orphan.orphans), (0, 1));
        let mut cpu = stored(&[21], None, &[1, 2]);
        if let Event::Stored { on_gpu, .. } = &mut cpu {
            *on_gpu = false;
        }
        assert_eq!(b.apply(&cpu).stored, 0);
        b.apply(&stored(&[22], None, &[1, 2]));
        assert_eq!(b.len(), 1);
        assert!(b.apply(&Event::Cleared).cleared);
        assert!(b.is_empty());
        assert_eq!(b.sync(), CacheState::Known);
    }

    #[test]
    fn memory_is_bounded_and_a_loss_is_unknown() {
        let mut b = EngineBlocks::new(3);
        assert_eq!(b.sync(), CacheState::Unknown, "not heard from yet");
        b.start_empty();
        b.apply(&stored(&[1, 2], None, &[1, 2, 3, 4]));
        assert_eq!(b.sync(), CacheState::Known);
        let over = b.apply(&stored(&[3, 4], Some(2), &[5, 6, 7, 8]));
        assert!(over.overflowed);
        assert_eq!((b.sync(), b.len()), (CacheState::Unknown, 0));
        b.start_empty();
        b.apply(&stored(&[1], None, &[1, 2]));
        b.lose();
        assert_eq!((b.sync(), b.len()), (CacheState::Unknown, 0));
    }

    #[test]
    fn the_same_hash_stored_again_is_counted_once() {
        let mut b = EngineBlocks::new(10);
        b.start_empty();
        b.apply(&stored(&[5], None, &[1, 2]));
        b.apply(&stored(&[5], None, &[1, 2]));
        assert_eq!(b.len(), 1);
        b.apply(&Event::Removed {
            hashes: vec![EngineHash(5)],
            on_gpu: true,
        });
        assert_eq!(b.matched(&chain_keys(0, None, &[1, 2], 2)), 0);
    }
}
