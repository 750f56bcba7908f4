//! Fair admission to the replicas' in-flight places (`shed_in_flight` on
//! each live replica): a routed request takes a place at once when one is
//! free, nobody waits ahead, and its tenant holds less than its share; else
//! it waits in a bounded queue.
//!
//! - **Shares** are max-min fair by weight over the tenants active within
//!   `window` (holding places, waiting, or having held some lately): a
//!   tenant that wants little (an agent between turns) keeps what it used,
//!   the rest goes to the others by weight. A flood is held to what the
//!   others leave, so they find a free place when they come back, and it
//!   has every place when it is alone (nothing is kept idle for nobody).
//! - **Turns**: `priority` before `standard`; within a class tenants take
//!   turns by weight (deficit round-robin: a turn lets `weight` requests
//!   through), a tenant at its share passed over.
//! - **Bounds**: a full queue pushes out the newest waiter of the tenant
//!   with the most waiting when it has at least two more than the
//!   newcomer's own (a flood cannot lock others out), or of a lower class;
//!   else the newcomer is turned away. A waiter past its deadline gives up.
//!
//! A request let through holds a [`Pass`] until it ends: counted against
//! its tenant's share, and against the free places until it is placed (so
//! one place is not given twice: the places are counted under the queue's
//! lock, after the passes not yet placed). Fairness decides when; the
//! policy still decides where. Time and places are passed in.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::Class;

/// Why a waiter did not get through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turned {
    /// The queue is full (its place went to another tenant's request).
    Full,
    /// Its deadline passed.
    Deadline,
}

enum Verdict {
    Go(Pass),
    PushedOut,
}

type Sender = oneshot::Sender<Verdict>;

/// The places now: free ones (bound minus load, over live replicas) and
/// all of them.
#[derive(Debug, Clone, Copy)]
pub struct Places {
    pub free: usize,
    pub total: usize,
}

/// A tenant's requests waiting in one class.
#[derive(Default)]
struct Line {
    /// Requests its current turn may still let through.
    deficit: u32,
    waiters: VecDeque<Sender>,
    /// In its class's turns.
    in_turn: bool,
}

impl Line {
    /// Drops the senders of waiters that gave up; how many.
    fn purge(&mut self) -> usize {
        let before = self.waiters.len();
        self.waiters.retain(|w| !w.is_closed());
        before - self.waiters.len()
    }
}

/// One tenant's use of the places.
struct Share {
    held: usize,
    /// The most it held lately, and when it last held that many.
    peak: usize,
    peak_at: Instant,
    weight: u32,
    /// `priority`, `standard`.
    lines: [Line; 2],
}

impl Share {
    fn waiting(&self) -> usize {
        self.lines.iter().map(|l| l.waiters.len()).sum()
    }

    /// Places it wants: what it holds and waits for, or held lately.
    fn demand(&self, now: Instant, window: Duration) -> usize {
        let lately = if now.saturating_duration_since(self.peak_at) <= window {
            self.peak
        } else {
            0
        };
        lately.max(self.held + self.waiting())
    }

    /// Takes a place; the peak kept is the most held within `window`.
    fn hold(&mut self, now: Instant, window: Duration) {
        self.held += 1;
        if self.held >= self.peak || now.saturating_duration_since(self.peak_at) > window {
            self.peak = self.held;
            self.peak_at = now;
        }
    }
}

struct Inner {
    shares: HashMap<Arc<str>, Share>,
    /// Tenants with waiters, per class, in turn order: the front one is
    /// being served.
    turns: [VecDeque<Arc<str>>; 2],
    /// Senders held, including those whose waiter gave up.
    entries: usize,
    /// Inactive tenants are let go when this many are held.
    prune_at: usize,
}

fn lane(class: Class) -> usize {
    match class {
        Class::Priority => 0,
        Class::Standard => 1,
    }
}

