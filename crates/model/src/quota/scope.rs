//! What the quota governs (pure): the rule that decides which pods the webhooks receive (their
//! CEL `matchConditions` in daemonset/controller/webhooks.yaml) and which pods the controller
//! caches. One rule in two languages; tests/it/manifests.rs checks the CEL against the same cases.
//!
//! A pod is governed when a container or init container names an `nvidia.com/*` resource in its
//! requests or limits, or the pod references ResourceClaims. Both are immutable after creation,
//! so a pod outside the rule can never come into it and need never be watched.

use k8s_openapi::api::core::v1::{Container, Pod};

/// The resource-name prefix of every GPU device-plugin resource (`nvidia.com/gpu`,
/// `nvidia.com/mig-<profile>`, time-sliced `nvidia.com/gpu.shared`).
pub const GPU_RESOURCE_PREFIX: &str = "nvidia.com/";

/// Whether the quota governs `pod`.
pub fn governs_pod(pod: &Pod) -> bool {
    claims_or_names(pod, |k| k.starts_with(GPU_RESOURCE_PREFIX))
}

/// Whether `pod` references ResourceClaims, or a container or init container names a
/// resource that `name` accepts in its requests or limits.
pub fn claims_or_names(pod: &Pod, name: impl Fn(&str) -> bool) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    let names = |c: &Container| {
        c.resources.as_ref().is_some_and(|r| {
            r.requests
                .iter()
                .chain(r.limits.iter())
                .flat_map(|m| m.keys())
                .any(|k| name(k))
        })
    };
    spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty())
        || spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .any(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[test]
    fn gpu_pods_and_claim_pods_are_governed_others_not() {
        let gpu = json!({"limits": {"nvidia.com/gpu": "1"}});
        let cpu = json!({"requests": {"cpu": "1"}});
        assert!(governs_pod(&pod(
            json!({"containers": [{"name": "a", "resources": gpu}]})
        )));
        assert!(governs_pod(&pod(
            json!({"containers": [{"name": "a", "resources": cpu}], "initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]})
        )));
        assert!(governs_pod(&pod(
            json!({"containers": [{"name": "a"}], "resourceClaims": [{"name": "g", "resourceClaimName": "c"}]})
        )));
        assert!(!governs_pod(&pod(
            json!({"containers": [{"name": "a", "resources": cpu}]})
        )));
        assert!(!governs_pod(&pod(
            json!({"containers": [{"name": "a", "resources": {"limits": {"example.com/fpga": "1"}}}], "resourceClaims": []})
        )));
        assert!(!governs_pod(&Pod::default()));
    }
}
