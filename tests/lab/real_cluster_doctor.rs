//! `gpuplane doctor` on a real node (issue 40): run as a node-local tool sees the node (the
//! lab-node's mount namespace: its /var/lib/kubelet and /var/run/cdi, its containerd config,
//! the agent on 127.0.0.1:9400), it passes while the real kubelet, containerd and agent run,
//! runs a smoke pod with one GPU through each kubelet API and cleans up after them, and names
//! each fault with its fix: the agent stopped, then no CDI directory.
//! Skips like tests/lab/real_cluster.rs (root and the cluster binaries needed), fails under `CI`.

use crate::cluster::{eventually, ClusterLab, LabAgent, NODE};
use crate::support;
use serde_json::Value;

/// `gpuplane doctor -o json` on lab-node: whether it passed, and its checks.
fn doctor(lab: &ClusterLab) -> (bool, Vec<Value>) {
    doctor_with(lab, &[])
}

/// [`doctor`] with `extra` flags.
fn doctor_with(lab: &ClusterLab, extra: &[&str]) -> (bool, Vec<Value>) {
    let out = lab
        .on_node(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["doctor", "--simulate", "dgx-h100", "-o", "json"])
        .arg("--containerd-config")
        .arg(lab.work.join("containerd.toml"))
        .args(["--agent-addr", "127.0.0.1:9400"])
        .args(extra)
        .output()
        .unwrap();
    support::doctor_report(&out)
}

#[test]
fn doctor_passes_on_a_healthy_node_and_names_a_stopped_agent_and_a_missing_cdi_directory() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let kubeconfig = lab.install_agent_identity();
    let agent = LabAgent::start(&lab, &kubeconfig, "doctor");
    let checks = eventually("doctor passing on lab-node", || {
        let (ok, checks) = doctor(&lab);
        ok.then_some(checks)
    });
    assert!(support::doctor_failed(&checks).is_empty(), "{checks:#?}");
    for name in support::DOCTOR_NODE_CHECKS {
        assert!(
            checks
                .iter()
                .any(|c| c["check"] == *name && c["status"] == "ok"),
            "{name} ok in {checks:#?}"
        );
    }

    // The smoke pods: one GPU through each kubelet API on this node, then nothing left.
    let admin = lab.admin_kubeconfig();
    let (ok, checks) = doctor_with(
        &lab,
        &[
            "--smoke",
            "--node-name",
            NODE,
            "--smoke-image",
            "lab.local/busybox:1",
            "--kubeconfig",
            admin.to_str().unwrap(),
        ],
    );
    assert!(ok, "{checks:#?}");
    for name in ["smoke-device-plugin", "smoke-dra"] {
        let c = checks.iter().find(|c| c["check"] == name).unwrap();
        assert_eq!(c["status"], "ok", "{c}");
        assert!(
            c["detail"]
                .as_str()
                .is_some_and(|d| d.contains("GPUPLANE_DEVICE_")),
            "{c}"
        );
    }
    for kind in ["pods", "resourceclaims"] {
        let left = lab.get_json(&["get", kind, "-n", "default"]).unwrap();
        assert_eq!(left["items"].as_array().map(Vec::len), Some(0), "{left}");
    }

    agent.stop();
    let (ok, checks) = doctor(&lab);
    assert!(!ok);
    assert_eq!(support::doctor_failed(&checks), ["agent"], "{checks:#?}");

    // The node loses its CDI directory (containerd reads CDI specs from /var/run/cdi).
    let removed = lab
        .on_node("sh")
        .args(["-c", "umount /run/cdi && rmdir /run/cdi"])
        .status()
        .unwrap();
    assert!(removed.success());
    let (ok, checks) = doctor(&lab);
    assert!(!ok);
    let cdi = checks.iter().find(|c| c["check"] == "cdi").unwrap();
    assert_eq!(cdi["status"], "fail", "{cdi}");
    assert!(cdi["fix"].as_str().is_some_and(|f| !f.is_empty()), "{cdi}");
}
