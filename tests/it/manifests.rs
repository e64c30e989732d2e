//! The deployment manifests in daemonset/: every object parses into its typed Kubernetes object
//! with no unknown field, the kustomization lists exactly the files there, the names and labels
//! objects refer to exist, the workloads' arguments are flags the binary accepts, and each
//! component's RBAC grants exactly the API calls its code makes, observed by driving the real
//! node agent and the real controller against the API server double.

use crate::lab::{Lab, DRIVER, NODE, WAIT};
use crate::support::eventually::{eventually, LIMIT};
use gpuplane_shell::source::DeviceSource;
use gpuplane_testkit::doubles::apiserver::{ApiCall, ApiServerDouble};
use k8s_openapi::api::admissionregistration::v1 as admission;
use k8s_openapi::api::apps::v1 as apps;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::policy::v1 as policy;
use k8s_openapi::api::rbac::v1 as rbac;
use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiext;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

const NS: &str = "gpuplane-system";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset")
}

/// One object of a manifest file.
#[derive(Debug, Clone)]
struct Doc {
    /// Relative to daemonset/.
    file: String,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }
    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }
    fn namespace(&self) -> Option<&str> {
        self.value["metadata"]["namespace"].as_str()
    }
}

fn read_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// Every YAML file under daemonset/ but the kustomization, relative paths, sorted.
fn manifest_files() -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let rel = path
                    .strip_prefix(base)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                if rel != "kustomization.yaml" {
                    out.push(rel);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &root(), &mut out);
    out.sort();
    out
}

/// What `kubectl apply -k daemonset/` applies: the kustomization's resources, in order.
fn kustomization() -> Value {
    read_docs(&root().join("kustomization.yaml")).remove(0)
}

fn docs() -> Vec<Doc> {
    kustomization()["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            let file = r.as_str().unwrap().to_string();
            read_docs(&root().join(&file))
                .into_iter()
                .map(move |value| Doc {
                    file: file.clone(),
                    value,
                })
        })
        .collect()
}

fn find<'a>(docs: &'a [Doc], kind: &str, ns: Option<&str>, name: &str) -> Option<&'a Doc> {
    docs.iter()
        .find(|d| d.kind() == kind && d.name() == name && d.namespace() == ns)
}

fn typed<K: DeserializeOwned>(d: &Doc) -> K {
    serde_json::from_value(d.value.clone())
        .unwrap_or_else(|e| panic!("{} {}/{}: {e}", d.file, d.kind(), d.name()))
}

// ---- typed parsing with no unknown fields ----

/// Keys of `original` that `back` lacks: fields the typed object did not know. Nulls are not
/// fields; arrays are compared element by element.
fn vanished(original: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(o), Value::Object(b)) => {
            for (k, v) in o {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(bv) => vanished(v, bv, &p, out),
                    None if v.is_null() => {}
                    None => out.push(p),
                }
            }
        }
        (Value::Array(o), Value::Array(b)) => {
            for (i, v) in o.iter().enumerate() {
                match b.get(i) {
                    Some(bv) => vanished(v, bv, &format!("{path}[{i}]"), out),
                    None => out.push(format!("{path}[{i}]")),
                }
            }
        }
        _ => {}
    }
}

/// Deserializes into `K`, serializes back and returns the fields that vanished.
fn round_trip<K: DeserializeOwned + Serialize>(v: &Value) -> Result<Vec<String>, String> {
    let k: K = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&k).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    vanished(v, &back, "", &mut out);
    Ok(out)
}

/// cert-manager.io/v1 objects: no k8s-openapi types, so the fields we use, strictly (a subset
/// of cert-manager's schema: a field outside it fails here, the safe direction).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CertManagerObject<S> {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: S,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IssuerSpec {
    self_signed: Option<BTreeMap<String, Value>>,
    ca: Option<CaIssuer>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CaIssuer {
    secret_name: String,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CertificateSpec {
    secret_name: String,
    duration: Option<String>,
    renew_before: Option<String>,
    common_name: Option<String>,
    dns_names: Vec<String>,
    is_ca: Option<bool>,
    issuer_ref: IssuerRef,
    private_key: Option<PrivateKey>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IssuerRef {
    name: String,
    kind: Option<String>,
    group: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PrivateKey {
    algorithm: Option<String>,
    size: Option<u32>,
    rotation_policy: Option<String>,
    encoding: Option<String>,
}

fn unknown_fields(d: &Doc) -> Result<Vec<String>, String> {
    let v = &d.value;
    let api_version = v["apiVersion"].as_str().unwrap_or_default();
    match (api_version, d.kind()) {
        ("v1", "Namespace") => round_trip::<core::Namespace>(v),
        ("v1", "ServiceAccount") => round_trip::<core::ServiceAccount>(v),
        ("v1", "ConfigMap") => round_trip::<core::ConfigMap>(v),
        ("v1", "Service") => round_trip::<core::Service>(v),
        ("apps/v1", "Deployment") => round_trip::<apps::Deployment>(v),
        ("apps/v1", "DaemonSet") => round_trip::<apps::DaemonSet>(v),
        ("policy/v1", "PodDisruptionBudget") => round_trip::<policy::PodDisruptionBudget>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<rbac::ClusterRole>(v),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<rbac::ClusterRoleBinding>(v)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<rbac::Role>(v),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<rbac::RoleBinding>(v),
        ("resource.k8s.io/v1", "DeviceClass") => round_trip::<resource::DeviceClass>(v),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            round_trip::<apiext::CustomResourceDefinition>(v)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration") => {
            round_trip::<admission::ValidatingWebhookConfiguration>(v)
        }
        ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration") => {
            round_trip::<admission::MutatingWebhookConfiguration>(v)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<admission::ValidatingAdmissionPolicy>(v)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<admission::ValidatingAdmissionPolicyBinding>(v)
        }
        ("cert-manager.io/v1", "Issuer") => round_trip::<CertManagerObject<IssuerSpec>>(v),
        ("cert-manager.io/v1", "Certificate") => {
            round_trip::<CertManagerObject<CertificateSpec>>(v)
        }
        (a, k) => Err(format!("no typed object known for {a} {k}")),
    }
}

#[test]
fn unknown_fields_are_detected_by_the_round_trip() {
    let d = Doc {
        file: "x".into(),
        value: json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "a", "namespace": NS, "lables": {"x": "y"}},
            "automountServiceAccountToken": null}),
    };
    assert_eq!(unknown_fields(&d).unwrap(), [".metadata.lables"]);
    let d = Doc {
        file: "x".into(),
        value: json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "a"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "imagePullPolicy": "Always", "imag": "x"}]}}}}),
    };
    assert_eq!(
        unknown_fields(&d).unwrap(),
        [".spec.template.spec.containers[0].imag"]
    );
}

