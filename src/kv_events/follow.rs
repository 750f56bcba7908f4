//! One replica's KV event stream: a ZMQ SUB socket on its engine's
//! publisher (multipart `[topic, seq, payload]`, `seq` 8 bytes big-endian
//! from 0 per engine process, `payload` a msgpack batch), read in sequence.
//!
//! - the next `seq`: the batch is applied, unless it is the first read
//!   since the socket was opened again (the engine may have restarted
//!   meanwhile and published as many batches as the last one read's
//!   number): then it is taken as a gap;
//! - a later one: batches were lost; they are asked for at the replay
//!   socket from the last one read, which must come back as it was read
//!   (else the engine restarted meanwhile); without a replay socket the
//!   replica's state is unknown;
//! - an earlier one: a new engine process (a restart: its cache starts
//!   empty), and batches it published before this one are asked for;
//! - the first batch heard: from 0 the engine's whole history is here,
//!   else the earlier ones are asked for (a router joining a running
//!   engine; not when it is past what an engine keeps for replay).
//!
//! An emptied cache (`AllBlocksCleared` read live or after a known state, a
//! restart) also makes the router's own index forget the replica's prefixes
//! at once (`Repair::Events`), instead of after a failed health check or a
//! miss; an old clear read in a replay of the engine's first batches (SGLang
//! clears at start) does not. A socket that fails, whose publisher closes
//! the connection (an engine restarting: the socket library's own
//! reconnection, backing off to 30 s, was seen not to hear the new process
//! for over a minute), or whose replica fails its health checks (ZMTP has
//! no heartbeat, so a host gone silently would hold a dead connection), is
//! opened again after a pause (1 s doubling to 10 s); the sequence carries
//! over, so batches lost meanwhile are asked for too. A message of another
//! topic or shape is skipped and counted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket};

use super::replay::{replay, CONNECT_TIMEOUT, MAX_MESSAGE};
use crate::config::KvEvents;
use crate::kv::{Batch, CacheState, EngineBlocks};
use crate::metrics::{KvOutcome, Metrics, Repair};
use crate::policy::Policy;
use crate::replicas::Replica;

const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// How often an open socket's replica is checked for failing health checks.
const DOWN_CHECK: Duration = Duration::from_secs(1);
/// Batches an engine keeps for replay (vLLM's `buffer_steps` default): a
/// first batch heard past it cannot be caught up from 0.
const REPLAY_KEPT: u64 = 10_000;

pub(super) struct Follow {
    pub replica: Arc<Replica>,
    pub config: Arc<KvEvents>,
    pub blocks: Arc<Mutex<EngineBlocks>>,
    pub policy: Arc<Policy>,
    pub metrics: Arc<Metrics>,
}

/// The last batch read: its `seq` and its payload's hash.
#[derive(Clone, Copy)]
struct Last {
    seq: u64,
    hash: u64,
}

impl Follow {
    pub async fn run(self) {
        let endpoint = KvEvents::resolve(&self.config.endpoint, self.replica.addr);
        if self.config.replay_endpoint.is_none() {
            log::warn!(
                "replica {}: kv_events has no replay_endpoint: after a lost batch or a \
                 reconnect its cache state is unknown until its engine's cache is next emptied",
                self.replica.name
            );
        }
        let mut last = None;
        let mut pause = RETRY_FIRST;
        let mut failing = false;
        loop {
            let Err(e) = self.session(&endpoint, &mut last, &mut failing).await;
            if !failing {
                // It was connected (or never tried): logged once per outage.
                log::warn!(
                    "replica {}: KV events from {endpoint}: {e}; retrying",
                    self.replica.name
                );
                failing = true;
                pause = RETRY_FIRST;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_MAX);
        }
    }

