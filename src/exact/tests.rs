//! `exact`: tokens as far as engines hold them, and a conversation's turns
//! continued from the one before.

use super::*;
use crate::kv::{EngineHash, Event};

/// SmolLM2's tokenizer (`scripts/real-engine.sh prepare` makes it).
fn model() -> ModelTokens {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/.real-engine/tokenizer");
    ModelTokens::load(Path::new(dir), 1 << 20).expect("scripts/real-engine.sh prepare")
}

/// An engine holding the whole 16-token blocks of `ids`.
fn engine_holding(ids: &[u32]) -> Arc<Mutex<EngineBlocks>> {
    let mut b = EngineBlocks::new(1 << 16);
    b.start_empty();
    let n = ids.len() / 16;
    b.apply(&Event::Stored {
        hashes: (1..=n as u64).map(EngineHash).collect(),
        parent: None,
        tokens: ids[..n * 16].to_vec(),
        block_size: 16,
        namespace: 0,
    });
    Arc::new(Mutex::new(b))
}

/// Keys of the whole 16-token blocks of `ids`.
fn keys(ids: &[u32]) -> Vec<(u32, Vec<u64>)> {
    vec![(16, crate::kv::chain_keys(0, None, ids, 16))]
}

/// Tokenized alone: no turn to continue, none left.
fn alone(
    m: &Arc<ModelTokens>,
    body: &[u8],
    known: &[Arc<Mutex<EngineBlocks>>],
    max: usize,
) -> Option<Chat> {
    let continuity = Continuity {
        turns: Turns::default(),
        checkpoints: Arc::new(Checkpoints::new()),
        budget: 0,
    };
    work(m, body, known, max, continuity).map(|(chat, _)| chat)
}

/// `Work::tokenize`, rendering whole where it does not continue.
fn work(
    m: &Arc<ModelTokens>,
    body: &[u8],
    known: &[Arc<Mutex<EngineBlocks>>],
    max_bytes: usize,
    continuity: Continuity,
) -> Tokenized {
    let work = Work {
        tokens: Arc::clone(m),
        body: bytes::Bytes::copy_from_slice(body),
        known: known.to_vec(),
        max_bytes,
        continuity,
    };
    work.tokenize(true).ok().flatten()
}

