//! Traces (`traces`): a request's spans exported as OTLP over HTTP to a
//! receiver built on the official OTLP protobuf definitions (PyPI
//! `opentelemetry-proto`, `tests/common/otlp_receiver.py`: no collector
//! binary installs from the package registries here), its `traceparent`
//! continued, the attempt's sent to the engine, sampling followed.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::http;
use common::{single, wait_for, RawReplica, Router};
use serde_json::Value;

/// The receiver process and the spans it printed.
struct Receiver {
    port: u16,
    spans: mpsc::Receiver<Value>,
    child: Child,
}

impl Receiver {
    fn start() -> Receiver {
        let python = concat!(env!("CARGO_MANIFEST_DIR"), "/.otel/venv/bin/python");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/otlp_receiver.py");
        let mut child = Command::new(python)
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the OTLP receiver (.otel/venv: scripts/prepare.sh)");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("port line");
        let port = line
            .trim()
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("receiver said {line:?}"));
        let (tx, spans) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        Receiver { port, spans, child }
    }

    /// Every span received once all of `names` came in `trace`.
    fn until(&self, trace: &str, names: &[&str]) -> Vec<Value> {
        let mut got: Vec<Value> = Vec::new();
        wait_for(
            &format!("spans {names:?} of {trace}"),
            Duration::from_secs(20),
            || {
                got.extend(self.spans.try_iter());
                let done = names.iter().all(|n| {
                    got.iter()
                        .any(|s| s["trace_id"] == trace && s["name"] == *n)
                });
                done.then(|| got.clone())
            },
        )
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const ANSWER: &str = r#"{"id":"c","object":"chat.completion","model":"sim","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

fn engine() -> RawReplica {
    RawReplica::start(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
            ANSWER.len()
        )
        .into_bytes(),
    )
}

fn traced_router(engine: &RawReplica, receiver: &Receiver, ratio: f64) -> Router {
    let yaml = format!(
        "traces: {{endpoint: \"http://127.0.0.1:{}/v1/traces\", sample_ratio: {ratio}}}\nreplicas:\n{}",
        receiver.port,
        engine.yaml("gpu0")
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("gpu0", true);
    router
}

fn post(router: &Router, headers: &[(&str, &str)]) -> http::Response {
    let body = serde_json::to_vec(&single("traced")).unwrap();
    http::request(router.addr, "POST", "/v1/chat/completions", headers, &body)
}

/// The `traceparent` the engine got with its last routed request.
fn engine_traceparent(engine: &RawReplica) -> Vec<String> {
    let heads = engine.heads.lock().unwrap();
    let head = heads.last().expect("the engine got a request");
    let value = head
        .lines()
        .find_map(|l| l.strip_prefix("traceparent: "))
        .unwrap_or_else(|| panic!("no traceparent in {head}"));
    value.trim().split('-').map(str::to_owned).collect()
}

#[test]
fn a_request_s_spans_continue_its_trace_and_the_engine_gets_the_attempt_s() {
    let receiver = Receiver::start();
    let engine = engine();
    // Nothing is sampled here but what the client sampled.
    let router = traced_router(&engine, &receiver, 0.0);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let r = post(
        &router,
        &[("traceparent", &format!("00-{trace}-{parent}-01"))],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let names = [
        "POST /v1/chat/completions",
        "admission",
        "read body",
        "parse",
        "place",
        "attempt",
    ];
    let spans: Vec<Value> = (receiver.until(trace, &names).into_iter())
        .filter(|s| s["trace_id"] == trace)
        .collect();
    let span = |name: &str| spans.iter().find(|s| s["name"] == name).unwrap();
    let root = span("POST /v1/chat/completions");
    assert_eq!(
        root["parent_span_id"], parent,
        "the client's span is the parent"
    );
    assert_eq!(root["kind"], 2, "server");
    assert_eq!(root["attributes"]["http.response.status_code"], 200);
    assert_eq!(root["attributes"]["replica"], "gpu0");
    assert_eq!(root["service"], "prefix-router");
    for name in &names[1..] {
        assert_eq!(span(name)["parent_span_id"], root["span_id"], "{name}");
    }
    let place = span("place");
    assert_eq!(place["attributes"]["replica"], "gpu0");
    assert_eq!(place["attributes"]["decision"], "spread");
    assert_eq!(place["attributes"]["model"], "sim");
    assert!(place["attributes"]["matched_tokens"].is_i64(), "{place}");
    let attempt = span("attempt");
    assert_eq!(attempt["kind"], 3, "client");
    // The engine continues the trace under the attempt, sampled.
    let sent = engine_traceparent(&engine);
    assert_eq!(sent[1], trace);
    assert_eq!(sent[2], attempt["span_id"].as_str().unwrap());
    assert_eq!(sent[3], "01");
}

#[test]
fn an_unsampled_request_exports_nothing_and_tells_the_engine_so() {
    let receiver = Receiver::start();
    let engine = engine();
    let router = traced_router(&engine, &receiver, 0.0);
    // Started here at a ratio of 0: not sampled, still propagated.
    assert_eq!(post(&router, &[]).status, 200);
    let unsampled = engine_traceparent(&engine);
    assert_eq!(unsampled[3], "00");
    // A sampled one after it: once its spans are in, the other's would be.
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let r = post(
        &router,
        &[("traceparent", &format!("00-{trace}-b7ad6b7169203331-01"))],
    );
    assert_eq!(r.status, 200);
    let all = receiver.until(trace, &["attempt", "POST /v1/chat/completions"]);
    let stray: Vec<&Value> = all.iter().filter(|s| s["trace_id"] != trace).collect();
    assert!(stray.is_empty(), "{stray:?}");
}

#[test]
fn without_traces_a_client_s_traceparent_goes_to_the_engine_unchanged() {
    let engine = engine();
    let router = Router::spawn(&format!("replicas:\n{}", engine.yaml("gpu0")), &[]);
    router.wait_replica_up("gpu0", true);
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(post(&router, &[("traceparent", incoming)]).status, 200);
    assert_eq!(engine_traceparent(&engine).join("-"), incoming);
}

#[test]
fn a_request_sampled_by_the_ratio_starts_a_trace_and_a_dead_collector_costs_no_request() {
    let receiver = Receiver::start();
    let engine = engine();
    let router = traced_router(&engine, &receiver, 1.0);
    assert_eq!(post(&router, &[]).status, 200);
    let started = engine_traceparent(&engine);
    assert_eq!(started[3], "01", "sampled at a ratio of 1");
    let spans = receiver.until(&started[1], &["POST /v1/chat/completions", "attempt"]);
    let root = spans
        .iter()
        .find(|s| s["name"] == "POST /v1/chat/completions")
        .unwrap();
    assert_eq!(root["parent_span_id"], "", "a trace of its own");
    // The collector gone: requests are answered as before.
    drop(receiver);
    for _ in 0..20 {
        let r = post(&router, &[]);
        assert_eq!(r.status, 200, "{}", r.text());
    }
}
