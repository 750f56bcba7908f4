//! The router's own answers: OpenAI-style errors (counted), JSON bodies,
//! and the header and error readings the seam shares.

use bytes::Bytes;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use crate::errors::{RateHeaders, RouterError};
use crate::metrics::Metrics;

/// Writes an OpenAI-style JSON error and counts it.
pub(super) async fn respond(
    session: &mut Session,
    err: &RouterError,
    metrics: &Metrics,
) -> Result<()> {
    metrics.errors.with_label_values(&[err.code()]).inc();
    let body = Bytes::from(err.body());
    let mut resp = ResponseHeader::build(err.status(), Some(4))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    if let Some(s) = err.retry_after_s() {
        resp.insert_header("retry-after", s.to_string())?;
    }
    if let RouterError::RateLimited {
        retry_after_ms,
        headers,
        ..
    } = err
    {
        // The OpenAI SDKs read this before `retry-after`.
        resp.insert_header("retry-after-ms", retry_after_ms.to_string())?;
        rate_headers(&mut resp, headers)?;
    }
    if let Some(retry) = err.should_retry() {
        resp.insert_header("x-should-retry", if retry { "true" } else { "false" })?;
    }
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

/// A tenant's `x-ratelimit-*` headers.
pub(super) fn rate_headers(resp: &mut ResponseHeader, headers: &RateHeaders) -> Result<()> {
    let mut result = Ok(());
    headers.each(|name, value| {
        if result.is_ok() {
            result = resp.insert_header(name, value).map(|_| ());
        }
    });
    result
}

/// A JSON answer of the router's own.
pub(super) async fn respond_json(session: &mut Session, status: u16, body: Vec<u8>) -> Result<()> {
    let body = Bytes::from(body);
    let mut resp = ResponseHeader::build(status, Some(2))?;
    resp.insert_header("content-type", "application/json")?;
    resp.insert_header("content-length", body.len().to_string())?;
    session.write_response_header(Box::new(resp), false).await?;
    session.write_response_body(Some(body), true).await
}

pub(super) fn header<'a>(session: &'a Session, name: &str) -> Option<&'a str> {
    session
        .req_header()
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
}

/// The client sent `Expect: 100-continue`.
pub(super) fn expects_continue(session: &Session) -> bool {
    header(session, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
}

/// Whether `e` failed while writing the request to the replica: the engine
/// then never had the whole request, so it cannot have started on it.
pub(super) fn failed_writing_request(e: &Error) -> bool {
    matches!(e.etype(), ErrorType::WriteError | ErrorType::WriteTimedout)
        && e.esource() == &ErrorSource::Upstream
}

/// Whether the client has seen the start of a final response (a `100
/// Continue` does not count).
pub fn response_started(session: &Session) -> bool {
    session
        .response_written()
        .is_some_and(|r| !r.status.is_informational())
}
