//! A long agent conversation's prompt through the chat template and the
//! tokenizer (SmolLM2's, from `scripts/real-engine.sh prepare`): whole, the
//! next turn's new messages alone, and the next turn with every earlier
//! piece in the cache.
//!   cargo bench -p tokens

use std::path::PathBuf;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tokens::ModelTokens;

/// About `tokens` tokens of an agent loop: tool calls and code-like output.
fn conversation(turns: usize) -> Vec<serde_json::Value> {
    let mut m = vec![serde_json::json!({"role": "system",
        "content": "You are a coding agent. Run the tests, read the failures, fix the code."})];
    for t in 0..turns {
        m.push(serde_json::json!({"role": "user", "content": format!("Step {t}: run the suite and fix what fails.")}));
        let output: String = (0..40)
            .map(|l| {
                format!(
                    "tests/test_{t}_{l}.py::case_{l} FAILED assert x[{l}] == {}\n",
                    l * 7 % 13
                )
            })
            .collect();
        m.push(serde_json::json!({"role": "assistant", "content": format!("Ran the suite (turn {t}):\n{output}")}));
    }
    m
}

fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "smollm2", "messages": messages}))
        .expect("json")
}

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.real-engine/tokenizer");
    let model = ModelTokens::load(&dir, 1 << 24).expect("scripts/real-engine.sh prepare");
    let turns = conversation(120);
    let earlier = body(&turns[..turns.len() - 2]);
    let next = body(&turns);
    let text = model.template.render_body(&next).expect("renders");
    let ids = model.pieces.whole(&text).expect("ids");
    eprintln!(
        "conversation: {} bytes of JSON, {} tokens",
        next.len(),
        ids.len()
    );
    c.bench_function("render the chat template", |b| {
        b.iter(|| {
            model
                .template
                .render_body(black_box(&next))
                .expect("renders")
        })
    });
    c.bench_function("tokenize the whole prompt (tokenizers, no cache)", |b| {
        b.iter(|| model.pieces.whole(black_box(&text)).expect("ids"))
    });
    let messages: Vec<minijinja::Value> = (turns.iter())
        .map(minijinja::Value::from_serialize)
        .collect();
    let n = messages.len();
    assert!(model.template.windowed());
    c.bench_function(
        "the next turn's new messages rendered after the last earlier one",
        |b| {
            b.iter(|| {
                (model.template)
                    .render_after(
                        black_box(&messages[n - 3]),
                        &messages[n - 2..],
                        None,
                        None,
                        "<|im_start|>assistant\n",
                    )
                    .expect("renders")
            })
        },
    );
    model.chat_ids(&earlier).expect("warms the cache");
    model.chat_ids(&next).expect("and the new pieces");
    c.bench_function("the next turn: render, split, every piece cached", |b| {
        b.iter(|| model.chat_ids(black_box(&next)).expect("ids"))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
