//! The framework's own floor for the proxy benchmark (`make bench-proxy`): a
//! minimal `ProxyHttp` that asks Pingora's round-robin `LoadBalancer` for a
//! replica and forwards the request untouched. Same crates and server settings
//! as the router, its default timeouts included (to clients: keep-alive, head,
//! write; to replicas: connect, read, write, idle, response head), none of its
//! work (no body read, no parse, no policy, no metrics), so the router's cost
//! over it is the router's own. `--no-timeouts` drops the timeouts (Pingora's
//! defaults: none), the floor the benchmark used before.
//!   target/release/examples/plain-pingora --listen 127.0.0.1:8080 \
//!     --upstream 127.0.0.1:8001 --upstream 127.0.0.1:8002 --threads 1
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use clap::Parser;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use pingora_load_balancing::{selection::RoundRobin, LoadBalancer};
use pingora_proxy::{ProxyHttp, Session};
use prefix_router::config::{ClientTimeouts, Timeouts};

#[derive(Parser)]
struct Cli {
    #[arg(long)]
    listen: String,
    /// An upstream `IP:port`; repeat for several.
    #[arg(long, required = true)]
    upstream: Vec<String>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Pingora's defaults (no timeouts) rather than the router's.
    #[arg(long)]
    no_timeouts: bool,
}

struct Plain {
    upstreams: Arc<LoadBalancer<RoundRobin>>,
    /// The router's defaults, unless `--no-timeouts`.
    timeouts: Option<(ClientTimeouts, Timeouts)>,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[async_trait]
impl ProxyHttp for Plain {
    /// When the request's first upstream was chosen.
    type CTX = Option<Instant>;

    fn new_ctx(&self) -> Option<Instant> {
        None
    }

    fn request_header_timeout(&self) -> Option<Duration> {
        self.timeouts.as_ref().map(|(c, _)| ms(c.header_ms))
    }

    fn upstream_response_header_deadline(&self, first: &Option<Instant>) -> Option<Instant> {
        let (_, t) = self.timeouts.as_ref()?;
        first.map(|at| at + ms(t.response_header_ms))
    }

    async fn early_request_filter(
        &self,
        session: &mut Session,
        _: &mut Option<Instant>,
    ) -> Result<()> {
        if let Some((c, _)) = &self.timeouts {
            if session.get_keepalive().is_some() {
                session.set_keepalive(Some(c.keepalive_idle_s));
            }
            session.set_write_timeout(Some(ms(c.write_ms)));
        }
        Ok(())
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        first: &mut Option<Instant>,
    ) -> Result<Box<HttpPeer>> {
        let upstream = self
            .upstreams
            .select(b"", 256)
            .ok_or_else(|| Error::explain(ErrorType::HTTPStatus(503), "no upstream"))?;
        let mut peer = HttpPeer::new(upstream, false, String::new());
        if let Some((_, t)) = &self.timeouts {
            first.get_or_insert_with(Instant::now);
            let o = &mut peer.options;
            o.connection_timeout = Some(ms(t.connect_ms));
            o.total_connection_timeout = Some(ms(t.connect_ms));
            o.read_timeout = Some(ms(t.read_ms));
            o.write_timeout = Some(ms(t.write_ms));
            o.idle_timeout = Some(ms(t.idle_ms));
        }
        Ok(Box::new(peer))
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut conf = ServerConf {
        threads: cli.threads,
        // As the router: one thread runs a current-thread runtime.
        work_stealing: cli.threads > 1,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(1),
        // As the router: idle connections kept to a thousand replicas.
        upstream_keepalive_pool_size: prefix_router::engine_client::IDLE_POOL / cli.threads.max(1),
        ..ServerConf::default()
    };
    if !cli.no_timeouts {
        // As the router: long timeouts on Tokio's timers.
        conf.fast_timeout_to_tokio_threshold_seconds = Some(5);
    }
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let upstreams = LoadBalancer::try_from_iter(cli.upstream.iter().map(String::as_str))?;
    let plain = Plain {
        upstreams: Arc::new(upstreams),
        timeouts: (!cli.no_timeouts).then(|| (ClientTimeouts::default(), Timeouts::default())),
    };
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, plain);
    proxy.add_tcp(&cli.listen);
    server.add_service(proxy);
    println!("listening on {}", cli.listen);
    server.run_forever()
}
