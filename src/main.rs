//! The router binary: CLI -> config -> Pingora server -> services. No logic.
//!   cargo run --release --bin prefix-router -- --config conf/example.yaml
//!   prefix-router --check --config FILE   (validate, print a summary, exit)
//!   prefix-router --probe URL              (GET it; exit 0 on 2xx: container health checks)
//!   prefix-router -u --config FILE         (take the listeners over from a running router)

/// mimalloc, not the system allocator: a 400 KiB body's buffers are reused
/// from request to request instead of faulted in afresh (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::Server;
use pingora_core::services::background::background_service;

use prefix_router::admission::Admission;
use prefix_router::auth::KeyFile;
use prefix_router::capacity::CapacityWatch;
use prefix_router::config::FleetMode;
use prefix_router::config::{Config, EMBEDDED_DEFAULT, POLICY_ENV};
use prefix_router::drain::Drain;
use prefix_router::engine_client::{own_host, own_requests};
use prefix_router::engine_load::EngineLoadWatch;
use prefix_router::health_checks::{HealthChecks, HealthProbe};
use prefix_router::metrics::Metrics;
use prefix_router::policy::Policy;
use prefix_router::proxy::Router;
use prefix_router::reload::{Live, Reloader};
use prefix_router::replicas::Replicas;
use prefix_router::request::Checkpoints;
use prefix_router::resolve::Resolver;
use prefix_router::response_ids::ResponseIds;
use prefix_router::settings::Settings;
use prefix_router::shared_pins::{SharedPins, SharedPinsTask};

/// A load balancer for LLM replicas that routes by request shape.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// YAML config (hot-reloaded). Without it: the embedded default, two
    /// replicas on 127.0.0.1:8001 and :8002 (see README).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Check the configuration (and the API keys file it names), print a
    /// one-line summary and exit: 0 when the router would start on it, else
    /// non-zero with the offending key or value.
    #[arg(long)]
    check: bool,
    /// GET this plain http:// URL (e.g. http://127.0.0.1:9091/healthz), print
    /// the status line and exit 0 on a 2xx answer within 2 s, else 1.
    #[arg(long, value_name = "URL")]
    probe: Option<String>,
    /// Zero-downtime upgrade: receive the listening sockets from the router
    /// running on the same `upgrade_sock`; then send that one SIGQUIT.
    #[arg(short = 'u', long)]
    upgrade: bool,
}

