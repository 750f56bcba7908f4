//! Pins shared between router instances through Redis (`fleet: {mode:
//! redis}`; Valkey alike). Every placement writes the key of its prompt's end
//! (and of its explicit conversation key) with the replica's name, a TTL on
//! each, batched and pipelined by a background task, never on the response
//! path. A request the local index knows nothing of reads the keys of its own
//! message ends (the last [`LOOKUP_ENDS`]) in one `MGET`, within
//! `redis_budget_ms`: the longest one another instance recorded is its pin.
//! Redis down, slow or refusing: the request is placed on the local index
//! alone, counted, and the outage logged once (and its end once).
//!
//! Responses API ids are shared the same way: the instance a response passes
//! through writes its id with the replica's name (`SET NX`: the first
//! instance to record an id names its holder for the fleet) and deletes it on
//! a successful `DELETE`; a request naming an id reads it (`GETEX`, which
//! renews its TTL: Redis 6.2 or later) within the budget, and Redis's answer
//! goes before the instance's own record. Response-id lookups hold at most
//! [`RESPONSE_LOOKUPS`] of the lookup queue, so made-up ids cannot crowd out
//! pin lookups.
//!
//! The connection (`connection`: the `redis` crate's multiplexed client
//! over TCP or TLS, its replies bounded by `bounded`) belongs to the
//! background task's own runtime; requests reach it by channels, so no proxy
//! worker ever waits on Redis's socket beyond its budget.

mod bounded;
mod connection;

pub use connection::SharedPinsTask;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;

/// Message ends a lookup asks about, the latest first: the previous turn's
/// prompt ends at one of the last few.
pub const LOOKUP_ENDS: usize = 16;
/// Placements waiting to be written; more are dropped (counted).
const WRITE_QUEUE: usize = 4096;
/// Writes sent in one pipeline.
const WRITE_BATCH: usize = 256;
/// Lookups waiting for the connection; more are answered "unavailable".
const LOOKUP_QUEUE: usize = 1024;
/// Response-id lookups waiting at once; more are answered "unavailable".
pub const RESPONSE_LOOKUPS: usize = 128;
const KEY_PREFIX: &str = "prefix-router:";

/// A write: a key and its replica's name (`keep` an existing value: a
/// response id's holder never changes), or a key to delete.
enum Write {
    Set {
        key: String,
        name: String,
        keep: bool,
    },
    Delete(String),
}
/// The receiving ends of the lookup and write queues.
type Queues = (mpsc::Receiver<Lookup>, mpsc::Receiver<Write>);

/// One lookup: the keys, longest prefix first (or one key whose TTL a
/// hit renews), and where to answer.
struct Lookup {
    keys: Vec<String>,
    renew: bool,
    answer: oneshot::Sender<Option<(usize, String)>>,
}

/// The router's handle on shared pins.
pub struct SharedPins {
    target: redis::ConnectionInfo,
    /// TLS for `rediss://`, built once at start.
    tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    budget: Duration,
    ttl_s: u64,
    lookups: mpsc::Sender<Lookup>,
    writes: mpsc::Sender<Write>,
    /// Response-id lookups in flight.
    response_lookups: AtomicUsize,
    /// The receiving ends, taken by the background task when it starts.
    queues: Mutex<Option<Queues>>,
    metrics: Arc<Metrics>,
}

impl SharedPins {
    /// Pins shared through the Redis at `target` (for `rediss://`, trusting
    /// the CAs of `ca_file`, else the system's); an error when TLS cannot be
    /// set up (a CA file with no certificate in it).
    pub fn new(
        target: redis::ConnectionInfo,
        ca_file: Option<&str>,
        budget: Duration,
        ttl_s: u64,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let tls = match crate::config::redis_url::is_tls(&target) {
            true => Some(Arc::new(connection::tls_config(ca_file)?)),
            false => None,
        };
        let (lookups, lookups_rx) = mpsc::channel(LOOKUP_QUEUE);
        let (writes, writes_rx) = mpsc::channel(WRITE_QUEUE);
        Ok(Self {
            target,
            tls,
            budget,
            ttl_s,
            lookups,
            writes,
            response_lookups: AtomicUsize::new(0),
            queues: Mutex::new(Some((lookups_rx, writes_rx))),
            metrics,
        })
    }

    /// The longest of `keys` (each `(prefix length, key)`, longest first)
    /// another instance recorded, with its replica's name; `None` on a miss,
    /// or when Redis does not answer within the budget.
    pub async fn lookup(&self, keys: Vec<(usize, u64)>) -> Option<(usize, String)> {
        if keys.is_empty() {
            return None;
        }
        let ends: Vec<usize> = keys.iter().map(|(pos, _)| *pos).collect();
        let keys = keys.into_iter().map(|(_, k)| redis_key(k)).collect();
        let (i, name) = self.ask("lookup", keys, false).await?;
        ends.get(i).map(|pos| (*pos, name))
    }

