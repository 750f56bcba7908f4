//! Criterion benches of the whole decision path (parse the body, hash the blocks,
//! look up, record) and of lookup cost against the number of tracked conversations.
//!   cargo bench --bench decision
//! Also prints the prefix index's memory per tracked conversation.

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use prefix_router::exact::{Continuity, Work};
use prefix_router::kv::{EngineBlocks, EngineHash, Event};
use prefix_router::policy::{
    ContinuationRule, Fleet, KvRoom, Mode, Policy, PolicyConfig, PrefixChain, ReplicaId,
    ReplicaState,
};
use prefix_router::request::{Checkpoints, Prompt, Turns};
use serde_json::json;
use std::sync::{Arc, Mutex};
use tokens::ModelTokens;

const BLOCK: usize = 1024;

fn policy(max_entries: usize) -> Policy {
    Policy::new(PolicyConfig {
        mode: Mode::Shape,
        continuation: ContinuationRule::ModelTurn,
        block_bytes: BLOCK,
        max_entries,
        kv_room: KvRoom::Off,
        load_guard: None,
        least_loaded: false,
        singles: None,
        queued_step: 16_384,
        fleet: Fleet::Local,
    })
}

fn fleet(n: u32) -> Vec<ReplicaState> {
    (0..n)
        .map(|i| ReplicaState {
            id: ReplicaId(i),
            name_hash: u64::from(i) << 8,
            live: true,
            in_flight: i % 3,
            waiting: 0,
            queued_bytes: 0,
            engine: None,
            room: None,
            engine_held: None,
            spread: true,
        })
        .collect()
}

/// A one-message prompt of `text` (a continuation when `model_turn`).
fn text_request(text: String, model_turn: bool) -> prefix_router::policy::Request {
    prefix_router::policy::Request {
        chain: PrefixChain::new(text.into_bytes(), vec![], BLOCK),
        model_turn,
        root_end: None,
        hint: None,
        messages: 1,
        key: None,
        cache_bypass: false,
        model: None,
        previous_response_id: None,
        store: true,
        stream: false,
    }
}

/// An agent conversation of about `bytes` bytes of JSON, tool turns included.
fn agent_body(bytes: usize, salt: usize) -> Vec<u8> {
    agent_turns(bytes, salt).0
}

/// An agent conversation of about `bytes` bytes, and its next turn: the
/// same with one more tool call and result.
fn agent_turns(bytes: usize, salt: usize) -> (Vec<u8>, Vec<u8>) {
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
    let body = |m: &[serde_json::Value]| {
        serde_json::to_vec(&json!({"model": "m", "stream": true, "messages": m})).unwrap()
    };
    let turn = body(&messages[..messages.len() - 3]);
    (turn, body(&messages))
}

