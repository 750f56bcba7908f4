//! The engines' KV-cache events as they arrive: vLLM's `EventBatch`
//! (`[ts, events, dp_rank?]`) of `BlockStored`, `BlockRemoved` and
//! `AllBlocksCleared`, which SGLang publishes too. Each event comes in one of
//! two encodings, by engine version: a positional array whose first element
//! names the event (older vLLM), or a map with `type` and named fields,
//! optional ones left out (current SGLang and vLLM); both are read, fields a
//! newer engine adds are skipped. A block hash is an integer (signed or not)
//! or bytes: each becomes an opaque 64-bit id ([`EngineHash`]). Events of
//! another KV group than the first (hybrid models), of another kind than
//! full attention, or of a kind not known here are read as [`Event::Other`]
//! and change nothing.
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
        }
        d.deserialize_any(V)
    }
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks filled: `tokens` holds `block_size` token ids per hash, in
    /// order, the first block's parent `parent` (`None`: the prompt's start).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        block_size: u32,
        /// The adapter (`lora_name`, else `lora_id`) and `cache_salt`,
        /// hashed: blocks of another adapter or salt are other blocks.
        namespace: u64,
        /// Held on the GPU (no `medium`, or `GPU`), not an offload tier.
        on_gpu: bool,
    },
    /// Blocks evicted.
    Removed {
        hashes: Vec<EngineHash>,
        on_gpu: bool,
    },
    /// The whole cache was emptied (a reset, a restart).
    Cleared,
    /// Not one this router reads (another group or kind, or a new event).
    Other,
}

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
    tokens: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    medium: Option<String>,
    group: Option<i64>,
    kind: Option<String>,
}

/// Positional fields after the tag, by event (older vLLM's `array_like`).
const STORED: [&str; 6] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
];
const REMOVED: [&str; 2] = ["block_hashes", "medium"];

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
    fn event<E: de::Error>(self, tag: &str) -> Result<Event, E> {
        let on_gpu = self.medium.as_deref().is_none_or(|m| m == "GPU");
        // Hybrid models: only the first group's full-attention blocks.
        let main = self.group.unwrap_or(0) == 0
            && (self.kind.as_deref()).is_none_or(|k| k.contains("full") || k.contains("mla"));
        Ok(match tag {
            _ if !main => Event::Other,
            "BlockStored" => {
                let hashes = self
                    .hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?;
                let tokens = self.tokens.ok_or_else(|| E::missing_field("token_ids"))?;
                let block_size = self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?;
                if block_size == 0 || tokens.len() != hashes.len() * block_size as usize {
                    return Err(E::custom(format_args!(
                        "{} token ids for {} blocks of {block_size}",
                        tokens.len(),
                        hashes.len()
                    )));
                }
                let adapter = match (&self.lora_name, self.lora_id) {
                    (Some(name), _) => xxhash_rust::xxh3::xxh3_64(name.as_bytes()),
                    (None, Some(id)) => id as u64 ^ 0x4c6f_5241,
                    (None, None) => 0,
                };
                let salt = (self.cache_salt.as_deref())
                    .map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
                Event::Stored {
                    hashes,
                    parent: self.parent,
                    tokens,
                    block_size,
                    namespace: adapter ^ salt.rotate_left(17),
                    on_gpu,
                }
            }
            "BlockRemoved" => Event::Removed {
                hashes: self
                    .hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                on_gpu,
            },
            "AllBlocksCleared" => Event::Cleared,
            _ => Event::Other,
        })
    }
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
                fields.event(&tag)
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
                let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
                fields.event(&tag)
            }
        }
        d.deserialize_any(V)
    }
}
