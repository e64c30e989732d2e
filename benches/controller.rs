//! `gpuplane controller` benchmarks. Each figure is printed next to a floor measured in the
//! same run on the same machine, and the ratio, because shared machines are noisy:
//! - admission webhook decision latency (p50/p99) and decisions per second at 1, 64 and 512
//!   concurrent clients, over HTTPS with persistent connections: pod CREATE AdmissionReviews
//!   against a Reject-mode GpuQuota large enough that every pod is admitted (so every decision
//!   records a reservation in the GpuQuota status, in batches: the group commit), vs a bare
//!   hyper + rustls handler on loopback answering a fixed small JSON body, driven by the same
//!   client at the same concurrency. The GpuQuota status writes are counted at the API server
//!   double. A second floor is one API round trip: a GpuQuota status PUT through the same kube
//!   client against the same double; the 1-client p50 target is 3x the TLS floor plus that.
//!
//! - Queue mode release rate: pods released per second from a queue of [`QUEUED`] gated pods
//!   under one Queue-mode GpuQuota with room for all, the loop started with the pods already
//!   there (as after a leader change), timed until the last gate is removed; vs the same number
//!   of bare gate-removal PATCHes (the loop's own guarded JSON patch, `writes::ungate`) against
//!   the same API server double, with the same client and the loop's write concurrency.
//!
//! The webhook runs in process against the API server double, with an rcgen test CA. Each
//! concurrency level uses its own namespace and GpuQuota, so every level starts from an empty
//! reservation list.
//!
//! As in a cluster, every allowed pod is then stored in the API server double and the real
//! quota loop runs beside the webhook: it counts stored pods in `used` and drops their
//! reservations. Each status write carries the reservations still in the status, so the figures
//! depend on how well the loop keeps the list short (the bench prints what is left per level).
//!
//! - Burst: 20,000 GPU pod creates in one namespace through the webhook, against a GpuQuota
//!   with room for 15,000: the peak serialized status size against the 256 KiB bound, and
//!   whether `used + reserved + escrows <= hard` held at every read (`controller/burst.rs`).
//!
//! - `explain pod` against the API server double: the controller's condition (one GET) and
//!   `--live` (every list), each against a bare GET of the pod (`controller/explain.rs`).
//!
//! Run: `cargo bench --bench controller [webhook|queue|burst|explain]` (results are kept in benches/results/).

#[path = "controller/burst.rs"]
mod burst;
mod common;
#[path = "controller/explain.rs"]
mod explain;
#[path = "controller/https.rs"]
mod https;
#[path = "controller/queue.rs"]
mod queue;

use common::{percentiles, row};
use https::{drive, floor_server, Level, Pki, FLOOR_BODY};

use gpuplane_cluster::controller::queue::{self as quota_loop, QueueOptions};
use gpuplane_cluster::controller_metrics::{MetricsSnapshot, QueueMetrics};
use gpuplane_cluster::published::Devices;
use gpuplane_cluster::webhook::{self, RunningWebhook, WebhookOptions};
use gpuplane_model::quota::GpuQuota;
use gpuplane_testkit::doubles::admission::pod_create_review;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use kube::api::{Api, PostParams};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_rustls::rustls;

/// Timed requests per concurrency level (rounded up to a multiple of the concurrency).
const REQUESTS: usize = 1024;
const CONCURRENCY: [usize; 3] = [1, 64, 512];

fn bench_pod(ns: &str, i: usize) -> Value {
    let name = format!("p-{i:05}");
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{ns}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
}

fn pod_review(ns: &str, i: usize) -> Vec<u8> {
    serde_json::to_vec(&pod_create_review(
        &format!("req-{ns}-{i}"),
        &bench_pod(ns, i),
    ))
    .unwrap()
}

fn quota(api: &ApiServerDouble, ns: &str) {
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "bench", "namespace": ns},
        "spec": {"hard": {"gpus": 1_000_000}, "mode": "Reject"}}),
    )
    .unwrap();
}

