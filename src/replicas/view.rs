//! The replica set as published: the list in configuration order, and for
//! each model which replicas may get a request for it, computed when the
//! set or a replica's models change, not per request. Health, ejection and
//! load are not part of it: they live in each replica's atomics, read at
//! decision time.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use super::Replica;
use crate::policy::ReplicaId;

#[derive(Debug, Default)]
pub struct View {
    list: Vec<Arc<Replica>>,
    /// For each model some replica lists: whether each replica (by position)
    /// serves it: those listing it, and those whose models are unknown.
    offered: HashMap<String, (Box<[bool]>, Members)>,
    /// For a model no replica lists: the replicas whose models are unknown.
    open: (Box<[bool]>, Members),
    /// Every replica, for a request naming no model.
    all: Members,
    /// Each replica's position by id.
    by_id: HashMap<ReplicaId, usize>,
}

/// The replicas a request for one model may get, by position, and the
/// window of them its next sample reads (see `Replicas::sample_into`):
/// each model's windows take turns on their own, and each window's reads
/// go round it from a cursor of its own.
#[derive(Debug, Default)]
pub struct Members {
    pub at: Box<[usize]>,
    next: AtomicUsize,
    /// Per window (by number; as many as members, the most there can be):
    /// where its next read starts, counted up without end (modulo its size).
    cursors: Box<[AtomicUsize]>,
}

impl Members {
    fn of(serves: &[bool]) -> Self {
        // A random first window: the set is published again often (a DNS
        // refresh, a model list), and window 0 must not get every restart.
        let first = RandomState::new().hash_one(serves.len()) as usize;
        let at: Box<[usize]> = (serves.iter().enumerate().filter(|(_, s)| **s))
            .map(|(i, _)| i)
            .collect();
        Self {
            cursors: at.iter().map(|_| AtomicUsize::new(0)).collect(),
            at,
            next: AtomicUsize::new(first),
        }
    }

    /// The next window's number (any; the caller takes it modulo).
    pub fn next_window(&self) -> usize {
        self.next.fetch_add(1, Relaxed)
    }

    /// Where a read of window `w` starts: one further than the last read's
    /// start, or than where a read stopped, whichever is further.
    pub fn start(&self, w: usize) -> usize {
        self.cursors.get(w).map_or(0, |c| c.fetch_add(1, Relaxed))
    }

    /// A read of window `w` stopped at `at` (counted as [`Members::start`]
    /// counts): the next starts past it.
    pub fn stopped(&self, w: usize, at: usize) {
        if let Some(c) = self.cursors.get(w) {
            c.fetch_max(at + 1, Relaxed);
        }
    }
}

impl View {
    pub fn new(list: Vec<Arc<Replica>>) -> Self {
        let models: Vec<_> = list.iter().map(|r| r.models()).collect();
        let open: Box<[bool]> = models.iter().map(Option::is_none).collect();
        let mut serving: HashMap<String, Box<[bool]>> = HashMap::new();
        for (i, listed) in models.iter().enumerate() {
            for m in listed.iter().flat_map(|l| l.iter()) {
                serving.entry(m.clone()).or_insert_with(|| open.clone())[i] = true;
            }
        }
        let offered = (serving.into_iter())
            .map(|(m, serves)| {
                let members = Members::of(&serves);
                (m, (serves, members))
            })
            .collect();
        let by_id = list.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
        Self {
            all: Members::of(&vec![true; list.len()]),
            open: (open.clone(), Members::of(&open)),
            list,
            offered,
            by_id,
        }
    }

    /// The replicas a request for `model` may get (any model: every one).
    pub fn members(&self, model: Option<&str>) -> &Members {
        match model {
            None => &self.all,
            Some(m) => self.offered.get(m).map_or(&self.open.1, |(_, w)| w),
        }
    }

    /// The position of the replica with this id.
    pub fn position(&self, id: ReplicaId) -> Option<usize> {
        self.by_id.get(&id).copied()
    }

    /// Whether each replica (by position) may get a request for `model`.
    pub fn offers(&self, model: &str) -> &[bool] {
        self.offered.get(model).map_or(&self.open.0, |(s, _)| s)
    }

    /// Some replica's model list names `model`.
    pub fn lists(&self, model: &str) -> bool {
        self.offered.contains_key(model)
    }

    /// No replica serves `model` (each lists its models, and none names it).
    pub fn nobody_serves(&self, model: &str) -> bool {
        !self.offers(model).iter().any(|o| *o)
    }
}

impl Deref for View {
    type Target = [Arc<Replica>];

    fn deref(&self) -> &[Arc<Replica>] {
        &self.list
    }
}
