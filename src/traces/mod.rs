//! Traces (`traces`): one OpenTelemetry span per request, with child spans
//! for its admission, body read, parse, placement and each attempt at a
//! replica, exported as OTLP over HTTP (protobuf) in batches from the
//! SDK's own thread. A request's W3C `traceparent` is continued (its
//! sender's sampling choice kept); the one sent to the engine names the
//! attempt's span, so an engine started with `--otlp-traces-endpoint`
//! continues the trace. Off (no `traces:`): no span, no thread, nothing
//! per request but an empty `Option`.

mod client;

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};

use crate::config;

/// Why traces could not be started.
#[derive(Debug, thiserror::Error)]
#[error("traces: {0}")]
pub struct TracesError(String);

/// Batches are sent this often (and when full).
const EXPORT_EVERY: Duration = Duration::from_millis(500);

/// The exporter and the tracer.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// How long a last export may take at a stop.
    timeout: Duration,
}

/// The longest path kept in `url.path` (a client chooses it).
const MAX_PATH: usize = 256;
/// A longer incoming `tracestate` is dropped (W3C: at least 512 kept).
const MAX_TRACESTATE: usize = 512;

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("Traces")
    }
}

impl Traces {
    pub fn start(c: &config::Traces) -> Result<Self, TracesError> {
        let timeout = crate::config::ms(c.export_timeout_ms);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(c.endpoint.clone())
            .with_timeout(timeout)
            .with_http_client(client::PlainHttp { timeout })
            .build()
            .map_err(|e| TracesError(e.to_string()))?;
        let batches = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(EXPORT_EVERY)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                c.sample_ratio,
            ))))
            .with_resource(
                opentelemetry_sdk::Resource::builder_empty()
                    .with_service_name(c.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("prefix-router");
        Ok(Self {
            provider,
            tracer,
            timeout,
        })
    }

    /// A request's trace, its root span started at `started` (named by its
    /// method until its route is known): continued from the request's
    /// `traceparent` when it has one.
    pub fn begin(&self, head: &pingora_http::RequestHeader, started: SystemTime) -> RequestTrace {
        let parent = TraceContextPropagator::new().extract(&Incoming(&head.headers));
        let mut root = self
            .tracer
            .span_builder(head.method.as_str().to_owned())
            .with_kind(SpanKind::Server)
            .with_start_time(started)
            .start_with_context(&self.tracer, &parent);
        // An unsampled span is not recorded: its attributes are not made.
        let sampled = root.span_context().is_sampled();
        if sampled {
            let path = head.uri.path();
            let mut cut = path.len().min(MAX_PATH);
            while !path.is_char_boundary(cut) {
                cut -= 1;
            }
            root.set_attribute(KeyValue::new(
                "http.request.method",
                head.method.as_str().to_owned(),
            ));
            root.set_attribute(KeyValue::new("url.path", path[..cut].to_owned()));
        }
        RequestTrace {
            tracer: self.tracer.clone(),
            root: parent.with_span(root),
            attempt: None,
            sampled,
        }
    }

    /// Sends what is batched and stops (at a graceful stop), within the
    /// export timeout and a second; blocks.
    pub fn stop(&self) {
        let within = self.timeout + Duration::from_secs(1);
        if let Err(e) = self.provider.shutdown_with_timeout(within) {
            log::warn!("traces: the last spans could not be sent: {e}");
        }
    }
}

/// One request's spans.
pub struct RequestTrace {
    tracer: SdkTracer,
    root: Context,
    /// The current attempt at a replica.
    attempt: Option<Context>,
    /// Kept: an unsampled request makes no child spans (its engine is
    /// sent the request's own span, unsampled).
    sampled: bool,
}

/// A child span of a sampled request, ended when it drops.
pub struct Step(Option<opentelemetry_sdk::trace::Span>);

impl Step {
    pub fn set(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        if let Some(span) = self.0.as_mut() {
            span.set_attribute(KeyValue::new(key, value));
        }
    }
}

