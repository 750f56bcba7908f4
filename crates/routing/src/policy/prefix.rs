//! Prefix identity: a chain of hashes over fixed-size blocks of a prompt's canonical text.
//!
//! ```text
//! H_0      = SEED                                  (the empty prefix)
//! H_{k+1}  = xxh3(text[kB .. (k+1)B], seed = H_k)   one per full block of B bytes
//! End(p)   = xxh3(text[kB .. p], seed = H_k ^ END)  the prefix ending exactly at p, k = p / B
//! ```
//!
//! `H_k` identifies the first `k` blocks, so two prompts that share their first
//! `kB` bytes share `H_1..H_k` whatever follows — the longest matching prefix is
//! found by walking the chain. A prompt rarely ends on a block boundary, so its
//! exact end gets its own key `End(len)`; a later prompt finds it by testing its
//! own message ends and the tail lengths recorded at its deepest matching block.
//! A prompt shorter than one block therefore still has an identity (`End(len)`
//! seeded by `H_0`), which is what the seed's "first N KiB" hash lacked.

use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::text::Text;

/// Hash of the empty prefix, `H_0`.
pub(crate) const SEED: u64 = 0x7072_6566_6978_2d72; // "prefix-r"
const END: u64 = 0x656e_645f_6f66_5f70; // "end_of_p"
const KEY: u64 = 0x6578_706c_6963_6974; // "explicit"
const IDENTITY: u64 = 0x6361_6368_655f_7361; // "cache_sa"

/// The hash chain of one prompt, computed once per request outside any lock.
#[derive(Debug, Clone)]
pub struct PrefixChain {
    pub(crate) block_bytes: usize,
    /// `H_0`: `SEED`, or a hash of the request's identity (its cache salt,
    /// model, tools: what the engine keys its cache by besides the text, so
    /// the index shares prefixes only within one identity).
    seed: u64,
    /// The canonical text, kept to hash candidate ends at lookup time
    /// (shared with the checkpoint a long body leaves, and with the next
    /// turn read from that checkpoint: see `request`).
    pub(crate) text: Arc<Text>,
    /// `H_1..H_n`, one per full block.
    pub(crate) blocks: Vec<u64>,
    /// Byte offsets where a message ends (candidate ends of an earlier prompt).
    pub(crate) message_ends: Vec<usize>,
}

impl PrefixChain {
    /// Hashes `text` in blocks of `block_bytes` (at least 1).
    /// `message_ends` are the offsets where a message of the prompt ends.
    pub fn new(text: Vec<u8>, message_ends: Vec<usize>, block_bytes: usize) -> Self {
        Self::identified(text, message_ends, block_bytes, None)
    }

    /// As [`PrefixChain::new`], for a request with an identity (see
    /// `request::identity`: its cache salt, model, tools): its prefixes, and
    /// its explicit key, match only requests of the same identity.
    pub fn identified(
        text: Vec<u8>,
        message_ends: Vec<usize>,
        block_bytes: usize,
        identity: Option<u64>,
    ) -> Self {
        Self::identified_after(text, message_ends, block_bytes, identity, None)
    }

    /// As [`PrefixChain::identified`] for a text that is `known`'s first
    /// `bytes` bytes, then `tail`: those bytes are shared with `known`'s
    /// text, not copied, and the hashes of the blocks within them are reused
    /// when they were taken with the same block size and identity; only the
    /// blocks after them are hashed.
    pub fn identified_after(
        tail: Vec<u8>,
        message_ends: Vec<usize>,
        block_bytes: usize,
        identity: Option<u64>,
        known: Option<(&PrefixChain, usize)>,
    ) -> Self {
        let block_bytes = block_bytes.max(1);
        let seed = identity.map_or(SEED, |i| xxh3_64_with_seed(&i.to_le_bytes(), IDENTITY));
        let (text, reused) = match known {
            Some((k, bytes)) => {
                let bytes = bytes.min(k.len());
                let same = k.seed == seed && k.block_bytes == block_bytes;
                let reused = match same {
                    true => &k.blocks[..k.blocks.len().min(bytes / block_bytes)],
                    false => &[][..],
                };
                (k.text.extended(bytes, tail), reused)
            }
            None => (Text::from(tail), &[][..]),
        };
        let mut blocks = Vec::with_capacity(text.len() / block_bytes);
        blocks.extend_from_slice(reused);
        let mut h = blocks.last().copied().unwrap_or(seed);
        text.blocks(reused.len() * block_bytes, block_bytes, |block| {
            h = xxh3_64_with_seed(block, h);
            blocks.push(h);
        });
        Self {
            block_bytes,
            seed,
            text: Arc::new(text),
            blocks,
            message_ends,
        }
    }

    /// Heap bytes held: the text, the block hashes and the message ends.
    pub fn heap_bytes(&self) -> usize {
        self.text.heap_bytes()
            + (self.blocks.capacity() + self.message_ends.capacity()) * std::mem::size_of::<u64>()
    }

    /// Length of the canonical text in bytes.
    pub fn len(&self) -> usize {
        self.text.len()
    }

    /// Whether the prompt is empty (it then has no identity worth recording).
    pub fn is_empty(&self) -> bool {
        self.text.len() == 0
    }

