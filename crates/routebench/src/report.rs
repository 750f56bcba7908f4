//! Summaries of samples (median and p90 with the sample size next to each),
//! Markdown tables, and an SVG plot of warm-turn TTFT per turn.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::client::Sample;

/// Median, p90 and n of some values.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Stat {
    pub median: f64,
    pub p90: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Self {
            median: at(0.5),
            p90: at(0.9),
            n: v.len(),
        }
    }

    /// `1.23 s (p90 1.50, n=14)`
    pub fn show(&self) -> String {
        if self.n == 0 {
            return "–".into();
        }
        format!("{:.2} s (p90 {:.2}, n={})", self.median, self.p90, self.n)
    }
}

/// Samples that succeeded.
pub fn ok(samples: &[Sample]) -> impl Iterator<Item = &Sample> + Clone {
    samples.iter().filter(|s| s.status == 200)
}

pub fn errors(samples: &[Sample]) -> usize {
    samples.iter().filter(|s| s.status != 200).count()
}

/// Share of prompt tokens served from cache.
pub fn cached_share<'a>(samples: impl Iterator<Item = &'a Sample>) -> f64 {
    let (c, p) = samples.fold((0, 0), |(c, p), s| {
        (c + s.cached_tokens, p + s.prompt_tokens)
    });
    if p == 0 {
        0.0
    } else {
        c as f64 / p as f64
    }
}

/// From the first start to the last finish, model seconds.
pub fn makespan<'a>(samples: impl Iterator<Item = &'a Sample> + Clone) -> f64 {
    let start = samples
        .clone()
        .map(|s| s.start_s)
        .fold(f64::INFINITY, f64::min);
    let end = samples.map(|s| s.start_s + s.total_s).fold(0.0, f64::max);
    if start.is_finite() {
        end - start
    } else {
        0.0
    }
}

/// Requests per replica, e.g. `gpu0 8 / gpu1 8`.
pub fn placement<'a>(samples: impl Iterator<Item = &'a Sample>) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for s in samples {
        *by.entry(if s.replica.is_empty() {
            "?"
        } else {
            &s.replica
        })
        .or_default() += 1;
    }
    by.iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Table cells: (column, value) pairs.
pub type Cells = Vec<(String, String)>;

/// One table: a row of cells per policy (or target).
pub type Rows = Vec<(String, Cells)>;

