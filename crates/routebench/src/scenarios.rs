//! The scenarios, in model-time sizes (tokens are bytes / 4 of the text sent).
//! Every prompt starts with the run's salt, so two runs never share a prefix.

use serde_json::json;

use crate::client::{join_all, Client, Sample};

/// Sizes of a run; `quick` shrinks everything for CI.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sizes {
    pub agents: usize,
    pub turns: usize,
    pub agent_initial_tokens: usize,
    pub agent_growth_tokens: usize,
    pub agent_max_tokens: u64,
    pub burst_requests: usize,
    pub burst_doc_tokens: usize,
    pub burst_max_tokens: u64,
    pub mixed_bursts: usize,
    pub probe_tokens: usize,
    pub capacity_families: Vec<usize>,
    pub capacity_turns: usize,
    /// `unseen-load`: clients sending one-shots straight to the first replica.
    pub unseen_clients: usize,
    /// `overload`: clients sending one-shots back to back for this long.
    pub overload_clients: usize,
    pub overload_s: f64,
    pub overload_tokens: usize,
    pub overload_max_tokens: u64,
    /// `shared-prefix`: tenants whose prompts fit the fleet (not one card);
    /// `-card` runs a third of them (fit one card), `-over` twice as many.
    pub tenants: usize,
    pub tenant_prompt_tokens: usize,
    pub tenant_question_tokens: usize,
    pub tenant_max_tokens: u64,
    /// Arrival rates (questions per model second) run one after the other;
    /// 0: one question at a time.
    pub tenant_rates: Vec<f64>,
    /// Questions measured at each rate, after one from every tenant.
    pub tenant_questions: usize,
    /// `many-tenants`: tenants whose prompts overflow the fleet's KV (the
    /// engines evict all the time), one card's cache emptied mid-run.
    pub many_tenants: usize,
    /// Its arrival rates, each with bursts and an emptied card.
    pub many_rates: Vec<f64>,
    /// `noisy-neighbour`: clients of the flooding tenant, each sending
    /// `overload`'s one-shots back to back.
    pub flood_clients: usize,
}

impl Sizes {
    /// The seed's shapes: 90k-token agent contexts, 16-prompt bursts, 50-80k families.
    pub fn seed() -> Self {
        Self {
            agents: 2,
            turns: 8,
            agent_initial_tokens: 80_000,
            agent_growth_tokens: 1_500,
            agent_max_tokens: 32,
            burst_requests: 16,
            burst_doc_tokens: 19_400,
            burst_max_tokens: 350,
            mixed_bursts: 3,
            probe_tokens: 60_000,
            // Any two on one 122,636-token card exceed it: the seed's pigeonhole.
            capacity_families: vec![80_000, 65_000, 60_000],
            capacity_turns: 5,
            unseen_clients: 8,
            // ~14 of these fit a card at once: 48 clients queue at the engines.
            overload_clients: 48,
            overload_s: 60.0,
            overload_tokens: 8_000,
            overload_max_tokens: 200,
            // 30 x 6k = 180k tokens: over one 122,636-token card, within two.
            tenants: 30,
            tenant_prompt_tokens: 6_000,
            tenant_question_tokens: 40,
            tenant_max_tokens: 32,
            tenant_rates: vec![4.0, 7.0],
            tenant_questions: 300,
            // Scaled from llm-d's precise-scheduling benchmark (150 tenants of
            // 6k-token prompts): 900k tokens, about twice what 4 cards hold.
            many_tenants: 150,
            // From light (the cards mostly idle) to the engines' queues
            // building: where placing by cache alone starts to pile up.
            many_rates: vec![4.0, 8.0, 12.0],
            // 10x its share of 8 places (2 cards, shed_in_flight 4) among
            // 3 tenants (2 agents and itself).
            flood_clients: 27,
        }
    }

    /// For two real llama.cpp replicas of one 4096-token slot each, on one CPU
    /// thread (~600 prompt tokens/s): the same shapes, scaled to fit a slot.
    pub fn real() -> Self {
        Self {
            agents: 2,
            turns: 6,
            agent_initial_tokens: 2_000,
            agent_growth_tokens: 100,
            agent_max_tokens: 8,
            burst_requests: 8,
            burst_doc_tokens: 500,
            burst_max_tokens: 8,
            mixed_bursts: 2,
            probe_tokens: 2_000,
            // Any two exceed one 4096-token slot; each fits alone.
            capacity_families: vec![2_600, 2_300, 2_000],
            capacity_turns: 3,
            unseen_clients: 2,
            overload_clients: 6,
            overload_s: 30.0,
            overload_tokens: 500,
            overload_max_tokens: 8,
            // With 4 slots of 4096 tokens each (ENGINE_SLOTS=4): each engine
            // keeps 4 prompts, 8 tenants fit the two, not one.
            tenants: 8,
            tenant_prompt_tokens: 2_000,
            tenant_question_tokens: 20,
            tenant_max_tokens: 8,
            tenant_rates: vec![0.0],
            tenant_questions: 48,
            many_tenants: 16,
            many_rates: vec![0.0],
            flood_clients: 8,
        }
    }

