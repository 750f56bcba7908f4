//! Stopping the router (SIGTERM, as an orchestrator does): streams in flight
//! finish, then the process exits 0, without waiting out the grace period
//! once nothing is in flight. Real processes.

mod common;

use std::time::Duration;

use common::http::EventStream;
use common::{streaming, Router, Sim};

#[test]
fn sigterm_lets_a_stream_in_flight_finish_then_exits_zero() {
    // 40 tokens at 20 a second: a stream of about two seconds.
    let a = Sim::start("a", &["--decode-tps", "20"]);
    let mut router = Router::start(&[&a], "shutdown_grace_s: 20\n");
    let mut stream = EventStream::open(
        router.addr,
        "/v1/chat/completions",
        &streaming("a long answer", 40),
    );
    assert_eq!(stream.status, 200);
    assert!(stream.next_event().is_some(), "the stream started");
    router.terminate();
    let mut events = 1;
    let mut last = String::new();
    while let Some(event) = stream.next_event() {
        events += 1;
        last = event;
    }
    assert_eq!(last, "data: [DONE]", "the stream ran to its end");
    assert!(events > 40, "every token arrived: {events} events");
    // Done well before the 20 s grace period: nothing was left in flight.
    let status = router.exit_status(Duration::from_secs(10));
    assert!(status.success(), "exit {status:?}");
}

#[test]
fn an_idle_router_exits_at_once_on_sigterm() {
    let a = Sim::start("a", &[]);
    let mut router = Router::start(&[&a], "shutdown_grace_s: 20\n");
    router.terminate();
    let status = router.exit_status(Duration::from_secs(5));
    assert!(status.success(), "exit {status:?}");
}
