//! Text to token ids, piece by piece: the text is cut at the tokenizer's
//! added tokens (leftmost-longest, as `tokenizers` cuts it), each added
//! token is its id, and each piece between them is encoded alone (by
//! [`crate::bpe`] where it applies, else `tokenizers`), its ids
//! kept in a cache keyed by the piece's hash (bounded in ids, each entry
//! charged 16 more for its slots, oldest out first). A tokenizer whose pieces would not encode as the whole text does
//! (see the crate's header) is used whole, without the cache.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Tokenizer;

use crate::bpe::ByteBpe;
use crate::TokensError;

/// Texts whose ids must come out the same whole and by pieces for the
/// pieces to be used: special tokens next to spaces, newlines and words.
const PROBES: [&str; 4] = [
    "{s}system\nYou are terse.{e}\n{s}user\n Hello  world{e}\n{s}assistant\n",
    "x{s}{s} y {e}\n\n z{e}",
    "{e}{s}\n",
    " leading and trailing {s}  ",
];

/// Texts whose ids must come out the same by pieces through [`ByteBpe`]
/// and whole from `tokenizers` for it to be used: each of GPT-2's splits, numbers in
/// several scripts, marks, wide and odd spaces, emoji and code.
const BPE_PROBES: [&str; 6] = [
    "Hello, world! It's the café's naïve coöperation—don't   stop.\n\n\tTabs\r\n",
    "IT'S 'S 'LL 've 're 'd 'm 't x² ٣4 12345 ½ Ⅻ",
    "日本語のテキスト、한국어 텍스트 and क़िताब पढ़ो",
    "🤖👍🏽 \u{a0}\u{3000}  \n \u{2028}end  ",
    "fn main() {\n    let x = a[i] + 1; // ok?!\n    return x;\n}\n",
    "  leading, trailing  and\u{200b}zero\u{feff}width ",
];

/// [`BPE_PROBES`], and every printable ASCII character and a sample of
/// two- and three-byte ones in a row.
fn bpe_probes() -> Vec<String> {
    let chars = (0x20..0x7f).chain((0xa0..0x3000).step_by(7));
    let every: String = chars.filter_map(char::from_u32).collect();
    (BPE_PROBES.iter().map(|t| t.to_string()))
        .chain([every])
        .collect()
}

/// A piece longer than this is probed before it is encoded (see
/// [`Pieces::encode_while`]).
pub const PROBE_BYTES: usize = 2048;
/// Ids at the end of a probe's encoding that are left out: a word at the
/// cut may end otherwise in the whole piece.
const PROBE_MARGIN: usize = 4;

/// What an entry of the cache costs beside its ids, counted in ids (its
/// map slot, order slot and allocation header: about 64 bytes).
const ENTRY_IDS: usize = 16;

/// Ids of the start of a text, and the bytes of the text they cover
/// (whole pieces); `deferred`: the piece after them was not encoded, but
/// for its first bytes, whose ids end `ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partial {
    pub ids: Vec<u32>,
    pub covered: usize,
    pub deferred: Option<Deferred>,
}

/// A piece not encoded but for its first `probed` bytes, into `probed_ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deferred {
    pub piece: std::ops::Range<usize>,
    pub probed: usize,
    pub probed_ids: usize,
}

impl Partial {
    fn whole(ids: Vec<u32>, covered: usize) -> Self {
        Self {
            ids,
            covered,
            deferred: None,
        }
    }
}

/// What became of a piece.
enum Step {
    Encoded,
    /// `go_on` said no: not encoded, nothing appended.
    Stopped,
    /// Wanted, not encoded: the ids of its first `probed` bytes appended.
    Deferred {
        probed: usize,
        probed_ids: usize,
    },
}

/// The piece's start up to a space (before a non-space) before `max`
/// bytes, when the piece is longer than `max` and has one past its
/// first quarter (a shorter cut would probe too little).
fn word_start_before(piece: &str, max: usize) -> Option<&str> {
    if piece.len() <= max {
        return None;
    }
    let b = piece.as_bytes();
    let cut = (max / 4..max).rev().find(|&i| {
        b[i] == b' ' && !b[i - 1].is_ascii_whitespace() && !b[i + 1].is_ascii_whitespace()
    })?;
    Some(&piece[..cut])
}

