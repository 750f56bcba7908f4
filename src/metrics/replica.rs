//! Per-replica series: the counters each request touches, resolved once
//! (an atomic add per event, not a label lookup), and the label
//! vocabularies of repairs and ejections.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use super::family::{Histogram, IntCounter, IntCounterVec, IntGauge};

use super::{Metrics, ENGINE_READ_RESULTS, HEALTH_CHECK_RESULTS};
use crate::policy::{Reason, Shape};
use crate::usage::Outcome;

/// Why a replica was ejected (the `reason` label of the ejection counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ejection {
    Dead,
    Outlier,
}

impl Ejection {
    pub const ALL: [Ejection; 2] = [Ejection::Dead, Ejection::Outlier];

    pub fn as_str(self) -> &'static str {
        match self {
            Ejection::Dead => "connect_failed",
            Ejection::Outlier => "consecutive_failures",
        }
    }
}

/// Why the index forgot part of what a replica held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// The engine reported a pin's predicted prefix (almost) all gone.
    Miss,
    /// The replica passed a health check after failing one.
    Restart,
    /// Its engine's KV events said its cache was emptied or it restarted.
    Events,
}

impl Repair {
    pub const ALL: [Repair; 3] = [Repair::Miss, Repair::Restart, Repair::Events];

    pub fn as_str(self) -> &'static str {
        match self {
            Repair::Miss => "miss",
            Repair::Restart => "restart",
            Repair::Events => "events",
        }
    }
}

/// A replica's per-request counters, resolved once (an atomic add per
/// event, not a label lookup). The ones by decision are created at the
/// first flush after a decision's first use on this replica, not at 0 when
/// it joins: 35 zero series per replica made most of a 1,000-replica
/// fleet's scrape.
pub struct ReplicaCounters {
    name: String,
    /// Where a series made here later is remembered for the sweep.
    names: Arc<ReplicaNames>,
    /// The vectors the lazy series come from.
    requests_vec: IntCounterVec,
    usage_vecs: [IntCounterVec; 3],
    /// `requests_total` by reason (in `Reason::ALL` order, `no_replica`
    /// excluded: it has no replica) and shape.
    requests: [[OnceLock<IntCounter>; 2]; REASONS],
    /// Predicted cached, delivered cached and reported prompt tokens, by
    /// reason (same order).
    usage: [OnceLock<[IntCounter; 3]>; REASONS],
    /// `pin_outcomes_total`: hit, miss.
    outcomes: [IntCounter; 2],
    /// `first_byte_seconds` and `duration_seconds` by reason (same order;
    /// the fleet's, shared by every replica).
    timings: Vec<[Histogram; 2]>,
    failovers: IntCounter,
    /// Its gauges the capacity watch sets every round.
    pub gauges: ReplicaGauges,
    /// Counts not yet in their series ([`ReplicaCounters::flush`]), by
    /// reason: requests by shape, and usage (predicted, cached and prompt
    /// tokens, and reports). In the replica's own memory, so a request adds
    /// to a line or two here, not to four series' handles each in an
    /// allocation of its own (cold at 1,000 replicas: about 3 µs a request,
    /// docs/scale.md).
    pending_requests: [[AtomicU64; 2]; REASONS],
    pending_usage: [[AtomicU64; 4]; REASONS],
}

/// Reasons a routed request may have (all but `NoReplica`).
const REASONS: usize = Reason::ALL.len() - 1;

/// A replica's gauges, resolved once: the capacity watch sets them for
/// every replica twice a second.
pub struct ReplicaGauges {
    pub in_flight: IntGauge,
    pub queued_prefill: IntGauge,
    pub working_set: IntGauge,
    pub pinned_working_set: IntGauge,
}

impl ReplicaCounters {
    pub fn new(m: &Metrics, name: &str) -> Self {
        m.remember_replica(name);
        let reasons = Reason::ALL.iter().filter(|&&r| r != Reason::NoReplica);
        let timings = reasons
            .map(|r| {
                [&m.first_byte_seconds, &m.duration_seconds]
                    .map(|h| h.with_label_values(&[r.as_str()]))
            })
            .collect();
        Self {
            name: name.to_owned(),
            names: Arc::clone(&m.replica_names),
            requests_vec: m.requests.clone(),
            usage_vecs: [&m.predicted_cached, &m.delivered_cached, &m.reported_prompt]
                .map(Clone::clone),
            requests: Default::default(),
            usage: Default::default(),
            timings,
            outcomes: ["hit", "miss"].map(|o| m.pin_outcomes.with_label_values(&[name, o])),
            failovers: m.failovers.with_label_values(&[name]),
            gauges: ReplicaGauges {
                in_flight: m.in_flight.with_label_values(&[name]),
                queued_prefill: m.queued_prefill.with_label_values(&[name]),
                working_set: m.working_set.with_label_values(&[name]),
                pinned_working_set: m.pinned_working_set.with_label_values(&[name]),
            },
            pending_requests: Default::default(),
            pending_usage: Default::default(),
        }
    }

