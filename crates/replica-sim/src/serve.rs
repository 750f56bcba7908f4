//! Serving one request: routes, the engine's events to JSON or SSE, fault
//! modes, and a request's life on the simulated card.

use super::*;

impl Sim {
    pub(crate) async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_owned();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        if let (Some(key), true) = (&self.cli.api_key, path.starts_with("/v1/")) {
            let presented = parts
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            if presented != Some(format!("Bearer {key}").as_str()) {
                return error(StatusCode::UNAUTHORIZED, "Unauthorized");
            }
        }
        match (&parts.method, path.as_str()) {
            (&Method::GET, "/health") => {
                let delay = self.health_delay_ms.load(Relaxed);
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                if self.healthy.load(Relaxed) {
                    full(StatusCode::OK, "text/plain", "")
                } else {
                    self.health_failed.fetch_add(1, Relaxed);
                    full(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "loading")
                }
            }
            (&Method::GET, "/v1/models") => {
                let models = self.models.lock().expect("models").clone();
                let data: Vec<Value> = models
                    .iter()
                    .map(|m| json!({"id": m, "object": "model", "owned_by": self.cli.name}))
                    .collect();
                json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
            }
            (&Method::POST, "/sim/models") => match serde_json::from_slice::<Vec<String>>(&body) {
                Ok(list) => {
                    *self.models.lock().expect("models") = list.clone();
                    json_response(StatusCode::OK, &json!({"models": list}))
                }
                Err(e) => error(StatusCode::BAD_REQUEST, &e.to_string()),
            },
            (&Method::GET, "/metrics") => {
                full(StatusCode::OK, "text/plain; version=0.0.4", self.metrics())
            }
            (&Method::GET, "/sim/stats") => json_response(StatusCode::OK, &self.stats()),
            (&Method::POST, "/sim/cached") => {
                // A chat request, read as `/v1/chat/completions` reads it.
                let req: Value = serde_json::from_slice(&body).unwrap_or_default();
                let text = routing::request::Prompt::parse(&body, usize::MAX)
                    .map(|p| p.text)
                    .unwrap_or_default();
                let ids = self.ids("/v1/chat/completions", &body);
                let engine = self.engine.lock().expect("engine lock");
                let cached = engine.cached_tokens(&text, ids.as_deref(), cache_identity(&req));
                let prompt = ids
                    .as_ref()
                    .map_or_else(|| engine.tokens(&text), |i| i.len() as u64);
                json_response(
                    StatusCode::OK,
                    &json!({"cached_tokens": cached, "prompt_tokens": prompt,
                        "queued_tokens": engine.queued_prefill_tokens()}),
                )
            }
            (&Method::POST, "/sim/reset") => {
                let dropped = self.engine.lock().expect("engine lock").reset_cache();
                json_response(StatusCode::OK, &json!({"dropped_blocks": dropped}))
            }
            (&Method::POST, "/sim/health") => {
                let query = parts.uri.query().unwrap_or("");
                let delay = (query.split('&'))
                    .find_map(|kv| kv.strip_prefix("delay_ms="))
                    .and_then(|v| v.parse().ok());
                if let Some(ms) = delay {
                    self.health_delay_ms.store(ms, Relaxed);
                } else {
                    self.healthy.store(!query.contains("ok=false"), Relaxed);
                }
                let ok = self.healthy.load(Relaxed);
                let delay_ms = self.health_delay_ms.load(Relaxed);
                json_response(
                    StatusCode::OK,
                    &json!({"healthy": ok, "delay_ms": delay_ms}),
                )
            }
            (&Method::POST, "/sim/accept") => {
                let paused = parts.uri.query().unwrap_or("").contains("paused=true");
                self.accepting.send_replace(!paused);
                json_response(StatusCode::OK, &json!({"accepting": !paused}))
            }
            (&Method::GET | &Method::DELETE, p) if p.starts_with("/v1/responses/") => {
                let id = &p["/v1/responses/".len()..];
                let mut store = self.responses.lock().expect("responses");
                let found = if parts.method == Method::DELETE {
                    store.remove(id).is_some()
                } else {
                    store.contains_key(id)
                };
                match (found, &parts.method) {
                    (false, _) => not_found_response(id),
                    (true, &Method::DELETE) => json_response(
                        StatusCode::OK,
                        &json!({"id": id, "object": "response", "deleted": true}),
                    ),
                    (true, _) => {
                        json_response(StatusCode::OK, &Kind::response(id, "completed", None, None))
                    }
                }
            }
            (
                &Method::POST,
                "/v1/chat/completions" | "/v1/completions" | "/v1/messages" | "/v1/responses",
            ) => {
                let n = self.received.fetch_add(1, Relaxed);
                self.log_id(&parts.headers);
                if self.cli.hang_after_requests.is_some_and(|h| n >= h) {
                    return std::future::pending().await;
                }
                if self.cli.fail_after_requests.is_some_and(|f| n >= f) {
                    let status = StatusCode::from_u16(self.cli.fail_status)
                        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                    return error(status, "simulated engine failure");
                }
                self.complete(&path, body).await
            }
            (&Method::POST, "/v1/audio/transcriptions" | "/v1/audio/translations") => {
                match routing::request::Prompt::parse_form_model(&body).model {
                    Some(m) if !self.models.lock().expect("models").contains(&m) => {
                        model_not_found(&m)
                    }
                    _ => json_response(
                        StatusCode::OK,
                        &json!({"text": "tok tok", "x_body_bytes": body.len()}),
                    ),
                }
            }
            (&Method::POST, "/v1/embeddings") => {
                let model = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("model")?.as_str().map(str::to_owned));
                match model {
                    Some(m) if !self.models.lock().expect("models").contains(&m) => {
                        model_not_found(&m)
                    }
                    _ => json_response(
                        StatusCode::OK,
                        &json!({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}],
                                "x_body_bytes": body.len()}),
                    ),
                }
            }
            _ => error(StatusCode::NOT_FOUND, &format!("no route {path}")),
        }
    }

    pub(crate) async fn complete(self: Arc<Self>, path: &str, body: Bytes) -> Response<Body> {
        let received = (body.len(), xxhash_rust::xxh3::xxh3_128(&body));
        let req: Value = match serde_json::from_slice(&body) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return self.tag(
                    error(StatusCode::BAD_REQUEST, "body is not a JSON object"),
                    received,
                )
            }
        };
        // vLLM answers 404 for a model it does not serve.
        if let Some(model) = req.get("model").and_then(Value::as_str) {
            if !self
                .models
                .lock()
                .expect("models")
                .iter()
                .any(|m| m == model)
            {
                return self.tag(model_not_found(model), received);
            }
        }
        // vLLM refuses a salt that is not a non-empty string.
        if req
            .get("cache_salt")
            .is_some_and(|s| !s.is_null() && s.as_str().is_none_or(str::is_empty))
        {
            return self.tag(
                error(
                    StatusCode::BAD_REQUEST,
                    "Parameter 'cache_salt' must be a non-empty string if provided.",
                ),
                received,
            );
        }
        let responses = path == "/v1/responses";
        let mut text = routing::request::Prompt::parse(&body, usize::MAX)
            .map(|p| p.text)
            .unwrap_or_default();
        let salt = cache_identity(&req);
        // The Responses API: this request's instructions, then the stored
        // conversation it continues (so its prefix is cached; the earlier
        // instructions are not carried over), then its new items.
        let mut history = Vec::new();
        if responses {
            let part = |v: Value| {
                routing::request::Prompt::parse_responses(v.to_string().as_bytes(), usize::MAX)
                    .map(|p| p.text)
                    .unwrap_or_default()
            };
            let instructions = part(json!({"instructions": req.get("instructions")}));
            if let Some(previous) = req.get("previous_response_id").and_then(Value::as_str) {
                match self.responses.lock().expect("responses").get(previous) {
                    Some(earlier) => history.clone_from(earlier),
                    None => return self.tag(not_found_response(previous), received),
                }
            }
            history.extend(part(json!({"input": req.get("input")})));
            text = [instructions.as_slice(), &history].concat();
        }
        let store = responses && req.get("store") != Some(&Value::Bool(false));
        let response_id = || {
            let n = self.next_response.fetch_add(1, Relaxed);
            format!("resp_{}_{n}", self.cli.name)
        };
        let kind = Kind::of(path, response_id);
        let max_tokens = req
            .get("max_tokens")
            .or_else(|| req.get("max_completion_tokens"))
            .or_else(|| req.get("max_output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(self.cli.default_max_tokens)
            .max(1);
        let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let usage_in_stream = req
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let ids = self.ids(path, &body);
        let started = Running::start(&self, &text, ids, salt, max_tokens);
        let (mut running, mut events) = match started {
            Ok(r) => r,
            Err(msg) => return self.tag(error(StatusCode::BAD_REQUEST, &msg), received),
        };
        // Time to first token: the card admits, prefills and emits the first token.
        let (prompt_tokens, cached_tokens) = loop {
            match events.recv().await {
                Some(Event::First {
                    prompt_tokens,
                    cached_tokens,
                }) => {
                    running.first_token();
                    break (prompt_tokens, cached_tokens);
                }
                Some(_) => continue,
                None => return error(StatusCode::INTERNAL_SERVER_ERROR, "engine stopped"),
            }
        };
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        });
        let output = "tok ".repeat(max_tokens as usize).trim_end().to_owned();
        if let (Kind::Responses(id), true) = (&kind, store) {
            // Stored once the answer is known (the id is in its first bytes).
            history.extend_from_slice(output.as_bytes());
            history.extend_from_slice(b"\x1fassistant\x1e");
            self.responses
                .lock()
                .expect("responses")
                .insert(id.clone(), history);
        }
        if !stream {
            while let Some(ev) = events.recv().await {
                if ev == Event::Done {
                    break;
                }
            }
            running.finish();
            return self.tag(
                json_response(StatusCode::OK, &kind.full(&output, &usage)),
                received,
            );
        }
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        tokio::spawn(async move {
            let mut pending = vec![kind.first_event(), kind.delta_event("tok")];
            let mut done = max_tokens == 1;
            if done {
                pending
                    .extend(kind.last_events(usage_in_stream.then_some(&usage), (&output, &usage)));
            }
            loop {
                for ev in pending.drain(..) {
                    if tx.send(Bytes::from(ev)).await.is_err() {
                        return; // the client left: `running` cancels the sequence
                    }
                }
                if done {
                    break;
                }
                match events.recv().await {
                    Some(Event::Token) => pending.push(kind.delta_event(" tok")),
                    Some(Event::Done) => {
                        pending.push(kind.delta_event(" tok"));
                        pending.extend(
                            kind.last_events(usage_in_stream.then_some(&usage), (&output, &usage)),
                        );
                        done = true;
                    }
                    Some(Event::First { .. }) => {}
                    None => return,
                }
            }
            running.finish();
        });
        let mut r = Response::new(BodyExt::boxed(ChannelBody(rx)));
        r.headers_mut().insert(
            "content-type",
            "text/event-stream".parse().expect("static header"),
        );
        r.headers_mut()
            .insert("cache-control", "no-cache".parse().expect("static header"));
        self.tag(r, received)
    }

    /// Drives the card: one engine step at a time, paced so that model time
    /// runs `time_scale` times faster than wall time, events delivered at the
    /// end of their step.
    pub(crate) async fn schedule(self: Arc<Self>) {
        let mut clock = tokio::time::Instant::now();
        loop {
            let (dt, events) = self.engine.lock().expect("engine lock").step();
            if events.is_empty() && dt == 0.0 {
                if self.engine.lock().expect("engine lock").idle() {
                    self.arrived.notified().await;
                } else {
                    tokio::task::yield_now().await;
                }
                clock = tokio::time::Instant::now();
                continue;
            }
            clock += Duration::from_secs_f64(dt / self.cli.time_scale);
            tokio::time::sleep_until(clock).await;
            let streams = self.streams.lock().expect("streams lock");
            for (id, ev) in events {
                if let Some(tx) = streams.get(&id) {
                    let _ = tx.send(ev);
                }
            }
        }
    }

    /// A chat completion's token ids, with `--tokenizer` (the template
    /// rendered and the text tokenized as the engine would).
    pub(crate) fn ids(&self, path: &str, body: &[u8]) -> Option<Arc<[u32]>> {
        let tokens = self
            .tokens
            .as_ref()
            .filter(|_| path == "/v1/chat/completions")?;
        tokens.chat_ids(body).ok().map(Arc::from)
    }

    pub(crate) fn tag(&self, mut r: Response<Body>, (len, hash): (usize, u128)) -> Response<Body> {
        let h = r.headers_mut();
        for (k, v) in [
            ("x-sim-replica", self.cli.name.clone()),
            ("x-sim-body-bytes", len.to_string()),
            ("x-sim-body-xxh3", format!("{hash:032x}")),
        ] {
            if let Ok(v) = v.parse() {
                h.insert(k, v);
            }
        }
        r
    }

    pub(crate) fn log_id(&self, headers: &hyper::HeaderMap) {
        use std::io::Write;
        let (Some(log), Some(id)) = (&self.id_log, headers.get("x-soak-id")) else {
            return;
        };
        let mut f = log.lock().expect("id log lock");
        let _ = f.write_all(id.as_bytes());
        let _ = f.write_all(b"\n");
    }

    pub(crate) fn stats(&self) -> Value {
        let e = self.engine.lock().expect("engine lock");
        let c = &e.counters;
        json!({
            "name": self.cli.name,
            "requests": c.requests,
            "running": self.running.load(Relaxed),
            "cancelled": self.cancelled.load(Relaxed),
            "received": self.received.load(Relaxed),
            "stalled": self.stalled.load(Relaxed),
            "health_failed": self.health_failed.load(Relaxed),
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.prefix_hits,
            "preemptions": c.preemptions,
            "kv_usage": e.kv_usage(),
        })
    }

    /// vLLM's metric names (v0.10+, `vllm:` prefix, `model_name` label).
    pub(crate) fn metrics(&self) -> String {
        let (running, waiting, usage, c) = {
            let e = self.engine.lock().expect("engine lock");
            (e.running(), e.waiting(), e.kv_usage(), e.counters.clone())
        };
        let l = "{model_name=\"sim\"}";
        let mut out = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{l} {running}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{l} {waiting}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{l} {usage}\n\
             # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{l} {}\n\
             # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{l} {}\n\
             # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{l} {}\n\
             # TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{l} {}\n\
             # TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{l} {}\n",
            c.prefix_queries, c.prefix_hits, c.prompt_tokens, c.generation_tokens, c.preemptions,
        );
        out.push_str(
            &self
                .ttft
                .lock()
                .expect("ttft lock")
                .render("vllm:time_to_first_token_seconds", "model_name=\"sim\""),
        );
        out
    }
}

