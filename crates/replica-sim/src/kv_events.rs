//! The card's KV events, published as vLLM publishes them
//! (`--kv-events-port`, with `--tokenizer`): a ZMQ PUB socket sending
//! `[topic, seq, payload]` (seq 8 bytes big-endian from 0, payload a msgpack
//! `EventBatch` `[ts, events, null]` of tagged maps: `BlockStored`,
//! `BlockRemoved`), and a ROUTER replay socket (the next port) answering
//! `["", start_seq]` with every batch it keeps from there
//! (`["", topic, seq, payload]`) and an end marker whose seq is -1. The
//! engine's changes are gathered every [`TICK`] into one batch; the last
//! [`KEPT`] batches are kept for replay (vLLM's default buffer). Prompts the
//! `tokens` crate does not render as the engine would (a `cache_salt`,
//! images) are cached by their text, not their tokens, and not published.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::KvChange;
use crate::Sim;

/// The topic every batch is sent under.
pub const TOPIC: &str = "kv-events";
/// How often the engine's changes are published.
const TICK: Duration = Duration::from_millis(10);
/// Batches kept for replay.
const KEPT: usize = 10_000;

type Kept = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds both sockets on `addr`'s host (its port and the next; 0: any two),
/// prints `kv events on PUB_PORT REPLAY_PORT`, and serves them for ever.
pub(crate) async fn serve(sim: Arc<Sim>, addr: SocketAddr) -> zeromq::ZmqResult<()> {
    let host = addr.ip();
    let mut publisher = PubSocket::new();
    let bound = publisher.bind(&format!("tcp://{addr}")).await?;
    let mut replay = RouterSocket::new();
    let replay_port = match addr.port() {
        0 => 0,
        p => p
            .checked_add(1)
            .ok_or(zeromq::ZmqError::Other("no port after 65535"))?,
    };
    let replay_bound = replay.bind(&format!("tcp://{host}:{replay_port}")).await?;
    println!("kv events on {} {}", port(&bound), port(&replay_bound));
    let kept: Kept = Arc::default();
    tokio::spawn(answer(replay, Arc::clone(&kept)));
    let mut seq = 0u64;
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        let changes = sim.engine.lock().expect("engine lock").take_kv();
        if changes.is_empty() {
            continue;
        }
        let payload = Bytes::from(batch(&changes, sim.cli.block_tokens));
        {
            let mut kept = kept.lock().expect("kept lock");
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back((seq, payload.clone()));
        }
        let mut msg = ZmqMessage::from(TOPIC);
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        publisher.send(msg).await?;
        seq += 1;
    }
}

fn port(e: &zeromq::Endpoint) -> u16 {
    match e {
        zeromq::Endpoint::Tcp(_, p) => *p,
        _ => 0,
    }
}

/// Answers replay requests from the batches kept.
async fn answer(mut socket: RouterSocket, kept: Kept) {
    while let Ok(ask) = socket.recv().await {
        let frames = ask.into_vec();
        let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let start = <[u8; 8]>::try_from(start.as_ref()).map_or(u64::MAX, u64::from_be_bytes);
        let batches: Vec<(u64, Bytes)> = (kept.lock().expect("kept lock").iter())
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let end = (u64::MAX, Bytes::new());
        for (seq, payload) in batches.into_iter().chain([end]) {
            let topic = if payload.is_empty() { "" } else { TOPIC };
            let frames = vec![
                id.clone(),
                Bytes::new(),
                Bytes::from(topic),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            let Ok(msg) = ZmqMessage::try_from(frames) else {
                break;
            };
            if socket.send(msg).await.is_err() {
                break;
            }
        }
    }
}

/// One `EventBatch`, msgpack-encoded.
fn batch(changes: &[KvChange], block_tokens: u64) -> Vec<u8> {
    let events: Vec<Value> = changes
        .iter()
        .map(|c| match c {
            KvChange::Stored {
                hashes,
                parent,
                tokens,
            } => json!({"type": "BlockStored", "block_hashes": hashes,
                "parent_block_hash": parent, "token_ids": tokens,
                "block_size": block_tokens, "medium": "GPU"}),
            KvChange::Removed(hashes) => {
                json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
            }
            KvChange::Cleared => json!({"type": "AllBlocksCleared"}),
        })
        .collect();
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    rmp_serde::to_vec(&json!([ts, events, null])).unwrap_or_default()
}
