//! The canonicalisation rules of the module header, walked over the scanner:
//! which fields are read, which skipped, and what each adds to its section.
//!
//! A field of the wrong type is an error, as it was for the serde visitors this
//! replaces (kept as the test oracle in `reference.rs`); so is nesting deeper
//! than serde_json's 128 levels in the fields that are read.

use std::sync::Arc;

use super::identity::{self, CALLS, PARTS};
use super::scan::{Canonical, JsonError, Number, Result, Scanner, Unescaped};
use super::{Fields, Section, MESSAGE_END};

/// serde_json's recursion limit: containers read, not skipped, count.
const DEPTH: u8 = 128;

/// The map keys the parser acts on; everything else is skipped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Field {
    Messages,
    System,
    Prompt,
    CacheKey,
    Model,
    /// Engine options that skip its prefix cache (see `CacheBypass`).
    CacheSalt,
    CachePrompt,
    PromptLogprobs,
    /// `stream`: whether the answer comes as it is generated.
    Stream,
    Role,
    Content,
    Text,
    Type,
    /// A top-level field the chat template renders (see `identity`), by its
    /// place in `identity::RENDERED`.
    Rendered(usize),
    /// A message's tool calls (see `identity::CALLS`).
    Calls,
    /// A part's media or tool input (see `identity::PARTS`).
    Media,
    Other,
}

fn field(key: &[u8]) -> Field {
    match key {
        b"messages" => Field::Messages,
        b"system" => Field::System,
        // SGLang's native `/generate` names its prompt's token ids so.
        b"prompt" | b"input_ids" => Field::Prompt,
        b"prompt_cache_key" => Field::CacheKey,
        b"model" => Field::Model,
        b"cache_salt" => Field::CacheSalt,
        b"cache_prompt" => Field::CachePrompt,
        b"prompt_logprobs" => Field::PromptLogprobs,
        b"stream" => Field::Stream,
        b"role" => Field::Role,
        b"content" => Field::Content,
        b"text" => Field::Text,
        b"type" => Field::Type,
        _ if CALLS.contains(&key) => Field::Calls,
        _ if PARTS.contains(&key) => Field::Media,
        _ => identity::rendered(key).map_or(Field::Other, Field::Rendered),
    }
}

/// Where a body's message list ended its last message (the offset just
/// past its `}`), the fields read before the list (none a `prompt`), and
/// the list's section as it ended: what a checkpoint resumes from (see
/// `checkpoint`). Only a body with one `messages` key has one: the fields
/// are copied once, not once per repeated key.
#[derive(Debug)]
pub struct Mark {
    pub raw_len: usize,
    pub fields: Arc<Fields>,
    pub list: Shape,
}

/// A section's size and signals, without its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub text: usize,
    pub ends: usize,
    pub model_turn: bool,
    pub root_end: Option<usize>,
    pub messages: usize,
}

impl Shape {
    fn of(s: &Section) -> Self {
        Shape {
            text: s.len(),
            ends: s.message_ends.len(),
            model_turn: s.model_turn,
            root_end: s.root_end,
            messages: s.messages,
        }
    }
}

/// Reads a body's top-level fields, each section within `max` bytes, and
/// with `marks` the end of its message list.
pub fn read(
    body: &[u8],
    max: usize,
    marks: bool,
) -> std::result::Result<(Fields, Option<Mark>), JsonError> {
    let mut w = Walk::new(body, 0, max, body.len().min(max).saturating_add(32));
    w.marks = marks;
    let fields = w.top()?;
    w.s.end()?;
    Ok((fields, w.mark))
}

/// What [`resume`] read: as [`read`] would, and whether the body's message
/// list is the one resumed (no other `messages` key followed it).
pub struct Resumed {
    pub fields: Fields,
    pub mark: Option<Mark>,
    pub continued: bool,
}

/// Reads a body whose first `from.raw_len` bytes are those of a body that
/// left `from`, from there: `list` holds the message list's section as it
/// was at that offset. What it reads is what [`read`] reads of the whole
/// body (the walk's state at the offset is the same).
pub fn resume(
    body: &[u8],
    max: usize,
    from: &Mark,
    list: Section,
) -> std::result::Result<Resumed, JsonError> {
    let mut w = Walk::new(body, from.raw_len, max, 0);
    w.section = list;
    (w.marks, w.lists) = (true, 1);
    // Inside the top-level object and its message list.
    w.depth -= 2;
    let last = w.elements(false)?.unwrap_or(from.raw_len);
    w.depth += 1;
    let mut fields = from.fields.before_list();
    w.mark = Some(Mark {
        raw_len: last,
        fields: Arc::clone(&from.fields),
        list: Shape::of(&w.section),
    });
    fields.messages = Some(std::mem::take(&mut w.section));
    w.keys(&mut fields, false)?;
    w.depth += 1;
    w.s.end()?;
    Ok(Resumed {
        fields,
        mark: w.mark,
        continued: w.lists == 1,
    })
}

