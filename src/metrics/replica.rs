//! Per-replica series: the counters each request touches, resolved once
//! when the replica joins (an atomic add per event, not a label lookup),
//! and the label vocabularies of repairs and ejections.

use std::time::Duration;

use prometheus::{Histogram, IntCounter};

use super::Metrics;
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

/// A replica's per-request counters, resolved once when it joins the set
/// (at 0, so they show before its first request): counting a request is an
/// atomic add, not a label lookup.
pub struct ReplicaCounters {
    /// `requests_total` by reason (in `Reason::ALL` order, `no_replica`
    /// excluded: it has no replica) and shape.
    requests: Vec<[IntCounter; 2]>,
    /// Predicted cached, delivered cached and reported prompt tokens, by
    /// reason (same order).
    usage: Vec<[IntCounter; 3]>,
    /// `pin_outcomes_total`: hit, miss.
    outcomes: [IntCounter; 2],
    /// `first_byte_seconds` and `duration_seconds` by reason (same order;
    /// the fleet's, shared by every replica).
    timings: Vec<[Histogram; 2]>,
    failovers: IntCounter,
}

impl ReplicaCounters {
    pub fn new(m: &Metrics, name: &str) -> Self {
        let reasons = Reason::ALL.iter().filter(|&&r| r != Reason::NoReplica);
        let requests = reasons
            .clone()
            .map(|r| {
                [Shape::Continuation, Shape::Single].map(|s| {
                    m.requests
                        .with_label_values(&[name, r.as_str(), s.as_str()])
                })
            })
            .collect();
        let timings = reasons
            .clone()
            .map(|r| {
                [&m.first_byte_seconds, &m.duration_seconds]
                    .map(|h| h.with_label_values(&[r.as_str()]))
            })
            .collect();
        let usage = reasons
            .map(|r| {
                [&m.predicted_cached, &m.delivered_cached, &m.reported_prompt]
                    .map(|c| c.with_label_values(&[name, r.as_str()]))
            })
            .collect();
        Self {
            requests,
            usage,
            timings,
            outcomes: ["hit", "miss"].map(|o| m.pin_outcomes.with_label_values(&[name, o])),
            failovers: m.failovers.with_label_values(&[name]),
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

    /// Counts one routed request.
    pub fn routed(&self, reason: Reason, shape: Shape) {
        if let Some(by_shape) = Self::at(reason).and_then(|i| self.requests.get(i)) {
            by_shape[usize::from(shape == Shape::Single)].inc();
        }
    }

    /// Counts the usage a response reported: `predicted` cached tokens the
    /// placement expected, `cached` and `prompt` as the engine reported them.
    pub fn usage(&self, reason: Reason, predicted: u64, cached: u64, prompt: u64) {
        if let Some([p, c, t]) = Self::at(reason).and_then(|i| self.usage.get(i)) {
            p.inc_by(predicted);
            c.inc_by(cached);
            t.inc_by(prompt);
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

impl std::fmt::Debug for ReplicaCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("ReplicaCounters")
    }
}
