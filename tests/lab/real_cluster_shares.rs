//! Fractional GPUs against real Kubernetes (issue 24): the agent publishes the simulated
//! dgx-a100's GPUs (80Gi each) as shared devices, the real kube-apiserver validates them, the
//! real scheduler packs claims by memory and compute (`consumedCapacity`, `shareID`), the real
//! kubelet prepares them, and the containers containerd starts see their share and their MPS
//! limits, one MPS control daemon (the stand-in of hack/fake-mps) per shared GPU. Skips like
//! tests/lab/real_cluster.rs (root and the cluster binaries needed), fails instead under `CI`.

use crate::cluster;
use crate::support;

use crate::cluster::{eventually, ClusterLab, LabAgent, LabProcess, NODE};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Every GPU of the node shared in steps of 1Gi and 10%.
const CONFIG: &str = "version: v1\nsharing:\n  consumableCapacity:\n    gpus: all\n    memoryStep: 1Gi\n    computeStep: 10\n";

/// Kills every stand-in MPS daemon whose pid file is under the lab's agent state dir when
/// dropped: the agent detaches its daemons, so the lab's teardown does not reach them when a
/// test fails before the last share ends.
struct Daemons(PathBuf);

impl Drop for Daemons {
    fn drop(&mut self) {
        let gpus = std::fs::read_dir(self.0.join("state/mps"))
            .into_iter()
            .flatten();
        for gpu in gpus.flatten() {
            let pid_file = gpu.path().join("pipe/nvidia-cuda-mps-control.pid");
            if let Ok(pid) = std::fs::read_to_string(pid_file) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", pid.trim()])
                    .status();
            }
        }
    }
}

/// The lab, the agent's kubeconfig and the agent on the simulated dgx-a100 sharing its GPUs,
/// with the stand-in MPS control program in its driver root; once all 8 GPUs are published.
fn lab_sharing() -> Option<(ClusterLab, PathBuf, LabProcess)> {
    let lab = ClusterLab::start()?;
    let kubeconfig = lab.install_agent_identity();
    let bin = LabAgent::dir(&lab).join("driver/usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(
        support::built_fake_mps(),
        bin.join("nvidia-cuda-mps-control"),
    )
    .unwrap();
    let agent = start_agent(&lab, &kubeconfig, "1");
    eventually("8 shared GPUs in lab-node's ResourceSlices", || {
        let shared = cluster::node_devices(&lab)
            .iter()
            .filter(|d| d["allowMultipleAllocations"] == true)
            .count();
        (shared == 8).then_some(())
    });
    Some((lab, kubeconfig, agent))
}

fn start_agent(lab: &ClusterLab, kubeconfig: &std::path::Path, tag: &str) -> LabProcess {
    LabAgent::start_with(
        lab,
        kubeconfig,
        tag,
        &["--simulate", "dgx-a100", "--device-plugin=true"],
        &[],
        Some(CONFIG),
    )
}

/// A pod holding a share (`memory`, `compute` percent) of one GPU that also matches `cel`,
/// printing its environment and then sleeping.
fn share_pod(lab: &ClusterLab, name: &str, memory: &str, compute: u32, cel: &str) {
    let extra = [
        format!("selectors: [{{cel: {{expression: '{cel}'}}}}]"),
        format!("capacity: {{requests: {{memory: {memory}, compute: \"{compute}\"}}}}"),
    ];
    lab.apply(&cluster::claim_template("default", name, &extra));
    lab.apply(&cluster::claim_pod("default", name, name));
}

/// A pod asking for `gpus` whole GPUs through the device plugin API.
fn device_plugin_pod(lab: &ClusterLab, name: &str, gpus: u32) {
    lab.apply(&cluster::gpu_pod(
        "default",
        name,
        gpus,
        r#"["sh", "-c", "env; sleep 3600"]"#,
    ));
}

fn value<'a>(env: &'a [String], key: &str) -> Option<&'a str> {
    env.iter().find_map(|l| l.strip_prefix(&format!("{key}=")))
}

/// The GPU UUID a container got (`GPUPLANE_DEVICE_<index>=index=..,uuid=..`).
fn uuid(env: &[String]) -> String {
    env.iter()
        .filter_map(|l| l.strip_prefix("GPUPLANE_DEVICE_")?.split_once('='))
        .find_map(|(_, v)| v.split(',').find_map(|kv| kv.strip_prefix("uuid=")))
        .unwrap_or_else(|| panic!("no GPU in {env:?}"))
        .to_string()
}

