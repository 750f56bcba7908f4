//! Several router instances in front of the same replicas (`fleet:`), as
//! separate processes: every turn of a conversation goes to whichever
//! instance, as behind an L4 balancer.

mod common;

use common::{conversation, Router, Sim};

#[test]
fn instances_in_rendezvous_mode_send_every_turn_of_a_conversation_to_one_replica_across_restarts() {
    let sims: Vec<Sim> = ["a", "b", "c"]
        .iter()
        .map(|name| Sim::start(name, &[]))
        .collect();
    let sims: Vec<&Sim> = sims.iter().collect();
    let fleet = "fleet: {mode: rendezvous}\n";
    // The second instance lists the replicas in another order.
    let reversed: Vec<&Sim> = sims.iter().rev().copied().collect();
    let mut routers = [Router::start(&sims, fleet), Router::start(&reversed, fleet)];
    let turn = |router: &Router, topic: &str, turn: usize| {
        let r = router.post("/v1/chat/completions", &conversation(topic, turn));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.decision(), "hash");
        r.replica().to_owned()
    };
    let mut homes = Vec::new();
    for c in 0..12 {
        let topic = format!("conversation {c}");
        let home = turn(&routers[c % 2], &topic, 1);
        for t in 2..5 {
            assert_eq!(
                turn(&routers[(c + t) % 2], &topic, t),
                home,
                "{topic}, turn {t}"
            );
        }
        homes.push(home);
    }
    let distinct: std::collections::HashSet<&String> = homes.iter().collect();
    assert!(distinct.len() > 1, "conversations spread: {homes:?}");
    // An instance restarted (its index empty) sends the next turns home too.
    routers[1] = Router::start(&reversed, fleet);
    for (c, home) in homes.iter().enumerate() {
        let topic = format!("conversation {c}");
        assert_eq!(
            &turn(&routers[1], &topic, 5),
            home,
            "{topic} after a restart"
        );
    }
}

#[test]
fn replicas_by_host_name_and_by_dns_serve_and_a_name_that_does_not_resolve_is_left_out() {
    let (a, b) = (Sim::start("a", &[]), Sim::start("b", &[]));
    let yaml = format!(
        "replicas:\n  - {{name: a, addr: \"localhost:{}\"}}\n  - {{name: lost, addr: \"no-such-replica.invalid:8000\"}}\n\
         replicas_dns:\n  - {{name: pool, addr: \"localhost:{}\"}}\n",
        a.addr.port(),
        b.addr.port()
    );
    let router = Router::spawn(&yaml, &[]);
    router.wait_replica_up("a", true);
    let pool = format!("pool-127.0.0.1-{}", b.addr.port());
    router.wait_replica_up(&pool, true);
    let mut seen = std::collections::HashSet::new();
    for i in 0..4 {
        let r = router.post(
            "/v1/chat/completions",
            &common::single(&format!("question {i}")),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        seen.insert(r.replica().to_owned());
    }
    assert!(seen.contains("a") && seen.contains(&pool), "{seen:?}");
    assert!(
        router
            .log()
            .contains("no-such-replica.invalid:8000: lookup failed"),
        "{}",
        router.log()
    );
}
