//! The log's writer and format, and the access log: one line per request at
//! `info` on target [`TARGET`].
//!
//! Lines are formatted on the thread that logs them, into a reused buffer
//! (the logger's; an access line, the commonest, into one of the thread's
//! own, past the logger's formatter), with no allocation per field, and
//! handed to a bounded
//! queue ([`QUEUE_LINES`]) that a thread of its own (`log-writer`) drains
//! (`tracing-appender`'s non-blocking writer) into a buffer another
//! writes to stderr at once when quiet, at most every 20 ms under load (in
//! batches, the rest by a `log-flush` thread): a worker
//! never waits on stderr (a slow terminal, a full pipe, a stalled log
//! shipper). A full queue drops lines and counts them
//! (`prefix_router_log_lines_dropped_total`); a line is cut at [`MAX_LINE`]
//! bytes, so the queue holds at most some 64 MiB; dropping [`Logging`] at
//! shutdown, or at the end of an upgrade's handover, writes out what is
//! queued.
//!
//! `log_format: json` (reloadable) makes every line one JSON object (`ts`,
//! `level`, `target`, then the message or, for the access log, its fields),
//! for log pipelines. An access line names the method and path, never the
//! query string (it may carry a key), headers (credentials) or the body
//! (prompt text).

use std::fmt::{self, Display, Write as _};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

mod batched;
use batched::Batched;

/// Log target of the access log.
pub const TARGET: &str = "access";

/// Lines queued for the writer before new ones are dropped: at most
/// [`MAX_LINE`] bytes each, about 200 for an access line.
pub const QUEUE_LINES: usize = 16_384;

/// A line's message is cut past this many bytes (an access line's path and
/// error past [`MAX_FIELD`]), so the queue's memory is bounded whatever
/// clients send.
pub const MAX_LINE: usize = 4096;
pub const MAX_FIELD: usize = 1024;

pub use crate::config::LogFormat;

static JSON: AtomicBool = AtomicBool::new(false);

/// Sets the format of every line from now on.
pub fn set_format(format: LogFormat) {
    JSON.store(format == LogFormat::Json, Relaxed);
}

/// The process's log writer: dropping it writes out the lines still queued.
pub struct Logging {
    queue: Option<WorkerGuard>,
    dropped: ErrorCounter,
    out: Option<Batched>,
}

impl Logging {
    /// Lines dropped so far because the queue was full.
    pub fn dropped(&self) -> ErrorCounter {
        self.dropped.clone()
    }
}

impl Drop for Logging {
    fn drop(&mut self) {
        // The queue drains into the buffer, then the buffer goes out.
        drop(self.queue.take());
        if let Some(mut out) = self.out.take() {
            let _ = out.write_out();
        }
    }
}

/// A queue of `lines` in front of `out`, drained by a thread of its own.
fn queue<W: Write + Send + 'static>(lines: usize, out: W) -> (NonBlocking, Logging) {
    let (writer, guard) = NonBlockingBuilder::default()
        .buffered_lines_limit(lines)
        .lossy(true)
        .thread_name("log-writer")
        .finish(out);
    let dropped = writer.error_counter();
    let logging = Logging {
        queue: Some(guard),
        dropped,
        out: None,
    };
    (writer, logging)
}

/// Starts the process's logger: level from `RUST_LOG` (default `info`),
/// lines in the format last set, written off the request path.
pub fn init() -> Logging {
    let out = Batched::start();
    let (writer, mut logging) = queue(QUEUE_LINES, out.clone());
    logging.out = Some(out);
    let _ = QUEUE.set(writer.clone());
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .target(env_logger::Target::Pipe(Box::new(writer)))
        .format(|buf, record| {
            let ts = Now;
            if !JSON.load(Relaxed) {
                write!(buf, "[{ts} {:<5} {}] ", record.level(), record.target())?;
                return writeln!(buf, "{}", Plain(Capped(record.args(), MAX_LINE)));
            }
            write!(
                buf,
                "{{\"ts\":\"{ts}\",\"level\":\"{}\",\"target\":{}",
                record.level(),
                Json(record.target())
            )?;
            writeln!(
                buf,
                ",\"message\":{}}}",
                Json(Capped(record.args(), MAX_LINE))
            )
        })
        .init();
    logging
}

