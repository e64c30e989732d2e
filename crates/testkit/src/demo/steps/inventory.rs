//! Step 1: the inventory, and every unit offered by both kubelet APIs (the device plugin's
//! ListAndWatch and the DRA ResourceSlices), with GPU Feature Discovery's node labels.

use super::{facts, listed, poll, published, Context};
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use crate::doubles::lab::NODE;
use gpuplane_model::inventory::Inventory;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use std::collections::{BTreeMap, BTreeSet};

/// The node labels the step shows, under `nvidia.com/`.
const SHOWN_LABELS: [&str; 5] = [
    "gpu.product",
    "gpu.count",
    "gpu.memory",
    "gpu.family",
    "mig.capable",
];

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let inv = cx.inventory;
    describe(inv, say);
    let topology = facts::topology_line(inv);
    say.say(&topology);
    // Every unit (a GPU with MIG off, a MIG device) by UUID, as both APIs must offer it.
    let units: BTreeMap<String, String> = inv
        .dra_devices()
        .iter()
        .map(|d| (d.uuid().to_string(), d.dra_name()))
        .collect();
    let (slices, devices) = match offered_by_both(cx, &units).await {
        Ok(seen) => seen,
        Err(e) => return Outcome::Failed(e),
    };
    for (resource, view) in cx.lab.kubelet.plugins() {
        say.say(format!(
            "kubelet, device plugin API (ListAndWatch): {resource}: {} devices, {} healthy",
            view.devices.len(),
            view.healthy()
        ));
    }
    say.say(format!(
        "API server, DRA: {devices} devices in {slices} ResourceSlice(s) of pool {NODE}"
    ));
    match node_labels(cx).await {
        Ok(labels) => say.say(format!(
            "node labels (as GPU Feature Discovery's): {labels}"
        )),
        Err(e) => return Outcome::Failed(format!("node labels: {e}")),
    }
    Outcome::Held(format!(
        "all {} units offered by both APIs; {topology}",
        units.len()
    ))
}

/// The GPU models, the driver, and the MIG devices, one line each.
fn describe(inv: &Inventory, say: &mut Narrator<'_>) {
    let mut products: BTreeMap<(&str, u64), usize> = BTreeMap::new();
    for g in &inv.gpus {
        *products.entry((&g.product_name, g.memory_mib)).or_default() += 1;
    }
    for ((product, mib), n) in &products {
        say.say(format!(
            "{n} x {product} ({:.1} GiB), driver {}, CUDA {}",
            *mib as f64 / 1024.0,
            inv.driver_version,
            inv.cuda_driver_version
        ));
    }
    let mig_on = inv.gpus.iter().filter(|g| g.mig.current).count();
    if mig_on > 0 {
        say.say(format!(
            "MIG on {mig_on} GPU(s): {} MIG device(s)",
            inv.mig_device_count()
        ));
    }
}

/// Waits until the device plugin lists and the ResourceSlices publish every unit of `units`
/// (UUID -> DRA name); then (slices, devices) as published.
async fn offered_by_both(
    cx: &Context<'_>,
    units: &BTreeMap<String, String>,
) -> Result<(usize, usize), String> {
    poll(|| async {
        let ids = listed(cx.lab);
        let (slices, devices) = published(&cx.client).await?;
        let in_dp = units.keys().filter(|u| ids.contains_key(*u)).count();
        let uuids: BTreeSet<&str> = devices.iter().filter_map(|d| d.uuid.as_deref()).collect();
        let in_dra = units.keys().filter(|u| uuids.contains(u.as_str())).count();
        match in_dp == units.len() && in_dra == units.len() {
            true => Ok((slices.len(), devices.len())),
            false => Err(format!(
                "the device plugin lists {in_dp} and the ResourceSlices publish {in_dra} of the {} units",
                units.len()
            )),
        }
    })
    .await
}

/// GPU Feature Discovery's labels, as the agent wrote them on its Node: `name=value, ...`.
async fn node_labels(cx: &Context<'_>) -> Result<String, String> {
    let nodes: Api<Node> = Api::all(cx.client.clone());
    let labels = poll(|| {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get(NODE).await.map_err(|e| e.to_string())?;
            let l = n.metadata.labels.unwrap_or_default();
            match l.get("nvidia.com/gpu.count") {
                Some(_) => Ok(l),
                None => Err("no GPU labels on the node yet".to_string()),
            }
        }
    })
    .await?;
    Ok(SHOWN_LABELS
        .iter()
        .filter_map(|k| {
            labels
                .get(&format!("nvidia.com/{k}"))
                .map(|v| format!("nvidia.com/{k}={v}"))
        })
        .collect::<Vec<_>>()
        .join(", "))
}
