//! Several router instances in front of the same replicas (`fleet:`), as
//! separate processes: every turn of a conversation goes to whichever
//! instance, as behind an L4 balancer.

mod common;

use std::time::Duration;

use common::http::request;
use common::{conversation, get, wait_for, Router, Sim};
use serde_json::json;

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

/// A Redis on a free port and the `fleet:` block sharing pins in its database `db`.
fn redis_fleet(db: u32) -> (common::RedisServer, String) {
    let port = common::free_addr().port();
    let fleet = format!(
        "fleet: {{mode: redis, redis_url: \"redis://127.0.0.1:{port}/{db}\", redis_budget_ms: 200}}\n"
    );
    (common::RedisServer::start(port), fleet)
}

/// `prefix_router_shared_pins_total{op, result}` of a router.
fn shared(router: &Router, op: &str, result: &str) -> f64 {
    router.metric(&format!(
        "prefix_router_shared_pins_total{{op=\"{op}\",result=\"{result}\"}}"
    ))
}

#[test]
fn instances_sharing_pins_through_redis_keep_conversations_across_instances_restarts_and_outages() {
    let sims: Vec<Sim> = ["a", "b"].iter().map(|n| Sim::start(n, &[])).collect();
    let sims: Vec<&Sim> = sims.iter().collect();
    let reversed: Vec<&Sim> = sims.iter().rev().copied().collect();
    let (mut redis, fleet) = redis_fleet(3);
    let mut routers = [
        Router::start(&sims, &fleet),
        Router::start(&reversed, &fleet),
    ];
    let send = |router: &Router, topic: &str, turn: usize| {
        let r = router.post("/v1/chat/completions", &conversation(topic, turn));
        assert_eq!(r.status, 200, "{}", r.text());
        (r.replica().to_owned(), r.decision().to_owned())
    };
    // Each turn on the other instance than the turn before: the pin comes
    // from what the other one wrote.
    let conversations = |routers: &[Router; 2], tag: &str| -> Vec<String> {
        (0..6)
            .map(|c| {
                let topic = format!("{tag} {c}");
                let written = shared(&routers[0], "write", "ok");
                let (home, _) = send(&routers[0], &topic, 1);
                wait_for("the placement written", Duration::from_secs(5), || {
                    (shared(&routers[0], "write", "ok") > written).then_some(())
                });
                for turn in 2..4 {
                    let (replica, decision) = send(&routers[turn % 2], &topic, turn);
                    assert_eq!(
                        (replica.as_str(), decision.as_str()),
                        (home.as_str(), "pin"),
                        "{topic}, turn {turn}"
                    );
                }
                home
            })
            .collect()
    };
    let homes = conversations(&routers, "before");
    assert!(
        homes.iter().any(|h| h == "a") && homes.iter().any(|h| h == "b"),
        "{homes:?}"
    );
    assert!(shared(&routers[1], "lookup", "hit") >= 6.0);
    // A restarted instance (empty index) finds the conversations in Redis.
    routers[1] = Router::start(&reversed, &fleet);
    for (c, home) in homes.iter().enumerate() {
        let (replica, decision) = send(&routers[1], &format!("before {c}"), 4);
        assert_eq!(
            (replica.as_str(), decision.as_str()),
            (home.as_str(), "pin")
        );
    }
    // Redis gone: no client sees an error; each instance places by its own index.
    redis.kill();
    for c in 0..6 {
        let topic = format!("outage {c}");
        send(&routers[0], &topic, 1);
        send(&routers[1], &topic, 2);
    }
    let down =
        shared(&routers[1], "lookup", "unavailable") + shared(&routers[1], "lookup", "timeout");
    assert!(down >= 1.0, "lookups while Redis is down are counted");
    for r in &routers {
        wait_for("the outage logged", Duration::from_secs(5), || {
            r.log().contains("unavailable").then_some(())
        });
    }
    // Back: pins are shared again once the instances reconnect.
    let _redis = common::RedisServer::start(redis.port);
    for r in &routers {
        let written = shared(r, "write", "ok");
        wait_for("writes to redis again", Duration::from_secs(20), || {
            if shared(r, "write", "ok") > written {
                return Some(());
            }
            send(r, "probe", 1);
            None
        });
    }
    let again = conversations(&routers, "after");
    assert_eq!(again.len(), 6);
}

