//! Matching devices exist but are unhealthy or tainted. For device-plugin resources the kubelet
//! counts an unhealthy device in capacity but not in allocatable, without saying why; the cause
//! is our agent's unhealthy taint (`gpu.gpuplane.dev/unhealthy=xid-48`) on the same GPU in the
//! node's ResourceSlices. A device counts as unhealthy only where both say so: a GPU withdrawn
//! from the device plugin while a claim holds it is missing from allocatable too, and is not
//! unhealthy. For claims, a slice taint the request does not tolerate (health, or an admin's)
//! keeps a device from it, as it keeps the scheduler.

use super::{excluded_by, NodeGpus, Reason};
use crate::quota::{DeviceCatalog, DeviceKind};
use k8s_openapi::api::core::v1::PodSpec;
use std::collections::BTreeMap;

/// Fills each node's `unhealthy` with its whole GPUs our agent marked unhealthy.
pub(super) fn mark_unhealthy(nodes: &mut [NodeGpus], catalog: &DeviceCatalog) {
    let mut by_node: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for d in catalog
        .devices()
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
    {
        let f = &d.facts;
        if let (Some(node), Some(cause)) = (f.node.as_deref(), f.unhealthy()) {
            by_node
                .entry(node)
                .or_default()
                .push(format!("{} ({cause})", d.name));
        }
    }
    for n in nodes {
        n.unhealthy = by_node.remove(n.name.as_str()).unwrap_or_default();
    }
}

/// The answer for a device-plugin resource whose free devices fall short, when the unhealthy
/// ones on nodes the pod may use would make up the difference: "needs 8 nvidia.com/gpu; 7 free
/// in the cluster; 1 more unhealthy: node-b gpu-3 (xid-48)".
pub(super) fn resource_answer(
    spec: &PodSpec,
    needs: &str,
    resource: &str,
    ask: u64,
    up: &[&NodeGpus],
) -> Option<(Reason, String)> {
    let usable: Vec<&NodeGpus> = up
        .iter()
        .copied()
        .filter(|n| excluded_by(spec, n).is_none())
        .collect();
    let free: u64 = usable.iter().map(|n| n.free(resource)).sum();
    let mut more = 0;
    let mut which = Vec::new();
    for n in &usable {
        let missing = n.unavailable.get(resource).copied().unwrap_or(0);
        let unhealthy = u64::try_from(n.unhealthy.len()).unwrap_or(u64::MAX);
        if missing.min(unhealthy) > 0 {
            more += missing.min(unhealthy);
            which.push(format!("{} {}", n.name, n.unhealthy.join(", ")));
        }
    }
    (more > 0 && free + more >= ask).then(|| {
        (
            Reason::Unhealthy,
            format!(
                "{needs}; {free} free on nodes it may use; {more} more unhealthy: {}",
                which.join("; ")
            ),
        )
    })
}

/// The answer for a claim request whose free untainted devices fall short, when the tainted
/// ones would make up the difference: the devices and their taints.
pub(super) fn claim_answer(
    needs: &str,
    want: u64,
    free: u64,
    all: usize,
    tainted: &[String],
) -> Option<(Reason, String)> {
    let count = u64::try_from(tainted.len()).unwrap_or(u64::MAX);
    (count > 0 && free + count >= want).then(|| {
        (
            Reason::Unhealthy,
            format!(
                "{needs}; {free} of the {all} matching free and untainted; {count} more tainted: {}",
                tainted.join(", ")
            ),
        )
    })
}
