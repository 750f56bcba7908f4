//! Byte-level BPE to ids alone, for GPT-2's family of tokenizers (SmolLM2,
//! Llama 3, Qwen 2.5 and most open chat models): the ids `tokenizers` gives
//! a piece with no added tokens, without its `Encoding` (a string per token,
//! offsets, per-byte alignments for every pre-tokenized word), which is
//! most of its time on new text (docs/performance.md). Built from the
//! tokenizer's own JSON when it has the shape handled here: no normalizer;
//! pre-tokenizers `Split` (a regex or a string, isolated, not inverted) and
//! `Digits`, then `ByteLevel` without a prefix space; a BPE model without
//! dropout or affixes. Else `None`, and
//! [`crate::Pieces`] keeps `tokenizers`.
//!
//! Each step is `tokenizers`' own: the splits run the same `fancy-regex`
//! patterns (a pattern that errors midway ends the matches there, as
//! there), `Digits` splits at `char::is_numeric`, and the merge loop is
//! `Word::merge_all` (lowest rank first, the leftmost of equals, a queued
//! merge dropped when its pair no longer makes its token). The load probes
//! in [`crate::Pieces`] and a differential test against `tokenizers` hold
//! the two equal.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use fancy_regex::Regex;
use serde_json::Value;

/// GPT-2's pattern, which `tokenizers`' `ByteLevel` splits by when
/// `use_regex` is set.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Words whose ids each thread keeps per tokenizer, before its cache
/// starts over. (An instance dropped leaves its words in the threads that
/// used it; tokenizers are loaded once, at start.)
const WORDS: usize = 1 << 14;
/// A word longer than this is not kept (so a cache holds at most about
/// 6 MB: 64 bytes and as many ids a word).
const WORD_BYTES: usize = 64;
/// A thread's merge buffers are given back past this many symbols (one
/// long word, a CJK document with no space, must not keep its size).
const KEPT_SYMBOLS: usize = 4096;

/// No neighbour.
const NONE: usize = usize::MAX;

/// Each instance's words have a cache of their own in every thread.
static INSTANCES: AtomicU64 = AtomicU64::new(0);

type Map<K, V> = HashMap<K, V, foldhash::fast::FixedState>;
/// A word's bytes → its ids: keys a client writes, so a random seed.
type Words = HashMap<Box<[u8]>, Box<[u32]>, foldhash::fast::RandomState>;

enum Stage {
    /// Numeric characters split off: each alone, or in runs.
    Digits { individual: bool },
    /// A pattern's matches and the text between them, each a split.
    Pattern(Regex),
}

pub struct ByteBpe {
    stages: Vec<Stage>,
    /// Each byte's token; a byte without one is the unknown token, or
    /// nothing when there is none (as `tokenizers` drops it).
    byte_ids: [Option<u32>; 256],
    /// The unknown token, and whether unknown bytes in a row make one.
    unk: Option<(u32, bool)>,
    /// A pair of tokens (left in the high half) → the merge's rank and
    /// the token it makes.
    merges: Map<u64, (u32, u32)>,
    /// With `ignore_merges`: the vocabulary by its tokens' bytes (a word
    /// found whole is its token).
    whole_words: Option<Map<Box<[u8]>, u32>>,
    vocab_size: usize,
    instance: u64,
}