/// One scenario's headline figures, as (column, value) pairs.
pub fn summarize(scenario: &str, samples: &[Sample]) -> Cells {
    let ttft = |f: &dyn Fn(&Sample) -> bool| {
        Stat::of(ok(samples).filter(|s| f(s)).map(|s| s.ttft_s).collect())
    };
    let mut row = Vec::new();
    match scenario {
        "agent-loop" | "agent-loop-shared" | "responses-loop" => {
            row.push(("cold first turn TTFT".into(), ttft(&|s| s.turn == 0).show()));
            row.push(("warm turn TTFT".into(), ttft(&|s| s.turn > 0).show()));
            row.push((
                "warm cached".into(),
                pct(cached_share(ok(samples).filter(|s| s.turn > 0))),
            ));
            row.push(("placement".into(), placement(ok(samples))));
        }
        "burst" => {
            row.push((
                "makespan".into(),
                format!("{:.2} s (n={})", makespan(ok(samples)), ok(samples).count()),
            ));
            row.push(("TTFT".into(), ttft(&|_| true).show()));
            // Equal shares and placements: equal prefill work, whatever the makespans say.
            row.push(("cached".into(), pct(cached_share(ok(samples)))));
            row.push(("placement".into(), placement(ok(samples))));
        }
        "mixed" | "unseen-load" => {
            // `unseen-load` is `mixed` with clients past the router: the same
            // cells, and placement, burst TTFT and those clients' TTFT too.
            let unseen = scenario == "unseen-load";
            let agent = |s: &Sample| s.group.starts_with("agent");
            let burst = |s: &Sample| s.group.starts_with("burst");
            row.push((
                "agent warm TTFT".into(),
                ttft(&|s| agent(s) && s.turn > 0).show(),
            ));
            if unseen {
                row.push((
                    "agent placement".into(),
                    placement(ok(samples).filter(|s| agent(s))),
                ));
            }
            row.push((
                "burst makespan".into(),
                Stat::of(burst_spans(samples)).show(),
            ));
            if unseen {
                row.push(("burst TTFT".into(), ttft(&burst).show()));
            }
            row.push((
                "burst placement".into(),
                placement(ok(samples).filter(|s| burst(s))),
            ));
            if unseen {
                row.push((
                    "outside TTFT (straight to gpu0)".into(),
                    ttft(&|s| s.group == "outside").show(),
                ));
            }
        }
        "probe" => {
            let at = |t: usize| ok(samples).find(|s| s.turn == t);
            let show = |s: Option<&Sample>| {
                s.map_or("–".into(), |s| {
                    format!("{:.2} s ({} cached)", s.ttft_s, s.cached_tokens)
                })
            };
            row.push(("cold".into(), show(at(0))));
            row.push(("same again".into(), show(at(1))));
            row.push(("varying tail".into(), ttft(&|s| s.group == "tail").show()));
        }
        "overload" => {
            let served = ok(samples).count();
            let shed = samples.iter().filter(|s| s.status == 429).count();
            let span = makespan(samples.iter());
            let mut ttft: Vec<f64> = ok(samples).map(|s| s.ttft_s).collect();
            ttft.sort_by(f64::total_cmp);
            let at = |q: f64| ttft.get(((ttft.len().max(1) - 1) as f64 * q).round() as usize);
            row.push((
                "goodput".into(),
                format!(
                    "{:.2} req/s ({served} served)",
                    served as f64 / span.max(1e-9)
                ),
            ));
            row.push((
                "TTFT p50 / p99 of served".into(),
                match (at(0.5), at(0.99)) {
                    (Some(p50), Some(p99)) => format!("{p50:.2} s / {p99:.2} s"),
                    _ => "–".into(),
                },
            ));
            row.push((
                "shed (429)".into(),
                format!(
                    "{shed} ({})",
                    pct(shed as f64 / samples.len().max(1) as f64)
                ),
            ));
            row.push(("placement".into(), placement(ok(samples))));
        }
        "noisy-neighbour" => noisy_cells(samples, &mut row),
        name if name.starts_with("shared-prefix") || name == "many-tenants" => {
            for (g, v) in groups(samples) {
                if g.starts_with("burst") {
                    continue;
                }
                let asked: Vec<&Sample> = v.into_iter().filter(|s| s.turn > 0).collect();
                let st = Stat::of(asked.iter().map(|s| s.ttft_s).collect());
                row.push((
                    format!("{g}: cached"),
                    pct(cached_share(asked.iter().copied())),
                ));
                row.push((format!("{g}: TTFT"), st.show()));
                row.push((format!("{g}: placement"), placement(asked.into_iter())));
            }
            if burst_spans(samples).is_empty() {
                return finish(scenario, samples, row);
            }
            let burst = |s: &&Sample| s.group.starts_with("burst");
            row.push((
                "burst makespan".into(),
                Stat::of(burst_spans(samples)).show(),
            ));
            row.push((
                "burst placement".into(),
                placement(ok(samples).filter(burst)),
            ));
        }
        "capacity" => {
            for (g, v) in groups(samples) {
                let warm: Vec<&Sample> = v.iter().copied().filter(|s| s.turn > 0).collect();
                let st = Stat::of(warm.iter().map(|s| s.ttft_s).collect());
                row.push((
                    g,
                    format!(
                        "{} · {} cached",
                        st.show(),
                        pct(cached_share(warm.into_iter()))
                    ),
                ));
            }
        }
        _ => {}
    }
    finish(scenario, samples, row)
}

/// `noisy-neighbour`'s cells: the agents' warm-turn TTFT flooded against
/// alone, their errors, the flood's goodput and refusals.
fn noisy_cells(samples: &[Sample], row: &mut Cells) {
    let warm = |g: &str| {
        Stat::of(
            ok(samples)
                .filter(|s| s.group == g && s.turn > 0)
                .map(|s| s.ttft_s)
                .collect(),
        )
    };
    let (alone, flooded) = (warm("alone"), warm("flooded"));
    row.push(("agents alone: warm TTFT".into(), alone.show()));
    row.push(("agents flooded: warm TTFT".into(), flooded.show()));
    row.push((
        "flooded / alone (p50, p90)".into(),
        format!(
            "{:.2}x, {:.2}x",
            flooded.median / alone.median.max(1e-9),
            flooded.p90 / alone.p90.max(1e-9)
        ),
    ));
    let agents = || samples.iter().filter(|s| s.group != "flood");
    row.push((
        "agents' errors".into(),
        agents().filter(|s| s.status != 200).count().to_string(),
    ));
    let flood: Vec<&Sample> = samples.iter().filter(|s| s.group == "flood").collect();
    let served = flood.iter().filter(|s| s.status == 200).count();
    let refused = flood
        .iter()
        .filter(|s| matches!(s.status, 429 | 503))
        .count();
    row.push((
        "flood: served, refused".into(),
        format!(
            "{:.2} req/s ({served}), {refused}",
            served as f64 / makespan(flood.iter().copied()).max(1e-9)
        ),
    ));
}
/// The cells every scenario ends with: errors, requests and duration.
fn finish(scenario: &str, samples: &[Sample], mut row: Cells) -> Cells {
    // A shed request is the point of `overload`, not an error there.
    let shed = match scenario {
        "overload" => samples.iter().filter(|s| s.status == 429).count(),
        // The flood's refusals are the point; the agents' are counted above.
        "noisy-neighbour" => (samples.iter())
            .filter(|s| s.group == "flood" && s.status != 200)
            .count(),
        _ => 0,
    };
    row.push(("errors".into(), (errors(samples) - shed).to_string()));
    row.push((
        "requests, duration".into(),
        format!("{}, {:.0} s", samples.len(), makespan(samples.iter())),
    ));
    row
}

