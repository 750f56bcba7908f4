//! replica-sim: a simulated single-GPU OpenAI-compatible replica (vLLM-like).
//!
//! Routes: `POST /v1/chat/completions`, `/v1/completions`, `/v1/messages` (JSON or
//! SSE with `stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (vLLM metric names), and for tests `GET /sim/stats`, `POST /sim/health?ok=false`
//! (or `?delay_ms=N`: answer `/health` that late),
//! `POST /sim/reset` (empty the prefix cache), `POST /sim/cached` (a chat
//! body's cached prefix and prompt, and the prefill queued ahead, in tokens),
//! `POST /sim/accept?paused=true|false` (stop or resume accepting connections:
//! with a short `--backlog`, connects then time out as on an overloaded host;
//! resume over a connection opened before the pause).
//! Fault modes for tests: `--hang-after-requests`, `--close-after-requests`,
//! `--fail-after-requests`, `--stall-bodies-over`; `--id-log` records each request's `x-soak-id`.
//! Every completion response carries `x-sim-replica`, `x-sim-body-bytes` and
//! `x-sim-body-xxh3` (of the exact request body received).
//! It prints `listening on IP:PORT` once bound (use `--listen 127.0.0.1:0`).
//! With `--tokenizer DIR` chat prompts are the model's token ids; with
//! `--kv-events-port` the card publishes its KV events as vLLM does (see
//! `kv_events`; it prints `kv events on PUB_PORT REPLAY_PORT`).
//!   cargo run --release --bin replica-sim -- --listen 127.0.0.1:8001 --name gpu0
//!
//! The `replica-sim` binary of the root package runs [`main`].

mod answers;
mod dialect;
mod engine;
mod histogram;
mod kv_events;
mod serve;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};

use answers::*;
use dialect::Kind;
use engine::{Engine, EngineConfig, Event, SeqId};
use histogram::Histogram;

#[derive(Parser, Debug, Clone)]
#[command(about = "A simulated single-GPU OpenAI-compatible replica")]
struct Cli {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// Name reported in `x-sim-replica` and as the model's owner.
    #[arg(long, default_value = "sim")]
    name: String,
    /// The models served, comma-separated, listed by `GET /v1/models`; a
    /// request naming another answers 404 as vLLM does (`POST /sim/models`
    /// with a JSON list switches them at runtime).
    #[arg(long, default_value = "sim", value_delimiter = ',')]
    models: Vec<String>,
    /// KV cache capacity in tokens.
    #[arg(long, default_value_t = 122_636)]
    kv_tokens: u64,
    /// Tokens per KV block (prefix-cache granularity).
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// Bytes of prompt text per token (the token estimate).
    #[arg(long, default_value_t = 4)]
    bytes_per_token: u64,
    /// Prefill throughput, tokens per second (model time).
    #[arg(long, default_value_t = 33_300.0)]
    prefill_tps: f64,
    /// Decode steps per second for the whole batch (model time).
    #[arg(long, default_value_t = 50.0)]
    decode_tps: f64,
    /// Model seconds per cached token a prefill reuses (attention over it).
    #[arg(long, default_value_t = 1.2e-5)]
    reuse_s_per_token: f64,
    /// Token budget of one scheduler step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    chunk_tokens: u64,
    /// Model seconds per wall second: 10 runs ten times faster than a card.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// At most this many sequences run at once (vLLM's `--max-num-seqs`);
    /// others wait in the queue. Default: as many as the KV pool holds.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Completion tokens when the request does not say (`max_tokens`).
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u64,
    /// Answer /health with 503 for this long after start (a loading engine).
    #[arg(long, default_value_t = 0)]
    loading_ms: u64,
    /// Testing: close a keep-alive connection, unanswered, when its request
    /// number N+1 arrives (a server that closed an idle connection as the
    /// proxy reused it). 0 = never.
    #[arg(long, default_value_t = 0)]
    close_after_requests: u64,
    /// Testing: completion requests after the first N are received (counted in
    /// `received`) and never answered, while /health keeps passing (a hung engine).
    #[arg(long)]
    hang_after_requests: Option<u64>,
    /// Testing: completion requests after the first N are answered
    /// `--fail-status`.
    #[arg(long)]
    fail_after_requests: Option<u64>,
    /// Testing: the status of those failed answers.
    #[arg(long, default_value_t = 500)]
    fail_status: u16,
    /// Testing: a request declaring a body larger than this is never read (an
    /// engine that stopped reading): the sender's write stalls.
    #[arg(long)]
    stall_bodies_over: Option<u64>,
    /// Listen backlog (accept queue length).
    #[arg(long, default_value_t = 1024)]
    backlog: u32,
    /// The model's tokenizer directory (`tokenizer.json`,
    /// `tokenizer_config.json`): chat prompts are its token ids (else the
    /// text's length over `--bytes-per-token`).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// Publishes the card's KV events as vLLM does, on this port (the
    /// replay socket on the next; 0: any two, printed); needs `--tokenizer`.
    #[arg(long, requires = "tokenizer")]
    kv_events_port: Option<u16>,
    /// Requests to `/v1/` paths must carry `Authorization: Bearer <key>`,
    /// else 401 (as vLLM's `--api-key`; `/health` and `/metrics` are open).
    #[arg(long)]
    api_key: Option<String>,
    /// Appends the `x-soak-id` header of every completion request received,
    /// one per line (the soak counts duplicate deliveries across restarts).
    #[arg(long)]
    id_log: Option<std::path::PathBuf>,
}

