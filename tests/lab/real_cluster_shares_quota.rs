//! The quota card of GPU shares (DRA consumable capacity) against real Kubernetes: the agent
//! publishes the simulated dgx-a100's GPUs as shared devices, the real kube-apiserver validates
//! and stores those slices, the real scheduler allocates a share and the real kubelet runs the
//! pod, while the real `gpuplane controller`, called by the API server as the quota webhook of
//! daemonset/, charges each share its memory and compute (docs/quota.md, "Shares of a GPU").
//! Skips like tests/lab/real_cluster.rs (root and the cluster binaries needed), fails instead
//! under `CI`.

use crate::cluster;

use crate::cluster::{
    eventually, eventually_or, refusals, repo, start_controller, ClusterLab, LabAgent, DRIVER, NODE,
};
use serde_json::Value;
use std::time::Instant;

/// The namespace of the card, and its quota.
const NS: &str = "team-s";
const QUOTA: &str = r#"apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: default, namespace: team-s}
spec:
  hard:
    gpuMemory: 20Gi
    gpus: 1
  mode: Reject
"#;

/// The DaemonSet's agent config (daemonset/node/config.yaml) with GPU shares turned on for
/// every GPU: memory in 1Gi steps, compute in steps of 10 percent.
fn agent_config() -> String {
    let cm: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("daemonset/node/config.yaml")).unwrap(),
    )
    .unwrap();
    let base = cm["data"]["config.yaml"].as_str().unwrap();
    format!(
        "{base}sharing:\n  consumableCapacity:\n    gpus: all\n    memoryStep: 1Gi\n    computeStep: 10\n"
    )
}

/// A ResourceClaimTemplate `name` of namespace [`NS`]: one share of a `gpu.gpuplane.dev`
/// device with `memory` and `compute` (percent).
fn share_template(name: &str, memory: &str, compute: u32) -> String {
    let capacity = format!("capacity: {{requests: {{memory: {memory}, compute: \"{compute}\"}}}}");
    cluster::claim_template(NS, name, &[capacity])
}

/// A pod of namespace [`NS`] holding a claim from `template`, printing its environment and
/// then sleeping so that it keeps the share.
fn share_pod(name: &str, template: &str) -> String {
    cluster::claim_pod(NS, name, template)
}

/// The devices of our driver's ResourceSlices on [`NODE`], as the API server stored them.
fn slice_devices(lab: &ClusterLab) -> Vec<Value> {
    lab.get_json(&["get", "resourceslices"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|s| s["spec"]["driver"] == DRIVER && s["spec"]["nodeName"] == NODE)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn attr_string(device: &Value, name: &str) -> Option<String> {
    device["attributes"][name]["string"]
        .as_str()
        .or_else(|| device["attributes"][format!("{DRIVER}/{name}")]["string"].as_str())
        .map(String::from)
}

/// A `KEY=value` line of a container's printed environment.
fn env_value(log: &str, key: &str) -> Option<String> {
    log.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(String::from)
}

/// The `GPUPLANE_DEVICE_*` lines of a printed environment, as (key, uuid).
fn logged_devices(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("GPUPLANE_DEVICE_"))
        .filter_map(|l| {
            let (key, value) = l.split_once('=')?;
            let uuid = value.split(',').find_map(|kv| kv.strip_prefix("uuid="))?;
            Some((key.to_string(), uuid.to_string()))
        })
        .collect()
}

#[test]
fn a_gpu_share_is_charged_its_memory_and_compute_by_the_real_api_server() {
    let began = Instant::now();
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let agent = LabAgent::start_with(
        &lab,
        &installed.agent,
        "shares",
        &["--simulate", "dgx-a100", "--device-plugin=false"],
        &[],
        Some(&agent_config()),
    );
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);

    let devices = eight_shared_gpus_published(&lab);
    the_webhook_prices_shares(&lab);
    let pod = the_first_share_runs(&lab);
    the_share_is_allocated_and_seen(&lab, &pod, &devices);
    the_share_is_charged_and_a_second_refused(&lab);

    // Neither process was refused an API call over the run.
    for (who, log) in [
        ("agent", agent.log_text()),
        ("controller", controller.log_text()),
    ] {
        assert!(
            refusals(&log).is_empty(),
            "the {who} was refused a call:\n{log}"
        );
    }
    eprintln!(
        "shares quota card: {:.1}s (lab start {:.1}s)",
        began.elapsed().as_secs_f64(),
        lab.start_time.as_secs_f64()
    );
}

