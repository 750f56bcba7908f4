//! Token-exact placement: each model's tokenizer (`tokenizers` in the
//! config), a chat request's prompt as its engine tokenizes it, and what
//! the replicas whose engines publish KV events (`kv_events`, their state
//! known) hold of it, for the policy (`ReplicaState::reported`).
//!
//! A prompt is tokenized only while some engine's state is known, and only
//! as far as some engine may hold it: the chat template rendered, then the
//! text tokenized piece by piece (the pieces cached, see the `tokens`
//! crate), and before a long piece not in the cache, its first words are
//! tokenized and the rest only when some engine holds the chain of blocks
//! through them. A new document or a new tenant's prompt costs its first
//! words, not its whole length. A request the template refuses, for a model
//! without a tokenizer, or not a chat completion is placed by the router's
//! own index alone, as are the replicas whose engines' state is not known.
//! Adapters' blocks are keyed apart by the engines (their names are not a
//! model's here), so requests naming an adapter are not matched.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use tokens::{Chat, ModelTokens};

use crate::body::INLINE_PARSE_BYTES;
use crate::kv::{chain_keys, namespace, CacheState, EngineBlocks};
use crate::policy::ReplicaState;
use crate::replicas::View;

/// Token ids each model's piece cache holds at most.
const CACHE_IDS: usize = 4 << 20;

/// The tokenizers of the config's models.
#[derive(Default)]
pub struct Exact {
    models: HashMap<String, Arc<ModelTokens>>,
}

impl Exact {
    /// Loads each model's tokenizer files (`model: directory`).
    pub fn load(dirs: &BTreeMap<String, String>) -> Result<Self, tokens::TokensError> {
        let models = dirs
            .iter()
            .map(|(model, dir)| {
                let tokens = ModelTokens::load(Path::new(dir), CACHE_IDS)?;
                Ok((model.clone(), Arc::new(tokens)))
            })
            .collect::<Result<_, tokens::TokensError>>()?;
        Ok(Self { models })
    }

    /// The prompt's tokens as far as some engine may hold them, when some
    /// replica's engine state is known and the request names a model with
    /// a tokenizer (or names none and only one has one). Long bodies are
    /// rendered on the blocking pool.
    pub async fn chat(
        &self,
        body: &bytes::Bytes,
        model: Option<&str>,
        list: &View,
    ) -> Option<Arc<Chat>> {
        let tokens = match model {
            Some(m) => self.models.get(m)?,
            None if self.models.len() == 1 => self.models.values().next()?,
            None => return None,
        };
        let known: Vec<_> = (list.iter())
            .filter_map(|r| r.engine_blocks())
            .filter(|b| lock(b).sync() == CacheState::Known)
            .collect();
        if known.is_empty() {
            return None;
        }
        let inline = body.len() <= INLINE_PARSE_BYTES;
        let (tokens, body) = (Arc::clone(tokens), body.clone());
        let job = move || tokenize(&tokens, &body, &known).map(Arc::new);
        if inline {
            return job();
        }
        tokio::task::spawn_blocking(job).await.ok().flatten()
    }
}

fn lock(blocks: &Mutex<EngineBlocks>) -> MutexGuard<'_, EngineBlocks> {
    blocks.lock().unwrap_or_else(|p| p.into_inner())
}

/// The prompt's ids as far as one of `known` holds their blocks.
fn tokenize(tokens: &ModelTokens, body: &[u8], known: &[Arc<Mutex<EngineBlocks>>]) -> Option<Chat> {
    let prompt = tokens.render(body).ok()?;
    let ns = namespace(0, prompt.salt.as_deref());
    // Per block size, the keys of the whole blocks of the ids so far.
    let mut chains: Vec<(u32, Vec<u64>)> = Vec::new();
    let mut held_somewhere = |ids: &[u32], next: &[u32]| {
        known.iter().any(|b| {
            let blocks = lock(b);
            let Some(size) = blocks.block_size() else {
                return false;
            };
            let bs = size as usize;
            let i = match chains.iter().position(|(s, _)| *s == size) {
                Some(i) => i,
                None => {
                    chains.push((size, Vec::new()));
                    chains.len() - 1
                }
            };
            let keys = &mut chains[i].1;
            let done = keys.len() * bs;
            let whole = ids.len() / bs * bs;
            if whole > done {
                keys.extend(chain_keys(ns, keys.last().copied(), &ids[done..whole], bs));
            }
            let tail: Vec<u32> = ids[whole..].iter().chain(next).copied().collect();
            let last = chain_keys(ns, keys.last().copied(), &tail, bs)
                .last()
                .copied();
            last.or(keys.last().copied())
                .is_none_or(|k| blocks.holds(k))
        })
    };
    let partial = (tokens.pieces)
        .encode_while(&prompt.text, &mut held_somewhere)
        .ok()?;
    let len = prompt.text.len();
    let total = match partial.covered {
        c if c >= len => partial.ids.len(),
        0 => len / 4,
        c => partial.ids.len() * len / c,
    };
    Some(Chat {
        ids: partial.ids,
        total,
        salt: prompt.salt,
    })
}

/// Sets `reported` on each offered replica whose engine's state is known:
/// what it holds of the prompt (`text_len` bytes of canonical text,
/// tokenized as `chat`), in bytes of that text (its tokens held, scaled).
pub fn report(chat: &Chat, text_len: usize, list: &View, offered: &mut [ReplicaState]) {
    let ns = namespace(0, chat.salt.as_deref());
    let mut keys: Vec<(u32, Vec<u64>)> = Vec::new();
    for s in offered.iter_mut().filter(|s| s.live) {
        let r = list.iter().find(|r| r.id == s.id);
        let Some(blocks) = r.and_then(|r| r.engine_blocks()) else {
            continue;
        };
        let blocks = lock(&blocks);
        let (CacheState::Known, Some(size)) = (blocks.sync(), blocks.block_size()) else {
            continue;
        };
        let i = match keys.iter().position(|(b, _)| *b == size) {
            Some(i) => i,
            None => {
                keys.push((size, chain_keys(ns, None, &chat.ids, size as usize)));
                keys.len() - 1
            }
        };
        let held = blocks.matched(&keys[i].1) * size as usize;
        let bytes = held as u128 * text_len as u128 / chat.total.max(1) as u128;
        s.reported = Some((bytes as usize).min(text_len));
    }
}
