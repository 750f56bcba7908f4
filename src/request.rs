//! Request body -> shape signals and the canonical prompt text the policy hashes.
//!
//! Canonical text, the same for a conversation on every turn: per message the
//! text of its content (a string, or the `text` of each part, tool results'
//! nested content included), `0x1F`, its role, then `0x1E`. Anthropic's
//! top-level `system` is a first `system` message wherever its key stands; a
//! completions `prompt` is its text (strings of a list joined by `0x1E`, token
//! ids as decimal numbers). Unknown fields are ignored.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::policy::{PrefixChain, Request};

const ROLE_SEP: u8 = 0x1F;
const MESSAGE_END: u8 = 0x1E;

/// Why a body could not be read as a prompt (it is still forwarded, spread).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("request body is not a JSON object: {0}")]
    Json(#[from] serde_json::Error),
}

/// The prompt of one request, canonicalised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    pub text: Vec<u8>,
    /// Offsets just past each message (only those within `max_text_bytes`).
    pub message_ends: Vec<usize>,
    /// An assistant / tool / function turn is present.
    pub model_turn: bool,
    pub messages: usize,
    /// `prompt_cache_key` from the body.
    pub key: Option<String>,
}

impl Prompt {
    /// Parses an OpenAI chat / completions or Anthropic messages body, keeping
    /// at most `max_text_bytes` of canonical text (the rest of the body is still
    /// validated, in time linear in its size). A key that appears twice counts
    /// once, with its last value, as Python's `json` (and so the engines) reads it.
    pub fn parse(body: &[u8], max_text_bytes: usize) -> Result<Self, RequestError> {
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
        Ok(fields.assemble(max_text_bytes))
    }

    /// The policy's view: hashes the text; `header_key` (`x-session-id`) is used
    /// when the body gave no `prompt_cache_key`.
    pub fn into_request(self, block_bytes: usize, header_key: Option<&str>) -> Request {
        let key = self
            .key
            .or_else(|| header_key.filter(|k| !k.is_empty()).map(str::to_owned));
        Request {
            chain: PrefixChain::new(self.text, self.message_ends, block_bytes),
            model_turn: self.model_turn,
            messages: self.messages,
            key,
        }
    }
}

/// The canonical text of one top-level field (`system`, `messages`, `prompt`).
#[derive(Debug, Default)]
struct Section {
    text: Vec<u8>,
    message_ends: Vec<usize>,
    model_turn: bool,
    messages: usize,
}

impl Section {
    /// Closes a message whose content was appended since it began: the role goes
    /// after the content, so the two may come in either order in the JSON.
    fn end_message(&mut self, role: &str, room: &mut usize) {
        push(&mut self.text, room, &[ROLE_SEP]);
        push(&mut self.text, room, role.as_bytes());
        if push(&mut self.text, room, &[MESSAGE_END]) {
            self.message_ends.push(self.text.len());
        }
        self.messages += 1;
        self.model_turn |= matches!(role, "assistant" | "tool" | "function");
    }
}

