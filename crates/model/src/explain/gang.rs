//! Gang waiting: a gated pod of an all-or-nothing pod group (`quota.gpuplane.dev/pod-group`).
//! The quota queue releases a group whole or not at all, so its members wait for the group,
//! not for themselves: the answer names the group, how many of its members exist and are held
//! at the gate, what the held ones ask together (beside what is free in the cluster, so a
//! group that would not fit even once admitted shows it), and what the queue waits for.

use super::{Cluster, Reason};
use crate::controller::pods::{self, gate_index, is_deleting, is_terminal};
use crate::quota::{pod_resource_counts, DeviceCatalog};
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;

/// One pod group as the explainer counts it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members {
    /// Live members (not finished, not being deleted), gated or not.
    pub present: u32,
    /// Of those, still at the quota gate.
    pub gated: u32,
    /// The largest size a member declares (the queue's rule); `None` when none parses.
    pub size: Option<u32>,
    /// What the gated members ask together, by device-plugin resource.
    pub asks: BTreeMap<String, u64>,
}

/// The pod groups among `pods`, by (namespace, group name).
pub(super) fn groups<P: std::borrow::Borrow<Pod>>(
    pods: &[P],
    catalog: &DeviceCatalog,
) -> BTreeMap<(String, String), Members> {
    let mut out: BTreeMap<(String, String), Members> = BTreeMap::new();
    let live = |p: &&Pod| !is_terminal(p) && !is_deleting(p);
    for p in pods.iter().map(std::borrow::Borrow::borrow).filter(live) {
        let Some((name, size)) = pods::group(p) else {
            continue;
        };
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        let m = out.entry((ns, name)).or_default();
        m.present += 1;
        if let Ok(s) = size {
            m.size = Some(m.size.map_or(s, |had| had.max(s)));
        }
        if gate_index(p).is_some() {
            m.gated += 1;
            for (r, n) in pod_resource_counts(p, catalog).unwrap_or_default() {
                *m.asks.entry(r).or_insert(0) += n;
            }
        }
    }
    out
}

/// The answer for a gated pod that belongs to a pod group; `None` for a single pod. `note` is
/// the quota queue's note on it (its `QuotaAdmitted` message).
pub(super) fn answer(pod: &Pod, cluster: &Cluster, note: Option<&str>) -> Option<(Reason, String)> {
    let (name, declared) = pods::group(pod)?;
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let who = pods::group_key(&ns, &name);
    let m = cluster.groups.get(&(ns, name)).cloned().unwrap_or_default();
    let Some(size) = m.size else {
        let why = declared.err().unwrap_or_default();
        return Some((Reason::Gang, format!("{who}: {why}")));
    };
    let (present, gated) = (m.present.max(1), m.gated.max(1));
    // An incomplete group holds nothing and blocks nothing: its place in the queue means
    // nothing until it is complete.
    let at = match present < size {
        true => String::new(),
        false => super::queue_position(pod, cluster),
    };
    let head =
        format!("{who}{at}: {present} of {size} members exist, {gated} held at the quota gate");
    if present < size {
        let missing = size - present;
        return Some((
            Reason::Gang,
            format!("{head}; none is released until the other {missing} exist"),
        ));
    }
    let asks: Vec<String> = m
        .asks
        .iter()
        .map(|(r, n)| {
            let free: u64 = cluster
                .nodes
                .iter()
                .filter(|x| x.schedulable)
                .map(|x| x.free(r))
                .sum();
            format!("{n} {r} ({free} free in the cluster)")
        })
        .collect();
    let mut message = head;
    if !asks.is_empty() {
        message += &format!(", asking together {}", asks.join(", "));
    }
    let waits = note.map_or("the quota controller has not decided on it yet", |n| {
        unit_reason(n, &who)
    });
    Some((
        Reason::Gang,
        format!("{message}; released together once the quota admits all: {waits}"),
    ))
}

/// The queue's note without its "pod group NS/NAME (N pods waiting): " lead, which the answer
/// says in its own words.
fn unit_reason<'a>(note: &'a str, who: &str) -> &'a str {
    note.strip_prefix(who)
        .and_then(|rest| rest.strip_prefix(" ("))
        .and_then(|rest| rest.split_once("): "))
        .map_or(note, |(_, why)| why)
}
