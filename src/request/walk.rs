//! The canonicalisation rules of the module header, walked over the scanner:
//! which fields are read, which skipped, and what each adds to its section.
//!
//! A field of the wrong type is an error, as it was for the serde visitors this
//! replaces (kept as the test oracle in `reference.rs`); so is nesting deeper
//! than serde_json's 128 levels in the fields that are read.

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
    Role,
    Content,
    Text,
    Type,
    Other,
}

fn field(key: &[u8]) -> Field {
    match key {
        b"messages" => Field::Messages,
        b"system" => Field::System,
        b"prompt" => Field::Prompt,
        b"prompt_cache_key" => Field::CacheKey,
        b"model" => Field::Model,
        b"cache_salt" => Field::CacheSalt,
        b"cache_prompt" => Field::CachePrompt,
        b"prompt_logprobs" => Field::PromptLogprobs,
        b"role" => Field::Role,
        b"content" => Field::Content,
        b"text" => Field::Text,
        b"type" => Field::Type,
        _ => Field::Other,
    }
}

/// Reads a body's top-level fields, each section within `max` bytes.
pub fn read(body: &[u8], max: usize) -> std::result::Result<Fields, JsonError> {
    let mut w = Walk {
        s: Scanner::new(body),
        section: Section::default(),
        max,
        reserve: body.len().min(max).saturating_add(32),
        depth: DEPTH,
        key: Vec::new(),
        word: Vec::new(),
    };
    let fields = w.top()?;
    w.s.end()?;
    Ok(fields)
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
}

impl Walk<'_> {
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
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match key {
                Field::Messages => {
                    self.begin(true);
                    self.messages()?;
                    f.messages = Some(std::mem::take(&mut self.section));
                }
                Field::System => {
                    self.begin(false);
                    self.content()?;
                    self.section.end_message(b"system", self.max);
                    f.system = Some(std::mem::take(&mut self.section));
                }
                Field::Prompt => {
                    self.begin(true);
                    self.texts()?;
                    self.section.messages += 1;
                    f.prompt = Some(std::mem::take(&mut self.section));
                }
                Field::CacheKey => f.key = self.cache_key()?,
                Field::Model => f.model = self.cache_key()?,
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
        self.depth += 1;
        Ok(f)
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
        let room = self.max.saturating_sub(self.section.text.len());
        self.section
            .text
            .extend_from_slice(bytes.get(..room).unwrap_or(bytes));
    }

    fn text(&mut self) -> Result<()> {
        self.s.bump();
        let limit = self.max;
        self.s.string(&mut Canonical {
            out: &mut self.section.text,
            limit,
        })
    }

    /// `messages`: a list of message objects, each closed after its content
    /// with its role (the two may come in either order).
    fn messages(&mut self) -> Result<()> {
        self.enter(b'[', "expected a list of messages")?;
        let mut first = true;
        while self.s.next_element(&mut first)? {
            self.enter(b'{', "expected a message object")?;
            let mut role = std::mem::take(&mut self.word);
            role.clear();
            let mut first = true;
            while let Some(key) = self.next_key(&mut first)? {
                match key {
                    Field::Role => self.word(&mut role)?,
                    Field::Content => self.content()?,
                    _ => self.s.skip_value()?,
                }
            }
            self.section.end_message(&role, self.max);
            self.word = role;
            self.depth += 1;
        }
        self.depth += 1;
        Ok(())
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

    /// A part: `text` counts, a nested `content` (tool results) counts, and a
    /// tool part marks a model turn.
    fn part(&mut self) -> Result<()> {
        self.enter(b'{', "expected an object")?;
        let mut first = true;
        while let Some(key) = self.next_key(&mut first)? {
            match key {
                Field::Text | Field::Content => self.content()?,
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
