//! gpuplane deployed as users deploy it (issue 23): `kubectl apply -k` of daemonset/ on a
//! three-node lab (hack/cluster/lab.sh with LAB_NODES=3), the DaemonSet's and the Deployment's
//! pods running our test image (tests/cluster/image.rs) in the nodes' containerd. The overlay
//! changes only what a loopback lab cannot have: the image (ours, `imagePullPolicy: Never`),
//! cert-manager's Certificate (a Secret of the same name and keys, made here), the webhooks'
//! caBundle, and `--simulate-from-node-label` so each node serves the machine its
//! `gpuplane.dev/simulate` label names. Everything else runs as shipped: mounts,
//! securityContext, probes, env, ServiceAccounts and their projected tokens, RBAC, the
//! node-scoped admission policy, the Service in front of the webhook.

use crate::cluster;
use crate::cluster::{eventually, image, ClusterLab, AGENT_NS, DRIVER, NODE};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

mod agents;
mod busy_hours;
mod controller;
mod doctor;
mod helm_install;
mod kueue;

/// Each node and the bundled machine it simulates.
pub(crate) const MACHINES: [(&str, &str); 3] = [
    (NODE, "dgx-h100"),
    ("lab-node-2", "a100-mig-mixed"),
    ("lab-node-3", "pcie-l4x4"),
];

/// The webhook's serving certificate for the Service's names and its CA, as cert-manager's
/// Certificate would make them: (Secret manifest, CA PEM).
fn webhook_secret(name: &str) -> (String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![
        format!("gpuplane-controller.{AGENT_NS}.svc"),
        format!("gpuplane-controller.{AGENT_NS}.svc.cluster.local"),
    ])
    .unwrap()
    .signed_by(&key, &ca)
    .unwrap();
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": AGENT_NS},
        "stringData": {"tls.crt": cert.pem(), "tls.key": key.serialize_pem(), "ca.crt": ca.pem()}
    });
    (serde_json::to_string(&secret).unwrap(), ca.pem())
}

/// The deployment overlay over daemonset/ at `overlay` (see the module docs for what it
/// changes, and nothing else).
fn deploy_overlay(overlay: &Path, image_ref: &str, extra: &str) -> String {
    use base64::Engine;
    // One CA per lab: an image upgrade re-applies the overlay, and a new CA there would race
    // the controller pods still serving the old certificate (a rollout does not rotate it).
    let (secret_file, ca_file) = (
        overlay.join("webhook-tls.json"),
        overlay.join("webhook-ca.pem"),
    );
    let ca_pem = match std::fs::read_to_string(&ca_file) {
        Ok(pem) if secret_file.exists() => pem,
        _ => {
            let (secret, ca_pem) = webhook_secret("gpuplane-webhook-tls");
            std::fs::write(&secret_file, secret).unwrap();
            std::fs::write(&ca_file, &ca_pem).unwrap();
            ca_pem
        }
    };
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let mut text = cluster::overlay_head(overlay, &["webhook-tls.json"]);
    text += &format!(
        r#"- target: {{kind: DaemonSet, name: gpuplane-node}}
  patch: |-
    - {{op: replace, path: /spec/template/spec/containers/0/image, value: "{image_ref}"}}
    - {{op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}}
    - {{op: add, path: /spec/template/spec/containers/0/args/-, value: --simulate-from-node-label}}
{extra}- target: {{kind: Deployment, name: gpuplane-controller}}
  patch: |-
    - {{op: replace, path: /spec/template/spec/containers/0/image, value: "{image_ref}"}}
    - {{op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}}
"#
    );
    for (kind, hooks) in [
        ("ValidatingWebhookConfiguration", 2),
        ("MutatingWebhookConfiguration", 2),
    ] {
        text += &format!(
            "- target: {{kind: {kind}, name: gpuplane-quota}}\n  patch: |-\n    - {{op: remove, path: /metadata/annotations}}\n"
        );
        for i in 0..hooks {
            text += &format!(
                "    - {{op: add, path: /webhooks/{i}/clientConfig/caBundle, value: \"{ca}\"}}\n"
            );
        }
    }
    text
}

