//! Structure-aware JSON for property tests of the body parser: the keys it
//! acts on, nested at random, and top-level keys written more than once.
//! Shared by `tests/fuzz_parse.rs` and the parser's oracle tests
//! (`crates/routing/src/request/reference.rs`), each through a `#[path]` module.

use proptest::prelude::*;
use serde_json::Value;

pub fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("messages".to_owned()),
        Just("system".to_owned()),
        Just("prompt".to_owned()),
        Just("prompt_cache_key".to_owned()),
        Just("model".to_owned()),
        Just("cache_salt".to_owned()),
        Just("cache_prompt".to_owned()),
        Just("prompt_logprobs".to_owned()),
        Just("role".to_owned()),
        Just("content".to_owned()),
        Just("text".to_owned()),
        Just("type".to_owned()),
        Just("tools".to_owned()),
        Just("tool_calls".to_owned()),
        Just("image_url".to_owned()),
        Just("input".to_owned()),
        Just("instructions".to_owned()),
        Just("output".to_owned()),
        "[a-z]{1,6}",
    ]
}

pub fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            Just("assistant".to_owned()),
            Just("tool_result".to_owned()),
            ".{0,40}",
            "[a\"\\\\\n\t\u{1}é😀]{0,90}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 96, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// `v` as a body; an object's keys written `repeat` times over.
pub fn shaped(v: &Value, repeat: usize) -> String {
    match v {
        Value::Object(m) if repeat > 1 => {
            let one: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}:{v}", Value::from(k.as_str())))
                .collect();
            let all = vec![one.join(","); repeat];
            let all: Vec<_> = all.into_iter().filter(|s| !s.is_empty()).collect();
            format!("{{{}}}", all.join(","))
        }
        _ => v.to_string(),
    }
}
