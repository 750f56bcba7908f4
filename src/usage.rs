//! What the engine says it reused: the cache figures of a response, read as
//! it streams past (no buffering, no delay), and the verdict on a pin.
//!
//! ```text
//! FIELDS  cached  usage.prompt_tokens_details.cached_tokens (vLLM, SGLang, llama.cpp,
//!                 the simulator; input_tokens_details.cached_tokens in the Responses API)
//!                 timings.cache_n (llama.cpp), usage.cache_read_input_tokens (Anthropic)
//!         prompt  usage.prompt_tokens, usage.input_tokens; Anthropic's input_tokens leave
//!                 out cache reads and writes, which are added back
//!         The last figure of each wins: an SSE stream's last usage chunk is its total.
//! MATCH   a JSON key is `"` name `"`, then `:` and digits, with any whitespace between;
//!         in valid JSON that byte run cannot sit inside a string (its quotes would be
//!         escaped), so a byte scan that jumps from quote to quote finds exactly the keys.
//! COUNTED a response that reported both figures, cached at most prompt, both under 2^32
//!         (anything else is not a usage report); a request that told its engine to
//!         skip the cache (`cache_salt`, ...) reports nothing about the replica.
//! VERDICT a placement that predicted reuse of at least MIN_VERDICT_TOKENS (matched bytes /
//!         BYTES_PER_TOKEN) is a hit when the engine reports at least half of it cached,
//!         else a miss; a miss with under a tenth of it cached is `Lost`: the replica no
//!         longer holds what the index believes (evicted, or a restarted engine).
//!         Shorter predictions get none: an engine's cache block can miss them whole.
//! ```

use std::sync::LazyLock;

use aho_corasick::packed::Searcher;
use aho_corasick::Span;
use memchr::memchr_iter;

/// Longest key looked for (`cache_creation_input_tokens`).
const MAX_KEY: usize = 27;

/// Predictions shorter than this (tokens) get no verdict.
pub const MIN_VERDICT_TOKENS: u64 = 256;

/// Which figure a key carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Figure {
    Cached,
    Prompt,
    /// Anthropic's cache reads and writes (outside its `input_tokens`).
    CacheRead,
    CacheWrite,
}

/// The keys looked for, and the figure each carries.
const KEYS: [(&[u8], Figure); 6] = [
    (b"cached_tokens", Figure::Cached),
    (b"cache_n", Figure::Cached),
    (b"prompt_tokens", Figure::Prompt),
    (b"input_tokens", Figure::Prompt),
    (b"cache_read_input_tokens", Figure::CacheRead),
    (b"cache_creation_input_tokens", Figure::CacheWrite),
];

/// The first letters of [`KEYS`]: a quoted run that starts otherwise is
/// dropped at once.
const FIRST: [u8; 3] = [b'c', b'p', b'i'];

fn is_key_letter(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'_')
}

/// How every key of [`KEYS`] ends, closing quote included.
const ENDINGS: [&[u8]; 2] = [b"tokens\"", b"cache_n\""];

/// The index of the quote that closes the first of [`ENDINGS`] to start at
/// or after `from`: both looked for in one SIMD pass (Teddy).
fn next_key_end(bytes: &[u8], from: usize) -> Option<usize> {
    static ENDS: LazyLock<Option<Searcher>> = LazyLock::new(|| Searcher::new(ENDINGS));
    match &*ENDS {
        Some(ends) => ends
            .find_in(bytes, Span::from(from..bytes.len()))
            .map(|m| m.end() - 1),
        None => next_key_end_each(bytes, from),
    }
}

/// [`next_key_end`] on a target without a SIMD searcher: from quote to
/// quote, each checked for an ending before it (each quote read once over a
/// piece, as the calls move on past it).
fn next_key_end_each(bytes: &[u8], from: usize) -> Option<usize> {
    memchr_iter(b'"', &bytes[from..])
        .map(|at| from + at)
        .find(|&quote| ENDINGS.iter().any(|e| bytes[from..=quote].ends_with(e)))
}

