//! Dynamic MIG against real Kubernetes (issue 25): the agent publishes the simulated node's
//! dynamic-MIG H100s as partitionable devices (counter sets in a slice of their own, a device
//! per profile and placement consuming them), the real kube-apiserver validates them, the real
//! scheduler allocates only combinations that fit the counters, and the real kubelet's prepare
//! makes the agent create each MIG instance, which the container sees; unprepare destroys it.
//! Skips like tests/lab/real_cluster.rs (root and the cluster binaries needed), fails under `CI`.

use crate::cluster;

use crate::cluster::{eventually, eventually_or, ClusterLab, LabAgent, LabProcess};
use serde_json::Value;
use std::collections::BTreeSet;

/// GPUs 0 and 1 of the profile are H100s in MIG mode with no instances: dynamic. GPU 2 has a
/// static MIG layout, GPU 3 is not in MIG mode.
const PROFILE: &str = "dynamic-mig-mixed";
const CONFIG: &str = "version: v1\ndynamicMig:\n  gpus: [0, 1]\n";
const METRICS: &str = "127.0.0.1:9400";

fn start_agent(lab: &ClusterLab) -> LabProcess {
    let kubeconfig = lab.install_agent_identity();
    LabAgent::start_with(
        lab,
        &kubeconfig,
        "dynamic",
        &["--simulate", PROFILE, "--device-plugin=true"],
        &[],
        Some(CONFIG),
    )
}

/// `gpu.gpuplane.dev/<name>` of a device (our own attributes are qualified in CEL only).
fn attr<'a>(d: &'a Value, name: &str) -> &'a Value {
    let a = &d["attributes"][name];
    let v = if a.is_null() {
        &d["attributes"][format!("gpu.gpuplane.dev/{name}")]
    } else {
        a
    };
    v.as_object()
        .and_then(|o| o.values().next())
        .unwrap_or(&Value::Null)
}

/// A pod holding one device of DeviceClass `class` matching `cel`.
fn pod(lab: &ClusterLab, name: &str, class: &str, cel: &str) {
    let extra = [format!("selectors: [{{cel: {{expression: '{cel}'}}}}]")];
    lab.apply(&cluster::claim_template_of("default", name, class, &extra));
    lab.apply(&cluster::claim_pod("default", name, name));
}

/// The device the claim of `pod` was allocated.
fn allocated(lab: &ClusterLab, pod: &str) -> String {
    eventually_or(
        &format!("the claim of pod {pod} allocated"),
        || {
            let claims = lab.get_json(&["get", "resourceclaims"])?;
            claims["items"]
                .as_array()?
                .iter()
                .find(|c| c["metadata"]["ownerReferences"][0]["name"] == pod)
                .and_then(|c| c["status"]["allocation"]["devices"]["results"][0]["device"].as_str())
                .map(String::from)
        },
        || lab.describe_pod(pod),
    )
}

/// The MIG UUID the container got (`GPUPLANE_DEVICE_<key>=...,uuid=MIG-...`).
fn mig_uuid(env: &[String]) -> String {
    env.iter()
        .filter_map(|l| l.strip_prefix("GPUPLANE_DEVICE_")?.split_once('='))
        .find_map(|(_, v)| v.split(',').find_map(|kv| kv.strip_prefix("uuid=")))
        .filter(|u| u.starts_with("MIG-"))
        .unwrap_or_else(|| panic!("no MIG device in {env:?}"))
        .to_string()
}

/// `gpuplane_dynamic_mig_instances{gpu}` as the agent reports it: GPU index -> instances.
fn instances(lab: &ClusterLab) -> Vec<(u32, u64)> {
    let out = lab
        .in_netns("curl")
        .args(["-sf", &format!("http://{METRICS}/metrics")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("gpuplane_dynamic_mig_instances{gpu=\"")?;
            let (gpu, n) = rest.split_once("\"} ")?;
            Some((gpu.parse().ok()?, n.trim().parse().ok()?))
        })
        .collect()
}

fn delete_pod(lab: &ClusterLab, name: &str) {
    lab.kubectl_ok(&["delete", "pod", name, "--wait=true"]);
}

const PROFILE_IS: &str = "device.attributes[\"gpu.gpuplane.dev\"].profile";
const PARENT_IS: &str = "device.attributes[\"gpu.gpuplane.dev\"].parentIndex";
const START_IS: &str = "device.attributes[\"gpu.gpuplane.dev\"].placementStart";