    /// `H_k` for `k` full blocks (`H_0` is the seed).
    pub(crate) fn block_hash(&self, k: usize) -> u64 {
        if k == 0 {
            self.seed
        } else {
            self.blocks[k - 1]
        }
    }

    /// `End(pos)`: the key of the prefix that ends exactly at `pos`.
    pub(crate) fn end_hash(&self, pos: usize) -> u64 {
        debug_assert!(pos <= self.len(), "an end past the text");
        let k = pos / self.block_bytes;
        let tail = self.text.get(k * self.block_bytes..pos).unwrap_or_default();
        xxh3_64_with_seed(&tail, self.block_hash(k) ^ END)
    }

    /// The index key for an explicit conversation key (`prompt_cache_key`,
    /// `x-session-id`) sent with this prompt (and its salt).
    pub(crate) fn key_hash(&self, key: &str) -> u64 {
        xxh3_64_with_seed(key.as_bytes(), KEY ^ self.seed ^ SEED)
    }

    /// The keys another router instance may know this prompt by, longest
    /// first: its explicit `key`, its own end, then the ends of its last
    /// `n` messages (an earlier turn ended at one of them).
    pub fn shared_keys(&self, key: Option<&str>, n: usize) -> Vec<(usize, u64)> {
        let len = self.len();
        let mut out: Vec<(usize, u64)> = key.map(|k| (len, self.key_hash(k))).into_iter().collect();
        let ends = std::iter::once(len).chain(self.message_ends.iter().rev().take(n).copied());
        let mut last = usize::MAX;
        for pos in ends.filter(|p| *p > 0 && *p <= len) {
            if pos != last {
                out.push((pos, self.end_hash(pos)));
                last = pos;
            }
        }
        out
    }

    /// The hash of the first block, or of the whole prompt when it is shorter:
    /// what `affinity` mode places by when nothing matches.
    pub(crate) fn head_hash(&self) -> u64 {
        match self.blocks.first() {
            Some(h) => *h,
            None => self.end_hash(self.text.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_leading_blocks_share_hashes_whatever_follows() {
        let a = PrefixChain::new(b"aaaabbbbccccXX".to_vec(), vec![], 4);
        let b = PrefixChain::new(b"aaaabbbbddddYYYY".to_vec(), vec![], 4);
        assert_eq!(a.blocks.len(), 3);
        assert_eq!(b.blocks.len(), 4);
        assert_eq!(a.blocks[..2], b.blocks[..2]);
        assert_ne!(a.blocks[2], b.blocks[2]);
    }

    #[test]
    fn end_of_a_prompt_is_found_inside_a_longer_one() {
        let short = PrefixChain::new(b"hello wor".to_vec(), vec![], 4);
        let long = PrefixChain::new(b"hello world, again".to_vec(), vec![], 4);
        assert_eq!(short.end_hash(9), long.end_hash(9));
        assert_ne!(short.end_hash(9), long.end_hash(10));
    }

    #[test]
    fn prompt_shorter_than_a_block_has_an_identity() {
        let a = PrefixChain::new(b"hi".to_vec(), vec![], 1024);
        let b = PrefixChain::new(b"ho".to_vec(), vec![], 1024);
        assert!(a.blocks.is_empty());
        assert_ne!(a.head_hash(), b.head_hash());
    }

    #[test]
    fn an_identity_gives_the_same_text_another_chain_shared_within_it() {
        let text = b"the same system prompt, long enough for blocks".to_vec();
        let plain = PrefixChain::new(text.clone(), vec![], 4);
        let a = PrefixChain::identified(text.clone(), vec![], 4, Some(1));
        let a2 = PrefixChain::identified(text.clone(), vec![], 4, Some(1));
        let b = PrefixChain::identified(text, vec![], 4, Some(2));
        assert_eq!(a.blocks, a2.blocks);
        assert_eq!(a.end_hash(7), a2.end_hash(7));
        for other in [&plain, &b] {
            assert!(a.blocks.iter().all(|h| !other.blocks.contains(h)));
            assert_ne!(a.end_hash(7), other.end_hash(7));
            assert_ne!(a.key_hash("session-1"), other.key_hash("session-1"));
        }
        assert_eq!(a.key_hash("session-1"), a2.key_hash("session-1"));
    }

    #[test]
    fn a_turn_finds_the_key_its_previous_turn_was_shared_under() {
        let t1 = PrefixChain::new(b"system\x1euser one\x1e".to_vec(), vec![7, 16], 4);
        let t2 = PrefixChain::new(
            b"system\x1euser one\x1emodel\x1euser two\x1e".to_vec(),
            vec![7, 16, 22, 31],
            4,
        );
        let written = t1.shared_keys(None, 16)[0];
        assert_eq!(written.0, 16);
        assert!(t2.shared_keys(None, 16).contains(&written));
        let keyed = t2.shared_keys(Some("conv-1"), 16);
        assert_eq!(keyed[0], (31, t2.key_hash("conv-1")));
        assert_eq!(keyed.len(), 1 + 4, "key, own end, message ends 22, 16, 7");
    }

    #[test]
    fn end_keys_differ_from_block_keys_at_a_boundary() {
        let a = PrefixChain::new(b"abcdefgh".to_vec(), vec![], 4);
        assert_ne!(a.end_hash(4), a.blocks[0]);
        assert_ne!(a.end_hash(8), a.blocks[1]);
    }
}
