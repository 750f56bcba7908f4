//! `prefix-router --check`: an operator validates a config before shipping
//! it: exit 0 and a one-line summary, or non-zero naming the bad key or value.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `prefix-router --check` on `yaml` (the embedded default for `None`).
fn check(yaml: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_prefix-router"));
    cmd.arg("--check").env_remove("PREFIX_ROUTER_POLICY");
    if let Some(yaml) = yaml {
        let path = temp_file("router.yaml", yaml);
        cmd.arg("--config").arg(path);
    }
    cmd.output().expect("run prefix-router --check")
}

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "prefix-router-check-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path
}

/// A directory with an empty `tokenizer.json` and nothing else.
fn half_tokenizer() -> PathBuf {
    let file = temp_file("tokenizer.json", "{}");
    file.parent().expect("its directory").to_owned()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_good_config_passes_with_a_one_line_summary_and_starts_nothing() {
    let out = check(Some(
        "listen: \"127.0.0.1:1\"\nreplicas:\n  - {name: gpu0, addr: \"10.0.0.1:8000\"}\n  - {name: gpu1, addr: \"10.0.0.2:8000\"}\n",
    ));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.contains("ok: 2 replicas (gpu0, gpu1)"), "{stdout}");
    let default = check(None);
    assert!(default.status.success(), "{}", text(&default.stderr));
    assert!(text(&default.stdout).contains("embedded default: ok"));
}

#[test]
fn a_bad_config_fails_naming_the_key_or_value() {
    let one = "replicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";
    for (yaml, named) in [
        (format!("kv_room: sometimes\n{one}"), "kv_room"),
        (format!("listen_port: 80\n{one}"), "listen_port"),
        (
            format!("timeouts: {{read_ms: 0}}\n{one}"),
            "timeouts.read_ms",
        ),
        ("replicas:\n".to_owned(), "replicas"),
        (
            "replicas: [{name: a, addr: \"vllm-0:99999\"}]\n".to_owned(),
            "replicas[0].addr",
        ),
        (
            "replicas: [{name: a, addr: \"127.0.0.1:1\"}\n".to_owned(),
            "YAML",
        ),
        (
            format!("tokenizers: {{m: /nonexistent}}\n{one}"),
            "tokenizers.m",
        ),
        (
            // A tokenizer.json but no tokenizer_config.json (the template).
            format!("tokenizers: {{m: {}}}\n{one}", half_tokenizer().display()),
            "tokenizer_config.json",
        ),
    ] {
        let out = check(Some(&yaml));
        assert!(!out.status.success(), "{yaml} passed");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(named), "{yaml}: {stderr}");
        assert!(text(&out.stdout).is_empty(), "{yaml}: no summary");
    }
}

#[test]
fn an_unreadable_api_keys_file_fails_the_check() {
    let missing =
        "api_keys_file: /nonexistent/keys\nreplicas: [{name: a, addr: \"127.0.0.1:1\"}]\n";
    let out = check(Some(missing));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("api_keys_file"),
        "{}",
        text(&out.stderr)
    );
}