#[derive(Default)]
struct Scratch {
    /// Each instance's words (its bytes, not a hash of them: a short
    /// word's hash is no key).
    words: Map<u64, Words>,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// GPT-2's byte → character table (`bytes_to_unicode`): printable bytes
/// stand for themselves, the others for 256 and up in byte order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            n += 1;
            255 + n
        };
        chars[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// A pre-tokenizer's stages, flattened; `None` for one not handled.
fn stages(pre: &Value, out: &mut Vec<Stage>, byte_level: &mut bool) -> Option<()> {
    if *byte_level {
        // Nothing may come after `ByteLevel` (it maps the bytes).
        return None;
    }
    match pre.get("type")?.as_str()? {
        "Sequence" => {
            for p in pre.get("pretokenizers")?.as_array()? {
                stages(p, out, byte_level)?;
            }
        }
        "Digits" => out.push(Stage::Digits {
            individual: pre.get("individual_digits")?.as_bool()?,
        }),
        "Split" => {
            let isolated = pre.get("behavior")?.as_str()? == "Isolated";
            if !isolated || pre.get("invert")?.as_bool()? {
                return None;
            }
            let pattern = pre.get("pattern")?;
            let regex = match (pattern.get("Regex"), pattern.get("String")) {
                (Some(r), _) => r.as_str()?.to_owned(),
                (None, Some(s)) if !s.as_str()?.is_empty() => {
                    fancy_regex::escape(s.as_str()?).into()
                }
                _ => return None,
            };
            out.push(Stage::Pattern(Regex::new(&regex).ok()?));
        }
        "ByteLevel" => {
            if pre.get("add_prefix_space")?.as_bool()? {
                return None;
            }
            if pre
                .get("use_regex")
                .and_then(Value::as_bool)
                .unwrap_or(true)
            {
                out.push(Stage::Pattern(Regex::new(GPT2).ok()?));
            }
            *byte_level = true;
        }
        _ => return None,
    }
    Some(())
}

impl ByteBpe {
    /// From a tokenizer's JSON (`tokenizer.json`'s), when it has the shape
    /// handled here (see the module's header).
    pub fn from_json(json: &Value) -> Option<Self> {
        let empty = |v: Option<&Value>| v.is_none_or(|v| v.is_null() || v.as_str() == Some(""));
        if !empty(json.get("normalizer")) {
            return None;
        }
        let (mut stages_, mut byte_level) = (Vec::new(), false);
        stages(json.get("pre_tokenizer")?, &mut stages_, &mut byte_level)?;
        let model = json.get("model")?;
        let no_dropout = model
            .get("dropout")
            .is_none_or(|d| d.is_null() || d.as_f64() == Some(0.0));
        if !byte_level
            || model.get("type")?.as_str()? != "BPE"
            || !no_dropout
            || !empty(model.get("continuing_subword_prefix"))
            || !empty(model.get("end_of_word_suffix"))
        {
            return None;
        }
        let vocab: Map<&str, u32> = (model.get("vocab")?.as_object()?.iter())
            .map(|(k, v)| Some((k.as_str(), u32::try_from(v.as_u64()?).ok()?)))
            .collect::<Option<_>>()?;
        // Two tokens of one id: `tokenizers` finds both, its serialization
        // only one (and which is chance).
        let ids: std::collections::HashSet<u32> = vocab.values().copied().collect();
        if ids.len() != vocab.len() {
            return None;
        }
        let chars = byte_chars();
        let byte_ids = chars.map(|c| vocab.get(c.encode_utf8(&mut [0; 4]) as &str).copied());
        let unk = match model.get("unk_token").and_then(Value::as_str) {
            Some(unk) => Some((*vocab.get(unk)?, model.get("fuse_unk")?.as_bool()?)),
            None => None,
        };
        let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool);
        if byte_ids.contains(&None) && byte_fallback.unwrap_or(false) {
            return None;
        }
        let mut merges = Map::default();
        for (rank, m) in model.get("merges")?.as_array()?.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => {
                    let mut parts = s.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a, b),
                        _ => return None,
                    }
                }
                Value::Array(p) if p.len() == 2 => (p[0].as_str()?, p[1].as_str()?),
                _ => return None,
            };
            let made = *vocab.get(format!("{a}{b}").as_str())?;
            let rank = u32::try_from(rank).ok()?;
            merges.insert(pair(*vocab.get(a)?, *vocab.get(b)?), (rank, made));
        }
        let ignore_merges = model.get("ignore_merges").and_then(Value::as_bool);
        let whole_words = ignore_merges.unwrap_or(false).then(|| {
            let byte_of: Map<char, u8> = (0..=255u8).map(|b| (chars[usize::from(b)], b)).collect();
            (vocab.iter())
                .filter_map(|(token, id)| {
                    let bytes: Option<Box<[u8]>> =
                        token.chars().map(|c| byte_of.get(&c).copied()).collect();
                    Some((bytes?, *id))
                })
                .collect()
        });
        Some(Self {
            stages: stages_,
            byte_ids,
            unk,
            merges,
            whole_words,
            vocab_size: vocab.len(),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The tokens of the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Appends the ids of `text` (which holds no added token).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        SCRATCH.with_borrow_mut(|scratch| {
            self.split(text, 0, &mut |word| {
                self.word(word.as_bytes(), scratch, out)
            });
        });
    }

    /// Calls `each` with the words of `text` from stage `stage` on.
    fn split(&self, text: &str, stage: usize, each: &mut dyn FnMut(&str)) {
        if text.is_empty() {
            return;
        }
        let Some(s) = self.stages.get(stage) else {
            return each(text);
        };
        let mut emit = |range: std::ops::Range<usize>| self.split(&text[range], stage + 1, each);
        let mut at = 0;
        match s {
            Stage::Digits { individual } => {
                let mut numeric_run = false;
                for (i, c) in text.char_indices() {
                    let numeric = c.is_numeric();
                    if *individual && numeric {
                        emit(at..i);
                        emit(i..i + c.len_utf8());
                        at = i + c.len_utf8();
                    } else if !*individual && numeric != numeric_run {
                        emit(at..i);
                        at = i;
                    }
                    numeric_run = numeric;
                }
            }
            Stage::Pattern(regex) => {
                for m in regex.find_iter(text).map_while(Result::ok) {
                    emit(at..m.start());
                    emit(m.start()..m.end());
                    at = m.end();
                }
            }
        }
        emit(at..text.len());
    }

    /// Appends a word's ids: from this thread's cache, or merged.
    fn word(&self, word: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if let [b] = word {
            return out.extend(self.byte_ids[usize::from(*b)].or(self.unk.map(|(unk, _)| unk)));
        }
        if let Some(id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            return out.push(*id);
        }
        let kept = (scratch.words.get(&self.instance)).and_then(|words| words.get(word));
        if let Some(ids) = kept {
            return out.extend_from_slice(ids);
        }
        let start = out.len();
        self.merge(word, scratch, out);
        if word.len() <= WORD_BYTES {
            let words = scratch.words.entry(self.instance).or_default();
            if words.len() >= WORDS {
                words.clear();
            }
            words.insert(word.into(), out[start..].into());
        }
    }

    /// `tokenizers`' `Word::merge_all`, on ids.
    fn merge(&self, word: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let Scratch { symbols, queue, .. } = scratch;
        let merge_of = |left: &Symbol, right: &Symbol| self.merges.get(&pair(left.id, right.id));
        symbols.clear();
        let mut add = |id: u32| {
            let i = symbols.len();
            if let Some(last) = symbols.last_mut() {
                last.next = i;
            }
            let prev = i.checked_sub(1).unwrap_or(NONE);
            symbols.push(Symbol {
                id,
                prev,
                next: NONE,
                alive: true,
            });
        };
        // As `BPE::merge_word`: an unknown byte's token waits, to be fused
        // with the next unknown one or added before the next known one.
        let mut unknown = None;
        for b in word {
            match (self.byte_ids[usize::from(*b)], self.unk) {
                (Some(id), _) => {
                    if let Some(unk) = unknown.take() {
                        add(unk);
                    }
                    add(id);
                }
                (None, Some((unk, fuse))) => {
                    if let (Some(waiting), false) = (unknown, fuse) {
                        add(waiting);
                    }
                    unknown = Some(unk);
                }
                (None, None) => {}
            }
        }
        if let Some(unk) = unknown {
            add(unk);
        }
        queue.clear();
        for (pos, w) in symbols.windows(2).enumerate() {
            if let Some(&(rank, made)) = merge_of(&w[0], &w[1]) {
                queue.push(Reverse((rank, pos, made)));
            }
        }
        while let Some(Reverse((_, pos, made))) = queue.pop() {
            let left = symbols[pos];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next];
            if merge_of(&left, &right).is_none_or(|&(_, m)| m != made) {
                continue;
            }
            symbols[left.next].alive = false;
            symbols[pos].id = made;
            symbols[pos].next = right.next;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            let current = symbols[pos];
            if current.prev != NONE {
                if let Some(&(rank, m)) = merge_of(&symbols[current.prev], &current) {
                    queue.push(Reverse((rank, current.prev, m)));
                }
            }
            if current.next != NONE {
                if let Some(&(rank, m)) = merge_of(&current, &symbols[current.next]) {
                    queue.push(Reverse((rank, pos, m)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
        symbols.shrink_to(KEPT_SYMBOLS);
        queue.shrink_to(KEPT_SYMBOLS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Every byte a token (ids 0..256 in byte order), then `extra`, made by
    /// `merges` in rank order.
    fn tiny(extra: &[&str], merges: &[[&str; 2]]) -> ByteBpe {
        let mut vocab = serde_json::Map::new();
        for (b, c) in byte_chars().iter().enumerate() {
            vocab.insert(c.to_string(), json!(b));
        }
        for (i, t) in extra.iter().enumerate() {
            vocab.insert((*t).to_owned(), json!(256 + i));
        }
        let json = json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "vocab": vocab, "merges": merges},
        });
        ByteBpe::from_json(&json).expect("the shape handled")
    }

    fn ids(bpe: &ByteBpe, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode(text, &mut out);
        out
    }

    #[test]
    fn bytes_stand_for_gpt2_s_characters() {
        let chars = byte_chars();
        assert_eq!(chars[usize::from(b'!')], '!');
        assert_eq!(chars[0], 'Ā');
        assert_eq!(chars[usize::from(b' ')], 'Ġ');
        assert_eq!(chars[0xAD], 'Ń');
    }

    #[test]
    fn merges_go_by_rank_then_leftmost() {
        let bpe = tiny(
            &["ab", "abc", "aa", "Ġab"],
            &[["a", "b"], ["ab", "c"], ["a", "a"], ["Ġ", "ab"]],
        );
        // "abc" then " ab" (GPT-2 keeps a word's space with it).
        assert_eq!(ids(&bpe, "abc ab"), [257, 259]);
        // Of three a's, the first two merge.
        assert_eq!(ids(&bpe, "aaa"), [258, 97]);
        // A word with no merge is its bytes; a second time, from the cache.
        for _ in 0..2 {
            assert_eq!(ids(&bpe, "cab"), [99, 256]);
        }
    }
}