/// The time now, as `env_logger` writes it with millisecond precision
/// (`2026-12-02T10:58:00.123Z`): the date and time of day formatted once a
/// second per thread, only the milliseconds on every line.
struct Now;

thread_local! {
    /// A second since the epoch and its `YYYY-MM-DDTHH:MM:SS`.
    static SECOND: std::cell::RefCell<(u64, String)> = const {
        std::cell::RefCell::new((u64::MAX, String::new()))
    };
}

impl Now {
    fn write_to(&self, out: &mut impl fmt::Write) -> fmt::Result {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        stamp(now, out)
    }
}

impl Display for Now {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_to(f)
    }
}

/// `since_epoch` written as [`Now`] writes it.
fn stamp(since_epoch: Duration, f: &mut impl fmt::Write) -> fmt::Result {
    let secs = since_epoch.as_secs();
    let second = || {
        let ts = i64::try_from(secs)
            .ok()
            .and_then(|s| jiff::Timestamp::from_second(s).ok())
            .ok_or(fmt::Error)?;
        let mut text = format!("{ts:.0}");
        text.pop(); // its `Z`
        Ok::<_, fmt::Error>(text)
    };
    let millis = since_epoch.subsec_millis();
    let cached = SECOND.try_with(|cell| {
        let mut held = cell.try_borrow_mut().ok()?;
        if held.0 != secs {
            *held = (secs, second().ok()?);
        }
        Some(write!(f, "{}.{millis:03}Z", held.1))
    });
    match cached {
        Ok(Some(written)) => written,
        // At the thread's exit, or written from within: not cached.
        _ => write!(f, "{}.{millis:03}Z", second()?),
    }
}

/// A value written as a JSON string, escaped as it is written.
struct Json<T>(T);

impl<T: Display> Display for Json<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        write!(Escape { out: f, json: true }, "{}", self.0)?;
        f.write_char('"')
    }
}

/// A value for the text format: control characters escaped (`\n`,
/// `\u001b`: what an engine or a client sent can neither forge a line nor
/// drive a terminal).
struct Plain<T>(T);

impl<T: Display> Display for Plain<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            Escape {
                out: f,
                json: false
            },
            "{}",
            self.0
        )
    }
}

/// Escapes what is written through it: every control character (C0, DEL,
/// C1), and for a JSON string its quote and backslash too.
struct Escape<'a, 'b> {
    out: &'a mut fmt::Formatter<'b>,
    json: bool,
}

impl fmt::Write for Escape<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut plain = 0;
        for (i, c) in s.char_indices() {
            let escaped = match c {
                '"' | '\\' if !self.json => continue,
                '"' => "\\\"",
                '\\' => "\\\\",
                '\n' => "\\n",
                '\r' => "\\r",
                '\t' => "\\t",
                c if c.is_control() => "",
                _ => continue,
            };
            self.out.write_str(&s[plain..i])?;
            if escaped.is_empty() {
                write!(self.out, "\\u{:04x}", c as u32)?;
            } else {
                self.out.write_str(escaped)?;
            }
            plain = i + c.len_utf8();
        }
        self.out.write_str(&s[plain..])
    }
}

/// At most `.1` bytes of a value (cut at a character), then `…` if cut.
struct Capped<T>(T, usize);

impl<T: Display> Display for Capped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cap = Cap {
            out: f,
            left: self.1,
            cut: false,
        };
        write!(cap, "{}", self.0)?;
        if cap.cut {
            cap.out.write_char('…')?;
        }
        Ok(())
    }
}

/// Writes through up to `left` bytes, then notes that the rest was cut.
struct Cap<'a, 'b> {
    out: &'a mut fmt::Formatter<'b>,
    left: usize,
    cut: bool,
}

impl fmt::Write for Cap<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if s.len() <= self.left {
            self.left -= s.len();
            return self.out.write_str(s);
        }
        let mut end = self.left;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.left = 0;
        self.cut = true;
        self.out.write_str(&s[..end])
    }
}

