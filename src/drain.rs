//! Stopping. After SIGTERM Pingora stops accepting and then waits its whole
//! grace period (`shutdown_grace_s`) before ending what still runs; this
//! service ends that wait early: once no request is in progress (every
//! request, any method or path, from its head until its response has gone),
//! the process exits 0.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;

use crate::admission::Admission;
use crate::traces::Traces;

/// Connections accepted just before the signal get this long to send their
/// request before an empty count means "drained".
const SETTLE: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(50);

/// Exits the process once a graceful stop has nothing left in flight.
pub struct Drain {
    pub admission: Arc<Admission>,
    /// Sent before exiting.
    pub traces: Option<Arc<Traces>>,
}

#[async_trait]
impl BackgroundService for Drain {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if shutdown.changed().await.is_err() {
            return;
        }
        tokio::time::sleep(SETTLE).await;
        while self.admission.in_progress() > 0 {
            tokio::time::sleep(POLL).await;
        }
        log::info!("stopping: nothing in flight, exiting");
        if let Some(t) = self.traces.clone() {
            let _ = tokio::task::spawn_blocking(move || t.stop()).await;
        }
        std::process::exit(0);
    }
}
