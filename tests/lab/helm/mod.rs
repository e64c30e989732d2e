//! The Helm chart in deployments/helm/gpuplane (issue 23): `helm lint --strict` is clean,
//! `helm template` with default values renders exactly the objects of `kubectl kustomize
//! daemonset/` (so the chart and the kustomize base cannot drift apart), non-default values
//! reach the objects they configure, values.schema.json refuses bad values naming the field,
//! and (as root, in the cluster lab of tests/cluster) the install, upgrade and uninstall that
//! docs/install.md describes work against a real API server.
//!
//! helm and kubectl are the ones hack/cluster/build.sh builds (components `helm` and
//! `kubernetes`): `GPUPLANE_CLUSTER_BIN`, else `build.sh --check`. Without them the tests print
//! `SKIPPED: ...` and pass, or fail when `CI` is set (as tests/cluster does).

use crate::cluster;

mod prometheus_access;

use base64::Engine;
use gpuplane_model::config::{AgentConfig, MigStrategy};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const CHART: &str = "deployments/helm/gpuplane";
const NS: &str = "gpuplane-system";
const RELEASE: &str = "gpuplane";

/// A CA certificate in PEM form for caBundle values (the schema wants a PEM; the tests only
/// check where it goes, except the lab's, which uses a real CA).
const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBtest\n-----END CERTIFICATE-----\n";

/// helm and kubectl, and a private home for helm's cache, config and data (it writes nothing
/// under the user's home).
struct Tools {
    helm: PathBuf,
    kubectl: PathBuf,
    home: tempfile::TempDir,
}

