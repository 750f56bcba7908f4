//! Test harness: real `replica-sim` and `prefix-router` processes on loopback,
//! started on free ports and polled until ready, plus a small blocking HTTP/1.1
//! client that can send chunked bodies, `Expect: 100-continue`, and read SSE
//! event by event.
#![allow(dead_code)]

mod accept;
pub mod http;
pub mod kv;
mod raw;
mod trickle;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use http::{get, post_json, Response};
#[allow(unused_imports)]
pub use raw::RawReplica;
#[allow(unused_imports)]
pub use trickle::TricklingReplica;

/// A keys file's line for `key` (`api_keys_file`, `admin_keys_file`): its
/// SHA-256 digest in hex.
pub fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Polls `f` every 20 ms until it returns `Some`, or panics after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A replica-sim process.
pub struct Sim {
    pub name: String,
    pub addr: SocketAddr,
    /// `--kv-tokens` when given: also declared to the router.
    pub kv_tokens: Option<u64>,
    /// With `--kv-events-port`: its KV events' ports (publisher, replay),
    /// declared to the router too.
    pub kv_events: Option<(u16, u16)>,
    /// `--backlog` when given: how many connections its accept queue holds.
    backlog: Option<u32>,
    child: Child,
}

impl Sim {
    /// Starts a simulator on a free port with fast defaults for tests
    /// (prefill 10M tokens/s, no reuse cost, decode 1000 steps/s, a 10M-token
    /// card) plus `args`.
    pub fn start(name: &str, args: &[&str]) -> Sim {
        Self::start_on("127.0.0.1:0", name, args)
    }

    /// Starts a simulator on a given address (a restart on the same port).
    pub fn start_on(listen: &str, name: &str, args: &[&str]) -> Sim {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_replica-sim"));
        cmd.args(["--listen", listen, "--name", name]);
        let fast = [
            ("--prefill-tps", "10000000"),
            ("--reuse-s-per-token", "0"),
            ("--decode-tps", "1000"),
            ("--kv-tokens", "10000000"),
        ];
        for (flag, fast) in fast {
            if !args.contains(&flag) {
                cmd.args([flag, fast]);
            }
        }
        let mut child = cmd
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn replica-sim");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("read listen line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("replica-sim said {line:?}"));
        let flag = |name: &str| {
            args.iter()
                .position(|a| *a == name)
                .and_then(|i| args.get(i + 1))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let kv_tokens = flag("--kv-tokens");
        let backlog = flag("--backlog").and_then(|b| u32::try_from(b).ok());
        // `--kv-events-port`: its publisher's and replay socket's ports.
        let kv_events = args.contains(&"--kv-events-port").then(|| {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read kv events line");
            let ports = line
                .trim()
                .strip_prefix("kv events on ")
                .unwrap_or_default();
            let mut ports = ports.split(' ').map(|p| p.parse().expect("a port"));
            (ports.next().expect(&line), ports.next().expect(&line))
        });
        Sim {
            name: name.to_owned(),
            addr,
            kv_tokens,
            kv_events,
            backlog,
            child,
        }
    }

    /// Stops the process at once (SIGKILL), like a crashed or restarted engine.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `GET /sim/stats` as JSON.
    pub fn stats(&self) -> serde_json::Value {
        get(self.addr, "/sim/stats").json()
    }

    /// Completion requests that reached the simulator, answered or not.
    pub fn received(&self) -> u64 {
        self.stats()["received"].as_u64().expect("received")
    }

    /// Makes `/health` answer 200 (`true`) or 503.
    pub fn set_healthy(&self, ok: bool) {
        let path = format!("/sim/health?ok={ok}");
        assert_eq!(
            http::request(self.addr, "POST", &path, &[], b"").status,
            200
        );
    }

