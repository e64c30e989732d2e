//! The GPU-hours ledger in the quota loop against the API server double: pods with known
//! lifetimes, a pod deleted while watched, and a controller restart during which a pod ends;
//! the book (ConfigMap), `gpuplane report`'s query, the GpuQuota's `status.gpuHours` and the
//! counters agree with the pods' own times.

use crate::support::eventually::{eventually_async, LIMIT};
use gpuplane_cluster::controller::hours::{Book, By, HoursSettings};
use gpuplane_cluster::controller::meter::{self, HoursOptions, ReportQuery, BOOK_KEY, BOOK_NAME};
use gpuplane_cluster::controller::queue::{self, QueueOptions};
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_model::quota::{GpuQuota, GpuQuotaSpec, Gpus, Limits};
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const QNS: &str = "team-a";
const CNS: &str = "gpuplane-system";

/// Whole seconds since the epoch, now.
fn now_s() -> i64 {
    Timestamp::now().as_second()
}

fn rfc(s: i64) -> String {
    Timestamp::from_second(s).unwrap().to_string()
}

type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
);

/// The quota loop with the ledger on, until the returned sender is dropped or fired.
fn start_loop(server: &ApiServerDouble, metrics: Arc<QueueMetrics>) -> Running {
    start_loop_every(server, metrics, Duration::from_millis(100))
}

/// [`start_loop`] flushing every `interval`.
fn start_loop_every(
    server: &ApiServerDouble,
    metrics: Arc<QueueMetrics>,
    interval: Duration,
) -> Running {
    let opts = QueueOptions {
        batch: Duration::from_millis(20),
        resync: Duration::from_millis(300),
        hours: Some(HoursOptions {
            settings: HoursSettings {
                owner_labels: vec!["team".into()],
                lag: Duration::ZERO,
                ..HoursSettings::default()
            },
            interval,
            namespace: CNS.into(),
            prometheus: None,
        }),
        ..QueueOptions::default()
    };
    let client = server.client().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let devices =
            gpuplane_cluster::published::Devices::start(&client, opts.catalog.clone(), |_, _| {});
        queue::run(client, opts, devices, metrics, async {
            let _ = stopped.await;
        })
        .await
    });
    (stop, task)
}

/// A 1-GPU pod of team `team`, with the status given.
async fn pod(pods: &Api<Pod>, name: &str, team: &str, status: serde_json::Value) {
    let p: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": QNS, "labels": {"team": team}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "main", "image": "busybox",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &p).await.unwrap();
    set_status(pods, name, status).await;
}

async fn set_status(pods: &Api<Pod>, name: &str, status: serde_json::Value) {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .unwrap();
}

fn running(start: i64) -> serde_json::Value {
    json!({"phase": "Running", "containerStatuses": [{"name": "main", "image": "busybox",
        "imageID": "", "ready": true, "restartCount": 0,
        "state": {"running": {"startedAt": rfc(start)}}}]})
}

fn finished(start: i64, end: i64) -> serde_json::Value {
    json!({"phase": "Succeeded", "containerStatuses": [{"name": "main", "image": "busybox",
        "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "startedAt": rfc(start),
                                 "finishedAt": rfc(end)}}}]})
}

async fn book(server: &ApiServerDouble) -> Option<Book> {
    let api: Api<ConfigMap> = Api::namespaced(server.client().unwrap(), CNS);
    let cm = api.get_opt(BOOK_NAME).await.unwrap()?;
    Some(Book::from_json(cm.data?.get(BOOK_KEY)?).unwrap())
}

fn tenant(book: &Book, by: By, name: &str) -> f64 {
    let r = book.report(&by, None, None, None);
    r.rows
        .iter()
        .find(|r| r.tenant == name)
        .map_or(0.0, |r| r.gpu_seconds)
}

