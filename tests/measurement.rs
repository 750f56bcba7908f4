//! The measurement kit, black-box: `routebench` (quick sizes) through the real
//! router in front of `replica-sim` processes, asserting what the scenarios exist
//! to show: pins hold, bursts use both cards, caches are hit and salted, and the
//! capacity wall is reported.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::Duration;

use common::{wait_for, Router, Sim};
use serde_json::Value;

fn out_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("routebench-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs one quick scenario; returns its samples.
fn run(router: &Router, probe: &Sim, scenario: &str, out: &Path) -> Vec<Value> {
    let status = Command::new(env!("CARGO_BIN_EXE_routebench"))
        .args([
            "run",
            "--quick",
            "--time-scale",
            "20",
            "--scenario",
            scenario,
        ])
        .arg("--url")
        .arg(format!("http://{}", router.addr))
        .arg("--probe-url")
        .arg(format!("http://{}", probe.addr))
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run routebench");
    assert!(status.success());
    let text = std::fs::read_to_string(out.join(format!("{scenario}.json"))).expect("samples");
    let v: Value = serde_json::from_str(&text).expect("json");
    let samples = v["samples"].as_array().expect("samples").clone();
    assert!(
        samples.iter().all(|s| s["status"] == 200),
        "errors in {scenario}"
    );
    samples
}

/// Replicas each group was placed on.
fn placements(samples: &[Value]) -> BTreeMap<String, BTreeSet<String>> {
    let mut by: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in samples {
        by.entry(s["group"].as_str().unwrap().to_owned())
            .or_default()
            .insert(s["replica"].as_str().unwrap().to_owned());
    }
    by
}

#[test]
fn agent_loops_stay_pinned_hit_the_cache_and_a_salted_rerun_starts_cold() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let out = out_dir("agent");
    let first = run(&router, &a, "agent-loop", &out);
    for (group, replicas) in placements(&first) {
        assert_eq!(replicas.len(), 1, "{group} moved: {replicas:?}");
    }
    for s in first.iter().filter(|s| s["turn"].as_u64() > Some(0)) {
        assert_eq!(s["decision"], "pin");
        assert!(
            s["cached_tokens"].as_u64() > Some(7_000),
            "warm turn not cached: {s}"
        );
    }
    let again = run(&router, &a, "agent-loop", &out);
    for s in again.iter().filter(|s| s["turn"] == 0) {
        assert_eq!(
            s["cached_tokens"], 0,
            "a second run shares a prefix with the first: {s}"
        );
    }
}

#[test]
fn a_burst_is_spread_under_shape_and_pinned_under_affinity() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let out = out_dir("burst");
    let shape = Router::start(&[&a, &b], "policy: shape\n");
    let spread = placements(&run(&shape, &a, "burst", &out));
    assert_eq!(spread["burst"].len(), 2, "{spread:?}");
    drop(shape);
    let affinity = Router::start(&[&a, &b], "policy: affinity\n");
    let pinned = placements(&run(&affinity, &a, "burst", &out));
    assert_eq!(pinned["burst"].len(), 1, "{pinned:?}");
}

#[test]
fn mixed_traffic_pins_agents_and_spreads_bursts() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "");
    let samples = run(&router, &a, "mixed", &out_dir("mixed"));
    let by = placements(&samples);
    assert!(
        by.iter()
            .filter(|(g, _)| g.starts_with("agent"))
            .all(|(_, r)| r.len() == 1),
        "{by:?}"
    );
    assert!(
        by.iter()
            .filter(|(g, _)| g.starts_with("burst"))
            .all(|(_, r)| r.len() == 2),
        "{by:?}"
    );
}

