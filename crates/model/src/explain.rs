//! Why a GPU pod is Pending (pure): one reason, with the numbers that make it actionable, from
//! what the cluster holds (pods, nodes). A classifier over the scheduler's inputs, not a second
//! scheduler: where it cannot be sure it says so and quotes the scheduler's own message.
//!
//! The order is the one an operator checks: held by Kueue (its admission gate: Kueue's own
//! message from the pod's Workload, `crate::kueue`), held by quota (our gate; a pod group's members as
//! one gang, `gang.rs`), no GPU capacity at all,
//! too little free in the whole cluster (capacity), enough free but only on nodes the pod may not
//! use (placement), enough free on usable nodes but no single node has enough (fragmentation).
//! A pod's claims are checked after its device-plugin resources (`claims.rs`): a request no
//! published device matches, or too few matching devices free. Where the free devices fall
//! short only because matching ones are unhealthy or tainted, the answer says so and names them
//! (`health.rs`). A pod the kubelet refused for NUMA alignment is answered first
//! (`topology.rs`): it is bound and Failed, but still has no GPU.

mod claims;
mod condition;
pub mod devices;
mod down;
mod gang;
mod health;
mod nodes;
mod placement;
mod pools;
mod queue;
mod topology;

pub use condition::{from_condition, GPUS_AVAILABLE};
pub use gang::Members;
pub use nodes::{node_gpus, NodeGpus};
use placement::excluded_by;
pub use pools::{fragmentation_by_pool, PoolFragmentation, POOL_LABEL};
pub use topology::refused_by_kubelet;

use crate::controller::pods::{gate_index, CONDITION};
use crate::kueue::KueueView;
use crate::quota::{pod_resource_counts, CatalogSettings, DeviceCatalog};
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use serde::Serialize;
use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

/// The kinds of answer, in the order they are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Reason {
    /// Not waiting for a GPU: scheduled already, finished, or asking for none.
    NotWaiting,
    /// Held by Kueue (its admission gate, or a suspended job): Kueue's own message says why.
    Kueue,
    /// Held at the quota gate: the quota controller's note says why.
    Quota,
    /// A member of a pod group held at the quota gate until the whole group may go (`gang.rs`).
    Gang,
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
    /// Too few free, but matching devices exist that are unhealthy or tainted.
    Unhealthy,
    /// The kubelet refused it with TopologyAffinityError: the node's free GPUs are not on one
    /// NUMA node, which the scheduler does not see.
    Topology,
    /// Just released from its scheduling gates (by the quota controller, say): what it asks
    /// for is free, and the scheduler has not tried it since.
    Scheduling,
    /// None of the above could be decided: the scheduler's message, quoted.
    Unknown,
}

impl Reason {
    /// Every reason a waiting pod can have (all but [`Reason::NotWaiting`]), in order.
    pub const WAITING: [Reason; 12] = [
        Reason::Kueue,
        Reason::Quota,
        Reason::Gang,
        Reason::Selector,
        Reason::NoGpuCapacity,
        Reason::Capacity,
        Reason::Placement,
        Reason::Fragmentation,
        Reason::Unhealthy,
        Reason::Topology,
        Reason::Scheduling,
        Reason::Unknown,
    ];

    /// The name the CLI, the pod condition and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NotWaiting => "NotWaiting",
            Reason::Kueue => "Kueue",
            Reason::Quota => "Quota",
            Reason::Gang => "Gang",
            Reason::Selector => "Selector",
            Reason::NoGpuCapacity => "NoGPUCapacity",
            Reason::Capacity => "Capacity",
            Reason::Placement => "Placement",
            Reason::Fragmentation => "Fragmentation",
            Reason::Unhealthy => "Unhealthy",
            Reason::Topology => "Topology",
            Reason::Scheduling => "Scheduling",
            Reason::Unknown => "Unknown",
        }
    }

    /// The reason named `s` (as [`Reason::as_str`] writes it), e.g. from the pod condition.
    pub fn parse(s: &str) -> Option<Reason> {
        std::iter::once(Reason::NotWaiting)
            .chain(Reason::WAITING)
            .find(|r| r.as_str() == s)
    }
}

