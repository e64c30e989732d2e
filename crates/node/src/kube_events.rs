//! The `events.k8s.io/v1` Events the agent posts (failures on claims, idle GPUs on pods): one
//! shape, reported by the driver name on this node. Pure.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

/// Who reports an Event: the driver name (reporting controller) on a node (instance).
#[derive(Debug, Clone, Copy)]
pub struct Reporter<'a> {
    pub driver: &'a str,
    pub node: &'a str,
}

impl Reporter<'_> {
    /// A Warning Event `name` regarding `regarding` (whose namespace it lives in), for
    /// `(action, reason)`. Pure.
    pub fn event(
        &self,
        name: String,
        regarding: ObjectReference,
        (action, reason): (&str, &str),
        note: &str,
        now: Timestamp,
    ) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: regarding.namespace.clone(),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some("Warning".into()),
            reason: Some(reason.into()),
            action: Some(action.into()),
            note: Some(note.into()),
            regarding: Some(regarding),
            reporting_controller: Some(self.driver.into()),
            reporting_instance: Some(self.node.into()),
            ..Event::default()
        }
    }
}
