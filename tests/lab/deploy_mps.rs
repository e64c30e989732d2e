//! Shares that hold (issue 38), deployed as users deploy gpuplane: daemonset/ through the
//! deployment overlay of tests/lab/deploy.rs on the three-node lab, lab-node simulating a
//! dgx-h100 whose GPUs are shared through DRA consumable capacity, the stand-in MPS control
//! program (hack/fake-mps) as the driver's `nvidia-cuda-mps-control`. The share pods run the
//! stand-in CUDA client, which connects to its GPU's daemon through the pipe directory and the
//! `/dev/shm` their CDI spec mounts, prints the limits it was given and holds its connection:
//! it fails the moment its MPS server goes away.
//!
//! The overlay adds only what the lab lacks: the stand-in driver under the node's state
//! directory (`--driver-root`) and the sharing section of the node config.

use crate::cluster::{self, eventually, image, ClusterLab, AGENT_NS, NODE};
use crate::deploy::{
    agent_pods, agents_ready, app_pods, apply_overlay_with, controllers_ready, lab_with_image,
    pod_phase, pod_token_kubeconfig, rollout,
};
use crate::support;
use serde_json::Value;

/// The stand-in driver root, under the node's /var/lib/gpuplane (the lab's nodes have no
/// /run/nvidia/driver of their own to write to).
const STAND_IN: &str = "/var/lib/gpuplane/stand-in-driver";

/// The agents' DaemonSet: the stand-in driver root.
fn driver_root_patch() -> String {
    let arg = "/spec/template/spec/containers/0/args/4";
    format!(
        "    - {{op: test, path: {arg}, value: --driver-root=/run/nvidia/driver}}\n    - {{op: replace, path: {arg}, value: --driver-root={STAND_IN}}}\n"
    )
}

/// Every GPU shared in steps of 1Gi and 10%.
const SHARING: &str =
    "sharing:\n  consumableCapacity:\n    gpus: all\n    memoryStep: 1Gi\n    computeStep: 10\n";

/// The shipped node config with `section` added.
pub(crate) fn config_patch(section: &str) -> String {
    let shipped =
        std::fs::read_to_string(cluster::repo().join("daemonset/node/config.yaml")).unwrap();
    let map: Value = serde_yaml_ng::from_str(&shipped).unwrap();
    let config = format!("{}{section}", map["data"]["config.yaml"].as_str().unwrap());
    format!(
        "- target: {{kind: ConfigMap, name: gpuplane-node-config}}\n  patch: |-\n    - {{op: replace, path: /data/config.yaml, value: {}}}\n",
        serde_json::to_string(&config).unwrap()
    )
}

/// Puts the stand-in MPS control program and CUDA client into every node's driver root.
fn install_stand_in(lab: &ClusterLab) {
    use std::os::unix::fs::PermissionsExt;
    for node in lab.nodes() {
        let bin = node.state_dir().join("stand-in-driver/usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        for (from, to) in [
            (support::built_fake_mps(), "nvidia-cuda-mps-control"),
            (support::built_fake_cuda_client(), "fake-cuda-client"),
        ] {
            std::fs::copy(from, bin.join(to)).unwrap();
            std::fs::set_permissions(bin.join(to), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        for dir in [node.state_dir(), node.state_dir().join("stand-in-driver")] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
}

fn deploy(lab: &ClusterLab, image_ref: &str) {
    apply_overlay_with(
        lab,
        image_ref,
        &driver_root_patch(),
        &[config_patch(SHARING)],
    );
}

/// A pod on lab-node holding a share (`memory`, `compute` percent) of GPU 0, run as `uid`,
/// running the stand-in CUDA client (from the node's driver root) in our image (it has the C
/// library the client needs).
fn share_pod(lab: &ClusterLab, name: &str, uid: u32, memory: &str, compute: u32, image: &str) {
    let extra = [
        "selectors: [{cel: {expression: 'device.attributes[\"gpu.gpuplane.dev\"].index == 0'}}]"
            .to_string(),
        format!("capacity: {{requests: {{memory: {memory}, compute: \"{compute}\"}}}}"),
    ];
    lab.apply(&cluster::claim_template("default", name, &extra));
    lab.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {NODE}}}
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  securityContext: {{runAsUser: {uid}, runAsGroup: {uid}}}
  resourceClaims: [{{name: gpu, resourceClaimTemplateName: {name}}}]
  volumes: [{{name: stand-in, hostPath: {{path: {STAND_IN}/usr/bin, type: Directory}}}}]
  containers:
  - name: cuda
    image: {image}
    imagePullPolicy: Never
    command: ["/stand-in/fake-cuda-client"]
    stdin: true
    volumeMounts: [{{name: stand-in, mountPath: /stand-in, readOnly: true}}]
    resources: {{claims: [{{name: gpu}}]}}
"#
    ));
}