/// A request on the card; dropped unfinished (client gone) it is cancelled.
pub(crate) struct Running {
    sim: Arc<Sim>,
    id: SeqId,
    started: tokio::time::Instant,
    first_seen: bool,
    done: bool,
}

impl Running {
    /// Submits the request; returns the guard and its event channel.
    pub(crate) fn start(
        sim: &Arc<Sim>,
        text: &[u8],
        ids: Option<Arc<[u32]>>,
        salt: u64,
        max_tokens: u64,
    ) -> Result<(Self, mpsc::UnboundedReceiver<Event>), String> {
        let id = sim.next_id.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        sim.streams.lock().expect("streams lock").insert(id, tx);
        let mut engine = sim.engine.lock().expect("engine lock");
        let submitted = match ids {
            Some(ids) => engine.submit_ids(id, ids, salt, max_tokens),
            None => engine.submit(id, text, salt, max_tokens),
        };
        drop(engine);
        if let Err(e) = submitted {
            sim.streams.lock().expect("streams lock").remove(&id);
            return Err(e);
        }
        sim.running.fetch_add(1, Relaxed);
        sim.arrived.notify_one();
        Ok((
            Self {
                sim: Arc::clone(sim),
                id,
                started: tokio::time::Instant::now(),
                first_seen: false,
                done: false,
            },
            rx,
        ))
    }

