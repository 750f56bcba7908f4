//! A single-pass JSON byte scanner: the lexical half of `Prompt::parse`.
//!
//! It reads every JSON document as `serde_json::from_str` does, and refuses
//! what serde_json refuses, strings the parser reads validated as for a Rust
//! `&str` (surrogates must pair), with one exception: a list or object the
//! parser skips unread is only matched to its closing bracket, 64 bytes at a
//! time, so a fault inside one (or its depth) is not looked for. UTF-8 is
//! checked per string read, and only for strings with a non-ASCII byte:
//! outside strings any non-ASCII byte is a syntax error anyway.
//!
//! Strings are scanned 64 bytes at a time for `"`, `\` and control bytes; the
//! runs between escapes are copied whole. Prompt text keeps the common escapes
//! as written ([`Canonical`]), so an escape every dozen bytes (code in tool
//! output) costs a table lookup, and the string one copy.

use std::fmt;

mod sink;

pub use sink::{Canonical, Sink, Skip, Unescaped};

use super::blocks::{
    block, brackets, canonical_escape, classify, escaped, letter_n, letters, prefix_xor,
    short_plain,
};

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
}

impl<'b> Scanner<'b> {
    /// A scanner that starts reading at byte `pos`.
    pub fn at(bytes: &'b [u8], pos: usize) -> Self {
        Scanner { bytes, pos }
    }

    /// The offset of the next byte to read.
    pub fn pos(&self) -> usize {
        self.pos
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
        let (bytes, start) = (self.bytes, self.pos);
        if let Some(len) = short_plain(bytes, start) {
            self.pos = start + len + 1;
            return Ok(bytes.get(start..start + len));
        }
        scratch.clear();
        self.string(&mut Unescaped {
            out: scratch,
            limit: usize::MAX,
        })?;
        Ok(None)
    }

    /// A string whose `"` is consumed, into `sink`.
    #[inline]
    pub fn string<S: Sink>(&mut self, sink: &mut S) -> Result<()> {
        // Short plain strings (ids, roles, types) end before a block is worth
        // classifying.
        let (bytes, start) = (self.bytes, self.pos);
        if let Some(len) = short_plain(bytes, start) {
            sink.run(bytes, start, start + len);
            self.pos = start + len + 1;
            return Ok(());
        }
        if S::KEEP_ESCAPES {
            if let Some(done) = self.canonical_string(sink) {
                return done;
            }
        }
        self.escaped_string(sink)
    }

    /// A string whose escapes are all of the canonical form (most are): one
    /// run, found 64 bytes at a time with no work per escape beyond checking
    /// its letter. `None`, with nothing consumed or written, for any other
    /// string, which `escaped_string` then reads (or rejects).
    #[inline(always)]
    fn canonical_string<S: Sink>(&mut self, sink: &mut S) -> Option<Result<()>> {
        let bytes = self.bytes;
        let start = self.pos;
        let mut at = start;
        let (mut carry, mut high) = (0, 0);
        loop {
            let m = block(bytes, at, classify);
            let escaped = escaped(m.backslash, &mut carry);
            let quote = m.quote & !escaped;
            // The bytes before the closing quote; all of them when there is none.
            let inside = quote.wrapping_sub(1) & !quote;
            if m.control & inside != 0 {
                return None;
            }
            // Escapes other than `\n`, `\"` and `\\` are checked letter by letter.
            let other = escaped & inside & !(m.quote | m.backslash | block(bytes, at, letter_n));
            if other != 0 && other & !block(bytes, at, letters) != 0 {
                return None;
            }
            high |= m.high & inside;
            if quote != 0 {
                let end = at + quote.trailing_zeros() as usize;
                if end >= bytes.len() {
                    return None;
                }
                sink.run(bytes, start, end);
                self.pos = end + 1;
                return Some(self.utf8(high != 0, start, end));
            }
            at += 64;
        }
    }