/// A three-node lab with our image in every node and the machines' labels on the nodes.
pub(crate) fn lab_with_image(tag: &str) -> Option<(ClusterLab, image::TestImage)> {
    let lab = ClusterLab::start_nodes(3)?;
    let built = match image::build(&lab.work, tag, tag) {
        Ok(b) => b,
        Err(why) => panic!("{why}"),
    };
    lab.import_image(&built.tar);
    for (node, machine) in MACHINES {
        lab.kubectl_ok(&[
            "label",
            "node",
            node,
            "nvidia.com/gpu.present=true",
            &format!("gpuplane.dev/simulate={machine}"),
        ]);
    }
    Some((lab, built))
}

/// `kubectl apply -k` of the deployment overlay; it must print no warning.
fn apply_overlay(lab: &ClusterLab, image_ref: &str) {
    apply_overlay_with(lab, image_ref, "", &[]);
}

/// [`apply_overlay`] with `extra` JSON patch lines for the agents' DaemonSet and further
/// patches (`patches`, whole kustomize patch entries).
pub(crate) fn apply_overlay_with(
    lab: &ClusterLab,
    image_ref: &str,
    extra: &str,
    patches: &[String],
) {
    let overlay = lab.work.join("deploy");
    std::fs::create_dir_all(&overlay).unwrap();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        deploy_overlay(&overlay, image_ref, extra) + &patches.concat(),
    )
    .unwrap();
    let out = lab.kubectl(&["apply", "-k", overlay.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kubectl apply -k: {stderr}");
    assert!(!stderr.contains("Warning:"), "{stderr}");
}

/// A pod: (node, name, ready).
pub(crate) type PodOnNode = (String, String, bool);

/// The pods of app `app` (`app.kubernetes.io/name`) in gpuplane's namespace that are not being
/// deleted: (node, pod name, ready).
pub(crate) fn app_pods(lab: &ClusterLab, app: &str) -> Vec<PodOnNode> {
    let selector = format!("app.kubernetes.io/name={app}");
    let pods = lab
        .get_json(&["get", "pods", "-n", AGENT_NS, "-l", &selector])
        .unwrap_or(Value::Null);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            let ready = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            let field = |v: &Value| v.as_str().unwrap_or("").to_string();
            (
                field(&p["spec"]["nodeName"]),
                field(&p["metadata"]["name"]),
                ready,
            )
        })
        .collect()
}

/// The agent pods: (node, pod name, ready).
pub(crate) fn agent_pods(lab: &ClusterLab) -> Vec<PodOnNode> {
    app_pods(lab, "gpuplane-node")
}

/// Waits until an agent pod is Ready on each of the three nodes; those pods.
pub(crate) fn agents_ready(lab: &ClusterLab) -> Vec<PodOnNode> {
    eventually("an agent pod Ready on each of the 3 nodes", || {
        let pods = agent_pods(lab);
        (pods.len() == 3 && pods.iter().all(|p| p.2)).then_some(pods)
    })
}

/// The three-node lab with daemonset/ applied through the deployment overlay (image `1`) and
/// every agent Ready: the lab, the image, the agent pods, and how long from apply to Ready.
fn deployed() -> Option<(ClusterLab, image::TestImage, Vec<PodOnNode>, f64)> {
    let (lab, built) = lab_with_image("1")?;
    let began = std::time::Instant::now();
    apply_overlay(&lab, &built.reference);
    let pods = agents_ready(&lab);
    let took = began.elapsed().as_secs_f64();
    // GPU pods need the quota webhook (it fails closed for them): both replicas serving.
    controllers_ready(&lab);
    Some((lab, built, pods, took))
}

