//! gpuplane in real Kubernetes (issue 13): figures through the upstream API server, scheduler
//! and kubelet of the cluster lab (tests/cluster), each next to its floor from the same run.
//!
//! 1. Pod start latency, create -> Running as a client sees it (create, then a watch): a pod
//!    with a ResourceClaim (DRA: scheduler allocation, NodePrepareResources, CDI) and a pod with
//!    `nvidia.com/gpu: 1` (device plugin: Allocate, CDI), each against the same pod without
//!    GPUs, interleaved. Kubernetes' own e2e guard is DRA <= 2.5x the pod without a claim.
//! 2. Pod creation throughput through the real API server, GPU pods created by 16 concurrent
//!    clients, in a namespace with a GpuQuota (every create calls both webhooks and reserves)
//!    vs an exempt namespace (the API server calls no webhook: the floor) and a namespace
//!    without a GpuQuota (both webhooks called, nothing to reserve: the cost of the calls
//!    themselves); the issue's target is a cost of at most 1.25x. The pods carry a scheduling
//!    gate of the bench's own, so the scheduler leaves them alone and only admission is
//!    measured. CPU per pod of the busy processes and the API server's own webhook latency
//!    and GpuQuota write counts are printed with it.
//!
//! Needs root and the cluster binaries (`./hack/cluster/build.sh`), like the real-cluster
//! tests; prints why and exits 0 otherwise. Run: `cargo bench --bench cluster`; results in
//! benches/results/cluster.txt.

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use cluster::{eventually, start_controller, ClusterLab, LabAgent, NODE};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const STARTS: usize = 12;
const CREATES: usize = 400;
const CLIENTS: usize = 16;
const ROUNDS: usize = 4;

fn main() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "bench");
    let _controller = start_controller(&lab, &installed, "bench");
    eventually("node lab-node to report nvidia.com/gpu: 8", || {
        let node = lab.get_json(&["get", "node", NODE])?;
        (node["status"]["allocatable"]["nvidia.com/gpu"] == "8").then_some(())
    });
    lab.apply(&format!(
        "{}---\n{}",
        cluster::ONE_GPU_TEMPLATE,
        r#"apiVersion: v1
kind: Namespace
metadata: {name: governed}
---
apiVersion: v1
kind: Namespace
metadata:
  name: exempt
  labels: {quota.gpuplane.dev/exempt: "true"}
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: default, namespace: governed}
spec:
  hard:
    devices: {nvidia.com/gpu: 100000}
---
apiVersion: v1
kind: Namespace
metadata: {name: unlimited}
"#
    ));
    // The client runs in the lab's network namespace, where the API server listens; threads
    // inherit the namespace of the thread that creates them, so enter it before the runtime.
    let netns = std::fs::File::open(format!("/proc/{}/ns/net", lab.init)).unwrap();
    nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let kubeconfig = kube::config::Kubeconfig::read_from(lab.admin_kubeconfig()).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        let client = kube::Client::try_from(config).unwrap();
        println!(
            "# cargo bench --bench cluster — {}; Kubernetes v1.37.2 (kube-apiserver, \
             kube-scheduler, kube-controller-manager, kubelet), containerd 2.4.2, etcd 3.7.3, \
             gpuplane node --simulate dgx-h100 and gpuplane controller (release build), one lab \
             on this machine's {} cores",
            now_utc(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        // `cargo bench --bench cluster -- latency|throughput` runs one part.
        let only: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        let part = |p: &str| only.is_empty() || only.iter().any(|a| a == p);
        if part("latency") {
            start_latency(&client).await;
        }
        if part("throughput") {
            creation_throughput(&client).await;
            api_server_account(&client).await;
        }
    });
}