    /// Any string, escapes handled one by one.
    fn escaped_string<S: Sink>(&mut self, sink: &mut S) -> Result<()> {
        let bytes = self.bytes;
        let start = self.pos;
        let mut run = start;
        let mut high = false;
        loop {
            let base = self.pos;
            let m = block(bytes, base, classify);
            let mut mask = m.quote | m.backslash | m.control;
            high |= m.high != 0;
            while mask != 0 {
                let t = base + mask.trailing_zeros() as usize;
                match bytes.get(t) {
                    Some(b'\\')
                        if S::KEEP_ESCAPES
                            && bytes.get(t + 1).is_some_and(|&e| canonical_escape(e)) =>
                    {
                        self.pos = t + 2;
                    }
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
        sink.char(c);
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

    /// Skips one value as [`Scanner::skip_value`] does; the bytes it spans.
    pub fn skip_raw(&mut self) -> Result<&'b [u8]> {
        self.peek();
        let start = self.pos;
        self.skip_value()?;
        Ok(self.bytes.get(start..self.pos).unwrap_or_default())
    }

    /// Skips one value: a scalar checked as serde_json checks it, a list or
    /// object by [`Scanner::skip_container`].
    pub fn skip_value(&mut self) -> Result<()> {
        match self.peek() {
            Some(b'"') => {
                self.bump();
                self.string(&mut Skip)
            }
            Some(b'-' | b'0'..=b'9') => self.skip_number(),
            Some(b't' | b'f' | b'n') => self.literal(),
            Some(b'[' | b'{') => self.skip_container(),
            _ => self.error("expected a value"),
        }
    }

    /// Skips a list or object whose first byte has been peeked, 64 bytes at a
    /// time: its end is the bracket that brings the nesting back to zero
    /// outside strings (quotes found as in [`Scanner::string`]). Only that is
    /// checked, not the grammar inside: the router does not read this value,
    /// and a body malformed only inside one is forwarded like any other (the
    /// engine, which reads it, refuses it).
    fn skip_container(&mut self) -> Result<()> {
        let bytes = self.bytes;
        let mut at = self.pos;
        // Escape carry; all ones when a block starts inside a string.
        let (mut carry, mut inside) = (0, 0u64);
        let mut depth = 0usize;
        while at < bytes.len() {
            let m = block(bytes, at, brackets);
            let quotes = m.quote & !escaped(m.backslash, &mut carry);
            let strings = prefix_xor(quotes) ^ inside;
            inside = 0u64.wrapping_sub(strings >> 63);
            let mut marks = (m.open | m.close) & !strings;
            while marks != 0 {
                let i = marks.trailing_zeros();
                if m.open >> i & 1 == 1 {
                    depth += 1;
                } else {
                    depth -= 1;
                    if depth == 0 {
                        self.pos = at + i as usize + 1;
                        return Ok(());
                    }
                }
                marks &= marks - 1;
            }
            at += 64;
        }
        self.pos = bytes.len();
        self.error("EOF in a list or object")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_strings_read_the_same_on_both_paths() {
        let text = "fn main() { println!(\"hi\\\\\"); }\n\t\u{1}é".repeat(40);
        let json = serde_json::to_string(&text).unwrap();
        for tail in ["", "\\/", "\\u00e9"] {
            let body = format!("{}{tail}\"", &json[..json.len() - 1]);
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            let mut s = Scanner::at(&body.as_bytes()[1..], 0);
            s.string(&mut Canonical {
                out: &mut fast,
                limit: usize::MAX,
            })
            .unwrap();
            let mut s = Scanner::at(&body.as_bytes()[1..], 0);
            s.escaped_string(&mut Canonical {
                out: &mut slow,
                limit: usize::MAX,
            })
            .unwrap();
            assert_eq!(fast, slow, "tail {tail:?}");
            assert_eq!(
                fast,
                [
                    &json[1..json.len() - 1],
                    if tail.is_empty() {
                        ""
                    } else if tail == "\\/" {
                        "/"
                    } else {
                        "é"
                    }
                ]
                .concat()
                .as_bytes()
            );
        }
    }
}
