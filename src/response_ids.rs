//! The Responses API's server-side state: which replica produced each
//! response id, learned from the response as it passes (the first `"id"` of
//! a JSON body, or of a stream's `response.created` event), so a request that
//! names it (`previous_response_id`, `GET`/`DELETE /v1/responses/{id}`) goes
//! to that replica and no other. An id is never moved to another replica
//! once known (vLLM takes a client's `request_id` as the response id: a
//! client must not take over another's). Bounded: two generations of ids,
//! the older dropped whole when the newer fills half the cap, so ids not
//! used for a while go first. Sharded by the id's hash, each shard with its
//! share of the cap: no request takes a lock every other request takes.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

use crate::policy::ReplicaId;

/// Response ids kept by default (about 100 bytes each with a 40-byte id).
pub const DEFAULT_CAP: usize = 1 << 18;

/// Longest id kept (OpenAI's and vLLM's are ~50 bytes).
pub const MAX_ID: usize = 256;

/// Shards of a store whose cap allows [`MIN_SHARD`] ids per shard.
const SHARDS: usize = 16;
const MIN_SHARD: usize = 64;

/// Response id -> the replica holding it.
pub struct ResponseIds {
    /// Half of each shard's cap: the new generation's size.
    half: usize,
    shards: Box<[Mutex<Generations>]>,
    /// Keyed per process: a client cannot pick ids that share a shard.
    seed: RandomState,
    /// Ids held in every shard together.
    len: AtomicUsize,
}

#[derive(Default)]
struct Generations {
    new: HashMap<String, ReplicaId>,
    old: HashMap<String, ReplicaId>,
}

impl Generations {
    /// Moves `id` to the new generation (a use), rotating when it is full.
    fn promote(&mut self, id: &str, replica: ReplicaId, half: usize) {
        if self.new.len() >= half {
            self.old = std::mem::take(&mut self.new);
        }
        self.old.remove(id);
        self.new.insert(id.to_owned(), replica);
    }
}

impl ResponseIds {
    /// Holds at most `cap` ids (at least 2).
    pub fn new(cap: usize) -> Self {
        let cap = cap.max(2);
        let shards = if cap >= SHARDS * MIN_SHARD { SHARDS } else { 1 };
        Self {
            half: cap / shards / 2,
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            seed: RandomState::new(),
            len: AtomicUsize::new(0),
        }
    }

    /// Runs `f` on the shard of `id`, keeping the count of ids.
    fn with<T>(&self, id: &str, f: impl FnOnce(&mut Generations) -> T) -> T {
        let shard = (self.seed.hash_one(id) % self.shards.len() as u64) as usize;
        let mut g = self.shards[shard].lock().unwrap_or_else(|p| p.into_inner());
        let before = g.new.len() + g.old.len();
        let out = f(&mut g);
        let after = g.new.len() + g.old.len();
        if after > before {
            self.len.fetch_add(after - before, Relaxed);
        } else {
            self.len.fetch_sub(before - after, Relaxed);
        }
        out
    }

    /// Records that `replica` holds response `id`, unless another replica
    /// is known to hold it.
    pub fn insert(&self, id: &str, replica: ReplicaId) {
        if id.is_empty() || id.len() > MAX_ID {
            return;
        }
        self.with(id, |g| {
            let known = g.new.get(id).or_else(|| g.old.get(id)).copied();
            if known.is_none_or(|r| r == replica) {
                g.promote(id, replica, self.half);
            }
        });
    }

    /// The replica holding `id`, if known (a use: it is kept longer).
    pub fn get(&self, id: &str) -> Option<ReplicaId> {
        self.with(id, |g| {
            if let Some(r) = g.new.get(id) {
                return Some(*r);
            }
            let r = *g.old.get(id)?;
            g.promote(id, r, self.half);
            Some(r)
        })
    }

    pub fn remove(&self, id: &str) {
        self.with(id, |g| {
            g.new.remove(id);
            g.old.remove(id);
        });
    }

