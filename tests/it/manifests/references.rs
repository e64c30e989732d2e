//! The kustomization lists every manifest once, objects live in gpuplane-system, the names and
//! labels objects refer to exist, workload arguments are flags, DeviceClasses and the node config.

use super::*;

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

#[test]
fn names_and_labels_that_objects_refer_to_exist() {
    let docs = docs();
    let work = workloads(&docs);
    assert_eq!(
        work.len(),
        2,
        "the controller Deployment and the node DaemonSet"
    );
    workloads_refer_to_what_exists(&docs, &work);
    services_and_budgets_select_workloads(&docs, &work);
    bindings_and_webhooks_refer_to_what_exists(&docs);
    admission_policies_restrict_the_workloads(&docs, &work);
}

/// A workload as [`workloads`] gives it: the object, its pod template and its selector.
type Workload<'a> = (&'a Doc, core::PodTemplateSpec, BTreeMap<String, String>);

/// Workloads select their own pods, and their ServiceAccounts, ConfigMaps, Secrets, probe ports
/// and mounted volumes exist.
fn workloads_refer_to_what_exists(docs: &[Doc], work: &[Workload]) {
    let secrets_made: BTreeSet<String> = docs
        .iter()
        .filter(|d| d.kind() == "Certificate")
        .map(|d| d.value["spec"]["secretName"].as_str().unwrap().to_string())
        .collect();
    for (d, template, selector) in work {
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
            find(docs, "ServiceAccount", d.namespace(), &sa).is_some(),
            "{}: ServiceAccount {sa} missing",
            d.name()
        );
        for v in spec.volumes.iter().flatten() {
            if let Some(cm) = &v.config_map {
                assert!(
                    find(docs, "ConfigMap", d.namespace(), &cm.name).is_some(),
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
}

/// Services select pods of a workload and target ports it declares; a PodDisruptionBudget
/// covers a workload's pods.
fn services_and_budgets_select_workloads(docs: &[Doc], work: &[Workload]) {
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
}

/// Bindings refer to roles and service accounts that exist; webhooks call a Service that
/// exists, with a CA from a Certificate that exists.
fn bindings_and_webhooks_refer_to_what_exists(docs: &[Doc]) {
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
            find(docs, role_kind, role_ns, role).is_some(),
            "{}: {role_kind} {role} missing",
            d.name()
        );
        for s in d.value["subjects"].as_array().unwrap() {
            assert_eq!(s["kind"], "ServiceAccount");
            let (ns, name) = (s["namespace"].as_str(), s["name"].as_str().unwrap());
            assert!(
                find(docs, "ServiceAccount", ns, name).is_some(),
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
        assert!(find(docs, "Certificate", Some(ns), name).is_some(), "{ca}");
        for w in d.value["webhooks"].as_array().unwrap() {
            let svc = &w["clientConfig"]["service"];
            let s = find(
                docs,
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
}

/// Each admission policy is bound and restricts the account of one of the workloads.
fn admission_policies_restrict_the_workloads(docs: &[Doc], work: &[Workload]) {
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
            find(docs, "ValidatingAdmissionPolicy", None, b).is_some(),
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
            gpuplane_model::inventory::ResourceName::mig(&profile.parse().unwrap()),
            "{}",
            d.name()
        );
        assert!(cel.contains("type == 'mig'"), "{}: {cel}", d.name());
    }
    assert_eq!(backed["nvidia.com/gpu"], "gpu.gpuplane.dev");
    // Every MIG profile of the simulation profiles has its class.
    for p in ["a100-mig-mixed", "h100-mig-single"] {
        let inv = gpuplane_model::sim::load(p).unwrap();
        for mig in inv.gpus.iter().flat_map(|g| g.mig_devices.iter()) {
            let name = gpuplane_model::inventory::ResourceName::mig(&mig.profile);
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
    let parsed = gpuplane_model::config::AgentConfig::parse(key, text).unwrap();
    assert_eq!(
        parsed.allocation,
        gpuplane_model::config::AllocationMode::Shared
    );
}
