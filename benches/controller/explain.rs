//! `explain pod` latency against the API server double (issue 26: p99 <= 100 ms): the default
//! path (the pod's controller condition, one GET) and `--live` (every list the classifier
//! needs) over [`NODES`] nodes with their bound pods, each against its floor: a bare GET of the
//! same pod through the same client.

use super::common::{percentiles, row};
use gpuplane_cluster::explain_cli;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::json;
use std::future::Future;
use std::time::{Duration, Instant};

/// Nodes of 8 GPUs, each with one bound pod holding 6 of them.
const NODES: usize = 200;
/// Timed calls per figure.
const CALLS: usize = 200;
const NS: &str = "bench";

/// `CALLS` timings of `f`.
async fn timed<F, Fut>(f: F) -> Vec<Duration>
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut out = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let t = Instant::now();
        f().await;
        out.push(t.elapsed());
    }
    out
}

fn fill(server: &ApiServerDouble) {
    for i in 0..NODES {
        let node = format!("node-{i}");
        server
            .put_json(
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
                "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "64"},
                    "conditions": [{"type": "Ready", "status": "True"}]}}),
            )
            .unwrap();
        server
            .put_json(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"namespace": "filler", "name": format!("held-{i}")},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x",
                    "resources": {"limits": {"nvidia.com/gpu": "6"}}}]},
                "status": {"phase": "Running"}}))
            .unwrap();
    }
    let cond = json!({"type": "gpuplane.dev/GPUsAvailable", "status": "False",
        "reason": "Fragmentation", "lastTransitionTime": "2026-12-03T11:00:00Z",
        "message": "needs 4 nvidia.com/gpu; 400 free across 200 nodes, at most 2 on one"});
    server
        .put_json(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": NS, "name": "frag"},
            "spec": {"containers": [{"name": "c", "image": "x",
                "resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
            "status": {"phase": "Pending", "conditions": [cond]}}))
        .unwrap();
}

pub async fn explain_bench() {
    let server = ApiServerDouble::start().await.unwrap();
    fill(&server);
    let client = server.client().unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let get = || async {
        pods.get("frag").await.unwrap();
    };
    let ask = |live: bool| {
        let client = client.clone();
        async move {
            let e = explain_cli::pod(&client, Default::default(), NS, "frag", live)
                .await
                .unwrap();
            assert_eq!(e.reason.as_str(), "Fragmentation");
        }
    };
    // Warm the connection pool before timing anything.
    get().await;
    println!("explain pod against the API server double, {NODES} nodes with a bound pod each; floor: a bare GET of the pod");
    let floor = percentiles(timed(get).await);
    row(
        "explain pod (the controller's condition)",
        percentiles(timed(|| ask(false)).await),
        floor,
    );
    row(
        "explain pod --live (every list)",
        percentiles(timed(|| ask(true)).await),
        floor,
    );
}
