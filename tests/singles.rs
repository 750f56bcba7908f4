//! Where singles go, black-box: to the replica holding their shared prompt
//! (within its bounds), spread while every card holds every prompt, off a
//! replica whose KV a pinned context takes, and after each other onto an
//! engine that keeps only its last prompt.

mod common;

use std::time::Duration;

use common::http;
use common::{single, wait_for, Router, Sim};
use serde_json::json;

/// A one-shot question to application `app`, behind its ~8 KiB system prompt.
fn app_question(app: &str, n: usize, max_tokens: u64) -> serde_json::Value {
    let prompt = format!("You are the assistant of {app}. Its manual follows. ").repeat(160);
    json!({"model": "sim", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": prompt},
        {"role": "user", "content": format!("{app} question {n}?")}]})
}

/// Sends each app's first question, then waits until the router's working
/// set (recomputed every 500 ms) counts all of their prompts.
fn first_sight(router: &Router, apps: &[String]) {
    for app in apps {
        let r = router.post("/v1/chat/completions", &app_question(app, 0, 2));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let tokens = |name: &str| {
        router.metric(&format!(
            "prefix_router_replica_working_set_tokens{{replica=\"{name}\"}}"
        ))
    };
    // Whole 1 KiB blocks of each ~8 KiB prompt, 4 bytes a token.
    let want = (apps.len() * 7 * 1024 / 4) as f64;
    wait_for("the working set", Duration::from_secs(10), || {
        (tokens("a") + tokens("b") >= want).then_some(())
    });
}

fn apps(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("app{i}")).collect()
}

/// Two simulators declaring `kv_tokens` KV each, with `more` arguments.
fn cards(kv_tokens: &str, more: &[&str]) -> (Sim, Sim) {
    let args = [&["--kv-tokens", kv_tokens][..], more].concat();
    (Sim::start("a", &args), Sim::start("b", &args))
}

#[test]
fn singles_behind_a_shared_application_prompt_return_to_the_replica_holding_it() {
    // Three ~8 KiB prompts, room for two on a card.
    let (a, b) = cards("4000", &[]);
    let router = Router::start(&[&a, &b], "");
    let apps = apps(3);
    first_sight(&router, &apps);
    let mut homes = Vec::new();
    for app in &apps {
        let r = router.post("/v1/chat/completions", &app_question(app, 1, 2));
        assert_eq!((r.status, r.decision()), (200, "prefix"), "{}", r.text());
        homes.push(r.replica().to_owned());
    }
    assert!(
        homes.contains(&"a".into()) && homes.contains(&"b".into()),
        "{homes:?}"
    );
    for n in 2..5 {
        for (app, home) in apps.iter().zip(&homes) {
            let r = router.post("/v1/chat/completions", &app_question(app, n, 2));
            assert_eq!(
                (r.replica(), r.decision()),
                (home.as_str(), "prefix"),
                "{app} {n}"
            );
            let cached = &r.json()["usage"]["prompt_tokens_details"]["cached_tokens"];
            assert!(cached.as_u64() > Some(1_500), "{app} {n}: {cached}");
        }
    }
    // The seed's rule, kept as a mode: every single by the counter.
    let (a, b) = cards("4000", &[]);
    let router = Router::start(&[&a, &b], "singles: {by: spread}\n");
    first_sight(&router, &apps);
    let picks: Vec<String> = (1..5)
        .map(|n| {
            let r = router.post("/v1/chat/completions", &app_question("app0", n, 2));
            assert_eq!(r.decision(), "spread");
            r.replica().to_owned()
        })
        .collect();
    assert!(picks.windows(2).all(|w| w[0] != w[1]), "{picks:?}");
}

#[test]
fn singles_spread_while_every_replica_could_hold_every_shared_prompt() {
    let apps = apps(3);
    // Room for all three on each card: the counter, as the seed's rule.
    let (a, b) = cards("20000", &[]);
    let router = Router::start(&[&a, &b], "");
    first_sight(&router, &apps);
    let picks: Vec<String> = (1..5)
        .map(|n| {
            let r = router.post("/v1/chat/completions", &app_question("app0", n, 2));
            assert_eq!((r.status, r.decision()), (200, "spread"));
            r.replica().to_owned()
        })
        .collect();
    assert!(picks.windows(2).all(|w| w[0] != w[1]), "{picks:?}");
    // Room for two: each prompt stays where it is held.
    let (a, b) = cards("4000", &[]);
    let router = Router::start(&[&a, &b], "");
    first_sight(&router, &apps);
    for n in 1..5 {
        let r = router.post("/v1/chat/completions", &app_question("app0", n, 2));
        assert_eq!((r.status, r.decision()), (200, "prefix"), "{n}");
    }
}

