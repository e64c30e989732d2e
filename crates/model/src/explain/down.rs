//! GPU nodes that offer nothing because their agent or driver is down (the seed's "node Ready,
//! GPU capacity zero" after a driver upgrade). A node counts as a GPU node when the agent's
//! labeller (or GPU Feature Discovery) labelled it so, or the kubelet still lists a GPU
//! resource for it; it is down for the device-plugin API when it offers no GPU resource at all,
//! and for DRA when it publishes no ResourceSlice. Only Ready, uncordoned nodes are looked at:
//! a node that is down as a whole is counted out (and said so) by the capacity check.

use super::{NodeGpus, Reason};
use std::collections::BTreeSet;

/// Labels that mark a GPU node: GFD's `gpu.present`, and the labeller's count and product.
const GPU_LABELS: [&str; 3] = [
    "nvidia.com/gpu.count",
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.present",
];

/// A GPU node that offers none of it, why, and how many it would have free when known (what
/// it had, less what its pods request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Down {
    pub name: String,
    pub why: String,
    pub had: Option<u64>,
}

/// The label that says `n` is a GPU node, as `key=value`.
fn gpu_label(n: &NodeGpus) -> Option<String> {
    GPU_LABELS.iter().find_map(|k| {
        let v = n.labels.get(*k)?;
        (v != "false" && v != "0").then(|| format!("{k}={v}"))
    })
}

/// The GPUs the labeller counted on `n` (`nvidia.com/gpu.count`).
fn label_count(n: &NodeGpus) -> Option<u64> {
    n.labels.get(GPU_LABELS[0])?.parse().ok()
}

/// GPU nodes whose device plugin offers nothing: the kubelet lists `resource` with 0
/// (unregistered; or allocatable 0 under a capacity, disconnected or every device unhealthy),
/// or the node is labelled a GPU node and lists no GPU resource at all (never registered).
pub(super) fn plugin_down(nodes: &[NodeGpus], resource: &str) -> Vec<Down> {
    let down = |n: &NodeGpus| {
        let offers_any = n.allocatable.values().any(|a| *a > 0);
        let listed = n.allocatable.contains_key(resource) || n.capacity.contains_key(resource);
        if offers_any || !(listed || gpu_label(n).is_some()) {
            return None;
        }
        let capacity = n.capacity.get(resource).copied().filter(|c| *c > 0);
        let why = match (capacity, gpu_label(n)) {
            (Some(c), _) => format!(
                "{resource} allocatable 0 of capacity {c} (device plugin disconnected, or every device unhealthy)"
            ),
            (None, _) if listed => format!("{resource} capacity 0 (agent not registered)"),
            (None, label) => format!(
                "labelled {}, offers no GPU resource (agent not registered)",
                label.unwrap_or_default()
            ),
        };
        let held = n.requested.get(resource).copied().unwrap_or(0);
        Some(Down {
            name: n.name.clone(),
            why,
            had: capacity
                .or_else(|| label_count(n))
                .map(|h| h.saturating_sub(held)),
        })
    };
    nodes
        .iter()
        .filter(|n| n.schedulable)
        .filter_map(down)
        .collect()
}

/// GPU nodes (by label, or a GPU resource the kubelet lists) that publish no ResourceSlice:
/// their DRA driver is not registered. `sliced`: the nodes that publish one.
pub(super) fn dra_down(nodes: &[NodeGpus], sliced: &BTreeSet<String>) -> Vec<Down> {
    nodes
        .iter()
        .filter(|n| n.schedulable && !sliced.contains(&n.name))
        .filter(|n| gpu_label(n).is_some() || !n.capacity.is_empty())
        .map(|n| Down {
            name: n.name.clone(),
            why: "no ResourceSlice (DRA driver not registered: agent stopped or driver down)"
                .into(),
            had: label_count(n),
        })
        .collect()
}

/// "b: why; c: why", by node name: the nodes come in the watch cache's order, and a message
/// that changed with it would be rewritten on the pod for nothing.
pub(super) fn names(down: &[Down]) -> String {
    let mut sorted: Vec<&Down> = down.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let each: Vec<String> = sorted
        .iter()
        .map(|d| format!("{}: {}", d.name, d.why))
        .collect();
    each.join("; ")
}

/// NoGPUCapacity when `free` falls short of `ask` and down GPU nodes could make up the
/// shortfall (or what they would have free is unknown): restoring them is the first thing to do. `None`
/// when nothing is down, or what is down could not make it fit either (then it is Capacity).
pub(super) fn verdict(
    needs: &str,
    free: u64,
    ask: u64,
    free_text: &str,
    down: &[Down],
) -> Option<(Reason, String)> {
    if down.is_empty() || free >= ask {
        return None;
    }
    let known: Option<u64> = down.iter().map(|d| d.had).sum();
    if known.is_some_and(|had| free + had < ask) {
        return None;
    }
    Some((
        Reason::NoGpuCapacity,
        format!(
            "{needs}; {free_text}; GPU nodes offering none: {}",
            names(down)
        ),
    ))
}
