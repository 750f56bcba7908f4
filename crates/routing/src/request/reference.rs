//! The serde_json parser `Prompt::parse` used before the byte scanner, kept
//! (but for the shared `Section` / `Fields`) as the oracle the scanner is
//! tested against.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

// Sections and their assembly are shared with the scanner: the oracle checks
// the reading of the body, not the assembly.
use super::{push, Fields, Prompt, Section, MESSAGE_END};

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
    Ok(fields.assemble(max_text_bytes))
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
                    "model" => Field::Model,
                    "cache_salt" => Field::CacheSalt,
                    "cache_prompt" => Field::CachePrompt,
                    "prompt_logprobs" => Field::PromptLogprobs,
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
mod strategies;

mod tests {
    use super::super::Prompt;
    use super::strategies::{json, shaped};
    use proptest::prelude::*;
    use serde_json::Value;

    /// The scanner and the oracle agree: the same prompt, or both refuse.
    fn same(body: &[u8], max: usize) -> std::result::Result<(), TestCaseError> {
        let new = Prompt::parse(body, max).ok();
        let old = super::parse(body, max).ok();
        prop_assert_eq!(new, old, "body {:?}", String::from_utf8_lossy(body));
        Ok(())
    }

    /// The source of a JSON string's contents, escapes and bad bytes included.
    fn literal() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-z ]{1,20}",
            Just("é".to_owned()),
            Just(r"\n".to_owned()),
            Just(r#"\""#.to_owned()),
            Just(r"\\".to_owned()),
            Just(r"\/".to_owned()),
            Just(r"\u00e9".to_owned()),
            Just(r"\u0041".to_owned()),
            Just(r"\ud83d\ude00".to_owned()),
            Just(r"\ud800".to_owned()),
            Just(r"\udc00".to_owned()),
            Just(r"\ud800\n".to_owned()),
            Just(r"\ud800\u0041".to_owned()),
            Just(r"\x".to_owned()),
            Just(r"\u12".to_owned()),
            Just("\u{1}".to_owned()),
        ];
        prop::collection::vec(piece, 0..32).prop_map(|p| p.concat())
    }

    /// `v` with every list or object the scanner skips unread replaced by 0:
    /// a fault inside one of those is not looked for (`skip_container`).
    fn strip_skipped(v: &Value) -> Value {
        fn scalar(v: &Value) -> Value {
            match v {
                Value::Array(_) | Value::Object(_) => Value::from(0),
                v => v.clone(),
            }
        }
        type Rule = (&'static str, fn(&Value) -> Value);
        fn object(v: &Value, read: &[Rule]) -> Value {
            let Value::Object(m) = v else {
                return v.clone();
            };
            let kept = m.iter().map(|(k, v)| {
                let rule = read.iter().find(|(name, _)| name == k);
                (k.clone(), rule.map_or_else(|| scalar(v), |(_, f)| f(v)))
            });
            Value::Object(kept.collect())
        }
        fn list(v: &Value, each: fn(&Value) -> Value) -> Value {
            match v {
                Value::Array(a) => Value::Array(a.iter().map(each).collect()),
                v => v.clone(),
            }
        }
        fn content(v: &Value) -> Value {
            match v {
                Value::Array(_) => list(v, content),
                v => object(
                    v,
                    &[("text", content), ("content", content), ("type", scalar)],
                ),
            }
        }
        fn message(v: &Value) -> Value {
            object(v, &[("role", scalar), ("content", content)])
        }
        object(
            v,
            &[
                ("messages", |v| list(v, message)),
                ("system", content),
                ("prompt", Value::clone),
                ("prompt_cache_key", scalar),
                ("model", scalar),
            ],
        )
    }

    proptest! {
        #[test]
        fn the_scanner_reads_random_json_as_the_serde_parser_did(
            v in json(), repeat in 1usize..4, max in prop_oneof![Just(usize::MAX), 0usize..64],
        ) {
            same(shaped(&v, repeat).as_bytes(), max)?;
        }

        #[test]
        fn the_scanner_refuses_what_the_serde_parser_refused(
            v in json(), at in any::<prop::sample::Index>(), byte in any::<u8>(), how in 0..3u8,
        ) {
            let mut body = shaped(&strip_skipped(&v), 1).into_bytes();
            let i = at.index(body.len() + 1);
            match how {
                0 => body.insert(i, byte),
                1 if i < body.len() => { body.remove(i); }
                _ => body.truncate(i),
            }
            same(&body, usize::MAX)?;
        }

        #[test]
        fn a_fault_inside_a_skipped_container_is_not_looked_for(
            v in json(), at in any::<prop::sample::Index>(), byte in any::<u8>(),
        ) {
            // Any byte but a bracket, quote or backslash, inserted anywhere in
            // a list the router skips (except inside an escape), leaves the
            // body read as if the list were not there.
            let filler = if b"[]{}\"\\".contains(&byte) { b'x' } else { byte };
            let inner = shaped(&v, 1);
            let mut body = format!(r#"{{"x":[{inner}],"y":1}}"#).into_bytes();
            let i = 6 + at.index(inner.len() + 1);
            prop_assume!(body[i - 1] != b'\\');
            body.insert(i, filler);
            prop_assert_eq!(Prompt::parse(&body, usize::MAX).ok(), Prompt::parse(b"{}", 64).ok());
        }

        #[test]
        fn escapes_read_as_the_serde_parser_read_them(s in literal(), at in 0..5usize) {
            let body = match at {
                0 => format!(r#"{{"messages":[{{"role":"user","content":"{s}"}}]}}"#),
                1 => format!(r#"{{"x":["{s}"],"prompt":["{s}",1]}}"#),
                2 => format!(r#"{{"prompt_cache_key":"{s}"}}"#),
                3 => format!(r#"{{"{s}":1,"system":[{{"type":"{s}","text":"a"}}]}}"#),
                _ => format!(r#"{{"messages":[{{"role":"{s}","x":{{"{s}":"{s}"}}}}]}}"#),
            };
            same(body.as_bytes(), usize::MAX)?;
            same(body.as_bytes(), 7)?;
        }
    }

    #[test]
    fn hand_written_edge_cases_agree() {
        let deep =
            |n: usize, open: &str, close: &str| format!("{}{}", open.repeat(n), close.repeat(n));
        let cases: Vec<String> = [
            "",
            " ",
            "{",
            "}",
            "{}",
            " {} ",
            "{} x",
            "{}}",
            "[]",
            "null",
            "\"x\"",
            r#"{"a":1,}"#,
            r#"{,"a":1}"#,
            r#"{"a" 1}"#,
            r#"{"a":}"#,
            r#"{a:1}"#,
            r#"{"a":[1,]}"#,
            r#"{"a":[,1]}"#,
            r#"{"a":[1 2]}"#,
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":.5}"#,
            r#"{"a":1e}"#,
            r#"{"a":1e+}"#,
            r#"{"a":-}"#,
            r#"{"a":+1}"#,
            r#"{"a":tru}"#,
            r#"{"a":nul}"#,
            r#"{"a":True}"#,
            r#"{"a":"\x"}"#,
            r#"{"a":"\u12g4"}"#,
            "{\"a\":\"\u{1}\"}",
            "{\"a\":\"\t\"}",
            r#"{"a":"\ud800"}"#,
            r#"{"\ud800":1}"#,
            r#"{"system":"\ud800"}"#,
            r#"{"system":"\udc00\ud800"}"#,
            r#"{"system":"\ud83d\ude00é"}"#,
            r#"{"prompt":-0}"#,
            r#"{"prompt":[-0]}"#,
            r#"{"prompt":0}"#,
            r#"{"prompt":1.5}"#,
            r#"{"prompt":18446744073709551615}"#,
            r#"{"prompt":18446744073709551616}"#,
            r#"{"prompt":-9223372036854775808}"#,
            r#"{"prompt":-9223372036854775809}"#,
            r#"{"prompt":[true]}"#,
            r#"{"prompt":[{}]}"#,
            r#"{"prompt":[null,"a",[1,[2]]]}"#,
            r#"{"system":1e400}"#,
            r#"{"system":-1e400}"#,
            r#"{"system":1e-400}"#,
            r#"{"system":0e99999999999999}"#,
            r#"{"x":1e400}"#,
            r#"{"system":1.5e308}"#,
            r#"{"messages":null}"#,
            r#"{"messages":[null]}"#,
            r#"{"messages":[[]]}"#,
            r#"{"messages":[{"role":1}]}"#,
            r#"{"messages":[{"role":null,"content":5}]}"#,
            r#"{"messages":[{"content":"a","role":"tool","role":"user"}]}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":5}"#,
            r#"{"model":""}"#,
            r#"{"model":"a","model":null}"#,
            r#"{"model":["m"]}"#,
            r#"{"prompt_cache_key":1}"#,
            r#"{"prompt_cache_key":null}"#,
            r#"{"prompt_cache_key":"k","prompt_cache_key":null}"#,
            r#"{"cache_salt":"s"}"#,
            r#"{"cache_salt":"s","cache_salt":null}"#,
            r#"{"cache_salt":""}"#,
            r#"{"cache_salt":5}"#,
            r#"{"cache_salt":"s","cache_salt":[1]}"#,
            r#"{"cache_salt":{},"cache_salt":"t\u0041"}"#,
            r#"{"cache_salt":"\ud800"}"#,
            r#"{"cache_s\u0061lt":[1e400]}"#,
            r#"{"cache_prompt":false}"#,
            r#"{"cache_prompt":false,"cache_prompt":true}"#,
            r#"{"cache_prompt":"false"}"#,
            r#"{"cache_prompt":[false]}"#,
            r#"{"cache_prompt":1e400}"#,
            r#"{"cache_prompt":"\ud800"}"#,
            r#"{"cache_prompt":fals}"#,
            r#"{"prompt_logprobs":0}"#,
            r#"{"prompt_logprobs":null}"#,
            r#"{"m\u0065ssages":[{"role":"\u0074ool"}]}"#,
            r#"{"system":{"type":"tool_use","content":[{"text":"a"}],"text":"b"}}"#,
            "{\"system\":\"caf\u{e9}\"}",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            format!(r#"{{"x":{}}}"#, deep(5000, "[", "]")),
            format!(r#"{{"x":{}}}"#, deep(5000, "{\"a\":", "}")),
            format!(r#"{{"system":{}}}"#, deep(125, "[", "]")),
            format!(r#"{{"system":{}}}"#, deep(126, "[", "]")),
            format!(r#"{{"system":{}}}"#, deep(127, "[", "]")),
            format!(r#"{{"prompt":{}}}"#, deep(126, "[", "]")),
            format!(r#"{{"prompt":{}}}"#, deep(127, "[", "]")),
            format!(r#"{{"system":{}}}"#, "1".repeat(400)),
            format!(r#"{{"x":"{}"}}"#, "\\\"".repeat(100)),
        ])
        .collect();
        // Faults inside a list or object the router skips are not looked for,
        // nor is its depth (serde_json refuses 128 levels of objects).
        let lenient = [
            r#"{"a":[1,]}"#,
            r#"{"a":[,1]}"#,
            r#"{"a":[1 2]}"#,
            r#"{"x":{"a":{"a":{"a":{"a""#,
        ];
        let mut differ = Vec::new();
        for body in &cases {
            for bytes in [
                body.as_bytes().to_vec(),
                [body.as_bytes(), b"\xff"].concat(),
            ] {
                let new = Prompt::parse(&bytes, usize::MAX).ok();
                let old = super::parse(&bytes, usize::MAX).ok();
                if new != old {
                    assert!(old.is_none(), "{body}: the scanner refused valid JSON");
                    let shown = String::from_utf8_lossy(&bytes);
                    differ.push(shown.chars().take(24).collect::<String>());
                }
            }
        }
        assert_eq!(differ, lenient);
        let invalid_utf8 = b"{\"system\":\"a\xc3\"}";
        assert!(Prompt::parse(invalid_utf8, 64).is_err());
        assert!(super::parse(invalid_utf8, 64).is_err());
    }
}