/// Appends what fits in `room`; whether all of `bytes` did.
fn push(text: &mut Vec<u8>, room: &mut usize, bytes: &[u8]) -> bool {
    let n = bytes.len().min(*room);
    text.extend_from_slice(&bytes[..n]);
    *room -= n;
    n == bytes.len()
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

    fn end_message(&mut self, role: &str) {
        self.section.end_message(role, &mut self.room);
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

/// The top-level fields found, last occurrence of each.
#[derive(Debug, Default)]
struct Fields {
    system: Option<Section>,
    messages: Option<Section>,
    prompt: Option<Section>,
    key: Option<String>,
}

impl Fields {
    /// The canonical text: Anthropic's `system` first wherever its key stood,
    /// then `messages`, then a completions `prompt`, within `max_text_bytes`.
    fn assemble(self, max_text_bytes: usize) -> Prompt {
        let sections = [self.system, self.messages, self.prompt];
        let mut parts = sections.into_iter().flatten();
        let mut prompt = Prompt {
            key: self.key,
            ..Prompt::default()
        };
        let Some(first) = parts.next() else {
            return prompt;
        };
        let (mut text, mut ends) = (first.text, first.message_ends);
        prompt.model_turn = first.model_turn;
        prompt.messages = first.messages;
        for s in parts {
            let shift = text.len();
            let mut room = max_text_bytes.saturating_sub(shift);
            push(&mut text, &mut room, &s.text);
            ends.extend(
                s.message_ends
                    .into_iter()
                    .map(|e| e + shift)
                    .filter(|e| *e <= text.len()),
            );
            prompt.model_turn |= s.model_turn;
            prompt.messages += s.messages;
        }
        // The buffer was sized for the whole body; keep only what the text needs.
        if text.capacity() > text.len() + text.len() / 4 + 64 {
            text.shrink_to_fit();
        }
        prompt.text = text;
        prompt.message_ends = ends;
        prompt
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
                Field::Prompt => {
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
    Role,
    Content,
    Text,
    Type,
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
                    "prompt" => Field::Prompt,
                    "prompt_cache_key" => Field::CacheKey,
                    "role" => Field::Role,
                    "content" => Field::Content,
                    "text" => Field::Text,
                    "type" => Field::Type,
                    _ => Field::Other,
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
        while let Some(key) = map.next_key::<Field>()? {
            match key {
                Field::Role => map.next_value_seed(Word(&mut role))?,
                Field::Content => map.next_value_seed(Content(&mut *p))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
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
        self.0.append(v.as_bytes());
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
        self.0.append(v.as_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Prompt {
        Prompt::parse(s.as_bytes(), usize::MAX).expect("valid body")
    }

    #[test]
    fn a_conversation_canonicalises_to_an_extension_of_its_earlier_turn() {
        let t1 = parse(
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q1"}]}"#,
        );
        let t2 = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"q1"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"x"}]},{"role":"tool","content":"r"}]}"#,
        );
        assert!(t2.text.starts_with(&t1.text));
        assert!(t2.message_ends.contains(&t1.text.len()));
        assert!(!t1.model_turn);
        assert!(t2.model_turn);
        assert_eq!((t1.messages, t2.messages), (2, 4));
    }

    #[test]
    fn anthropic_system_and_tool_results_count() {
        let p = parse(
            r#"{"system":[{"type":"text","text":"be brief"}],"messages":[{"role":"user","content":[
                {"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"42"}]}]}]}"#,
        );
        assert!(p.model_turn);
        assert_eq!(p.messages, 2);
        let text = String::from_utf8(p.text).unwrap();
        assert!(text.contains("be brief") && text.contains("42"));
    }

    #[test]
    fn key_order_does_not_change_the_canonical_text() {
        let a = parse(r#"{"system":"S","messages":[{"role":"user","content":"q"}]}"#);
        let b = parse(r#"{"messages":[{"content":"q","role":"user"}],"system":"S"}"#);
        assert_eq!(a, b);
        assert_eq!(a.message_ends.len(), 2);
    }

    #[test]
    fn completions_prompts_of_every_form_have_text() {
        assert_eq!(parse(r#"{"prompt":"abc"}"#).text, b"abc");
        assert_eq!(parse(r#"{"prompt":["a","b"]}"#).text, b"a\x1eb");
        assert_eq!(parse(r#"{"prompt":[1,2]}"#).text, b"1 \x1e2 ");
        assert_eq!(parse(r#"{"prompt":"caf\u00e9"}"#).text, "café".as_bytes());
    }

    #[test]
    fn explicit_key_prefers_the_body_then_the_header() {
        let body =
            parse(r#"{"prompt":"x","prompt_cache_key":"conv-1"}"#).into_request(64, Some("h"));
        assert_eq!(body.key.as_deref(), Some("conv-1"));
        let header = parse(r#"{"prompt":"x"}"#).into_request(64, Some("h"));
        assert_eq!(header.key.as_deref(), Some("h"));
    }

    #[test]
    fn a_repeated_key_counts_once_with_its_last_value() {
        let twice =
            parse(r#"{"system":"A","messages":[{"role":"user","content":"q"}],"system":"B"}"#);
        let once = parse(r#"{"system":"B","messages":[{"role":"user","content":"q"}]}"#);
        assert_eq!(twice, once);
        let m = parse(
            r#"{"messages":[{"role":"user","content":"old"}],"messages":[{"role":"user","content":"new"}]}"#,
        );
        assert_eq!(m.messages, 1);
        assert_eq!(m.text, b"new\x1fuser\x1e");
    }

    #[test]
    fn the_canonical_text_stops_at_its_cap_and_the_rest_still_validates() {
        let body = format!(
            r#"{{"system":"{}","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "s".repeat(10),
            "u".repeat(100)
        );
        let p = Prompt::parse(body.as_bytes(), 50).unwrap();
        assert_eq!(p.text.len(), 50);
        assert_eq!(p.messages, 2);
        assert!(p.message_ends.iter().all(|e| *e <= 50));
        assert!(Prompt::parse(&body.as_bytes()[..body.len() - 1], 50).is_err());
    }

    #[test]
    fn not_json_is_an_error_not_a_panic() {
        assert!(Prompt::parse(b"{not json", 1 << 20).is_err());
        assert!(Prompt::parse(b"[1,2]", 1 << 20).is_err());
        assert_eq!(
            parse(r#"{"messages":[{"role":"user","content":{"odd":1}}],"x":[1]}"#).messages,
            1
        );
    }
}