fn decide(p: &Policy, body: &[u8], rs: &[ReplicaState]) -> Option<ReplicaId> {
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
        let p = policy(1 << 20);
        decide(&p, &body, &rs);
        g.bench_with_input(BenchmarkId::new("agent_body_kib", kib), &body, |b, body| {
            b.iter(|| decide(&p, black_box(body), &rs))
        });
    }
    // The next turn of a conversation whose last turn left a checkpoint.
    let (turn, next) = agent_turns(400 * 1024, 2);
    let (turn, next) = (Bytes::from(turn), Bytes::from(next));
    let rs = fleet(8);
    let p = policy(1 << 20);
    let checkpoints = || {
        let c = Checkpoints::new();
        c.parse(&turn, 8 << 20, BLOCK, 1 << 30, None).unwrap();
        c
    };
    let resumed = checkpoints()
        .parse(&next, 8 << 20, BLOCK, 1 << 30, None)
        .unwrap();
    assert!(resumed.resumed());
    p.place(&resumed.request, &rs);
    // A first turn through the checkpoints: the parse, and the checkpoint it leaves.
    g.bench_function(BenchmarkId::new("agent_first_turn_kib", 400), |b| {
        b.iter_batched(
            Checkpoints::new,
            |c| {
                let parsed = c.parse(black_box(&turn), 8 << 20, BLOCK, 1 << 30, None);
                let replica = p.place(&parsed.unwrap().request, &rs).replica;
                (c, replica)
            },
            criterion::BatchSize::PerIteration,
        )
    });
    g.bench_function(BenchmarkId::new("agent_next_turn_kib", 400), |b| {
        b.iter_batched(
            checkpoints,
            |c| {
                let parsed = c.parse(black_box(&next), 8 << 20, BLOCK, 1 << 30, None);
                let replica = p.place(&parsed.unwrap().request, &rs).replica;
                (c, replica)
            },
            criterion::BatchSize::PerIteration,
        )
    });
    g.finish();
    // Where the 400 KiB path spends its time.
    let mut g = c.benchmark_group("decision_parts_400kib");
    let body = agent_body(400 * 1024, 0);
    let rs = fleet(8);
    let p = policy(1 << 20);
    decide(&p, &body, &rs);
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
        b.iter_batched(
            || prompt.clone(),
            |prompt| prompt.into_request(BLOCK, None),
            criterion::BatchSize::LargeInput,
        )
    });
    let req = prompt.clone().into_request(BLOCK, None);
    g.bench_function("lookup_and_record", |b| {
        b.iter(|| p.place(black_box(&req), &rs))
    });
    g.finish();
}

fn lookup_vs_tracked(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_4kib");
    g.sample_size(30);
    for conversations in [1_000usize, 1_000_000] {
        let p = policy(8 << 20);
        let rs = fleet(64);
        for i in 0..conversations {
            // A 2 KiB canonical prompt each: two blocks plus its end.
            let text = format!("conversation {i:>12} ").repeat(2048 / 26);
            p.place(&text_request(text, true), &rs);
        }
        let per = p.index_bytes() as f64 / conversations as f64;
        println!(
            "tracked {conversations} conversations of 2 KiB: {} entries, {:.0} bytes per conversation",
            p.tracked_entries(),
            per
        );
        let body = agent_body(4 * 1024, 1);
        for replicas in [2u32, 64] {
            let rs = fleet(replicas);
            decide(&p, &body, &rs);
            g.bench_with_input(
                BenchmarkId::new(format!("replicas_{replicas}"), conversations),
                &body,
                |b, body| b.iter(|| decide(&p, black_box(body), &rs)),
            );
        }
    }
    g.finish();
}

/// A single's placement against the fleet's size, as the proxy makes it:
/// the replicas' states read into a kept buffer, then the policy's choice
/// (the counter, over the least loaded with `engine_load`; or a sample of
/// the fleet), 16 in flight.
fn fleet_size(c: &mut Criterion) {
    use prefix_router::config;
    use prefix_router::metrics::Metrics;
    use prefix_router::replicas::{HealthRules, Replicas};
    use std::time::{Duration, Instant};
    let mut g = c.benchmark_group("fleet_size");
    let rules = HealthRules {
        fall: 3,
        rise: 1,
        serving: Duration::from_secs(5),
        interval: Duration::from_secs(1),
        per_second: 0,
    };
    // Distinct questions: each a single whose first block no index holds.
    let requests: Vec<_> = (0..4096)
        .map(|i| {
            let body = json!({"model": "m", "messages": [{"role": "user",
                "content": format!("question {i}: {}", "please summarise these notes. ".repeat(130))}]});
            let prompt = Prompt::parse(&serde_json::to_vec(&body).unwrap(), 8 << 20).unwrap();
            prompt.into_request(BLOCK, None)
        })
        .collect();
    for n in [2usize, 128, 1000] {
        let cfg: Vec<config::Replica> = (0..n)
            .map(|i| config::Replica::at(format!("r{i}"), format!("127.0.0.1:{}", 10_000 + i)))
            .collect();
        let set = Replicas::new(&cfg, Metrics::standalone());
        let view = set.snapshot();
        for r in view.iter() {
            r.on_check(true, false, Instant::now(), &rules);
        }
        let _busy: Vec<_> = view
            .iter()
            .step_by((n / 16).max(1))
            .take(16)
            .map(|r| r.begin(0, 0))
            .collect();
        // As the proxy places: every replica's state, or (`sample`, the
        // default above 64 replicas) a window of 32 and the prefix's holders.
        for (name, least_loaded, sample) in [
            ("counter", false, false),
            ("least_loaded", true, false),
            ("sampled", false, true),
        ] {
            let p = Policy::new(PolicyConfig {
                least_loaded,
                ..policy(1 << 20).config()
            });
            let mut states = Vec::new();
            let mut i = 0;
            g.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| {
                    i = (i + 1) % requests.len();
                    let (view, states) = (&view, &mut states);
                    let req = black_box(&requests[i]);
                    p.place_offered(req, move |holders| {
                        if !(sample && Replicas::sample_into(view, &[], None, holders, 32, states))
                        {
                            Replicas::states_into(view, &[], None, None, states);
                        }
                        states
                    })
                    .replica
                })
            });
        }
    }
    g.finish();
}

