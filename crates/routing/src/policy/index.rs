//! The prefix index: prefix hash -> the replica that most recently served it,
//! capped in entries with segmented-LRU eviction, O(1) per operation; the
//! passes over every entry (a working set, forgetting a replica) go through
//! the slab a [`CHUNK`] at a time, so their caller can let go of the lock
//! between chunks.
//!
//! Scan resistance, as database buffer pools protect themselves from
//! sequential scans: a new entry enters the *probation* segment; recorded
//! again (a later request carried the same prefix: a continuation, a shared
//! system prompt) it moves to the *protected* segment, which holds at most
//! [`PROTECTED_SHARE`] of the cap and demotes its least recent entry back to
//! probation when full. Eviction takes probation's least recent entry first.
//! So a flood of one-shot prompts larger than the whole index only churns
//! probation, and a live conversation, recorded on every turn, stays.
//!
//! Entries live in a slab threaded by two doubly linked recency lists; the map
//! from hash to slot uses the hash itself (keys are already xxh3 outputs).
//! Cost per entry: a 40-byte slot plus a 17-byte hash-map bucket at the
//! table's load factor, plus growth slack; `heap_bytes` reports it and `docs/performance.md` the
//! measured cost per tracked conversation.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const NIL: u32 = u32::MAX;
/// Marks an unused tail-length slot; tail lengths are below the block size (< 65535).
const NO_TAIL: u16 = u16::MAX;
/// Tail lengths remembered per block: prompts that ended inside the next block.
pub(crate) const TAILS: usize = 4;

/// What the index knows of one prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The replica that served this prefix most recently.
    pub replica: u32,
    /// Clock (seconds) of the last upsert.
    pub touched: u32,
    /// Lengths past this block at which recorded prompts ended, newest first.
    tails: [u16; TAILS],
}

impl Entry {
    fn new(replica: u32, touched: u32) -> Self {
        Self {
            replica,
            touched,
            tails: [NO_TAIL; TAILS],
        }
    }

    /// Tail lengths recorded after this block, newest first.
    pub fn tails(&self) -> impl Iterator<Item = usize> + '_ {
        self.tails
            .iter()
            .take_while(|t| **t != NO_TAIL)
            .map(|t| *t as usize)
    }

    /// Remembers that a prompt ended `len` bytes past this block.
    pub fn add_tail(&mut self, len: u16) {
        let pos = self.tails.iter().position(|t| *t == len || *t == NO_TAIL);
        let end = pos.unwrap_or(TAILS - 1);
        self.tails.copy_within(0..end, 1);
        self.tails[0] = len;
    }
}

#[derive(Debug)]
struct Slot {
    key: u64,
    entry: Entry,
    prev: u32,
    next: u32,
    /// A block of prompt text (not a prompt end or an explicit key).
    block: bool,
    /// Last recorded by a continuation: part of a context expected back.
    pinned: bool,
    /// Which recency list holds it: [`PROBATION`] or [`PROTECTED`] ([`FREE`]:
    /// none, the slot is unused).
    segment: u8,
}

const PROBATION: u8 = 0;
const PROTECTED: u8 = 1;
/// A slot on the free list, in no recency list.
const FREE: u8 = 2;
/// The protected segment's share of the cap, in percent.
pub(crate) const PROTECTED_SHARE: usize = 80;

/// One recency list: most recent at `head`, evicted from `tail`.
#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// Keys are uniformly distributed hashes already: use them as their own hash.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Hashes a replica id (a small integer from a counter) with one multiply:
/// a pass over a full index looks one up per block, and std's SipHash made
/// most of the pass (`make bench`, `working_set`).
#[derive(Default)]
pub(crate) struct IdHash(u64);

/// 2⁶⁴ over the golden ratio, odd: Fibonacci hashing's multiplier.
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(FIBONACCI);
        }
    }
    fn write_u32(&mut self, n: u32) {
        // Distinct ids stay distinct in the low bits (the bucket) and mix
        // into the high ones (the tag).
        self.0 = u64::from(n).wrapping_mul(FIBONACCI);
    }
}

/// A capped segmented-LRU map from prefix hash to [`Entry`].
#[derive(Debug)]
pub(crate) struct PrefixIndex {
    map: HashMap<u64, u32, BuildHasherDefault<Identity>>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Probation and protected recency lists.
    lists: [List; 2],
    cap: usize,
    protected_cap: usize,
    /// The latest clock second recorded: a pass for entries since a later
    /// one has nothing to read.
    newest: u32,
    /// Entries recorded and removed so far: unchanged, the index reads as a
    /// pass last read it.
    writes: u64,
}

