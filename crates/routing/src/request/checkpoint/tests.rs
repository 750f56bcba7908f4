//! Checkpoints: resumed reads equal whole reads, budgets, eviction, races.

use super::*;
use proptest::prelude::*;

/// What a request must equal: the parse from the first byte.
fn whole(body: &[u8], max: usize, block_bytes: usize) -> Option<Request> {
    let prompt = Prompt::parse(body, max).ok()?;
    Some(prompt.into_request(block_bytes, None))
}

fn same(a: Option<&Request>, b: Option<&Request>) -> std::result::Result<(), TestCaseError> {
    let view = |r: Option<&Request>| {
        r.map(|r| {
            let c = &r.chain;
            let text = c.text.to_vec();
            let shape = (r.model_turn, r.root_end, r.messages, r.cache_bypass);
            let names = (r.key.clone(), r.model.clone());
            (text, c.blocks.clone(), c.message_ends.clone(), shape, names)
        })
    };
    prop_assert_eq!(view(a), view(b));
    Ok(())
}

/// A JSON string: escaped by serde_json, or written with the escapes a
/// client may choose.
fn string() -> impl Strategy<Value = String> {
    let text = "[a-z \"\\\\\n\t\u{1}é]{0,24}".prop_map(|s| serde_json::json!(s).to_string());
    let pieces = prop::collection::vec(
        prop_oneof![
            "[a-z ]{1,8}",
            Just(r"\u0041".to_owned()),
            Just(r"\/".to_owned()),
            Just(r"\ud83d\ude00".to_owned()),
            Just(r"\n".to_owned()),
        ],
        0..6,
    );
    prop_oneof![3 => text, 1 => pieces.prop_map(|p| format!("\"{}\"", p.concat()))]
}