    /// Under a second per scenario at --time-scale 20, for tests (run with
    /// --kv-tokens 12000 so the capacity scenario still hits the wall).
    pub fn quick() -> Self {
        Self {
            agents: 2,
            turns: 4,
            agent_initial_tokens: 8_000,
            agent_growth_tokens: 300,
            agent_max_tokens: 4,
            burst_requests: 8,
            burst_doc_tokens: 4_000,
            burst_max_tokens: 8,
            mixed_bursts: 2,
            probe_tokens: 6_000,
            // With --kv-tokens 12000: any two on one card exceed it.
            capacity_families: vec![8_000, 6_500, 6_000],
            capacity_turns: 3,
            unseen_clients: 2,
            overload_clients: 8,
            overload_s: 5.0,
            overload_tokens: 1_000,
            overload_max_tokens: 8,
            // With --kv-tokens 12000: 6 x 3k over one card, within two.
            tenants: 6,
            tenant_prompt_tokens: 3_000,
            tenant_question_tokens: 20,
            tenant_max_tokens: 4,
            tenant_rates: vec![4.0],
            tenant_questions: 30,
            many_tenants: 12,
            many_rates: vec![4.0],
            flood_clients: 6,
        }
    }
}

/// Deterministic filler text of about `tokens` tokens, distinct per `seed`.
pub fn filler(seed: &str, tokens: usize) -> String {
    let mut out = String::with_capacity(tokens * 4 + 64);
    let mut i = 0u64;
    while out.len() < tokens * 4 {
        out.push_str(&format!(
            "{seed} line {i}: the quick brown fox jumps over the lazy dog. "
        ));
        i += 1;
    }
    out.truncate(tokens * 4);
    out
}

/// The reply the simulators produce (the client re-sends what it received).
fn reply(max_tokens: u64) -> String {
    "tok ".repeat(max_tokens as usize).trim_end().to_owned()
}

/// The first context of an agent conversation: its own, or with `shared`
/// one every agent of the run starts from (an agent platform's system prompt).
pub fn agent_prompt(salt: &str, name: &str, s: &Sizes, shared: bool) -> String {
    let whose = if shared { "every agent" } else { name };
    format!(
        "{salt} {whose}: you are a coding agent.\n{}",
        filler(whose, s.agent_initial_tokens)
    )
}

/// One agent conversation: a big first context, then tool results growing it.
pub async fn agent(c: &Client, system: String, name: &str, s: &Sizes, pause_s: f64) -> Vec<Sample> {
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": format!("{name}: fix the failing test")}),
    ];
    let mut out = Vec::new();
    for turn in 0..s.turns {
        let sample = c.chat(name, turn, &messages, s.agent_max_tokens).await;
        out.push(sample);
        messages.push(json!({"role": "assistant", "content": reply(s.agent_max_tokens)}));
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("call{turn}"),
            "content": filler(&format!("{name} tool output {turn}"), s.agent_growth_tokens)}),
        );
        // Tool execution time on the client: staggers the conversations.
        sleep_model(c, pause_s * (1.0 + turn as f64 % 3.0)).await;
    }
    out
}

/// One agent on the Responses API, its state kept by the engine: each turn
/// sends only the new tool output and names the previous response.
async fn responses_agent(
    c: &Client,
    salt: &str,
    name: &str,
    s: &Sizes,
    pause_s: f64,
) -> Vec<Sample> {
    let instructions = format!(
        "{salt} {name}: you are a coding agent.\n{}",
        filler(name, s.agent_initial_tokens)
    );
    let mut input =
        vec![json!({"role": "user", "content": format!("{name}: fix the failing test")})];
    let mut previous: Option<String> = None;
    let mut out = Vec::new();
    for turn in 0..s.turns {
        let (sample, id) = c
            .responses(
                name,
                turn,
                Some(&instructions),
                &input,
                previous.as_deref(),
                s.agent_max_tokens,
            )
            .await;
        out.push(sample);
        let Some(id) = id else { break };
        previous = Some(id);
        input = vec![
            json!({"type": "function_call_output", "call_id": format!("call{turn}"),
            "output": filler(&format!("{name} tool output {turn}"), s.agent_growth_tokens)}),
        ];
        sleep_model(c, pause_s * (1.0 + turn as f64 % 3.0)).await;
    }
    out
}

