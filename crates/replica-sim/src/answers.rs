//! The simulator's answers: JSON and errors as vLLM words them, and the
//! SSE body fed by a channel.

use super::*;

pub(crate) type Body = BoxBody<Bytes, Infallible>;

pub(crate) fn full(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", content_type.parse().expect("static header"));
    r
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

/// vLLM's answer for a model it does not serve.
pub(crate) fn model_not_found(model: &str) -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"error": {"message": format!("The model `{model}` does not exist."),
                "type": "NotFoundError", "param": "model", "code": 404}}),
    )
}

/// vLLM's answer for a response id it does not hold.
pub(crate) fn not_found_response(id: &str) -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"error": {"message": format!("Response with id '{id}' not found."),
            "type": "invalid_request_error", "param": "response_id", "code": 404}}),
    )
}

pub(crate) fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}}),
    )
}

/// An SSE body fed by a channel; the sender sees the client leave.
pub(crate) struct ChannelBody(pub(crate) mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}
