//! A bound on what Redis may send: the `redis` crate reads a reply of any
//! size, so the stream under it is watched frame by frame (RESP2 framing
//! only, not values) and cut at the first reply past the bounds below; every
//! read after a cut fails too. The connection then fails, and the router
//! places on its own index until a new one is up. What the router asks for
//! (replica names, at most 16 keys at a time, flat replies) stays far inside
//! them.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Longest header line (`+OK`, `-ERR ...`, `$12`, `*16`).
const MAX_LINE: usize = 4096;
/// Longest bulk string (a replica's name, a response id's holder).
const MAX_BULK: u64 = 64 << 10;
/// Most items in one array (an `MGET` asks for at most 16 keys).
const MAX_ITEMS: u64 = 256;
/// Deepest nesting of arrays: the router's replies are flat.
const MAX_DEPTH: usize = 1;
/// Most bytes in one top-level reply, header lines included.
const MAX_REPLY: u64 = 1 << 20;

/// Where the reader is in the reply stream.
#[derive(Debug, Default)]
pub struct Frames {
    /// The header line read so far.
    line: Vec<u8>,
    /// Bulk bytes (and their CRLF) still to come.
    bulk_left: u64,
    /// Items still to come in each open array, innermost last.
    open: Vec<u64>,
    /// Bytes of the top-level reply read so far.
    reply_bytes: u64,
    /// A bound was passed: the stream is cut for good.
    cut: bool,
}

impl Frames {
    /// Reads the next bytes of the stream; an error at the first past a bound.
    pub fn feed(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.cut {
            return Err(too_large("more after a cut"));
        }
        let fed = self.frames(bytes);
        self.cut = fed.is_err();
        fed
    }

    fn frames(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            if self.bulk_left > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.bulk_left).unwrap_or(usize::MAX));
                self.bulk_left -= n as u64;
                self.count(n)?;
                bytes = &bytes[n..];
                if self.bulk_left == 0 {
                    self.item_done();
                }
                continue;
            }
            let end = memchr::memchr(b'\n', bytes);
            let take = end.map_or(bytes.len(), |i| i + 1);
            if self.line.len() + take > MAX_LINE {
                return Err(too_large("a reply line"));
            }
            self.count(take)?;
            self.line.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if end.is_some() {
                let line = std::mem::take(&mut self.line);
                self.header(&line)?;
            }
        }
        Ok(())
    }

    /// One whole header line, CRLF included.
    fn header(&mut self, line: &[u8]) -> io::Result<()> {
        let Some(body) = line.strip_suffix(b"\r\n") else {
            return Err(bad("a reply line without CRLF"));
        };
        let count = || -> io::Result<i64> {
            std::str::from_utf8(&body[1..])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad("a reply length that is not a number"))
        };
        match body.first() {
            Some(b'+' | b'-' | b':') => self.item_done(),
            Some(b'$') => match count()? {
                -1 => self.item_done(),
                n if n < 0 => return Err(bad("a negative bulk length")),
                n if n as u64 > MAX_BULK => return Err(too_large("a bulk reply")),
                n => self.bulk_left = n as u64 + 2,
            },
            Some(b'*') => match count()? {
                -1 | 0 => self.item_done(),
                n if n < 0 => return Err(bad("a negative array length")),
                n if n as u64 > MAX_ITEMS => return Err(too_large("an array reply")),
                _ if self.open.len() >= MAX_DEPTH => return Err(too_large("nested arrays")),
                n => self.open.push(n as u64),
            },
            _ => return Err(bad("a reply type outside RESP2")),
        }
        Ok(())
    }

    /// Counts `n` bytes of the current top-level reply.
    fn count(&mut self, n: usize) -> io::Result<()> {
        self.reply_bytes += n as u64;
        if self.reply_bytes > MAX_REPLY {
            return Err(too_large("a reply"));
        }
        Ok(())
    }

    /// An item ended: it counts in its array, which may end in turn; a
    /// top-level reply that ended starts the count again.
    fn item_done(&mut self) {
        while let Some(left) = self.open.last_mut() {
            *left -= 1;
            if *left > 0 {
                return;
            }
            self.open.pop();
        }
        self.reply_bytes = 0;
    }
}

