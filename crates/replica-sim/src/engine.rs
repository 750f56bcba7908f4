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
//!            BPE tokenizers on English and code).
//! ```
//! Calibration (docs/simulator.md): prefill_tps 33,300 and reuse 1.2e-5 s/token
//! give a 90k-token prompt 2.7 s cold and ~1.1 s warm, the seed's figures.

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
        let prompt_tokens = self.tokens(text);
        let limit = self.capacity() * self.cfg.block_tokens - 2 * self.cfg.block_tokens;
        if prompt_tokens + max_tokens > limit {
            return Err(format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
                prompt_tokens + max_tokens
            ));
        }
        let blocks = self.blocks_of(text, salt);
        self.waiting.push_back(Seq {
            id,
            blocks,
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

    /// The hash of each full block of a prompt text, chained from `salt`.
    fn blocks_of(&self, text: &[u8], salt: u64) -> Vec<u64> {
        let block_bytes = (self.cfg.block_tokens * self.cfg.bytes_per_token).max(1) as usize;
        let chain = |h: &mut u64, b: &[u8]| {
            *h = xxh3_64_with_seed(b, *h);
            Some(*h)
        };
        text.chunks_exact(block_bytes).scan(salt, chain).collect()
    }

    /// Tokens of a prompt's longest prefix held now (an oracle's view).
    pub fn cached_tokens(&self, text: &[u8], salt: u64) -> u64 {
        let held = |h: &&u64| self.refs.contains_key(h) || self.released.contains_key(h);
        self.blocks_of(text, salt).iter().take_while(held).count() as u64 * self.cfg.block_tokens
    }

    /// Empties the prefix cache (a restart): unheld cached blocks dropped.
    pub fn reset_cache(&mut self) -> usize {
        let dropped = self.released.len();
        self.released.clear();
        self.lru.clear();
        dropped
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
            for h in &s.blocks[cached as usize..] {
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
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calibrated card (the binary's defaults).
    fn card(kv_tokens: u64) -> Engine {
        Engine::new(EngineConfig {
            kv_tokens,
            block_tokens: 16,
            bytes_per_token: 4,
            prefill_tps: 33_300.0,
            decode_tps: 50.0,
            reuse_s_per_token: 1.2e-5,
            chunk_tokens: 8192,
            max_num_seqs: None,
        })
    }

    /// Runs until idle; returns (model time, TTFT and finish time per sequence).
    fn run(e: &mut Engine) -> (f64, HashMap<SeqId, (f64, f64, u64)>) {
        let mut t = 0.0;
        let mut out: HashMap<SeqId, (f64, f64, u64)> = HashMap::new();
        while !e.idle() {
            let (dt, events) = e.step();
            t += dt;
            for (id, ev) in events {
                match ev {
                    Event::First { cached_tokens, .. } => {
                        out.insert(id, (t, 0.0, cached_tokens));
                    }
                    Event::Done => out.get_mut(&id).expect("first").1 = t,
                    Event::Token => {}
                }
            }
        }
        (t, out)
    }

    fn text(salt: u64, tokens: u64) -> Vec<u8> {
        let line = format!("document {salt}: some words about the topic at hand. ");
        line.repeat((tokens * 4) as usize / line.len() + 1)
            .into_bytes()[..(tokens * 4) as usize]
            .to_vec()
    }

    #[test]
    fn ninety_k_tokens_prefill_cold_in_2_7_s_and_warm_in_about_1_1_s() {
        let mut e = card(122_636);
        let prompt = text(1, 90_000);
        e.submit(1, &prompt, 0, 1).unwrap();
        let (_, cold) = run(&mut e);
        let mut longer = prompt.clone();
        longer.extend_from_slice(&text(2, 1_000));
        e.submit(2, &longer, 0, 1).unwrap();
        let (_, warm) = run(&mut e);
        let (cold, warm) = (cold[&1].0, warm[&2].0);
        assert!((cold - 2.7).abs() < 0.1, "cold {cold}");
        assert!((warm - 1.1).abs() < 0.1, "warm {warm}");
    }

    #[test]
    fn max_num_seqs_admits_the_next_request_when_one_finishes() {
        // 30k-token prompts (~0.9 s of prefill each), 100 output tokens (2 s).
        let pair = |max_num_seqs| {
            let mut e = card(122_636);
            e.cfg.max_num_seqs = max_num_seqs;
            e.submit(1, &text(1, 30_000), 0, 100).unwrap();
            e.submit(2, &text(2, 30_000), 0, 100).unwrap();
            let (_, out) = run(&mut e);
            (out[&1], out[&2])
        };
        let (first, second) = pair(Some(1));
        assert!(
            second.0 > first.1,
            "started after the first ended: {first:?} {second:?}"
        );
        let (first, second) = pair(None);
        assert!(second.0 < first.1, "ran beside it: {first:?} {second:?}");
    }

    #[test]
    fn a_running_sequence_and_cached_prefixes_share_the_pool() {
        let mut e = card(16 * 100); // 100 blocks
        e.submit(1, &text(1, 16 * 60), 0, 1).unwrap();
        run(&mut e);
        e.submit(2, &text(2, 16 * 60), 0, 1).unwrap();
        run(&mut e);
        // Only 100 blocks: the second prompt (60 blocks and one for its
        // output) evicted 21 of the first's; as in vLLM, a prefix loses its
        // tail first, so its first 39 blocks still hit.
        e.submit(3, &text(1, 16 * 60), 0, 1).unwrap();
        let (_, out) = run(&mut e);
        assert_eq!(out[&3].2, 16 * 39);
    }

    #[test]
    fn decode_waits_for_nothing_but_its_batch() {
        let mut e = card(122_636);
        e.submit(1, &text(1, 100), 0, 50).unwrap();
        let (t, out) = run(&mut e);
        // 49 decode steps at 50 steps/s after a tiny prefill.
        assert!((out[&1].1 - 0.98).abs() < 0.02 && t == out[&1].1, "{out:?}");
    }

    /// Makespan of `n` distinct cold prompts of `tokens` tokens submitted at once.
    fn burst(n: u64, tokens: u64, max_tokens: u64) -> f64 {
        let mut e = card(122_636);
        for i in 0..n {
            e.submit(i, &text(i + 100, tokens), 0, max_tokens).unwrap();
        }
        run(&mut e).0
    }

    #[test]
    fn sixteen_cold_20k_prompts_take_about_30_s_on_one_card_and_18_6_on_two() {
        let one_card = burst(16, 20_000, 350);
        let two_cards = burst(8, 20_000, 350); // each card takes half
        assert!((one_card - 30.1).abs() < 1.5, "one card {one_card}");
        assert!((two_cards - 18.6).abs() < 1.0, "two cards {two_cards}");
    }

    #[test]
    fn only_requests_of_one_salt_share_cached_blocks() {
        let mut e = card(122_636);
        let prompt = text(1, 10_000);
        e.submit(1, &prompt, 7, 1).unwrap();
        run(&mut e);
        e.submit(2, &prompt, 8, 1).unwrap();
        e.submit(3, &prompt, 0, 1).unwrap();
        let (_, other) = run(&mut e);
        assert_eq!((other[&2].2, other[&3].2), (0, 0), "other salts, or none");
        e.submit(4, &prompt, 7, 1).unwrap();
        let (_, same) = run(&mut e);
        assert!(same[&4].2 > 9_000, "same salt: {same:?}");
    }

    #[test]
    fn a_request_larger_than_the_card_is_refused() {
        let mut e = card(1_000);
        assert!(e
            .submit(1, &text(1, 2_000), 0, 1)
            .unwrap_err()
            .contains("maximum context length"));
    }

    #[test]
    fn preemption_frees_room_and_everything_still_finishes() {
        let mut e = card(16 * 40);
        for i in 0..3 {
            e.submit(i, &text(i + 10, 16 * 10), 0, 200).unwrap();
        }
        let (_, out) = run(&mut e);
        assert_eq!(out.len(), 3);
        assert!(out.values().all(|(_, done, _)| *done > 0.0));
        assert!(e.counters.preemptions > 0);
    }
}
