//! Soak: the demo's workloads in a loop against the real agent binary for a bounded time, with
//! the agent's resident memory (`VmRSS` in `/proc/<pid>/status`) sampled twice a second.
//!
//! The agent runs `gpuplane node --nvml-lib <fake libnvidia-ml>` on a simulated DGX H100 (the
//! real NVML code path), DRA on, against the API server double and the kubelet doubles in
//! this process. Each cycle: a ResourceClaim prepared and unprepared over DRA and deleted, and
//! a pod admitted through the device plugin API (GetPreferred + Allocate) whenever one of
//! `POD_SLOTS` is free; every 10th cycle an Xid 48 on a GPU (health recovers after 1 s of
//! quiet); every 5th a `/metrics` scrape; every 50th both kubelet doubles restart (sockets
//! re-created, re-registration).
//!
//! A pod runs until the agent has listed it in PodResources (any real container outlives a
//! poll), then ends. Its GPU is not given to claims while it runs, nor after it ends until the
//! agent has listed PodResources again without it: what a scheduler does seeing the in-use
//! taint. A claim refused on that GPU afterwards is a hold that outlived its pod; the count
//! should be zero. (Pods that end before any listing, as they did in this soak until
//! 2026-12-01, are Allocates PodResources never listed: the grace period keeps those.)
//!
//! Memory growth is measured, not asserted: the first quarter of the run (at least 10 s) is
//! warm-up; the figures are RSS at the end of warm-up, the steady state's range and median,
//! and its growth (least-squares slope and last-minus-first). `SOAK_SECONDS` (default 60)
//! bounds the run. Run: `cargo bench --bench soak`; results are kept in
//! benches/results/soak.txt.

#[path = "../tests/support/mod.rs"]
mod support;

use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use gpuplane_testkit::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{AgentProcess, DRIVER};

const GPU: &str = "nvidia.com/gpu";
/// Pods running (or ended, not yet seen gone by the agent) at once.
const POD_SLOTS: usize = 4;
const WAIT: Duration = Duration::from_secs(30);
/// The ledger runs with the default `podResourcesGrace` (1 s): every soak pod is listed before
/// it ends, so the grace period protects only Allocates racing a listing, and a hold that
/// outlived its pod would show as refused claims.
const CONFIG: &str = "health: {recoveryQuietPeriod: 1s}\n";

/// (seconds since start, VmRSS in KiB).
type Sample = (f64, u64);
type Samples = Arc<Mutex<Vec<Sample>>>;

fn sample_rss(pid: u32, start: Instant, samples: Samples, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        if let Some(kib) = support::vm_rss_kib(pid) {
            samples
                .lock()
                .unwrap()
                .push((start.elapsed().as_secs_f64(), kib));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[derive(Default, Debug)]
struct Counts {
    cycles: u64,
    allocated: u64,
    allocate_refused: u64,
    prepared: u64,
    /// Refused by the ledger: the GPU was still held by a pod that ended and that the agent
    /// had since listed PodResources without.
    prepare_refused_ended: u64,
    /// Refused by the ledger for an Allocate PodResources had not listed yet (grace period).
    prepare_refused_unlisted: u64,
    /// Refused by the ledger for another holder.
    prepare_refused_other: u64,
    prepare_failed: u64,
    first_refusal: Option<String>,
    first_allocate_refusal: Option<String>,
    first_failure: Option<String>,
    unprepared: u64,
    xids: u64,
    restarts: u64,
    scrapes: u64,
}

impl Counts {
    /// A prepare the ledger refused (`held by ...`), by the holder it names.
    fn refused(&mut self, e: String) {
        if e.contains("held by container soak/") {
            self.prepare_refused_ended += 1;
        } else if e.contains("held by a device plugin allocation") {
            self.prepare_refused_unlisted += 1;
        } else {
            self.prepare_refused_other += 1;
        }
        if self.first_refusal.is_none() {
            self.first_refusal = Some(e);
        }
    }
}

/// One pod slot of the soak (see the module docs). `lists` is the kubelet double's
/// PodResources List count read right after the slot's last change.
enum Slot {
    Free,
    Running {
        pod: String,
        gpu: String,
        lists: u64,
    },
    Ended {
        gpu: String,
        lists: u64,
    },
}

impl Slot {
    fn gpu(&self) -> Option<&str> {
        match self {
            Slot::Free => None,
            Slot::Running { gpu, .. } | Slot::Ended { gpu, .. } => Some(gpu),
        }
    }
}

fn append(control: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(control)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

fn median(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

/// Least-squares slope of RSS over time, in KiB per minute.
fn slope_per_minute(points: &[(f64, u64)]) -> f64 {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1 as f64).sum::<f64>() / n;
    let num: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 as f64 - my)).sum();
    let den: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if den == 0.0 {
        0.0
    } else {
        num / den * 60.0
    }
}

async fn soak(seconds: u64) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let lib = root.join("libnvidia-ml.so.1");
    std::fs::copy(support::built_fake(), &lib).unwrap();
    let control = root.join("control");
    std::fs::write(&control, "").unwrap();
    let api = ApiServerDouble::start().await.unwrap();
    let mut kubelet = KubeletDouble::start(&root.join("kubelet")).await.unwrap();
    let mut dra = KubeletDraDouble::start(&root.join("kubelet"), KubeletDraOptions::default());
    support::lay_out_node(root, 8, &api.url());
    let agent = AgentProcess::spawn(
        root,
        CONFIG,
        &["--nvml-lib", lib.to_str().unwrap()],
        &[
            ("GPUPLANE_FAKE_NVML_PROFILE", "dgx-h100".as_ref()),
            ("GPUPLANE_FAKE_NVML_CONTROL", control.as_os_str()),
            ("RUST_LOG", "warn".as_ref()),
        ],
        "soak",
    );
    let start = Instant::now();
    let samples: Samples = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (samples, stop, pid) = (samples.clone(), stop.clone(), agent.pid());
        std::thread::spawn(move || sample_rss(pid, start, samples, stop))
    };
    dra.wait_registered(DRIVER, WAIT).await.unwrap();
    kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    dra.watch_health(DRIVER).unwrap();
    let serving = start.elapsed().as_secs_f64();
    let uuids: Vec<String> = gpuplane_model::sim::load("dgx-h100")
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.uuid.to_string())
        .collect();

    let mut w = Workload {
        api: &api,
        kubelet: &mut kubelet,
        dra: &mut dra,
        control: &control,
        uuids,
        slots: (0..POD_SLOTS).map(|_| Slot::Free).collect(),
        n: Counts::default(),
    };
    let until = start + Duration::from_secs(seconds);
    while Instant::now() < until {
        w.cycle(&agent).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n = w.n;
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let mut agent = agent;
    assert!(agent.running(), "the agent died:\n{}", agent.log_text());
    report(seconds, serving, &n, &samples.lock().unwrap());
    agent.kill();
}

