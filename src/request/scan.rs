//! A single-pass JSON byte scanner: the lexical half of `Prompt::parse`.
//!
//! It accepts exactly the JSON that `serde_json::from_str` accepts, with the
//! same split between strings the parser reads (escapes validated as for a
//! Rust `&str`: surrogates must pair) and values it skips (only the grammar is
//! checked, as `serde::de::IgnoredAny` does, at any depth, without recursion).
//! UTF-8 is checked per string, and only for strings with a non-ASCII byte:
//! outside strings any non-ASCII byte is a syntax error anyway.
//!
//! Strings are scanned 64 bytes at a time for `"`, `\` and control bytes; the
//! runs between escapes are copied whole, so an escape every dozen bytes (code
//! in tool output) costs a few instructions, not a call.

use std::fmt;

/// Why a body is not JSON (or not the JSON the parser expects), and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    what: &'static str,
    at: usize,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} at byte {}", self.what, self.at)
    }
}

impl std::error::Error for JsonError {}

pub type Result<T> = std::result::Result<T, JsonError>;

/// How a number reads, as serde_json would hand it to a visitor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Number {
    /// An integer serde_json reads as `u64` or `i64` (`-0` is not one).
    Integer,
    /// Read as `f64`: a fraction, an exponent, `-0`, or an integer out of range.
    Float { finite: bool },
}

/// Where unescaped string bytes go: the canonical text (within a limit) or
/// nowhere (a skipped string, whose `\u` escapes are not paired up).
pub trait Sink {
    /// Validate surrogate pairs in `\u` escapes (serde_json does for `&str`).
    const PAIRS: bool;
    fn run(&mut self, bytes: &[u8], from: usize, to: usize);
    fn push(&mut self, bytes: &[u8]);
    fn byte(&mut self, byte: u8);
}

/// Skipped strings.
pub struct Skip;

impl Sink for Skip {
    const PAIRS: bool = false;
    fn run(&mut self, _: &[u8], _: usize, _: usize) {}
    fn push(&mut self, _: &[u8]) {}
    fn byte(&mut self, _: u8) {}
}

/// Unescaped bytes appended to `out` while it is shorter than `limit`.
pub struct Text<'o> {
    pub out: &'o mut Vec<u8>,
    pub limit: usize,
}

impl Sink for Text<'_> {
    const PAIRS: bool = true;
    #[inline(always)]
    fn run(&mut self, bytes: &[u8], from: usize, to: usize) {
        let keep = to
            .saturating_sub(from)
            .min(self.limit.saturating_sub(self.out.len()));
        if keep == 0 {
            return;
        }
        let old = self.out.len();
        // A short run is copied as a fixed 32 bytes and cut back: two stores,
        // not a call to memcpy.
        if keep <= 32 {
            if let Some(chunk) = bytes.get(from..).and_then(|s| s.first_chunk::<32>()) {
                self.out.extend_from_slice(chunk);
                self.out.truncate(old + keep);
                return;
            }
        }
        if let Some(run) = bytes.get(from..from + keep) {
            self.out.extend_from_slice(run);
        }
    }
    #[inline(always)]
    fn push(&mut self, bytes: &[u8]) {
        let keep = bytes.len().min(self.limit.saturating_sub(self.out.len()));
        if let Some(b) = bytes.get(..keep) {
            self.out.extend_from_slice(b);
        }
    }
    #[inline(always)]
    fn byte(&mut self, byte: u8) {
        if self.out.len() < self.limit {
            self.out.push(byte);
        }
    }
}

/// Bit `i` set where byte `i` of the block is `"`, `\` or a control byte; and
/// whether any byte is non-ASCII. Flags per byte (vector compares), then eight
/// at a time gathered into bits by a multiply.
#[inline(always)]
fn classify(block: &[u8; 64]) -> (u64, bool) {
    let mut flags = [0u8; 64];
    let mut high = 0u8;
    for (f, &b) in flags.iter_mut().zip(block) {
        *f = u8::from((b == b'"') | (b == b'\\') | (b < 0x20));
        high |= b;
    }
    let mut mask = 0u64;
    for (i, w) in flags.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
        mask |= (w.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * i);
    }
    (mask, high >= 0x80)
}