/// A bundled machine, from `gpuplane discover`: the UUIDs its DRA devices carry (the MIG
/// devices of a GPU in MIG mode, else the GPU) and its GPUs not in MIG mode (what the shipped
/// config, MIG strategy `none`, offers as `nvidia.com/gpu`).
pub(crate) fn machine(name: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .args(["discover", "--simulate", name, "-o", "json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (mut dra, mut whole) = (BTreeSet::new(), BTreeSet::new());
    for g in v["gpus"].as_array().into_iter().flatten() {
        let uuid = g["uuid"].as_str().unwrap().to_string();
        if g["mig"]["current"] == true {
            dra.extend(
                g["migDevices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|m| m["uuid"].as_str().map(String::from)),
            );
        } else {
            dra.insert(uuid.clone());
            whole.insert(uuid);
        }
    }
    (dra, whole)
}

/// A pod on `node` printing its environment and sleeping, holding one `nvidia.com/gpu`
/// (`claim`: false) or one GPU through a claim from DeviceClass gpu.gpuplane.dev.
pub(crate) fn gpu_pod(lab: &ClusterLab, name: &str, node: &str, claim: bool) {
    let (claims, resources) = if claim {
        (
            format!("  resourceClaims:\n  - {{name: gpu, resourceClaimTemplateName: {name}}}\n"),
            "      claims: [{name: gpu}]\n".to_string(),
        )
    } else {
        (
            String::new(),
            "      limits: {nvidia.com/gpu: 1}\n".to_string(),
        )
    };
    if claim {
        lab.apply(&format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly: {{deviceClassName: gpu.gpuplane.dev, count: 1}}\n"
        ));
    }
    lab.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n  restartPolicy: Never\n  terminationGracePeriodSeconds: 1\n{claims}  containers:\n  - name: c\n    image: lab.local/busybox:1\n    imagePullPolicy: Never\n    command: [\"sh\", \"-c\", \"env; sleep 3600\"]\n    resources:\n{resources}"
    ));
}

/// The GPU UUIDs a pod's container was given (its environment), once it printed it.
pub(crate) fn pod_gpus(lab: &ClusterLab, pod: &str) -> BTreeSet<String> {
    let log = eventually(&format!("pod {pod}'s env in its log"), || {
        let out = lab.kubectl(&["logs", pod]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.contains("PATH=").then_some(text)
    });
    log.lines()
        .find_map(|l| l.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
        .unwrap_or_else(|| panic!("no NVIDIA_VISIBLE_DEVICES in {pod}:\n{log}"))
        .split(',')
        .filter(|u| u.starts_with("GPU-"))
        .map(String::from)
        .collect()
}

/// A kubeconfig with a token of the agent's ServiceAccount bound to agent pod `pod`, as the
/// kubelet projects into it (the API server adds the pod's node to the user's extra).
pub(crate) fn pod_token_kubeconfig(lab: &ClusterLab, pod: &str) -> std::path::PathBuf {
    let p = lab.get_json(&["get", "pod", pod, "-n", AGENT_NS]).unwrap();
    let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
    lab.token_kubeconfig(
        &format!("pod-{pod}"),
        &[
            "create",
            "token",
            cluster::AGENT_SA,
            "-n",
            AGENT_NS,
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            pod,
            "--bound-object-uid",
            &uid,
        ],
    )
}

/// Waits until the controller's 2 replicas are Ready; those pods.
pub(crate) fn controllers_ready(lab: &ClusterLab) -> Vec<(String, bool)> {
    eventually("the controller's 2 replicas Ready", || {
        let pods = controller_pods(lab);
        (pods.len() == 2 && pods.iter().all(|p| p.1)).then_some(pods)
    })
}

/// The controller pods: (name, ready).
fn controller_pods(lab: &ClusterLab) -> Vec<(String, bool)> {
    app_pods(lab, "gpuplane-controller")
        .into_iter()
        .map(|(_, name, ready)| (name, ready))
        .collect()
}

/// `kubectl rollout status` of the agents' DaemonSet, until it completes.
pub(crate) fn rollout(lab: &ClusterLab) {
    let out = lab.kubectl(&[
        "rollout",
        "status",
        "daemonset/gpuplane-node",
        "-n",
        AGENT_NS,
        "--timeout=300s",
    ]);
    assert!(
        out.status.success(),
        "the rollout did not complete: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub(crate) fn pod_phase(lab: &ClusterLab, ns: &str, pod: &str) -> Option<String> {
    lab.get_json(&["get", "pod", pod, "-n", ns])?["status"]["phase"]
        .as_str()
        .map(String::from)
}

/// Files in a directory whose names start with `prefix`.
fn files_with_prefix(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}