    /// Position of a reason in the per-reason lists (`Reason::ALL` order,
    /// which ends with `NoReplica`, the one not kept).
    fn at(reason: Reason) -> Option<usize> {
        const _: () = assert!(matches!(
            Reason::ALL[Reason::ALL.len() - 1],
            Reason::NoReplica
        ));
        Reason::ALL.iter().position(|&r| r == reason)
    }

    /// Counts one routed request (in its series at the next flush).
    pub fn routed(&self, reason: Reason, shape: Shape) {
        if let Some(by_shape) = Self::at(reason).and_then(|i| self.pending_requests.get(i)) {
            by_shape[usize::from(shape == Shape::Single)].fetch_add(1, Relaxed);
        }
    }

    /// Counts the usage a response reported: `predicted` cached tokens the
    /// placement expected, `cached` and `prompt` as the engine reported them
    /// (in their series at the next flush).
    pub fn usage(&self, reason: Reason, predicted: u64, cached: u64, prompt: u64) {
        if let Some(pending) = Self::at(reason).and_then(|i| self.pending_usage.get(i)) {
            for (n, by) in pending.iter().zip([predicted, cached, prompt]) {
                n.fetch_add(by, Relaxed);
            }
            // Released after the tokens: a flush that takes this report
            // takes its tokens too.
            pending[3].fetch_add(1, Release);
        }
    }

    /// Adds the counts since the last flush to their series, making a
    /// series at its first count: before every scrape, and as the counters
    /// are dropped (a replica removed, or its address changed).
    pub fn flush(&self) {
        let reasons = Reason::ALL.iter().filter(|&&r| r != Reason::NoReplica);
        let requests = self.pending_requests.iter().zip(&self.requests);
        let usage = self.pending_usage.iter().zip(&self.usage);
        for (reason, ((requests, request_series), (usage, usage_series))) in
            reasons.zip(requests.zip(usage))
        {
            let shapes = [Shape::Continuation, Shape::Single];
            for ((shape, n), series) in shapes.into_iter().zip(requests).zip(request_series) {
                let n = n.swap(0, Relaxed);
                if n > 0 {
                    series
                        .get_or_init(|| {
                            self.names.remember(&self.name);
                            self.requests_vec.with_label_values(&[
                                &self.name,
                                reason.as_str(),
                                shape.as_str(),
                            ])
                        })
                        .inc_by(n);
                }
            }
            if usage[3].swap(0, Acquire) == 0 {
                continue;
            }
            let series = usage_series.get_or_init(|| {
                self.names.remember(&self.name);
                self.usage_vecs
                    .each_ref()
                    .map(|v| v.with_label_values(&[&self.name, reason.as_str()]))
            });
            for (c, n) in series.iter().zip(usage) {
                c.inc_by(n.swap(0, Relaxed));
            }
        }
    }

    /// Records when the first response body bytes of a routed request came.
    pub fn first_byte(&self, reason: Reason, since_start: Duration) {
        self.timing(reason, 0, since_start);
    }

    /// Records how long a routed request took, start to end.
    pub fn duration(&self, reason: Reason, since_start: Duration) {
        self.timing(reason, 1, since_start);
    }

    fn timing(&self, reason: Reason, which: usize, since_start: Duration) {
        if let Some(h) = Self::at(reason).and_then(|i| self.timings.get(i)) {
            h[which].observe(since_start.as_secs_f64());
        }
    }

    /// Counts whether a placement's predicted reuse happened.
    pub fn outcome(&self, outcome: Outcome) {
        self.outcomes[usize::from(outcome != Outcome::Hit)].inc();
    }

    /// Counts one request moved to another replica after a connect failure.
    pub fn failover(&self) {
        self.failovers.inc();
    }
}

impl Drop for ReplicaCounters {
    fn drop(&mut self) {
        self.flush();
    }
}

impl std::fmt::Debug for ReplicaCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("ReplicaCounters")
    }
}

/// Sweeps a name that left is swept again in, before it is forgotten: a
/// health check in flight when it left may set one of its gauges again, and
/// its requests in flight count when its counters drop.
/// A series made later (a request in flight there, its first of a
/// decision) remembers the name again.
const SWEEPS_REMEMBERED: u8 = 3;

/// Replica names with series, and the sweeps each has been gone
/// (`Metrics::sweep_replicas`).
#[derive(Debug, Default)]
pub(super) struct ReplicaNames(Mutex<HashMap<String, u8>>);

