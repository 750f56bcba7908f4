//! `ByteBpe` against `tokenizers` on the same tokenizer JSON: SmolLM2's as
//! shipped (`scripts/real-engine.sh prepare`) and the same vocabulary
//! under Llama 3's pre-tokenizer and `ignore_merges`. Any text, ids equal.
//! `make fuzz` runs them longer.

use std::path::PathBuf;
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{json, Value};
use tokenizers::Tokenizer;
use tokens::bpe::ByteBpe;

/// Llama 3's split pattern (its tokenizer.json's `Split`).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn smollm2() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.real-engine/tokenizer/tokenizer.json");
    let text = std::fs::read_to_string(path).expect("scripts/real-engine.sh prepare");
    serde_json::from_str(&text).expect("json")
}

fn llama3_shaped() -> Value {
    let mut json = smollm2();
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    json["model"]["ignore_merges"] = json!(true);
    json
}

/// Both implementations of one JSON.
struct Pair {
    ours: ByteBpe,
    theirs: Tokenizer,
}

impl Pair {
    fn of(json: &Value) -> Self {
        let theirs: Tokenizer = json.to_string().parse().expect("tokenizers loads it");
        let ours = ByteBpe::from_json(json).expect("the shape ByteBpe handles");
        Self { ours, theirs }
    }

    fn check(&self, text: &str) -> Result<(), TestCaseError> {
        let mut ours = Vec::new();
        self.ours.encode(text, &mut ours);
        let theirs = self.theirs.encode_fast(text, false).expect("encodes");
        prop_assert_eq!(&ours, &theirs.get_ids().to_vec(), "{:?}", text);
        Ok(())
    }
}

/// SmolLM2's with an unknown token, fused or not: the bytes its
/// vocabulary lacks become it.
fn with_unk(fuse: bool) -> Value {
    let mut json = smollm2();
    json["model"]["unk_token"] = json!("<|endoftext|>");
    json["model"]["fuse_unk"] = json!(fuse);
    json
}

/// SmolLM2's vocabulary under other pre-tokenizers of the shape handled:
/// digits in runs, a `Split` by a string, one whose regex matches empty
/// strings, and Llama 3's with an unknown token.
fn variants() -> Vec<Value> {
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut json = smollm2();
        edit(&mut json);
        json
    };
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: Value| json!({"type": "Split", "pattern": pattern, "behavior": "Isolated", "invert": false});
    vec![
        with(&|j| j["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = json!(false)),
        with(&|j| {
            j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                split(json!({"String": "e."})),
                {"type": "Digits", "individual_digits": false},
                byte_level(true),
            ]})
        }),
        with(&|j| {
            j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                split(json!({"Regex": r"\s*"})),
                byte_level(false),
            ]})
        }),
        {
            let mut j = llama3_shaped();
            j["model"]["unk_token"] = json!("<|endoftext|>");
            j["model"]["fuse_unk"] = json!(true);
            j
        },
    ]
}

thread_local! {
    static SMOLLM2: Arc<Pair> = Arc::new(Pair::of(&smollm2()));
    static VARIANTS: Vec<Pair> = variants().iter().map(Pair::of).collect();
    static UNK: [Arc<Pair>; 2] = [false, true].map(|fuse| Arc::new(Pair::of(&with_unk(fuse))));
    static LLAMA3_SHAPED: Arc<Pair> = Arc::new(Pair::of(&llama3_shaped()));
}

