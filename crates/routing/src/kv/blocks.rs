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
//! engine's cache is next emptied. At most `max_blocks` blocks are kept (the
//! bound is checked before an event's blocks go in, and the maps' memory is
//! given back when they are dropped): an engine that reports more is taken
//! as unknown too. (A ZMQ message over 16 MiB fails the connection before
//! it is buffered: see the router's `kv_events`.)

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
    let mut bytes = Vec::with_capacity(block_size.min(tokens.len()) * 4);
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
    /// Malformed events skipped (a malformed removal makes the state
    /// unknown: what it removed is not known).
    pub unreadable: usize,
    /// The cache was emptied (the event said so).
    pub cleared: bool,
    /// More than `max_blocks`: the state is unknown now.
    pub overflowed: bool,
}

impl std::ops::AddAssign for Applied {
    fn add_assign(&mut self, o: Applied) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.orphans += o.orphans;
        self.unreadable += o.unreadable;
        self.cleared |= o.cleared;
        self.overflowed |= o.overflowed;
    }
}

/// One replica's blocks.
#[derive(Debug)]
pub struct EngineBlocks {
    /// Engine hash -> its key and how many copies the engine holds.
    keys: HashMap<EngineHash, (u64, u32)>,
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
        self.drop_all();
        self.sync = CacheState::Known;
    }

    /// Events were lost: what is kept can no longer be trusted.
    pub fn lose(&mut self) {
        self.drop_all();
        self.sync = CacheState::Unknown;
    }

    /// Empties the maps and gives their memory back.
    fn drop_all(&mut self) {
        self.keys = HashMap::new();
        self.held = HashMap::new();
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &Event) -> Applied {
        let mut done = Applied::default();
        match event {
            Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                namespace,
            } => {
                self.block_size = Some(*block_size);
                let parent_key = match parent {
                    None => None,
                    Some(p) => match self.keys.get(p) {
                        Some((k, _)) => Some(*k),
                        None => {
                            done.orphans = hashes.len();
                            return done;
                        }
                    },
                };
                if self.keys.len() + hashes.len() > self.max_blocks {
                    self.lose();
                    done.overflowed = true;
                    return done;
                }
                let keys = chain_keys(*namespace, parent_key, tokens, *block_size as usize);
                for (hash, key) in hashes.iter().zip(keys) {
                    let entry = self.keys.entry(*hash).or_insert((key, 0));
                    if entry.0 != key {
                        // The same hash for other tokens: the newer ones.
                        let (old, copies) = std::mem::replace(entry, (key, 0));
                        for _ in 0..copies {
                            Self::release(&mut self.held, old);
                        }
                    }
                    entry.1 += 1;
                    *self.held.entry(key).or_insert(0) += 1;
                    done.stored += 1;
                }
            }
            Event::Removed { hashes } => {
                for hash in hashes {
                    let Some((key, copies)) = self.keys.get_mut(hash) else {
                        continue;
                    };
                    let key = *key;
                    *copies -= 1;
                    if *copies == 0 {
                        self.keys.remove(hash);
                    }
                    Self::release(&mut self.held, key);
                    done.removed += 1;
                }
            }
            Event::Cleared => {
                self.start_empty();
                done.cleared = true;
            }
            Event::Unreadable { removal } => {
                done.unreadable = 1;
                if *removal {
                    self.lose();
                }
            }
            Event::Other => {}
        }
        done
    }

    fn release(held: &mut HashMap<u64, u32>, key: u64) {
        if let Some(n) = held.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&key);
            }
        }
    }

    /// Whether the engine holds the block of this key.
    pub fn holds(&self, key: u64) -> bool {
        self.held.contains_key(&key)
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
        self.keys.capacity() * (8 + 12 + 1) + self.held.capacity() * (8 + 4 + 1)
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
                hashes: vec![EngineHash(12)]
            })
            .removed,
            1
        );
        assert_eq!(b.matched(&request), 2);
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn an_unknown_parent_an_unreadable_event_and_a_clear() {
        let mut b = EngineBlocks::new(100);
        b.start_empty();
        let orphan = b.apply(&stored(&[20], Some(99), &[1, 2]));
        assert_eq!((orphan.stored, orphan.orphans), (0, 1));
        b.apply(&stored(&[22], None, &[1, 2]));
        let skipped = b.apply(&Event::Unreadable { removal: false });
        assert_eq!((skipped.unreadable, b.sync()), (1, CacheState::Known));
        assert_eq!(b.len(), 1);
        assert!(b.apply(&Event::Cleared).cleared);
        assert!(b.is_empty());
        assert_eq!(b.sync(), CacheState::Known);
        b.apply(&Event::Unreadable { removal: true });
        assert_eq!(b.sync(), CacheState::Unknown, "what it removed is unknown");
    }

    #[test]
    fn memory_is_bounded_and_a_loss_is_unknown() {
        let mut b = EngineBlocks::new(3);
        assert_eq!(b.sync(), CacheState::Unknown, "not heard from yet");
        b.start_empty();
        b.apply(&stored(&[1, 2], None, &[1, 2, 3, 4]));
        assert_eq!(b.sync(), CacheState::Known);
        let over = b.apply(&stored(&[3, 4], Some(2), &[5, 6, 7, 8]));
        assert!(over.overflowed, "checked before the blocks go in");
        assert_eq!(
            (b.sync(), b.len(), b.heap_bytes()),
            (CacheState::Unknown, 0, 0)
        );
        b.start_empty();
        b.apply(&stored(&[1], None, &[1, 2]));
        b.lose();
        assert_eq!((b.sync(), b.len()), (CacheState::Unknown, 0));
    }

    #[test]
    fn copies_of_a_block_are_held_until_the_last_is_removed() {
        let mut b = EngineBlocks::new(10);
        b.start_empty();
        b.apply(&stored(&[5], None, &[1, 2]));
        b.apply(&stored(&[5], None, &[1, 2]));
        assert_eq!(b.len(), 1);
        let request = chain_keys(0, None, &[1, 2], 2);
        let remove = Event::Removed {
            hashes: vec![EngineHash(5)],
        };
        b.apply(&remove);
        assert_eq!(b.matched(&request), 1, "a copy is still held");
        b.apply(&remove);
        assert_eq!(b.matched(&request), 0);
        // The same hash for other tokens replaces the block.
        b.apply(&stored(&[6], None, &[1, 2]));
        b.apply(&stored(&[6], None, &[3, 4]));
        assert_eq!(b.matched(&request), 0);
        assert_eq!(b.matched(&chain_keys(0, None, &[3, 4], 2)), 1);
    }
}