struct Walk<'b> {
    s: Scanner<'b>,
    section: Section,
    max: usize,
    /// Capacity for the first prompt-carrying section (the body's size, capped;
    /// 32 more for the scanner's overlong copies).
    reserve: usize,
    /// Containers still allowed to open.
    depth: u8,
    key: Vec<u8>,
    /// Reused for short strings (roles, part types).
    word: Vec<u8>,
    mark: Option<Mark>,
    /// Whether to mark the message list, and `messages` keys read.
    marks: bool,
    lists: u32,
}

impl<'b> Walk<'b> {
    fn new(body: &'b [u8], at: usize, max: usize, reserve: usize) -> Self {
        Walk {
            s: Scanner::at(body, at),
            section: Section::default(),
            max,
            reserve,
            depth: DEPTH,
            key: Vec::new(),
            word: Vec::new(),
            mark: None,
            marks: false,
            lists: 0,
        }
    }

    /// Consumes `open` and counts a level of nesting.
    fn enter(&mut self, open: u8, what: &'static str) -> Result<()> {
        self.s.expect(open, what)?;
        self.depth -= 1;
        if self.depth == 0 {
            return self.s.error("nested too deeply");
        }
        Ok(())
    }

    fn next_key(&mut self, first: &mut bool) -> Result<Option<Field>> {
        self.s.next_key(first, &mut self.key, field)
    }

    fn top(&mut self) -> Result<Fields> {
        self.enter(b'{', "expected a JSON object")?;
        let mut f = Fields::default();
        self.keys(&mut f, true)?;
        self.depth += 1;
        Ok(f)
    }

    /// The keys of the top-level object, up to its `}`.
    fn keys(&mut self, f: &mut Fields, mut first: bool) -> Result<()> {
        while let Some(key) = self.next_key(&mut first)? {
            match key {
                Field::Messages => {
                    self.lists += 1;
                    let marks = self.marks && self.lists == 1 && f.prompt.is_none();
                    let before = marks.then(|| Arc::new(f.before_list()));
                    self.begin(true);
                    let last = self.messages()?;
                    let list = Shape::of(&self.section);
                    f.messages = Some(std::mem::take(&mut self.section));
                    self.mark = last.zip(before).map(|(raw_len, fields)| Mark {
                        raw_len,
                        fields,
                        list,
                    });
                }
                Field::System => {
                    self.begin(false);
                    self.content()?;
                    self.section.end_message(b"system", self.max);
                    f.system = Some(std::mem::take(&mut self.section));
                }
                // SGLang's native `/generate` names its prompt `text`.
                Field::Prompt | Field::Text => {
                    self.begin(true);
                    self.texts()?;
                    self.section.messages += 1;
                    f.prompt = Some(std::mem::take(&mut self.section));
                }
                Field::CacheKey => f.key = self.cache_key()?,
                Field::Model => f.model = self.cache_key()?,
                Field::Rendered(i) => f.rendered[i] = Some(identity::hash(self.s.skip_raw()?)),
                Field::Stream => f.stream = self.s.skip_raw()? == b"true",
                Field::CacheSalt if self.s.peek() == Some(b'"') => {
                    f.salt = self.cache_key()?;
                    f.odd_salt = false;
                }
                Field::CacheSalt | Field::PromptLogprobs | Field::CachePrompt => {
                    // A salt that is not a string (null: none), or any value
                    // but null for prompt logprobs; `cache_prompt` turns the
                    // cache off with `false` only.
                    let first = self.s.peek();
                    match key {
                        Field::CacheSalt => {
                            f.salt = None;
                            f.odd_salt = first != Some(b'n');
                        }
                        Field::PromptLogprobs => f.logprobs = first != Some(b'n'),
                        _ => f.no_cache = first == Some(b'f'),
                    }
                    self.s.skip_value()?;
                }
                _ => self.s.skip_value()?,
            }
        }
        Ok(())
    }

    /// A fresh section for one top-level field: a repeated key replaces, never
    /// accumulates, so the work stays linear in the body.
    fn begin(&mut self, reserve: bool) {
        let capacity = if reserve {
            std::mem::take(&mut self.reserve)
        } else {
            0
        };
        self.section = Section {
            text: Vec::with_capacity(capacity),
            ..Section::default()
        };
    }

    fn append(&mut self, bytes: &[u8]) {
        let room = self.max.saturating_sub(self.section.len());
        self.section
            .text
            .extend_from_slice(bytes.get(..room).unwrap_or(bytes));
    }

    fn text(&mut self) -> Result<()> {
        self.s.bump();
        let limit = self.max.saturating_sub(self.section.base);
        self.s.string(&mut Canonical {
            out: &mut self.section.text,
            limit,
        })
    }

