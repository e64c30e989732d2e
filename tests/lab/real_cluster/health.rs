//! An Xid makes a GPU unhealthy for the kubelet and the scheduler until it recovers, and an
//! admin drains a GPU with a DeviceTaintRule.

use super::*;

/// An Xid through the real kubelet and scheduler: the agent on the real NVML code path (the
/// fake libnvidia-ml serving dgx-h100, real character device nodes) reports a critical Xid on
/// GPU 3; the kubelet marks it unhealthy (allocatable 7), the ResourceSlice taint keeps the
/// scheduler from allocating it to a claim (Pending with the scheduler's reason); after the
/// quiet period it recovers: the taint goes, the waiting claim is allocated it, and once that
/// claim is gone the kubelet counts all eight healthy.
#[test]
fn an_xid_makes_a_gpu_unhealthy_for_the_kubelet_and_the_scheduler_until_it_recovers() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let kubeconfig = lab.install_agent_identity();
    // Long enough for the kubelet's node status (every 10 s) and the scheduler to see it.
    let (_agent, control) = xid_agent(&lab, &kubeconfig, "60s");
    wait_registered(&lab);
    let gpu3 = gpuplane_model::sim::load("dgx-h100").unwrap().gpus[3]
        .uuid
        .to_string();
    let unhealthy = |lab: &ClusterLab| {
        slice_devices(lab)
            .iter()
            .filter(|(_, d)| {
                d["taints"].as_array().is_some_and(|t| {
                    t.iter().any(|t| {
                        t["key"] == "gpu.gpuplane.dev/unhealthy" && t["effect"] == "NoSchedule"
                    })
                })
            })
            .filter_map(|(_, d)| attr_string(d, "uuid"))
            .collect::<BTreeSet<String>>()
    };

    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&control)
        .unwrap();
    writeln!(f, "xid 3 48").unwrap();
    eventually(
        "the kubelet to count GPU 3 unhealthy (allocatable 7)",
        || (allocatable_gpus(&lab).as_deref() == Some("7")).then_some(()),
    );
    eventually("the slice to taint GPU 3 unhealthy", || {
        (unhealthy(&lab) == BTreeSet::from([gpu3.clone()])).then_some(())
    });
    claim_pod(
        &lab,
        "wants-gpu-3",
        1,
        &format!("device.attributes['gpu.gpuplane.dev'].uuid == '{gpu3}'"),
    );
    let reason = eventually("the scheduler's reason for wants-gpu-3", || {
        cluster::unschedulable_reason(&lab, "wants-gpu-3")
    });
    assert!(reason.contains("claim"), "{reason}");

    // Recovery after the quiet period: the taint goes and the waiting claim is allocated
    // GPU 3 at once, so the device plugin keeps it withdrawn (one inventory) ...
    eventually("the unhealthy taint to go", || {
        unhealthy(&lab).is_empty().then_some(())
    });
    eventually("the waiting claim pod to be scheduled", || {
        let pod = lab.get_json(&["get", "pod", "wants-gpu-3"])?;
        (pod["spec"]["nodeName"] == NODE).then_some(())
    });
    eventually(
        "GPU 3 withdrawn from the device plugin while the claim holds it",
        || (allocatable_gpus(&lab).as_deref() == Some("7")).then_some(()),
    );
    // Health in pod status (ResourceHealthStatus, fed by our dra-health stream): an Xid on the
    // prepared GPU shows in the container's allocatedResourcesStatus as the kubelet reports
    // it, and recovery clears it.
    wait_phase(&lab, "wants-gpu-3", &["Running"]);
    let health = |lab: &ClusterLab| -> Option<String> {
        let pod = lab.get_json(&["get", "pod", "wants-gpu-3"])?;
        let statuses = pod["status"]["containerStatuses"][0]["allocatedResourcesStatus"]
            .as_array()?
            .clone();
        let claim = statuses
            .iter()
            .find(|s| s["name"].as_str().is_some_and(|n| n.starts_with("claim:")))?;
        claim["resources"][0]["health"].as_str().map(String::from)
    };
    eventually("the pod status to report its GPU healthy", || {
        (health(&lab).as_deref() == Some("Healthy")).then_some(())
    });
    writeln!(f, "xid 3 48").unwrap();
    eventually("the pod status to report its GPU unhealthy", || {
        (health(&lab).as_deref() == Some("Unhealthy")).then_some(())
    });
    eventually(
        "the pod status to report its GPU healthy after recovery",
        || (health(&lab).as_deref() == Some("Healthy")).then_some(()),
    );
    // ... until the claim is gone: then the kubelet counts all eight healthy again.
    lab.kubectl_ok(&[
        "delete",
        "pod",
        "wants-gpu-3",
        "--wait=true",
        "--timeout=120s",
    ]);
    eventually(
        "the kubelet to count GPU 3 healthy again (allocatable 8)",
        || (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(()),
    );
}

/// Draining a GPU is the admin's call, with a `DeviceTaintRule` (docs/dra.md, "Taints"): a
/// `NoExecute` rule on one device makes the real eviction controller delete the pod whose claim
/// holds it and the real scheduler keep new claims off it, until the rule is deleted.
#[test]
fn an_admin_drains_a_gpu_with_a_device_taint_rule() {
    let Some((lab, _kc, _agent)) = lab_with_agent() else {
        return;
    };
    let gpu5 = gpuplane_model::sim::load("dgx-h100").unwrap().gpus[5]
        .uuid
        .clone();
    let on_gpu5 = format!("device.attributes['gpu.gpuplane.dev'].uuid == '{gpu5}'");
    claim_pod(&lab, "on-gpu-5", 1, &on_gpu5);
    wait_phase(&lab, "on-gpu-5", &["Running"]);
    lab.apply(&format!(
        r#"apiVersion: resource.k8s.io/v1
kind: DeviceTaintRule
metadata: {{name: drain-gpu-5}}
spec:
  deviceSelector: {{driver: {DRIVER}, pool: {NODE}, device: gpu-5}}
  taint: {{key: example.com/maintenance, value: drain, effect: NoExecute}}
"#
    ));
    eventually_or(
        "the eviction controller to delete the pod on the drained GPU",
        || {
            let gone = match lab.get_json(&["get", "pod", "on-gpu-5"]) {
                None => true,
                Some(p) => !p["metadata"]["deletionTimestamp"].is_null(),
            };
            gone.then_some(())
        },
        || lab.describe_pod("on-gpu-5"),
    );
    lab.kubectl_ok(&[
        "delete",
        "pod",
        "on-gpu-5",
        "--ignore-not-found",
        "--wait=true",
    ]);
    claim_pod(&lab, "wants-gpu-5", 1, &on_gpu5);
    let reason = eventually("the scheduler's reason for wants-gpu-5", || {
        cluster::unschedulable_reason(&lab, "wants-gpu-5")
    });
    assert!(reason.contains("claim"), "{reason}");
    lab.kubectl_ok(&["delete", "devicetaintrule", "drain-gpu-5"]);
    wait_phase(&lab, "wants-gpu-5", &["Running"]);
}
