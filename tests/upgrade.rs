//! Zero-downtime upgrade (Pingora's listener hand-over): a second router
//! started with `-u` receives the listening sockets when the first gets
//! SIGQUIT; the first finishes what it holds and exits 0. Under load, no
//! request fails and a stream in flight on the old process runs to its end.
//! Real processes; every request opens its own connection.

mod common;

use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::http::{try_request, EventStream};
use common::{single, streaming, wait_for, Router, Sim};

/// A fresh directory only this user can enter (the upgrade socket's must be).
fn private_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "prefix-router-upgrade-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .expect("private dir");
    dir
}

#[test]
fn a_new_binary_takes_the_listeners_over_without_a_failed_request() {
    // 20 tokens a second: a one-shot takes 0.1 s, the stream below 10 s,
    // past Pingora's 5 s of overlap and into the old process's drain.
    let a = Sim::start("a", &["--decode-tps", "20"]);
    let b = Sim::start("b", &["--decode-tps", "20"]);
    let sock = private_dir("handover").join("upgrade.sock");
    let mut old = Router::start(
        &[&a, &b],
        &format!(
            "upgrade_sock: \"{}\"\nshutdown_grace_s: 20\n",
            sock.display()
        ),
    );
    let mut stream = EventStream::open(old.addr, "/v1/chat/completions", &streaming("long", 200));
    assert_eq!(stream.status, 200);

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (addr, stop) = (old.addr, Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let body = serde_json::to_vec(&single(&format!("load {i}"))).expect("json");
                let r = try_request(addr, "POST", "/v1/chat/completions", &[], &body);
                outcomes.push(r.map(|r| (r.status, r.text())).map_err(|e| e.to_string()));
                i += 1;
            }
            outcomes
        })
    };
    let mut new = old.start_upgrade();
    wait_for(
        "the new router's upgrade socket",
        Duration::from_secs(10),
        || {
            assert!(new.running(), "the new router exited:\n{}", new.log());
            sock.exists().then_some(())
        },
    );
    old.signal("QUIT");
    let mut events = 0;
    let mut last = String::new();
    while let Some(event) = stream.next_event() {
        events += 1;
        last = event;
    }
    let status = old.exit_status(Duration::from_secs(30));
    // The new process answers on the inherited sockets, metrics included.
    wait_for(
        "requests counted by the new router",
        Duration::from_secs(10),
        || {
            let served: f64 = ["a", "b"]
                .iter()
                .map(|r| {
                    new.metric(&format!(
                        "prefix_router_requests_total{{decision=\"spread\",replica=\"{r}\",shape=\"single\"}}"
                    ))
                })
                .sum();
            (served >= 20.0).then_some(())
        },
    );
    stop.store(true, Ordering::Relaxed);
    let outcomes = load.join().expect("load thread");
    let failed: Vec<_> = outcomes
        .iter()
        .filter(|o| !matches!(o, Ok((200, _))))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed, e.g. {:?}\nold log:\n{}\nnew log:\n{}",
        failed.len(),
        outcomes.len(),
        failed.first(),
        old.log(),
        new.log()
    );
    assert!(
        outcomes.len() > 50,
        "load ran throughout: {}",
        outcomes.len()
    );
    assert_eq!(
        last, "data: [DONE]",
        "the old process's stream ran to its end"
    );
    assert!(events > 200, "every token arrived: {events} events");
    assert!(status.success(), "old router exit {status:?}");
    assert!(new.running(), "the new router runs on");
}

#[test]
fn a_new_binary_that_cannot_start_leaves_the_old_one_serving() {
    let a = Sim::start("a", &[]);
    let sock = private_dir("broken").join("upgrade.sock");
    let old = Router::start(&[&a], &format!("upgrade_sock: \"{}\"\n", sock.display()));
    // The new binary's config names an API keys file that is not there.
    let mut new =
        old.start_upgrade_with(|yaml| format!("api_keys_file: /nonexistent/keys\n{yaml}"));
    let status = new.exit_status(Duration::from_secs(10));
    assert!(!status.success(), "the new binary failed: {status:?}");
    assert!(new.log().contains("api_keys_file"), "{}", new.log());
    assert!(!sock.exists(), "it failed before taking the sockets over");
    assert_eq!(
        old.post("/v1/chat/completions", &single("still here"))
            .status,
        200
    );
}
