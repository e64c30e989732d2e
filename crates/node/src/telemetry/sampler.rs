//! Asks every device for its readings, one thread per GPU, off every serving path.
//!
//! NVML stalls on a GPU that fell off the bus, so each GPU (with its MIG devices) has a thread
//! of its own: a stalled GPU holds up only its own readings. The threads never touch the state
//! lock for longer than a copy of their device list, and nothing the kubelet calls waits on
//! them. A device whose query has been running longer than an interval is reported as not
//! answering ([`Samples::latest`]) while the call is still stuck, so a hung device is never
//! silently missing. The threads are not joined at shutdown: a hung driver call must not keep
//! the process from exiting.

use super::lock;
use crate::inventory::DeviceUuid;
use crate::source::DeviceSource;
use crate::state::NodeState;
use crate::telemetry::attribute::DeviceLabels;
use crate::telemetry::cgroup::{self, ContainerRef};
use crate::telemetry::{Readings, Sample};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A device's latest answer, when it came, and the containers of its processes.
#[derive(Debug, Clone)]
struct Stored {
    labels: DeviceLabels,
    sample: Sample,
    containers: BTreeMap<u32, ContainerRef>,
}

#[derive(Debug, Default)]
struct Book {
    latest: BTreeMap<DeviceUuid, Stored>,
    /// Per device being asked now: since when.
    asking: BTreeMap<DeviceUuid, (Instant, DeviceLabels)>,
    /// Devices whose failure has been logged (logged again only after they answer).
    failing: BTreeSet<DeviceUuid>,
}

/// What a scrape reads: the devices (with their labels), their samples, and each PID's
/// container.
#[derive(Debug, Clone, Default)]
pub struct Latest {
    pub devices: Vec<(DeviceUuid, DeviceLabels)>,
    pub samples: BTreeMap<DeviceUuid, Sample>,
    pub containers: BTreeMap<u32, ContainerRef>,
}

/// The samples the threads keep, read at every scrape.
#[derive(Debug)]
pub struct Samples {
    book: Mutex<Book>,
    interval: Duration,
    stop: AtomicBool,
    /// Wakes sleeping threads at shutdown (with the mutex it waits on).
    wake: Condvar,
    sleeping: Mutex<()>,
}

impl Samples {
    /// Every device's latest sample, a device stuck in a query longer than an interval as
    /// failed; and the container of each PID seen on any device.
    pub fn latest(&self) -> Latest {
        let book = lock(&self.book);
        let mut out = Latest::default();
        for (uuid, stored) in &book.latest {
            out.containers
                .extend(stored.containers.iter().map(|(p, c)| (*p, c.clone())));
            out.devices.push((uuid.clone(), stored.labels.clone()));
            out.samples.insert(uuid.clone(), stored.sample.clone());
        }
        // A device stuck in a query longer than an interval is down, asked before or not.
        for (uuid, (since, labels)) in &book.asking {
            if since.elapsed() <= self.interval {
                continue;
            }
            let why = format!(
                "no answer for {:.1} s (the driver call is still running)",
                since.elapsed().as_secs_f64()
            );
            if !book.latest.contains_key(uuid) {
                out.devices.push((uuid.clone(), labels.clone()));
            }
            out.samples.insert(uuid.clone(), Sample::Failed(why));
        }
        out
    }

    /// Ends the threads at their next wake-up (a thread stuck in the driver ends after it).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    fn record(
        &self,
        (uuid, labels): &(DeviceUuid, DeviceLabels),
        sample: Sample,
        containers: BTreeMap<u32, ContainerRef>,
    ) {
        let mut book = lock(&self.book);
        book.asking.remove(uuid);
        match &sample {
            Sample::Failed(why) => {
                if book.failing.insert(uuid.clone()) {
                    tracing::warn!(device = %uuid, error = %why, "device telemetry: the device does not answer; reported as down");
                }
            }
            Sample::Answered(_) => {
                if book.failing.remove(uuid) {
                    tracing::info!(device = %uuid, "device telemetry: the device answers again");
                }
            }
        }
        let labels = labels.clone();
        let stored = Stored {
            labels,
            sample,
            containers,
        };
        book.latest.insert(uuid.clone(), stored);
    }

    /// Forgets devices that are gone for good (a destroyed MIG instance).
    fn forget(&self, gone: &[&DeviceUuid]) {
        let mut book = lock(&self.book);
        for uuid in gone {
            book.latest.remove(*uuid);
            book.failing.remove(*uuid);
        }
    }

    /// Sleeps one interval, or less if stopped; false once stopped.
    fn pause(&self) -> bool {
        let guard = lock(&self.sleeping);
        let (_guard, _) = self
            .wake
            .wait_timeout_while(guard, self.interval, |_| !self.stop.load(Ordering::SeqCst))
            .unwrap_or_else(|p| p.into_inner());
        !self.stop.load(Ordering::SeqCst)
    }
}

