//! Controller memory: the real `gpuplane controller` binary against the API server double
//! holding 10,000 pods without GPUs and 1,000 GPU pods in 10 namespaces with a GpuQuota each,
//! its resident memory (`VmRSS`) sampled once it has counted every GPU pod, next to the floor:
//! the same binary against the same quotas and no pods, in the same run.
//!
//! The controller caches only the pods the quota governs (`quota::governs_pod`, the webhooks'
//! matchConditions), so the pods without GPUs should cost it their decoding only. Target:
//! under 64 MiB, of the binary `GPUPLANE_SHIPPED_BIN` names (benches/common/shipped.rs). Run:
//! `cargo bench --bench controller_memory`; results in
//! benches/results/controller_memory.txt.

#[path = "common/shipped.rs"]
mod shipped;
#[path = "../tests/support/mod.rs"]
mod support;

use gpuplane_testkit::demo::tls::DemoPki;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NAMESPACES: usize = 10;
const GPU_PODS: usize = 1_000;
const OTHER_PODS: usize = 10_000;
const WAIT: Duration = Duration::from_secs(300);

/// A pod as a real workload looks: labels, two containers with env and probes.
fn pod(ns: &str, name: &str, gpus: u32) -> Value {
    let env: Vec<Value> = (0..10)
        .map(|i| json!({"name": format!("SETTING_{i}"), "value": format!("value-{i}-of-{name}")}))
        .collect();
    let mut resources =
        json!({"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}});
    if gpus > 0 {
        resources["limits"]["nvidia.com/gpu"] = json!(gpus.to_string());
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns,
                     "labels": {"app": "bench", "tier": "worker", "pod-template-hash": "5d9f8c7b6"},
                     "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(512)}},
        "spec": {
            "nodeName": "node-a",
            "containers": [
                {"name": "main", "image": "registry.example/app:1.2.3", "env": env,
                 "command": ["/app", "--serve"], "resources": resources,
                 "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}}},
                {"name": "sidecar", "image": "registry.example/proxy:2.0", "env": env.clone()}
            ]
        },
        "status": {"phase": "Running"}
    })
}

fn seed(api: &ApiServerDouble, with_pods: bool) {
    for n in 0..NAMESPACES {
        let ns = format!("team-{n}");
        api.put_json(
            json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "q", "namespace": ns},
            "spec": {"hard": {"devices": {"nvidia.com/gpu": GPU_PODS}}}}),
        )
        .unwrap();
        if !with_pods {
            continue;
        }
        for i in 0..GPU_PODS / NAMESPACES {
            api.put_json(pod(&ns, &format!("gpu-{i}"), 1)).unwrap();
        }
        for i in 0..OTHER_PODS / NAMESPACES {
            api.put_json(pod(&ns, &format!("web-{i}"), 0)).unwrap();
        }
    }
}

fn used_gpus(api: &ApiServerDouble, ns: &str) -> Option<u64> {
    let q = api.get_json("quota.gpuplane.dev/v1alpha1", "gpuquotas", Some(ns), "q")?;
    // Written by the controller once it has decided the namespace; zero counts are left out.
    let used = q["status"].get("used")?;
    Some(used["devices"]["nvidia.com/gpu"].as_u64().unwrap_or(0))
}

fn spawn_controller(dir: &Path, kubeconfig: &Path, pki: &DemoPki) -> Child {
    let log = std::fs::File::create(dir.join("controller.log")).unwrap();
    Command::new(shipped::binary().0)
        .arg("controller")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--tls-cert-file")
        .arg(&pki.cert_file)
        .arg("--tls-key-file")
        .arg(&pki.key_file)
        .arg("--webhook-addr")
        .arg(format!("127.0.0.1:{}", support::free_port()))
        .arg("--leader-elect=false")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start gpuplane controller")
}

/// Runs the controller against a fresh double; its peak RSS (KiB) over 5 s once every
/// namespace's usage is counted, and the time that took.
async fn measure(with_pods: bool) -> (u64, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let api = ApiServerDouble::start().await.unwrap();
    seed(&api, with_pods);
    let kubeconfig = support::write_kubeconfig(dir.path(), &api.url());
    let pki = DemoPki::issue(dir.path()).unwrap();
    let mut child = spawn_controller(dir.path(), &kubeconfig, &pki);
    let start = Instant::now();
    let want = if with_pods { GPU_PODS / NAMESPACES } else { 0 } as u64;
    loop {
        let done = (0..NAMESPACES).all(|n| used_gpus(&api, &format!("team-{n}")) == Some(want));
        if done {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the controller exited: {}",
            std::fs::read_to_string(dir.path().join("controller.log")).unwrap_or_default()
        );
        assert!(
            start.elapsed() < WAIT,
            "the controller did not count the pods within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counted = start.elapsed();
    let mut peak = 0;
    for _ in 0..10 {
        peak = peak.max(support::vm_rss_kib(child.id()).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    (peak, counted)
}

#[tokio::main]
async fn main() {
    let (floor, floor_t) = measure(false).await;
    let (loaded, loaded_t) = measure(true).await;
    let mib = |k: u64| k as f64 / 1024.0;
    let (bin, which) = shipped::binary();
    println!("controller memory (VmRSS peak over 5 s after every namespace's usage is counted)");
    println!("({which} binary, {bin})");
    println!("{:<58} {:>10} {:>12}", "", "RSS MiB", "counted in");
    println!(
        "{:<58} {:>10.1} {:>10.1} s",
        format!("{OTHER_PODS} pods without GPUs + {GPU_PODS} GPU pods, {NAMESPACES} quotas"),
        mib(loaded),
        loaded_t.as_secs_f64()
    );
    println!(
        "{:<58} {:>10.1} {:>10.1} s",
        "floor: the same quotas, no pods",
        mib(floor),
        floor_t.as_secs_f64()
    );
    println!(
        "ratio {:.2}x; target: under 64 MiB ({})",
        loaded as f64 / floor.max(1) as f64,
        if mib(loaded) < 64.0 { "met" } else { "NOT met" }
    );
}
