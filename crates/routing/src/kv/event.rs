//! The engines' KV-cache events as they arrive: vLLM's `EventBatch`
//! (`[ts, events, dp_rank?]`) of `BlockStored`, `BlockRemoved` and
//! `AllBlocksCleared`, which SGLang publishes too. Each event comes in one of
//! two encodings, by engine version: a positional array whose first element
//! names the event (vLLM's `array_like`, fields in vLLM's order), or a map
//! with `type` and named fields, optional ones left out (current SGLang and
//! vLLM); both are read, fields a newer engine adds are skipped. A block hash
//! is an integer (signed or not), bytes or text: each becomes an opaque
//! 64-bit id ([`EngineHash`]).
//!
//! One event the router cannot use never costs the rest of its batch: an
//! event of another KV group or kind (hybrid models), of an offload tier or
//! a remote one, of a kind not known here is [`Event::Other`]; one that is
//! malformed (token ids that are not plain ids, as EAGLE's pairs; a block
//! size of 0 or past [`MAX_BLOCK_SIZE`]; token and hash counts that
//! disagree; blocks keyed by more than their tokens, `extra_keys`) is
//! [`Event::Unreadable`].
//!
//! Format-agnostic serde visitors: the caller decodes msgpack with them.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// An engine's id for one block, opaque: an integer as its 64 bits, bytes
/// hashed to 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl<'de> Deserialize<'de> for EngineHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = EngineHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (an integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<EngineHash, E> {
                Ok(EngineHash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<EngineHash, E> {
                Ok(EngineHash(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<EngineHash, E> {
                Ok(EngineHash(xxhash_rust::xxh3::xxh3_64(v)))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<EngineHash, E> {
                self.visit_bytes(&v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<EngineHash, E> {
                self.visit_bytes(v.as_bytes())
            }
        }
        d.deserialize_any(V)
    }
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// GPU blocks filled: `tokens` holds `block_size` token ids per hash,
    /// in order, the first block's parent `parent` (`None`: the prompt's
    /// start).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        block_size: u32,
        /// The adapter (`lora_name`, else `lora_id`) and `cache_salt`,
        /// hashed: blocks of another adapter or salt are other blocks.
        namespace: u64,
    },
    /// GPU blocks evicted.
    Removed { hashes: Vec<EngineHash> },
    /// The whole cache was emptied (a reset, a restart).
    Cleared,
    /// Not one this router reads (another group, kind or tier, or a new
    /// event).
    Other,
    /// Malformed: `removal` when it removed blocks (what it removed is
    /// unknown then).
    Unreadable { removal: bool },
}

/// The largest block size read (vLLM's are 16 to 128 tokens, SGLang's pages
/// 1 to 64): more is taken as malformed.
pub const MAX_BLOCK_SIZE: u32 = 4096;

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Batch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an event batch [ts, events, ...]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Batch, A::Error> {
                let ts = required(&mut s, 0, "ts")?;
                let events = required(&mut s, 1, "events")?;
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Batch { ts, events })
            }
        }
        d.deserialize_seq(V)
    }
}

fn required<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(
    s: &mut A,
    i: usize,
    what: &'static str,
) -> Result<T, A::Error> {
    s.next_element()?
        .ok_or_else(|| de::Error::invalid_length(i, &what))
}

/// The fields of any event, as read from either encoding.
#[derive(Default)]
struct Fields {
    hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    tokens: Option<TokenIds>,
    block_size: Option<u64>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    extra_keys: Option<Extra>,
    medium: Option<String>,
    locality: Option<String>,
    ownership: Option<String>,
    group: Option<i64>,
    kind: Option<String>,
}

/// Positional fields after the tag, by event, in vLLM's order.
const STORED: [&str; 13] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
];
const REMOVED: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// Token ids, or `None` when one is not a plain id (EAGLE's pairs).
struct TokenIds(Option<Vec<u32>>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("token ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<TokenIds, A::Error> {
                let mut ids = Some(Vec::with_capacity(s.size_hint().unwrap_or(0).min(1 << 16)));
                while let Some(Anything(id)) = s.next_element()? {
                    match (&mut ids, id.and_then(|v| u32::try_from(v).ok())) {
                        (Some(ids), Some(id)) => ids.push(id),
                        _ => ids = None,
                    }
                }
                Ok(TokenIds(ids))
            }
        }
        d.deserialize_seq(V)
    }
}

/// `extra_keys`: whether any block's is set (its key then depends on more
/// than its tokens: media, a salt, an adapter).
struct Extra(bool);

impl<'de> Deserialize<'de> for Extra {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Extra;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("extra keys")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Extra, A::Error> {
                let mut set = false;
                while let Some(v) = s.next_element::<Option<IgnoredAny>>()? {
                    set |= v.is_some();
                }
                Ok(Extra(set))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Extra, E> {
                Ok(Extra(false))
            }
        }
        d.deserialize_any(V)
    }
}

/// Any one value: a non-negative integer as itself, anything else `None`.
struct Anything(Option<u64>);

