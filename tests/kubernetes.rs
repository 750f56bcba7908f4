//! The Kubernetes manifests in `deploy/kubernetes/`: valid against the
//! Kubernetes schemas (`kubernetes-validate` from PyPI, installed into
//! `.kube/venv` by `scripts/prepare.sh`; no cluster runs here), carrying a
//! router config that passes `--check`, and agreeing with it on ports, probe
//! paths and the drain time.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn manifest(name: &str) -> Value {
    let text = std::fs::read_to_string(dir().join(name)).expect("manifest");
    serde_yaml::from_str(&text).expect("YAML")
}

fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let validate = Path::new(env!("CARGO_MANIFEST_DIR")).join(".kube/venv/bin/kubernetes-validate");
    assert!(validate.exists(), "run scripts/prepare.sh first");
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    // The oldest release still common in clusters, and the newest known.
    for version in ["1.29.0", "1.37.0"] {
        let out = Command::new(&validate)
            .args(["--strict", "--kubernetes-version", version])
            .args(&files)
            .output()
            .expect("run kubernetes-validate");
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{version}: {said}");
        for f in &files {
            let passed = format!("{} passed", f.display());
            assert!(said.contains(&passed), "{version}: {said}");
        }
    }
    // The checker does refuse a broken manifest.
    let bad = std::env::temp_dir().join(format!("prefix-router-bad-{}.yaml", std::process::id()));
    let text = std::fs::read_to_string(dir().join("deployment.yaml")).expect("deployment");
    std::fs::write(&bad, text.replace("replicas: 3", "replicas: three")).expect("write");
    let out = Command::new(&validate)
        .arg("--strict")
        .arg(&bad)
        .output()
        .expect("run kubernetes-validate");
    let _ = std::fs::remove_file(&bad);
    assert!(!out.status.success());
}

#[test]
fn the_configmap_holds_a_router_config_that_the_deployment_agrees_with() {
    let config_text = manifest("configmap.yaml")["data"]["config.yaml"]
        .as_str()
        .expect("config.yaml in the ConfigMap")
        .to_owned();
    let path = std::env::temp_dir().join(format!("prefix-router-k8s-{}.yaml", std::process::id()));
    std::fs::write(&path, &config_text).expect("write config");
    let out = Command::new(env!("CARGO_BIN_EXE_prefix-router"))
        .arg("--check")
        .arg("--config")
        .arg(&path)
        .output()
        .expect("run --check");
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config: Value = serde_yaml::from_str(&config_text).expect("config YAML");
    let port = |key: &str| -> u64 {
        let addr = config[key].as_str().expect("listen address");
        let port = addr.rsplit_once(':').expect("IP:port").1;
        port.parse().expect("port")
    };
    let deployment = manifest("deployment.yaml");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let port_named = |name: &str| -> u64 {
        container["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .expect("named port")
    };
    assert_eq!(port_named("http"), port("listen"));
    assert_eq!(port_named("metrics"), port("metrics_listen"));
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/ready")
    );
    // The preStop pause, then SIGTERM's drain, must end before Kubernetes
    // kills the pod.
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    let drain = config["shutdown_grace_s"]
        .as_u64()
        .expect("shutdown_grace_s");
    let pause: u64 = container["lifecycle"]["preStop"]["exec"]["command"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("preStop sleep seconds");
    assert!(
        pause + drain + 5 <= grace,
        "pause {pause} s, drain {drain} s, grace {grace} s"
    );
    assert_eq!(config["fleet"]["mode"].as_str(), Some("rendezvous"));
    // The router's config is mounted as a directory (hot reload follows a
    // ConfigMap update), and the Service and the budget select its pods.
    let mount = &container["volumeMounts"][0];
    assert_eq!(mount["mountPath"].as_str(), Some("/etc/prefix-router"));
    assert!(mount.get("subPath").is_none());
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&manifest("service.yaml")["spec"]["selector"], labels);
    assert_eq!(
        &manifest("pdb.yaml")["spec"]["selector"]["matchLabels"],
        labels
    );
}