/// Starts the sampling: one thread per GPU, every `interval`, for the GPUs the node has now
/// and, checked every interval, those that join it later (a GPU lost at start that answers
/// again, a rediscovery); `host_proc` is the host's /proc (read-only), where each process's
/// cgroup names its container.
pub fn start(
    source: Arc<dyn DeviceSource>,
    state: Arc<NodeState>,
    interval: Duration,
    host_proc: Option<PathBuf>,
) -> std::io::Result<Arc<Samples>> {
    let samples = Arc::new(Samples {
        book: Mutex::new(Book::default()),
        interval,
        stop: AtomicBool::new(false),
        wake: Condvar::new(),
        sleeping: Mutex::new(()),
    });
    let sampler = Sampler {
        source,
        state,
        samples: samples.clone(),
        host_proc,
    };
    let mut started = BTreeSet::new();
    sampler.start_new(&mut started)?;
    std::thread::Builder::new()
        .name("gpuplane-sample-gpus".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            while sampler.samples.pause() {
                if let Err(e) = sampler.start_new(&mut started) {
                    tracing::warn!(error = %e, "device telemetry: cannot start a sampling thread; trying again next interval");
                }
            }
        })?;
    Ok(samples)
}

/// What each GPU's sampling thread works with.
#[derive(Clone)]
struct Sampler {
    source: Arc<dyn DeviceSource>,
    state: Arc<NodeState>,
    samples: Arc<Samples>,
    host_proc: Option<PathBuf>,
}

impl Sampler {
    /// Starts a thread for each GPU in the inventory without one (`started`).
    fn start_new(&self, started: &mut BTreeSet<DeviceUuid>) -> std::io::Result<()> {
        let gpus: Vec<DeviceUuid> = self
            .state
            .read()
            .inventory
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .filter(|u| !started.contains(u))
            .collect();
        for gpu in gpus {
            let me = self.clone();
            let name = gpu.clone();
            std::thread::Builder::new()
                .name("gpuplane-sample".into())
                .stack_size(256 * 1024)
                .spawn(move || me.run(&name))?;
            started.insert(gpu);
        }
        Ok(())
    }

    /// Samples GPU `gpu` and its MIG devices every interval until stopped.
    fn run(&self, gpu: &DeviceUuid) {
        let mut devices = Vec::new();
        loop {
            // A GPU missing from the inventory (lost) keeps its last device list: each is
            // asked, fails, and is reported down rather than dropped.
            if let Some(now) = devices_of(&self.state, gpu) {
                let gone: Vec<&DeviceUuid> = devices
                    .iter()
                    .map(|(u, _)| u)
                    .filter(|u| !now.iter().any(|(n, _)| n == *u))
                    .collect();
                self.samples.forget(&gone);
                devices = now;
            }
            for device in &devices {
                let asked = (Instant::now(), device.1.clone());
                lock(&self.samples.book)
                    .asking
                    .insert(device.0.clone(), asked);
                let (sample, containers) = match self.source.sample(&device.0) {
                    Ok(r) => {
                        let containers = containers_of(&r, self.host_proc.as_deref());
                        (Sample::Answered(r), containers)
                    }
                    Err(e) => (Sample::Failed(e.to_string()), BTreeMap::new()),
                };
                self.samples.record(device, sample, containers);
            }
            if !self.samples.pause() {
                return;
            }
        }
    }
}

/// GPU `gpu` and its MIG devices as the node has them now, labelled; `None` while the GPU is
/// not in the inventory.
fn devices_of(state: &NodeState, gpu: &DeviceUuid) -> Option<Vec<(DeviceUuid, DeviceLabels)>> {
    let snap = state.read();
    let g = snap.inventory.gpus.iter().find(|g| g.uuid == *gpu)?;
    let label = |uuid: &DeviceUuid, mig_profile: String| {
        // A MIG device is its quota share of the GPU (busy time in whole GPUs).
        let share = gpuplane_model::quota::catalog::mig_share(&mig_profile, Some(&g.product_name));
        let labels = DeviceLabels {
            uuid: uuid.to_string(),
            gpu: g.index.to_string(),
            gpu_share: share.map_or((1, 1), |s| (s.numer(), s.denom())),
            mig_profile,
        };
        (uuid.clone(), labels)
    };
    let migs = g
        .mig_devices
        .iter()
        .map(|m| label(&m.uuid, m.profile.to_string()));
    Some(
        std::iter::once(label(&g.uuid, String::new()))
            .chain(migs)
            .collect(),
    )
}

/// The container of each process in `r`, from `<host_proc>/<pid>/cgroup`. A process that has
/// ended or runs outside any pod has none.
fn containers_of(r: &Readings, host_proc: Option<&Path>) -> BTreeMap<u32, ContainerRef> {
    let Some(proc_root) = host_proc else {
        return BTreeMap::new();
    };
    r.processes
        .iter()
        .filter_map(|p| {
            let text =
                std::fs::read_to_string(proc_root.join(p.pid.to_string()).join("cgroup")).ok()?;
            Some((p.pid, cgroup::container_of(&text)?))
        })
        .collect()
}
