//! The demo's thirteen steps. Each makes real calls (gRPC to the agent through the kubelet doubles,
//! HTTPS AdmissionReviews to the webhook, the kube client to the API server double), narrates
//! what came back, and judges the step from those answers only. A step the machine cannot show
//! (too few GPUs, no NVLink) is skipped with the reason.
//!
//! One file per step (the quota steps share `quota::review`); this module
//! holds what they share: the context, what a step leaves for later ones, and the polling and
//! reading helpers.

mod allocation;
mod claim;
mod dynamic_mig;
mod health;
pub(super) mod hours;
mod inventory;
mod one_ledger;
mod pending;
mod pod_group;
mod preemption;
mod quota;
mod share;
mod telemetry;

use super::facts::{self, PublishedDevice};
use super::summary::{Outcome, Step};
use super::tls::DemoPki;
use super::Narrator;
use crate::doubles::lab::NodeLab;
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_model::inventory::Inventory;
use gpuplane_node::dra::ClaimRef;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};
use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a step waits for something to happen before it says it did not.
const WAIT: Duration = Duration::from_secs(15);
/// The namespace of the node-level steps' pods and claims.
const NODE_NAMESPACE: &str = "demo";

/// What the steps talk to.
pub struct Context<'a> {
    pub lab: &'a NodeLab,
    pub inventory: &'a Inventory,
    pub client: kube::Client,
    /// The webhook's HTTPS address.
    pub webhook: SocketAddr,
    pub pki: &'a DemoPki,
    pub queue: Arc<QueueMetrics>,
    pub profile: &'a str,
    /// The agent's `/metrics`.
    pub agent_metrics: SocketAddr,
}

/// What a step leaves for later ones.
#[derive(Debug, Default)]
pub struct Carry {
    /// Device-plugin IDs the 4-GPU pod holds (step 2).
    pod_ids: Vec<String>,
    /// The claim prepared in step 3 and its device.
    claim: Option<(ClaimRef, PublishedDevice)>,
}

/// Runs one step.
pub async fn run(
    step: Step,
    cx: &Context<'_>,
    carry: &mut Carry,
    say: &mut Narrator<'_>,
) -> Outcome {
    match step {
        Step::Inventory => inventory::run(cx, say).await,
        Step::NvlinkAllocation => allocation::run(cx, carry, say).await,
        Step::DraClaim => claim::run(cx, carry, say).await,
        Step::LedgerRefusal => one_ledger::run(cx, carry, say).await,
        Step::Quota => quota::run(cx, say).await,
        Step::PodGroup => pod_group::run(cx, say).await,
        Step::XidHealth => health::run(cx, carry, say).await,
        Step::GpuShare => share::run(cx, say).await,
        Step::DynamicMig => dynamic_mig::run(cx, say).await,
        Step::WhyPending => pending::run(cx, say).await,
        Step::Preemption => preemption::run(cx, say).await,
        Step::GpuHours => hours::run(cx, say).await,
        Step::Telemetry => telemetry::run(cx, carry, say).await,
    }
}

/// Polls `probe` until it answers `Ok`, for at most [`WAIT`]; on time-out, the last thing it
/// saw.
async fn poll<T, F, Fut>(mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match probe().await {
            Ok(v) => return Ok(v),
            Err(seen) if Instant::now() >= deadline => {
                return Err(format!("after {}s: {seen}", WAIT.as_secs()))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

/// The ResourceSlices as the API server serves them.
async fn published(
    client: &kube::Client,
) -> Result<(Vec<ResourceSlice>, Vec<PublishedDevice>), String> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("listing ResourceSlices: {e}"))?
        .items;
    let devices = facts::published_devices(&slices);
    Ok((slices, devices))
}

/// Device-plugin ID -> (resource, health), over every resource the kubelet double follows.
fn listed(lab: &NodeLab) -> BTreeMap<String, (String, String)> {
    lab.kubelet
        .plugins()
        .into_iter()
        .flat_map(|(r, v)| {
            v.devices
                .into_iter()
                .map(move |d| (d.id, (r.clone(), d.health)))
        })
        .collect()
}

fn gpu_index(inv: &Inventory, uuid: &str) -> Option<u32> {
    inv.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index)
}

fn list(items: &[String]) -> String {
    items.join(", ")
}
