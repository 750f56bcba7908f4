//! The log's last stage: stderr behind a buffer, written out at once when
//! quiet and in batches under load (by a `log-flush` thread that sleeps
//! while no line comes).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the buffer of written lines goes out (lines wait at most this).
const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// stderr behind a buffer: the queue's writer asks for a flush whenever the
/// queue empties, about once per line at a few thousand lines a second; one
/// is done at once when the last was at least [`FLUSH_EVERY`] ago (a quiet
/// router's lines go out as they come), else left to a thread of its own
/// (`log-flush`) that writes the buffer out [`FLUSH_EVERY`] after a line
/// came: under load, lines go out in batches, not a system call each. With
/// no line to write the thread sleeps, not waking an idle router.
#[derive(Clone)]
pub(super) struct Batched(Arc<Mutex<Buffered>>);

struct Buffered {
    out: std::io::BufWriter<std::io::Stderr>,
    flushed: std::time::Instant,
    /// The `log-flush` thread, woken by a line written.
    flusher: Option<std::thread::Thread>,
}

impl Batched {
    pub(super) fn start() -> Self {
        let out = Self(Arc::new(Mutex::new(Buffered {
            out: std::io::BufWriter::with_capacity(64 << 10, std::io::stderr()),
            flushed: std::time::Instant::now(),
            flusher: None,
        })));
        let weak = Arc::downgrade(&out.0);
        let spawned = std::thread::Builder::new()
            .name("log-flush".into())
            .spawn(move || loop {
                // Until a line is written (a wake-up without one flushes
                // nothing), then once the lines after it had time to come.
                std::thread::park();
                std::thread::sleep(FLUSH_EVERY);
                match weak.upgrade() {
                    Some(out) => {
                        let _ = Batched(out).write_out();
                    }
                    None => return,
                }
            });
        match spawned {
            Ok(flusher) => out.lock().flusher = Some(flusher.thread().clone()),
            // No thread: the buffer is written out only when full or at
            // exit; say so once, where it will be seen.
            Err(_) => {
                eprintln!("prefix-router: no log-flush thread; log lines go out in 64 KiB batches")
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffered> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the buffer out; with `due`, only if the last flush was at
    /// least [`FLUSH_EVERY`] ago.
    fn flush_if(&mut self, due: bool) -> std::io::Result<()> {
        let mut b = self.lock();
        if due && b.flushed.elapsed() < FLUSH_EVERY {
            return Ok(());
        }
        b.flushed = std::time::Instant::now();
        b.out.flush()
    }

    pub(super) fn write_out(&mut self) -> std::io::Result<()> {
        self.flush_if(false)
    }
}

impl Write for Batched {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut b = self.lock();
        if let Some(flusher) = &b.flusher {
            flusher.unpark();
        }
        b.out.write(buf)
    }

    /// At once when the last flush was long enough ago, else left to the
    /// `log-flush` thread.
    fn flush(&mut self) -> std::io::Result<()> {
        self.flush_if(true)
    }
}
