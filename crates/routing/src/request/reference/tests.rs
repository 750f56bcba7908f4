//! The scanner against the serde oracle, on generated and hostile bodies.

use super::super::Prompt;
use super::strategies::{json, shaped};
use proptest::prelude::*;
use serde_json::Value;

/// The scanner and the oracle agree: the same prompt, or both refuse.
fn same(body: &[u8], max: usize) -> std::result::Result<(), TestCaseError> {
    let new = Prompt::parse(body, max).ok();
    let old = super::parse(body, max).ok();
    prop_assert_eq!(new, old, "body {:?}", String::from_utf8_lossy(body));
    Ok(())
}

/// The source of a JSON string's contents, escapes and bad bytes included.
fn literal() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-z ]{1,20}",
        Just("é".to_owned()),
        Just(r"\n".to_owned()),
        Just(r#"\""#.to_owned()),
        Just(r"\\".to_owned()),
        Just(r"\/".to_owned()),
        Just(r"\u00e9".to_owned()),
        Just(r"\u0041".to_owned()),
        Just(r"\ud83d\ude00".to_owned()),
        Just(r"\ud800".to_owned()),
        Just(r"\udc00".to_owned()),
        Just(r"\ud800\n".to_owned()),
        Just(r"\ud800\u0041".to_owned()),
        Just(r"\x".to_owned()),
        Just(r"\u12".to_owned()),
        Just("\u{1}".to_owned()),
    ];
    prop::collection::vec(piece, 0..32).prop_map(|p| p.concat())
}