/// A block entry as a pass reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecentBlock {
    pub replica: u32,
    /// Its clock second.
    pub touched: u32,
    /// A continuation recorded it last.
    pub pinned: bool,
}

/// Slots a pass over the index ([`PrefixIndex::recent_blocks`],
/// [`PrefixIndex::forget`]) reads under one hold of its lock: about
/// 30 µs to read (more when many of them are dropped), where a whole shard
/// of a full index held it about 0.4 ms, and on a busy core several times
/// that while the pass's thread waited for its turn.
pub(crate) const CHUNK: usize = 4096;

impl PrefixIndex {
    /// An empty index holding at most `cap` entries (at least 1).
    pub fn new(cap: usize) -> Self {
        Self {
            map: HashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            lists: [EMPTY; 2],
            cap: cap.max(1),
            protected_cap: (cap.max(1) * PROTECTED_SHARE / 100).max(1),
            newest: 0,
            writes: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Entries recorded and removed so far.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Heap bytes held: slab slots plus hash-map buckets (key, slot, control byte).
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.map.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.free.capacity() * std::mem::size_of::<u32>()
    }

    /// Looks a prefix up without changing its recency.
    pub fn get(&self, key: u64) -> Option<&Entry> {
        self.map.get(&key).map(|s| &self.slots[*s as usize].entry)
    }

    /// Records `key` as served by `replica` at `now_s`: a new key enters
    /// probation, a known one moves to the front of the protected segment.
    /// Evicts when the cap is exceeded. `block` marks entries that stand for a
    /// block of prompt text, `pinned` a record by a continuation. Returns the entry.
    pub fn upsert(
        &mut self,
        key: u64,
        replica: u32,
        now_s: u32,
        block: bool,
        pinned: bool,
    ) -> &mut Entry {
        self.newest = self.newest.max(now_s);
        self.writes += 1;
        let (slot, segment) = match self.map.get(&key) {
            Some(s) => {
                let s = *s;
                self.unlink(s);
                let slot = &mut self.slots[s as usize];
                slot.entry.replica = replica;
                slot.entry.touched = now_s;
                slot.block = block;
                slot.pinned = pinned;
                (s, PROTECTED)
            }
            None => {
                if self.map.len() >= self.cap {
                    self.evict();
                }
                let slot = Slot {
                    key,
                    entry: Entry::new(replica, now_s),
                    prev: NIL,
                    next: NIL,
                    block,
                    pinned,
                    segment: PROBATION,
                };
                let s = match self.free.pop() {
                    Some(s) => {
                        self.slots[s as usize] = slot;
                        s
                    }
                    None => {
                        self.slots.push(slot);
                        (self.slots.len() - 1) as u32
                    }
                };
                self.map.insert(key, s);
                (s, PROBATION)
            }
        };
        self.push_front(slot, segment);
        if self.lists[PROTECTED as usize].len > self.protected_cap {
            let oldest = self.lists[PROTECTED as usize].tail;
            self.unlink(oldest);
            self.push_front(oldest, PROBATION);
        }
        &mut self.slots[slot as usize].entry
    }

    /// Appends to `out` each block entry touched at or after `since_s` among
    /// the slab's slots `from..from + CHUNK`; returns where the next chunk starts
    /// (`None` after the last). A slab's slots never move, so a pass whose
    /// lock is released between chunks reads each slot once; an entry
    /// recorded meanwhile may be missed or counted twice (the working set is
    /// an estimate already: the gauges, `kv_room`'s weights), and is a write,
    /// so the next working set passes again.
    pub fn recent_blocks(
        &self,
        from: usize,
        since_s: u32,
        out: &mut Vec<RecentBlock>,
    ) -> Option<usize> {
        if self.newest < since_s {
            return None;
        }
        let (chunk, next) = self.chunk(from);
        let recent = chunk
            .iter()
            .filter(|s| s.segment != FREE && s.block && s.entry.touched >= since_s);
        out.extend(recent.map(|s| RecentBlock {
            replica: s.entry.replica,
            touched: s.entry.touched,
            pinned: s.pinned,
        }));
        next
    }

    /// Drops each entry that `doomed` picks by its replica and its clock
    /// second among the slab's slots `from..from + CHUNK`; returns how
    /// many, and where the next chunk starts (`None` after the last).
    pub fn forget(
        &mut self,
        from: usize,
        doomed: impl Fn(u32, u32) -> bool,
    ) -> (usize, Option<usize>) {
        let (chunk, next) = self.chunk(from);
        let picked: Vec<u32> = (chunk.iter().zip(from as u32..))
            .filter(|(s, _)| s.segment != FREE && doomed(s.entry.replica, s.entry.touched))
            .map(|(_, at)| at)
            .collect();
        for s in &picked {
            self.remove(*s);
        }
        (picked.len(), next)
    }

    /// The slab's slots `from..from + CHUNK`, and where the next chunk starts.
    fn chunk(&self, from: usize) -> (&[Slot], Option<usize>) {
        let end = from.saturating_add(CHUNK).min(self.slots.len());
        let chunk = self.slots.get(from..end).unwrap_or_default();
        (chunk, (end < self.slots.len()).then_some(end))
    }

    /// Drops probation's least recent entry, or protected's when probation is empty.
    fn evict(&mut self) {
        let [probation, protected] = self.lists;
        let victim = if probation.tail != NIL {
            probation.tail
        } else {
            protected.tail
        };
        if victim != NIL {
            self.remove(victim);
        }
    }

    fn remove(&mut self, s: u32) {
        self.writes += 1;
        self.unlink(s);
        self.map.remove(&self.slots[s as usize].key);
        self.slots[s as usize].segment = FREE;
        self.free.push(s);
    }

    fn unlink(&mut self, s: u32) {
        let (prev, next, segment) = {
            let slot = &self.slots[s as usize];
            (slot.prev, slot.next, slot.segment)
        };
        let list = &mut self.lists[segment as usize];
        list.len -= 1;
        match prev {
            NIL => list.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => list.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, s: u32, segment: u8) {
        let list = &mut self.lists[segment as usize];
        let old = list.head;
        list.head = s;
        list.len += 1;
        if old == NIL {
            list.tail = s;
        }
        {
            let slot = &mut self.slots[s as usize];
            slot.prev = NIL;
            slot.next = old;
            slot.segment = segment;
        }
        if old != NIL {
            self.slots[old as usize].prev = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_entry_is_evicted_first() {
        let mut idx = PrefixIndex::new(2);
        idx.upsert(1, 0, 0, true, false);
        idx.upsert(2, 0, 0, true, false);
        idx.upsert(1, 0, 0, true, false); // touch 1: 2 is now the oldest
        idx.upsert(3, 0, 0, true, false);
        assert_eq!(idx.len(), 2);
        assert!(idx.get(1).is_some());
        assert!(idx.get(2).is_none());
        assert!(idx.get(3).is_some());
    }

    #[test]
    fn a_flood_of_new_keys_larger_than_the_cap_leaves_recorded_twice_keys() {
        let mut idx = PrefixIndex::new(100);
        for k in 0..10 {
            idx.upsert(k, 0, 0, true, false);
            idx.upsert(k, 0, 1, true, false); // a second turn: protected
        }
        for k in 1_000..100_000 {
            idx.upsert(k, 1, 2, true, false);
        }
        assert_eq!(idx.len(), 100);
        assert!(
            (0..10).all(|k| idx.get(k).is_some()),
            "the flood evicted a conversation"
        );
        assert_eq!(idx.lists[0].len + idx.lists[1].len, 100);
    }

    #[test]
    fn the_protected_segment_is_capped_and_demotes_to_probation() {
        let mut idx = PrefixIndex::new(10);
        for k in 0..20 {
            idx.upsert(k, 0, 0, true, false);
            idx.upsert(k, 0, 0, true, false);
        }
        assert!(idx.lists[1].len <= 8);
        assert_eq!(idx.len(), 10);
        // The most recently protected keys survive.
        assert!((12..20).all(|k| idx.get(k).is_some()));
    }

    #[test]
    fn upsert_moves_the_prefix_to_the_new_replica() {
        let mut idx = PrefixIndex::new(8);
        idx.upsert(7, 0, 0, true, false);
        idx.upsert(7, 1, 0, true, false);
        assert_eq!(idx.get(7).map(|e| e.replica), Some(1));
        assert_eq!(idx.len(), 1);
    }

    #[test]
    fn forgetting_a_replica_drops_only_its_entries() {
        let mut idx = PrefixIndex::new(8);
        idx.upsert(1, 0, 0, true, false);
        idx.upsert(2, 1, 0, true, false);
        idx.upsert(3, 0, 0, true, false);
        assert_eq!(idx.forget(0, |r, _| r == 0), (2, None));
        assert_eq!(idx.len(), 1);
        assert!(idx.get(2).is_some());
        // Freed slots are reused and the recency list stays consistent.
        for k in 10..20 {
            idx.upsert(k, 1, 0, true, false);
        }
        assert_eq!(idx.len(), 8);
    }

    #[test]
    fn forgetting_before_a_time_keeps_what_was_recorded_since() {
        let mut idx = PrefixIndex::new(8);
        idx.upsert(1, 0, 10, true, false);
        idx.upsert(2, 0, 20, true, false);
        idx.upsert(3, 1, 5, true, false);
        idx.upsert(1, 0, 30, true, false);
        assert_eq!(idx.forget(0, |r, t| r == 0 && t < 30), (1, None));
        assert_eq!(idx.get(2), None);
        assert!(idx.get(1).is_some() && idx.get(3).is_some());
    }

    /// Every recent block, chunk by chunk, as a pass reads them: its replica
    /// and whether it is pinned.
    fn recent(idx: &PrefixIndex, since_s: u32) -> Vec<(u32, bool)> {
        let (mut out, mut from) = (Vec::new(), Some(0));
        while let Some(at) = from {
            from = idx.recent_blocks(at, since_s, &mut out);
        }
        out.iter().map(|b| (b.replica, b.pinned)).collect()
    }

    #[test]
    fn recent_blocks_are_those_of_the_window_and_skip_other_entries() {
        let mut idx = PrefixIndex::new(8);
        idx.upsert(1, 0, 10, true, false);
        idx.upsert(2, 1, 20, true, false);
        idx.upsert(3, 1, 30, false, false);
        idx.upsert(4, 0, 30, true, true);
        // Recorded again: counted by its new stamp.
        idx.upsert(2, 1, 40, true, false);
        assert_eq!(recent(&idx, 20), vec![(1, false), (0, true)]);
        assert_eq!(recent(&idx, 0).len(), 3);
        assert_eq!(recent(&idx, 41), vec![], "nothing recorded since");
        // A removed entry is not counted, its slot reused is.
        idx.forget(0, |r, _| r == 1);
        assert_eq!(recent(&idx, 0), vec![(0, false), (0, true)]);
        idx.upsert(5, 2, 50, true, false);
        assert_eq!(recent(&idx, 50), vec![(2, false)]);
        let mut out = Vec::new();
        idx.recent_blocks(0, 50, &mut out);
        assert_eq!(out[0].touched, 50);
    }

    #[test]
    fn writes_count_records_and_removals_not_lookups() {
        let mut idx = PrefixIndex::new(2);
        idx.upsert(1, 0, 0, true, false);
        idx.upsert(1, 0, 1, true, false);
        assert_eq!(idx.writes(), 2);
        idx.get(1);
        let mut out = Vec::new();
        idx.recent_blocks(0, 0, &mut out);
        assert_eq!(idx.writes(), 2, "reads are no writes");
        idx.upsert(2, 0, 1, true, false);
        idx.upsert(3, 0, 1, true, false); // evicts one
        assert_eq!(idx.writes(), 5);
        idx.forget(0, |_, _| true);
        assert_eq!(idx.writes(), 7);
    }

    #[test]
    fn a_pass_reads_a_large_slab_a_chunk_at_a_time_and_every_slot_once() {
        let mut idx = PrefixIndex::new(3 * CHUNK);
        for k in 0..(2 * CHUNK + 7) as u64 {
            idx.upsert(k, (k % 3) as u32, 1, true, false);
        }
        let mut out = Vec::new();
        assert_eq!(idx.recent_blocks(0, 0, &mut out), Some(CHUNK));
        assert_eq!(out.len(), CHUNK);
        assert_eq!(idx.recent_blocks(CHUNK, 0, &mut out), Some(2 * CHUNK));
        assert_eq!(idx.recent_blocks(2 * CHUNK, 0, &mut out), None);
        assert_eq!(out.len(), 2 * CHUNK + 7);
        // Forgetting goes chunk by chunk too, and finds each entry once.
        let (mut dropped, mut from) = (0, Some(0));
        while let Some(at) = from {
            let (n, next) = idx.forget(at, |r, _| r == 1);
            assert!(n <= CHUNK / 3 + 1);
            (dropped, from) = (dropped + n, next);
        }
        assert_eq!(dropped, (2 * CHUNK + 7) / 3);
        assert_eq!(idx.len(), 2 * CHUNK + 7 - dropped);
    }

    #[test]
    fn tails_keep_the_newest_distinct_lengths() {
        let mut e = Entry::new(0, 0);
        for t in [5, 6, 5, 7, 8, 9] {
            e.add_tail(t);
        }
        assert_eq!(e.tails().collect::<Vec<_>>(), vec![9, 8, 7, 5]);
    }
}