/// Max-min fair shares of `total` places by weight, over `(name, demand,
/// weight)`: water-filled, then rounded so they add up to what was given
/// (largest remainders first); every tenant at least one place.
fn allocate(total: usize, mut wants: Vec<(Arc<str>, usize, u32)>) -> HashMap<Arc<str>, usize> {
    wants.sort_by(|a, b| {
        let (x, y) = (a.1 as f64 / a.2 as f64, b.1 as f64 / b.2 as f64);
        x.total_cmp(&y)
    });
    let mut left = total as f64;
    let mut weights: f64 = wants.iter().map(|w| f64::from(w.2)).sum();
    let mut given = Vec::with_capacity(wants.len());
    for (name, demand, weight) in wants {
        let fair = left * f64::from(weight) / weights.max(1.0);
        let g = (demand as f64).min(fair);
        left -= g;
        weights -= f64::from(weight);
        given.push((name, g));
    }
    let whole: f64 = given.iter().map(|(_, g)| g.floor()).sum();
    let sum: f64 = given.iter().map(|(_, g)| g).sum();
    let mut extra = (sum.round() - whole).max(0.0) as usize;
    let mut by_remainder: Vec<usize> = (0..given.len()).collect();
    by_remainder.sort_by(|&a, &b| {
        let r = |i: usize| given[i].1 - given[i].1.floor();
        r(b).total_cmp(&r(a))
    });
    let mut out: HashMap<Arc<str>, usize> = given
        .iter()
        .map(|(n, g)| (Arc::clone(n), g.floor() as usize))
        .collect();
    for i in by_remainder {
        if extra == 0 {
            break;
        }
        if let Some(v) = out.get_mut(&given[i].0) {
            *v += 1;
            extra -= 1;
        }
    }
    out.values_mut().for_each(|v| *v = (*v).max(1));
    out
}

/// The queue.
pub struct Queue {
    inner: Mutex<Inner>,
    /// Waiters waiting now.
    waiting: AtomicUsize,
    /// Passes not yet placed.
    unplaced: AtomicUsize,
    /// When a waiter last looked for room (ms since `epoch`): one look
    /// serves all waiting.
    looked: AtomicU64,
    epoch: Instant,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("waiting", &self.waiting())
            .finish()
    }
}

impl Default for Queue {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                shares: HashMap::new(),
                turns: Default::default(),
                entries: 0,
                prune_at: 64,
            }),
            waiting: AtomicUsize::new(0),
            unplaced: AtomicUsize::new(0),
            looked: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// What a request gets when it asks for a place.
pub enum Entry {
    Pass(Pass),
    Wait(Waiter),
}