/// One finished request.
pub struct Entry<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// 0 when no response started.
    pub status: u16,
    pub replica: Option<&'a str>,
    pub decision: Option<&'a str>,
    pub shape: Option<&'a str>,
    pub matched_bytes: usize,
    /// Replicas tried before the last.
    pub tried: usize,
    /// Arrival to the replica's first body bytes.
    pub first_byte: Option<Duration>,
    pub duration: Duration,
    pub error: Option<&'a dyn std::fmt::Display>,
}

/// A JSON field whose value may be absent (`null`).
struct OrNull<T>(Option<T>);

impl<T: Display> Display for OrNull<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(v) => Json(v).fmt(f),
            None => f.write_str("null"),
        }
    }
}

/// Logs `e` at `info` on [`TARGET`], formatting nothing when that is off.
/// The line is written as the logger's format would write it, into a
/// buffer of the thread's own, and handed to the queue directly (past the
/// logger's filter and formatter: it is always `info` on [`TARGET`]).
pub fn write(e: &Entry) {
    if !log::log_enabled!(target: TARGET, log::Level::Info) {
        return;
    }
    let Some(queue) = QUEUE.get() else {
        return;
    };
    let queued = LINE.try_with(|cell| {
        let Ok(mut held) = cell.try_borrow_mut() else {
            return false;
        };
        let (line, writer) = &mut *held;
        line.clear();
        if line_of(e, line).is_ok() {
            // Lossy: a full queue drops the line and counts it.
            let _ = writer
                .get_or_insert_with(|| queue.clone())
                .write_all(line.as_bytes());
        }
        true
    });
    // The thread's buffer is gone (its exit) or in use: one of its own.
    if queued != Ok(true) {
        let mut line = String::new();
        if line_of(e, &mut line).is_ok() {
            let _ = queue.clone().write_all(line.as_bytes());
        }
    }
}

/// The queue every line goes to, for access lines written past the logger.
static QUEUE: std::sync::OnceLock<NonBlocking> = std::sync::OnceLock::new();

thread_local! {
    /// An access line being written, and the thread's handle on the queue.
    static LINE: std::cell::RefCell<(String, Option<NonBlocking>)> =
        const { std::cell::RefCell::new((String::new(), None)) };
}

