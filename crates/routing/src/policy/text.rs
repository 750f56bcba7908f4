//! A prompt's canonical text as its prefix chain keeps it: in pieces, the
//! first ones shared with the text of the conversation's turn it continues.
//!
//! A turn read from a checkpoint (see `request`) starts with the text of
//! the turn that left it, hundreds of KiB in a long agent loop: that text is
//! shared, not copied, and the turn's own bytes follow in a piece of their
//! own. A piece at least as long as the one before it is merged with it (a
//! copy of both), as are the last two past [`MAX_PIECES`]: pieces shrink
//! from the first on, so a long conversation's text is in a few pieces, and
//! each of its bytes is copied about log2(turns) times in all, not once per
//! turn.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

/// Pieces a text holds at most.
const MAX_PIECES: usize = 8;

/// Bytes, in pieces: each piece's first `end` bytes, in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Text {
    pieces: Vec<Piece>,
    len: usize,
}

#[derive(Debug, Clone)]
struct Piece {
    bytes: Arc<Vec<u8>>,
    end: usize,
}

impl From<Vec<u8>> for Text {
    fn from(bytes: Vec<u8>) -> Self {
        let mut text = Text::default();
        text.push(bytes);
        text
    }
}

#[cfg(test)]
impl PartialEq for Text {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.get(0..self.len) == other.get(0..other.len)
    }
}

impl Text {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held, shared pieces included.
    pub(crate) fn heap_bytes(&self) -> usize {
        let pieces: usize = self.pieces.iter().map(|p| p.bytes.capacity()).sum();
        pieces + self.pieces.capacity() * std::mem::size_of::<Piece>()
    }

    /// Its first `n` bytes (all of it, when shorter), shared, then `tail`.
    pub(crate) fn extended(&self, n: usize, tail: Vec<u8>) -> Text {
        let mut out = Text {
            pieces: Vec::with_capacity(self.pieces.len() + 1),
            len: 0,
        };
        let mut left = n.min(self.len);
        for p in &self.pieces {
            if left == 0 {
                break;
            }
            let end = p.end.min(left);
            out.pieces.push(Piece {
                bytes: Arc::clone(&p.bytes),
                end,
            });
            out.len += end;
            left -= end;
        }
        out.push(tail);
        while let [.., before, last] = &out.pieces[..] {
            if last.end < before.end && out.pieces.len() <= MAX_PIECES {
                break;
            }
            let both = [&before.bytes[..before.end], &last.bytes[..last.end]].concat();
            out.pieces.truncate(out.pieces.len() - 2);
            out.len -= both.len();
            out.push(both);
        }
        out
    }

    fn push(&mut self, bytes: Vec<u8>) {
        if !bytes.is_empty() {
            self.len += bytes.len();
            let end = bytes.len();
            let bytes = Arc::new(bytes);
            self.pieces.push(Piece { bytes, end });
        }
    }