    /// Ids held (read without a lock).
    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Finds the first `"id"` string of a response body fed in pieces, looking
/// no further than the first 64 KiB.
#[derive(Debug, Default)]
pub struct IdScan {
    seen: Vec<u8>,
    /// Where the next search starts (each byte is searched about once).
    from: usize,
    done: bool,
}

const SCAN_BYTES: usize = 64 << 10;

/// What the bytes so far say of the first `"id"`.
enum Scan {
    Found(String),
    /// Not complete yet: more bytes may tell, read again from `from`
    /// (where a pending `"id"` begins, or where one may begin).
    NotYet {
        from: usize,
    },
    /// The first `"id"` is not a usable string.
    Never,
}

/// Whitespace allowed on either side of the `:` after `"id"`.
const MAX_SPACE: usize = 64;

impl IdScan {
    /// Feeds the next piece; the id once found (returned once).
    pub fn feed(&mut self, piece: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = SCAN_BYTES.saturating_sub(self.seen.len());
        self.seen.extend_from_slice(&piece[..piece.len().min(room)]);
        let found = match first_id(self.seen.get(self.from..).unwrap_or_default()) {
            Scan::Found(id) => Some(id),
            Scan::Never => None,
            Scan::NotYet { from } if self.seen.len() < SCAN_BYTES => {
                // What is before `from` holds no `"id"` to wait for.
                self.from += from;
                return None;
            }
            Scan::NotYet { .. } => None,
        };
        self.done = true;
        self.seen = Vec::new();
        found
    }
}

/// `rest` past its leading whitespace, unless there is more than [`MAX_SPACE`].
fn spaced(rest: &[u8]) -> Option<&[u8]> {
    let trimmed = rest.trim_ascii_start();
    (rest.len() - trimmed.len() <= MAX_SPACE).then_some(trimmed)
}

/// The value of the first `"id": "..."` (ids hold no escapes; at most
/// [`MAX_SPACE`] bytes of whitespace around its `:`).
fn first_id(text: &[u8]) -> Scan {
    let Some(at) = memchr::memmem::find(text, b"\"id\"") else {
        // A `"id"` cut at the end of the text starts in its last 3 bytes.
        return Scan::NotYet {
            from: text.len().saturating_sub(3),
        };
    };
    let pending = Scan::NotYet { from: at };
    let Some(rest) = spaced(&text[at + 4..]) else {
        return Scan::Never;
    };
    let Some(rest) = rest.strip_prefix(b":") else {
        return if rest.is_empty() {
            pending
        } else {
            Scan::Never
        };
    };
    let Some(rest) = spaced(rest) else {
        return Scan::Never;
    };
    let Some(rest) = rest.strip_prefix(b"\"") else {
        return if rest.is_empty() {
            pending
        } else {
            Scan::Never
        };
    };
    match memchr::memchr2(b'"', b'\\', rest) {
        None if rest.len() <= MAX_ID => pending,
        Some(end) if rest[end] == b'"' && end > 0 && end <= MAX_ID => {
            String::from_utf8(rest[..end].to_vec()).map_or(Scan::Never, Scan::Found)
        }
        _ => Scan::Never,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_id_goes_first() {
        let ids = ResponseIds::new(2);
        ids.insert("a", ReplicaId(1));
        ids.insert("b", ReplicaId(2));
        assert_eq!(ids.get("a"), Some(ReplicaId(1)));
        ids.insert("c", ReplicaId(3));
        assert_eq!(
            (ids.get("a"), ids.get("b"), ids.get("c")),
            (Some(ReplicaId(1)), None, Some(ReplicaId(3)))
        );
        for i in 0..1000 {
            ids.get("a");
            ids.insert(&format!("x{i}"), ReplicaId(4));
        }
        assert_eq!(ids.len(), 2);
        ids.remove("a");
        assert_eq!(ids.len(), 1);
    }

    #[test]
    fn a_sharded_store_finds_every_id_counts_them_and_stays_under_its_cap() {
        let ids = ResponseIds::new(SHARDS * MIN_SHARD);
        assert_eq!(ids.shards.len(), SHARDS);
        // 100 ids: no shard of 64 (two generations of 32) gets more than
        // 32 but by chance (300 did, about once in 200 runs: the reads
        // below then rotate a generation away).
        for i in 0..100 {
            ids.insert(&format!("resp_{i}"), ReplicaId(i % 3));
        }
        assert_eq!(ids.len(), 100);
        assert!((0..100).all(|i| ids.get(&format!("resp_{i}")) == Some(ReplicaId(i % 3))));
        ids.remove("resp_7");
        assert_eq!((ids.len(), ids.get("resp_7")), (99, None));
        for i in 0..100_000 {
            ids.insert(&format!("more_{i}"), ReplicaId(0));
        }
        assert!(ids.len() <= SHARDS * MIN_SHARD, "{}", ids.len());
    }

    #[test]
    fn the_id_is_found_across_pieces_in_a_body_or_a_stream() {
        let mut scan = IdScan::default();
        assert_eq!(
            scan.feed(
                b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"i"
            ),
            None
        );
        assert_eq!(
            scan.feed(b"d\": \"resp_42\",\"object\":\"response\"}}"),
            Some("resp_42".into())
        );
        assert_eq!(scan.feed(b"{\"id\":\"later\"}"), None, "once");
        let mut scan = IdScan::default();
        assert_eq!(
            scan.feed(br#"{"id":"resp_1","output":[{"id":"msg_1"}]}"#),
            Some("resp_1".into())
        );
        let mut scan = IdScan::default();
        assert_eq!(scan.feed(&vec![b' '; SCAN_BYTES]), None);
        assert_eq!(scan.feed(br#"{"id":"too late"}"#), None);
        let mut scan = IdScan::default();
        assert_eq!(
            scan.feed(br#"{"id":5,"x":{"id":"inner"}}"#),
            None,
            "the first id is not a string"
        );
        assert_eq!(scan.feed(br#"{"id":"later"}"#), None);
    }

    proptest::proptest! {
        /// However a body is cut into pieces, the id found is the one found
        /// in the whole body, and arbitrary bytes never panic.
        #[test]
        fn pieces_find_the_id_the_whole_body_holds(
            before in "[ -~]{0,40}",
            space in 0usize..100,
            id in "[A-Za-z0-9_]{0,300}",
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            cuts in proptest::collection::vec(0usize..2048, 0..8),
        ) {
            let ws = " ".repeat(space);
            let mut body = format!("{before}\"id\"{ws}:{ws}\"{id}\",").into_bytes();
            body.extend_from_slice(&noise);
            let whole = IdScan::default().feed(&body);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut scan = IdScan::default();
            let (mut at, mut found) = (0, None);
            for c in cuts.into_iter().chain([body.len()]) {
                found = found.or(scan.feed(&body[at..c]));
                at = c;
            }
            proptest::prop_assert_eq!(&found, &whole);
            let mut noisy = IdScan::default();
            noisy.feed(&noise);
        }
    }
}
