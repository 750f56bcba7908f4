//! Starts what `compare` measures: fresh `replica-sim` processes (or given
//! replica addresses) and a `prefix-router` with one policy (or several
//! instances of it, `--instances`), or the peer SMG
//! (`smg launch --policy cache_aware`, installed from PyPI into a venv kept
//! under the output directory's parent), on free ports, polled until ready;
//! stopped on drop.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Running processes of one arm.
pub struct Fleet {
    /// Every router instance (one but with `--instances`), and its metrics.
    pub routers: Vec<SocketAddr>,
    metrics: Vec<SocketAddr>,
    pub replicas: Vec<SocketAddr>,
    router_logs: Vec<PathBuf>,
    children: Vec<Child>,
}

/// How to start an arm.
pub struct Arm<'a> {
    /// `POLICY` or `POLICY+KEY=VALUE+...`: the router's `policy` and more
    /// top-level config keys (e.g. `shape+kv_room=pack`), keys of a block
    /// (`shape+fleet.mode=rendezvous`), or keys of every replica's entry
    /// (`shape+replica.prompt_cache=last`); `+kv_events` (see [`KV_EVENTS`]);
    /// `smg`: the peer; `oracle`, `oracle-soonest`: no router (see [`ORACLE`]).
    pub policy: &'a str,
    /// Existing replicas; when empty, `sims` simulators are started.
    pub external: &'a [SocketAddr],
    pub sims: usize,
    pub kv_tokens: u64,
    /// More arguments for every simulator.
    pub sim_args: &'a [String],
    pub time_scale: f64,
    /// The router's working-set window, wall seconds.
    pub window_s: u32,
    pub dir: &'a Path,
    /// The `model` requests name (SMG routes by it).
    pub model: &'a str,
    /// Router instances in front of the same replicas.
    pub instances: usize,
}

/// An arm's label as a file name: `shape+kv_room=off #2` -> `shape_kv_room_off__2`.
pub fn file_name(label: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || c == '-';
    label
        .chars()
        .map(|c| if safe(c) { c } else { '_' })
        .collect()
}

/// The arm name of the peer.
pub const SMG: &str = "smg";
/// The arm with no router: each request sent straight to the card holding
/// the longest prefix of its prompt (simulated cards only).
pub const ORACLE: &str = "oracle";
/// The arm with no router that sends each request straight to the card
/// where its prefill would end soonest by the cards' own state: the least
/// prompt queued there plus its own tokens not cached there.
pub const ORACLE_SOONEST: &str = "oracle-soonest";

/// Whether an arm is an oracle (no router; the client places).
pub fn is_oracle(policy: &str) -> bool {
    policy == ORACLE || policy == ORACLE_SOONEST
}
/// The setting (`shape+kv_events`) that has the cards publish their KV
/// events and the router follow them, token for token.
pub const KV_EVENTS: &str = "kv_events";
/// The release measured in this project's results (pinned for reproducibility).
const SMG_VERSION: &str = "smg==1.13.0";

/// `smg` from PyPI in a venv next to the output directory (`bench-out/venv`
/// by default, shared with `make bench-proxy`), installed on first use.
fn ensure_smg(out: &Path) -> Result<PathBuf> {
    let out = std::path::absolute(out)?;
    let venv = out.parent().unwrap_or(&out).join("venv");
    let smg = venv.join("bin/smg");
    if smg.exists() {
        return Ok(smg);
    }
    let ok = |c: &mut Command| c.status().is_ok_and(|s| s.success());
    if !ok(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        || !ok(Command::new(venv.join("bin/pip")).args(["install", "-q", SMG_VERSION]))
        || !smg.exists()
    {
        bail!(
            "could not install smg into {} (python3 -m venv, pip install smg)",
            venv.display()
        );
    }
    Ok(smg)
}

/// The installed SMG's version, once an SMG arm has run.
pub fn smg_version(out: &Path) -> Option<String> {
    let out = std::path::absolute(out).ok()?;
    let python = out.parent().unwrap_or(&out).join("venv/bin/python");
    let script = "import importlib.metadata as m; print(m.version('smg'))";
    let run = Command::new(python).args(["-c", script]).output().ok()?;
    let v = String::from_utf8(run.stdout).ok()?;
    Some(v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// A one-token chat completion answered 200.
fn post_ok(addr: SocketAddr, model: &str) -> bool {
    use std::io::{Read, Write};
    let body = format!(
        r#"{{"model":"{model}","max_tokens":1,"messages":[{{"role":"user","content":"ready?"}}]}}"#
    );
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let sent = write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    sent.is_ok() && s.read_to_string(&mut out).is_ok() && out.starts_with("HTTP/1.1 200")
}

fn free_addr() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// A sibling binary of this one (same cargo profile directory).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found next to routebench: build all binaries (cargo build --release --bins)",
            path.display()
        );
    }
    Ok(path)
}