async fn wait_watermark(server: &ApiServerDouble, at_least_s: i64) -> Book {
    let start = Instant::now();
    loop {
        if let Some(b) = book(server).await {
            if b.watermark().is_some_and(|w| w >= at_least_s * 1000) {
                return b;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for the book's watermark to pass {at_least_s}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn pods_are_counted_from_their_own_times_across_a_controller_restart() {
    let server = ApiServerDouble::start().await.unwrap();
    let client = server.client().unwrap();
    let spec = GpuQuotaSpec {
        hard: Limits {
            gpus: Some(Gpus::whole(8)),
            ..Limits::default()
        },
        ..GpuQuotaSpec::default()
    };
    Api::<GpuQuota>::namespaced(client.clone(), QNS)
        .create(&PostParams::default(), &GpuQuota::new("default", spec))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), QNS);
    let t = now_s() - 30;
    // "a" ran 20 s before the controller started; "b" runs on; "c" runs until deleted.
    pod(&pods, "a", "ml", finished(t, t + 20)).await;
    pod(&pods, "b", "ml", running(t + 10)).await;
    pod(&pods, "c", "ops", running(t)).await;
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, task) = start_loop(&server, metrics.clone());
    wait_watermark(&server, t + 30).await;
    let deleted_after = Timestamp::now().as_millisecond();
    pods.delete("c", &DeleteParams::default()).await.unwrap();
    let deleted_before = Timestamp::now().as_millisecond();
    // Past the deletion, then down.
    wait_watermark(&server, deleted_before / 1000 + 1).await;
    stop.send(()).unwrap();
    task.await.unwrap();
    let down = book(&server).await.unwrap();
    // "b" ends while no controller runs, after the watermark.
    let end = down.watermark().unwrap() / 1000 + 2;
    tokio::time::sleep_until(Instant::now() + Duration::from_millis(2500)).await;
    set_status(&pods, "b", finished(t + 10, end)).await;
    let (stop, task) = start_loop(&server, metrics.clone());
    let b = wait_watermark(&server, end + 1).await;
    let ml = tenant(&b, By::Owner("team".into()), "ml");
    // Exact but for the float sums of several flushes.
    let want = 20.0 + (end - t - 10) as f64;
    assert!((ml - want).abs() < 1e-6, "{ml} vs {want}: {b:?}");
    let ops = tenant(&b, By::Owner("team".into()), "ops");
    let (lo, hi) = (
        (deleted_after - t * 1000) as f64 / 1000.0,
        (deleted_before - t * 1000) as f64 / 1000.0 + 1.0,
    );
    assert!(lo <= ops && ops <= hi, "{lo} <= {ops} <= {hi}");
    let total = tenant(&b, By::Namespace, QNS);
    assert!((total - (ml + ops)).abs() < 1e-6);
    assert!((tenant(&b, By::Quota, "team-a/default") - total).abs() < 1e-6);
    // gpuplane report's query reads the same book.
    let query = ReportQuery {
        controller_namespace: CNS.into(),
        by: By::Owner("team".into()),
        namespace: Some(QNS.into()),
        since: None,
        until: None,
    };
    let report = meter::report(&client, &query).await.unwrap();
    assert!(report
        .rows
        .iter()
        .any(|r| r.tenant == "ml" && (r.gpu_hours - ml / 3600.0).abs() < 1e-9));
    // The quota's status shows the period's total; the counters hold both leaders' flushes.
    eventually_async("status.gpuHours", LIMIT, || async {
        let q = Api::<GpuQuota>::namespaced(client.clone(), QNS)
            .get("default")
            .await
            .unwrap();
        let h = q.status.and_then(|s| s.gpu_hours);
        h.is_some_and(|h| (h.gpu_seconds - total).abs() < 1e-6)
    })
    .await;
    let text = gpuplane_common::metrics::render(&[metrics.registry()]);
    let counter = |prefix: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{prefix} missing from:\n{text}"))
    };
    let counted = counter("gpuplane_gpu_seconds_total{namespace=\"team-a\",label_team=\"ml\"}");
    assert!((counted - ml).abs() < 1e-6, "{counted} vs {ml}");
    let q = counter("gpuplane_quota_gpu_seconds_total{namespace=\"team-a\",quota=\"default\"}");
    assert!((q - total).abs() < 1e-6);
    stop.send(()).unwrap();
    task.await.unwrap();
}

#[tokio::test]
async fn a_stopping_leader_flushes_the_book_once_more() {
    let server = ApiServerDouble::start().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(server.client().unwrap(), QNS);
    let t = now_s() - 10;
    pod(&pods, "a", "ml", running(t)).await;
    // Flushes an hour apart: only the first (at once) and the last (at the stop) happen.
    let metrics = Arc::new(QueueMetrics::default());
    let (stop, task) = start_loop_every(&server, metrics, Duration::from_secs(3600));
    let first = wait_watermark(&server, t).await.watermark().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stopped_at = Timestamp::now().as_millisecond();
    stop.send(()).unwrap();
    task.await.unwrap();
    let last = book(&server).await.unwrap();
    assert!(
        last.watermark().unwrap() >= stopped_at,
        "{first} -> {last:?}"
    );
    let counted = tenant(&last, By::Namespace, QNS);
    let want = (last.watermark().unwrap() - t * 1000) as f64 / 1000.0;
    assert!((counted - want).abs() < 1e-6, "{counted} vs {want}");
}