fn figure(key: &[u8]) -> Option<Figure> {
    KEYS.iter().find(|(k, _)| *k == key).map(|&(_, f)| f)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Looking for a quote.
    Idle,
    /// Inside a quoted run that may be a key; `len` bytes of it kept.
    Key { len: u8 },
    /// After a known key's closing quote, before its colon.
    Colon(Figure),
    /// After the colon, before the first digit.
    Value(Figure),
    /// Reading digits.
    Digits(Figure, u64),
}

/// The cache figures of one response, fed its body piece by piece.
#[derive(Debug, Clone)]
pub struct UsageScan {
    state: State,
    key: [u8; MAX_KEY],
    /// Prompt tokens the engine reused from its cache.
    cached: Option<u64>,
    /// Prompt tokens of the request, as the engine counted them.
    prompt: Option<u64>,
    read: Option<u64>,
    written: Option<u64>,
}

impl Default for UsageScan {
    fn default() -> Self {
        Self {
            state: State::Idle,
            key: [0; MAX_KEY],
            cached: None,
            prompt: None,
            read: None,
            written: None,
        }
    }
}

impl UsageScan {
    /// Reads the next piece of the body; a key or number may span pieces.
    pub fn feed(&mut self, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                // Every key ends in `tokens"` or `cache_n"`, which an answer's
                // text seldom holds: from one such end to the next, reading
                // only the quoted run each closes, as the quote before that
                // run would have opened it. No key of ours ends between `i`
                // and that end, so every quote in between opens a run (or
                // closes one that is not ours) and this finds what a scan
                // from quote to quote finds.
                State::Idle => match next_key_end(bytes, i) {
                    Some(quote) => {
                        let from = quote.saturating_sub(MAX_KEY).max(i);
                        let start = bytes[from..quote]
                            .iter()
                            .rposition(|b| !is_key_letter(*b))
                            .map_or(from, |q| from + q + 1);
                        let opened = start > i && bytes[start - 1] == b'"';
                        if opened && FIRST.contains(&bytes[start]) {
                            self.state = State::Key { len: 0 };
                            i = start;
                        } else {
                            // Not a key of ours; its quote may open the next.
                            i = quote;
                        }
                    }
                    None => {
                        self.keep_open_run(&bytes[i..]);
                        return;
                    }
                },
                // A run that does not start as one of ours can never become
                // one: on to the next quote (the one that ends it, which may
                // open a key).
                State::Key { len: 0 } if bytes[i] != b'"' && !FIRST.contains(&bytes[i]) => {
                    self.state = State::Idle;
                    i += 1;
                }
                // A run of key letters at once, then the byte that ends it.
                State::Key { len } => {
                    let len = usize::from(len);
                    let run = bytes[i..]
                        .iter()
                        .take(MAX_KEY - len)
                        .take_while(|b| is_key_letter(**b))
                        .count();
                    self.key[len..len + run].copy_from_slice(&bytes[i..i + run]);
                    i += run;
                    // At most MAX_KEY (27), so it fits.
                    self.state = State::Key {
                        len: (len + run) as u8,
                    };
                    if let Some(&b) = bytes.get(i) {
                        self.step(b);
                        i += 1;
                    }
                }
                _ => {
                    self.step(bytes[i]);
                    i += 1;
                }
            }
        }
    }

    /// At the end of a piece read while idle: a quote followed by key letters
    /// up to the end opens a run the next piece may finish as a key.
    fn keep_open_run(&mut self, tail: &[u8]) {
        let run = tail
            .iter()
            .rev()
            .take(MAX_KEY + 1)
            .take_while(|b| is_key_letter(**b))
            .count();
        if run <= MAX_KEY && tail.len() > run && tail[tail.len() - run - 1] == b'"' {
            self.key[..run].copy_from_slice(&tail[tail.len() - run..]);
            // At most MAX_KEY (27), so it fits.
            self.state = State::Key { len: run as u8 };
        }
    }

    /// The figures once the body ended (a number at the very end counts).
    pub fn finish(&mut self) {
        self.step(b' ');
        self.state = State::Idle;
    }

    /// The request's prompt tokens as the engine counted them (Anthropic's
    /// input tokens with those read from and written to its cache).
    pub fn prompt_tokens(&self) -> Option<u64> {
        let read = self.read.unwrap_or(0);
        let prompt = self.prompt?.saturating_add(read);
        Some(prompt.saturating_add(self.written.unwrap_or(0))).filter(|p| *p <= u64::from(u32::MAX))
    }

    /// `(cached, prompt)` tokens when the response reported both, sensibly.
    pub fn figures(&self) -> Option<(u64, u64)> {
        let (cached, prompt) = match self.read {
            Some(read) => {
                let written = self.written.unwrap_or(0);
                (
                    read,
                    self.prompt?.saturating_add(read).saturating_add(written),
                )
            }
            None => (self.cached?, self.prompt?),
        };
        (cached <= prompt && prompt <= u64::from(u32::MAX)).then_some((cached, prompt))
    }

    fn step(&mut self, b: u8) {
        self.state = match self.state {
            State::Idle => State::Idle,
            State::Key { len } => match b {
                b'"' => match figure(&self.key[..usize::from(len)]) {
                    Some(f) => State::Colon(f),
                    // Not a key of ours: this quote may open the next one.
                    None => State::Key { len: 0 },
                },
                b if is_key_letter(b) && usize::from(len) < MAX_KEY => {
                    self.key[usize::from(len)] = b;
                    State::Key { len: len + 1 }
                }
                _ => State::Idle,
            },
            State::Colon(f) => match b {
                b':' => State::Value(f),
                b' ' | b'\t' | b'\r' | b'\n' => State::Colon(f),
                b'"' => State::Key { len: 0 },
                _ => State::Idle,
            },
            State::Value(f) => match b {
                b'0'..=b'9' => State::Digits(f, u64::from(b - b'0')),
                b' ' | b'\t' | b'\r' | b'\n' => State::Value(f),
                b'"' => State::Key { len: 0 },
                _ => State::Idle,
            },
            State::Digits(f, n) => match b {
                b'0'..=b'9' => {
                    State::Digits(f, n.saturating_mul(10).saturating_add(u64::from(b - b'0')))
                }
                _ => {
                    *match f {
                        Figure::Cached => &mut self.cached,
                        Figure::Prompt => &mut self.prompt,
                        Figure::CacheRead => &mut self.read,
                        Figure::CacheWrite => &mut self.written,
                    } = Some(n);
                    if b == b'"' {
                        State::Key { len: 0 }
                    } else {
                        State::Idle
                    }
                }
            },
        };
    }
}

