//! The probes' budget (`health_check.max_per_second`,
//! `engine_load.max_per_second`): a fleet whose probes every interval would
//! pass it has each live replica probed once every `spread` rounds, the
//! replicas' turns staggered by a hash of their names so that each round
//! probes an even slice however they joined.
//! A thousand replicas checked every second cost the router about 0.04 of
//! a core in loopback TCP alone (docs/scale.md); the request path sees a
//! replica that stops answering at once either way (ejection on a refused
//! connection or repeated failures).
//!
//! And their pace: a round's probes start in small groups spread over
//! [`window`] (half the interval, at most a second), not all at once, so
//! that requests beside a round of hundreds of probes wait behind a group,
//! not the round (`docs/scale.md`, *Probes paced*).

use std::future::Future;
use std::time::Duration;

/// Rounds between a replica's probes, so that `replicas` probed every
/// `interval` make at most `per_second` probes a second (0: no budget).
pub fn spread(replicas: usize, interval: Duration, per_second: u32) -> u32 {
    if per_second == 0 {
        return 1;
    }
    let per_round = (f64::from(per_second) * interval.as_secs_f64()).max(f64::MIN_POSITIVE);
    (replicas as f64 / per_round)
        .ceil()
        .clamp(1.0, f64::from(u32::MAX)) as u32
}

/// Whether the replica whose phase (a hash of its name) is `phase` is
/// probed in its `round`-th round.
pub fn turn(phase: u64, round: u32, spread: u32) -> bool {
    phase
        .wrapping_add(u64::from(round))
        .is_multiple_of(u64::from(spread.max(1)))
}

/// Probes started together at most (while the window has room): a group
/// costs the requests beside it about as long as a few other requests.
pub const GROUP: usize = 8;

/// The longest a round's starts are spread over: a router holds its
/// listener until every replica has had its first check (at most 4 s), and
/// a replica added by a reload waits its round's turn.
pub const MAX_WINDOW: Duration = Duration::from_secs(1);

/// The span a round's probes start over, for rounds every `interval`: half
/// of it, at most [`MAX_WINDOW`].
pub fn window(interval: Duration) -> Duration {
    (interval / 2).min(MAX_WINDOW)
}

/// Groups start at least this far apart (fewer, larger groups beyond).
pub const MIN_GAP: Duration = Duration::from_millis(10);

/// How `due` probes of a round are started over `window`: groups of at
/// most `GROUP` (more when `window` has room for fewer than their number
/// `MIN_GAP` apart), the groups evenly apart. `(probes per group, gap)`;
/// a round of `GROUP` or fewer starts at once.
pub fn pace(due: usize, window: Duration) -> (usize, Duration) {
    let slots = (window.as_nanos() / MIN_GAP.as_nanos()).clamp(1, u128::from(u32::MAX)) as usize;
    let groups = due.div_ceil(GROUP).clamp(1, slots);
    let gap = window / u32::try_from(groups).unwrap_or(u32::MAX);
    (due.div_ceil(groups).max(1), gap)
}

