//! Waiting for a replica (`shed_in_flight`): a routed request that arrives
//! while every live replica has that many in flight is answered 429 at
//! once, or with `queue` the places are shared fairly between tenants (see
//! `tenants::queue`) and it waits its turn before its body is read. Every
//! request's end lets the next waiters in.

use std::sync::Arc;
use std::time::Instant;

use super::{Ctx, Router};
use crate::config::{ms, Class};
use crate::errors::RouterError;
use crate::tenants::queue::{Entry, Places, Terms, Turned};
use crate::tenants::ANONYMOUS;

impl Router {
    /// Whether a request may go on to be placed under the in-flight
    /// `bound`: at once, after its turn in the queue, or not (the error).
    pub(super) async fn wait_for_room(&self, ctx: &mut Ctx, bound: u32) -> Result<(), RouterError> {
        // Copied out: no settings held over the wait.
        let Some(q) = self.settings.load().queue.clone() else {
            return match self.replicas.saturated(bound) {
                true => Err(RouterError::Saturated { in_flight: bound }),
                false => Ok(()),
            };
        };
        let (tenant, class, weight) = match &ctx.read.tenant {
            Some(t) => (Arc::clone(t.name()), t.class, t.weight()),
            None => (Arc::from(ANONYMOUS), Class::Standard, 1),
        };
        let started = Instant::now();
        let places = || self.places(Some(bound));
        let entered = (self.queue).enter(&tenant, class, weight, places, self.terms(&q));
        let result = match entered {
            Ok(Entry::Pass(pass)) => Ok(pass),
            Ok(Entry::Wait(waiter)) => {
                let tenants = &self.metrics.tenants;
                tenants.queue_waiting.set(self.queue.waiting() as i64);
                let deadline = started + ms(q.deadline_ms);
                let result = waiter.wait(deadline, || self.let_waiters_in()).await;
                tenants.queue_waiting.set(self.queue.waiting() as i64);
                result
            }
            Err(turned) => Err(turned),
        };
        // Every request that asked counts, at 0 when it went on at once.
        match &ctx.read.tenant {
            Some(t) => t.waited(started.elapsed()),
            None => (self.metrics.tenants.queue_wait)
                .with_label_values(&[ANONYMOUS])
                .observe(started.elapsed().as_secs_f64()),
        }
        let err = match result {
            Ok(pass) => {
                ctx.read.pass = Some(pass);
                return Ok(());
            }
            Err(Turned::Full) => RouterError::QueueFull {
                max_waiting: q.max_waiting,
            },
            Err(Turned::Deadline) => RouterError::QueueTimeout { ms: q.deadline_ms },
        };
        if let Some(t) = &ctx.read.tenant {
            t.turned_away();
        }
        Err(err)
    }

    /// The in-flight places under `bound`: free, and all.
    fn places(&self, bound: Option<u32>) -> Places {
        match bound.and_then(|b| self.replicas.places(b)) {
            Some((free, total)) => Places { free, total },
            // No replica is live, or no bound any more (a reload): nothing
            // to wait for.
            None => Places {
                free: usize::MAX,
                total: usize::MAX,
            },
        }
    }

    fn terms(&self, q: &crate::config::Queue) -> Terms {
        Terms {
            max_waiting: q.max_waiting,
            window: ms(q.share_window_ms),
            now: Instant::now(),
        }
    }

    /// Lets waiters through into the places free now (every one of them
    /// when a reload took the queue or the bound away).
    pub(super) fn let_waiters_in(&self) {
        if self.queue.waiting() == 0 {
            return;
        }
        let s = self.settings.load();
        let bound = s.shed_in_flight.filter(|_| s.queue.is_some());
        let q = s.queue.clone().unwrap_or_default();
        drop(s);
        self.queue.dispatch(|| self.places(bound), self.terms(&q));
        (self.metrics.tenants.queue_waiting).set(self.queue.waiting() as i64);
    }
}
