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
//! and then off the request's path (see `Work::tokenize`). On the path, a
//! new tenant's prompt or a new document costs its first words, not its
//! length. A long conversation's turn keeps its tokens with its body's
//! checkpoint (`request::Turn`): the next turn renders and tokenizes only its
//! new messages.
//!
//! Not matched (placed by the router's own index): requests the `tokens`
//! crate does not render as the engine does (a salt, another template,
//! images, ...), for a model without a tokenizer, prompts past
//! `max_prompt_bytes`, other paths than chat completions, and replicas
//! whose engines' state is not known. Adapters' blocks are keyed apart by
//! the engines, so an adapter named in `tokenizers` never matches.

mod chains;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use routing::request::{Checkpoints, Kept, Turn, Turns};
use tokens::{Earlier, ModelTokens};

use crate::body::on_pool;
use crate::kv::{CacheState, EngineBlocks};
use crate::policy::{ReplicaState, BYTES_PER_TOKEN};
use crate::replicas::View;
use chains::{Blocks, Chains};

/// A chat request's prompt as its engine tokenizes it: the keys of the
/// whole blocks of its first `len` ids (all of them unless tokenizing
/// stopped early, see `tokenize`) in each block size of the engines, of
/// about `total` ids; an engine holding all of them holds about `assumed`
/// more (the rest of a piece not tokenized yet). `continued`: from its
/// conversation's earlier turn (only the new messages rendered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chat {
    pub keys: Vec<(u32, Vec<u64>)>,
    pub len: usize,
    pub total: usize,
    pub assumed: usize,
    pub continued: bool,
}

impl Chat {
    /// Bytes its keys hold (counted against the request's budget).
    pub fn heap_bytes(&self) -> usize {
        self.keys.iter().map(|(_, k)| k.len() * 8).sum()
    }
}

/// What a conversation's turn leaves with its body's checkpoint for the
/// next: the model it was tokenized for, the render and ids to continue
/// from (`tokens::Earlier`) and the block chains of those ids.
struct Memo {
    tokens: Weak<ModelTokens>,
    earlier: Earlier,
    blocks: Vec<Blocks>,
}

/// Token ids each model's piece cache holds at most.
const CACHE_IDS: usize = 4 << 20;

/// The tokenizers of the config's models.
#[derive(Default)]
pub struct Exact {
    models: HashMap<String, Arc<ModelTokens>>,
}

/// Where a body's turn is continued from and left for the next (see
/// `request::Turn`), and the store that keeps it within `budget` bytes.
pub struct Continuity {
    pub turns: Turns,
    pub checkpoints: Arc<Checkpoints>,
    pub budget: usize,
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
                } else if !tokens.pieces.ids_only() {
                    log::info!(
                        "tokenizers.{model}: not a byte-level BPE of the shape merged here \
                         (docs/routing.md): its pieces are tokenized by tokenizers"
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
    /// not rendered here (see `tokens::ModelTokens::render`). A turn that
    /// continues one whose tokens were kept with its checkpoint renders and
    /// tokenizes only its new messages: on the async worker when they (and
    /// what is rendered again with them) are short. Otherwise bodies past
    /// [`INLINE_BYTES`] are read on the blocking pool.
    pub async fn chat(
        &self,
        body: &bytes::Bytes,
        model: Option<&str>,
        list: &View,
        max_bytes: usize,
        continuity: Continuity,
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
        let work = Work {
            tokens: Arc::clone(tokens),
            body: body.clone(),
            known,
            max_bytes,
            continuity,
        };
        let inline = || match work.short_turn() {
            Some(done) => Some(done),
            None if body.len() <= INLINE_BYTES => Some(work.tokenize(true).ok().flatten()),
            None => None,
        };
        // A panic inside `tokenizers` or the template costs only the exact
        // placement (the pool's is caught by its join).
        let inline = std::panic::catch_unwind(std::panic::AssertUnwindSafe(inline));
        let (chat, later) = match inline {
            Ok(Some(done)) => done?,
            Ok(None) => on_pool(move || work.tokenize(true).ok().flatten()).await?,
            Err(_) => {
                log::error!("tokenizing a prompt panicked: it is placed by its text");
                return None;
            }
        };
        if let Some(later) = later {
            later.start();
        }
        Some(Arc::new(chat))
    }
}

/// Bodies up to this size are tokenized on the async worker (a few
/// thousand tokens: a millisecond or two when none is cached); a turn
/// continued from its last renders its new messages on it when they are
/// this short, and what it renders again ([`Earlier::render_bytes`]) is
/// at most [`INLINE_RENDER`].
const INLINE_BYTES: usize = 8 << 10;
const INLINE_RENDER: usize = 64 << 10;

/// A later turn's text tokenized off the request's path at most.
const LATER_BYTES: usize = 1 << 20;

fn lock(blocks: &Mutex<EngineBlocks>) -> MutexGuard<'_, EngineBlocks> {
    blocks.lock().unwrap_or_else(|p| p.into_inner())
}

