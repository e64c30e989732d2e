//! The idle Event: a hold idle for the whole window (`super::rounds` finds it) gets one Event
//! on its pod, with the numbers.
//!
//! One Event per pod and device, also across agent restarts: its name is derived from the pod
//! and the device, so the API server refuses a second one (`AlreadyExists`) rather than the
//! agent keeping a record.

use super::idle::{idle_note, HeldUse};
use super::pods::PodDirectory;
use crate::kube_events::Reporter;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::time::Duration;

/// The Event's reason.
pub const REASON: &str = "GpuIdle";

/// Where idle Events go: the API, as the driver on this node.
#[derive(Clone)]
pub struct IdleEvents {
    pub client: kube::Client,
    pub driver: String,
    pub node: String,
}

/// The Event for `u` idle `idle_for` on pod `uid`; `None` for a hold without a pod. Pure.
pub fn idle_event(
    u: &HeldUse,
    idle_for: Duration,
    uid: &str,
    reporter: Reporter<'_>,
    now: Timestamp,
) -> Option<Event> {
    if u.holder.pod.is_empty() {
        return None;
    }
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(u.holder.namespace.clone()),
        name: Some(u.holder.pod.clone()),
        uid: Some(uid.into()),
        ..ObjectReference::default()
    };
    // `<pod>.gpu-idle.<device>`: a DNS subdomain, the same for the same pod and device.
    let pod: String = u.holder.pod.chars().take(150).collect();
    let device = u.device.uuid.to_ascii_lowercase();
    let name = format!("{pod}.gpu-idle.{device}");
    let note = idle_note(u, idle_for);
    Some(reporter.event(name, regarding, ("MonitorGpu", REASON), &note, now))
}

/// Posts the idle Event of `u`; an Event already there (posted by an earlier agent) is fine.
pub(super) async fn post(
    events: &IdleEvents,
    pods: &PodDirectory,
    u: &HeldUse,
    idle_for: Duration,
) {
    let Some(uid) = pods.uid_of(&u.holder.namespace, &u.holder.pod) else {
        tracing::debug!(pod = %u.holder.pod, "idle device's pod not known yet; no Event");
        return;
    };
    let reporter = Reporter {
        driver: &events.driver,
        node: &events.node,
    };
    let Some(event) = idle_event(u, idle_for, &uid, reporter, Timestamp::now()) else {
        return;
    };
    let api: Api<Event> = Api::namespaced(events.client.clone(), &u.holder.namespace);
    match tokio::time::timeout(
        Duration::from_secs(30),
        api.create(&PostParams::default(), &event),
    )
    .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(kube::Error::Api(e))) if e.code == 409 => {}
        Ok(Err(e)) => {
            tracing::warn!(pod = %u.holder.pod, error = %e, "posting the idle GPU Event failed")
        }
        Err(_) => tracing::warn!(pod = %u.holder.pod, "posting the idle GPU Event got no answer"),
    }
}