/// Whether a placement's predicted reuse happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    Miss,
    /// A miss with (almost) nothing reused: the index's belief is dead.
    Lost,
}

impl Outcome {
    /// The verdict for `predicted` tokens expected cached and `delivered`
    /// reported; `None` under [`MIN_VERDICT_TOKENS`] predicted.
    pub fn of(predicted: u64, delivered: u64) -> Option<Outcome> {
        if predicted < MIN_VERDICT_TOKENS {
            None
        } else if delivered.saturating_mul(2) >= predicted {
            Some(Outcome::Hit)
        } else if delivered.saturating_mul(10) < predicted {
            Some(Outcome::Lost)
        } else {
            Some(Outcome::Miss)
        }
    }

    /// The metric label: a lost pin is a miss.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::Miss | Outcome::Lost => "miss",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memchr::memchr;

    fn scan(pieces: &[&[u8]]) -> (Option<u64>, Option<u64>) {
        let mut s = UsageScan::default();
        for p in pieces {
            s.feed(p);
        }
        s.finish();
        (s.cached, s.prompt)
    }

    const VLLM: &[u8] = br#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":81564,"total_tokens":81596,"completion_tokens":32,"prompt_tokens_details":{"cached_tokens":80016}}}"#;

    #[test]
    fn finds_the_openai_usage_of_a_whole_body() {
        assert_eq!(scan(&[VLLM]), (Some(80016), Some(81564)));
    }

