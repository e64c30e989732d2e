//! Both kubelet APIs register with the real kubelet, serve GPU pods (device plugin, and
//! nvidia.com/gpu through DRA on a DRA-only node) and come back after restarts.

use super::*;

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
