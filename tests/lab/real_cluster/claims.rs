//! DRA claims through the real kubelet and scheduler: prepared and unprepared, one inventory
//! across both APIs, and a killed agent that restarts without handing out a held GPU.

use super::*;

#[test]
fn a_dra_claim_is_prepared_and_unprepared_by_the_real_kubelet() {
    let Some((lab, _kc, _agent)) = lab_with_agent() else {
        return;
    };
    lab.apply(&format!(
        "{}---\n{}",
        cluster::ONE_GPU_TEMPLATE,
        r#"apiVersion: v1
kind: Pod
metadata: {name: dra-pod, namespace: default}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
  - {name: gpu, resourceClaimTemplateName: one-gpu}
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sh", "-c", "env; sleep 3600"]
    resources:
      claims: [{name: gpu}]
"#
    ));
    wait_phase(&lab, "dra-pod", &["Running"]);
    let pod = lab.get_json(&["get", "pod", "dra-pod"]).unwrap();
    assert_eq!(pod["spec"]["nodeName"], NODE);
    let claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .unwrap_or_else(|| panic!("no generated claim in {}", pod["status"]))
        .to_string();
    let claim = lab
        .get_json(&["get", "resourceclaim", &claim_name])
        .unwrap();
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        results.len(),
        1,
        "one device allocated: {}",
        claim["status"]
    );
    assert_eq!(results[0]["driver"], DRIVER);
    assert_eq!(results[0]["pool"], NODE);
    let allocated = results[0]["device"].as_str().unwrap().to_string();
    let devices = slice_devices(&lab);
    let (_, device) = devices
        .iter()
        .find(|(n, _)| *n == allocated)
        .unwrap_or_else(|| panic!("allocated device {allocated} is in no slice"));
    let uuid = attr_string(device, "uuid").unwrap();
    // The CDI spec of the claim, written by NodePrepareResources, read by containerd.
    let uid = claim["metadata"]["uid"].as_str().unwrap();
    let spec = lab.cdi_dir().join(format!("gpuplane-claim-{uid}.json"));
    assert!(spec.exists(), "{} after prepare", spec.display());
    // The container sees exactly the allocated device.
    let log = env_log(&lab, "dra-pod");
    let seen = logged_uuids(&log);
    assert_eq!(
        seen,
        BTreeSet::from([uuid.clone()]),
        "the container's devices:\n{log}"
    );
    if let Some(visible) = env_value(&log, "NVIDIA_VISIBLE_DEVICES") {
        assert_eq!(visible, uuid);
    }
    // The claim's status.devices says what was prepared (written under the manifests' RBAC,
    // which the API server checks per driver).
    let entry = our_device_status(&lab, &claim_name, &allocated);
    assert_eq!(entry["data"]["uuid"], uuid.as_str(), "{entry}");
    assert!(entry["data"]["productName"].is_string(), "{entry}");
    // Deleting the pod unprepares the claim: its CDI spec goes.
    lab.kubectl_ok(&["delete", "pod", "dra-pod", "--wait=true", "--timeout=120s"]);
    eventually(
        "the claim's CDI spec to be removed (NodeUnprepareResources)",
        || (!spec.exists()).then_some(()),
    );

    a_standalone_claim_loses_our_status_on_unprepare(&lab);
}

/// A standalone claim outlives its pod: unprepare removes our status.devices entry.
fn a_standalone_claim_loses_our_status_on_unprepare(lab: &ClusterLab) {
    lab.apply(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: standalone, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu.gpuplane.dev}
---
apiVersion: v1
kind: Pod
metadata: {name: standalone-pod, namespace: default}
spec:
  terminationGracePeriodSeconds: 1
  resourceClaims:
  - {name: gpu, resourceClaimName: standalone}
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sleep", "3600"]
    resources:
      claims: [{name: gpu}]
"#,
    );
    wait_phase(lab, "standalone-pod", &["Running"]);
    let claim = lab
        .get_json(&["get", "resourceclaim", "standalone"])
        .unwrap();
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string();
    our_device_status(lab, "standalone", &device);
    lab.kubectl_ok(&[
        "delete",
        "pod",
        "standalone-pod",
        "--wait=true",
        "--timeout=120s",
    ]);
    eventually(
        "our status.devices entry to be removed on unprepare",
        || {
            let c = lab.get_json(&["get", "resourceclaim", "standalone"])?;
            let ours = c["status"]["devices"]
                .as_array()
                .is_some_and(|d| d.iter().any(|e| e["driver"] == DRIVER));
            (!ours).then_some(())
        },
    );
}

