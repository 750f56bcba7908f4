//! Engines' own load, read from their Prometheus endpoints (config
//! `engine_load`): requests running and waiting, and KV cache in use, under
//! vLLM's, SGLang's and llama.cpp's names. A background service reads every
//! replica each interval (past `max_per_second`, each in its turn of every
//! few rounds: `crate::replicas::probes`), the round's reads paced over
//! half the interval (at most a second), and hands the figures to the
//! replica, where the policy sees them as the requests beyond the router's
//! own ([`EngineLoad`]).
//! A read that fails, takes longer than the interval or names none of the
//! known series keeps the last figures; three in a row drop them, so the
//! router's own counts are in force: logged once per replica (and once when
//! reads work again); every read is counted in `prefix_router_engine_reads_total`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::connectors::http::Connector as HttpConnector;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use pingora_core::upstreams::peer::HttpPeer;

use crate::config;
use crate::engine_client::{OwnGet, KEEP_IDLE};
use crate::metrics::Metrics;
use crate::policy::{EngineLoad, ReplicaId};
use crate::replicas::{probes, Replica, Replicas};

/// Requests running, by engine.
const RUNNING: [&str; 3] = [
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
];
/// Requests waiting for a place in the running batch.
const WAITING: [&str; 3] = [
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
];
/// KV cache in use, 0..1 (llama.cpp exports none).
const KV_USED: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// A larger metrics page is refused (vLLM's is ~100 KiB).
const MAX_PAGE_BYTES: usize = 4 << 20;

/// What one engine reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Requests running plus waiting.
    pub requests: u32,
    /// KV cache in use, per mille, when the engine says.
    pub kv_used_permille: Option<u16>,
}

impl Reading {
    /// The load the policy sees: what the engine counts beyond the router's
    /// own `own` requests there when the read started.
    pub fn seen_beside(self, own: u32) -> EngineLoad {
        EngineLoad {
            unseen: self.requests.saturating_sub(own),
            kv_used_permille: self.kv_used_permille,
        }
    }
}

/// Load figures from a Prometheus text page: running plus waiting requests
/// summed over label sets (data-parallel ranks, models), the largest KV
/// use; `None` when the page has none of the request series.
pub fn parse(page: &str) -> Option<Reading> {
    let (mut requests, mut seen, mut kv) = (0f64, false, None::<f64>);
    for line in page.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        if RUNNING.contains(&name) || WAITING.contains(&name) {
            requests += value;
            seen = true;
        } else if KV_USED.contains(&name) {
            kv = Some(kv.map_or(value, |k| k.max(value)));
        }
    }
    seen.then(|| Reading {
        requests: requests.round().min(f64::from(u32::MAX - 1)) as u32,
        kv_used_permille: kv.map(|k| (k.min(1.0) * 1000.0).round() as u16),
    })
}

/// One sample line's metric name and value (finite, not negative).
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim_start();
    if line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t'])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    (value.is_finite() && value >= 0.0).then_some((name, value))
}

/// The index just past the `}` closing a label set that starts `text`
/// (label values are quoted and may hold `}` and escaped quotes).
fn labels_end(text: &str) -> Option<usize> {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// Why a read gave nothing usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    /// No answer, an error status, a page over the size cap, or not within
    /// the interval.
    Failed,
    /// An answer with none of the known series.
    Unrecognised,
}

/// Reads in a row that give nothing before a replica's last figures are
/// dropped: an engine busy enough to answer late must not look idle at once.
const KEEP_THROUGH_MISSES: u32 = 3;

/// The background service that reads every replica's metrics.
pub struct EngineLoadWatch {
    reader: Arc<Reader>,
    interval: Duration,
    /// Reads a second at most (0: no cap).
    per_second: u32,
}

/// What one read needs; shared by the concurrent reads of a round.
struct Reader {
    replicas: Arc<Replicas>,
    page: OwnGet,
    metrics: Arc<Metrics>,
    /// Reads in a row that gave nothing, per replica.
    misses: Mutex<HashMap<ReplicaId, u32>>,
}

