//! Follows the kubelet's PodResources API to learn which device-plugin devices are still
//! assigned to live containers: the device plugin API never reports releases, so this is how
//! the allocation ledger frees units when pods end, and how it is rebuilt after a restart. It
//! runs with the device plugin off too: pods another device plugin placed keep their GPUs.

use crate::deviceplugin::allocate;
use crate::deviceplugin::resources::Plan;
use crate::grpc;
use crate::inventory::{DeviceId, DeviceUuid, ResourceName};
use crate::ledger::Holder;
use crate::metrics::{self, ApiLabel};
use crate::proto::podresources_v1 as pr;
use crate::state::NodeState;
use gpuplane_model::report::chain;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often PodResources is listed. A unit PodResources has listed is released at the first
/// listing without it, so this (plus one List) bounds how long a device stays held after its
/// container ends: keep it at most 1 s.
pub const POLL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error(transparent)]
    Socket(#[from] grpc::SocketError),
    #[error("PodResources List failed: {}", chain(.0))]
    List(tonic::Status),
}

/// Units the kubelet reports assigned: unit -> (holder, `namespace/pod/container`). A unit
/// listed more than once (time-sliced replicas in several containers) gets a holder naming all
/// its listed device IDs and all its containers, so the ledger can match each one to its
/// Allocate.
pub fn units_in_use(
    list: &pr::ListPodResourcesResponse,
    plan: &Plan,
) -> BTreeMap<DeviceUuid, (Holder, String)> {
    type Listed = (ResourceName, BTreeSet<DeviceId>, BTreeSet<String>);
    let mut ids: BTreeMap<DeviceUuid, Listed> = BTreeMap::new();
    for pod in &list.pod_resources {
        for c in &pod.containers {
            let who = format!("{}/{}/{}", pod.namespace, pod.name, c.name);
            for d in &c.devices {
                let Some(resource) = plan.resource(&d.resource_name) else {
                    continue;
                };
                for id in &d.device_ids {
                    if let Some(dev) = resource.devices.iter().find(|x| &x.id == id) {
                        let e = ids.entry(dev.unit.clone()).or_insert_with(|| {
                            (resource.name.clone(), BTreeSet::new(), BTreeSet::new())
                        });
                        e.1.insert(dev.id.clone());
                        e.2.insert(who.clone());
                    }
                }
            }
        }
    }
    ids.into_iter()
        .map(|(unit, (resource, ids, pods))| {
            let ids: Vec<DeviceId> = ids.into_iter().collect();
            let pods: Vec<String> = pods.into_iter().collect();
            (unit, (allocate::holder(&resource, &ids), pods.join(", ")))
        })
        .collect()
}

async fn list(socket: &Path) -> Result<pr::ListPodResourcesResponse, PodResourcesError> {
    let channel = grpc::connect(socket).await?;
    let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(channel);
    Ok(client
        .list(pr::ListPodResourcesRequest {})
        .await
        .map_err(PodResourcesError::List)?
        .into_inner())
}

/// How many pods the kubelet's PodResources v1 `List` names, for `gpuplane doctor`.
pub async fn pods_listed(socket: &Path) -> Result<usize, String> {
    const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
    match tokio::time::timeout(TIMEOUT, list(socket)).await {
        Ok(Ok(answer)) => Ok(answer.pod_resources.len()),
        Ok(Err(e)) => Err(chain(&e).to_string()),
        Err(_) => Err(format!("no answer within {TIMEOUT:?}")),
    }
}

/// What a failing first listing holds up, for its log line.
fn unknown_note(state: &NodeState) -> &'static str {
    if state.read().awaiting_device_plugin_holds {
        " (until then this node's ResourceSlices are not written and no claim is prepared: \
         check that the kubelet's pod-resources directory is mounted)"
    } else {
        ""
    }
}

/// Reconciles the ledger's device-plugin holds with PodResources until shutdown. The first
/// answer clears [`crate::state::Snapshot::awaiting_device_plugin_holds`].
pub async fn run(socket: PathBuf, state: Arc<NodeState>, mut shutdown: watch::Receiver<bool>) {
    let mut failing = false;
    loop {
        // Taken before the List is sent: an Allocate after it cannot be in its answer.
        let listed_at = Instant::now();
        match tokio::time::timeout(Duration::from_secs(5), list(&socket)).await {
            Ok(Ok(resp)) => {
                failing = false;
                state.update_holds(|s| {
                    let in_use = units_in_use(&resp, &s.plan);
                    let grace = s.config.pod_resources_grace;
                    let (added, released, conflicts) = s.ledger.sync_device_plugin(&in_use, listed_at, grace);
                    for u in &added {
                        tracing::info!(device = %u, holder = %in_use[u].1, "device plugin hold learned from PodResources");
                    }
                    for u in &released {
                        metrics::node().ledger_releases.get_or_create(&ApiLabel::DEVICE_PLUGIN).inc();
                        tracing::info!(device = %u, holder = "device plugin", "released: PodResources lists no container holding it");
                    }
                    for c in &conflicts {
                        tracing::error!(error = %c, "PodResources lists a device another consumer holds");
                    }
                    let first = std::mem::take(&mut s.awaiting_device_plugin_holds);
                    if first {
                        tracing::info!(held = in_use.len(), "device plugin holds known from the kubelet's PodResources");
                    }
                    ((), first || !added.is_empty() || !released.is_empty())
                });
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(socket = %socket.display(), error = %e, "cannot read PodResources; device-plugin holds are kept until it answers{}", unknown_note(&state));
                }
                failing = true;
            }
            Err(_) => {
                if !failing {
                    tracing::warn!(socket = %socket.display(), "PodResources did not answer in 5s; device-plugin holds are kept{}", unknown_note(&state));
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
    }
}
