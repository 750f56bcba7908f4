//! A per-minute limit as a bucket refilled continuously: full at its limit,
//! a minute to refill from empty. A token charge may take it below zero (a
//! request larger than what is left, or the engine reporting more tokens
//! than estimated); the debt is paid back by refilling. Time is passed in.

use std::time::{Duration, Instant};

use crate::errors::Rate;

/// What is left of one limit, as of `at`.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    level: f64,
    at: Instant,
    /// The limit it was last refilled for (0: none).
    limit: u64,
}

const MINUTE: f64 = 60.0;

impl Bucket {
    /// A full bucket.
    pub fn full(limit: u64, now: Instant) -> Self {
        Self {
            level: limit as f64,
            at: now,
            limit,
        }
    }

    /// Refills for the time since the last look (never past `limit`: a
    /// lowered limit takes effect at once; a raised one, or one set anew,
    /// adds what it raised).
    pub fn refill(&mut self, limit: u64, now: Instant) {
        if limit > self.limit {
            self.level += (limit - self.limit) as f64;
        }
        self.limit = limit;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * limit as f64 / MINUTE).min(limit as f64);
        self.at = now;
    }

    /// Takes `n` when at least `n` is left, or when the bucket is full (a
    /// request larger than the whole limit is let through alone, into
    /// debt); else how long until `n` is (capped at what a full bucket has).
    pub fn take(&mut self, limit: u64, n: u64) -> Result<(), Duration> {
        let full = self.level >= limit as f64;
        if self.level >= n as f64 || full {
            self.level -= n as f64;
            Ok(())
        } else {
            Err(self.wait_for(limit, n.min(limit)))
        }
    }

    /// Whether anything is left (a debt refuses every request until paid).
    pub fn positive(&self) -> bool {
        self.level > 0.0
    }

    /// Gives back `n` (a refused request's charge, an overestimate).
    pub fn give(&mut self, limit: u64, n: u64) {
        self.level = (self.level + n as f64).min(limit as f64);
    }

    /// Charges `n` more, into debt if need be (a correction).
    pub fn charge(&mut self, n: u64) {
        self.level -= n as f64;
    }

    /// How long until `n` is left.
    pub fn wait_for(&self, limit: u64, n: u64) -> Duration {
        if limit == 0 || self.level >= n as f64 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((n as f64 - self.level) * MINUTE / limit as f64)
    }

    pub fn is_full(&self, limit: u64) -> bool {
        self.level >= limit as f64
    }

    /// The limit's headers: what is left (whole units) and when it is full.
    pub fn rate(&self, limit: u64) -> Rate {
        Rate {
            limit,
            remaining: self.level.max(0.0) as u64,
            reset_ms: self.wait_for(limit, limit).as_millis() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_in_a_minute_and_says_how_long_to_wait() {
        let t0 = Instant::now();
        let mut b = Bucket::full(60, t0);
        for _ in 0..60 {
            b.take(60, 1).unwrap();
        }
        assert_eq!(b.take(60, 1), Err(Duration::from_secs(1)));
        assert_eq!(b.rate(60).reset_ms, 60_000);
        b.refill(60, t0 + Duration::from_millis(2500));
        assert_eq!(b.rate(60).remaining, 2);
        b.refill(60, t0 + Duration::from_secs(600));
        assert!(b.is_full(60), "never past its limit");
    }

    #[test]
    fn a_charge_larger_than_the_limit_passes_only_when_full_and_leaves_a_debt() {
        let t0 = Instant::now();
        let mut b = Bucket::full(1000, t0);
        b.take(1000, 5000).unwrap();
        assert!(!b.positive());
        assert_eq!(b.rate(1000).remaining, 0);
        // The debt (4000) and the limit refill in five minutes.
        assert_eq!(b.rate(1000).reset_ms, 300_000);
        assert_eq!(b.take(1000, 5000), Err(Duration::from_secs(300)));
        b.give(1000, 4500);
        assert_eq!(b.rate(1000).remaining, 500);
    }

    #[test]
    fn a_lowered_limit_takes_effect_at_once_and_a_raised_one_adds_the_difference() {
        let t0 = Instant::now();
        let mut b = Bucket::full(100, t0);
        b.refill(10, t0);
        assert_eq!(b.rate(10).remaining, 10);
        b.take(10, 5).unwrap();
        b.refill(60, t0);
        assert_eq!(b.rate(60).remaining, 55);
        // A limit set where there was none starts full.
        let mut none = Bucket::full(0, t0);
        none.refill(0, t0 + Duration::from_secs(5));
        none.refill(600, t0 + Duration::from_secs(5));
        assert!(none.is_full(600));
    }
}