fn too_large(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("redis sent {what} past the router's bound"),
    )
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("redis sent {what}"))
}

/// Why a stream was cut, once it was (the client above sees only a broken
/// connection).
pub type Cut = std::sync::Arc<std::sync::OnceLock<String>>;

/// A stream whose reads are checked by [`Frames`]; writes pass unchanged.
pub struct Bounded<S> {
    inner: S,
    frames: Frames,
    cut: Cut,
}

impl<S> Bounded<S> {
    pub fn new(inner: S, cut: Cut) -> Self {
        Self {
            inner,
            frames: Frames::default(),
            cut,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Bounded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let fed = this.frames.feed(&buf.filled()[before..]);
                if let Err(e) = &fed {
                    let _ = this.cut.set(e.to_string());
                }
                Poll::Ready(fed)
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Bounded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `stream` cut at `cuts`; whether it passed.
    fn passes(stream: &[u8], cuts: &[usize]) -> bool {
        let mut frames = Frames::default();
        let mut at = 0;
        for cut in cuts
            .iter()
            .map(|c| c % (stream.len() + 1))
            .chain([stream.len()])
        {
            let cut = cut.max(at);
            if frames.feed(&stream[at..cut]).is_err() {
                return false;
            }
            at = cut;
        }
        true
    }

    #[test]
    fn what_the_router_asks_for_passes_and_oversized_replies_are_cut() {
        let mget =
            b"*3\r\n$5\r\ngpu-0\r\n$-1\r\n$5\r\ngpu-1\r\n+OK\r\n:1\r\n-ERR no\r\n*0\r\n*-1\r\n";
        assert!(passes(mget, &[]));
        assert!(passes(mget, &[1, 2, 3, 5, 8, 13, 21]));
        let big = format!("${}\r\n", MAX_BULK + 1);
        assert!(!passes(big.as_bytes(), &[]));
        let many = format!("*{}\r\n", MAX_ITEMS + 1);
        assert!(!passes(many.as_bytes(), &[]));
        assert!(!passes(&[b'+'; MAX_LINE + 1], &[]), "an endless line");
        assert!(!passes(b"*1\r\n*1\r\n:1\r\n", &[]), "nested");
        // Many bulks of the largest size in one reply: cut at the reply's bound.
        let mut wide = format!("*{MAX_ITEMS}\r\n").into_bytes();
        let bulk = [b"$65536\r\n".as_slice(), &[b'x'; 65536], b"\r\n"].concat();
        for _ in 0..MAX_ITEMS {
            wide.extend_from_slice(&bulk);
        }
        assert!(!passes(&wide, &[]));
        // Once cut, nothing more passes, however well formed.
        let mut frames = Frames::default();
        assert!(frames.feed(b"$x\r\n").is_err() && frames.feed(b"+OK\r\n").is_err());
        assert!(!passes(b"%1\r\n", &[]), "RESP3 is not asked for");
        assert!(!passes(b"$x\r\n", &[]));
        // A bulk's bytes are not read as headers, whatever they hold.
        assert!(passes(b"$4\r\n*-9\n\r\n+OK\r\n", &[6]));
    }

    fn reply() -> impl Strategy<Value = Vec<u8>> {
        let leaf = prop_oneof![
            Just(b"+OK\r\n".to_vec()),
            Just(b"$-1\r\n".to_vec()),
            any::<i64>().prop_map(|n| format!(":{n}\r\n").into_bytes()),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| {
                let mut v = format!("${}\r\n", b.len()).into_bytes();
                v.extend(b);
                v.extend(b"\r\n");
                v
            }),
        ];
        let array = proptest::collection::vec(leaf.clone(), 1..20).prop_map(|items| {
            let mut v = format!("*{}\r\n", items.len()).into_bytes();
            v.extend(items.concat());
            v
        });
        prop_oneof![leaf, array]
    }

    proptest! {
        #[test]
        fn replies_within_the_bounds_pass_however_the_stream_is_cut(
            replies in proptest::collection::vec(reply(), 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut cuts = cuts;
            cuts.sort_unstable();
            prop_assert!(passes(&replies.concat(), &cuts));
        }

        #[test]
        fn any_bytes_are_judged_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let _ = passes(&bytes, &cuts);
        }
    }
}