    /// A replica entry for the router's YAML.
    pub fn yaml(&self) -> String {
        let kv = self
            .kv_tokens
            .map(|k| format!(", kv_tokens: {k}"))
            .unwrap_or_default();
        let events = self
            .kv_events
            .map(|(p, r)| {
                format!(
                    ", kv_events: {{endpoint: \"tcp://127.0.0.1:{p}\", topic: kv-events, \
                     replay_endpoint: \"tcp://127.0.0.1:{r}\"}}"
                )
            })
            .unwrap_or_default();
        format!(
            "  - {{name: {}, addr: \"{}\"{kv}{events}}}\n",
            self.name, self.addr
        )
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port (bound and released; the router binds it next),
/// below the kernel's ephemeral range: a port the kernel hands to a bind to
/// port 0 (a simulator, a client socket) in a test running beside this one
/// is then never the one a router was told to bind, which raced before.
pub fn free_addr() -> SocketAddr {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0);
    // Each process starts at its own place in [10000, low).
    let span = low.saturating_sub(10_000);
    let start = u64::from(std::process::id()) * 97;
    for _ in 0..span.min(4096) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 10_000 + (start + n) % span;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
            return l.local_addr().expect("addr");
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

/// A prefix-router process with its config file.
pub struct Router {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub config: PathBuf,
    child: Child,
    dir: PathBuf,
}

impl Router {
    /// What the router logged (at `warn` and above).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("router.log")).unwrap_or_default()
    }

    /// The log once it holds `needle`: lines reach the file a few
    /// milliseconds after they are logged (a writer thread of their own).
    pub fn wait_log(&self, needle: &str) -> String {
        wait_for(
            &format!("{needle:?} in the log"),
            Duration::from_secs(10),
            || {
                let log = self.log();
                log.contains(needle).then_some(log)
            },
        )
    }
}

impl Router {
    /// Starts the router with `extra` YAML (e.g. `policy: affinity`) in front of
    /// `sims`, and waits until every sim is reported up on `/metrics`.
    pub fn start(sims: &[&Sim], extra: &str) -> Router {
        Self::start_with_env(sims, extra, &[])
    }

    pub fn start_with_env(sims: &[&Sim], extra: &str, env: &[(&str, &str)]) -> Router {
        let r = Self::spawn(&Self::yaml(sims, extra), env);
        for s in sims {
            r.wait_replica_up(&s.name, true);
        }
        r
    }

    /// The YAML for `sims` plus `extra` top-level keys (`listen` is filled in by `spawn`).
    pub fn yaml(sims: &[&Sim], extra: &str) -> String {
        let mut y = String::from(extra);
        if !y.is_empty() && !y.ends_with('\n') {
            y.push('\n');
        }
        y.push_str("replicas:\n");
        if sims.is_empty() {
            y = y.replace("replicas:\n", "replicas: []\n");
        }
        for s in sims {
            y.push_str(&s.yaml());
        }
        y
    }

    /// Starts the router on `yaml` without waiting for replicas.
    pub fn spawn(yaml: &str, env: &[(&str, &str)]) -> Router {
        Self::spawn_logging_to(yaml, env, None)
    }

    /// As [`Router::spawn`], its log going to `stderr` (else a file that
    /// [`Router::log`] reads).
    pub fn spawn_logging_to(yaml: &str, env: &[(&str, &str)], stderr: Option<Stdio>) -> Router {
        let addr = free_addr();
        let metrics_addr = free_addr();
        let dir = std::env::temp_dir().join(format!(
            "prefix-router-test-{}-{}",
            std::process::id(),
            addr.port()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("router.yaml");
        let head = format!(
            "listen: \"{addr}\"\nmetrics_listen: \"{metrics_addr}\"\nreload_interval_ms: 100\n"
        );
        std::fs::write(&config, format!("{head}{yaml}")).expect("write config");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_prefix-router"));
        cmd.arg("--config")
            .arg(&config)
            .env_remove("PREFIX_ROUTER_POLICY")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr.unwrap_or_else(|| {
                std::fs::File::create(dir.join("router.log"))
                    .expect("log file")
                    .into()
            }));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn prefix-router");
        let r = Router {
            addr,
            metrics_addr,
            config,
            child,
            dir,
        };
        wait_for("router metrics endpoint", Duration::from_secs(20), || {
            http::try_request(r.metrics_addr, "GET", "/metrics", &[], b"")
                .ok()
                .filter(|resp| resp.status == 200)
        });
        wait_for("router proxy port", Duration::from_secs(20), || {
            std::net::TcpStream::connect(r.addr).ok()
        });
        r
    }

    /// A file in the router's temporary directory (removed with the router).
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).expect("write file");
        path
    }

