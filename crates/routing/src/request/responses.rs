//! OpenAI's Responses API body (`POST /v1/responses`) -> the same canonical
//! prompt as chat: `instructions` is a first `system` message; `input` is a
//! `user` message when it is a string, else one message per item: a message
//! item's text parts under its role, a `function_call`'s name and arguments
//! under `function_call`, a `function_call_output`'s output under
//! `function_call_output`, a `reasoning` item's summary under `reasoning`
//! (the last three, like an `assistant` message, are model turns: the request
//! is a continuation). Also read: `model`, `prompt_cache_key`,
//! `previous_response_id` (the conversation's state is on the replica that
//! produced that response) and `store` (`false`: nothing is kept there).
//! Strings are kept in the escaped form `serde_json` writes, as for chat.
//! Parsed with `serde_json` (not the chat path's scanner): Responses bodies
//! that name a previous response carry only the new items.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::identity::{self, PARTS};
use super::{Fields, Prompt, Section};

type Raw<'a> = &'a serde_json::value::RawValue;

/// A Responses API request as the router reads it. Items are read one at a
/// time into the canonical text, never held as a tree: memory stays about
/// the body's size whatever its shape.
pub fn parse(body: &[u8], max: usize) -> Result<Prompt, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let prompt = Top { max }.deserialize(&mut de)?;
    de.end()?;
    Ok(prompt)
}

macro_rules! expecting {
    ($what:literal) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str($what)
        }
    };
}

fn nonempty(s: Option<Cow<'_, str>>) -> Option<String> {
    s.filter(|s| !s.is_empty()).map(Cow::into_owned)
}

struct Top {
    max: usize,
}

impl<'de> DeserializeSeed<'de> for Top {
    type Value = Prompt;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Top {
    type Value = Prompt;
    expecting!("a JSON object");

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
        let max = self.max;
        let mut f = Fields::default();
        let (mut previous, mut no_store) = (None, false);
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "instructions" => {
                    f.system = map.next_value::<Option<Cow<str>>>()?.map(|text| {
                        let mut s = Section::default();
                        append(&mut s.text, &text, max);
                        s.end_message(b"system", max);
                        s
                    });
                }
                "input" => {
                    let mut s = Section::default();
                    map.next_value_seed(Input { s: &mut s, max })?;
                    f.messages = Some(s);
                }
                "model" => f.model = nonempty(map.next_value()?),
                "prompt_cache_key" => f.key = nonempty(map.next_value()?),
                "previous_response_id" => previous = nonempty(map.next_value()?),
                "store" => no_store = map.next_value::<Option<bool>>()? == Some(false),
                "stream" => f.stream = map.next_value::<Raw>()?.get() == "true",
                other => match identity::rendered(other.as_bytes()) {
                    Some(i) => {
                        let raw = map.next_value::<Raw>()?;
                        f.rendered[i] = Some(identity::hash(raw.get().as_bytes()));
                    }
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                },
            }
        }
        let mut prompt = f.assemble(max, 0);
        prompt.model_turn |= previous.is_some();
        prompt.previous_response_id = previous;
        prompt.no_store = no_store;
        Ok(prompt)
    }
}

/// `input`: a string (one `user` message) or a list of items.
struct Input<'s> {
    s: &'s mut Section,
    max: usize,
}

impl<'de> DeserializeSeed<'de> for Input<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Input<'_> {
    type Value = ();
    expecting!("a string or a list of items");

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        append(&mut self.s.text, v, self.max);
        self.s.end_message(b"user", self.max);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(item) = seq.next_element::<Item>()? {
            item.close(self.s, self.max);
        }
        Ok(())
    }
}

/// One item of `input`, its text gathered (in the escaped form) as it is read.
#[derive(Default)]
struct Item {
    kind: Option<String>,
    role: Option<String>,
    /// `content` (messages), `summary` (reasoning), `output` (tool output).
    text: Vec<u8>,
    name: Vec<u8>,
    arguments: Vec<u8>,
}

impl Item {
    /// Appends the item to the canonical text, closed by its role or type.
    fn close(self, s: &mut Section, max: usize) {
        let role = match (self.kind.as_deref(), self.role) {
            (Some("message") | None, Some(role)) => role,
            (Some(kind @ ("function_call" | "function_call_output" | "reasoning")), _) => {
                s.model_turn = true;
                kind.to_owned()
            }
            _ => return,
        };
        for part in [&self.name, &self.arguments, &self.text] {
            let room = max.saturating_sub(s.text.len());
            s.text.extend_from_slice(&part[..part.len().min(room)]);
        }
        s.end_message(role.as_bytes(), max);
    }
}