/// The slices as the API server validated and stored them: every GPU of the dgx-a100 (80Gi
/// each) is one shared device with the two consumable capacities and their policies.
fn eight_shared_gpus_published(lab: &ClusterLab) -> Vec<Value> {
    let devices = eventually("8 shared GPUs in lab-node's ResourceSlices", || {
        let d = slice_devices(lab);
        (d.len() == 8 && d.iter().all(|d| d["allowMultipleAllocations"] == true)).then_some(d)
    });
    for d in &devices {
        let compute = &d["capacity"]["compute"];
        assert_eq!(compute["value"], "100", "{d}");
        assert_eq!(
            compute["requestPolicy"],
            serde_json::json!({"default": "100", "validRange": {"min": "10", "max": "100", "step": "10"}}),
            "{d}"
        );
        let memory = &d["capacity"]["memory"];
        assert_eq!(memory["value"], "80Gi", "{d}");
        assert_eq!(
            memory["requestPolicy"],
            serde_json::json!({"default": "80Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}),
            "{d}"
        );
    }
    devices
}

/// The card's namespace: a GpuQuota of 20Gi and one GPU, and the shares' templates; the
/// webhook then prices shares from the published slices.
fn the_webhook_prices_shares(lab: &ClusterLab) {
    // The card's namespace: a GpuQuota of 20Gi and one GPU, and the two shares' templates.
    lab.kubectl_ok(&["create", "namespace", NS]);
    lab.apply(QUOTA);
    lab.apply(&share_template("share-15gi-80", "15Gi", 80));
    lab.apply(&share_template("share-10gi-50", "10Gi", 50));
    lab.apply(&share_template("share-21gi-10", "21Gi", 10));
    // Once the webhook holds the quota and prices shares from the published slices, a server
    // dry run of a share over the memory quota is refused with its price.
    let last = std::cell::RefCell::new(String::new());
    eventually_or(
        "the webhook to price shares against GpuQuota team-s/default",
        || {
            let probe = share_pod("dry-run-probe", "share-21gi-10");
            let answer = lab.create(&probe, &["--dry-run=server"]);
            let priced = answer.as_ref().is_err_and(|e| {
                e.contains("gpuMemory: requested 21Gi, used 0 of 20Gi in GpuQuota team-s/default")
            });
            *last.borrow_mut() = format!("{answer:?}");
            priced.then_some(())
        },
        || format!("the last dry run: {}", last.borrow()),
    );
}

/// The first share fits (15Gi of 20Gi, 4/5 of 1 GPU) and runs; its pod.
fn the_first_share_runs(lab: &ClusterLab) -> Value {
    // The first share fits (15Gi of 20Gi, 4/5 of 1 GPU) and runs.
    lab.create(&share_pod("first", "share-15gi-80"), &[])
        .unwrap();
    let pod = eventually_or(
        "pod team-s/first to run",
        || {
            let p = lab.get_json(&["get", "pod", "first", "-n", NS])?;
            (p["status"]["phase"] == "Running").then_some(p)
        },
        || lab.describe_pod_in(NS, "first"),
    );
    assert_eq!(pod["spec"]["nodeName"], NODE);
    pod
}

/// The scheduler allocated a share of one of `devices` to `pod`, and the container sees that
/// GPU and its share.
fn the_share_is_allocated_and_seen(lab: &ClusterLab, pod: &Value, devices: &[Value]) {
    // The scheduler allocated a share: the claim's result carries what it consumes and the
    // share's ID.
    let claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .unwrap_or_else(|| panic!("no generated claim in {}", pod["status"]))
        .to_string();
    let claim = lab
        .get_json(&["get", "resourceclaim", &claim_name, "-n", NS])
        .unwrap();
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(results.len(), 1, "one share allocated: {}", claim["status"]);
    let result = &results[0];
    assert_eq!(result["driver"], DRIVER, "{result}");
    assert_eq!(result["pool"], NODE, "{result}");
    assert_eq!(
        result["consumedCapacity"],
        serde_json::json!({"memory": "15Gi", "compute": "80"}),
        "{result}"
    );
    assert!(
        result["shareID"].as_str().is_some_and(|s| !s.is_empty()),
        "no shareID: {result}"
    );
    let allocated = result["device"].as_str().unwrap();
    let device = devices
        .iter()
        .find(|d| d["name"] == allocated)
        .unwrap_or_else(|| panic!("allocated device {allocated} is in no slice"));
    let uuid = attr_string(device, "uuid").unwrap();

    // The container sees that GPU and its share.
    let log = eventually("pod team-s/first's env in its log", || {
        let out = lab.kubectl(&["logs", "first", "-n", NS]);
        let log = String::from_utf8_lossy(&out.stdout).into_owned();
        log.contains("PATH=").then_some(log)
    });
    let seen = logged_devices(&log);
    assert_eq!(seen.len(), 1, "one GPU in the container's env:\n{log}");
    assert_eq!(seen[0].1, uuid, "the allocated GPU:\n{log}");
    let index = device["attributes"]["index"]["int"].as_i64().unwrap();
    assert_eq!(seen[0].0, index.to_string(), "keyed by its index:\n{log}");
    assert_eq!(
        env_value(&log, "GPUPLANE_SHARE_MEMORY").as_deref(),
        Some("15Gi"),
        "{log}"
    );
    assert_eq!(
        env_value(&log, "GPUPLANE_SHARE_COMPUTE").as_deref(),
        Some("80"),
        "{log}"
    );
}

/// The controller counts the running share at its price, and a second share over the quota
/// is refused.
fn the_share_is_charged_and_a_second_refused(lab: &ClusterLab) {
    // The controller counts the running share at its price, and nothing else.
    eventually("GpuQuota team-s/default to count the share as used", || {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", NS])?;
        let s = &q["status"];
        (s["used"]["gpuMemory"] == "15Gi"
            && s["used"]["gpus"] == "4/5"
            && s["reservations"].as_array().is_none_or(|r| r.is_empty()))
        .then_some(())
    });

    // The second share (10Gi, 1/2 GPU) would make 25Gi of 20Gi and 13/10 of 1: kubectl prints
    // the webhook's refusal with both dimensions, and there is no such pod.
    let err = lab
        .create(&share_pod("second", "share-10gi-50"), &[])
        .unwrap_err();
    assert!(
        err.contains(r#"admission webhook "quota.gpuplane.dev" denied the request"#)
            && err.contains(
                "gpuMemory: requested 10Gi, used 15Gi of 20Gi in GpuQuota team-s/default"
            )
            && err.contains("gpus: requested 1/2, used 4/5 of 1 in GpuQuota team-s/default"),
        "kubectl's error: {err}"
    );
    assert!(lab.get_json(&["get", "pod", "second", "-n", NS]).is_none());
}