#[test]
fn every_manifest_parses_into_its_typed_object_with_no_unknown_fields() {
    let docs = docs();
    assert!(docs.len() >= 20, "{} objects", docs.len());
    let mut problems = Vec::new();
    for d in &docs {
        match unknown_fields(d) {
            Ok(fields) if fields.is_empty() => {}
            Ok(fields) => problems.push(format!(
                "{} {}/{}: unknown fields {fields:?}",
                d.file,
                d.kind(),
                d.name()
            )),
            Err(e) => problems.push(format!("{} {}/{}: {e}", d.file, d.kind(), d.name())),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

// ---- the kustomization and references ----

#[test]
fn the_kustomization_lists_every_manifest_once_and_nothing_else() {
    let k = kustomization();
    assert_eq!(k["kind"], "Kustomization");
    let listed: Vec<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "listed twice: {listed:?}");
    for f in &listed {
        assert!(root().join(f).is_file(), "kustomization lists missing {f}");
    }
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(sorted, manifest_files(), "files in daemonset/ not listed");
    // Object identities are unique (kustomize refuses duplicates).
    let docs = docs();
    let mut seen = BTreeSet::new();
    for d in &docs {
        let id = (
            d.kind().to_string(),
            d.namespace().map(String::from),
            d.name().to_string(),
        );
        assert!(seen.insert(id.clone()), "{id:?} defined twice");
    }
}

fn is_cluster_scoped(kind: &str) -> bool {
    matches!(
        kind,
        "Namespace"
            | "ClusterRole"
            | "ClusterRoleBinding"
            | "DeviceClass"
            | "CustomResourceDefinition"
            | "ValidatingWebhookConfiguration"
            | "MutatingWebhookConfiguration"
            | "ValidatingAdmissionPolicy"
            | "ValidatingAdmissionPolicyBinding"
    )
}

#[test]
fn every_object_lives_in_gpuplane_system_which_is_defined() {
    let docs = docs();
    assert!(find(&docs, "Namespace", None, NS).is_some());
    for d in &docs {
        if is_cluster_scoped(d.kind()) {
            assert_eq!(
                d.namespace(),
                None,
                "{} {} is cluster-scoped",
                d.kind(),
                d.name()
            );
        } else {
            assert_eq!(d.namespace(), Some(NS), "{} {}", d.kind(), d.name());
        }
    }
}

/// Workloads (Deployments and DaemonSets) with their pod templates.
fn workloads(docs: &[Doc]) -> Vec<(&Doc, core::PodTemplateSpec, BTreeMap<String, String>)> {
    docs.iter()
        .filter_map(|d| {
            let (template, selector) = match d.kind() {
                "Deployment" => {
                    let s = typed::<apps::Deployment>(d).spec.unwrap();
                    (s.template, s.selector)
                }
                "DaemonSet" => {
                    let s = typed::<apps::DaemonSet>(d).spec.unwrap();
                    (s.template, s.selector)
                }
                _ => return None,
            };
            Some((d, template, selector.match_labels.unwrap_or_default()))
        })
        .collect()
}

fn matches(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn names_and_labels_that_objects_refer_to_exist() {
    let docs = docs();
    let work = workloads(&docs);
    assert_eq!(
        work.len(),
        2,
        "the controller Deployment and the node DaemonSet"
    );
    let secrets_made: BTreeSet<String> = docs
        .iter()
        .filter(|d| d.kind() == "Certificate")
        .map(|d| d.value["spec"]["secretName"].as_str().unwrap().to_string())
        .collect();
    for (d, template, selector) in &work {
        let labels = template
            .metadata
            .clone()
            .unwrap()
            .labels
            .unwrap_or_default();
        assert!(
            matches(selector, &labels),
            "{}: selector misses its pods",
            d.name()
        );
        let spec = template.spec.clone().unwrap();
        let sa = spec.service_account_name.clone().unwrap();
        assert!(
            find(&docs, "ServiceAccount", d.namespace(), &sa).is_some(),
            "{}: ServiceAccount {sa} missing",
            d.name()
        );
        for v in spec.volumes.iter().flatten() {
            if let Some(cm) = &v.config_map {
                assert!(
                    find(&docs, "ConfigMap", d.namespace(), &cm.name).is_some(),
                    "{}: ConfigMap {} missing",
                    d.name(),
                    cm.name
                );
            }
            if let Some(s) = &v.secret {
                let name = s.secret_name.clone().unwrap();
                assert!(
                    secrets_made.contains(&name),
                    "{}: Secret {name} made by nobody",
                    d.name()
                );
            }
        }
        let volumes: BTreeSet<String> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.clone())
            .collect();
        for c in &spec.containers {
            let ports: BTreeSet<String> = c
                .ports
                .iter()
                .flatten()
                .filter_map(|p| p.name.clone())
                .collect();
            for probe in [&c.readiness_probe, &c.liveness_probe] {
                let port = probe
                    .as_ref()
                    .unwrap()
                    .http_get
                    .as_ref()
                    .unwrap()
                    .port
                    .clone();
                if let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(p) = port {
                    assert!(
                        ports.contains(&p),
                        "{}: probe port {p} not declared",
                        d.name()
                    );
                }
            }
            for m in c.volume_mounts.iter().flatten() {
                assert!(
                    volumes.contains(&m.name),
                    "{}: mount of missing volume {}",
                    d.name(),
                    m.name
                );
            }
        }
    }
    // Services select pods of a workload and target ports it declares.
    for d in docs.iter().filter(|d| d.kind() == "Service") {
        let spec = typed::<core::Service>(d).spec.unwrap();
        let selector = spec.selector.unwrap();
        let (_, template, _) = work
            .iter()
            .find(|(w, t, _)| {
                w.namespace() == d.namespace()
                    && matches(
                        &selector,
                        &t.metadata.clone().unwrap().labels.unwrap_or_default(),
                    )
            })
            .unwrap_or_else(|| panic!("Service {} selects no workload's pods", d.name()));
        let declared: BTreeSet<String> = template
            .spec
            .clone()
            .unwrap()
            .containers
            .iter()
            .flat_map(|c| c.ports.clone().unwrap_or_default())
            .filter_map(|p| p.name)
            .collect();
        for p in spec.ports.unwrap() {
            if let Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(t)) =
                p.target_port
            {
                assert!(
                    declared.contains(&t),
                    "Service {}: targetPort {t} not declared",
                    d.name()
                );
            }
        }
    }
    // A PodDisruptionBudget covers a workload's pods.
    for d in docs.iter().filter(|d| d.kind() == "PodDisruptionBudget") {
        let sel = typed::<policy::PodDisruptionBudget>(d)
            .spec
            .unwrap()
            .selector
            .unwrap()
            .match_labels
            .unwrap();
        assert!(work.iter().any(|(_, t, _)| matches(
            &sel,
            &t.metadata.clone().unwrap().labels.unwrap_or_default()
        )));
    }
    // Bindings refer to roles and service accounts that exist.
    for d in docs
        .iter()
        .filter(|d| d.kind().ends_with("Binding") && d.value["roleRef"].is_object())
    {
        let role_kind = d.value["roleRef"]["kind"].as_str().unwrap();
        let role_ns = if role_kind == "Role" {
            d.namespace()
        } else {
            None
        };
        let role = d.value["roleRef"]["name"].as_str().unwrap();
        assert!(
            find(&docs, role_kind, role_ns, role).is_some(),
            "{}: {role_kind} {role} missing",
            d.name()
        );
        for s in d.value["subjects"].as_array().unwrap() {
            assert_eq!(s["kind"], "ServiceAccount");
            let (ns, name) = (s["namespace"].as_str(), s["name"].as_str().unwrap());
            assert!(
                find(&docs, "ServiceAccount", ns, name).is_some(),
                "{}: subject {name} missing",
                d.name()
            );
        }
    }
    // Webhooks call a Service that exists, on a port it serves; their CA comes from a
    // Certificate that exists.
    for d in docs
        .iter()
        .filter(|d| d.kind().ends_with("WebhookConfiguration"))
    {
        let ca = d.value["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            .as_str()
            .unwrap();
        let (ns, name) = ca.split_once('/').unwrap();
        assert!(find(&docs, "Certificate", Some(ns), name).is_some(), "{ca}");
        for w in d.value["webhooks"].as_array().unwrap() {
            let svc = &w["clientConfig"]["service"];
            let s = find(
                &docs,
                "Service",
                svc["namespace"].as_str(),
                svc["name"].as_str().unwrap(),
            )
            .unwrap_or_else(|| panic!("webhook {}: Service {svc} missing", w["name"]));
            assert!(
                s.value["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["port"] == svc["port"]),
                "webhook {}: port {} not served",
                w["name"],
                svc["port"]
            );
        }
    }
    // Each admission policy has a binding naming it, and restricts the account of one of the
    // workloads: the node agent's (ResourceSlices, node labels) or the controller's (the
    // namespace label).
    let policies: Vec<&Doc> = docs
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicy")
        .collect();
    let bound: BTreeSet<&str> = docs
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicyBinding")
        .map(|b| b.value["spec"]["policyName"].as_str().unwrap())
        .collect();
    let users: Vec<String> = work
        .iter()
        .map(|(d, t, _)| {
            let sa = t.spec.clone().unwrap().service_account_name.unwrap();
            format!("system:serviceaccount:{}:{sa}", d.namespace().unwrap())
        })
        .collect();
    for b in &bound {
        assert!(
            find(&docs, "ValidatingAdmissionPolicy", None, b).is_some(),
            "a binding names the missing policy {b}"
        );
    }
    let mut restricted = BTreeSet::new();
    for policy in &policies {
        assert!(
            bound.contains(policy.name()),
            "{}: no binding",
            policy.name()
        );
        let conditions = policy.value["spec"]["matchConditions"].to_string();
        let user = users
            .iter()
            .find(|u| conditions.contains(u.as_str()))
            .unwrap_or_else(|| panic!("{}: names no workload's account", policy.name()));
        restricted.insert(user.clone());
    }
    assert_eq!(
        restricted.len(),
        2,
        "both accounts restricted: {restricted:?}"
    );
}

fn container_args(docs: &[Doc], kind: &str) -> Vec<String> {
    let d = docs.iter().find(|d| d.kind() == kind).unwrap();
    d.value["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let prefix = format!("--{name}=");
    args.iter().find_map(|a| a.strip_prefix(&prefix))
}

#[test]
fn the_workloads_arguments_are_flags_the_binary_accepts() {
    let docs = docs();
    for kind in ["DaemonSet", "Deployment"] {
        let mut args = container_args(&docs, kind);
        // clap checks every flag and value before it acts on --help.
        args.push("--help".into());
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplane"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{kind} args {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

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
    let gpu = json!({"limits": {"nvidia.com/gpu": "1"}});
    let cpu = json!({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}});
    let pods = [
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
    ];
    for (what, pod, want) in &pods {
        let q = quota.match_conditions.as_deref().unwrap_or_default();
        assert_eq!(
            sent_to(&quota.name, q, "pods", pod),
            *want,
            "validating: {what}"
        );
        let g = gate.match_conditions.as_deref().unwrap_or_default();
        assert_eq!(
            sent_to(&gate.name, g, "pods", pod),
            *want,
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
            gpuplane_shell::quota::governs_pod(&typed),
            *want,
            "controller cache: {what}"
        );
    }
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
    // Every webhook honours the namespace opt-out label.
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
    // The gate is called only where the controller put the queue label; enforcement
    // everywhere in scope.
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

/// Whether a label selector (as a namespaceSelector) selects `labels`; none selects all.
fn selects(
    selector: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let Some(s) = selector else { return true };
    let by_labels = s
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    by_labels
        && s.match_expressions.iter().flatten().all(|e| {
            let values = e.values.clone().unwrap_or_default();
            let value = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("operator {other}"),
            }
        })
}

/// CEL values as an admission policy sees them: JSON objects, and the policy's variables.
type CelVars = std::collections::HashMap<String, kube_cel::cel::Value>;

/// Evaluates `expression` as the API server's CEL does for admission policies (optional
/// syntax on) with `objects` bound and, when given, `variables`.
fn cel_eval(
    expression: &str,
    objects: &[(&str, &Value)],
    variables: Option<&CelVars>,
) -> kube_cel::cel::Value {
    use kube_cel::{cel, KubeCelExt};
    let expr = cel::parser::Parser::default()
        .enable_optional_syntax(true)
        .parse(expression)
        .unwrap_or_else(|e| panic!("{expression}: {e}"));
    let mut ctx = cel::Context::default().with_all();
    for (name, v) in objects {
        ctx.add_variable(*name, v).unwrap();
    }
    if let Some(vars) = variables {
        ctx.add_variable_from_value("variables", vars.clone());
    }
    cel::Value::resolve(&expr, &ctx).unwrap_or_else(|e| panic!("{expression}: {e}"))
}

/// The messages of the validations of admission policy `name` that deny an UPDATE of `old`
/// to `new` (through `subresource`, "" for the object itself) by `user`; None when its
/// matchConditions leave the request alone.
fn policy_denials(
    docs: &[Doc],
    name: &str,
    (user, subresource): (&str, &str),
    old: &Value,
    new: &Value,
) -> Option<Vec<String>> {
    let request = json!({"operation": "UPDATE", "subResource": subresource,
        "userInfo": {"username": user}});
    policy_denials_of(docs, name, &request, old, new)
}

/// [`policy_denials`] of any `request` (operation, userInfo); `old` or `new` is null where the
/// operation has none.
fn policy_denials_of(
    docs: &[Doc],
    name: &str,
    request: &Value,
    old: &Value,
    new: &Value,
) -> Option<Vec<String>> {
    use kube_cel::cel::Value as V;
    let policy: admission::ValidatingAdmissionPolicy =
        typed(find(docs, "ValidatingAdmissionPolicy", None, name).unwrap());
    let spec = policy.spec.unwrap();
    // A policy with a parameter gets the object its binding names.
    let params = spec
        .param_kind
        .as_ref()
        .and_then(|k| {
            let binding = docs.iter().find(|d| {
                d.kind() == "ValidatingAdmissionPolicyBinding"
                    && d.value["spec"]["policyName"] == name
            })?;
            let r = &binding.value["spec"]["paramRef"];
            find(
                docs,
                k.kind.as_deref()?,
                r["namespace"].as_str(),
                r["name"].as_str()?,
            )
        })
        .map_or(Value::Null, |d| d.value.clone());
    let objects = [
        ("object", new),
        ("oldObject", old),
        ("request", request),
        ("params", &params),
    ];
    for c in spec.match_conditions.iter().flatten() {
        if cel_eval(&c.expression, &objects, None) != V::Bool(true) {
            return None;
        }
    }
    let mut variables = CelVars::new();
    for v in spec.variables.iter().flatten() {
        let value = cel_eval(&v.expression, &objects, Some(&variables));
        variables.insert(v.name.clone(), value);
    }
    let mut denials = Vec::new();
    for v in spec.validations.iter().flatten() {
        match cel_eval(&v.expression, &objects, Some(&variables)) {
            V::Bool(true) => {}
            V::Bool(false) => denials.push(v.message.clone().unwrap_or_default()),
            other => panic!("{name}: {} is {other:?}", v.expression),
        }
    }
    Some(denials)
}

#[test]
fn the_node_agent_may_create_and_delete_only_mps_daemon_pods_of_its_own_node() {
    let docs = docs();
    let policy = "gpuplane-node-mps-pods";
    let agent = "system:serviceaccount:gpuplane-system:gpuplane-node";
    let request = |op: &str, user: &str, node: &str| {
        json!({"operation": op, "subResource": "", "userInfo": {"username": user,
            "extra": {"authentication.kubernetes.io/node-name": [node]}}})
    };
    // The pod the agent renders (crates/model/src/mps_pod.rs), every field the policy reads.
    let daemonset = find(&docs, "DaemonSet", Some(NS), "gpuplane-node").unwrap();
    let agent_pod = gpuplane_shell::mps_pod::AgentPod {
        namespace: NS.into(),
        image: daemonset.value["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap()
            .into(),
        ..Default::default()
    };
    let daemon = |node: &str| {
        let pod = gpuplane_shell::mps_pod::DaemonPod {
            node,
            unit: "GPU-1",
            multiuser: true,
            agent: &agent_pod,
            state_dir: "/var/lib/gpuplane",
            driver_root: "/run/nvidia/driver",
            driver_root_mount: "/run/nvidia/driver",
            nvml_lib: Some("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        };
        serde_json::to_value(pod.render()).unwrap()
    };
    let null = Value::Null;
    let deny = |op: &str, node: &str, pod: &Value| {
        let (old, new) = if op == "DELETE" {
            (pod, &null)
        } else {
            (&null, pod)
        };
        policy_denials_of(&docs, policy, &request(op, agent, node), old, new).expect("matches")
    };
    let own = daemon("node-a");
    assert_eq!(deny("CREATE", "node-a", &own), Vec::<String>::new());
    assert_eq!(deny("DELETE", "node-a", &own), Vec::<String>::new());
    // (This evaluator leaves messageExpression out; the real API server words it.)
    assert_eq!(deny("CREATE", "node-b", &own).len(), 1);
    assert_eq!(deny("DELETE", "node-b", &own).len(), 1);
    // Anything else than a daemon pod, on its own node too.
    let mut shell = own.clone();
    shell["spec"]["containers"][0]["args"] = json!(["node"]);
    assert_eq!(deny("CREATE", "node-a", &shell).len(), 1);
    let mut other_image = own.clone();
    other_image["spec"]["containers"][0]["image"] = json!("attacker/shell:1");
    assert_eq!(deny("CREATE", "node-a", &other_image).len(), 1);
    let mut unlabelled = own.clone();
    unlabelled["metadata"]["labels"] = json!({"app": "x"});
    assert_eq!(deny("CREATE", "node-a", &unlabelled).len(), 1);
    assert_eq!(deny("DELETE", "node-a", &unlabelled).len(), 1);
    // Other users are not this policy's business.
    let admin = request("CREATE", "kubernetes-admin", "");
    assert!(policy_denials_of(&docs, policy, &admin, &null, &shell).is_none());
}

#[test]
fn the_controller_may_change_only_the_queue_label_of_a_namespace() {
    let docs = docs();
    let policy = "gpuplane-controller-namespaces";
    let controller = "system:serviceaccount:gpuplane-system:gpuplane-controller";
    // Every optional field the policy reads is present: the cel crate fails `.?` on a missing
    // key where Kubernetes' CEL yields none (the real-cluster tier runs the policy itself).
    let namespace = |labels: Value, annotations: Value, finalizers: Value| {
        json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "team-a", "labels": labels, "annotations": annotations,
                "finalizers": ["example.com/keep"]},
            "spec": {"finalizers": finalizers}})
    };
    let k = ["kubernetes"];
    let old = namespace(json!({"team": "a"}), json!({"owner": "x"}), json!(k));
    let labelled = namespace(
        json!({"team": "a", "quota.gpuplane.dev/queue": "true"}),
        json!({"owner": "x"}),
        json!(k),
    );
    let deny = |old: &Value, new: &Value| {
        let d = policy_denials(&docs, policy, (controller, ""), old, new).expect("matches");
        !d.is_empty()
    };
    assert!(!deny(&old, &labelled), "adding the label");
    assert!(!deny(&labelled, &old), "removing it");
    assert!(!deny(&old, &old), "a no-op");
    let mut changed = vec![
        (
            "another label",
            namespace(json!({"team": "b"}), json!({"owner": "x"}), json!(k)),
        ),
        (
            "exempting the namespace",
            namespace(
                json!({"team": "a", "quota.gpuplane.dev/exempt": "true"}),
                json!({"owner": "x"}),
                json!(k),
            ),
        ),
        (
            "dropping a label",
            namespace(json!({}), json!({"owner": "x"}), json!(k)),
        ),
        (
            "an annotation",
            namespace(json!({"team": "a"}), json!({"owner": "y"}), json!(k)),
        ),
        (
            "the spec",
            namespace(json!({"team": "a"}), json!({"owner": "x"}), json!([])),
        ),
        (
            "another value of the label",
            namespace(
                json!({"team": "a", "quota.gpuplane.dev/queue": "false"}),
                json!({"owner": "x"}),
                json!(k),
            ),
        ),
    ];
    let mut unfinalized = old.clone();
    unfinalized["metadata"]["finalizers"] = json!([]);
    changed.push(("a metadata finalizer", unfinalized));
    for (what, new) in &changed {
        assert!(deny(&old, new), "the controller changing {what} is allowed");
    }
    // Anyone else is not this policy's business.
    let admin = policy_denials(&docs, policy, ("kubernetes-admin", ""), &old, &changed[0].1);
    assert_eq!(admin, None);
}

#[test]
fn the_controller_may_change_only_its_gate_and_its_conditions_of_a_pod() {
    use gpuplane_shell::controller::explainer::CONDITION as EXPLAIN_CONDITION;
    use gpuplane_shell::controller::pods::CONDITION as QUOTA_CONDITION;
    use gpuplane_shell::quota::SCHEDULING_GATE;
    let docs = docs();
    let policy = "gpuplane-controller-pods";
    let controller = "system:serviceaccount:gpuplane-system:gpuplane-controller";
    let condition = |ty: &str, status: &str| json!({"type": ty, "status": status});
    // Every optional field the policy reads is present (see the namespace policy's test).
    let old = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "labels": {"team": "a"}, "annotations": {},
            "finalizers": [], "ownerReferences": []},
        "spec": {"containers": [{"name": "c", "image": "app:1"}], "initContainers": [],
            "tolerations": [], "nodeSelector": {}, "affinity": {},
            "activeDeadlineSeconds": 60, "terminationGracePeriodSeconds": 30,
            "schedulingGates": [{"name": SCHEDULING_GATE}, {"name": "example.com/other"}]},
        "status": {"phase": "Pending", "message": "", "reason": "", "nominatedNodeName": "",
            "hostIP": "", "hostIPs": [], "podIP": "", "podIPs": [], "startTime": "",
            "qosClass": "BestEffort", "containerStatuses": [], "initContainerStatuses": [],
            "ephemeralContainerStatuses": [], "resourceClaimStatuses": [],
            "conditions": [condition("PodScheduled", "False")]}});
    let denied = |sub: &str, new: &Value| {
        policy_denials(&docs, policy, (controller, sub), &old, new).expect("matches")
    };
    let with = |path: &[&str], v: Value| {
        let mut new = old.clone();
        let (last, parents) = path.split_last().unwrap();
        let mut at = &mut new;
        for p in parents {
            at = &mut at[*p];
        }
        at[*last] = v;
        new
    };
    // What the controller writes: its gate off, its two conditions on.
    let ungated = with(
        &["spec", "schedulingGates"],
        json!([{"name": "example.com/other"}]),
    );
    assert_eq!(denied("", &ungated), Vec::<String>::new());
    let conditions = json!([
        condition("PodScheduled", "False"),
        condition(QUOTA_CONDITION, "False"),
        condition(EXPLAIN_CONDITION, "False"),
    ]);
    let own = with(&["status", "conditions"], conditions);
    assert_eq!(denied("status", &own), Vec::<String>::new());
    // Everything else RBAC would let through.
    let refused = [
        (
            "",
            with(
                &["spec", "schedulingGates"],
                json!([{"name": SCHEDULING_GATE}]),
            ),
        ),
        ("", with(&["spec", "schedulingGates"], json!([]))),
        (
            "",
            with(
                &["spec", "containers"],
                json!([{"name": "c", "image": "evil:1"}]),
            ),
        ),
        (
            "",
            with(&["spec", "tolerations"], json!([{"operator": "Exists"}])),
        ),
        ("", with(&["metadata", "labels"], json!({"team": "b"}))),
        (
            "status",
            with(
                &["status", "conditions"],
                json!([condition("PodScheduled", "True")]),
            ),
        ),
        ("status", with(&["status", "phase"], json!("Failed"))),
        (
            "status",
            with(&["status", "nominatedNodeName"], json!("node-b")),
        ),
    ];
    for (sub, new) in &refused {
        assert_eq!(denied(sub, new).len(), 1, "allowed through {sub:?}: {new}");
    }
    // Anyone else is not this policy's business.
    assert_eq!(
        policy_denials(&docs, policy, ("kubernetes-admin", ""), &old, &refused[2].1),
        None
    );
}

#[test]
fn device_classes_select_the_driver_the_node_agent_serves() {
    let docs = docs();
    let args = container_args(&docs, "DaemonSet");
    let driver = flag(&args, "driver-name").unwrap();
    assert_eq!(driver, DRIVER);
    let classes: Vec<&Doc> = docs.iter().filter(|d| d.kind() == "DeviceClass").collect();
    assert!(!classes.is_empty());
    for d in classes {
        let class: resource::DeviceClass = typed(d);
        for s in class.spec.selectors.unwrap() {
            let cel = s.cel.unwrap().expression;
            assert!(
                cel.contains(&format!("device.driver == '{driver}'")),
                "{}: {cel}",
                d.name()
            );
            // Unqualified attributes live under the driver's name.
            for (i, _) in cel.match_indices("device.attributes['") {
                let rest = &cel[i + "device.attributes['".len()..];
                assert!(
                    rest.starts_with(&format!("{driver}']")),
                    "{}: {cel}",
                    d.name()
                );
            }
        }
    }
}

/// The classes that back device-plugin resource names through DRA (extendedResourceName):
/// `gpu.gpuplane.dev` backs `nvidia.com/gpu`; each per-profile MIG class the name the device
/// plugin gives that profile, and selects exactly that profile; no name is backed twice.
#[test]
fn device_classes_back_the_device_plugin_resource_names() {
    let docs = docs();
    let mut backed = std::collections::BTreeMap::new();
    for d in docs.iter().filter(|d| d.kind() == "DeviceClass") {
        let class: resource::DeviceClass = typed(d);
        let Some(name) = class.spec.extended_resource_name.clone() else {
            continue;
        };
        assert!(
            backed.insert(name.clone(), d.name().to_string()).is_none(),
            "{name} is backed by two classes"
        );
        let cel = class.spec.selectors.unwrap()[0]
            .cel
            .clone()
            .unwrap()
            .expression;
        if name == "nvidia.com/gpu" {
            assert_eq!(d.name(), "gpu.gpuplane.dev");
            continue;
        }
        let profile = cel
            .split("profile == '")
            .nth(1)
            .and_then(|r| r.split('\'').next())
            .unwrap_or_else(|| panic!("{}: no profile in {cel}", d.name()));
        assert_eq!(
            name,
            gpuplane_shell::inventory::ResourceName::mig(&profile.parse().unwrap()),
            "{}",
            d.name()
        );
        assert!(cel.contains("type == 'mig'"), "{}: {cel}", d.name());
    }
    assert_eq!(backed["nvidia.com/gpu"], "gpu.gpuplane.dev");
    // Every MIG profile of the simulation profiles has its class.
    for p in ["a100-mig-mixed", "h100-mig-single"] {
        let inv = gpuplane_shell::sim::load(p).unwrap();
        for mig in inv.gpus.iter().flat_map(|g| g.mig_devices.iter()) {
            let name = gpuplane_shell::inventory::ResourceName::mig(&mig.profile);
            assert!(
                backed.contains_key(name.as_str()),
                "{p}: no class backs {name}"
            );
        }
    }
}

#[test]
fn the_node_config_map_is_a_valid_agent_config_at_the_path_the_agent_reads() {
    let docs = docs();
    let args = container_args(&docs, "DaemonSet");
    let config = Path::new(flag(&args, "config").unwrap());
    let ds = docs.iter().find(|d| d.kind() == "DaemonSet").unwrap();
    let pod = &ds.value["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| config.starts_with(m["mountPath"].as_str().unwrap()))
        .unwrap_or_else(|| panic!("{} is on no mount", config.display()));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let cm_name = volume["configMap"]["name"].as_str().unwrap();
    let cm: core::ConfigMap = typed(find(&docs, "ConfigMap", Some(NS), cm_name).unwrap());
    let key = config.file_name().unwrap().to_str().unwrap();
    let text = &cm.data.unwrap()[key];
    let parsed = gpuplane_shell::config::AgentConfig::parse(key, text).unwrap();
    assert_eq!(
        parsed.allocation,
        gpuplane_shell::config::AllocationMode::Shared
    );
}

// ---- RBAC against the calls the code makes ----

/// (verb, API group, resource or resource/subresource).
type Rule = (String, String, String);

/// What the roles bound to `namespace/account` grant: cluster-wide (ClusterRoleBindings) and
/// per namespace (RoleBindings).
fn grants(docs: &[Doc], namespace: &str, account: &str) -> BTreeMap<Rule, Option<String>> {
    let mut out = BTreeMap::new();
    for b in docs
        .iter()
        .filter(|d| d.kind() == "ClusterRoleBinding" || d.kind() == "RoleBinding")
    {
        let bound = b.value["subjects"].as_array().unwrap().iter().any(|s| {
            s["kind"] == "ServiceAccount" && s["namespace"] == namespace && s["name"] == account
        });
        if !bound {
            continue;
        }
        let role_kind = b.value["roleRef"]["kind"].as_str().unwrap();
        let scope = (b.kind() == "RoleBinding").then(|| b.namespace().unwrap().to_string());
        let role = find(
            docs,
            role_kind,
            if role_kind == "Role" {
                b.namespace()
            } else {
                None
            },
            b.value["roleRef"]["name"].as_str().unwrap(),
        )
        .unwrap();
        for r in role.value["rules"].as_array().unwrap() {
            let list = |k: &str| -> Vec<String> {
                r[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect()
            };
            for (verb, group, res) in
                itertools3(&list("verbs"), &list("apiGroups"), &list("resources"))
            {
                assert!(
                    verb != "*" && group != "*" && res != "*",
                    "{}: wildcards are not least privilege",
                    role.name()
                );
                // Only the synthetic permission the API server checks for status.devices
                // names objects (the driver names the agent writes entries for), and the
                // controller's get and update of the GPU-hours book.
                if let Some(names) = r.get("resourceNames") {
                    let want = match res.as_str() {
                        "resourceclaims/driver" => DRIVER,
                        "configmaps" => gpuplane_shell::controller::meter::BOOK_NAME,
                        _ => panic!("resourceNames on {res}: extend this test"),
                    };
                    assert_eq!(names, &serde_json::json!([want]), "{}", role.name());
                }
                out.insert((verb, group, res), scope.clone());
            }
        }
    }
    out
}

/// What `--mps-daemons=pods` calls (crates/shell/src/mps/pods.rs): the agent's own pod read, this
/// node's daemon pods listed, one created for a GPU that MPS shares use and deleted after its
/// last share (tests/it/mps_pods.rs runs those pods).
async fn mps_daemon_pod_calls(api: &ApiServerDouble, gpu: gpuplane_shell::inventory::DeviceUuid) {
    use gpuplane_shell::mps::MpsHost;
    api.put_json(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpuplane-node-x1", "namespace": NS},
        "spec": {"nodeName": NODE, "containers": [{"name": "agent", "image": "gpuplane:test"}]}}))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let paths = gpuplane_shell::paths::HostPaths::under(dir.path());
    let own = gpuplane_shell::mps::pods::PodSettings {
        namespace: NS.into(),
        name: "gpuplane-node-x1".into(),
        nvml_lib: None,
    };
    let pods =
        gpuplane_shell::mps::pods::MpsPods::new(api.client().unwrap(), NODE, &own, &paths, None)
            .await
            .unwrap();
    let daemon_pods = || {
        api.list_json("v1", "pods", Some(NS))
            .iter()
            .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuplane-mps")
            .count()
    };
    let (p, g) = (pods.clone(), gpu.clone());
    tokio::task::spawn_blocking(move || p.reconcile(&BTreeMap::from([(g, true)])))
        .await
        .unwrap();
    assert_eq!(daemon_pods(), 1);
    tokio::task::spawn_blocking(move || pods.reconcile(&BTreeMap::new()))
        .await
        .unwrap();
    assert_eq!(daemon_pods(), 0);
}

fn itertools3(a: &[String], b: &[String], c: &[String]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for x in a {
        for y in b {
            for z in c {
                out.push((x.clone(), y.clone(), z.clone()));
            }
        }
    }
    out
}

/// Non-resource URLs every authenticated user may GET (the `system:public-info-viewer` and
/// `system:discovery` ClusterRoles): no grant of ours needed.
const PUBLIC_URLS: &[&str] = &["/version", "/healthz", "/livez", "/readyz", "/api", "/apis"];

/// The calls observed, each checked against `granted`; returns the distinct rules used.
fn check_calls(
    calls: &[ApiCall],
    granted: &BTreeMap<Rule, Option<String>>,
    who: &str,
) -> BTreeSet<Rule> {
    let mut used = BTreeSet::new();
    for c in calls {
        match c {
            ApiCall::NonResource { verb, path } => assert!(
                verb == "get" && PUBLIC_URLS.contains(&path.as_str()),
                "{who} calls non-resource {verb} {path}"
            ),
            ApiCall::Resource(r) => {
                let resource = if r.subresource.is_empty() {
                    r.resource.clone()
                } else {
                    format!("{}/{}", r.resource, r.subresource)
                };
                let rule = (r.verb.clone(), r.group.clone(), resource);
                match granted.get(&rule) {
                    None => panic!("{who}'s RBAC does not grant {rule:?} ({c:?})"),
                    Some(Some(ns)) => assert_eq!(
                        r.namespace.as_deref(),
                        Some(ns.as_str()),
                        "{who}: {rule:?} is granted in {ns} only ({c:?})"
                    ),
                    Some(None) => {}
                }
                used.insert(rule);
            }
        }
    }
    used
}

fn rule(verb: &str, group: &str, resource: &str) -> Rule {
    (verb.into(), group.into(), resource.into())
}

/// Every grant is used, or listed in `unreached` (calls the code makes that the scenario does
/// not reach).
fn check_grants_used(
    granted: &BTreeMap<Rule, Option<String>>,
    used: &BTreeSet<Rule>,
    unreached: &[Rule],
    who: &str,
) {
    for g in granted.keys() {
        assert!(
            used.contains(g) || unreached.contains(g),
            "{who}'s RBAC grants {g:?}, which no call used; used: {used:#?}"
        );
    }
    for u in unreached {
        assert!(
            granted.contains_key(u),
            "{who}: allowlisted {u:?} is not granted"
        );
        assert!(
            !used.contains(u),
            "{who}: {u:?} is reached now: drop it from the allowlist"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_the_node_agent_calls() {
    let lab = Lab::new("pcie-l4x4").await;
    // A slice of this node left by an earlier inventory: the publisher deletes it.
    lab.api
        .put_json(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpu-gpuplane-dev-old"},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": []}}),
        )
        .unwrap();
    // The node's Node object: the agent labels it (and reads its APIs label).
    lab.api
        .put_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
        .unwrap();
    let agent = lab.start("health: {recoveryQuietPeriod: 1h}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("the node labelled", |l| {
        l.api
            .get_json("v1", "nodes", None, NODE)
            .is_some_and(|n| n["metadata"]["labels"]["nvidia.com/gpu.count"] == "4")
    })
    .await;
    lab.eventually("slices published and the old one gone", |l| {
        let s = l.slices();
        !s.is_empty()
            && s.iter()
                .all(|s| s["metadata"]["name"] != "node-a-gpu-gpuplane-dev-old")
    })
    .await;
    // A good claim (claims get), a device going unhealthy (slice update), and a claim for it
    // (an Event on the claim).
    let good = lab.claim("good", &["gpu-0"]);
    lab.prepare(&good).await.unwrap();
    let uuid = lab.sim.discover().unwrap().inventory.gpus[1].uuid.clone();
    lab.sim.inject_xid(&uuid, None, 48);
    lab.eventually("a taint on gpu-1", |l| !l.taints("gpu-1").is_empty())
        .await;
    let bad = lab.claim("bad", &["gpu-1"]);
    lab.prepare(&bad).await.unwrap_err();
    lab.eventually("the Event on the claim", |l| {
        !l.api
            .list_json("events.k8s.io/v1", "events", Some("team-a"))
            .is_empty()
    })
    .await;
    agent.stop().await;
    mps_daemon_pod_calls(
        &lab.api,
        lab.sim.discover().unwrap().inventory.gpus[2].uuid.clone(),
    )
    .await;

    let docs = docs();
    let granted = grants(&docs, NS, "gpuplane-node");
    let used = check_calls(&lab.api.api_calls(), &granted, "gpuplane node");
    // Granted calls this scenario does not reach: the API server's own check of
    // resourceclaims/driver for status.devices writes (the double does not model it; the
    // real-cluster tier does: tests/lab/real_cluster.rs sees the entries written).
    check_grants_used(
        &granted,
        &used,
        &[rule(
            "associated-node:patch",
            "resource.k8s.io",
            "resourceclaims/driver",
        )],
        "gpuplane node",
    );
    for r in [
        rule("list", "resource.k8s.io", "resourceslices"),
        rule("watch", "resource.k8s.io", "resourceslices"),
        rule("create", "resource.k8s.io", "resourceslices"),
        rule("update", "resource.k8s.io", "resourceslices"),
        rule("delete", "resource.k8s.io", "resourceslices"),
        rule("get", "resource.k8s.io", "resourceclaims"),
        rule("create", "events.k8s.io", "events"),
        rule("get", "", "nodes"),
        rule("list", "", "nodes"),
        rule("watch", "", "nodes"),
        rule("patch", "", "nodes"),
        rule("patch", "resource.k8s.io", "resourceclaims/status"),
        rule("get", "", "pods"),
        rule("list", "", "pods"),
        rule("create", "", "pods"),
        rule("delete", "", "pods"),
    ] {
        assert!(used.contains(&r), "{r:?} not observed: {used:#?}");
    }
}

