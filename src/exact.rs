//! Token-exact placement: each model's tokenizer (`tokenizers` in the
//! config), a chat request's prompt as its engine tokenizes it, and what
//! the replicas whose engines publish KV events (`kv_events`, their state
//! known) hold of it, for the policy (`ReplicaState::engine_held`).
//!
//! A prompt is tokenized only while some engine that may serve it has a
//! known state, and only as far as some engine may hold it: the chat
//! template rendered, then the text tokenized piece by piece (the pieces
//! cached, see the `tokens` crate); before a long piece not in the cache
//! (over 2 KiB, with a space to cut at), its first words are tokenized, and
//! the rest only when some engine holds the chain of blocks through them,
//! and then off the request's path (see `tokenize`). A new tenant's prompt
//! or a new document costs its first words, not its length.
//!
//! Not matched (placed by the router's own index): requests the `tokens`
//! crate does not render as the engine does (a salt, another template,
//! images, ...), for a model without a tokenizer, prompts past
//! `max_prompt_bytes`, other paths than chat completions, and replicas
//! whose engines' state is not known. Adapters' blocks are keyed apart by
//! the engines, so an adapter named in `tokenizers` never matches.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use tokens::ModelTokens;

use crate::body::on_pool;
use crate::kv::{chain_keys, CacheState, EngineBlocks};
use crate::policy::{ReplicaState, BYTES_PER_TOKEN};
use crate::replicas::View;

/// A chat request's prompt as its engine tokenizes it: its first `ids`
/// (all of them unless tokenizing stopped early, see `tokenize`), of about
/// `total`; an engine holding all of them holds about `assumed` more (the
/// rest of a piece not tokenized yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chat {
    pub ids: Vec<u32>,
    pub total: usize,
    pub assumed: usize,
}

impl Chat {
    /// Bytes its ids hold (counted against the request's budget).
    pub fn heap_bytes(&self) -> usize {
        self.ids.len() * std::mem::size_of::<u32>()
    }
}

/// Token ids each model's piece cache holds at most.
const CACHE_IDS: usize = 4 << 20;

/// The tokenizers of the config's models.
#[derive(Default)]
pub struct Exact {
    models: HashMap<String, Arc<ModelTokens>>,
}

impl Exact {
    /// No model has a tokenizer: nothing is matched token for token.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Loads each model's tokenizer files (`model: directory`).
    pub fn load(dirs: &BTreeMap<String, String>) -> Result<Self, tokens::TokensError> {
        let models = dirs
            .iter()
            .map(|(model, dir)| {
                let tokens = ModelTokens::load(Path::new(dir), CACHE_IDS)?;
                if !tokens.pieces.by_pieces() {
                    log::warn!(
                        "tokenizers.{model}: its special tokens do not split its text \
                         cleanly: every prompt is tokenized whole, without the piece cache"
                    );
                }
                Ok((model.clone(), Arc::new(tokens)))
            })
            .collect::<Result<_, tokens::TokensError>>()?;
        Ok(Self { models })
    }

    /// The prompt's tokens as far as some engine may hold them, when the
    /// request names a model with a tokenizer (or names none and only one
    /// has one) and some replica that may serve it has an engine whose
    /// state is known; `None` for a prompt past `max_bytes` rendered or one
    /// not rendered here (see `tokens::ModelTokens::render`). Bodies past
    /// [`INLINE_BYTES`] are read on the blocking pool.
    pub async fn chat(
        &self,
        body: &bytes::Bytes,
        model: Option<&str>,
        list: &View,
        max_bytes: usize,
    ) -> Option<Arc<Chat>> {
        let tokens = match model {
            Some(m) => self.models.get(m)?,
            None if self.models.len() == 1 => self.models.values().next()?,
            None => return None,
        };
        let offered = model.map(|m| list.offers(m));
        let known: Vec<_> = (list.iter().enumerate())
            .filter(|(i, _)| offered.is_none_or(|o| o.get(*i).copied().unwrap_or(false)))
            .filter_map(|(_, r)| r.engine_blocks())
            .filter(|b| lock(b).sync() == CacheState::Known)
            .collect();
        if known.is_empty() {
            return None;
        }
        let inline = body.len() <= INLINE_BYTES;
        let (tokens, body) = (Arc::clone(tokens), body.clone());
        let job = move || tokenize(&tokens, &body, &known, max_bytes).map(Arc::new);
        if inline {
            return job();
        }
        on_pool(job).await
    }
}

/// Bodies up to this size are tokenized on the async worker (a few
/// thousand tokens: a millisecond or two when none is cached).
const INLINE_BYTES: usize = 8 << 10;

fn lock(blocks: &Mutex<EngineBlocks>) -> MutexGuard<'_, EngineBlocks> {
    blocks.lock().unwrap_or_else(|p| p.into_inner())
}

