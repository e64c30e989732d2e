//! Why a GPU pod is Pending (pure): one reason, with the numbers that make it actionable, from
//! what the cluster holds (pods, nodes). A classifier over the scheduler's inputs, not a second
//! scheduler: where it cannot be sure it says so and quotes the scheduler's own message.
//!
//! The order is the one an operator checks: held by quota (our gate), no GPU capacity at all,
//! too little free in the whole cluster (capacity), enough free but only on nodes the pod may not
//! use (placement), enough free on usable nodes but no single node has enough (fragmentation).
//! A pod's claims are checked after its device-plugin resources (`claims.rs`): a request no
//! published device matches, or too few matching devices free.

mod claims;

use crate::controller::pods::{gate_index, is_terminal, CONDITION};
use crate::quota::{pod_resource_counts, CatalogSettings, DeviceCatalog};
use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, Taint, Toleration,
};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use serde::Serialize;
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// The kinds of answer, in the order they are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Reason {
    /// Not waiting for a GPU: scheduled already, finished, or asking for none.
    NotWaiting,
    /// Held at the quota gate: the quota controller's note says why.
    Quota,
    /// A claim's request matches no published device, or names no DeviceClass that exists.
    Selector,
    /// No node offers the resource at all (no agent registered, or its driver is down).
    #[serde(rename = "NoGPUCapacity")]
    NoGpuCapacity,
    /// The cluster has fewer free than the pod asks, in total.
    Capacity,
    /// Enough free, but only on nodes the pod's taints, tolerations or selectors exclude.
    Placement,
    /// Enough free on nodes the pod may use, but no one node has enough.
    Fragmentation,
    /// None of the above could be decided: the scheduler's message, quoted.
    Unknown,
}

impl Reason {
    /// Every reason a waiting pod can have (all but [`Reason::NotWaiting`]), in order.
    pub const WAITING: [Reason; 7] = [
        Reason::Quota,
        Reason::Selector,
        Reason::NoGpuCapacity,
        Reason::Capacity,
        Reason::Placement,
        Reason::Fragmentation,
        Reason::Unknown,
    ];

    /// The name the CLI, the pod condition and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NotWaiting => "NotWaiting",
            Reason::Quota => "Quota",
            Reason::Selector => "Selector",
            Reason::NoGpuCapacity => "NoGPUCapacity",
            Reason::Capacity => "Capacity",
            Reason::Placement => "Placement",
            Reason::Fragmentation => "Fragmentation",
            Reason::Unknown => "Unknown",
        }
    }
}

/// One pod's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub namespace: String,
    pub pod: String,
    pub reason: Reason,
    pub message: String,
}

/// One node as the explainer needs it: what it offers, what its pods already take, and what
/// decides which pods may land there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeGpus {
    pub name: String,
    /// Allocatable GPU device-plugin resources, by name.
    pub allocatable: BTreeMap<String, u64>,
    /// What the pods bound to it and not finished request, by name.
    pub requested: BTreeMap<String, u64>,
    /// Ready and not cordoned.
    pub schedulable: bool,
    pub taints: Vec<Taint>,
    pub labels: BTreeMap<String, String>,
}

impl NodeGpus {
    fn free(&self, resource: &str) -> u64 {
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
            let allocatable = status
                .and_then(|s| s.allocatable.as_ref())
                .into_iter()
                .flatten()
                .filter(|(r, _)| catalog.is_gpu_resource(r))
                .filter_map(|(r, q)| Some((r.clone(), crate::quota::charge::quantity_count(q)?)))
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
                schedulable: ready && !spec.unschedulable.unwrap_or(false),
                taints: spec.taints.unwrap_or_default(),
                labels: n
                    .metadata
                    .labels
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
            }
        })
        .collect()
}

/// What the explainer reads of the cluster, gathered once for many pods.
pub struct Cluster {
    pub nodes: Vec<NodeGpus>,
    /// Published GPU devices and DeviceClasses; shared, since it changes far less often than
    /// the rest (a controller keeps it until a slice or class changes).
    pub catalog: Arc<DeviceCatalog>,
    /// Devices held by allocated claims: (driver, pool, device) to the holding claim's uid.
    pub taken: BTreeMap<(String, String, String), String>,
    /// ResourceClaimTemplates by (namespace, name).
    pub templates: BTreeMap<(String, String), k8s_openapi::api::resource::v1::ResourceClaimSpec>,
    /// Answers to claim requests already classified against this cluster, by request: pods
    /// made from one template ask the same, and each answer evaluates every published
    /// device's CEL (8,000 devices x 1,000 pods a cycle at 1,000 nodes without it).
    answers: claims::Answers,
}

/// Everything [`Cluster::new`] reads, as listed from the API server.
#[derive(Default)]
pub struct Listed {
    pub nodes: Vec<Node>,
    /// Pods bound to nodes (others may be present; they are skipped).
    pub pods: Vec<Pod>,
    pub slices: Vec<ResourceSlice>,
    pub classes: Vec<DeviceClass>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
}