impl EngineLoadWatch {
    /// `peer` and `connector` carry the replica TLS settings (the peer's
    /// address is replaced per replica); `host` is the `Host` header the
    /// health checks send too.
    pub fn new(
        replicas: Arc<Replicas>,
        load: &config::EngineLoad,
        host: &str,
        (peer, connector): (HttpPeer, HttpConnector),
        metrics: Arc<Metrics>,
    ) -> pingora_core::Result<Self> {
        // Connections kept between reads, past the rounds of a replica's turns.
        let page = OwnGet::new(
            &load.path,
            host,
            (peer, connector),
            KEEP_IDLE,
            MAX_PAGE_BYTES,
        )?;
        Ok(Self {
            reader: Arc::new(Reader {
                replicas,
                page,
                metrics,
                misses: Mutex::new(HashMap::new()),
            }),
            interval: config::ms(load.interval_ms),
            per_second: load.max_per_second,
        })
    }

    /// Reads every replica whose turn round `round` is (every replica,
    /// within the budget), started in paced groups (`probes::run_paced`),
    /// each ending within the interval from the round's start.
    async fn round(&self, round: u32) {
        let list = self.reader.replicas.snapshot();
        let spread = probes::spread(list.len(), self.interval, self.per_second);
        // Every read ends by the round's end, however late in it it started.
        let deadline = tokio::time::Instant::now() + self.interval;
        let reader = Arc::clone(&self.reader);
        let read = move |r: Arc<Replica>| {
            let reader = Arc::clone(&reader);
            async move {
                // The router's own requests there as the engine counts them.
                let own = r.in_flight();
                let reading = match tokio::time::timeout_at(deadline, reader.read(&r)).await {
                    Ok(Ok(page)) => {
                        parse(&String::from_utf8_lossy(&page)).ok_or(Unread::Unrecognised)
                    }
                    Ok(Err(_)) | Err(_) => Err(Unread::Failed),
                };
                reader.report(&r, reading.map(|l| (l, own)));
            }
        };
        let window = probes::window(self.interval);
        (self.reader.replicas)
            .probe_round(&list, |r| r.read_due(round, spread), window, read)
            .await;
        let ids: HashSet<ReplicaId> = list.iter().map(|r| r.id).collect();
        let mut misses = self.reader.misses.lock().unwrap_or_else(|p| p.into_inner());
        misses.retain(|id, _| ids.contains(id));
    }
}

impl Reader {
    async fn read(&self, replica: &Replica) -> pingora_core::Result<Vec<u8>> {
        self.page
            .get(replica.addr, replica.api_key().as_deref())
            .await
    }

    /// Hands a read's result (the figures, and the router's own requests
    /// there when it started) to the replica, counts it, and logs when a
    /// replica's figures are dropped and when they are back.
    fn report(&self, r: &Replica, reading: Result<(Reading, u32), Unread>) {
        let result = match reading {
            Ok(_) => "ok",
            Err(Unread::Failed) => "failed",
            Err(Unread::Unrecognised) => "unrecognised",
        };
        let listed = self.replicas.snapshot();
        // Still in the set (by id: a rename keeps it), looked up, not
        // searched: a round reads every replica.
        let kept = listed.position(r.id).map(|i| &listed[i]);
        // A name reloaded away while being read gets no series again.
        let named =
            kept.is_some_and(|x| x.name == r.name) || listed.iter().any(|x| x.name == r.name);
        if named {
            (self.metrics.engine_reads)
                .with_label_values(&[&r.name, result])
                .inc();
        }
        if kept.is_none() {
            // Reloaded away while being read: nothing of it is shown again
            // (unless a replica of that name is still there).
            if !named {
                self.metrics.engine_load(&r.name, None);
            }
            return;
        }
        let mut misses = self.misses.lock().unwrap_or_else(|p| p.into_inner());
        let missed = misses.entry(r.id).or_insert(0);
        match reading {
            Ok((load, own)) => {
                if *missed >= KEEP_THROUGH_MISSES {
                    log::info!("replica {}: engine load readable again", r.name);
                }
                *missed = 0;
                r.set_engine(Some(load.seen_beside(own)));
                self.metrics
                    .engine_load(&r.name, Some((load.requests, load.kv_used_permille)));
            }
            Err(why) => {
                *missed = missed.saturating_add(1);
                if *missed != KEEP_THROUGH_MISSES {
                    return;
                }
                r.set_engine(None);
                self.metrics.engine_load(&r.name, None);
                log::warn!(
                    "replica {}: engine load not readable ({} reads in a row: {}); placing by the \
                     router's own counts until it is",
                    r.name,
                    KEEP_THROUGH_MISSES,
                    match why {
                        Unread::Failed => "no answer in time, an error status or an oversized page",
                        Unread::Unrecognised =>
                            "none of vllm:num_requests_running/_waiting, sglang:num_running_reqs/\
                             num_queue_reqs, llamacpp:requests_processing/_deferred",
                    }
                );
            }
        }
    }
}