/// The classified block at `at`; past the end the input reads as `"` bytes,
/// which the caller finds are not there.
#[inline(always)]
fn block(bytes: &[u8], at: usize) -> (u64, bool) {
    match bytes.get(at..).and_then(|s| s.first_chunk::<64>()) {
        Some(block) => classify(block),
        None => {
            let mut pad = [b'"'; 64];
            for (d, s) in pad.iter_mut().zip(bytes.get(at..).unwrap_or_default()) {
                *d = *s;
            }
            classify(&pad)
        }
    }
}

/// What each one-letter escape stands for; 0 for none.
const UNESCAPE: [u8; 256] = {
    let mut t = [0u8; 256];
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t[b'/' as usize] = b'/';
    t[b'n' as usize] = b'\n';
    t[b't' as usize] = b'\t';
    t[b'r' as usize] = b'\r';
    t[b'b' as usize] = 0x08;
    t[b'f' as usize] = 0x0c;
    t
};

fn hex4(bytes: &[u8], at: usize) -> Option<u32> {
    let digits = bytes.get(at..at + 4)?;
    digits.iter().try_fold(0u32, |n, &d| {
        let v = (d as char).to_digit(16)?;
        Some(n << 4 | v)
    })
}

/// A cursor over the body.
pub struct Scanner<'b> {
    bytes: &'b [u8],
    pos: usize,
    /// Open containers of a skipped value (`true` for an object).
    frames: Vec<bool>,
}

impl<'b> Scanner<'b> {
    pub fn new(bytes: &'b [u8]) -> Self {
        Scanner {
            bytes,
            pos: 0,
            frames: Vec::new(),
        }
    }

    pub fn error<T>(&self, what: &'static str) -> Result<T> {
        Err(JsonError { what, at: self.pos })
    }