// The controller: the webhook over HTTPS and the quota loops, with a test CA.

mod tls {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;

    /// A test CA and a serving certificate for localhost in a temp dir.
    pub struct Pki {
        ca: CertifiedIssuer<'static, KeyPair>,
        pub dir: tempfile::TempDir,
    }

    impl Pki {
        pub fn new() -> Pki {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
            let pki = Pki {
                ca,
                dir: tempfile::tempdir().unwrap(),
            };
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(vec!["localhost".to_string()])
                .unwrap()
                .signed_by(&key, &pki.ca)
                .unwrap();
            std::fs::write(pki.cert(), cert.pem()).unwrap();
            std::fs::write(pki.key(), key.serialize_pem()).unwrap();
            pki
        }

        pub fn cert(&self) -> PathBuf {
            self.dir.path().join("tls.crt")
        }

        pub fn key(&self) -> PathBuf {
            self.dir.path().join("tls.key")
        }

        /// POSTs `body` to `path` and returns the response body (HTTP/1.1, one connection).
        pub async fn post(&self, addr: SocketAddr, path: &str, body: &[u8]) -> serde_json::Value {
            let cfg = gpuplane_testkit::demo::tls::client_trusting(self.ca.der().clone()).unwrap();
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut conn = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes()).await.unwrap();
            conn.write_all(body).await.unwrap();
            let mut out = Vec::new();
            let _ = conn.read_to_end(&mut out).await;
            let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
            let head = String::from_utf8_lossy(&out[..split]).to_ascii_lowercase();
            assert!(head.starts_with("http/1.1 200"), "{head}");
            assert!(!head.contains("transfer-encoding: chunked"), "{head}");
            serde_json::from_slice(&out[split + 4..]).unwrap()
        }
    }
}

