//! The shared pins' connection: the `redis` crate's multiplexed client
//! (AUTH with a user name, SELECT, the commands and their replies) over a
//! TCP or TLS stream the router opens and bounds itself.
//!
//! Every command waits at most [`REPLY_TIMEOUT`]. A connection that closes
//! (a reset, a reply past the bounds), or whose commands time out or fail
//! on the connection [`FAILURES_TO_RECONNECT`] times in a row (a Redis gone
//! silent), is replaced: while none is up, lookups are answered at once
//! (nothing known) and writes dropped, and a new one is tried with a
//! backoff. An error Redis answers (an ACL refusal, out of memory, a read-
//! only replica) fails that command only, and is logged once per connection.
//!
//! TLS: the server's certificate must name the URL's host (a DNS name, or
//! an IP address as an IP subject-alt-name); client certificates (Redis's
//! `tls-auth-clients yes`) are not supported.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_rustls::rustls;

use super::bounded::{Bounded, Cut};
use super::{Lookup, SharedPins, Write, LOOKUP_QUEUE, WRITE_BATCH};

/// Connecting, TLS and the handshake (AUTH, SELECT) together.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for one command's reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(1);
/// Failed or timed-out commands in a row that replace the connection.
const FAILURES_TO_RECONNECT: u32 = 3;

/// A stream the client runs over: TCP or TLS, bounded.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// An open connection: the client, the task driving it (until aborted),
/// and why its stream was cut, if it was.
struct Open {
    conn: MultiplexedConnection,
    driver: tokio::task::JoinHandle<()>,
    cut: Cut,
}

/// Opens a connection to `pins.target`: TCP (TLS for `rediss://`), the
/// replies bounded, then the crate's handshake.
async fn connect(pins: &SharedPins) -> Result<Open, String> {
    let (host, port, tls) = match pins.target.addr() {
        ConnectionAddr::Tcp(host, port) => (host, *port, false),
        ConnectionAddr::TcpTls { host, port, .. } => (host, *port, true),
        other => return Err(format!("unsupported address {other}")),
    };
    let tcp = TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let cut = Cut::default();
    let stream: Box<dyn Io> = if tls {
        let config = pins.tls.clone().ok_or("no TLS set up for rediss://")?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("TLS server name {host}: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        Box::new(Bounded::new(tls, Cut::clone(&cut)))
    } else {
        Box::new(Bounded::new(tcp, Cut::clone(&cut)))
    };
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(REPLY_TIMEOUT));
    let (conn, driver) =
        MultiplexedConnection::new_with_config(pins.target.redis_settings(), stream, config)
            .await
            .map_err(|e| e.to_string())?;
    Ok(Open {
        conn,
        driver: tokio::spawn(driver),
        cut,
    })
}