fn now_utc() -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A long-running pod in `default`: no GPUs, one `nvidia.com/gpu`, or one claim.
fn start_pod(name: &str, kind: Kind) -> Pod {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": "lab.local/busybox:1",
                            "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]
        }
    });
    match kind {
        Kind::Plain => {}
        Kind::DevicePlugin => {
            pod["spec"]["containers"][0]["resources"] = json!({"limits": {"nvidia.com/gpu": 1}})
        }
        Kind::Claim => {
            pod["spec"]["resourceClaims"] =
                json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]);
            pod["spec"]["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
        }
    }
    serde_json::from_value(pod).unwrap()
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    DevicePlugin,
    Claim,
}

async fn start_latency(client: &kube::Client) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let kinds = [Kind::Plain, Kind::DevicePlugin, Kind::Claim];
    let mut took: [Vec<Duration>; 3] = Default::default();
    // One warm-up round (image layers, first CDI spec), then STARTS interleaved rounds.
    for round in 0..=STARTS {
        for (i, kind) in kinds.iter().enumerate() {
            let name = format!("start-{i}-{round}");
            let began = Instant::now();
            pods.create(&PostParams::default(), &start_pod(&name, *kind))
                .await
                .unwrap();
            tokio::time::timeout(
                cluster::WAIT,
                await_condition(pods.clone(), &name, conditions::is_pod_running()),
            )
            .await
            .unwrap_or_else(|_| panic!("pod {name} did not run"))
            .unwrap();
            if round > 0 {
                took[i].push(began.elapsed());
            }
            // Gone before the next, so every claim and device is free again. A graceful delete:
            // the kubelet unprepares a pod's claims before the pod leaves the API server, while
            // a forced one (grace 0) lets the scheduler give the device to the next claim
            // first, whose NodePrepare gpuplane then refuses until the unprepare (the kubelet
            // retries after a backoff of about a minute).
            let uid = pods.get(&name).await.unwrap().metadata.uid.unwrap();
            pods.delete(&name, &DeleteParams::default()).await.unwrap();
            tokio::time::timeout(
                cluster::WAIT,
                await_condition(pods.clone(), &name, conditions::is_deleted(&uid)),
            )
            .await
            .unwrap_or_else(|_| panic!("pod {name} was not deleted"))
            .unwrap();
        }
    }
    println!(
        "pod start latency, create -> Running seen by a watch, {STARTS} pods each, interleaved \
         (one warm-up round not counted)"
    );
    let floor = stats(&mut took[0]);
    println!(
        "{:<34} p50 {:>8.1}ms mean {:>8.1}ms min {:>8.1}ms max {:>8.1}ms",
        "no GPUs (floor)", floor.0, floor.1, floor.2, floor.3
    );
    for (label, i, target) in [
        ("nvidia.com/gpu: 1 (device plugin)", 1, None),
        ("ResourceClaim (DRA)", 2, Some(2.5)),
    ] {
        let s = stats(&mut took[i]);
        let target = target.map_or(String::new(), |t: f64| {
            format!(
                " | target p50 <= {t}x: {}",
                if s.0 / floor.0 <= t { "met" } else { "NOT met" }
            )
        });
        println!(
            "{label:<34} p50 {:>8.1}ms mean {:>8.1}ms min {:>8.1}ms max {:>8.1}ms | ratio p50 {:.2}x mean {:.2}x{target}",
            s.0,
            s.1,
            s.2,
            s.3,
            s.0 / floor.0,
            s.1 / floor.1
        );
    }
}

/// (p50, mean, min, max) in milliseconds.
fn stats(samples: &mut [Duration]) -> (f64, f64, f64, f64) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mean = samples.iter().map(|d| ms(*d)).sum::<f64>() / samples.len() as f64;
    (
        ms(samples[samples.len() / 2]),
        mean,
        ms(samples[0]),
        ms(samples[samples.len() - 1]),
    )
}

/// A GPU pod held by the bench's own scheduling gate (never scheduled).
fn held_pod(ns: &str, name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "schedulingGates": [{"name": "bench.gpuplane.dev/hold"}],
            "containers": [{"name": "c", "image": "lab.local/busybox:1",
                            "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                            "resources": {"limits": {"nvidia.com/gpu": 1}}}]
        }
    })
}

