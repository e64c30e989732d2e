//! The quota webhooks' configurations (match conditions, namespace selectors) send them only the
//! requests they govern.

use super::*;

/// Whether the API server would send `object` to `webhook`: every matchCondition true, none
/// failing to evaluate (an error would apply the failure policy, e.g. deny a pod that has
/// nothing to do with GPUs). Evaluated with the `cel` crate plus Kubernetes' CEL library
/// (kube-cel), binding `object` and `request` as the API server does, map keys as they are.
/// (kube-cel's own VAP evaluator escapes every key, `nvidia__dot__com__slash__gpu`, which the
/// API server does only for schema property names, never for map keys like resource names.)
fn sent_to(
    webhook: &str,
    conditions: &[admission::MatchCondition],
    resource: &str,
    object: &Value,
) -> bool {
    use kube_cel::{cel, KubeCelExt};
    let mut ctx = cel::Context::default().with_all();
    let group = if resource == "pods" {
        ""
    } else {
        "resource.k8s.io"
    };
    let request = json!({
        "operation": "CREATE", "namespace": "team-a",
        "resource": {"group": group, "version": "v1", "resource": resource},
    });
    ctx.add_variable("object", object).unwrap();
    ctx.add_variable("request", &request).unwrap();
    let mut sent = true;
    for c in conditions {
        let program = cel::Program::compile(&c.expression)
            .unwrap_or_else(|e| panic!("{webhook}: condition {} does not compile: {e}", c.name));
        match program.execute(&ctx) {
            Ok(cel::Value::Bool(b)) => sent &= b,
            other => panic!(
                "{webhook}: condition {} does not evaluate to a bool for {object}: {other:?}",
                c.name
            ),
        }
    }
    sent
}

fn pod_asking(containers: Value, init: Option<Value>, claims: bool) -> Value {
    let mut spec = json!({"containers": containers});
    if let Some(i) = init {
        spec["initContainers"] = i;
    }
    if claims {
        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"}, "spec": spec})
}

fn claim_of(requests: Value) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "c", "namespace": "team-a"}, "spec": {"devices": {"requests": requests}}})
}