fn pod_review(uid: &str, pod: Value) -> Vec<u8> {
    serde_json::to_vec(&gpuplane_testkit::doubles::admission::pod_create_review(
        uid, &pod,
    ))
    .unwrap()
}

fn gpu_pod(ns: &str, name: &str, gated: bool) -> Value {
    let mut spec = json!({"containers": [{"name": "main", "image": "cuda",
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
    if gated {
        spec["schedulingGates"] = json!([{"name": gpuplane_shell::quota::SCHEDULING_GATE}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}")}, "spec": spec})
}

fn seed_cluster(api: &ApiServerDouble) {
    for ns in ["team-a", "team-b"] {
        api.put_json(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
            "spec": {"finalizers": ["kubernetes"]}}),
        )
        .unwrap();
    }
    for d in docs().iter().filter(|d| d.kind() == "DeviceClass") {
        api.put_json(d.value.clone()).unwrap();
    }
    api.put_json(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "n1-gpu-gpuplane-dev-0"},
        "spec": {"driver": DRIVER, "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
                "capacity": {"memory": {"value": "16Gi"}}}]}}),
    )
    .unwrap();
    api.put_json(
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-gpu", "namespace": "team-a"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": "gpu.gpuplane.dev"}}]}}}}),
    )
    .unwrap();
    for (ns, spec) in [
        (
            "team-a",
            json!({"hard": {"gpuMemory": "20Gi"}, "mode": "Reject"}),
        ),
        ("team-b", json!({"hard": {"gpus": "1"}, "mode": "Queue"})),
    ] {
        api.put_json(
            json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": "default", "namespace": ns}, "spec": spec}),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_the_controller_calls() {
    use gpuplane_shell::controller::{self, lease::LeaseTimings, ControllerOptions};
    let api = ApiServerDouble::start().await.unwrap();
    seed_cluster(&api);
    let pki = tls::Pki::new();
    let mut opts = gpuplane_shell::webhook::WebhookOptions::new(pki.cert(), pki.key(), NS);
    opts.addr = "127.0.0.1:0".parse().unwrap();
    opts.sync_timeout = Duration::from_secs(10);
    let webhook = gpuplane_shell::webhook::start(api.client().unwrap(), opts)
        .await
        .unwrap();
    let mut loops = ControllerOptions::new(NS, "replica-1");
    loops.lease = LeaseTimings {
        lease_duration: Duration::from_secs(1),
        renew_deadline: Duration::from_millis(600),
        retry_period: Duration::from_millis(100),
    };
    loops.queue.batch = Duration::from_millis(20);
    loops.queue.resync = Duration::from_millis(300);
    if let Some(h) = loops.queue.hours.as_mut() {
        h.interval = Duration::from_millis(100);
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = api.client().unwrap();
    let task = tokio::spawn(async move {
        controller::run(
            client,
            loops,
            std::sync::Arc::new(controller::metrics::QueueMetrics::default()),
            async {
                let _ = stopped.await;
            },
        )
        .await
    });

    // Reject mode, through the webhook: a pod whose claim comes from a template (template
    // get, quota get, reservation written to status).
    let mut a = gpu_pod("team-a", "a", false);
    a["spec"] = json!({"containers": [{"name": "c", "image": "x"}],
        "resourceClaims": [{"name": "g", "resourceClaimTemplateName": "one-gpu"}]});
    let r = pki
        .post(webhook.addr(), "/validate", &pod_review("u1", a))
        .await;
    assert_eq!(r["response"]["allowed"], true, "{r}");
    // Queue mode, through the loops: two gated one-GPU pods under a one-GPU quota: one is
    // released (gate removed), the other waits with a condition and an Event.
    for name in ["q1", "q2"] {
        api.put_json(gpu_pod("team-b", name, true)).unwrap();
    }
    let gated = |name: &str| {
        api.get_json("v1", "pods", Some("team-b"), name).unwrap()["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| !g.is_empty())
    };
    eventually(
        "one pod released and one waiting with an Event",
        LIMIT,
        || {
            (gated("q1") != gated("q2"))
                && !api.list_json("v1", "events", Some("team-b")).is_empty()
        },
    )
    .await;
    // The namespace labeler: team-b (Queue mode) gets the label the gate webhook selects on.
    eventually("the queue label on team-b", LIMIT, || {
        api.get_json("v1", "namespaces", None, "team-b").unwrap()["metadata"]["labels"]
            ["quota.gpuplane.dev/queue"]
            == "true"
    })
    .await;
    // The leader renews its Lease.
    eventually("a Lease renewal", LIMIT, || {
        api.count_requests("PUT", "/leases/") > 0
    })
    .await;
    // The GPU-hours book: read, created, then replaced.
    eventually("a GPU-hours book update", LIMIT, || {
        api.count_requests("PUT", "/configmaps/") > 0
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    webhook.stop().await;

    let docs = docs();
    let granted = grants(&docs, NS, "gpuplane-controller");
    let used = check_calls(&api.api_calls(), &granted, "gpuplane controller");
    // Granted calls this scenario does not reach, with the code that makes them: evictions
    // (controller/queue/preempt.rs; the double has no Eviction API, so the real API server
    // checks this grant in tests/lab/real_cluster_preemption.rs, which fails on any refusal).
    let unreached = [rule("create", "", "pods/eviction")];
    check_grants_used(&granted, &used, &unreached, "gpuplane controller");
}

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
    use gpuplane_shell::quota::owners::is_label_key;
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
