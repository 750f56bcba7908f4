//! The request body on the router: read whole within the size limit, the
//! time limit and the shared byte budget; drained after an early answer so
//! the client can read it; parsed into the policy's view off the async
//! workers when large.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use pingora_core::{Error, ErrorType, Result};
use pingora_proxy::Session;
use tokio::sync::Semaphore;

use crate::admission::Ticket;
use crate::errors::RouterError;
use crate::metrics::Metrics;
use crate::paths::Route;
use crate::policy::Request;
use crate::request::{Checkpoints, Prompt, Turns, CHECKPOINT_MIN_BODY};
use crate::settings::Settings;

/// Bodies up to this size are parsed on the async worker (tens of µs);
/// larger ones on the blocking pool, so one request never stalls others.
pub const INLINE_PARSE_BYTES: usize = 64 << 10;

/// Bodies up to this size whose checkpoint leaves at most
/// [`INLINE_PARSE_BYTES`] to parse are read on the async worker too.
pub const INLINE_RESUME_BYTES: usize = 1 << 20;

/// How long the rest of a refused body is read and discarded, so a client
/// that sends everything before reading still gets the answer.
pub const LINGER: Duration = Duration::from_secs(10);

/// Once a body's first bytes have arrived, its buffer is sized at once to
/// its declared length up to this (one copy of those first bytes, none of
/// the rest); past it, it grows by doubling as bytes arrive. Nothing is
/// held before the first bytes: a client that declares a large body and
/// sends nothing holds nothing.
const EAGER_CAPACITY: usize = 1 << 20;

/// The most Pingora reads of a request body at a time.
const READ_PIECE: usize = 64 << 10;

/// Pingora's own wait for each piece of an HTTP/1.1 request body; it fires
/// before `body_read_timeout_ms` when that is longer and the client idles.
const PIECE_TIMEOUT: Duration = Duration::from_secs(60);

/// Bounds the blocking parses running at once to the machine's cores.
static PARSERS: LazyLock<Semaphore> =
    LazyLock::new(|| Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get())));

/// Reads the whole body, reserving its buffer's bytes on `ticket` as it
/// grows. `Ok(Err(_))` is the client's fault (or the budget's), to answer;
/// `Err(_)` (its source the client) when the client is gone.
pub async fn read(
    session: &mut Session,
    limit: usize,
    declared: Option<usize>,
    ticket: &mut Ticket,
) -> Result<std::result::Result<Bytes, RouterError>> {
    // Sized to the declared length (up to EAGER_CAPACITY) after the first
    // piece, then grows by doubling, never past the declared length: a body
    // that sends what it declared ends in an exactly sized buffer.
    let declared_cap = declared.unwrap_or(limit).min(limit);
    let eager = declared.map_or(0, |_| EAGER_CAPACITY);
    let mut buf = Vec::new();
    let mut reserved = 0;
    // Reserved on the ticket before it is allocated.
    let mut grow = |buf: &mut Vec<u8>, n: usize, ticket: &mut Ticket| {
        let mut want = buf.capacity();
        if want - buf.len() < n {
            let doubled = (2 * want).max(eager).min(declared_cap);
            want = doubled.max(buf.len() + n);
        }
        let more = want.saturating_sub(reserved);
        reserved += more;
        let room = ticket.reserve(more);
        if room {
            buf.reserve_exact(want - buf.len());
        }
        room
    };
    loop {
        // Room for the next piece before it is read (Pingora copies it straight
        // into this buffer): none past the declared length, a whole piece for
        // a chunked body (one past the limit is refused without growing the
        // buffer). The first piece grows the buffer itself, and is reserved
        // at the top of the next turn.
        let next = match (buf.is_empty(), declared) {
            (true, _) => 0,
            (false, Some(_)) => READ_PIECE.min(declared_cap.saturating_sub(buf.len())),
            (false, None) => READ_PIECE,
        };
        if !grow(&mut buf, next, ticket) {
            return Ok(Err(RouterError::OVER_BUDGET));
        }
        match session.read_request_body_into(&mut buf).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) => return read_failure(&e).map(Err).ok_or_else(|| e.into_down()),
        }
        if buf.len() > limit {
            return Ok(Err(RouterError::BodyTooLarge { limit }));
        }
    }
    // A chunked body's buffer grew by doubling: keep only what it holds.
    if buf.capacity() > buf.len() + buf.len() / 4 + 4096 {
        return Ok(Ok(Bytes::copy_from_slice(&buf)));
    }
    Ok(Ok(Bytes::from(buf)))
}