fn wait(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while !ok() {
        if start.elapsed() > timeout {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn get(addr: SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

impl Fleet {
    pub fn start(arm: &Arm) -> Result<Fleet> {
        let mut children = Vec::new();
        let mut replicas = arm.external.to_vec();
        // `+kv_events`: the cards publish their KV events, the router follows
        // them with the cards' tokenizer (`--sim-arg=--tokenizer=DIR`).
        let events = arm.policy.split('+').any(|p| p == KV_EVENTS);
        let tokenizer = (arm.sim_args.iter()).find_map(|a| a.strip_prefix("--tokenizer="));
        if events && (tokenizer.is_none() || !arm.external.is_empty()) {
            bail!("+{KV_EVENTS} needs simulated cards with --sim-arg=--tokenizer=DIR");
        }
        let mut event_ports = Vec::new();
        for i in 0..if arm.external.is_empty() { arm.sims } else { 0 } {
            let mut child = Command::new(sibling("replica-sim")?)
                .args(["--listen", "127.0.0.1:0", "--name", &format!("gpu{i}")])
                .args(["--kv-tokens", &arm.kv_tokens.to_string()])
                .args(["--time-scale", &arm.time_scale.to_string()])
                .args(arm.sim_args)
                .args(if events {
                    &["--kv-events-port", "0"][..]
                } else {
                    &[]
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("start replica-sim")?;
            let mut out = BufReader::new(child.stdout.take().context("sim stdout")?);
            let mut line = String::new();
            out.read_line(&mut line)?;
            let addr = line
                .trim()
                .trim_start_matches("listening on ")
                .parse()
                .context("sim address")?;
            if events {
                line.clear();
                out.read_line(&mut line)?;
                let ports = line.trim().trim_start_matches("kv events on ").to_owned();
                event_ports.push(ports.replace(' ', ":"));
            }
            replicas.push(addr);
            children.push(child);
        }
        if is_oracle(arm.policy) {
            if !arm.external.is_empty() {
                bail!("the oracle asks simulated cards what they hold: no --replica");
            }
            return Ok(Fleet {
                routers: Vec::new(),
                metrics: Vec::new(),
                replicas,
                router_logs: Vec::new(),
                children,
            });
        }
        if arm.policy == SMG {
            if arm.instances > 1 {
                bail!("the peer runs as one instance");
            }
            let (router, metrics) = (free_addr()?, free_addr()?);
            return Self::start_smg(arm, router, metrics, replicas, children);
        }
        let window_s = arm.window_s;
        let mut parts = arm.policy.split('+');
        let policy = parts.next().unwrap_or_default();
        let mut settings = format!("policy: {policy}\nworking_set_window_s: {window_s}\n");
        // `replica.KEY=VALUE` goes into every replica's entry; `BLOCK.KEY=VALUE`
        // into a block (`fleet.mode=rendezvous+fleet.singles=root`).
        let mut each = String::new();
        let mut blocks: Vec<(&str, Vec<String>)> = Vec::new();
        for setting in parts.filter(|p| *p != KV_EVENTS) {
            let (key, value) = setting
                .split_once('=')
                .with_context(|| format!("{setting:?}: expected KEY=VALUE"))?;
            match key.split_once('.') {
                Some(("replica", key)) => each.push_str(&format!(", {key}: {value}")),
                Some((block, key)) => {
                    let entry = format!("{key}: {value}");
                    match blocks.iter_mut().find(|(b, _)| *b == block) {
                        Some((_, entries)) => entries.push(entry),
                        None => blocks.push((block, vec![entry])),
                    }
                }
                None => settings.push_str(&format!("{key}: {value}\n")),
            }
        }
        for (block, entries) in blocks {
            settings.push_str(&format!("{block}: {{{}}}\n", entries.join(", ")));
        }
        if let (true, Some(dir)) = (events, tokenizer) {
            settings.push_str(&format!("tokenizers: {{{}: \"{dir}\"}}\n", arm.model));
        }
        settings.push_str("replicas:\n");
        for (i, r) in replicas.iter().enumerate() {
            let follow = match event_ports.get(i).and_then(|p| p.split_once(':')) {
                Some((publish, replay)) => format!(
                    ", kv_events: {{endpoint: \"tcp://127.0.0.1:{publish}\", topic: kv-events, \
                     replay_endpoint: \"tcp://127.0.0.1:{replay}\"}}"
                ),
                None => String::new(),
            };
            settings.push_str(&format!(
                "  - {{name: gpu{i}, addr: \"{r}\", kv_tokens: {}{each}{follow}}}\n",
                arm.kv_tokens
            ));
        }
        std::fs::create_dir_all(arm.dir)?;
        let name = file_name(arm.policy);
        let mut fleet = Fleet {
            routers: Vec::new(),
            metrics: Vec::new(),
            replicas,
            router_logs: Vec::new(),
            children,
        };
        // Instances share the replicas; each has its own ports and files.
        for i in 0..arm.instances.max(1) {
            let (router, metrics) = (free_addr()?, free_addr()?);
            let file = match i {
                0 => format!("router-{name}"),
                _ => format!("router-{name}-{i}"),
            };
            let config = arm.dir.join(format!("{file}.yaml"));
            std::fs::write(
                &config,
                format!("listen: \"{router}\"\nmetrics_listen: \"{metrics}\"\n{settings}"),
            )?;
            let router_log = arm.dir.join(format!("{file}.log"));
            let log = std::fs::File::create(&router_log)?;
            fleet.children.push(
                Command::new(sibling("prefix-router")?)
                    .arg("--config")
                    .arg(&config)
                    .env_remove("PREFIX_ROUTER_POLICY")
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .context("start prefix-router")?,
            );
            fleet.routers.push(router);
            fleet.metrics.push(metrics);
            fleet.router_logs.push(router_log);
            let n = fleet.replicas.len();
            wait(
                "every replica up behind the router",
                Duration::from_secs(120),
                || {
                    get(metrics, "/metrics").is_some_and(|m| {
                        m.lines()
                            .filter(|l| {
                                l.starts_with("prefix_router_replica_up{") && l.ends_with(" 1")
                            })
                            .count()
                            == n
                    })
                },
            )?;
        }
        Ok(fleet)
    }

    /// SMG in front of `replicas`, its log beside the router logs.
    fn start_smg(
        arm: &Arm,
        router: SocketAddr,
        metrics: SocketAddr,
        replicas: Vec<SocketAddr>,
        mut children: Vec<Child>,
    ) -> Result<Fleet> {
        let smg = ensure_smg(arm.dir)?;
        std::fs::create_dir_all(arm.dir)?;
        let router_log = arm.dir.join("router-smg.log");
        let mut cmd = Command::new(smg);
        cmd.args(["launch", "--host", "127.0.0.1", "--port"])
            .arg(router.port().to_string())
            .arg("--worker-urls")
            .args(replicas.iter().map(|r| format!("http://{r}")))
            .args(["--policy", "cache_aware", "--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &metrics.port().to_string()])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&router_log)?);
        children.push(cmd.spawn().context("start smg")?);
        let fleet = Fleet {
            routers: vec![router],
            metrics: Vec::new(),
            replicas,
            router_logs: vec![router_log],
            children,
        };
        // Ready when it routes a request (it first learns each worker's models).
        wait(
            "SMG routing to the replicas",
            Duration::from_secs(120),
            || post_ok(router, arm.model),
        )?;
        Ok(fleet)
    }

    /// The sum of a counter's series starting `series` over the router
    /// instances, so far; `None` for the peer (no metrics of ours).
    pub fn counter(&self, series: &str) -> Option<f64> {
        (!self.metrics.is_empty()).then(|| {
            self.metrics
                .iter()
                .filter_map(|m| get(*m, "/metrics"))
                .flat_map(|text| {
                    text.lines()
                        .filter(|l| l.starts_with(series))
                        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                        .collect::<Vec<f64>>()
                })
                .sum()
        })
    }

    /// Lines of the routers' logs that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.router_logs
            .iter()
            .flat_map(|log| {
                std::fs::read_to_string(log)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains(needle))
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
