//! The burst benchmark: [`CREATES`] GPU pod creates in one namespace through the webhook's
//! real admission path (HTTPS, [`CLIENTS`] persistent connections), against one Reject-mode
//! GpuQuota with room for [`HARD`] GPUs, with every allowed pod stored as the API server would
//! and the real quota loop counting them. A sampler reads the GpuQuota every few milliseconds
//! and records the peak serialized size of its status (against the 256 KiB bound) and whether
//! `used + reserved + escrows <= hard` held at every read (exactness); the pods stored are
//! checked against `hard` at the end.

use super::https::{drive, Level, Pki};
use super::{bench_pod, pod_review};
use gpuplane_cluster::controller::queue::{self as quota_loop, QueueOptions};
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_cluster::published::Devices;
use gpuplane_cluster::webhook::{self, RunningWebhook, WebhookOptions};
use gpuplane_model::quota::{GpuQuota, MAX_RESERVATIONS};
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pod creates in the burst.
const CREATES: usize = 20_000;
/// GPUs the GpuQuota allows: the burst asks for more, so denials happen too.
const HARD: usize = 15_000;
const CLIENTS: usize = 64;
const NS: &str = "burst";
/// The bound on a GpuQuota's serialized status.
const BOUND: usize = 256 * 1024;

/// What the sampler saw.
#[derive(Default)]
struct Peaks {
    bytes: AtomicUsize,
    reservations: AtomicUsize,
    reads: AtomicUsize,
    /// Reads where what counts against `hard` exceeded it.
    over: AtomicUsize,
}

impl Peaks {
    fn sample(&self, v: &Value) {
        let bytes = serde_json::to_vec(&v["status"]).map_or(0, |b| b.len());
        self.bytes.fetch_max(bytes, Ordering::Relaxed);
        let Ok(q) = serde_json::from_value::<GpuQuota>(v.clone()) else {
            return;
        };
        let s = q.status_or_default();
        self.reservations
            .fetch_max(s.reservations.len(), Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        let fits = s.consumed(None).is_ok_and(|c| {
            q.spec
                .hard
                .bounds()
                .iter()
                .all(|(dim, bound)| c.get(dim) <= *bound)
        });
        if !fits {
            self.over.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn read(api: &ApiServerDouble) -> Option<Value> {
    api.get_json(
        "quota.gpuplane.dev/v1alpha1",
        "gpuquotas",
        Some(NS),
        "burst",
    )
}

/// Reads the GpuQuota into `peaks` every 5 ms until `done`.
async fn sample_until(api: Arc<ApiServerDouble>, peaks: Arc<Peaks>, done: Arc<AtomicBool>) {
    while !done.load(Ordering::Relaxed) {
        if let Some(v) = read(&api) {
            peaks.sample(&v);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The webhook and the quota loop running against `api`, and how to stop the loop.
async fn start(
    api: &ApiServerDouble,
    pki: &Pki,
) -> (
    RunningWebhook,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop_loop, loop_stopped) = tokio::sync::oneshot::channel::<()>();
    let client = api.client().unwrap();
    let devices = Devices::start(&client, Default::default(), |_, _| {});
    let loop_task = tokio::spawn(quota_loop::run(
        client,
        QueueOptions {
            batch: Duration::from_millis(20),
            ..QueueOptions::default()
        },
        devices,
        Arc::new(QueueMetrics::default()),
        async {
            let _ = loop_stopped.await;
        },
    ));
    let mut opts = WebhookOptions::new(pki.path("tls.crt"), pki.path("tls.key"), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(20);
    let hook = webhook::start(api.client().unwrap(), opts).await.unwrap();
    (hook, stop_loop, loop_task)
}

pub async fn burst_bench() {
    let api = Arc::new(ApiServerDouble::start().await.unwrap());
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "burst", "namespace": NS},
        "spec": {"hard": {"gpus": HARD}, "mode": "Reject"}}),
    )
    .unwrap();
    let pki = Pki::new();
    let (hook, stop_loop, loop_task) = start(&api, &pki).await;

    let peaks = Arc::new(Peaks::default());
    let done = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_until(api.clone(), peaks.clone(), done.clone()));
    let stored = Arc::new(AtomicUsize::new(0));
    let (created_tx, mut created_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let creator = {
        let (api, stored) = (api.clone(), stored.clone());
        tokio::spawn(async move {
            while let Some(i) = created_rx.recv().await {
                api.put_json(bench_pod(NS, i)).unwrap();
                stored.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> = Arc::new(|i| pod_review(NS, i));
    let level = drive(
        &pki.client_config(),
        hook.addr(),
        "/validate",
        CLIENTS,
        CREATES.div_ceil(CLIENTS),
        body,
        Some(created_tx),
    )
    .await;
    creator.await.unwrap();
    // Let the loop catch up, then one last read.
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    if let Some(v) = read(&api) {
        peaks.sample(&v);
    }
    report(&level, &peaks, stored.load(Ordering::Relaxed));
    let _ = stop_loop.send(());
    loop_task.await.unwrap();
    hook.stop().await;
    if let Ok(api) = Arc::try_unwrap(api) {
        api.stop().await;
    }
}

fn report(level: &Level, peaks: &Peaks, stored: usize) {
    let n = level.allowed + level.denied + level.closed;
    let rate = n as f64 / level.wall.as_secs_f64();
    let bytes = peaks.bytes.load(Ordering::Relaxed);
    let over = peaks.over.load(Ordering::Relaxed);
    println!(
        "burst: {n} pod CREATEs (nvidia.com/gpu: 1) in one namespace, {CLIENTS} clients over HTTPS, Reject-mode GpuQuota (gpus: {HARD}), pods stored and counted by the quota loop"
    );
    println!(
        "{:<56} {rate:>9.0}/s over {:.1?} (a minute needs {:.0}/s)",
        "creates per second",
        level.wall,
        CREATES as f64 / 60.0
    );
    println!(
        "{:<56} allowed {} denied over hard {} backpressure (429) {} closed {}",
        "",
        level.allowed,
        level.denied - level.backpressure,
        level.backpressure,
        level.closed
    );
    println!(
        "{:<56} {bytes:>9} B | bound {BOUND:>9} B | ratio {:>5.2}x (peak/bound); peak reservations {} (cap {MAX_RESERVATIONS})",
        "peak serialized GpuQuota status",
        bytes as f64 / BOUND as f64,
        peaks.reservations.load(Ordering::Relaxed),
    );
    println!(
        "{:<56} used + reserved + escrows <= hard at {} of {} reads; pods stored {stored} <= hard {HARD}: {}",
        "exactness",
        peaks.reads.load(Ordering::Relaxed) - over,
        peaks.reads.load(Ordering::Relaxed),
        if over == 0 && stored <= HARD && stored == level.allowed { "held" } else { "VIOLATED" }
    );
}
