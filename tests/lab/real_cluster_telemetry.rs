//! Device telemetry against real Kubernetes (issue 40): the agent over the fake libnvidia-ml
//! reads the host's real /proc, so the PIDs the fake NVML names are those of real containers
//! that the lab's kubelet and containerd started, in the cgroups they made; the pods come from
//! the real API server through the agent's RBAC. A busy and an idle pod each ask for an
//! `nvidia.com/gpu` (which the scheduler may satisfy through DRA, with a claim it generates for
//! the extended resource): each reading lands on its pod, and the idle one gets one Event.
//! Skips like tests/lab/real_cluster.rs (root and the cluster binaries needed), fails under `CI`.

use crate::cluster;
use crate::cluster::{eventually, eventually_or, ClusterLab, LabAgent, LabProcess};
use crate::support;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const METRICS: &str = "127.0.0.1:9400";
const NS: &str = "telemetry";
const GIB: u64 = 1 << 30;

/// The agent over the fake NVML (dgx-h100), sampling every 200 ms, reading the host's /proc,
/// reporting holds idle for 3 s; its telemetry file.
pub(crate) fn start_agent(lab: &ClusterLab, kubeconfig: &Path, tag: &str) -> (LabProcess, PathBuf) {
    let dir = LabAgent::dir(lab);
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    gpuplane_testkit::doubles::devnodes::make_gpu_nodes(&dev, 0..8).unwrap();
    let telemetry = dir.join("telemetry.json");
    let fake = support::built_fake();
    let agent = LabAgent::start_with(
        lab,
        kubeconfig,
        tag,
        &[
            "--nvml-lib",
            fake.to_str().unwrap(),
            "--device-plugin=true",
            "--telemetry-interval=200ms",
            "--host-proc=/proc",
            "--idle-after=3s",
        ],
        &[
            ("GPUPLANE_FAKE_NVML_PROFILE", "dgx-h100".as_ref()),
            ("GPUPLANE_FAKE_NVML_TELEMETRY", telemetry.as_os_str()),
        ],
        None,
    );
    (agent, telemetry)
}

pub(crate) fn metrics(lab: &ClusterLab, family: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let out = lab
        .in_netns("curl")
        .args(["-sf", &format!("http://{METRICS}/metrics")])
        .output()
        .unwrap();
    gpuplane_testkit::metrics_text::series(&String::from_utf8_lossy(&out.stdout), family)
}

/// The host PIDs of pod `name`'s container: processes whose cgroup names the pod's UID and
/// the container's runtime ID, as the real kubelet and containerd made them.
pub(crate) fn container_pids(lab: &ClusterLab, ns: &str, name: &str) -> Vec<u32> {
    let pod = lab.get_json(&["get", "pod", "-n", ns, name]).unwrap();
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_string();
    let id = pod["status"]["containerStatuses"][0]["containerID"]
        .as_str()
        .and_then(|c| c.split_once("://"))
        .map(|(_, id)| id.to_string())
        .unwrap();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        let in_pod = cgroup.contains(&uid) || cgroup.contains(&uid.replace('-', "_"));
        if in_pod && cgroup.contains(&id) {
            pids.push(pid);
        }
    }
    pids
}

/// The GPU the agent says pod `name` holds.
pub(crate) fn held_gpu(lab: &ClusterLab, ns: &str, name: &str) -> String {
    eventually_or(
        &format!("a GPU held by pod {name} in gpuplane_device_holder_info"),
        || {
            metrics(lab, "gpuplane_device_holder_info")
                .into_iter()
                .find(|(l, _)| l["pod"] == name && l["namespace"] == ns)
                .map(|(l, _)| l["uuid"].clone())
        },
        || {
            let info = metrics(lab, "gpuplane_device_holder_info");
            let up = metrics(lab, "gpuplane_device_up");
            format!(
                "holders: {info:?}\nup: {up:?}\n{}",
                lab.describe_pod_in(ns, name)
            )
        },
    )
}

/// Every whole GPU of bundled machine `profile` busy, with no processes: what a telemetry file
/// holds before a test says what its pods do. A hold's idle clock starts at its hand-out, so
/// under load a pod could be reported idle before the test has written its readings.
pub(crate) fn all_busy(profile: &str) -> Value {
    let gpus = crate::deploy::machine(profile).1;
    gpus.into_iter()
        .map(|uuid| (uuid, json!({"gpuUtil": 80})))
        .collect()
}

pub(crate) fn set_telemetry(path: &Path, devices: Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json!({ "devices": devices }).to_string()).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

#[test]
fn real_containers_processes_land_on_their_pods_and_an_idle_gpu_gets_one_event() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let (_agent, telemetry) = start_agent(&lab, &lab.install_agent_identity(), "telemetry");
    set_telemetry(&telemetry, all_busy("dgx-h100"));
    lab.kubectl_ok(&["create", "namespace", NS]);
    for name in ["busy", "idle"] {
        lab.apply(&cluster::sleeping_gpu_pod(NS, name, 1, "", ""));
    }
    for name in ["busy", "idle"] {
        cluster::wait_running(&lab, NS, name);
    }
    let (busy_gpu, idle_gpu) = (held_gpu(&lab, NS, "busy"), held_gpu(&lab, NS, "idle"));
    let (busy_pids, idle_pids) = (
        container_pids(&lab, NS, "busy"),
        container_pids(&lab, NS, "idle"),
    );
    assert!(
        !busy_pids.is_empty() && !idle_pids.is_empty(),
        "{busy_pids:?} {idle_pids:?}"
    );
    set_telemetry(
        &telemetry,
        json!({
            busy_gpu.clone(): {"gpuUtil": 80, "processes": [{"pid": busy_pids[0], "memoryBytes": 2 * GIB, "smUtil": 80}]},
            idle_gpu.clone(): {"gpuUtil": 0, "processes": [{"pid": idle_pids[0], "memoryBytes": GIB}]}
        }),
    );
    for (name, gpu, memory) in [("busy", &busy_gpu, 2 * GIB), ("idle", &idle_gpu, GIB)] {
        let what = format!("{name}'s container charged {memory} bytes of {gpu}");
        eventually(&what, || {
            metrics(&lab, "gpuplane_container_gpu_memory_used_bytes")
                .iter()
                .any(|(l, v)| {
                    l["uuid"] == *gpu
                        && l["namespace"] == NS
                        && l["pod"] == name
                        && l["container"] == "c"
                        && !l["api"].is_empty()
                        && *v == memory as f64
                })
                .then_some(())
        });
    }
    let events = eventually("the GpuIdle Event on pod idle", || {
        let e = cluster::pod_events(&lab, NS, "idle", "GpuIdle");
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains(&idle_gpu)),
        "{events:?}"
    );
    assert!(cluster::pod_events(&lab, NS, "busy", "GpuIdle").is_empty());
}
