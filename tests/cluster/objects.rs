//! The objects tests apply to the lab (GPU pods, claim templates, claim pods) and what the lab
//! says of them (events, environment, slices, devices, reasons).

use super::*;

/// The ResourceClaimTemplate `default/one-gpu`: one device of DeviceClass `gpu.gpuplane.dev`.
pub const ONE_GPU_TEMPLATE: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: default}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.gpuplane.dev}
"#;

/// A pod that runs busybox's `command` (a JSON list) in `ns` asking for `gpus` whole
/// `nvidia.com/gpu` (none: no resources), with a 1 s grace period.
pub fn gpu_pod(ns: &str, name: &str, gpus: u32, command: &str) -> String {
    let resources = if gpus == 0 {
        String::new()
    } else {
        format!("\n    resources:\n      limits: {{nvidia.com/gpu: {gpus}}}")
    };
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: {command}{resources}
"#
    )
}

/// A pod `ns/name` that sleeps asking `gpus` nvidia.com/gpu, with `meta` lines added to its
/// metadata and `spec` lines to its spec (each indented two).
pub fn sleeping_gpu_pod(ns: &str, name: &str, gpus: u32, meta: &str, spec: &str) -> String {
    sleeping_gpu_pod_for(ns, name, gpus, meta, spec, 3600)
}

/// [`sleeping_gpu_pod`] sleeping `seconds`.
pub fn sleeping_gpu_pod_for(
    ns: &str,
    name: &str,
    gpus: u32,
    meta: &str,
    spec: &str,
    seconds: u32,
) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
{meta}spec:
  terminationGracePeriodSeconds: 1
{spec}  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sleep", "{seconds}"]
    resources:
      limits: {{nvidia.com/gpu: {gpus}}}
"#
    )
}

/// The Events with `reason` on pod `ns/name`.
pub fn pod_events(lab: &ClusterLab, ns: &str, name: &str, reason: &str) -> Vec<Value> {
    let selector = format!("involvedObject.name={name},reason={reason}");
    lab.get_json(&["get", "events", "-n", ns, "--field-selector", &selector])
        .and_then(|e| e["items"].as_array().cloned())
        .unwrap_or_default()
}

/// A ResourceClaimTemplate `ns/name`: one request `gpu` of DeviceClass `gpu.gpuplane.dev`,
/// with `extra` lines (`count: 2`, `capacity: {...}`, ...) added to its `exactly`.
pub fn claim_template(ns: &str, name: &str, extra: &[String]) -> String {
    claim_template_of(ns, name, "gpu.gpuplane.dev", extra)
}

/// [`claim_template`] with DeviceClass `class`.
pub fn claim_template_of(ns: &str, name: &str, class: &str, extra: &[String]) -> String {
    let extra: String = extra.iter().map(|l| format!("\n          {l}")).collect();
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {ns}}}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: {class}{extra}
"#
    )
}

/// Waits until pod `ns/name` runs (describing it on timeout).
pub fn wait_running(lab: &ClusterLab, ns: &str, name: &str) {
    eventually_or(
        &format!("pod {ns}/{name} to run"),
        || {
            let pod = lab.get_json(&["get", "pod", name, "-n", ns])?;
            (pod["status"]["phase"] == "Running").then_some(())
        },
        || lab.describe_pod_in(ns, name),
    );
}

/// The environment pod `default/<pod>` printed (the `env` of [`claim_pod`]), once it did.
pub fn pod_env(lab: &ClusterLab, pod: &str) -> Vec<String> {
    pod_env_in(lab, "default", pod)
}

/// [`pod_env`] of pod `ns/<pod>`.
pub fn pod_env_in(lab: &ClusterLab, ns: &str, pod: &str) -> Vec<String> {
    eventually_or(
        &format!("pod {ns}/{pod}'s environment in its log"),
        || {
            let log = lab.kubectl(&["logs", "-n", ns, pod]);
            let text = String::from_utf8_lossy(&log.stdout).into_owned();
            text.contains("PATH=")
                .then(|| text.lines().map(String::from).collect())
        },
        || lab.describe_pod_in(ns, pod),
    )
}

/// The scheduler's reason for not placing pod `default/<name>`: its PodScheduled=False message.
pub fn unschedulable_reason(lab: &ClusterLab, name: &str) -> Option<String> {
    let pod = lab.get_json(&["get", "pod", name])?;
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
        .and_then(|c| c["message"].as_str().map(String::from))
}

/// The ResourceSlices of our driver on [`NODE`], as the API server stored them.
pub fn node_slices(lab: &ClusterLab) -> Vec<Value> {
    lab.get_json(&["get", "resourceslices"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
        .collect()
}

/// The devices of [`node_slices`].
pub fn node_devices(lab: &ClusterLab) -> Vec<Value> {
    node_slices(lab)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// A pod `ns/name` holding a claim made from template `template`, printing its environment and
/// then sleeping so that it keeps the devices.
pub fn claim_pod(ns: &str, name: &str, template: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
  - {{name: gpu, resourceClaimTemplateName: {template}}}
  containers:
  - name: c
    image: lab.local/busybox:1
    imagePullPolicy: Never
    command: ["sh", "-c", "env; sleep 3600"]
    resources:
      claims: [{{name: gpu}}]
"#
    )
}

/// The arguments of the `kubectl label nodes --all ...` command in docs/install.md (Helm,
/// Uninstall; backslash-continued lines), without `kubectl`.
pub fn documented_label_removal() -> Vec<String> {
    let doc = std::fs::read_to_string(repo().join("docs/install.md")).unwrap();
    let start = doc
        .find("kubectl label nodes --all")
        .expect("docs/install.md has no `kubectl label nodes --all ...` command");
    let end = start + doc[start..].find("```").unwrap();
    doc[start..end]
        .split_whitespace()
        .filter(|w| *w != "\\")
        .skip(1)
        .map(String::from)
        .collect()
}

/// name -> resourceVersion of the ResourceSlices of our driver (of node `node` only, unless
/// it is empty).
pub fn slice_versions(lab: &ClusterLab, node: &str) -> std::collections::BTreeMap<String, String> {
    lab.get_json(&["get", "resourceslices"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|s| {
            s["spec"]["driver"] == DRIVER && (node.is_empty() || s["spec"]["nodeName"] == node)
        })
        .map(|s| {
            let field = |k: &str| s["metadata"][k].as_str().unwrap_or("").to_string();
            (field("name"), field("resourceVersion"))
        })
        .collect()
}
