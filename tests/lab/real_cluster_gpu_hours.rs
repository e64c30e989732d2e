//! The GPU-hours ledger on real Kubernetes (issue 27): two pods with known lifetimes (`sleep 20`
//! and `sleep 40`, one GPU each, through the node agent's device plugin), the controller stopped
//! after the first ends and started again after the second ended, then the book (ConfigMap),
//! the GpuQuota's `status.gpuHours` and `gpuplane report -o json` compared with the pods' own
//! `containerStatuses` times, within 1%. Skips like tests/lab/real_cluster.rs.

use crate::cluster::{
    eventually, gpuplane_json, sleeping_gpu_pod_for, start_controller_with, wait_controller_ready,
    ClusterLab, LabAgent, AGENT_NS,
};
use gpuplane_cluster::controller::hours::{Book, By};
use gpuplane_cluster::controller::meter::{BOOK_KEY, BOOK_NAME};
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

const NS: &str = "hours";
/// Fast flushes, so the lab waits seconds, not minutes; the owner key the test reports by.
const FLAGS: &[&str] = &[
    "--gpu-hours-interval=2s",
    // The watermark trails the clock by more than a loaded lab's kubelet takes to report
    // a container's start: a start seen behind the watermark would lose its time before it.
    "--gpu-hours-lag=8s",
    "--owner-label=team",
];

fn sleeper(name: &str, seconds: u32) -> String {
    let (meta, spec) = ("  labels: {team: ml}\n", "  restartPolicy: Never\n");
    sleeping_gpu_pod_for(NS, name, 1, meta, spec, seconds)
}

/// The pod's run in seconds from its container's own times, and its end (ms), once finished.
fn finished(lab: &ClusterLab, name: &str) -> Option<(f64, i64)> {
    let pod = lab.get_json(&["get", "pod", name, "-n", NS])?;
    let t = &pod["status"]["containerStatuses"][0]["state"]["terminated"];
    let ms = |v: &Value| -> Option<i64> {
        Some(v.as_str()?.parse::<Timestamp>().ok()?.as_millisecond())
    };
    let (start, end) = (ms(&t["startedAt"])?, ms(&t["finishedAt"])?);
    Some(((end - start) as f64 / 1000.0, end))
}

fn book(lab: &ClusterLab) -> Option<Book> {
    let cm = lab.get_json(&["get", "configmap", BOOK_NAME, "-n", AGENT_NS])?;
    Book::from_json(cm["data"][BOOK_KEY].as_str()?).ok()
}

fn within_1pct(got: f64, want: f64) -> bool {
    (got - want).abs() <= 0.01 * want
}

#[test]
fn gpu_hours_match_the_pods_own_times_across_a_controller_restart() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller_with(&lab, &installed, "1", FLAGS);
    wait_controller_ready(&lab);
    lab.kubectl_ok(&["create", "namespace", NS]);
    lab.apply(&format!(
        "apiVersion: quota.gpuplane.dev/v1alpha1\nkind: GpuQuota\nmetadata: {{name: default, namespace: {NS}}}\nspec:\n  hard: {{gpus: 4}}\n"
    ));
    for (name, seconds) in [("short", 20), ("long", 40)] {
        eventually(&format!("pod {name} to be created"), || {
            lab.create(&sleeper(name, seconds), &[]).ok()
        });
    }
    eventually("pod short to finish", || finished(&lab, "short"));
    // Down while "long" ends: it is counted from its own times when the controller is back.
    controller.stop();
    let (long, long_end) = eventually("pod long to finish", || finished(&lab, "long"));
    let down_book = book(&lab).map(|b| b.watermark());
    let _controller = start_controller_with(&lab, &installed, "2", FLAGS);
    let (short, _) = finished(&lab, "short").unwrap();
    let want = short + long;
    let b = eventually("the book to count past pod long's end", || {
        book(&lab).filter(|b| b.watermark().is_some_and(|w| w > long_end))
    });
    assert!(
        down_book.flatten().is_some_and(|w| w < long_end),
        "the controller was down when pod long ended"
    );
    let report = b.report(&By::Namespace, Some(NS), None, None);
    let got = report.rows.first().map_or(0.0, |r| r.gpu_seconds);
    assert!(
        within_1pct(got, want),
        "book {got} s vs pods' own {want} s: {b:?}"
    );
    eventually("status.gpuHours to show it", || {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", NS])?;
        let s = q["status"]["gpuHours"]["gpuSeconds"].as_f64()?;
        within_1pct(s, want).then_some(())
    });
    let json = gpuplane_json(&lab, &["report", "--by", "team", "-n", NS, "-o", "json"]);
    let row = &json["rows"][0];
    assert_eq!(row["tenant"], "ml", "{json}");
    let hours = row["gpuHours"].as_f64().unwrap();
    assert!(
        within_1pct(hours * 3600.0, want),
        "report {hours} h vs {want} s"
    );
    eprintln!(
        "pods' own times: {short} s + {long} s = {want} s; book {got} s ({:+.3}%); report {:.1} s",
        100.0 * (got - want) / want,
        hours * 3600.0
    );
}
