//! The serde_json parser `Prompt::parse` used before the byte scanner, kept
//! (but for the shared `Section` / `Fields`) as the oracle the scanner is
//! tested against.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

// Sections and their assembly are shared with the scanner: the oracle checks
// the reading of the body, not the assembly.
use super::identity::{self, CALLS, PARTS};
use super::{push, Fields, Prompt, Section, MESSAGE_END};

type Raw<'a> = &'a serde_json::value::RawValue;

/// The old `Prompt::parse`.
pub fn parse(body: &[u8], max_text_bytes: usize) -> Result<Prompt, serde_json::Error> {
    let mut parser = Parser {
        section: Section::default(),
        scratch: String::new(),
        room: max_text_bytes,
        max: max_text_bytes,
        reserve: body.len().min(max_text_bytes),
    };
    // Validating UTF-8 once up front lets serde_json skip it per string.
    let body =
        std::str::from_utf8(body).map_err(<serde_json::Error as serde::de::Error>::custom)?;
    let mut de = serde_json::Deserializer::from_str(body);
    let fields = de.deserialize_map(Top(&mut parser))?;
    de.end()?;
    Ok(fields.assemble(max_text_bytes, 0))
}

/// Parsing state: the section being built, a reused buffer for short strings
/// (roles, part types), and the canonical bytes still allowed.
struct Parser {
    section: Section,
    scratch: String,
    /// Canonical bytes still allowed in the current section.
    room: usize,
    /// The canonical text budget of a section.
    max: usize,
    /// Capacity for the first prompt-carrying section (the body's size, capped).
    reserve: usize,
}

impl Parser {
    fn append(&mut self, bytes: &[u8]) {
        push(&mut self.section.text, &mut self.room, bytes);
    }

    /// Prompt text in canonical form: as `serde_json` escapes it, unquoted.
    fn append_text(&mut self, v: &str) {
        let quoted = serde_json::to_string(v).unwrap_or_default();
        self.append(
            quoted
                .as_bytes()
                .get(1..quoted.len() - 1)
                .unwrap_or_default(),
        );
    }

    fn end_message(&mut self, role: &str) {
        self.section.end_message(role.as_bytes(), self.max);
        self.room = self.max.saturating_sub(self.section.text.len());
    }

    /// Parses one top-level field into a fresh section with the whole text
    /// budget, and returns it: a repeated key replaces, never accumulates, so
    /// the work stays linear in the body.
    fn section<E>(
        &mut self,
        reserve: bool,
        fill: impl FnOnce(&mut Self) -> Result<(), E>,
    ) -> Result<Section, E> {
        let capacity = if reserve {
            std::mem::take(&mut self.reserve)
        } else {
            0
        };
        self.section = Section {
            text: Vec::with_capacity(capacity),
            ..Section::default()
        };
        self.room = self.max;
        fill(self)?;
        Ok(std::mem::take(&mut self.section))
    }
}

macro_rules! expecting {
    ($what:literal) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str($what)
        }
    };
}

/// The top-level object.
struct Top<'p>(&'p mut Parser);

impl<'de> Visitor<'de> for Top<'_> {
    type Value = Fields;
    expecting!("a JSON object");

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let p = self.0;
        let mut f = Fields::default();
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Messages => {
                    f.messages = Some(p.section(true, |p| map.next_value_seed(Messages(p)))?);
                }
                Field::System => {
                    f.system = Some(p.section(false, |p| {
                        map.next_value_seed(Content(&mut *p))?;
                        p.end_message("system");
                        Ok(())
                    })?);
                }
                Field::Prompt | Field::Text => {
                    f.prompt = Some(p.section(true, |p| {
                        map.next_value_seed(Texts(&mut *p))?;
                        p.section.messages += 1;
                        Ok(())
                    })?);
                }
                Field::CacheKey => {
                    f.key = map
                        .next_value::<Option<String>>()?
                        .filter(|k| !k.is_empty());
                }
                Field::Model => {
                    f.model = map
                        .next_value::<Option<String>>()?
                        .filter(|k| !k.is_empty());
                }
                Field::CacheSalt => {
                    let raw = map.next_value::<Box<serde_json::value::RawValue>>()?;
                    f.salt = None;
                    f.odd_salt = raw.get() != "null";
                    if raw.get().starts_with('"') {
                        let salt: String =
                            serde_json::from_str(raw.get()).map_err(serde::de::Error::custom)?;
                        f.salt = Some(salt).filter(|s| !s.is_empty());
                        f.odd_salt = false;
                    }
                }
                Field::PromptLogprobs => {
                    f.logprobs = map.next_value::<Option<IgnoredAny>>()?.is_some();
                }
                Field::CachePrompt => {
                    let raw = map.next_value::<Box<serde_json::value::RawValue>>()?;
                    f.no_cache = raw.get() == "false";
                }
                Field::Stream => f.stream = map.next_value::<Raw>()?.get() == "true",
                Field::Rendered(i) => {
                    f.rendered[i] = Some(identity::hash(map.next_value::<Raw>()?.get().as_bytes()));
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(f)
    }
}

