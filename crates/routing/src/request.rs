//! Request body -> shape signals and the canonical prompt text the policy hashes.
//!
//! Canonical text, the same for a conversation on every turn: per message the
//! text of its content (a string, or the `text` of each part, tool results'
//! nested content included), `0x1F`, its role, then `0x1E`. Text is kept in the
//! escaped form `serde_json` writes (`\n`, `\"`, `\u001f`; other characters as
//! UTF-8): one-to-one with the text itself, so identity does not depend on how
//! a client escaped it, and most strings are copied as written, not unescaped. Anthropic's
//! top-level `system` is a first `system` message wherever its key stands; a
//! completions `prompt` (SGLang's native `text` or `input_ids`) is its text (strings of a list joined by `0x1E`, token
//! ids as decimal numbers). `model` is kept (it decides which replicas may
//! serve the request). Unknown fields are ignored, except those the engine
//! keys its cache by besides the text (vLLM's `cache_salt`, the model, the
//! tools and template fields; markers for tool calls and media in place: see
//! `identity`), which make the prefix identity, and the engine options that skip its prefix
//! cache (`cache_prompt: false`, `prompt_logprobs`), which are noted: such a
//! response says nothing of what the replica holds.
//!
//! The body is read in one pass by a byte scanner (`scan`) under these rules
//! (`walk`); it reads what the serde visitors it replaced read (kept in
//! `reference` as the test oracle) and refuses what they refused, except faults
//! inside lists and objects it skips unread (see `scan`). A body it refuses is
//! still forwarded, spread; the engine answers it.

mod blocks;
mod checkpoint;
mod identity;
#[cfg(test)]
mod reference;
mod responses;
mod scan;
mod walk;

use crate::policy::{PrefixChain, Request};

pub use checkpoint::{
    Checkpoints, Kept, Parsed, Start, Turn, Turns, MIN_BODY as CHECKPOINT_MIN_BODY,
};
pub use scan::JsonError;

/// Longest model name kept (names are metric label values downstream).
pub const MAX_MODEL_NAME: usize = 256;

const ROLE_SEP: u8 = 0x1F;
const MESSAGE_END: u8 = 0x1E;

/// Why a body could not be read as a prompt (it is still forwarded, spread).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("request body is not a JSON object: {0}")]
    Json(#[from] JsonError),
    #[error("request body is not a JSON object of the expected shape: {0}")]
    Shape(#[from] serde_json::Error),
}

/// The prompt of one request, canonicalised.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    pub text: Vec<u8>,
    /// Offsets just past each message (only those within `max_text_bytes`).
    pub message_ends: Vec<usize>,
    /// An assistant / tool / function turn is present.
    pub model_turn: bool,
    /// Where the conversation's root ends: the messages before its first
    /// model turn (with one; and within the text kept).
    pub root_end: Option<usize>,
    pub messages: usize,
    /// `prompt_cache_key` from the body.
    pub key: Option<String>,
    /// What besides the messages' text the engine keys its cache by: the
    /// `cache_salt`, the model, the tools and template fields (see
    /// `identity`); `None` when the body names none of them.
    pub identity: Option<u64>,
    /// `model` from the body: which replicas may serve it.
    pub model: Option<String>,
    /// Responses API: the response this request continues (its state is on
    /// the replica that produced it), and `store: false`.
    pub previous_response_id: Option<String>,
    pub no_store: bool,
    /// `stream: true`: the answer comes as it is generated (else whole, at
    /// the end of the generation).
    pub stream: bool,
    /// The body asks the engine not to reuse its prefix cache
    /// (`cache_prompt: false`, `prompt_logprobs`, a `cache_salt` that is not
    /// a string).
    pub cache_bypass: bool,
}