#[test]
fn the_scheduler_packs_instances_by_the_counters_and_the_agent_makes_and_unmakes_them() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let _agent = start_agent(&lab);
    let devices = eventually("the dynamic GPUs' devices in lab-node's slices", || {
        let d = cluster::node_devices(&lab);
        d.iter()
            .any(|d| d["name"] == "gpu-1-mig-1g10gb-at6")
            .then_some(d)
    });

    every_kind_of_gpu_publishes(&lab, &devices);

    // 3g.40gb at slice 4 of GPU 0, then a 4g.40gb there too: they fit together.
    pod(
        &lab,
        "three",
        "mig.gpuplane.dev",
        &format!("{PROFILE_IS} == \"3g.40gb\" && {PARENT_IS} == 0 && {START_IS} == 4"),
    );
    pod(
        &lab,
        "four",
        "mig.gpuplane.dev",
        &format!("{PROFILE_IS} == \"4g.40gb\" && {PARENT_IS} == 0"),
    );
    cluster::wait_running(&lab, "default", "three");
    cluster::wait_running(&lab, "default", "four");
    assert_eq!(allocated(&lab, "three"), "gpu-0-mig-3g40gb-at4");
    assert_eq!(allocated(&lab, "four"), "gpu-0-mig-4g40gb-at0");
    let (a, b) = (
        mig_uuid(&cluster::pod_env(&lab, "three")),
        mig_uuid(&cluster::pod_env(&lab, "four")),
    );
    assert_ne!(a, b, "each container sees its own new instance");

    // GPU 0 is full: a 1g.10gb anywhere lands on GPU 1.
    pod(
        &lab,
        "one",
        "mig.gpuplane.dev",
        &format!("{PROFILE_IS} == \"1g.10gb\""),
    );
    cluster::wait_running(&lab, "default", "one");
    assert!(
        allocated(&lab, "one").starts_with("gpu-1-mig-1g10gb-at"),
        "{}",
        allocated(&lab, "one")
    );
    assert_eq!(instances(&lab), [(0, 2), (1, 1)]);

    // GPU 1 whole waits while an instance is on it.
    pod(
        &lab,
        "whole",
        "gpu.gpuplane.dev",
        "device.attributes[\"gpu.gpuplane.dev\"].index == 1",
    );
    eventually_or(
        "the whole-GPU pod unschedulable",
        || cluster::unschedulable_reason(&lab, "whole"),
        || lab.describe_pod("whole"),
    );
    delete_pod(&lab, "one");
    cluster::wait_running(&lab, "default", "whole");
    assert_eq!(allocated(&lab, "whole"), "gpu-1");
    let full = mig_uuid(&cluster::pod_env(&lab, "whole"));
    assert!(
        full.starts_with("MIG-"),
        "the whole GPU is its full instance"
    );

    for p in ["three", "four", "whole"] {
        delete_pod(&lab, p);
    }
    eventually("no instance left once the pods are gone", || {
        (instances(&lab) == [(0, 0), (1, 0)]).then_some(())
    });
}

/// All three kinds of GPU publish: counter sets in a slice of their own, placements consuming
/// them (in `devices`), the static MIG GPU's instances, the MIG-off GPU whole.
fn every_kind_of_gpu_publishes(lab: &ClusterLab, devices: &[Value]) {
    let slices = cluster::node_slices(lab);
    let sets: BTreeSet<String> = slices
        .iter()
        .flat_map(|s| {
            s["spec"]["sharedCounters"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|c| c["name"].as_str().map(String::from))
        .collect();
    assert_eq!(
        sets,
        BTreeSet::from(["gpu-0".to_string(), "gpu-1".to_string()])
    );
    assert!(
        slices
            .iter()
            .all(|s| s["spec"]["sharedCounters"].is_null() || s["spec"]["devices"].is_null()),
        "counter sets are in slices without devices"
    );
    let names: BTreeSet<String> = devices
        .iter()
        .filter_map(|d| d["name"].as_str().map(String::from))
        .collect();
    for want in [
        "gpu-0",
        "gpu-0-mig-3g40gb-at4",
        "gpu-0-mig-4g40gb-at0",
        "gpu-3",
    ] {
        assert!(names.contains(want), "{want} in {names:?}");
    }
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("gpu-2-mig-") && !n.contains("-at")),
        "the static MIG GPU publishes its instances: {names:?}"
    );
    let placed = devices
        .iter()
        .find(|d| d["name"] == "gpu-0-mig-3g40gb-at4")
        .unwrap();
    assert_eq!(attr(placed, "profile"), "3g.40gb");
    assert_eq!(attr(placed, "placementStart"), 4);
    assert!(placed["consumesCounters"][0]["counterSet"] == "gpu-0");
}