/// `e`'s whole line in the format in force, ending in a newline.
fn line_of(e: &Entry, out: &mut String) -> fmt::Result {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    if JSON.load(Relaxed) {
        let first_byte = e.first_byte.map(ms);
        return writeln!(
            out,
            "{{\"ts\":\"{}\",\"level\":\"INFO\",\"target\":\"{TARGET}\",\"method\":{},\"path\":{},\"status\":{},\"replica\":{},\"decision\":{},\"shape\":{},\"matched_bytes\":{},\"tried\":{},\"first_byte_ms\":{},\"ms\":{},\"error\":{}}}",
            Now,
            Json(e.method),
            Json(Capped(e.path, MAX_FIELD)),
            e.status,
            OrNull(e.replica),
            OrNull(e.decision),
            OrNull(e.shape),
            e.matched_bytes,
            e.tried,
            first_byte.map_or(serde_json::Value::Null, serde_json::Value::from),
            serde_json::Value::from(ms(e.duration)),
            OrNull(e.error.map(|e| Capped(e, MAX_FIELD))),
        );
    }
    // The text format, piece by piece.
    let mut n = itoa::Buffer::new();
    out.push('[');
    Now.write_to(out)?;
    out.push_str(" INFO  ");
    out.push_str(TARGET);
    out.push_str("] ");
    out.push_str(e.method);
    out.push(' ');
    write!(out, "{}", Plain(Capped(e.path, MAX_FIELD)))?;
    out.push_str(" status=");
    out.push_str(n.format(e.status));
    out.push_str(" replica=");
    out.push_str(e.replica.unwrap_or("-"));
    out.push_str(" decision=");
    out.push_str(e.decision.unwrap_or("-"));
    out.push_str(" shape=");
    out.push_str(e.shape.unwrap_or("-"));
    out.push_str(" matched_bytes=");
    out.push_str(n.format(e.matched_bytes));
    out.push_str(" tried=");
    out.push_str(n.format(e.tried));
    out.push_str(" first_byte_ms=");
    match e.first_byte {
        Some(d) => out.push_str(n.format(d.as_millis() as u64)),
        None => out.push('-'),
    }
    out.push_str(" ms=");
    out.push_str(n.format(e.duration.as_millis() as u64));
    if let Some(error) = e.error {
        write!(out, " error={}", Json(Capped(error, MAX_FIELD)))?;
    }
    out.push('\n');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_are_escaped_as_they_are_written() {
        for s in [
            "plain",
            "a \"quote\" and \\ back",
            "line\nbreak\ttab\r",
            "ctl \u{1} \u{1f}",
            "é 😀",
        ] {
            let written = Json(s).to_string();
            let read: String = serde_json::from_str(&written).expect(&written);
            assert_eq!(read, s);
        }
        // JSON escapes DEL and C1 too; the text format only controls.
        assert_eq!(Json("\u{7f}\u{9b}").to_string(), "\"\\u007f\\u009b\"");
        assert_eq!(
            Plain("a \"b\" \\ \u{1b}[2J\nc").to_string(),
            "a \"b\" \\ \\u001b[2J\\nc"
        );
        assert_eq!(OrNull(None::<&str>).to_string(), "null");
        // Cut at a character, marked.
        assert_eq!(Capped("abcé", 4).to_string(), "abc…");
        assert_eq!(Capped("abc", 3).to_string(), "abc");
        let long = Capped("x".repeat(3000) + &"y".repeat(3000), MAX_LINE);
        assert_eq!(long.to_string().chars().count(), MAX_LINE + 1);
    }

    #[test]
    fn an_access_line_in_the_text_format() {
        let err: &dyn Display = &"upstream \"x\" failed";
        let entry = Entry {
            method: "POST",
            path: "/v1/chat\ncompletions",
            status: 502,
            replica: Some("a"),
            decision: Some("pin"),
            shape: Some("continuation"),
            matched_bytes: 4096,
            tried: 1,
            first_byte: None,
            duration: Duration::from_micros(3_900),
            error: Some(err),
        };
        let mut line = String::new();
        line_of(&entry, &mut line).expect("written");
        let (head, rest) = line.split_once("] ").expect("a head");
        assert!(
            head.starts_with('[') && head.ends_with(" INFO  access"),
            "{head}"
        );
        assert_eq!(
            rest,
            "POST /v1/chat\\ncompletions status=502 replica=a decision=pin shape=continuation \
             matched_bytes=4096 tried=1 first_byte_ms=- ms=3 error=\"upstream \\\"x\\\" failed\"\n"
        );
    }

    /// A writer that never returns: a pipe nobody reads.
    struct Stuck(std::sync::mpsc::Receiver<()>);

    impl Write for Stuck {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_lines_and_never_blocks_the_logger() {
        let (release, stuck) = std::sync::mpsc::channel();
        let (mut writer, logging) = queue(8, Stuck(stuck));
        let started = std::time::Instant::now();
        for i in 0..100 {
            writer
                .write_all(format!("line {i}\n").as_bytes())
                .expect("queued or dropped");
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        // One line may be with the writer, eight queued: the rest dropped.
        assert!(logging.dropped().dropped_lines() >= 100 - 9);
        drop(release);
    }

    #[test]
    fn timestamps_are_written_as_env_logger_writes_them() {
        // Within one second, across seconds, days and years, and going back.
        for (secs, ms) in [
            (0, 0),
            (1_764_672_000, 5),
            (1_764_672_000, 999),
            (1_764_672_001, 120),
            (1_767_225_599, 999),
            (1_767_225_600, 0),
            (951_782_400, 42),
        ] {
            let at = Duration::from_secs(secs) + Duration::from_millis(ms);
            let mut ours = String::new();
            stamp(at, &mut ours).expect("written");
            let ts = jiff::Timestamp::from_second(secs as i64).expect("in range")
                + jiff::SignedDuration::from_millis(ms as i64);
            assert_eq!(ours, format!("{ts:.3}"), "{secs}.{ms:03}");
        }
    }
}
