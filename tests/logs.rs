//! The log: `log_format: json` makes every line one JSON object, the access
//! line per request carries placement and timings, and no line carries a
//! query string, a credential or prompt text. Real processes.

mod common;

use std::time::Duration;

use common::http::request;
use common::{single, wait_for, Router, Sim};

#[test]
fn json_lines_carry_the_access_fields_and_never_secrets() {
    let a = Sim::start("a", &[]);
    let router = Router::start_with_env(&[&a], "log_format: json\n", &[("RUST_LOG", "info")]);
    let body = serde_json::to_vec(&single("SECRET-PROMPT please")).expect("json");
    let r = request(
        router.addr,
        "POST",
        "/v1/chat/completions?api_key=SECRET-QUERY",
        &[("authorization", "Bearer SECRET-HEADER")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let access = wait_for("the access line", Duration::from_secs(10), || {
        let log = router.log();
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        lines.into_iter().find(|l| l["target"] == "access")
    });
    assert_eq!(access["method"], "POST");
    assert_eq!(access["path"], "/v1/chat/completions");
    assert_eq!(access["status"], 200);
    assert_eq!(access["replica"], "a");
    assert_eq!(access["decision"], "spread");
    assert_eq!(access["level"], "INFO");
    assert!(
        access["ts"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{access}"
    );
    let first = access["first_byte_ms"].as_f64().expect("first_byte_ms");
    let total = access["ms"].as_f64().expect("ms");
    assert!(first > 0.0 && first <= total, "{access}");
    let log = router.log();
    for secret in ["SECRET-PROMPT", "SECRET-QUERY", "SECRET-HEADER"] {
        assert!(!log.contains(secret), "{secret} reached the log:\n{log}");
    }

    // The format is reloadable: back to text.
    router.rewrite(&Router::yaml(&[&a], "log_format: text\n"));
    wait_for("the reload", Duration::from_secs(10), || {
        (router.metric("prefix_router_config_reloads_total{result=\"ok\"}") == 1.0).then_some(())
    });
    assert_eq!(
        router.post("/v1/chat/completions", &single("again")).status,
        200
    );
    wait_for("a text access line", Duration::from_secs(10), || {
        router
            .log()
            .lines()
            .any(|l| l.contains(" INFO  access] POST /v1/chat/completions status=200 replica=a"))
            .then_some(())
    });
}

#[test]
fn a_log_nobody_reads_holds_no_request_up_and_shutdown_writes_it_all_out() {
    // stderr is a pipe nobody reads (a stalled log shipper): it fills after
    // 64 KiB. Lines written on the request path would block every worker.
    use std::io::Read;
    let a = Sim::start("a", &[]);
    let (mut unread, stderr) = std::io::pipe().expect("pipe");
    let mut router = Router::spawn_logging_to(
        &Router::yaml(&[&a], ""),
        &[("RUST_LOG", "info")],
        Some(stderr.into()),
    );
    router.wait_replica_up("a", true);
    let sent = 2_000;
    for i in 0..sent {
        let r = router.post("/v1/chat/completions", &single(&format!("q {i}")));
        assert_eq!(r.status, 200, "request {i}");
    }
    let dropped = router.metric("prefix_router_log_lines_dropped_total");
    router.terminate();
    // Read while it exits: every line it queued is written out at the end.
    let reading = std::thread::spawn(move || {
        let mut log = String::new();
        unread.read_to_string(&mut log).map(|_| log)
    });
    assert!(router.exit_status(Duration::from_secs(30)).success());
    let log = reading.join().expect("reader").expect("log");
    let access = log.lines().filter(|l| l.contains(" access] POST ")).count();
    assert_eq!(
        (access, dropped),
        (sent, 0.0),
        "{}",
        &log[log.len().saturating_sub(500)..]
    );
}

/// What an engine says reaches the log (its model list, on a change): an
/// id carrying terminal control sequences (ESC, a C1 `CSI`, DEL, a newline
/// that would forge a line) is escaped in the text format, so a line read
/// in a terminal or a log viewer shows them and never runs them.
#[test]
fn control_characters_from_an_engine_are_escaped_in_the_text_log() {
    let a = Sim::start("a", &["--models", "m\u{1b}[2J\u{9b}31m\u{7f}\nFORGED"]);
    let router = Router::start_with_env(&[&a], "", &[("RUST_LOG", "info")]);
    let log = router.wait_log("serves models");
    let line = (log.lines())
        .find(|l| l.contains("serves models"))
        .expect("the models line");
    assert!(
        !line.chars().any(char::is_control),
        "a control character reached the log: {line:?}"
    );
    assert!(
        line.contains(r"m\u001b[2J\u009b31m\u007f\nFORGED"),
        "{line}"
    );
    assert!(!log.lines().any(|l| l.starts_with("FORGED")), "{log}");
}
