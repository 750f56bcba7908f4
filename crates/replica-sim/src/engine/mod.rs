//! The model of one card, as a deterministic step function in model time.
//!
//! ```text
//! KV POOL    kv_tokens / block_tokens blocks, shared by running sequences and
//!            cached prefix blocks (the seed's capacity wall comes from this).
//!            Full prompt blocks are identified by a hash chain (seeded by the
//!            request's identity: `cache_salt`, model, tools, as vLLM's
//!            cache keys carry them) and stay cached,
//!            unreferenced, after their sequence ends (tail first, as vLLM
//!            frees them); LRU eviction frees them.
//! ADMISSION  FIFO: a waiting request starts when blocks for its whole prompt
//!            (cached ones are shared, not copied) and its first output block fit,
//!            and fewer than `max_num_seqs` run (when set).
//! STEP       continuous batching with chunked prefill: every decoding sequence
//!            gets one token, then prefilling sequences share the rest of a
//!            `chunk_tokens` budget in arrival order.
//!            time = prefill tokens / prefill_tps
//!                 + (decoding ? 1 / decode_tps : 0)
//!                 + cached tokens of sequences whose prefill starts * reuse_s_per_token
//! PREEMPTION a decoding sequence that needs a block when none is free evicts
//!            cached blocks first, then preempts the newest running sequence,
//!            which restarts from the queue head (recompute, as vLLM does).
//! TOKENS     bytes / bytes_per_token of the canonical prompt text (4: close to
//!            BPE tokenizers on English and code); or, with the model's tokenizer
//!            (`submit_ids`), the prompt's token ids, blocks chained over them.
//! EVENTS     with `record_kv`, what the pool's cache gains and loses, as vLLM's
//!            KV events say it: blocks newly cached at admission (their tokens,
//!            after their parent), blocks evicted or dropped by a reset.
//! ```
//! Calibration (docs/simulator.md): prefill_tps 33,300 and reuse 1.2e-5 s/token
//! give a 90k-token prompt 2.7 s cold and ~1.1 s warm, the seed's figures.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Engine parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kv_tokens: u64,
    pub block_tokens: u64,
    pub bytes_per_token: u64,
    /// Prefill throughput, tokens per model second.
    pub prefill_tps: f64,
    /// One decode step for the whole batch, per model second.
    pub decode_tps: f64,
    /// Model seconds per cached token reused by a prefill (attention over it).
    pub reuse_s_per_token: f64,
    /// Token budget of one step (chunked prefill).
    pub chunk_tokens: u64,
    /// At most this many sequences run at once (vLLM's `max_num_seqs`).
    pub max_num_seqs: Option<usize>,
}

/// A sequence's identity, chosen by the caller.
pub type SeqId = u64;

/// What a step produced for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Prefill finished: the first token is out.
    First {
        prompt_tokens: u64,
        cached_tokens: u64,
    },
    /// One more token.
    Token,
    /// The last token; the sequence left the card.
    Done,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    /// Hash of each full prompt block.
    blocks: Vec<u64>,
    /// Its token ids, when submitted by them (for the KV events).
    ids: Option<Arc<[u32]>>,
    prompt_tokens: u64,
    max_tokens: u64,
    cached_tokens: u64,
    prefilled: u64,
    generated: u64,
    /// Private blocks (partial prompt block and output).
    private_blocks: u64,
    /// Whether its shared blocks are referenced (admitted).
    admitted: bool,
}

impl Seq {
    fn in_prefill(&self) -> bool {
        self.prefilled < self.prompt_tokens
    }
}

/// The card.
#[derive(Debug)]
pub struct Engine {
    pub cfg: EngineConfig,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Cached block hash -> references from running sequences.
    refs: HashMap<u64, u32>,
    /// Unreferenced cached blocks, least recently used first (hash, stamp).
    lru: VecDeque<(u64, u64)>,
    /// Last release stamp of each unreferenced block (stale `lru` records skip).
    released: HashMap<u64, u64>,
    stamp: u64,
    private_in_use: u64,
    pub counters: Counters,
    /// The cache's changes since last taken (`record_kv`), else `None`.
    kv_log: Option<Vec<KvChange>>,
}

/// A change to the cached blocks, as a KV event reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvChange {
    /// Blocks newly cached, in chain order after `parent` (`None`: the
    /// prompt's start), with their tokens.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed(Vec<u64>),
    /// Every block dropped (vLLM's `AllBlocksCleared`).
    Cleared,
}