/// TLS as a client of Redis: the CAs of `ca_file` (PEM; at least one), else
/// the system's (a warning when there are none).
pub(super) fn tls_config(ca_file: Option<&str>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(file) => {
            let certs = CertificateDer::pem_file_iter(file).map_err(|e| format!("{file}: {e}"))?;
            for cert in certs {
                let cert = cert.map_err(|e| format!("{file}: {e}"))?;
                roots.add(cert).map_err(|e| format!("{file}: {e}"))?;
            }
            if roots.is_empty() {
                return Err(format!("{file} holds no PEM certificate"));
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                log::warn!(
                    "fleet: no system CA certificates found for rediss://; name the Redis CA in \
                     fleet.redis_ca_file"
                );
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// One connection's commands in a row that failed on the connection, and
/// the signal that there were too many.
#[derive(Default)]
struct Health {
    failures: AtomicU32,
    broken: Notify,
    /// The last failure, for the log.
    last: std::sync::Mutex<String>,
    /// An error Redis answered was logged (once per connection).
    refused: AtomicBool,
}

impl Health {
    fn record<T>(&self, result: &redis::RedisResult<T>) {
        let Err(e) = result else {
            self.failures.store(0, Relaxed);
            return;
        };
        let on_connection = e.is_timeout()
            || e.is_io_error()
            || e.is_connection_dropped()
            || e.is_unrecoverable_error();
        if !on_connection {
            if !self.refused.swap(true, Relaxed) {
                log::warn!("fleet: redis answered an error: {e} (logged once per connection)");
            }
            return;
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = e.to_string();
        if self.failures.fetch_add(1, Relaxed) + 1 >= FAILURES_TO_RECONNECT {
            self.broken.notify_one();
        }
    }
}

/// The background task: one connection at a time, lookups answered
/// concurrently over it, writes batched into pipelines one at a time.
pub struct SharedPinsTask(pub Arc<SharedPins>);

impl SharedPinsTask {
    /// Serves the queues over `conn` until it fails too often (the reason
    /// returned) or the queues close (`None`).
    async fn serve(
        &self,
        conn: &MultiplexedConnection,
        driver: &mut tokio::task::JoinHandle<()>,
        lookups: &mut mpsc::Receiver<Lookup>,
        writes: &mut mpsc::Receiver<Write>,
    ) -> Option<String> {
        let health = Arc::new(Health::default());
        // Lookups waiting on Redis at once; more wait in the queue (and their
        // askers give up at their budget).
        let in_flight = Arc::new(Semaphore::new(LOOKUP_QUEUE));
        let mut writing: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::select! {
                _ = &mut *driver => return Some("the connection closed".into()),
                _ = health.broken.notified() => {
                    let last = health.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    return Some(format!("{FAILURES_TO_RECONNECT} commands in a row failed or timed out, the last: {last}"));
                }
                l = lookups.recv() => {
                    let l = l?;
                    let permit = Arc::clone(&in_flight).acquire_owned().await.ok()?;
                    let (pins, health, mut conn) = (Arc::clone(&self.0), Arc::clone(&health), conn.clone());
                    tokio::spawn(async move {
                        lookup(&pins, &health, &mut conn, l).await;
                        drop(permit);
                    });
                }
                w = writes.recv(), if writing.is_none() => {
                    let mut batch = vec![w?];
                    while batch.len() < WRITE_BATCH {
                        match writes.try_recv() {
                            Ok(w) => batch.push(w),
                            Err(_) => break,
                        }
                    }
                    let (pins, health, mut conn) = (Arc::clone(&self.0), Arc::clone(&health), conn.clone());
                    writing = Some(tokio::spawn(async move { write(&pins, &health, &mut conn, batch).await }));
                }
                _ = async { writing.as_mut().expect("guarded").await }, if writing.is_some() => {
                    writing = None;
                }
            }
        }
    }
}

/// Answers one lookup (`MGET`, or `GETEX` renewing a response id's TTL):
/// the first key holding a name, or `None`; dropped unanswered on an error
/// (counted `unavailable` by the asker).
async fn lookup(pins: &SharedPins, health: &Health, conn: &mut MultiplexedConnection, l: Lookup) {
    let name = |v: Option<Vec<u8>>| v.and_then(|b| String::from_utf8(b).ok());
    let found = if l.renew {
        let mut cmd = redis::cmd("GETEX");
        cmd.arg(l.keys.first()).arg("EX").arg(pins.ttl_s);
        let r = cmd.query_async::<Option<Vec<u8>>>(conn).await;
        health.record(&r);
        r.map(|v| name(v).map(|n| (0, n)))
    } else {
        let r = redis::cmd("MGET")
            .arg(&l.keys)
            .query_async::<Vec<Option<Vec<u8>>>>(conn)
            .await;
        health.record(&r);
        r.map(|v| {
            v.into_iter()
                .enumerate()
                .find_map(|(i, v)| Some((i, name(v)?)))
        })
    };
    if let Ok(found) = found {
        let _ = l.answer.send(found);
    }
}

/// Writes a batch in one pipeline, each counted by its reply.
async fn write(
    pins: &SharedPins,
    health: &Health,
    conn: &mut MultiplexedConnection,
    batch: Vec<Write>,
) {
    let mut pipe = redis::pipe();
    for w in &batch {
        match w {
            Write::Set { key, name, keep } => {
                let cmd = pipe.cmd("SET").arg(key).arg(name).arg("EX").arg(pins.ttl_s);
                if *keep {
                    cmd.arg("NX");
                }
            }
            Write::Delete(key) => {
                pipe.cmd("DEL").arg(key);
            }
        }
    }
    // Each command's reply, an error Redis answered among them.
    let replies = pipe.ignore_errors().query_async::<Vec<Value>>(conn).await;
    health.record(&replies);
    let replies = replies.unwrap_or_default();
    for (i, w) in batch.iter().enumerate() {
        let result = match replies.get(i) {
            Some(Value::ServerError(e)) => {
                health.record::<()>(&Err(e.clone().into()));
                "error"
            }
            Some(r) if w.accepts(r) => "ok",
            _ => "unavailable",
        };
        pins.count(w.op(), result);
    }
}

#[async_trait]
impl BackgroundService for SharedPinsTask {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let taken = self
            .0
            .queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some((mut lookups, mut writes)) = taken else {
            return;
        };
        let down = AtomicBool::new(false);
        let mut backoff = Duration::from_millis(100);
        let target = self.0.target.addr().to_string();
        loop {
            let session = async {
                let mut open = tokio::time::timeout(CONNECT_TIMEOUT, connect(&self.0))
                    .await
                    .map_err(|_| "connect timed out".to_owned())??;
                if down.swap(false, Relaxed) {
                    log::warn!("fleet: redis {target} reachable again: pins shared");
                }
                backoff = Duration::from_millis(100);
                let ended = self
                    .serve(&open.conn, &mut open.driver, &mut lookups, &mut writes)
                    .await;
                open.driver.abort();
                match (ended, open.cut.get()) {
                    (None, _) => Ok(()),
                    (Some(why), Some(cut)) => Err(format!("{why}; {cut}")),
                    (Some(why), None) => Err(why),
                }
            };
            let result = tokio::select! {
                _ = shutdown.changed() => return,
                r = session => r,
            };
            match result {
                // The queues closed: the router is going away.
                Ok(()) => return,
                Err(e) => {
                    if !down.swap(true, Relaxed) {
                        log::warn!(
                            "fleet: redis {target} unavailable ({e}): placing on this instance's own index until it is back"
                        );
                    }
                }
            }
            // While down, lookups are answered at once (nothing known) and
            // writes dropped, until the next attempt.
            let wait = tokio::time::sleep(backoff);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = &mut wait => break,
                    l = lookups.recv() => match l {
                        Some(l) => drop(l.answer),
                        None => return,
                    },
                    w = writes.recv() => match w {
                        Some(w) => self.0.count(w.op(), "unavailable"),
                        None => return,
                    },
                }
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}