impl RequestTrace {
    /// Whether the request's spans are kept (sampled).
    pub fn sampled(&self) -> bool {
        self.sampled
    }

    /// Starts a child span of the request (ended when it drops).
    pub fn step(&self, name: &'static str) -> Step {
        Step((self.sampled).then(|| self.tracer.start_with_context(name, &self.root)))
    }

    /// Starts a span for an attempt at `replica` (ending the one before).
    pub fn attempt(&mut self, replica: &str) {
        self.end_attempt(None);
        if !self.sampled {
            return;
        }
        let span = self
            .tracer
            .span_builder(Cow::Borrowed("attempt"))
            .with_kind(SpanKind::Client)
            .with_attributes([KeyValue::new("replica", replica.to_owned())])
            .start_with_context(&self.tracer, &self.root);
        self.attempt = Some(self.root.with_span(span));
    }

    /// Ends the current attempt, failed with `error` when given.
    pub fn end_attempt(&mut self, error: Option<String>) {
        if let Some(cx) = self.attempt.take() {
            let span = cx.span();
            if let Some(e) = error {
                span.set_status(Status::error(e));
            }
            span.end();
        }
    }

    /// Writes the current attempt's `traceparent` (and `tracestate`) into
    /// the request sent to the engine, replacing the client's.
    pub fn inject(&self, head: &mut pingora_http::RequestHeader) {
        let cx = self.attempt.as_ref().unwrap_or(&self.root);
        TraceContextPropagator::new().inject_context(cx, &mut Outgoing(head));
    }

    /// Ends the request's span with its status and error; `name`: its
    /// route, when it had one (`POST /v1/chat/completions`).
    pub fn end(
        mut self,
        name: Option<String>,
        status: u16,
        error: Option<String>,
        attributes: Vec<KeyValue>,
    ) {
        let failed = error
            .clone()
            .or_else(|| (status >= 500).then(|| status.to_string()));
        self.end_attempt(failed.clone());
        let span = self.root.span();
        if let Some(name) = name {
            span.update_name(name);
        }
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        for kv in attributes {
            span.set_attribute(kv);
        }
        if let Some(e) = failed {
            span.set_status(Status::error(e));
        }
        span.end();
    }
}

struct Incoming<'a>(&'a http::HeaderMap);

impl Extractor for Incoming<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = self.0.get(key).and_then(|v| v.to_str().ok())?;
        (key != "tracestate" || value.len() <= MAX_TRACESTATE).then_some(value)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct Outgoing<'a>(&'a mut pingora_http::RequestHeader);

impl Injector for Outgoing<'_> {
    fn set(&mut self, key: &str, value: String) {
        // `tracestate` comes empty when there is none.
        if value.is_empty() {
            self.0.remove_header(key);
        } else if let Err(e) = self.0.insert_header(key.to_owned(), value) {
            log::debug!("traces: {key} not sent: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_s_traceparent_is_continued_and_the_attempt_s_is_sent_on() {
        let traces = Traces::start(&config::Traces {
            endpoint: "http://127.0.0.1:9/v1/traces".into(),
            sample_ratio: 0.0,
            ..Default::default()
        })
        .unwrap();
        let mut head =
            pingora_http::RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        let incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        head.insert_header("traceparent", incoming).unwrap();
        let mut trace = traces.begin(&head, SystemTime::now());
        trace.attempt("gpu0");
        let mut upstream = head.clone();
        trace.inject(&mut upstream);
        let sent = upstream.headers["traceparent"].to_str().unwrap().to_owned();
        let parts: Vec<&str> = sent.split('-').collect();
        // Same trace, a new parent (the attempt), sampled as the client said
        // (the ratio here is 0).
        assert_eq!(parts[1], "0af7651916cd43dd8448eb211c80319c");
        assert_ne!(parts[2], "b7ad6b7169203331");
        assert_eq!(parts[3], "01");
        assert!(upstream.headers.get("tracestate").is_none());
        trace.end(None, 200, None, Vec::new());
    }
}
