//! The shipped GpuQuota CRD's validation refuses what it must.

use super::*;

/// The schema of `spec` in the shipped GpuQuota CRD.
fn gpuquota_spec_schema() -> Value {
    let d = docs();
    let crd = find(
        &d,
        "CustomResourceDefinition",
        None,
        "gpuquotas.quota.gpuplane.dev",
    )
    .unwrap();
    crd.value["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone()
}

/// The GpuQuota CRD's own rules on `spec.temporary`, evaluated as the API server does (`self`
/// is the spec): a raise adds only to a dimension `hard` limits, and raises something.
#[test]
fn the_crd_refuses_a_raise_of_what_hard_does_not_limit_or_of_nothing() {
    use kube_cel::cel::Value as V;
    let rules = gpuquota_spec_schema()["x-kubernetes-validations"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(rules.len(), 2);
    let refusals = |spec: Value| -> Vec<String> {
        rules
            .iter()
            .filter(|r| {
                cel_eval(r["rule"].as_str().unwrap(), &[("self", &spec)], None) != V::Bool(true)
            })
            .map(|r| r["message"].as_str().unwrap().to_string())
            .collect()
    };
    let raise =
        |hard: Value| json!({"hard": hard, "expires": "2026-12-31T00:00:00Z", "reason": "r"});
    let base = json!({"gpus": "4", "devices": {"nvidia.com/gpu": 4}});
    assert!(refusals(json!({"hard": base})).is_empty());
    assert!(refusals(json!({"hard": base, "temporary": [
        raise(json!({"gpus": "2"})), raise(json!({"devices": {"nvidia.com/gpu": 2}}))]}))
    .is_empty());
    for bad in [
        json!({"gpuMemory": "80Gi"}),
        json!({"devices": {"nvidia.com/mig-1g.10gb": 2}}),
        json!({"gpus": "1", "devices": {"gpu.gpuplane.dev": 1}}),
    ] {
        let r = refusals(json!({"hard": base, "temporary": [raise(bad.clone())]}));
        assert_eq!(r.len(), 1, "{bad}: {r:?}");
        assert!(
            r[0].starts_with(
                "spec.temporary: a raise may only add to a dimension spec.hard limits"
            ),
            "{r:?}"
        );
    }
    let r = refusals(json!({"hard": base, "temporary": [raise(json!({}))]}));
    assert_eq!(
        r,
        ["spec.temporary: each raise must raise at least one of gpus, gpuMemory or devices"]
    );
    let r = refusals(json!({"hard": {"gpus": "1"}, "temporary": [raise(json!({"devices": {}}))]}));
    assert_eq!(r.len(), 1, "an empty device map raises nothing: {r:?}");
}

/// The shipped GpuQuota CRD's schema of `spec.requireLabels`, evaluated as the API server does
/// (the key's pattern, then its CEL rule on the prefix's length): it accepts exactly the keys
/// Kubernetes accepts as label keys (the model's `is_label_key`, which the webhook asks of a
/// quota an older CRD let a bad key into), at most 16 of them.
#[test]
fn the_crd_refuses_a_required_label_that_is_no_label_key() {
    use gpuplane_model::quota::owners::is_label_key;
    use kube_cel::cel::Value as V;
    let schema = &gpuquota_spec_schema()["properties"]["requireLabels"];
    assert_eq!(schema["maxItems"], 16);
    let items = &schema["items"];
    let max_len = items["maxLength"].as_u64().unwrap() as usize;
    let pattern = items["pattern"].clone();
    let rules = items["x-kubernetes-validations"].as_array().unwrap();
    let accepted = |key: &str| {
        let k = json!(key);
        key.len() <= max_len
            && cel_eval("self.matches(p)", &[("self", &k), ("p", &pattern)], None) == V::Bool(true)
            && rules.iter().all(|r| {
                cel_eval(r["rule"].as_str().unwrap(), &[("self", &k)], None) == V::Bool(true)
            })
    };
    let prefix = |n: usize| format!("{}.io", "a".repeat(n - 3));
    let keys = [
        "team".to_string(),
        "cost-center".into(),
        "example.com/cost-center".into(),
        "A_b.C-9".into(),
        "a".repeat(63),
        format!("{}/{}", prefix(253), "a".repeat(63)),
        String::new(),
        "team name".into(),
        "-team".into(),
        "team/".into(),
        "/team".into(),
        "a/b/c".into(),
        "Example.com/team".into(),
        "a..b/team".into(),
        "a".repeat(64),
        format!("{}/team", prefix(254)),
        "team\u{e9}".into(),
    ];
    for k in &keys {
        assert_eq!(accepted(k), is_label_key(k), "{k:?}");
    }
    let refused = keys.iter().filter(|k| !is_label_key(k)).count();
    assert_eq!(refused, 11, "the bad keys are bad");
    let long_prefix = format!("{}/team", prefix(254));
    let rule = &rules[0];
    assert_eq!(
        cel_eval(
            rule["rule"].as_str().unwrap(),
            &[("self", &json!(long_prefix))],
            None
        ),
        V::Bool(false),
        "the pattern alone lets a 254-character prefix in; the rule refuses it"
    );
}
