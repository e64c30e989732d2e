//! Step 2: a 4-GPU pod through the device plugin API. GetPreferredAllocation must pick a set
//! no other set of the free GPUs outscores (NVLink first), and Allocate must hand out exactly
//! that set with its CDI devices.

use super::{facts, gpu_index, list, Carry, Context, NODE_NAMESPACE};
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use gpuplane_model::inventory::Inventory;
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use gpuplane_model::topology::TopologyModel;
use std::collections::BTreeSet;

/// GPUs of the topology step's request.
const REQUEST: usize = 4;

pub(super) async fn run(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let inv = cx.inventory;
    let available = healthy_gpus(cx);
    if available.len() < REQUEST {
        return Outcome::Skipped(format!(
            "{} offers {} whole GPU(s) as {GPU_RESOURCE}; the request needs {REQUEST}",
            cx.profile,
            available.len()
        ));
    }
    if !facts::has_nvlink(inv) {
        return Outcome::Skipped(format!(
            "{} has no NVLink between its GPUs: there is no NVLink-optimal set to show",
            cx.profile
        ));
    }
    let choice = match preferred(cx, &available, say).await {
        Ok(c) => c,
        Err(outcome) => return outcome,
    };
    let admitted = cx
        .lab
        .kubelet
        .admit(NODE_NAMESPACE, "train-4gpu", "main", GPU_RESOURCE, REQUEST)
        .await;
    let (ids, grant) = match admitted {
        Ok(a) => a,
        Err(s) => return Outcome::Failed(format!("Allocate failed: {}", s.message())),
    };
    let cdi: Vec<String> = grant.cdi_devices.iter().map(|d| d.name.clone()).collect();
    say.say(format!(
        "pod {NODE_NAMESPACE}/train-4gpu admitted by the kubelet double: Allocate returned {} CDI device(s): {}",
        cdi.len(),
        list(&cdi)
    ));
    carry.pod_ids = ids.clone();
    let Choice {
        preferred,
        gpus,
        score,
        best,
        lanes,
    } = choice;
    let same: BTreeSet<&String> = ids.iter().collect();
    say.say(format!(
        "topology score of the set {score}; best of every {REQUEST}-GPU set of the available ones {best}"
    ));
    if same != preferred.iter().collect() {
        return Outcome::Failed(format!(
            "the pod got {} but the preferred set was {}",
            list(&ids),
            list(&preferred)
        ));
    }
    if best != score {
        return Outcome::Failed(format!(
            "{} scores {score}; the best set scores {best}",
            list(&gpus)
        ));
    }
    if cdi.len() != REQUEST {
        return Outcome::Failed(format!(
            "Allocate returned {} CDI devices for {REQUEST} GPUs",
            cdi.len()
        ));
    }
    Outcome::Held(format!(
        "{} allocated: {lanes} NVLink lanes, no other {REQUEST}-GPU set of the {} free scores higher",
        list(&gpus),
        available.len()
    ))
}

/// The healthy whole GPUs the kubelet double's ListAndWatch shows, by device-plugin ID.
fn healthy_gpus(cx: &Context<'_>) -> Vec<String> {
    cx.lab
        .kubelet
        .plugin(GPU_RESOURCE)
        .map(|v| {
            v.devices
                .into_iter()
                .filter(|d| d.health == "Healthy")
                .map(|d| d.id)
                .collect()
        })
        .unwrap_or_default()
}

/// GetPreferredAllocation's set, and how it compares with every other set.
struct Choice {
    /// The device-plugin IDs it answered.
    preferred: Vec<String>,
    /// The same set as `GPU<index>` names.
    gpus: Vec<String>,
    /// Its topology score, and the best score of any set of the available GPUs.
    score: u64,
    best: u64,
    /// NVLink lanes within the set.
    lanes: u32,
}

/// Asks GetPreferredAllocation for [`REQUEST`] of `available`, scores its answer against every
/// other set and narrates it; the outcome instead when the step cannot go on.
async fn preferred(
    cx: &Context<'_>,
    available: &[String],
    say: &mut Narrator<'_>,
) -> Result<Choice, Outcome> {
    let inv = cx.inventory;
    let preferred = cx
        .lab
        .kubelet
        .preferred(GPU_RESOURCE, available, &[], REQUEST)
        .await
        .map_err(|s| Outcome::Failed(format!("GetPreferredAllocation failed: {}", s.message())))?;
    let indices =
        |ids: &[String]| -> Option<Vec<u32>> { ids.iter().map(|id| gpu_index(inv, id)).collect() };
    let (Some(chosen), Some(pool)) = (indices(&preferred), indices(available)) else {
        return Err(Outcome::Failed(format!(
            "GetPreferredAllocation answered IDs that are not GPUs of the inventory: {}",
            list(&preferred)
        )));
    };
    let model = TopologyModel::new(inv);
    let score = model.set_score(&chosen);
    let Some(best) = facts::best_set_score(&model, &pool, REQUEST) else {
        return Err(Outcome::Skipped(format!(
            "{} free GPUs: too many {REQUEST}-GPU sets to check the choice against every one",
            pool.len()
        )));
    };
    let (lanes, without) = facts::nvlinks_within(inv, &chosen);
    let gpus: Vec<String> = chosen.iter().map(|i| format!("GPU{i}")).collect();
    say.say(format!(
        "GetPreferredAllocation({REQUEST} of {} available) -> {}: {lanes} NVLink lanes over its {} pairs, {without} pair(s) without NVLink, NUMA node(s) {}",
        available.len(),
        list(&gpus),
        chosen.len() * (chosen.len() - 1) / 2,
        numa_nodes(inv, &chosen)
    ));
    Ok(Choice {
        preferred,
        gpus,
        score,
        best,
        lanes,
    })
}

/// The NUMA nodes of the GPUs `chosen`, comma-separated (`?` where unknown).
fn numa_nodes(inv: &Inventory, chosen: &[u32]) -> String {
    let numa: BTreeSet<String> = chosen
        .iter()
        .filter_map(|i| inv.gpu(*i))
        .map(|g| g.numa_node.map_or("?".to_string(), |n| n.to_string()))
        .collect();
    numa.into_iter().collect::<Vec<_>>().join(",")
}
