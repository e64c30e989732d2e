//! The Queue-mode benchmark: pods released per second from a queue of [`QUEUED`] gated pods
//! under one GpuQuota with room for all, against the same number of bare gate-removal PATCHes.

use gpuplane_cluster::controller::pods::PodRef;
use gpuplane_cluster::controller::queue::{self, QueueOptions};
use gpuplane_cluster::controller::writes::{self, Ungated};
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_cluster::published::Devices;
use gpuplane_model::quota::SCHEDULING_GATE;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Gated pods in the queue benchmark.
const QUEUED: usize = 10_000;

fn gated_pod(ns: &str, i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p-{i:05}"), "namespace": ns, "uid": format!("uid-{ns}-{i}")},
        "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}],
            "containers": [{"name": "main", "image": "cuda",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
}

/// Removes the gate of every pod of `ns` with `concurrency` PATCHes in flight; the pods
/// ungated.
async fn bare_ungate(client: &kube::Client, ns: &str, concurrency: usize) -> usize {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods: Vec<PodRef> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(PodRef::of)
        .collect();
    let work = Arc::new(std::sync::Mutex::new(pods));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (api, work) = (api.clone(), work.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            loop {
                let Some(p) = work.lock().unwrap().pop() else {
                    return done;
                };
                if writes::ungate(&api, &p).await.unwrap() == Ungated::Removed {
                    done += 1;
                }
            }
        }));
    }
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap();
    }
    done
}

pub async fn queue_bench() {
    let api = ApiServerDouble::start().await.unwrap();
    // Every pod's events stay in the history, so watches resume instead of re-listing.
    api.set_history_limit(4 * QUEUED + 1000);
    let ns = "bench-queue";
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {"hard": {"gpus": 1_000_000}, "mode": "Queue"}}),
    )
    .unwrap();
    for i in 0..QUEUED {
        api.put_json(gated_pod(ns, i)).unwrap();
    }
    let client = api.client().unwrap();
    let opts = QueueOptions {
        batch: Duration::from_millis(20),
        ..QueueOptions::default()
    };
    let concurrency = opts.concurrency;
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let t = Instant::now();
    let task = tokio::spawn(queue::run(
        client.clone(),
        opts,
        Devices::start(&client, Default::default(), |_, _| {}),
        metrics.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    while metrics.snapshot().released < QUEUED as u64 {
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the loop released {:?} in 10 minutes",
            metrics.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = t.elapsed();
    let _ = stop.send(());
    task.await.unwrap();
    let m = metrics.snapshot();
    let patches = api.count_requests("PATCH", "/pods/");

    // The floor: the same gate removals, bare, on a second queue in the same API server.
    let floor_ns = "bench-floor";
    for i in 0..QUEUED {
        api.put_json(gated_pod(floor_ns, i)).unwrap();
    }
    let ft = Instant::now();
    let floor_done = bare_ungate(&client, floor_ns, concurrency).await;
    let floor_took = ft.elapsed();
    assert_eq!(floor_done, QUEUED, "the floor ungated every pod");

    let rate = QUEUED as f64 / took.as_secs_f64();
    let floor_rate = QUEUED as f64 / floor_took.as_secs_f64();
    println!(
        "queue: {QUEUED} gated pods under one Queue-mode GpuQuota with room for all, loop started with them queued;"
    );
    println!(
        "floor: {QUEUED} bare gate-removal PATCHes (writes::ungate), same API server double and client, {concurrency} in flight"
    );
    println!(
        "{:<56} {rate:>9.0}/s | floor {floor_rate:>9.0}/s | ratio {:>5.2}x (floor/queue)",
        format!("pods released per second ({QUEUED} queued)"),
        floor_rate / rate
    );
    println!(
        "{:<56} {:.2?} | floor {:.2?} | cycles {} status writes {} (conflicts {}) gate PATCHes {patches}",
        "",
        took,
        floor_took,
        m.cycles,
        m.status_writes,
        m.status_conflicts
    );
    api.stop().await;
}
