//! The OpenAI Python SDK works unchanged through the router: chat, and a
//! Responses API loop chained by `previous_response_id` (streaming and not,
//! retrieve, delete) across two replicas, where a turn sent to the wrong one
//! fails with the engine's 404. `scripts/prepare.sh` installs the SDK into
//! `.sdk/venv` (PyPI).

mod common;

use std::path::Path;
use std::process::Command;

use common::{Router, Sim};

#[test]
fn the_openai_sdk_chains_responses_through_the_router() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".sdk/venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/prepare.sh",
        python.display()
    );
    let a = Sim::start("a", &[]);
    let b = Sim::start("b", &[]);
    let router = Router::start(&[&a, &b], "");
    // Four chains, so both replicas hold some: a misrouted turn is a 404.
    for _ in 0..4 {
        let out = Command::new(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/openai_client.py"))
            .arg(format!("http://{}", router.addr))
            .output()
            .expect("run the SDK script");
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok 4"));
    }
    assert!(a.received() > 0 && b.received() > 0, "both replicas served");
}
