//! A prompt's block keys as engines key them (`kv::chain_keys`), one chain
//! per block size among the engines, extended as its ids come, and asked
//! whether some engine holds the chain so far.

use std::sync::{Arc, Mutex};

use super::lock;
use crate::kv::{chain_keys, EngineBlocks};

/// The keys of a prompt's whole blocks of one size, and its ids past them.
#[derive(Debug, Clone)]
pub struct Blocks {
    pub size: u32,
    pub keys: Vec<u64>,
    carry: Vec<u32>,
}

impl Blocks {
    fn new(size: u32) -> Self {
        Self {
            size,
            keys: Vec::new(),
            carry: Vec::new(),
        }
    }

    /// Appends the prompt's next ids.
    pub fn push(&mut self, mut ids: &[u32]) {
        let bs = self.size as usize;
        if !self.carry.is_empty() {
            let take = (bs - self.carry.len()).min(ids.len());
            self.carry.extend_from_slice(&ids[..take]);
            ids = &ids[take..];
            if self.carry.len() < bs {
                return;
            }
            let parent = self.keys.last().copied();
            self.keys.extend(chain_keys(0, parent, &self.carry, bs));
            self.carry.clear();
        }
        let whole = ids.len() / bs * bs;
        let parent = self.keys.last().copied();
        self.keys.extend(chain_keys(0, parent, &ids[..whole], bs));
        self.carry.extend_from_slice(&ids[whole..]);
    }

    /// The key of the last whole block were `next` to come after the ids
    /// so far (`None`: no whole block).
    fn ahead(&self, next: &[u32]) -> Option<u64> {
        let bs = self.size as usize;
        if self.carry.len() + next.len() < bs {
            return self.keys.last().copied();
        }
        let tail: Vec<u32> = self.carry.iter().chain(next).copied().collect();
        let parent = self.keys.last().copied();
        chain_keys(0, parent, &tail, bs).last().copied()
    }

    /// A copy with room for a turn's more keys (a clone's exact capacity
    /// would be copied again at the first).
    fn to_extend(&self) -> Self {
        let mut keys = Vec::with_capacity(self.keys.len() + 256);
        keys.extend_from_slice(&self.keys);
        Self {
            size: self.size,
            keys,
            carry: self.carry.clone(),
        }
    }

    /// Bytes it holds.
    pub fn heap_bytes(&self) -> usize {
        self.keys.len() * 8 + self.carry.len() * 4
    }
}

/// The engines whose state is known, with their block sizes, and a
/// prompt's chains in those sizes: `start` before the ids being encoded,
/// `now` through the first `fed` of them (made when first asked).
pub struct Chains {
    engines: Vec<(Arc<Mutex<EngineBlocks>>, Option<u32>)>,
    pub start: Vec<Blocks>,
    now: Option<Vec<Blocks>>,
    fed: usize,
}

impl Chains {
    /// From an earlier turn's chains (`None`: from no ids), when they
    /// cover every block size of the engines.
    pub fn new(known: &[Arc<Mutex<EngineBlocks>>], earlier: Option<&[Blocks]>) -> Option<Self> {
        let engines: Vec<_> = (known.iter())
            .map(|b| (Arc::clone(b), lock(b).block_size()))
            .collect();
        let mut sizes: Vec<u32> = engines.iter().filter_map(|(_, s)| *s).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let start = (sizes.into_iter())
            .map(|size| match earlier {
                None => Some(Blocks::new(size)),
                Some(e) => e.iter().find(|b| b.size == size).map(Blocks::to_extend),
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            engines,
            start,
            now: None,
            fed: 0,
        })
    }

    /// Whether some engine holds the blocks through `ids` (the ids encoded
    /// so far) then `next` (only the last whole block is asked: engines
    /// evict a chain from its end); true while there is no whole block yet.
    pub fn held(&mut self, ids: &[u32], next: &[u32]) -> bool {
        let Chains {
            engines,
            start,
            now,
            fed,
        } = self;
        let now = now.get_or_insert_with(|| start.clone());
        let new = ids.get(*fed..).unwrap_or_default();
        for b in now.iter_mut() {
            b.push(new);
        }
        *fed = ids.len();
        let last: Vec<(u32, Option<u64>)> = now.iter().map(|b| (b.size, b.ahead(next))).collect();
        engines.iter().any(|(b, size)| {
            match last
                .iter()
                .find(|(s, _)| Some(*s) == *size)
                .map(|(_, k)| *k)
            {
                Some(Some(k)) => lock(b).holds(k),
                Some(None) => true,
                None => false,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_in_any_cuts_the_keys_are_those_of_the_whole() {
        let ids: Vec<u32> = (0..100).collect();
        let whole = chain_keys(0, None, &ids, 16);
        for cuts in [vec![100], vec![1, 99], vec![15, 1, 16, 68], vec![33, 0, 67]] {
            let mut b = Blocks::new(16);
            let mut at = 0;
            for n in cuts {
                b.push(&ids[at..at + n]);
                at += n;
            }
            assert_eq!(b.keys, whole);
            assert_eq!(b.carry, ids[96..]);
            assert_eq!(b.heap_bytes(), 6 * 8 + 4 * 4);
        }
        // The next block's key, ahead of its ids.
        let mut b = Blocks::new(16);
        b.push(&ids[..40]);
        assert_eq!(b.ahead(&ids[40..48]), Some(whole[2]));
        assert_eq!(b.ahead(&ids[40..41]), Some(whole[1]));
        assert_eq!(Blocks::new(16).ahead(&ids[..15]), None);
    }
}