#[test]
fn the_probe_sees_a_cold_then_a_warm_replica() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let samples = run(&router, &a, "probe", &out_dir("probe"));
    let cached = |turn: u64| {
        samples.iter().find(|s| s["turn"] == turn).unwrap()["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached(0), 0);
    assert!(
        cached(1) > 5_900,
        "identical prompt not cached: {}",
        cached(1)
    );
    assert!(
        cached(2) > 5_900,
        "the shared document not cached with another tail"
    );
}

#[test]
fn the_capacity_scenario_overflows_a_card_and_the_router_says_so() {
    let kv = ["--kv-tokens", "12000"];
    let (a, b) = (Sim::start("a", &kv), Sim::start("b", &kv));
    let router = Router::start(&[&a, &b], "");
    let samples = run(&router, &a, "capacity", &out_dir("capacity"));
    let ws = |r: &str| {
        router.metric(&format!(
            "prefix_router_replica_working_set_tokens{{replica=\"{r}\"}}"
        ))
    };
    wait_for(
        "a working set above 12000 tokens",
        Duration::from_secs(10),
        || (ws("a").max(ws("b")) > 12_000.0).then_some(()),
    );
    let log = wait_for("the capacity warning", Duration::from_secs(10), || {
        Some(router.log()).filter(|l| l.contains("exceeds its KV capacity of 12000 tokens"))
    });
    assert!(
        log.contains("another card") && log.contains("compaction"),
        "levers not named: {log}"
    );
    // Three families on two cards that each hold one: some warm turns miss.
    let warm: Vec<&Value> = samples
        .iter()
        .filter(|s| s["turn"].as_u64() > Some(0))
        .collect();
    let (cached, prompt) = warm.iter().fold((0, 0), |(c, p), s| {
        (
            c + s["cached_tokens"].as_u64().unwrap(),
            p + s["prompt_tokens"].as_u64().unwrap(),
        )
    });
    assert!(
        cached * 10 < prompt * 9,
        "no thrash: {cached} of {prompt} cached"
    );
}

/// The working-set gauges fall back to 0 once their window has passed with
/// no traffic: an idle router ages what it counted, though it no longer
/// reads its index each time it refreshes them.
#[test]
fn an_idle_routers_working_set_empties_when_its_window_passes() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(&[&a, &b], "working_set_window_s: 2");
    let r = router.post(
        "/v1/chat/completions",
        &common::single(&"a long question, ".repeat(200)),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let tokens = || {
        ["a", "b"]
            .map(|r| {
                router.metric(&format!(
                    "prefix_router_replica_working_set_tokens{{replica=\"{r}\"}}"
                ))
            })
            .iter()
            .sum::<f64>()
    };
    wait_for(
        "the prompt in the working set",
        Duration::from_secs(10),
        || (tokens() >= 512.0).then_some(()),
    );
    wait_for("an empty working set", Duration::from_secs(15), || {
        (tokens() == 0.0).then_some(())
    });
}

/// `compare` rotates the arm order by one each round (so drift does not
/// always fall on the same arm), still lists arms in the order given, and
/// reports a burst's cached share and the router's index repairs.
#[test]
fn compare_rotates_the_arms_each_round_and_lists_them_in_the_order_given() {
    let out = out_dir("compare");
    let run = Command::new(env!("CARGO_BIN_EXE_routebench"))
        .args(["compare", "--quick", "--time-scale", "20", "--salts", "2"])
        .args(["--scenario", "burst", "--policies", "shape,roundrobin"])
        .arg("--out")
        .arg(&out)
        .arg("--results")
        .arg(out.join("results.md"))
        .env("RUST_LOG", "info")
        .output()
        .expect("run routebench");
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{log}");
    let ran: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split("routebench] ").nth(1))
        .filter_map(|l| l.strip_suffix(": burst"))
        .collect();
    assert_eq!(
        ran,
        ["shape #1", "roundrobin #1", "roundrobin #2", "shape #2"]
    );

    let md = std::fs::read_to_string(out.join("results.md")).expect("results");
    let table: Vec<&str> = md
        .lines()
        .skip_while(|l| !l.starts_with("| burst |"))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(table.len() > 2, "{md}");
    assert!(table[0].contains("| cached |"), "{}", table[0]);
    assert!(
        table[0].ends_with("| index repairs | cached tokens predicted / delivered |"),
        "{}",
        table[0]
    );
    let cell = |row: &str, i: usize| row.split('|').nth(i).unwrap_or("").trim().to_owned();
    let arms: Vec<String> = table[2..].iter().map(|r| cell(r, 1)).collect();
    assert_eq!(
        arms,
        ["shape #1", "shape #2", "roundrobin #1", "roundrobin #2"]
    );
    for row in &table[2..] {
        let mut last = row.trim_end_matches('|').rsplit('|').map(str::trim);
        let (fidelity, repairs) = (last.next().unwrap_or(""), last.next().unwrap_or(""));
        assert_eq!(repairs, "0", "{row}");
        // Bursts of new documents: the router predicts no cached tokens.
        assert!(fidelity.starts_with("0k / "), "{row}");
    }
}

