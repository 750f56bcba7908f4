//! A conversation's next turn from its earlier one. An agent loop sends its
//! whole conversation again each turn, a few messages longer. For a
//! template found windowed and a tokenizer used by pieces, the earlier
//! messages render as they did, so the next prompt is the earlier render
//! (without its generation prompt) followed by what the new messages add
//! after the last earlier one ([`ChatTemplate::render_after`]); and its ids
//! are the earlier ones up to the render's last added token (no piece
//! crosses one) followed by the ids of the text from there.
//!
//! [`Earlier`] is what a turn leaves for the next; the caller keeps it with
//! the earlier body (the router: with that body's checkpoint) and passes the
//! offset up to which the next body has the earlier one's bytes, just past
//! its last message. Only the bytes after it are read: the new messages,
//! and the fields after the list, which must render as the earlier turn's
//! did (their rendered fields are kept; else the next turn is rendered
//! whole).
//!
//! [`ChatTemplate::render_after`]: crate::ChatTemplate::render_after

use std::collections::HashMap;
use std::sync::Arc;

use minijinja::Value;
use serde_json::value::RawValue;

use crate::template::fields;
use crate::{ModelTokens, TokensError, NOT_RENDERED};

/// Text from an earlier render's last added token kept at most (a template
/// with no added token between messages would keep the whole render).
const MAX_REST: usize = 64 << 10;
/// The fields after the list kept as bytes at most (compared as bytes
/// first); longer, only their rendered fields are.
const MAX_TAIL: usize = 16 << 10;

/// What a conversation's turn leaves for its next (see the module header).
#[derive(Debug)]
pub struct Earlier {
    next: Next,
    /// Ids of the render before its last added token: the next turn's
    /// ids start with them.
    pub ids: usize,
    /// The render from there, without the generation prompt.
    rest: String,
    /// Bytes of the render without the generation prompt.
    len: usize,
}

impl Earlier {
    /// Bytes it holds, about.
    pub fn heap_bytes(&self) -> usize {
        self.render_bytes() + self.next.tail.heap_bytes() + self.rest.len() + 128
    }

    /// About the bytes of what the next turn renders again besides its new
    /// messages: the last message, tools and template arguments.
    pub fn render_bytes(&self) -> usize {
        self.next.last_bytes + self.next.context.bytes
    }
}

/// A prompt's text to tokenize: the whole render, or what follows an
/// earlier turn's ids.
#[derive(Debug)]
pub struct Prompt {
    pub text: String,
    /// Ids before `text` (an earlier turn's [`Earlier::ids`]; 0: whole).
    pub after_ids: usize,
    /// Bytes of the whole prompt.
    pub len: usize,
    /// Bytes of `text` before the generation prompt.
    head: usize,
    /// What its next turn is rendered from.
    next: Option<Next>,
}

impl Prompt {
    /// Whether its next turn can be continued from it ([`ModelTokens::earlier`]).
    pub fn continuable(&self) -> bool {
        self.next.is_some()
    }
}

/// What a turn's next is rendered from: its last message (and about its
/// bytes), what every turn of the conversation renders with, and the
/// fields after its message list.
#[derive(Debug)]
struct Next {
    last: Value,
    last_bytes: usize,
    context: Arc<Context>,
    tail: Tail,
}

/// The tools and template arguments a conversation renders with, the
/// generation prompt they give, and about their bytes.
#[derive(Debug)]
struct Context {
    tools: Option<Value>,
    kwargs: Option<Value>,
    generation: String,
    bytes: usize,
}

/// The fields of a body after its message list: their bytes (from the
/// list's `]`) when short, and the JSON text of those that render.
#[derive(Debug)]
struct Tail {
    bytes: Option<Arc<[u8]>>,
    rendered: Vec<(String, String)>,
}