    /// Records the model-time TTFT once (wall time times the time scale).
    pub(crate) fn first_token(&mut self) {
        if !std::mem::replace(&mut self.first_seen, true) {
            let model_s = self.started.elapsed().as_secs_f64() * self.sim.cli.time_scale;
            self.sim.ttft.lock().expect("ttft lock").observe(model_s);
        }
    }

    pub(crate) fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.sim.running.fetch_sub(1, Relaxed);
        self.sim
            .streams
            .lock()
            .expect("streams lock")
            .remove(&self.id);
        if !self.done {
            self.sim.cancelled.fetch_add(1, Relaxed);
            self.sim.engine.lock().expect("engine lock").cancel(self.id);
        }
    }
}

/// What the engine's cache keys carry besides the prompt's text, read from
/// the request as vLLM does (not from the router's own reading): the
/// `cache_salt`, the model (a LoRA adapter is a model name), and what the chat
/// template renders before the messages (the tools, the template and its
/// kwargs, documents). 0 when the request names none of them.
fn cache_identity(req: &Value) -> u64 {
    const KEYS: [&str; 7] = [
        "cache_salt",
        "model",
        "tools",
        "functions",
        "chat_template",
        "chat_template_kwargs",
        "documents",
    ];
    let parts: Vec<&Value> = KEYS
        .iter()
        .map(|k| req.get(k).unwrap_or(&Value::Null))
        .collect();
    if parts.iter().all(|v| v.is_null()) {
        return 0;
    }
    xxhash_rust::xxh3::xxh3_64(
        Value::from(parts.into_iter().cloned().collect::<Vec<_>>())
            .to_string()
            .as_bytes(),
    )
}
