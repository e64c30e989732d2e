//! The whole of daemonset/ against real Kubernetes (issue 13): `kubectl apply -k` through the
//! lab's loopback overlay, the real `gpuplane controller` serving the quota webhooks by URL,
//! called by the real kube-apiserver, with the node agent and the real scheduler and kubelet
//! running the pods it admits. Skips like tests/lab/real_cluster.rs (root and the cluster binaries
//! needed), fails instead under `CI`.

use crate::cluster;
use crate::cluster::{
    eventually, refusals, start_controller, ClusterLab, LabAgent, LabProcess,
    CONTROLLER_METRICS_ADDR, NODE,
};
use gpuplane_model::quota::SCHEDULING_GATE;
use serde_json::Value;
use std::path::Path;

mod pending_pods;
mod whole_install;

/// A long-running busybox pod in `ns` asking for `gpus` whole GPUs (none: no resources).
fn pod(ns: &str, name: &str, gpus: u32) -> String {
    cluster::gpu_pod(ns, name, gpus, r#"["sleep", "3600"]"#)
}

/// A GpuQuota `hard` of `gpus` in dimension `dim`: `devices` (`nvidia.com/gpu` counted by
/// name) or `gpus` (whole-GPU equivalents, whatever API the devices come through).
fn quota(ns: &str, dim: &str, gpus: u32, mode: &str) -> String {
    let hard = match dim {
        "devices" => format!("devices: {{nvidia.com/gpu: {gpus}}}"),
        _ => format!("{dim}: {gpus}"),
    };
    format!(
        r#"apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {{name: default, namespace: {ns}}}
spec:
  hard:
    {hard}
  mode: {mode}
"#
    )
}

/// A namespace with a GpuQuota of `gpus` in `dim` (see [`quota`]), once the webhooks' caches
/// hold it: a server-side dry run of a pod one GPU over it is refused (Reject) or gated (Queue).
fn namespace_with_quota(lab: &ClusterLab, ns: &str, dim: &str, gpus: u32, mode: &str) {
    lab.kubectl_ok(&["create", "namespace", ns]);
    lab.apply(&quota(ns, dim, gpus, mode));
    let over = pod(ns, "dry-run-probe", gpus + 1);
    eventually(
        &format!("the webhooks to enforce GpuQuota {ns}/default"),
        || match lab.create(&over, &["--dry-run=server"]) {
            Err(e) => {
                (mode == "Reject" && e.contains(&format!("in GpuQuota {ns}/default"))).then_some(())
            }
            Ok(p) => (mode == "Queue" && gates(&p) == [SCHEDULING_GATE]).then_some(()),
        },
    );
}

pub(crate) fn pod_json(lab: &ClusterLab, ns: &str, name: &str) -> Option<Value> {
    lab.get_json(&["get", "pod", name, "-n", ns])
}

fn gates(pod: &Value) -> Vec<String> {
    pod["spec"]["schedulingGates"]
        .as_array()
        .map(|g| {
            g.iter()
                .filter_map(|g| g["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The PodScheduled condition's reason, if any.
fn scheduled_reason(pod: &Value) -> Option<String> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodScheduled")?["reason"]
        .as_str()
        .map(String::from)
}

/// The controller's `/metrics` text.
pub(crate) fn controller_metrics(lab: &ClusterLab) -> String {
    let out = lab
        .in_netns("curl")
        .args(["-sf", &format!("http://{CONTROLLER_METRICS_ADDR}/metrics")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scraping the controller's metrics failed"
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