    #[test]
    fn finds_it_however_the_body_is_cut() {
        for cut in 0..VLLM.len() {
            let (a, b) = VLLM.split_at(cut);
            assert_eq!(scan(&[a, b]), (Some(80016), Some(81564)), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = VLLM.chunks(1).collect();
        assert_eq!(scan(&bytes), (Some(80016), Some(81564)));
    }

    #[test]
    fn reads_llama_cpp_timings_and_spaced_json() {
        let body = br#"{"timings": {"cache_n" : 1368, "prompt_n": 3},
            "usage": {"prompt_tokens": 1371}}"#;
        assert_eq!(scan(&[body]), (Some(1368), Some(1371)));
    }

    #[test]
    fn an_sse_stream_counts_its_last_usage_chunk() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(scan(&[stream]), (Some(8), Some(10)));
    }

    #[test]
    fn text_that_quotes_a_key_is_not_a_key() {
        // The model wrote `"cached_tokens": 5` in its answer: escaped quotes.
        let body = br#"{"content":"say \"cached_tokens\": 5 and \"prompt_tokens\":7","usage":{"prompt_tokens":3}}"#;
        assert_eq!(scan(&[body]), (None, Some(3)));
        // A string value right before the key does not swallow its quote.
        let body = br#"{"a":"b","cached_tokens":4,"x":"prompt_tokens","y":1}"#;
        assert_eq!(scan(&[body]), (Some(4), None));
        // A key's closing quote opens no run.
        let body = br#"{"cached_tokens"prompt_tokens":9,"input_tokens":2}"#;
        assert_eq!(scan(&[body]), (None, Some(2)));
    }

