//! Pausing a simulator's accept loop with its accept queue full, so that
//! connects time out as on an overloaded host.

use std::net::SocketAddr;
use std::time::Duration;

use super::{http, Sim};

impl Sim {
    /// Stops accepting connections and fills the accept queue (start the sim
    /// with a short `--backlog`), so connects time out as on an overloaded
    /// host. The returned handle resumes it, over a connection opened first.
    ///
    /// The queue counts as full by the kernel's own count (Linux drops SYNs
    /// once it holds backlog + 1), not by one connect timing out: on a host
    /// that steals the CPU, a connect can time out with room left, and a
    /// router's connect then lands in the queue and waits for an answer.
    pub fn pause_accept(&self) -> Paused {
        let backlog = self.backlog.expect("start the sim with --backlog");
        let mut control = std::net::TcpStream::connect(self.addr).expect("control connection");
        control
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        http::keepalive_post(&mut control, "/sim/accept?paused=true");
        let mut queued = Vec::new();
        for _ in 0..64 {
            if accept_queue(self.addr) > backlog {
                return Paused { control, queued };
            }
            // Times out once the kernel's count is caught up and full.
            if let Ok(s) =
                std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(300))
            {
                queued.push(s);
            }
        }
        panic!("the accept queue of {} never filled", self.addr)
    }
}

/// Connections waiting in the accept queue of the IPv4 listener on `addr`,
/// from `/proc/net/tcp` (a listener's `rx_queue` is that count).
fn accept_queue(addr: SocketAddr) -> u32 {
    let tcp = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!(":{:04X}", addr.port());
    tcp.lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 4 && f[1].ends_with(&local) && f[3] == "0A")
        .and_then(|f| u32::from_str_radix(f[4].split(':').nth(1)?, 16).ok())
        .unwrap_or_else(|| panic!("no listener on {addr} in /proc/net/tcp"))
}

/// A simulator that stopped accepting connections; see [`Sim::pause_accept`].
pub struct Paused {
    control: std::net::TcpStream,
    queued: Vec<std::net::TcpStream>,
}

impl Paused {
    /// Accepts connections again.
    pub fn resume(mut self) {
        http::keepalive_post(&mut self.control, "/sim/accept?paused=false");
        self.queued.clear();
    }
}