    /// One socket's life: connects, then reads until it fails.
    async fn session(
        &self,
        endpoint: &str,
        last: &mut Option<Last>,
        failing: &mut bool,
    ) -> Result<std::convert::Infallible, String> {
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        options.max_message_size(MAX_MESSAGE);
        let mut sub = SubSocket::with_options(options);
        let mut events = sub.monitor();
        sub.connect(endpoint).await.map_err(|e| e.to_string())?;
        (sub.subscribe(&self.config.topic).await).map_err(|e| e.to_string())?;
        if std::mem::take(failing) {
            log::info!(
                "replica {}: KV events from {endpoint} readable again",
                self.replica.name
            );
        }
        let mut check = tokio::time::interval(DOWN_CHECK);
        // The connection was lost since the last batch read.
        let mut resumed = last.is_some();
        loop {
            let message = tokio::select! {
                m = sub.recv() => m.map_err(|e| e.to_string())?,
                event = events.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        return Err("the publisher closed the connection".into());
                    }
                    Some(_) => continue,
                },
                _ = check.tick() => {
                    if self.replica.has_been_checked() && !self.replica.checked() {
                        return Err("its health checks fail".into());
                    }
                    continue;
                }
            };
            // `[topic, seq, payload]`, the topic exactly the one asked for
            // (ZMQ matches subscriptions by prefix).
            let frames = (message.len() == 3)
                .then(|| (message.get(0), message.get(1), message.get(2)))
                .and_then(|(t, s, p)| Some((t?, <[u8; 8]>::try_from(s?.as_ref()).ok()?, p?)));
            match frames {
                Some((topic, seq, payload))
                    if self.config.topic.is_empty()
                        || topic.as_ref() == self.config.topic.as_bytes() =>
                {
                    let seq = u64::from_be_bytes(seq);
                    let resumed = std::mem::take(&mut resumed);
                    self.receive(last, seq, payload.clone(), resumed).await;
                }
                _ => self
                    .metrics
                    .kv
                    .batch(&self.replica.name, KvOutcome::Skipped),
            }
        }
    }

    /// Batch `seq` arrived after `last` (`resumed`: the first on a socket
    /// opened again since).
    async fn receive(&self, last: &mut Option<Last>, seq: u64, payload: Bytes, resumed: bool) {
        let hash = xxhash_rust::xxh3::xxh3_64(&payload);
        let prev = last.replace(Last { seq, hash });
        let forget = match prev {
            Some(l) if seq == l.seq.wrapping_add(1) && !resumed => true,
            Some(l) if seq > l.seq => self.fill_gap(l, seq).await,
            Some(_) => {
                // A new engine process: its cache starts empty.
                self.emptied(true);
                self.catch_up(seq).await;
                true
            }
            None if seq > REPLAY_KEPT => {
                self.unknown(KvOutcome::Lost);
                true
            }
            None => {
                self.catch_up(seq).await;
                true
            }
        };
        self.apply(&payload, KvOutcome::Applied, forget);
    }

    /// Batches after `l` up to `seq` were lost: asked for from `l` itself,
    /// which must come back as it was read, else the engine restarted
    /// meanwhile. Returns whether a clear read now empties the router's
    /// own index.
    async fn fill_gap(&self, l: Last, seq: u64) -> bool {
        let Some(batches) = self.replayed(l.seq, seq).await else {
            self.unknown(KvOutcome::Lost);
            return true;
        };
        if batches.first().map(|b| xxhash_rust::xxh3::xxh3_64(b)) != Some(l.hash) {
            self.emptied(true);
            self.catch_up(seq).await;
            return true;
        }
        let known = self.lock().sync() == CacheState::Known;
        for payload in &batches[1..] {
            self.apply(payload, KvOutcome::Replayed, known);
        }
        true
    }

    /// The engine's batches `0..upto` were not read: from the replay
    /// socket, in order and complete (the engine's cache was empty before
    /// batch 0), or the replica's state is unknown.
    async fn catch_up(&self, upto: u64) {
        if upto == 0 {
            self.lock().start_empty();
            return;
        }
        let Some(batches) = self.replayed(0, upto).await else {
            self.unknown(KvOutcome::Lost);
            return;
        };
        self.lock().start_empty();
        for payload in batches {
            // A clear among the engine's first batches is history.
            self.apply(&payload, KvOutcome::Replayed, false);
        }
    }

    /// Batches `from..upto` from the replay socket, if there is one and it
    /// still holds them all.
    async fn replayed(&self, from: u64, upto: u64) -> Option<Vec<Bytes>> {
        let endpoint = KvEvents::resolve(self.config.replay_endpoint.as_ref()?, self.replica.addr);
        match replay(&endpoint, from, upto).await {
            Ok(batches) => Some(batches),
            Err(e) => {
                log::warn!(
                    "replica {}: KV event batches {from}..{upto} not replayed from {endpoint}: {e}",
                    self.replica.name
                );
                None
            }
        }
    }

    /// Applies one batch's events; `forget`: a clear among them empties the
    /// router's own index for the replica.
    fn apply(&self, payload: &[u8], outcome: KvOutcome, forget: bool) {
        let Ok(batch) = rmp_serde::from_slice::<Batch>(payload) else {
            self.unknown(KvOutcome::Undecodable);
            return;
        };
        let mut total = crate::kv::Applied::default();
        {
            let mut blocks = self.lock();
            for event in &batch.events {
                total += blocks.apply(event);
            }
        }
        let name = &self.replica.name;
        self.metrics.kv.batch(name, outcome);
        self.metrics.kv.blocks_changed(name, &total);
        if total.overflowed {
            self.metrics.kv.batch(name, KvOutcome::Overflowed);
            log::warn!(
                "replica {name}: its engine holds more than kv_events.max_blocks ({}) blocks: its \
                 cache state is unknown until the engine's cache is next emptied",
                self.config.max_blocks
            );
        }
        if total.cleared {
            // Forgotten before it is counted: a client that sees the reset
            // finds its conversations unpinned.
            if forget {
                self.forget();
            }
            self.metrics.kv.reset(name, false);
        }
        self.publish();
    }

    /// The engine's cache is empty (`restart`: a new process; else it said
    /// so): the router's own index forgets what it placed there.
    fn emptied(&self, restart: bool) {
        self.forget();
        self.metrics.kv.reset(&self.replica.name, restart);
    }

    fn forget(&self) {
        let forgotten = self.policy.forget_replica(self.replica.id);
        self.metrics
            .repaired(&self.replica.name, Repair::Events, forgotten);
    }

    /// Events were lost (`why`): the replica's state is unknown.
    fn unknown(&self, why: KvOutcome) {
        self.lock().lose();
        self.metrics.kv.batch(&self.replica.name, why);
        self.publish();
    }

    fn publish(&self) {
        let blocks = self.lock();
        self.metrics.kv.state(
            &self.replica.name,
            blocks.len(),
            blocks.sync() == CacheState::Known,
            blocks.heap_bytes(),
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EngineBlocks> {
        self.blocks.lock().unwrap_or_else(|p| p.into_inner())
    }
}