/// The block size of each engine, and the keys of a prompt's whole blocks
/// in each size met, extended as its ids are.
struct Chains {
    engines: Vec<(Arc<Mutex<EngineBlocks>>, Option<u32>)>,
    keys: Vec<(u32, Vec<u64>)>,
}

impl Chains {
    fn new(known: &[Arc<Mutex<EngineBlocks>>]) -> Self {
        let engines = known
            .iter()
            .map(|b| (Arc::clone(b), lock(b).block_size()))
            .collect();
        Self {
            engines,
            keys: Vec::new(),
        }
    }

    /// Whether some engine holds the blocks through `ids` then `next`
    /// (only the last whole block is asked: engines evict a chain from its
    /// end); true while there is no whole block yet.
    fn held(&mut self, ids: &[u32], next: &[u32]) -> bool {
        let mut sizes: Vec<u32> = self.engines.iter().filter_map(|(_, s)| *s).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut last = Vec::with_capacity(sizes.len());
        for size in sizes {
            let bs = size as usize;
            let keys = keys_of(&mut self.keys, size, Vec::new);
            let (done, whole) = (keys.len() * bs, ids.len() / bs * bs);
            if whole > done {
                keys.extend(chain_keys(0, keys.last().copied(), &ids[done..whole], bs));
            }
            let tail: Vec<u32> = ids[whole..].iter().chain(next).copied().collect();
            let ahead = chain_keys(0, keys.last().copied(), &tail, bs)
                .last()
                .copied();
            last.push((size, ahead.or(keys.last().copied())));
        }
        self.engines.iter().any(|(b, size)| {
            let key = last
                .iter()
                .find(|(s, _)| Some(*s) == *size)
                .map(|(_, k)| *k);
            match key {
                Some(Some(k)) => lock(b).holds(k),
                Some(None) => true,
                None => false,
            }
        })
    }
}

/// The prompt's ids as far as one of `known` holds their blocks. A long
/// piece some engine holds that the piece cache does not have yet (another
/// router placed it, a client sent it straight there) is not tokenized on
/// the request's path: its first words place the request (an engine holding
/// them all is taken to hold the piece) and the piece is tokenized on the
/// blocking pool for the next request.
fn tokenize(
    tokens: &Arc<ModelTokens>,
    body: &[u8],
    known: &[Arc<Mutex<EngineBlocks>>],
    max_bytes: usize,
) -> Option<Chat> {
    let text = tokens.render(body).ok().filter(|t| t.len() <= max_bytes)?;
    let mut chains = Chains::new(known);
    let partial = (tokens.pieces)
        .encode_while(&text, true, |ids, next| chains.held(ids, next))
        .ok()?;
    let (assumed, rest) = match &partial.deferred {
        Some(d) => {
            learn_later(tokens, &text[d.piece.clone()]);
            // The rest at the probe's bytes per token.
            let tokens_in = |bytes: usize| bytes * d.probed_ids / d.probed.max(1);
            let assumed = tokens_in(d.piece.len().saturating_sub(d.probed));
            (assumed, tokens_in(text.len() - d.piece.end))
        }
        None => (0, 0),
    };
    let total = match partial.covered {
        c if c >= text.len() => partial.ids.len(),
        _ if partial.deferred.is_some() => partial.ids.len() + assumed + rest,
        0 => text.len() / BYTES_PER_TOKEN as usize,
        c => partial.ids.len() * text.len() / c,
    };
    Some(Chat {
        ids: partial.ids,
        total,
        assumed,
    })
}

/// Tokenizes `piece` into the cache on the blocking pool, when called on
/// the runtime (dropped if the pool is busy past one per core).
fn learn_later(tokens: &Arc<ModelTokens>, piece: &str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (tokens, piece) = (Arc::clone(tokens), piece.to_owned());
    runtime.spawn(on_pool(move || tokens.pieces.learn(&piece).ok()));
}

/// The keys kept for block size `size`, made by `make` the first time.
fn keys_of(
    all: &mut Vec<(u32, Vec<u64>)>,
    size: u32,
    make: impl FnOnce() -> Vec<u64>,
) -> &mut Vec<u64> {
    let i = match all.iter().position(|(s, _)| *s == size) {
        Some(i) => i,
        None => {
            all.push((size, make()));
            all.len() - 1
        }
    };
    &mut all[i].1
}

