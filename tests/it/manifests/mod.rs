//! The deployment manifests in daemonset/: every object parses into its typed Kubernetes object
//! with no unknown field, the kustomization lists exactly the files there, the names and labels
//! objects refer to exist, the workloads' arguments are flags the binary accepts, and each
//! component's RBAC grants exactly the API calls its code makes, observed by driving the real
//! node agent and the real controller against the API server double.

use crate::lab::{Lab, DRIVER, NODE, WAIT};
use crate::support::eventually::{eventually, LIMIT};
use gpuplane_model::source::DeviceSource;
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

mod admission_policies;
mod crd;
mod rbac_calls;
mod references;
mod typed_parsing;
mod webhook_scope;

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
                        "configmaps" => gpuplane_cluster::controller::meter::BOOK_NAME,
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

fn rule(verb: &str, group: &str, resource: &str) -> Rule {
    (verb.into(), group.into(), resource.into())
}
