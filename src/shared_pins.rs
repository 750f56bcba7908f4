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
//! The connection belongs to the background task's own runtime; requests
//! reach it by channels, so no proxy worker ever waits on Redis's socket
//! beyond its budget.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::config::RedisTarget;
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
    target: RedisTarget,
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
    pub fn new(target: RedisTarget, budget: Duration, ttl_s: u64, metrics: Arc<Metrics>) -> Self {
        let (lookups, lookups_rx) = mpsc::channel(LOOKUP_QUEUE);
        let (writes, writes_rx) = mpsc::channel(WRITE_QUEUE);
        Self {
            target,
            budget,
            ttl_s,
            lookups,
            writes,
            response_lookups: AtomicUsize::new(0),
            queues: Mutex::new(Some((lookups_rx, writes_rx))),
            metrics,
        }
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
    fn accepts(&self, reply: &Reply) -> bool {
        match (self, reply) {
            (Write::Set { .. }, Reply::Ok) | (Write::Delete(_), Reply::Other) => true,
            (Write::Set { keep, .. }, Reply::Bulk(None)) => *keep,
            _ => false,
        }
    }
}

impl SharedPins {
    fn count(&self, op: &str, result: &str) {
        self.metrics
            .shared_pins
            .with_label_values(&[op, result])
            .inc();
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

/// A RESP command.
fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// One reply, as far as the router reads replies.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Ok,
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
    Other,
}

type Io = BufReader<TcpStream>;

async fn line(io: &mut Io) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    io.read_until(b'\n', &mut buf).await?;
    if !buf.ends_with(b"\r\n") {
        return Err(std::io::Error::other("connection closed mid-reply"));
    }
    buf.truncate(buf.len() - 2);
    Ok(buf)
}

fn number(bytes: &[u8]) -> std::io::Result<i64> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad length in a reply"))
}

/// Longest bulk string accepted (replica names are short).
const MAX_BULK: i64 = 1 << 16;

async fn reply(io: &mut Io) -> std::io::Result<Reply> {
    let head = line(io).await?;
    match head.first() {
        Some(b'+') => Ok(Reply::Ok),
        Some(b'-') => Err(std::io::Error::other(format!(
            "redis: {}",
            String::from_utf8_lossy(&head[1..])
        ))),
        Some(b':') => Ok(Reply::Other),
        Some(b'$') => {
            let n = number(&head[1..])?;
            if n < 0 {
                return Ok(Reply::Bulk(None));
            }
            if n > MAX_BULK {
                return Err(std::io::Error::other("reply too long"));
            }
            let mut data = vec![0; n as usize + 2];
            io.read_exact(&mut data).await?;
            data.truncate(n as usize);
            Ok(Reply::Bulk(Some(data)))
        }
        Some(b'*') => {
            let n = number(&head[1..])?;
            let mut items = Vec::with_capacity(n.clamp(0, 1024) as usize);
            for _ in 0..n.max(0) {
                items.push(Box::pin(reply(io)).await?);
            }
            Ok(Reply::Array(items))
        }
        _ => Err(std::io::Error::other("unknown reply")),
    }
}

/// Connects, authenticates and selects the database.
async fn connect(t: &RedisTarget) -> std::io::Result<Io> {
    let stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&t.addr))
        .await
        .map_err(|_| std::io::Error::other("connect timed out"))??;
    stream.set_nodelay(true)?;
    let mut io = BufReader::new(stream);
    let mut out = Vec::new();
    let mut expect = 0;
    if let Some(p) = &t.password {
        command(&mut out, &[b"AUTH", p.as_bytes()]);
        expect += 1;
    }
    if t.db != 0 {
        command(&mut out, &[b"SELECT", t.db.to_string().as_bytes()]);
        expect += 1;
    }
    if expect > 0 {
        io.get_mut().write_all(&out).await?;
        for _ in 0..expect {
            reply(&mut io).await?;
        }
    }
    Ok(io)
}

/// The background task: one connection, lookups answered in arrival order,
/// writes batched into pipelines.
pub struct SharedPinsTask(pub std::sync::Arc<SharedPins>);