/// `v` with every list or object the scanner skips unread replaced by 0:
/// a fault inside one of those is not looked for (`skip_container`).
fn strip_skipped(v: &Value) -> Value {
    fn scalar(v: &Value) -> Value {
        match v {
            Value::Array(_) | Value::Object(_) => Value::from(0),
            v => v.clone(),
        }
    }
    type Rule = (&'static str, fn(&Value) -> Value);
    fn object(v: &Value, read: &[Rule]) -> Value {
        let Value::Object(m) = v else {
            return v.clone();
        };
        let kept = m.iter().map(|(k, v)| {
            let rule = read.iter().find(|(name, _)| name == k);
            (k.clone(), rule.map_or_else(|| scalar(v), |(_, f)| f(v)))
        });
        Value::Object(kept.collect())
    }
    fn list(v: &Value, each: fn(&Value) -> Value) -> Value {
        match v {
            Value::Array(a) => Value::Array(a.iter().map(each).collect()),
            v => v.clone(),
        }
    }
    fn content(v: &Value) -> Value {
        match v {
            Value::Array(_) => list(v, content),
            v => object(
                v,
                &[("text", content), ("content", content), ("type", scalar)],
            ),
        }
    }
    fn message(v: &Value) -> Value {
        object(v, &[("role", scalar), ("content", content)])
    }
    object(
        v,
        &[
            ("messages", |v| list(v, message)),
            ("system", content),
            ("prompt", Value::clone),
            ("text", Value::clone),
            ("input_ids", Value::clone),
            ("prompt_cache_key", scalar),
            ("model", scalar),
        ],
    )
}

proptest! {
    #[test]
    fn the_scanner_reads_random_json_as_the_serde_parser_did(
        v in json(), repeat in 1usize..4, max in prop_oneof![Just(usize::MAX), 0usize..64],
    ) {
        same(shaped(&v, repeat).as_bytes(), max)?;
    }

    #[test]
    fn the_scanner_refuses_what_the_serde_parser_refused(
        v in json(), at in any::<prop::sample::Index>(), byte in any::<u8>(), how in 0..3u8,
    ) {
        let mut body = shaped(&strip_skipped(&v), 1).into_bytes();
        let i = at.index(body.len() + 1);
        match how {
            0 => body.insert(i, byte),
            1 if i < body.len() => { body.remove(i); }
            _ => body.truncate(i),
        }
        same(&body, usize::MAX)?;
    }

    #[test]
    fn a_fault_inside_a_skipped_container_is_not_looked_for(
        v in json(), at in any::<prop::sample::Index>(), byte in any::<u8>(),
    ) {
        // Any byte but a bracket, quote or backslash, inserted anywhere in
        // a list the router skips (except inside an escape), leaves the
        // body read as if the list were not there.
        let filler = if b"[]{}\"\\".contains(&byte) { b'x' } else { byte };
        let inner = shaped(&v, 1);
        let mut body = format!(r#"{{"x":[{inner}],"y":1}}"#).into_bytes();
        let mut i = 6 + at.index(inner.len() + 1);
        // Not inside an escape: before the run of backslashes it follows.
        while body[i - 1] == b'\\' {
            i -= 1;
        }
        body.insert(i, filler);
        prop_assert_eq!(Prompt::parse(&body, usize::MAX).ok(), Prompt::parse(b"{}", 64).ok());
    }

    #[test]
    fn escapes_read_as_the_serde_parser_read_them(s in literal(), at in 0..5usize) {
        let body = match at {
            0 => format!(r#"{{"messages":[{{"role":"user","content":"{s}"}}]}}"#),
            1 => format!(r#"{{"x":["{s}"],"prompt":["{s}",1]}}"#),
            2 => format!(r#"{{"prompt_cache_key":"{s}"}}"#),
            3 => format!(r#"{{"{s}":1,"system":[{{"type":"{s}","text":"a"}}]}}"#),
            _ => format!(r#"{{"messages":[{{"role":"{s}","x":{{"{s}":"{s}"}}}}]}}"#),
        };
        same(body.as_bytes(), usize::MAX)?;
        same(body.as_bytes(), 7)?;
    }
}

#[test]
fn hand_written_edge_cases_agree() {
    let deep = |n: usize, open: &str, close: &str| format!("{}{}", open.repeat(n), close.repeat(n));
    let cases: Vec<String> = [
        "",
        " ",
        "{",
        "}",
        "{}",
        " {} ",
        "{} x",
        "{}}",
        "[]",
        "null",
        "\"x\"",
        r#"{"a":1,}"#,
        r#"{,"a":1}"#,
        r#"{"a" 1}"#,
        r#"{"a":}"#,
        r#"{a:1}"#,
        r#"{"a":[1,]}"#,
        r#"{"a":[,1]}"#,
        r#"{"a":[1 2]}"#,
        r#"{"a":01}"#,
        r#"{"a":1.}"#,
        r#"{"a":.5}"#,
        r#"{"a":1e}"#,
        r#"{"a":1e+}"#,
        r#"{"a":-}"#,
        r#"{"a":+1}"#,
        r#"{"a":tru}"#,
        r#"{"a":nul}"#,
        r#"{"a":True}"#,
        r#"{"a":"\x"}"#,
        r#"{"a":"\u12g4"}"#,
        "{\"a\":\"\u{1}\"}",
        "{\"a\":\"\t\"}",
        r#"{"a":"\ud800"}"#,
        r#"{"\ud800":1}"#,
        r#"{"system":"\ud800"}"#,
        r#"{"system":"\udc00\ud800"}"#,
        r#"{"system":"\ud83d\ude00é"}"#,
        r#"{"prompt":-0}"#,
        r#"{"prompt":[-0]}"#,
        r#"{"prompt":0}"#,
        r#"{"prompt":1.5}"#,
        r#"{"prompt":18446744073709551615}"#,
        r#"{"prompt":18446744073709551616}"#,
        r#"{"prompt":-9223372036854775808}"#,
        r#"{"prompt":-9223372036854775809}"#,
        r#"{"prompt":[true]}"#,
        r#"{"prompt":[{}]}"#,
        r#"{"prompt":[null,"a",[1,[2]]]}"#,
        r#"{"system":1e400}"#,
        r#"{"system":-1e400}"#,
        r#"{"system":1e-400}"#,
        r#"{"system":0e99999999999999}"#,
        r#"{"x":1e400}"#,
        r#"{"system":1.5e308}"#,
        r#"{"messages":null}"#,
        r#"{"messages":[null]}"#,
        r#"{"messages":[[]]}"#,
        r#"{"messages":[{"role":1}]}"#,
        r#"{"messages":[{"role":null,"content":5}]}"#,
        r#"{"messages":[{"content":"a","role":"tool","role":"user"}]}"#,
        r#"{"model":"m","messages":[]}"#,
        r#"{"model":5}"#,
        r#"{"model":""}"#,
        r#"{"model":"a","model":null}"#,
        r#"{"model":["m"]}"#,
        r#"{"prompt_cache_key":1}"#,
        r#"{"prompt_cache_key":null}"#,
        r#"{"prompt_cache_key":"k","prompt_cache_key":null}"#,
        r#"{"cache_salt":"s"}"#,
        r#"{"cache_salt":"s","cache_salt":null}"#,
        r#"{"cache_salt":""}"#,
        r#"{"cache_salt":5}"#,
        r#"{"cache_salt":"s","cache_salt":[1]}"#,
        r#"{"cache_salt":{},"cache_salt":"t\u0041"}"#,
        r#"{"cache_salt":"\ud800"}"#,
        r#"{"cache_s\u0061lt":[1e400]}"#,
        r#"{"cache_prompt":false}"#,
        r#"{"cache_prompt":false,"cache_prompt":true}"#,
        r#"{"cache_prompt":"false"}"#,
        r#"{"cache_prompt":[false]}"#,
        r#"{"cache_prompt":1e400}"#,
        r#"{"cache_prompt":"\ud800"}"#,
        r#"{"cache_prompt":fals}"#,
        r#"{"prompt_logprobs":0}"#,
        r#"{"prompt_logprobs":null}"#,
        r#"{"m\u0065ssages":[{"role":"\u0074ool"}]}"#,
        r#"{"system":{"type":"tool_use","content":[{"text":"a"}],"text":"b"}}"#,
        "{\"system\":\"caf\u{e9}\"}",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!(r#"{{"x":{}}}"#, deep(5000, "[", "]")),
        format!(r#"{{"x":{}}}"#, deep(5000, "{\"a\":", "}")),
        format!(r#"{{"system":{}}}"#, deep(125, "[", "]")),
        format!(r#"{{"system":{}}}"#, deep(126, "[", "]")),
        format!(r#"{{"system":{}}}"#, deep(127, "[", "]")),
        format!(r#"{{"prompt":{}}}"#, deep(126, "[", "]")),
        format!(r#"{{"prompt":{}}}"#, deep(127, "[", "]")),
        format!(r#"{{"system":{}}}"#, "1".repeat(400)),
        format!(r#"{{"x":"{}"}}"#, "\\\"".repeat(100)),
    ])
    .collect();
    // Faults inside a list or object the router skips are not looked for,
    // nor is its depth (serde_json refuses 128 levels of objects).
    let lenient = [
        r#"{"a":[1,]}"#,
        r#"{"a":[,1]}"#,
        r#"{"a":[1 2]}"#,
        r#"{"x":{"a":{"a":{"a":{"a""#,
    ];
    let mut differ = Vec::new();
    for body in &cases {
        for bytes in [
            body.as_bytes().to_vec(),
            [body.as_bytes(), b"\xff"].concat(),
        ] {
            let new = Prompt::parse(&bytes, usize::MAX).ok();
            let old = super::parse(&bytes, usize::MAX).ok();
            if new != old {
                assert!(old.is_none(), "{body}: the scanner refused valid JSON");
                let shown = String::from_utf8_lossy(&bytes);
                differ.push(shown.chars().take(24).collect::<String>());
            }
        }
    }
    assert_eq!(differ, lenient);
    let invalid_utf8 = b"{\"system\":\"a\xc3\"}";
    assert!(Prompt::parse(invalid_utf8, 64).is_err());
    assert!(super::parse(invalid_utf8, 64).is_err());
}
