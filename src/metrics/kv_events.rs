//! The engines' KV events as the router reads them, per replica: batches
//! by outcome, blocks stored, removed and left out, cache resets, and what
//! the router holds of each engine's cache.

use super::family::{IntCounterVec, IntGaugeVec, Register};

/// What became of one batch of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOutcome {
    /// Read in order as it was published.
    Applied,
    /// Lost on the way, then read from the engine's replay socket.
    Replayed,
    /// Lost and not replayed: the replica's cache state is unknown.
    Lost,
    /// Not a batch the router can read (also leaves the state unknown).
    Undecodable,
    /// A message of another topic or shape, skipped.
    Skipped,
    /// Its blocks would pass `max_blocks`: the state is unknown.
    Overflowed,
}

impl KvOutcome {
    pub const ALL: [KvOutcome; 6] = [
        KvOutcome::Applied,
        KvOutcome::Replayed,
        KvOutcome::Lost,
        KvOutcome::Undecodable,
        KvOutcome::Skipped,
        KvOutcome::Overflowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KvOutcome::Applied => "applied",
            KvOutcome::Replayed => "replayed",
            KvOutcome::Lost => "lost",
            KvOutcome::Undecodable => "undecodable",
            KvOutcome::Skipped => "skipped",
            KvOutcome::Overflowed => "overflowed",
        }
    }
}

/// The `change` values of `kv_event_blocks_total`.
pub const BLOCK_CHANGES: [&str; 4] = ["stored", "removed", "orphaned", "unreadable"];
/// The `cause` values of `kv_engine_resets_total`.
pub const RESET_CAUSES: [&str; 2] = ["cleared", "restart"];

pub struct KvEventMetrics {
    batches: IntCounterVec,
    blocks_changed: IntCounterVec,
    resets: IntCounterVec,
    blocks: IntGaugeVec,
    synced: IntGaugeVec,
    bytes: IntGaugeVec,
}

impl KvEventMetrics {
    pub fn new(r: &mut Register) -> Self {
        Self {
            batches: r.counter_vec("prefix_router_kv_event_batches_total", "KV event batches from each replica's engine, by outcome (applied, replayed, lost, undecodable, skipped: another topic or shape, overflowed: past max_blocks)", &["replica", "outcome"]),
            blocks_changed: r.counter_vec("prefix_router_kv_event_blocks_total", "GPU blocks each engine's KV events stored and removed, stored blocks left out (orphaned: their parent never seen), and malformed events skipped (unreadable)", &["replica", "change"]),
            resets: r.counter_vec("prefix_router_kv_engine_resets_total", "Engine caches emptied as their KV events tell: AllBlocksCleared (cleared) or a new sequence (restart)", &["replica", "cause"]),
            blocks: r.gauge_vec("prefix_router_kv_blocks", "GPU blocks each replica's engine holds, as its KV events say", &["replica"]),
            synced: r.gauge_vec("prefix_router_kv_synced", "1 while every KV event since the engine's cache was last empty has been read; 0: its state is unknown", &["replica"]),
            bytes: r.gauge_vec("prefix_router_kv_index_bytes", "Bytes the router holds for each replica's blocks, about", &["replica"]),
        }
    }

    pub fn batch(&self, replica: &str, outcome: KvOutcome) {
        self.batches
            .with_label_values(&[replica, outcome.as_str()])
            .inc();
    }

    pub fn blocks_changed(&self, replica: &str, done: &crate::kv::Applied) {
        let counts = [done.stored, done.removed, done.orphans, done.unreadable];
        for (change, n) in BLOCK_CHANGES.iter().zip(counts) {
            if n > 0 {
                self.blocks_changed
                    .with_label_values(&[replica, change])
                    .inc_by(n as u64);
            }
        }
    }

    /// `restart`: a new sequence; else AllBlocksCleared.
    pub fn reset(&self, replica: &str, restart: bool) {
        self.resets
            .with_label_values(&[replica, RESET_CAUSES[usize::from(restart)]])
            .inc();
    }

    /// What the router holds of the replica's cache now.
    pub fn state(&self, replica: &str, blocks: usize, synced: bool, bytes: usize) {
        self.blocks.with_label_values(&[replica]).set(blocks as i64);
        self.synced
            .with_label_values(&[replica])
            .set(i64::from(synced));
        self.bytes.with_label_values(&[replica]).set(bytes as i64);
    }

    /// A replica's events followed from now: every series at 0, so they
    /// show (and `rate()` works) before its first batch.
    pub fn join(&self, replica: &str) {
        for o in KvOutcome::ALL {
            self.batches.with_label_values(&[replica, o.as_str()]);
        }
        for c in BLOCK_CHANGES {
            self.blocks_changed.with_label_values(&[replica, c]);
        }
        for c in RESET_CAUSES {
            self.resets.with_label_values(&[replica, c]);
        }
        self.state(replica, 0, false, 0);
    }

    /// Drops every series of `replica`.
    pub fn forget(&self, replica: &str) {
        for g in [&self.blocks, &self.synced, &self.bytes] {
            g.remove_label_values(&[replica]);
        }
        for o in KvOutcome::ALL {
            self.batches.remove_label_values(&[replica, o.as_str()]);
        }
        for c in BLOCK_CHANGES {
            self.blocks_changed.remove_label_values(&[replica, c]);
        }
        for c in RESET_CAUSES {
            self.resets.remove_label_values(&[replica, c]);
        }
    }
}