/// Creates `CREATES` held pods in `ns` from `CLIENTS` concurrent clients; pods per second.
async fn create_round(client: &kube::Client, ns: &str, round: usize) -> f64 {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let next = Arc::new(AtomicUsize::new(0));
    let began = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (pods, next, ns) = (pods.clone(), next.clone(), ns.to_string());
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= CREATES {
                    return;
                }
                let pod: Pod =
                    serde_json::from_value(held_pod(&ns, &format!("held-{round}-{i}"))).unwrap();
                pods.create(&PostParams::default(), &pod)
                    .await
                    .unwrap_or_else(|e| panic!("creating a pod in {ns}: {e}"));
            }
        });
    }
    while let Some(done) = clients.join_next().await {
        done.unwrap();
    }
    CREATES as f64 / began.elapsed().as_secs_f64()
}

/// The namespaces of the throughput part: (namespace, what a create costs there).
const MODES: [(&str, &str); 3] = [
    ("exempt", "exempt namespace: no webhook call (floor)"),
    ("unlimited", "webhooks called, no GpuQuota there"),
    ("governed", "webhooks called, GpuQuota reserves"),
];

async fn creation_throughput(client: &kube::Client) {
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    let mut cpu: Vec<Cpu> = vec![Cpu::default(); MODES.len()];
    // Alternating rounds, so drift on a noisy machine hits every mode alike.
    for round in 0..ROUNDS {
        for (i, (ns, _)) in MODES.iter().enumerate() {
            let before = Cpu::now();
            rates[i].push(create_round(client, ns, round).await);
            cpu[i].add(&Cpu::now().since(&before));
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let floor = mean(&rates[0]);
    println!(
        "pod creation throughput, {CREATES} GPU pods per round, {CLIENTS} concurrent clients, \
         {ROUNDS} alternating rounds per namespace"
    );
    for (i, (_, label)) in MODES.iter().enumerate() {
        let rate = mean(&rates[i]);
        let ratio = floor / rate;
        let target = if i + 1 == MODES.len() {
            format!(
                " | target <= 1.25x: {}",
                if ratio <= 1.25 { "met" } else { "NOT met" }
            )
        } else {
            String::new()
        };
        println!(
            "{label:<44} {rate:>6.0} pods/s (rounds: {}) | ratio {ratio:.2}x (floor/this){target}",
            fmt_rounds(&rates[i])
        );
        println!(
            "{:<44} CPU per pod: {}",
            "",
            cpu[i].report((ROUNDS * CREATES) as f64)
        );
    }
}

/// What the API server itself counted: each webhook's calls and mean latency, and the
/// GpuQuota writes (the webhook's group commits and the controller loop's).
async fn api_server_account(client: &kube::Client) {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    let sum = |metric: &str, has: &[&str]| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(metric) && has.iter().all(|h| l.contains(h)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    for hook in ["gate.quota.gpuplane.dev", "quota.gpuplane.dev"] {
        let name = format!("name=\"{hook}\"");
        let calls = sum(
            "apiserver_admission_webhook_admission_duration_seconds_count",
            &[&name],
        );
        let secs = sum(
            "apiserver_admission_webhook_admission_duration_seconds_sum",
            &[&name],
        );
        println!(
            "API server: webhook {hook}: {calls:.0} calls, mean {:.2}ms",
            secs * 1e3 / calls.max(1.0)
        );
    }
    for verb in ["PUT", "PATCH", "POST"] {
        let n = sum(
            "apiserver_request_total{",
            &["resource=\"gpuquotas\"", &format!("verb=\"{verb}\"")],
        );
        println!("API server: GpuQuota {verb} requests: {n:.0}");
    }
    controller_account().await;
    quota_size(client).await;
}

/// The controller's own count: the quota loop's status writes (the rest are the webhook's),
/// and how long the webhook itself took per decision.
async fn controller_account() {
    let Some(text) = controller_metrics().await else {
        return;
    };
    for m in [
        "gpuplane_quota_status_writes_total",
        "gpuplane_quota_status_conflicts_total",
    ] {
        let v: f64 = text
            .lines()
            .filter(|l| l.starts_with(m))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        println!("controller: {m} {v:.0}");
    }
    // Next to the API server's view of the same calls.
    let series = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains("webhook=\"validate\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (secs, n) = (
        series("gpuplane_webhook_decision_seconds_sum"),
        series("gpuplane_webhook_decision_seconds_count"),
    );
    println!(
        "controller: validating decisions {n:.0}, mean {:.2}ms as the webhook measured them",
        secs * 1e3 / n.max(1.0)
    );
}

/// The size of the governed namespace's GpuQuota at the end, and its reservations left.
async fn quota_size(client: &kube::Client) {
    let quotas: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        "governed",
        &kube::discovery::ApiResource {
            group: "quota.gpuplane.dev".into(),
            version: "v1alpha1".into(),
            api_version: "quota.gpuplane.dev/v1alpha1".into(),
            kind: "GpuQuota".into(),
            plural: "gpuquotas".into(),
        },
    );
    if let Ok(q) = quotas.get("default").await {
        let reservations = q.data["status"]["reservations"]
            .as_array()
            .map_or(0, Vec::len);
        println!(
            "GpuQuota governed/default at the end: {} bytes of JSON, {reservations} reservations",
            serde_json::to_vec(&q).map_or(0, |b| b.len())
        );
    }
}

/// The controller's /metrics text (plain HTTP on its metrics address, in the lab's network
/// namespace, which this process has entered).
async fn controller_metrics() -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(cluster::CONTROLLER_METRICS_ADDR)
        .await
        .ok()?;
    tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    tcp.read_to_string(&mut body).await.ok()?;
    Some(body)
}

/// CPU time (user + system) of the lab's busy processes, from /proc (host PIDs).
#[derive(Default, Clone)]
struct Cpu {
    /// (process, seconds), in a fixed order.
    secs: Vec<(&'static str, f64)>,
}

const PROCESSES: [&str; 4] = [
    "kube-apiserver",
    "etcd",
    "gpuplane controller",
    "kube-controller",
];

impl Cpu {
    fn now() -> Cpu {
        let tick = 100.0; // USER_HZ on Linux
        let mut secs: Vec<(&'static str, f64)> = PROCESSES.iter().map(|p| (*p, 0.0)).collect();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let path = entry.path();
            let Ok(cmdline) = std::fs::read(path.join("cmdline")) else {
                continue;
            };
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let exe = args
                .first()
                .map_or("", |a| a.rsplit('/').next().unwrap_or(""));
            let name = match exe {
                "gpuplane" if args.get(1).is_some_and(|a| a == "controller") => {
                    "gpuplane controller"
                }
                "kube-controller-manager" => "kube-controller",
                other => other,
            };
            let Some(slot) = secs.iter_mut().find(|(p, _)| *p == name) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
                continue;
            };
            // Fields after the `(comm)`: utime and stime are the 12th and 13th.
            let rest = stat.rsplit(')').next().unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 =
                f[11].parse::<f64>().unwrap_or(0.0) + f[12].parse::<f64>().unwrap_or(0.0);
            slot.1 += ticks / tick;
        }
        Cpu { secs }
    }

    fn since(&self, earlier: &Cpu) -> Cpu {
        Cpu {
            secs: self
                .secs
                .iter()
                .zip(&earlier.secs)
                .map(|((p, a), (_, b))| (*p, a - b))
                .collect(),
        }
    }

    fn add(&mut self, other: &Cpu) {
        if self.secs.is_empty() {
            self.secs = other.secs.clone();
        } else {
            for ((_, a), (_, b)) in self.secs.iter_mut().zip(&other.secs) {
                *a += b;
            }
        }
    }

    fn report(&self, pods: f64) -> String {
        self.secs
            .iter()
            .map(|(p, s)| format!("{p} {:.2}ms", s * 1e3 / pods))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn fmt_rounds(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}
