//! The framework's own floor for the proxy benchmark (`make bench-proxy`): a
//! minimal `ProxyHttp` that asks Pingora's round-robin `LoadBalancer` for a
//! replica and forwards the request untouched. Same crates and server settings
//! as the router, none of its work (no body read, no parse, no policy, no
//! metrics), so the router's cost over it is the router's own.
//!   target/release/examples/plain-pingora --listen 127.0.0.1:8080 \
//!     --upstream 127.0.0.1:8001 --upstream 127.0.0.1:8002 --threads 1
#![forbid(unsafe_code)]

use std::sync::Arc;

use async_trait::async_trait;
use clap::Parser;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use pingora_load_balancing::{selection::RoundRobin, LoadBalancer};
use pingora_proxy::{ProxyHttp, Session};

#[derive(Parser)]
struct Cli {
    #[arg(long)]
    listen: String,
    /// An upstream `IP:port`; repeat for several.
    #[arg(long, required = true)]
    upstream: Vec<String>,
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

struct Plain(Arc<LoadBalancer<RoundRobin>>);

#[async_trait]
impl ProxyHttp for Plain {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let upstream = self
            .0
            .select(b"", 256)
            .ok_or_else(|| Error::explain(ErrorType::HTTPStatus(503), "no upstream"))?;
        Ok(Box::new(HttpPeer::new(upstream, false, String::new())))
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let conf = ServerConf {
        threads: cli.threads,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let upstreams = LoadBalancer::try_from_iter(cli.upstream.iter().map(String::as_str))?;
    let mut proxy =
        pingora_proxy::http_proxy_service(&server.configuration, Plain(Arc::new(upstreams)));
    proxy.add_tcp(&cli.listen);
    server.add_service(proxy);
    println!("listening on {}", cli.listen);
    server.run_forever()
}