/// Where an answer came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "source", rename_all = "lowercase")]
pub enum Source {
    /// Classified from the cluster's state when asked.
    Computed,
    /// Read from the controller's condition [`GPUS_AVAILABLE`] on the pod (current within
    /// about two seconds, its message within the controller's refresh period). `since` is the
    /// condition's lastTransitionTime: when the controller first found the pod waiting.
    Controller { since: Option<String> },
}

/// One pod's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    pub namespace: String,
    pub pod: String,
    pub reason: Reason,
    pub message: String,
    #[serde(flatten)]
    pub source: Source,
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
    /// Pod groups by (namespace, group name).
    pub groups: BTreeMap<(String, String), gang::Members>,
    /// Gated units' queue positions by (namespace, unit key): (position, queue length).
    pub queues: BTreeMap<(String, String), (usize, usize)>,
    /// Kueue's Workloads and LocalQueues (empty where Kueue is not read).
    pub kueue: KueueView,
    /// Answers to claim requests already classified against this cluster, by request: pods
    /// made from one template ask the same, and each answer evaluates every published
    /// device's CEL (8,000 devices x 1,000 pods a cycle at 1,000 nodes without it).
    answers: claims::Answers,
    /// Answers to a resource ask under a placement (`resource_answer`), by both: pods of one
    /// workload ask alike, and each answer reads every node (5,000 Pending pods x 1,000 nodes
    /// a cycle without it).
    resource_answers: Mutex<HashMap<String, Option<(Reason, String)>>>,
}

/// Everything [`Cluster::new`] reads, as listed from the API server.
#[derive(Default)]
pub struct Listed {
    pub nodes: Vec<Node>,
    /// Pods bound to nodes, and the pods of the groups the explained pods belong to (pod
    /// groups are counted from them; other unbound pods are skipped).
    pub pods: Vec<Pod>,
    pub slices: Vec<ResourceSlice>,
    pub classes: Vec<DeviceClass>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    /// Kueue's Workloads and LocalQueues, where it runs.
    pub kueue: KueueView,
}

/// What [`Cluster::from_shared`] reads besides the catalog: the objects, or anything that
/// borrows them (a reflector store's `Arc`s), so a caller holding shared copies clones none.
pub struct Shared<'a, N, P, C, T> {
    pub nodes: &'a [N],
    /// Pods bound to nodes, and the pods of the groups the explained pods belong to (others
    /// may be present; they are skipped).
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
        let mut cluster = Cluster::from_shared(&shared, Arc::new(catalog));
        cluster.kueue = listed.kueue.clone();
        cluster
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
        let mut nodes = node_gpus(listed.nodes, listed.pods, &catalog);
        health::mark_unhealthy(&mut nodes, &catalog);
        Cluster {
            nodes,
            groups: gang::groups(listed.pods, &catalog),
            queues: queue::positions(listed.pods),
            kueue: KueueView::default(),
            taken: claims::taken(listed.claims),
            answers: claims::Answers::default(),
            resource_answers: Mutex::default(),
            templates: templates(listed.templates),
            catalog,
        }
    }
}

/// ResourceClaimTemplates' claim specs by (namespace, name).
fn templates<T: Borrow<ResourceClaimTemplate>>(
    templates: &[T],
) -> BTreeMap<(String, String), k8s_openapi::api::resource::v1::ResourceClaimSpec> {
    templates
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
        .collect()
}

/// Why `pod` is Pending.
pub fn explain(pod: &Pod, cluster: &Cluster) -> Explanation {
    let (reason, message) = classify(pod, cluster);
    Explanation {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        reason,
        message,
        source: Source::Computed,
    }
}