/// The allocation result of the claim of `pod`.
fn allocation(lab: &ClusterLab, pod: &str) -> Value {
    let claims = lab.get_json(&["get", "resourceclaims"]).unwrap();
    claims["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["metadata"]["ownerReferences"][0]["name"] == pod)
        .map(|c| c["status"]["allocation"]["devices"]["results"][0].clone())
        .unwrap_or_else(|| panic!("no claim of pod {pod}"))
}

/// The PID in a GPU's MPS daemon pid file while that process lives.
fn daemon(lab: &ClusterLab, uuid: &str) -> Option<u32> {
    let dir = LabAgent::dir(lab).join(format!("state/mps/{uuid}"));
    let pid: u32 = std::fs::read_to_string(dir.join("pipe/nvidia-cuda-mps-control.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .then_some(pid)
}

fn daemon_starts(lab: &ClusterLab, uuid: &str) -> usize {
    std::fs::read_to_string(LabAgent::dir(lab).join(format!("state/mps/{uuid}/log/control.log")))
        .unwrap_or_default()
        .matches(" start ")
        .count()
}

fn allocatable_gpus(lab: &ClusterLab) -> Option<String> {
    let node = lab.get_json(&["get", "node", NODE])?;
    node["status"]["allocatable"]["nvidia.com/gpu"]
        .as_str()
        .map(String::from)
}

const ANY: &str = "true";
const GPU_INDEX: &str = "device.attributes[\"gpu.gpuplane.dev\"].index";

#[test]
fn shares_pack_one_gpu_under_one_mps_daemon_and_exclude_whole_holds_until_the_last_ends() {
    let Some((lab, kubeconfig, agent)) = lab_sharing() else {
        return;
    };
    let _daemons = Daemons(LabAgent::dir(&lab));
    // The API server accepted the request policies as the agent rendered them.
    let gpu0 = cluster::node_devices(&lab)
        .into_iter()
        .find(|d| d["name"] == "gpu-0")
        .unwrap();
    assert_eq!(
        gpu0["capacity"]["memory"]["requestPolicy"]["validRange"],
        serde_json::json!({"min": "1Gi", "max": "80Gi", "step": "1Gi"})
    );
    assert_eq!(gpu0["capacity"]["compute"]["value"], "100");

    // Two 40Gi halves: the scheduler packs them onto one GPU.
    share_pod(&lab, "half-a", "40Gi", 50, ANY);
    cluster::wait_running(&lab, "default", "half-a");
    share_pod(&lab, "half-b", "40Gi", 50, ANY);
    cluster::wait_running(&lab, "default", "half-b");
    let (a, b) = (
        cluster::pod_env(&lab, "half-a"),
        cluster::pod_env(&lab, "half-b"),
    );
    let shared = uuid(&a);
    assert_eq!(uuid(&b), shared, "both halves on one GPU");
    for env in [&a, &b] {
        assert_eq!(value(env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("50"));
        assert_eq!(
            value(env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            Some("0=40960M")
        );
        assert_eq!(value(env, "GPUPLANE_SHARE_ENFORCEMENT"), Some("MPS"));
        let pipe = value(env, "CUDA_MPS_PIPE_DIRECTORY").unwrap();
        assert!(pipe.ends_with(&format!("mps/{shared}/pipe")), "{pipe}");
    }
    let result = allocation(&lab, "half-a");
    assert_eq!(
        result["consumedCapacity"],
        serde_json::json!({"memory": "40Gi", "compute": "50"})
    );
    assert!(result["shareID"].is_string(), "{result}");
    assert!(daemon(&lab, &shared).is_some(), "the GPU's MPS daemon runs");
    assert_eq!(daemon_starts(&lab, &shared), 1, "one daemon serves both");

    // A third half lands on another GPU; a share that fits nowhere it may go waits.
    share_pod(&lab, "half-c", "40Gi", 50, ANY);
    cluster::wait_running(&lab, "default", "half-c");
    let other = uuid(&cluster::pod_env(&lab, "half-c"));
    assert_ne!(other, shared);
    let index = allocation(&lab, "half-a")["device"]
        .as_str()
        .unwrap()
        .trim_start_matches("gpu-")
        .to_string();
    share_pod(
        &lab,
        "no-room",
        "10Gi",
        10,
        &format!("{GPU_INDEX} == {index}"),
    );
    let why = eventually("the scheduler's reason for no-room", || {
        cluster::unschedulable_reason(&lab, "no-room")
    });
    assert!(why.contains("cannot allocate all claims"), "{why}");

    // Shares exclude whole holds of either API: the device plugin withdraws the two shared
    // GPUs, and a whole-GPU claim on the first waits.
    eventually("the device plugin to offer 6 GPUs", || {
        (allocatable_gpus(&lab).as_deref() == Some("6")).then_some(())
    });
    device_plugin_pod(&lab, "dp-seven", 7);
    let why = eventually("the scheduler's reason for dp-seven", || {
        cluster::unschedulable_reason(&lab, "dp-seven")
    });
    assert!(why.contains("Insufficient nvidia.com/gpu"), "{why}");
    lab.kubectl_ok(&["delete", "pod", "dp-seven", "--wait=false"]);

    // A killed agent comes back with its shares and its daemon.
    let pid = daemon(&lab, &shared).unwrap();
    agent.kill();
    let agent = start_agent(&lab, &kubeconfig, "2");
    eventually("the restarted agent to adopt the daemon", || {
        agent
            .log_text()
            .contains("adopted the running MPS control daemon")
            .then_some(())
    });
    assert_eq!(daemon(&lab, &shared), Some(pid), "the daemon was adopted");

    // The last share ends: the daemon stops, the GPU is whole again for both APIs.
    lab.kubectl_ok(&["delete", "pod", "half-a", "half-b", "half-c", "no-room"]);
    eventually("the MPS daemons to stop", || {
        (daemon(&lab, &shared).is_none() && daemon(&lab, &other).is_none()).then_some(())
    });
    eventually("the device plugin to offer 8 GPUs again", || {
        (allocatable_gpus(&lab).as_deref() == Some("8")).then_some(())
    });
    let holders: BTreeSet<String> = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("stopped the MPS control daemon"))
        .map(String::from)
        .collect();
    assert!(!holders.is_empty(), "the agent logged the stops");
}
