//! One replica's KV event stream: a ZMQ SUB socket on its engine's
//! publisher (multipart `[topic, seq, payload]`, `seq` 8 bytes big-endian
//! from 0 per engine process, `payload` a msgpack batch), read in sequence.
//!
//! - the next `seq`: the batch is applied;
//! - a later one: batches were lost; they are asked for at the replay
//!   socket when there is one, else the replica's state is unknown;
//! - an earlier one: a new engine process (a restart: its cache starts
//!   empty), and batches it published before this one are asked for;
//! - the first batch heard: from 0 the engine's whole history is here,
//!   else the earlier ones are asked for (a router joining a running engine).
//!
//! An emptied cache (`AllBlocksCleared`, a restart) also makes the router's
//! own index forget the replica's prefixes at once (`Repair::Events`),
//! instead of after a failed health check or a miss. A socket that fails,
//! or whose replica fails its health checks (ZMTP has no heartbeat, so a
//! host gone silently would hold a dead connection), is opened again after
//! a pause (1 s doubling to 10 s); the sequence carries over, so batches
//! lost meanwhile are asked for too.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use zeromq::{Socket, SocketOptions, SocketRecv, SubSocket};

use super::replay::{replay, CONNECT_TIMEOUT};
use crate::config::KvEvents;
use crate::kv::{Batch, CacheState, EngineBlocks, Event};
use crate::metrics::{KvOutcome, Metrics, Repair};
use crate::policy::Policy;
use crate::replicas::Replica;

const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// How often an open socket's replica is checked for failing health checks.
const DOWN_CHECK: Duration = Duration::from_secs(1);

pub(super) struct Follow {
    pub replica: Arc<Replica>,
    pub config: Arc<KvEvents>,
    pub blocks: Arc<Mutex<EngineBlocks>>,
    pub policy: Arc<Policy>,
    pub metrics: Arc<Metrics>,
}

impl Follow {
    pub async fn run(self) {
        let endpoint = KvEvents::resolve(&self.config.endpoint, self.replica.addr);
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
        last: &mut Option<u64>,
        failing: &mut bool,
    ) -> Result<std::convert::Infallible, String> {
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_TIMEOUT);
        let mut sub = SubSocket::with_options(options);
        sub.connect(endpoint).await.map_err(|e| e.to_string())?;
        (sub.subscribe(&self.config.topic).await).map_err(|e| e.to_string())?;
        if std::mem::take(failing) {
            log::info!(
                "replica {}: KV events from {endpoint} readable again",
                self.replica.name
            );
        }
        let mut check = tokio::time::interval(DOWN_CHECK);
        loop {
            let message = tokio::select! {
                m = sub.recv() => m.map_err(|e| e.to_string())?,
                _ = check.tick() => {
                    // ZMTP has no heartbeat here: an engine host gone
                    // silently would hold a dead connection for ever. Its
                    // failing health checks end it; a new one is opened.
                    if self.replica.has_been_checked() && !self.replica.checked() {
                        return Err("its health checks fail".into());
                    }
                    continue;
                }
            };
            let n = message.len();
            let seq = (n >= 2)
                .then(|| message.get(n - 2))
                .flatten()
                .and_then(|s| <[u8; 8]>::try_from(s.as_ref()).ok())
                .map(u64::from_be_bytes);
            let (Some(seq), Some(payload)) = (seq, message.get(n.wrapping_sub(1))) else {
                self.undecodable();
                continue;
            };
            self.receive(last, seq, payload.clone()).await;
        }
    }

    /// Batch `seq` arrived after `last`.
    async fn receive(&self, last: &mut Option<u64>, seq: u64, payload: Bytes) {
        let missing_from = match *last {
            Some(l) if seq == l.wrapping_add(1) => None,
            Some(l) if seq > l => Some(l + 1),
            Some(_) => {
                // A new engine process: its cache starts empty.
                self.emptied(true);
                Some(0)
            }
            None => Some(0),
        };
        *last = Some(seq);
        if let Some(from) = missing_from {
            self.catch_up(from, seq).await;
        }
        self.apply(&payload, KvOutcome::Applied);
    }

    /// Batches `from..upto` were not read: from the replay socket, in
    /// order and complete, or the replica's state is unknown.
    async fn catch_up(&self, from: u64, upto: u64) {
        if from == upto {
            // From the engine's first batch: its cache was empty before it.
            self.lock().start_empty();
            return;
        }
        let got = match &self.config.replay_endpoint {
            Some(e) => {
                let endpoint = KvEvents::resolve(e, self.replica.addr);
                match replay(&endpoint, from, upto).await {
                    Ok(batches) => Some(batches),
                    Err(e) => {
                        log::warn!(
                            "replica {}: KV event batches {from}..{upto} lost, and not replayed \
                             from {endpoint}: {e}",
                            self.replica.name
                        );
                        None
                    }
                }
            }
            None => None,
        };
        let Some(batches) = got else {
            self.lock().lose();
            self.metrics.kv.batch(&self.replica.name, KvOutcome::Lost);
            self.publish();
            return;
        };
        if from == 0 {
            self.lock().start_empty();
        }
        for payload in batches {
            self.apply(&payload, KvOutcome::Replayed);
        }
    }

    /// Applies one batch's events.
    fn apply(&self, payload: &[u8], outcome: KvOutcome) {
        let Ok(batch) = rmp_serde::from_slice::<Batch>(payload) else {
            self.undecodable();
            return;
        };
        let (mut stored, mut removed, mut orphaned, mut cleared) = (0, 0, 0, false);
        {
            let mut blocks = self.lock();
            for event in &batch.events {
                let done = blocks.apply(event);
                stored += done.stored;
                removed += done.removed;
                orphaned += done.orphans;
                cleared |= matches!(event, Event::Cleared);
            }
        }
        let name = &self.replica.name;
        self.metrics.kv.batch(name, outcome);
        self.metrics
            .kv
            .blocks_changed(name, stored, removed, orphaned);
        if cleared {
            self.emptied(false);
        }
        self.publish();
    }

    /// The engine's cache is empty (`restart`: a new process; else it said
    /// so): the router's own index forgets what it placed there.
    fn emptied(&self, restart: bool) {
        self.metrics.kv.reset(&self.replica.name, restart);
        let forgotten = self.policy.forget_replica(self.replica.id);
        if forgotten > 0 {
            self.metrics
                .repaired(&self.replica.name, Repair::Events, forgotten);
        }
    }

    fn undecodable(&self) {
        self.lock().lose();
        (self.metrics.kv).batch(&self.replica.name, KvOutcome::Undecodable);
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