#[test]
fn the_quota_webhooks_receive_only_what_they_govern() {
    let docs = docs();
    let validating: admission::ValidatingWebhookConfiguration = typed(
        find(
            &docs,
            "ValidatingWebhookConfiguration",
            None,
            "gpuplane-quota",
        )
        .unwrap(),
    );
    let mutating: admission::MutatingWebhookConfiguration = typed(
        find(
            &docs,
            "MutatingWebhookConfiguration",
            None,
            "gpuplane-quota",
        )
        .unwrap(),
    );
    let quota = validating
        .webhooks
        .iter()
        .flatten()
        .find(|w| w.name == "quota.gpuplane.dev")
        .unwrap();
    let gate = mutating
        .webhooks
        .iter()
        .flatten()
        .find(|w| w.name == "gate.quota.gpuplane.dev")
        .unwrap();
    // Outside Queue mode: gates a pod whose ResourceClaimTemplate is not created yet.
    let template_gate = mutating
        .webhooks
        .iter()
        .flatten()
        .find(|w| w.name == "template-gate.quota.gpuplane.dev")
        .unwrap();
    for (what, pod, want) in &pods_to_send() {
        pod_sent_where_governed(quota, gate, template_gate, what, pod, *want);
    }
    claims_sent_where_governed(quota);
    // Failure policies: enforcement fails closed (GPU requests only reach it), the gate open.
    assert_eq!(quota.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(gate.failure_policy.as_deref(), Some("Ignore"));
    assert_eq!(template_gate.failure_policy.as_deref(), Some("Ignore"));
    let named_claim = pod_asking(json!([{"name": "m"}]), None, false);
    let mut named_claim = named_claim;
    named_claim["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "c"}]);
    let t = template_gate
        .match_conditions
        .as_deref()
        .unwrap_or_default();
    assert!(!sent_to(&template_gate.name, t, "pods", &named_claim));
    every_webhook_honours_the_opt_out(&validating, &mutating);
    namespaces_select_the_webhooks(quota, gate, template_gate);
}

/// Pods, and whether the quota webhooks govern them (GPUs in any container, or a claim
/// template) or not (CPU and memory only, no resources, another vendor's device).
fn pods_to_send() -> [(&'static str, Value, bool); 8] {
    let gpu = json!({"limits": {"nvidia.com/gpu": "1"}});
    let cpu = json!({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}});
    [
        (
            "a pod with nvidia.com/gpu limits",
            pod_asking(json!([{"name": "m", "resources": gpu}]), None, false),
            true,
        ),
        (
            "a pod with a MIG request only",
            pod_asking(
                json!([{"name": "m", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]),
                None,
                false,
            ),
            true,
        ),
        (
            "a pod whose GPU is in an init container",
            pod_asking(
                json!([{"name": "m"}]),
                Some(json!([{"name": "i", "resources": gpu}])),
                false,
            ),
            true,
        ),
        (
            "a pod in the second of two containers",
            pod_asking(
                json!([{"name": "a", "resources": cpu}, {"name": "b", "resources": gpu}]),
                None,
                false,
            ),
            true,
        ),
        (
            "a pod referencing a ResourceClaimTemplate",
            pod_asking(json!([{"name": "m"}]), None, true),
            true,
        ),
        (
            "a pod with CPU and memory only",
            pod_asking(
                json!([{"name": "m", "resources": cpu}]),
                Some(json!([{"name": "i", "resources": cpu}])),
                false,
            ),
            false,
        ),
        (
            "a pod without resources",
            pod_asking(
                json!([{"name": "m"}, {"name": "n", "resources": {}}]),
                None,
                false,
            ),
            false,
        ),
        (
            "a pod with another vendor's device",
            pod_asking(
                json!([{"name": "m", "resources": {"limits": {"example.com/fpga": "1"}}}]),
                None,
                false,
            ),
            false,
        ),
    ]
}

/// `pod` (`what`) reaches the validating webhook and the gate exactly when governed (`want`),
/// the template gate exactly when it names a template, and the controller caches it likewise.
fn pod_sent_where_governed(
    quota: &admission::ValidatingWebhook,
    gate: &admission::MutatingWebhook,
    template_gate: &admission::MutatingWebhook,
    what: &str,
    pod: &Value,
    want: bool,
) {
    let q = quota.match_conditions.as_deref().unwrap_or_default();
    assert_eq!(
        sent_to(&quota.name, q, "pods", pod),
        want,
        "validating: {what}"
    );
    let g = gate.match_conditions.as_deref().unwrap_or_default();
    assert_eq!(
        sent_to(&gate.name, g, "pods", pod),
        want,
        "mutating: {what}"
    );
    // Only pods that name a template; every such pod is governed.
    let t = template_gate
        .match_conditions
        .as_deref()
        .unwrap_or_default();
    let names_template = pod["spec"]["resourceClaims"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["resourceClaimTemplateName"].is_string()));
    assert_eq!(
        sent_to(&template_gate.name, t, "pods", pod),
        names_template,
        "template gate: {what}"
    );
    // The controller caches exactly the pods the webhooks receive.
    let typed: core::Pod = serde_json::from_value(pod.clone()).unwrap();
    assert_eq!(
        gpuplane_model::quota::governs_pod(&typed),
        want,
        "controller cache: {what}"
    );
}

/// Claims reach the validating webhook exactly when they ask for a GPU class.
fn claims_sent_where_governed(quota: &admission::ValidatingWebhook) {
    let claims = [
        (
            "a claim of gpu.gpuplane.dev",
            claim_of(json!([{"name": "g", "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}])),
            true,
        ),
        (
            "a claim of NVIDIA's class",
            claim_of(json!([{"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com"}}])),
            true,
        ),
        (
            "a prioritized list ending in a MIG class",
            claim_of(
                json!([{"name": "g", "firstAvailable": [{"name": "a", "deviceClassName": "nic.example.com"}, {"name": "b", "deviceClassName": "mig-1g.gpuplane.dev"}]}]),
            ),
            true,
        ),
        (
            "a claim of a NIC class",
            claim_of(json!([{"name": "n", "exactly": {"deviceClassName": "nic.example.com"}}])),
            false,
        ),
    ];
    for (what, claim, want) in &claims {
        let q = quota.match_conditions.as_deref().unwrap_or_default();
        assert_eq!(
            sent_to(&quota.name, q, "resourceclaims", claim),
            *want,
            "validating: {what}"
        );
    }
}

/// Every webhook honours the namespace opt-out label.
fn every_webhook_honours_the_opt_out(
    validating: &admission::ValidatingWebhookConfiguration,
    mutating: &admission::MutatingWebhookConfiguration,
) {
    let selectors = validating
        .webhooks
        .iter()
        .flatten()
        .map(|w| w.namespace_selector.clone())
        .chain(
            mutating
                .webhooks
                .iter()
                .flatten()
                .map(|w| w.namespace_selector.clone()),
        );
    for sel in selectors {
        let exprs = sel.and_then(|s| s.match_expressions).unwrap_or_default();
        assert!(
            exprs.iter().any(|e| e.key == "quota.gpuplane.dev/exempt"
                && e.operator == "NotIn"
                && e.values.as_deref() == Some(&["true".to_string()][..])),
            "{exprs:?}"
        );
    }
}

/// The gate is called only where the controller put the queue label; enforcement everywhere
/// in scope.
fn namespaces_select_the_webhooks(
    quota: &admission::ValidatingWebhook,
    gate: &admission::MutatingWebhook,
    template_gate: &admission::MutatingWebhook,
) {
    let ns = |name: &str, extra: &[(&str, &str)]| {
        let mut l = BTreeMap::from([("kubernetes.io/metadata.name".to_string(), name.to_string())]);
        l.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        l
    };
    let queue = ("quota.gpuplane.dev/queue", "true");
    let exempt = ("quota.gpuplane.dev/exempt", "true");
    for (what, labels, validated, gated) in [
        ("a namespace", ns("team-a", &[]), true, false),
        ("a Queue-mode namespace", ns("team-q", &[queue]), true, true),
        (
            "another value",
            ns("team-q", &[("quota.gpuplane.dev/queue", "yes")]),
            true,
            false,
        ),
        (
            "an exempt one",
            ns("team-q", &[queue, exempt]),
            false,
            false,
        ),
        ("kube-system", ns("kube-system", &[queue]), false, false),
        ("the controller's", ns(NS, &[queue]), false, false),
    ] {
        assert_eq!(
            selects(quota.namespace_selector.as_ref(), &labels),
            validated,
            "validating: {what}"
        );
        assert_eq!(
            selects(gate.namespace_selector.as_ref(), &labels),
            gated,
            "mutating: {what}"
        );
        // Exactly one of the two gates is called where the validating webhook is.
        assert_eq!(
            selects(template_gate.namespace_selector.as_ref(), &labels),
            validated && !gated,
            "template gate: {what}"
        );
    }
}