#[test]
fn a_burst_behind_one_shared_prompt_still_uses_both_replicas() {
    // Twelve ~8 KiB prompts, room for ten on a card; slow decoding keeps
    // every request of the burst in flight while the others are placed.
    let (a, b) = cards("20000", &["--decode-tps", "10"]);
    let router = Router::start(&[&a, &b], "");
    first_sight(&router, &apps(12));
    let addr = router.addr;
    let placed: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=8)
            .map(|n| {
                s.spawn(move || {
                    let body = app_question("app0", n, 10);
                    let r = http::post_json(addr, "/v1/chat/completions", &body);
                    assert_eq!(r.status, 200, "{}", r.text());
                    (r.replica().to_owned(), r.decision().to_owned())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let on_a = placed.iter().filter(|(r, _)| r == "a").count();
    // The holder takes requests while it has at most 2 more waiting for
    // their first byte than the other (`bound_queued`), so neither gets more
    // than 5 of 8.
    assert!((3..=5).contains(&on_a), "{placed:?}");
    assert!(placed.iter().any(|(_, d)| d == "prefix"), "{placed:?}");
}

#[test]
fn singles_follow_each_other_onto_an_engine_that_keeps_only_its_last_prompt() {
    // One llama.cpp slot: room in the KV for everything, but any prompt
    // displaces the context the engine kept. Singles run 5 s each.
    let sim = |name| Sim::start(name, &["--kv-tokens", "100000", "--decode-tps", "20"]);
    let (a, b) = (sim("a"), sim("b"));
    let yaml = Router::yaml(&[&a, &b], "").replace(
        "kv_tokens: 100000}",
        "kv_tokens: 100000, prompt_cache: last}",
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("a", true);
    router.wait_replica_up("b", true);
    // An agent pinned to each card.
    let agent = |topic: &str| {
        json!({"model": "sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": format!("{topic}: the failing test. ").repeat(100)},
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "looking"},
            {"role": "user", "content": "go on"}]})
    };
    let mut homes = Vec::new();
    for topic in ["parser", "scheduler"] {
        let r = router.post("/v1/chat/completions", &agent(topic));
        assert_eq!(r.status, 200, "{}", r.text());
        let home = r.replica().to_owned();
        let series =
            format!("prefix_router_replica_pinned_working_set_tokens{{replica=\"{home}\"}}");
        wait_for("the pinned working set", Duration::from_secs(5), || {
            (router.metric(&series) > 0.0).then_some(())
        });
        homes.push((home, topic));
    }
    assert_ne!(homes[0].0, homes[1].0, "one agent per card");
    // Four singles, each sent once the one before is running: the first
    // displaces one agent's context, the rest follow it there.
    let in_flight = || {
        ["a", "b"]
            .iter()
            .map(|r| {
                router.metric(&format!(
                    "prefix_router_in_flight_requests{{replica=\"{r}\"}}"
                ))
            })
            .sum::<f64>()
    };
    let singles: Vec<_> = (0..4)
        .map(|i| {
            let addr = router.addr;
            let mut body = single(&format!("question {i}: {}", "Summarise this. ".repeat(50)));
            body["max_tokens"] = json!(100);
            let t = std::thread::spawn(move || {
                common::http::post_json(addr, "/v1/chat/completions", &body)
            });
            wait_for("the single running", Duration::from_secs(5), || {
                (in_flight() >= f64::from(i + 1)).then_some(())
            });
            t
        })
        .collect();
    let places: Vec<String> = singles
        .into_iter()
        .map(|t| {
            let r = t.join().expect("single");
            assert_eq!(r.status, 200, "{}", r.text());
            r.replica().to_owned()
        })
        .collect();
    assert!(places.iter().all(|p| *p == places[0]), "{places:?}");
    // The other agent's context was never displaced; its next turn is pinned.
    let (home, spared) = homes
        .iter()
        .find(|(home, _)| *home != places[0])
        .expect("spared");
    let mut next = agent(spared);
    next["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"role": "user", "content": "and now?"}));
    let r = router.post("/v1/chat/completions", &next);
    assert_eq!((r.replica(), r.decision()), (home.as_str(), "pin"));
}

#[test]
fn singles_keep_off_a_replica_whose_kv_is_taken_by_a_pinned_context() {
    // Cards of 2,000 tokens (8,000 bytes of prompt text).
    let a = Sim::start("a", &["--kv-tokens", "2000"]);
    let b = Sim::start("b", &["--kv-tokens", "2000"]);
    let router = Router::start(&[&a, &b], "");
    // An agent's context of ~6,500 bytes, pinned to one card.
    let context = "The failing test and the files it touches. ".repeat(150);
    let agent = json!({"model": "sim", "max_tokens": 2, "messages": [
        {"role": "system", "content": context},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "looking"},
        {"role": "user", "content": "go on"}]});
    let home = router.post("/v1/chat/completions", &agent);
    assert_eq!(home.status, 200);
    let (home, other) = match home.replica() {
        "a" => ("a", "b"),
        _ => ("b", "a"),
    };
    let series = format!("prefix_router_replica_pinned_working_set_tokens{{replica=\"{home}\"}}");
    wait_for("the pinned working set", Duration::from_secs(5), || {
        (router.metric(&series) > 1_000.0).then_some(())
    });
    // Singles of ~3,000 bytes: no room beside the context, so none goes there.
    let places: Vec<String> = (0..4)
        .map(|i| {
            let text = format!("question {i}: {}", "Summarise this paragraph. ".repeat(120));
            let r = router.post("/v1/chat/completions", &single(&text));
            assert_eq!(r.status, 200, "{}", r.text());
            r.replica().to_owned()
        })
        .collect();
    assert_eq!(places, [other; 4]);
    // The agent's next turn is still pinned at home.
    let mut next = agent.clone();
    if let Some(m) = next["messages"].as_array_mut() {
        m.push(json!({"role": "user", "content": "and now?"}));
    }
    let r = router.post("/v1/chat/completions", &next);
    assert_eq!((r.replica(), r.decision()), (home, "pin"));
}
