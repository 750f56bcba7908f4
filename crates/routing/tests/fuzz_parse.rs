//! Fuzzing `Prompt::parse` and the shape signals: arbitrary bytes and
//! structure-aware JSON (the keys the parser acts on, nested at random,
//! top-level keys repeated). 256 cases per `cargo test`; a longer run:
//!   PROPTEST_CASES=200000 cargo test --release --test fuzz_parse

use proptest::prelude::*;
use routing::request::Prompt;

#[path = "strategies/json.rs"]
mod strategies;
use strategies::{json, shaped};

const CAP: usize = 4096;

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
        let body = shaped(&v, repeat);
        // An error (a field of the wrong type) forwards the body unparsed, spread.
        if let Ok(p) = Prompt::parse(body.as_bytes(), CAP) {
            check(&p);
            let r = p.into_request(64, None);
            prop_assert!(r.chain.len() <= CAP);
        }
    }
}
