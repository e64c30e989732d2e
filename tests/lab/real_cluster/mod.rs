//! gpuplane against real Kubernetes (issue 13): the upstream kube-apiserver, scheduler,
//! controller manager, kubelet and containerd of hack/cluster/lab.sh, and the real
//! `gpuplane node --simulate dgx-h100` in the lab's network namespace. Each test starts its
//! own lab (one at a time: the machine's cores are few) and asserts outcomes only, with
//! generous hang guards and no timing assertions. Skips when not root or when the cluster
//! binaries are not built (hack/cluster/build.sh); fails instead under `CI`.

use crate::cluster;
use crate::cluster::{
    eventually, eventually_or, ClusterLab, LabAgent, LabProcess, AGENT_USER, DRIVER, NODE,
};
use crate::support;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;

mod claims;
mod explain_cli;
mod health;
mod registration;

/// The GPU UUIDs of the simulated dgx-h100, from `gpuplane discover`.
fn profile_uuids() -> BTreeSet<String> {
    let uuids = crate::deploy::machine("dgx-h100").1;
    assert_eq!(uuids.len(), 8, "dgx-h100 has 8 GPUs: {uuids:?}");
    uuids
}

/// The node's allocatable `nvidia.com/gpu`, if any.
pub(crate) fn allocatable_gpus(lab: &ClusterLab) -> Option<String> {
    let node = lab.get_json(&["get", "node", NODE])?;
    node["status"]["allocatable"]["nvidia.com/gpu"]
        .as_str()
        .map(String::from)
}

/// The ResourceSlices of lab-node for our driver.
fn our_slices(lab: &ClusterLab) -> Vec<Value> {
    lab.get_json(&["get", "resourceslices"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
        .collect()
}

/// Device name -> its `uuid` attribute, over all our slices.
fn slice_devices(lab: &ClusterLab) -> Vec<(String, Value)> {
    our_slices(lab)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| (d["name"].as_str().unwrap().to_string(), d))
        .collect()
}

fn attr_string(device: &Value, name: &str) -> Option<String> {
    device["attributes"][name]["string"]
        .as_str()
        .or_else(|| device["attributes"][format!("{DRIVER}/{name}")]["string"].as_str())
        .map(String::from)
}

/// A lab with the agent's identity installed and the agent registered with both APIs.
fn lab_with_agent() -> Option<(ClusterLab, PathBuf, LabProcess)> {
    let lab = ClusterLab::start()?;
    let kubeconfig = lab.install_agent_identity();
    let agent = LabAgent::start(&lab, &kubeconfig, "1");
    wait_registered(&lab);
    Some((lab, kubeconfig, agent))
}

/// Both APIs registered with the real kubelet: 8 allocatable `nvidia.com/gpu` on the node,
/// the DRA plugin registered with the kubelet, 8 GPUs in lab-node's ResourceSlices.
fn wait_registered(lab: &ClusterLab) {
    eventually(
        "node lab-node to report nvidia.com/gpu: 8 allocatable",
        || (allocatable_gpus(lab).as_deref() == Some("8")).then_some(()),
    );
    eventually("the ResourceSlices of lab-node to list 8 GPUs", || {
        let gpus = slice_devices(lab)
            .iter()
            .filter(|(_, d)| attr_string(d, "type").as_deref() == Some("gpu"))
            .count();
        (gpus == 8).then_some(())
    });
    eventually("the kubelet to connect to the DRA plugin", || {
        (dra_connections(lab) > 0).then_some(())
    });
}

fn pod_phase(lab: &ClusterLab, name: &str) -> Option<String> {
    lab.get_json(&["get", "pod", name])
        .and_then(|p| p["status"]["phase"].as_str().map(String::from))
}

/// Waits for the pod to reach one of `phases`; panics (with its description) on `Failed`
/// unless that is wanted.
pub(crate) fn wait_phase(lab: &ClusterLab, name: &str, phases: &[&str]) -> String {
    eventually_or(
        &format!("pod {name} to reach {phases:?}"),
        || {
            let phase = pod_phase(lab, name)?;
            if phase == "Failed" && !phases.contains(&"Failed") {
                panic!("pod {name} failed:\n{}", lab.describe_pod(name));
            }
            phases.contains(&phase.as_str()).then_some(phase)
        },
        || lab.describe_pod(name),
    )
}

fn env_value(log: &str, key: &str) -> Option<String> {
    log.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(String::from)
}

/// How often the kubelet's DRA manager has connected to our plugin (its log).
fn dra_connections(lab: &ClusterLab) -> usize {
    lab.log_lines("kubelet", "\"Connection changed\"")
        .iter()
        .filter(|l| l.contains(&format!("driverName=\"{DRIVER}\"")) && l.contains("connected=true"))
        .count()
}

/// The log of a pod whose container printed its environment, once it has.
fn env_log(lab: &ClusterLab, pod: &str) -> String {
    eventually(&format!("pod {pod}'s env in its log"), || {
        let log = lab.kubectl_ok(&["logs", pod]);
        log.contains("PATH=").then_some(log)
    })
}

/// A pod holding a claim of `count` GPUs from DeviceClass gpu.gpuplane.dev whose devices also
/// match `selector` (CEL), sleeping so that it keeps them.
pub(crate) fn claim_pod(lab: &ClusterLab, name: &str, count: u32, selector: &str) {
    let extra = [
        format!("count: {count}"),
        format!("selectors: [{{cel: {{expression: \"{selector}\"}}}}]"),
    ];
    lab.apply(&cluster::claim_template("default", name, &extra));
    lab.apply(&cluster::claim_pod("default", name, name));
}

/// The agent on the fake NVML (dgx-h100, device plugin on), whose health recovers after
/// `quiet` without Xids; returns it and the control file an Xid is written to (`xid 3 48`).
pub(crate) fn xid_agent(
    lab: &ClusterLab,
    kubeconfig: &std::path::Path,
    quiet: &str,
) -> (cluster::LabProcess, PathBuf) {
    let dir = LabAgent::dir(lab);
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    gpuplane_testkit::doubles::devnodes::make_gpu_nodes(&dev, 0..8).unwrap();
    let control = dir.join("nvml-control");
    std::fs::write(&control, "").unwrap();
    let fake = support::built_fake();
    let config = format!("version: v1\nhealth: {{recoveryQuietPeriod: {quiet}}}\n");
    let agent = LabAgent::start_with(
        lab,
        kubeconfig,
        "xid",
        &["--nvml-lib", fake.to_str().unwrap(), "--device-plugin=true"],
        &[
            ("GPUPLANE_FAKE_NVML_PROFILE", "dgx-h100".as_ref()),
            ("GPUPLANE_FAKE_NVML_CONTROL", control.as_os_str()),
        ],
        Some(&config),
    );
    (agent, control)
}

/// `gpuplane explain <args> -o json --kubeconfig <admin>` in the lab: its parsed stdout, or
/// its stderr when it fails.
pub(crate) fn explain(lab: &ClusterLab, args: &[&str]) -> Result<Value, String> {
    let out = lab
        .in_netns(env!("CARGO_BIN_EXE_gpuplane"))
        .arg("explain")
        .args(args)
        .args(["-o", "json", "--kubeconfig"])
        .arg(lab.admin_kubeconfig())
        .output()
        .unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}
