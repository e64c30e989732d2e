//! gpuplane against real Kubernetes (issue 13): the upstream kube-apiserver, scheduler,
//! controller manager, kubelet and containerd of hack/cluster/lab.sh, and the real
//! `gpuplane node --simulate dgx-h100` in the lab's network namespace. Each test starts its
//! own lab (one at a time: the machine's cores are few) and asserts outcomes only, with
//! generous hang guards and no timing assertions. Skips when not root or when the cluster
//! binaries are not built (hack/cluster/build.sh); fails instead under `CI`.

use crate::cluster;
use crate::support;

use crate::cluster::{
    eventually, eventually_or, ClusterLab, LabAgent, LabProcess, AGENT_USER, DRIVER, NODE,
};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// The GPU UUIDs of the simulated dgx-h100, from `gpuplane discover`.
fn profile_uuids() -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["discover", "--simulate", "dgx-h100", "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "gpuplane discover failed");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut uuids = BTreeSet::new();
    collect_uuids(&v, &mut uuids);
    assert_eq!(uuids.len(), 8, "dgx-h100 has 8 GPUs: {v}");
    uuids
}

fn collect_uuids(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match x {
                    Value::String(s) if k == "uuid" && s.starts_with("GPU-") => {
                        out.insert(s.clone());
                    }
                    _ => collect_uuids(x, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_uuids(x, out)),
        _ => {}
    }
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

#[test]
fn both_apis_register_with_the_real_kubelet() {
    let Some((lab, agent_kubeconfig, agent)) = lab_with_agent() else {
        return;
    };
    // The kubelet's own account of the two registrations.
    let kubelet_dp = lab.log_lines("kubelet", "nvidia.com/gpu");
    assert!(
        !kubelet_dp.is_empty(),
        "the kubelet log never names nvidia.com/gpu"
    );
    let node = lab.get_json(&["get", "node", NODE]).unwrap();
    assert_eq!(node["status"]["capacity"]["nvidia.com/gpu"], "8");
    // Every GPU of the profile is in a slice, by UUID.
    let in_slices: BTreeSet<String> = slice_devices(&lab)
        .iter()
        .filter_map(|(_, d)| attr_string(d, "uuid"))
        .filter(|u| u.starts_with("GPU-"))
        .collect();
    assert_eq!(in_slices, profile_uuids());
    // The agent itself reports ready (registered with every API, slices published).
    let readyz = lab
        .in_netns("curl")
        .args(["-sf", "http://127.0.0.1:9400/readyz"])
        .output()
        .unwrap();
    assert!(
        readyz.status.success(),
        "agent /readyz: {}",
        agent.log_text()
    );

    // The manifests' policy holds the agent to its own node: with its real node-bound token,
    // a ResourceSlice of another node is refused by the ValidatingAdmissionPolicy (its own
    // were admitted above), and a call outside its RBAC is forbidden.
    let other = r#"apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: other-node-gpu}
spec:
  driver: gpu.gpuplane.dev
  nodeName: other-node
  pool: {name: other-node, generation: 1, resourceSliceCount: 1}
  devices: [{name: gpu-0}]
"#;
    let out = lab.kubectl_as(&agent_kubeconfig, &["create", "-f", "-"], Some(other));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another node's slice was admitted");
    assert!(
        err.contains("may not write the ResourceSlices of node 'other-node'"),
        "{err}"
    );
    let out = lab.kubectl_as(&agent_kubeconfig, &["get", "secrets", "-A"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Forbidden"), "{err}");
    // GPU Feature Discovery's labels on the node, written with the same token; the policy
    // holds those writes to the agent's own node and to nvidia.com/ labels.
    eventually("GFD's labels on lab-node", || {
        let node = lab.get_json(&["get", "node", NODE])?;
        let l = &node["metadata"]["labels"];
        (l["nvidia.com/gpu.count"] == "8"
            && l["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
            && l["nvidia.com/gpu.family"] == "hopper"
            && l["nvidia.com/mig.capable"] == "true")
            .then_some(())
    });
    let out = lab.kubectl_as(
        &agent_kubeconfig,
        &["label", "node", NODE, "team=anyone"],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may change only the nvidia.com/ labels"),
        "{err}"
    );
    lab.apply("apiVersion: v1\nkind: Node\nmetadata: {name: other-node}\n");
    let out = lab.kubectl_as(
        &agent_kubeconfig,
        &["label", "node", "other-node", "nvidia.com/gpu.count=1"],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may not change node 'other-node'"),
        "{err}"
    );
    // The agent's RBAC was enough for everything it did: no refusal in its log.
    let log = agent.log_text();
    assert!(
        cluster::refusals(&log).is_empty(),
        "the agent was refused a call:\n{log}"
    );
}

#[test]
fn a_device_plugin_pod_gets_two_gpus() {
    let Some((lab, _kc, agent)) = lab_with_agent() else {
        return;
    };
    lab.apply(
        r#"apiVersion: v1
kind: Pod
metadata: {name: two-gpus, namespace: default}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["env"]
    resources:
      limits: {nvidia.com/gpu: 2}
"#,
    );
    wait_phase(&lab, "two-gpus", &["Succeeded"]);
    let pod = lab.get_json(&["get", "pod", "two-gpus"]).unwrap();
    assert_eq!(
        pod["spec"]["nodeName"], NODE,
        "placed by the real scheduler"
    );
    let log = lab.kubectl_ok(&["logs", "two-gpus"]);
    let visible = env_value(&log, "NVIDIA_VISIBLE_DEVICES")
        .unwrap_or_else(|| panic!("no NVIDIA_VISIBLE_DEVICES in the container's env:\n{log}"));
    let got: Vec<&str> = visible.split(',').collect();
    let distinct: BTreeSet<String> = got.iter().map(|s| s.to_string()).collect();
    assert_eq!(got.len(), 2, "two GPUs: {visible}");
    assert_eq!(distinct.len(), 2, "two distinct GPUs: {visible}");
    // The kubelet's device manager asked for a preferred pair first (our topology scoring),
    // then allocated.
    let log = agent.log_text();
    let asked = log.find("preferred allocation");
    let granted = log.find("handed out");
    assert!(
        asked.is_some() && granted.is_some() && asked < granted,
        "GetPreferredAllocation before Allocate:\n{log}"
    );
    // dgx-h100 is an NVSwitch machine: every pair is NVLink-optimal, so any two of its GPUs.
    assert!(
        distinct.is_subset(&profile_uuids()),
        "{visible} are not dgx-h100 GPUs"
    );
    // gpu.gpuplane.dev backs nvidia.com/gpu through DRA too, but this node advertises it
    // through the device plugin, so the scheduler took that path: no extended-resource claim.
    assert!(
        pod["status"]["extendedResourceClaimStatus"].is_null(),
        "{}",
        pod["status"]
    );
    let claims = lab.get_json(&["get", "resourceclaims"]).unwrap();
    assert_eq!(
        claims["items"].as_array().map(Vec::len),
        Some(0),
        "{claims}"
    );
}

/// A node labelled `gpuplane.dev/apis=dra` (the agent started with the DaemonSet's flags,
/// both APIs): the agent serves DRA only, and unchanged `nvidia.com/gpu: 1` pods are served by
/// DRA through the DeviceClass that backs the name (extendedResourceName): the real scheduler
/// makes each pod's claim, the kubelet prepares it, and eight pods at once get the eight GPUs,
/// none shared; a ninth waits until one ends.
#[test]
fn nvidia_com_gpu_pods_are_served_by_dra_on_a_dra_only_node() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let kubeconfig = lab.install_agent_identity();
    lab.kubectl_ok(&["label", "node", NODE, "gpuplane.dev/apis=dra"]);
    let agent = LabAgent::start(&lab, &kubeconfig, "dra-only");
    eventually("the ResourceSlices of lab-node to list 8 GPUs", || {
        let gpus = slice_devices(&lab)
            .iter()
            .filter(|(_, d)| attr_string(d, "type").as_deref() == Some("gpu"))
            .count();
        (gpus == 8).then_some(())
    });
    eventually("the kubelet to connect to the DRA plugin", || {
        (dra_connections(&lab) > 0).then_some(())
    });
    assert_eq!(
        allocatable_gpus(&lab),
        None,
        "no device plugin on this node"
    );
    let pod =
        |name: &str| cluster::gpu_pod("default", name, 1, r#"["sh", "-c", "env; sleep 3600"]"#);
    let names: Vec<String> = (0..8).map(|i| format!("er-{i}")).collect();
    let all: Vec<String> = names.iter().map(|n| pod(n)).collect();
    lab.apply(&all.join("---\n"));
    let mut seen = BTreeSet::new();
    for name in &names {
        wait_phase(&lab, name, &["Running"]);
        let p = lab.get_json(&["get", "pod", name]).unwrap();
        let status = &p["status"]["extendedResourceClaimStatus"];
        assert_eq!(
            status["requestMappings"][0]["resourceName"], "nvidia.com/gpu",
            "{name}: {status}"
        );
        let claim = status["resourceClaimName"].as_str().unwrap();
        let c = lab.get_json(&["get", "resourceclaim", claim]).unwrap();
        let results = c["status"]["allocation"]["devices"]["results"]
            .as_array()
            .unwrap();
        assert_eq!(results.len(), 1, "{c}");
        assert_eq!(results[0]["driver"], DRIVER);
        let log = env_log(&lab, name);
        let visible = env_value(&log, "NVIDIA_VISIBLE_DEVICES")
            .unwrap_or_else(|| panic!("no NVIDIA_VISIBLE_DEVICES in {name}:\n{log}"));
        assert!(seen.insert(visible.clone()), "{visible} handed out twice");
    }
    assert_eq!(seen, profile_uuids(), "the eight pods hold the eight GPUs");
    lab.apply(&pod("er-waits"));
    eventually_or(
        "the ninth pod to be unschedulable",
        || {
            let p = lab.get_json(&["get", "pod", "er-waits"])?;
            p["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
                .then_some(())
        },
        || lab.describe_pod("er-waits"),
    );
    lab.kubectl_ok(&["delete", "pod", "er-3", "--wait=true", "--timeout=120s"]);
    wait_phase(&lab, "er-waits", &["Running"]);
    let log = env_log(&lab, "er-waits");
    assert!(env_value(&log, "NVIDIA_VISIBLE_DEVICES").is_some_and(|v| profile_uuids().contains(&v)));
    let log = agent.log_text();
    let chosen = log.lines().find(|l| l.contains("kubelet APIs"));
    assert!(
        chosen.is_some_and(|l| l.contains("dra") && l.contains("gpuplane.dev/apis")),
        "{log}"
    );

    // The same node switched to the device plugin only: the agent stops for the label change,
    // the new one serves the device plugin, and the same unchanged pod spec takes that path.
    lab.kubectl_ok(&["delete", "pod", "--all", "--wait=true", "--timeout=120s"]);
    lab.kubectl_ok(&[
        "label",
        "node",
        NODE,
        "gpuplane.dev/apis=device-plugin",
        "--overwrite",
    ]);
    eventually("the agent to stop for the label change", || {
        agent.log_text().contains("changed; stopping").then_some(())
    });
    drop(agent);
    let agent = LabAgent::start(&lab, &kubeconfig, "device-plugin-only");
    eventually(
        "node lab-node to report nvidia.com/gpu: 8 from the device plugin",
        || (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(()),
    );
    run_gpu_pod(&lab, "via-device-plugin");
    let p = lab.get_json(&["get", "pod", "via-device-plugin"]).unwrap();
    assert!(
        p["status"]["extendedResourceClaimStatus"].is_null(),
        "{}",
        p["status"]
    );
    let log = agent.log_text();
    assert!(
        log.contains("handed out") && log.contains("device plugin"),
        "the device plugin handed it out:\n{log}"
    );
}

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

    // A standalone claim outlives its pod: unprepare removes our status.devices entry.
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
    wait_phase(&lab, "standalone-pod", &["Running"]);
    let claim = lab
        .get_json(&["get", "resourceclaim", "standalone"])
        .unwrap();
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string();
    our_device_status(&lab, "standalone", &device);
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

#[test]
fn both_apis_come_back_after_kubelet_and_agent_restarts() {
    let Some((lab, kubeconfig, agent)) = lab_with_agent() else {
        return;
    };
    let registered = r#""Registered client" name="nvidia.com/gpu""#;
    let registrations = lab.log_lines("kubelet", registered).len();
    // The new kubelet's device manager knows nothing of the old one's plugins: it must take the
    // re-registered plugin's device list. (Its node-status log line "Updated capacity" is no
    // sign: it appears only when the value changes, and the Node still holds the old kubelet's
    // 8 when the plugin re-registers before the first status sync.)
    let processed = r#""Processed device updates for resource" resourceName="nvidia.com/gpu" totalCount=8 healthyCount=8"#;
    let updates = lab.log_lines("kubelet", processed).len();
    let dra_connects = dra_connections(&lab);
    lab.restart_kubelet();
    eventually("the device plugin to register with the new kubelet", || {
        (lab.log_lines("kubelet", registered).len() > registrations).then_some(())
    });
    eventually(
        "the new kubelet to take the plugin's 8 healthy devices",
        || (lab.log_lines("kubelet", processed).len() > updates).then_some(()),
    );
    eventually(
        "nvidia.com/gpu: 8 allocatable after the kubelet restart",
        || (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(()),
    );
    eventually("the new kubelet to connect to the DRA plugin", || {
        (dra_connections(&lab) > dra_connects).then_some(())
    });
    run_gpu_pod(&lab, "after-kubelet-restart");

    let dra_connects = dra_connections(&lab);
    let registrations = lab.log_lines("kubelet", registered).len();
    // The kubelet keeps the stopped plugin's devices in capacity (unhealthy): no capacity
    // change to wait for, but the new plugin's device list must have reached it.
    let updates = lab.log_lines("kubelet", processed).len();
    agent.stop();
    let agent = LabAgent::start(&lab, &kubeconfig, "2");
    eventually("the new agent's device plugin to register", || {
        (lab.log_lines("kubelet", registered).len() > registrations).then_some(())
    });
    eventually(
        "the kubelet to take the new agent's 8 healthy devices",
        || (lab.log_lines("kubelet", processed).len() > updates).then_some(()),
    );
    wait_registered(&lab);
    eventually(
        "the kubelet to connect to the new agent's DRA plugin",
        || (dra_connections(&lab) > dra_connects).then_some(()),
    );
    run_gpu_pod(&lab, "after-agent-restart");
    drop(agent);
}

/// How often the kubelet's DRA manager has connected to our plugin (its log).
fn dra_connections(lab: &ClusterLab) -> usize {
    lab.log_lines("kubelet", "\"Connection changed\"")
        .iter()
        .filter(|l| l.contains(&format!("driverName=\"{DRIVER}\"")) && l.contains("connected=true"))
        .count()
}

/// A pod with one `nvidia.com/gpu` that must run to completion and see one GPU.
fn run_gpu_pod(lab: &ClusterLab, name: &str) {
    lab.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["env"]
    resources:
      limits: {{nvidia.com/gpu: 1}}
"#
    ));
    wait_phase(lab, name, &["Succeeded"]);
    let log = lab.kubectl_ok(&["logs", name]);
    let visible = env_value(&log, "NVIDIA_VISIBLE_DEVICES")
        .unwrap_or_else(|| panic!("no NVIDIA_VISIBLE_DEVICES in {name}:\n{log}"));
    assert!(profile_uuids().contains(&visible), "{visible}");
}

/// The log of a pod whose container printed its environment, once it has.
fn env_log(lab: &ClusterLab, pod: &str) -> String {
    eventually(&format!("pod {pod}'s env in its log"), || {
        let log = lab.kubectl_ok(&["logs", pod]);
        log.contains("PATH=").then_some(log)
    })
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