/// `agent-loop` on the Responses API: `previous_response_id` chains.
pub async fn responses_loop(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let runs = (0..s.agents).map(|i| {
        let name = format!("agent{i}");
        async move { responses_agent(c, salt, &name, s, 0.2 + 1.3 * i as f64).await }
    });
    join_all(runs).await.into_iter().flatten().collect()
}

/// `agents` conversations side by side, each a sequential-turn client; with
/// `shared` all starting from one system prompt (`agent-loop-shared`).
pub async fn agent_loop(c: &Client, salt: &str, s: &Sizes, shared: bool) -> Vec<Sample> {
    // Different tool times per conversation, so their turns do not arrive in
    // lockstep (which would let a counter pin them by accident).
    let runs = (0..s.agents).map(|i| {
        let name = format!("agent{i}");
        let system = agent_prompt(salt, &name, s, shared);
        async move { agent(c, system, &name, s, 0.2 + 1.3 * i as f64).await }
    });
    join_all(runs).await.into_iter().flatten().collect()
}

/// `burst_requests` distinct cold prompts at once, sharing a system prompt.
pub async fn burst(
    c: &Client,
    salt: &str,
    s: &Sizes,
    label: &str,
    n: usize,
    doc_tokens: usize,
) -> Vec<Sample> {
    let system = format!(
        "{salt} {label}: answer from the document.\n{}",
        filler("house rules", 600)
    );
    let runs = (0..n).map(|i| {
        let messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("{}\nQuestion {i}?", filler(&format!("{label} doc {i}"), doc_tokens))}),
        ];
        async move { c.chat(label, i, &messages, s.burst_max_tokens).await }
    });
    join_all(runs).await
}

/// Agent loops and bursts of singles at the same time.
pub async fn mixed(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let bursts = async {
        let mut out = Vec::new();
        for b in 0..s.mixed_bursts {
            sleep_model(c, 4.0).await;
            let label = format!("burst{b}");
            out.extend(
                burst(
                    c,
                    salt,
                    s,
                    &label,
                    s.burst_requests / 2,
                    s.burst_doc_tokens / 2,
                )
                .await,
            );
        }
        out
    };
    let (mut agents, bursts) = tokio::join!(agent_loop(c, salt, s, false), bursts);
    agents.extend(bursts);
    agents
}

/// `mixed` (agent loops and bursts of singles through the router) while other
/// clients keep the first replica busy straight, past the router (another
/// router instance's share, a team calling the engine directly): load the
/// router does not count.
pub async fn unseen_load(c: &Client, direct: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let done = std::sync::atomic::AtomicBool::new(false);
    let routed = async {
        let out = mixed(c, salt, s).await;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    };
    let outside = (0..s.unseen_clients).map(|i| {
        let done = &done;
        async move {
            let mut out = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let n = out.len();
                let doc = filler(&format!("{salt} outside {i} {n}"), s.burst_doc_tokens);
                let messages = vec![json!({"role": "user", "content": doc})];
                out.push(
                    direct
                        .chat("outside", n, &messages, s.burst_max_tokens)
                        .await,
                );
            }
            out
        }
    });
    let (mut out, outside) = tokio::join!(routed, join_all(outside));
    out.extend(outside.into_iter().flatten());
    out
}

