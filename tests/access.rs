//! Who may use the listener and what a client can learn or smuggle: API
//! keys checked before any body is read, placement headers off, path
//! variants, request smuggling, pipelined requests.

mod common;

use std::time::Duration;

use common::http;
use common::{conversation, sha256_hex, single, wait_for, Router, Sim};
use serde_json::json;

#[test]
fn placement_headers_off_hides_replicas_from_clients() {
    let a = Sim::start("a", &["--hang-after-requests", "1"]);
    let router = Router::start(
        &[&a],
        "placement_headers: false\ntimeouts: {read_ms: 300}\n",
    );
    let r = router.post("/v1/chat/completions", &conversation("quiet", 0));
    assert_eq!(r.status, 200);
    assert_eq!(
        (
            r.header("x-prefix-router-replica"),
            r.header("x-prefix-router-decision")
        ),
        (None, None)
    );
    let r = router.post("/v1/chat/completions", &conversation("quiet", 1));
    assert_eq!(r.status, 504);
    assert!(!r.text().contains("replica a"), "{}", r.text());
}

#[test]
fn path_variants_are_limited_and_routed_as_the_canonical_path() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "max_body_bytes: 1000\n");
    let big = serde_json::to_vec(&single(&"y".repeat(5000))).unwrap();
    let small = serde_json::to_vec(&conversation("path", 1)).unwrap();
    router.post("/v1/chat/completions", &conversation("path", 0));
    for path in [
        "/v1/chat/completions/",
        "//v1/chat/completions",
        "/v1/chat/%63ompletions",
        "/v1/chat/./completions?x=1",
    ] {
        let r = http::request(router.addr, "POST", path, &[], &big);
        assert_eq!(r.status, 413, "{path} skipped the body limit");
        let r = http::request(router.addr, "POST", path, &[], &small);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.decision(), "pin", "{path} was not routed by prompt");
    }
}

