//! The kubelet refused the pod: its topology manager (`single-numa-node`, or `restricted`)
//! could not align the GPUs the scheduler counted free on the node, since the scheduler counts
//! a node's devices, not its NUMA nodes. The kubelet ends such a pod Failed with
//! `status.reason` TopologyAffinityError ("Pod was rejected: Resources cannot be allocated with
//! Topology locality") and nothing retries it. The answer names the free GPUs per NUMA node
//! there, from the `resource.kubernetes.io/numaNode` attribute of the node's ResourceSlices,
//! and points to the way the scheduler does see NUMA: a claim whose constraint is a
//! `matchAttribute` on that attribute.

use super::{Cluster, Reason};
use crate::quota::{pod_resource_counts, DeviceKind};
use crate::slices::render::names::NUMA_NODE;
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;

/// The kubelet's `status.reason` on a pod its topology manager refused.
pub const TOPOLOGY_AFFINITY_ERROR: &str = "TopologyAffinityError";

/// Whether the kubelet refused `pod` for NUMA alignment (Failed, TopologyAffinityError).
pub fn refused_by_kubelet(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|s| {
        s.phase.as_deref() == Some("Failed") && s.reason.as_deref() == Some(TOPOLOGY_AFFINITY_ERROR)
    })
}

/// The Topology answer for a pod the kubelet refused, `None` for any other pod.
pub(super) fn answer(pod: &Pod, cluster: &Cluster) -> Option<(Reason, String)> {
    if !refused_by_kubelet(pod) {
        return None;
    }
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or("its node");
    let asks: Vec<String> = pod_resource_counts(pod, &cluster.catalog)
        .unwrap_or_default()
        .into_iter()
        .map(|(r, n)| format!("{n} {r}"))
        .collect();
    let asks = if asks.is_empty() {
        "its devices".to_string()
    } else {
        asks.join(", ")
    };
    let refused = format!(
        "the kubelet on {node} refused it ({TOPOLOGY_AFFINITY_ERROR}): its topology manager could not put {asks} on one NUMA node, which the scheduler does not see"
    );
    let free = free_by_numa(node, cluster);
    let Some(most) = free.values().max() else {
        return Some((
            Reason::Topology,
            format!("{refused}; {node} publishes no {NUMA_NODE} for its GPUs"),
        ));
    };
    let each: Vec<String> = free.iter().map(|(n, f)| format!("{n}: {f}")).collect();
    Some((
        Reason::Topology,
        format!(
            "{refused}; free GPUs on {node} by NUMA node: {}; ask for at most {most} there, or through a ResourceClaim with a matchAttribute constraint on {NUMA_NODE}, which the scheduler does see",
            each.join(", ")
        ),
    ))
}

/// Free whole GPUs on `node` per NUMA node (every NUMA node with a GPU, free or not): neither
/// allocated to a claim, nor held through the device plugin, nor tainted.
fn free_by_numa(node: &str, cluster: &Cluster) -> BTreeMap<i64, u64> {
    let mut out = BTreeMap::new();
    for d in cluster.catalog.devices() {
        let f = &d.facts;
        let (Some(numa), DeviceKind::Gpu) = (f.numa, &d.kind) else {
            continue;
        };
        if f.node.as_deref() != Some(node) {
            continue;
        }
        let key = (d.driver.clone(), d.pool.clone(), d.name.clone());
        let free =
            !cluster.taken.contains_key(&key) && f.usable(&[]) == super::devices::Usable::Yes;
        *out.entry(numa).or_insert(0) += u64::from(free);
    }
    out
}
