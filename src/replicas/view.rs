//! The replica set as published: the list in configuration order, and for
//! each model which replicas may get a request for it, computed when the
//! set or a replica's models change, not per request. Health, ejection and
//! load are not part of it: they live in each replica's atomics, read at
//! decision time.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Arc;

use super::Replica;

#[derive(Debug, Default)]
pub struct View {
    list: Vec<Arc<Replica>>,
    /// For each model some replica lists: whether each replica (by position)
    /// serves it: those listing it, and those whose models are unknown.
    offered: HashMap<String, Box<[bool]>>,
    /// For a model no replica lists: the replicas whose models are unknown.
    open: Box<[bool]>,
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
        Self {
            list,
            offered,
            open,
        }
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
