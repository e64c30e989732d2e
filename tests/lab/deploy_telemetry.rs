//! Device telemetry deployed as users deploy it (issue 40): daemonset/ through the deployment
//! overlay of tests/lab/deploy on the three-node lab, its shipped read-only hostPath /proc
//! and RBAC, the agents sampling every 500 ms and following idle holds for 3 s, each node's
//! simulated devices driven by a telemetry file under its state directory
//! (`--simulate-telemetry`). GPU pods on two nodes: the PIDs of their real containers, as the
//! nodes' /proc names them (what NVML would report), land on their pods and containers in
//! each agent pod's /metrics, and the idle pod gets one GpuIdle Event, the busy ones none.

use crate::cluster::{self, eventually, eventually_or, ClusterLab, AGENT_NS, NODE};
use crate::deploy::{
    agent_pods, agents_ready, apply_overlay_with, controllers_ready, gpu_pod, lab_with_image,
    pod_gpus, MACHINES,
};
use crate::real_cluster_telemetry::{all_busy, container_pids};
use serde_json::json;
use std::collections::BTreeMap;

const GIB: u64 = 1 << 30;
/// The third node (a pcie-l4x4).
const OTHER_NODE: &str = "lab-node-3";

/// The agents' DaemonSet: samples every 500 ms, idle after 3 s, the telemetry file.
fn telemetry_patch() -> String {
    let arg = "/spec/template/spec/containers/0/args";
    format!(
        "    - {{op: test, path: {arg}/12, value: --telemetry-interval=10s}}\n\
         \x20   - {{op: replace, path: {arg}/12, value: --telemetry-interval=500ms}}\n\
         \x20   - {{op: add, path: {arg}/-, value: --idle-after=3s}}\n\
         \x20   - {{op: add, path: {arg}/-, value: --simulate-telemetry=/var/lib/gpuplane/telemetry.json}}\n"
    )
}

/// PID `pid` (this test's PID namespace) as the lab's nodes see it: the lab's own PID
/// namespace is the second in `NSpid` (the root's, the lab's, the container's).
pub(crate) fn node_pid(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ns: Vec<u32> = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    ns[1]
}

/// `gpuplane_container_gpu_memory_used_bytes` of the agent pod on `node`, through the API
/// server's pod proxy: (pod, container, uuid) -> bytes.
fn memory_on(lab: &ClusterLab, node: &str) -> BTreeMap<(String, String, String), f64> {
    let Some((_, agent, _)) = agent_pods(lab).into_iter().find(|p| p.0 == node) else {
        return BTreeMap::new();
    };
    let path = format!("/api/v1/namespaces/{AGENT_NS}/pods/{agent}:9400/proxy/metrics");
    let out = lab.kubectl(&["get", "--raw", &path]);
    let text = String::from_utf8_lossy(&out.stdout);
    gpuplane_testkit::metrics_text::series(&text, "gpuplane_container_gpu_memory_used_bytes")
        .into_iter()
        .filter(|(l, _)| l["namespace"] == "default")
        .map(|(l, v)| {
            (
                (l["pod"].clone(), l["container"].clone(), l["uuid"].clone()),
                v,
            )
        })
        .collect()
}

/// Replaces `node`'s telemetry file (under its state directory) with `devices`.
pub(crate) fn write_telemetry(lab: &ClusterLab, node: &str, devices: serde_json::Value) {
    let dir = lab
        .nodes()
        .into_iter()
        .find(|n| n.name == node)
        .unwrap()
        .state_dir();
    let (tmp, file) = (dir.join("telemetry.tmp"), dir.join("telemetry.json"));
    std::fs::write(&tmp, json!({ "devices": devices }).to_string()).unwrap();
    std::fs::rename(tmp, file).unwrap();
}

#[test]
fn deployed_agents_charge_real_containers_to_their_pods_and_report_an_idle_gpu_once() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    apply_overlay_with(&lab, &built.reference, &telemetry_patch(), &[]);
    agents_ready(&lab);
    controllers_ready(&lab);
    for (node, profile) in MACHINES {
        write_telemetry(&lab, node, all_busy(profile));
    }
    let pods = [("busy", NODE), ("idle", NODE), ("l4", OTHER_NODE)];
    for (name, node) in pods {
        gpu_pod(&lab, name, node, name == "idle");
    }
    let mut held = BTreeMap::new();
    for (name, node) in pods {
        cluster::wait_running(&lab, "default", name);
        let gpu = pod_gpus(&lab, name).into_iter().next().unwrap();
        let pid = node_pid(container_pids(&lab, "default", name)[0]);
        held.insert(name, (node, gpu, pid));
    }
    let process = |name: &str, gib: u64, util: u32| {
        let (_, gpu, pid) = &held[name];
        (
            gpu.clone(),
            json!({"gpuUtil": util, "processes": [{"pid": pid, "memoryBytes": gib * GIB, "smUtil": util}]}),
        )
    };
    let (b, i, l) = (
        process("busy", 3, 60),
        process("idle", 1, 0),
        process("l4", 2, 90),
    );
    write_telemetry(&lab, NODE, json!({ b.0: b.1, i.0: i.1 }));
    write_telemetry(&lab, OTHER_NODE, json!({ l.0: l.1 }));
    for (name, gib) in [("busy", 3), ("idle", 1), ("l4", 2)] {
        let (node, gpu, _) = held[name].clone();
        let key = (name.to_string(), "c".to_string(), gpu.clone());
        eventually_or(
            &format!("pod {name}'s container charged {gib} GiB of {gpu} by the agent on {node}"),
            || (memory_on(&lab, node).get(&key) == Some(&((gib * GIB) as f64))).then_some(()),
            || format!("{:?}", memory_on(&lab, node)),
        );
    }
    let events = eventually("the GpuIdle Event on pod idle", || {
        let e = cluster::pod_events(&lab, "default", "idle", "GpuIdle");
        (!e.is_empty()).then_some(e)
    });
    assert_eq!(events.len(), 1, "{events:?}");
    let idle_gpu = &held["idle"].1;
    assert!(
        events[0]["message"]
            .as_str()
            .is_some_and(|m| m.contains(idle_gpu.as_str())),
        "{events:?}"
    );
    for busy in ["busy", "l4"] {
        assert!(cluster::pod_events(&lab, "default", busy, "GpuIdle").is_empty());
    }
}