impl Tail {
    /// `bytes` from the list's `]`; `None` when they do not end the body's
    /// object, or name another message list.
    fn read(bytes: &[u8]) -> Option<Self> {
        let fields = fields_after(bytes).ok()?;
        let mut rendered: Vec<(String, String)> = (fields.into_iter())
            .filter(|(k, _)| RENDERED.contains(&k.as_str()) || NOT_RENDERED.contains(&k.as_str()))
            .map(|(k, v)| (k, v.get().to_owned()))
            .collect();
        if rendered.iter().any(|(k, _)| k == "messages") {
            return None;
        }
        rendered.sort_unstable();
        Some(Self {
            bytes: (bytes.len() <= MAX_TAIL).then(|| Arc::from(bytes)),
            rendered,
        })
    }

    /// The tail of a body that continues this one's: the same bytes, or
    /// fields that render the same.
    fn next(&self, bytes: &[u8]) -> Option<Self> {
        if let Some(same) = self.bytes.as_ref().filter(|b| ***b == *bytes) {
            let rendered = self.rendered.clone();
            return Some(Self {
                bytes: Some(Arc::clone(same)),
                rendered,
            });
        }
        Self::read(bytes).filter(|t| t.rendered == self.rendered)
    }

    fn heap_bytes(&self) -> usize {
        let rendered: usize = self
            .rendered
            .iter()
            .map(|(k, v)| k.len() + v.len() + 48)
            .sum();
        self.bytes.as_ref().map_or(0, |b| b.len()) + rendered
    }
}

/// Keys of the body's fields after the message list that change the
/// prompt (or make it one not rendered here).
const RENDERED: [&str; 4] = [
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
];

impl ModelTokens {
    /// Whether a conversation's next turn is rendered and tokenized from
    /// its earlier one ([`ModelTokens::prompt_after`]).
    pub fn continues(&self) -> bool {
        self.template.windowed() && self.pieces.by_pieces()
    }

    /// A chat request's prompt, as [`ModelTokens::render`] renders it;
    /// with `list_end` (the offset just past the body's last message) and
    /// a model that [continues](ModelTokens::continues), what its next turn
    /// is rendered from ([`ModelTokens::earlier`]).
    pub fn prompt(&self, body: &[u8], list_end: Option<usize>) -> Result<Prompt, TokensError> {
        let value = self.checked(body)?;
        let (messages, tools, kwargs) = fields(&value)?;
        let text = self
            .template
            .render(messages.clone(), tools.clone(), kwargs.clone())?;
        let next = list_end
            .filter(|_| self.continues())
            .and_then(|end| Tail::read(tail_at(body, end)?))
            .and_then(|tail| {
                let last = messages.get_item(&Value::from(messages.len()?.checked_sub(1)?));
                let last = last.ok().filter(|m| !m.is_undefined())?;
                let generation = (self.template)
                    .generation_prompt(&last, tools.clone(), kwargs.clone())
                    .ok()?;
                let head = text.strip_suffix(generation.as_str())?.len();
                let values = [tools.as_ref(), kwargs.as_ref()];
                let bytes = values.into_iter().flatten().map(weight).sum::<usize>();
                let context = Context {
                    bytes: bytes + generation.len(),
                    tools,
                    kwargs,
                    generation,
                };
                let next = Next {
                    last_bytes: weight(&last),
                    last,
                    context: Arc::new(context),
                    tail,
                };
                Some((next, head))
            });
        let (next, head) = match next {
            Some((next, head)) => (Some(next), head),
            None => (None, text.len()),
        };
        Ok(Prompt {
            len: text.len(),
            text,
            after_ids: 0,
            head,
            next,
        })
    }

