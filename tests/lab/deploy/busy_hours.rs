//! Busy vs allocated GPU-hours as users deploy them (issue 40): the chart on the three-node
//! lab with telemetry every 500 ms (idle after 3 s), the controller's
//! `controller.prometheusUrl` naming a real Prometheus 3 (hack/cluster/build.sh builds it)
//! outside the pod network and asking for basic auth (the chart's
//! `controller.prometheusBasicAuthSecret`, a kubernetes.io/basic-auth Secret, and a tenant
//! header), which finds the agents and controllers through the API server by
//! the chart's `prometheus.io/*` pod annotations, as the prometheus-community chart's default
//! `kubernetes-pods` job does. A namespace runs a busy pod (its GPU 80% busy for a stretch the
//! test times) on lab-node and an idle one on lab-node-3; the agents roll and the controller's
//! leader goes in the middle. The report and the GpuQuota's `status.gpuHours` then show busy
//! vs allocated per owner, never counting twice; every dashboard query answers; no device
//! series is put on the agent's own pod.

use super::controller::lease_holder;
use super::helm_install::{helm_install, release_namespace};
use super::*;
use crate::cluster::{eventually_or, LabPrometheus};
use crate::deploy_telemetry::{node_pid, write_telemetry};
use crate::real_cluster_busy_hours::{
    busy_vs_allocated_booked, dashboard_queries_answer, now_ms, users_read_busy_vs_allocated,
};
use crate::real_cluster_telemetry::container_pids;
use serde_json::json;
use std::time::Instant;

const NS: &str = "busy-deployed";
const GIB: u64 = 1 << 30;
/// The pods: name (and owner `team`), node, GPU memory their process uses.
const PODS: [(&str, &str, u64); 2] = [("busy", NODE, 2 * GIB), ("idle", "lab-node-3", GIB)];

/// The busy pod's busy-seconds counter as Prometheus has it now: one (scraped agent
/// `instance`, value) per live series (a gone agent's series are marked stale).
fn busy_counters(lab: &ClusterLab, prometheus: &LabPrometheus) -> Vec<(String, f64)> {
    let expr =
        format!("gpuplane_container_gpu_busy_seconds_total{{namespace=\"{NS}\",pod=\"busy\"}}");
    prometheus
        .query(lab, &expr)
        .iter()
        .filter_map(|s| {
            let value = s["value"][1].as_str()?.parse().ok()?;
            Some((s["metric"]["instance"].as_str()?.to_string(), value))
        })
        .collect()
}

/// The counter's value once it has one live series past `past`, and its agent.
fn busy_past(lab: &ClusterLab, prometheus: &LabPrometheus, past: f64) -> (String, f64) {
    eventually(
        &format!("Prometheus to have the busy pod's counter past {past} s"),
        || match busy_counters(lab, prometheus).as_slice() {
            [(instance, v)] if *v > past => Some((instance.clone(), *v)),
            _ => None,
        },
    )
}

/// The GPU pod `name` holds, as Prometheus has it from the agents.
fn held_gpu(lab: &ClusterLab, prometheus: &LabPrometheus, name: &str) -> String {
    let expr = format!("gpuplane_device_holder_info{{namespace=\"{NS}\",pod=\"{name}\"}}");
    eventually_or(
        &format!("Prometheus to have pod {name}'s GPU from its agent"),
        || {
            let answer = prometheus.query(lab, &expr);
            answer.first()?["metric"]["uuid"].as_str().map(String::from)
        },
        || format!("{:?}", prometheus.query(lab, "up")),
    )
}

/// Each pod's node and what its GPU does: the busy one 80% busy while `busy`, the idle one
/// never; each pod's process uses its memory.
fn telemetry(lab: &ClusterLab, held: &[(String, u32, u64)], busy: bool) {
    for ((name, node, _), (gpu, pid, memory)) in PODS.iter().zip(held) {
        let util = if *name == "busy" && busy { 80 } else { 0 };
        let process = json!({"pid": pid, "memoryBytes": memory, "smUtil": util});
        write_telemetry(
            lab,
            node,
            json!({ gpu.clone(): {"gpuUtil": util, "processes": [process]} }),
        );
    }
}