/// What [`Cluster::from_shared`] reads besides the catalog: the objects, or anything that
/// borrows them (a reflector store's `Arc`s), so a caller holding shared copies clones none.
pub struct Shared<'a, N, P, C, T> {
    pub nodes: &'a [N],
    /// Pods bound to nodes (others may be present; they are skipped).
    pub pods: &'a [P],
    pub claims: &'a [C],
    pub templates: &'a [T],
}

impl Cluster {
    pub fn new(listed: &Listed, settings: CatalogSettings) -> Cluster {
        let catalog = DeviceCatalog::new(&listed.slices, &listed.classes, settings);
        let shared = Shared {
            nodes: &listed.nodes,
            pods: &listed.pods,
            claims: &listed.claims,
            templates: &listed.templates,
        };
        Cluster::from_shared(&shared, Arc::new(catalog))
    }

    /// [`Cluster::new`] with a catalog built already (from the same cluster's slices and
    /// classes).
    pub fn from_shared<N, P, C, T>(
        listed: &Shared<N, P, C, T>,
        catalog: Arc<DeviceCatalog>,
    ) -> Cluster
    where
        N: Borrow<Node>,
        P: Borrow<Pod>,
        C: Borrow<ResourceClaim>,
        T: Borrow<ResourceClaimTemplate>,
    {
        Cluster {
            nodes: node_gpus(listed.nodes, listed.pods, &catalog),
            catalog,
            taken: claims::taken(listed.claims),
            answers: claims::Answers::default(),
            templates: listed
                .templates
                .iter()
                .map(|t| {
                    let t: &ResourceClaimTemplate = t.borrow();
                    let m = &t.metadata;
                    let key = (
                        m.namespace.clone().unwrap_or_default(),
                        m.name.clone().unwrap_or_default(),
                    );
                    (key, t.spec.spec.clone())
                })
                .collect(),
        }
    }
}

/// Why `pod` is Pending.
pub fn explain(pod: &Pod, cluster: &Cluster) -> Explanation {
    let (reason, message) = classify(pod, cluster);
    Explanation {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        reason,
        message,
    }
}

fn classify(pod: &Pod, cluster: &Cluster) -> (Reason, String) {
    let spec = pod.spec.clone().unwrap_or_default();
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if let Some(node) = &spec.node_name {
        return (Reason::NotWaiting, format!("scheduled to node {node}"));
    }
    if phase.is_some_and(|p| p != "Pending") {
        return (Reason::NotWaiting, format!("phase {}", phase.unwrap_or("")));
    }
    if gate_index(pod).is_some() {
        let note = quota_note(pod)
            .unwrap_or_else(|| "the quota controller has not decided on it yet".into());
        return (Reason::Quota, format!("held by GPU quota: {note}"));
    }
    let asks = match pod_resource_counts(pod, &cluster.catalog) {
        Ok(a) => a,
        Err(e) => {
            return (
                Reason::Unknown,
                format!("its GPU requests cannot be read: {e}"),
            )
        }
    };
    let has_claims = spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty());
    if asks.is_empty() && !has_claims {
        return (Reason::NotWaiting, "it asks for no GPU".into());
    }
    for (resource, &ask) in &asks {
        if let Some(answer) = resource_answer(&spec, resource, ask, &cluster.nodes) {
            return answer;
        }
    }
    if let Some(answer) = claims::answer(pod, cluster) {
        return answer;
    }
    (
        Reason::Unknown,
        format!(
            "what it asks for is free on some node; {}",
            scheduler_says(pod)
        ),
    )
}

/// The answer for one requested resource, or `None` when some usable node has enough of it.
fn resource_answer(
    spec: &PodSpec,
    resource: &str,
    ask: u64,
    nodes: &[NodeGpus],
) -> Option<(Reason, String)> {
    let offering: Vec<&NodeGpus> = nodes
        .iter()
        .filter(|n| n.allocatable.get(resource).is_some_and(|a| *a > 0))
        .collect();
    let needs = format!("needs {ask} {resource}");
    if offering.is_empty() {
        return Some((
            Reason::NoGpuCapacity,
            format!(
                "{needs}; no node offers {resource} (is the gpuplane agent running and registered on the GPU nodes?)"
            ),
        ));
    }
    let up: Vec<&NodeGpus> = offering.iter().copied().filter(|n| n.schedulable).collect();
    let total: u64 = up.iter().map(|n| n.free(resource)).sum();
    if total < ask {
        let down = offering.len() - up.len();
        let mut m = format!("{needs}; {total} free in the cluster");
        if down > 0 {
            let _ = write!(m, " ({down} node(s) offering it are not Ready or cordoned)");
        }
        return Some((Reason::Capacity, m));
    }
    let usable: Vec<&NodeGpus> = up
        .iter()
        .copied()
        .filter(|n| excluded_by(spec, n).is_none())
        .collect();
    let usable_free: u64 = usable.iter().map(|n| n.free(resource)).sum();
    if usable.iter().any(|n| n.free(resource) >= ask) {
        return None;
    }
    if usable_free < ask {
        let why: Vec<String> = up
            .iter()
            .filter(|n| n.free(resource) > 0)
            .filter_map(|n| excluded_by(spec, n).map(|w| format!("{}: {w}", n.name)))
            .collect();
        return Some((
            Reason::Placement,
            format!(
                "{needs}; {total} free in the cluster, {usable_free} on nodes it may use; excluded: {}",
                why.join("; ")
            ),
        ));
    }
    Some((
        Reason::Fragmentation,
        fragmentation(&needs, resource, &usable),
    ))
}

