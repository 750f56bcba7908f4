//! The log's format, and the access log: one line per request at `info` on
//! target [`TARGET`]. `log_format: json` (reloadable) makes every line one
//! JSON object (`ts`, `level`, `target`, then the message or, for the access
//! log, its fields), for log pipelines. An access line names the method and
//! path, never the query string (it may carry a key), headers (credentials)
//! or the body (prompt text).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

/// Log target of the access log.
pub const TARGET: &str = "access";

pub use crate::config::LogFormat;

static JSON: AtomicBool = AtomicBool::new(false);

/// Sets the format of every line from now on.
pub fn set_format(format: LogFormat) {
    JSON.store(format == LogFormat::Json, Relaxed);
}

/// Starts the process's logger: level from `RUST_LOG` (default `info`),
/// lines in the format last set.
pub fn init() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| {
            let ts = buf.timestamp_millis();
            if !JSON.load(Relaxed) {
                return writeln!(
                    buf,
                    "[{ts} {:<5} {}] {}",
                    record.level(),
                    record.target(),
                    record.args()
                );
            }
            let head = serde_json::json!({
                "ts": ts.to_string(),
                "level": record.level().as_str(),
                "target": record.target(),
            })
            .to_string();
            let head = head.strip_suffix('}').unwrap_or(&head);
            let message = record.args().to_string();
            match message.strip_prefix('{') {
                // The access log's own object: its fields follow the head's.
                Some(fields) if record.target() == TARGET => writeln!(buf, "{head},{fields}"),
                _ => writeln!(
                    buf,
                    "{head},\"message\":{}}}",
                    serde_json::Value::from(message)
                ),
            }
        })
        .init();
}

/// One finished request.
pub struct Entry<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// 0 when no response started.
    pub status: u16,
    pub replica: Option<&'a str>,
    pub decision: Option<&'a str>,
    pub shape: Option<&'a str>,
    pub matched_bytes: usize,
    /// Replicas tried before the last.
    pub tried: usize,
    /// Arrival to the replica's first body bytes.
    pub first_byte: Option<Duration>,
    pub duration: Duration,
    pub error: Option<&'a dyn std::fmt::Display>,
}

/// Logs `e` at `info` on [`TARGET`], formatting nothing when that is off.
pub fn write(e: &Entry) {
    if !log::log_enabled!(target: TARGET, log::Level::Info) {
        return;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    if JSON.load(Relaxed) {
        let line = serde_json::json!({
            "method": e.method,
            "path": e.path,
            "status": e.status,
            "replica": e.replica,
            "decision": e.decision,
            "shape": e.shape,
            "matched_bytes": e.matched_bytes,
            "tried": e.tried,
            "first_byte_ms": e.first_byte.map(ms),
            "ms": ms(e.duration),
            "error": e.error.map(|e| e.to_string()),
        });
        log::info!(target: TARGET, "{line}");
    } else {
        log::info!(
            target: TARGET,
            "{} {} status={} replica={} decision={} shape={} matched_bytes={} tried={} first_byte_ms={} ms={}{}",
            e.method,
            e.path,
            e.status,
            e.replica.unwrap_or("-"),
            e.decision.unwrap_or("-"),
            e.shape.unwrap_or("-"),
            e.matched_bytes,
            e.tried,
            e.first_byte.map_or("-".to_owned(), |d| d.as_millis().to_string()),
            e.duration.as_millis(),
            e.error
                .map(|e| format!(" error={:?}", e.to_string()))
                .unwrap_or_default()
        );
    }
}