/// A chat body to tokenize for the engines in `known`.
pub struct Work {
    pub tokens: Arc<ModelTokens>,
    pub body: bytes::Bytes,
    pub known: Vec<Arc<Mutex<EngineBlocks>>>,
    pub max_bytes: usize,
    pub continuity: Continuity,
}

/// Not continued from a kept turn (and asked not to render whole).
pub struct Whole;

/// What [`Work::tokenize`] gives: the prompt's tokens (`None`: not matched)
/// and what is left to do off the request's path.
pub type Tokenized = Option<(Chat, Option<Later>)>;

impl Work {
    /// The tokens of a turn continued from its last when it is short
    /// enough for the async worker (see [`INLINE_BYTES`]); `None` when it
    /// is not, or turns out not to continue it.
    fn short_turn(&self) -> Option<Tokenized> {
        let from = self.continuity.turns.from.as_ref()?;
        let memo = from.kept::<Memo>()?;
        let unread = self.body.len().saturating_sub(from.list_end());
        if unread > INLINE_BYTES || memo.earlier.render_bytes() > INLINE_RENDER {
            return None;
        }
        self.tokenize(false).ok()
    }

    /// The prompt's ids as far as one of `known` holds their blocks, from
    /// the turn it continues when that one's were kept (else rendered
    /// whole, unless `whole` is false). A long piece some engine holds that
    /// the piece cache does not have yet (another router placed it, a
    /// client sent it straight there) is not tokenized on the request's
    /// path: its first words place the request (an engine holding them all
    /// is taken to hold the piece) and the piece is tokenized on the
    /// blocking pool for the next request. What the next turn continues
    /// from is kept with the checkpoint the body left: at once when its ids
    /// are all known, else by the [`Later`] returned for a conversation's
    /// later turn, to run off the request's path.
    pub fn tokenize(&self, whole: bool) -> Result<Tokenized, Whole> {
        let Work {
            tokens,
            body,
            known,
            max_bytes,
            continuity,
        } = self;
        let Turns { from, left } = &continuity.turns;
        let continued = from.as_ref().and_then(|f| {
            let memo = f.kept::<Memo>()?;
            let same_model = std::ptr::eq(memo.tokens.as_ptr(), Arc::as_ptr(tokens));
            let chains = Chains::new(known, Some(&memo.blocks)).filter(|_| same_model)?;
            let prompt = tokens
                .prompt_after(&memo.earlier, body, f.list_end())
                .ok()?;
            Some((prompt, chains))
        });
        let is_continued = continued.is_some();
        let (prompt, mut chains) = match continued {
            Some(c) => c,
            None if !whole => return Err(Whole),
            None => {
                let list_end = left.as_ref().map(|l| l.list_end());
                let Ok(prompt) = tokens.prompt(body, list_end) else {
                    return Ok(None);
                };
                let Some(chains) = Chains::new(known, None) else {
                    return Ok(None);
                };
                (prompt, chains)
            }
        };
        if prompt.len > *max_bytes {
            return Ok(None);
        }
        let (text, base) = (prompt.text.as_str(), prompt.after_ids);
        let encoded = (tokens.pieces).encode_while(text, true, |ids, next| chains.held(ids, next));
        let Ok(partial) = encoded else {
            return Ok(None);
        };
        let ids = partial.ids;
        let done = partial.covered >= text.len();
        let (assumed, rest) = match &partial.deferred {
            Some(d) => {
                // The rest at the probe's bytes per token.
                let tokens_in = |bytes: usize| bytes * d.probed_ids / d.probed.max(1);
                let assumed = tokens_in(d.piece.len().saturating_sub(d.probed));
                (assumed, tokens_in(text.len() - d.piece.end))
            }
            None => (0, 0),
        };
        let total = base
            + match partial.covered {
                _ if done => ids.len(),
                _ if partial.deferred.is_some() => ids.len() + assumed + rest,
                0 => text.len() / BYTES_PER_TOKEN as usize,
                c => ids.len() * text.len() / c,
            };
        let deferred = partial.deferred.map(|d| text[d.piece].to_owned());
        let mut blocks = chains.start;
        let mut later = None;
        let mut fed = 0;
        let left = left.as_ref().filter(|_| prompt.continuable());
        match (left, done) {
            (Some(left), true) => {
                let keep = |memo, bytes| {
                    (continuity.checkpoints).keep_with(left, memo, bytes, continuity.budget)
                };
                fed = keep_turn(tokens, prompt, &ids, &mut blocks, keep);
            }
            // Only a conversation's later turn: a body read once is not
            // tokenized past what engines hold.
            (Some(left), false) if from.is_some() && text.len() <= LATER_BYTES => {
                later = Some(Later {
                    tokens: Arc::clone(tokens),
                    prompt,
                    blocks: blocks.clone(),
                    left: left.clone(),
                    checkpoints: Arc::clone(&continuity.checkpoints),
                    budget: continuity.budget,
                    deferred: None,
                })
            }
            _ => {}
        }
        // A piece deferred is learnt by the turn's `Later`, or alone.
        match (&mut later, deferred) {
            (Some(l), piece) => l.deferred = piece,
            (None, Some(piece)) => learn_later(tokens, piece),
            (None, None) => {}
        }
        for b in &mut blocks {
            b.push(&ids[fed..]);
        }
        let chat = Chat {
            keys: blocks.into_iter().map(|b| (b.size, b.keys)).collect(),
            len: base + ids.len(),
            total,
            assumed,
            continued: is_continued,
        };
        Ok(Some((chat, later)))
    }
}