/// Runs `probe` on each of `due`, started as [`pace`] says over `window`,
/// and returns when all have ended.
pub async fn run_paced<T, F, P>(due: Vec<T>, window: Duration, probe: P)
where
    P: Fn(T) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let (per_group, gap) = pace(due.len(), window);
    let start = tokio::time::Instant::now();
    let mut running = tokio::task::JoinSet::new();
    let mut due = due.into_iter().peekable();
    let mut group = 0u32;
    while due.peek().is_some() {
        if group > 0 {
            tokio::time::sleep_until(start + gap * group).await;
        }
        for item in due.by_ref().take(per_group) {
            running.spawn(probe(item));
        }
        group += 1;
    }
    while let Some(ended) = running.join_next().await {
        if let Some(e) = ended.err().filter(|e| e.is_panic()) {
            log::warn!("a probe's task panicked: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_fleet_within_the_budget_is_probed_every_round() {
        assert_eq!(spread(200, SECOND, 200), 1);
        assert_eq!(spread(1, Duration::from_millis(50), 20), 1);
        assert_eq!(spread(100_000, SECOND, 0), 1, "0: no budget");
    }

    #[test]
    fn past_the_budget_each_replica_waits_its_turn() {
        assert_eq!(spread(1_000, SECOND, 250), 4);
        assert_eq!(spread(1_000, SECOND, 200), 5);
        assert_eq!(spread(201, SECOND, 200), 2);
        // Reads every 500 ms: 250 a round.
        assert_eq!(spread(1_000, Duration::from_millis(500), 500), 4);
        // Less than one probe a round: five a second, a round every 100 ms.
        assert_eq!(spread(5, Duration::from_millis(100), 5), 10);
        assert_eq!(spread(5, Duration::ZERO, 5), u32::MAX);
    }

    #[test]
    fn a_round_starts_over_half_its_interval_and_at_most_a_second() {
        assert_eq!(
            window(Duration::from_millis(500)),
            Duration::from_millis(250)
        );
        assert_eq!(window(Duration::from_secs(2)), MAX_WINDOW);
        assert_eq!(window(Duration::from_secs(60)), MAX_WINDOW);
    }

    #[test]
    fn a_small_round_starts_at_once_and_a_large_one_in_groups_over_the_window() {
        let half = Duration::from_millis(500);
        assert_eq!(pace(0, half), (1, half));
        assert_eq!(pace(2, half), (2, half));
        assert_eq!(pace(GROUP, half), (GROUP, half));
        // 250 checks: 32 groups of 8, about 16 ms apart.
        assert_eq!(pace(250, half), (8, half / 32));
        // No room for 10 ms gaps: fewer, larger groups.
        assert_eq!(pace(1_000, half), (20, MIN_GAP));
        assert_eq!(
            pace(1_000, Duration::from_millis(5)),
            (1_000, Duration::from_millis(5))
        );
        assert_eq!(pace(1_000, Duration::ZERO), (1_000, Duration::ZERO));
    }

    #[tokio::test]
    async fn a_paced_round_starts_its_groups_apart_and_waits_for_every_probe() {
        use std::sync::{Arc, Mutex};
        let (started, ended) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(0)));
        let t0 = tokio::time::Instant::now();
        let window = Duration::from_millis(120);
        let (log, done) = (Arc::clone(&started), Arc::clone(&ended));
        run_paced((0..4 * GROUP).collect(), window, move |i: usize| {
            let (log, done) = (Arc::clone(&log), Arc::clone(&done));
            async move {
                log.lock().unwrap().push((i, t0.elapsed()));
                tokio::time::sleep(Duration::from_millis(20)).await;
                *done.lock().unwrap() += 1;
            }
        })
        .await;
        assert_eq!(
            *ended.lock().unwrap(),
            4 * GROUP,
            "the round waits for every probe"
        );
        let started = started.lock().unwrap();
        assert_eq!(started.len(), 4 * GROUP);
        for &(i, at) in started.iter() {
            let group = u32::try_from(i / GROUP).unwrap();
            assert!(
                at >= window / 4 * group,
                "probe {i} of group {group} started at {at:?}"
            );
        }
    }

    #[test]
    fn every_round_probes_an_even_slice_and_every_replica_its_turn() {
        let (replicas, spread) = (1_000u64, 5);
        let phase = |i: u64| xxhash_rust::xxh3::xxh3_64(format!("gpu{i}").as_bytes());
        for round in 0..spread {
            let probed = (0..replicas)
                .filter(|&i| turn(phase(i), round, spread))
                .count();
            assert!((150..=250).contains(&probed), "round {round}: {probed}");
        }
        for i in 0..replicas {
            let turns = (0..spread)
                .filter(|&round| turn(phase(i), round, spread))
                .count();
            assert_eq!(turns, 1, "replica {i}");
        }
    }
}