/// The tools, or `None` after printing why the test skips (a panic under `CI`).
fn tools() -> Option<Tools> {
    match cluster::cluster_bin_with(&["helm", "kubectl"]) {
        Ok(dir) => Some(Tools {
            helm: dir.join("helm"),
            kubectl: dir.join("kubectl"),
            home: tempfile::tempdir().unwrap(),
        }),
        Err(why) => {
            if std::env::var_os("CI").is_some() {
                panic!("helm test cannot run, and CI is set so it may not skip: {why}");
            }
            eprintln!("SKIPPED: helm test: {why}");
            None
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Tools {
    /// `helm <args>` (in the repository root), with helm's own directories in `home`.
    fn helm_cmd(&self, program: Command, args: &[&str]) -> Output {
        let mut cmd = program;
        for (var, dir) in [
            ("HELM_CACHE_HOME", "cache"),
            ("HELM_CONFIG_HOME", "config"),
            ("HELM_DATA_HOME", "data"),
        ] {
            cmd.env(var, self.home.path().join(dir));
        }
        cmd.args(args)
            .current_dir(cluster::repo())
            .stdin(Stdio::null())
            .output()
            .expect("run helm")
    }

    fn helm(&self, args: &[&str]) -> Output {
        self.helm_cmd(Command::new(&self.helm), args)
    }

    /// `helm template` of the chart in namespace `ns` with the CRDs, as `helm install` would
    /// apply it; stdout, or helm's error.
    fn template(&self, ns: &str, args: &[&str]) -> Result<String, String> {
        let mut all = vec![
            "template",
            RELEASE,
            CHART,
            "--namespace",
            ns,
            "--include-crds",
        ];
        all.extend_from_slice(args);
        let out = self.helm(&all);
        if out.status.success() {
            Ok(String::from_utf8(out.stdout).unwrap())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// [`Tools::template`] that must succeed, parsed.
    fn render(&self, ns: &str, args: &[&str]) -> Objects {
        let text = self
            .template(ns, args)
            .unwrap_or_else(|e| panic!("helm template {args:?} failed: {e}"));
        objects(&text)
    }

    /// `kubectl kustomize <dir>`.
    fn kustomize(&self, dir: &Path) -> String {
        let out = Command::new(&self.kubectl)
            .arg("kustomize")
            .arg(dir)
            .output()
            .expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl kustomize {} failed: {}",
            dir.display(),
            text(&out)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `manifests` as `kubectl kustomize` writes them: a kustomization with them as its one
    /// resource and no transformer, which changes no object. kustomize's YAML writer (yaml.v3)
    /// adds a blank line in a folded (`>-`) scalar before a more-indented line, so its output
    /// parses back with an extra `\n` in the CEL expressions of the webhooks and admission
    /// policies (`kubectl apply -k` sends its in-memory objects, without it). Writing helm's
    /// objects the same way compares the objects rather than the two writers.
    fn through_kustomize(&self, manifests: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rendered.yaml"), manifests).unwrap();
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- rendered.yaml\n",
        )
        .unwrap();
        self.kustomize(dir.path())
    }
}

/// Objects by `apiVersion kind namespace/name`.
type Objects = BTreeMap<String, Value>;

fn key(v: &Value) -> String {
    format!(
        "{} {} {}/{}",
        v["apiVersion"].as_str().unwrap_or("?"),
        v["kind"].as_str().unwrap_or("?"),
        v["metadata"]["namespace"].as_str().unwrap_or(""),
        v["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// A multi-document YAML stream, parsed; empty documents (templates that render nothing) are
/// skipped, a second object with the same key fails the test.
fn objects(text: &str) -> Objects {
    let mut out = Objects::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("bad YAML: {e}\n{text}"));
        if v.is_null() {
            continue;
        }
        let k = key(&v);
        assert!(out.insert(k.clone(), v).is_none(), "{k} twice");
    }
    out
}

/// The config file of a ConfigMap, parsed, in place of its text: the chart writes
/// `.Values.config` with toYaml, so key order, list style and the comments of
/// daemonset/node/config.yaml differ while every field must be the same.
fn parse_embedded_yaml(objects: &mut Objects) {
    for v in objects.values_mut() {
        if v["kind"] != "ConfigMap" {
            continue;
        }
        if let Some(data) = v.get_mut("data").and_then(Value::as_object_mut) {
            for (k, item) in data.iter_mut() {
                if let (true, Some(s)) = (k.ends_with(".yaml"), item.as_str()) {
                    let parsed: Value = serde_yaml_ng::from_str(s).unwrap();
                    *item = json!({ "parsed YAML": parsed });
                }
            }
        }
    }
}

/// Where `a` (kustomize) and `b` (helm) differ, one line per JSON path.
fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let p = format!("{path}.{k}");
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => diff(u, v, &p, out),
                    (Some(u), None) => out.push(format!("{p}: only in kustomize: {u}")),
                    (None, Some(v)) => out.push(format!("{p}: only in helm: {v}")),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                diff(u, v, &format!("{path}[{i}]"), out);
            }
        }
        _ if a != b => out.push(format!("{path}: kustomize {a}, helm {b}")),
        _ => {}
    }
}

/// Every difference between two sets of objects, readable; empty when they are the same.
fn differences(kustomize: &Objects, helm: &Objects) -> Vec<String> {
    let mut out = Vec::new();
    for k in kustomize.keys().filter(|k| !helm.contains_key(*k)) {
        out.push(format!("{k}: only in kustomize"));
    }
    for k in helm.keys().filter(|k| !kustomize.contains_key(*k)) {
        out.push(format!("{k}: only in helm"));
    }
    for (k, a) in kustomize {
        if let Some(b) = helm.get(k) {
            let mut lines = Vec::new();
            diff(a, b, "", &mut lines);
            if !lines.is_empty() {
                out.push(format!("{k}:\n  {}", lines.join("\n  ")));
            }
        }
    }
    out
}

/// daemonset/ and the chart rendered with `args`, both through kustomize's writer and parsed.
fn kustomize_and_helm(t: &Tools, args: &[&str]) -> (Objects, Objects) {
    let mut k = objects(&t.kustomize(&cluster::repo().join("daemonset")));
    let rendered = t
        .template(NS, args)
        .unwrap_or_else(|e| panic!("helm template failed: {e}"));
    let mut h = objects(&t.through_kustomize(&rendered));
    parse_embedded_yaml(&mut k);
    parse_embedded_yaml(&mut h);
    (k, h)
}

fn find<'a>(objects: &'a Objects, kind: &str, name: &str) -> &'a Value {
    objects
        .values()
        .find(|v| v["kind"] == kind && v["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in {:?}", objects.keys()))
}