/// Sets `engine_held` on each offered replica whose engine's state is
/// known: what it holds of the prompt (`text_len` bytes of canonical text,
/// tokenized as `chat`), in bytes of that text (its tokens held, scaled).
/// The keys are computed outside the engines' locks.
pub fn report(chat: &Chat, text_len: usize, list: &View, offered: &mut [ReplicaState]) {
    let mut by_size: Vec<(u32, Vec<u64>)> = Vec::new();
    for s in offered.iter_mut().filter(|s| s.live) {
        let r = list.iter().find(|r| r.id == s.id);
        let Some(blocks) = r.and_then(|r| r.engine_blocks()) else {
            continue;
        };
        let Some(size) = lock(&blocks).block_size() else {
            continue;
        };
        let keys = keys_of(&mut by_size, size, || {
            chain_keys(0, None, &chat.ids, size as usize)
        });
        let blocks = lock(&blocks);
        if blocks.sync() != CacheState::Known || blocks.block_size() != Some(size) {
            continue;
        }
        let matched = blocks.matched(keys);
        // Holding every whole block of the ids: the rest of a deferred
        // piece too (see `tokenize`).
        let held = match matched == keys.len() && chat.assumed > 0 {
            true => chat.ids.len() + chat.assumed,
            false => matched * size as usize,
        };
        let bytes = held as u128 * text_len as u128 / chat.total.max(1) as u128;
        s.engine_held = Some((bytes as usize).min(text_len));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{EngineHash, Event};

    /// SmolLM2's tokenizer (`scripts/real-engine.sh prepare` makes it).
    fn model() -> ModelTokens {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/.real-engine/tokenizer");
        ModelTokens::load(Path::new(dir), 1 << 20).expect("scripts/real-engine.sh prepare")
    }

    /// An engine holding the whole 16-token blocks of `ids`.
    fn engine_holding(ids: &[u32]) -> Arc<Mutex<EngineBlocks>> {
        let mut b = EngineBlocks::new(1 << 16);
        b.start_empty();
        let n = ids.len() / 16;
        b.apply(&Event::Stored {
            hashes: (1..=n as u64).map(EngineHash).collect(),
            parent: None,
            tokens: ids[..n * 16].to_vec(),
            block_size: 16,
            namespace: 0,
        });
        Arc::new(Mutex::new(b))
    }

    fn body(doc: &str) -> Vec<u8> {
        serde_json::json!({"messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": doc}]})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_prompt_is_tokenized_as_far_as_some_engine_holds_it() {
        let m = Arc::new(model());
        let held = "The harbour cranes lift containers all day long. ".repeat(100);
        let ids = m.chat_ids(&body(&held)).expect("ids");
        let engine = [engine_holding(&ids)];
        let chat = tokenize(&m, &body(&held), &engine, usize::MAX).expect("tokens");
        assert_eq!(
            (chat.ids.as_slice(), chat.total),
            (ids.as_slice(), ids.len())
        );
        // Another document after the same system prompt: its first words
        // are held nowhere, so the rest is not tokenized.
        let other = "Airport gates open at dawn for the first flights out. ".repeat(100);
        let chat = tokenize(&m, &body(&other), &engine, usize::MAX).expect("tokens");
        assert!(
            chat.ids.len() < 16,
            "stopped before the document: {}",
            chat.ids.len()
        );
        let whole = m.chat_ids(&body(&other)).expect("ids").len();
        assert!(
            chat.total > whole / 2 && chat.total < whole * 2,
            "{} ~ {whole}",
            chat.total
        );
        // Held by an engine, not in this router's cache (another router
        // placed it): its first words place it, an engine holding them all
        // is taken to hold the rest of the piece (`assumed`).
        let elsewhere = "Rail timetables for the coming winter season. ".repeat(100);
        let ids = model().chat_ids(&body(&elsewhere)).expect("ids");
        let engine = [engine_holding(&ids)];
        let chat = tokenize(&m, &body(&elsewhere), &engine, usize::MAX).expect("tokens");
        assert!(
            chat.ids.len() < ids.len() / 2,
            "{} of {}",
            chat.ids.len(),
            ids.len()
        );
        assert_eq!(chat.ids.as_slice(), &ids[..chat.ids.len()]);
        let whole = chat.ids.len() + chat.assumed;
        assert!(
            whole > ids.len() * 3 / 4 && whole < ids.len() * 5 / 4,
            "{whole} ~ {}",
            ids.len()
        );
        // No engine with a block size yet (nothing heard): none holds it.
        let none = [Arc::new(Mutex::new(EngineBlocks::new(16)))];
        let third = "Weather reports for the northern coast this week. ".repeat(100);
        let chat = tokenize(&m, &body(&third), &none, usize::MAX).expect("tokens");
        assert!(chat.ids.len() < 16, "{}", chat.ids.len());
        // Not matched: a prompt past the bound, or one with a salt.
        assert!(tokenize(&m, &body(&held), &engine, 1000).is_none());
        let mut salted: serde_json::Value = serde_json::from_slice(&body(&held)).expect("json");
        salted["cache_salt"] = "tenant-a".into();
        let salted = salted.to_string().into_bytes();
        assert!(tokenize(&m, &salted, &engine, usize::MAX).is_none());
    }
}