#[test]
fn api_keys_gate_the_listener_before_any_body_is_read_and_reload() {
    let a = Sim::start("a", &[]);
    let dir = std::env::temp_dir().join(format!("prefix-router-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("# clients\n{}\n", sha256_hex("k1"))).unwrap();
    // At `info` a request line is logged per request: it must not carry a key.
    let router = Router::start_with_env(
        &[&a],
        &format!("api_keys_file: \"{}\"\n", keys.display()),
        &[("RUST_LOG", "info")],
    );
    let body = serde_json::to_vec(&single("who?")).unwrap();
    let post = |auth: &[(&str, &str)]| {
        http::request(router.addr, "POST", "/v1/chat/completions", auth, &body)
    };
    for auth in [
        &[][..],
        &[("authorization", "Bearer k2")],
        &[("authorization", "k1")],
    ] {
        let r = post(auth);
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(post(&[("authorization", "Bearer k1")]).status, 200);
    assert_eq!(post(&[("x-api-key", "k1")]).status, 200);
    assert_eq!(http::get(router.addr, "/v1/models").status, 401);
    // Refused before the body is read: a declared 1 GiB body is not awaited.
    let r = http::send_stalled(router.addr, "/v1/chat/completions", 1 << 30, b"{");
    assert_eq!(r.status, 401);
    assert_eq!(a.received(), 2);
    std::fs::write(&keys, format!("{}\n", sha256_hex("k2"))).unwrap();
    wait_for("the new keys", Duration::from_secs(10), || {
        (post(&[("authorization", "Bearer k2")]).status == 200).then_some(())
    });
    assert_eq!(post(&[("authorization", "Bearer k1")]).status, 401);
    assert!(router.metric("prefix_router_errors_total{kind=\"invalid_api_key\"}") >= 6.0);
    assert_eq!(
        router.metric("prefix_router_api_keys_reloads_total{file=\"api_keys_file\",result=\"ok\"}"),
        1.0
    );
    let log = router.wait_log("POST /v1/chat/completions status=200");
    assert!(
        !log.contains("k1") && !log.contains("k2"),
        "a key reached the log"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Request-smuggling probes: conflicting or obfuscated framing must never let
/// a second request reach a replica.
#[test]
fn smuggling_probes_never_deliver_a_second_request() {
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let inner =
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 14\r\n\r\n{\"prompt\":\"x\"}";
    let chunked_inner = format!("0\r\n\r\n{inner}");
    let probes = [
        // CL.TE: a front end that reads Content-Length forwards the rest.
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\ntransfer-encoding: chunked\r\n\r\n{chunked_inner}",
            chunked_inner.len()
        ),
        // TE.CL
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{inner}\r\n0\r\n\r\n",
            inner.len()
        ),
        // Two different Content-Lengths.
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 14\r\ncontent-length: {}\r\n\r\n{{\"prompt\":\"x\"}}{inner}",
            14 + inner.len()
        ),
        // Obfuscated Transfer-Encoding.
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: xchunked\r\ncontent-length: 14\r\n\r\n{{\"prompt\":\"x\"}}{inner}"),
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding : chunked\r\n\r\n{chunked_inner}"),
        format!("POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked, identity\r\n\r\n{chunked_inner}"),
    ];
    for (i, probe) in probes.iter().enumerate() {
        let before = a.received();
        let answer = http::raw(router.addr, probe.as_bytes());
        let delivered = a.received() - before;
        assert!(
            delivered <= 1,
            "probe {i}: {delivered} requests reached the replica: {answer}"
        );
        let responses = answer.matches("HTTP/1.1 ").count();
        assert!(responses <= 1, "probe {i}: {responses} responses: {answer}");
    }
    assert_eq!(
        router.post("/v1/chat/completions", &single("after")).status,
        200
    );
}

#[test]
fn client_keys_stay_at_the_edge_and_each_replica_gets_its_own() {
    // Engines started with keys of their own (`--api-key`: 401 on /v1/
    // without it); clients present a router key the engines do not take.
    let mut a = Sim::start("a", &["--api-key", "engine-a"]);
    let b = Sim::start("b", &["--api-key", "engine-b"]);
    let dir = std::env::temp_dir().join(format!("prefix-router-edge-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let clients = file("clients", &format!("{}\n", sha256_hex("k1")));
    let (key_a, key_b) = (file("a.key", "engine-a\n"), file("b.key", "engine-b"));
    let with_key = |s: &Sim, key: &str| {
        s.yaml()
            .replace("\"}\n", &format!("\", api_key_file: \"{key}\"}}\n"))
    };
    let router = Router::spawn(
        &format!(
            "api_keys_file: \"{clients}\"\nreplicas:\n{}{}",
            with_key(&a, &key_a),
            with_key(&b, &key_b)
        ),
        &[],
    );
    router.wait_replica_up("a", true);
    router.wait_replica_up("b", true);
    let client = [("authorization", "Bearer k1")];
    // Each engine's model list is read with its key: the router answers
    // `/v1/models` itself once it knows every list.
    wait_for("both model lists", Duration::from_secs(10), || {
        let r = http::request(router.addr, "GET", "/v1/models", &client, b"");
        (r.status == 200 && r.json()["data"][0]["owned_by"] == "prefix-router").then_some(())
    });
    let mut served = std::collections::BTreeSet::new();
    for i in 0..6 {
        let body = serde_json::to_vec(&single(&format!("edge {i}"))).unwrap();
        let r = http::request(router.addr, "POST", "/v1/chat/completions", &client, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        served.insert(r.replica().to_owned());
    }
    assert_eq!(served.len(), 2, "both engines took their own key");
    // An engine's key is no client key.
    let body = serde_json::to_vec(&single("engine key")).unwrap();
    let r = http::request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer engine-a")],
        &body,
    );
    assert_eq!(r.status, 401);
    // A key rotated in place: the engine restarts with a new one and its
    // file is rewritten; the config is not touched.
    let addr = a.addr.to_string();
    a.kill();
    let _a = Sim::start_on(&addr, "a", &["--api-key", "engine-a2"]);
    std::fs::write(&key_a, "engine-a2\n").unwrap();
    let mut i = 0;
    wait_for(
        "a answered with the rotated key",
        Duration::from_secs(20),
        || {
            i += 1;
            let body = serde_json::to_vec(&single(&format!("rotated {i}"))).unwrap();
            let r = http::request(router.addr, "POST", "/v1/chat/completions", &client, &body);
            (r.status == 200 && r.replica() == "a").then_some(())
        },
    );

    // An engine that checks the clients' own key: the router keeps the key
    // at the edge unless `forward_client_keys: true`.
    let c = Sim::start("c", &["--api-key", "k1"]);
    let yaml = |forward: bool| {
        format!(
            "api_keys_file: \"{clients}\"\nforward_client_keys: {forward}\nreplicas:\n{}",
            c.yaml()
        )
    };
    let router = Router::spawn(&yaml(false), &[]);
    router.wait_replica_up("c", true);
    let post = || http::request(router.addr, "POST", "/v1/chat/completions", &client, &body);
    assert_eq!(post().status, 401, "the client's key reached the engine");
    // Its model list is refused too: the operator is told once.
    router.wait_log("replica c refuses the router's requests");
    router.rewrite(&yaml(true));
    wait_for("the key forwarded", Duration::from_secs(10), || {
        (post().status == 200).then_some(())
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pipelined_requests_and_a_head_longer_than_the_first_read_reach_the_replica_whole() {
    // HTTP/1.1 pipelining: each request answered in order, the streamed ones
    // too (the next request's bytes then arrive while an answer is written).
    // A request's first read takes up to 8 KiB and what it holds then moves to
    // a buffer of its size: the header and a body read with it must survive
    // the move, requests pipelined behind it must still be parsed from it,
    // and a head longer than the first read must grow it.
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let request = |pad: usize, prompt: &str, stream: bool| {
        let body = serde_json::to_vec(
            &json!({"model": "sim", "max_tokens": 8, "stream": stream, "prompt": prompt}),
        )
        .unwrap();
        let mut wire = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: test\r\nx-pad: {}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            "p".repeat(pad),
            body.len()
        )
        .into_bytes();
        wire.extend(&body);
        (wire, format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&body)))
    };
    let sent = [
        request(1, &"four kilobytes ".repeat(280), false),
        request(1, "pipelined behind it, streamed", true),
        request(12_000, "behind a head of 12 KB", false),
        request(1, &"and a last one ".repeat(700), true),
    ];
    let wires: Vec<Vec<u8>> = sent.iter().map(|(w, _)| w.clone()).collect();
    for (i, (got, (_, want))) in http::pipelined(router.addr, &wires)
        .into_iter()
        .zip(&sent)
        .enumerate()
    {
        let r = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(
            r.header("x-sim-body-xxh3"),
            Some(want.as_str()),
            "request {i}"
        );
        if i % 2 == 1 {
            assert!(
                r.text().ends_with("data: [DONE]\n\n"),
                "request {i}: {}",
                r.text()
            );
        }
    }
    // Two short ones in one read: the first moves what was read, the
    // second is parsed from the copy.
    let short = [request(1, "one", true), request(1, "two", false)];
    let wires: Vec<Vec<u8>> = short.iter().map(|(w, _)| w.clone()).collect();
    for (got, (_, want)) in http::pipelined(router.addr, &wires).into_iter().zip(&short) {
        let r = got.expect("answer");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-sim-body-xxh3"), Some(want.as_str()));
    }
    // A head of 12 KB alone on its connection: read past the first 8 KiB.
    let (wire, want) = request(12_000, "alone", false);
    let r = http::pipelined(router.addr, &[wire])
        .remove(0)
        .expect("answer");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-sim-body-xxh3"), Some(want.as_str()));
    // A request refused before its body is read closes the connection: what
    // follows it is never taken for a request of its own.
    let small = Router::start(&[&a], "max_body_bytes: 4096\n");
    let refused = [
        request(1, &"too long ".repeat(1000), false).0,
        request(1, "after", false).0,
    ];
    let mut got = http::pipelined(small.addr, &refused).into_iter();
    let first = got.next().expect("first").expect("answer");
    assert_eq!(first.status, 413, "{}", first.text());
    assert!(
        got.next().expect("second").is_err(),
        "the bytes after a refused request were answered"
    );
}

#[test]
fn a_head_sent_a_few_bytes_at_a_time_is_read_whole_whichever_read_ends_it() {
    // A partial head is parsed again only once the bytes read since hold
    // the blank line that ends it (parsing from the first byte at every read
    // cost the square of a slow head's size): a blank line split across two
    // reads must still end it, with CRLF or bare LF line ends.
    let a = Sim::start("a", &[]);
    let router = Router::start(&[&a], "");
    let body = br#"{"model":"sim","max_tokens":4,"prompt":"a slow client"}"#;
    let want = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(body));
    for eol in ["\r\n", "\n"] {
        let head = [
            "POST /v1/completions HTTP/1.1",
            "host: test",
            "content-type: application/json",
            &format!("content-length: {}", body.len()),
            "",
            "",
        ]
        .join(eol);
        let wire = [head.as_bytes(), body].concat();
        let whole = http::in_pieces(router.addr, &[&wire]).expect("answer");
        if eol == "\r\n" {
            assert_eq!(whole.status, 200, "{}", whole.text());
        }
        // Split one to three bytes before the head's end, after a first
        // piece that leaves a partial head.
        for back in 1..=3 {
            let end = head.len() - back;
            let pieces = [&wire[..20], &wire[20..end], &wire[end..]];
            let r = http::in_pieces(router.addr, &pieces).expect("answer");
            assert_eq!(r.status, whole.status, "{eol:?}, {back} back: {}", r.text());
            if r.status == 200 {
                assert_eq!(r.header("x-sim-body-xxh3"), Some(want.as_str()));
            }
        }
        // Blank lines before the request line (the parser skips them), a
        // few at a time: the head's end is looked for after them.
        let blank = eol.repeat(40);
        let r = http::in_pieces(
            router.addr,
            &[
                &blank.as_bytes()[..4],
                &blank.as_bytes()[4..],
                &wire[..20],
                &wire[20..],
            ],
        )
        .expect("answer");
        assert_eq!(
            r.status,
            whole.status,
            "{eol:?} after blank lines: {}",
            r.text()
        );
    }
}