/// One API round trip: `n` GpuQuota status PUTs in a row (each with the resourceVersion the
/// last one returned), through the real kube client against the double.
async fn api_round_trips(client: &kube::Client, ns: &str, n: usize) -> Vec<Duration> {
    let api: Api<GpuQuota> = Api::namespaced(client.clone(), ns);
    let mut q = api.get("bench").await.unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let t = Instant::now();
        match api
            .replace_status("bench", &PostParams::default(), &q)
            .await
        {
            Ok(next) => {
                out.push(t.elapsed());
                q = next;
            }
            // The controller loop wrote it in between: read again, not counted.
            Err(kube::Error::Api(s)) if s.code == 409 => q = api.get("bench").await.unwrap(),
            Err(e) => panic!("{e}"),
        }
    }
    out
}

/// What every concurrency level of the webhook benchmark runs against.
struct Rig {
    api: Arc<ApiServerDouble>,
    webhook: RunningWebhook,
    /// The controller loop's counters.
    loop_metrics: Arc<QueueMetrics>,
    cfg: Arc<rustls::ClientConfig>,
    floor_addr: SocketAddr,
    /// One API round trip: (p50, p99).
    rtt: (Duration, Duration),
}

async fn webhook_bench() {
    let api = Arc::new(ApiServerDouble::start().await.unwrap());
    for c in CONCURRENCY {
        quota(&api, &format!("bench-{c}"));
    }
    quota(&api, "bench-rtt");
    // The controller loop runs as in a cluster: the API server stores every allowed pod, the
    // loop counts it in `used` and drops its reservation, so the status holds only
    // admissions in flight.
    let loop_metrics = Arc::new(QueueMetrics::default());
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
        loop_metrics.clone(),
        async {
            let _ = loop_stopped.await;
        },
    ));
    let pki = Pki::new();
    let mut opts = WebhookOptions::new(pki.path("tls.crt"), pki.path("tls.key"), "gpuplane-system");
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(20);
    let webhook = webhook::start(api.client().unwrap(), opts).await.unwrap();
    let floor_addr = floor_server(pki.server_config()).await;
    let rtt =
        percentiles(api_round_trips(&api.client().unwrap(), "bench-rtt", REQUESTS.min(512)).await);
    let rig = Rig {
        api,
        webhook,
        loop_metrics,
        cfg: pki.client_config(),
        floor_addr,
        rtt,
    };

    println!(
        "webhook: POST /validate, pod CREATE with nvidia.com/gpu: 1, Reject-mode GpuQuota (gpus: 1000000),"
    );
    println!(
        "HTTPS with persistent connections; floor: bare hyper + rustls handler, fixed {}-byte JSON answer",
        FLOOR_BODY.len()
    );
    for c in CONCURRENCY {
        level(&rig, c).await;
    }
    let counters = rig.webhook.metrics.render();
    let counters: Vec<&str> = counters
        .lines()
        .filter(|l| {
            l.starts_with("gpuplane_webhook_admissions_total")
                || l.starts_with("gpuplane_webhook_reservation_contended_total")
        })
        .collect();
    println!("{}", counters.join("\n"));
    let _ = stop_loop.send(());
    loop_task.await.unwrap();
    rig.webhook.stop().await;
    if let Ok(api) = Arc::try_unwrap(rig.api) {
        api.stop().await;
    }
}

/// The GpuQuota writes counted so far: at the API server, by the webhook, by the loop.
struct Writes {
    api: usize,
    hook: u64,
    conflicts: u64,
    escrowed: u64,
    loop_: MetricsSnapshot,
}

impl Writes {
    fn now(rig: &Rig) -> Writes {
        let commits = &rig.webhook.commits;
        Writes {
            api: rig.api.count_requests("PUT", "gpuquotas")
                + rig.api.count_requests("PATCH", "gpuquotas"),
            hook: commits.writes.load(Ordering::Relaxed),
            conflicts: commits.conflicts.load(Ordering::Relaxed),
            escrowed: commits.escrowed.load(Ordering::Relaxed),
            loop_: rig.loop_metrics.snapshot(),
        }
    }
}