fn pct(x: f64) -> String {
    format!("{:.0} %", x * 100.0)
}

/// The makespan of each burst group.
fn burst_spans(samples: &[Sample]) -> Vec<f64> {
    groups(samples)
        .iter()
        .filter(|(g, _)| g.starts_with("burst"))
        .map(|(_, v)| makespan(v.iter().copied()))
        .collect()
}

fn groups(samples: &[Sample]) -> BTreeMap<String, Vec<&Sample>> {
    let mut by: BTreeMap<String, Vec<&Sample>> = BTreeMap::new();
    for s in ok(samples) {
        by.entry(s.group.clone()).or_default().push(s);
    }
    by
}

/// The headline measures of one scenario run: median warm-turn TTFT for
/// agent loops and capacity families, makespan for bursts, agent warm TTFT
/// and the median burst makespan within mixed traffic.
pub fn headline(scenario: &str, samples: &[Sample]) -> Vec<(String, f64)> {
    let warm = |f: &dyn Fn(&Sample) -> bool| {
        Stat::of(
            ok(samples)
                .filter(|s| s.turn > 0 && f(s))
                .map(|s| s.ttft_s)
                .collect(),
        )
        .median
    };
    if scenario == "shared-prefix" || scenario == "many-tenants" {
        // Per rate: the engines' cached share and the p90 TTFT of the
        // measured questions.
        let mut out = Vec::new();
        for (g, v) in groups(samples) {
            let asked = || v.iter().copied().filter(|s| s.turn > 0);
            out.push((format!("{scenario} {g}: {CACHED}"), cached_share(asked())));
            let p90 = Stat::of(asked().map(|s| s.ttft_s).collect()).p90;
            out.push((format!("{scenario} {g}: p90 TTFT"), p90));
        }
        return out;
    }
    let v: Vec<(&str, f64)> = match scenario {
        "agent-loop" => vec![(AGENT_LOOP, warm(&|_| true))],
        "agent-loop-shared" => vec![(AGENT_LOOP_SHARED, warm(&|_| true))],
        "responses-loop" => vec![(RESPONSES_LOOP, warm(&|_| true))],
        "burst" => vec![(BURST, makespan(ok(samples)))],
        "mixed" => vec![
            (MIXED_AGENT, warm(&|s| s.group.starts_with("agent"))),
            (MIXED_BURST, Stat::of(burst_spans(samples)).median),
        ],
        "unseen-load" => vec![
            (UNSEEN_AGENT, warm(&|s| s.group.starts_with("agent"))),
            (UNSEEN_BURST, Stat::of(burst_spans(samples)).median),
        ],
        "capacity" => vec![(CAPACITY, warm(&|_| true))],
        _ => Vec::new(),
    };
    v.into_iter().map(|(m, x)| (m.to_owned(), x)).collect()
}

/// Headline measures ending so are shares, shown in percent.
const CACHED: &str = "cached share";

/// The headline row of Redis round trips per request in `scenario`.
pub fn redis_lookups(scenario: &str) -> &'static str {
    match scenario {
        "agent-loop" => REDIS_AGENT_LOOP,
        "burst" => REDIS_BURST,
        "mixed" => REDIS_MIXED,
        _ => REDIS_OTHER,
    }
}

const REDIS_AGENT_LOOP: &str = "agent-loop: Redis round trips per request";
const REDIS_BURST: &str = "burst: Redis round trips per request";
const REDIS_MIXED: &str = "mixed: Redis round trips per request";
const REDIS_OTHER: &str = "other scenarios: Redis round trips per request";

const AGENT_LOOP: &str = "agent-loop warm-turn TTFT (median)";
const RESPONSES_LOOP: &str = "responses-loop warm-turn TTFT (median)";
const AGENT_LOOP_SHARED: &str = "agent-loop-shared warm-turn TTFT (median)";
const BURST: &str = "burst makespan";
const MIXED_AGENT: &str = "agent warm TTFT amid bursts (median)";
const MIXED_BURST: &str = "burst makespan amid agents (median of bursts)";
const UNSEEN_AGENT: &str = "agent warm TTFT amid bursts and unseen load (median)";
const UNSEEN_BURST: &str = "burst makespan amid agents and unseen load (median of bursts)";
const CAPACITY: &str = "capacity warm-turn TTFT (median, all families)";

