//! Starts what `compare` measures: fresh `replica-sim` processes (or given
//! replica addresses) and a `prefix-router` with one policy, on free ports,
//! polled until ready; stopped on drop.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Running processes of one arm.
pub struct Fleet {
    pub router: SocketAddr,
    pub replicas: Vec<SocketAddr>,
    pub router_log: PathBuf,
    children: Vec<Child>,
}

/// How to start an arm.
pub struct Arm<'a> {
    /// `POLICY` or `POLICY+KEY=VALUE+...`: the router's `policy` and more
    /// top-level config keys (e.g. `shape+kv_room=pack`).
    pub policy: &'a str,
    /// Existing replicas; when empty, `sims` simulators are started.
    pub external: &'a [SocketAddr],
    pub sims: usize,
    pub kv_tokens: u64,
    pub time_scale: f64,
    /// The router's working-set window, wall seconds.
    pub window_s: u32,
    pub dir: &'a Path,
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
        for i in 0..if arm.external.is_empty() { arm.sims } else { 0 } {
            let mut child = Command::new(sibling("replica-sim")?)
                .args(["--listen", "127.0.0.1:0", "--name", &format!("gpu{i}")])
                .args(["--kv-tokens", &arm.kv_tokens.to_string()])
                .args(["--time-scale", &arm.time_scale.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("start replica-sim")?;
            let mut line = String::new();
            BufReader::new(child.stdout.take().context("sim stdout")?).read_line(&mut line)?;
            let addr = line
                .trim()
                .trim_start_matches("listening on ")
                .parse()
                .context("sim address")?;
            replicas.push(addr);
            children.push(child);
        }
        let (router, metrics) = (free_addr()?, free_addr()?);
        let window_s = arm.window_s;
        let mut parts = arm.policy.split('+');
        let policy = parts.next().unwrap_or_default();
        let mut yaml = format!(
            "listen: \"{router}\"\nmetrics_listen: \"{metrics}\"\npolicy: {policy}\nworking_set_window_s: {window_s}\n"
        );
        for setting in parts {
            let (key, value) = setting
                .split_once('=')
                .with_context(|| format!("{setting:?}: expected KEY=VALUE"))?;
            yaml.push_str(&format!("{key}: {value}\n"));
        }
        yaml.push_str("replicas:\n");
        for (i, r) in replicas.iter().enumerate() {
            yaml.push_str(&format!(
                "  - {{name: gpu{i}, addr: \"{r}\", kv_tokens: {}}}\n",
                arm.kv_tokens
            ));
        }
        std::fs::create_dir_all(arm.dir)?;
        let config = arm.dir.join(format!("router-{}.yaml", arm.policy));
        std::fs::write(&config, yaml)?;
        let router_log = arm.dir.join(format!("router-{}.log", arm.policy));
        let log = std::fs::File::create(&router_log)?;
        children.push(
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
        let fleet = Fleet {
            router,
            replicas,
            router_log,
            children,
        };
        let n = fleet.replicas.len();
        wait(
            "every replica up behind the router",
            Duration::from_secs(120),
            || {
                get(metrics, "/metrics").is_some_and(|m| {
                    m.lines()
                        .filter(|l| l.starts_with("prefix_router_replica_up{") && l.ends_with(" 1"))
                        .count()
                        == n
                })
            },
        )?;
        Ok(fleet)
    }

    /// Lines of the router's log that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(&self.router_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
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
