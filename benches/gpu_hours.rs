//! The GPU-hours ledger's cost at 10,000 GPU pods (issue 27): what one flush costs the
//! controller's CPU, each figure next to a floor from the same run.
//!
//! - a flush's accounting (`hours::account`: every pod's overlap with the new interval, split
//!   by UTC day, under namespace, GpuQuota and owner keys, the book trimmed) and the book's
//!   JSON (what the ConfigMap write sends); floor: the same loop over the same pods that only
//!   sums rate times overlap;
//! - reading the pods' views again (`run_interval` and `Metered::of`, which a flush does only
//!   for pods whose resourceVersion changed, or all of them after the catalog changed); floor:
//!   `pod_charge` alone, which the quota loop already pays per changed pod.
//!
//! 10,000 pods in 100 namespaces with one GpuQuota each, 20 teams, a mix of whole GPUs and
//! time-sliced quarters, a quarter finished; a flush every 30 s (the default) on a book at its steady state
//! (40 days counted, the older ones folded into months by the size bound).
//! The share of one core the ledger takes is the flush's p50 over the interval. Run:
//! `cargo bench --bench gpu_hours`; results in benches/results/gpu_hours.txt.

mod common;

use common::{percentiles, row};
use gpuplane_cluster::controller::hours::{account, Book, HoursSettings, Metered};
use gpuplane_model::quota::{pod_charge, CatalogSettings, DeviceCatalog};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

const PODS: usize = 10_000;
const NAMESPACES: usize = 100;
const ROUNDS: usize = 60;
const INTERVAL: Duration = Duration::from_secs(30);
/// 2026-12-03T00:00:00Z in ms.
const DAY0: i64 = 1_796_256_000_000;

fn pod(i: usize) -> Pod {
    let ns = format!("team-{}", i % NAMESPACES);
    let (resource, gpus) = if i.is_multiple_of(3) {
        ("nvidia.com/gpu.shared", "1")
    } else {
        ("nvidia.com/gpu", "2")
    };
    let start = format!("2026-10-2{}T0{}:{:02}:00Z", i % 3, i % 8, i % 60);
    let state = if i.is_multiple_of(4) {
        json!({"terminated": {"exitCode": 0, "startedAt": start, "finishedAt": "2026-12-03T10:05:00Z"}})
    } else {
        json!({"running": {"startedAt": start}})
    };
    serde_json::from_value(json!({
        "metadata": {"name": format!("p{i}"), "namespace": ns, "uid": format!("u{i}"),
                     "labels": {"team": format!("t{}", i % 20), "model": format!("m{}", i % 7)}},
        "spec": {"nodeName": "n", "containers": [{"name": "main", "image": "i",
                 "resources": {"limits": {resource: gpus}}}]},
        "status": {"phase": if i.is_multiple_of(4) { "Succeeded" } else { "Running" },
                   "containerStatuses": [{"name": "main", "image": "i", "imageID": "",
                   "ready": true, "restartCount": 0, "state": state}]},
    }))
    .unwrap_or_default()
}

fn floor_sum(pods: &[Metered], from: i64, upto: i64) -> f64 {
    let mut sum = 0.0;
    for p in pods {
        let a = p.interval.start.max(from);
        let b = p.interval.end.unwrap_or(upto).min(upto);
        if b > a {
            sum += (b - a) as f64 / 1000.0 * (p.rate.gpus + p.rate.gpu_memory);
        }
    }
    sum
}

fn main() {
    let settings = HoursSettings {
        owner_labels: vec!["team".into(), "model".into()],
        ..HoursSettings::default()
    };
    // A time-sliced resource: a replica is a quarter of a GPU.
    let catalog = DeviceCatalog::new(
        &[],
        &[],
        CatalogSettings {
            time_slicing: [("nvidia.com/gpu.shared".to_string(), 4)].into(),
            ..CatalogSettings::default()
        },
    );
    let templates = BTreeMap::new();
    let pods: Vec<Pod> = (0..PODS).map(pod).collect();
    let views: Vec<Metered> = pods
        .iter()
        .filter_map(|p| {
            let c = pod_charge(p, &templates, &catalog).ok()?;
            Metered::of(p, &c.usage, &settings.owner_labels)
        })
        .collect();
    assert_eq!(views.len(), PODS, "every bench pod is metered");
    let quotas: BTreeMap<String, Vec<String>> = (0..NAMESPACES)
        .map(|n| (format!("team-{n}"), vec!["default".to_string()]))
        .collect();
    let step = INTERVAL.as_millis() as i64;
    // A book at its steady state: 40 days counted (the pods running all along), its older
    // days folded into months by the size bound, then today up to 10:00.
    let mut book = Book::default();
    for d in (1..=40).rev() {
        book = account(&book, &views, &quotas, DAY0 - d * 86_400_000, &settings).book;
    }
    let mut book = account(&book, &views, &quotas, DAY0 + 10 * 3_600_000, &settings).book;
    let (mut flush, mut floor, mut bytes) = (Vec::new(), Vec::new(), 0);
    for _ in 0..ROUNDS {
        let from = book.watermark().unwrap_or(0);
        let t = Instant::now();
        let out = account(&book, &views, &quotas, from + step, &settings);
        bytes = black_box(out.book.to_json()).len();
        flush.push(t.elapsed());
        let t = Instant::now();
        black_box(floor_sum(black_box(&views), from, from + step));
        floor.push(t.elapsed());
        book = out.book;
    }
    let (mut reread, mut priced) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        for p in &pods {
            if let Ok(c) = pod_charge(p, &templates, &catalog) {
                black_box(Metered::of(p, &c.usage, &settings.owner_labels));
            }
        }
        reread.push(t.elapsed());
        let t = Instant::now();
        for p in &pods {
            let _ = black_box(pod_charge(p, &templates, &catalog));
        }
        priced.push(t.elapsed());
    }
    println!("# cargo bench --bench gpu_hours: {PODS} GPU pods, {NAMESPACES} namespaces, owner labels team and model, a flush every {INTERVAL:?}");
    let f = percentiles(flush);
    row("a flush: account + the book's JSON", f, percentiles(floor));
    row(
        "a pod's view read again (all pods)",
        percentiles(reread),
        percentiles(priced),
    );
    println!(
        "book: {bytes} bytes ({} KiB) at its steady state; CPU share of one core at one flush per {INTERVAL:?}: {:.3}%",
        bytes / 1024,
        100.0 * f.0.as_secs_f64() / INTERVAL.as_secs_f64()
    );
}
