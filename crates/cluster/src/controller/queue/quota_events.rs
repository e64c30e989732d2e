//! Events about GpuQuotas that a namespace's decision asks for (a temporary raise that
//! expired), recorded once the quota's status says so.

use super::{Decision, QueueLoop};
use crate::controller::writes;
use crate::quota::crd::API_VERSION;
use k8s_openapi::api::core::v1::{Event as CoreEvent, ObjectReference};
use kube::api::Api;

impl QueueLoop {
    /// Records the decision's Events about quotas (a temporary raise that expired), now that
    /// their status says so. Best effort, like every Event.
    pub(super) async fn quota_events(&self, ns: &str, decision: &Decision) {
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), ns);
        for (name, reason, message) in &decision.quota_events {
            let uid = decision
                .quotas
                .iter()
                .find(|(q, _)| q.metadata.name.as_ref() == Some(name))
                .and_then(|(q, _)| q.metadata.uid.clone());
            let about = ObjectReference {
                api_version: Some(API_VERSION.into()),
                kind: Some("GpuQuota".into()),
                name: Some(name.clone()),
                namespace: Some(ns.into()),
                uid,
                ..ObjectReference::default()
            };
            let note = writes::Note {
                warning: false,
                reason,
                message,
                action: "Expire",
            };
            if let Err(e) = writes::event_about(&events, about, note, &self.opts.instance).await {
                tracing::warn!(quota = %format!("{ns}/{name}"), error = %e, "could not record an Event");
            }
        }
    }
}
