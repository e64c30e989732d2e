//! The controller's answer kept on the pod: the condition [`GPUS_AVAILABLE`] the explainer
//! writes on every waiting GPU pod. Reading it back answers "why Pending" from the pod alone,
//! without the cluster-wide lists a computed answer needs.

use super::{refused_by_kubelet, Explanation, Reason, Source};
use k8s_openapi::api::core::v1::Pod;

/// The pod condition the controller's explainer keeps: False while the pod waits for a GPU
/// (reason and message as [`Explanation`]), True once it is scheduled.
pub const GPUS_AVAILABLE: &str = "gpuplane.dev/GPUsAvailable";

/// The controller's answer on `pod`: its [`GPUS_AVAILABLE`] condition when False with a reason
/// this version knows, on a pod that still waits (Pending and unscheduled, or refused by the
/// kubelet for NUMA alignment). `None` otherwise: the answer must be computed.
pub fn from_condition(pod: &Pod) -> Option<Explanation> {
    let status = pod.status.as_ref()?;
    let unscheduled = pod.spec.as_ref().is_none_or(|s| s.node_name.is_none());
    let pending = status.phase.as_deref() == Some("Pending") && unscheduled;
    if !pending && !refused_by_kubelet(pod) {
        return None;
    }
    let c = status
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GPUS_AVAILABLE && c.status == "False")?;
    let reason = c
        .reason
        .as_deref()
        .and_then(Reason::parse)
        .filter(|r| *r != Reason::NotWaiting)?;
    Some(Explanation {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        reason,
        message: c.message.clone().unwrap_or_default(),
        source: Source::Controller {
            since: c.last_transition_time.as_ref().map(|t| t.0.to_string()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(status: serde_json::Value, node: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": "team-a", "name": "p"},
            "spec": {"containers": [], "nodeName": node},
            "status": status,
        }))
        .unwrap()
    }

    fn cond(status: &str, reason: &str) -> serde_json::Value {
        json!({"type": GPUS_AVAILABLE, "status": status, "reason": reason,
            "message": "needs 4 nvidia.com/gpu; 2 free in the cluster",
            "lastTransitionTime": "2026-12-03T11:00:00Z"})
    }

    #[test]
    fn every_reason_round_trips_through_its_name() {
        let all = std::iter::once(Reason::NotWaiting).chain(Reason::WAITING);
        for r in all {
            assert_eq!(Reason::parse(r.as_str()), Some(r), "{r:?}");
        }
        assert_eq!(Reason::parse("Scheduled"), None);
        assert_eq!(Reason::parse("capacity"), None);
    }

    #[test]
    fn a_waiting_pod_is_answered_from_its_false_condition() {
        let p = pod(
            json!({"phase": "Pending", "conditions": [cond("False", "Capacity")]}),
            None,
        );
        let e = from_condition(&p).unwrap();
        assert_eq!((e.pod.as_str(), e.reason), ("p", Reason::Capacity));
        assert_eq!(e.message, "needs 4 nvidia.com/gpu; 2 free in the cluster");
        let since = Some("2026-12-03T11:00:00Z".to_string());
        assert_eq!(e.source, Source::Controller { since });
        let out = serde_json::to_value(&e).unwrap();
        assert_eq!(
            (&out["source"], &out["since"], &out["reason"]),
            (
                &json!("controller"),
                &json!("2026-12-03T11:00:00Z"),
                &json!("Capacity")
            )
        );
    }

    #[test]
    fn a_refused_pod_is_answered_from_its_topology_condition() {
        let status = json!({"phase": "Failed", "reason": "TopologyAffinityError",
            "conditions": [cond("False", "Topology")]});
        let e = from_condition(&pod(status, Some("node-a"))).unwrap();
        assert_eq!(e.reason, Reason::Topology);
    }

    #[test]
    fn anything_else_is_left_to_compute() {
        let cases = [
            // No condition, a True one, a reason this version does not know.
            (json!({"phase": "Pending"}), None),
            (
                json!({"phase": "Pending", "conditions": [cond("True", "Scheduled")]}),
                None,
            ),
            (
                json!({"phase": "Pending", "conditions": [cond("False", "Newer")]}),
                None,
            ),
            // Scheduled or running while the condition still says False.
            (
                json!({"phase": "Pending", "conditions": [cond("False", "Capacity")]}),
                Some("node-a"),
            ),
            (
                json!({"phase": "Running", "conditions": [cond("False", "Capacity")]}),
                None,
            ),
        ];
        for (status, node) in cases {
            let p = pod(status.clone(), node);
            assert_eq!(from_condition(&p), None, "{status} on {node:?}");
        }
    }
}