/// The map keys the parser acts on; everything else is skipped unparsed.
enum Field {
    Messages,
    System,
    Prompt,
    CacheKey,
    Model,
    CacheSalt,
    CachePrompt,
    PromptLogprobs,
    Stream,
    Role,
    Content,
    Text,
    Type,
    Rendered(usize),
    Calls,
    Media,
    Other,
}

impl<'de> serde::Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Field;
            expecting!("a key");
            fn visit_str<E>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "messages" => Field::Messages,
                    "system" => Field::System,
                    "prompt" | "input_ids" => Field::Prompt,
                    "prompt_cache_key" => Field::CacheKey,
                    "model" => Field::Model,
                    "cache_salt" => Field::CacheSalt,
                    "cache_prompt" => Field::CachePrompt,
                    "prompt_logprobs" => Field::PromptLogprobs,
                    "stream" => Field::Stream,
                    "role" => Field::Role,
                    "content" => Field::Content,
                    "text" => Field::Text,
                    "type" => Field::Type,
                    _ if CALLS.contains(&v.as_bytes()) => Field::Calls,
                    _ if PARTS.contains(&v.as_bytes()) => Field::Media,
                    _ => identity::rendered(v.as_bytes()).map_or(Field::Other, Field::Rendered),
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// A short string written into a reused buffer (roles, part types).
struct Word<'b>(&'b mut String);

impl<'de> DeserializeSeed<'de> for Word<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Visitor<'_> for Word<'_> {
    type Value = ();
    expecting!("a string");
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.clear();
        self.0.push_str(v);
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.clear();
        Ok(())
    }
}

/// `messages`: a list of message objects.
struct Messages<'p>(&'p mut Parser);

impl<'de> DeserializeSeed<'de> for Messages<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = ();
    expecting!("a list of messages");

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Message(self.0))?.is_some() {}
        Ok(())
    }
}

/// One message: its content is appended, then its role.
struct Message<'p>(&'p mut Parser);

impl<'de> DeserializeSeed<'de> for Message<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_> {
    type Value = ();
    expecting!("a message object");

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let p = self.0;
        let mut role = std::mem::take(&mut p.scratch);
        role.clear();
        let mut calls = None;
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Role => map.next_value_seed(Word(&mut role))?,
                Field::Content => map.next_value_seed(Content(&mut *p))?,
                Field::Calls => {
                    calls = Some(identity::marker(map.next_value::<Raw>()?.get().as_bytes()));
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if let Some(calls) = calls {
            p.append(&calls);
        }
        p.end_message(&role);
        p.scratch = role;
        Ok(())
    }
}

/// Message content: a string, a list of parts, or anything else (ignored).
struct Content<'p>(&'p mut Parser);

impl<'de> DeserializeSeed<'de> for Content<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Content<'_> {
    type Value = ();
    expecting!("message content");

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.append_text(v);
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Content(&mut *self.0))?.is_some() {}
        Ok(())
    }
    /// A part: `text` counts, a nested `content` (tool results) counts, and a
    /// tool part marks a model turn.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let p = self.0;
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Text | Field::Content => map.next_value_seed(Content(&mut *p))?,
                Field::Media => {
                    p.append(&identity::marker(map.next_value::<Raw>()?.get().as_bytes()));
                }
                Field::Type => {
                    let mut kind = std::mem::take(&mut p.scratch);
                    map.next_value_seed(Word(&mut kind))?;
                    p.section.model_turn |= matches!(
                        kind.as_str(),
                        "tool_result" | "tool_use" | "function_call_output"
                    );
                    p.scratch = kind;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
}

/// A completions `prompt`: a string, or nested lists of strings and token ids
/// (list items joined by `0x1E`, token ids as decimal numbers).
struct Texts<'p>(&'p mut Parser);

impl<'de> DeserializeSeed<'de> for Texts<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Texts<'_> {
    type Value = ();
    expecting!("a prompt: a string, token ids, or a list of them");

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.append_text(v);
        Ok(())
    }
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.append(format!("{v} ").as_bytes());
        Ok(())
    }
    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.append(format!("{v} ").as_bytes());
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut first = true;
        loop {
            let (start, room) = (self.0.section.text.len(), self.0.room);
            if !first {
                self.0.append(&[MESSAGE_END]);
            }
            if seq.next_element_seed(Texts(&mut *self.0))?.is_none() {
                self.0.section.text.truncate(start);
                self.0.room = room;
                return Ok(());
            }
            first = false;
        }
    }
}

#[path = "../../tests/strategies/json.rs"]
pub(super) mod strategies;

mod tests;
