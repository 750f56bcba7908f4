//! routebench: the seed's scenarios against any OpenAI-compatible endpoint, and
//! `compare`, which measures the router's three policies side by side.
//!
//! Scenarios: `agent-loop` (sequential-turn conversations growing toward ~90k
//! tokens), `burst` (16 distinct cold prompts at once), `mixed` (both at once),
//! `probe` (the same long prompt twice on one idle replica, then varying tails),
//! `capacity` (three 50-80k-token families on two cards), and on request
//! `overload` (more one-shot clients than the cards hold), `unseen-load`
//! (`mixed` while other clients load one replica past the router) and
//! `responses-loop` (`agent-loop` on the Responses API, chained by
//! `previous_response_id`, so each turn sends only its new items), and
//! `shared-prefix` (steady one-shot questions from many tenants, each behind its
//! own long system prompt; `-card`: a third of the tenants, whose prompts fit
//! one card, `-over`: twice as many, more than the fleet holds, `-bursts`: with
//! `mixed`'s bursts arriving meanwhile), `many-tenants` (`-bursts` with 150
//! tenants, about twice what 4 cards hold, so the engines evict all the time,
//! at 4, 8 and 12 questions a second, each with bursts and the first card's
//! cache emptied halfway; run it with `--sims 4`), and
//! `agent-loop-shared` (`agent-loop` with every agent starting from one
//! system prompt), and `noisy-neighbour` (agent loops, each its own tenant
//! in the `x-tenant` header, alone and then while one more tenant floods
//! the fleet with one-shots at ten times its share). The `oracle` arm has no router: each request goes straight
//! to the simulated card that holds the longest prefix of its prompt then; `oracle-soonest` to the
//! card where its prefill would end soonest by the cards' own state. Every run salts its
//! prompts; every median comes with its p90 and sample size. Times are model
//! seconds: wall seconds times `--time-scale` (the simulators' own; 1 for real engines).
//!   cargo run --release --bin routebench -- run --url http://127.0.0.1:8080 --probe-url http://127.0.0.1:8001
//!   cargo run --release --bin routebench -- compare --results docs/results.md
//!
//! Two tools of `make bench-scale`: `stubs` (many lightweight replicas in one
//! process) and `hold` (many SSE streams opened and held through an endpoint).
//!
//! The `routebench` binary of the root package runs [`main`].

mod client;
mod fleet;
mod hold;
mod noisy;
mod plot;
mod report;
mod scenarios;
mod stubs;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use client::{Client, Oracle, Sample};
use scenarios::Sizes;

const ALL: [&str; 15] = [
    "agent-loop",
    "burst",
    "mixed",
    "probe",
    "capacity",
    "overload",
    "unseen-load",
    "responses-loop",
    "shared-prefix",
    "shared-prefix-card",
    "shared-prefix-over",
    "shared-prefix-bursts",
    "agent-loop-shared",
    "many-tenants",
    "noisy-neighbour",
];
/// Run when no `--scenario` is given (the others are asked for by name).
const DEFAULT: usize = 5;
/// What the router logs when a working set exceeds a replica's KV.
const WARNING: &str = "exceeds its KV capacity";

