//! Pods that name a ResourceClaimTemplate not created yet (pure): what the webhooks and the
//! controller decide for them.
//!
//! Plain Kubernetes lets such a pod wait for its template (`kubectl apply -f dir/` in any
//! order, GitOps). Quota cannot price the pod yet, so it is admitted *gated*
//! ([`crate::quota::SCHEDULING_GATE`]) and charged nothing: a gated pod is never scheduled, its
//! claims are never allocated, so it holds no devices and exactness holds. Once the template
//! exists the controller prices the pod as the webhook would and releases it when it fits.
//! A pod that arrives ungated (the mutating webhook was away, or `spec.nodeName` is set) is
//! denied, as before: fail closed.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use std::collections::BTreeMap;

use super::charge::pod_template_names;

/// The templates `pod` names that are not in `templates` (not created yet), sorted.
pub fn missing_templates(
    pod: &Pod,
    templates: &BTreeMap<String, ResourceClaimSpec>,
) -> Vec<String> {
    pod_template_names(pod)
        .into_iter()
        .filter(|t| !templates.contains_key(t))
        .collect()
}

fn names(namespace: &str, missing: &[String]) -> String {
    let list: Vec<String> = missing.iter().map(|t| format!("{namespace}/{t}")).collect();
    format!("ResourceClaimTemplate {}", list.join(", "))
}

/// What a gated pod waiting for its templates is told (admission warning and pod condition).
pub fn waiting_message(namespace: &str, missing: &[String]) -> String {
    format!(
        "waiting for {} to be created: GPU quota charges the pod and releases it once it exists",
        names(namespace, missing)
    )
}

/// Why an ungated pod naming missing templates is denied.
pub fn ungated_denial(namespace: &str, missing: &[String]) -> String {
    format!(
        "{} not found, and the pod arrived without the scheduling gate that holds such a pod until \
         its template exists (the mutating webhook was not reached, or spec.nodeName is set); \
         create the template first, or create the pod again",
        names(namespace, missing)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c"}], "resourceClaims": [
                {"name": "a", "resourceClaimTemplateName": "gpu"},
                {"name": "b", "resourceClaimTemplateName": "mig"},
                {"name": "c", "resourceClaimName": "shared"}]}
        }))
        .unwrap()
    }

    #[test]
    fn only_templates_not_created_yet_are_missing() {
        let mut templates = BTreeMap::new();
        assert_eq!(missing_templates(&pod(), &templates), ["gpu", "mig"]);
        templates.insert("gpu".to_string(), ResourceClaimSpec::default());
        assert_eq!(missing_templates(&pod(), &templates), ["mig"]);
        templates.insert("mig".to_string(), ResourceClaimSpec::default());
        assert!(missing_templates(&pod(), &templates).is_empty());
    }

    #[test]
    fn messages_name_every_missing_template_with_its_namespace() {
        let missing = ["gpu".to_string(), "mig".to_string()];
        assert_eq!(
            waiting_message("team-a", &missing),
            "waiting for ResourceClaimTemplate team-a/gpu, team-a/mig to be created: GPU quota \
             charges the pod and releases it once it exists"
        );
        assert!(ungated_denial("team-a", &missing[..1]).starts_with(
            "ResourceClaimTemplate team-a/gpu not found, and the pod arrived without"
        ));
    }
}