/// The simulator's hooks the `oracle` arm and `many-tenants` use: what it
/// holds of a prompt, and its cache emptied as a restart would.
#[test]
fn the_simulator_says_what_it_holds_of_a_prompt_and_empties_its_cache() {
    let sim = Sim::start("a", &[]);
    let body = serde_json::json!({"model": "sim", "max_tokens": 1, "messages": [
        {"role": "system", "content": "The manual of application 7. ".repeat(200)},
        {"role": "user", "content": "How do I start it?"}]});
    let cached = || {
        let r = common::http::post_json(sim.addr, "/sim/cached", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["cached_tokens"].as_u64().expect("cached_tokens")
    };
    assert_eq!(cached(), 0, "nothing held yet");
    assert_eq!(
        common::http::post_json(sim.addr, "/v1/chat/completions", &body).status,
        200
    );
    let held = cached();
    assert!(held > 1_000, "its prompt is held: {held}");
    let r = common::http::post_json(sim.addr, "/sim/cached", &body).json();
    let prompt = r["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(prompt >= held && prompt < held + 32, "{r}");
    assert_eq!(r["queued_tokens"].as_u64(), Some(0), "idle: nothing queued");
    let reset = common::http::post_json(sim.addr, "/sim/reset", &serde_json::json!({}));
    assert_eq!(reset.status, 200, "{}", reset.text());
    assert_eq!(cached(), 0, "emptied");
}

/// The `oracle` arm (no router) sends each question to the card holding
/// its tenant's prompt: on `many-tenants` (quick sizes, cards that hold a
/// third of the prompts each) the engines report more of the prompts cached
/// than under round-robin.
#[test]
fn the_oracle_arm_finds_the_card_holding_each_prompt() {
    let out = out_dir("oracle");
    let run = Command::new(env!("CARGO_BIN_EXE_routebench"))
        .args(["compare", "--quick", "--time-scale", "20", "--sims", "2"])
        // Cards that hold about a third of the prompts: no one card holds all.
        .args(["--kv-tokens", "12000"])
        .args([
            "--scenario",
            "many-tenants",
            "--policies",
            "oracle,roundrobin",
        ])
        .arg("--out")
        .arg(&out)
        .arg("--results")
        .arg(out.join("results.md"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run routebench");
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{log}");
    assert!(!log.contains("could not be emptied"), "{log}");
    let md = std::fs::read_to_string(out.join("results.md")).expect("results");
    let cells = |l: &str| -> Vec<String> { l.split('|').map(|c| c.trim().to_owned()).collect() };
    let line = |start: &str| {
        md.lines()
            .find(|l| l.starts_with(start))
            .map(cells)
            .unwrap_or_else(|| panic!("{md}"))
    };
    let (head, row) = (
        line("| measure |"),
        line("| many-tenants 4/s: cached share |"),
    );
    let share = |arm: &str| -> f64 {
        let i = head
            .iter()
            .position(|h| h == arm)
            .unwrap_or_else(|| panic!("{head:?}"));
        row[i]
            .trim_end_matches(" %")
            .parse()
            .unwrap_or_else(|_| panic!("{row:?}"))
    };
    let (oracle, roundrobin) = (share("oracle"), share("roundrobin"));
    assert!(
        oracle > roundrobin + 10.0,
        "oracle {oracle} %, roundrobin {roundrobin} %"
    );
}

#[test]
fn noisy_neighbour_runs_agents_as_tenants_beside_a_flood_that_waits_its_turn() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let router = Router::start(
        &[&a, &b],
        "shed_in_flight: 2\nqueue: {}\ntenants: {header: x-tenant, named: {agent0: {}, agent1: {}, flood: {}}}\n",
    );
    let samples = run(&router, &a, "noisy-neighbour", &out_dir("noisy"));
    let of = |group: &'static str| samples.iter().filter(move |s| s["group"] == group);
    for phase in ["alone", "flooded"] {
        assert_eq!(of(phase).count(), 8, "{phase}: 2 agents of 4 turns");
        for s in of(phase).filter(|s| s["turn"].as_u64() > Some(0)) {
            assert_eq!(s["decision"], "pin", "{s}");
        }
    }
    assert!(of("flood").count() > 0);
    // Each is counted as its own tenant, and the flood waited for places.
    for tenant in ["agent0", "agent1", "flood"] {
        let series = format!("prefix_router_tenant_requests_total{{tenant=\"{tenant}\"}}");
        assert!(router.metric(&series) > 0.0, "{series}");
    }
    let waits = "prefix_router_tenant_queue_wait_seconds_count{tenant=\"flood\"}";
    assert_eq!(router.metric(waits), of("flood").count() as f64);
}
