//! Owner labels (`spec.requireLabels`): which GPU pods are refused and what the refusal says;
//! the CRD's key pattern against the API server's label-key grammar.

use super::*;
use crate::quota::owners::is_label_key;

/// GpuQuota `team-a/<name>` requiring `keys`.
fn requiring(name: &str, keys: &[&str]) -> GpuQuota {
    quota(
        "team-a",
        name,
        json!({"hard": {"gpus": "4"}, "requireLabels": keys}),
        json!(null),
    )
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const POD: &str = "team-a/train-1";

#[test]
fn a_gpu_pod_lacking_one_required_label_is_refused_naming_pod_quota_and_label() {
    let quotas = [requiring("gpus", &["team", "cost-center"])];
    let gpu = mem_charge(10);
    let l = labels(&[("team", "vision"), ("app", "x")]);
    assert_eq!(
        owner_refusal(&quotas, POD, Some(&l), Some(&gpu)).as_deref(),
        Some(
            "pod team-a/train-1 is refused by GpuQuota team-a/gpus: it lacks the label(s) \
             cost-center that this quota requires on every GPU pod; add them to the pod (or its \
             template)"
        )
    );
    let all = labels(&[("team", "vision"), ("cost-center", "42")]);
    assert_eq!(owner_refusal(&quotas, POD, Some(&all), Some(&gpu)), None);
}

#[test]
fn every_missing_label_of_every_requiring_quota_is_named() {
    let quotas = [
        requiring("gpus", &["team", "cost-center"]),
        requiring("open", &[]),
        requiring("finance", &["example.com/budget"]),
    ];
    let refusal = owner_refusal(&quotas, POD, None, Some(&mem_charge(1)));
    assert_eq!(
        refusal.as_deref(),
        Some(
            "pod team-a/train-1 is refused by GpuQuota team-a/gpus: it lacks the label(s) team, \
             cost-center that this quota requires on every GPU pod; add them to the pod (or its \
             template). It is also refused by GpuQuota team-a/finance: it lacks the label(s) \
             example.com/budget that this quota requires on every GPU pod; add them to the pod \
             (or its template)"
        )
    );
    // Labels that are there are not named.
    let l = labels(&[("cost-center", "42")]);
    let refusal = owner_refusal(&quotas[..1], POD, Some(&l), Some(&mem_charge(1))).unwrap();
    assert!(
        refusal.contains("lacks the label(s) team that"),
        "{refusal}"
    );
}

#[test]
fn an_empty_value_names_no_owner() {
    let quotas = [requiring("gpus", &["team", "cost-center"])];
    let l = labels(&[("team", ""), ("cost-center", "42")]);
    assert_eq!(
        owner_refusal(&quotas, POD, Some(&l), Some(&mem_charge(1))).as_deref(),
        Some(
            "pod team-a/train-1 is refused by GpuQuota team-a/gpus: it lacks the label(s) team \
             (empty) that this quota requires on every GPU pod (an empty value names no owner); \
             add them with a value to the pod (or its template)"
        )
    );
}

#[test]
fn a_pod_asking_for_no_gpu_or_a_quota_requiring_nothing_refuses_nothing() {
    let quotas = [requiring("gpus", &["team"])];
    assert_eq!(
        owner_refusal(&quotas, POD, None, Some(&Charge::default())),
        None
    );
    let open = [
        requiring("open", &[]),
        quota("team-a", "plain", json!({"hard": {}}), json!(null)),
    ];
    assert_eq!(owner_refusal(&open, POD, None, Some(&mem_charge(1))), None);
    assert_eq!(owner_refusal(&[], POD, None, Some(&mem_charge(1))), None);
}

#[test]
fn a_pod_not_priced_yet_is_taken_for_a_gpu_pod() {
    let quotas = [requiring("gpus", &["team"])];
    let refusal = owner_refusal(&quotas, POD, None, None).unwrap();
    assert!(refusal.contains("lacks the label(s) team"), "{refusal}");
    let l = labels(&[("team", "vision")]);
    assert_eq!(owner_refusal(&quotas, POD, Some(&l), None), None);
}

#[test]
fn a_key_no_pod_can_carry_refuses_every_gpu_pod_naming_the_key() {
    // The CRD refuses such a key; an older CRD may have let it in. The webhook answers with
    // the quota to fix, whatever labels the pod has.
    let quotas = [requiring("gpus", &["team", "team name", "a/b/c"])];
    let l = labels(&[("team", "vision")]);
    assert_eq!(
        owner_refusal(&quotas, POD, Some(&l), Some(&mem_charge(1))).as_deref(),
        Some(
            "pod team-a/train-1 is refused by GpuQuota team-a/gpus: its spec.requireLabels names \
             `team name`, `a/b/c`, which no pod can carry (a label key is an optional \
             DNS-subdomain prefix and `/`, then at most 63 of [A-Za-z0-9_.-], alphanumeric at \
             both ends); fix the GpuQuota's requireLabels"
        )
    );
    assert_eq!(
        owner_refusal(&quotas, POD, Some(&l), Some(&Charge::default())),
        None
    );
}

#[test]
fn the_crd_accepts_exactly_the_label_keys_kubernetes_accepts_in_require_labels() {
    use kube_core::CustomResourceExt;
    let crd = serde_json::to_value(GpuQuota::crd()).unwrap();
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["requireLabels"];
    assert_eq!(schema["maxItems"], 16);
    let pattern = regex::Regex::new(schema["items"]["pattern"].as_str().unwrap()).unwrap();
    let long = "a".repeat(63);
    let too_long = "a".repeat(64);
    let keys = [
        ("team", true),
        ("cost-center", true),
        ("example.com/team", true),
        ("a.b-c/x_y.z", true),
        ("A9", true),
        (&long, true),
        ("", false),
        ("-team", false),
        ("team name", false),
        ("Example.com/team", false),
        ("/team", false),
        ("team/", false),
        ("a/b/c", false),
        ("x_", false),
        ("_x", false),
        (&too_long, false),
        ("a..b/c", false),
        ("a.b/C.d", true),
    ];
    for (k, ok) in keys {
        assert_eq!(is_label_key(k), ok, "{k:?}");
        assert_eq!(pattern.is_match(k), ok, "pattern: {k:?}");
    }
    // The pattern leaves the prefix's length (at most 253) to a CEL rule (tests/it/manifests.rs
    // evaluates it) and the whole to maxLength, 253 + 1 + 63.
    assert_eq!(schema["items"]["maxLength"], 317);
    let long_prefix = format!("{}.com/team", "a".repeat(250));
    assert!(!is_label_key(&long_prefix) && pattern.is_match(&long_prefix));
}