/// Keeps (by `keep`: the memo and its bytes) what the next turn of
/// `prompt` continues from: `ids` are its text's, `blocks` its chains
/// before them, into which the ids before the cut are pushed (their count
/// is returned).
fn keep_turn(
    tokens: &Arc<ModelTokens>,
    prompt: tokens::Prompt,
    ids: &[u32],
    blocks: &mut [Blocks],
    keep: impl FnOnce(Kept, usize) -> bool,
) -> usize {
    let base = prompt.after_ids;
    let Some(earlier) = tokens.earlier(prompt, ids) else {
        return 0;
    };
    let fed = earlier.ids - base;
    for b in blocks.iter_mut() {
        b.push(&ids[..fed]);
    }
    let blocks = blocks.to_vec();
    let bytes = earlier.heap_bytes() + blocks.iter().map(Blocks::heap_bytes).sum::<usize>();
    let tokens = Arc::downgrade(tokens);
    keep(
        Arc::new(Memo {
            tokens,
            earlier,
            blocks,
        }),
        bytes,
    );
    fed
}

/// Turns tokenized for their next off the request's path ([`Later`]): one
/// at a time, and only while a parse's place on the blocking pool is free.
static LATER: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// A conversation's later turn not tokenized whole on the request's path,
/// to tokenize off it (into the piece cache) and keep for its next turn.
pub struct Later {
    tokens: Arc<ModelTokens>,
    prompt: tokens::Prompt,
    blocks: Vec<Blocks>,
    left: Turn,
    checkpoints: Arc<Checkpoints>,
    budget: usize,
    /// A piece deferred on the path, learnt alone if this does not run.
    deferred: Option<String>,
}

impl Later {
    /// Runs it on the blocking pool unless another runs or the pool is
    /// busy: then only its deferred piece is learnt (the next turn is read
    /// whole, and leaves one again).
    fn start(self) {
        let one = LATER.try_acquire();
        let pool = crate::body::try_pool_slot();
        let (Ok(one), Some(pool)) = (one, pool) else {
            if let Some(piece) = self.deferred {
                learn_later(&self.tokens, piece);
            }
            return;
        };
        tokio::task::spawn_blocking(move || {
            let _slots = (one, pool);
            self.run();
        });
    }

    /// Tokenizes the turn's text (the pieces into the cache) and keeps it.
    pub fn run(self) {
        let Ok(ids) = self.tokens.pieces.encode(&self.prompt.text) else {
            return;
        };
        let mut blocks = self.blocks;
        let (checkpoints, left, budget) = (self.checkpoints, self.left, self.budget);
        let keep = |memo, bytes| checkpoints.keep_with(&left, memo, bytes, budget);
        keep_turn(&self.tokens, self.prompt, &ids, &mut blocks, keep);
    }
}

/// Tokenizes `piece` into the cache on the blocking pool, when called on
/// the runtime (dropped if the pool is busy past one per core).
fn learn_later(tokens: &Arc<ModelTokens>, piece: String) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let tokens = Arc::clone(tokens);
    runtime.spawn(on_pool(move || tokens.pieces.learn(&piece).ok()));
}

/// Sets `engine_held` on each offered replica whose engine's state is
/// known: what it holds of the prompt (`text_len` bytes of canonical text,
/// tokenized as `chat`), in bytes of that text (its tokens held, scaled).
/// `offered` is in `list`'s order, as `Replicas::states` gives it (else
/// each is looked up by id).
pub fn report(chat: &Chat, text_len: usize, list: &View, offered: &mut [ReplicaState]) {
    for (at, s) in offered.iter_mut().enumerate().filter(|(_, s)| s.live) {
        let r = match list.get(at) {
            Some(r) if r.id == s.id => Some(r),
            _ => list.iter().find(|r| r.id == s.id),
        };
        let Some(blocks) = r.and_then(|r| r.engine_blocks()) else {
            continue;
        };
        let blocks = lock(&blocks);
        let size = blocks.block_size();
        // An engine whose block size came after the prompt was tokenized
        // is not matched (its keys were not made).
        let Some((size, keys)) = chat.keys.iter().find(|(s, _)| Some(*s) == size) else {
            continue;
        };
        if blocks.sync() != CacheState::Known {
            continue;
        }
        let matched = blocks.matched(keys);
        // Holding every whole block of the ids: the rest of a deferred
        // piece too (see `tokenize`).
        let held = match matched == keys.len() && chat.assumed > 0 {
            true => chat.len + chat.assumed,
            false => matched * *size as usize,
        };
        let bytes = held as u128 * text_len as u128 / chat.total.max(1) as u128;
        s.engine_held = Some((bytes as usize).min(text_len));
    }
}

#[cfg(test)]
mod tests;