fn fragmentation(needs: &str, resource: &str, usable: &[&NodeGpus]) -> String {
    let free = usable
        .iter()
        .map(|n| (n.name.as_str(), n.free(resource)))
        .collect();
    spread(needs, free, "nodes")
}

/// "`needs`; T free across N `places`, at most M on one: a 2, b 2", largest first.
fn spread(needs: &str, free: Vec<(&str, u64)>, places: &str) -> String {
    let mut free: Vec<(&str, u64)> = free.into_iter().filter(|(_, f)| *f > 0).collect();
    free.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let total: u64 = free.iter().map(|(_, f)| f).sum();
    let most = free.first().map_or(0, |(_, f)| *f);
    let each: Vec<String> = free.iter().map(|(n, f)| format!("{n} {f}")).collect();
    format!(
        "{needs}; {total} free across {} {places}, at most {most} on one: {}",
        free.len(),
        each.join(", ")
    )
}

/// Why the pod may not land on `node`, if it may not: an untolerated taint, or a node selector
/// or required node affinity the node's labels do not satisfy.
fn excluded_by(spec: &PodSpec, node: &NodeGpus) -> Option<String> {
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    if let Some(t) = node
        .taints
        .iter()
        .find(|t| blocks(t) && !tolerations.iter().any(|o| tolerates(o, t)))
    {
        let value = t
            .value
            .as_deref()
            .map(|v| format!("={v}"))
            .unwrap_or_default();
        return Some(format!("taint {}{value}:{} not tolerated", t.key, t.effect));
    }
    for (k, v) in spec.node_selector.iter().flatten() {
        if node.labels.get(k) != Some(v) {
            return Some(format!("nodeSelector {k}={v} not matched"));
        }
    }
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .map(|r| r.node_selector_terms.as_slice());
    match terms {
        Some(terms) if !terms.iter().any(|t| term_matches(t, node)) => {
            Some("required node affinity not matched".into())
        }
        _ => None,
    }
}

/// Only these effects keep a pod off a node (PreferNoSchedule is a preference).
fn blocks(t: &Taint) -> bool {
    t.effect == "NoSchedule" || t.effect == "NoExecute"
}

/// Kubernetes' toleration rule: an empty key with Exists matches every taint; an empty effect
/// matches every effect; Equal (the default) compares the values.
fn tolerates(o: &Toleration, t: &Taint) -> bool {
    let effect = o
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == t.effect);
    let exists = o.operator.as_deref() == Some("Exists");
    let key = match o.key.as_deref() {
        None | Some("") => exists,
        Some(k) => k == t.key,
    };
    let value = exists || o.value.as_deref().unwrap_or("") == t.value.as_deref().unwrap_or("");
    effect && key && value
}

/// A node selector term: every expression holds (on labels, or on the node's name for
/// `matchFields`); an empty term matches nothing, as in Kubernetes.
fn term_matches(t: &NodeSelectorTerm, node: &NodeGpus) -> bool {
    let labels = t.match_expressions.as_deref().unwrap_or_default();
    let fields = t.match_fields.as_deref().unwrap_or_default();
    if labels.is_empty() && fields.is_empty() {
        return false;
    }
    let name = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
    labels.iter().all(|r| requirement_holds(r, &node.labels))
        && fields.iter().all(|r| requirement_holds(r, &name))
}

fn requirement_holds(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let have = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => have.is_some_and(|v| values.contains(v)),
        "NotIn" => have.is_none_or(|v| !values.contains(v)),
        "Exists" => have.is_some(),
        "DoesNotExist" => have.is_none(),
        "Gt" | "Lt" => {
            let (Some(h), Some(w)) = (
                have.and_then(|v| number(v)),
                values.first().and_then(|v| number(v)),
            ) else {
                return false;
            };
            if r.operator == "Gt" {
                h > w
            } else {
                h < w
            }
        }
        _ => false,
    }
}

/// The quota controller's note on a gated pod (its `QuotaAdmitted` condition).
fn quota_note(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION)
        .and_then(|c| c.message.clone())
        .filter(|m| !m.is_empty())
}

/// The scheduler's own message from the pod's PodScheduled condition, quoted.
pub(crate) fn scheduler_says(pod: &Pod) -> String {
    let message = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message.clone());
    match message {
        Some(m) => format!("the scheduler says: {m:?}"),
        None => "the scheduler has not reported on it yet".into(),
    }
}

#[cfg(test)]
mod tests;