/// The rules of one decision.
#[derive(Debug, Clone, Copy)]
pub struct Terms {
    pub max_waiting: usize,
    pub window: Duration,
    pub now: Instant,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Relaxed)
    }

    /// Free places under the lock: the passes not yet placed are read
    /// before the replicas' loads (a pass placed in between is counted
    /// twice, never missed).
    fn free(&self, places: &impl Fn() -> Places) -> Places {
        let unplaced = self.unplaced.load(Relaxed);
        let p = places();
        Places {
            free: p.free.saturating_sub(unplaced),
            total: p.total,
        }
    }

    /// A request of `tenant` asks for a place: a pass at once when a place
    /// is free, nobody waits, and its share allows; else in line. At
    /// `max_waiting`, the newest waiter of the tenant with the most waiting
    /// is pushed out for it when that tenant has at least two more waiting
    /// than this one (or waits in a lower class); else this one is turned
    /// away.
    pub fn enter(
        self: &Arc<Self>,
        tenant: &Arc<str>,
        class: Class,
        weight: u32,
        places: impl Fn() -> Places,
        terms: Terms,
    ) -> Result<Entry, Turned> {
        let mut inner = self.lock();
        if inner.shares.len() >= inner.prune_at {
            prune(&mut inner, terms);
        }
        let share = inner
            .shares
            .entry(Arc::clone(tenant))
            .or_insert_with(|| Share {
                held: 0,
                peak: 0,
                peak_at: terms.now,
                weight,
                lines: Default::default(),
            });
        share.weight = weight.max(1);
        let held = share.held;
        if self.waiting() == 0 {
            let p = self.free(&places);
            let within = p.free > 0
                && (held == 0 || {
                    let shares = self.shares_of(&inner, p.total, terms, Some(tenant));
                    held < shares.get(tenant).copied().unwrap_or(1)
                });
            if within {
                return Ok(Entry::Pass(self.pass(&mut inner, tenant, terms)));
            }
        }
        if self.waiting() >= terms.max_waiting {
            self.push_out(&mut inner, tenant, class)?;
        }
        if inner.entries > terms.max_waiting.saturating_mul(2).saturating_add(16) {
            let mut dropped = 0;
            for s in inner.shares.values_mut() {
                dropped += s.lines.iter_mut().map(Line::purge).sum::<usize>();
            }
            inner.entries -= dropped;
        }
        let (tx, rx) = oneshot::channel();
        let Some(share) = inner.shares.get_mut(tenant) else {
            return Err(Turned::Full);
        };
        let line = &mut share.lines[lane(class)];
        line.waiters.push_back(tx);
        let newly = !std::mem::replace(&mut line.in_turn, true);
        if newly {
            inner.turns[lane(class)].push_back(Arc::clone(tenant));
        }
        inner.entries += 1;
        self.waiting.fetch_add(1, Relaxed);
        drop(inner);
        self.dispatch(places, terms);
        Ok(Entry::Wait(Waiter {
            queue: Arc::clone(self),
            rx,
        }))
    }

    /// Every active tenant's share of `total` places now (`asking`: a
    /// tenant wanting one more).
    fn shares_of(
        &self,
        inner: &Inner,
        total: usize,
        terms: Terms,
        asking: Option<&Arc<str>>,
    ) -> HashMap<Arc<str>, usize> {
        let wants = (inner.shares.iter())
            .map(|(n, s)| {
                let more = usize::from(asking.is_some_and(|a| a == n));
                let demand = s.demand(terms.now, terms.window).max(s.held + more);
                (Arc::clone(n), demand, s.weight)
            })
            .filter(|w| w.1 > 0)
            .collect();
        allocate(total, wants)
    }

    fn pass(self: &Arc<Self>, inner: &mut Inner, tenant: &Arc<str>, terms: Terms) -> Pass {
        if let Some(s) = inner.shares.get_mut(tenant) {
            s.hold(terms.now, terms.window);
        }
        self.unplaced.fetch_add(1, Relaxed);
        Pass {
            queue: Arc::clone(self),
            tenant: Arc::clone(tenant),
            unplaced: true,
        }
    }

    fn push_out(&self, inner: &mut Inner, tenant: &Arc<str>, class: Class) -> Result<(), Turned> {
        // Live waiters only: those that gave up are dropped first.
        let mut dropped = 0;
        for s in inner.shares.values_mut() {
            dropped += s.lines.iter_mut().map(Line::purge).sum::<usize>();
        }
        inner.entries -= dropped;
        let waiting = |inner: &Inner, name: &Arc<str>, i: usize| {
            inner
                .shares
                .get(name)
                .map_or(0, |s| s.lines[i].waiters.len())
        };
        let own = waiting(inner, tenant, lane(class));
        let victim = (lane(class)..2)
            .flat_map(|i| inner.turns[i].iter().map(move |n| (i, n)))
            .map(|(i, n)| (i, n, waiting(inner, n, i)))
            .filter(|(i, _, n)| *n > 0 && (*i > lane(class) || *n > own + 1))
            .max_by_key(|(i, _, n)| (*i, *n))
            .map(|(i, n, _)| (i, Arc::clone(n)))
            .ok_or(Turned::Full)?;
        let pushed =
            (inner.shares.get_mut(&victim.1)).and_then(|s| s.lines[victim.0].waiters.pop_back());
        if let Some(w) = pushed {
            inner.entries -= 1;
            // Its waiter stops waiting when it reads this.
            let _ = w.send(Verdict::PushedOut);
        }
        Ok(())
    }

    /// Lets waiters through into the free places, by class and turn, each
    /// within its tenant's share.
    pub fn dispatch(self: &Arc<Self>, places: impl Fn() -> Places, terms: Terms) {
        if self.waiting() == 0 {
            return;
        }
        // Passes a waiter gone meanwhile hands back: dropped after the lock.
        let mut returned = Vec::new();
        let mut inner = self.lock();
        let p = self.free(&places);
        let mut free = p.free;
        if free > 0 {
            let shares = self.shares_of(&inner, p.total, terms, None);
            while free > 0 {
                let Some((tenant, w)) = next(&mut inner, &shares) else {
                    break;
                };
                let pass = self.pass(&mut inner, &tenant, terms);
                match w.send(Verdict::Go(pass)) {
                    Ok(()) => free -= 1,
                    Err(verdict) => returned.push(verdict),
                }
            }
        }
        if inner.shares.len() >= inner.prune_at {
            prune(&mut inner, terms);
        }
        drop(inner);
        drop(returned);
    }

    /// Whether a waiter should look for room now: not when another did
    /// within a fifth of [`LOOK_EVERY`].
    fn time_to_look(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.looked.load(Relaxed);
        let gap = LOOK_EVERY.as_millis() as u64 / 5;
        now >= last + gap
            && self
                .looked
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }
}