#[test]
fn deployed_agents_and_controller_book_busy_vs_allocated_hours_from_a_prometheus_that_finds_them() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    let prometheus = LabPrometheus::discovering_pods(&lab);
    let url = format!("controller.prometheusUrl={}", prometheus.url());
    release_namespace(&lab);
    lab.apply(&prometheus.basic_auth_secret(AGENT_NS, "prometheus-auth"));
    let values = [
        "--set",
        "controller.prometheusBasicAuthSecret=prometheus-auth",
        // What a Mimir or Cortex tenant needs; Prometheus itself ignores it.
        "--set",
        "controller.prometheusHeaders.X-Scope-OrgID=gpu-platform",
        "--set",
        "node.telemetry.interval=500ms",
        "--set",
        "node.telemetry.idleAfter=3s",
        "--set",
        "simulate.telemetryFile=/var/lib/gpuplane/telemetry.json",
        "--set",
        &url,
        "--set",
        "controller.ownerLabels={team}",
    ];
    helm_install(&lab, &lab.work.join("helm-home"), &built.reference, &values);
    let held = start_pods(&lab, &prometheus);
    let (stretch, gap, off) = busy_stretch(&lab, &prometheus, &held);
    let busy = busy_vs_allocated_booked(&lab, NS, (stretch, gap), off);
    users_read_busy_vs_allocated(&lab, NS, busy);
    // An unheld device's series have no holder, and Prometheus must not lend them the
    // scraped agent pod's namespace and name.
    let lent = prometheus.query(&lab, "gpuplane_device_up{namespace=\"gpuplane-system\"}");
    assert!(lent.is_empty(), "{lent:?}");
    dashboard_queries_answer(&lab, &prometheus, NS);
}

/// The namespace with a GpuQuota, the busy and idle pods on their nodes; each pod's GPU (from
/// Prometheus), its process's PID as its node sees it, and the memory it will use.
fn start_pods(lab: &ClusterLab, prometheus: &LabPrometheus) -> Vec<(String, u32, u64)> {
    lab.kubectl_ok(&["create", "namespace", NS]);
    lab.apply(&format!(
        "apiVersion: quota.gpuplane.dev/v1alpha1\nkind: GpuQuota\nmetadata: {{name: default, namespace: {NS}}}\nspec:\n  hard: {{gpus: 4}}\n"
    ));
    for (name, node, _) in PODS {
        let meta = format!("  labels: {{team: {name}}}\n");
        let spec = format!("  nodeSelector: {{kubernetes.io/hostname: {node}}}\n");
        let pod = cluster::sleeping_gpu_pod(NS, name, 1, &meta, &spec);
        eventually(&format!("pod {name} to be created"), || {
            lab.create(&pod, &[]).ok()
        });
    }
    PODS.iter()
        .map(|(name, _, memory)| {
            cluster::wait_running(lab, NS, name);
            let pid = node_pid(container_pids(lab, NS, name)[0]);
            (held_gpu(lab, prometheus, name), pid, *memory)
        })
        .collect()
}

/// The busy pod's GPU 80% busy while the agents roll (each restarts its counters) and the
/// controller's leader goes. Returns the stretch's length, how long it took from the start
/// of the roll until the busy pod's agent counted again (an upper bound on what was not
/// sampled), and the wall clock at its end.
fn busy_stretch(
    lab: &ClusterLab,
    prometheus: &LabPrometheus,
    held: &[(String, u32, u64)],
) -> (f64, f64, i64) {
    let on = Instant::now();
    telemetry(lab, held, true);
    let (before, _) = busy_past(lab, prometheus, 5.0);
    let down = Instant::now();
    lab.kubectl_ok(&[
        "rollout",
        "restart",
        "daemonset/gpuplane-node",
        "-n",
        AGENT_NS,
    ]);
    eventually("a rolled agent to count the busy pod", || {
        let now = busy_counters(lab, prometheus);
        now.iter().any(|(i, _)| *i != before).then_some(())
    });
    let gap = down.elapsed().as_secs_f64();
    rollout(lab);
    let controllers = controllers_ready(lab);
    let leader = eventually("the controller's Lease holder", || {
        let h = lease_holder(lab)?;
        controllers
            .iter()
            .find(|c| h.starts_with(&c.0))
            .map(|c| c.0.clone())
    });
    let (_, at_handover) = busy_past(lab, prometheus, 0.0);
    lab.kubectl_ok(&["delete", "pod", &leader, "-n", AGENT_NS, "--wait=true"]);
    eventually("the Lease to move to another replica", || {
        lease_holder(lab).filter(|h| !h.starts_with(&leader))
    });
    busy_past(lab, prometheus, at_handover + 4.0);
    telemetry(lab, held, false);
    (on.elapsed().as_secs_f64(), gap, now_ms())
}