/// The soak's workload against the running agent: the doubles it drives and what it counted.
struct Workload<'a> {
    api: &'a ApiServerDouble,
    kubelet: &'a mut KubeletDouble,
    dra: &'a mut KubeletDraDouble,
    /// The fake NVML's control file (Xid injection).
    control: &'a Path,
    /// The GPUs' UUIDs, by index.
    uuids: Vec<String>,
    slots: Vec<Slot>,
    n: Counts,
}

impl Workload<'_> {
    /// One cycle (see the module docs).
    async fn cycle(&mut self, agent: &AgentProcess) {
        let i = self.n.cycles;
        self.n.cycles += 1;
        let claim = self.prepare_claim(i).await;
        self.advance_slots();
        self.admit_pod(i).await;
        if let Some(c) = claim {
            if self
                .dra
                .unprepare(DRIVER, std::slice::from_ref(&c))
                .await
                .is_ok_and(|a| a.values().all(Result::is_ok))
            {
                self.n.unprepared += 1;
            }
        }
        if i % 10 == 9 {
            append(self.control, &format!("xid {} 48", (i / 10) % 8));
            self.n.xids += 1;
        }
        if i % 5 == 4 && agent.get("/metrics").is_some() {
            self.n.scrapes += 1;
        }
        if i % 50 == 49 {
            self.restart_kubelet().await;
        }
    }

    /// A claim prepared on the next GPU in turn that the ledger gives it, if any does. GPUs
    /// ListAndWatch shows unhealthy (an Xid not yet recovered) are not tried, nor those of the
    /// soak's pods until the agent has seen them gone.
    async fn prepare_claim(&mut self, i: u64) -> Option<ClaimRef> {
        let healthy: Vec<String> = self
            .kubelet
            .plugin(GPU)
            .map(|v| {
                v.devices
                    .iter()
                    .filter(|d| d.health == "Healthy")
                    .map(|d| d.id.clone())
                    .collect()
            })
            .unwrap_or_default();
        for k in 0..8 {
            let g = (i + k) % 8;
            let uuid = &self.uuids[g as usize];
            if !healthy.contains(uuid) || self.slots.iter().any(|s| s.gpu() == Some(uuid.as_str()))
            {
                continue;
            }
            let c = support::put_claim(self.api, &format!("claim-{i}-{k}"), &[&format!("gpu-{g}")]);
            let answer = self.dra.prepare(DRIVER, std::slice::from_ref(&c)).await;
            self.api.delete_json(
                "resource.k8s.io/v1",
                "resourceclaims",
                Some("team-a"),
                &c.name,
            );
            match answer.ok().and_then(|mut a| a.remove(c.uid.as_str())) {
                Some(Ok(_)) => {
                    self.n.prepared += 1;
                    return Some(c);
                }
                Some(Err(e)) if e.contains("held by") => self.n.refused(e),
                other => {
                    self.n.prepare_failed += 1;
                    if self.n.first_failure.is_none() {
                        self.n.first_failure = Some(format!("{other:?}"));
                    }
                }
            }
        }
        None
    }

    /// Pods: each slot moves on once the agent has listed PodResources since its change.
    fn advance_slots(&mut self) {
        let lists = self.kubelet.pod_resources_lists();
        for slot in self.slots.iter_mut() {
            match slot {
                Slot::Running {
                    pod,
                    gpu,
                    lists: at,
                } if lists >= *at + 2 => {
                    self.kubelet.end_pod("soak", pod);
                    *slot = Slot::Ended {
                        gpu: std::mem::take(gpu),
                        lists: self.kubelet.pod_resources_lists(),
                    };
                }
                Slot::Ended { lists: at, .. } if lists >= *at + 2 => *slot = Slot::Free,
                _ => {}
            }
        }
    }

    /// A pod through the device plugin API in a free slot; the claimed GPU is withdrawn from
    /// it.
    async fn admit_pod(&mut self, i: u64) {
        let Some(slot) = self.slots.iter_mut().find(|s| matches!(s, Slot::Free)) else {
            return;
        };
        let pod = format!("pod-{i}");
        match self.kubelet.admit("soak", &pod, "main", GPU, 1).await {
            Ok((mut ids, _)) if !ids.is_empty() => {
                self.n.allocated += 1;
                *slot = Slot::Running {
                    pod,
                    gpu: ids.remove(0),
                    lists: self.kubelet.pod_resources_lists(),
                };
            }
            Ok(_) => self.n.allocate_refused += 1,
            Err(e) => {
                self.n.allocate_refused += 1;
                if self.n.first_allocate_refusal.is_none() {
                    self.n.first_allocate_refusal = Some(e.message().to_string());
                }
            }
        }
    }

    /// Both kubelet doubles restart (sockets re-created, re-registration).
    async fn restart_kubelet(&mut self) {
        self.kubelet.restart().await.unwrap();
        self.dra.restart().await;
        self.dra.wait_registered(DRIVER, WAIT).await.unwrap();
        self.kubelet
            .wait_for(WAIT, |p| p.contains_key(GPU))
            .await
            .unwrap();
        self.dra.watch_health(DRIVER).unwrap();
        self.n.restarts += 1;
    }
}

