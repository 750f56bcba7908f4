//! The probes' budget (`health_check.max_per_second`,
//! `engine_load.max_per_second`): a fleet whose probes every interval would
//! pass it has each live replica probed once every `spread` rounds, the
//! replicas' turns staggered by a hash of their names so that each round
//! probes an even slice however they joined.
//! A thousand replicas checked every second cost the router about 0.04 of
//! a core in loopback TCP alone (docs/scale.md); the request path sees a
//! replica that stops answering at once either way (ejection on a refused
//! connection or repeated failures).

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