    /// Rewrites the config file (same listen ports) with new replicas / keys.
    pub fn rewrite(&self, yaml: &str) {
        let head = format!(
            "listen: \"{}\"\nmetrics_listen: \"{}\"\nreload_interval_ms: 100\n",
            self.addr, self.metrics_addr
        );
        let tmp = self.dir.join("router.yaml.tmp");
        std::fs::write(&tmp, format!("{head}{yaml}")).expect("write config");
        std::fs::rename(&tmp, &self.config).expect("replace config");
    }

    /// Writes raw text to the config file (for invalid-file tests).
    pub fn write_raw(&self, text: &str) {
        std::fs::write(&self.config, text).expect("write config");
    }

    /// The value of a metric series (exact name with labels), 0 when absent.
    pub fn metric(&self, series: &str) -> f64 {
        let text = get(self.metrics_addr, "/metrics").text();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    /// Waits until `prefix_router_replica_up{replica=name}` equals `up`.
    pub fn wait_replica_up(&self, name: &str, up: bool) {
        let series = format!("prefix_router_replica_up{{replica=\"{name}\"}}");
        let want = if up { 1.0 } else { 0.0 };
        wait_for(
            &format!("{series} == {want}"),
            Duration::from_secs(20),
            || (self.metric(&series) == want).then_some(()),
        );
    }

    /// Sends `n` one-shot chat requests tagged `tag`; returns the replica of each.
    pub fn singles(&self, n: usize, tag: &str) -> Vec<String> {
        (0..n)
            .map(|i| {
                let r = self.post("/v1/chat/completions", &single(&format!("{tag} {i}")));
                assert_eq!(r.status, 200, "{}", r.text());
                r.replica().to_owned()
            })
            .collect()
    }

    /// `POST path` with a JSON body through the router.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        post_json(self.addr, path, body)
    }
}

impl Router {
    /// Times the router's threads went to sleep and were woken (their
    /// voluntary context switches, from `/proc`) a second, over `window`.
    pub fn wakeups_per_second(&self, window: Duration) -> f64 {
        let pid = self.child.id();
        let count = || -> u64 {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc");
            (tasks.flatten())
                .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
                .filter_map(|status| {
                    let line = status
                        .lines()
                        .find(|l| l.starts_with("voluntary_ctxt_switches:"))?;
                    line.split_whitespace().nth(1)?.parse::<u64>().ok()
                })
                .sum()
        };
        let before = count();
        std::thread::sleep(window);
        (count().saturating_sub(before)) as f64 / window.as_secs_f64()
    }