    /// `messages`: a list of message objects, each closed after its content
    /// with its role (the two may come in either order). Where its last
    /// message ended, if it has one.
    fn messages(&mut self) -> Result<Option<usize>> {
        self.enter(b'[', "expected a list of messages")?;
        let last = self.elements(true)?;
        self.depth += 1;
        Ok(last)
    }

    /// The messages of a list up to its `]`.
    fn elements(&mut self, mut first: bool) -> Result<Option<usize>> {
        let mut last = None;
        while self.s.next_element(&mut first)? {
            self.enter(b'{', "expected a message object")?;
            let mut role = std::mem::take(&mut self.word);
            role.clear();
            let (mut first, mut calls) = (true, None);
            while let Some(key) = self.next_key(&mut first)? {
                match key {
                    Field::Role => self.word(&mut role)?,
                    Field::Content => self.content()?,
                    Field::Calls => calls = Some(identity::marker(self.s.skip_raw()?)),
                    _ => self.s.skip_value()?,
                }
            }
            // After the content, whichever key came first.
            if let Some(calls) = calls {
                self.append(&calls);
            }
            self.section.end_message(&role, self.max);
            self.word = role;
            self.depth += 1;
            last = Some(self.s.pos());
        }
        Ok(last)
    }

    /// A string (roles, part types) into `out`, or null (empty).
    fn word(&mut self, out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        match self.s.peek() {
            Some(b'"') => {
                self.s.bump();
                self.s.string(&mut Unescaped {
                    out,
                    limit: usize::MAX,
                })
            }
            Some(b'n') => self.s.literal(),
            _ => self.s.error("expected a string"),
        }
    }

    fn cache_key(&mut self) -> Result<Option<String>> {
        let mut key = Vec::new();
        if self.s.peek() == Some(b'n') {
            self.s.literal()?;
            return Ok(None);
        }
        self.s.expect(b'"', "expected a string")?;
        self.s.string(&mut Unescaped {
            out: &mut key,
            limit: usize::MAX,
        })?;
        match String::from_utf8(key) {
            Ok(key) => Ok(Some(key).filter(|k| !k.is_empty())),
            Err(_) => self.s.error("invalid UTF-8 in a string"),
        }
    }

    /// Message content: a string, a list of parts, a part, or a scalar (ignored).
    fn content(&mut self) -> Result<()> {
        match self.s.peek() {
            Some(b'"') => self.text(),
            Some(b'[') => {
                self.enter(b'[', "expected a list")?;
                let mut first = true;
                while self.s.next_element(&mut first)? {
                    self.content()?;
                }
                self.depth += 1;
                Ok(())
            }
            Some(b'{') => self.part(),
            Some(b't' | b'f' | b'n') => self.s.literal(),
            Some(b'-' | b'0'..=b'9') => match self.s.number()? {
                (Number::Float { finite: false }, _) => self.s.error("number out of range"),
                _ => Ok(()),
            },
            _ => self.s.error("expected a value"),
        }
    }

    /// A part: `text` counts, a nested `content` (tool results) counts, media
    /// and tool input leave their marker, and a tool part marks a model turn.
    fn part(&mut self) -> Result<()> {
        self.enter(b'{', "expected an object")?;
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match key {
                Field::Text | Field::Content => self.content()?,
                Field::Media => {
                    let marker = identity::marker(self.s.skip_raw()?);
                    self.append(&marker);
                }
                Field::Type => {
                    let mut kind = std::mem::take(&mut self.word);
                    self.word(&mut kind)?;
                    self.section.model_turn |= matches!(
                        kind.as_slice(),
                        b"tool_result" | b"tool_use" | b"function_call_output"
                    );
                    self.word = kind;
                }
                _ => self.s.skip_value()?,
            }
        }
        self.depth += 1;
        Ok(())
    }

    /// A completions `prompt`: a string, or nested lists of strings and token
    /// ids (list items joined by `0x1E`, token ids as decimal numbers).
    fn texts(&mut self) -> Result<()> {
        match self.s.peek() {
            Some(b'"') => self.text(),
            Some(b'[') => {
                self.enter(b'[', "expected a list")?;
                let (mut first, mut joined) = (true, false);
                while self.s.next_element(&mut first)? {
                    if joined {
                        self.append(&[MESSAGE_END]);
                    }
                    self.texts()?;
                    joined = true;
                }
                self.depth += 1;
                Ok(())
            }
            Some(b'n') => self.s.literal(),
            Some(b'-' | b'0'..=b'9') => match self.s.number()? {
                (Number::Integer, digits) => {
                    self.append(digits);
                    self.append(b" ");
                    Ok(())
                }
                _ => self.s.error("expected an integer token id"),
            },
            _ => self.s.error("expected a prompt"),
        }
    }
}
