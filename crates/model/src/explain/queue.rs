//! Where a gated pod stands in its namespace's quota queue (Queue mode). The queue orders
//! units, single pods and whole pod groups, by the planner's own [`queue_order`] (priority,
//! then creation, then key); this rebuilds those units from the gated pods the explainer sees,
//! with the planner's keys, so a position here is the one the queue goes by.

use crate::controller::plan::{queue_order, Waiting};
use crate::controller::pods::{self, is_queued};
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;
use std::time::SystemTime;

/// A unit's key as the planner writes it ([`pods::pod_key`], [`pods::group_key`]).
pub(super) fn unit_key(pod: &Pod) -> (String, String) {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let key = match pods::group(pod) {
        Some((group, _)) => pods::group_key(&ns, &group),
        None => pods::pod_key(&ns, pod.metadata.name.as_deref().unwrap_or("")),
    };
    (ns, key)
}

/// By (namespace, unit key): its 1-based position in its namespace's queue and the queue's
/// length in units.
pub(super) fn positions<P: std::borrow::Borrow<Pod>>(
    pods: &[P],
) -> BTreeMap<(String, String), (usize, usize)> {
    // Per namespace, per unit key: (highest priority, earliest creation).
    let mut units: BTreeMap<String, BTreeMap<String, (i32, SystemTime)>> = BTreeMap::new();
    for p in pods
        .iter()
        .map(std::borrow::Borrow::borrow)
        .filter(|p| is_queued(p))
    {
        let (ns, key) = unit_key(p);
        let (priority, created) = (pods::priority(p), pods::created(p));
        units
            .entry(ns)
            .or_default()
            .entry(key)
            .and_modify(|u| *u = (u.0.max(priority), u.1.min(created)))
            .or_insert((priority, created));
    }
    let mut out = BTreeMap::new();
    for (ns, keyed) in units {
        let queue: Vec<Waiting<()>> = keyed
            .into_iter()
            .map(|(key, (priority, created))| Waiting {
                key,
                priority,
                created,
                since: created,
                charge: (),
                group: None,
            })
            .collect();
        for (i, index) in queue_order(&queue).into_iter().enumerate() {
            let key = queue[index].key.clone();
            out.insert((ns.clone(), key), (i + 1, queue.len()));
        }
    }
    out
}