#[derive(Parser)]
#[command(about = "Measure LLM routing: agent loops, bursts, mixes, cache probes, capacity")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Common {
    /// Scenarios to run (default: all but `overload` and `unseen-load`).
    #[arg(long = "scenario", value_parser = ALL)]
    scenarios: Vec<String>,
    /// Model seconds per wall second of the replicas (1 for real engines).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Scenario sizes: `seed` (90k-token agents, 16-prompt bursts), `real`
    /// (fits llama.cpp slots of 4096 tokens), `quick` (tests).
    #[arg(long, default_value = "seed", value_parser = ["seed", "real", "quick"])]
    sizes: String,
    /// Same as `--sizes quick`.
    #[arg(long)]
    quick: bool,
    /// The `model` field sent.
    #[arg(long, default_value = "sim")]
    model: String,
    /// Where JSON samples and Markdown summaries go.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve many lightweight replicas in this process (`make bench-scale`).
    Stubs(stubs::StubArgs),
    /// Open many SSE streams through an endpoint and hold them (`make bench-scale`).
    Hold(hold::HoldArgs),
    /// Run scenarios against one endpoint.
    Run {
        /// Base URL of the endpoint (the router, or a replica).
        #[arg(long)]
        url: String,
        /// Base URL of one replica for `probe` (default: --url).
        #[arg(long)]
        probe_url: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Start the router once per policy in front of fresh simulators (or the
    /// given replicas) and run the same scenarios against each.
    Compare {
        /// Arms: a policy, or a policy with more router settings joined by
        /// `+` (`shape+kv_room=pack`; `BLOCK.KEY=VALUE` a key of a block,
        /// `shape+fleet.mode=rendezvous`; `replica.KEY=VALUE` a key of every
        /// replica, `shape+replica.prompt_cache=last`; `shape+kv_events`:
        /// the cards publish their KV events and the router places by them,
        /// with `--sim-arg=--tokenizer=DIR`).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "shape,roundrobin,affinity"
        )]
        policies: Vec<String>,
        /// Also measure the best peer: SMG (`smg` from PyPI, `cache_aware`),
        /// installed into `venv/` beside `--out` on first use.
        #[arg(long, value_parser = [fleet::SMG])]
        peer: Option<String>,
        /// Existing replicas (`IP:port`) instead of simulators, e.g. real engines.
        #[arg(long = "replica")]
        replicas: Vec<SocketAddr>,
        /// Simulated cards per arm (unless `--replica` gives replicas).
        #[arg(long, default_value_t = 2)]
        sims: usize,
        /// KV capacity of each simulated card (and the router's `kv_tokens`).
        #[arg(long, default_value_t = 122_636)]
        kv_tokens: u64,
        /// More arguments for every simulated card (`--sim-arg=--max-num-seqs=1`).
        #[arg(long = "sim-arg", allow_hyphen_values = true)]
        sim_args: Vec<String>,
        /// Write the side-by-side report here (Markdown, with an SVG beside it).
        #[arg(long)]
        results: Option<PathBuf>,
        /// A title line for the report.
        #[arg(long, default_value = "simulated replicas (replica-sim)")]
        label: String,

        /// Run every arm this many times, each round with fresh salts; the
        /// headline table shows every round's figure.
        #[arg(long, default_value_t = 1)]
        salts: usize,
        /// Router instances per arm in front of the same replicas, each
        /// request sent to one of them at random (several routers behind an
        /// L4 balancer; `fleet:` settings decide whether they agree).
        #[arg(long, default_value_t = 1)]
        instances: usize,
        /// Model seconds of the router's working-set window, and of quiet
        /// between scenarios so each scenario's capacity warnings are its own.
        #[arg(long, default_value_t = 60.0)]
        window_model_s: f64,
        #[command(flatten)]
        common: Common,
    },
}

fn salt() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("[routebench run {nanos:x}]")
}

fn sizes(c: &Common) -> Sizes {
    match (c.quick, c.sizes.as_str()) {
        (true, _) | (_, "quick") => Sizes::quick(),
        (_, "real") => Sizes::real(),
        _ => Sizes::seed(),
    }
}

fn chosen(c: &Common) -> Vec<String> {
    if c.scenarios.is_empty() {
        ALL[..DEFAULT].iter().map(|s| s.to_string()).collect()
    } else {
        c.scenarios.clone()
    }
}

/// Runs one scenario; `probe` and `unseen-load`'s outside clients go to
/// `probe` (one replica), the rest to `c`.
async fn scenario(name: &str, c: &Client, probe: &Client, s: &Sizes) -> Vec<Sample> {
    let salt = salt();
    match name {
        "agent-loop" => scenarios::agent_loop(c, &salt, s, false).await,
        "agent-loop-shared" => scenarios::agent_loop(c, &salt, s, true).await,
        "burst" => {
            scenarios::burst(c, &salt, s, "burst", s.burst_requests, s.burst_doc_tokens).await
        }
        "mixed" => scenarios::mixed(c, &salt, s).await,
        "probe" => scenarios::probe(probe, &salt, s).await,
        "capacity" => scenarios::capacity(c, &salt, s).await,
        "overload" => scenarios::overload(c, &salt, s).await,
        "unseen-load" => scenarios::unseen_load(c, probe, &salt, s).await,
        "responses-loop" => scenarios::responses_loop(c, &salt, s).await,
        "shared-prefix" => scenarios::shared_prefix(c, &salt, s, s.tenants, false, None).await,
        "shared-prefix-card" => {
            scenarios::shared_prefix(c, &salt, s, s.tenants.div_ceil(3), false, None).await
        }
        "shared-prefix-over" => {
            scenarios::shared_prefix(c, &salt, s, s.tenants * 2, false, None).await
        }
        "shared-prefix-bursts" => {
            scenarios::shared_prefix(c, &salt, s, s.tenants, true, None).await
        }
        // The first replica's cache emptied midway (`probe` is it).
        "many-tenants" => {
            scenarios::shared_prefix(c, &salt, s, s.many_tenants, true, Some(probe)).await
        }
        "noisy-neighbour" => noisy::noisy_neighbour(c, &salt, s).await,
        _ => Vec::new(),
    }
}

