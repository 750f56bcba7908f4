//! The Responses API's server-side state: which replica produced each
//! response id, learned from the response as it passes (the first `"id"` of
//! a JSON body, or of a stream's `response.created` event), so a request that
//! names it (`previous_response_id`, `GET`/`DELETE /v1/responses/{id}`) goes
//! to that replica and no other. Bounded: least recently used ids go first.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::policy::ReplicaId;

/// Response ids kept by default (~150 bytes each).
pub const DEFAULT_CAP: usize = 1 << 18;

/// Longest id kept (OpenAI's and vLLM's are ~50 bytes).
pub const MAX_ID: usize = 256;

/// Response id -> the replica holding it, least recently used evicted.
pub struct ResponseIds {
    inner: Mutex<Lru>,
}

struct Lru {
    cap: usize,
    /// Id -> (replica, stamp of its latest use).
    map: HashMap<String, (ReplicaId, u64)>,
    /// Uses, oldest first; entries whose stamp is stale are skipped.
    order: VecDeque<(u64, String)>,
    stamp: u64,
}

impl Lru {
    fn touch(&mut self, id: &str) -> u64 {
        self.stamp += 1;
        self.order.push_back((self.stamp, id.to_owned()));
        if self.order.len() > 2 * self.cap.max(8) {
            let map = &self.map;
            self.order
                .retain(|(s, id)| map.get(id).is_some_and(|e| e.1 == *s));
        }
        self.stamp
    }
}

impl ResponseIds {
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Mutex::new(Lru {
                cap: cap.max(1),
                map: HashMap::new(),
                order: VecDeque::new(),
                stamp: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `replica` holds response `id`.
    pub fn insert(&self, id: &str, replica: ReplicaId) {
        if id.is_empty() || id.len() > MAX_ID {
            return;
        }
        let mut l = self.lock();
        let stamp = l.touch(id);
        l.map.insert(id.to_owned(), (replica, stamp));
        while l.map.len() > l.cap {
            let Some((s, old)) = l.order.pop_front() else {
                break;
            };
            if l.map.get(&old).is_some_and(|e| e.1 == s) {
                l.map.remove(&old);
            }
        }
    }

    /// The replica holding `id`, if known (a use: it is kept longer).
    pub fn get(&self, id: &str) -> Option<ReplicaId> {
        let mut l = self.lock();
        let replica = l.map.get(id)?.0;
        let stamp = l.touch(id);
        if let Some(e) = l.map.get_mut(id) {
            e.1 = stamp;
        }
        Some(replica)
    }

    pub fn remove(&self, id: &str) {
        self.lock().map.remove(id);
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
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
    done: bool,
}

const SCAN_BYTES: usize = 64 << 10;

impl IdScan {
    /// Feeds the next piece; the id once found (returned once).
    pub fn feed(&mut self, piece: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = SCAN_BYTES.saturating_sub(self.seen.len());
        self.seen.extend_from_slice(&piece[..piece.len().min(room)]);
        let found = first_id(&self.seen);
        if found.is_some() || self.seen.len() >= SCAN_BYTES {
            self.done = true;
            self.seen = Vec::new();
        }
        found
    }
}

/// The value of the first `"id": "..."` (no escapes inside, as ids have none).
fn first_id(text: &[u8]) -> Option<String> {
    let at = memchr::memmem::find(text, b"\"id\"")?;
    let rest = &text[at + 4..];
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let rest = rest.strip_prefix(b"\"")?;
    let end = memchr::memchr2(b'"', b'\\', rest)?;
    if rest[end] != b'"' || end == 0 || end > MAX_ID {
        return None;
    }
    String::from_utf8(rest[..end].to_vec()).ok()
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
    }
}
