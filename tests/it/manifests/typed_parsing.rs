//! Every manifest parses into its typed Kubernetes object (cert-manager's too) with no unknown
//! field, and the round trip that detects unknown fields does.

use super::*;

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