/// The `ShareLimitsEnforced` condition of `pod`'s claim, once the agent wrote it; also checks
/// that the claim's share is not marked memory-held.
fn share_condition(lab: &ClusterLab, pod: &str) -> Value {
    let claim = eventually(&format!("{pod}'s claim"), || {
        let out = lab.kubectl(&["get", "pod", pod, "-o", "json"]);
        let p: Value = serde_json::from_slice(&out.stdout).ok()?;
        p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
            .as_str()
            .map(str::to_string)
    });
    eventually(&format!("{pod}'s ShareLimitsEnforced condition"), || {
        let out = lab.kubectl(&["get", "resourceclaim", &claim, "-o", "json"]);
        let c: Value = serde_json::from_slice(&out.stdout).ok()?;
        let device = &c["status"]["devices"][0];
        assert_eq!(device["data"]["share"]["memoryHeld"], false, "{device}");
        device["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "ShareLimitsEnforced")
            .cloned()
    })
}

/// The client's lines so far.
fn client_log(lab: &ClusterLab, pod: &str) -> String {
    String::from_utf8_lossy(&lab.kubectl(&["logs", pod]).stdout).to_string()
}

/// Waits until `pod`'s client connected; its `active-thread-percentage`.
fn connected(lab: &ClusterLab, pod: &str) -> String {
    let line = eventually(&format!("{pod}'s client connected"), || {
        let log = client_log(lab, pod);
        log.lines()
            .find(|l| l.starts_with("connected "))
            .map(String::from)
    });
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("active-thread-percentage="))
        .unwrap_or_else(|| panic!("{line}"))
        .to_string()
}

/// Every client still holds the connection it made first: its pod runs and it connected once.
fn still_connected(lab: &ClusterLab, pods: &[&str], after: &str) {
    for pod in pods {
        let log = client_log(lab, pod);
        assert_eq!(
            pod_phase(lab, "default", pod).as_deref(),
            Some("Running"),
            "{pod} after {after}: {log}\n{}",
            lab.describe_pod(pod)
        );
        assert_eq!(
            log.lines().filter(|l| l.starts_with("connected ")).count(),
            1,
            "{pod} after {after}: {log}"
        );
    }
}

/// The MPS daemon pods: (node, name, uid, restart count).
fn daemon_pods(lab: &ClusterLab) -> Vec<(String, String, String, u64)> {
    let pods = lab
        .get_json(&[
            "get",
            "pods",
            "-n",
            AGENT_NS,
            "-l",
            "app.kubernetes.io/name=gpuplane-mps",
        ])
        .unwrap_or(Value::Null);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |v: &Value| v.as_str().unwrap_or("").to_string();
            (
                s(&p["spec"]["nodeName"]),
                s(&p["metadata"]["name"]),
                s(&p["metadata"]["uid"]),
                p["status"]["containerStatuses"][0]["restartCount"]
                    .as_u64()
                    .unwrap_or(0),
            )
        })
        .collect()
}

