//! Placement (pure): whether a pod may land on a node by Kubernetes' rules for what the
//! explainer reads of it: taints the pod does not tolerate (NoSchedule, NoExecute), its
//! nodeSelector and its required node affinity (labels and the `metadata.name` field). The
//! toleration rule is also what device taints are matched with (`devices.rs`).

use super::NodeGpus;
use k8s_openapi::api::core::v1::{
    NodeSelectorRequirement, NodeSelectorTerm, PodSpec, Taint, Toleration,
};
use std::collections::BTreeMap;

/// Why the pod may not land on `node`, if it may not: an untolerated taint, or a node selector
/// or required node affinity the node's labels do not satisfy.
pub(super) fn excluded_by(spec: &PodSpec, node: &NodeGpus) -> Option<String> {
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
pub(super) fn tolerates(o: &Toleration, t: &Taint) -> bool {
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
