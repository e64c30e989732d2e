//! Busy GPU-hours on real Kubernetes (issue 40): the agent over the fake libnvidia-ml, a real
//! Prometheus (Debian's, serving HTTPS) scraping it and the controller, and the controller
//! booking busy time from Prometheus' samples (`--prometheus-url`, `--prometheus-ca-file`). A namespace runs a busy pod (its GPU 80%
//! busy for a stretch the test times) and an idle one; the agent restarts and the controller
//! hands over to a new one in the middle. The book, `gpuplane report` and the GpuQuota's
//! `status.gpuHours` then show busy vs allocated per owner: the busy pod's busy time is 80%
//! of the stretch (less what the agent's restart left unsampled, never counted twice), the
//! idle one's 0, and peak memory as its processes used. Every query of the dashboard in
//! deployments/dashboards/ answers from the same Prometheus. Skips like the other labs.

use crate::cluster::{
    self, eventually, gpuplane_json, start_controller_with, wait_controller_ready, ClusterLab,
    LabPrometheus, AGENT_NS,
};
use crate::real_cluster_telemetry::{
    container_pids, held_gpu, metrics, set_telemetry, start_agent,
};
use gpuplane_cluster::controller::hours::{Book, By, ReportRow};
use gpuplane_cluster::controller::meter::{BOOK_KEY, BOOK_NAME};
use serde_json::{json, Value};
use std::time::{Instant, SystemTime};

const NS: &str = "busy-hours";
const GIB: u64 = 1 << 30;

/// The wall clock, ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    let d = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
    i64::try_from(d.unwrap().as_millis()).unwrap()
}

/// The GPU-hours book as the controller last wrote it.
fn book(lab: &ClusterLab) -> Option<Book> {
    let cm = lab.get_json(&["get", "configmap", BOOK_NAME, "-n", AGENT_NS])?;
    Book::from_json(cm["data"][BOOK_KEY].as_str()?).ok()
}

/// The busy pod's counter as the agent exports it now.
fn busy_counter(lab: &ClusterLab) -> Option<f64> {
    metrics(lab, "gpuplane_container_gpu_busy_seconds_total")
        .into_iter()
        .find(|(l, _)| l["namespace"] == NS && l["pod"] == "busy")
        .map(|(_, v)| v)
}

/// Namespace `ns`'s row of owner `team` (label `team`) in the book.
fn row(book: &Book, ns: &str, team: &str) -> ReportRow {
    let r = book.report(&By::Owner("team".into()), Some(ns), None, None);
    r.rows
        .into_iter()
        .find(|r| r.tenant == team)
        .unwrap_or_else(|| panic!("no row for team {team} in {book:?}"))
}

/// The pods' GPUs: the busy one 80% busy (`busy` true) or idle, each pod's process using
/// its memory (2 GiB busy, 1 GiB idle).
fn telemetry(gpus: &[(String, u32, u64)], busy: bool) -> Value {
    let (b, i) = (&gpus[0], &gpus[1]);
    let util = if busy { 80 } else { 0 };
    json!({
        b.0.clone(): {"gpuUtil": util, "processes": [{"pid": b.1, "memoryBytes": b.2, "smUtil": util}]},
        i.0.clone(): {"gpuUtil": 0, "processes": [{"pid": i.1, "memoryBytes": i.2}]}
    })
}

#[test]
fn busy_gpu_hours_come_from_a_real_prometheus_once_across_agent_and_controller_restarts() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let (agent, file) = start_agent(&lab, &installed.agent, "1");
    let Some(prometheus) = LabPrometheus::start(&lab) else {
        return;
    };
    let to_prometheus = prometheus.controller_flags();
    let mut flags = vec![
        "--gpu-hours-interval=2s",
        // The watermark trails the clock by more than a loaded lab's kubelet takes to report
        // a container's start: a start seen behind the watermark would lose its time before it.
        "--gpu-hours-lag=8s",
        "--owner-label=team",
    ];
    flags.extend(to_prometheus.iter().map(String::as_str));
    let controller = start_controller_with(&lab, &installed, "1", &flags);
    wait_controller_ready(&lab);
    lab.kubectl_ok(&["create", "namespace", NS]);
    lab.apply(&format!(
        "apiVersion: quota.gpuplane.dev/v1alpha1\nkind: GpuQuota\nmetadata: {{name: default, namespace: {NS}}}\nspec:\n  hard: {{gpus: 4}}\n"
    ));
    for name in ["busy", "idle"] {
        let meta = format!("  labels: {{team: {name}}}\n");
        eventually(&format!("pod {name} to be created"), || {
            lab.create(&cluster::sleeping_gpu_pod(NS, name, 1, &meta, ""), &[])
                .ok()
        });
    }
    let mut gpus = Vec::new();
    for (name, memory) in [("busy", 2 * GIB), ("idle", GIB)] {
        cluster::wait_running(&lab, NS, name);
        let pid = container_pids(&lab, NS, name)[0];
        gpus.push((held_gpu(&lab, NS, name), pid, memory));
    }
    // The stretch the busy pod's GPU is 80% busy: [on, off].
    let on = Instant::now();
    set_telemetry(&file, telemetry(&gpus, true));
    eventually("the busy pod's counter to grow past 5 s", || {
        busy_counter(&lab).filter(|v| *v > 5.0)
    });
    // The agent restarts: its counters start over; what it did not sample while down is lost.
    let down = Instant::now();
    agent.stop();
    let (_agent, _) = start_agent(&lab, &installed.agent, "2");
    eventually("the restarted agent to count the busy pod again", || {
        busy_counter(&lab).filter(|v| *v > 0.0)
    });
    let gap = down.elapsed().as_secs_f64();
    // The controller hands over to a new leader, which goes on from the book's watermarks.
    controller.stop();
    let _controller = start_controller_with(&lab, &installed, "2", &flags);
    wait_controller_ready(&lab);
    eventually("the busy pod's counter to grow past 4 s again", || {
        busy_counter(&lab).filter(|v| *v > 4.0)
    });
    set_telemetry(&file, telemetry(&gpus, false));
    let (stretch, off) = (on.elapsed().as_secs_f64(), now_ms());
    let busy = busy_vs_allocated_booked(&lab, NS, (stretch, gap), off);
    users_read_busy_vs_allocated(&lab, NS, busy);
    dashboard_queries_answer(&lab, &prometheus, NS);
}