    /// The first of `keys` that holds a name, and which it is, asked of the
    /// background task and awaited within the budget; the outcome counted
    /// under `op`.
    async fn ask(&self, op: &str, keys: Vec<String>, renew: bool) -> Option<(usize, String)> {
        let (answer, rx) = oneshot::channel();
        let lookup = Lookup {
            keys,
            renew,
            answer,
        };
        if self.lookups.try_send(lookup).is_err() {
            self.count(op, "unavailable");
            return None;
        }
        let (found, result) = match tokio::time::timeout(self.budget, rx).await {
            Ok(Ok(Some(found))) => (Some(found), "hit"),
            Ok(Ok(None)) => (None, "miss"),
            // The task answered nothing: Redis is down.
            Ok(Err(_)) => (None, "unavailable"),
            Err(_) => (None, "timeout"),
        };
        self.count(op, result);
        found
    }

    /// Queues `keys` as held by `replica` (written in the background).
    pub fn record(&self, keys: &[u64], replica: &str) {
        for k in keys {
            self.write(Write::Set {
                key: redis_key(*k),
                name: replica.to_owned(),
                keep: false,
            });
        }
    }

    /// The replica another instance recorded for response `id`, within the
    /// budget.
    pub async fn response_holder(&self, id: &str) -> Option<String> {
        let key = response_key(id)?;
        let _slot = Slot::take(&self.response_lookups, RESPONSE_LOOKUPS).or_else(|| {
            self.count("response_lookup", "unavailable");
            None
        })?;
        let found = self.ask("response_lookup", vec![key], true).await;
        found.map(|(_, name)| name)
    }

    /// Queues response `id` as held by `replica`, unless an instance
    /// recorded it first.
    pub fn record_response(&self, id: &str, replica: &str) {
        if let Some(key) = response_key(id) {
            self.write(Write::Set {
                key,
                name: replica.to_owned(),
                keep: true,
            });
        }
    }

    /// Queues the deletion of response `id` (deleted on its replica).
    pub fn forget_response(&self, id: &str) {
        if let Some(key) = response_key(id) {
            self.write(Write::Delete(key));
        }
    }

    fn write(&self, w: Write) {
        let op = w.op();
        if self.writes.try_send(w).is_err() {
            self.count(op, "dropped");
        }
    }

    /// Counts one shared-pins operation's outcome.
    fn count(&self, op: &str, result: &str) {
        self.metrics
            .shared_pins
            .with_label_values(&[op, result])
            .inc();
    }
}

/// One of at most `max` places, held until dropped (a request that goes
/// away mid-lookup gives its place back).
struct Slot<'a>(&'a AtomicUsize);

impl<'a> Slot<'a> {
    fn take(taken: &'a AtomicUsize, max: usize) -> Option<Self> {
        let slot = Slot(taken);
        (taken.fetch_add(1, Relaxed) < max).then_some(slot)
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Write {
    /// The `op` it is counted under.
    fn op(&self) -> &'static str {
        match self {
            Write::Set { keep: false, .. } => "write",
            _ => "response_write",
        }
    }

    /// Whether `reply` is what it should get: `OK`; nil from a `SET NX` of
    /// an id another instance recorded first; a count from `DEL`.
    fn accepts(&self, reply: &redis::Value) -> bool {
        use redis::Value;
        match (self, reply) {
            (Write::Set { .. }, Value::Okay) | (Write::Delete(_), Value::Int(_)) => true,
            (Write::Set { keep, .. }, Value::Nil) => *keep,
            _ => false,
        }
    }
}

fn redis_key(k: u64) -> String {
    format!("{KEY_PREFIX}{k:016x}")
}

/// A response id's key: the id itself (a hash could be made to collide);
/// none for an id no instance keeps (empty or longer than `MAX_ID`).
fn response_key(id: &str) -> Option<String> {
    let kept = !id.is_empty() && id.len() <= crate::response_ids::MAX_ID;
    kept.then(|| format!("{KEY_PREFIX}response:{id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_accepts_only_its_own_reply() {
        let set = |keep| Write::Set {
            key: "k".into(),
            name: "a".into(),
            keep,
        };
        let delete = Write::Delete("k".into());
        use redis::Value;
        // An id another instance recorded first answers nil to `SET NX`.
        assert!(set(true).accepts(&Value::Nil));
        assert!(!set(false).accepts(&Value::Nil));
        assert!(set(false).accepts(&Value::Okay) && set(true).accepts(&Value::Okay));
        assert!(delete.accepts(&Value::Int(1)) && !delete.accepts(&Value::Okay));
        assert!(!set(true).accepts(&Value::Int(0)));
        assert_eq!(
            (set(false).op(), set(true).op()),
            ("write", "response_write")
        );
        assert_eq!(delete.op(), "response_write");
    }

    #[test]
    fn response_lookups_hold_at_most_their_slots() {
        let taken = AtomicUsize::new(0);
        let held: Vec<_> = (0..3).map_while(|_| Slot::take(&taken, 3)).collect();
        assert_eq!(held.len(), 3);
        assert!(Slot::take(&taken, 3).is_none());
        drop(held);
        assert_eq!(taken.load(Relaxed), 0);
        assert!(Slot::take(&taken, 3).is_some());
    }
}