fn lab_node_agent(lab: &ClusterLab) -> Option<String> {
    agent_pods(lab)
        .into_iter()
        .find(|p| p.0 == NODE && p.2)
        .map(|p| p.1)
}

/// Three share pods on one GPU, two of them with other users than root, keep their MPS
/// connection through a deleted agent pod, a rolling update to another build and the agent
/// leaving the node and coming back; the GPU's daemon runs in one pod of its own the whole
/// time, and new shares are prepared after each. Their last unprepare deletes the daemon pod;
/// uninstalling deletes one that still serves.
#[test]
fn shares_keep_their_mps_server_through_agent_restarts_upgrades_and_returns() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    install_stand_in(&lab);
    deploy(&lab, &built.reference);
    agents_ready(&lab);
    controllers_ready(&lab);
    let image = built.reference.as_str();
    let mut pods = three_shares_connect(&lab, image);
    // These nodes mount cgroup v1 at /sys/fs/cgroup (the lab's kubelet runs cgroupfs on v1), where
    // NVIDIA's per-cgroup memory limit does not exist: the claim says its memory is cooperative
    // too, never held.
    let condition = share_condition(&lab, "share-a");
    assert_eq!(condition["reason"], "MPS", "{condition}");
    assert_eq!(condition["status"], "False", "{condition}");
    let daemons = daemon_pods(&lab);
    assert_eq!(
        daemons.len(),
        1,
        "one daemon pod for the shared GPU: {daemons:?}"
    );
    assert_eq!(daemons[0].0, NODE);
    let daemon = daemons[0].clone();
    let same_daemon = |after: &str| {
        let now = daemon_pods(&lab);
        assert_eq!(now, vec![daemon.clone()], "the daemon pod after {after}");
    };

    the_agents_token_creates_only_daemon_pods_of_its_build(&lab, &daemon.1);

    // (b) The agent's pod deleted: the DaemonSet makes a new one.
    // The new agent prepares shares. (A share whose prepare the kubelet tried while no agent
    // was registered waits for the kubelet's retry backoff instead: about 70 s here.)
    let first = lab_node_agent(&lab).unwrap();
    let began = std::time::Instant::now();
    lab.kubectl_ok(&["delete", "pod", &first, "-n", AGENT_NS, "--wait=false"]);
    eventually("a new agent pod Ready on lab-node", || {
        lab_node_agent(&lab).filter(|p| *p != first)
    });
    let ready = began.elapsed().as_secs_f64();
    share_pod(&lab, "share-d", 3000, "5Gi", 10, image);
    assert_eq!(connected(&lab, "share-d"), "10.0");
    eprintln!(
        "agent pod deleted -> new agent Ready {ready:.1}s -> a share created then connected {:.1}s",
        began.elapsed().as_secs_f64()
    );
    pods.push("share-d");
    still_connected(&lab, &pods, "the agent pod's deletion");
    same_daemon("the agent pod's deletion");

    // (a) A rolling update to another build.
    let second = image::build(&lab.work, "2", "2").unwrap();
    lab.import_image(&second.tar);
    deploy(&lab, &second.reference);
    rollout(&lab);
    still_connected(&lab, &pods, "the rolling update");
    same_daemon("the rolling update");
    share_pod(&lab, "share-e", 1000, "5Gi", 10, image);
    assert_eq!(connected(&lab, "share-e"), "10.0");
    pods.push("share-e");

    // (c) The agent leaves the node (its DaemonSet no longer selects it) and comes back.
    lab.kubectl_ok(&["label", "node", NODE, "nvidia.com/gpu.present-"]);
    eventually("no agent pod on lab-node", || {
        (!agent_pods(&lab).iter().any(|p| p.0 == NODE)).then_some(())
    });
    still_connected(&lab, &pods, "the agent's leaving");
    lab.kubectl_ok(&["label", "node", NODE, "nvidia.com/gpu.present=true"]);
    eventually("the agent back on lab-node", || lab_node_agent(&lab));
    still_connected(&lab, &pods, "the agent's return");
    same_daemon("the agent's return");
    share_pod(&lab, "share-f", 0, "5Gi", 10, image);
    assert_eq!(connected(&lab, "share-f"), "10.0");
    pods.push("share-f");

    the_last_unprepare_deletes_the_daemon_pod(&lab, &pods);
    uninstalling_deletes_a_serving_daemon_pod(&lab, image);
}