fn body(doc: &str) -> Vec<u8> {
    serde_json::json!({"messages": [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": doc}]})
    .to_string()
    .into_bytes()
}

#[test]
fn a_prompt_is_tokenized_as_far_as_some_engine_holds_it() {
    let m = Arc::new(model());
    let held = "The harbour cranes lift containers all day long. ".repeat(100);
    let ids = m.chat_ids(&body(&held)).expect("ids");
    let engine = [engine_holding(&ids)];
    let chat = alone(&m, &body(&held), &engine, usize::MAX).expect("tokens");
    assert_eq!(
        (chat.keys, chat.len, chat.total),
        (keys(&ids), ids.len(), ids.len())
    );
    // Another document after the same system prompt: its first words
    // are held nowhere, so the rest is not tokenized.
    let other = "Airport gates open at dawn for the first flights out. ".repeat(100);
    let chat = alone(&m, &body(&other), &engine, usize::MAX).expect("tokens");
    assert!(chat.len < 16, "stopped before the document: {}", chat.len);
    let whole = m.chat_ids(&body(&other)).expect("ids").len();
    assert!(
        chat.total > whole / 2 && chat.total < whole * 2,
        "{} ~ {whole}",
        chat.total
    );
    // Held by an engine, not in this router's cache (another router
    // placed it): its first words place it, an engine holding them all
    // is taken to hold the rest of the piece (`assumed`).
    let elsewhere = "Rail timetables for the coming winter season. ".repeat(100);
    let ids = model().chat_ids(&body(&elsewhere)).expect("ids");
    let engine = [engine_holding(&ids)];
    let chat = alone(&m, &body(&elsewhere), &engine, usize::MAX).expect("tokens");
    assert!(chat.len < ids.len() / 2, "{} of {}", chat.len, ids.len());
    assert_eq!(chat.keys, keys(&ids[..chat.len]));
    let whole = chat.len + chat.assumed;
    assert!(
        whole > ids.len() * 3 / 4 && whole < ids.len() * 5 / 4,
        "{whole} ~ {}",
        ids.len()
    );
    // No engine with a block size yet (nothing heard): none holds it.
    let none = [Arc::new(Mutex::new(EngineBlocks::new(16)))];
    let third = "Weather reports for the northern coast this week. ".repeat(100);
    let chat = alone(&m, &body(&third), &none, usize::MAX).expect("tokens");
    assert!(chat.len < 16, "{}", chat.len);
    // Not matched: a prompt past the bound, or one with a salt.
    assert!(alone(&m, &body(&held), &engine, 1000).is_none());
    let mut salted: serde_json::Value = serde_json::from_slice(&body(&held)).expect("json");
    salted["cache_salt"] = "tenant-a".into();
    let salted = salted.to_string().into_bytes();
    assert!(alone(&m, &salted, &engine, usize::MAX).is_none());
}

/// An agent loop's bodies, each over the checkpoints' least: a long
/// system prompt, then per turn a tool call and its result (with the
/// fields after the list as clients send them).
fn agent(turns: usize) -> Vec<bytes::Bytes> {
    let system = "You are a coding agent. Fix the failing tests. ".repeat(800);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": "Run the suite."}),
    ];
    let mut bodies = Vec::new();
    for t in 0..turns {
        // (Keys in their order: `user` after the list, changing.)
        let body = serde_json::json!({"model": "m", "messages": messages,
            "stream": true, "user": format!("turn {t}")});
        bodies.push(bytes::Bytes::from(body.to_string()));
        messages.push(serde_json::json!({"role": "assistant", "content": "",
            "tool_calls": [{"id": format!("c{t}"), "type": "function",
            "function": {"name": "run", "arguments": "{}"}}]}));
        let output: String = (0..30)
            .map(|l| format!("test_{t}_{l} FAILED line {}\n", l * 7))
            .collect();
        messages.push(
            serde_json::json!({"role": "tool", "tool_call_id": format!("c{t}"),
            "content": output}),
        );
    }
    bodies
}

/// Each turn through the checkpoints as the proxy reads it.
fn turns(
    m: &Arc<ModelTokens>,
    bodies: &[bytes::Bytes],
    known: &[Arc<Mutex<EngineBlocks>>],
    mut check: impl FnMut(usize, &Turns, Option<Chat>, Option<Later>),
) {
    let checkpoints = Arc::new(Checkpoints::new());
    for (n, b) in bodies.iter().enumerate() {
        let parsed = checkpoints
            .parse(b, usize::MAX, 64, 1 << 30, None)
            .expect("parses");
        let continuity = Continuity {
            turns: parsed.turns.clone(),
            checkpoints: Arc::clone(&checkpoints),
            budget: 1 << 30,
        };
        let (chat, later) = work(m, b, known, usize::MAX, continuity).unzip();
        check(n, &parsed.turns, chat, later.flatten());
    }
}

#[test]
fn a_turn_continued_from_the_one_before_is_tokenized_as_the_whole() {
    let m = Arc::new(model());
    assert!(m.continues());
    let bodies = agent(5);
    // Every piece in the cache, an engine holding it all: nothing is
    // left for later, each turn keeps what the next continues from.
    let all = m.chat_ids(&bodies[4]).expect("ids");
    let engine = [engine_holding(&all)];
    bodies.iter().for_each(|b| drop(m.chat_ids(b)));
    turns(&m, &bodies, &engine, |n, turns, chat, later| {
        let from = turns.from.as_ref();
        assert_eq!(
            from.is_some_and(|f| f.kept::<Memo>().is_some()),
            n > 0,
            "turn {n}"
        );
        assert!(
            turns
                .left
                .as_ref()
                .is_some_and(|l| l.kept::<Memo>().is_some()),
            "turn {n}"
        );
        assert!(later.is_none());
        let ids = m.chat_ids(&bodies[n]).expect("ids");
        let want = Chat {
            keys: keys(&ids),
            len: ids.len(),
            total: ids.len(),
            assumed: 0,
            continued: n > 0,
        };
        assert_eq!(chat, Some(want), "turn {n}");
    });
    // Another model's tokenizer (another `tokenizers` entry, or a
    // reload) does not continue this one's turn.
    let other = Arc::new(model());
    bodies.iter().for_each(|b| drop(other.chat_ids(b)));
    let checkpoints = Arc::new(Checkpoints::new());
    let mut by = [&m, &other]
        .into_iter()
        .zip(&bodies[1..3])
        .map(|(model, b)| {
            let parsed = (checkpoints.parse(b, usize::MAX, 64, 1 << 30, None)).expect("parses");
            let continuity = Continuity {
                turns: parsed.turns,
                checkpoints: Arc::clone(&checkpoints),
                budget: 1 << 30,
            };
            work(model, b, &engine, usize::MAX, continuity)
                .expect("tokens")
                .0
        });
    let (first, second) = (by.next().expect("one"), by.next().expect("two"));
    assert!(!first.continued && !second.continued);
    let ids = m.chat_ids(&bodies[2]).expect("ids");
    assert_eq!((second.keys, second.len), (keys(&ids), ids.len()));
    // A turn whose fields after the list change what renders (tools
    // given) is rendered whole, and still the same.
    let mut changed: serde_json::Value = serde_json::from_slice(&bodies[2]).expect("json");
    changed["tools"] = serde_json::json!([{"type": "function", "function": {"name": "run"}}]);
    let changed = bytes::Bytes::from(changed.to_string());
    let two = [bodies[1].clone(), changed.clone()];
    turns(&m, &two, &engine, |n, _, chat, _| {
        let ids = m.chat_ids(&two[n]).expect("ids");
        assert_eq!(chat.map(|c| (c.keys, c.len)), Some((keys(&ids), ids.len())));
    });
}

#[test]
fn a_turn_stopped_where_no_engine_holds_it_is_tokenized_whole_later_for_the_next() {
    let reference = model();
    let bodies = agent(4);
    // An engine holding the first turn only; no piece cached.
    let first = reference.chat_ids(&bodies[0]).expect("ids");
    let engine = [engine_holding(&first)];
    let m = Arc::new(model());
    turns(&m, &bodies, &engine, |n, turns, chat, later| {
        let chat = chat.expect("tokens");
        let kept = |t: &Option<Turn>| t.as_ref().is_some_and(|t| t.kept::<Memo>().is_some());
        match n {
            // Read once: tokenized no further than engines hold, and
            // nothing left for later (a body may never come again).
            0 => assert!(later.is_none() && !kept(&turns.left)),
            // Resumed: the rest is tokenized off the path; then kept.
            1 => {
                assert!(
                    chat.len < chat.total,
                    "stopped: {} of {}",
                    chat.len,
                    chat.total
                );
                let later = later.expect("left for later");
                assert!(!kept(&turns.left));
                later.run();
                assert!(kept(&turns.left));
            }
            // Continued: only the new messages, short pieces all
            // tokenized, kept at once.
            _ => {
                assert!(kept(&turns.from) && kept(&turns.left), "turn {n}");
                assert!(later.is_none() && chat.len == chat.total, "turn {n}");
            }
        }
        let ids = reference.chat_ids(&bodies[n]).expect("ids");
        assert_eq!(chat.keys, keys(&ids[..chat.len]), "turn {n}");
    });
}