    /// Sends SIGTERM (an orchestrator stopping the router).
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends a signal by name (`TERM`, `QUIT`).
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{name}"), &pid])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -{name} {pid}");
    }

    /// Starts a second router on this one's config with `-u` (it waits to
    /// receive the listening sockets; send this one SIGQUIT to hand them over).
    pub fn start_upgrade(&self) -> Router {
        self.start_upgrade_with(|yaml| yaml.to_owned())
    }

    /// [`Router::start_upgrade`] with this router's config changed by `edit`.
    pub fn start_upgrade_with(&self, edit: impl Fn(&str) -> String) -> Router {
        let dir = self.dir.with_extension("upgrade");
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("router.yaml");
        let yaml = std::fs::read_to_string(&self.config).expect("read config");
        std::fs::write(&config, edit(&yaml)).expect("write config");
        let child = Command::new(env!("CARGO_BIN_EXE_prefix-router"))
            .args(["-u", "--config"])
            .arg(&config)
            .env_remove("PREFIX_ROUTER_POLICY")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("router.log")).expect("log file"))
            .spawn()
            .expect("spawn prefix-router -u");
        Router {
            addr: self.addr,
            metrics_addr: self.metrics_addr,
            config,
            child,
            dir,
        }
    }

    /// The process has not exited.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Waits (at most `within`) for the process to exit.
    pub fn exit_status(&mut self, within: Duration) -> std::process::ExitStatus {
        wait_for("the router to exit", within, || {
            self.child.try_wait().ok().flatten()
        })
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A chat body of one user message.
/// An agent conversation with a long system prompt (about 1,500 tokens),
/// after `turns` turns, ending in a user turn.
pub fn agent(turns: usize) -> serde_json::Value {
    let context = "The repository layout and the failing test output. ".repeat(120);
    let mut m = vec![serde_json::json!({"role": "system", "content": context})];
    for t in 0..turns {
        m.push(serde_json::json!({"role": "user", "content": format!("step {t}")}));
        m.push(serde_json::json!({"role": "assistant", "content": format!("result {t}")}));
    }
    m.push(serde_json::json!({"role": "user", "content": format!("step {turns}")}));
    serde_json::json!({"model": "sim", "max_tokens": 2, "messages": m})
}

pub fn single(text: &str) -> serde_json::Value {
    serde_json::json!({"model": "sim", "max_tokens": 2,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]})
}

/// A streaming chat body of one user message generating `max_tokens` tokens.
pub fn streaming(text: &str, max_tokens: u64) -> serde_json::Value {
    let mut body = single(text);
    body["stream"] = serde_json::json!(true);
    body["max_tokens"] = serde_json::json!(max_tokens);
    body
}

/// A chat body of a conversation after `turns` turns (assistant turns included).
pub fn conversation(topic: &str, turns: usize) -> serde_json::Value {
    let mut m = vec![serde_json::json!({"role": "system", "content": "You are an agent."})];
    for t in 0..turns {
        m.push(serde_json::json!({"role": "user", "content": format!("{topic} step {t}")}));
        m.push(serde_json::json!({"role": "assistant", "content": format!("{topic} result {t}")}));
    }
    m.push(serde_json::json!({"role": "user", "content": format!("{topic} step {turns}")}));
    serde_json::json!({"model": "sim", "max_tokens": 2, "messages": m})
}

/// Runs the `openssl` CLI (`scripts/prepare.sh` installs it); panics unless it succeeds.
pub fn openssl(args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl CLI (scripts/prepare.sh installs it)");
    assert!(status.success(), "openssl {args:?}");
}

/// A real `redis-server` (Debian's, installed by `scripts/prepare.sh`) on a
/// given loopback port, nothing persisted; killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    /// A Redis started with `args` (a TLS port, ACL users), ready once
    /// its port (`--port`, or the TLS one) takes connections.
    pub fn start_args(port: u16, args: &[&str]) -> RedisServer {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/prepare.sh installs it)");
        wait_for("redis listening", Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        RedisServer { port, child }
    }

    pub fn start(port: u16) -> RedisServer {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/prepare.sh installs it)");
        wait_for("redis answering PING", Duration::from_secs(10), || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
            s.write_all(b"PING\r\n").ok()?;
            let mut buf = [0u8; 7];
            s.read_exact(&mut buf).ok()?;
            (&buf == b"+PONG\r\n").then_some(())
        });
        RedisServer { port, child }
    }

    /// Whether `key` exists in database `db`.
    pub fn exists(&self, db: u32, key: &str) -> bool {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("redis");
        write!(s, "SELECT {db}\r\nEXISTS {key}\r\n").expect("redis write");
        let mut lines = BufReader::new(s).lines();
        assert_eq!(lines.next().and_then(Result::ok).as_deref(), Some("+OK"));
        lines.next().and_then(Result::ok).as_deref() == Some(":1")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// SmolLM2's tokenizer files (`scripts/real-engine.sh prepare` makes them).
pub fn tokenizer_dir() -> String {
    format!("{}/.real-engine/tokenizer", env!("CARGO_MANIFEST_DIR"))
}