struct Sim {
    cli: Cli,
    engine: Mutex<Engine>,
    /// Event channel of each request on the card.
    streams: Mutex<HashMap<SeqId, mpsc::UnboundedSender<Event>>>,
    /// Wakes the scheduler when a request arrives on an idle card.
    arrived: Notify,
    next_id: AtomicU64,
    healthy: AtomicBool,
    /// `/health` requests answered 503 (tests count the checks a replica failed).
    health_failed: AtomicU64,
    /// `/health` answers after this many milliseconds (a slow engine).
    health_delay_ms: AtomicU64,
    models: std::sync::Mutex<Vec<String>>,
    /// Responses API: stored responses (id -> the conversation's text so
    /// far, output included), as an engine keeps them for `previous_response_id`.
    responses: std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    next_response: AtomicU64,
    running: AtomicU64,
    cancelled: AtomicU64,
    /// Completion requests that arrived, answered or not.
    received: AtomicU64,
    /// Requests left unread by `--stall-bodies-over`.
    stalled: AtomicU64,
    accepting: tokio::sync::watch::Sender<bool>,
    id_log: Option<Mutex<std::fs::File>>,
    /// Model-time TTFT histogram (vllm:time_to_first_token_seconds).
    ttft: Mutex<Histogram>,
    /// The model's tokenizer (`--tokenizer`).
    tokens: Option<tokens::ModelTokens>,
}

/// A listener with the given accept-queue length.
fn listen(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Runs the simulator with the process's arguments until it is killed.
#[tokio::main]
pub async fn main() -> std::io::Result<()> {
    let cli = Cli::parse();
    let listener = listen(cli.listen, cli.backlog)?;
    println!("listening on {}", listener.local_addr()?);
    let loading = Duration::from_millis(cli.loading_ms);
    let sim = Arc::new(Sim {
        engine: Mutex::new(Engine::new(EngineConfig {
            kv_tokens: cli.kv_tokens,
            block_tokens: cli.block_tokens,
            bytes_per_token: cli.bytes_per_token,
            prefill_tps: cli.prefill_tps,
            decode_tps: cli.decode_tps,
            reuse_s_per_token: cli.reuse_s_per_token,
            chunk_tokens: cli.chunk_tokens,
            max_num_seqs: cli.max_num_seqs,
        })),
        streams: Mutex::new(HashMap::new()),
        arrived: Notify::new(),
        next_id: AtomicU64::new(0),
        healthy: AtomicBool::new(loading.is_zero()),
        health_failed: AtomicU64::new(0),
        health_delay_ms: AtomicU64::new(0),
        models: std::sync::Mutex::new(cli.models.clone()),
        responses: std::sync::Mutex::new(std::collections::HashMap::new()),
        next_response: AtomicU64::new(0),
        running: AtomicU64::new(0),
        cancelled: AtomicU64::new(0),
        received: AtomicU64::new(0),
        stalled: AtomicU64::new(0),
        accepting: tokio::sync::watch::Sender::new(true),
        id_log: match &cli.id_log {
            Some(p) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            )),
            None => None,
        },
        ttft: Mutex::new(Histogram::default()),
        tokens: match &cli.tokenizer {
            Some(dir) => Some(
                tokens::ModelTokens::load(dir, 4 << 20)
                    .map_err(|e| std::io::Error::other(e.to_string()))?,
            ),
            None => None,
        },
        cli,
    });
    tokio::spawn(Arc::clone(&sim).schedule());
    if let Some(port) = sim.cli.kv_events_port {
        sim.engine.lock().expect("engine lock").record_kv();
        let addr = SocketAddr::new(listener.local_addr()?.ip(), port);
        let sim = Arc::clone(&sim);
        tokio::spawn(async move {
            if let Err(e) = kv_events::serve(sim, addr).await {
                eprintln!("kv events: {e}");
                std::process::exit(1);
            }
        });
    }
    if !loading.is_zero() {
        let s = Arc::clone(&sim);
        tokio::spawn(async move {
            tokio::time::sleep(loading).await;
            s.healthy.store(true, Relaxed);
        });
    }
    let mut accepting = sim.accepting.subscribe();
    loop {
        // Paused: connections wait in the backlog, then SYNs are dropped.
        let _ = accepting.wait_for(|on| *on).await;
        // A pause also cancels the pending accept, so nothing is taken after it.
        let (stream, _) = tokio::select! {
            biased;
            _ = accepting.wait_for(|on| !*on) => continue,
            r = listener.accept() => r?,
        };
        // As uvicorn (vLLM) and SGLang's server do: without it, Nagle holds a
        // streamed token behind the response head until the client's delayed
        // ACK (~40 ms).
        let _ = stream.set_nodelay(true);
        let sim = Arc::clone(&sim);
        let served = Arc::new(AtomicU64::new(0));
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let sim = Arc::clone(&sim);
                let n = served.fetch_add(1, Relaxed);
                async move {
                    let declared = req
                        .headers()
                        .get("content-length")
                        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                    if let (Some(max), Some(n)) = (sim.cli.stall_bodies_over, declared) {
                        if n > max {
                            sim.stalled.fetch_add(1, Relaxed);
                            return std::future::pending().await;
                        }
                    }
                    let limit = sim.cli.close_after_requests;
                    if limit > 0 && n >= limit && req.uri().path() != "/health" {
                        sim.received.fetch_add(1, Relaxed);
                        return Err("closing a reused connection");
                    }
                    Ok(sim.handle(req).await)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}
