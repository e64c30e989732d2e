//! The bench's cluster and its changes: kwok nodes with GPU capacity and the agent's
//! ResourceSlices, filler pods bound to them, the Pending pods of each reason; the flips that
//! change 1,000 pods' reason at once, new pods, and the explain CLI against its floor.

use super::common::{percentiles, row};
use super::watch::{self, Shared};
use super::ClusterLab;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

pub struct Size {
    pub nodes: usize,
    /// Pending pods per reason.
    pub pods: usize,
}

impl Size {
    /// The pod `gpuplane explain pod` is asked about, and how many times.
    pub fn explain_sample(&self) -> (String, usize) {
        ("bench/frag-0".into(), 200)
    }
}

const TAINT: &str = "dedicated";
/// Writes in flight while building the cluster.
const PARALLEL: usize = 32;

fn node_name(i: usize) -> String {
    format!("node-{i:04}")
}

/// The node `i` of `n`: the last one tainted (nobody tolerates it), the last tenth A100s.
fn node(i: usize, n: usize, name: &str) -> Node {
    let pool = if i >= n - n / 10 { "a100" } else { "h100" };
    let taints = if i == n - 1 || name == "node-extra" {
        json!([{"key": TAINT, "value": "reserved", "effect": "NoSchedule"}])
    } else {
        json!([])
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
            "gpuplane.dev/pool": pool, "type": "kwok"}},
        "spec": {"taints": taints}
    }))
    .unwrap()
}

/// The status a GPU node's kubelet reports once the device plugin registered.
fn capacity() -> Value {
    let r = json!({"cpu": "128", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"});
    json!({"status": {"capacity": r, "allocatable": r}})
}

/// The node's slices as the agent renders them from its (simulated) inventory.
fn slices(i: usize, n: usize, name: &str) -> Vec<ResourceSlice> {
    let profile = if i >= n - n / 10 {
        "dgx-a100"
    } else {
        "dgx-h100"
    };
    let text = gpuplane_model::sim::bundled_text(profile).unwrap();
    let inv = gpuplane_model::sim::from_str(profile, profile, text).unwrap();
    let mut health = gpuplane_model::health::HealthBook::default();
    health.set_inventory(&inv);
    gpuplane_node::slices::render::render(&inv, &health, "gpu.gpuplane.dev", name)
}

/// A pod asking `gpus` of the device plugin, bound to `node` when given.
pub(super) fn gpu_pod(ns: &str, name: &str, gpus: u32, node: Option<&str>) -> Pod {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"terminationGracePeriodSeconds": 0, "automountServiceAccountToken": false,
            "containers": [{"name": "c", "image": "lab.local/pause:1",
                "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}
    });
    if let Some(n) = node {
        p["spec"]["nodeName"] = json!(n);
    }
    serde_json::from_value(p).unwrap()
}

/// A pod whose claim asks for a product no node has.
fn selector_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {"automountServiceAccountToken": false,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "b200"}],
            "containers": [{"name": "c", "image": "lab.local/pause:1",
                "resources": {"claims": [{"name": "gpu"}]}}]}
    }))
    .unwrap()
}

const OBJECTS: &str = r#"apiVersion: v1
kind: Namespace
metadata: {name: fill, labels: {quota.gpuplane.dev/exempt: "true"}}
---
apiVersion: v1
kind: Namespace
metadata: {name: bench, labels: {quota.gpuplane.dev/exempt: "true"}}
---
apiVersion: v1
kind: Namespace
metadata: {name: queued}
---
apiVersion: quota.gpuplane.dev/v1alpha1
kind: GpuQuota
metadata: {name: default, namespace: queued}
spec:
  hard:
    devices: {nvidia.com/gpu: 1}
  mode: Queue
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: b200, namespace: bench}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.gpuplane.dev
          selectors:
          - cel: {expression: "device.attributes['gpu.gpuplane.dev'].productName == 'NVIDIA B200'"}
"#;

/// Runs `f` on every item, `PARALLEL` at a time.
async fn each<T, F, Fut>(items: Vec<T>, f: F)
where
    T: Send + 'static,
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    each_n(PARALLEL, items, f).await
}

