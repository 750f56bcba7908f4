//! A KV event publisher as vLLM's (`kv_publisher.py`, on pyzmq and msgspec
//! from `.kv/venv`, which `scripts/prepare.sh` makes): a real ZMQ PUB and
//! replay ROUTER, fed batches by the test.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::Value;

pub struct Publisher {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    pub port: u16,
    pub replay_port: u16,
}

impl Publisher {
    /// Starts ours; `subscribed` is read only once a subscriber has
    /// subscribed, so call [`Publisher::wait_ready`] after the router is
    /// configured.
    pub fn start() -> Publisher {
        Self::run("kv_publisher.py", &[])
    }

    /// Starts SGLang's own publisher code, read from its wheel in
    /// `.kv/wheels` (`sglang_publisher.py`), on topic `kv-events`. It cannot
    /// tell when a subscriber is in: publish, then [`Publisher::probe`].
    pub fn sglang() -> Publisher {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/.kv/wheels");
        let wheel = std::fs::read_dir(dir)
            .expect(".kv/wheels (scripts/prepare.sh fills it)")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.to_string_lossy().contains("sglang-"))
            .expect("SGLang's wheel in .kv/wheels (scripts/prepare.sh)");
        Self::run(
            "sglang_publisher.py",
            &[&wheel.to_string_lossy(), "kv-events"],
        )
    }

    fn run(script: &str, args: &[&str]) -> Publisher {
        let root = env!("CARGO_MANIFEST_DIR");
        let mut child = Command::new(format!("{root}/.kv/venv/bin/python"))
            .arg(format!("{root}/tests/common/{script}"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run .kv/venv/bin/python (scripts/prepare.sh makes it)");
        let input = child.stdin.take().expect("stdin");
        let output = BufReader::new(child.stdout.take().expect("stdout"));
        let mut p = Publisher {
            child,
            input,
            output,
            port: 0,
            replay_port: 0,
        };
        let ports = p.line();
        let mut words = ports.split_whitespace().skip(1);
        p.port = words.next().and_then(|w| w.parse().ok()).expect(&ports);
        p.replay_port = words.next().and_then(|w| w.parse().ok()).expect(&ports);
        p
    }

    /// Publishes empty batches until `heard` (a PUB socket drops what it
    /// sends before a subscription is in; the router asks the replay socket
    /// for what it missed). Within a minute: after a publisher restarts,
    /// the SUB socket's own reconnection backs off (0.1 s doubling), so on
    /// a loaded machine whose publisher took seconds to bind again the
    /// next attempt can be 13 s later (seen once in CI at 20 s).
    /// Returns how many batches it published.
    pub fn probe(&mut self, mut heard: impl FnMut() -> bool) -> u64 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut sent = 0;
        while !heard() {
            assert!(
                std::time::Instant::now() < deadline,
                "the router never heard a batch"
            );
            self.publish(serde_json::json!([]), "map", false);
            sent += 1;
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        sent
    }

    /// Waits for the router's subscription.
    pub fn wait_ready(&mut self) {
        assert_eq!(self.line(), "subscribed");
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.output.read_line(&mut line).expect("publisher output");
        assert!(!line.is_empty(), "the publisher exited");
        line.trim().to_owned()
    }

    fn send(&mut self, command: Value) -> String {
        writeln!(self.input, "{command}").expect("publisher input");
        self.line()
    }

    /// Publishes the next batch (`drop`: buffered for replay, not sent);
    /// its number.
    pub fn publish(&mut self, events: Value, encoding: &str, drop: bool) -> u64 {
        let answer = self.send(serde_json::json!({
            "events": events, "encoding": encoding, "drop": drop
        }));
        let seq = answer.strip_prefix("ok ").and_then(|s| s.parse().ok());
        seq.unwrap_or_else(|| panic!("{answer}"))
    }

    /// Sends a batch under another `topic` (no seq used, not kept).
    pub fn publish_to(&mut self, topic: &str, events: Value) {
        let answer = self.send(serde_json::json!({"events": events, "topic": topic}));
        assert_eq!(answer, "ok");
    }

    /// A new engine process: batches from 0 again, none buffered.
    pub fn restart(&mut self) {
        assert_eq!(self.send(serde_json::json!({"restart": true})), "ok");
    }

    /// As [`Publisher::restart`], the PUB socket closed and bound again
    /// (ours only): its subscribers are disconnected, as from a process
    /// that exited.
    pub fn restart_rebound(&mut self) {
        let answer = self.send(serde_json::json!({"restart": true, "rebind": true}));
        assert_eq!(answer, "ok");
    }

    /// Waits until a subscriber has subscribed again (ours only).
    pub fn wait_subscribed(&mut self) {
        assert_eq!(
            self.send(serde_json::json!({"wait_subscribed": true})),
            "ok"
        );
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` blocks of 2 tokens from hash `first` on, chained after `parent`.
pub fn stored(first: u64, n: u64, parent: Option<u64>) -> Value {
    let tokens: Vec<u64> = (0..2 * n).map(|t| first * 10 + t).collect();
    serde_json::json!({"type": "BlockStored", "block_hashes": (first..first + n).collect::<Vec<_>>(),
        "parent_block_hash": parent, "token_ids": tokens, "block_size": 2, "medium": "GPU"})
}

/// What [`hostile_publisher`] sends once connected.
#[derive(Clone, Copy)]
pub enum Hostile {
    /// The head of one frame of this many bytes, then 4 KiB of it.
    Frame(u64),
    /// Empty frames of one message, without end.
    EmptyFrames,
}

/// A publisher that speaks ZMTP 3.0 (NULL mechanism, a PUB's READY) by
/// hand, then sends its `n`th connection `what[n]` (the last one again
/// past the end): a hostile or broken engine. Each connection's end (the
/// subscriber gave up on it) is sent on the channel.
pub fn hostile_publisher(what: Vec<Hostile>) -> (u16, std::sync::mpsc::Receiver<()>) {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (closed, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { return };
            let mut greeting = [0u8; 64];
            greeting[0] = 0xff;
            greeting[9] = 0x7f;
            greeting[10] = 3;
            greeting[12..16].copy_from_slice(b"NULL");
            let mut ready = vec![0x04, 0];
            ready.extend_from_slice(b"\x05READY\x0bSocket-Type\0\0\0\x03PUB");
            ready[1] = (ready.len() - 2) as u8;
            let mut peer = [0u8; 64];
            let greeted = conn.write_all(&greeting).is_ok()
                && conn.read_exact(&mut peer).is_ok()
                && conn.write_all(&ready).is_ok();
            match what[n.min(what.len() - 1)] {
                _ if !greeted => {}
                Hostile::Frame(len) => {
                    let mut frame = vec![0x02];
                    frame.extend_from_slice(&len.to_be_bytes());
                    frame.extend_from_slice(&[0u8; 4096]);
                    if conn.write_all(&frame).is_ok() {
                        // Until the subscriber closes the connection.
                        let mut sink = [0u8; 4096];
                        while conn.read(&mut sink).is_ok_and(|n| n > 0) {}
                    }
                }
                Hostile::EmptyFrames => {
                    let frames = [0x01u8, 0x00].repeat(2048);
                    while conn.write_all(&frames).is_ok() {}
                }
            }
            if closed.send(()).is_err() {
                return;
            }
        }
    });
    (port, ended)
}
