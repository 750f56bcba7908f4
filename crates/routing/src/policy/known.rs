//! What the index knows of a prompt: its prefixes' replicas, longest
//! first, and the record of a placement.

use super::*;

impl Policy {
    /// Every known prefix of this prompt, longest first.
    pub(super) fn matches(&self, chain: &PrefixChain) -> Vec<Match> {
        let b = chain.block_bytes;
        let mut out = Vec::new();
        // Block 1 alone first: most prompts that miss, miss there.
        let first = chain.blocks.first().and_then(|h| self.index.get(*h));
        let found = match first {
            Some(_) => self.index.get_all(&chain.blocks),
            None => Vec::new(),
        };
        let mut depth = 0;
        while let Some(Some(e)) = found.get(depth) {
            depth += 1;
            out.push(Match {
                pos: depth * b,
                replica: ReplicaId(e.replica),
                end: false,
                touched: e.touched,
            });
        }
        // An earlier prompt that this one extends ended past the deepest
        // matching block and before the next block boundary.
        let base = depth * b;
        let upto = (base + b - 1).min(chain.len());
        let tails = self
            .index
            .get(chain.block_hash(depth))
            .map(|e| e.tails().map(|t| base + t).collect::<Vec<_>>())
            .unwrap_or_default();
        let mut ends: Vec<usize> = chain
            .message_ends
            .iter()
            .copied()
            .chain(std::iter::once(chain.len()))
            .chain(tails)
            .filter(|p| *p > 0 && *p >= base && *p <= upto)
            .collect();
        ends.sort_unstable();
        ends.dedup();
        for pos in ends {
            if let Some(e) = self.index.get(chain.end_hash(pos)) {
                out.push(Match {
                    pos,
                    replica: ReplicaId(e.replica),
                    end: true,
                    touched: e.touched,
                });
            }
        }
        out.sort_by_key(|m| std::cmp::Reverse(m.pos));
        out
    }

    /// Records that `replica` now holds this prompt's prefix. The end key goes in
    /// first and block 1 last, so LRU eviction trims a conversation from its tail.
    pub(super) fn record(
        &self,
        chain: &PrefixChain,
        key: Option<u64>,
        replica: ReplicaId,
        pinned: bool,
    ) {
        let upsert = |key, block, tail| Upsert { key, block, tail };
        let mut ops = Vec::with_capacity(chain.blocks.len() + 2);
        if let Some(k) = key {
            ops.push(upsert(k, false, None));
        }
        if !chain.is_empty() {
            let n = chain.blocks.len();
            let tail = (chain.len() - n * chain.block_bytes) as u16;
            ops.push(upsert(chain.end_hash(chain.len()), false, None));
            // Block n (or the empty prefix, which is no block, when n is 0)
            // keeps the tail length of this prompt's end.
            ops.push(upsert(chain.block_hash(n), n > 0, Some(tail)));
            let earlier = chain.blocks[..n.saturating_sub(1)].iter().rev();
            ops.extend(earlier.map(|h| upsert(*h, true, None)));
        }
        self.index
            .upsert_all(&ops, replica.0, self.clock_s.load(Relaxed), pinned);
    }
}
