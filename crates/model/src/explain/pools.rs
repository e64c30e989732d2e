//! The fragmentation ratio per node pool: how much of a pool's free GPUs cannot be used
//! together on one node. A node pool is the nodes that carry the same GPU product label
//! (`nvidia.com/gpu.product`, set by the agent's labeller as GPU Feature Discovery does):
//! nodes of one product are interchangeable for a GPU pod, which is what pools of
//! autoscalers and node groups mean; a DRA pool is one node's devices, too small to say
//! anything about spreading. Nodes without the label form the pool `unlabelled`.
//!
//! Per pool and device-plugin resource, over Ready, uncordoned nodes:
//! `ratio = 1 - largest free on one node / free in the pool`; 0 when all free GPUs sit on one
//! node (or none is free), approaching 1 as the free GPUs spread thin (8 nodes with 1 free
//! each: 0.875). A pod asking more than the largest free on one node cannot start in that pool
//! however large its free total.

use super::NodeGpus;
use std::collections::BTreeMap;

/// The node label that names a node's pool.
pub const POOL_LABEL: &str = "nvidia.com/gpu.product";

/// One pool's free GPUs of one resource, and how spread they are.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolFragmentation {
    pub pool: String,
    pub resource: String,
    /// Free in the whole pool.
    pub free: u64,
    /// Free on its emptiest node (the most one pod can get there).
    pub largest: u64,
    /// `1 - largest / free`, 0 when nothing is free.
    pub ratio: f64,
}

/// Every (pool, resource) of the schedulable nodes, sorted, with its ratio.
pub fn fragmentation_by_pool(nodes: &[NodeGpus]) -> Vec<PoolFragmentation> {
    let mut acc: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for n in nodes.iter().filter(|n| n.schedulable) {
        let pool = n
            .labels
            .get(POOL_LABEL)
            .cloned()
            .unwrap_or_else(|| "unlabelled".into());
        for resource in n.allocatable.keys() {
            let free = n.free(resource);
            let (total, largest) = acc.entry((pool.clone(), resource.clone())).or_default();
            *total += free;
            *largest = (*largest).max(free);
        }
    }
    acc.into_iter()
        .map(|((pool, resource), (free, largest))| PoolFragmentation {
            pool,
            resource,
            free,
            largest,
            ratio: ratio(largest, free),
        })
        .collect()
}

fn ratio(largest: u64, free: u64) -> f64 {
    if free == 0 {
        return 0.0;
    }
    // Counts of GPUs: far below 2^52, exact as f64.
    1.0 - largest as f64 / free as f64
}