/// Our `status.devices` entry for `device` of claim `name` (namespace default), once written,
/// with its `Ready` condition checked.
fn our_device_status(lab: &ClusterLab, name: &str, device: &str) -> Value {
    let entry = eventually(&format!("status.devices of claim {name}"), || {
        let c = lab.get_json(&["get", "resourceclaim", name])?;
        c["status"]["devices"]
            .as_array()?
            .iter()
            .find(|e| e["driver"] == DRIVER && e["pool"] == NODE && e["device"] == device)
            .cloned()
    });
    let ready = entry["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .unwrap_or_else(|| panic!("no Ready condition: {entry}"));
    assert_eq!(ready["status"], "True", "{entry}");
    entry
}

/// UUIDs in a container log's `GPUPLANE_DEVICE_*` lines.
fn logged_uuids(log: &str) -> BTreeSet<String> {
    log.lines()
        .filter(|l| l.starts_with("GPUPLANE_DEVICE_"))
        .filter_map(|l| {
            l.split_once('=')?
                .1
                .split(',')
                .find_map(|kv| kv.strip_prefix("uuid=").map(String::from))
        })
        .collect()
}

/// A claim pod holding 3 GPUs, then a device-plugin pod (`dp-five`) taking the other five:
/// the device plugin withdraws the prepared three, the two sets are disjoint and together all
/// eight, and the slices taint the five in use. The (claim, device plugin) UUIDs.
fn every_gpu_held_by_both_apis(lab: &ClusterLab) -> (BTreeSet<String>, BTreeSet<String>) {
    claim_pod(lab, "claims-three", 3, "true");
    wait_phase(lab, "claims-three", &["Running"]);
    let dra_log = env_log(lab, "claims-three");
    let by_claim = logged_uuids(&dra_log);
    assert_eq!(by_claim.len(), 3, "{dra_log}");
    eventually(
        "the device plugin to withdraw the 3 prepared GPUs (allocatable 5)",
        || (allocatable_gpus(lab).as_deref() == Some("5")).then_some(()),
    );
    lab.apply(
        r#"apiVersion: v1
kind: Pod
metadata: {name: dp-five, namespace: default}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sh", "-c", "env; sleep 3600"]
    resources:
      limits: {nvidia.com/gpu: 5}
"#,
    );
    wait_phase(lab, "dp-five", &["Running"]);
    let dp_log = env_log(lab, "dp-five");
    let by_plugin: BTreeSet<String> = env_value(&dp_log, "NVIDIA_VISIBLE_DEVICES")
        .unwrap_or_default()
        .split(',')
        .map(String::from)
        .collect();
    assert_eq!(by_plugin.len(), 5, "{dp_log}");
    assert!(
        by_plugin.is_disjoint(&by_claim),
        "one GPU handed out twice: claim {by_claim:?}, device plugin {by_plugin:?}"
    );
    let mut all = by_plugin.clone();
    all.extend(by_claim.iter().cloned());
    assert_eq!(all, profile_uuids());
    eventually(
        "the slices to taint the five device-plugin GPUs in use",
        || (tainted_in_use(lab) == by_plugin).then_some(()),
    );
    (by_claim, by_plugin)
}

/// One inventory through the real scheduler and kubelet: GPUs prepared for a claim leave the
/// device plugin's allocatable, GPUs a device-plugin pod holds are tainted in the slice so the
/// scheduler allocates no claim on them, the two sets never meet, and a claim that nothing can
/// satisfy (all held, or a selector that matches no device) stays Pending with the scheduler's
/// reason.
#[test]
fn one_inventory_across_both_apis_and_unsatisfiable_claims_stay_pending() {
    let Some((lab, _kc, _agent)) = lab_with_agent() else {
        return;
    };
    every_gpu_held_by_both_apis(&lab);

    // Nothing is left: a further claim is not allocated, and the scheduler says why.
    claim_pod(&lab, "claims-one-more", 1, "true");
    let reason = eventually("the scheduler's reason for claims-one-more", || {
        cluster::unschedulable_reason(&lab, "claims-one-more")
    });
    assert!(
        reason.contains("claim"),
        "the scheduler names the claim it cannot allocate: {reason}"
    );
    // A selector no device matches: Pending with the scheduler's reason too.
    claim_pod(
        &lab,
        "claims-no-such-gpu",
        1,
        "device.attributes['gpu.gpuplane.dev'].productName == 'no-such-gpu'",
    );
    let reason = eventually("the scheduler's reason for claims-no-such-gpu", || {
        cluster::unschedulable_reason(&lab, "claims-no-such-gpu")
    });
    assert!(reason.contains("claim"), "{reason}");
    for name in ["claims-one-more", "claims-no-such-gpu"] {
        assert_eq!(pod_phase(&lab, name).as_deref(), Some("Pending"));
    }
}

/// UUIDs of the GPUs lab-node's slices carry the device plugin's in-use taint on.
fn tainted_in_use(lab: &ClusterLab) -> BTreeSet<String> {
    slice_devices(lab)
        .iter()
        .filter(|(_, d)| {
            d["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["value"] == "in-use"))
        })
        .filter_map(|(_, d)| attr_string(d, "uuid"))
        .collect()
}

/// The allocation of the claim a pod's template made (`<pod>-gpu-<suffix>`), if any.
fn pod_claim_allocation(lab: &ClusterLab, pod: &str) -> Option<Value> {
    let p = lab.get_json(&["get", "pod", pod])?;
    let claim = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"].as_str()?;
    let c = lab.get_json(&["get", "resourceclaim", claim])?;
    Some(c["status"]["allocation"].clone()).filter(|a| !a.is_null())
}

/// Issue 22: a SIGKILLed agent (an OOM kill, a crash) restarted while pods of both APIs run
/// and a claim waits for a GPU the device plugin holds. The new agent learns the device
/// plugin's holds from the kubelet before it writes anything, so the slices (and their in-use
/// taints) are not rewritten, it makes no API write at all (the API server's audit log), and
/// the waiting claim stays unallocated until the device-plugin pod ends; then it runs.
#[test]
fn a_killed_agent_restarts_without_a_write_and_a_waiting_claim_gets_no_held_gpu() {
    let Some((lab, kubeconfig, agent)) = lab_with_agent() else {
        return;
    };
    let (_, by_plugin) = every_gpu_held_by_both_apis(&lab);
    claim_pod(&lab, "claims-waiting", 1, "true");
    eventually("the scheduler's reason for claims-waiting", || {
        cluster::unschedulable_reason(&lab, "claims-waiting")
    });

    let versions = cluster::slice_versions(&lab, NODE);
    let writes = lab.audited_writes(AGENT_USER);
    assert!(
        writes.iter().any(|w| w.contains("resourceslices")),
        "the audit log shows the first agent's slice writes: {writes:?}"
    );
    agent.kill();
    let agent = LabAgent::start(&lab, &kubeconfig, "after-kill");
    eventually(
        "the restarted agent's /readyz (registered, slices published)",
        || {
            lab.in_netns("curl")
                .args(["-sf", "http://127.0.0.1:9400/readyz"])
                .output()
                .ok()
                .filter(|o| o.status.success())
        },
    );
    eventually("the kubelet to take the new agent's devices", || {
        (allocatable_gpus(&lab).as_deref() == Some("5")).then_some(())
    });
    // A window for anything the new agent would still write: several PodResources polls, a
    // slice sync after each state change, the node labeler. Not a timing assertion: a
    // write at any later time fails the same checks.
    std::thread::sleep(std::time::Duration::from_secs(5));
    let after: Vec<String> = lab.audited_writes(AGENT_USER)[writes.len()..].to_vec();
    assert!(
        after.is_empty(),
        "the restarted agent wrote to the API server with nothing changed: {after:?}\n{}",
        agent.log_text()
    );
    assert_eq!(
        cluster::slice_versions(&lab, NODE),
        versions,
        "the restart rewrote lab-node's ResourceSlices"
    );
    assert_eq!(tainted_in_use(&lab), by_plugin);
    assert_eq!(
        pod_phase(&lab, "claims-waiting").as_deref(),
        Some("Pending")
    );
    assert!(
        pod_claim_allocation(&lab, "claims-waiting").is_none(),
        "claims-waiting was allocated while every GPU was held"
    );

    // The device-plugin pod ends: its GPUs lose the taint and the waiting claim gets one.
    lab.kubectl_ok(&["delete", "pod", "dp-five", "--wait=false"]);
    wait_phase(&lab, "claims-waiting", &["Running"]);
    let got = logged_uuids(&env_log(&lab, "claims-waiting"));
    assert_eq!(got.len(), 1);
    assert!(got.is_subset(&by_plugin), "{got:?} was one of dp-five's");
    drop(agent);
}