    /// The prompt of a body that continues the conversation `earlier` was
    /// left by: its bytes up to `at` are the earlier body's, through its
    /// last message. The text is what follows `earlier.ids` ids. An error
    /// when the body does not continue it (the fields after the list
    /// changed what renders, a message not rendered here).
    pub fn prompt_after(
        &self,
        earlier: &Earlier,
        body: &[u8],
        at: usize,
    ) -> Result<Prompt, TokensError> {
        let (new, close, last_bytes) = next_messages(body, at)?;
        let tail = (earlier.next.tail.next(&body[close..])).ok_or(TokensError::Unsupported(
            "the fields after the messages changed",
        ))?;
        let context = Arc::clone(&earlier.next.context);
        let after = (self.template).render_after(
            &earlier.next.last,
            &new,
            context.tools.clone(),
            context.kwargs.clone(),
            &context.generation,
        )?;
        let mut text = String::with_capacity(earlier.rest.len() + after.text.len());
        text.push_str(&earlier.rest);
        text.push_str(&after.text);
        let (last, last_bytes) = match new.last() {
            Some(m) => (m.clone(), last_bytes),
            None => (earlier.next.last.clone(), earlier.next.last_bytes),
        };
        Ok(Prompt {
            len: earlier.len - earlier.rest.len() + text.len(),
            head: earlier.rest.len() + after.head,
            text,
            after_ids: earlier.ids,
            next: Some(Next {
                last,
                last_bytes,
                context,
                tail,
            }),
        })
    }

    /// What `prompt`'s next turn is rendered from, `ids` being the ids of
    /// its whole text; `None` when it has none.
    pub fn earlier(&self, prompt: Prompt, ids: &[u32]) -> Option<Earlier> {
        let next = prompt.next?;
        let head = &prompt.text[..prompt.head];
        let cut = self.pieces.last_added(head);
        if head.len() - cut.unwrap_or(0) > MAX_REST {
            return None;
        }
        let (before, rest) = match cut {
            Some(cut) => {
                let from_cut = self.pieces.encode(&prompt.text[cut..]).ok()?.len();
                let before = ids.len().checked_sub(from_cut)?;
                (prompt.after_ids + before, &head[cut..])
            }
            None => (prompt.after_ids, head),
        };
        Some(Earlier {
            next,
            ids: before,
            rest: rest.to_owned(),
            len: prompt.len - (prompt.text.len() - prompt.head),
        })
    }
}

/// The body's bytes from its list's `]` on, the list ending at `end`.
fn tail_at(body: &[u8], end: usize) -> Option<&[u8]> {
    let close = skip_space(body, end);
    (body.get(close) == Some(&b']')).then(|| &body[close..])
}

