//! The explainer's Unhealthy and Topology reasons produced by real situations (issue 26): a
//! kubelet with `topologyManagerPolicy: single-numa-node` refusing a pod the scheduler placed,
//! and an Xid making a GPU unhealthy for the kubelet and the slices. Each is checked where users
//! see it: the pod condition, one Event, `gpuplane explain pod` and the controller's metric.
//! Skips like tests/lab/real_cluster.rs (root and the cluster binaries needed), fails instead
//! under `CI`.

use crate::cluster;
use crate::cluster::{eventually, refusals, start_controller, ClusterLab, LabAgent, NODE};
use crate::real_cluster::{allocatable_gpus, claim_pod, explain, wait_phase, xid_agent};
use crate::real_cluster_quota::{controller_metrics, pod_json};
use serde_json::Value;

const CONDITION: &str = "gpuplane.dev/GPUsAvailable";

fn sleeping(name: &str, gpus: u32) -> String {
    cluster::gpu_pod("default", name, gpus, r#"["sleep", "3600"]"#)
}

/// Pod `default/pod` carries `reason` with `message` in its condition, in one Warning Event
/// and in `gpuplane explain pod` (which reads it from the condition).
fn shown(lab: &ClusterLab, pod: &str, reason: &str, message: &str) {
    let cond = eventually(&format!("the {reason} condition on pod {pod}"), || {
        let p = pod_json(lab, "default", pod)?;
        let conds = p["status"]["conditions"].as_array()?.clone();
        conds
            .into_iter()
            .find(|c| c["type"] == CONDITION && c["reason"] == reason && c["message"] == message)
    });
    assert_eq!(cond["status"], "False", "{cond}");
    let events = eventually(&format!("a {reason} Event for pod {pod}"), || {
        let items = cluster::pod_events(lab, "default", pod, reason);
        (!items.is_empty()).then_some(items)
    });
    assert_eq!(events.len(), 1, "one Event per reason: {events:?}");
    assert_eq!(events[0]["type"], "Warning", "{:?}", events[0]);
    let cli = explain(lab, &["pod", &format!("default/{pod}")]).unwrap();
    assert_eq!(
        (&cli["reason"], &cli["message"], &cli["source"]),
        (
            &Value::from(reason),
            &Value::from(message),
            &Value::from("controller")
        ),
        "{cli}"
    );
}

/// Waits for `gpuplane_pending_gpu_pods{reason} n` on the controller's metrics.
fn pending_metric(lab: &ClusterLab, reason: &str, n: u64) {
    let line = format!("gpuplane_pending_gpu_pods{{reason=\"{reason}\"}} {n}");
    eventually(&line, || {
        controller_metrics(lab)
            .lines()
            .any(|l| l == line)
            .then_some(())
    });
}

/// The lab's kubelet runs the topology manager's `single-numa-node` policy; the simulated
/// dgx-h100 reports its GPUs on NUMA nodes 0 and 1 through ListAndWatch. The lab machine has
/// one NUMA node, so the kubelet's device manager finds only NUMA node 0's four GPUs in any
/// NUMA mask, as a real two-node machine finds at most four on one: five GPUs cannot be
/// aligned. The scheduler counts eight free and binds the pod; the kubelet refuses it
/// (Failed, TopologyAffinityError), and the explainer says so with the free GPUs per NUMA node
/// from the slices. Four GPUs fit one NUMA node and run; the numbers then follow.
#[test]
fn a_pod_the_kubelet_refuses_for_numa_alignment_is_explained_as_topology() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    lab.configure_kubelet("topologyManagerPolicy: single-numa-node\n");
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    eventually("node lab-node to report nvidia.com/gpu: 8", || {
        (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(())
    });
    lab.create(&sleeping("five", 5), &[]).unwrap();
    let status = eventually("the kubelet to refuse pod five", || {
        let p = pod_json(&lab, "default", "five")?;
        (p["status"]["phase"] == "Failed").then(|| p["status"].clone())
    });
    assert_eq!(status["reason"], "TopologyAffinityError", "{status}");
    let message = |free: &str, most: u32| {
        format!("the kubelet on {NODE} refused it (TopologyAffinityError): its topology manager could not put 5 nvidia.com/gpu on one NUMA node, which the scheduler does not see; free GPUs on {NODE} by NUMA node: {free}; ask for at most {most} there, or through a ResourceClaim with a matchAttribute constraint on resource.kubernetes.io/numaNode, which the scheduler does see")
    };
    shown(&lab, "five", "Topology", &message("0: 4, 1: 4", 4));
    pending_metric(&lab, "Topology", 1);
    let all = explain(&lab, &["namespace", "default"]).unwrap();
    assert_eq!(all.as_array().map(Vec::len), Some(1), "{all}");
    assert_eq!(all[0]["reason"], "Topology", "{all}");

    // Four fit NUMA node 0: the kubelet admits them, and the answer's numbers follow.
    lab.create(&sleeping("four", 4), &[]).unwrap();
    wait_phase(&lab, "four", &["Running"]);
    shown(&lab, "five", "Topology", &message("0: 0, 1: 4", 4));
    lab.kubectl_ok(&["delete", "pod", "five", "--wait=true"]);
    pending_metric(&lab, "Topology", 0);
    let log = controller.log_text();
    assert!(
        refusals(&log).is_empty(),
        "the controller was refused a call:\n{log}"
    );
}

/// An Xid through the real kubelet (fake libnvidia-ml serving dgx-h100): GPU 3 unhealthy, so
/// the kubelet offers 7 of 8 and the slices taint gpu-3 `xid-48`. A pod asking 8 and a claim
/// asking for GPU 3 are Unhealthy, naming the GPU and the Xid. After the quiet period GPU 3
/// recovers and the pod asking 8 is scheduled.
#[test]
fn gpus_made_unhealthy_by_an_xid_are_named_for_the_pods_they_keep_pending() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let (_agent, control) = xid_agent(&lab, &installed.agent, "90s");
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    eventually("node lab-node to report nvidia.com/gpu: 8", || {
        (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(())
    });
    let gpu3 = gpuplane_model::sim::load("dgx-h100").unwrap().gpus[3]
        .uuid
        .to_string();
    std::fs::write(&control, "xid 3 48\n").unwrap();
    eventually(
        "the kubelet to count GPU 3 unhealthy (allocatable 7)",
        || (allocatable_gpus(&lab).as_deref() == Some("7")).then_some(()),
    );
    lab.create(&sleeping("eight", 8), &[]).unwrap();
    claim_pod(
        &lab,
        "wants-gpu-3",
        1,
        &format!("device.attributes['gpu.gpuplane.dev'].uuid == '{gpu3}'"),
    );
    shown(
        &lab,
        "eight",
        "Unhealthy",
        &format!("needs 8 nvidia.com/gpu; 7 free on nodes it may use; 1 more unhealthy: {NODE} gpu-3 (xid-48)"),
    );
    shown(
        &lab,
        "wants-gpu-3",
        "Unhealthy",
        &format!("request gpu needs 1 device(s) of DeviceClass gpu.gpuplane.dev; 0 of the 1 matching free and untainted; 1 more tainted: {NODE}/gpu-3 gpu.gpuplane.dev/unhealthy=xid-48:NoSchedule"),
    );
    pending_metric(&lab, "Unhealthy", 2);

    // The claim pod goes; GPU 3 recovers after the quiet period and eight is scheduled.
    lab.kubectl_ok(&["delete", "pod", "wants-gpu-3", "--wait=true"]);
    wait_phase(&lab, "eight", &["Running"]);
    eventually("the condition on eight to turn True (Scheduled)", || {
        let p = pod_json(&lab, "default", "eight")?;
        p["status"]["conditions"].as_array()?.iter().find(|c| {
            c["type"] == CONDITION && c["status"] == "True" && c["reason"] == "Scheduled"
        })?;
        Some(())
    });
    pending_metric(&lab, "Unhealthy", 0);
    let log = controller.log_text();
    assert!(
        refusals(&log).is_empty(),
        "the controller was refused a call:\n{log}"
    );
}
