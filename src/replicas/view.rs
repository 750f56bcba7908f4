//! The replica set as published: the list in configuration order, and for
//! each model which replicas may get a request for it, computed when the
//! set or a replica's models change, not per request. Health, ejection and
//! load are not part of it: they live in each replica's atomics, read at
//! decision time.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;

use super::Replica;
use crate::policy::ReplicaId;

#[derive(Debug, Default)]
pub struct View {
    list: Vec<Arc<Replica>>,
    /// For each model some replica lists: whether each replica (by position)
    /// serves it: those listing it, and those whose models are unknown.
    offered: HashMap<String, Box<[bool]>>,
    /// For a model no replica lists: the replicas whose models are unknown.
    open: Box<[bool]>,
    /// Each replica's position by id, and by address (the first there).
    by_id: HashMap<ReplicaId, usize>,
    by_addr: HashMap<SocketAddr, usize>,
}

impl View {
    pub fn new(list: Vec<Arc<Replica>>) -> Self {
        let models: Vec<_> = list.iter().map(|r| r.models()).collect();
        let open: Box<[bool]> = models.iter().map(Option::is_none).collect();
        let mut offered: HashMap<String, Box<[bool]>> = HashMap::new();
        for (i, listed) in models.iter().enumerate() {
            for m in listed.iter().flat_map(|l| l.iter()) {
                offered.entry(m.clone()).or_insert_with(|| open.clone())[i] = true;
            }
        }
        let by_id = list.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
        let mut by_addr = HashMap::with_capacity(list.len());
        for (i, r) in list.iter().enumerate() {
            by_addr.entry(r.addr).or_insert(i);
        }
        Self {
            list,
            offered,
            open,
            by_id,
            by_addr,
        }
    }

    /// The position of the replica with this id.
    pub fn position(&self, id: ReplicaId) -> Option<usize> {
        self.by_id.get(&id).copied()
    }

    /// The replica at `addr` (the first listed there).
    pub fn at_addr(&self, addr: &SocketAddr) -> Option<&Arc<Replica>> {
        self.by_addr.get(addr).map(|i| &self.list[*i])
    }

    /// Whether each replica (by position) may get a request for `model`.
    pub fn offers(&self, model: &str) -> &[bool] {
        self.offered.get(model).unwrap_or(&self.open)
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