impl SharedPinsTask {
    async fn serve(
        &self,
        io: &mut Io,
        lookups: &mut mpsc::Receiver<Lookup>,
        writes: &mut mpsc::Receiver<Write>,
    ) -> std::io::Result<()> {
        let ttl = self.0.ttl_s.to_string();
        loop {
            tokio::select! {
                l = lookups.recv() => {
                    let Some(l) = l else { return Ok(()) };
                    let keys = l.keys.iter().map(|k| k.as_bytes());
                    let args: Vec<&[u8]> = if l.renew {
                        [&b"GETEX"[..]].into_iter().chain(keys.take(1)).chain([&b"EX"[..], ttl.as_bytes()]).collect()
                    } else {
                        [&b"MGET"[..]].into_iter().chain(keys).collect()
                    };
                    let mut out = Vec::new();
                    command(&mut out, &args);
                    io.get_mut().write_all(&out).await?;
                    let name = |r: Reply| match r {
                        Reply::Bulk(Some(name)) => String::from_utf8(name).ok(),
                        _ => None,
                    };
                    let found = match reply(io).await? {
                        Reply::Array(items) if !l.renew => {
                            items.into_iter().enumerate().find_map(|(i, r)| Some((i, name(r)?)))
                        }
                        r @ Reply::Bulk(_) if l.renew => name(r).map(|n| (0, n)),
                        _ => return Err(std::io::Error::other("lookup: unexpected reply")),
                    };
                    let _ = l.answer.send(found);
                }
                w = writes.recv() => {
                    let Some(first) = w else { return Ok(()) };
                    let mut batch = vec![first];
                    while batch.len() < WRITE_BATCH {
                        match writes.try_recv() {
                            Ok(w) => batch.push(w),
                            Err(_) => break,
                        }
                    }
                    let mut out = Vec::new();
                    for w in &batch {
                        match w {
                            Write::Set { key, name, keep } => {
                                let mut args: Vec<&[u8]> = vec![b"SET", key.as_bytes(), name.as_bytes(), b"EX", ttl.as_bytes()];
                                if *keep {
                                    args.push(b"NX");
                                }
                                command(&mut out, &args);
                            }
                            Write::Delete(key) => command(&mut out, &[b"DEL", key.as_bytes()]),
                        }
                    }
                    io.get_mut().write_all(&out).await?;
                    for w in &batch {
                        if !w.accepts(&reply(io).await?) {
                            return Err(std::io::Error::other("write: unexpected reply"));
                        }
                        self.0.count(w.op(), "ok");
                    }
                }
            }
        }
    }
}

#[async_trait]
impl BackgroundService for SharedPinsTask {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let taken = self
            .0
            .queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some((mut lookups, mut writes)) = taken else {
            return;
        };
        let down = AtomicBool::new(false);
        let mut backoff = Duration::from_millis(100);
        let target = self.0.target.clone();
        loop {
            let session = async {
                let mut io = connect(&target).await?;
                if down.swap(false, Relaxed) {
                    log::warn!("fleet: redis {} reachable again: pins shared", target.addr);
                }
                backoff = Duration::from_millis(100);
                self.serve(&mut io, &mut lookups, &mut writes).await
            };
            let result = tokio::select! {
                _ = shutdown.changed() => return,
                r = session => r,
            };
            if let Err(e) = result {
                if !down.swap(true, Relaxed) {
                    log::warn!(
                        "fleet: redis {} unavailable ({e}): placing on this instance's own index until it is back",
                        target.addr
                    );
                }
            }
            // While down, lookups are answered at once (nothing known) and
            // writes dropped, until the next attempt.
            let wait = tokio::time::sleep(backoff);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = &mut wait => break,
                    l = lookups.recv() => match l {
                        Some(l) => drop(l.answer),
                        None => return,
                    },
                    w = writes.recv() => match w {
                        Some(w) => self.0.count(w.op(), "unavailable"),
                        None => return,
                    },
                }
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
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
        // An id another instance recorded first answers nil to `SET NX`.
        assert!(set(true).accepts(&Reply::Bulk(None)));
        assert!(!set(false).accepts(&Reply::Bulk(None)));
        assert!(set(false).accepts(&Reply::Ok) && set(true).accepts(&Reply::Ok));
        assert!(delete.accepts(&Reply::Other) && !delete.accepts(&Reply::Ok));
        assert!(!set(true).accepts(&Reply::Other));
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

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, &[b"MGET", b"a", b"bc"]);
        assert_eq!(out, b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$2\r\nbc\r\n");
    }
}