impl<'de> Deserialize<'de> for Anything {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Anything;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Anything, E> {
                Ok(Anything(Some(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Anything, E> {
                Ok(Anything(u64::try_from(v).ok()))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<Anything, E> {
                Ok(Anything(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Anything, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Anything(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Anything, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Anything(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// Runs `$put` with `$to` bound to the field `$name` names (each arm
/// type-checked on its own, so `$put` may read any field's type), `$skip`
/// for a name not read here.
macro_rules! field {
    ($f:expr, $name:expr, |$to:ident| $put:expr, $skip:expr) => {
        match $name {
            "block_hashes" => {
                let $to = &mut $f.hashes;
                $put
            }
            "parent_block_hash" => {
                let $to = &mut $f.parent;
                $put
            }
            "token_ids" => {
                let $to = &mut $f.tokens;
                $put
            }
            "block_size" => {
                let $to = &mut $f.block_size;
                $put
            }
            "lora_id" => {
                let $to = &mut $f.lora_id;
                $put
            }
            "group_idx" => {
                let $to = &mut $f.group;
                $put
            }
            "lora_name" => {
                let $to = &mut $f.lora_name;
                $put
            }
            "cache_salt" => {
                let $to = &mut $f.cache_salt;
                $put
            }
            "extra_keys" => {
                let $to = &mut $f.extra_keys;
                $put
            }
            "locality" => {
                let $to = &mut $f.locality;
                $put
            }
            "ownership" => {
                let $to = &mut $f.ownership;
                $put
            }
            "medium" => {
                let $to = &mut $f.medium;
                $put
            }
            "kv_cache_spec_kind" => {
                let $to = &mut $f.kind;
                $put
            }
            _ => $skip,
        }
    };
}

impl Fields {
    /// The event these fields make; never an error: see the header.
    fn event(self, tag: &str) -> Event {
        // On this engine's GPU: no tier named, or GPU; local; not an
        // offloading tier's copy.
        let on_gpu = self.medium.as_deref().is_none_or(|m| m == "GPU")
            && self.locality.as_deref().is_none_or(|l| l == "LOCAL")
            && self.ownership.is_none();
        // Hybrid models: only the first group's full-attention blocks.
        let main = self.group.unwrap_or(0) == 0
            && (self.kind.as_deref()).is_none_or(|k| {
                let k = k.to_ascii_lowercase();
                k.contains("full") || k.contains("mla")
            });
        match tag {
            "AllBlocksCleared" => Event::Cleared,
            _ if !main || !on_gpu => Event::Other,
            "BlockStored" => self
                .stored()
                .unwrap_or(Event::Unreadable { removal: false }),
            "BlockRemoved" => match self.hashes {
                Some(hashes) => Event::Removed { hashes },
                None => Event::Unreadable { removal: true },
            },
            _ => Event::Other,
        }
    }

    fn stored(self) -> Option<Event> {
        let hashes = self.hashes?;
        let tokens = self.tokens?.0?;
        let block_size = u32::try_from(self.block_size?).ok()?;
        let whole = (hashes.len()).checked_mul(block_size as usize) == Some(tokens.len());
        if block_size == 0 || block_size > MAX_BLOCK_SIZE || !whole || hashes.is_empty() {
            return None;
        }
        if self.extra_keys.is_some_and(|e| e.0) {
            return None;
        }
        let adapter = match (&self.lora_name, self.lora_id) {
            (Some(name), _) => xxhash_rust::xxh3::xxh3_64(name.as_bytes()),
            (None, Some(id)) => id as u64 ^ 0x4c6f_5241,
            (None, None) => 0,
        };
        Some(Event::Stored {
            hashes,
            parent: self.parent,
            tokens,
            block_size,
            namespace: namespace(adapter, self.cache_salt.as_deref()),
        })
    }
}

/// The namespace a block's key is chained in: its adapter (0: the base
/// model; else a hash of its name or id, as the event gives it) and the
/// request's `cache_salt`, which engines key blocks by beside the tokens.
pub fn namespace(adapter: u64, salt: Option<&str>) -> u64 {
    let salt = salt.map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
    adapter ^ salt.rotate_left(17)
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Event;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a KV event (an array led by its name, or a map with `type`)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Event, A::Error> {
                let tag: String = required(&mut s, 0, "the event's name")?;
                let names: &[&str] = match tag.as_str() {
                    "BlockStored" => &STORED,
                    "BlockRemoved" => &REMOVED,
                    _ => &[],
                };
                let mut fields = Fields::default();
                for name in names {
                    // An older engine may end the array early.
                    let more = field!(
                        fields,
                        *name,
                        |to| match s.next_element()? {
                            Some(v) => {
                                *to = v;
                                true
                            }
                            None => false,
                        },
                        s.next_element::<IgnoredAny>()?.is_some()
                    );
                    if !more {
                        break;
                    }
                }
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(fields.event(&tag))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Event, A::Error> {
                let mut fields = Fields::default();
                let mut tag = None;
                while let Some(key) = m.next_key::<String>()? {
                    if key == "type" {
                        tag = Some(m.next_value::<String>()?);
                        continue;
                    }
                    field!(fields, key.as_str(), |to| *to = m.next_value()?, {
                        m.next_value::<IgnoredAny>()?;
                    });
                }
                // No `type`: not an event this router knows.
                Ok(tag.map_or(Event::Other, |tag| fields.event(&tag)))
            }
        }
        d.deserialize_any(V)
    }
}