/// Waits until the book has busy time past `off` (ms since the epoch), then checks namespace
/// `ns`'s owners: `busy` (80% busy for a stretch of `stretch` s, of which the agent sampled
/// nothing for up to `gap` s) within its bounds and below its allocated time, `idle` none; peak
/// memory 2 GiB and 1 GiB. Returns the busy owner's busy GPU-seconds.
pub(crate) fn busy_vs_allocated_booked(
    lab: &ClusterLab,
    ns: &str,
    (stretch, gap): (f64, f64),
    off: i64,
) -> f64 {
    let b = eventually("busy time to be booked past the stretch", || {
        book(lab).filter(|b| b.busy_watermark().is_some_and(|w| w > off + 2_000))
    });
    let (busy, idle) = (row(&b, ns, "busy"), row(&b, ns, "idle"));
    // 2 s for the agent's rounds at the stretch's two edges on a loaded machine; counting the
    // seconds before a restart twice would be past `high`.
    let (low, high) = (0.8 * (stretch - gap) - 2.0, 0.8 * stretch + 2.0);
    eprintln!(
        "busy pod: {:.2} busy GPU-s of {:.2} allocated; want {low:.2}..{high:.2} (stretch {stretch:.2} s, unsampled up to {gap:.2} s)",
        busy.busy_gpu_seconds, busy.gpu_seconds
    );
    assert!(
        (low..=high).contains(&busy.busy_gpu_seconds),
        "busy {} not in {low}..{high}: {b:?}",
        busy.busy_gpu_seconds
    );
    assert!(busy.gpu_seconds > busy.busy_gpu_seconds, "{b:?}");
    assert_eq!(idle.busy_gpu_seconds, 0.0, "{b:?}");
    assert!(idle.gpu_seconds > 0.0, "{b:?}");
    assert_eq!(busy.peak_gpu_memory_bytes, (2 * GIB) as f64);
    assert_eq!(idle.peak_gpu_memory_bytes, GIB as f64);
    busy.busy_gpu_seconds
}

/// What users read of namespace `ns`: `gpuplane report` (JSON and table) shows the busy
/// owner's `busy_seconds` or more, the idle one's none, and the GpuQuota's `status.gpuHours`
/// catches up.
pub(crate) fn users_read_busy_vs_allocated(lab: &ClusterLab, ns: &str, busy_seconds: f64) {
    let json = gpuplane_json(lab, &["report", "--by", "team", "-n", ns, "-o", "json"]);
    let rows = json["rows"].as_array().unwrap();
    let of = |team: &str| rows.iter().find(|r| r["tenant"] == team).unwrap().clone();
    assert!(of("busy")["busyGpuSeconds"].as_f64().unwrap() >= busy_seconds);
    assert!(of("idle")["gpuHours"].as_f64().unwrap() > 0.0, "{json}");
    assert_eq!(of("idle")["busyGpuHours"].as_f64(), Some(0.0), "{json}");
    assert_eq!(of("busy")["peakGpuMemoryGib"].as_f64(), Some(2.0), "{json}");
    let table = lab
        .in_netns(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["report", "--by", "team", "-n", ns, "--kubeconfig"])
        .arg(lab.admin_kubeconfig())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("BUSY-GPU-HOURS") && table.contains("PEAK-GPU-MEM-GIB"),
        "{table}"
    );
    eventually("status.gpuHours to show busy time", || {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", ns])?;
        let s = q["status"]["gpuHours"]["busyGpuSeconds"].as_f64()?;
        (s >= busy_seconds).then_some(())
    });
}

/// Every query of deployments/dashboards/gpuplane.json, with `$namespace` as `ns`, answers
/// with data from the Prometheus scraping the real agents and controller.
pub(crate) fn dashboard_queries_answer(lab: &ClusterLab, prometheus: &LabPrometheus, ns: &str) {
    let path = cluster::repo().join("deployments/dashboards/gpuplane.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let mut asked = 0;
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap().replace("$namespace", ns);
            let title = panel["title"].as_str().unwrap_or_default();
            eventually(&format!("panel {title:?}'s query {expr} to answer"), || {
                (!prometheus.query(lab, &expr).is_empty()).then_some(())
            });
            asked += 1;
        }
    }
    assert!(asked >= 15, "{asked} queries");
}