    /// The next byte after whitespace, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        while let Some(&b) = self.bytes.get(self.pos) {
            if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                return Some(b);
            }
            self.pos += 1;
        }
        None
    }

    #[inline]
    pub fn bump(&mut self) {
        self.pos += 1;
    }

    /// Consumes `byte` (after whitespace) or fails with `what`.
    pub fn expect(&mut self, byte: u8, what: &'static str) -> Result<()> {
        if self.peek() != Some(byte) {
            return self.error(what);
        }
        self.bump();
        Ok(())
    }

    /// Only whitespace may follow the value.
    pub fn end(&mut self) -> Result<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => self.error("trailing characters"),
        }
    }

    /// `true`, `false` or `null`, whose first byte has been peeked.
    pub fn literal(&mut self) -> Result<()> {
        let word: &[u8] = match self.bytes.get(self.pos) {
            Some(b't') => b"true",
            Some(b'f') => b"false",
            _ => b"null",
        };
        if self.bytes.get(self.pos..self.pos + word.len()) != Some(word) {
            return self.error("expected a value");
        }
        self.pos += word.len();
        Ok(())
    }

    /// Steps to the next element of an array whose `[` is consumed; `false`
    /// (with the `]` consumed) at its end.
    pub fn next_element(&mut self, first: &mut bool) -> Result<bool> {
        match self.peek() {
            Some(b']') => {
                self.bump();
                Ok(false)
            }
            Some(b',') if !*first => {
                self.bump();
                match self.peek() {
                    Some(b']') => self.error("trailing comma"),
                    Some(_) => Ok(true),
                    None => self.error("EOF in a list"),
                }
            }
            Some(_) if *first => {
                *first = false;
                Ok(true)
            }
            Some(_) => self.error("expected `,` or `]`"),
            None => self.error("EOF in a list"),
        }
    }

    /// Steps to the next key of an object whose `{` is consumed and reads it,
    /// validated, through `name`; consumes the `:`. `None` (with the `}`
    /// consumed) at its end.
    pub fn next_key<K>(
        &mut self,
        first: &mut bool,
        scratch: &mut Vec<u8>,
        name: impl FnOnce(&[u8]) -> K,
    ) -> Result<Option<K>> {
        match self.peek() {
            Some(b'}') => {
                self.bump();
                return Ok(None);
            }
            Some(b',') if !*first => {
                self.bump();
                if self.peek() == Some(b'}') {
                    return self.error("trailing comma");
                }
            }
            Some(_) if *first => *first = false,
            Some(_) => return self.error("expected `,` or `}`"),
            None => return self.error("EOF in an object"),
        }
        self.expect(b'"', "expected a key")?;
        let key = self.key(scratch)?;
        let key = name(key.unwrap_or(scratch.as_slice()));
        self.expect(b':', "expected `:`")?;
        Ok(Some(key))
    }

    /// A key (its `"` consumed): the raw bytes when plain ASCII, else `None`
    /// with the unescaped key in `scratch`.
    fn key(&mut self, scratch: &mut Vec<u8>) -> Result<Option<&'b [u8]>> {
        let bytes = self.bytes;
        let start = self.pos;
        let mut at = start;
        while let Some(&b) = bytes.get(at) {
            if b == b'"' {
                self.pos = at + 1;
                return Ok(bytes.get(start..at));
            }
            if b == b'\\' || !(0x20..0x80).contains(&b) {
                break;
            }
            at += 1;
        }
        scratch.clear();
        self.string(&mut Text {
            out: scratch,
            limit: usize::MAX,
        })?;
        Ok(None)
    }

    /// A string whose `"` is consumed, unescaped into `sink`.
    #[inline]
    pub fn string<S: Sink>(&mut self, sink: &mut S) -> Result<()> {
        let bytes = self.bytes;
        let start = self.pos;
        let mut run = start;
        let mut high = false;
        loop {
            let base = self.pos;
            let (mut mask, h) = block(bytes, base);
            high |= h;
            while mask != 0 {
                let t = base + mask.trailing_zeros() as usize;
                match bytes.get(t) {
                    Some(b'\\') => {
                        sink.run(bytes, run, t);
                        self.pos = t + 1;
                        run = self.escape(sink)?;
                    }
                    Some(b'"') => {
                        sink.run(bytes, run, t);
                        self.pos = t + 1;
                        return self.utf8(high, start, t);
                    }
                    Some(_) => {
                        self.pos = t;
                        return self.error("control character in a string");
                    }
                    None => {
                        self.pos = bytes.len();
                        return self.error("EOF in a string");
                    }
                }
                let done = self.pos - base;
                if done >= 64 {
                    break;
                }
                mask &= u64::MAX << done;
            }
            self.pos = self.pos.max(base + 64);
        }
    }

    #[cold]
    fn utf8_error(&mut self, start: usize) -> Result<()> {
        self.pos = start;
        self.error("invalid UTF-8 in a string")
    }

    #[inline]
    fn utf8(&mut self, high: bool, start: usize, end: usize) -> Result<()> {
        if high && std::str::from_utf8(self.bytes.get(start..end).unwrap_or_default()).is_err() {
            return self.utf8_error(start);
        }
        Ok(())
    }

    /// An escape whose `\` is consumed; returns where the next run of plain
    /// bytes starts. The common escapes go through a table, without a branch
    /// per kind.
    #[inline(always)]
    fn escape<S: Sink>(&mut self, sink: &mut S) -> Result<usize> {
        let at = self.pos;
        let e = self.bytes.get(at).copied().unwrap_or(0);
        let byte = UNESCAPE[usize::from(e)];
        if byte != 0 {
            sink.byte(byte);
            self.pos = at + 1;
            return Ok(self.pos);
        }
        self.rare_escape(sink)
    }

    #[cold]
    fn rare_escape<S: Sink>(&mut self, sink: &mut S) -> Result<usize> {
        match self.bytes.get(self.pos) {
            Some(b'u') => {
                self.pos += 1;
                self.unicode(sink)?;
                Ok(self.pos)
            }
            Some(_) => self.error("invalid escape"),
            None => self.error("EOF in a string"),
        }
    }

    /// The hex digits of a `\u` escape (and of its pair's second half).
    #[cold]
    fn unicode<S: Sink>(&mut self, sink: &mut S) -> Result<()> {
        let Some(n) = hex4(self.bytes, self.pos) else {
            return self.error("invalid \\u escape");
        };
        self.pos += 4;
        if !S::PAIRS {
            return Ok(());
        }
        let code = match n {
            0xDC00..=0xDFFF => return self.error("lone surrogate in \\u escape"),
            0xD800..=0xDBFF => {
                if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return self.error("lone surrogate in \\u escape");
                }
                self.pos += 2;
                match hex4(self.bytes, self.pos) {
                    Some(low @ 0xDC00..=0xDFFF) => {
                        self.pos += 4;
                        0x1_0000 + ((n - 0xD800) << 10 | (low - 0xDC00))
                    }
                    _ => return self.error("lone surrogate in \\u escape"),
                }
            }
            _ => n,
        };
        let Some(c) = char::from_u32(code) else {
            return self.error("invalid \\u escape");
        };
        sink.push(c.encode_utf8(&mut [0; 4]).as_bytes());
        Ok(())
    }

    /// A number whose first byte has been peeked.
    pub fn number(&mut self) -> Result<(Number, &'b [u8])> {
        let start = self.pos;
        let negative = self.bytes.get(start) == Some(&b'-');
        if negative {
            self.pos += 1;
        }
        let mut value = Some(0u64);
        match self.bytes.get(self.pos) {
            Some(b'0') => {
                self.pos += 1;
                if matches!(self.bytes.get(self.pos), Some(b'0'..=b'9')) {
                    return self.error("invalid number");
                }
            }
            Some(b'1'..=b'9') => {
                while let Some(&d @ b'0'..=b'9') = self.bytes.get(self.pos) {
                    value = value
                        .and_then(|v| v.checked_mul(10))
                        .and_then(|v| v.checked_add(u64::from(d - b'0')));
                    self.pos += 1;
                }
            }
            _ => return self.error("invalid number"),
        }
        let mut float = false;
        if self.bytes.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            self.digits()?;
            float = true;
        }
        if matches!(self.bytes.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.bytes.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            self.digits()?;
            float = true;
        }
        let text = self.bytes.get(start..self.pos).unwrap_or_default();
        let integer = match (float, value, negative) {
            (false, Some(_), false) => true,
            (false, Some(v), true) => (1..=1 << 63).contains(&v),
            _ => false,
        };
        if integer {
            return Ok((Number::Integer, text));
        }
        let finite = std::str::from_utf8(text)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .is_some_and(f64::is_finite);
        Ok((Number::Float { finite }, text))
    }

    /// One or more digits.
    fn digits(&mut self) -> Result<()> {
        if !matches!(self.bytes.get(self.pos), Some(b'0'..=b'9')) {
            return self.error("invalid number");
        }
        while matches!(self.bytes.get(self.pos), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        Ok(())
    }

    /// Skips one value, checking only its grammar (any depth, iteratively).
    pub fn skip_value(&mut self) -> Result<()> {
        let mut frames = std::mem::take(&mut self.frames);
        frames.clear();
        let result = self.skip_in(&mut frames);
        self.frames = frames;
        result
    }

    fn skip_in(&mut self, frames: &mut Vec<bool>) -> Result<()> {
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.bump();
                    self.string(&mut Skip)?;
                }
                Some(b'-' | b'0'..=b'9') => self.skip_number()?,
                Some(b't' | b'f' | b'n') => self.literal()?,
                Some(open @ (b'[' | b'{')) => {
                    self.bump();
                    let object = open == b'{';
                    match self.peek() {
                        Some(b']') if !object => self.bump(),
                        Some(b'}') if object => self.bump(),
                        _ => {
                            frames.push(object);
                            if object {
                                self.skip_key()?;
                            }
                            continue;
                        }
                    }
                }
                _ => return self.error("expected a value"),
            }
            // After a value: close what ends here, then on to the next value.
            loop {
                let Some(&object) = frames.last() else {
                    return Ok(());
                };
                match self.peek() {
                    Some(b',') => {
                        self.bump();
                        if object {
                            self.skip_key()?;
                        }
                        break;
                    }
                    Some(b']') if !object => self.bump(),
                    Some(b'}') if object => self.bump(),
                    _ => return self.error("expected `,` or the end of a list or object"),
                }
                frames.pop();
            }
        }
    }

    fn skip_key(&mut self) -> Result<()> {
        self.expect(b'"', "expected a key")?;
        self.string(&mut Skip)?;
        self.expect(b':', "expected `:`")
    }

    fn skip_number(&mut self) -> Result<()> {
        // The grammar only: serde_json does not convert a skipped number.
        let negative = self.bytes.get(self.pos) == Some(&b'-');
        if negative {
            self.pos += 1;
        }
        match self.bytes.get(self.pos) {
            Some(b'0') => {
                self.pos += 1;
                if matches!(self.bytes.get(self.pos), Some(b'0'..=b'9')) {
                    return self.error("invalid number");
                }
            }
            Some(b'1'..=b'9') => self.digits()?,
            _ => return self.error("invalid number"),
        }
        if self.bytes.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            self.digits()?;
        }
        if matches!(self.bytes.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.bytes.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            self.digits()?;
        }
        Ok(())
    }
}
