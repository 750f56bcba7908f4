//! OpenAI's Responses API body (`POST /v1/responses`) -> the same canonical
//! prompt as chat: `instructions` is a first `system` message; `input` is a
//! `user` message when it is a string, else one message per item: a message
//! item's text parts under its role, a `function_call`'s name and arguments
//! under `function_call`, a `function_call_output`'s output under
//! `function_call_output`, a `reasoning` item's summary under `reasoning`
//! (the last three, like an `assistant` message, are model turns: the request
//! is a continuation). Also read: `model`, `prompt_cache_key`,
//! `previous_response_id` (the conversation's state is on the replica that
//! produced that response) and `store` (`false`: nothing is kept there).
//! Strings are kept in the escaped form `serde_json` writes, as for chat.
//! Parsed with `serde_json` (not the chat path's scanner): Responses bodies
//! that name a previous response carry only the new items.

use serde_json::Value;

use super::{Prompt, Section};

/// A Responses API request as the router reads it.
pub fn parse(body: &[u8], max: usize) -> Result<Prompt, serde_json::Error> {
    let v: Value = serde_json::from_slice(body)?;
    let Value::Object(top) = v else {
        return Err(serde::de::Error::custom("expected a JSON object"));
    };
    let mut s = Section::default();
    let string = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned);
    if let Some(instructions) = top.get("instructions").and_then(Value::as_str) {
        append_str(&mut s, instructions, max);
        s.end_message(b"system", max);
    }
    match top.get("input") {
        Some(Value::String(text)) => {
            append_str(&mut s, text, max);
            s.end_message(b"user", max);
        }
        Some(Value::Array(items)) => {
            for item in items {
                self::item(&mut s, item, max);
            }
        }
        _ => {}
    }
    let previous = top.get("previous_response_id").and_then(string);
    Ok(Prompt {
        model_turn: s.model_turn || previous.is_some(),
        messages: s.messages,
        text: s.text,
        message_ends: s.message_ends,
        key: top.get("prompt_cache_key").and_then(string),
        model: top.get("model").and_then(string),
        previous_response_id: previous,
        no_store: top.get("store") == Some(&Value::Bool(false)),
        ..Prompt::default()
    })
}

/// One item of `input`.
fn item(s: &mut Section, item: &Value, max: usize) {
    let kind = item.get("type").and_then(Value::as_str);
    let role = item.get("role").and_then(Value::as_str);
    match (kind, role) {
        (Some("message") | None, Some(role)) => {
            match item.get("content") {
                Some(Value::String(text)) => append_str(s, text, max),
                Some(Value::Array(parts)) => {
                    for text in parts.iter().filter_map(|p| p.get("text")?.as_str()) {
                        append_str(s, text, max);
                    }
                }
                _ => {}
            }
            s.end_message(role.as_bytes(), max);
        }
        (Some(kind @ "function_call"), _) => {
            for field in ["name", "arguments"] {
                if let Some(text) = item.get(field).and_then(Value::as_str) {
                    append_str(s, text, max);
                }
            }
            model_turn(s, kind, max);
        }
        (Some(kind @ "function_call_output"), _) => {
            match item.get("output") {
                Some(Value::String(text)) => append_str(s, text, max),
                Some(other) => append_str(s, &other.to_string(), max),
                None => {}
            }
            model_turn(s, kind, max);
        }
        (Some(kind @ "reasoning"), _) => {
            let summary = item.get("summary").and_then(Value::as_array);
            for text in summary
                .into_iter()
                .flatten()
                .filter_map(|p| p.get("text")?.as_str())
            {
                append_str(s, text, max);
            }
            model_turn(s, kind, max);
        }
        _ => {}
    }
}

fn model_turn(s: &mut Section, kind: &str, max: usize) {
    s.end_message(kind.as_bytes(), max);
    s.model_turn = true;
}

/// Appends a string in `serde_json`'s escaped form, within `max` bytes.
fn append_str(s: &mut Section, text: &str, max: usize) {
    let escaped = Value::from(text).to_string();
    let inner = &escaped.as_bytes()[1..escaped.len() - 1];
    let room = max.saturating_sub(s.text.len());
    s.text.extend_from_slice(&inner[..inner.len().min(room)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> Prompt {
        parse(s.as_bytes(), usize::MAX).expect("valid body")
    }

    #[test]
    fn a_stateless_loop_re_sends_its_history_and_extends_its_prompt() {
        let t1 = parse_str(
            r#"{"model":"m","instructions":"Be terse.","input":[{"role":"user","content":"list files"}]}"#,
        );
        let t2 = parse_str(
            r#"{"model":"m","instructions":"Be terse.","store":false,"input":[
                {"role":"user","content":[{"type":"input_text","text":"list files"}]},
                {"type":"reasoning","summary":[{"type":"summary_text","text":"use ls"}]},
                {"type":"function_call","call_id":"c1","name":"ls","arguments":"{\"dir\":\".\"}"},
                {"type":"function_call_output","call_id":"c1","output":"a.txt\nb.txt"}]}"#,
        );
        assert!(t2.text.starts_with(&t1.text));
        assert!(t2.message_ends.contains(&t1.text.len()));
        assert!(!t1.model_turn && t2.model_turn);
        assert_eq!((t1.messages, t2.messages), (2, 5));
        assert_eq!(t1.model.as_deref(), Some("m"));
        assert!(t2.no_store && !t1.no_store);
        let text = String::from_utf8(t2.text).unwrap();
        assert!(
            text.contains(r#"a.txt\nb.txt"#),
            "escaped as serde_json writes: {text}"
        );
    }

    #[test]
    fn a_string_input_is_a_user_message_and_a_previous_response_makes_a_continuation() {
        let p =
            parse_str(r#"{"input":"hi","previous_response_id":"resp_1","prompt_cache_key":"k"}"#);
        assert_eq!(p.text, b"hi\x1fuser\x1e");
        assert!(p.model_turn);
        assert_eq!(p.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(p.key.as_deref(), Some("k"));
        assert!(parse(b"[1]", 10).is_err());
        assert!(parse(b"{\"input\":", 10).is_err());
        let cut = parse(br#"{"input":"a long question"}"#, 4).unwrap();
        assert_eq!(cut.text, b"a lo");
    }
}