impl<'de> serde::Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Item, D::Error> {
        d.deserialize_map(ItemVisitor)
    }
}

struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;
    expecting!("an input item object");

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
        let mut item = Item::default();
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "type" => item.kind = nonempty(map.next_value()?),
                "role" => item.role = nonempty(map.next_value()?),
                "content" | "summary" | "output" => map.next_value_seed(Texts(&mut item.text))?,
                "name" => map.next_value_seed(Texts(&mut item.name))?,
                "arguments" => map.next_value_seed(Texts(&mut item.arguments))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(item)
    }
}

/// Text: a string, or the `text` of each part of a list (or of one part);
/// anything else holds none.
struct Texts<'b>(&'b mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for Texts<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Texts<'_> {
    type Value = ();
    expecting!("text");

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        append(self.0, v, usize::MAX);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Texts(&mut *self.0))?.is_some() {}
        Ok(())
    }

    /// A part: its `text`, and a marker for its media (see `identity`).
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "text" {
                map.next_value_seed(Texts(&mut *self.0))?;
            } else if PARTS.contains(&key.as_bytes()) {
                let raw = map.next_value::<Raw>()?;
                self.0
                    .extend_from_slice(&identity::marker(raw.get().as_bytes()));
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
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

/// Appends a string in `serde_json`'s escaped form, up to `max` bytes in all.
fn append(out: &mut Vec<u8>, text: &str, max: usize) {
    let escaped = serde_json::Value::from(text).to_string();
    let inner = &escaped.as_bytes()[1..escaped.len() - 1];
    let room = max.saturating_sub(out.len());
    out.extend_from_slice(&inner[..inner.len().min(room)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> Prompt {
        parse(s.as_bytes(), usize::MAX).expect("valid body")
    }

    #[test]
    fn a_stateless_loop_re_sends_its_history_and_extends_its_prompt() {
        let t1 = parse_str(
            r#"{"model":"m","instructions":"Be terse.","input":[{"role":"user","content":"list files"}]}"#,
        );
        let t2 = parse_str(
            r#"{"model":"m","instructions":"Be terse.","store":false,"input":[
                {"role":"user","content":[{"type":"input_text","text":"list files"}]},
                {"type":"reasoning","summary":[{"type":"summary_text","text":"use ls"}]},
                {"type":"function_call","call_id":"c1","name":"ls","arguments":"{\"dir\":\".\"}"},
                {"type":"function_call_output","call_id":"c1","output":"a.txt\nb.txt"}]}"#,
        );
        assert!(t2.text.starts_with(&t1.text));
        assert!(t2.message_ends.contains(&t1.text.len()));
        assert!(!t1.model_turn && t2.model_turn);
        assert_eq!((t1.messages, t2.messages), (2, 5));
        assert_eq!(t1.model.as_deref(), Some("m"));
        assert!(t2.no_store && !t1.no_store);
        let text = String::from_utf8(t2.text).unwrap();
        assert!(
            text.contains(r#"a.txt\nb.txt"#),
            "escaped as serde_json writes: {text}"
        );
    }

    #[test]
    fn a_string_input_is_a_user_message_and_a_previous_response_makes_a_continuation() {
        let p =
            parse_str(r#"{"input":"hi","previous_response_id":"resp_1","prompt_cache_key":"k"}"#);
        assert_eq!(p.text, b"hi\x1fuser\x1e");
        assert!(p.model_turn);
        assert_eq!(p.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(p.key.as_deref(), Some("k"));
        assert!(parse(b"[1]", 10).is_err());
        assert!(parse(b"{\"input\":", 10).is_err());
        let cut = parse(br#"{"input":"a long question"}"#, 4).unwrap();
        assert_eq!(cut.text, b"a lo");
    }

    use super::super::reference::strategies;

    proptest::proptest! {
        /// Arbitrary bytes and structure-aware JSON never panic, and what is
        /// kept stays within the cap, its message ends in order.
        #[test]
        fn any_body_parses_within_its_cap(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1024),
            v in strategies::json(),
            cap in 0usize..512,
        ) {
            let _ = parse(&bytes, cap);
            if let Ok(p) = parse(strategies::shaped(&v, 1).as_bytes(), cap) {
                proptest::prop_assert!(p.text.len() <= cap);
                proptest::prop_assert!(p.message_ends.windows(2).all(|w| w[0] <= w[1]));
                proptest::prop_assert!(p.message_ends.iter().all(|e| *e <= p.text.len()));
            }
        }
    }
}
