//! Admission: how many routed requests the router holds at once, and how many
//! request-body bytes they buffer together. Past either cap a request is
//! answered 503 at once instead of growing memory without bound.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// The two caps and what is held now.
#[derive(Debug)]
pub struct Admission {
    max_requests: AtomicUsize,
    max_bytes: AtomicUsize,
    requests: AtomicUsize,
    bytes: AtomicUsize,
}

impl Admission {
    /// New limits (a reload); what is held already stays admitted.
    pub fn set_limits(&self, max_requests: usize, max_bytes: usize) {
        self.max_requests.store(max_requests, Relaxed);
        self.max_bytes.store(max_bytes, Relaxed);
    }

    pub fn new(max_requests: usize, max_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            max_requests: AtomicUsize::new(max_requests),
            max_bytes: AtomicUsize::new(max_bytes),
            requests: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
        })
    }

    /// A slot for one request, or `None` at the cap.
    pub fn admit(self: &Arc<Self>) -> Option<Ticket> {
        take(&self.requests, 1, self.max_requests.load(Relaxed)).then(|| Ticket {
            admission: Arc::clone(self),
            bytes: 0,
        })
    }

    /// Whether `n` more body bytes would fit now (reserves nothing).
    pub fn has_room(&self, n: usize) -> bool {
        self.bytes
            .load(Relaxed)
            .checked_add(n)
            .is_some_and(|total| total <= self.max_bytes.load(Relaxed))
    }

    /// Requests held now.
    pub fn requests(&self) -> usize {
        self.requests.load(Relaxed)
    }

    /// Body bytes buffered now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Relaxed)
    }
}

/// Adds `n` to `counter` unless that passes `max`.
fn take(counter: &AtomicUsize, n: usize, max: usize) -> bool {
    counter
        .fetch_update(Relaxed, Relaxed, |held| {
            held.checked_add(n).filter(|total| *total <= max)
        })
        .is_ok()
}

/// One admitted request and the body bytes it reserved; released on drop.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    bytes: usize,
}

impl Ticket {
    /// Reserves `n` more body bytes; `false` when the shared budget is spent.
    pub fn reserve(&mut self, n: usize) -> bool {
        let ok = take(
            &self.admission.bytes,
            n,
            self.admission.max_bytes.load(Relaxed),
        );
        if ok {
            self.bytes += n;
        }
        ok
    }

    /// Gives the reserved bytes back (the request keeps its slot).
    pub fn release_bytes(&mut self) {
        self.release(self.bytes);
    }

    /// Gives `n` of the reserved bytes back.
    pub fn release(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.admission.bytes.fetch_sub(n, Relaxed);
        self.bytes -= n;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release_bytes();
        self.admission.requests.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_past_the_cap_are_refused_until_one_ends() {
        let a = Admission::new(2, 100);
        let t1 = a.admit().unwrap();
        let _t2 = a.admit().unwrap();
        assert!(a.admit().is_none());
        drop(t1);
        assert!(a.admit().is_some());
    }

    #[test]
    fn body_bytes_share_one_budget_and_return_to_it() {
        let a = Admission::new(10, 100);
        let mut t1 = a.admit().unwrap();
        let mut t2 = a.admit().unwrap();
        assert!(t1.reserve(60));
        assert!(!t2.reserve(41));
        assert!(t2.reserve(40));
        assert_eq!(a.bytes(), 100);
        assert!(!a.has_room(1));
        drop(t1);
        assert_eq!((a.bytes(), a.requests()), (40, 1));
        t2.release(15);
        assert_eq!(a.bytes(), 25);
        t2.release_bytes();
        assert_eq!((a.bytes(), a.requests()), (0, 1));
        assert!(a.has_room(100) && !a.has_room(101));
    }
}