    #[test]
    fn no_usage_or_a_null_one_reports_nothing() {
        assert_eq!(scan(&[br#"{"usage":null}"#]), (None, None));
        assert_eq!(
            scan(&[br#"{"cached_tokens":null,"prompt_tokens":"7"}"#]),
            (None, None)
        );
        assert_eq!(
            scan(&[b"not json at all \"", b"cached_tokens"]),
            (None, None)
        );
    }

    #[test]
    fn every_key_starts_with_a_first_letter_and_fits() {
        for (key, _) in KEYS {
            assert!(FIRST.contains(&key[0]), "{}", String::from_utf8_lossy(key));
            assert!(key.len() <= MAX_KEY);
            let closed = [key, &b"\""[..]].concat();
            assert_eq!(next_key_end(&closed, 0), Some(key.len()));
        }
        // A key with a letter more, or one before it, is not that key.
        for body in [
            &br#"{"cache_creation_input_tokensx":5,"prompt_tokens":9}"#[..],
            br#"{"xcached_tokens":5,"prompt_tokens":9}"#,
        ] {
            assert_eq!(scan(&[body]), (None, Some(9)));
        }
    }

    #[test]
    fn huge_numbers_saturate() {
        let body = br#"{"cached_tokens":99999999999999999999999999}"#;
        assert_eq!(scan(&[body]).0, Some(u64::MAX));
    }

    #[test]
    fn only_sensible_reports_of_both_figures_count() {
        let figures = |body: &[u8]| {
            let mut s = UsageScan::default();
            s.feed(body);
            s.finish();
            s.figures()
        };
        assert_eq!(figures(VLLM), Some((80016, 81564)));
        // Anthropic: input_tokens leave out cache reads and writes.
        let anthropic = br#"{"usage":{"input_tokens":20,"cache_read_input_tokens":1000,"cache_creation_input_tokens":30,"output_tokens":5}}"#;
        assert_eq!(figures(anthropic), Some((1000, 1050)));
        assert_eq!(figures(br#"{"timings":{"cache_n":5}}"#), None);
        assert_eq!(figures(br#"{"cached_tokens":9,"prompt_tokens":5}"#), None);
        assert_eq!(
            figures(br#"{"cached_tokens":1,"prompt_tokens":99999999999}"#),
            None
        );
    }

    #[test]
    fn verdicts() {
        assert_eq!(Outcome::of(0, 5), None);
        assert_eq!(Outcome::of(MIN_VERDICT_TOKENS - 1, 0), None);
        assert_eq!(Outcome::of(1000, 980), Some(Outcome::Hit));
        assert_eq!(Outcome::of(1000, 500), Some(Outcome::Hit));
        assert_eq!(Outcome::of(1000, 499), Some(Outcome::Miss));
        assert_eq!(Outcome::of(1000, 100), Some(Outcome::Miss));
        assert_eq!(Outcome::of(1000, 99), Some(Outcome::Lost));
        assert_eq!(Outcome::of(1000, 0), Some(Outcome::Lost));
    }

    /// Bodies made of the pieces usage reports are written in, with noise
    /// around them: keys, quotes, escapes, colons, whitespace and digits.
    fn body() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let piece = prop_oneof![
            Just(&b"\"cached_tokens\""[..]),
            Just(&b"\"prompt_tokens\""[..]),
            Just(&b"\"input_tokens\""[..]),
            Just(&b"\"cache_n\""[..]),
            Just(&b"\"cache_read_input_tokens\""[..]),
            Just(&b"\"cache_creation_input_tokens\""[..]),
            Just(&b"\"usage\":{"[..]),
            // Runs that end as keys do, not ours or not opened.
            Just(&b"\"completion_tokens\""[..]),
            Just(&b"prompt_tokens\""[..]),
            Just(&b"_tokens"[..]),
            Just(&b"cache_n"[..]),
            Just(&b"\\\""[..]),
            Just(&b"\""[..]),
            Just(&b":"[..]),
            Just(&b" \n"[..]),
            Just(&b","[..]),
            Just(&b"}"[..]),
            Just(&b"data: "[..]),
        ]
        .prop_map(<[u8]>::to_vec);
        let digits = "[0-9]{1,25}".prop_map(String::into_bytes);
        // Long lowercase runs, past the longest key.
        let words = "[a-z_\"]{0,40}".prop_map(String::into_bytes);
        let noise = prop::collection::vec(any::<u8>(), 0..8);
        prop::collection::vec(prop_oneof![piece, digits, words, noise], 0..64)
            .prop_map(|v| v.concat())
    }

    /// The scan a byte at a time from quote to quote (past quotes it finds
    /// with `memchr`), as it was before it read key letters in runs and
    /// jumped from one key's end to the next.
    fn feed_stepwise(s: &mut UsageScan, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            if s.state == State::Idle {
                match memchr(b'"', &bytes[i..]) {
                    Some(at) => {
                        i += at + 1;
                        s.state = State::Key { len: 0 };
                    }
                    None => return,
                }
                continue;
            }
            s.step(bytes[i]);
            i += 1;
        }
    }

    proptest::proptest! {
        /// Jumping between key ends and reading key letters in runs finds
        /// what stepping from quote to quote finds.
        #[test]
        fn runs_read_as_steps(body in body(), cut in 0usize..4096) {
            let cut = cut % (body.len() + 1);
            let (mut runs, mut steps) = (UsageScan::default(), UsageScan::default());
            for piece in [&body[..cut], &body[cut..]] {
                runs.feed(piece);
                feed_stepwise(&mut steps, piece);
            }
            runs.finish();
            steps.finish();
            let figures = |s: &UsageScan| (s.cached, s.prompt, s.read, s.written);
            proptest::prop_assert_eq!(figures(&runs), figures(&steps));
        }

        /// Without a SIMD searcher, key ends are found where it finds them.
        #[test]
        fn key_ends_found_either_way_agree(body in body(), from in 0usize..4096) {
            let from = from % (body.len() + 1);
            proptest::prop_assert_eq!(next_key_end_each(&body, from), next_key_end(&body, from));
        }

        /// Whatever the bytes and however they are cut into pieces, the
        /// scan neither panics nor depends on the cuts.
        #[test]
        fn pieces_read_as_the_whole_body(body in body(), cuts in proptest::collection::vec(0usize..4096, 0..8)) {
            let whole = {
                let mut s = UsageScan::default();
                s.feed(&body);
                s.finish();
                (s.cached, s.prompt, s.figures())
            };
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = UsageScan::default();
            let mut at = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                s.feed(&body[at..c]);
                at = c;
            }
            s.finish();
            proptest::prop_assert_eq!((s.cached, s.prompt, s.figures()), whole);
            if let Some((cached, prompt)) = whole.2 {
                proptest::prop_assert!(cached <= prompt);
            }
        }
    }
}
