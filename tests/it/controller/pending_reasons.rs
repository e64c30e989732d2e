//! Why a pending GPU pod waits: its reason and condition, one Event per change of reason, and the
//! explainer's device catalog following slices and classes.

use super::*;

fn gpu_node(name: &str, gpus: u64) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "status": {"allocatable": {"nvidia.com/gpu": gpus.to_string(), "cpu": "64"},
            "conditions": [{"type": "Ready", "status": "True"}]}})
}

/// Runs the explainer against `server` with `opts` until the returned sender is used or
/// dropped; its task to await after.
fn start_explainer(
    server: &ApiServerDouble,
    opts: gpuplane_cluster::controller::explainer::ExplainerOptions,
    metrics: Arc<QueueMetrics>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    use gpuplane_cluster::published::Devices;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = server.client().unwrap();
    let task = tokio::spawn(async move {
        let devices = Devices::start(&client, Default::default(), |_, _| {});
        gpuplane_cluster::controller::explainer::run(client, opts, devices, metrics, async {
            let _ = stopped.await;
        })
        .await
    });
    (stop, task)
}

#[tokio::test]
async fn every_new_reason_lands_before_any_event_and_each_pod_gets_one_event() {
    use gpuplane_cluster::controller::explainer::{ExplainerOptions, CONDITION};
    let server = ApiServerDouble::start().await.unwrap();
    server.put_json(gpu_node("node-1", 2)).unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let names: Vec<String> = (0..5).map(|i| format!("wait-{i}")).collect();
    for name in &names {
        let mut p = pod(name, 4, false);
        p["spec"].as_object_mut().unwrap().remove("nodeName");
        pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap())
            .await
            .unwrap();
    }
    let mut opts = ExplainerOptions::new("replica-1");
    opts.debounce = Duration::from_millis(50);
    // One write at a time, so the order shows: Events go in batches of 4 after the reasons.
    opts.concurrency = 1;
    let (stop, task) = start_explainer(&server, opts, Arc::new(QueueMetrics::default()));
    let all_events = || async {
        let mut n = 0;
        for name in &names {
            n += events_for(&server, name).await.len();
        }
        n
    };
    eventually_async("a first Event", LIMIT, || async { all_events().await > 0 }).await;
    for name in &names {
        let c = condition_of(&pods.get(name).await.unwrap(), CONDITION);
        assert_eq!(
            c.map(|c| c.1).as_deref(),
            Some("Capacity"),
            "{name}: its reason before any Event"
        );
    }
    eventually_async("five Events", LIMIT, || async { all_events().await == 5 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for name in &names {
        assert_eq!(
            events_for(&server, name).await.len(),
            1,
            "{name}: one Event"
        );
    }
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test]
async fn a_pending_gpu_pod_carries_why_it_waits_and_one_event_per_change_of_reason() {
    use gpuplane_cluster::controller::explainer::{ExplainerOptions, CONDITION};
    let server = ApiServerDouble::start().await.unwrap();
    server.put_json(gpu_node("node-1", 2)).unwrap();
    let start = |metrics: Arc<QueueMetrics>| {
        let mut opts = ExplainerOptions::new("replica-1");
        opts.debounce = Duration::from_millis(50);
        opts.message_refresh = Duration::ZERO;
        start_explainer(&server, opts, metrics)
    };
    let (stop, task) = start(Arc::new(QueueMetrics::default()));
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let mut big = pod("big", 4, false);
    big["spec"].as_object_mut().unwrap().remove("nodeName");
    let big: Pod = serde_json::from_value(big).unwrap();
    pods.create(&PostParams::default(), &big).await.unwrap();
    let said = || async { condition_of(&pods.get("big").await.unwrap(), CONDITION) };
    let capacity = (
        "False".to_string(),
        "Capacity".to_string(),
        "needs 4 nvidia.com/gpu; 2 free in the cluster".to_string(),
    );
    eventually_async("reason Capacity on the pod", LIMIT, || async {
        said().await.as_ref() == Some(&capacity)
    })
    .await;
    eventually_async("an Event", LIMIT, || async {
        !events_for(&server, "big").await.is_empty()
    })
    .await;
    // Changes that leave the reason alone (another node too small, a label) make no Event.
    server.put_json(gpu_node("node-0", 1)).unwrap();
    let message = "needs 4 nvidia.com/gpu; 3 free in the cluster";
    eventually_async("the message follows", LIMIT, || async {
        said().await.is_some_and(|c| c.2 == message)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let evs = events_for(&server, "big").await;
    assert_eq!(evs.len(), 1, "{evs:?}");
    assert_eq!(evs[0].reason.as_deref(), Some("Capacity"));
    assert_eq!(evs[0].type_.as_deref(), Some("Warning"));
    // A new leader does not repeat what the condition already says.
    let _ = stop.send(());
    task.await.unwrap();
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, task) = start(metrics.clone());
    let lines = [
        "gpuplane_pending_gpu_pods{reason=\"Capacity\"} 1",
        "gpuplane_pending_gpu_pods{reason=\"Placement\"} 0",
    ];
    eventually_async("the new leader's first cycle", LIMIT, || async {
        let text = gpuplane_common::metrics::render(&[metrics.registry()]);
        lines.iter().all(|line| text.lines().any(|l| l == *line))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(events_for(&server, "big").await.len(), 1);
    // A node with room: the reason changes, and a second Event says so.
    server.put_json(gpu_node("node-2", 8)).unwrap();
    eventually_async("another reason", LIMIT, || async {
        said().await.is_some_and(|c| c.1 != "Capacity")
    })
    .await;
    let new = said().await.unwrap().1;
    eventually_async("a second Event", LIMIT, || async {
        events_for(&server, "big").await.len() == 2
    })
    .await;
    let reasons: Vec<_> = events_for(&server, "big")
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    assert!(reasons.contains(&new), "{reasons:?}");
    // Scheduled: the condition turns True and the wait is observed under the last reason.
    pods.patch(
        "big",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"nodeName": "node-2"}})),
    )
    .await
    .unwrap();
    let scheduled = (
        "True".to_string(),
        "Scheduled".to_string(),
        "scheduled to node node-2".to_string(),
    );
    eventually_async("condition True", LIMIT, || async {
        said().await.as_ref() == Some(&scheduled)
    })
    .await;
    let seen = format!("gpuplane_pending_gpu_pod_seconds_count{{reason=\"{new}\"}} 1");
    let text = gpuplane_common::metrics::render(&[metrics.registry()]);
    assert!(text.lines().any(|l| l == seen), "{seen} in:\n{text}");
    assert_eq!(events_for(&server, "big").await.len(), 2);
    let _ = stop.send(());
    task.await.unwrap();
}