impl ReplicaNames {
    pub(super) fn remember(&self, name: &str) {
        let mut names = self.lock();
        match names.get_mut(name) {
            Some(sweeps_gone) => *sweeps_gone = 0,
            None => {
                names.insert(name.to_owned(), 0);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, u8>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The lifecycle of a replica's series.
impl Metrics {
    /// Drops every series, counters too, of each replica name not in
    /// `set`: with `replicas_dns` each pod is a name of its own, and series
    /// kept for every pod that ever ran would grow without bound. A name
    /// that comes back starts its counters at 0 (`rate()` reads a reset). A
    /// name still in the set (an address change) keeps its series: its new
    /// handles count in them. Run after a removal and on a timer, since a
    /// health check in flight at the removal may set a gauge again.
    pub fn sweep_replicas(&self, in_set: impl Fn(&str) -> bool) {
        let mut names = self.replica_names.lock();
        names.retain(|name, sweeps_gone| {
            if in_set(name) {
                *sweeps_gone = 0;
                return true;
            }
            self.forget_replica_series(name);
            *sweeps_gone += 1;
            *sweeps_gone < SWEEPS_REMEMBERED
        });
    }

    /// Notes a replica name whose series `sweep_replicas` must drop when
    /// it leaves the set.
    pub(super) fn remember_replica(&self, name: &str) {
        self.replica_names.remember(name);
    }

    fn forget_replica_series(&self, replica: &str) {
        self.forget_replica(replica);
        let reasons = Reason::ALL.iter().filter(|&&r| r != Reason::NoReplica);
        for reason in reasons.map(|r| r.as_str()) {
            for shape in [Shape::Continuation, Shape::Single] {
                let _ = self
                    .requests
                    .remove_label_values(&[replica, reason, shape.as_str()]);
            }
            for c in [
                &self.predicted_cached,
                &self.delivered_cached,
                &self.reported_prompt,
            ] {
                c.remove_label_values(&[replica, reason]);
            }
        }
        self.failovers.remove_label_values(&[replica]);
        self.kv.forget(replica);
        let by_kind = [
            (&self.pin_outcomes, &["hit", "miss"][..]),
            (&self.ejections, &Ejection::ALL.map(Ejection::as_str)[..]),
            (&self.index_repairs, &Repair::ALL.map(Repair::as_str)[..]),
            (&self.engine_reads, &ENGINE_READ_RESULTS[..]),
            (&self.health_checks, &HEALTH_CHECK_RESULTS[..]),
        ];
        for (counter, kinds) in by_kind {
            for kind in kinds {
                counter.remove_label_values(&[replica, kind]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has_series_of(m: &Metrics, name: &str) -> bool {
        m.page().unwrap().contains(&format!("replica=\"{name}\""))
    }

    /// The value of the series (its name and labels as written) on the page.
    fn value(m: &Metrics, series: &str) -> Option<String> {
        let page = m.page().unwrap();
        let line = page.lines().find(|l| l.starts_with(series))?;
        line.rsplit(' ').next().map(str::to_owned)
    }

    #[test]
    fn counts_reach_their_series_at_a_flush_or_when_dropped() {
        let m = Metrics::new();
        let requests =
            "prefix_router_requests_total{decision=\"spread\",replica=\"a\",shape=\"single\"}";
        let usage = |name| {
            format!("prefix_router_{name}_tokens_total{{decision=\"spread\",replica=\"a\"}}")
        };
        let prompt = &usage("reported_prompt");
        let c = ReplicaCounters::new(&m, "a");
        c.routed(Reason::Spread, Shape::Single);
        c.routed(Reason::Spread, Shape::Single);
        c.usage(Reason::Spread, 0, 0, 0);
        assert_eq!(value(&m, requests), None, "not before a flush");
        c.flush();
        assert_eq!(value(&m, requests).as_deref(), Some("2"));
        // A report of no tokens still makes its series.
        assert_eq!(value(&m, prompt).as_deref(), Some("0"));
        c.routed(Reason::Spread, Shape::Single);
        c.usage(Reason::Spread, 10, 5, 700);
        drop(c);
        assert_eq!(value(&m, requests).as_deref(), Some("3"));
        assert_eq!(value(&m, prompt).as_deref(), Some("700"));
        assert_eq!(value(&m, &usage("predicted_cached")).as_deref(), Some("10"));
        assert_eq!(value(&m, &usage("delivered_cached")).as_deref(), Some("5"));
    }

    #[test]
    fn a_sweep_drops_the_series_of_a_replica_that_left_and_again_when_one_comes_back() {
        let m = Metrics::new();
        let counters = ["a", "b"].map(|name| {
            m.add_replica(name, (true, false), 0, None);
            let c = ReplicaCounters::new(&m, name);
            c.routed(Reason::Spread, Shape::Single);
            c.flush();
            c
        });
        m.sweep_replicas(|name| name == "a");
        assert!(has_series_of(&m, "a"));
        assert!(!has_series_of(&m, "b"));
        // A health check in flight when it left sets its gauge again.
        m.show_live("b", false);
        m.sweep_replicas(|name| name == "a");
        assert!(!has_series_of(&m, "b"));
        // Forgotten after a few sweeps; a name that joins again is swept again.
        for _ in 0..SWEEPS_REMEMBERED {
            m.sweep_replicas(|name| name == "a");
        }
        assert!(!m.replica_names.lock().contains_key("b"));
        // A request still in flight there when it left is the first of its
        // decision: its series is made, and swept.
        counters[1].routed(Reason::Pin, Shape::Continuation);
        counters[1].flush();
        assert!(has_series_of(&m, "b"));
        m.sweep_replicas(|name| name == "a");
        assert!(!has_series_of(&m, "b"));
        m.add_replica("b", (true, false), 0, None);
        m.sweep_replicas(|name| name == "a");
        assert!(!has_series_of(&m, "b"));
        assert!(has_series_of(&m, "a"));
    }
}
