//! `routebench stubs`: many lightweight replicas in one process, for
//! `make bench-scale`. Each of N ports answers what the router (and SMG) ask
//! a replica: `GET /health`, `GET /v1/models` (one model), `GET /metrics` in
//! vLLM's format (its in-flight count as `vllm:num_requests_running`), and
//! `POST /v1/chat/completions` with a fixed small answer (after `--delay-ms`,
//! a prefill's time that keeps many requests in flight), or, when the body
//! asks for `"stream": true`, a stream of `--events` SSE chunks `--gap-ms`
//! apart (a slow decode that holds the stream open). Nothing is simulated:
//! the stubs cost as little as an answer can, so the router's cost is what a
//! curve shows. The ports are printed one per line on stdout once all listen.

use std::convert::Infallible;
use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, Infallible>;

#[derive(clap::Args)]
pub struct StubArgs {
    /// How many replicas (ports) to serve.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// The one model `/v1/models` lists.
    #[arg(long, default_value = "bench")]
    model: String,
    /// SSE chunks in a streamed answer.
    #[arg(long, default_value_t = 4)]
    events: u32,
    /// Milliseconds between a streamed answer's chunks (the first goes at once).
    #[arg(long, default_value_t = 0)]
    gap_ms: u64,
    /// Milliseconds before a whole (not streamed) answer.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
}

struct Stubs {
    models: Bytes,
    events: u32,
    gap: Duration,
    delay: Duration,
    /// Requests in flight, per port (read by `/metrics`).
    running: Vec<AtomicU64>,
}

const ANSWER: &str = r#"{"id":"chatcmpl-stub","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
const CHUNK: &[u8] = br#"data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,"model":"bench","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}"#;

/// Serves `args.replicas` ports until killed.
pub async fn stubs(args: StubArgs) -> Result<()> {
    let mut listeners = Vec::with_capacity(args.replicas);
    for _ in 0..args.replicas {
        listeners.push(
            TcpListener::bind("127.0.0.1:0")
                .await
                .context("binding a stub port")?,
        );
    }
    let models = serde_json::json!({"object": "list", "data": [
        {"id": args.model, "object": "model", "owned_by": "stub"}]});
    let stubs = Arc::new(Stubs {
        models: Bytes::from(models.to_string()),
        events: args.events,
        gap: Duration::from_millis(args.gap_ms),
        delay: Duration::from_millis(args.delay_ms),
        running: (0..args.replicas).map(|_| AtomicU64::new(0)).collect(),
    });
    let mut out = std::io::stdout().lock();
    for l in &listeners {
        writeln!(out, "{}", l.local_addr()?.port())?;
    }
    out.flush()?;
    drop(out);
    let mut tasks = tokio::task::JoinSet::new();
    for (port, listener) in listeners.into_iter().enumerate() {
        tasks.spawn(accept(listener, port, Arc::clone(&stubs)));
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

async fn accept(listener: TcpListener, port: usize, stubs: Arc<Stubs>) -> Result<()> {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            // Out of descriptors: the run's client sees the refusal, the
            // stubs keep serving the connections they have.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let stubs = Arc::clone(&stubs);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let stubs = Arc::clone(&stubs);
                async move { Ok::<_, Infallible>(stubs.answer(port, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

impl Stubs {
    async fn answer(self: Arc<Self>, port: usize, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return full(StatusCode::BAD_REQUEST, "text/plain", ""),
        };
        match (&parts.method, parts.uri.path()) {
            (&Method::GET, "/health") => full(StatusCode::OK, "text/plain", ""),
            (&Method::GET, "/v1/models") => {
                full(StatusCode::OK, "application/json", self.models.clone())
            }
            (&Method::GET, "/metrics") => {
                let running = self.running[port].load(Relaxed);
                let page = format!(
                    "# TYPE vllm:num_requests_running gauge\n\
                     vllm:num_requests_running{{engine=\"0\",model_name=\"bench\"}} {running}.0\n\
                     # TYPE vllm:num_requests_waiting gauge\n\
                     vllm:num_requests_waiting{{engine=\"0\",model_name=\"bench\"}} 0.0\n\
                     # TYPE vllm:kv_cache_usage_perc gauge\n\
                     vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"bench\"}} 0.0\n"
                );
                full(StatusCode::OK, "text/plain; version=0.0.4", page)
            }
            (&Method::POST, "/v1/chat/completions") => {
                if asks_stream(&body) {
                    let mut r = Response::new(
                        Stream {
                            left: self.events,
                            tick: (!self.gap.is_zero()).then(|| tokio::time::interval(self.gap)),
                            _running: Running::new(Arc::clone(&self), port),
                        }
                        .boxed(),
                    );
                    r.headers_mut()
                        .insert("content-type", "text/event-stream".parse().expect("static"));
                    r
                } else {
                    if !self.delay.is_zero() {
                        let _running = Running::new(Arc::clone(&self), port);
                        tokio::time::sleep(self.delay).await;
                    }
                    full(StatusCode::OK, "application/json", ANSWER)
                }
            }
            _ => full(
                StatusCode::NOT_FOUND,
                "application/json",
                r#"{"error":{"message":"not found","type":"invalid_request_error","code":404}}"#,
            ),
        }
    }
}

/// `"stream": true` anywhere in the body (the stubs parse nothing).
fn asks_stream(body: &[u8]) -> bool {
    let Some(at) = body.windows(8).position(|w| w == b"\"stream\"") else {
        return false;
    };
    let rest = &body[at + 8..];
    let rest = rest
        .iter()
        .skip_while(|b| matches!(b, b' ' | b':'))
        .copied();
    rest.take(4).eq(b"true".iter().copied())
}

/// Counts a stream in its port's `running` while it lives.
struct Running {
    stubs: Arc<Stubs>,
    port: usize,
}

impl Running {
    fn new(stubs: Arc<Stubs>, port: usize) -> Self {
        stubs.running[port].fetch_add(1, Relaxed);
        Self { stubs, port }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stubs.running[self.port].fetch_sub(1, Relaxed);
    }
}

/// A streamed answer: `left` chunks on `tick`'s beat, then `[DONE]`.
struct Stream {
    left: u32,
    tick: Option<tokio::time::Interval>,
    _running: Running,
}

impl hyper::body::Body for Stream {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == u32::MAX {
            return Poll::Ready(None);
        }
        if let Some(tick) = self.tick.as_mut() {
            if tick.poll_tick(cx).is_pending() {
                return Poll::Pending;
            }
        }
        let frame = if self.left == 0 {
            self.left = u32::MAX;
            Bytes::from_static(b"data: [DONE]\n\n")
        } else {
            self.left -= 1;
            let mut b = Vec::with_capacity(CHUNK.len() + 2);
            b.extend_from_slice(CHUNK);
            b.extend_from_slice(b"\n\n");
            Bytes::from(b)
        };
        Poll::Ready(Some(Ok(Frame::data(frame))))
    }
}

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_asked_for_only_by_stream_true() {
        assert!(asks_stream(
            br#"{"model":"bench","stream": true,"messages":[]}"#
        ));
        assert!(asks_stream(br#"{"stream":true}"#));
        assert!(!asks_stream(
            br#"{"stream":false,"messages":[{"content":"true"}]}"#
        ));
        assert!(!asks_stream(br#"{"messages":[]}"#));
    }
}