/// Numbers that change twice inside a pod's message window reach the pod when the window
/// ends, though nothing else changes after: the explainer wakes for them, not at its resync.
#[tokio::test]
async fn the_latest_numbers_are_written_when_the_message_window_ends() {
    use gpuplane_cluster::controller::explainer::{ExplainerOptions, CONDITION};
    let server = ApiServerDouble::start().await.unwrap();
    server.put_json(gpu_node("node-1", 2)).unwrap();
    let mut opts = ExplainerOptions::new("replica-1");
    opts.debounce = Duration::from_millis(50);
    opts.message_refresh = Duration::from_secs(3);
    // Past the test's limit: only the window's end can bring the last numbers.
    opts.resync = Duration::from_secs(3600);
    let (stop, task) = start_explainer(&server, opts, Arc::new(QueueMetrics::default()));
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let mut big = pod("big", 8, false);
    big["spec"].as_object_mut().unwrap().remove("nodeName");
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(big).unwrap(),
    )
    .await
    .unwrap();
    let message =
        || async { condition_of(&pods.get("big").await.unwrap(), CONDITION).map(|c| (c.1, c.2)) };
    let free = |n: u64| {
        Some((
            "Capacity".to_string(),
            format!("needs 8 nvidia.com/gpu; {n} free in the cluster"),
        ))
    };
    eventually_async("the first numbers", LIMIT, || async {
        message().await == free(2)
    })
    .await;
    // Two changes inside the window: the second's numbers are the ones that must land.
    server.put_json(gpu_node("node-2", 1)).unwrap();
    server.put_json(gpu_node("node-3", 1)).unwrap();
    eventually_async("the latest numbers after the window", LIMIT, || async {
        message().await == free(4)
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap();
}

/// The explainer keeps its device catalog between cycles; a new ResourceSlice or a changed
/// DeviceClass must still reach the answer (the catalog is rebuilt when either changes).
#[tokio::test]
async fn the_explainers_kept_device_catalog_follows_slices_and_classes() {
    use gpuplane_cluster::controller::explainer::{ExplainerOptions, CONDITION};
    let server = ApiServerDouble::start().await.unwrap();
    let class = |product: &str| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu.gpuplane.dev"},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.attributes['gpu.gpuplane.dev'].productName == '{product}'")}}]}})
    };
    server.put_json(class("NVIDIA H100 80GB HBM3")).unwrap();
    server
        .put_json(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one", "namespace": QNS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
                "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}),
        )
        .unwrap();
    let mut opts = ExplainerOptions::new("replica-1");
    opts.debounce = Duration::from_millis(50);
    let (stop, task) = start_explainer(&server, opts, Arc::new(QueueMetrics::default()));
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let claim: Pod = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "claim", "namespace": QNS},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one"}],
            "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &claim).await.unwrap();
    let reason =
        || async { condition_of(&pods.get("claim").await.unwrap(), CONDITION).map(|c| c.1) };
    eventually_async("Selector: nothing is published", LIMIT, || async {
        reason().await.as_deref() == Some("Selector")
    })
    .await;
    let text = gpuplane_model::sim::bundled_text("dgx-h100").unwrap();
    let inv = gpuplane_model::sim::from_str("dgx-h100", "dgx-h100", text).unwrap();
    let mut health = gpuplane_model::health::HealthBook::default();
    health.set_inventory(&inv);
    for s in gpuplane_node::slices::render::render(&inv, &health, "gpu.gpuplane.dev", "node-1") {
        server.put_json(serde_json::to_value(s).unwrap()).unwrap();
    }
    eventually_async("another reason once H100s are published", LIMIT, || async {
        reason().await.is_some_and(|r| r != "Selector")
    })
    .await;
    server.put_json(class("NVIDIA B200")).unwrap();
    eventually_async(
        "Selector again once the class asks for what is not there",
        LIMIT,
        || async { reason().await.as_deref() == Some("Selector") },
    )
    .await;
    let _ = stop.send(());
    task.await.unwrap();
}