fn classify(pod: &Pod, cluster: &Cluster) -> (Reason, String) {
    // Borrowed: a cycle classifies every Pending GPU pod, thousands at scale.
    let none = PodSpec::default();
    let spec = pod.spec.as_ref().unwrap_or(&none);
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if let Some(answer) = topology::answer(pod, cluster) {
        return answer;
    }
    if let Some(node) = &spec.node_name {
        return (Reason::NotWaiting, format!("scheduled to node {node}"));
    }
    if phase.is_some_and(|p| p != "Pending") {
        return (Reason::NotWaiting, format!("phase {}", phase.unwrap_or("")));
    }
    if let Some(m) = crate::kueue::managed(pod).filter(|m| m.held) {
        return (Reason::Kueue, cluster.kueue.pod_message(pod, &m));
    }
    if gate_index(pod).is_some() {
        let note = quota_note(pod);
        if let Some(answer) = gang::answer(pod, cluster, note.as_deref()) {
            return answer;
        }
        let note = note.unwrap_or_else(|| "the quota controller has not decided on it yet".into());
        let at = queue_position(pod, cluster);
        return (Reason::Quota, format!("held by GPU quota{at}: {note}"));
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
        if let Some(answer) = cluster.resource_answer(spec, resource, ask) {
            return answer;
        }
    }
    if let Some(answer) = claims::answer(pod, cluster) {
        return answer;
    }
    if just_released(pod, spec) {
        return (
            Reason::Scheduling,
            "released from its scheduling gates; what it asks for is free on some node, and \
             the scheduler has not tried it since"
                .into(),
        );
    }
    (
        Reason::Unknown,
        format!(
            "what it asks for is free on some node; {}",
            scheduler_says(pod)
        ),
    )
}

/// Whether the pod was just released from its scheduling gates: its `PodScheduled` False
/// condition is still the `SchedulingGated` one the API server set while gates were on, though
/// none is left (it stays until the scheduler's first attempt).
fn just_released(pod: &Pod, spec: &PodSpec) -> bool {
    let gated = spec
        .scheduling_gates
        .as_ref()
        .is_some_and(|g| !g.is_empty());
    !gated
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("SchedulingGated")
            })
}

impl Cluster {
    /// [`resource_answer`], computed once per distinct ask and placement rules (what
    /// `placement::excluded_by` reads of the spec).
    fn resource_answer(
        &self,
        spec: &PodSpec,
        resource: &str,
        ask: u64,
    ) -> Option<(Reason, String)> {
        let required = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref());
        let rules = (&spec.tolerations, &spec.node_selector, required);
        let Ok(rules) = serde_json::to_string(&rules) else {
            return resource_answer(spec, resource, ask, &self.nodes);
        };
        let key = format!("{resource}\n{ask}\n{rules}");
        let mut memo = self
            .resource_answers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        memo.entry(key)
            .or_insert_with(|| resource_answer(spec, resource, ask, &self.nodes))
            .clone()
    }
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
    let down = down::plugin_down(nodes, resource);
    if offering.is_empty() {
        let why = match down.is_empty() {
            true => " (is the gpuplane agent running and registered on the GPU nodes?)".into(),
            false => format!(": {}", down::names(&down)),
        };
        return Some((
            Reason::NoGpuCapacity,
            format!("{needs}; no node offers {resource}{why}"),
        ));
    }
    let up: Vec<&NodeGpus> = offering.iter().copied().filter(|n| n.schedulable).collect();
    let total: u64 = up.iter().map(|n| n.free(resource)).sum();
    let free_text = format!("{total} free in the cluster");
    if let Some(answer) = down::verdict(&needs, total, ask, &free_text, &down) {
        return Some(answer);
    }
    if total < ask {
        if let Some(answer) = health::resource_answer(spec, &needs, resource, ask, &up) {
            return Some(answer);
        }
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

/// ", position P of N in namespace NS's queue" for a gated pod's unit, when the pod is among
/// those the cluster was read with.
fn queue_position(pod: &Pod, cluster: &Cluster) -> String {
    let (ns, key) = queue::unit_key(pod);
    match cluster.queues.get(&(ns.clone(), key)) {
        Some((at, of)) => format!(", position {at} of {of} in namespace {ns}'s queue"),
        None => String::new(),
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
