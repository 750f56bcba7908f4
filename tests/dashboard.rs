//! Observability, proven against real processes: every Grafana panel's query
//! and every alert rule's expression runs in a real Prometheus (Debian's
//! `prometheus` package) scraping a live router and simulated vLLM replicas
//! under traffic, and must parse and return data; the alert rules pass
//! `promtool check` and their unit tests; `docs/metrics.md` lists exactly the
//! series the router exports, with their types and labels.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{conversation, free_addr, get, single, wait_for, Router, Sim};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Every query of the dashboard: (panel title, PromQL).
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo("grafana/prefix-router.json")).expect("dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("expr");
            out.push((
                panel["title"].as_str().unwrap_or("").to_owned(),
                expr.to_owned(),
            ));
        }
    }
    out
}

/// Every alert of conf/alerts.yml: (name, expression).
fn alert_rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo("conf/alerts.yml")).expect("alerts");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("alerts are YAML");
    let mut out = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            out.push((
                rule["alert"].as_str().expect("alert").to_owned(),
                rule["expr"].as_str().expect("expr").to_owned(),
            ));
        }
    }
    out
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server scraping the router and the replicas every second.
struct Prometheus {
    addr: SocketAddr,
    child: Child,
    dir: PathBuf,
}

impl Prometheus {
    fn start(router: SocketAddr, replicas: &[SocketAddr]) -> Prometheus {
        let dir = std::env::temp_dir().join(format!(
            "prefix-router-prom-{}-{}",
            std::process::id(),
            router.port()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let targets = |addrs: &[SocketAddr]| {
            addrs
                .iter()
                .map(|a| format!("\"{a}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n\
             \x20 - job_name: prefix-router\n    static_configs: [{{targets: [{}]}}]\n\
             \x20 - job_name: replicas\n    static_configs: [{{targets: [{}]}}]\n",
            repo("conf/alerts.yml").display(),
            targets(&[router]),
            targets(replicas)
        );
        std::fs::write(dir.join("prometheus.yml"), config).expect("write config");
        let addr = free_addr();
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log"))
            .spawn()
            .expect("run `prometheus` (Debian's package; scripts/prepare.sh installs it)");
        let p = Prometheus { addr, child, dir };
        wait_for("prometheus ready", Duration::from_secs(30), || {
            common::http::try_request(p.addr, "GET", "/-/ready", &[], b"")
                .ok()
                .filter(|r| r.status == 200)
        });
        p
    }

    /// An instant query: `Err` with Prometheus's message when it does not
    /// parse, else the number of series it returned.
    fn query(&self, expr: &str) -> Result<usize, String> {
        let r = get(
            self.addr,
            &format!("/api/v1/query?query={}", percent_encode(expr)),
        );
        let v = r.json();
        if v["status"] != "success" {
            return Err(format!("{}: {}", r.status, v["error"]));
        }
        Ok(v["data"]["result"].as_array().map_or(0, Vec::len))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends traffic of every kind until dropped: singles, continuations
/// (pins), explicit keys, and a request the router refuses.
struct Traffic {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(addr: SocketAddr) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut i = 0;
            while !flag.load(Ordering::Relaxed) {
                let topic = format!("topic {i}");
                let mut keyed = single(&format!("keyed {i}"));
                keyed["prompt_cache_key"] = serde_json::json!(format!("key {}", i % 3));
                for body in [
                    single(&format!("one-shot {i}")),
                    conversation(&topic, 1),
                    conversation(&topic, 2),
                    keyed,
                ] {
                    let _ = common::post_json(addr, "/v1/chat/completions", &body);
                }
                let _ = common::http::try_request(addr, "POST", "/v1/chat/completions", &[], b"{");
                i += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Traffic {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn every_panel_and_alert_query_returns_data_in_a_real_prometheus() {
    // The cards publish their KV events, which the router follows.
    let dir = common::tokenizer_dir();
    let args = [
        "--kv-tokens",
        "100000",
        "--tokenizer",
        &dir,
        "--kv-events-port",
        "0",
    ];
    let a = Sim::start("a", &args);
    let b = Sim::start("b", &args);
    let extra = format!(
        "engine_load: {{interval_ms: 100}}\ntokenizers: {{sim: \"{dir}\"}}\ntenants: {{}}\nshed_in_flight: 64\nqueue: {{}}\n"
    );
    let router = Router::start(&[&a, &b], &extra);
    let _traffic = Traffic::start(router.addr);
    let prom = Prometheus::start(router.metrics_addr, &[a.addr, b.addr]);
    let queries = dashboard_queries();
    assert!(queries.len() >= 30, "{} dashboard queries", queries.len());
    for (panel, expr) in &queries {
        wait_for(
            &format!("panel {panel:?}: {expr} to return data"),
            Duration::from_secs(30),
            || match prom.query(expr) {
                Err(e) => panic!("panel {panel:?}: {expr} does not parse: {e}"),
                Ok(n) => (n > 0).then_some(()),
            },
        );
    }
    // Alert expressions return nothing on a healthy fleet (promtool's unit
    // tests below show each firing); here each must parse against real series.
    let alerts = alert_rules();
    assert_eq!(alerts.len(), 6, "{alerts:?}");
    for (name, expr) in &alerts {
        if let Err(e) = prom.query(expr) {
            panic!("alert {name}: {expr} does not parse: {e}");
        }
    }
    // And Prometheus itself loaded the rule file.
    let rules = get(prom.addr, "/api/v1/rules").json();
    let loaded = rules["data"]["groups"][0]["rules"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(loaded, alerts.len(), "{rules}");
}

fn promtool(args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(repo("conf"))
        .output()
        .expect("run `promtool` (Debian's prometheus package; scripts/prepare.sh installs it)");
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    promtool(&["check", "rules", "alerts.yml"]);
    promtool(&["test", "rules", "alerts.test.yml"]);
}

/// One metric family as the endpoint describes it.
#[derive(Debug, PartialEq)]
struct Family {
    kind: String,
    labels: Vec<String>,
    help: String,
}

/// The router's metric families, from its live endpoint.
fn exported(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        // OpenMetrics: a counter's family is named without the `_total`
        // its series have; its help ends with a full stop.
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.entry(name.to_owned()).or_insert(Family {
                kind: String::new(),
                labels: Vec::new(),
                help: help.strip_suffix('.').unwrap_or(help).to_owned(),
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(mut f) = out.remove(name) {
                f.kind = kind.to_owned();
                let name = match kind {
                    "counter" => format!("{name}_total"),
                    _ => name.to_owned(),
                };
                out.insert(name, f);
            }
        } else if !line.is_empty() && !line.starts_with('#') {
            let series = line.split(' ').next().unwrap_or("");
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| out.get(*f).is_some_and(|f| f.kind == "histogram"))
                })
                .unwrap_or(name);
            if let Some(f) = out.get_mut(family) {
                for pair in labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|p| !p.is_empty())
                {
                    let key = pair.split('=').next().unwrap_or("").to_owned();
                    if key != "le" && !f.labels.contains(&key) {
                        f.labels.push(key);
                    }
                }
            }
        }
    }
    for f in out.values_mut() {
        f.labels.sort();
    }
    out
}

fn unit(name: &str) -> &'static str {
    let base = name.trim_end_matches("_total");
    [
        ("_seconds", "seconds"),
        ("_bytes", "bytes"),
        ("_tokens", "tokens"),
        ("_ratio", "ratio 0..1"),
    ]
    .iter()
    .find(|(suffix, _)| base.ends_with(suffix))
    .map_or(
        if name.ends_with("_total") {
            "count"
        } else {
            "number"
        },
        |(_, u)| u,
    )
}

/// The table `docs/metrics.md` must hold.
fn metrics_table(families: &BTreeMap<String, Family>) -> String {
    let mut t =
        String::from("| metric | type | labels | unit | meaning |\n|---|---|---|---|---|\n");
    for (name, f) in families {
        let labels = if f.labels.is_empty() {
            "—".to_owned()
        } else {
            f.labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        t.push_str(&format!(
            "| `{name}` | {} | {labels} | {} | {} |\n",
            f.kind,
            unit(name),
            f.help.replace('|', "\\|")
        ));
    }
    t
}

#[test]
fn docs_metrics_md_lists_every_series_the_router_exports() {
    let a = Sim::start("a", &["--kv-tokens", "100000"]);
    // Its engine's KV events followed (from a port nobody listens on: the
    // series show at 0).
    let addr = format!("addr: \"{}\"", a.addr);
    let extra = "engine_load: {interval_ms: 100}\ntenants: {}\nshed_in_flight: 64\nqueue: {}\n";
    let yaml = Router::yaml(&[&a], extra).replace(
        &addr,
        &format!("{addr}, kv_events: {{endpoint: \"tcp://127.0.0.1:9\"}}"),
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("a", true);
    assert_eq!(
        router.post("/v1/chat/completions", &single("hello")).status,
        200
    );
    let families = wait_for("the engine's load read", Duration::from_secs(10), || {
        let f = exported(&get(router.metrics_addr, "/metrics").text());
        f.contains_key("prefix_router_engine_kv_used_ratio")
            .then_some(f)
    });
    let families: BTreeMap<_, _> = families
        .into_iter()
        .filter(|(n, _)| n.starts_with("prefix_router_"))
        .collect();
    assert!(families.len() > 25, "{families:?}");
    let table = metrics_table(&families);
    let path = repo("docs/metrics.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    const BEGIN: &str = "<!-- metrics table: generated by tests/dashboard.rs -->\n";
    const END: &str = "<!-- /metrics table -->";
    let current = doc
        .split_once(BEGIN)
        .and_then(|(_, rest)| rest.split_once(END))
        .map(|(table, _)| table);
    if current != Some(table.as_str()) && std::env::var_os("PREFIX_ROUTER_WRITE_DOCS").is_some() {
        let (head, tail) = match doc.split_once(BEGIN) {
            Some((head, rest)) => (
                head.to_owned(),
                rest.split_once(END).map_or("", |(_, t)| t).to_owned(),
            ),
            None => (doc.clone(), "\n".to_owned()),
        };
        std::fs::write(&path, format!("{head}{BEGIN}{table}{END}{tail}"))
            .expect("write docs/metrics.md");
        return;
    }
    assert_eq!(
        current,
        Some(table.as_str()),
        "docs/metrics.md is out of date with the live endpoint; regenerate with \
         PREFIX_ROUTER_WRITE_DOCS=1 cargo test --test dashboard docs_metrics"
    );
}