/// Three share pods on one GPU, two of them of other users than root, each connected with its
/// compute share; their names.
fn three_shares_connect(lab: &ClusterLab, image: &str) -> Vec<&'static str> {
    let mut pods = Vec::new();
    for (name, uid, memory, compute) in [
        ("share-a", 1000, "20Gi", 30),
        ("share-b", 2000, "20Gi", 20),
        ("share-c", 0, "10Gi", 10),
    ] {
        let began = std::time::Instant::now();
        share_pod(lab, name, uid, memory, compute, image);
        assert_eq!(connected(lab, name), format!("{compute}.0"), "{name}");
        // Wall times for benches/results/dra.txt: share-a starts the GPU's daemon pod.
        eprintln!(
            "{name} created -> client connected: {:.1}s",
            began.elapsed().as_secs_f64()
        );
        pods.push(name);
    }
    pods
}

/// The agent's own token may create daemon pods of its build on its node, and nothing else:
/// the daemon pod `daemon` with another image is refused.
fn the_agents_token_creates_only_daemon_pods_of_its_build(lab: &ClusterLab, daemon: &str) {
    let agent = lab_node_agent(lab).unwrap();
    let kubeconfig = pod_token_kubeconfig(lab, &agent);
    let mut forged = lab
        .get_json(&["get", "pod", daemon, "-n", AGENT_NS])
        .unwrap();
    forged["metadata"] = serde_json::json!({"name": "forged", "namespace": AGENT_NS,
        "labels": forged["metadata"]["labels"].clone()});
    forged["spec"]["containers"][0]["image"] = "lab.local/busybox:1".into();
    forged.as_object_mut().unwrap().remove("status");
    let out = lab.kubectl_as(
        &kubeconfig,
        &["create", "-f", "-"],
        Some(&forged.to_string()),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a daemon pod of another image was admitted"
    );
    assert!(
        err.contains("gpuplane-node-mps-pods") && err.contains("lab.local/busybox:1"),
        "{err}"
    );
}

/// The last share's unprepare deletes the daemon pod and its files.
fn the_last_unprepare_deletes_the_daemon_pod(lab: &ClusterLab, pods: &[&str]) {
    for pod in pods {
        lab.kubectl_ok(&["delete", "pod", pod, "--wait=false"]);
    }
    eventually("no MPS daemon pod once the shares are gone", || {
        daemon_pods(lab).is_empty().then_some(())
    });
    let mps_dir = lab.nodes()[0].state_dir().join("mps");
    eventually("the daemon's files removed", || {
        let left = std::fs::read_dir(&mps_dir).map(|d| d.count()).unwrap_or(0);
        (left == 0).then_some(())
    });
}

/// Uninstalling with a share running leaves no daemon pod behind.
fn uninstalling_deletes_a_serving_daemon_pod(lab: &ClusterLab, image: &str) {
    share_pod(lab, "share-g", 0, "5Gi", 10, image);
    connected(lab, "share-g");
    assert_eq!(daemon_pods(lab).len(), 1);
    let overlay = lab.work.join("deploy");
    lab.kubectl_ok(&["delete", "-k", overlay.to_str().unwrap(), "--wait=false"]);
    eventually("no MPS daemon pod after uninstalling", || {
        (daemon_pods(lab).is_empty() && app_pods(lab, "gpuplane-node").is_empty()).then_some(())
    });
}
