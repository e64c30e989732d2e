//! What the controller reads from a Pod (pure): its gate, group, queue position, whether it
//! holds quota, and the `QuotaAdmitted` condition it carries.

use crate::quota::SCHEDULING_GATE;
use k8s_openapi::api::core::v1::Pod;
use std::time::SystemTime;

/// Label naming a pod's group; all members are released together.
pub const GROUP_LABEL: &str = "quota.gpuplane.dev/pod-group";
/// Annotation giving the number of members a group needs before any is released.
pub const GROUP_SIZE_ANNOTATION: &str = "quota.gpuplane.dev/pod-group-size";
/// The pod condition the controller keeps on queued pods.
pub const CONDITION: &str = "QuotaAdmitted";

/// A pod as the queue needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// Position of the admission gate in `spec.schedulingGates` (for a guarded JSON patch).
    pub gate_index: Option<usize>,
    /// The `QuotaAdmitted` condition: its position in `status.conditions`, status and message.
    pub condition: Option<(usize, String, String)>,
}

impl PodRef {
    pub fn of(pod: &Pod) -> PodRef {
        PodRef {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            gate_index: gate_index(pod),
            condition: condition(pod),
        }
    }
}

/// Where our scheduling gate is, if the pod has it.
pub fn gate_index(pod: &Pod) -> Option<usize> {
    pod.spec
        .as_ref()?
        .scheduling_gates
        .as_ref()?
        .iter()
        .position(|g| g.name == SCHEDULING_GATE)
}

fn condition(pod: &Pod) -> Option<(usize, String, String)> {
    let conds = pod.status.as_ref()?.conditions.as_ref()?;
    conds
        .iter()
        .enumerate()
        .find(|(_, c)| c.type_ == CONDITION)
        .map(|(i, c)| (i, c.status.clone(), c.message.clone().unwrap_or_default()))
}

/// Succeeded or Failed: holds nothing any more.
pub fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

pub fn is_deleting(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// Created, not finished and not waiting at our scheduling gate: its charge counts in
/// `status.used`, scheduled or not (as Kubernetes' ResourceQuota counts every non-terminal
/// pod), so its reservation can go as soon as the controller sees it. A pod at the gate is
/// queued (or admitted and about to be ungated): its reservation speaks for it.
pub fn is_counted(pod: &Pod) -> bool {
    !is_terminal(pod) && gate_index(pod).is_none()
}

/// Waiting for the controller: has our gate and is not being deleted.
pub fn is_queued(pod: &Pod) -> bool {
    gate_index(pod).is_some() && !is_deleting(pod) && !is_terminal(pod)
}

pub fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

pub fn created(pod: &Pod) -> SystemTime {
    pod.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| SystemTime::from(t.0))
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// When the kubelet started the pod (`status.startTime`); `None` while it has not.
pub fn started(pod: &Pod) -> Option<SystemTime> {
    pod.status
        .as_ref()?
        .start_time
        .as_ref()
        .map(|t| SystemTime::from(t.0))
}

/// A queue unit's key, as notes and the queue's order name it: "pod NS/NAME".
pub fn pod_key(namespace: &str, name: &str) -> String {
    format!("pod {namespace}/{name}")
}

/// A pod group's unit key: "pod group NS/GROUP".
pub fn group_key(namespace: &str, group: &str) -> String {
    format!("pod group {namespace}/{group}")
}

/// The pod's group: its name and the size its annotation asks for (`Err` with the bad text
/// when the annotation is missing or not a positive number).
pub fn group(pod: &Pod) -> Option<(String, Result<u32, String>)> {
    let name = pod.metadata.labels.as_ref()?.get(GROUP_LABEL)?.clone();
    let raw = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GROUP_SIZE_ANNOTATION));
    let size = match raw {
        Some(s) => s
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                format!("annotation {GROUP_SIZE_ANNOTATION}={s:?} is not a positive number")
            }),
        None => Err(format!("annotation {GROUP_SIZE_ANNOTATION} is missing")),
    };
    Some((name, size))
}
