//! Admission: how many requests the router has in flight to replicas at
//! once (a slot, taken when a request is placed: a client still sending its
//! body holds none), how many request-body bytes are buffered together, and
//! how many requests one client address has in progress. Past a cap a
//! request is answered at once instead of growing memory without bound.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::config;

/// The caps and what is held now.
#[derive(Debug)]
pub struct Admission {
    max_requests: AtomicUsize,
    max_bytes: AtomicUsize,
    /// Requests in progress per client address (an IPv6 /64); 0: not counted.
    max_per_client: AtomicUsize,
    requests: AtomicUsize,
    bytes: AtomicUsize,
    /// Requests from their head to their end (the drain waits for them).
    in_progress: AtomicUsize,
    /// Per client address, while `max_per_client` is set; sharded by address.
    clients: [Mutex<HashMap<IpAddr, usize>>; CLIENT_SHARDS],
}

const CLIENT_SHARDS: usize = 16;

impl Admission {
    /// New limits (a reload); what is held already stays admitted.
    pub fn set_limits(&self, limits: &config::Limits) {
        self.max_requests.store(limits.max_requests, Relaxed);
        self.max_bytes.store(limits.max_buffered_bytes, Relaxed);
        self.max_per_client
            .store(limits.max_requests_per_client, Relaxed);
    }

    pub fn new(limits: &config::Limits) -> Arc<Self> {
        let admission = Self {
            max_requests: AtomicUsize::new(0),
            max_bytes: AtomicUsize::new(0),
            max_per_client: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            in_progress: AtomicUsize::new(0),
            clients: Default::default(),
        };
        admission.set_limits(limits);
        Arc::new(admission)
    }

    /// A request's head arrived from `client`: counted until the returned
    /// guard drops; `Err` with the cap when that address has
    /// `max_requests_per_client` in progress already.
    pub fn arrive(self: &Arc<Self>, client: Option<IpAddr>) -> Result<Arrival, usize> {
        let max = self.max_per_client.load(Relaxed);
        let client = client.filter(|_| max > 0).map(client_of);
        if let Some(ip) = client {
            let mut shard = self.shard(ip);
            let n = shard.entry(ip).or_insert(0);
            if *n >= max {
                return Err(max);
            }
            *n += 1;
        }
        self.in_progress.fetch_add(1, Relaxed);
        Ok(Arrival {
            admission: Arc::clone(self),
            client,
        })
    }

    fn shard(&self, ip: IpAddr) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        let hash = match ip {
            IpAddr::V4(v4) => u128::from(u32::from(v4)),
            IpAddr::V6(v6) => u128::from(v6),
        };
        let i = (xxhash_rust::xxh3::xxh3_64(&hash.to_le_bytes()) as usize) % CLIENT_SHARDS;
        self.clients[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests in progress, from their head to their end.
    pub fn in_progress(&self) -> usize {
        self.in_progress.load(Relaxed)
    }

    /// A ticket for one request's head and body bytes; it takes a slot when
    /// placed.
    pub fn receive(self: &Arc<Self>) -> Ticket {
        Ticket {
            admission: Arc::clone(self),
            bytes: 0,
            head: 0,
            slot: false,
        }
    }

    /// Every slot is taken now (takes none).
    pub fn full(&self) -> bool {
        self.requests.load(Relaxed) >= self.max_requests.load(Relaxed)
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

/// A request in progress (see [`Admission::arrive`]); uncounted on drop.
#[derive(Debug)]
pub struct Arrival {
    admission: Arc<Admission>,
    client: Option<IpAddr>,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.admission.in_progress.fetch_sub(1, Relaxed);
        if let Some(ip) = self.client {
            let mut shard = self.admission.shard(ip);
            if let Some(n) = shard.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    shard.remove(&ip);
                }
            }
        }
    }
}

/// The client an address stands for: itself, or for IPv6 its /64 (one host
/// holds a whole one).
pub fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        v4 => v4,
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

/// One request's head and body bytes and, once placed, its slot; released
/// on drop.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    bytes: usize,
    /// The head's bytes: held until the request ends.
    head: usize,
    slot: bool,
}

impl Ticket {
    /// Takes the request's slot (kept over retries); `false` at the cap.
    pub fn take_slot(&mut self) -> bool {
        if !self.slot {
            let max = self.admission.max_requests.load(Relaxed);
            self.slot = take(&self.admission.requests, 1, max);
        }
        self.slot
    }

    /// Holds the `n` bytes of the request's head until the request ends (a
    /// head outlives its body); `false` when the shared budget is spent.
    pub fn hold_head(&mut self, n: usize) -> bool {
        let max = self.admission.max_bytes.load(Relaxed);
        let ok = take(&self.admission.bytes, n, max);
        if ok {
            self.head += n;
        }
        ok
    }

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

    /// Gives the reserved bytes back (the request keeps any slot).
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
        self.admission.bytes.fetch_sub(self.head, Relaxed);
        if self.slot {
            self.admission.requests.fetch_sub(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_requests: usize, max_bytes: usize) -> Arc<Admission> {
        Admission::new(&config::Limits {
            max_requests,
            max_buffered_bytes: max_bytes,
            max_requests_per_client: 2,
            ..Default::default()
        })
    }

    #[test]
    fn a_client_address_has_at_most_its_share_in_progress() {
        let a = admission(10, 100);
        let (one, two) = (
            Some("10.0.0.1".parse().unwrap()),
            Some("10.0.0.2".parse().unwrap()),
        );
        let first = a.arrive(one).unwrap();
        let _second = a.arrive(one).unwrap();
        assert!(a.arrive(one).is_err());
        let _other = a.arrive(two).unwrap();
        let _unknown = a.arrive(None).unwrap();
        assert_eq!(a.in_progress(), 4);
        drop(first);
        assert!(a.arrive(one).is_ok());
        assert_eq!(a.in_progress(), 3);
        // One IPv6 /64 is one client.
        let v6 = |s: &str| Some(s.parse().unwrap());
        let _x = a.arrive(v6("2001:db8::1")).unwrap();
        let _y = a.arrive(v6("2001:db8::ffff:2")).unwrap();
        assert!(a.arrive(v6("2001:db8::3")).is_err());
        assert!(a.arrive(v6("2001:db8:0:1::3")).is_ok());
    }

    #[test]
    fn slots_past_the_cap_are_refused_until_one_ends() {
        let a = admission(2, 100);
        let mut t1 = a.receive();
        let _receiving = a.receive();
        assert!(t1.take_slot() && t1.take_slot(), "one slot, kept");
        assert!(a.receive().take_slot());
        assert_eq!(
            a.requests(),
            1,
            "the second slot was dropped with its ticket"
        );
        let mut t2 = a.receive();
        assert!(t2.take_slot() && a.full());
        assert!(!a.receive().take_slot());
        drop(t1);
        assert!(!a.full() && a.receive().take_slot());
    }

    #[test]
    fn body_bytes_share_one_budget_and_return_to_it() {
        let a = admission(10, 100);
        let mut t1 = a.receive();
        let mut t2 = a.receive();
        assert!(t2.take_slot());
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
        // A head is held until the ticket goes, whatever bytes are released.
        assert!(t2.hold_head(30) && !t2.hold_head(71));
        t2.release_bytes();
        assert_eq!(a.bytes(), 30);
        drop(t2);
        assert_eq!(a.bytes(), 0);
    }
}
