//! The working set ([`Policy::working_set`]) kept between passes: what a
//! pass over the index read per replica, with the index's write count when
//! the pass began. While the index takes no write, the same window is that
//! reading. A pass over an index unwritten since the pass before (an idle
//! router's) also keeps the window's oldest [`DETAIL_S`] seconds apart, by
//! clock second, so a later window within them is the reading less the
//! seconds that aged out: an idle router reads its slab once every
//! `DETAIL_S` seconds, not every time the capacity watch asks (every 500 ms,
//! for as long as the window holds anything recorded; a pass over a full
//! index costs milliseconds). A busy one's passes keep nothing apart: its
//! next write would discard them.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use std::sync::atomic::Ordering::Relaxed;

use super::index::{IdHash, RecentBlock};
use super::types::{ReplicaId, WorkingSet};
use super::Policy;

type ByReplica = HashMap<u32, Blocks, BuildHasherDefault<IdHash>>;

/// Seconds at the old end of its window that a reading keeps by second: how
/// far it ages without another pass. Fewer than the window's (300 by
/// default), so what it keeps stays small beside the index (a thousand
/// replicas busy in every second: 30,000 counts).
pub(crate) const DETAIL_S: u32 = 30;

/// Blocks counted, and of them pinned ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Blocks {
    all: u64,
    pinned: u64,
}

/// One pass's reading, aged since.
#[derive(Debug)]
pub(crate) struct Reading {
    /// The index's writes when the pass began (a write during the pass
    /// leaves it behind, so the next ask passes again).
    writes: u64,
    /// The `since` the pass read from: the first second of `by_second`.
    base: u32,
    /// Block entries recorded at or after this second are counted.
    since: u32,
    /// What was counted in each of the seconds `base..`, if kept apart
    /// (`DETAIL_S` of them, or none).
    by_second: Vec<ByReplica>,
    /// All that was counted (once [`Reading::counted`]).
    totals: ByReplica,
    /// Passes made by this reading and those it replaced.
    pub passes: u64,
}

impl Reading {
    /// An empty reading of a pass beginning at `writes`, counting since
    /// `since`, after `passes` before it; `apart`: keeping the oldest
    /// seconds apart.
    pub fn new(writes: u64, since: u32, passes: u64, apart: bool) -> Self {
        Self {
            writes,
            base: since,
            since,
            by_second: vec![ByReplica::default(); if apart { DETAIL_S as usize } else { 0 }],
            totals: ByReplica::default(),
            passes: passes + 1,
        }
    }

    /// An empty reading for the pass that replaces `before` (which did not
    /// hold): its oldest seconds kept apart if the index was not written
    /// since `before`'s pass (it only aged: idle, likely to stay so).
    pub fn after(before: Option<Reading>, writes: u64, since: u32) -> Self {
        let idle = before.as_ref().is_some_and(|r| r.writes == writes);
        Self::new(writes, since, before.map_or(0, |r| r.passes), idle)
    }

    /// Whether it still reads an index at `writes` since `since`: nothing
    /// recorded or removed since, no older second asked for, and what ages
    /// out kept by second.
    pub fn holds(&self, writes: u64, since: u32) -> bool {
        let kept = self.since..=self.base.saturating_add(self.by_second.len() as u32);
        self.writes == writes && kept.contains(&since)
    }

    /// Counts a chunk of the pass (each block touched at or after `since`).
    pub fn add(&mut self, chunk: &[RecentBlock]) {
        for b in chunk {
            let second = b.touched.wrapping_sub(self.base) as usize;
            count(
                self.by_second.get_mut(second).unwrap_or(&mut self.totals),
                b,
            );
        }
    }

    /// The reading once the pass has added every chunk: the seconds kept
    /// apart summed into the totals (one map update per block in the pass).
    pub fn counted(mut self) -> Self {
        for second in &self.by_second {
            for (replica, n) in second {
                let sum = self.totals.entry(*replica).or_default();
                sum.all += n.all;
                sum.pinned += n.pinned;
            }
        }
        self
    }

    /// Drops what was recorded before `since` (within the seconds kept
    /// apart: see [`Reading::holds`]).
    pub fn age(&mut self, since: u32) {
        let from = self.since.saturating_sub(self.base) as usize;
        let to = since.saturating_sub(self.base) as usize;
        for second in self.by_second.iter_mut().take(to).skip(from) {
            for (replica, gone) in std::mem::take(second) {
                if let Some(n) = self.totals.get_mut(&replica) {
                    n.all -= gone.all;
                    n.pinned -= gone.pinned;
                    if n.all == 0 {
                        self.totals.remove(&replica);
                    }
                }
            }
        }
        self.since = self.since.max(since);
    }

    /// Bytes per replica (blocks of `block_bytes`), in replica id order.
    pub fn sets(&self, block_bytes: u64) -> Vec<(ReplicaId, WorkingSet)> {
        let mut sets: Vec<_> = (self.totals.iter())
            .map(|(r, n)| {
                let set = WorkingSet {
                    all: n.all * block_bytes,
                    pinned: n.pinned * block_bytes,
                };
                (ReplicaId(*r), set)
            })
            .collect();
        sets.sort_unstable_by_key(|(r, _)| r.0);
        sets
    }
}