fn report(seconds: u64, serving: f64, n: &Counts, samples: &[(f64, u64)]) {
    let warmup = (seconds as f64 / 4.0).max(10.0);
    let (warm, steady): (Vec<Sample>, Vec<Sample>) = samples.iter().partition(|s| s.0 < warmup);
    println!(
        "gpuplane soak: {seconds} s against the agent binary (release), {} logical CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "workload: {} cycles; {} Allocates ({} refused), {} prepares (refused by the ledger: {} on a GPU whose pod had ended and been seen gone, {} by an Allocate PodResources had not listed yet, {} other; {} failed), {} unprepares, {} Xids, {} kubelet restarts (both APIs), {} /metrics scrapes",
        n.cycles, n.allocated, n.allocate_refused, n.prepared, n.prepare_refused_ended, n.prepare_refused_unlisted, n.prepare_refused_other, n.prepare_failed, n.unprepared, n.xids, n.restarts, n.scrapes
    );
    if let Some(r) = &n.first_refusal {
        println!("first refused prepare: {r}");
    }
    if let Some(r) = &n.first_allocate_refusal {
        println!("first refused Allocate: {r}");
    }
    if let Some(f) = &n.first_failure {
        println!("first failed prepare: {f}");
    }
    let Some(first) = samples.iter().find(|s| s.0 >= serving) else {
        println!("no RSS samples");
        return;
    };
    println!(
        "RSS once serving (first sample after registration, {:.1} s): {} KiB",
        first.0, first.1
    );
    if warm.len() < 5 || steady.len() < 5 {
        println!("too few samples for warm-up and steady state");
        return;
    }
    let warm_end: Vec<u64> = warm.iter().rev().take(5).map(|s| s.1).collect();
    let steady_kib: Vec<u64> = steady.iter().map(|s| s.1).collect();
    let head: Vec<u64> = steady_kib.iter().take(5).copied().collect();
    let tail: Vec<u64> = steady_kib.iter().rev().take(5).copied().collect();
    println!(
        "warm-up (first {warmup:.0} s): RSS at its end (median of last 5 samples) {} KiB",
        median(&warm_end)
    );
    println!(
        "steady state ({} samples, {:.0}-{:.0} s): min {} KiB, median {} KiB, max {} KiB",
        steady.len(),
        steady[0].0,
        steady[steady.len() - 1].0,
        steady_kib.iter().min().unwrap(),
        median(&steady_kib),
        steady_kib.iter().max().unwrap()
    );
    println!(
        "steady-state growth: slope {:+.1} KiB/min; last 5 vs first 5 samples (medians) {:+} KiB",
        slope_per_minute(&steady),
        median(&tail) as i64 - median(&head) as i64
    );
}

fn main() {
    let seconds = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(soak(seconds));
}
