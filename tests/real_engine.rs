//! A real engine behind the router: two llama.cpp replicas (xllamacpp from
//! PyPI, SmolLM2 cut to 4 blocks; `scripts/real-engine.sh prepare`, which
//! `make test` runs). A growing conversation stays on its replica and that
//! replica reports the prefix as cached; a single goes to the other one.

mod common;

use std::process::{Child, Command, Stdio};

use common::{free_addr, Router};
use serde_json::json;

struct Engine(Child, std::net::SocketAddr);

impl Engine {
    fn start() -> Engine {
        let root = env!("CARGO_MANIFEST_DIR");
        assert!(
            std::path::Path::new(root)
                .join(".real-engine/smollm2-135m-4blocks.gguf")
                .exists(),
            "the real engine is not prepared: run scripts/real-engine.sh prepare (make test does)"
        );
        let addr = free_addr();
        let child = Command::new(format!("{root}/scripts/real-engine.sh"))
            .args(["serve", "--port", &addr.port().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the real engine");
        Engine(child, addr)
    }

    fn yaml(&self, name: &str) -> String {
        format!("  - {{name: {name}, addr: \"{}\"}}\n", self.1)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn cached(r: &common::Response) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_conversation_stays_on_the_llama_cpp_replica_that_caches_it() {
    let (e0, e1) = (Engine::start(), Engine::start());
    let yaml = format!(
        "health_check: {{interval_ms: 200}}\nreplicas:\n{}{}",
        e0.yaml("llama0"),
        e1.yaml("llama1")
    );
    let router = Router::spawn(&yaml, &[]);
    for name in ["llama0", "llama1"] {
        router.wait_replica_up(name, true);
    }
    let doc: String = (0..120)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog. "))
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": format!("Answer from the document.\n{doc}")}),
        json!({"role": "user", "content": "What is on line 3?"}),
    ];
    let body =
        |m: &Vec<serde_json::Value>| json!({"model": "smollm2", "max_tokens": 4, "messages": m});
    let first = router.post("/v1/chat/completions", &body(&messages));
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(cached(&first), 0, "a cold prompt reported cached tokens");
    let home = first.replica().to_owned();
    // A one-shot in between goes to the other replica.
    let single = router.post(
        "/v1/chat/completions",
        &body(&vec![json!({"role": "user", "content": "Hello?"})]),
    );
    assert_ne!(single.replica(), home);
    let mut last = first;
    let mut reported = 0;
    for turn in 1..3 {
        let reply = last.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        messages.push(json!({"role": "assistant", "content": reply}));
        messages.push(json!({"role": "user", "content": format!("And line {}?", 3 + turn)}));
        let r = router.post("/v1/chat/completions", &body(&messages));
        assert_eq!(r.status, 200);
        assert_eq!(
            (r.replica(), r.decision()),
            (home.as_str(), "pin"),
            "turn {turn}"
        );
        assert!(
            cached(&r) > 1_000,
            "turn {turn}: the engine recomputed the prefix ({} cached)",
            cached(&r)
        );
        reported += cached(&r);
        last = r;
    }
    // The router read the same figures from the engine's answers, and its
    // predictions (bytes / 4) came true.
    let series = |name: &str, labels: &str| {
        router.metric(&format!(
            "prefix_router_{name}{{{labels},replica=\"{home}\"}}"
        ))
    };
    let delivered = series("delivered_cached_tokens_total", "decision=\"pin\"");
    assert_eq!(delivered, reported as f64);
    assert_eq!(series("pin_outcomes_total", "outcome=\"hit\""), 2.0);
}