/// Text that meets every branch of both patterns often: words of several
/// scripts, numbers, contractions in either case, runs of every kind of
/// space, punctuation, marks and emoji (no added token: `Pieces` cuts
/// those off before it).
fn texty() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        "[a-zA-Z]{1,12}",
        "[0-9]{1,7}",
        "'(s|t|re|ve|m|ll|d|S|T|RE|LL)",
        "[ \t\n\r]{1,4}",
        "[\u{a0}\u{3000}\u{2028}\u{200b}\u{feff}\u{85}]",
        "[.,;:!?(){}\\[\\]<>|=+*/\\\\_#@$%^&~`\"'-]{1,3}",
        "[éüßçøñÆ]{1,3}",
        "[日本語한국어テキスト]{1,4}",
        "[क़िताबपढ़ोमें]{1,4}",
        "[²³½٣४Ⅻ①]{1,2}",
        "[🤖👍🏽🇫🇷]{1,2}",
        "[\u{0}-\u{1f}\u{7f}-\u{a0}]",
    ];
    proptest::collection::vec(part, 0..32).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn smollm2_s_ids_on_text_like_prompts(text in texty()) {
        SMOLLM2.with(|p| p.check(&text))?;
    }

    #[test]
    fn smollm2_s_ids_on_any_string(text in any::<String>()) {
        SMOLLM2.with(|p| p.check(&text))?;
    }

    #[test]
    fn unknown_bytes_fused_or_not(text in texty()) {
        UNK.with(|[apart, fused]| {
            apart.check(&text)?;
            fused.check(&text)
        })?;
    }

    #[test]
    fn other_pre_tokenizers_ids(text in texty()) {
        VARIANTS.with(|v| v.iter().try_for_each(|p| p.check(&text)))?;
    }

    #[test]
    fn llama3_shaped_ids_on_text_like_prompts(text in texty()) {
        LLAMA3_SHAPED.with(|p| p.check(&text))?;
    }

    #[test]
    fn llama3_shaped_ids_on_any_string(text in any::<String>()) {
        LLAMA3_SHAPED.with(|p| p.check(&text))?;
    }
}

#[test]
fn long_words_and_repeated_text_keep_their_ids() {
    // Past the kept word length, and again from each thread's cache.
    let p = SMOLLM2.with(Arc::clone);
    let long = "x".repeat(300) + &"ab".repeat(200) + " " + &"9".repeat(50);
    for _ in 0..2 {
        p.check(&long).expect("long words");
        p.check("the same words again and again").expect("cached");
    }
}

#[test]
fn shapes_not_handled_are_left_to_tokenizers() {
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut json = smollm2();
        edit(&mut json);
        ByteBpe::from_json(&json).is_some()
    };
    assert!(with(&|_| {}));
    assert!(!with(&|j| j["normalizer"] = json!({"type": "NFC"})));
    assert!(!with(
        &|j| j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true)
    ));
    assert!(!with(
        &|j| j["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁"})
    ));
    assert!(!with(
        &|j| j["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            {"type": "Digits", "individual_digits": true},
        ]})
    ));
    assert!(!with(&|j| j["model"]["dropout"] = json!(0.1)));
    assert!(!with(
        &|j| j["model"]["continuing_subword_prefix"] = json!("##")
    ));
    assert!(!with(&|j| j["model"]["type"] = json!("WordPiece")));
    // SmolLM2's vocabulary lacks some bytes (controls, bytes UTF-8 never
    // has): `tokenizers` drops them, or with `byte_fallback` looks for
    // `<0x..>` tokens, which is not done here.
    assert!(!with(&|j| j["model"]["byte_fallback"] = json!(true)));
    // Two tokens of one id (which of them a serialization keeps is chance).
    assert!(!with(&|j| {
        let q = j["model"]["vocab"]["Q"].clone();
        j["model"]["vocab"]["R"] = q;
    }));
}

#[test]
fn two_tokenizers_on_one_thread_keep_their_words_apart() {
    // "ा" and "ि" differ in their last byte, as two instances' seeds for
    // a hash of short words might: each must get its own word's ids.
    let (a, b) = (Pair::of(&with_unk(false)), Pair::of(&with_unk(true)));
    for _ in 0..2 {
        a.check("ा").expect("the first's word");
        b.check("ि").expect("the second's word");
    }
}

#[test]
fn a_vocabulary_with_two_tokens_of_one_id_is_left_to_tokenizers() {
    // Serialized, such a tokenizer keeps one of the two: the pieces must
    // not be merged from that.
    let mut json = smollm2();
    let q = json["model"]["vocab"]["Q"].clone();
    json["model"]["vocab"]["R"] = q;
    let tokenizer: Tokenizer = json.to_string().parse().expect("tokenizers loads it");
    let pieces = tokens::Pieces::new(tokenizer, 1 << 20);
    assert!(pieces.by_pieces() && !pieces.ids_only());
    let text = "<|im_start|>QR RQ<|im_end|>";
    assert_eq!(pieces.encode(text).ok(), pieces.whole(text).ok());
}