pub struct Pieces {
    tokenizer: Tokenizer,
    /// Added tokens and their ids; `None`: encode whole.
    split: Option<(AhoCorasick, Vec<u32>)>,
    /// A piece's ids without `tokenizers`' `Encoding`, where the tokenizer
    /// is of the shape [`ByteBpe`] handles and the probes agree.
    bpe: Option<ByteBpe>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    ids: HashMap<u64, Arc<[u32]>>,
    order: VecDeque<u64>,
    held: usize,
    max: usize,
    hits: u64,
    misses: u64,
}

impl Pieces {
    pub fn load(path: &Path, cache_ids: usize) -> Result<Self, TokensError> {
        let tokenizer = Tokenizer::from_file(path).map_err(|e| TokensError::Load {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        Ok(Self::new(tokenizer, cache_ids))
    }

    pub fn new(mut tokenizer: Tokenizer, cache_ids: usize) -> Self {
        // As transformers calls it: a prompt is never cut nor padded (a
        // `truncation` or `padding` in tokenizer.json would apply to each
        // piece on its own).
        let _ = tokenizer.with_truncation(None);
        tokenizer.with_padding(None);
        let vocab_size = tokenizer.get_vocab_size(false);
        let bpe = (tokenizer.to_string(false).ok())
            .and_then(|json| ByteBpe::from_json(&serde_json::from_str(&json).ok()?))
            // Every token serialized (two tokens of one id are not).
            .filter(|bpe| bpe.vocab_size() == vocab_size);
        let mut p = Self {
            split: None,
            bpe: None,
            tokenizer,
            cache: Mutex::new(Cache::default()),
        };
        // A tokenizer that panics on the probes is used whole (and its
        // callers catch its panics).
        let split = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.splitter()));
        p.split = split.ok().flatten();
        // By pieces, the BPE probes must give the ids of the whole.
        if p.split.is_some() {
            p.bpe = bpe;
            let agrees = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                bpe_probes()
                    .iter()
                    .all(|text| p.encode(text).ok() == p.whole(text).ok())
            }));
            if !agrees.unwrap_or(false) {
                p.bpe = None;
            }
        }
        p.cache = Mutex::new(Cache {
            max: cache_ids,
            ..Cache::default()
        });
        p
    }

    /// The added-token matcher, when pieces encode as the whole does.
    fn splitter(&self) -> Option<(AhoCorasick, Vec<u32>)> {
        let added = self.tokenizer.get_added_tokens_decoder();
        if added.is_empty()
            || added
                .values()
                .any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word)
        {
            return None;
        }
        let (ids, words): (Vec<u32>, Vec<String>) =
            added.iter().map(|(id, t)| (*id, t.content.clone())).unzip();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&words)
            .ok()?;
        let mut specials: Vec<(u32, &str)> = (added.iter())
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (*id, t.content.as_str()))
            .collect();
        specials.sort_unstable();
        let specials: Vec<&str> = specials.into_iter().map(|(_, s)| s).collect();
        let (s, e) = (specials.first()?, specials.last()?);
        let split = Some((matcher, ids));
        let probe = Self {
            tokenizer: self.tokenizer.clone(),
            split,
            bpe: None,
            cache: Mutex::new(Cache::default()),
        };
        for text in PROBES {
            let text = text.replace("{s}", s).replace("{e}", e);
            if probe.encode(&text).ok()? != self.whole(&text).ok()? {
                return None;
            }
        }
        probe.split
    }

    /// Whether the text is tokenized by pieces (else whole).
    pub fn by_pieces(&self) -> bool {
        self.split.is_some()
    }

    /// Where the last added token of `text` starts (a piece cannot cross
    /// it: the ids before it are those of the text before it), when the
    /// text is tokenized by pieces.
    pub fn last_added(&self, text: &str) -> Option<usize> {
        let (matcher, _) = self.split.as_ref()?;
        matcher.find_iter(text).last().map(|m| m.start())
    }

    /// The ids of `text` as the tokenizer gives them (no special tokens
    /// added: a chat template writes its own).
    pub fn whole(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        let encoding = (self.tokenizer.encode_fast(text, false))
            .map_err(|e| TokensError::Tokenize(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of `text`, by pieces where the tokenizer allows.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        Ok(self.encode_while(text, false, |_, _| true)?.ids)
    }

    /// The ids of `text` as [`Pieces::encode`] gives them, as far as
    /// `go_on` wants them. Before a piece longer than [`PROBE_BYTES`] that
    /// is not in the cache is encoded, `go_on(ids, next)` is asked with the
    /// ids so far and the piece's first ids (its first bytes encoded, up to
    /// a space that starts a word, less the last few ids); when it says no,
    /// the ids so far are returned with the bytes of text they cover. A
    /// caller matching a prompt against what caches hold stops where no
    /// cache can hold more, without encoding the rest (a new document).
    /// With `defer`, a piece it wants is not encoded either: the ids end
    /// with its first ones, and [`Partial::deferred`] names it, for the
    /// caller to [`Pieces::learn`] off its path.
    pub fn encode_while(
        &self,
        text: &str,
        defer: bool,
        mut go_on: impl FnMut(&[u32], &[u32]) -> bool,
    ) -> Result<Partial, TokensError> {
        let Some((matcher, ids)) = &self.split else {
            let ids = self.whole(text)?;
            return Ok(Partial::whole(ids, text.len()));
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        let ends = (matcher.find_iter(text).map(|m| (m.start(), Some(m))))
            .chain(std::iter::once((text.len(), None)));
        for (end, special) in ends {
            let piece = &text[at..end];
            match self.piece(piece, &mut out, defer, &mut go_on)? {
                Step::Encoded => {}
                Step::Stopped => return Ok(Partial::whole(out, at)),
                Step::Deferred { probed, probed_ids } => {
                    return Ok(Partial {
                        ids: out,
                        covered: at,
                        deferred: Some(Deferred {
                            piece: at..end,
                            probed,
                            probed_ids,
                        }),
                    })
                }
            }
            if let Some(m) = special {
                out.push(ids[m.pattern().as_usize()]);
                at = m.end();
            }
        }
        Ok(Partial::whole(out, text.len()))
    }

    /// Encodes a piece into the cache (one a [`Partial`] deferred).
    pub fn learn(&self, piece: &str) -> Result<(), TokensError> {
        self.piece(piece, &mut Vec::new(), false, &mut |_, _| true)
            .map(|_| ())
    }

    /// Appends the piece's ids (or, deferred, its first ones).
    fn piece(
        &self,
        piece: &str,
        out: &mut Vec<u32>,
        defer: bool,
        go_on: &mut impl FnMut(&[u32], &[u32]) -> bool,
    ) -> Result<Step, TokensError> {
        if piece.is_empty() {
            return Ok(Step::Encoded);
        }
        let key = xxhash_rust::xxh3::xxh3_64(piece.as_bytes());
        if let Some(ids) = self.lock().get(key) {
            out.extend_from_slice(&ids);
            return Ok(Step::Encoded);
        }
        if let Some(head) = word_start_before(piece, PROBE_BYTES) {
            let mut next = self.ids(head)?;
            next.truncate(next.len().saturating_sub(PROBE_MARGIN));
            if !go_on(out, &next) {
                return Ok(Step::Stopped);
            }
            if defer {
                out.extend_from_slice(&next);
                let (probed, probed_ids) = (head.len(), next.len());
                return Ok(Step::Deferred { probed, probed_ids });
            }
        }
        let ids: Arc<[u32]> = self.ids(piece)?.into();
        out.extend_from_slice(&ids);
        self.lock().put(key, ids);
        Ok(Step::Encoded)
    }

    /// A piece's ids (it holds no added token): by [`ByteBpe`] where
    /// there is one, else as [`Pieces::whole`].
    fn ids(&self, piece: &str) -> Result<Vec<u32>, TokensError> {
        let Some(bpe) = &self.bpe else {
            return self.whole(piece);
        };
        let mut ids = Vec::with_capacity(piece.len() / 3);
        bpe.encode(piece, &mut ids);
        Ok(ids)
    }

    /// Whether pieces are tokenized by [`ByteBpe`] (else by `tokenizers`).
    pub fn ids_only(&self) -> bool {
        self.bpe.is_some()
    }

    /// Pieces found in the cache, and encoded, since the start.
    pub fn cache_counts(&self) -> (u64, u64) {
        let c = self.lock();
        (c.hits, c.misses)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Cache {
    fn get(&mut self, key: u64) -> Option<Arc<[u32]>> {
        let ids = self.ids.get(&key).cloned();
        match ids {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        ids
    }

    fn put(&mut self, key: u64, ids: Arc<[u32]>) {
        let charge = |ids: &[u32]| ids.len() + ENTRY_IDS;
        if charge(&ids) > self.max {
            return;
        }
        self.held += charge(&ids);
        match self.ids.insert(key, ids) {
            Some(was) => self.held -= charge(&was),
            None => self.order.push_back(key),
        }
        while self.held > self.max {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(ids) = self.ids.remove(&old) {
                self.held -= charge(&ids);
            }
        }
    }
}
