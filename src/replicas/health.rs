//! A replica's health as the active checks see it, in the style of
//! Kubernetes' probes and Envoy's health checker: down after
//! `unhealthy_threshold` failed checks in a row, up after
//! `healthy_threshold` passes in a row (a joining replica too). A check
//! that times out while the replica is completing prompts (a whole 2xx
//! answer lately) does not count: a `/health` late under a burst says less
//! than the answers do. An explicit failure always counts (an engine that
//! says it is unhealthy, or one being drained by its `/health`). A passing
//! check also ends an ejection whose time is up. Past the probes' budget
//! (`max_per_second`) a live replica is checked in its turn of every few
//! rounds ([`super::probes`]); one that is not live, or whose last check
//! failed, every round.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::{probes, Replica};
use crate::config;

/// The bound on one whole health check (connect, answer, model list).
pub const CHECK_DEADLINE: Duration = Duration::from_secs(3);

/// How check results become up and down (config `health_check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthRules {
    /// Counted failures in a row that take a replica down.
    pub fall: u32,
    /// Passes in a row that bring it up.
    pub rise: u32,
    /// A replica that answered a routed request this recently is serving.
    pub serving: Duration,
    /// The rounds' interval, and the checks a second at most (0: no cap).
    pub interval: Duration,
    pub per_second: u32,
}

impl HealthRules {
    /// Rounds between a live replica's checks in a fleet of `replicas`, and
    /// these rules with the serving window widened by two turns (the
    /// rounds a turn adds, twice: it spans two checks as before).
    pub fn spread(&self, replicas: usize) -> (u32, HealthRules) {
        let spread = probes::spread(replicas, self.interval, self.per_second);
        let rounds = spread.saturating_sub(1).saturating_mul(2);
        let more = self.interval.saturating_mul(rounds);
        let serving = self.serving.saturating_add(more);
        (spread, HealthRules { serving, ..*self })
    }
}

impl From<&config::HealthCheck> for HealthRules {
    fn from(h: &config::HealthCheck) -> Self {
        Self {
            fall: h.unhealthy_threshold.max(1),
            rise: h.healthy_threshold.max(1),
            // Two rounds and the slowest check: an answer since the round
            // before the one that failed.
            serving: config::ms(h.interval_ms).saturating_mul(2) + CHECK_DEADLINE,
            interval: config::ms(h.interval_ms),
            per_second: h.max_per_second,
        }
    }
}

