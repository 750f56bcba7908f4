//! The response shapes of each route: OpenAI chat and completions, Anthropic
//! messages, OpenAI responses; whole JSON bodies and SSE events.

use serde_json::{json, Value};

/// The response dialect of a route.
#[derive(Clone)]
pub enum Kind {
    Chat,
    Completion,
    Messages,
    /// The Responses API, with this response's id.
    Responses(String),
}

/// The Responses API's usage from chat's.
fn responses_usage(usage: &Value) -> Value {
    json!({"input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"]})
}

impl Kind {
    /// The dialect of `path`; `id` names a Responses API response.
    pub fn of(path: &str, id: impl FnOnce() -> String) -> Self {
        match path {
            "/v1/completions" => Kind::Completion,
            "/v1/messages" => Kind::Messages,
            "/v1/responses" => Kind::Responses(id()),
            _ => Kind::Chat,
        }
    }

    /// A Responses API response object.
    pub fn response(id: &str, status: &str, text: Option<&str>, usage: Option<&Value>) -> Value {
        let output: Vec<Value> = text
            .map(|t| json!({"type": "message", "id": format!("msg_{id}"), "role": "assistant",
                "status": "completed", "content": [{"type": "output_text", "text": t, "annotations": []}]}))
            .into_iter()
            .collect();
        json!({"id": id, "object": "response", "created_at": 0, "model": "sim", "status": status,
            "output": output, "usage": usage.map(responses_usage)})
    }

    pub fn full(&self, text: &str, usage: &Value) -> Value {
        match self {
            Kind::Responses(id) => Self::response(id, "completed", Some(text), Some(usage)),
            Kind::Chat => json!({"id": "chatcmpl-sim", "object": "chat.completion", "model": "sim",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage}),
            Kind::Completion => {
                json!({"id": "cmpl-sim", "object": "text_completion", "model": "sim",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage})
            }
            Kind::Messages => {
                // Anthropic's `input_tokens` leaves out the tokens read from the cache.
                let cached = usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                let input = usage["prompt_tokens"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(cached);
                json!({"id": "msg-sim", "type": "message", "role": "assistant", "model": "sim",
                "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens",
                "usage": {"input_tokens": input, "output_tokens": usage["completion_tokens"],
                          "cache_read_input_tokens": cached}})
            }
        }
    }

    pub fn first_event(&self) -> String {
        match self {
            Kind::Responses(id) => sse_named(
                "response.created",
                &json!({"type": "response.created", "sequence_number": 0,
                    "response": Self::response(id, "in_progress", None, None)}),
            ),
            Kind::Chat => sse(
                &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "model": "sim",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
            ),
            Kind::Completion => sse(
                &json!({"id": "cmpl-sim", "object": "text_completion", "model": "sim",
                "choices": [{"index": 0, "text": "", "finish_reason": null}]}),
            ),
            Kind::Messages => sse_named(
                "message_start",
                &json!({"type": "message_start",
                "message": {"id": "msg-sim", "type": "message", "role": "assistant", "model": "sim", "content": []}}),
            ),
        }
    }

    pub fn delta_event(&self, text: &str) -> String {
        match self {
            Kind::Responses(_) => sse_named(
                "response.output_text.delta",
                &json!({"type": "response.output_text.delta", "output_index": 0,
                    "content_index": 0, "delta": text}),
            ),
            Kind::Chat => sse(
                &json!({"id": "chatcmpl-sim", "object": "chat.completion.chunk", "model": "sim",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]}),
            ),
            Kind::Completion => sse(
                &json!({"id": "cmpl-sim", "object": "text_completion", "model": "sim",
                "choices": [{"index": 0, "text": text, "finish_reason": null}]}),
            ),
            Kind::Messages => sse_named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}),
            ),
        }
    }

    /// The closing events; the Responses API always reports usage (`full`
    /// is the whole usage and text, for its `response.completed`).
    pub fn last_events(&self, usage: Option<&Value>, full: (&str, &Value)) -> Vec<String> {
        match self {
            Kind::Responses(id) => vec![sse_named(
                "response.completed",
                &json!({"type": "response.completed",
                    "response": Self::response(id, "completed", Some(full.0), Some(full.1))}),
            )],
            Kind::Messages => vec![sse_named("message_stop", &json!({"type": "message_stop"}))],
            _ => {
                let mut v = Vec::new();
                if let Some(u) = usage {
                    v.push(sse(
                        &json!({"id": "sim", "object": "chat.completion.chunk", "model": "sim",
                        "choices": [], "usage": u}),
                    ));
                }
                v.push("data: [DONE]\n\n".to_owned());
                v
            }
        }
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

fn sse_named(event: &str, v: &Value) -> String {
    format!("event: {event}\ndata: {v}\n\n")
}