fn main() -> anyhow::Result<()> {
    // Dropped at the end of `main`: the lines still queued are written out.
    let logging = prefix_router::access_log::init();
    let cli = Cli::parse();
    if let Some(url) = &cli.probe {
        match prefix_router::status::probe(url, std::time::Duration::from_secs(2)) {
            Ok(line) => {
                println!("{line}");
                return Ok(());
            }
            Err(e) => {
                eprintln!("{url}: {e}");
                std::process::exit(1);
            }
        }
    }
    let env_policy = std::env::var(POLICY_ENV).ok();
    // With the text it came from: the reloader judges edits against it.
    let (cfg, loaded) = match &cli.config {
        Some(path) => Config::load_text(path, env_policy.as_deref())
            .with_context(|| format!("config {}", path.display()))?,
        None => (
            Config::parse(EMBEDDED_DEFAULT, env_policy.as_deref()).context("embedded default")?,
            EMBEDDED_DEFAULT.to_owned(),
        ),
    };
    prefix_router::access_log::set_format(cfg.log_format);
    // Everything that can fail comes before Pingora's bootstrap: under `-u`
    // the old router hands its sockets over once that has run, so a failure
    // after it would leave no router at all.
    let open_keys = |file: &Option<String>, key: &str| -> anyhow::Result<_> {
        file.as_ref()
            .map(|f| {
                KeyFile::open(f.into())
                    .map(Arc::new)
                    .with_context(|| format!("{key} {f}"))
            })
            .transpose()
    };
    let keys = open_keys(&cfg.api_keys_file, "api_keys_file")?;
    let admin_keys = open_keys(&cfg.admin_keys_file, "admin_keys_file")?;
    let traces = match &cfg.traces {
        Some(t) => Some(Arc::new(prefix_router::traces::Traces::start(t)?)),
        None => None,
    };
    if let Some(warning) = cfg.key_warning() {
        log::warn!("config: {warning}");
    }
    #[cfg(feature = "tls")]
    let listen_tls = match &cfg.listen_tls {
        Some(t) => Some((
            t.addr.clone(),
            prefix_router::listen_tls::settings(&t.cert_file, &t.key_file).context("listen_tls")?,
        )),
        None => None,
    };
    let probe = HealthProbe::new(&cfg.health_check, &cfg.replica_tls).context("health check")?;
    let resolver = Arc::new(Resolver::default());
    // Names resolve before the set is built (each within its deadline);
    // the runtime is let go at once, a lookup still blocked included.
    let startup = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("runtime for name lookups")?;
    startup.block_on(resolver.refresh(&cfg, prefix_router::resolve::STARTUP_LOOKUP_DEADLINE));
    startup.shutdown_background();
    let listed = resolver.expand(&cfg, |_| None);
    let metrics = Arc::new(Metrics::new());
    metrics.watch_log_drops(logging.dropped());
    let replicas = Arc::new(Replicas::new(&listed, Arc::clone(&metrics)));
    let engine_load = match &cfg.engine_load {
        Some(e) => Some(
            EngineLoadWatch::new(
                Arc::clone(&replicas),
                e,
                own_host(&cfg.replica_tls),
                own_requests(&cfg.replica_tls),
                Arc::clone(&metrics),
            )
            .context("engine_load")?,
        ),
        None => None,
    };
    // Loaded (and checked) before `--check` answers.
    let exact = Arc::new(
        prefix_router::exact::Exact::load(&cfg.tokenizers)
            .map_err(|why| anyhow::anyhow!("tokenizers: {why}"))?,
    );
    let upgrade_sock = prefix_router::upgrade::socket(&cfg);
    if cli.check {
        let source = cli
            .config
            .as_ref()
            .map_or("embedded default".to_owned(), |p| p.display().to_string());
        println!(
            "{source}: ok: {} replicas ({}), policy {}, listen {}, metrics {}, upgrade socket {}{}",
            listed.len(),
            listed
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            cfg.policy.as_str(),
            cfg.listen,
            cfg.metrics_listen,
            upgrade_sock.display(),
            cfg.kv_room_inactive()
                .map(|why| format!("; {why}"))
                .unwrap_or_default()
        );
        let unresolved = resolver.failing();
        if !unresolved.is_empty() {
            println!(
                "names that do not resolve here (looked up again every dns_refresh_ms when running): {}",
                unresolved.join(", ")
            );
        }
        return Ok(());
    }
    log::info!(
        "prefix-router: listen {} metrics {} policy {} replicas [{}]",
        cfg.listen,
        cfg.metrics_listen,
        cfg.policy.as_str(),
        listed
            .iter()
            .map(|r| format!("{} {}", r.name, r.addr))
            .collect::<Vec<_>>()
            .join(", ")
    );

    if let Some(why) = cfg.kv_room_inactive() {
        log::info!("{why}");
    }
    raise_open_files();
    if cfg.timeouts.idle_ms >= 5_000 {
        log::warn!(
            "timeouts.idle_ms is {} ms: at or above the engines' keep-alive (uvicorn: 5 s), a pooled \
             connection may be one the engine is closing, and a request lost that way is answered 502, \
             not re-sent",
            cfg.timeouts.idle_ms
        );
    }
    // A receiving router insists on a private socket directory; a running one
    // disables the hand-over rather than send its sockets somewhere unsafe.
    let upgrade_sock = if cli.upgrade {
        prefix_router::upgrade::checked(&upgrade_sock).context("upgrade_sock")?
    } else {
        prefix_router::upgrade::socket_or_disabled(&upgrade_sock)
    };
    let conf = ServerConf {
        threads: cfg.threads,
        // One thread has nothing to steal work from: Pingora's no-steal
        // flavour runs it as a current-thread runtime, which spent 18 % less
        // CPU per request than a one-worker work-stealing runtime in front of
        // 1,000 replicas (the same in front of 2; docs/scale.md, *One thread,
        // no stealing*).
        work_stealing: cfg.threads > 1,
        // Pingora's fast timers stay registered until their deadline even when
        // the read they guarded ended long before: with `read_ms` at 600 s that
        // held ~135 B per thread and 10 ms slot for 10 minutes (the soak's RSS
        // grew for 600 s).
        // Tokio's timers are removed with the read; only short timeouts stay fast.
        fast_timeout_to_tokio_threshold_seconds: Some(5),
        // After SIGTERM Pingora stops accepting, waits the whole grace period
        // (sessions in flight run on), then stops its runtimes within the
        // timeout, ending whatever still runs; `Drain` exits sooner once
        // nothing is in flight.
        grace_period_seconds: Some(cfg.shutdown_grace_s),
        graceful_shutdown_timeout_seconds: Some(5),
        ca_file: cfg.replica_tls.ca_file.clone(),
        // SIGQUIT hands the listeners to a router started with `-u` on this
        // socket, then stops like SIGTERM (after Pingora's 5 s of overlap).
        upgrade_sock: upgrade_sock.display().to_string(),
        // Pingora multiplies it by the threads: IDLE_POOL in all.
        upstream_keepalive_pool_size: prefix_router::engine_client::IDLE_POOL / cfg.threads.max(1),
        ..ServerConf::default()
    };
    let opt = Opt {
        upgrade: cli.upgrade,
        ..Opt::default()
    };
    let mut server = Server::new_with_opt_and_conf(Some(opt), conf);

    metrics.init();
    for r in replicas.snapshot().iter() {
        metrics.add_replica(&r.name, (r.live(), false), r.in_flight(), r.kv_tokens());
    }
    let policy = Arc::new(Policy::new(prefix_router::policy_config::policy_config(
        &cfg,
    )));
    if cfg.fleet.mode != FleetMode::Local {
        // Instances of one fleet: counters started apart, so concurrent
        // first turns through different instances are not all sent alike.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        policy.seed_counters(now ^ u64::from(std::process::id()) << 32);
    }
    let health_checks = background_service(
        "replicas",
        HealthChecks::new(
            Arc::clone(&replicas),
            Arc::clone(&policy),
            Arc::clone(&probe),
            prefix_router::config::ms(cfg.health_check.interval_ms),
            Arc::clone(&metrics),
        ),
    );
    let settings = Arc::new(arc_swap::ArcSwap::from_pointee(Settings::from_config(&cfg)));
    let responses = Arc::new(ResponseIds::new(prefix_router::response_ids::DEFAULT_CAP));
    let admission = Admission::new(&cfg.limits);
    // Shared pins: a background task owns the Redis connection.
    let shared = match (&cfg.fleet.mode, &cfg.fleet.redis_url) {
        (FleetMode::Redis, Some(url)) => {
            let target = prefix_router::config::parse_redis_url(url)
                .map_err(|why| anyhow::anyhow!("fleet.redis_url: {why}"))?;
            let ca_file = cfg.fleet.redis_ca_file.as_deref();
            Some(Arc::new(
                SharedPins::new(
                    target,
                    ca_file,
                    prefix_router::config::ms(cfg.fleet.redis_budget_ms),
                    cfg.fleet.redis_ttl_s,
                    Arc::clone(&metrics),
                )
                .map_err(|why| anyhow::anyhow!("fleet.redis_url (TLS): {why}"))?,
            ))
        }
        _ => None,
    };
    let router = Router {
        settings: Arc::clone(&settings),
        policy: Arc::clone(&policy),
        replicas: Arc::clone(&replicas),
        admission: Arc::clone(&admission),
        keys: keys.clone(),
        tenants: prefix_router::tenants::Tenants::new(Arc::clone(&metrics)),
        queue: Arc::default(),
        traces: traces.clone(),
        responses: Arc::clone(&responses),
        shared: shared.clone(),
        checkpoints: Arc::new({
            let replicas = Arc::clone(&replicas);
            Checkpoints::serving(move |model| !replicas.nobody_serves(model))
        }),
        exact: Arc::clone(&exact),
        metrics: Arc::clone(&metrics),
    };
    let capacity = CapacityWatch::new(
        cfg.working_set_window_s,
        Arc::clone(&policy),
        Arc::clone(&replicas),
        Arc::clone(&admission),
        Arc::clone(&metrics),
    );
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, router);
    if let Some(app) = proxy.app_logic_mut() {
        // HTTP/2 clients get HTTP/1's deadlines: the preface within
        // `header_ms`, an idle connection closed after `keepalive_idle_s`.
        let mut options = pingora_core::apps::HttpServerOptions::default();
        options.h2_idle_timeout = Some(std::time::Duration::from_secs(
            cfg.client_timeouts.keepalive_idle_s,
        ));
        options.h2_handshake_timeout = Some(std::time::Duration::from_millis(
            cfg.client_timeouts.header_ms,
        ));
        app.server_options = Some(options);
        let mut h2 = pingora_core::protocols::http::v2::server::default_h2_options();
        h2.max_concurrent_streams(cfg.limits.max_streams_per_connection);
        app.h2_options = Some(h2);
    }
    // A client connection's read buffer lives as long as the connection: at
    // Pingora's 64 KiB, 10,000 open streams held 640 MiB in them alone
    // (docs/scale.md). So it has none: a request's first read goes into an
    // 8 KiB buffer of its own (a short prompt in one system call), whose
    // bytes then move to one of their size (patches/pingora-core-0.9.1.diff).
    proxy.add_listener(
        pingora_core::listeners::ListenerConfig::tcp(cfg.listen.as_str()).l4_buffer(
            pingora_core::listeners::L4BufferSettings::default().read(CLIENT_READ_BUFFER),
        ),
    );
    #[cfg(feature = "tls")]
    if let Some((addr, tls)) = listen_tls {
        proxy.add_tls_with_settings(&addr, None, tls);
    }
    let serving = prefix_router::replicas::HealthRules::from(&cfg.health_check).serving;
    let mut status = prefix_router::status::service(
        Arc::clone(&replicas),
        Arc::clone(&metrics),
        admin_keys.clone(),
        serving,
        {
            let c = &cfg.client_timeouts;
            prefix_router::status::Deadlines {
                header: std::time::Duration::from_millis(c.header_ms),
                keepalive_s: c.keepalive_idle_s,
                write: std::time::Duration::from_millis(c.write_ms),
                max_connections: cfg.limits.max_metrics_connections,
            }
        },
    );
    status.add_tcp(&cfg.metrics_listen);

    if let Some(watch) = engine_load {
        server.add_service(background_service("engine load", watch));
    }
    server.add_service(background_service(
        "kv events",
        prefix_router::kv_events::KvEventsWatch {
            replicas: Arc::clone(&replicas),
            policy: Arc::clone(&policy),
            metrics: Arc::clone(&metrics),
        },
    ));
    let gate = server.add_service(background_service(
        "ready gate",
        prefix_router::status::ReadyGate {
            replicas: Arc::clone(&replicas),
            max_wait: prefix_router::status::READY_GATE_MAX_WAIT,
        },
    ));
    if let Some(path) = cli.config {
        let live = Live {
            replicas,
            policy,
            settings,
            admission: Arc::clone(&admission),
            probe,
            keys,
            admin_keys,
            resolver,
            metrics,
        };
        let reloader = Reloader::new(path, cfg, loaded, env_policy, live);
        server.add_service(background_service("reload", reloader));
    }
    if let Some(shared) = shared {
        server.add_service(background_service("shared pins", SharedPinsTask(shared)));
    }
    server.add_service(background_service("drain", Drain { admission, traces }));
    server.add_service(background_service("capacity", capacity));
    server.add_service(health_checks);
    server.add_service(proxy).add_dependency(&gate);
    server.add_service(status);
    // Under `-u`: receive the listening sockets (waits ~6 s for them).
    server.bootstrap();
    // Returns once the services have shut down (SIGTERM's drain, or the
    // handover of an upgrade); the queued log lines are then written out.
    server.run(pingora_core::server::RunArgs::default());
    drop(logging);
    Ok(())
}

/// Bytes of a client connection's read buffer over plain TCP (Pingora's
/// default: 64 KiB): none.
const CLIENT_READ_BUFFER: usize = 0;

/// Raises the soft limit on open descriptors to the hard one (a proxied
/// request holds two: the client's and the replica's), and says so: the
/// common soft default of 1,024 caps a router at about 500 open streams.
fn raise_open_files() {
    let before = rlimit::Resource::NOFILE.get().map(|(soft, _)| soft).ok();
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(now) if before.is_some_and(|b| now > b) => log::info!(
            "open files: soft limit raised from {} to {now} (the hard limit); \
             each open request holds two",
            before.unwrap_or_default()
        ),
        Ok(now) => log::info!("open files: up to {now}; each open request holds two"),
        Err(e) => log::warn!("open files: the soft limit could not be raised: {e}"),
    }
}
