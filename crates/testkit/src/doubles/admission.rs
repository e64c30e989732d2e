//! What the API server sends an admission webhook, for the demo, tests and benches that stand
//! in for it.

use serde_json::{json, Value};

/// An AdmissionReview v1 for creating `pod` in its namespace (by user `alice`), as the API
/// server sends it.
pub fn pod_create_review(uid: &str, pod: &Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

/// An AdmissionReview v1 for creating the ResourceClaim `claim` in its namespace (by user
/// `alice`), as the API server sends it.
pub fn claim_create_review(uid: &str, claim: &Value) -> Value {
    let mut review = pod_create_review(uid, claim);
    let kind = json!({"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"});
    let resource =
        json!({"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"});
    let r = &mut review["request"];
    r["kind"] = kind.clone();
    r["requestKind"] = kind;
    r["resource"] = resource.clone();
    r["requestResource"] = resource;
    review
}
