//! The controller's writes to pods (I/O): removing the admission gate, pod conditions
//! (`QuotaAdmitted`, the explainer's `gpuplane.dev/GPUsAvailable`), core/v1 Events, and
//! [`bounded`], which runs a cycle's writes a few at a time.
//!
//! The gate is removed with a JSON patch guarded by `test` operations on the pod's uid and on
//! the gate's position, so a pod re-created under the same name, or whose gates moved, is
//! never released by mistake: a failed test reads the pod again and, if it is the same pod
//! and still gated, tries once more at the gate's new position.

use super::pods::{self, PodRef, CONDITION};
use crate::quota::SCHEDULING_GATE;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use std::future::Future;
use tokio::task::JoinSet;

/// The component name on Events.
pub const COMPONENT: &str = "gpuplane-controller";

/// What became of a gate removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ungated {
    /// We removed the gate.
    Removed,
    /// The gate was already gone.
    AlreadyGone,
    /// The pod no longer exists (or is another pod now).
    PodGone,
}

fn is_code(e: &kube::Error, codes: &[u16]) -> bool {
    matches!(e, kube::Error::Api(s) if codes.contains(&s.code))
}

fn gate_patch(uid: &str, index: usize) -> Result<json_patch::Patch, serde_json::Error> {
    serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "test", "path": format!("/spec/schedulingGates/{index}/name"), "value": SCHEDULING_GATE},
        {"op": "remove", "path": format!("/spec/schedulingGates/{index}")},
    ]))
}

fn patch_error(e: serde_json::Error) -> kube::Error {
    kube::Error::SerdeError(e)
}

/// Removes the admission gate from `pod`.
pub async fn ungate(api: &Api<Pod>, pod: &PodRef) -> Result<Ungated, kube::Error> {
    let mut index = pod.gate_index;
    for attempt in 0..2 {
        let Some(i) = index else {
            return Ok(Ungated::AlreadyGone);
        };
        let patch = gate_patch(&pod.uid, i).map_err(patch_error)?;
        match api
            .patch(
                &pod.name,
                &PatchParams::default(),
                &Patch::Json::<()>(patch),
            )
            .await
        {
            Ok(_) => return Ok(Ungated::Removed),
            Err(e) if is_code(&e, &[404]) => return Ok(Ungated::PodGone),
            Err(e) if is_code(&e, &[409, 422]) && attempt == 0 => {
                let Some(now) = api.get_opt(&pod.name).await? else {
                    return Ok(Ungated::PodGone);
                };
                if now.metadata.uid.as_deref() != Some(pod.uid.as_str()) {
                    return Ok(Ungated::PodGone);
                }
                index = pods::gate_index(&now);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Ungated::AlreadyGone)
}

/// A pod condition to set.
#[derive(Debug, Clone, Copy)]
pub struct Condition<'a> {
    /// Its `type`, e.g. `QuotaAdmitted`.
    pub type_: &'a str,
    pub status: bool,
    pub reason: &'a str,
    pub message: &'a str,
}

/// Sets condition `c` on pod `name` (strategic merge: merged by `type` upstream, so the
/// scheduler's and kubelet's conditions stay). `previous` is the status the pod shows now for
/// that type: `lastTransitionTime` is written only when the status flips. A pod that is gone
/// is not an error.
pub async fn set_pod_condition(
    api: &Api<Pod>,
    name: &str,
    previous: Option<&str>,
    c: Condition<'_>,
) -> Result<(), kube::Error> {
    let status = if c.status { "True" } else { "False" };
    let mut cond = json!({
        "type": c.type_,
        "status": status,
        "reason": c.reason,
        "message": c.message,
    });
    if previous != Some(status) {
        cond["lastTransitionTime"] = json!(Timestamp::now().to_string());
    }
    let body = json!({"status": {"conditions": [cond]}});
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Strategic(body))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if is_code(&e, &[404]) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Sets the pod's `QuotaAdmitted` condition.
pub async fn set_condition(
    api: &Api<Pod>,
    pod: &PodRef,
    admitted: bool,
    reason: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let previous = pod.condition.as_ref().map(|(_, s, _)| s.as_str());
    let c = Condition {
        type_: CONDITION,
        status: admitted,
        reason,
        message,
    };
    set_pod_condition(api, &pod.name, previous, c).await
}

/// Records a core/v1 Event about `pod`.
pub async fn event(
    api: &Api<Event>,
    pod: &PodRef,
    warning: bool,
    reason: &str,
    message: &str,
    instance: &str,
) -> Result<(), kube::Error> {
    let about = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: Some(pod.uid.clone()),
        ..ObjectReference::default()
    };
    let note = Note {
        warning,
        reason,
        message,
        action: "Queue",
    };
    event_about(api, about, note, instance).await
}

/// What an Event says.
pub struct Note<'a> {
    pub warning: bool,
    pub reason: &'a str,
    pub message: &'a str,
    /// What the controller did (`Queue`, `Expire`).
    pub action: &'a str,
}

/// Records a core/v1 Event about any object of the namespace `api` is for.
pub async fn event_about(
    api: &Api<Event>,
    about: ObjectReference,
    note: Note<'_>,
    instance: &str,
) -> Result<(), kube::Error> {
    let now = Timestamp::now();
    let ev = Event {
        metadata: ObjectMeta {
            name: Some(format!(
                "{}.{:x}",
                about.name.as_deref().unwrap_or("object"),
                now.as_nanosecond()
            )),
            namespace: about.namespace.clone(),
            ..ObjectMeta::default()
        },
        involved_object: about,
        reason: Some(note.reason.into()),
        message: Some(note.message.into()),
        type_: Some(if note.warning { "Warning" } else { "Normal" }.into()),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: None,
        }),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(instance.into()),
        action: Some(note.action.into()),
        ..Event::default()
    };
    api.create(&PostParams::default(), &ev).await.map(|_| ())
}

/// Runs `f` over `items` with at most `limit` in flight; results in completion order.
pub async fn bounded<T, R, F, Fut>(limit: usize, items: Vec<T>, f: F) -> Vec<R>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let mut set = JoinSet::new();
    let mut out = Vec::with_capacity(items.len());
    let mut items = items.into_iter();
    loop {
        while set.len() < limit.max(1) {
            match items.next() {
                Some(t) => {
                    set.spawn(f(t));
                }
                None => break,
            }
        }
        match set.join_next().await {
            Some(Ok(r)) => out.push(r),
            Some(Err(e)) => tracing::warn!(error = %e, "a write task failed"),
            None => break,
        }
    }
    out
}
