//! Issue 26 on several nodes: why a GPU pod is Pending when the answer depends on more than
//! one node. Three nodes: lab-node runs the real agent (the simulated dgx-h100, 8 GPUs, both
//! APIs); lab-node-2 and lab-node-3 advertise 4 `nvidia.com/gpu` each as Kubernetes documents
//! for extended resources (a node status patch; the kubelet keeps it and admits pods against
//! it) and carry another product label, so they form a second node pool. The real scheduler
//! places the pods; the controller explains the rest.

use crate::cluster::{
    self, eventually, eventually_or, refusals, start_controller, ClusterLab, LabAgent,
    CONTROLLER_METRICS_ADDR, DRIVER, NODE,
};
use serde_json::Value;

/// The product label of the two advertised nodes: their node pool.
const A100: &str = "NVIDIA-A100-SXM4-80GB";

/// A sleeping pod asking `gpus` GPUs, pinned to `node` when given.
fn pod(ns: &str, name: &str, gpus: u32, node: Option<&str>, meta: &str) -> String {
    let pin = node
        .map(|n| format!("  nodeSelector: {{kubernetes.io/hostname: {n}}}\n"))
        .unwrap_or_default();
    cluster::sleeping_gpu_pod(ns, name, gpus, meta, &pin)
}

fn metrics(lab: &ClusterLab) -> String {
    let out = lab
        .in_netns("curl")
        .args(["-sf", &format!("http://{CONTROLLER_METRICS_ADDR}/metrics")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `metrics` carries `line`.
fn wait_metric(lab: &ClusterLab, line: &str) {
    eventually_or(
        &format!("metric line {line}"),
        || metrics(lab).lines().any(|l| l == line).then_some(()),
        || metrics(lab),
    );
}

/// Our condition on pod `ns/name` once its reason is `reason`.
fn condition(lab: &ClusterLab, ns: &str, name: &str, reason: &str) -> Value {
    eventually_or(
        &format!("pod {ns}/{name}'s GPUsAvailable condition to say {reason}"),
        || {
            let p = lab.get_json(&["get", "pod", name, "-n", ns])?;
            p["status"]["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == "gpuplane.dev/GPUsAvailable" && c["reason"] == reason)
                .cloned()
        },
        || lab.describe_pod_in(ns, name),
    )
}

/// `gpuplane explain pod NS/NAME -o json` in the lab.
fn explain(lab: &ClusterLab, target: &str) -> Value {
    crate::cluster::gpuplane_json(lab, &["explain", "pod", target, "-o", "json"])
}

/// Advertises 4 `nvidia.com/gpu` on `node` and labels it as an A100 node.
fn advertise(lab: &ClusterLab, node: &str) {
    let gpus =
        r#"{"status":{"capacity":{"nvidia.com/gpu":"4"},"allocatable":{"nvidia.com/gpu":"4"}}}"#;
    lab.kubectl_ok(&[
        "patch",
        "node",
        node,
        "--subresource=status",
        "--type=merge",
        "-p",
        gpus,
    ]);
    let product = format!("nvidia.com/gpu.product={A100}");
    lab.kubectl_ok(&["label", "node", node, &product, "nvidia.com/gpu.count=4"]);
}

/// Fragmentation, then the pod scheduling once one node has enough; a pod group held at the
/// quota gate as Gang; the agent stopped as NoGPUCapacity naming its node, for a device-plugin
/// pod and (its ResourceSlices gone) for a claim, and started again.
/// Each with the condition, the Event, `gpuplane explain` and the metrics.
#[test]
fn fragmentation_gang_and_a_stopped_agent_each_carry_their_reason_and_numbers() {
    let Some(lab) = ClusterLab::start_nodes(3) else {
        return;
    };
    let installed = lab.install(true);
    let agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    for node in ["lab-node-2", "lab-node-3"] {
        advertise(&lab, node);
    }
    eventually("every node to offer its nvidia.com/gpu", || {
        let nodes = lab.get_json(&["get", "nodes"])?;
        let offered: Vec<&Value> = nodes["items"]
            .as_array()?
            .iter()
            .map(|n| &n["status"]["allocatable"]["nvidia.com/gpu"])
            .collect();
        (offered.len() == 3 && offered.iter().all(|g| *g == "8" || *g == "4")).then_some(())
    });

    fragmentation_until_one_node_has_enough(&lab);
    gang(&lab);

    // The agent stops: lab-node offers none, and the 2 free on lab-node-3 are not enough for
    // 4 while lab-node would have 2 more. Started again: fragmentation across the two.
    agent.stop();
    lab.apply(&pod("default", "again", 4, None, ""));
    let cond = condition(&lab, "default", "again", "NoGPUCapacity");
    let message = cond["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(
            "needs 4 nvidia.com/gpu; 2 free in the cluster; GPU nodes offering none: lab-node: nvidia.com/gpu "
        ),
        "{cond}"
    );
    assert_eq!(explain(&lab, "default/again")["reason"], "NoGPUCapacity");
    // The Event follows the condition (new reasons are written before Events).
    let evs = eventually("a NoGPUCapacity Event on pod again", || {
        let e = cluster::pod_events(&lab, "default", "again", "NoGPUCapacity");
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(evs.len(), 1, "{evs:?}");
    wait_metric(
        &lab,
        "gpuplane_pending_gpu_pods{reason=\"NoGPUCapacity\"} 1",
    );
    claims_with_the_agent_down(&lab);
    let _agent = LabAgent::start(&lab, &installed.agent, "2");
    let cond = condition(&lab, "default", "again", "Fragmentation");
    assert_eq!(
        cond["message"],
        "needs 4 nvidia.com/gpu; 4 free across 2 nodes, at most 2 on one: lab-node 2, lab-node-3 2",
        "{cond}"
    );
    wait_metric(
        &lab,
        "gpuplane_pending_gpu_pods{reason=\"NoGPUCapacity\"} 0",
    );
    let log = controller.log_text();
    assert!(
        refusals(&log).is_empty(),
        "the controller was refused a call:\n{log}"
    );
}

/// 2 free on each node: 6 in all, none with 4; a pod of 4 waits as Fragmentation (condition,
/// Event, `gpuplane explain`, metrics) until h2 ends and lab-node-2 has 4 free.
fn fragmentation_until_one_node_has_enough(lab: &ClusterLab) {
    // 2 free on each node: 6 in all, none with 4.
    for (name, gpus, node) in [
        ("h1", 6, NODE),
        ("h2", 2, "lab-node-2"),
        ("h3", 2, "lab-node-3"),
    ] {
        lab.apply(&pod("default", name, gpus, Some(node), ""));
    }
    for name in ["h1", "h2", "h3"] {
        cluster::wait_running(lab, "default", name);
    }
    lab.apply(&pod("default", "four", 4, None, ""));
    let frag = "needs 4 nvidia.com/gpu; 6 free across 3 nodes, at most 2 on one: lab-node 2, lab-node-2 2, lab-node-3 2";
    let cond = condition(lab, "default", "four", "Fragmentation");
    assert_eq!(
        (&cond["status"], &cond["message"]),
        (&"False".into(), &frag.into()),
        "{cond}"
    );
    let evs = eventually("a Fragmentation Event on pod four", || {
        let e = cluster::pod_events(lab, "default", "four", "Fragmentation");
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(
        (evs.len(), &evs[0]["type"]),
        (1, &"Warning".into()),
        "{evs:?}"
    );
    let cli = explain(lab, "default/four");
    assert_eq!(
        (&cli["reason"], &cli["message"]),
        (&"Fragmentation".into(), &frag.into()),
        "{cli}"
    );
    wait_metric(lab, "gpuplane_pending_gpu_pods{reason=\"Fragmentation\"} 1");
    let pool = format!("pool=\"{A100}\",resource=\"nvidia.com/gpu\"");
    wait_metric(lab, &format!("gpuplane_node_pool_free_gpus{{{pool}}} 4"));
    wait_metric(
        lab,
        &format!("gpuplane_node_pool_fragmentation_ratio{{{pool}}} 0.5"),
    );

    // h2 ends: lab-node-2 has 4 free, the scheduler places `four` there.
    lab.kubectl_ok(&["delete", "pod", "h2", "--wait=true"]);
    let cond = condition(lab, "default", "four", "Scheduled");
    assert_eq!(cond["status"], "True", "{cond}");
    assert_eq!(explain(lab, "default/four")["reason"], "NotWaiting");
    wait_metric(lab, "gpuplane_pending_gpu_pods{reason=\"Fragmentation\"} 0");
    wait_metric(
        lab,
        &format!("gpuplane_node_pool_fragmentation_ratio{{{pool}}} 0.0"),
    );
}

/// A pod group of 3 in a Queue-mode namespace whose GpuQuota allows 2 GPUs: 2 members are
/// Gang waiting for the third; with all 3 there, Gang with what they ask together and why
/// the queue holds them (3 GPUs can never fit in 2).
fn gang(lab: &ClusterLab) {
    lab.kubectl_ok(&["create", "namespace", "gang"]);
    lab.apply(
        r#"apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: default, namespace: gang}
spec:
  hard: {gpus: 2}
  mode: Queue
"#,
    );
    let member = |name: &str| {
        let meta = "  labels: {quota.gpuplane.dev/pod-group: train}\n  annotations: {quota.gpuplane.dev/pod-group-size: \"3\"}\n";
        pod("gang", name, 1, None, meta)
    };
    // The webhook gates pods once its cache holds the quota.
    eventually("the webhook to gate the group's first member", || {
        let p = lab.create(&member("m0"), &[]).ok()?;
        if p["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| !g.is_empty())
        {
            return Some(());
        }
        lab.kubectl_ok(&["delete", "pod", "-n", "gang", "m0", "--wait=true"]);
        None
    });
    lab.apply(&member("m1"));
    // m0 said "1 of 3" before m1 existed; a new message under the same reason is written
    // within the explainer's refresh period (10 s), so wait for it.
    let head = "pod group gang/train: 2 of 3 members exist, 2 held at the quota gate";
    let want = format!("{head}; none is released until the other 1 exist");
    eventually_or(
        "m0's Gang condition to count m1",
        || (condition(lab, "gang", "m0", "Gang")["message"] == want.as_str()).then_some(()),
        || lab.describe_pod_in("gang", "m0"),
    );
    assert_eq!(explain(lab, "gang/m1")["reason"], "Gang");
    wait_metric(lab, "gpuplane_pending_gpu_pods{reason=\"Gang\"} 2");
    lab.apply(&member("m2"));
    let cond = eventually_or(
        "m2's Gang condition to quote the quota",
        || {
            let c = condition(lab, "gang", "m2", "Gang");
            c["message"]
                .as_str()?
                .contains("can never be admitted")
                .then_some(c)
        },
        || lab.describe_pod_in("gang", "m2"),
    );
    let message = cond["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("pod group gang/train, position 1 of 1 in namespace gang's queue: 3 of 3 members exist, 3 held at the quota gate, asking together 3 nvidia.com/gpu ("),
        "{cond}"
    );
    assert!(
        message.contains("; released together once the quota admits all: can never be admitted: "),
        "{cond}"
    );
    let evs = eventually("a Gang Event on pod m2", || {
        let e = cluster::pod_events(lab, "gang", "m2", "Gang");
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(
        (evs.len(), &evs[0]["type"]),
        (1, &"Normal".into()),
        "{evs:?}"
    );
    wait_metric(lab, "gpuplane_pending_gpu_pods{reason=\"Gang\"} 3");
    lab.kubectl_ok(&["delete", "namespace", "gang", "--wait=true"]);
}

/// With the agent stopped the kubelet deletes its ResourceSlices: a claim for one GPU is
/// NoGPUCapacity naming the GPU nodes that publish none (lab-node, whose agent stopped, and the
/// two advertised nodes, which never ran a DRA driver).
fn claims_with_the_agent_down(lab: &ClusterLab) {
    eventually("lab-node's ResourceSlices gone", || {
        cluster::node_slices(lab).is_empty().then_some(())
    });
    lab.apply(&cluster::claim_template("default", "one", &[]));
    lab.apply(&cluster::claim_pod("default", "claimer", "one"));
    let cond = condition(lab, "default", "claimer", "NoGPUCapacity");
    let why = "no ResourceSlice (DRA driver not registered: agent stopped or driver down)";
    assert_eq!(
        cond["message"],
        format!(
            "request gpu: no device of DeviceClass {DRIVER} is published; GPU nodes offering none: lab-node: {why}; lab-node-2: {why}; lab-node-3: {why}"
        ),
        "{cond}"
    );
    wait_metric(lab, "gpuplane_pending_gpu_pods{reason=\"NoGPUCapacity\"} 2");
    lab.kubectl_ok(&["delete", "pod", "claimer", "--wait=true"]);
}