impl Prompt {
    /// Parses an OpenAI chat / completions or Anthropic messages body, keeping
    /// at most `max_text_bytes` of canonical text (the rest of the body is still
    /// validated, in time linear in its size). A key that appears twice counts
    /// once, with its last value, as Python's `json` (and so the engines) reads it.
    pub fn parse(body: &[u8], max_text_bytes: usize) -> Result<Self, RequestError> {
        let (fields, _) = walk::read(body, max_text_bytes, false)?;
        Ok(fields.assemble(max_text_bytes, 0))
    }

    /// Reads only the `model` of a JSON body (embeddings, rerank, tokenize):
    /// no prompt, so the request is spread within the model's replicas.
    pub fn parse_model(body: &[u8]) -> Result<Self, RequestError> {
        #[derive(serde::Deserialize)]
        struct ModelOnly<'a> {
            #[serde(borrow)]
            model: Option<std::borrow::Cow<'a, str>>,
        }
        let m: ModelOnly = serde_json::from_slice(body)?;
        Ok(Self {
            model: m.model.filter(|m| !m.is_empty()).map(|m| m.into_owned()),
            ..Self::default()
        })
    }

    /// Reads only the `model` field of a `multipart/form-data` body (audio
    /// transcriptions): the value of the part named `model`, up to the next
    /// delimiter line (every delimiter starts `\r\n--`, whatever the boundary).
    pub fn parse_form_model(body: &[u8]) -> Self {
        let model = (|| {
            let at = memchr::memmem::find(body, b"name=\"model\"")?;
            let rest = &body[at..];
            let start = memchr::memmem::find(rest, b"\r\n\r\n")? + 4;
            let value = &rest[start..];
            let end = memchr::memmem::find(value, b"\r\n--")?;
            let model = std::str::from_utf8(&value[..end]).ok()?.trim();
            (!model.is_empty() && model.len() <= MAX_MODEL_NAME).then(|| model.to_owned())
        })();
        Self {
            model,
            ..Self::default()
        }
    }

    /// Parses an OpenAI Responses API body (see `responses`).
    pub fn parse_responses(body: &[u8], max_text_bytes: usize) -> Result<Self, RequestError> {
        Ok(responses::parse(body, max_text_bytes)?)
    }

    /// The policy's view: hashes the text; `header_key` (`x-session-id`) is used
    /// when the body gave no `prompt_cache_key`.
    pub fn into_request(self, block_bytes: usize, header_key: Option<&str>) -> Request {
        self.into_request_after(block_bytes, header_key, None)
    }

    /// As [`Prompt::into_request`] for a prompt whose text follows the first
    /// `bytes` bytes of `known`'s (see [`PrefixChain::identified_after`]).
    fn into_request_after(
        self,
        block_bytes: usize,
        header_key: Option<&str>,
        known: Option<(&PrefixChain, usize)>,
    ) -> Request {
        let key = self
            .key
            .or_else(|| header_key.filter(|k| !k.is_empty()).map(str::to_owned));
        Request {
            chain: PrefixChain::identified_after(
                self.text,
                self.message_ends,
                block_bytes,
                self.identity,
                known,
            ),
            model_turn: self.model_turn,
            root_end: self.root_end,
            hint: None,
            messages: self.messages,
            key,
            cache_bypass: self.cache_bypass,
            model: self.model,
            previous_response_id: self.previous_response_id,
            store: !self.no_store,
            stream: self.stream,
        }
    }
}

/// The canonical text of one top-level field (`system`, `messages`, `prompt`).
#[derive(Debug, Default, Clone)]
struct Section {
    text: Vec<u8>,
    /// Bytes of the section before `text`, not held here: those a message
    /// list read from a checkpoint had at it (the checkpoint's chain holds
    /// them). Offsets (`message_ends`, `root_end`) count them.
    base: usize,
    message_ends: Vec<usize>,
    model_turn: bool,
    /// Where the first message holding a model turn starts.
    root_end: Option<usize>,
    messages: usize,
}

impl Section {
    /// Its length, with its `base`.
    fn len(&self) -> usize {
        self.base + self.text.len()
    }

