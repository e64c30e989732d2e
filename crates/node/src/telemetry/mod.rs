//! Device telemetry on the node: every device sampled through the device source on threads of
//! its own ([`sampler`]), this node's pods followed so a process's cgroup names its container
//! ([`pods`]), and at each scrape the samples charged to the ledger's holders and exported
//! ([`export`]) through the pure `gpuplane_model::telemetry::attribute`; every interval the
//! holds' use feeds the busy counters and the idle watch ([`rounds`]).
//!
//! Nothing here is on a serving path: Allocate, NodePrepare and ListAndWatch never wait on a
//! sample, and a scrape only copies what the threads last stored.

pub mod export;
pub mod idle_events;
pub mod pods;
pub mod rounds;
pub mod sampler;

pub use gpuplane_model::telemetry::*;

use crate::ledger::Holder;
use crate::source::DeviceSource;
use crate::state::{NodeState, Snapshot};
use attribute::{Attributed, Hold};
use pods::PodDirectory;
use sampler::Samples;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `--telemetry-interval` and `--host-proc`.
#[derive(Debug, Clone)]
pub struct TelemetryOptions {
    /// How often every device is asked.
    pub interval: Duration,
    /// The host's /proc, mounted read-only: each GPU process's cgroup names its pod and
    /// container. `None`: processes are counted but not attributed.
    pub host_proc: Option<PathBuf>,
    /// Report holds that stay idle; `None`: off.
    pub idle: Option<idle::IdlePolicy>,
}

/// The running telemetry: the samplers' store and the pod directory.
#[derive(Debug)]
pub struct Telemetry {
    samples: Arc<Samples>,
    pods: Arc<PodDirectory>,
    /// How long each hold has been idle, as the idle watch last found (seconds).
    idle: Mutex<Vec<(attribute::DeviceLabels, Hold, f64)>>,
    /// Each hold's busy seconds, as the last round left them.
    busy: Mutex<Vec<(attribute::DeviceLabels, Hold, f64)>>,
}

impl Telemetry {
    /// Starts the sampling threads for the GPUs `state` has now.
    pub fn start(
        source: Arc<dyn DeviceSource>,
        state: Arc<NodeState>,
        opts: &TelemetryOptions,
    ) -> std::io::Result<Telemetry> {
        let samples = sampler::start(source, state, opts.interval, opts.host_proc.clone())?;
        Ok(Telemetry {
            samples,
            pods: Arc::new(PodDirectory::default()),
            idle: Mutex::new(Vec::new()),
            busy: Mutex::new(Vec::new()),
        })
    }

    /// The directory [`pods::follow`] keeps.
    pub fn pods(&self) -> Arc<PodDirectory> {
        self.pods.clone()
    }

    /// Ends the sampling threads.
    pub fn stop(&self) {
        self.samples.stop();
    }

    fn set_idle(&self, idle: Vec<(attribute::DeviceLabels, Hold, f64)>) {
        *lock(&self.idle) = idle;
    }

    fn set_busy(&self, busy: Vec<(attribute::DeviceLabels, Hold, f64)>) {
        *lock(&self.busy) = busy;
    }

    /// Each hold's busy seconds so far.
    pub fn busy(&self) -> Vec<(attribute::DeviceLabels, Hold, f64)> {
        lock(&self.busy).clone()
    }

    /// How long each hold has been idle (empty while idle holds are not followed).
    pub fn idle(&self) -> Vec<(attribute::DeviceLabels, Hold, f64)> {
        lock(&self.idle).clone()
    }

    /// What a scrape exports now.
    pub fn attributed(&self, state: &NodeState) -> Attributed {
        let latest = self.samples.latest();
        let holds = holds(&state.read(), &self.pods);
        let containers = latest
            .containers
            .iter()
            .filter_map(|(pid, c)| Some((*pid, self.pods.workload(c)?)))
            .collect();
        attribute::attribute(&latest.devices, &latest.samples, &holds, &containers)
    }
}

/// Locks a mutex, recovering the data if a panicking holder poisoned it: every value guarded in
/// this module is replaced whole, so it stays consistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every unit's holders in the ledger, as exported.
fn holds(
    snap: &Snapshot,
    pods: &PodDirectory,
) -> BTreeMap<crate::inventory::DeviceUuid, Vec<Hold>> {
    let mut out: BTreeMap<_, Vec<Hold>> = BTreeMap::new();
    for (unit, holder) in snap.ledger.holds() {
        out.entry(unit.clone())
            .or_default()
            .extend(holds_of(holder, "", pods));
    }
    for (unit, shares) in snap.ledger.shares() {
        for s in shares {
            out.entry(unit.clone())
                .or_default()
                .extend(holds_of(&s.holder, &s.share_id, pods));
        }
    }
    out
}

/// A ledger holder as exported holds: a device-plugin unit listed for several containers
/// (time-sliced replicas) is one hold per container.
fn holds_of(holder: &Holder, share: &str, pods: &PodDirectory) -> Vec<Hold> {
    match holder {
        Holder::DevicePlugin { pod: Some(who), .. } => who
            .split(", ")
            .map(|one| {
                let mut parts = one.splitn(3, '/');
                Hold {
                    api: "device-plugin".into(),
                    namespace: parts.next().unwrap_or_default().into(),
                    pod: parts.next().unwrap_or_default().into(),
                    container: parts.next().unwrap_or_default().into(),
                    ..Hold::default()
                }
            })
            .collect(),
        // Allocated, not yet listed by PodResources: held, by a container not known yet.
        Holder::DevicePlugin { pod: None, .. } => vec![Hold {
            api: "device-plugin".into(),
            ..Hold::default()
        }],
        Holder::Claim { name, .. } => {
            let (namespace, claim) = name.split_once('/').unwrap_or(("", name));
            vec![Hold {
                api: "dra".into(),
                namespace: namespace.into(),
                pod: pods.pod_of_claim(namespace, claim).unwrap_or_default(),
                claim: claim.into(),
                share: share.into(),
                ..Hold::default()
            }]
        }
    }
}
