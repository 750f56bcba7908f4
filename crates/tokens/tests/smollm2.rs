//! SmolLM2's own tokenizer files (built by `scripts/real-engine.sh prepare`
//! from the GGUF the real-engine test serves): ids as llama.cpp gives them,
//! by pieces as whole, and its chat template rendered.

use std::path::PathBuf;

use serde_json::json;
use tokens::ModelTokens;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.real-engine/tokenizer")
}

fn model() -> ModelTokens {
    ModelTokens::load(&dir(), 1 << 20)
        .expect("scripts/real-engine.sh prepare makes .real-engine/tokenizer")
}

#[test]
fn ids_are_llama_cpp_s_whole_and_by_pieces() {
    let m = model();
    assert!(
        m.pieces.by_pieces(),
        "ChatML's special tokens split cleanly"
    );
    assert!(
        m.pieces.ids_only(),
        "byte-level BPE: merged without tokenizers"
    );
    let golden: Vec<serde_json::Value> =
        serde_json::from_str(include_str!("golden/smollm2.json")).expect("golden ids");
    for g in golden {
        let text = g["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(g["ids"].clone()).expect("ids");
        assert_eq!(
            m.pieces.whole(text).expect("whole"),
            want,
            "whole: {text:?}"
        );
        assert_eq!(
            m.pieces.encode(text).expect("pieces"),
            want,
            "pieces: {text:?}"
        );
    }
}

#[test]
fn a_conversation_s_next_turn_tokenizes_only_its_new_pieces() {
    let m = model();
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    let mut asked = 0;
    for turn in 0..5 {
        messages.push(json!({"role": "user", "content": format!("step {turn}: run the tests")}));
        let body = json!({"model": "smollm2", "messages": messages}).to_string();
        let ids = m.chat_ids(body.as_bytes()).expect("ids");
        let text = m.template.render_body(body.as_bytes()).expect("text");
        assert_eq!(ids, m.pieces.whole(&text).expect("whole"), "turn {turn}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
        let (_, encoded) = m.pieces.cache_counts();
        // After the first turn, only the new pieces: the last answer and
        // the new question (the rest, the system prompt, "\n" and the
        // generation prompt, from the cache).
        if turn > 0 {
            assert_eq!(encoded - asked, 2, "turn {turn}");
        }
        asked = encoded;
        messages.push(json!({"role": "assistant", "content": format!("ok {turn}")}));
    }
    // The template's own default system prompt when none is given.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}]}).to_string();
    let text = m.template.render_body(body.as_bytes()).expect("text");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn smollm2_s_next_turn_renders_from_its_new_messages_alone() {
    let m = model();
    assert!(m.template.windowed());
    let message = |v: serde_json::Value| minijinja::Value::from_serialize(v);
    let conversation: Vec<minijinja::Value> = [
        json!({"role": "user", "content": "step 0: run the tests"}),
        json!({"role": "assistant", "content": "ok 0"}),
        json!({"role": "user", "content": "step 1: fix what fails"}),
    ]
    .into_iter()
    .map(message)
    .collect();
    let whole = (m.template)
        .render(minijinja::Value::from(conversation.clone()), None, None)
        .expect("renders");
    let head = (m.template)
        .render_with(
            minijinja::Value::from(conversation[..2].to_vec()),
            None,
            None,
            false,
        )
        .expect("renders");
    let after = (m.template)
        .render_after(
            &conversation[1],
            &conversation[2..],
            None,
            None,
            "<|im_start|>assistant\n",
        )
        .expect("renders");
    assert_eq!(
        after.text,
        "<|im_start|>user\nstep 1: fix what fails<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(head + &after.text, whole);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// Any text: by pieces as whole (special tokens, spaces, newlines,
    /// digits, non-ASCII next to one another).
    #[test]
    fn pieces_encode_as_the_whole_text(parts in proptest::collection::vec(
        proptest::prop_oneof![
            proptest::strategy::Just("<|im_start|>".to_owned()),
            proptest::strategy::Just("<|im_end|>".to_owned()),
            proptest::strategy::Just("<|endoftext|>".to_owned()),
            "[ \n\t]{1,3}",
            "[a-z]{1,6}",
            "[0-9]{1,4}",
            "[.,'!?]{1,2}",
            "[éü日本🤖]{1,2}",
        ],
        0..24,
    )) {
        let m = MODEL.with(|m| m.clone());
        let text = parts.concat();
        proptest::prop_assert_eq!(m.pieces.encode(&text).expect("pieces"), m.pieces.whole(&text).expect("whole"));
    }
}

thread_local! {
    static MODEL: std::sync::Arc<ModelTokens> = std::sync::Arc::new(model());
}

#[test]
fn a_long_new_piece_is_probed_by_its_first_words_and_encoded_only_if_wanted() {
    let m = model();
    let doc = "The quarterly report on the harbour's cranes, and what they lift. ".repeat(200);
    let text =
        format!("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{doc}<|im_end|>\n");
    let whole = m.pieces.whole(&text).expect("whole");
    // Wanted all the way: as `encode`, and the probe's ids are the start
    // of the document's own.
    let mut probes = Vec::new();
    let all = (m.pieces)
        .encode_while(&text, false, |ids, next| {
            probes.push((ids.len(), next.to_vec()));
            true
        })
        .expect("ids");
    assert_eq!(
        (all.ids.as_slice(), all.covered),
        (whole.as_slice(), text.len())
    );
    assert_eq!(probes.len(), 1, "one piece is long: the document's");
    let (before, next) = &probes[0];
    assert!(next.len() > 100, "about 2 KiB of words: {}", next.len());
    assert_eq!(&whole[*before..before + next.len()], next.as_slice());
    // Not wanted: the ids stop before the document, which is not encoded.
    let (_, encoded) = m.pieces.cache_counts();
    let other = text.replace("harbour", "airport");
    let part = m
        .pieces
        .encode_while(&other, false, |_, _| false)
        .expect("ids");
    assert_eq!(part.ids.as_slice(), &whole[..*before]);
    assert_eq!(
        &other[..part.covered],
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>"
    );
    assert_eq!(
        m.pieces.cache_counts().1,
        encoded + 1,
        "the probe's lookup only"
    );
}

#[test]
fn prompts_the_engine_builds_otherwise_are_not_rendered() {
    let m = model();
    let user = json!({"role": "user", "content": "Hi"});
    let image = json!({"role": "user", "content": [{"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]});
    for (body, why) in [
        (json!({"messages": [user], "cache_salt": "t"}), "cache_salt"),
        (
            json!({"messages": [user], "chat_template": "{{ 1 }}"}),
            "chat_template",
        ),
        (
            json!({"messages": [user], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            json!({"messages": [image]}),
            "a content part other than text",
        ),
    ] {
        match m.render(body.to_string().as_bytes()) {
            Err(tokens::TokensError::Unsupported(field)) => assert_eq!(field, why),
            other => panic!("{body}: {other:?}"),
        }
    }
    let texts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "add_generation_prompt": true, "cache_salt": null});
    assert!(m.render(texts.to_string().as_bytes()).is_ok());
}

/// An agent loop's turns, each continued from the one before
/// (`prompt_after` from what `earlier` left), give the ids of the whole
/// render; the fields after the list may change where they do not render.
#[test]
fn a_turn_continued_from_the_one_before_has_the_whole_s_ids() {
    let m = model();
    assert!(m.continues());
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "Fix the tests."}),
    ];
    let mut earlier: Option<(tokens::Earlier, usize)> = None;
    for turn in 0..6 {
        let body =
            json!({"messages": messages, "model": "smollm2", "user": format!("u{}", turn % 2)});
        let body = body.to_string().into_bytes();
        let list_end = body.windows(2).rposition(|w| w == b"}]").expect("list") + 1;
        let ids = m.chat_ids(&body).expect("ids");
        let prompt = match &earlier {
            None => m.prompt(&body, Some(list_end)).expect("renders"),
            Some((e, at)) => m.prompt_after(e, &body, *at).expect("continues"),
        };
        let before = prompt.after_ids;
        assert_eq!(turn == 0, before == 0);
        let new = m.pieces.encode(&prompt.text).expect("ids");
        assert_eq!(&ids[before..], new.as_slice(), "turn {turn}");
        assert_eq!(prompt.len, m.render(&body).expect("renders").len());
        let e = m.earlier(prompt, &new).expect("continuable");
        assert!(e.ids > before && e.ids < ids.len(), "turn {turn}");
        earlier = Some((e, list_end));
        messages.push(json!({"role": "assistant", "content": format!("ran {turn}")}));
        messages.push(json!({"role": "tool", "content": format!("{turn} failed")}));
    }
    // Tools given after the list change the render: not continued.
    let (e, at) = earlier.expect("earlier");
    let body = json!({"messages": messages, "tools": [{"type": "function"}]}).to_string();
    assert!(m.prompt_after(&e, body.as_bytes(), at).is_err());
}