/// Lifetime counters, named after vLLM's metrics.
#[derive(Debug, Default, Clone)]
pub struct Counters {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests: u64,
    pub preemptions: u64,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Self {
        Self {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            refs: HashMap::new(),
            lru: VecDeque::new(),
            released: HashMap::new(),
            stamp: 0,
            private_in_use: 0,
            counters: Counters::default(),
            kv_log: None,
        }
    }

    /// Records the cache's changes from now on ([`Engine::take_kv`]).
    pub fn record_kv(&mut self) {
        self.kv_log.get_or_insert_with(Vec::new);
    }

    /// The cache's changes recorded since the last call.
    pub fn take_kv(&mut self) -> Vec<KvChange> {
        self.kv_log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn log_removed(&mut self, hashes: Vec<u64>) {
        if let (Some(log), false) = (&mut self.kv_log, hashes.is_empty()) {
            log.push(KvChange::Removed(hashes));
        }
    }

    fn capacity(&self) -> u64 {
        self.cfg.kv_tokens / self.cfg.block_tokens.max(1)
    }

    fn used(&self) -> u64 {
        self.refs.len() as u64 + self.released.len() as u64 + self.private_in_use
    }

    /// Fraction of KV blocks held by running sequences (vLLM's kv_cache_usage_perc).
    pub fn kv_usage(&self) -> f64 {
        (self.refs.len() as u64 + self.private_in_use) as f64 / self.capacity().max(1) as f64
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Token count of a prompt text.
    pub fn tokens(&self, text: &[u8]) -> u64 {
        (text.len() as u64)
            .div_ceil(self.cfg.bytes_per_token)
            .max(1)
    }

    /// Queues a request with its canonical prompt text. Like vLLM's
    /// `max_model_len` check, a request that could not fit the card alone is
    /// refused. Its block hash chain is seeded by `salt` (vLLM's `cache_salt`:
    /// only requests of one salt share cached blocks; 0: none).
    pub fn submit(
        &mut self,
        id: SeqId,
        text: &[u8],
        salt: u64,
        max_tokens: u64,
    ) -> Result<(), String> {
        let blocks = self.blocks_of(text, salt);
        self.enqueue(id, blocks, self.tokens(text), None, max_tokens)
    }

    /// As [`Engine::submit`], the prompt given by its token ids.
    pub fn submit_ids(
        &mut self,
        id: SeqId,
        ids: Arc<[u32]>,
        salt: u64,
        max_tokens: u64,
    ) -> Result<(), String> {
        let blocks = self.blocks_of_ids(&ids, salt);
        self.enqueue(id, blocks, ids.len().max(1) as u64, Some(ids), max_tokens)
    }

    fn enqueue(
        &mut self,
        id: SeqId,
        blocks: Vec<u64>,
        prompt_tokens: u64,
        ids: Option<Arc<[u32]>>,
        max_tokens: u64,
    ) -> Result<(), String> {
        let limit = self.capacity() * self.cfg.block_tokens - 2 * self.cfg.block_tokens;
        if prompt_tokens + max_tokens > limit {
            return Err(format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
                prompt_tokens + max_tokens
            ));
        }
        self.waiting.push_back(Seq {
            id,
            blocks,
            ids,
            prompt_tokens,
            max_tokens: max_tokens.max(1),
            cached_tokens: 0,
            prefilled: 0,
            generated: 0,
            private_blocks: 0,
            admitted: false,
        });
        self.counters.requests += 1;
        Ok(())
    }

    /// The hash of each full block of token ids, chained from `salt`.
    fn blocks_of_ids(&self, ids: &[u32], salt: u64) -> Vec<u64> {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.chain(&bytes, (self.cfg.block_tokens * 4).max(4) as usize, salt)
    }

    /// The hash of each full block of a prompt text, chained from `salt`.
    fn blocks_of(&self, text: &[u8], salt: u64) -> Vec<u64> {
        let block_bytes = (self.cfg.block_tokens * self.cfg.bytes_per_token).max(1) as usize;
        self.chain(text, block_bytes, salt)
    }

    fn chain(&self, bytes: &[u8], block_bytes: usize, salt: u64) -> Vec<u64> {
        let chain = |h: &mut u64, b: &[u8]| {
            *h = xxh3_64_with_seed(b, *h);
            Some(*h)
        };
        bytes.chunks_exact(block_bytes).scan(salt, chain).collect()
    }

    /// Tokens of a prompt's longest prefix held now (an oracle's view): its
    /// text, or its token ids when given.
    pub fn cached_tokens(&self, text: &[u8], ids: Option<&[u32]>, salt: u64) -> u64 {
        let held = |h: &&u64| self.refs.contains_key(h) || self.released.contains_key(h);
        let blocks = match ids {
            Some(ids) => self.blocks_of_ids(ids, salt),
            None => self.blocks_of(text, salt),
        };
        blocks.iter().take_while(held).count() as u64 * self.cfg.block_tokens
    }

    /// Prompt tokens still to prefill before a request sent now would start
    /// its own (an oracle's view): the waiting sequences' prompts less what
    /// the cache holds of them now, and the rest of those in prefill.
    pub fn queued_prefill_tokens(&self) -> u64 {
        let held = |h: &&u64| self.refs.contains_key(h) || self.released.contains_key(h);
        let waiting = self.waiting.iter().map(|s| {
            let cached = s.blocks.iter().take_while(held).count() as u64 * self.cfg.block_tokens;
            s.prompt_tokens.saturating_sub(cached)
        });
        let prefilling = self
            .running
            .iter()
            .map(|s| s.prompt_tokens - s.prefilled.min(s.prompt_tokens));
        waiting.chain(prefilling).sum()
    }

    /// Empties the prefix cache (a restart): unheld cached blocks dropped.
    /// With none held (nothing running), every block is: told as vLLM's
    /// `reset_prefix_cache` tells it, `AllBlocksCleared`; else the blocks
    /// dropped are told removed.
    pub fn reset_cache(&mut self) -> usize {
        let dropped: Vec<u64> = self.released.drain().map(|(h, _)| h).collect();
        self.lru.clear();
        let n = dropped.len();
        match (&mut self.kv_log, self.refs.is_empty()) {
            (Some(log), true) => log.push(KvChange::Cleared),
            _ => self.log_removed(dropped),
        }
        n
    }

    /// Drops a request wherever it is (the client left); its blocks are released.
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.release(&s);
        }
    }

    /// Runs one step: returns its model duration and the events it produced.
    /// Zero duration and no events when idle.
    pub fn step(&mut self) -> (f64, Vec<(SeqId, Event)>) {
        self.admit();
        let mut events = Vec::new();
        let mut budget = self.cfg.chunk_tokens.max(1);
        let mut decoding = false;
        let mut prefill_tokens = 0u64;
        let mut reuse_tokens = 0u64;
        // Decode first: one token per sequence past its prefill.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].in_prefill() || budget == 0 {
                i += 1;
                continue;
            }
            if !self.grow(i) {
                continue; // preempted something; re-examine index i
            }
            let s = &mut self.running[i];
            s.generated += 1;
            budget -= 1;
            decoding = true;
            self.counters.generation_tokens += 1;
            if s.generated >= s.max_tokens {
                events.push((s.id, Event::Done));
                let s = self.running.remove(i);
                self.release(&s);
            } else {
                events.push((s.id, Event::Token));
                i += 1;
            }
        }
        // Prefill chunks in arrival order.
        for s in self.running.iter_mut().filter(|s| s.in_prefill()) {
            if budget == 0 {
                break;
            }
            if s.prefilled == s.cached_tokens {
                reuse_tokens += s.cached_tokens;
            }
            let n = (s.prompt_tokens - s.prefilled).min(budget);
            s.prefilled += n;
            budget -= n;
            prefill_tokens += n;
            if !s.in_prefill() {
                // The prefill step also yields the first token.
                s.generated = 1;
                self.counters.generation_tokens += 1;
                events.push((
                    s.id,
                    Event::First {
                        prompt_tokens: s.prompt_tokens,
                        cached_tokens: s.cached_tokens,
                    },
                ));
                if s.max_tokens == 1 {
                    events.push((s.id, Event::Done));
                }
            }
        }
        let done: Vec<SeqId> = self
            .running
            .iter()
            .filter(|s| !s.in_prefill() && s.generated >= s.max_tokens)
            .map(|s| s.id)
            .collect();
        for id in done {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(i);
                self.release(&s);
            }
        }
        let mut t = prefill_tokens as f64 / self.cfg.prefill_tps
            + reuse_tokens as f64 * self.cfg.reuse_s_per_token;
        if decoding {
            t += 1.0 / self.cfg.decode_tps;
        }
        (t, events)
    }

    /// Starts waiting requests, in order, while their blocks fit.
    fn admit(&mut self) {
        while let Some(s) = self.waiting.front() {
            if self
                .cfg
                .max_num_seqs
                .is_some_and(|m| self.running.len() >= m)
            {
                return;
            }
            let cached = s
                .blocks
                .iter()
                .take_while(|h| self.refs.contains_key(h) || self.released.contains_key(h))
                .count() as u64;
            let full = s.blocks.len() as u64;
            let partial = u64::from(s.prompt_tokens % self.cfg.block_tokens != 0);
            // New shared blocks, the partial block, and room for the first output tokens.
            let need = (full - cached) + partial + 1;
            let reusable = s.blocks[..cached as usize]
                .iter()
                .filter(|h| self.released.contains_key(h))
                .count() as u64;
            let free = self.capacity().saturating_sub(self.used());
            let evictable = self.released.len() as u64 - reusable;
            if need > free + evictable {
                return;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                return;
            };
            for h in &s.blocks[..cached as usize] {
                self.reference(*h);
            }
            while self.capacity() < self.used() + need && self.evict_one() {}
            for (k, h) in s.blocks.iter().enumerate().skip(cached as usize) {
                let known = self.refs.contains_key(h) || self.released.contains_key(h);
                if self.kv_log.is_some() && !known {
                    self.log_stored(&s, k);
                }
                self.reference(*h);
            }
            s.private_blocks = partial + 1;
            self.private_in_use += s.private_blocks;
            s.cached_tokens =
                (cached * self.cfg.block_tokens).min(s.prompt_tokens.saturating_sub(1));
            s.prefilled = s.cached_tokens;
            s.admitted = true;
            self.counters.prefix_queries += s.prompt_tokens;
            self.counters.prefix_hits += s.cached_tokens;
            self.counters.prompt_tokens += s.prompt_tokens;
            self.running.push(s);
        }
    }

    /// Gives running sequence `i` room for one more token; may evict cached
    /// blocks or preempt the newest sequence. False when `i` itself moved.
    fn grow(&mut self, i: usize) -> bool {
        let s = &self.running[i];
        let tokens = s.prompt_tokens + s.generated + 1;
        let held = s.blocks.len() as u64 + s.private_blocks;
        if tokens <= held * self.cfg.block_tokens {
            return true;
        }
        loop {
            if self.used() < self.capacity() {
                self.running[i].private_blocks += 1;
                self.private_in_use += 1;
                return true;
            }
            if self.evict_one() {
                continue;
            }
            // Preempt the newest sequence (possibly `i` itself): recompute later.
            let Some(victim) = self.running.pop() else {
                return false;
            };
            self.release(&victim);
            self.counters.preemptions += 1;
            let last = self.running.len();
            self.waiting.push_front(Seq {
                cached_tokens: 0,
                prefilled: 0,
                generated: 0,
                private_blocks: 0,
                admitted: false,
                ..victim
            });
            if last == i {
                return false;
            }
        }
    }

    fn reference(&mut self, h: u64) {
        self.released.remove(&h);
        *self.refs.entry(h).or_insert(0) += 1;
    }

    fn release(&mut self, s: &Seq) {
        if !s.admitted {
            return;
        }
        self.private_in_use -= s.private_blocks;
        // Tail first, as vLLM frees a request's blocks: under pressure a
        // cached prefix is shortened, not cut at its head.
        for h in s.blocks.iter().rev() {
            if let Some(n) = self.refs.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.refs.remove(h);
                    self.stamp += 1;
                    self.released.insert(*h, self.stamp);
                    self.lru.push_back((*h, self.stamp));
                }
            }
        }
    }

    fn evict_one(&mut self) -> bool {
        while let Some((h, stamp)) = self.lru.pop_front() {
            if self.released.get(&h) == Some(&stamp) {
                self.released.remove(&h);
                self.log_removed(vec![h]);
                return true;
            }
        }
        false
    }

    /// Logs block `k` of `s` as newly cached: into the last event when it
    /// continues it, else a new one after its parent.
    fn log_stored(&mut self, s: &Seq, k: usize) {
        let (Some(log), Some(ids)) = (&mut self.kv_log, &s.ids) else {
            return;
        };
        let bt = self.cfg.block_tokens as usize;
        let tokens = &ids[k * bt..(k + 1) * bt];
        let parent = k.checked_sub(1).map(|p| s.blocks[p]);
        if let Some(KvChange::Stored {
            hashes, tokens: t, ..
        }) = log.last_mut()
        {
            if hashes.last().copied() == parent && parent.is_some() {
                hashes.push(s.blocks[k]);
                t.extend_from_slice(tokens);
                return;
            }
        }
        log.push(KvChange::Stored {
            hashes: vec![s.blocks[k]],
            parent,
            tokens: tokens.to_vec(),
        });
    }
}

#[cfg(test)]
mod tests;
