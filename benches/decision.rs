//! Criterion benches of the whole decision path (parse the body, hash the blocks,
//! look up, record) and of lookup cost against the number of tracked conversations.
//!   cargo bench --bench decision
//! Also prints the prefix index's memory per tracked conversation.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use prefix_router::policy::{
    ContinuationRule, Mode, Policy, PolicyConfig, ReplicaId, ReplicaState,
};
use prefix_router::request::Prompt;
use serde_json::json;

const BLOCK: usize = 1024;

fn policy(max_entries: usize) -> Policy {
    Policy::new(PolicyConfig {
        mode: Mode::Shape,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: BLOCK,
        max_entries,
        load_guard: None,
    })
}

fn fleet(n: u32) -> Vec<ReplicaState> {
    (0..n)
        .map(|i| ReplicaState {
            id: ReplicaId(i),
            live: true,
            in_flight: i % 3,
        })
        .collect()
}

/// An agent conversation of about `bytes` bytes of JSON, tool turns included.
fn agent_body(bytes: usize, salt: usize) -> Vec<u8> {
    let mut messages =
        vec![json!({"role": "system", "content": format!("run {salt}: you are a coding agent. ")})];
    let mut t = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        messages.push(
            json!({"role": "user", "content": format!("step {t}: please look at file {t}.rs")}),
        );
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{t}"), "type": "function", "function": {"name": "read", "arguments": "{}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{t}"), "content": "fn main() { println!(\"hello\"); }\n".repeat(24)}));
        t += 1;
    }
    serde_json::to_vec(&json!({"model": "m", "stream": true, "messages": messages})).unwrap()
}

fn decide(p: &mut Policy, body: &[u8], rs: &[ReplicaState]) -> Option<ReplicaId> {
    let req = match Prompt::parse(body, 8 << 20) {
        Ok(prompt) => prompt.into_request(BLOCK, None),
        Err(_) => return p.spread(rs).replica,
    };
    p.place(&req, rs).replica
}

fn decision_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_path");
    for kib in [4usize, 400] {
        let body = agent_body(kib * 1024, 0);
        let rs = fleet(8);
        let mut p = policy(1 << 20);
        decide(&mut p, &body, &rs);
        g.bench_with_input(BenchmarkId::new("agent_body_kib", kib), &body, |b, body| {
            b.iter(|| decide(&mut p, black_box(body), &rs))
        });
    }
    g.finish();
    // Where the 400 KiB path spends its time.
    let mut g = c.benchmark_group("decision_parts_400kib");
    let body = agent_body(400 * 1024, 0);
    let rs = fleet(8);
    let mut p = policy(1 << 20);
    decide(&mut p, &body, &rs);
    let prompt = Prompt::parse(&body, 8 << 20).unwrap();
    g.bench_function("parse_body", |b| {
        b.iter(|| Prompt::parse(black_box(&body), 8 << 20).unwrap())
    });
    // The same bytes of tool output as one message: what the structure costs.
    let text = "fn main() { println!(\"hello\"); }\n".repeat(400 * 1024 / 36);
    let one =
        serde_json::to_vec(&json!({"messages": [{"role": "tool", "content": text}]})).unwrap();
    g.bench_function("parse_one_message", |b| {
        b.iter(|| Prompt::parse(black_box(&one), 8 << 20).unwrap())
    });
    g.bench_function("json_validate_only", |b| {
        b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap())
    });
    g.bench_function("hash_blocks", |b| {
        b.iter(|| black_box(prompt.clone()).into_request(BLOCK, None))
    });
    let req = prompt.clone().into_request(BLOCK, None);
    g.bench_function("lookup_and_record", |b| {
        b.iter(|| p.place(black_box(&req), &rs))
    });
    g.finish();
}

fn lookup_vs_tracked(c: &mut Criterion) {
    let mut g = c.benchmark_group("lookup_64_replicas");
    g.sample_size(30);
    let rs = fleet(64);
    for conversations in [1_000usize, 1_000_000] {
        let mut p = policy(8 << 20);
        for i in 0..conversations {
            // A 2 KiB canonical prompt each: two blocks plus its end.
            let text = format!("conversation {i:>12} ").repeat(2048 / 26);
            let req = prefix_router::policy::Request {
                chain: p.chain(text.into_bytes(), vec![]),
                model_turn: true,
                messages: 1,
                key: None,
            };
            p.place(&req, &rs);
        }
        let per = p.index_bytes() as f64 / conversations as f64;
        println!(
            "tracked {conversations} conversations of 2 KiB: {} entries, {:.0} bytes per conversation",
            p.tracked_entries(),
            per
        );
        let body = agent_body(4 * 1024, 1);
        decide(&mut p, &body, &rs);
        g.bench_with_input(
            BenchmarkId::new("tracked_conversations", conversations),
            &body,
            |b, body| b.iter(|| decide(&mut p, black_box(body), &rs)),
        );
    }
    g.finish();
}

criterion_group!(benches, decision_path, lookup_vs_tracked);
criterion_main!(benches);
