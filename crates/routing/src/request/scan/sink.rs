//! Where a scanned string's bytes go: nowhere, unescaped, or in canonical
//! escaped form.

/// Where a string's bytes go: unescaped (keys, roles), in canonical escaped
/// form (prompt text), or nowhere (a skipped string, whose `\u` escapes are
/// not paired up).
pub trait Sink {
    /// Validate surrogate pairs in `\u` escapes (serde_json does for `&str`).
    const PAIRS: bool;
    /// The escapes of the canonical form (`\"`, `\\`, `\b`, `\f`, `\n`,
    /// `\r`, `\t`) stay in the run as written, so a string that has no other
    /// escape is one run: no work per escape.
    const KEEP_ESCAPES: bool;
    fn run(&mut self, bytes: &[u8], from: usize, to: usize);
    fn push(&mut self, bytes: &[u8]);
    fn byte(&mut self, byte: u8);
    /// A character read from a `\u` escape.
    fn char(&mut self, c: char);
}

/// Skipped strings.
pub struct Skip;

impl Sink for Skip {
    const PAIRS: bool = false;
    const KEEP_ESCAPES: bool = true;
    fn run(&mut self, _: &[u8], _: usize, _: usize) {}
    fn push(&mut self, _: &[u8]) {}
    fn byte(&mut self, _: u8) {}
    fn char(&mut self, _: char) {}
}

/// A string's bytes appended to `out` while it is shorter than `limit`:
/// unescaped, or with `CANONICAL` in the form `serde_json` writes (the
/// escapes above, other control characters as `\u00xx` in lower-case hex,
/// everything else as UTF-8), which is one-to-one with the unescaped text and
/// keeps prefixes prefixes, whatever escapes the client chose.
pub struct Text<'o, const CANONICAL: bool> {
    pub out: &'o mut Vec<u8>,
    pub limit: usize,
}

/// Keys, roles, part types, `prompt_cache_key`.
pub type Unescaped<'o> = Text<'o, false>;
/// Prompt text.
pub type Canonical<'o> = Text<'o, true>;

impl<const CANONICAL: bool> Sink for Text<'_, CANONICAL> {
    const PAIRS: bool = true;
    const KEEP_ESCAPES: bool = CANONICAL;
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
    fn char(&mut self, c: char) {
        let short = match c {
            '"' => Some(b'"'),
            '\\' => Some(b'\\'),
            '\u{8}' => Some(b'b'),
            '\u{c}' => Some(b'f'),
            '\n' => Some(b'n'),
            '\r' => Some(b'r'),
            '\t' => Some(b't'),
            _ => None,
        };
        match (CANONICAL, short) {
            (true, Some(e)) => self.push(&[b'\\', e]),
            (true, None) if c < ' ' => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let n = usize::from(c as u8);
                self.push(&[b'\\', b'u', b'0', b'0', HEX[n >> 4], HEX[n & 15]]);
            }
            _ => self.push(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}
