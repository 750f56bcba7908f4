//! The engines' KV-cache events (`kv_events` on a replica): a task per
//! replica follows its engine's publisher ([`follow`]), asking its replay
//! socket for lost batches ([`replay`]), and keeps what the engine holds in
//! an [`EngineBlocks`] (bounded by `max_blocks`). A background service
//! starts and stops the tasks as the replica set and their `kv_events`
//! change (reloads, DNS pools): checked every second.
//!
//! What the events drive: the blocks are the replica's (`engine_blocks`),
//! so a request whose model has a tokenizer is placed by what the engine
//! holds of its tokens (see `exact`); an engine whose cache was emptied (a
//! restart, `AllBlocksCleared`) has its prefixes forgotten by the router's
//! own index at once; the metrics show each replica's blocks and whether
//! its state is known.

mod follow;
mod replay;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::config::KvEvents;
use crate::kv::EngineBlocks;
use crate::metrics::Metrics;
use crate::policy::{Policy, ReplicaId};
use crate::replicas::Replicas;

pub use replay::{replay, ReplayError};

/// How often the set of followed replicas is brought up to date.
const RECONCILE: Duration = Duration::from_secs(1);

/// The background service that follows every replica's events.
pub struct KvEventsWatch {
    pub replicas: Arc<Replicas>,
    pub policy: Arc<Policy>,
    pub metrics: Arc<Metrics>,
}

/// A replica followed: by which config, its task and its blocks.
struct Followed {
    name: String,
    config: Arc<KvEvents>,
    task: tokio::task::JoinHandle<()>,
}

impl KvEventsWatch {
    /// Starts a task for each replica with `kv_events` not followed yet (or
    /// followed by another config, or whose task ended), stops those of
    /// replicas that left or dropped it (their series go once the task has).
    fn reconcile(&self, followed: &mut HashMap<ReplicaId, Followed>) {
        let list = self.replicas.snapshot();
        let wanted = |id: &ReplicaId, f: &Followed| {
            list.iter().any(|r| {
                r.id == *id && r.name == f.name && r.kv_events().is_some_and(|c| c == f.config)
            })
        };
        let gone: Vec<_> = followed.extract_if(|id, f| !wanted(id, f)).collect();
        for (id, f) in gone {
            f.task.abort();
            if let Some(r) = list.iter().find(|r| r.id == id) {
                r.follow_blocks(None);
            }
            let (metrics, replicas) = (Arc::clone(&self.metrics), Arc::clone(&self.replicas));
            tokio::spawn(async move {
                let _ = f.task.await;
                // Unless another config of the same replica is followed now.
                let list = replicas.snapshot();
                if !list
                    .iter()
                    .any(|r| r.name == f.name && r.kv_events().is_some())
                {
                    metrics.kv.forget(&f.name);
                }
            });
        }
        followed.retain(|_, f| !f.task.is_finished());
        for r in list.iter() {
            let Some(config) = r.kv_events() else {
                continue;
            };
            if followed.contains_key(&r.id) {
                continue;
            }
            let blocks = Arc::new(Mutex::new(EngineBlocks::new(config.max_blocks)));
            r.follow_blocks(Some(Arc::clone(&blocks)));
            self.metrics.kv.join(&r.name);
            let task = tokio::spawn(
                follow::Follow {
                    replica: Arc::clone(r),
                    config: Arc::clone(&config),
                    blocks,
                    policy: Arc::clone(&self.policy),
                    metrics: Arc::clone(&self.metrics),
                }
                .run(),
            );
            followed.insert(
                r.id,
                Followed {
                    name: r.name.clone(),
                    config,
                    task,
                },
            );
        }
    }
}

#[async_trait]
impl BackgroundService for KvEventsWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut followed = HashMap::new();
        let mut tick = tokio::time::interval(RECONCILE);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tick.tick() => self.reconcile(&mut followed),
            }
        }
        for f in followed.values() {
            f.task.abort();
        }
    }
}