/// One headline figure: arm, salt (round), measure, value.
pub type Headline = (String, usize, String, f64);

/// This run's headline figures per arm (every salt's, in run order), with the
/// seed's measurements beside them when the run used the seed's sizes.
pub fn seed_table(headline: &[Headline], arms: &[String], with_seed: bool) -> String {
    // Scenarios without headline measures (`noisy-neighbour`): no table.
    if headline.is_empty() {
        return String::new();
    }
    let cell = |arm: &str, measure: &str| {
        let values: Vec<String> = headline
            .iter()
            .filter(|(a, _, m, _)| a == arm && *m == measure)
            .map(|(_, _, _, v)| {
                if measure.ends_with(CACHED) {
                    format!("{:.0} %", v * 100.0)
                } else {
                    format!("{v:.2}")
                }
            })
            .collect();
        let unit = if measure.contains("per request") || measure.ends_with(CACHED) {
            ""
        } else {
            " s"
        };
        if values.is_empty() {
            "–".to_owned()
        } else {
            format!("{}{unit}", values.join(" / "))
        }
    };
    let mut out = String::from("| measure |");
    if with_seed {
        out.push_str(" seed: pinned | seed: round-robin | seed: shape rule |");
    }
    for arm in arms {
        let _ = write!(out, " {arm} |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(arms.len() + if with_seed { 3 } else { 0 }));
    out.push('\n');
    let fixed = [
        (AGENT_LOOP, ["1.10 s", "2.68 s", "1.10 s"]),
        (BURST, ["30.1 s", "18.6 s", "19.97 s"]),
        (MIXED_AGENT, ["–", "–", "–"]),
        (MIXED_BURST, ["–", "–", "–"]),
        (UNSEEN_AGENT, ["–", "–", "–"]),
        (UNSEEN_BURST, ["–", "–", "–"]),
        (CAPACITY, ["–", "–", "–"]),
        (REDIS_AGENT_LOOP, ["–", "–", "–"]),
        (REDIS_BURST, ["–", "–", "–"]),
        (REDIS_MIXED, ["–", "–", "–"]),
        (REDIS_OTHER, ["–", "–", "–"]),
    ];
    // Then the measures named per run (`shared-prefix`'s rates), as they came.
    let mut named: Vec<(&str, [&str; 3])> = Vec::new();
    for (_, _, m, _) in headline {
        if !fixed.iter().any(|(f, _)| f == m) && !named.iter().any(|(n, _)| n == m) {
            named.push((m, ["–", "–", "–"]));
        }
    }
    for (measure, seed) in fixed.into_iter().chain(named) {
        if !headline.iter().any(|(_, _, m, _)| m == measure) {
            continue;
        }
        let _ = write!(out, "| {measure} |");
        if with_seed {
            let _ = write!(out, " {} | {} | {} |", seed[0], seed[1], seed[2]);
        }
        for arm in arms {
            let _ = write!(out, " {} |", cell(arm, measure));
        }
        out.push('\n');
    }
    out
}

/// A Markdown table: one row per policy (or target), columns from `summarize`.
pub fn table(scenario: &str, rows: &[(String, Cells)]) -> String {
    let Some((_, first)) = rows.first() else {
        return String::new();
    };
    let mut out = format!("| {scenario} |");
    for (col, _) in first {
        let _ = write!(out, " {col} |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(first.len()));
    for (name, cells) in rows {
        let _ = write!(out, "\n| {name} |");
        for (_, v) in cells {
            let _ = write!(out, " {v} |");
        }
    }
    out.push('\n');
    out
}

/// Median warm-turn TTFT per turn of the agent-loop scenario, per series.
pub fn per_turn(samples: &[Sample]) -> Vec<(usize, f64)> {
    let mut by: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for s in ok(samples).filter(|s| s.group.starts_with("agent")) {
        by.entry(s.turn).or_default().push(s.ttft_s);
    }
    by.into_iter()
        .map(|(t, v)| (t, Stat::of(v).median))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_p90_with_the_sample_size() {
        let s = Stat::of((1..=10).map(f64::from).collect());
        assert_eq!((s.median, s.p90, s.n), (6.0, 9.0, 10));
        assert_eq!(Stat::of(vec![]).show(), "–");
    }

    #[test]
    fn makespan_runs_from_first_start_to_last_finish() {
        let s = |start_s, total_s| Sample {
            start_s,
            total_s,
            status: 200,
            ..Sample::default()
        };
        let v = [s(1.0, 2.0), s(2.0, 5.0)];
        assert_eq!(makespan(v.iter()), 6.0);
    }
}