/// Placements per second from one and two threads sharing a policy: the
/// sharded index, and the same policy behind one lock (the design before).
fn shared_policy(c: &mut Criterion) {
    let mut g = c.benchmark_group("place_4kib_shared");
    g.sample_size(20);
    let rs = fleet(8);
    let requests: Vec<_> = (0..4096)
        .map(|i| {
            let body = agent_body(4 * 1024, i);
            let prompt = Prompt::parse(&body, 8 << 20).unwrap();
            prompt.into_request(BLOCK, None)
        })
        .collect();
    let sharded = policy(1 << 20);
    let one_lock = std::sync::Mutex::new(policy(1 << 20));
    for threads in [1usize, 2] {
        let run = |iters: u64, place: &(dyn Fn(&prefix_router::policy::Request) + Sync)| {
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for t in 0..threads {
                    let requests = &requests;
                    s.spawn(move || {
                        for i in (t as u64..iters).step_by(threads) {
                            place(&requests[i as usize % requests.len()]);
                        }
                    });
                }
            });
            start.elapsed()
        };
        g.bench_function(BenchmarkId::new("sharded_threads", threads), |b| {
            b.iter_custom(|iters| {
                run(iters, &|r| {
                    black_box(sharded.place(r, &rs));
                })
            })
        });
        g.bench_function(BenchmarkId::new("one_lock_threads", threads), |b| {
            b.iter_custom(|iters| {
                run(iters, &|r| {
                    black_box(one_lock.lock().unwrap().place(r, &rs));
                })
            })
        });
    }
    g.finish();
}