    /// The bytes in `range`, copied only when they span pieces; `None` past
    /// its end.
    pub(crate) fn get(&self, range: Range<usize>) -> Option<Cow<'_, [u8]>> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        let mut copy: Option<Vec<u8>> = None;
        let mut start = 0;
        for p in &self.pieces {
            let end = start + p.end;
            if end > range.start && start < range.end {
                let bytes = &p.bytes[range.start.max(start) - start..range.end.min(end) - start];
                if copy.is_none() && range.end <= end {
                    return Some(Cow::Borrowed(bytes));
                }
                copy.get_or_insert_with(|| Vec::with_capacity(range.len()))
                    .extend_from_slice(bytes);
            }
            start = end;
        }
        Some(Cow::Owned(copy.unwrap_or_default()))
    }

    /// All its bytes, copied (tests).
    #[cfg(test)]
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        self.get(0..self.len)
            .map(Cow::into_owned)
            .unwrap_or_default()
    }

    /// Whether the two start with the same piece, held once (tests).
    #[cfg(test)]
    pub(crate) fn shares_with(&self, other: &Text) -> bool {
        let first = |t: &Text| t.pieces.first().map(|p| Arc::as_ptr(&p.bytes));
        first(self).is_some() && first(self) == first(other)
    }

    /// Calls `f` on each whole block of `size` bytes from byte `from` on, in
    /// order.
    pub(crate) fn blocks(&self, from: usize, size: usize, mut f: impl FnMut(&[u8])) {
        let mut at = from;
        let mut start = 0;
        for p in &self.pieces {
            let end = start + p.end;
            // The blocks within this piece, borrowed.
            if at >= start {
                let bytes = &p.bytes[..p.end];
                for block in bytes[(at - start).min(p.end)..].chunks_exact(size) {
                    f(block);
                    at += size;
                }
            }
            // One spanning this piece's end and the next, copied.
            if at < end && at + size <= self.len {
                if let Some(block) = self.get(at..at + size) {
                    f(&block);
                    at += size;
                }
            }
            start = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text made of these pieces.
    fn pieces(parts: &[&[u8]]) -> Text {
        let mut text = Text::default();
        for p in parts {
            text = text.extended(text.len(), p.to_vec());
        }
        text
    }

    #[test]
    fn extending_shares_the_first_bytes_and_reads_as_one_text() {
        let first = Text::from(b"abcdefgh".to_vec());
        let next = first.extended(6, b"XYZ".to_vec());
        assert_eq!(next.to_vec(), b"abcdefXYZ");
        assert!(Arc::ptr_eq(&first.pieces[0].bytes, &next.pieces[0].bytes));
        assert_eq!(next.get(4..8).as_deref(), Some(&b"efXY"[..]));
        assert!(matches!(next.get(0..6), Some(Cow::Borrowed(_))));
        assert_eq!(next.get(9..9).as_deref(), Some(&b""[..]));
        assert_eq!(next.get(3..10), None);
        assert_eq!(next, Text::from(b"abcdefXYZ".to_vec()));
        assert_ne!(next, Text::from(b"abcdefXYz".to_vec()));
    }

    #[test]
    fn blocks_are_the_whole_blocks_of_the_joined_bytes() {
        let parts: [&[u8]; 5] = [b"abcde", b"", b"f", b"ghijklm", b"nopqrst"];
        let text = pieces(&parts);
        let joined: Vec<u8> = parts.concat();
        for size in 1..=8 {
            for from in (0..joined.len()).step_by(size) {
                let mut seen = Vec::new();
                text.blocks(from, size, |b| seen.push(b.to_vec()));
                let want: Vec<Vec<u8>> = joined[from..]
                    .chunks_exact(size)
                    .map(<[u8]>::to_vec)
                    .collect();
                assert_eq!(seen, want, "size {size} from {from}");
            }
        }
    }

    #[test]
    fn pieces_shrink_from_the_first_and_stay_few() {
        let mut text = Text::from(vec![b'a'; 1000]);
        let mut want = vec![b'a'; 1000];
        for turn in 0..200 {
            let tail = vec![b'0' + (turn % 10) as u8; 3];
            want.extend_from_slice(&tail);
            text = text.extended(text.len(), tail);
            assert!(text.pieces.len() <= MAX_PIECES);
            let ends: Vec<usize> = text.pieces.iter().map(|p| p.end).collect();
            assert!(ends.windows(2).all(|w| w[1] < w[0]), "{ends:?}");
            assert_eq!(text.pieces[0].bytes.len(), 1000, "the first stays shared");
        }
        assert_eq!(text.to_vec(), want);
        // A prefix cut inside a piece.
        let cut = text.extended(1002, b"!".to_vec());
        assert_eq!(cut.to_vec(), [&want[..1002], b"!"].concat());
        // Tails as long as the first: merged into it.
        let long = text.extended(text.len(), vec![b'z'; 2000]);
        assert_eq!(long.pieces.len(), 1);
        assert_eq!(long.to_vec(), [&want[..], &[b'z'; 2000][..]].concat());
    }
}
