//! The routing policy's parameters, read from the config (the policy crate
//! knows nothing of YAML; the config nothing of the policy).

use crate::config::{
    Config, ContinuationName, FleetMode, FleetSingles, KvRoomName, PolicyName, SinglesBy,
};
use crate::policy::{self, ContinuationRule, KvRoom, Mode, PolicyConfig};

/// The policy's parameters from the config.
pub fn policy_config(cfg: &Config) -> PolicyConfig {
    PolicyConfig {
        mode: match cfg.policy {
            PolicyName::Shape => Mode::Shape,
            PolicyName::Roundrobin => Mode::RoundRobin,
            PolicyName::Affinity => Mode::Affinity,
        },
        continuation: match cfg.continuation {
            ContinuationName::ModelTurn => ContinuationRule::ModelTurn,
            ContinuationName::MultiMessage => ContinuationRule::MultiMessage,
        },
        block_bytes: cfg.prefix_index.block_bytes,
        max_entries: cfg.prefix_index.max_entries,
        kv_room: match cfg.kv_room {
            KvRoomName::Off => KvRoom::Off,
            KvRoomName::Spread => KvRoom::Spread,
            KvRoomName::Pack => KvRoom::Pack,
        },
        load_guard: cfg.load_guard_in_flight,
        least_loaded: cfg.engine_load.is_some(),
        singles: (cfg.singles.by == SinglesBy::Prefix).then_some(policy::SinglesByPrefix {
            min_bytes: cfg.singles.min_prefix_bytes,
            min_percent: cfg.singles.min_prefix_percent,
            bound: cfg.singles.bound_queued,
            spread_while_all_fit: cfg.singles.spread_while_all_fit,
        }),
        queued_step: cfg.queued_prefill_step_bytes,
        fleet: match cfg.fleet.mode {
            FleetMode::Local | FleetMode::Redis => policy::Fleet::Local,
            FleetMode::Rendezvous => policy::Fleet::Rendezvous {
                singles: cfg.fleet.singles == FleetSingles::Root,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "replicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";

    #[test]
    fn least_loaded_placement_follows_engine_load() {
        let off = Config::parse(ONE, None).unwrap();
        assert!(!policy_config(&off).least_loaded);
        let on = Config::parse(&format!("engine_load: {{}}\n{ONE}"), None).unwrap();
        assert!(policy_config(&on).least_loaded);
    }

    #[test]
    fn the_environment_policy_reaches_the_policy() {
        let c = Config::parse(&format!("policy: shape\n{ONE}"), Some("affinity")).unwrap();
        assert_eq!(policy_config(&c).mode, Mode::Affinity);
    }
}