fn content() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => string(),
        1 => Just("null".to_owned()),
        1 => string().prop_map(|t| format!(r#"[{{"type":"text","text":{t}}}]"#)),
        1 => string().prop_map(|t| format!(r#"[{{"type":"tool_result","tool_use_id":"t","content":{t}}}]"#)),
    ]
}

fn message() -> impl Strategy<Value = String> {
    let role = prop::sample::select(vec!["user", "assistant", "tool", "system", "x"]);
    (role, content(), any::<bool>(), any::<bool>()).prop_map(|(role, c, flip, calls)| {
        let calls = if calls {
            r#","tool_calls":[{"id":"c"}]"#
        } else {
            ""
        };
        match flip {
            false => format!(r#"{{"role":"{role}","content":{c}{calls}}}"#),
            true => format!(r#"{{"content":{c}{calls}, "role" : "{role}"}}"#),
        }
    })
}

/// Top-level fields other than the list.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        string().prop_map(|s| format!(r#""model":{s}"#)),
        content().prop_map(|s| format!(r#""system":{s}"#)),
        string().prop_map(|s| format!(r#""prompt_cache_key":{s}"#)),
        prop::sample::select(vec![
            r#""cache_salt":"s""#,
            r#""cache_salt":null"#,
            r#""cache_salt":1"#
        ])
        .prop_map(str::to_owned),
        Just(r#""stream":true"#.to_owned()),
        Just(r#""tools":[{"type":"function","function":{"name":"f"}}]"#.to_owned()),
        Just(r#""prompt":"p""#.to_owned()),
        prop::collection::vec(message(), 0..3)
            .prop_map(|m| format!(r#""messages":[{}]"#, m.join(","))),
    ]
}

/// A conversation's turns: the fields before its list, its messages
/// turn by turn, and the fields after it on each turn.
#[derive(Debug, Clone)]
struct Turns {
    before: Vec<String>,
    turns: Vec<Vec<String>>,
    after: Vec<Vec<String>>,
}

fn turns() -> impl Strategy<Value = Turns> {
    let fields = || prop::collection::vec(field(), 0..3);
    let turn = prop::collection::vec(message(), 0..4);
    // Past the pieces a text holds at most (see `policy::text`).
    let n = 3..=10;
    (fields(), prop::collection::vec((turn, fields()), n)).prop_map(|(before, t)| Turns {
        before,
        turns: t.iter().map(|(m, _)| m.clone()).collect(),
        after: t.into_iter().map(|(_, a)| a).collect(),
    })
}

impl Turns {
    /// The body of turn `n`: every message so far.
    fn body(&self, n: usize) -> String {
        let messages: Vec<&String> = self.turns[..=n].iter().flatten().collect();
        let list = format!(
            r#""messages":[{}]"#,
            messages
                .iter()
                .map(|m| m.as_str())
                .collect::<Vec<_>>()
                .join(",")
        );
        // Past the head, wherever the list ends.
        let mut fields = vec![format!(r#""user":"{}""#, "u".repeat(HEAD))];
        fields.extend(self.before.iter().cloned());
        fields.push(list);
        fields.extend(self.after[n].iter().cloned());
        format!("{{{}}}", fields.join(","))
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_resumed_parse_reads_what_a_parse_from_the_start_reads(
        t in turns(),
        max in prop_oneof![Just(usize::MAX), 0usize..400],
        block_bytes in prop_oneof![Just(1024usize), 1usize..24],
        fault in prop::option::of((any::<prop::sample::Index>(), any::<u8>(), 0..3u8)),
    ) {
        let store = Checkpoints::with_min_body(0);
        let mut left = false;
        for n in 0..t.turns.len() {
            let mut body = t.body(n).into_bytes();
            // The last turn, with a byte inserted, removed or cut past
            // the middle of the turn before.
            if let (Some((at, byte, how)), true) = (fault, n + 1 == t.turns.len()) {
                let prefix = t.body(n - 1).len().min(body.len()) / 2;
                let i = prefix + at.index(body.len() - prefix + 1);
                match how {
                    0 => body.insert(i, byte),
                    1 if i < body.len() => { body.remove(i); }
                    _ => body.truncate(i),
                }
            }
            let body = Bytes::from(body);
            let got = store.parse(&body, max, block_bytes, 1 << 30, None).ok();
            let want = whole(&body, max, block_bytes);
            same(got.as_ref().map(|p| &p.request), want.as_ref())?;
            // A turn after one that left a checkpoint at the end of the
            // list it extends resumes from it.
            if fault.is_none() && left {
                prop_assert!(got.is_some_and(|p| p.resumed()), "turn {} did not resume", n);
            }
            let relisted = t.after[n].iter().any(|f| f.starts_with(r#""messages""#));
            left = !relisted && store.entries().iter().any(|c| c.body == body);
        }
    }
}

/// A conversation of `turns` turns of about 1 KiB each.
fn conversation(turns: usize) -> Vec<Bytes> {
    let mut messages = Vec::new();
    (0..turns)
        .map(|t| {
            messages.push(format!(
                r#"{{"role":"user","content":"{t}: {}"}}"#,
                "x".repeat(1000)
            ));
            let body = format!(
                r#"{{"model":"m","messages":[{}],"stream":true}}"#,
                messages.join(",")
            );
            Bytes::from(body)
        })
        .collect()
}

#[test]
fn a_conversation_keeps_one_checkpoint_its_latest_turn() {
    let store = Checkpoints::with_min_body(0);
    let bodies = conversation(5);
    for (n, body) in bodies.iter().enumerate() {
        let parsed = store.parse(body, usize::MAX, 64, 1 << 30, None).unwrap();
        assert_eq!(parsed.resumed(), n > 0);
    }
    let entries = store.entries();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].body, bodies[4]);
}

#[test]
fn a_resumed_turn_shares_the_text_it_resumed_from() {
    let store = Checkpoints::with_min_body(0);
    let parse = |body| store.parse(body, usize::MAX, 64, 1 << 30, None).unwrap();
    // A long system prompt, then turns of about 1 KiB: the first turn's
    // text stays shared (later ones merge among themselves).
    let system = format!(r#"{{"role":"system","content":"{}"}},"#, "s".repeat(40_000));
    let bodies = conversation(30).into_iter().map(|b| {
        let b = String::from_utf8(b.to_vec()).unwrap();
        Bytes::from(b.replacen(r#""messages":["#, &format!(r#""messages":[{system}"#), 1))
    });
    let bodies: Vec<Bytes> = bodies.collect();
    let first = parse(&bodies[0]).request;
    for body in &bodies[1..] {
        let next = parse(body);
        assert!(next.resumed());
        assert!(next.request.chain.text.shares_with(&first.chain.text));
        let want = whole(body, usize::MAX, 64).unwrap();
        assert_eq!(next.request.chain.text, want.chain.text);
        assert_eq!(next.request.chain.blocks, want.chain.blocks);
    }
}

#[test]
fn the_budget_drops_the_least_recently_used() {
    let a = conversation(3);
    let b: Vec<Bytes> = conversation(3)
        .into_iter()
        .map(|x| Bytes::from(String::from_utf8_lossy(&x).replace("\"m\"", "\"n\"")))
        .collect();
    let probe = Checkpoints::with_min_body(0);
    probe.parse(&a[0], usize::MAX, 64, 1 << 30, None).unwrap();
    let one = probe.bytes();
    // Room for about two first turns.
    let (store, budget) = (Checkpoints::with_min_body(0), one * 5 / 2);
    let parse = |body: &Bytes| store.parse(body, usize::MAX, 64, budget, None).unwrap();
    parse(&a[0]);
    parse(&b[0]);
    assert_eq!(store.entries().len(), 2);
    // Using a's makes b's the oldest; a's second turn needs the room.
    assert!(parse(&a[1]).resumed());
    assert!(store.bytes() <= budget);
    assert!(!parse(&b[1]).resumed());
    // No budget: nothing kept.
    let none = Checkpoints::with_min_body(0);
    none.parse(&a[0], usize::MAX, 64, 0, None).unwrap();
    assert!(!none
        .parse(&a[1], usize::MAX, 64, 0, None)
        .unwrap()
        .resumed());
    assert_eq!(none.bytes(), 0);
}

#[test]
fn a_full_store_is_trimmed_below_its_budget_not_at_every_new_checkpoint() {
    let first_turn = |i: usize| {
        let body =
            String::from_utf8_lossy(&conversation(1)[0]).replace("\"m\"", &format!("\"m{i}\""));
        Bytes::from(body)
    };
    let probe = Checkpoints::with_min_body(0);
    probe
        .parse(&first_turn(0), usize::MAX, 64, 1 << 30, None)
        .unwrap();
    let budget = probe.bytes() * 40;
    let store = Checkpoints::with_min_body(0);
    let mut trims = 0;
    for i in 0..100 {
        let before = store.entries().len();
        store
            .parse(&first_turn(i), usize::MAX, 64, budget, None)
            .unwrap();
        assert!(store.bytes() <= budget);
        if store.entries().len() <= before {
            trims += 1;
            assert!(store.bytes() <= budget - budget / TRIM_SLACK);
        }
    }
    // 60 checkpoints past a full store: a trim every few, not each.
    assert!((1..=25).contains(&trims), "{trims} trims");
}

#[test]
fn a_checkpoint_larger_than_what_a_trim_leaves_is_not_kept_and_displaces_none() {
    let (a, b) = (conversation(1), conversation(3));
    let probe = Checkpoints::with_min_body(0);
    probe.parse(&b[2], usize::MAX, 64, 1 << 30, None).unwrap();
    let large = probe.bytes();
    // b's third turn fits the budget but not the 15/16 a trim leaves.
    let budget = large + large / 32;
    let store = Checkpoints::with_min_body(0);
    store.parse(&a[0], usize::MAX, 64, budget, None).unwrap();
    let small = store.bytes();
    assert!(small > 0 && large > budget - budget / TRIM_SLACK);
    store.parse(&b[2], usize::MAX, 64, budget, None).unwrap();
    assert_eq!(
        store.bytes(),
        small,
        "a's checkpoint stays, b's is not kept"
    );
}

#[test]
fn a_body_that_differs_before_the_checkpoint_is_read_from_the_start() {
    let store = Checkpoints::with_min_body(0);
    let bodies = conversation(2);
    store
        .parse(&bodies[0], usize::MAX, 64, 1 << 30, None)
        .unwrap();
    // The same length and window, one byte changed in the middle.
    let mut forged = bodies[1].to_vec();
    forged[400] = b'y';
    let forged = Bytes::from(forged);
    let parsed = store.parse(&forged, usize::MAX, 64, 1 << 30, None).unwrap();
    assert!(!parsed.resumed());
    let want = whole(&forged, usize::MAX, 64).unwrap();
    assert_eq!(parsed.request.chain.text, want.chain.text);
}

#[test]
fn a_lowered_budget_is_kept_at_the_next_body_and_one_too_large_displaces_none() {
    let store = Checkpoints::with_min_body(0);
    let (a, b) = (conversation(2), conversation(4));
    store.parse(&a[0], usize::MAX, 64, 1 << 30, None).unwrap();
    let one = store.bytes();
    // b's first turn is larger than the budget: not kept, a's stays.
    store.parse(&b[3], usize::MAX, 64, one + 1, None).unwrap();
    assert_eq!(store.bytes(), one);
    assert!(store
        .parse(&a[1], usize::MAX, 64, one * 3, None)
        .unwrap()
        .resumed());
    // A reload to 0 frees everything at the next body, short or not.
    store.start(b"{}", usize::MAX, 0);
    assert_eq!((store.bytes(), store.entries().len()), (0, 0));
}

#[test]
fn bodies_with_two_message_lists_or_a_salt_after_theirs_leave_none() {
    let store = Checkpoints::with_min_body(0);
    let pad = "u".repeat(HEAD);
    let list = r#""messages":[{"role":"user","content":"q"}]"#;
    for body in [
        format!(r#"{{"x":"{pad}",{list},{list}}}"#),
        format!(r#"{{"x":"{pad}","messages":[],{list}}}"#),
        format!(r#"{{"x":"{pad}",{list},"cache_salt":"t"}}"#),
        format!(r#"{{"x":"{pad}","cache_salt":"t",{list},"cache_salt":"u"}}"#),
    ] {
        store
            .parse(&Bytes::from(body), usize::MAX, 64, 1 << 30, None)
            .unwrap();
        assert_eq!(store.bytes(), 0);
    }
    // A salt before the list is part of the bytes a later turn must share.
    let salted = format!(r#"{{"x":"{pad}","cache_salt":"t",{list}}}"#);
    store
        .parse(&Bytes::from(salted), usize::MAX, 64, 1 << 30, None)
        .unwrap();
    assert!(store.bytes() > 0);
}

#[test]
fn a_model_nobody_serves_leaves_none() {
    let store = Checkpoints {
        serves: Some(Box::new(|model: &str| model == "m")),
        ..Checkpoints::with_min_body(0)
    };
    let ours = conversation(2);
    let other = String::from_utf8_lossy(&ours[0]).replace("\"m\"", "\"other\"");
    let parse = |body: &Bytes| store.parse(body, usize::MAX, 64, 1 << 30, None).unwrap();
    parse(&Bytes::from(other));
    assert_eq!(store.bytes(), 0);
    parse(&ours[0]);
    assert!(parse(&ours[1]).resumed());
}

#[test]
fn short_bodies_leave_no_checkpoint() {
    let store = Checkpoints::new();
    for body in conversation(3) {
        assert!(body.len() < MIN_BODY);
        assert!(!store
            .parse(&body, usize::MAX, 64, 1 << 30, None)
            .unwrap()
            .resumed());
    }
    assert_eq!(store.bytes(), 0);
}

#[test]
fn what_is_kept_with_a_checkpoint_is_found_by_the_next_turn_and_counted_until_dropped() {
    let store = Checkpoints::with_min_body(0);
    let bodies = conversation(3);
    let first = store
        .parse(&bodies[0], usize::MAX, 64, 1 << 30, None)
        .unwrap();
    let left = first
        .turns
        .left
        .expect("the first turn leaves a checkpoint");
    assert_eq!(bodies[0][left.list_end()], b']');
    let before = store.bytes();
    assert!(store.keep_with(&left, Arc::new(7_u32), 1000, 1 << 30));
    assert_eq!(store.bytes(), before + 1000);
    // Once only.
    assert!(!store.keep_with(&left, Arc::new(8_u32), 1000, 1 << 30));
    let next = store
        .parse(&bodies[1], usize::MAX, 64, 1 << 30, None)
        .unwrap();
    let from = next.turns.from.expect("resumed");
    assert_eq!(from.list_end(), left.list_end());
    assert_eq!(from.kept::<u32>().as_deref(), Some(&7));
    assert!(from.kept::<String>().is_none());
    // The next turn's checkpoint replaced it: its bytes and what it kept are
    // gone, and nothing is kept with a checkpoint no longer held.
    let now = next
        .turns
        .left
        .expect("a longer list leaves a new checkpoint");
    assert!(now.kept::<u32>().is_none());
    assert_eq!(
        store.bytes(),
        store.entries().iter().map(|c| c.held()).sum::<usize>()
    );
    assert!(!store.keep_with(&from, Arc::new(9_u32), 10, 1 << 30));
    assert!(store.keep_with(&now, Arc::new(10_u32), 10, 1 << 30));
    // A budget that no longer holds it drops it with what it keeps.
    store.start(b"{}", usize::MAX, 0);
    assert_eq!(store.bytes(), 0);
}