    /// Closes a message whose content was appended since it began: the role goes
    /// after the content, so the two may come in either order in the JSON.
    fn end_message(&mut self, role: &[u8], max: usize) {
        // Where this message starts; past the cap (an earlier message was
        // cut), the text kept ends there.
        let start = match self.message_ends.len() == self.messages {
            true => self.message_ends.last().copied().unwrap_or(0),
            false => self.len(),
        };
        let room = &mut max.saturating_sub(self.len());
        push(&mut self.text, room, &[ROLE_SEP]);
        push(&mut self.text, room, role);
        if push(&mut self.text, room, &[MESSAGE_END]) {
            self.message_ends.push(self.len());
        }
        self.messages += 1;
        // A tool part (Anthropic's tool_result) may have set it already.
        self.model_turn |= matches!(role, b"assistant" | b"tool" | b"function");
        if self.model_turn && self.root_end.is_none() {
            self.root_end = Some(start);
        }
    }
}

/// Appends what fits in `room`; whether all of `bytes` did.
fn push(text: &mut Vec<u8>, room: &mut usize, bytes: &[u8]) -> bool {
    let n = bytes.len().min(*room);
    text.extend_from_slice(&bytes[..n]);
    *room -= n;
    n == bytes.len()
}

/// The top-level fields found, last occurrence of each.
#[derive(Debug, Default)]
struct Fields {
    system: Option<Section>,
    messages: Option<Section>,
    prompt: Option<Section>,
    key: Option<String>,
    /// vLLM's `cache_salt` (a non-empty string): the engine shares cache only
    /// between requests of one salt, so the prefix identity includes it.
    salt: Option<String>,
    /// `model` (a non-empty string).
    model: Option<String>,
    /// The top-level fields the chat template renders (see `identity`).
    rendered: identity::Rendered,
    /// A `cache_salt` that is not a string: what the engine does with it is
    /// unknown, so its reuse is no evidence.
    odd_salt: bool,
    /// llama.cpp's `cache_prompt: false`, vLLM's `prompt_logprobs`: each
    /// makes the engine skip its prefix cache.
    no_cache: bool,
    logprobs: bool,
    /// `stream: true`.
    stream: bool,
}

impl Fields {
    /// Heap bytes held by the strings and the `system` section.
    fn heap_bytes(&self) -> usize {
        let strings = [&self.key, &self.salt, &self.model];
        let strings: usize = strings
            .iter()
            .flat_map(|s| s.as_ref())
            .map(String::capacity)
            .sum();
        let system = self.system.as_ref();
        strings + system.map_or(0, |s| s.text.capacity() + 8 * s.message_ends.capacity())
    }

    /// The fields a checkpoint keeps of those read before a message list:
    /// all but the sections, and `system`.
    fn before_list(&self) -> Fields {
        Fields {
            system: self.system.clone(),
            key: self.key.clone(),
            salt: self.salt.clone(),
            model: self.model.clone(),
            rendered: self.rendered,
            odd_salt: self.odd_salt,
            no_cache: self.no_cache,
            logprobs: self.logprobs,
            stream: self.stream,
            ..Fields::default()
        }
    }

