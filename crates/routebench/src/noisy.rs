//! `noisy-neighbour`: agent loops, each its own tenant, alone and then
//! while one more tenant floods the fleet at ten times its share (its
//! report cells are `report::noisy_cells`).

use serde_json::json;

use crate::client::{join_all, Client, Sample};
use crate::scenarios::{agent, agent_prompt, filler, sleep_model, Sizes};

/// `noisy-neighbour`: `agents` agent loops, each its own tenant (the
/// `x-tenant` header), first alone (group `alone`), then again while one
/// more tenant sends `overload`'s one-shots from `flood_clients` clients
/// back to back (group `flooded`; the flood's own `flood`), a refused one
/// (429, 503) retried after a model second as the SDKs do.
pub async fn noisy_neighbour(c: &Client, salt: &str, s: &Sizes) -> Vec<Sample> {
    let loops = |phase: &'static str| {
        let runs = (0..s.agents).map(move |i| {
            let name = format!("agent{i}");
            let system = agent_prompt(&format!("{salt} {phase}"), &name, s, false);
            let c = c.as_tenant(&name);
            async move {
                let mut out = agent(&c, system, &name, s, 0.2 + 1.3 * i as f64).await;
                out.iter_mut().for_each(|x| x.group = phase.to_owned());
                out
            }
        });
        async {
            join_all(runs)
                .await
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
        }
    };
    let mut out = loops("alone").await;
    let done = std::sync::atomic::AtomicBool::new(false);
    let flooded = async {
        let v = loops("flooded").await;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        v
    };
    let flooder = c.as_tenant("flood");
    let flood = (0..s.flood_clients).map(|i| {
        let (done, c) = (&done, &flooder);
        async move {
            let mut out = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let n = out.len();
                let question = filler(&format!("{salt} flood {i} {n}"), s.overload_tokens);
                let messages = vec![json!({"role": "user", "content": question})];
                let sample = c.chat("flood", n, &messages, s.overload_max_tokens).await;
                let refused = matches!(sample.status, 429 | 503);
                out.push(sample);
                if refused {
                    sleep_model(c, 1.0).await;
                }
            }
            out
        }
    });
    let (agents, flood) = tokio::join!(flooded, join_all(flood));
    out.extend(agents);
    out.extend(flood.into_iter().flatten());
    out
}