/// What a failed read of the body answers the client: a broken framing (a
/// bad chunk, the connection ending before the declared length) is the
/// client's, not a replica's; `None` when the connection failed (reset):
/// there is nobody to answer.
fn read_failure(e: &Error) -> Option<RouterError> {
    match e.etype() {
        ErrorType::ReadError => None,
        ErrorType::ReadTimedout => Some(RouterError::BodyTimeout {
            ms: PIECE_TIMEOUT.as_millis() as u64,
        }),
        t => Some(RouterError::BadBody {
            detail: e
                .context
                .as_ref()
                .map_or_else(|| t.as_str().to_owned(), |c| c.to_string()),
        }),
    }
}

/// Reads and discards what is left of the body, at most `max_bytes` and for
/// at most [`LINGER`].
pub async fn drain(session: &mut Session, max_bytes: usize) {
    let discard = async {
        let mut seen = 0;
        while let Ok(Some(chunk)) = session.read_request_body().await {
            seen += chunk.len();
            if seen > max_bytes {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, discard).await;
}

/// The policy's view of a body, or `None` when it is not a prompt (it is then
/// forwarded as is and spread). Chat and messages bodies are read through
/// `checkpoints` (see `request::Checkpoints`): the checkpoints it was read
/// from and left come with it.
pub async fn parse(
    body: Bytes,
    route: Route,
    settings: &Settings,
    checkpoints: Arc<Checkpoints>,
    header_key: Option<String>,
    metrics: &Arc<Metrics>,
) -> Option<(Request, Turns)> {
    let metrics = Arc::clone(metrics);
    let (max_prompt_bytes, block_bytes) = (settings.max_prompt_bytes, settings.block_bytes);
    let budget = settings.max_checkpoint_bytes;
    let chat = matches!(route, Route::Prompt(_));
    let mut start = chat
        .then(|| checkpoints.start(&body, max_prompt_bytes, budget))
        .flatten();
    // A body read from a checkpoint costs a compare and a copy or two of what
    // the checkpoint covers (a few µs per 100 KiB: at most a few hundred µs
    // here) and a parse of the rest; compared here, so a body that only
    // looks like it is parsed whole on the pool.
    let inline = body.len() <= INLINE_PARSE_BYTES
        || (body.len() <= INLINE_RESUME_BYTES
            && start
                .as_mut()
                .is_some_and(|s| s.unread(body.len()) <= INLINE_PARSE_BYTES && s.confirm(&body)));
    let parse = move || {
        if chat {
            let key = header_key.as_deref();
            let parsed =
                checkpoints.parse_from(start, &body, max_prompt_bytes, block_bytes, budget, key);
            let parsed = parsed.ok()?;
            if body.len() >= CHECKPOINT_MIN_BODY {
                metrics
                    .prompts
                    .long_parse(parsed.resumed(), checkpoints.bytes());
            }
            return Some((parsed.request, parsed.turns));
        }
        let prompt = match route {
            Route::Responses => Prompt::parse_responses(&body, max_prompt_bytes),
            Route::Form(_) => Ok(Prompt::parse_form_model(&body)),
            Route::Prompt(_) | Route::Model(_) => Prompt::parse_model(&body),
        };
        prompt.ok().map(|p| {
            let request = p.into_request(block_bytes, header_key.as_deref());
            (request, Turns::default())
        })
    };
    if inline {
        return parse();
    }
    on_pool(parse).await
}

/// A place on the blocking pool, when one is free now (for work that may
/// be dropped, run with `spawn_blocking` while it is held).
pub fn try_pool_slot() -> Option<tokio::sync::SemaphorePermit<'static>> {
    PARSERS.try_acquire().ok()
}

/// Runs `job` on the blocking pool, at most one per core at a time.
pub async fn on_pool<T: Send + 'static>(
    job: impl FnOnce() -> Option<T> + Send + 'static,
) -> Option<T> {
    let _permit = PARSERS.acquire().await.ok()?;
    tokio::task::spawn_blocking(job).await.ok().flatten()
}