/// One concurrency level: `c` clients against the webhook, each allowed pod then stored as
/// the API server would, and the same clients against the floor.
async fn level(rig: &Rig, c: usize) {
    let per_client = REQUESTS.div_ceil(c);
    let ns = format!("bench-{c}");
    let before = Writes::now(rig);
    let (created_tx, mut created_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let creator = {
        let (api, ns) = (rig.api.clone(), ns.clone());
        tokio::spawn(async move {
            while let Some(i) = created_rx.recv().await {
                api.put_json(bench_pod(&ns, i)).unwrap();
            }
        })
    };
    let body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> = {
        let ns = ns.clone();
        Arc::new(move |i| pod_review(&ns, i))
    };
    let hook = drive(
        &rig.cfg,
        rig.webhook.addr(),
        "/validate",
        c,
        per_client,
        body,
        Some(created_tx),
    )
    .await;
    creator.await.unwrap();
    let after = Writes::now(rig);
    let floor_body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync> =
        Arc::new(|i| pod_review("floor", i));
    let floor = drive(
        &rig.cfg,
        rig.floor_addr,
        "/validate",
        c,
        per_client,
        floor_body,
        None,
    )
    .await;
    if hook.samples.is_empty() || floor.samples.is_empty() {
        println!("{c} clients: every connection was closed before answering");
        return;
    }
    report_level(rig, c, &ns, hook, floor, &before, &after);
}

/// Prints a level's latency and rate next to the floor's, its write counts, and its target.
fn report_level(
    rig: &Rig,
    c: usize,
    ns: &str,
    hook: Level,
    floor: Level,
    before: &Writes,
    after: &Writes,
) {
    let n = hook.samples.len();
    let hook_rate = n as f64 / hook.wall.as_secs_f64();
    let floor_rate = floor.samples.len() as f64 / floor.wall.as_secs_f64();
    let (hook_p50, hook_p99) = percentiles(hook.samples.clone());
    let floor_p50 = percentiles(floor.samples.clone()).0;
    row(
        &format!("decision latency, {c:>3} clients ({n} requests)"),
        percentiles(hook.samples),
        percentiles(floor.samples),
    );
    println!(
        "{:<56} {hook_rate:>9.0}/s | floor {floor_rate:>9.0}/s | ratio {:>5.2}x (floor/webhook)",
        format!("decisions per second, {c:>3} clients"),
        floor_rate / hook_rate
    );
    let reservations = rig
        .api
        .get_json(
            "quota.gpuplane.dev/v1alpha1",
            "gpuquotas",
            Some(ns),
            "bench",
        )
        .and_then(|q| q["status"]["reservations"].as_array().map(|a| a.len()))
        .unwrap_or(0);
    println!(
        "{:<56} allowed {} denied {} closed {} (floor closed {}); connections set up in {:.1?} (floor {:.1?})",
        "",
        hook.allowed,
        hook.denied,
        hook.closed,
        floor.closed,
        hook.setup,
        floor.setup
    );
    let hook_writes = after.hook - before.hook;
    println!(
        "{:<56} GpuQuota status writes {}: webhook {hook_writes} (1 per {:.1} admissions, {} admitted within its escrow; {} conflicts), controller {} ({} conflicts, {} cycles); reservations left {reservations}",
        "",
        after.api - before.api,
        hook.allowed as f64 / hook_writes.max(1) as f64,
        after.escrowed - before.escrowed,
        after.conflicts - before.conflicts,
        after.loop_.status_writes - before.loop_.status_writes,
        after.loop_.status_conflicts - before.loop_.status_conflicts,
        after.loop_.cycles - before.loop_.cycles,
    );
    let (rtt_p50, rtt_p99) = rig.rtt;
    let target = match c {
        1 => {
            let bound = floor_p50 * 3 + rtt_p50;
            format!(
                "target p50 <= 3 x floor p50 + one API round trip (p50 {rtt_p50:.1?}, p99 {rtt_p99:.1?}) = {bound:.1?}: p50 {hook_p50:.1?}, {:.2}x the bound",
                hook_p50.as_secs_f64() / bound.as_secs_f64()
            )
        }
        64 => format!(
            "target >= 2000/s and <= 1 webhook write per 16 admissions: {hook_rate:.0}/s, 1 write per {:.1}",
            hook.allowed as f64 / hook_writes.max(1) as f64
        ),
        _ => format!("target p99 <= 100ms: p99 {hook_p99:.1?}"),
    };
    println!("{:<56} {target}", "");
}

fn main() {
    // `cargo bench --bench controller queue`: only the sections whose name contains the filter
    // (cargo passes `--bench` itself).
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if wanted("webhook") {
            webhook_bench().await;
        }
        if wanted("queue") {
            queue::queue_bench().await;
        }
        if wanted("burst") {
            burst::burst_bench().await;
        }
        if wanted("explain") {
            explain::explain_bench().await;
        }
    });
}
