//! The GPU quota controller's loops (cluster side, `gpuplane controller`): releases queued GPU
//! pods by removing their admission scheduling gate when their GpuQuotas have room, keeps
//! GpuQuota usage and reservations current, and runs only on the replica holding the Lease
//! (the webhook, `crate::webhook`, is served by every replica).
//!
//! - `plan`, `ledger`, `namespace`, `pods`, `queue_label`, `lease`, `hours`: the pure decisions
//!   (`gpuplane_model::controller`, re-exported here).
//! - [`cache`] (pure): watch-fed stores.
//! - [`queue`]: the loop (watchers, reconcile, error policy); [`writes`]: pod writes.
//! - [`explainer`]: why each Pending GPU pod waits, kept on the pod as a condition, an Event
//!   per change of reason, and metrics by reason; [`kueue`]: Kueue's Workloads and
//!   LocalQueues, which it reads where Kueue runs (`--kueue`).
//! - [`labeler`]: the namespace label `quota.gpuplane.dev/queue`
//!   on namespaces with a Queue-mode GpuQuota, which the mutating gate webhook selects on.
//! - [`meter`]: the GPU-hours ledger's shell (the book in a ConfigMap, flushed by the quota
//!   loop; its accounting is the model's `hours`).
//! - [`schedule`]: the driver both loops share (batched inputs, deadlines, resync).
//!
//! Beside it: [`crate::elector`] (leader election over a coordination.k8s.io/v1 Lease, its rules
//! the model's `lease`), [`crate::controller_metrics`] (the loops' metrics, per GpuQuota, and the
//! ledger's counters). [`run`] runs the loops; [`crate::replica::run`] is the command's entry
//! point.

pub mod cache;
pub mod explainer;
pub mod kueue;
pub mod labeler;
pub mod meter;
pub mod prometheus;
pub mod queue;
pub mod schedule;
mod watchers;
pub mod writes;

pub use gpuplane_model::controller::*;

use crate::controller_metrics::QueueMetrics;
use crate::elector::Role;
use crate::published::Devices;
use explainer::ExplainerOptions;
use labeler::LabelerOptions;
use lease::LeaseTimings;
use queue::QueueOptions;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::watch;

/// The Lease the replicas compete for.
pub const LEASE_NAME: &str = "gpuplane-controller";

/// Everything the loops need besides a client.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// The controller's own namespace: where the Lease lives.
    pub namespace: String,
    /// Run the loops only while holding the Lease (false: always, for a single replica).
    pub leader_elect: bool,
    /// This replica's name in the Lease and on Events.
    pub identity: String,
    pub lease: LeaseTimings,
    pub queue: QueueOptions,
    pub labels: LabelerOptions,
}

impl ControllerOptions {
    pub fn new(namespace: &str, identity: &str) -> ControllerOptions {
        let queue = QueueOptions {
            instance: identity.into(),
            hours: Some(meter::HoursOptions {
                namespace: namespace.into(),
                ..meter::HoursOptions::default()
            }),
            ..QueueOptions::default()
        };
        ControllerOptions {
            namespace: namespace.into(),
            leader_elect: true,
            identity: identity.into(),
            lease: LeaseTimings::default(),
            queue,
            labels: LabelerOptions::default(),
        }
    }
}

/// Runs the loops until `shutdown`: under leader election (only while leading; the Lease is
/// released after the loops stopped) or, with `leader_elect` false, at once.
pub async fn run(
    client: kube::Client,
    opts: ControllerOptions,
    metrics: Arc<QueueMetrics>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), crate::elector::ElectionError> {
    let (role, _) = watch::channel(Role::Follower(None));
    run_reporting(client, opts, metrics, role, None, shutdown).await
}

/// [`run`], publishing this replica's part on `role` (always leader without election), reading
/// `devices` (the webhook's, in a replica) or, without, watching them itself.
pub async fn run_reporting(
    client: kube::Client,
    opts: ControllerOptions,
    metrics: Arc<QueueMetrics>,
    role: watch::Sender<Role>,
    devices: Option<Arc<Devices>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), crate::elector::ElectionError> {
    let devices =
        devices.unwrap_or_else(|| Devices::start(&client, opts.queue.catalog.clone(), |_, _| {}));
    if !opts.leader_elect {
        role.send_replace(Role::Leader);
        let (queue, labels) = (opts.queue, opts.labels);
        loops(client, queue, labels, devices, metrics, shutdown).await;
        role.send_replace(Role::Follower(None));
        return Ok(());
    }
    let candidate = crate::elector::Elector::new(
        client.clone(),
        &opts.namespace,
        LEASE_NAME,
        &opts.identity,
        opts.lease,
    )?
    .reporting(role);
    crate::elector::lead(candidate, shutdown, |stop| {
        loops(
            client.clone(),
            opts.queue.clone(),
            opts.labels.clone(),
            devices.clone(),
            metrics.clone(),
            stop,
        )
    })
    .await;
    Ok(())
}

/// The leader's loops side by side (the queue, the labeler, the explainer), all stopped by
/// `stop`; the queue and the explainer read the one `devices`.
async fn loops(
    client: kube::Client,
    queue: QueueOptions,
    labels: LabelerOptions,
    devices: Arc<Devices>,
    metrics: Arc<QueueMetrics>,
    stop: impl Future<Output = ()>,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let relay = async {
        stop.await;
        stop_tx.send_replace(true);
    };
    let explain = ExplainerOptions {
        kueue: queue.settings.kueue,
        ..ExplainerOptions::new(&queue.instance)
    };
    let both = async {
        tokio::join!(
            queue::run(
                client.clone(),
                queue,
                devices.clone(),
                metrics.clone(),
                stopped(stop_rx.clone())
            ),
            labeler::run(client.clone(), labels, stopped(stop_rx.clone())),
            // Boxed: its six reflectors make a large future.
            Box::pin(explainer::run(
                client,
                explain,
                devices,
                metrics,
                stopped(stop_rx)
            )),
        )
    };
    // The loops end only when stopped (or when their watchers' channels close).
    tokio::pin!(both);
    tokio::select! {
        _ = relay => {
            both.await;
        }
        _ = &mut both => {}
    };
}