fn skip_space(body: &[u8], mut i: usize) -> usize {
    while body.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

/// The messages after `at` (inside the list, just past a message), the
/// offset of the list's `]`, and the bytes of the last one.
fn next_messages(body: &[u8], at: usize) -> Result<(Vec<Value>, usize, usize), TokensError> {
    let mut new = Vec::new();
    let (mut i, mut last) = (at, 0);
    loop {
        i = skip_space(body, i);
        match body.get(i) {
            Some(b']') => return Ok((new, i, last)),
            Some(b',') => {
                let mut stream =
                    serde_json::Deserializer::from_slice(&body[i + 1..]).into_iter::<Value>();
                let message = (stream.next())
                    .ok_or(TokensError::Unsupported("a list that ends with a comma"))?
                    .map_err(|e| TokensError::Template(e.to_string()))?;
                last = stream.byte_offset();
                i += 1 + last;
                new.push(message);
            }
            _ => {
                return Err(TokensError::Unsupported(
                    "a body that does not continue the earlier messages",
                ))
            }
        }
    }
}

/// The fields of the body's object after its message list (`tail` starts
/// at the list's `]`), as their JSON text.
fn fields_after(tail: &[u8]) -> Result<HashMap<String, Box<RawValue>>, TokensError> {
    let bad = || TokensError::Template("the fields after the messages are not JSON".into());
    let rest = tail.strip_prefix(b"]").ok_or_else(bad)?;
    let rest = &rest[skip_space(rest, 0)..];
    // `, "key": ...}` or `}`.
    let (fields, ok) = match rest.strip_prefix(b",") {
        Some(f) => {
            let f = &f[skip_space(f, 0)..];
            (f, f.starts_with(b"\""))
        }
        None => (rest, rest.starts_with(b"}")),
    };
    if !ok {
        return Err(bad());
    }
    let mut object = Vec::with_capacity(fields.len() + 1);
    object.push(b'{');
    object.extend_from_slice(fields);
    serde_json::from_slice(&object).map_err(|e| TokensError::Template(e.to_string()))
}

/// About the bytes a value holds.
fn weight(v: &Value) -> usize {
    use minijinja::value::ValueKind as K;
    let items = v.try_iter().into_iter().flatten();
    16 + match v.kind() {
        K::String => v.as_str().map_or(0, str::len),
        K::Map => items
            .map(|k| weight(&k) + weight(&v.get_item(&k).unwrap_or_default()))
            .sum(),
        K::Seq => items.map(|x| weight(&x)).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_after_an_offset_and_the_fields_after_the_list_are_read() {
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "a"} ,
            {"role": "assistant", "content": "b"},{"role":"user","content":"c"} ], "stream": true}"#;
        let at = body.iter().position(|b| *b == b'}').expect("a message") + 1;
        let (new, close, last) = next_messages(body, at).expect("continues");
        assert_eq!(last, r#"{"role":"user","content":"c"}"#.len());
        assert_eq!(new.len(), 2);
        assert_eq!(
            new[1].get_attr("content").expect("content").as_str(),
            Some("c")
        );
        assert_eq!(&body[close..close + 1], b"]");
        let fields = fields_after(&body[close..]).expect("fields");
        assert_eq!(fields["stream"].get(), "true");
        assert!(fields_after(b"]}").expect("none").is_empty());
        assert!(fields_after(b"],}").is_err() && fields_after(br#"]"k":1}"#).is_err());
        // Nothing new.
        let last = body
            .windows(3)
            .position(|w| w == b"} ]")
            .expect("the list's end");
        assert_eq!(next_messages(body, last + 1).expect("ends").0.len(), 0);
        // Not inside the list after a message, or a broken message.
        assert!(next_messages(body, 3).is_err());
        assert!(next_messages(br#", {"role": "#, 0).is_err());
        assert!(next_messages(b", ]", 0).is_err());
        assert_eq!(tail_at(body, last + 1), Some(&body[last + 2..]));
        assert_eq!(tail_at(body, 3), None);
    }

    #[test]
    fn a_tail_continues_with_the_same_bytes_or_the_same_rendered_fields() {
        let tail =
            Tail::read(br#"], "model": "m", "tools": [{"type": "function"}]}"#).expect("reads");
        assert_eq!(
            tail.rendered,
            [("tools".to_owned(), r#"[{"type": "function"}]"#.to_owned())]
        );
        let same = tail
            .next(br#"], "model": "m", "tools": [{"type": "function"}]}"#)
            .expect("same");
        assert!(Arc::ptr_eq(
            same.bytes.as_ref().expect("kept"),
            tail.bytes.as_ref().expect("kept")
        ));
        // Other fields changed, or moved: the rendered ones are the same.
        assert!(tail
            .next(br#"], "tools": [{"type": "function"}], "user": "u"}"#)
            .is_some());
        // Tools changed, a salt or another list of messages added: not.
        assert!(tail.next(br#"], "model": "m", "tools": []}"#).is_none());
        assert!(tail
            .next(br#"], "tools": [{"type": "function"}], "cache_salt": "s"}"#)
            .is_none());
        assert!(Tail::read(br#"], "messages": []}"#).is_none());
        // A long tail is compared by its rendered fields only.
        let long = format!(r#"], "metadata": "{}"}}"#, "x".repeat(MAX_TAIL));
        let long = Tail::read(long.as_bytes()).expect("reads");
        assert!(long.bytes.is_none() && long.heap_bytes() < 100);
    }

    #[test]
    fn a_value_s_weight_counts_its_strings() {
        let v =
            Value::from_serialize(serde_json::json!({"role": "tool", "content": "x".repeat(1000)}));
        let w = weight(&v);
        assert!((1000..1200).contains(&w), "{w}");
    }
}