/// The next waiter by class and turn whose tenant is within its share,
/// skipping waiters that gave up.
fn next(inner: &mut Inner, shares: &HashMap<Arc<str>, usize>) -> Option<(Arc<str>, Sender)> {
    let Inner {
        shares: all,
        turns,
        entries,
        ..
    } = inner;
    for (i, turn) in turns.iter_mut().enumerate() {
        // Each tenant in line is looked at once per pass over the class.
        let mut looked = 0;
        while looked < turn.len() {
            let Some(name) = turn.front().cloned() else {
                break;
            };
            let Some(s) = all.get_mut(&name) else {
                turn.pop_front();
                continue;
            };
            let at_share = s.held >= shares.get(&name).copied().unwrap_or(1);
            let line = &mut s.lines[i];
            while line.waiters.front().is_some_and(Sender::is_closed) {
                line.waiters.pop_front();
                *entries -= 1;
            }
            if line.waiters.is_empty() || !line.in_turn {
                (line.deficit, line.in_turn) = (0, false);
                turn.pop_front();
                continue;
            }
            if at_share {
                line.deficit = 0;
                turn.rotate_left(1);
                looked += 1;
                continue;
            }
            if line.deficit == 0 {
                line.deficit = s.weight;
            }
            line.deficit -= 1;
            let w = line.waiters.pop_front()?;
            *entries -= 1;
            if line.waiters.is_empty() {
                (line.deficit, line.in_turn) = (0, false);
                turn.pop_front();
            } else if line.deficit == 0 {
                turn.rotate_left(1);
            }
            return Some((name, w));
        }
    }
    None
}

/// Lets go of tenants no longer active (their shares are then as new), and
/// of names in the turns whose tenant has no waiters there.
fn prune(inner: &mut Inner, terms: Terms) {
    inner.shares.retain(|_, s| {
        s.held > 0
            || s.waiting() > 0
            || terms.now.saturating_duration_since(s.peak_at) <= terms.window
    });
    let Inner { shares, turns, .. } = inner;
    for (i, turn) in turns.iter_mut().enumerate() {
        let mut seen = HashSet::new();
        turn.retain(|n| {
            shares.get(n).is_some_and(|s| s.lines[i].in_turn) && seen.insert(Arc::clone(n))
        });
    }
    inner.prune_at = 2 * inner.shares.len() + 64;
}

/// A request in line.
pub struct Waiter {
    queue: Arc<Queue>,
    rx: oneshot::Receiver<Verdict>,
}

/// How often a waiter looks for room itself (room that opens without a
/// request ending: a replica back, an engine's own queue draining).
const LOOK_EVERY: Duration = Duration::from_millis(50);

impl Waiter {
    /// Waits for its turn until `deadline`, calling `look` now and then to
    /// let waiters through when room opened by other means.
    pub async fn wait(mut self, deadline: Instant, look: impl Fn()) -> Result<Pass, Turned> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // A pass given at the last moment is taken, not lost.
                return match self.rx.try_recv() {
                    Ok(Verdict::Go(pass)) => Ok(pass),
                    _ => Err(Turned::Deadline),
                };
            }
            match tokio::time::timeout(left.min(LOOK_EVERY), &mut self.rx).await {
                Ok(Ok(Verdict::Go(pass))) => return Ok(pass),
                Ok(Ok(Verdict::PushedOut) | Err(_)) => return Err(Turned::Full),
                Err(_) if self.queue.time_to_look() => look(),
                Err(_) => {}
            }
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.queue.waiting.fetch_sub(1, Relaxed);
    }
}

/// A request let through: holds a place of its tenant's share until it
/// drops, and one of the free places until it is placed.
pub struct Pass {
    queue: Arc<Queue>,
    tenant: Arc<str>,
    unplaced: bool,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Pass")
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl Pass {
    /// Placed: the replica's own count holds its place now.
    pub fn placed(&mut self) {
        if std::mem::take(&mut self.unplaced) {
            self.queue.unplaced.fetch_sub(1, Relaxed);
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.placed();
        if let Some(s) = self.queue.lock().shares.get_mut(&self.tenant) {
            // Recent use is timed from its end: a tenant that held this
            // many until now keeps them in its share for the window.
            if s.held >= s.peak {
                s.peak_at = Instant::now();
            }
            s.held = s.held.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests;
