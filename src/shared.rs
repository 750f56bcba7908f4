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
//! The connection belongs to the background task's own runtime; requests
//! reach it by channels, so no proxy worker ever waits on Redis's socket
//! beyond its budget.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::METRICS;

/// Message ends a lookup asks about, the latest first: the previous turn's
/// prompt ends at one of the last few.
pub const LOOKUP_ENDS: usize = 16;
/// Placements waiting to be written; more are dropped (counted).
const WRITE_QUEUE: usize = 4096;
/// Writes sent in one pipeline.
const WRITE_BATCH: usize = 256;
/// Lookups waiting for the connection; more are answered "unavailable".
const LOOKUP_QUEUE: usize = 1024;
const KEY_PREFIX: &str = "prefix-router:";

/// Where Redis is and how it is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// `host:port`.
    pub addr: String,
    pub db: u32,
    pub password: Option<String>,
}

/// A `redis://[:PASSWORD@]HOST:PORT[/DB]` URL.
pub fn parse_url(url: &str) -> Result<RedisTarget, String> {
    let rest = url
        .strip_prefix("redis://")
        .ok_or("must start with redis://")?;
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let password = auth
        .map(|a| a.split_once(':').map_or(a, |(_, p)| p).to_owned())
        .filter(|p| !p.is_empty());
    let (addr, db) = match rest.split_once('/') {
        Some((addr, "")) => (addr, 0),
        Some((addr, db)) => (
            addr,
            db.parse()
                .map_err(|_| format!("database `{db}` is not a number"))?,
        ),
        None => (rest, 0),
    };
    let port_ok = addr
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if !port_ok {
        return Err(format!("`{addr}` is not HOST:PORT"));
    }
    Ok(RedisTarget {
        addr: addr.to_owned(),
        db,
        password,
    })
}

/// A placement to write: a prompt key and its replica's name.
type Write = (u64, String);
/// The receiving ends of the lookup and write queues.
type Queues = (mpsc::Receiver<Lookup>, mpsc::Receiver<Write>);

/// One lookup: the keys, longest prefix first, and where to answer.
struct Lookup {
    keys: Vec<u64>,
    answer: oneshot::Sender<Option<(usize, String)>>,
}

/// The router's handle on shared pins.
pub struct SharedPins {
    target: RedisTarget,
    budget: Duration,
    ttl_s: u64,
    lookups: mpsc::Sender<Lookup>,
    writes: mpsc::Sender<Write>,
    /// The receiving ends, taken by the background task when it starts.
    queues: Mutex<Option<Queues>>,
}

impl SharedPins {
    pub fn new(target: RedisTarget, budget: Duration, ttl_s: u64) -> Self {
        let (lookups, lookups_rx) = mpsc::channel(LOOKUP_QUEUE);
        let (writes, writes_rx) = mpsc::channel(WRITE_QUEUE);
        Self {
            target,
            budget,
            ttl_s,
            lookups,
            writes,
            queues: Mutex::new(Some((lookups_rx, writes_rx))),
        }
    }

    /// The longest of `keys` (each `(prefix length, key)`, longest first)
    /// another instance recorded, with its replica's name; `None` on a miss,
    /// or when Redis does not answer within the budget.
    pub async fn lookup(&self, keys: Vec<(usize, u64)>) -> Option<(usize, String)> {
        if keys.is_empty() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let ends: Vec<usize> = keys.iter().map(|(pos, _)| *pos).collect();
        let lookup = Lookup {
            keys: keys.into_iter().map(|(_, k)| k).collect(),
            answer: tx,
        };
        if self.lookups.try_send(lookup).is_err() {
            count("lookup", "unavailable");
            return None;
        }
        match tokio::time::timeout(self.budget, rx).await {
            Ok(Ok(Some((i, name)))) => {
                count("lookup", "hit");
                ends.get(i).map(|pos| (*pos, name))
            }
            Ok(Ok(None)) => {
                count("lookup", "miss");
                None
            }
            // The task answered nothing: Redis is down.
            Ok(Err(_)) => {
                count("lookup", "unavailable");
                None
            }
            Err(_) => {
                count("lookup", "timeout");
                None
            }
        }
    }

    /// Queues `keys` as held by `replica` (written in the background).
    pub fn record(&self, keys: &[u64], replica: &str) {
        for k in keys {
            if self.writes.try_send((*k, replica.to_owned())).is_err() {
                count("write", "dropped");
            }
        }
    }
}

fn count(op: &str, result: &str) {
    METRICS.shared_pins.with_label_values(&[op, result]).inc();
}

fn redis_key(k: u64) -> String {
    format!("{KEY_PREFIX}{k:016x}")
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
                    let keys: Vec<String> = l.keys.iter().map(|k| redis_key(*k)).collect();
                    let mut args: Vec<&[u8]> = vec![b"MGET"];
                    args.extend(keys.iter().map(|k| k.as_bytes()));
                    let mut out = Vec::new();
                    command(&mut out, &args);
                    io.get_mut().write_all(&out).await?;
                    let found = match reply(io).await? {
                        Reply::Array(items) => items.into_iter().enumerate().find_map(|(i, r)| match r {
                            Reply::Bulk(Some(name)) => String::from_utf8(name).ok().map(|n| (i, n)),
                            _ => None,
                        }),
                        _ => return Err(std::io::Error::other("MGET: not an array")),
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
                    for (k, name) in &batch {
                        let key = redis_key(*k);
                        command(&mut out, &[b"SET", key.as_bytes(), name.as_bytes(), b"EX", ttl.as_bytes()]);
                    }
                    io.get_mut().write_all(&out).await?;
                    for _ in &batch {
                        if reply(io).await? != Reply::Ok {
                            return Err(std::io::Error::other("SET: unexpected reply"));
                        }
                    }
                    METRICS.shared_pins.with_label_values(&["write", "ok"]).inc_by(batch.len() as u64);
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
                        Some(_) => count("write", "unavailable"),
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
    fn urls_name_host_port_database_and_password() {
        assert_eq!(
            parse_url("redis://127.0.0.1:6379/2"),
            Ok(RedisTarget {
                addr: "127.0.0.1:6379".into(),
                db: 2,
                password: None
            })
        );
        let t = parse_url("redis://:s3cret@redis.fleet:6380").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.db, t.password.as_deref()),
            ("redis.fleet:6380", 0, Some("s3cret"))
        );
        for bad in [
            "http://x:1",
            "redis://nohost",
            "redis://h:0/1",
            "redis://h:1/x",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        command(&mut out, &[b"MGET", b"a", b"bc"]);
        assert_eq!(out, b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$2\r\nbc\r\n");
    }
}