/// Runs `f` on every item, `n` at a time.
async fn each_n<T, F, Fut>(n: usize, items: Vec<T>, f: F)
where
    T: Send + 'static,
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for item in items {
        if set.len() >= n {
            set.join_next().await.unwrap().unwrap();
        }
        set.spawn(f(item));
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

/// Creates a node with its capacity and slices.
async fn add_node(client: kube::Client, i: usize, n: usize, name: String) {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(&PostParams::default(), &node(i, n, &name))
        .await
        .unwrap();
    nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(capacity()))
        .await
        .unwrap();
    let api: Api<ResourceSlice> = Api::all(client);
    for s in slices(i, n, &name) {
        api.create(&PostParams::default(), &s).await.unwrap();
    }
}

/// Nodes, slices, fillers (once every filler runs), then the Pending pods.
pub async fn cluster(lab: &ClusterLab, client: &kube::Client, size: &Size) {
    lab.apply(OBJECTS);
    let n = size.nodes;
    let c = client.clone();
    each((0..n).collect(), move |i| {
        add_node(c.clone(), i, n, node_name(i))
    })
    .await;
    let c = client.clone();
    each((0..n).collect(), move |i| {
        // Two nodes keep 1 free, the tainted one 4: 6 free, at most 1 on a usable node.
        let gpus = match i {
            0 | 1 => 7,
            _ if i == n - 1 => 4,
            _ => 8,
        };
        let c = c.clone();
        async move {
            let pod = gpu_pod("fill", &format!("fill-{i:04}"), gpus, Some(&node_name(i)));
            let api: Api<Pod> = Api::namespaced(c, "fill");
            api.create(&PostParams::default(), &pod).await.unwrap();
        }
    })
    .await;
    let fill: Api<Pod> = Api::namespaced(client.clone(), "fill");
    let running = ListParams::default().fields("status.phase=Running");
    let began = Instant::now();
    while fill.list_metadata(&running).await.unwrap().items.len() < n {
        assert!(
            began.elapsed() < Duration::from_secs(600),
            "kwok did not run the fillers"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    queue_enforced(client).await;
    pending(client, size.pods).await;
}

/// Waits until the webhook gates a pod of namespace `queued` (a server-side dry run comes
/// back gated: the controller labelled the namespace and the webhook's cache holds the quota).
async fn queue_enforced(client: &kube::Client) {
    let api: Api<Pod> = Api::namespaced(client.clone(), "queued");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let began = Instant::now();
    loop {
        if let Ok(p) = api.create(&dry, &gpu_pod("queued", "probe", 2, None)).await {
            let gates = p.spec.and_then(|s| s.scheduling_gates).unwrap_or_default();
            if !gates.is_empty() {
                return;
            }
        }
        assert!(
            began.elapsed() < Duration::from_secs(120),
            "the Queue-mode quota is not enforced"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The Pending pods, `per` of each reason.
async fn pending(client: &kube::Client, per: usize) {
    let mut pods = Vec::new();
    for i in 0..per {
        pods.push(gpu_pod("bench", &format!("cap-{i}"), 8, None));
        pods.push(gpu_pod("bench", &format!("place-{i}"), 4, None));
        pods.push(gpu_pod("bench", &format!("frag-{i}"), 2, None));
        pods.push(selector_pod(&format!("sel-{i}")));
        pods.push(gpu_pod("queued", &format!("q-{i}"), 2, None));
    }
    let c = client.clone();
    each(pods, move |p| {
        let c = c.clone();
        async move {
            let ns = p.metadata.namespace.clone().unwrap();
            let api: Api<Pod> = Api::namespaced(c, &ns);
            api.create(&PostParams::default(), &p).await.unwrap();
        }
    })
    .await;
}

/// The changes: a tainted node added and removed, the tainted node's filler deleted and made
/// again. Each moves the cluster's free total across 8, so the 8-GPU pods flip between Capacity
/// and Placement (nothing can be scheduled: the free GPUs are on the tainted node).
pub async fn flips(client: &kube::Client, book: &Shared, size: &Size) -> Vec<Duration> {
    let n = size.nodes;
    let nodes: Api<Node> = Api::all(client.clone());
    let fill: Api<Pod> = Api::namespaced(client.clone(), "fill");
    let last = node_name(n - 1);
    let filler = format!("fill-{:04}", n - 1);
    let now = || DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    println!(
        "time from a change to the updated reason on the {} pods it flips, as a watch sees it; \
         floor: the same watch seeing the change itself",
        size.pods
    );
    let mut p99s = Vec::new();
    for round in 0..2 {
        // A node added: created bare, Ready by kwok, then its GPUs appear.
        nodes
            .create(&PostParams::default(), &node(0, n, "node-extra"))
            .await
            .unwrap();
        wait_ready(&nodes, "node-extra").await;
        let t0 = Instant::now();
        nodes
            .patch_status(
                "node-extra",
                &PatchParams::default(),
                &Patch::Merge(capacity()),
            )
            .await
            .unwrap();
        p99s.push(
            flip(
                book,
                size,
                t0,
                "Placement",
                "node:node-extra:8",
                "a node added",
            )
            .await,
        );
        let t0 = Instant::now();
        nodes.delete("node-extra", &now()).await.unwrap();
        p99s.push(
            flip(
                book,
                size,
                t0,
                "Capacity",
                "gone:node/node-extra",
                "a node removed",
            )
            .await,
        );
        wait_gone_node(&nodes, "node-extra").await;
        book.lock()
            .unwrap()
            .sightings
            .retain(|k, _| !k.contains("node-extra"));
        let t0 = Instant::now();
        fill.delete(&filler, &now()).await.unwrap();
        let gone = format!("gone:fill/{filler}");
        p99s.push(flip(book, size, t0, "Placement", &gone, "a pod deleted").await);
        wait_gone_pod(&fill, &filler).await;
        book.lock()
            .unwrap()
            .sightings
            .retain(|k, _| !k.contains(&filler));
        let t0 = Instant::now();
        let pod = gpu_pod("fill", &filler, 4, Some(&last));
        fill.create(&PostParams::default(), &pod).await.unwrap();
        let seen = format!("pod:fill/{filler}");
        p99s.push(flip(book, size, t0, "Capacity", &seen, "a pod created").await);
        println!("  (round {} done)", round + 1);
    }
    p99s
}

/// The floor of a flip: the bench itself sets a condition of its own on the same pods, as
/// many writes in flight as the explainer (32), then twice as many, each pod's write seen by
/// the same watch: what the API server of this machine takes for 1,000 pods, under this load.
pub async fn write_floor(client: &kube::Client, book: &Shared, size: &Size, flips: &[Duration]) {
    let (best, worst) = (
        flips.iter().min().copied().unwrap_or_default(),
        flips.iter().max().copied().unwrap_or_default(),
    );
    for in_flight in [32, 64] {
        let reason = format!("InFlight{in_flight}");
        let names: Vec<String> = (0..size.pods).map(|i| format!("cap-{i}")).collect();
        let t0 = Instant::now();
        let (api, r) = (
            Api::<Pod>::namespaced(client.clone(), "bench"),
            reason.clone(),
        );
        each_n(in_flight, names.clone(), move |name| {
            let (api, r) = (api.clone(), r.clone());
            async move {
                let cond = json!({"type": watch::FLOOR_CONDITION, "status": "True", "reason": r,
                    "message": "the bench's own write", "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string()});
                let body = json!({"status": {"conditions": [cond]}});
                api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(body))
                    .await
                    .unwrap();
            }
        })
        .await;
        let keys: Vec<String> = names
            .iter()
            .map(|n| format!("floor:bench/{n}:{reason}"))
            .collect();
        watch::until(book, "the bench's own writes", super::PATIENCE, |b| {
            keys.iter().all(|k| b.sightings.contains_key(k))
        })
        .await;
        let took: Vec<Duration> = keys
            .iter()
            .filter_map(|k| watch::sighted(book, k))
            .map(|t| t.saturating_duration_since(t0))
            .collect();
        let (p50, p99) = percentiles(took);
        println!(
            "floor of a flip: {} bare condition PATCHes by the bench, {in_flight} in flight, as the watch sees them: p50 {p50:.1?} p99 {p99:.1?} | the flips' p99 {best:.1?}-{worst:.1?} | ratio {:.2}x-{:.2}x",
            size.pods,
            best.as_secs_f64() / p99.as_secs_f64(),
            worst.as_secs_f64() / p99.as_secs_f64(),
        );
    }
}

/// Waits until every `cap-*` pod shows `reason`, then prints the latencies after `t0` next to
/// when the watch saw `floor_key`.
async fn flip(
    book: &Shared,
    size: &Size,
    t0: Instant,
    reason: &str,
    floor_key: &str,
    what: &str,
) -> Duration {
    let per = size.pods;
    watch::until(
        book,
        &format!("{per} pods to show {reason}"),
        super::PATIENCE,
        |b| watch::count(b, "bench/cap-", reason) >= per,
    )
    .await;
    let floor =
        watch::sighted(book, floor_key).map_or(Duration::ZERO, |t| t.saturating_duration_since(t0));
    let took = watch::latencies(&book.lock().unwrap(), "bench/cap-", t0);
    let (p50, p99) = percentiles(took.clone());
    let max = took.iter().max().copied().unwrap_or_default();
    row(
        &format!("{what}: -> {reason} (max {max:.1?})"),
        (p50, p99),
        (floor, floor),
    );
    let verdict = if p99 <= Duration::from_secs(2) {
        "met"
    } else {
        "NOT met"
    };
    println!("{:56} target p99 <= 2 s: {verdict}", "");
    p99
}

async fn wait_ready(nodes: &Api<Node>, name: &str) {
    let began = Instant::now();
    loop {
        let ready = nodes.get(name).await.ok().and_then(|n| {
            let c = n.status?.conditions?;
            Some(c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if ready == Some(true) {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "kwok did not make {name} Ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_gone_node(nodes: &Api<Node>, name: &str) {
    while nodes.get_opt(name).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_gone_pod(pods: &Api<Pod>, name: &str) {
    while pods.get_opt(name).await.unwrap().is_some() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// New Pending pods one at a time: create -> its reason on the pod, against create -> the
/// watch seeing the pod.
pub async fn new_pods(client: &kube::Client, book: &Shared) {
    let api: Api<Pod> = Api::namespaced(client.clone(), "bench");
    let (mut took, mut floor) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let name = format!("new-{i}");
        let key = format!("bench/{name}");
        let t0 = Instant::now();
        api.create(&PostParams::default(), &gpu_pod("bench", &name, 2, None))
            .await
            .unwrap();
        watch::until(book, &format!("{name}'s reason"), super::PATIENCE, |b| {
            b.pods.get(&key).is_some_and(|s| s.reason.is_some())
        })
        .await;
        {
            let b = book.lock().unwrap();
            took.push(b.pods[&key].since.saturating_duration_since(t0));
            floor.push(b.sightings[&format!("pod:{key}")].saturating_duration_since(t0));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    row(
        "a new Pending pod -> its reason (40 pods)",
        percentiles(took.clone()),
        percentiles(floor),
    );
}

/// The requests the API server dispatched for flow schema `service-accounts`: the
/// controller's (the lab's controllers use kube-system's, kwok and the bench are exempt).
pub async fn controller_requests(client: &kube::Client) -> f64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    text.lines()
        .filter(|l| l.starts_with("apiserver_flowcontrol_dispatched_requests_total{"))
        .filter(|l| l.contains(r#"flow_schema="service-accounts""#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `gpuplane explain pod` against `kubectl get pod` (its floor: one GET by a process that
/// also starts, reads a kubeconfig and dials), interleaved.
pub async fn explain_latency(lab: &ClusterLab, (pod, calls): &(String, usize)) {
    let kubeconfig = lab.admin_kubeconfig();
    let (ns, name) = pod.split_once('/').unwrap();
    let (mut took, mut floor) = (Vec::new(), Vec::new());
    for _ in 0..*calls {
        let t0 = Instant::now();
        let out = lab
            .in_netns(env!("CARGO_BIN_EXE_gpuplane"))
            .args(["explain", "pod", pod, "--kubeconfig"])
            .arg(&kubeconfig)
            .output()
            .unwrap();
        took.push(t0.elapsed());
        assert!(
            out.status.success(),
            "explain: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let t0 = Instant::now();
        let out = lab.kubectl(&["get", "pod", "-n", ns, name, "-o", "name"]);
        floor.push(t0.elapsed());
        assert!(out.status.success());
    }
    let (p50, p99) = percentiles(took.clone());
    row(
        &format!("gpuplane explain pod {pod} ({calls} calls)"),
        (p50, p99),
        percentiles(floor),
    );
    let verdict = if p99 <= Duration::from_millis(100) {
        "met"
    } else {
        "NOT met"
    };
    println!("{:56} target p99 <= 100 ms: {verdict}", "");
}
