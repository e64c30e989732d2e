//! The nodes as the explainer sees them: what each offers of the GPU resources, what its
//! pods already take, and what decides which pods may land there.

use crate::controller::pods::is_terminal;
use crate::quota::{pod_resource_counts, DeviceCatalog};
use k8s_openapi::api::core::v1::{Node, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::borrow::Borrow;
use std::collections::BTreeMap;

/// One node as the explainer needs it: what it offers, what its pods already take, and what
/// decides which pods may land there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeGpus {
    pub name: String,
    /// Allocatable GPU device-plugin resources, by name.
    pub allocatable: BTreeMap<String, u64>,
    /// Their capacity (the kubelet keeps a resource listed, at 0, after its plugin left).
    pub capacity: BTreeMap<String, u64>,
    /// What the pods bound to it and not finished request, by name.
    pub requested: BTreeMap<String, u64>,
    /// Ready and not cordoned.
    pub schedulable: bool,
    pub taints: Vec<Taint>,
    pub labels: BTreeMap<String, String>,
    /// Capacity minus allocatable of its GPU resources: devices the kubelet counts but does
    /// not offer (unhealthy, or withdrawn from the device plugin while a claim holds them).
    pub unavailable: BTreeMap<String, u64>,
    /// Its whole GPUs our agent marked unhealthy, as "gpu-3 (xid-48)" (from the slices).
    pub unhealthy: Vec<String>,
}

impl NodeGpus {
    pub(super) fn free(&self, resource: &str) -> u64 {
        let a = self.allocatable.get(resource).copied().unwrap_or(0);
        a.saturating_sub(self.requested.get(resource).copied().unwrap_or(0))
    }
}

/// The nodes with their GPU resources and what `pods` bound to them request.
pub fn node_gpus<N: Borrow<Node>, P: Borrow<Pod>>(
    nodes: &[N],
    pods: &[P],
    catalog: &DeviceCatalog,
) -> Vec<NodeGpus> {
    let mut requested: BTreeMap<&str, BTreeMap<String, u64>> = BTreeMap::new();
    for p in pods.iter().map(Borrow::borrow).filter(|p| !is_terminal(p)) {
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            continue;
        };
        // A pod whose quantities do not parse was refused by the API server; none is here.
        let counts = pod_resource_counts(p, catalog).unwrap_or_default();
        let on = requested.entry(node).or_default();
        for (r, n) in counts {
            *on.entry(r).or_insert(0) += n;
        }
    }
    nodes
        .iter()
        .map(|n| {
            let n: &Node = n.borrow();
            let name = n.metadata.name.clone().unwrap_or_default();
            let spec = n.spec.clone().unwrap_or_default();
            let status = n.status.as_ref();
            let gpus = |m: Option<&BTreeMap<String, Quantity>>| -> BTreeMap<String, u64> {
                m.into_iter()
                    .flatten()
                    .filter(|(r, _)| catalog.is_gpu_resource(r))
                    .filter_map(|(r, q)| {
                        Some((r.clone(), crate::quota::charge::quantity_count(q)?))
                    })
                    .collect()
            };
            let allocatable = gpus(status.and_then(|s| s.allocatable.as_ref()));
            let capacity = gpus(status.and_then(|s| s.capacity.as_ref()));
            let unavailable = capacity
                .iter()
                .map(|(r, c)| {
                    let a = allocatable.get(r).copied().unwrap_or(0);
                    (r.clone(), c.saturating_sub(a))
                })
                .filter(|(_, n)| *n > 0)
                .collect();
            let ready = status
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            NodeGpus {
                requested: requested.remove(name.as_str()).unwrap_or_default(),
                name,
                allocatable,
                capacity,
                schedulable: ready && !spec.unschedulable.unwrap_or(false),
                taints: spec.taints.unwrap_or_default(),
                labels: n
                    .metadata
                    .labels
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
                unavailable,
                unhealthy: Vec::new(),
            }
        })
        .collect()
}