    /// The canonical text: Anthropic's `system` first wherever its key stood,
    /// then `messages`, then a completions `prompt`, within `max_text_bytes`.
    /// Its first `skip` bytes are held elsewhere: those of `system` and of the
    /// list's `base` when the list was read from a checkpoint whose chain
    /// holds them (0 otherwise); the prompt's `text` holds the bytes after them.
    fn assemble(self, max_text_bytes: usize, skip: usize) -> Prompt {
        let sections = [self.system, self.messages, self.prompt];
        let mut prompt = Prompt {
            identity: identity::of(self.salt.as_deref(), self.model.as_deref(), &self.rendered),
            key: self.key,
            model: self.model,
            cache_bypass: self.odd_salt || self.no_cache || self.logprobs,
            stream: self.stream,
            ..Prompt::default()
        };
        // Bytes `skip..len` of the text.
        let mut text = Vec::new();
        let mut len = 0;
        let mut ends = Vec::new();
        for s in sections.into_iter().flatten() {
            let shift = len;
            if prompt.root_end.is_none() {
                prompt.root_end = s.root_end.map(|e| e + shift);
            }
            prompt.model_turn |= s.model_turn;
            prompt.messages += s.messages;
            if shift + s.len() <= skip {
                // Held elsewhere whole (within the cap: the checkpoint's was).
                len = shift + s.len();
                ends.extend(s.message_ends.into_iter().map(|e| e + shift));
                continue;
            }
            // What is held elsewhere ends where this section's own bytes start.
            let own = shift + s.base;
            debug_assert_eq!(own, skip + text.len(), "a section held in part elsewhere");
            let mut room = max_text_bytes.saturating_sub(own);
            if text.is_empty() {
                text = s.text;
                text.truncate(room);
            } else {
                push(&mut text, &mut room, &s.text);
            }
            len = skip + text.len();
            ends.extend(
                s.message_ends
                    .into_iter()
                    .map(|e| e + shift)
                    .filter(|e| *e <= len),
            );
        }
        // The buffer was sized for the whole body; keep only what the text needs.
        if text.capacity() > text.len() + text.len() / 4 + 64 {
            text.shrink_to_fit();
        }
        prompt.root_end = prompt.root_end.map(|e| e.min(len));
        prompt.text = text;
        prompt.message_ends = ends;
        prompt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Prompt {
        Prompt::parse(s.as_bytes(), usize::MAX).expect("valid body")
    }

    #[test]
    fn the_model_of_a_form_body_is_its_model_part() {
        let body = b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\x00\x01\r\n--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-large\r\n--b0undary--\r\n";
        assert_eq!(
            Prompt::parse_form_model(body).model.as_deref(),
            Some("whisper-large")
        );
        assert_eq!(Prompt::parse_form_model(b"no form").model, None);
        let empty = b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n\r\n--b--";
        assert_eq!(Prompt::parse_form_model(empty).model, None);
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
        // Its root: the messages before the first model turn, that is turn 1.
        assert_eq!((t1.root_end, t2.root_end), (None, Some(t1.text.len())));
    }

    #[test]
    fn the_root_ends_before_the_first_message_with_a_model_turn() {
        let tool_part = parse(
            r#"{"system":"S","messages":[{"role":"user","content":"q"},{"role":"user","content":[
                {"type":"tool_result","tool_use_id":"t","content":"42"}]},{"role":"user","content":"more"}]}"#,
        );
        let before = parse(r#"{"system":"S","messages":[{"role":"user","content":"q"}]}"#);
        assert_eq!(tool_part.root_end, Some(before.text.len()));
        let opens = parse(r#"{"messages":[{"role":"assistant","content":"hi"}]}"#);
        assert_eq!(opens.root_end, Some(0));
    }

    #[test]
    fn a_root_past_the_cap_ends_where_the_text_kept_does() {
        let body = |turns: &str| {
            format!(
                r#"{{"system":"{}","messages":[{{"role":"user","content":"{}"}}{turns}]}}"#,
                "s".repeat(10),
                "u".repeat(100)
            )
        };
        let first = Prompt::parse(body("").as_bytes(), 50).unwrap();
        let next = body(r#",{"role":"assistant","content":"a"},{"role":"user","content":"v"}"#);
        let next = Prompt::parse(next.as_bytes(), 50).unwrap();
        assert_eq!(next.root_end, Some(50), "the cut first message is all root");
        assert_eq!(first.text, next.text);
        // A Responses body whose instructions alone pass the cap.
        let long = format!(
            r#"{{"instructions":"{}","input":[{{"type":"function_call_output","call_id":"c","output":"x"}}]}}"#,
            "i".repeat(80)
        );
        let r = Prompt::parse_responses(long.as_bytes(), 50).unwrap();
        assert_eq!(r.root_end, Some(50));
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
    fn text_is_canonical_whatever_escapes_the_client_chose() {
        let plain = parse(r#"{"prompt":"a\"b\\c\nd\u0001é/<"}"#);
        assert_eq!(plain.text, r#"a\"b\\c\nd\u0001é/<"#.as_bytes());
        let odd = parse(r#"{"prompt":"a\u0022b\u005cc\u000Ad\u0001\u00e9\/\u003c"}"#);
        assert_eq!(odd.text, plain.text);
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
    fn what_the_template_renders_besides_the_text_is_the_identity() {
        let body = |extra: &str| {
            parse(&format!(
                r#"{{"messages":[{{"role":"user","content":"q"}}],"model":"m"{extra}}}"#
            ))
        };
        let plain = body("");
        assert_eq!(plain.identity, body("").identity);
        let tools = r#","tools":[{"type":"function","function":{"name":"ls"}}]"#;
        let variants = [
            body(tools),
            body(r#","tools":[{"type":"function","function":{"name":"rm"}}]"#),
            body(r#","chat_template_kwargs":{"enable_thinking":false}"#),
            body(r#","cache_salt":"t""#),
            parse(r#"{"messages":[{"role":"user","content":"q"}],"model":"m-lora"}"#),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_eq!(v.text, plain.text, "the text is the same");
            assert_ne!(v.identity, plain.identity, "variant {i}");
            for w in &variants[i + 1..] {
                assert_ne!(v.identity, w.identity);
            }
        }
        // The same tool list, wherever its key stands, is the same identity;
        // what the template does not render (tool_choice) is not in it.
        let before = parse(&format!(
            r#"{{"model":"m"{tools},"messages":[{{"role":"user","content":"q"}}]}}"#
        ));
        assert_eq!(before.identity, variants[0].identity);
        assert_eq!(body(r#","tool_choice":"auto""#).identity, plain.identity);
    }

    #[test]
    fn tool_calls_and_media_leave_a_marker_where_they_stand() {
        let turn = |call: &str, image: &str| {
            parse(&format!(
                r#"{{"messages":[{{"role":"user","content":"q"}},
                {{"role":"assistant","content":null,"tool_calls":[{{"function":{{"arguments":"{call}"}}}}]}},
                {{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{image}"}}}},{{"type":"text","text":"what is it"}}]}}]}}"#
            ))
        };
        let a = turn("a", "data:1");
        let first = a.message_ends[0];
        for other in [turn("b", "data:1"), turn("a", "data:2")] {
            assert_eq!(other.text[..first], a.text[..first]);
            assert_ne!(other.text, a.text);
            assert_eq!(other.text.len(), a.text.len());
        }
        // Whichever key of the message comes first.
        let swapped = parse(
            r#"{"messages":[{"role":"user","content":"q"},
            {"tool_calls":[{"function":{"arguments":"a"}}],"content":"x","role":"assistant"}]}"#,
        );
        let ordered = parse(
            r#"{"messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":"x","tool_calls":[{"function":{"arguments":"a"}}]}]}"#,
        );
        assert_eq!(swapped.text, ordered.text);
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

    proptest::proptest! {
        /// A form body of any bytes never panics; a model found is short.
        #[test]
        fn any_form_body_reads_a_short_model_or_none(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1024),
            model in "[ -~]{0,300}",
        ) {
            let _ = Prompt::parse_form_model(&bytes);
            let form = format!(
                "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--b--\r\n"
            );
            let found = Prompt::parse_form_model(form.as_bytes()).model;
            proptest::prop_assert!(found.as_ref().is_none_or(|m| m.len() <= MAX_MODEL_NAME));
            if !model.trim().is_empty() && model.len() <= MAX_MODEL_NAME && !model.contains("\r\n--") {
                proptest::prop_assert_eq!(found.as_deref(), Some(model.trim()));
            }
        }
    }
}