impl Replica {
    /// Records a whole successful answer to a prompt at `now`.
    pub fn answered(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.joined).as_millis();
        let ms = u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1;
        // Skipped while the recorded answer is this recent (no store per answer).
        let last = self.answered_ms.load(Relaxed);
        if last == 0 || ms.saturating_sub(last) >= 10 {
            self.answered_ms.store(ms, Relaxed);
        }
    }

    /// It completed a prompt's answer within `window` before `now`.
    pub fn serving(&self, now: Instant, window: Duration) -> bool {
        let at = self.answered_ms.load(Relaxed);
        if at == 0 {
            return false;
        }
        let since = now.saturating_duration_since(self.joined).as_millis();
        u64::try_from(since).unwrap_or(u64::MAX)
            < (at - 1).saturating_add(window.as_millis() as u64)
    }

    /// Whether this health-check round checks it: every round while it is
    /// not live or its last check failed (so it goes down after its
    /// failures in a row, not after as many turns), else its turn of every
    /// `spread`.
    pub fn check_due(&self, spread: u32) -> bool {
        let round = self.check_rounds.fetch_add(1, Relaxed);
        !self.live()
            || self.checks_failed.load(Relaxed) > 0
            || probes::turn(self.name_hash, round, spread)
    }

    /// Whether the engine-load reader's `round` reads it, reading each
    /// replica once in `spread` rounds.
    pub fn read_due(&self, round: u32, spread: u32) -> bool {
        probes::turn(self.name_hash, round, spread)
    }

    /// The checks have brought it up at least once since it joined.
    pub fn was_up(&self) -> bool {
        self.up_once.load(Relaxed)
    }

    /// Records an active health check result at `now` under `rules`
    /// (`timed_out`: it failed by taking too long); returns whether liveness
    /// changed.
    pub fn on_check(
        &self,
        passed: bool,
        timed_out: bool,
        now: Instant,
        rules: &HealthRules,
    ) -> bool {
        let before = self.live();
        if passed {
            self.checks_failed.store(0, Relaxed);
            let n = self.checks_passed.fetch_add(1, Relaxed).saturating_add(1);
            if n >= rules.rise {
                self.checked.store(true, Relaxed);
                self.up_once.store(true, Relaxed);
                self.judged.store(true, Relaxed);
            }
            if self.is_ejected() {
                let e = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
                if e.1.is_none_or(|until| now >= until) {
                    self.ejected.store(false, Relaxed);
                }
            }
        } else {
            self.checks_passed.store(0, Relaxed);
            self.judged.store(true, Relaxed);
            if !(timed_out && self.serving(now, rules.serving)) {
                let n = self.checks_failed.fetch_add(1, Relaxed).saturating_add(1);
                if n >= rules.fall {
                    self.checked.store(false, Relaxed);
                }
            }
        }
        before != self.live()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::replicas::Replicas;
    use std::sync::Arc;

    const RULES: HealthRules = HealthRules {
        fall: 3,
        rise: 2,
        serving: Duration::from_secs(5),
        interval: Duration::from_secs(1),
        per_second: 0,
    };

    fn replica() -> Arc<Replica> {
        let c = config::Replica::at("a", "127.0.0.1:1");
        let set = Replicas::new(&[c], Metrics::standalone());
        Arc::clone(&set.snapshot()[0])
    }

    #[test]
    fn down_after_the_unhealthy_threshold_and_up_after_the_healthy_one() {
        let r = replica();
        let t = Instant::now();
        assert!(!r.on_check(true, false, t, &RULES), "one pass of two");
        assert!(!r.has_been_checked(), "not decided yet");
        assert!(r.on_check(true, false, t, &RULES) && r.live() && r.was_up());
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(!r.on_check(false, false, t, &RULES));
        // A pass in between starts the count again.
        assert!(!r.on_check(true, false, t, &RULES));
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(
            r.on_check(false, false, t, &RULES),
            "third failure in a row"
        );
        assert!(!r.live() && r.was_up());
        assert!(!r.on_check(true, false, t, &RULES));
        assert!(r.on_check(true, false, t, &RULES) && r.live());
    }

    #[test]
    fn late_checks_do_not_count_while_the_replica_completes_prompts() {
        let r = replica();
        let t = Instant::now();
        r.on_check(true, false, t, &RULES);
        r.on_check(true, false, t, &RULES);
        r.answered(t);
        for i in 1..=10 {
            assert!(!r.on_check(false, true, t + Duration::from_millis(400 * i), &RULES));
        }
        assert!(r.live(), "answering within the window");
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(
            r.on_check(false, false, t, &RULES),
            "an explicit failure counts"
        );
        r.on_check(true, false, t, &RULES);
        assert!(r.on_check(true, false, t, &RULES) && r.live());
        let later = t + RULES.serving + Duration::from_millis(1);
        r.on_check(false, true, later, &RULES);
        r.on_check(false, true, later, &RULES);
        assert!(r.on_check(false, true, later, &RULES) && !r.live());
    }

    #[test]
    fn a_joining_replica_is_not_up_before_it_passes() {
        let r = replica();
        let t = Instant::now();
        assert!(!r.on_check(false, false, t, &RULES));
        assert!(!r.live() && !r.was_up() && r.has_been_checked());
        // An answer does not bring it up: only checks do.
        r.answered(t);
        assert!(!r.on_check(true, false, t, &RULES) && !r.live());
    }

    #[test]
    fn past_the_budget_a_live_replica_is_checked_in_its_turn_and_a_down_one_every_round() {
        let rules = HealthRules {
            per_second: 100,
            ..RULES
        };
        let (spread, wide) = rules.spread(400);
        assert_eq!(spread, 4);
        assert_eq!(wide.serving, RULES.serving + Duration::from_secs(6));
        let r = replica();
        let checked = |r: &Replica| (0..8).filter(|_| r.check_due(spread)).count();
        assert_eq!(checked(&r), 8, "not up yet: every round");
        let t = Instant::now();
        r.on_check(true, false, t, &RULES);
        r.on_check(true, false, t, &RULES);
        assert_eq!(checked(&r), 2, "live: one round in four");
        r.on_check(false, false, t, &RULES);
        assert!(r.live(), "one failure of three");
        assert_eq!(checked(&r), 8, "its last check failed: every round");
    }
}
