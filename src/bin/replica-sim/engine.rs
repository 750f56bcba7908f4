//! The model of one card: a prefix cache of token blocks with LRU eviction,
//! prefill and decode rates, and the counters vLLM exports. Time is model time;
//! the HTTP layer divides by `--time-scale` when it sleeps.
//!
//! Tokens are estimated as `bytes / bytes_per_token` of the prompt text (4 by
//! default, close to BPE tokenizers on English). The prompt text is the same
//! canonical text the router hashes, so a cache hit here means the same prefix.

use std::collections::{HashMap, VecDeque};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Engine parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kv_tokens: u64,
    pub block_tokens: u64,
    pub bytes_per_token: u64,
    /// Prefill throughput, tokens per model second.
    pub prefill_tps: f64,
}

/// What admitting a prompt cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Model seconds of prefill for the uncached tokens.
    pub prefill_s: f64,
}

/// The card's state.
#[derive(Debug)]
pub struct Engine {
    pub cfg: EngineConfig,
    /// Cached block hash -> last use tick.
    blocks: HashMap<u64, u64>,
    lru: VecDeque<(u64, u64)>,
    tick: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub requests_total: u64,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Self {
        Self {
            cfg,
            blocks: HashMap::new(),
            lru: VecDeque::new(),
            tick: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            requests_total: 0,
        }
    }

    fn capacity_blocks(&self) -> usize {
        (self.cfg.kv_tokens / self.cfg.block_tokens.max(1)) as usize
    }

    /// Fraction of the KV pool holding cached blocks.
    pub fn kv_usage(&self) -> f64 {
        self.blocks.len() as f64 / self.capacity_blocks().max(1) as f64
    }

    /// Looks the prompt's blocks up, caches them, and prices the prefill.
    pub fn admit(&mut self, text: &[u8]) -> Admission {
        let block_bytes = (self.cfg.block_tokens * self.cfg.bytes_per_token).max(1) as usize;
        let prompt_tokens = (text.len() as u64)
            .div_ceil(self.cfg.bytes_per_token)
            .max(1);
        let mut h = 0u64;
        let mut cached_blocks = 0u64;
        let mut matching = true;
        let mut hashes = Vec::with_capacity(text.len() / block_bytes);
        for block in text.chunks_exact(block_bytes) {
            h = xxh3_64_with_seed(block, h);
            hashes.push(h);
            if matching && self.blocks.contains_key(&h) {
                cached_blocks += 1;
            } else {
                matching = false;
            }
        }
        for h in hashes {
            self.touch(h);
        }
        let cached_tokens = (cached_blocks * self.cfg.block_tokens).min(prompt_tokens);
        self.prefix_queries += prompt_tokens;
        self.prefix_hits += cached_tokens;
        self.prompt_tokens_total += prompt_tokens;
        self.requests_total += 1;
        Admission {
            prompt_tokens,
            cached_tokens,
            prefill_s: (prompt_tokens - cached_tokens) as f64 / self.cfg.prefill_tps,
        }
    }

    fn touch(&mut self, h: u64) {
        self.tick += 1;
        self.blocks.insert(h, self.tick);
        self.lru.push_back((h, self.tick));
        while self.blocks.len() > self.capacity_blocks() {
            match self.lru.pop_front() {
                // Only the newest record of a block counts; older ones are stale.
                Some((old, t)) if self.blocks.get(&old) == Some(&t) => {
                    self.blocks.remove(&old);
                }
                Some(_) => {}
                None => break,
            }
        }
        if self.lru.len() > 4 * self.capacity_blocks().max(1024) {
            let blocks = &self.blocks;
            self.lru.retain(|(h, t)| blocks.get(h) == Some(t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(kv_tokens: u64) -> Engine {
        Engine::new(EngineConfig {
            kv_tokens,
            block_tokens: 16,
            bytes_per_token: 4,
            prefill_tps: 1000.0,
        })
    }

    #[test]
    fn a_repeated_prompt_is_served_from_cache() {
        let mut e = engine(10_000);
        let text = vec![b'a'; 6400];
        let cold = e.admit(&text);
        let warm = e.admit(&text);
        assert_eq!(cold.cached_tokens, 0);
        assert_eq!(warm.cached_tokens, 1600);
        assert!(warm.prefill_s < cold.prefill_s / 10.0);
    }

    #[test]
    fn cache_is_bounded_by_kv_tokens() {
        let mut e = engine(160); // 10 blocks
        let a: Vec<u8> = (0..6400u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..6400u32).map(|i| (i % 241) as u8).collect();
        e.admit(&a);
        e.admit(&b);
        assert!(e.kv_usage() <= 1.0);
        assert_eq!(e.admit(&a).cached_tokens, 0, "a was evicted by b");
    }
}
