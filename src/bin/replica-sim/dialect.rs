//! The response shapes of each route: OpenAI chat and completions, Anthropic
//! messages; whole JSON bodies and SSE events.

use serde_json::{json, Value};

/// The response dialect of a route.
#[derive(Clone, Copy)]
pub enum Kind {
    Chat,
    Completion,
    Messages,
}

impl Kind {
    pub fn of(path: &str) -> Self {
        match path {
            "/v1/completions" => Kind::Completion,
            "/v1/messages" => Kind::Messages,
            _ => Kind::Chat,
        }
    }

    pub fn full(self, text: &str, usage: &Value) -> Value {
        match self {
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

    pub fn first_event(self) -> String {
        match self {
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

    pub fn delta_event(self, text: &str) -> String {
        match self {
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

    pub fn last_events(self, usage: Option<&Value>) -> Vec<String> {
        match self {
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