impl Policy {
    /// Bytes of distinct prompt blocks placed on each replica within the last
    /// `window_s` seconds: the prefix cache each replica is asked to hold; in
    /// replica id order. One pass over the index, a chunk of a shard locked
    /// at a time, the thread yielding between chunks (a full index's pass
    /// takes milliseconds), unless nothing was recorded or removed since the
    /// last: then that pass's reading, less what aged out (see `working`).
    pub fn working_set(&self, window_s: u32) -> Vec<(ReplicaId, WorkingSet)> {
        let since = self.clock_s.load(Relaxed).saturating_sub(window_s);
        let mut kept = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        let writes = self.index.writes();
        let reading = match kept.take() {
            Some(r) if r.holds(writes, since) => kept.insert(r),
            before => {
                let mut r = Reading::after(before, writes, since);
                self.index.recent_blocks(since, |chunk| r.add(chunk));
                kept.insert(r.counted())
            }
        };
        reading.age(since);
        reading.sets(self.config().block_bytes as u64)
    }

    /// Passes over the index the working set has made.
    #[cfg(test)]
    pub(super) fn working_set_passes(&self) -> u64 {
        let kept = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        kept.as_ref().map_or(0, |r| r.passes)
    }
}

fn count(sums: &mut ByReplica, b: &RecentBlock) {
    let n = sums.entry(b.replica).or_default();
    n.all += 1;
    n.pinned += u64::from(b.pinned);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(replica: u32, touched: u32, pinned: bool) -> RecentBlock {
        RecentBlock {
            replica,
            touched,
            pinned,
        }
    }

    fn set(all: u64, pinned: u64) -> WorkingSet {
        WorkingSet { all, pinned }
    }

    /// A reading of `blocks`, since `since`, its oldest seconds apart.
    fn read(since: u32, blocks: &[RecentBlock]) -> Reading {
        let mut r = Reading::new(7, since, 0, true);
        r.add(blocks);
        r.counted()
    }

    #[test]
    fn aging_drops_the_seconds_before_the_window_and_replicas_left_with_none() {
        let mut r = read(
            10,
            &[
                block(2, 10, true),
                block(1, 10, false),
                block(2, 12, false),
                block(1, 15, true),
            ],
        );
        assert_eq!(
            r.sets(4),
            vec![(ReplicaId(1), set(8, 4)), (ReplicaId(2), set(8, 4))]
        );
        r.age(11);
        assert_eq!(
            r.sets(4),
            vec![(ReplicaId(1), set(4, 4)), (ReplicaId(2), set(4, 0))]
        );
        r.age(13);
        assert_eq!(r.sets(4), vec![(ReplicaId(1), set(4, 4))]);
        r.age(12);
        assert_eq!(r.sets(4), vec![(ReplicaId(1), set(4, 4))], "no going back");
        r.age(16);
        assert_eq!(r.sets(4), vec![]);
    }

    #[test]
    fn it_holds_only_for_the_same_writes_and_seconds_it_kept() {
        let mut r = read(10, &[]);
        assert!(r.holds(7, 10) && r.holds(7, 11) && r.holds(7, 10 + DETAIL_S));
        assert!(!r.holds(8, 10), "written since");
        assert!(!r.holds(7, 9), "a longer window than was read");
        assert!(
            !r.holds(7, 11 + DETAIL_S),
            "aged past what it kept by second"
        );
        r.age(20);
        assert!(!r.holds(7, 19), "a longer window than it has aged to");
        let next = Reading::after(Some(r), 8, 10);
        assert_eq!(next.passes, 2);
        assert!(next.by_second.is_empty(), "written since: busy");
        assert_eq!(
            Reading::after(Some(next), 8, 11).by_second.len(),
            DETAIL_S as usize
        );
    }

    #[test]
    fn a_reading_with_no_seconds_apart_holds_for_its_own_window_only() {
        let mut r = Reading::new(7, 10, 0, false);
        r.add(&[block(1, 10, false), block(1, 12, false)]);
        let r = r.counted();
        assert_eq!(r.sets(1), vec![(ReplicaId(1), set(2, 0))]);
        assert!(r.holds(7, 10));
        assert!(!r.holds(7, 11) && !r.holds(8, 10));
    }

    #[test]
    fn seconds_past_the_detail_are_counted_in_the_totals_only() {
        let mut r = read(
            5,
            &[block(1, 4 + DETAIL_S, false), block(1, 5 + DETAIL_S, true)],
        );
        assert_eq!(r.sets(1), vec![(ReplicaId(1), set(2, 1))]);
        assert!(r.by_second.iter().map(|s| s.len()).sum::<usize>() == 1);
        r.age(5 + DETAIL_S);
        assert_eq!(r.sets(1), vec![(ReplicaId(1), set(1, 1))]);
    }
}