/// Steady one-shot questions from `tenants` applications, each behind its own
/// long system prompt, tenants drawn uniformly: at each of `tenant_rates` in
/// turn, one question from every tenant (turn 0: the prompts' first sight),
/// then `tenant_questions` measured (turn 1..), arriving as a Poisson
/// process (one at a time at rate 0). The group is the rate (`4/s`,
/// `serial`). With `bursts`, `mixed`'s bursts of cold documents arrive
/// meanwhile, every 10 model seconds from the first measured question.
pub async fn shared_prefix(
    c: &Client,
    salt: &str,
    s: &Sizes,
    tenants: usize,
    bursts: bool,
    reset: Option<&Client>,
) -> Vec<Sample> {
    let prompts: Vec<String> = (0..tenants)
        .map(|t| {
            format!(
                "{salt} tenant {t}: you are the assistant of application {t}.\n{}",
                filler(&format!("application {t} manual"), s.tenant_prompt_tokens)
            )
        })
        .collect();
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let mut out = Vec::new();
    // `many-tenants` (a card emptied midway): its own rates, each with
    // bursts; else bursts at the first rate only.
    let rates = if reset.is_some() {
        &s.many_rates
    } else {
        &s.tenant_rates
    };
    for rate in rates {
        let group = if *rate > 0.0 {
            format!("{rate}/s")
        } else {
            "serial".to_owned()
        };
        let ask = |turn: usize, t: usize| {
            let messages = vec![
                json!({"role": "system", "content": prompts[t]}),
                json!({"role": "user", "content": format!("Question {turn} for application {t}: {}",
                    filler(&format!("{group} question {turn}"), s.tenant_question_tokens))}),
            ];
            let group = group.clone();
            async move { c.chat(&group, turn, &messages, s.tenant_max_tokens).await }
        };
        let arrivals: Vec<(usize, usize)> = (0..tenants)
            .map(|t| (0, t))
            .chain((1..=s.tenant_questions).map(|n| (n, rng.below(tenants))))
            .collect();
        if *rate <= 0.0 {
            for (turn, t) in arrivals {
                out.push(ask(turn, t).await);
            }
            continue;
        }
        let mut at = 0.0;
        let timed: Vec<_> = arrivals
            .into_iter()
            .map(|(turn, t)| {
                at += -rng.unit().ln() / rate;
                let due = at;
                let ask = &ask;
                async move {
                    sleep_model(c, due).await;
                    ask(turn, t).await
                }
            })
            .collect();
        // Bursts start with the measured questions: after every tenant's first.
        let warm_s = tenants as f64 / rate;
        let mixed_in = async {
            let mut b_out = Vec::new();
            if !bursts {
                return b_out;
            }
            sleep_model(c, warm_s).await;
            for b in 0..s.mixed_bursts {
                sleep_model(c, 10.0).await;
                let label = match reset {
                    Some(_) => format!("burst{b} at {group}"),
                    None => format!("burst{b}"),
                };
                let (n, doc) = (s.burst_requests / 2, s.burst_doc_tokens / 2);
                b_out.extend(burst(c, salt, s, &label, n, doc).await);
            }
            b_out
        };
        // Halfway through the measured questions, one card's cache is
        // emptied (a restart between two health checks).
        let emptied = async {
            if let Some(card) = reset {
                sleep_model(c, warm_s + s.tenant_questions as f64 / rate / 2.0).await;
                if !card.post_hook("/sim/reset").await {
                    log::warn!("the card's cache could not be emptied (POST /sim/reset)");
                }
            }
        };
        let (asked, burst_samples, ()) = tokio::join!(join_all(timed), mixed_in, emptied);
        out.extend(asked);
        out.extend(burst_samples);
        if bursts && reset.is_none() {
            break; // bursts are measured at the first rate only
        }
    }
    out
}

/// A small deterministic generator: every arm sees the same arrivals.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The seed's direct cache question, on one replica: the same long prompt twice
/// on an idle replica (cold, then warm), then with three different tails.
pub async fn probe(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let doc = format!("{salt} probe\n{}", filler("probe document", s.probe_tokens));
    let ask = |q: &str| vec![json!({"role": "user", "content": format!("{doc}\n{q}")})];
    let mut out = Vec::new();
    for (turn, group, q) in [
        (0, "same", "Summarise."),
        (1, "same", "Summarise."),
        (2, "tail", "What is the first line?"),
        (3, "tail", "What is the last line?"),
        (4, "tail", "Count the foxes."),
    ] {
        out.push(c.chat(group, turn, &ask(q), 1).await);
    }
    out
}

/// The seed's capacity wall: concurrent families of large contexts, each a
/// sequential-turn client, more context than the cards hold.
pub async fn capacity(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let runs = s.capacity_families.iter().enumerate().map(|(i, tokens)| {
        let sizes = Sizes {
            turns: s.capacity_turns,
            agent_initial_tokens: *tokens,
            agent_growth_tokens: 1_000.min(*tokens / 20),
            ..s.clone()
        };
        let name = format!("family{i}-{}k", tokens / 1000);
        let system = agent_prompt(salt, &name, &sizes, false);
        async move { agent(c, system, &name, &sizes, 0.5).await }
    });
    join_all(runs).await.into_iter().flatten().collect()
}

/// More demand than the cards hold: clients each sending one-shot questions
/// back to back for `overload_s` model seconds. A client told 429 waits its
/// `Retry-After` (1 s, model time: a real client's second) and goes on.
pub async fn overload(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let end = c.now() + s.overload_s;
    let runs = (0..s.overload_clients).map(|i| async move {
        let mut out = Vec::new();
        while c.now() < end {
            let n = out.len();
            let question = filler(
                &format!("{salt} client {i} question {n}"),
                s.overload_tokens,
            );
            let messages = vec![json!({"role": "user", "content": question})];
            let sample = c
                .chat("overload", n, &messages, s.overload_max_tokens)
                .await;
            let shed = sample.status == 429;
            out.push(sample);
            if shed {
                sleep_model(c, 1.0).await;
            }
        }
        out
    });
    join_all(runs).await.into_iter().flatten().collect()
}

pub async fn sleep_model(c: &Client, model_s: f64) {
    tokio::time::sleep(std::time::Duration::from_secs_f64(model_s / c.scale)).await;
}