#[async_trait]
impl BackgroundService for EngineLoadWatch {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut round = 0u32;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => self.round(round).await,
            }
            round = round.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(requests: u32, kv: Option<u16>) -> Option<Reading> {
        Some(Reading {
            requests,
            kv_used_permille: kv,
        })
    }

    #[test]
    fn vllm_pages_sum_running_and_waiting_over_engines() {
        let page =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 9.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.4123\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.87\n";
        assert_eq!(parse(page), load(9, Some(870)));
    }

    #[test]
    fn sglang_and_llama_cpp_pages_are_read_by_their_names() {
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 8\n\
            sglang:num_queue_reqs{model_name=\"m\"} 4\n\
            sglang:token_usage{model_name=\"m\"} 0.28\n";
        assert_eq!(parse(sglang), load(12, Some(280)));
        let llama = "# TYPE llamacpp:requests_processing gauge\n\
            llamacpp:requests_processing 1\n\
            llamacpp:requests_deferred 2\n\
            llamacpp:prompt_tokens_total 123456\n";
        assert_eq!(parse(llama), load(3, None));
    }

    #[test]
    fn labels_holding_braces_quotes_and_spaces_do_not_confuse_the_reader() {
        let page = "vllm:num_requests_running{model_name=\"a } \\\"b\\\" {c\"} 5 1700000000000\n\
            vllm:num_requests_waiting{model_name=\"x y\"}\t1e0\n";
        assert_eq!(parse(page), load(6, None));
    }

    #[test]
    fn pages_without_known_series_or_with_bad_values_give_nothing_usable() {
        for page in [
            "",
            "<html>not found</html>",
            "process_cpu_seconds_total 3\nvllm:kv_cache_usage_perc 0.5\n",
            "vllm:num_requests_running{model_name=\"m\" 3\n",
            "vllm:num_requests_running NaN\nvllm:num_requests_waiting -1\n",
            "vllm:num_requests_runningX 3\n",
        ] {
            assert_eq!(parse(page), None, "{page:?}");
        }
    }

    #[test]
    fn the_routers_own_requests_are_not_counted_twice() {
        let r = Reading {
            requests: 5,
            kv_used_permille: Some(10),
        };
        assert_eq!(r.seen_beside(3).unseen, 2);
        assert_eq!(r.seen_beside(9).unseen, 0, "some finished since");
    }

    #[test]
    fn absurd_figures_are_clamped() {
        let page = "vllm:num_requests_running 1e30\nvllm:kv_cache_usage_perc 7\n";
        assert_eq!(parse(page), load(u32::MAX - 1, Some(1000)));
    }

    /// One sample line of `name` with a label set that may hold `}`, `"`
    /// and `\` in its values, and `value`.
    fn line(name: &str, label: &str, value: f64) -> String {
        let escaped = label.replace('\\', "\\\\").replace('"', "\\\"");
        format!("{name}{{model_name=\"{escaped}\",rank=\"0\"}} {value}\n")
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_without_panicking(page in ".{0,400}") {
            let _ = parse(&page);
        }

        #[test]
        fn generated_pages_sum_requests_and_take_the_largest_kv_use(
            samples in proptest::collection::vec(
                (0usize..5, "[a-z}{\"\\\\ ]{0,12}", 0u32..10_000, 0.0f64..1.0),
                1..12,
            ),
        ) {
            let names = [RUNNING[0], WAITING[1], KV_USED[0], "vllm:other", RUNNING[2]];
            let mut page = String::from("# HELP vllm:num_requests_running running\n");
            let (mut requests, mut kv, mut seen) = (0u64, None::<f64>, false);
            for (n, label, count, share) in &samples {
                let name = names[*n];
                if name.ends_with("perc") {
                    page += &line(name, label, *share);
                    kv = Some(kv.map_or(*share, |k| k.max(*share)));
                } else {
                    page += &line(name, label, f64::from(*count));
                    if name != "vllm:other" {
                        requests += u64::from(*count);
                        seen = true;
                    }
                }
            }
            let want = seen.then(|| Reading {
                requests: requests as u32,
                kv_used_permille: kv.map(|k| (k * 1000.0).round() as u16),
            });
            proptest::prop_assert_eq!(parse(&page), want, "{}", page);
        }
    }
}
