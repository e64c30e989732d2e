//! Installing daemonset/ into the lab: the kustomize overlay that points it at the lab's image
//! and registry, and what an install leaves to the tests.

use super::*;

/// What [`ClusterLab::install`] made: each service account's kubeconfig and the webhook's
/// serving certificate (for 127.0.0.1, issued by a CA the webhook configurations trust).
pub struct Installed {
    pub agent: PathBuf,
    pub controller: PathBuf,
    pub webhook_cert: PathBuf,
    pub webhook_key: PathBuf,
}

/// The start of a kustomization at `overlay` over daemonset/ (kustomize takes only a relative
/// path to a base) with `resources` of its own, and the patches every lab needs: cert-manager
/// is not installed, so its Issuer and Certificate go. Patches follow.
pub fn overlay_head(overlay: &Path, resources: &[&str]) -> String {
    let up = "../".repeat(overlay.components().count() - 1);
    let base = format!(
        "{up}{}",
        repo()
            .join("daemonset")
            .display()
            .to_string()
            .trim_start_matches('/')
    );
    let own: String = resources.iter().map(|r| format!("- {r}\n")).collect();
    format!(
        r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- {base}
{own}patches:
- patch: |-
    $patch: delete
    apiVersion: cert-manager.io/v1
    kind: Issuer
    metadata: {{name: gpuplane-selfsigned, namespace: {AGENT_NS}}}
- patch: |-
    $patch: delete
    apiVersion: cert-manager.io/v1
    kind: Certificate
    metadata: {{name: gpuplane-webhook, namespace: {AGENT_NS}}}
"#
    )
}

/// The kustomization the lab applies over daemonset/ (at `overlay`; kustomize takes only a
/// relative path to a base). The patches are the loopback ones and nothing else:
/// - cert-manager is not installed: the test is the CA (`ca_pem`), so its Issuer and
///   Certificate go;
/// - the agent and the controller run as host processes in the lab's network namespace (the
///   lab has no image registry): the Deployment keeps 0 replicas and the DaemonSet selects no
///   node, while the API server still validates both;
/// - the webhooks are called by URL on 127.0.0.1 (the controller shares the API server's
///   network namespace) with `ca_pem` as caBundle, or left out when `ca_pem` is `None`.
pub fn lab_overlay(overlay: &Path, ca_pem: Option<&str>) -> String {
    let mut text = overlay_head(overlay, &[]);
    text += r#"- target: {kind: Deployment, name: gpuplane-controller}
  patch: |-
    - {op: replace, path: /spec/replicas, value: 0}
- target: {kind: DaemonSet, name: gpuplane-node}
  patch: |-
    - {op: replace, path: /spec/template/spec/nodeSelector, value: {gpuplane.dev/lab: host-process}}
"#;
    match ca_pem {
        Some(pem) => {
            use base64::Engine;
            let ca = base64::engine::general_purpose::STANDARD.encode(pem);
            let url = |path: &str| {
                format!("{{url: \"https://{WEBHOOK_ADDR}{path}\", caBundle: \"{ca}\"}}")
            };
            let (validate, mutate) = (url("/validate"), url("/mutate"));
            text += &format!(
                r#"- target: {{kind: ValidatingWebhookConfiguration, name: gpuplane-quota}}
  patch: |-
    - {{op: remove, path: /metadata/annotations}}
    - {{op: replace, path: /webhooks/0/clientConfig, value: {validate}}}
    - {{op: replace, path: /webhooks/1/clientConfig, value: {validate}}}
- target: {{kind: MutatingWebhookConfiguration, name: gpuplane-quota}}
  patch: |-
    - {{op: remove, path: /metadata/annotations}}
    - {{op: replace, path: /webhooks/0/clientConfig, value: {mutate}}}
    - {{op: replace, path: /webhooks/1/clientConfig, value: {mutate}}}
"#
            );
        }
        None => {
            for kind in [
                "ValidatingWebhookConfiguration",
                "MutatingWebhookConfiguration",
            ] {
                text += &format!(
                    "- patch: |-\n    $patch: delete\n    apiVersion: admissionregistration.k8s.io/v1\n    kind: {kind}\n    metadata: {{name: gpuplane-quota}}\n"
                );
            }
        }
    }
    text
}