fn of_kind<'a>(objects: &'a Objects, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    objects.values().filter(move |v| v["kind"] == kind)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn container(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]["containers"][0]
}

fn args_of(workload: &Value) -> Vec<String> {
    strings(&container(workload)["args"])
}

/// The node agent's config file as the agent reads it.
fn agent_config(objects: &Objects) -> AgentConfig {
    let cm = find(objects, "ConfigMap", "gpuplane-node-config");
    let text = cm["data"]["config.yaml"].as_str().unwrap();
    AgentConfig::parse("config.yaml", text)
        .unwrap_or_else(|e| panic!("the rendered config is refused by the agent: {e}\n{text}"))
}

/// Runs the binary with `args` and `--help`: clap checks every flag and value before it acts
/// on --help, so this fails on a flag or value the binary does not accept.
fn assert_binary_accepts(what: &str, mut args: Vec<String>) {
    args.push("--help".into());
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what} args {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `yaml` into a file of `dir` for `helm -f`.
fn values_file(dir: &Path, name: &str, yaml: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    path.to_str().unwrap().to_string()
}

/// Everything but the certificate differs from the defaults.
const NON_DEFAULT_VALUES: &str = r#"
image: {repository: registry.example.com/gpu/gpuplane, tag: "1.2.3", pullPolicy: Always}
imagePullSecrets: [{name: registry-login}]
driverName: gpu.nvidia.com
apis: {devicePlugin: false, dra: true}
simulate: {fromNodeLabel: true, telemetryFile: /var/lib/gpuplane/telemetry.json}
config:
  flags: {migStrategy: mixed}
  sharing:
    timeSlicing:
      renameByDefault: true
      resources:
      - {name: nvidia.com/gpu, replicas: 4}
      - {name: nvidia.com/mig-1g.10gb, replicas: 2, rename: nvidia.com/mig-1g.10gb.quarter}
node:
  nodeSelector: {nvidia.com/gpu.present: null, pool: gpu}
  tolerations: [{key: dedicated, operator: Equal, value: gpu, effect: NoSchedule}]
  priorityClassName: gpu-critical
  resources: {requests: {cpu: 50m, memory: 100Mi}, limits: {memory: 1Gi}}
  telemetry: {interval: 1m30s, idleAfter: 30m, idleBelow: 10}
controller:
  replicas: 3
  kueue: true
  prometheusUrl: https://thanos-querier.openshift-monitoring.svc:9091
  prometheusCaFile: /var/run/secrets/kubernetes.io/serviceaccount/service-ca.crt
  prometheusBearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
  nodeSelector: {role: infra}
  priorityClassName: ""
  resources: {requests: {cpu: 200m, memory: 256Mi}}
"#;

#[test]
fn lint_is_clean_with_default_and_non_default_values() {
    let Some(t) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let other = values_file(dir.path(), "other.yaml", NON_DEFAULT_VALUES);
    let ca = values_file(dir.path(), "ca.pem", TEST_CA_PEM);
    let secret = format!("webhookCertificate.caBundle={ca}");
    for args in [
        vec![],
        vec![
            "-f",
            other.as_str(),
            "--set",
            "webhookCertificate.existingSecret=my-webhook-tls",
            "--set-file",
            secret.as_str(),
        ],
    ] {
        let mut all = vec!["lint", "--strict", CHART, "--namespace", NS];
        all.extend_from_slice(&args);
        let out = t.helm(&all);
        let said = text(&out);
        assert!(out.status.success(), "helm lint {args:?} failed:\n{said}");
        assert!(
            said.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{said}"
        );
        // --strict fails on warnings; INFO (no icon) is all that may be said.
        let findings: Vec<&str> = said
            .lines()
            .filter(|l| l.starts_with('[') && !l.starts_with("[INFO]"))
            .collect();
        assert!(findings.is_empty(), "helm lint {args:?}: {findings:?}");
    }
}

#[test]
fn default_values_render_exactly_what_kustomize_builds() {
    let Some(t) = tools() else { return };
    let (k, h) = kustomize_and_helm(&t, &[]);
    let problems = differences(&k, &h);
    assert!(
        problems.is_empty(),
        "helm template (default values) differs from kubectl kustomize daemonset/ (the CRD: \
         copy daemonset/controller/crd.yaml over {CHART}/crds/gpuquotas.quota.gpuplane.dev.yaml):\n{}",
        problems.join("\n")
    );
    // Not vacuous: the whole install, the CRD (crds/) and the cert-manager objects included.
    assert!(k.len() > 50, "{} objects", k.len());
    for kind in [
        "Namespace",
        "CustomResourceDefinition",
        "DaemonSet",
        "Deployment",
        "Certificate",
        "Issuer",
        "PodDisruptionBudget",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        assert_eq!(of_kind(&h, kind).count(), 1, "{kind}");
    }
    // The config text differs from daemonset/node/config.yaml's (comments, layout); the agent
    // must read the same config from both.
    assert_eq!(
        agent_config(&objects(&t.template(NS, &[]).unwrap())),
        agent_config(&objects(&t.kustomize(&cluster::repo().join("daemonset"))))
    );
}

#[test]
fn the_comparison_notices_a_changed_value() {
    let Some(t) = tools() else { return };
    let (k, h) = kustomize_and_helm(
        &t,
        &[
            "--set",
            "controller.replicas=3",
            "--set",
            "config.nodeLabels.enabled=false",
        ],
    );
    let problems = differences(&k, &h);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    for object in [
        "apps/v1 Deployment gpuplane-system/gpuplane-controller:",
        "v1 ConfigMap gpuplane-system/gpuplane-node-config:",
    ] {
        assert!(
            problems.iter().any(|p| p.starts_with(object)),
            "{object} {problems:#?}"
        );
    }
    let all = problems.join("\n");
    assert!(all.contains(".spec.replicas: kustomize 2, helm 3"), "{all}");
    assert!(
        all.contains(
            ".data.config.yaml.parsed YAML.nodeLabels.enabled: kustomize true, helm false"
        ),
        "{all}"
    );
}

#[test]
fn values_reach_the_objects_they_configure() {
    let Some(t) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let values = values_file(dir.path(), "values.yaml", NON_DEFAULT_VALUES);
    let o = t.render(NS, &["-f", &values]);

    let ds = find(&o, "DaemonSet", "gpuplane-node");
    let deploy = find(&o, "Deployment", "gpuplane-controller");
    for w in [ds, deploy] {
        let c = container(w);
        assert_eq!(c["image"], "registry.example.com/gpu/gpuplane:1.2.3");
        assert_eq!(c["imagePullPolicy"], "Always");
        assert_eq!(
            w["spec"]["template"]["spec"]["imagePullSecrets"],
            json!([{"name": "registry-login"}])
        );
    }

    let agent = the_agent_gets_its_values(ds);
    let controller = the_controller_gets_its_values(&o, deploy);
    classes_and_rbac_name_the_driver(&o);
    the_config_file_gets_its_values(&o);

    // The binary accepts both workloads' arguments. --simulate-from-node-label is checked
    // once the binary has it (it is being added alongside this chart).
    let has_simulate_flag = text(
        &Command::new(env!("CARGO_BIN_EXE_gpuplane"))
            .args(["node", "--help"])
            .output()
            .unwrap(),
    )
    .contains("--simulate-from-node-label");
    assert_binary_accepts(
        "DaemonSet",
        agent
            .into_iter()
            .filter(|a| has_simulate_flag || a != "--simulate-from-node-label")
            .collect(),
    );
    assert_binary_accepts("Deployment", controller);

    // The defaults: no simulation, and the controller prices the default driver unasked.
    let d = t.render(NS, &[]);
    assert!(!args_of(find(&d, "DaemonSet", "gpuplane-node"))
        .iter()
        .any(|a| a.starts_with("--simulate")));
    assert!(!args_of(find(&d, "Deployment", "gpuplane-controller"))
        .iter()
        .any(|a| a.starts_with("--driver-name") || a.starts_with("--time-sliced")));
    scrape_annotations_name_the_metrics_port(&d);
}

/// Both workloads' pods carry Prometheus's `prometheus.io/*` annotations naming the port
/// their `--metrics-addr` serves, and the agent's defaults keep telemetry on with idle Events
/// off.
fn scrape_annotations_name_the_metrics_port(o: &Objects) {
    for (kind, name) in [
        ("DaemonSet", "gpuplane-node"),
        ("Deployment", "gpuplane-controller"),
    ] {
        let w = find(o, kind, name);
        let a = &w["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(a["prometheus.io/scrape"], "true", "{name}: {a}");
        assert_eq!(a["prometheus.io/path"], "/metrics", "{name}: {a}");
        let port = a["prometheus.io/port"].as_str().unwrap();
        let addr = format!("--metrics-addr=0.0.0.0:{port}");
        assert!(args_of(w).contains(&addr), "{name}: {addr} not in its args");
    }
    let agent = args_of(find(o, "DaemonSet", "gpuplane-node"));
    assert!(agent.iter().any(|a| a == "--telemetry-interval=10s"));
    assert!(!agent.iter().any(|a| a.starts_with("--idle-")), "{agent:?}");
}

/// The agent's values: APIs, driver name, the simulation flag, scheduling, resources; its
/// arguments.
fn the_agent_gets_its_values(ds: &Value) -> Vec<String> {
    // The agent: APIs, driver name, the simulation flag, scheduling, resources.
    let agent = args_of(ds);
    for want in [
        "--device-plugin=false",
        "--dra=true",
        "--driver-name=gpu.nvidia.com",
        "--simulate-from-node-label",
        "--simulate-telemetry=/var/lib/gpuplane/telemetry.json",
        "--telemetry-interval=1m30s",
        "--idle-after=30m",
        "--idle-below=10",
    ] {
        assert!(agent.iter().any(|a| a == want), "{want} not in {agent:?}");
    }
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({"pool": "gpu"}));
    assert_eq!(
        pod["tolerations"],
        json!([{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}])
    );
    assert_eq!(pod["priorityClassName"], "gpu-critical");
    assert_eq!(
        container(ds)["resources"],
        json!({"requests": {"cpu": "50m", "memory": "100Mi"}, "limits": {"memory": "1Gi"}})
    );
    agent
}

/// The controller's values: replicas (a PDB with more than one), the driver it prices, the
/// time-sliced resources under their advertised names, scheduling; its arguments.
fn the_controller_gets_its_values(o: &Objects, deploy: &Value) -> Vec<String> {
    // The controller: replicas (a PDB with more than one), the driver it prices, the
    // time-sliced resources under their advertised names, scheduling.
    assert_eq!(deploy["spec"]["replicas"], 3);
    assert_eq!(of_kind(o, "PodDisruptionBudget").count(), 1);
    let controller = args_of(deploy);
    for want in [
        "--driver-name=gpu.nvidia.com",
        "--time-sliced=nvidia.com/gpu.shared=4",
        "--time-sliced=nvidia.com/mig-1g.10gb.quarter=2",
        "--kueue",
        "--prometheus-url=https://thanos-querier.openshift-monitoring.svc:9091",
        "--prometheus-ca-file=/var/run/secrets/kubernetes.io/serviceaccount/service-ca.crt",
        "--prometheus-bearer-token-file=/var/run/secrets/kubernetes.io/serviceaccount/token",
    ] {
        assert!(
            controller.iter().any(|a| a == want),
            "{want} not in {controller:?}"
        );
    }
    let cpod = &deploy["spec"]["template"]["spec"];
    assert_eq!(cpod["nodeSelector"], json!({"role": "infra"}));
    assert!(cpod.get("priorityClassName").is_none(), "{cpod}");
    assert_eq!(
        container(deploy)["resources"],
        json!({"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}})
    );
    controller
}

/// Every DeviceClass selects the configured driver, and the agent may write the status of
/// claims of that driver.
fn classes_and_rbac_name_the_driver(o: &Objects) {
    let classes: Vec<&Value> = of_kind(o, "DeviceClass").collect();
    assert!(classes.len() > 30, "{} DeviceClasses", classes.len());
    for c in classes {
        let cel = c["spec"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap();
        assert!(
            cel.starts_with(
                "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com']."
            ),
            "{}: {cel}",
            c["metadata"]["name"]
        );
        assert!(!cel.contains("gpu.gpuplane.dev"), "{cel}");
    }
    let role = find(o, "ClusterRole", "gpuplane-node");
    let driver_rule = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resources"] == json!(["resourceclaims/driver"]))
        .unwrap();
    assert_eq!(driver_rule["resourceNames"], json!(["gpu.nvidia.com"]));
}

/// The config file: what the agent reads.
fn the_config_file_gets_its_values(o: &Objects) {
    let config = agent_config(o);
    assert_eq!(config.mig_strategy, MigStrategy::Mixed);
    let sliced: Vec<(&str, u32)> = config
        .time_slicing
        .iter()
        .map(|r| (r.advertised_as.as_str(), r.replicas))
        .collect();
    assert_eq!(
        sliced,
        [
            ("nvidia.com/gpu.shared", 4),
            ("nvidia.com/mig-1g.10gb.quarter", 2)
        ]
    );
    assert!(config.node_labels, "defaults the values did not set stay");
}

#[test]
fn an_existing_secret_replaces_cert_manager() {
    let Some(t) = tools() else { return };
    let dir = tempfile::tempdir().unwrap();
    let ca = values_file(dir.path(), "ca.pem", TEST_CA_PEM);
    let o = t.render(
        NS,
        &[
            "--set",
            "webhookCertificate.existingSecret=my-webhook-tls",
            "--set-file",
            &format!("webhookCertificate.caBundle={ca}"),
            "--set",
            "controller.replicas=1",
        ],
    );
    for v in o.values() {
        assert!(
            !v["apiVersion"]
                .as_str()
                .unwrap()
                .starts_with("cert-manager.io/"),
            "{}",
            key(v)
        );
    }
    let bundle = base64::engine::general_purpose::STANDARD.encode(TEST_CA_PEM);
    let mut webhooks = 0;
    for kind in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        let cfg = find(&o, kind, "gpuplane-quota");
        assert!(cfg["metadata"].get("annotations").is_none(), "{cfg}");
        for w in cfg["webhooks"].as_array().unwrap() {
            assert_eq!(
                w["clientConfig"]["caBundle"],
                bundle.as_str(),
                "{}",
                w["name"]
            );
            assert_eq!(w["clientConfig"]["service"]["namespace"], NS);
            webhooks += 1;
        }
    }
    assert_eq!(webhooks, 4);
    let deploy = find(&o, "Deployment", "gpuplane-controller");
    let volumes = &deploy["spec"]["template"]["spec"]["volumes"];
    assert_eq!(
        volumes,
        &json!([{"name": "tls", "secret": {"secretName": "my-webhook-tls"}}])
    );
    // One replica: no PodDisruptionBudget that would block every drain.
    assert_eq!(deploy["spec"]["replicas"], 1);
    assert_eq!(of_kind(&o, "PodDisruptionBudget").count(), 0);
}

#[test]
fn another_release_namespace_is_used_throughout() {
    let Some(t) = tools() else { return };
    let ns = "gpu-ops";
    let o = t.render(ns, &[]);
    fn all_strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Array(a) => a.iter().for_each(|x| all_strings(x, out)),
            Value::Object(m) => m.iter().for_each(|(k, x)| {
                out.push(k);
                all_strings(x, out)
            }),
            _ => {}
        }
    }
    for v in o.values() {
        let mut s = Vec::new();
        all_strings(v, &mut s);
        let stale: Vec<&&str> = s.iter().filter(|s| s.contains(NS)).collect();
        assert!(stale.is_empty(), "{} still names {NS}: {stale:?}", key(v));
        if let Some(got) = v["metadata"].get("namespace") {
            assert_eq!(got, ns, "{}", key(v));
        }
    }
    assert!(o.contains_key(&format!("v1 Namespace /{ns}")));
    let agent = format!("system:serviceaccount:{ns}:gpuplane-node");
    let policy = find(
        &o,
        "ValidatingAdmissionPolicy",
        "gpuplane-node-resourceslices",
    );
    assert!(
        policy["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .unwrap()
            .contains(&agent),
        "{policy}"
    );
    let cert = find(&o, "Certificate", "gpuplane-webhook");
    assert_eq!(
        strings(&cert["spec"]["dnsNames"]),
        [
            format!("gpuplane-controller.{ns}.svc"),
            format!("gpuplane-controller.{ns}.svc.cluster.local")
        ]
    );
    let hooks = find(&o, "ValidatingWebhookConfiguration", "gpuplane-quota");
    assert_eq!(
        hooks["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{ns}/gpuplane-webhook")
    );
    assert_eq!(
        hooks["webhooks"][0]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["kube-system", ns])
    );
    let binding = find(&o, "ClusterRoleBinding", "gpuplane-controller");
    assert_eq!(binding["subjects"][0]["namespace"], ns);

    // Without the Namespace object, for a namespace managed elsewhere.
    let o = t.render(ns, &["--set", "createNamespace=false"]);
    assert_eq!(of_kind(&o, "Namespace").count(), 0);
}

#[test]
fn bad_values_are_refused_naming_the_field() {
    let Some(t) = tools() else { return };
    for (set, field) in [
        ("controller.replicas=-1", "/controller/replicas"),
        ("controller.replicas=0", "/controller/replicas"),
        ("imageTag=1.0", "'imageTag' not allowed"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("config.flags.migStrategy=both", "/config/flags/migStrategy"),
        ("config.health.recoveryQuietPeriod=5", "/config/health/recoveryQuietPeriod"),
        ("config.sharing.timeSlicing.resources[0].name=nvidia.com/gpu,config.sharing.timeSlicing.resources[0].replicas=1",
         "/config/sharing/timeSlicing/resources/0/replicas"),
        ("config.flags.plugin.migStrategy=mixed", "'migStrategy' not allowed"),
        ("driverName=GPU_Driver", "/driverName"),
        ("apis.dra=yes", "/apis/dra"),
        ("node.telemetry.interval=10", "/node/telemetry/interval"),
        ("node.telemetry.idleBelow=0", "/node/telemetry/idleBelow"),
        ("simulate.telemetryFile=telemetry.json", "/simulate/telemetryFile"),
        ("controller.prometheusUrl=ftp://p:9090", "/controller/prometheusUrl"),
        ("webhookCertificate.existingSecret=mine", "/webhookCertificate/caBundle"),
        ("webhookCertificate.caBundle=abc", "/webhookCertificate/caBundle"),
    ] {
        let err = t
            .template(NS, &["--set", set])
            .expect_err(&format!("--set {set} was accepted"));
        assert!(
            err.contains("values don't meet the specifications of the schema"),
            "--set {set}: {err}"
        );
        assert!(err.contains(field), "--set {set}: {field} not named in {err}");
    }
}

#[test]
fn the_uninstall_doc_removes_every_label_the_agent_writes() {
    let args = cluster::documented_label_removal();
    assert_eq!(args[..3], ["label", "nodes", "--all"]);
    let removed: Vec<&str> = args[3..]
        .iter()
        .map(|a| {
            a.strip_suffix('-')
                .unwrap_or_else(|| panic!("{a} is not a removal"))
        })
        .collect();
    assert_eq!(removed, gpuplane_model::labels::MANAGED);
}
