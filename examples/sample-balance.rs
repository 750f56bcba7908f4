//! How evenly placement in windows (`sample`) spreads singles over a large
//! fleet, simulated with the router's own placement (`Replicas::sample_into`
//! and `Policy::place_offered`, as `proxy::place` calls them): 1,000 live
//! replicas, a new one-shot question placed per tick, each held in flight
//! for a time drawn from an exponential distribution (answers of varied
//! length), so that `load` requests are in flight per replica on average. Per window
//! size, every 1,000 ticks after a warm-up, the in-flight counts across the
//! fleet: their standard deviation over their mean (0: even), the largest
//! over the mean, and the share of placements that went to a replica
//! busier than the fleet's least busy, and how many replicas' states a
//! placement read (a window is read up to its first idle replica). A window offers its least loaded
//! (requests in flight); the whole fleet read (`sample: {above: 0}`) is
//! shown beside, though there the counter takes turns among the replicas
//! least queued for prefill, and these requests carry none: plain turns.
//! The hold times are one seeded stream for every row; each window's turn
//! starts at random, as in the router, so a run repeats only about.
//!
//!     cargo run --release --example sample-balance [REPLICAS]
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::time::Instant;

use prefix_router::config;
use prefix_router::metrics::Metrics;
use prefix_router::policy::{Policy, ReplicaState};
use prefix_router::policy_config::policy_config;
use prefix_router::replicas::{HealthRules, Replicas};
use prefix_router::request::Prompt;

/// SplitMix64: a seeded, reproducible stream of uniform draws.
struct Draws(u64);

impl Draws {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with this mean, at least one tick.
    fn hold(&mut self, mean: f64) -> u64 {
        ((-(1.0 - self.unit()).ln() * mean) as u64).max(1)
    }
}

struct Spread {
    cv: f64,
    max_over_mean: f64,
    above_least: f64,
    read: f64,
}

fn run(n: usize, load: f64, window: usize) -> Spread {
    let cfg: Vec<config::Replica> = (0..n)
        .map(|i| config::Replica::at(format!("r{i}"), format!("127.0.0.1:{}", 10_000 + i)))
        .collect();
    let set = Replicas::new(&cfg, Metrics::standalone());
    let view = set.snapshot();
    let rules = HealthRules {
        fall: 3,
        rise: 1,
        serving: std::time::Duration::from_secs(5),
        interval: std::time::Duration::from_secs(1),
        per_second: 0,
    };
    for r in view.iter() {
        r.on_check(true, false, Instant::now(), &rules);
    }
    // The router's policy as shipped (no `engine_load`: the counter takes
    // turns among the least queued).
    let policy = Policy::new(policy_config(&config::Config::default()));
    // A new one-shot question each tick: a placement records its prompt, so
    // a question asked again would go back to the replica it went to.
    let question = |t: u64| {
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user",
            "content": format!("question {t}: please summarise these notes.")}]});
        let body = serde_json::to_vec(&body).expect("json");
        Prompt::parse(&body, 1 << 20)
            .expect("a prompt")
            .into_request(1024, None)
    };
    let mean_hold = load * n as f64;
    let (warm, ticks) = ((5.0 * mean_hold) as u64, (40.0 * mean_hold) as u64);
    let mut draws = Draws(0x5EED);
    // Requests in flight by (end, start): their guards, dropped at the end.
    let mut held = BTreeMap::new();
    let mut states: Vec<ReplicaState> = Vec::new();
    let (mut cv, mut top, mut samples) = (0.0, 0.0, 0u32);
    let (mut placed, mut above, mut read) = (0u64, 0u64, 0usize);
    for t in 0..warm + ticks {
        while held
            .first_key_value()
            .is_some_and(|(&(end, _), _)| end <= t)
        {
            held.pop_first();
        }
        let req = &question(t);
        let offered = &mut states;
        let decision = policy.place_offered(req, |holders| {
            if !(window > 0 && Replicas::sample_into(&view, &[], None, holders, window, offered)) {
                Replicas::states_into(&view, &[], None, None, offered);
            }
            if t >= warm {
                read += offered.len();
            }
            offered
        });
        let Some(at) = decision.replica.and_then(|id| view.position(id)) else {
            continue;
        };
        if t >= warm {
            let least = view.iter().map(|r| r.in_flight()).min().unwrap_or(0);
            placed += 1;
            above += u64::from(view[at].in_flight() > least);
        }
        held.insert((t + draws.hold(mean_hold), t), view[at].begin(0, 0));
        if t >= warm && t % 1000 == 0 {
            let counts: Vec<f64> = view.iter().map(|r| f64::from(r.in_flight())).collect();
            let mean = counts.iter().sum::<f64>() / n as f64;
            let var = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / n as f64;
            let max = counts.iter().copied().fold(0.0, f64::max);
            cv += var.sqrt() / mean;
            top += max / mean;
            samples += 1;
        }
    }
    Spread {
        cv: cv / f64::from(samples),
        max_over_mean: top / f64::from(samples),
        above_least: above as f64 / placed as f64,
        read: read as f64 / ticks as f64,
    }
}

fn main() {
    let n = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    println!("{n} replicas; one single a tick, each held an exponential time (mean: load x replicas ticks)");
    println!("| in flight per replica | window | std / mean | largest / mean | placed above the least busy | replicas read per placement |");
    println!("|---|---|---|---|---|---|");
    for load in [0.25, 1.0, 4.0, 16.0] {
        for window in [0, 32, 16, 8] {
            let s = run(n, load, window);
            let name = if window == 0 {
                "the whole fleet".to_owned()
            } else {
                window.to_string()
            };
            println!(
                "| {load} | {name} | {:.3} | {:.2} | {:.1} % | {:.1} |",
                s.cv,
                s.max_over_mean,
                100.0 * s.above_least,
                s.read
            );
        }
    }
}
