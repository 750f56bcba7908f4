//! Fuzzing `Prompt::parse` and the shape signals: arbitrary bytes and
//! structure-aware JSON (the keys the parser acts on, nested at random,
//! top-level keys repeated). 256 cases per `cargo test`; a longer run:
//!   PROPTEST_CASES=200000 cargo test --release --test fuzz_parse

use prefix_router::request::Prompt;
use proptest::prelude::*;
use serde_json::Value;

const CAP: usize = 4096;

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("messages".to_owned()),
        Just("system".to_owned()),
        Just("prompt".to_owned()),
        Just("prompt_cache_key".to_owned()),
        Just("role".to_owned()),
        Just("content".to_owned()),
        Just("text".to_owned()),
        Just("type".to_owned()),
        "[a-z]{1,6}",
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            Just("assistant".to_owned()),
            Just("tool_result".to_owned()),
            ".{0,40}"
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

fn check(p: &Prompt) {
    assert!(p.text.len() <= CAP);
    assert!(p.message_ends.windows(2).all(|w| w[0] <= w[1]));
    assert!(p.message_ends.iter().all(|e| *e <= p.text.len()));
    assert!(p.message_ends.len() <= p.messages);
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(p) = Prompt::parse(&body, CAP) {
            check(&p);
        }
    }

    #[test]
    fn arbitrary_json_parses_within_its_caps(v in json(), repeat in 1usize..4) {
        // Repeated top-level objects' keys: the same key written `repeat` times.
        let body = match &v {
            Value::Object(m) if repeat > 1 => {
                let one: Vec<String> = m.iter().map(|(k, v)| format!("{}:{v}", Value::from(k.as_str()))).collect();
                format!("{{{}}}", vec![one.join(","); repeat].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>().join(","))
            }
            _ => v.to_string(),
        };
        // An error (a field of the wrong type) forwards the body unparsed, spread.
        if let Ok(p) = Prompt::parse(body.as_bytes(), CAP) {
            check(&p);
            let r = p.into_request(64, None);
            prop_assert!(r.chain.len() <= CAP);
        }
    }
}
