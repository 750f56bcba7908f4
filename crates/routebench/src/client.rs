//! A plain OpenAI client that times one streamed chat completion or Responses
//! API response: time to the first streamed token (TTFT) and to the end, with
//! what the response says about placement (`x-prefix-router-*` headers, when
//! present) and caching (`usage.prompt_tokens_details.cached_tokens`,
//! `input_tokens_details.cached_tokens`, or llama.cpp's `timings.cache_n`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::{connect::HttpConnector, Client as HyperClient};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

/// One timed request.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Sample {
    /// Scenario-defined labels: which conversation, which turn, which kind.
    pub group: String,
    pub turn: usize,
    /// Model seconds (wall seconds times the time scale).
    pub ttft_s: f64,
    pub total_s: f64,
    /// Seconds since the scenario started, model time.
    pub start_s: f64,
    pub status: u16,
    pub replica: String,
    pub decision: String,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// How an oracle arm chooses a simulated card for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oracle {
    /// The card holding the longest prefix of its prompt (`oracle`).
    Longest,
    /// The card where its prefill would end soonest: the least prompt
    /// queued there plus its own tokens not cached there, then the longest
    /// prefix (`oracle-soonest`).
    Soonest,
}

/// The endpoint and how to turn wall time into model time.
#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpConnector, Full<Bytes>>,
    /// Several (router instances behind an L4 balancer): each request goes
    /// to one of them at random.
    bases: Arc<Vec<String>>,
    /// xorshift state picking the base; seeded alike in every run.
    pick: Arc<AtomicU64>,
    /// The bases are replicas, and how each request chooses one of them
    /// (the oracle arms); `None`: at random.
    oracle: Option<Oracle>,
    pub model: String,
    /// Sent as `x-tenant` (`noisy-neighbour`: the router's `tenants.header`).
    pub tenant: Option<Arc<str>>,
    /// Model seconds per wall second (the simulators' `--time-scale`; 1 for real engines).
    pub scale: f64,
    pub epoch: Instant,
}

impl Client {
    pub fn new(base: &str, model: &str, scale: f64) -> Self {
        Self::spread(&[base.to_owned()], model, scale)
    }

