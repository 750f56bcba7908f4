//! `routebench hold`: opens many SSE streams through an endpoint at a given
//! rate and holds them while they last, for `make bench-scale`'s open-streams
//! curve. Each stream is its own connection (`Connection: close`), written
//! and read as raw HTTP/1.1, so the client costs little next to what it
//! measures. Every `--report-ms` a JSON line on stdout counts streams whose
//! `200` head came (`opened`), ended with `data: [DONE]` (`done`), failed
//! (refused, not `200`, or cut before `[DONE]`), and SSE events read in all.
//! It exits when every stream has ended. Events are found in the raw bytes,
//! chunk framing and all: an event a chunk boundary splits (which the stubs'
//! one-write events make rare) is not counted.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(clap::Args)]
pub struct HoldArgs {
    /// The endpoint, `HOST:PORT`.
    #[arg(long)]
    addr: std::net::SocketAddr,
    /// Streams to open.
    #[arg(long)]
    streams: usize,
    /// Streams opened per second.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// The request body (a chat completion with `"stream": true`).
    #[arg(long)]
    body_file: std::path::PathBuf,
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    #[arg(long, default_value_t = 1000)]
    report_ms: u64,
}

#[derive(Default)]
struct Counts {
    opened: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    events: AtomicU64,
}

/// An SSE event as the stubs (and engines) write it.
const EVENT: &[u8] = b"data: {";
const DONE: &[u8] = b"[DONE]";
/// Bytes of a read kept for the next: too few to hold a whole [`EVENT`]
/// (counted already), enough for one split across the two reads.
const CARRY: usize = EVENT.len() - 1;

/// Opens the streams and reports until all have ended.
pub async fn hold(args: HoldArgs) -> Result<()> {
    let body = std::fs::read(&args.body_file).context("reading --body-file")?;
    let mut request = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        args.path,
        args.addr,
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let request: Arc<[u8]> = request.into();
    let counts = Arc::new(Counts::default());
    let start = Instant::now();
    let every = Duration::from_secs_f64(1.0 / args.rate.max(0.001));
    let opener = {
        let counts = Arc::clone(&counts);
        let addr = args.addr;
        let streams = args.streams;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for _ in 0..streams {
                tick.tick().await;
                let counts = Arc::clone(&counts);
                let request = Arc::clone(&request);
                tokio::spawn(async move {
                    let ok = one(addr, &request, &counts).await.unwrap_or(false);
                    let ended = if ok { &counts.done } else { &counts.failed };
                    ended.fetch_add(1, Relaxed);
                });
            }
        })
    };
    let mut report = tokio::time::interval(Duration::from_millis(args.report_ms.max(10)));
    loop {
        report.tick().await;
        let (done, failed) = (counts.done.load(Relaxed), counts.failed.load(Relaxed));
        println!(
            "{}",
            serde_json::json!({
                "t": start.elapsed().as_secs_f64(),
                "opened": counts.opened.load(Relaxed),
                "done": done,
                "failed": failed,
                "events": counts.events.load(Relaxed),
            })
        );
        if opener.is_finished() && (done + failed) as usize >= args.streams {
            return Ok(());
        }
    }
}

/// One stream: true when it ended with `[DONE]`.
async fn one(addr: std::net::SocketAddr, request: &[u8], counts: &Counts) -> Result<bool> {
    let mut conn = TcpStream::connect(addr).await?;
    conn.write_all(request).await?;
    let mut buf = vec![0u8; 2048];
    let mut head = Vec::new();
    // The response head.
    let mut kept = loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(false);
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = find(&head, b"\r\n\r\n") {
            if !head.starts_with(b"HTTP/1.1 200") {
                return Ok(false);
            }
            counts.opened.fetch_add(1, Relaxed);
            break head.split_off(end + 4);
        }
        if head.len() > 64 * 1024 {
            return Ok(false);
        }
    };
    // Events, counted across reads (a read may split one: the tail of the
    // last read is kept until the next).
    let mut done = false;
    loop {
        counts.events.fetch_add(occurrences(&kept, EVENT), Relaxed);
        done |= find(&kept, DONE).is_some();
        let keep_from = kept.len().saturating_sub(CARRY);
        kept.drain(..keep_from);
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(done);
        }
        kept.extend_from_slice(&buf[..n]);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn occurrences(hay: &[u8], needle: &[u8]) -> u64 {
    hay.windows(needle.len()).filter(|w| *w == needle).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_counted_once_across_split_reads() {
        let all = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 0..all.len() {
            let (mut kept, mut n, mut done) = (Vec::new(), 0, false);
            for part in [&all[..cut], &all[cut..]] {
                kept.extend_from_slice(part);
                n += occurrences(&kept, EVENT);
                done |= find(&kept, DONE).is_some();
                let keep_from = kept.len().saturating_sub(CARRY);
                kept.drain(..keep_from);
            }
            assert_eq!((n, done), (2, true), "cut at {cut}");
        }
    }
}