#[test]
fn instances_sharing_redis_send_a_responses_turn_to_the_replica_holding_its_previous_response() {
    let sims: Vec<Sim> = ["a", "b"].iter().map(|n| Sim::start(n, &[])).collect();
    let sims: Vec<&Sim> = sims.iter().collect();
    let reversed: Vec<&Sim> = sims.iter().rev().copied().collect();
    let (redis, fleet) = redis_fleet(4);
    let routers = [
        Router::start(&sims, &fleet),
        Router::start(&reversed, &fleet),
    ];
    let turn = |router: &Router, input: &str, previous: Option<&str>| {
        let mut body = json!({"model": "sim", "input": input, "max_output_tokens": 2});
        if let Some(id) = previous {
            body["previous_response_id"] = json!(id);
        }
        let r = router.post("/v1/responses", &body);
        // The simulator, like an engine, answers 404 for a response it does not hold.
        assert_eq!(r.status, 200, "{input}: {}", r.text());
        let id = r.json()["id"].as_str().expect("id").to_owned();
        (id, r.replica().to_owned(), r.decision().to_owned())
    };
    let key = |id: &str| format!("prefix-router:response:{id}");
    let written = |id: &str| {
        wait_for("the response id in redis", Duration::from_secs(5), || {
            redis.exists(4, &key(id)).then_some(())
        })
    };
    // Four conversations started on one instance (spread over both
    // replicas), each later turn sent through the other instance than the
    // turn before: only the shared id tells it where the response is.
    let mut last: Vec<(String, String)> = (0..4)
        .map(|c| {
            let (id, home, _) = turn(&routers[0], &format!("conversation {c}"), None);
            (id, home)
        })
        .collect();
    assert!(last.iter().any(|(_, h)| h == "a") && last.iter().any(|(_, h)| h == "b"));
    for step in 1..4 {
        for (c, (id, home)) in last.iter_mut().enumerate() {
            written(id);
            let router = &routers[step % 2];
            let (next, replica, decision) = turn(router, &format!("c{c} step {step}"), Some(id));
            assert_eq!(
                (replica.as_str(), decision.as_str()),
                (home.as_str(), "key"),
                "conversation {c}, step {step}"
            );
            *id = next;
        }
    }
    // GET and DELETE through the instance that did not see the response
    // (step 3 went through the second).
    let (id, _) = &last[0];
    written(id);
    let other = &routers[0];
    assert_eq!(get(other.addr, &format!("/v1/responses/{id}")).status, 200);
    let deleted = request(
        other.addr,
        "DELETE",
        &format!("/v1/responses/{id}"),
        &[],
        b"",
    );
    assert_eq!(deleted.status, 200, "{}", deleted.text());
    wait_for("the id deleted from redis", Duration::from_secs(5), || {
        (!redis.exists(4, &key(id))).then_some(())
    });
}

#[test]
fn a_redis_that_accepts_and_never_answers_costs_each_request_at_most_its_budget() {
    // A listener that takes connections and says nothing: a hung Redis.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = hung.local_addr().expect("addr").port();
    let held = std::thread::spawn(move || {
        let conns: Vec<_> = hung.incoming().take(4).collect();
        std::thread::park();
        drop(conns);
    });
    let sim = Sim::start("a", &[]);
    let fleet = format!(
        "fleet: {{mode: redis, redis_url: \"redis://127.0.0.1:{port}/0\", redis_budget_ms: 50}}\n"
    );
    let router = Router::start(&[&sim], &fleet);
    for turn in 1..6 {
        let started = std::time::Instant::now();
        let r = router.post(
            "/v1/chat/completions",
            &conversation(&format!("hung {turn}"), turn),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        // The budget (50 ms), with room for a loaded machine, and well
        // under the connection's own 1 s reply timeout; a hung lookup
        // without a budget would hold the request for ever.
        assert!(started.elapsed() < Duration::from_millis(900));
    }
    assert!(shared(&router, "lookup", "timeout") >= 1.0);
    drop(held);
}
