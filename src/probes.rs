//! The metrics listener: Prometheus text on `/metrics` (and, as before, on
//! any other path), plus the probes an orchestrator polls: `/healthz`
//! (liveness: the process serves) and `/ready` (readiness: the configuration
//! loaded and at least one replica is live; 503 otherwise).

use std::sync::Arc;

use async_trait::async_trait;
use http::{header, HeaderValue, Response, StatusCode};
use pingora_core::apps::http_app::{HttpServer, ServeHttp};
use pingora_core::modules::http::compression::ResponseCompressionBuilder;
use pingora_core::protocols::http::ServerSession;
use pingora_core::services::listening::Service;
use prometheus::{Encoder, TextEncoder, TEXT_FORMAT};

use crate::replicas::Replicas;

/// Serves metrics and probes.
pub struct MetricsApp {
    replicas: Arc<Replicas>,
}

/// The metrics listener's service (gzip when the client accepts it).
pub fn service(replicas: Arc<Replicas>) -> Service<HttpServer<MetricsApp>> {
    let mut server = HttpServer::new_app(MetricsApp { replicas });
    server.add_module(ResponseCompressionBuilder::enable(7));
    Service::new("metrics and probes".to_owned(), server)
}

fn answer(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<Vec<u8>> {
    let len = body.len();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

#[async_trait]
impl ServeHttp for MetricsApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/healthz" => answer(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/ready" => {
                let list = self.replicas.snapshot();
                let live = list.iter().filter(|r| r.live()).count();
                let status = if live > 0 {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                let body = format!("{live} of {} replicas live\n", list.len());
                answer(status, "text/plain", body.into_bytes())
            }
            _ => {
                let mut buffer = Vec::new();
                match TextEncoder::new().encode(&prometheus::gather(), &mut buffer) {
                    Ok(()) => answer(StatusCode::OK, TEXT_FORMAT, buffer),
                    Err(e) => answer(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        format!("{e}\n").into_bytes(),
                    ),
                }
            }
        }
    }
}
