//! `gpuplane explain` names capacity and placement with the numbers the scheduler acts on.

use super::*;

/// Waits until the real scheduler has reported pod `name` unschedulable.
fn wait_unschedulable(lab: &ClusterLab, name: &str) {
    eventually(
        &format!("the scheduler to report pod {name} unschedulable"),
        || {
            let pod = lab.get_json(&["get", "pod", name])?;
            pod["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
                .then_some(())
        },
    );
}

/// `gpuplane explain` against the real scheduler's cluster: a pod asking more GPUs than are
/// free is Capacity with the numbers, a pod whose node selector excludes the only GPU node is
/// Placement naming the selector, a claim no published device matches is Selector naming what
/// exists, the namespace view lists them all, and a missing pod is a clear error. The numbers follow the cluster: once the pod holding GPUs ends, the answer changes.
#[test]
fn explain_names_capacity_and_placement_with_the_numbers_the_scheduler_acts_on() {
    let Some((lab, _, _agent)) = lab_with_agent() else {
        return;
    };
    lab.apply(&cluster::sleeping_gpu_pod("default", "holder", 6, "", ""));
    wait_phase(&lab, "holder", &["Running"]);
    lab.apply(&cluster::sleeping_gpu_pod("default", "four", 4, "", ""));
    lab.apply(&cluster::sleeping_gpu_pod(
        "default",
        "elsewhere",
        1,
        "",
        "  nodeSelector: {gpu-pool: b}\n",
    ));
    wait_unschedulable(&lab, "four");
    wait_unschedulable(&lab, "elsewhere");

    let four = explain(&lab, &["pod", "default/four"]).unwrap();
    assert_eq!(four["reason"], "Capacity", "{four}");
    assert_eq!(
        four["message"],
        "needs 4 nvidia.com/gpu; 2 free in the cluster"
    );
    let elsewhere = explain(&lab, &["pod", "default/elsewhere"]).unwrap();
    assert_eq!(elsewhere["reason"], "Placement", "{elsewhere}");
    assert_eq!(
        elsewhere["message"],
        format!("needs 1 nvidia.com/gpu; 2 free in the cluster, 0 on nodes it may use; excluded: {NODE}: nodeSelector gpu-pool=b not matched")
    );
    // A claim no published device can satisfy: the request, the expression, what exists.
    let want = "device.attributes['gpu.gpuplane.dev'].productName == 'NVIDIA B200'";
    lab.apply(&format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: b200, namespace: default}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpuplane.dev
          selectors: [{{cel: {{expression: "{want}"}}}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: b200, namespace: default}}
spec:
  terminationGracePeriodSeconds: 1
  resourceClaims: [{{name: gpu, resourceClaimTemplateName: b200}}]
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sleep", "3600"]
    resources:
      claims: [{{name: gpu}}]
"#
    ));
    wait_unschedulable(&lab, "b200");
    let b200 = explain(&lab, &["pod", "default/b200"]).unwrap();
    assert_eq!(b200["reason"], "Selector", "{b200}");
    assert_eq!(
        b200["message"],
        format!("request gpu: no device of DeviceClass gpu.gpuplane.dev matches {want}; this cluster has NVIDIA H100 80GB HBM3 x 8")
    );
    let all = explain(&lab, &["namespace", "default"]).unwrap();
    let reasons: Vec<(&str, &str)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["pod"].as_str().unwrap(), a["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("b200", "Selector"),
            ("elsewhere", "Placement"),
            ("four", "Capacity")
        ]
    );
    let missing = explain(&lab, &["pod", "default/nope"]).unwrap_err();
    assert!(missing.contains("pod default/nope not found"), "{missing}");

    // The holder ends: 8 free, the scheduler places `four`, and `explain` says it waits no more.
    lab.kubectl_ok(&["delete", "pod", "holder", "--wait=false"]);
    wait_phase(&lab, "four", &["Running"]);
    let four = explain(&lab, &["pod", "default/four"]).unwrap();
    assert_eq!(four["reason"], "NotWaiting", "{four}");
    assert_eq!(four["message"], format!("scheduled to node {NODE}"));
}
