//! Unit tests of [`Replica`](super::Replica).

use super::*;
use crate::metrics::Metrics;
use crate::policy::Room;
use crate::replicas::tests::cfg;
use crate::replicas::Replicas;

#[test]
fn kv_room_is_capacity_less_the_pinned_set_and_the_singles_in_flight() {
    let mut c = cfg(&[("a", "127.0.0.1:1"), ("b", "127.0.0.1:2")]);
    c[0].kv_tokens = Some(1_000);
    let set = Replicas::new(&c, Metrics::standalone());
    let (a, b) = (
        Arc::clone(&set.snapshot()[0]),
        Arc::clone(&set.snapshot()[1]),
    );
    assert_eq!(b.state().room, None, "no kv_tokens, no known room");
    a.set_pinned_bytes(1_500);
    let single = a.begin(500, 0);
    let other = a.begin(0, 0);
    assert_eq!(
        a.state().room,
        Some(Room {
            free: 4_000 - 1_500 - 500,
            cold: 500,
            pinned: 1_500,
            capacity: 4_000,
        })
    );
    drop(single);
    drop(other);
    assert_eq!(a.state().room.map(|r| (r.free, r.cold)), Some((2_500, 0)));
    assert_eq!(a.in_flight(), 0);
}

#[test]
fn an_engine_keeping_its_last_prompt_has_room_only_once_a_single_displaced_its_context() {
    let mut c = cfg(&[("a", "127.0.0.1:1")]);
    c[0].kv_tokens = Some(1_000);
    c[0].prompt_cache = PromptCache::Last;
    let set = Replicas::new(&c, Metrics::standalone());
    let a = Arc::clone(&set.snapshot()[0]);
    let free = || a.state().room.map(|r| r.free);
    assert_eq!(free(), Some(4_000), "nothing pinned: the whole cache");
    a.set_pinned_bytes(1_500);
    assert_eq!(free(), Some(0), "any prompt would displace the context");
    let single = a.begin(500, 0);
    assert_eq!(
        free(),
        Some(3_500),
        "displaced already: room beside the single"
    );
    drop(single);
    c[0].prompt_cache = PromptCache::Shared;
    set.apply(&c);
    assert_eq!(free(), Some(2_500), "reloaded: prefixes share the KV again");
}

#[test]
fn the_kv_an_engine_reports_in_use_bounds_the_room() {
    let mut c = cfg(&[("a", "127.0.0.1:1")]);
    c[0].kv_tokens = Some(1_000);
    let set = Replicas::new(&c, Metrics::standalone());
    let a = Arc::clone(&set.snapshot()[0]);
    a.set_pinned_bytes(1_000);
    let engine = |unseen, kv_used_permille| {
        Some(EngineLoad {
            unseen,
            kv_used_permille,
        })
    };
    a.set_engine(engine(8, Some(900)));
    let s = a.state();
    assert_eq!(s.room.map(|r| r.free), Some(400), "the engine's 10 % free");
    assert_eq!((s.in_flight, s.load()), (0, 8));
    a.set_engine(engine(0, Some(100)));
    assert_eq!(
        a.state().room.map(|r| r.free),
        Some(3_000),
        "the router's own estimate"
    );
    a.set_engine(engine(3, None));
    assert_eq!(a.state().room.map(|r| r.free), Some(3_000));
    a.set_engine(None);
    assert_eq!(a.state().engine, None);
}

#[test]
fn prompt_queued_for_prefill_counts_until_the_first_byte_and_once() {
    let set = Replicas::new(&cfg(&[("a", "127.0.0.1:1")]), Metrics::standalone());
    let a = Arc::clone(&set.snapshot()[0]);
    let mut first = a.begin(0, 4_000);
    let second = a.begin(0, 1_000);
    assert_eq!((a.state().queued_bytes, a.state().waiting), (5_000, 2));
    first.answered();
    assert_eq!((a.state().queued_bytes, a.state().waiting), (1_000, 1));
    drop(first);
    assert_eq!(a.state().queued_bytes, 1_000, "answered already: not again");
    drop(second);
    assert_eq!((a.state().queued_bytes, a.state().waiting), (0, 0));
}