/// A 400 KiB agent turn's tokens as the engines key them (SmolLM2's
/// template and tokenizer, from `scripts/real-engine.sh prepare`), an
/// engine holding the earlier turn: continued from the earlier turn's
/// tokens kept with its checkpoint, and rendered and tokenized whole.
fn exact_turn(c: &mut Criterion) {
    let dir = std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.real-engine/tokenizer"
    ));
    if !dir.exists() {
        eprintln!("exact_400kib skipped: no tokenizer (scripts/real-engine.sh prepare)");
        return;
    }
    let model = |cache| Arc::new(ModelTokens::load(dir, cache).expect("tokenizer"));
    // SmolLM2's template writes a content as a string: the tool calls'
    // null contents as empty ones.
    let rendered = |b: Vec<u8>| {
        let b = String::from_utf8(b)
            .unwrap()
            .replace(r#""content":null"#, r#""content":"""#);
        Bytes::from(b)
    };
    let (turn, next) = agent_turns(400 * 1024, 3);
    let (turn, next) = (rendered(turn), rendered(next));
    let cached = model(1 << 24);
    let ids = cached.chat_ids(&next).expect("tokens");
    let earlier = cached.chat_ids(&turn).expect("tokens");
    println!(
        "exact_400kib: {} bytes, {} tokens ({} new)",
        next.len(),
        ids.len(),
        ids.len() - earlier.len()
    );
    let mut engine = EngineBlocks::new(1 << 20);
    engine.start_empty();
    let n = earlier.len() / 16;
    engine.apply(&Event::Stored {
        hashes: (1..=n as u64).map(EngineHash).collect(),
        parent: None,
        tokens: earlier[..n * 16].to_vec(),
        block_size: 16,
        namespace: 0,
    });
    let known = [Arc::new(Mutex::new(engine))];
    let work = |m: &Arc<ModelTokens>, body: &Bytes, turns, store: &Arc<Checkpoints>| Work {
        tokens: Arc::clone(m),
        body: body.clone(),
        known: known.to_vec(),
        max_bytes: usize::MAX,
        continuity: Continuity {
            turns,
            checkpoints: Arc::clone(store),
            budget: 1 << 30,
        },
    };
    // The first turn through a store of checkpoints, its tokens kept with
    // its checkpoint; the next turn's checkpoints (resumed from, left).
    let next_turns = |m: &Arc<ModelTokens>| {
        let store = Arc::new(Checkpoints::new());
        let parse = |body: &Bytes| store.parse(body, 8 << 20, BLOCK, 1 << 30, None).unwrap();
        let kept = work(m, &turn, parse(&turn).turns, &store).tokenize(true);
        assert!(kept.is_ok_and(|t| t.is_some()));
        let next = parse(&next);
        assert!(next.resumed());
        (next.turns, store)
    };
    let mut g = c.benchmark_group("exact_400kib");
    let go = |m: &Arc<ModelTokens>, (turns, store): &(Turns, Arc<Checkpoints>)| {
        let tokenized = work(m, black_box(&next), turns.clone(), store).tokenize(true);
        let (chat, _) = tokenized.ok().flatten().expect("tokens");
        assert_eq!(chat.len, ids.len());
        chat
    };
    let second = next_turns(&cached);
    assert!(go(&cached, &second).continued);
    g.bench_function("next_turn_continued", |b| b.iter(|| go(&cached, &second)));
    // No piece cache: the new messages' text through `tokenizers` each time
    // (the earlier turn kept by the same model: another's is not continued).
    let uncached = model(0);
    let second_uncached = next_turns(&uncached);
    assert!(go(&uncached, &second_uncached).continued);
    g.bench_function("next_turn_continued_new_text_uncached", |b| {
        b.iter(|| go(&uncached, &second_uncached))
    });
    let new_text = {
        let (a, b) = (cached.render(&turn).unwrap(), cached.render(&next).unwrap());
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        b[common..].to_owned()
    };
    g.bench_function("tokenizers_on_the_new_text", |b| {
        b.iter(|| cached.pieces.whole(black_box(&new_text)).unwrap())
    });
    // A cold turn as the router meets it: the piece cache holds the
    // earlier turns' pieces, none of the new ones (each iteration's new
    // messages say something else), against `tokenizers` on that new text.
    let new_from = turn
        .iter()
        .zip(next.iter())
        .take_while(|(x, y)| x == y)
        .count();
    let mut n = 0u32;
    let mut unseen = |text: &[u8], from: usize| {
        n += 1;
        let mut text = text.to_vec();
        for (word, width) in [(&b"please"[..], 6), (b"hello", 5)] {
            let at = (text[from..].windows(word.len()).rposition(|w| w == word)).unwrap() + from;
            let stamp = format!("{n:0width$}");
            text[at..at + width].copy_from_slice(&stamp.as_bytes()[stamp.len() - width..]);
        }
        text
    };
    // Each continues the earlier turn's checkpoint (which a parse through
    // its store would replace by the one it leaves); what it leaves is kept
    // in a store of its own.
    let from = second.0.from.clone();
    g.bench_function("next_turn_continued_new_text_unseen", |b| {
        b.iter_batched(
            || {
                let body = Bytes::from(unseen(&next, new_from));
                let store = Arc::new(Checkpoints::new());
                let left = store.parse(&body, 8 << 20, BLOCK, 1 << 30, None).unwrap();
                let from = from.clone();
                let turns = Turns { from, ..left.turns };
                (body, turns, store)
            },
            |(body, turns, store)| {
                let tokenized = work(&cached, &body, turns, &store).tokenize(true);
                let (chat, _) = tokenized.ok().flatten().expect("tokens");
                assert!(chat.continued);
                chat
            },
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("tokenizers_on_the_new_text_unseen", |b| {
        b.iter_batched(
            || String::from_utf8(unseen(new_text.as_bytes(), 0)).unwrap(),
            |text| cached.pieces.whole(&text).unwrap(),
            criterion::BatchSize::SmallInput,
        )
    });
    g.sample_size(20);
    let alone = (Turns::default(), Arc::new(Checkpoints::new()));
    g.bench_function("next_turn_whole_every_piece_cached", |b| {
        b.iter(|| go(&cached, &alone))
    });
    g.finish();
}

/// The capacity watch's pass over the index (every 500 ms, off the request
/// path but on its core, a shard locked at a time): the distinct blocks
/// placed per replica within the window, with the index full of recent
/// entries (the default 1M, 2 KiB singles spread over 1,000 replicas and
/// the window's 300 s); one single placed before each, since an index
/// unchanged since the last pass is not read again (`unchanged`: that ask).
fn working_set(c: &mut Criterion) {
    let mut g = c.benchmark_group("working_set");
    g.sample_size(10);
    let p = policy(1 << 20);
    let rs = fleet(1000);
    for i in 0..400_000 {
        p.set_clock(i * 300 / 400_000);
        let text = format!("single {i:>12} ").repeat(2048 / 20);
        p.place(&text_request(text, false), &rs);
    }
    println!("working_set: {} entries tracked", p.tracked_entries());
    let mut i = 400_000;
    g.bench_function("full_index_1000_replicas", |b| {
        b.iter(|| {
            i += 1;
            let text = format!("single {i:>12} ").repeat(2048 / 20);
            p.place(&text_request(text, false), &rs);
            black_box(p.working_set(300))
        })
    });
    g.bench_function("unchanged", |b| b.iter(|| black_box(p.working_set(300))));
    g.bench_function("forget_before_full_index", |b| {
        b.iter(|| black_box(p.forget_before(rs[5].id, 1)))
    });
    g.finish();
}

/// The usage scan every answer passes through: an SSE event of vLLM's
/// shape, its closing usage event, and a non-streamed 4 KiB answer of code
/// (no quote in its text).
fn usage_scan(c: &mut Criterion) {
    use prefix_router::usage::UsageScan;
    let delta = br#"data: {"id":"chatcmpl-8f3c2a7d9e0b4c1f","object":"chat.completion.chunk","created":1733400000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null}]}

"#;
    let last = br#"data: {"id":"chatcmpl-8f3c2a7d9e0b4c1f","object":"chat.completion.chunk","created":1733400000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":81564,"total_tokens":81596,"completion_tokens":32,"prompt_tokens_details":{"cached_tokens":80016}}}

"#;
    let code = format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":900,"completion_tokens":1000,"prompt_tokens_details":{{"cached_tokens":512}}}}}}"#,
        "def read_config(path_name):\n    with open(path_name) as file_handle:\n        return parse_yaml(file_handle.read())\n".repeat(4096 / 110)
    );
    let mut g = c.benchmark_group("usage_scan");
    for (name, body) in [
        ("sse_delta_event", &delta[..]),
        ("sse_usage_event", &last[..]),
        ("answer_4kib_code", code.as_bytes()),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut s = UsageScan::default();
                s.feed(black_box(body));
                black_box(s.figures())
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    fleet_size,
    decision_path,
    lookup_vs_tracked,
    shared_policy,
    exact_turn,
    working_set,
    usage_scan
);
criterion_main!(benches);
