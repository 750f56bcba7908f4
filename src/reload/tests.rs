//! The reloader's unit tests: edits judged, names looked up, what a
//! starting router read.

use super::*;

fn reloader(dir: &std::path::Path, yaml: &str) -> Reloader {
    started_from(dir, yaml, yaml)
}

/// A reloader whose running config came from `loaded`, the file holding
/// `on_disk` by the time it is made.
fn started_from(dir: &std::path::Path, loaded: &str, on_disk: &str) -> Reloader {
    let mut cfg = Config::parse(loaded, None).unwrap();
    cfg.read_replica_keys().unwrap();
    std::fs::write(dir.join("router.yaml"), on_disk).unwrap();
    made(dir, cfg, loaded)
}

/// The reloader of `dir`'s config file for a router running `cfg`,
/// parsed from `loaded`.
fn made(dir: &std::path::Path, cfg: Config, loaded: &str) -> Reloader {
    let path = dir.join("router.yaml");
    let metrics = Metrics::standalone();
    let live = Live {
        replicas: Arc::new(Replicas::new(&cfg.replicas, Arc::clone(&metrics))),
        policy: Arc::new(Policy::new(crate::policy_config::policy_config(&cfg))),
        settings: Arc::new(ArcSwap::from_pointee(Settings::from_config(&cfg))),
        admission: Admission::new(&cfg.limits),
        probe: HealthProbe::new(&cfg.health_check, &cfg.replica_tls).unwrap(),
        keys: None,
        admin_keys: None,
        resolver: Arc::default(),
        metrics,
    };
    Reloader::new(path, cfg, loaded.to_owned(), None, live)
}

#[tokio::test]
async fn an_edit_made_while_the_router_started_is_applied_at_the_first_check() {
    let dir = std::env::temp_dir().join(format!("prefix-router-start-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = started_from(
        &dir,
        "replicas:\n- {name: a, addr: \"127.0.0.1:1\"}\n",
        "replicas:\n- {name: a, addr: \"127.0.0.1:1\"}\n- {name: b, addr: \"127.0.0.1:2\"}\n",
    );
    let change = r.check().await.unwrap().expect("the edit is applied");
    assert_eq!(change.added[0].name, "b");
    assert_eq!(r.live.replicas.snapshot().len(), 2);
    assert!(r.check().await.unwrap().is_none(), "and judged once");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_key_rotated_while_the_router_started_is_read_at_the_first_check() {
    let dir = std::env::temp_dir().join(format!("prefix-router-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("a.key");
    std::fs::write(&key, "k1\n").unwrap();
    let yaml = format!(
        "replicas:\n- {{name: a, addr: \"127.0.0.1:1\", api_key_file: \"{}\"}}\n",
        key.display()
    );
    std::fs::write(dir.join("router.yaml"), &yaml).unwrap();
    let cfg = Config::load(&dir.join("router.yaml"), None).unwrap();
    std::fs::write(&key, "k2\n").unwrap();
    let r = made(&dir, cfg, &yaml);
    let key_of_a = || r.live.replicas.snapshot()[0].api_key().unwrap();
    let k2 = crate::config::Secret::read(&key.display().to_string()).unwrap();
    assert!(*key_of_a() != k2, "it starts with the key read at start");
    r.check_settled().await.unwrap();
    assert!(
        *key_of_a() == k2,
        "the rotated key is read at the first check"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn invalid_edit_keeps_the_previous_set_and_a_valid_one_applies() {
    let dir = std::env::temp_dir().join(format!("prefix-router-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = reloader(&dir, "replicas:\n- {name: a, addr: \"127.0.0.1:1\"}\n");
    assert!(r.check().await.unwrap().is_none(), "unchanged file");
    std::fs::write(&r.path, "replicas:\n- {name: a, adr: \"127.0.0.1:1\"}\n").unwrap();
    assert!(r.check().await.unwrap_err().to_string().contains("adr"));
    assert_eq!(r.live.replicas.snapshot().len(), 1);
    let moved = "reload_max_removed_percent: 100\nreplicas:\n- {name: b, addr: \"127.0.0.1:2\"}\n";
    std::fs::write(&r.path, moved).unwrap();
    let change = r.check().await.unwrap().unwrap();
    assert_eq!(change.added[0].name, "b");
    assert_eq!(change.removed[0].name, "a");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn names_are_looked_up_again_and_a_changed_address_is_a_replica_change() {
    let dir = std::env::temp_dir().join(format!("prefix-router-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let name = "engine.invalid:80";
    let r = reloader(
        &dir,
        &format!("dns_refresh_ms: 100\nreplicas:\n- {{name: a, addr: \"127.0.0.1:1\"}}\n- {{name: b, addr: \"{name}\"}}\n"),
    );
    let due = || {
        *r.resolved_at.lock().unwrap() = Instant::now() - Duration::from_secs(1);
    };
    let addrs = |r: &Reloader| -> Vec<String> {
        r.live
            .replicas
            .snapshot()
            .iter()
            .map(|x| format!("{} {}", x.name, x.addr))
            .collect()
    };
    assert_eq!(addrs(&r), ["a 127.0.0.1:1"], "b does not resolve yet");
    r.live
        .resolver
        .remember(name, vec!["10.0.0.7:80".parse().unwrap()]);
    assert!(r.refresh_names().await.is_none(), "not due yet");
    due();
    let change = r.refresh_names().await.expect("b resolved");
    assert_eq!(change.added[0].name, "b");
    assert_eq!(addrs(&r), ["a 127.0.0.1:1", "b 10.0.0.7:80"]);
    due();
    assert!(r.refresh_names().await.is_none(), "unchanged");
    r.live
        .resolver
        .remember(name, vec!["10.0.0.8:80".parse().unwrap()]);
    due();
    let change = r.refresh_names().await.expect("moved");
    assert_eq!((change.added.len(), change.removed.len()), (1, 1));
    assert_eq!(addrs(&r), ["a 127.0.0.1:1", "b 10.0.0.8:80"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