fn save(out: &std::path::Path, file: &str, samples: &[Sample], sizes: &Sizes) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let v = serde_json::json!({"sizes": sizes, "samples": samples});
    std::fs::write(out.join(file), serde_json::to_string_pretty(&v)?)?;
    Ok(())
}

/// Runs routebench with the process's arguments.
#[tokio::main]
pub async fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match Cli::parse().cmd {
        Cmd::Stubs(args) => stubs::stubs(args).await,
        Cmd::Hold(args) => hold::hold(args).await,
        Cmd::Run {
            url,
            probe_url,
            common,
        } => run(&url, probe_url.as_deref(), &common).await,
        Cmd::Compare {
            mut policies,
            peer,
            replicas,
            sims,
            kv_tokens,
            sim_args,
            results,
            label,
            window_model_s,
            salts,
            instances,
            common,
        } => {
            policies.extend(peer);
            let arms = Arms {
                policies,
                external: replicas,
                sims: sims.max(1),
                kv_tokens,
                sim_args,
                window_model_s,
                salts: salts.max(1),
                instances: instances.max(1),
            };
            compare(&arms, results, &label, &common).await
        }
    }
}

async fn run(url: &str, probe_url: Option<&str>, common: &Common) -> Result<()> {
    let s = sizes(common);
    let c = Client::new(url, &common.model, common.time_scale);
    let probe = Client::new(probe_url.unwrap_or(url), &common.model, common.time_scale);
    let mut md = String::new();
    for name in chosen(common) {
        let samples = scenario(&name, &c, &probe, &s).await;
        save(&common.out, &format!("{name}.json"), &samples, &s)?;
        md.push_str(&report::table(
            &name,
            &[(url.to_owned(), report::summarize(&name, &samples))],
        ));
        md.push('\n');
    }
    std::fs::write(common.out.join("summary.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// Refuses an arm `compare` could not start, before any arm runs.
fn check_arm(arm: &str) -> Result<()> {
    let mut parts = arm.split('+');
    let base = parts.next().unwrap_or_default();
    if !["shape", "roundrobin", "affinity", fleet::SMG].contains(&base) && !fleet::is_oracle(base) {
        bail!("unknown policy {base} in arm {arm}");
    }
    for setting in parts {
        if base == fleet::SMG || fleet::is_oracle(base) {
            bail!("arm {arm}: the peer and the oracle take no router settings");
        }
        if setting != fleet::KV_EVENTS
            && !setting
                .split_once('=')
                .is_some_and(|(k, v)| !k.is_empty() && !v.is_empty())
        {
            bail!("arm {arm}: {setting:?} is not KEY=VALUE");
        }
    }
    Ok(())
}

/// What `compare` starts for each policy.
struct Arms {
    policies: Vec<String>,
    external: Vec<SocketAddr>,
    sims: usize,
    kv_tokens: u64,
    sim_args: Vec<String>,
    window_model_s: f64,
    /// Rounds, each of every arm with fresh salts.
    salts: usize,
    instances: usize,
}

/// Router counters read around each scenario.
const SHARED_LOOKUPS: &str = "prefix_router_shared_pins_total{op=\"lookup\"";
const REPAIRS: &str = "prefix_router_index_repairs_total";
const PREDICTED: &str = "prefix_router_predicted_cached_tokens_total";
const DELIVERED: &str = "prefix_router_delivered_cached_tokens_total";

async fn compare(
    arms: &Arms,
    results: Option<PathBuf>,
    label: &str,
    common: &Common,
) -> Result<()> {
    let policies = &arms.policies;
    let s = sizes(common);
    let names = chosen(common);
    let mut rows: Vec<(String, report::Rows)> =
        names.iter().map(|n| (n.clone(), Vec::new())).collect();
    let mut turns = Vec::new();
    let mut warnings = Vec::new();
    let mut headline = Vec::new();
    for policy in policies {
        check_arm(policy)?;
    }
    let started = std::time::Instant::now();
    let mut labels = Vec::new();
    for round in 0..arms.salts {
        for policy in arm_order(policies, round) {
            // With several rounds, each round's arm is a column of its own
            // in the detailed tables.
            let label = if arms.salts > 1 {
                format!("{policy} #{}", round + 1)
            } else {
                policy.clone()
            };
            let file = fleet::file_name(&label);
            labels.push(label.clone());
            let fleet = fleet::Fleet::start(&fleet::Arm {
                policy,
                external: &arms.external,
                sims: arms.sims,
                kv_tokens: arms.kv_tokens,
                sim_args: &arms.sim_args,
                time_scale: common.time_scale,
                window_s: (arms.window_model_s / common.time_scale).ceil().max(1.0) as u32,
                dir: &common.out,
                model: &common.model,
                instances: arms.instances,
            })
            .with_context(|| format!("starting the {policy} arm"))?;
            let routers: Vec<String> = fleet
                .routers
                .iter()
                .map(|r| format!("http://{r}"))
                .collect();
            let c = if fleet::is_oracle(policy) {
                let cards: Vec<String> = (fleet.replicas.iter())
                    .map(|r| format!("http://{r}"))
                    .collect();
                let rule = match policy == fleet::ORACLE_SOONEST {
                    true => Oracle::Soonest,
                    false => Oracle::Longest,
                };
                Client::oracle(&cards, &common.model, common.time_scale, rule)
            } else {
                Client::spread(&routers, &common.model, common.time_scale)
            };
            let probe = Client::new(
                &format!("http://{}", fleet.replicas[0]),
                &common.model,
                common.time_scale,
            );
            for (i, name) in names.iter().enumerate() {
                log::info!("{label}: {name}");
                let before = fleet.log_lines(WARNING).len();
                let lookups = fleet.counter(SHARED_LOOKUPS).unwrap_or(0.0);
                let counted = [REPAIRS, PREDICTED, DELIVERED];
                let was = counted.map(|c| fleet.counter(c));
                let samples = scenario(name, &c, &probe, &s).await;
                if policy.contains("fleet.mode=redis") && !samples.is_empty() {
                    let per_request = (fleet.counter(SHARED_LOOKUPS).unwrap_or(0.0) - lookups)
                        / samples.len() as f64;
                    headline.push((
                        policy.clone(),
                        round,
                        report::redis_lookups(name).to_owned(),
                        per_request,
                    ));
                }
                let said = fleet.log_lines(WARNING);
                warnings.push((
                    label.clone(),
                    name.clone(),
                    said.len() - before,
                    said.get(before).cloned(),
                ));
                save(&common.out, &format!("{name}-{file}.json"), &samples, &s)?;
                if name == "agent-loop" && round == 0 {
                    turns.push((policy.clone(), report::per_turn(&samples)));
                }
                for (measure, value) in report::headline(name, &samples) {
                    headline.push((policy.clone(), round, measure, value));
                }
                let mut cells = report::summarize(name, &samples);
                // What the engines' cache reports made the router forget, and
                // the cached tokens it predicted against those they reported.
                let grown = |k: usize| fleet.counter(counted[k]).zip(was[k]).map(|(a, b)| a - b);
                let repairs = grown(0).map_or("–".into(), |n| format!("{n:.0}"));
                cells.push(("index repairs".into(), repairs));
                let fidelity = (grown(1).zip(grown(2))).map_or("–".into(), |(p, d)| {
                    format!("{:.0}k / {:.0}k", p / 1e3, d / 1e3)
                });
                cells.push(("cached tokens predicted / delivered".into(), fidelity));
                rows[i].1.push((label.clone(), cells));
                // Let the router's working-set window (one model minute) pass, so the
                // next scenario's capacity warnings are its own.
                let quiet = (arms.window_model_s / common.time_scale).ceil().max(1.0) + 1.0;
                tokio::time::sleep(std::time::Duration::from_secs_f64(quiet)).await;
            }
        }
    }
    // Tables list the arms in the order given, rounds in order.
    let position = |label: &str| {
        let policy = label.split(" #").next().unwrap_or(label);
        policies.iter().position(|p| p == policy)
    };
    labels.sort_by_key(|l| position(l));
    for row in &mut rows {
        row.1.sort_by_key(|(l, _)| position(l));
    }
    turns.sort_by_key(|(p, _)| position(p));
    let rounds = if arms.salts > 1 {
        format!(
            ", {} rounds of them, each with fresh salts and the arm order rotated by one \
             (headline cells list every round's figure in order; `#n` marks round n below)",
            arms.salts
        )
    } else {
        String::new()
    };
    let instances = match arms.instances {
        1 => String::new(),
        n => format!(" through {n} router instances, each request sent to one of them at random"),
    };
    let replicas = if arms.external.is_empty() {
        "fresh replicas"
    } else {
        "the same given replicas (what their caches hold carries over from one arm to the next)"
    };
    let mut md = format!(
        "### {label}\n\nOne run, {} arms in sequence{rounds}, each in front of {replicas}{instances}, one \
         model minute of quiet between scenarios; {:.0} s wall in all. Times are model seconds \
         (wall × {}); cells give the median, the p90 and the number of requests.\n\n",
        policies.len(),
        started.elapsed().as_secs_f64(),
        common.time_scale
    );
    if let Some(v) = policies
        .iter()
        .any(|p| p == fleet::SMG)
        .then(|| fleet::smg_version(&common.out))
        .flatten()
    {
        md.push_str(&format!(
            "The peer: SMG {v} (`smg launch --policy cache_aware`, its defaults), \
             in front of the same replicas.\n\n"
        ));
    }
    let seed_sizes = !common.quick && common.sizes == "seed";
    md.push_str(&report::seed_table(&headline, policies, seed_sizes));
    md.push('\n');
    for (name, r) in &rows {
        md.push_str(&report::table(name, r));
        md.push('\n');
    }
    md.push_str("Capacity warnings the router logged during each scenario (working set above a replica's `kv_tokens`):\n\n");
    let mut warn_rows = Vec::new();
    for label in &labels {
        let cells = names
            .iter()
            .map(|n| {
                let count = warnings
                    .iter()
                    .find(|w| &w.0 == label && &w.1 == n)
                    .map_or(0, |w| w.2);
                // The peer logs no capacity warnings of ours.
                let peer = label.split(' ').next() == Some(fleet::SMG);
                (
                    n.clone(),
                    if peer {
                        "–".into()
                    } else {
                        count.to_string()
                    },
                )
            })
            .collect();
        warn_rows.push((label.clone(), cells));
    }
    md.push_str(&report::table("warnings", &warn_rows));
    let counts: Vec<_> = warnings
        .iter()
        .map(|(p, n, c, _)| serde_json::json!({"policy": p, "scenario": n, "warnings": c}))
        .collect();
    std::fs::create_dir_all(&common.out)?;
    std::fs::write(
        common.out.join("warnings.json"),
        serde_json::to_string_pretty(&counts)?,
    )?;
    if let Some(example) = warnings.iter().find_map(|w| w.3.as_deref()) {
        let text = example.split("] ").last().unwrap_or(example);
        md.push_str(&format!("\nFor example: `{text}`\n"));
    }
    let svg = plot::svg("agent-loop: median TTFT per turn (model s)", &turns);
    if let Some(path) = results.as_ref().filter(|_| !turns.is_empty()) {
        let name = path.with_extension("svg");
        let name = name
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("results.svg");
        md.push_str(&format!(
            "\n![agent-loop: median TTFT per turn per policy]({name})\n"
        ));
    }
    std::fs::create_dir_all(&common.out)?;
    std::fs::write(common.out.join("summary.md"), &md)?;
    std::fs::write(common.out.join("agent-loop-ttft.svg"), &svg)?;
    if let Some(path) = results {
        let svg_path = path.with_extension("svg");
        std::fs::write(&svg_path, &svg)?;
        std::fs::write(&path, &md)?;
        log::info!("wrote {} and {}", path.display(), svg_path.display());
    }
    println!("{md}");
    Ok(())
}

/// The arms of one round: the order given, rotated by the round's number, so
/// drift over a long run (a shared machine, engines warming up) does not
/// always fall on the arm that runs last.
fn arm_order(policies: &[String], round: usize) -> impl Iterator<Item = &String> {
    policies.iter().cycle().skip(round).take(policies.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_runs_every_arm_once_starting_one_later() {
        let arms: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let order = |round| {
            arm_order(&arms, round)
                .cloned()
                .collect::<Vec<_>>()
                .join("")
        };
        assert_eq!(order(0), "abc");
        assert_eq!(order(1), "bca");
        assert_eq!(order(2), "cab");
        assert_eq!(order(3), "abc");
    }
}