    /// A client that sends each request to one of `bases` at random.
    pub fn spread(bases: &[String], model: &str, scale: f64) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            // Engines close idle keep-alive connections (llama.cpp after 5 s);
            // do not reuse one that may already be gone.
            http: HyperClient::builder(TokioExecutor::new())
                .pool_idle_timeout(std::time::Duration::from_secs(2))
                .build(connector),
            bases: Arc::new(
                bases
                    .iter()
                    .map(|b| b.trim_end_matches('/').to_owned())
                    .collect(),
            ),
            pick: Arc::new(AtomicU64::new(0x9e37_79b9_7f4a_7c15)),
            oracle: None,
            model: model.to_owned(),
            tenant: None,
            scale,
            epoch: Instant::now(),
        }
    }

    /// An oracle arm: no router; each request goes straight to a simulated
    /// replica chosen by what each holds and queues when it is sent (each is
    /// asked: `POST /sim/cached`) by `rule`, ties to one at random.
    pub fn oracle(replicas: &[String], model: &str, scale: f64, rule: Oracle) -> Self {
        let mut c = Self::spread(replicas, model, scale);
        c.oracle = Some(rule);
        c
    }

    /// The same endpoint, its requests naming `tenant` (header `x-tenant`).
    pub fn as_tenant(&self, tenant: &str) -> Self {
        let mut c = self.clone();
        c.tenant = Some(Arc::from(tenant));
        c
    }

    /// The next draw of the shared xorshift, below `n`.
    fn draw(&self, n: usize) -> usize {
        let mut x = self.pick.load(Relaxed);
        loop {
            let mut next = x;
            next ^= next << 13;
            next ^= next >> 7;
            next ^= next << 17;
            match self.pick.compare_exchange_weak(x, next, Relaxed, Relaxed) {
                Ok(_) => return (next % n.max(1) as u64) as usize,
                Err(now) => x = now,
            }
        }
    }

    /// The base URL of the next request with `body`.
    async fn base(&self, body: &Bytes) -> &str {
        let Some(rule) = self.oracle else {
            return &self.bases[self.draw(self.bases.len())];
        };
        let asks = self.bases.iter().map(|b| async move {
            let req = Request::post(format!("{b}/sim/cached"))
                .header("content-type", "application/json")
                .body(Full::new(body.clone()));
            // Lower is better: a card that does not answer ranks last.
            const LAST: (u64, u64) = (u64::MAX, u64::MAX);
            let Ok(req) = req else { return LAST };
            let Ok(resp) = self.http.request(req).await else {
                return LAST;
            };
            let Ok(bytes) = resp.into_body().collect().await else {
                return LAST;
            };
            let v: Value = serde_json::from_slice(&bytes.to_bytes()).unwrap_or_default();
            let n = |k: &str| v[k].as_u64().unwrap_or(0);
            let cached = n("cached_tokens");
            let first = match rule {
                Oracle::Longest => 0,
                // The prompt tokens its prefill waits for and computes there.
                Oracle::Soonest => n("queued_tokens") + n("prompt_tokens").saturating_sub(cached),
            };
            (first, u64::MAX - cached)
        });
        let ranks = join_all(asks).await;
        let best = ranks.iter().copied().min().unwrap_or_default();
        let tied: Vec<usize> = (0..ranks.len()).filter(|i| ranks[*i] == best).collect();
        &self.bases[tied[self.draw(tied.len())]]
    }

    /// POSTs an empty body to `path` of the first base (a simulator's
    /// test hook); whether it answered 2xx.
    pub async fn post_hook(&self, path: &str) -> bool {
        let req = Request::post(format!("{}{path}", self.bases[0])).body(Full::new(Bytes::new()));
        match req {
            Ok(r) => self
                .http
                .request(r)
                .await
                .is_ok_and(|r| r.status().is_success()),
            Err(_) => false,
        }
    }

    /// Model seconds since `epoch`.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * self.scale
    }

    /// Streams `/v1/chat/completions` for `messages` and times it.
    pub async fn chat(
        &self,
        group: &str,
        turn: usize,
        messages: &[Value],
        max_tokens: u64,
    ) -> Sample {
        let body = json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let (mut s, events) = self
            .stream("/v1/chat/completions", body, group, turn, b"data:")
            .await;
        for v in events {
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                s.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                s.cached_tokens = u
                    .pointer("/prompt_tokens_details/cached_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
            }
            if let Some(n) = v.pointer("/timings/cache_n").and_then(Value::as_u64) {
                s.cached_tokens = s.cached_tokens.max(n);
            }
        }
        s
    }

    /// Streams `/v1/responses` (`input` items, continuing `previous` when
    /// given) and times it to the first output text; also the response's id.
    pub async fn responses(
        &self,
        group: &str,
        turn: usize,
        instructions: Option<&str>,
        input: &[Value],
        previous: Option<&str>,
        max_tokens: u64,
    ) -> (Sample, Option<String>) {
        let mut body = json!({
            "model": self.model,
            "input": input,
            "max_output_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
        });
        if let Some(i) = instructions {
            body["instructions"] = json!(i);
        }
        if let Some(p) = previous {
            body["previous_response_id"] = json!(p);
        }
        let (mut s, events) = self
            .stream("/v1/responses", body, group, turn, b"output_text.delta")
            .await;
        let mut id = None;
        for v in events {
            if let Some(r) = v.get("response") {
                id = id.or_else(|| r["id"].as_str().map(str::to_owned));
                if let Some(u) = r.get("usage").filter(|u| !u.is_null()) {
                    s.prompt_tokens = u["input_tokens"].as_u64().unwrap_or(0);
                    s.cached_tokens = u
                        .pointer("/input_tokens_details/cached_tokens")
                        .and_then(Value::as_u64)
                        .unwrap_or(0);
                }
            }
        }
        (s, id)
    }

    /// POSTs `body` to `path` as a stream and times it: TTFT when `first`
    /// first appears in the body; the `data:` events parsed as JSON.
    async fn stream(
        &self,
        path: &str,
        body: Value,
        group: &str,
        turn: usize,
        first: &[u8],
    ) -> (Sample, Vec<Value>) {
        let mut s = Sample {
            group: group.to_owned(),
            turn,
            start_s: self.now(),
            ..Sample::default()
        };
        let body = Bytes::from(body.to_string());
        let base = self.base(&body).await;
        let send = || {
            let mut req =
                Request::post(format!("{base}{path}")).header("content-type", "application/json");
            if let Some(t) = &self.tenant {
                req = req.header("x-tenant", &**t);
            }
            let req = req.body(Full::new(body.clone()));
            async move {
                match req {
                    Ok(r) => self.http.request(r).await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        let mut started = Instant::now();
        let mut resp = send().await;
        if let Err(e) = &resp {
            // No response at all (e.g. a connection closed as it was reused): once more.
            log::warn!("request failed, retrying once: {e}");
            started = Instant::now();
            resp = send().await;
        }
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                log::warn!("request failed: {e}");
                return (s, Vec::new());
            }
        };
        s.status = resp.status().as_u16();
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        s.replica = header("x-prefix-router-replica");
        s.decision = header("x-prefix-router-decision");
        if self.oracle.is_some() {
            (s.replica, s.decision) = (header("x-sim-replica"), "oracle".to_owned());
        }
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            if s.ttft_s == 0.0 && data.windows(first.len()).any(|w| w == first) {
                s.ttft_s = started.elapsed().as_secs_f64() * self.scale;
            }
            buf.extend_from_slice(data);
        }
        s.total_s = started.elapsed().as_secs_f64() * self.scale;
        let events = String::from_utf8_lossy(&buf)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l.strip_prefix("data: ")?).ok())
            .collect();
        (s, events)
    }
}

/// Runs futures concurrently on this task and returns their outputs in order.
pub async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let handles: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = handles.iter().map(|_| None).collect();
    let mut pending: Vec<_> = handles.into_iter().enumerate().collect();
    std::future::poll_fn(|cx| {
        pending.retain_mut(|(i, f)| match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => {
                outputs[*i] = Some(v);
                false
            }
            std::task::Poll::Pending => true,
        });
        if pending.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}
