//! The Helm chart installs, upgrades and uninstalls the agents on the lab.

use super::*;

/// Helm, as docs/install.md has it, on the three-node lab with our image: the namespace first,
/// then `helm install --take-ownership` with the image, `simulate.fromNodeLabel` and the
/// webhook certificate from a Secret of our own (no cert-manager here): the agents become
/// Ready on all nodes and serve GPU pods. `helm upgrade --reuse-values` with a changed agent
/// config (MIG strategy `mixed`) reaches the agents (lab-node-2 then offers its MIG devices).
/// `helm uninstall` removes the release but the CRD (Helm never deletes crds/), the agents'
/// sockets and slices go, and the documented command removes the node labels they wrote.
#[test]
fn helm_installs_upgrades_and_uninstalls_the_agents() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    let home = lab.work.join("helm-home");
    install_with_helm(&lab, &home, &built.reference);
    upgrade_with_helm(&lab, &home);
    uninstall_with_helm(&lab, &home);
}

/// `helm` with `args`, its state under `home`, against the lab; what it printed.
pub(crate) fn helm(lab: &ClusterLab, home: &Path, args: &[&str]) -> String {
    let mut cmd = lab.in_netns(lab.bin.join("helm"));
    for (var, dir) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        cmd.env(var, home.join(dir));
    }
    let out = cmd
        .args(args)
        .arg("--kubeconfig")
        .arg(lab.admin_kubeconfig())
        .current_dir(cluster::repo())
        .output()
        .expect("run helm");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "helm {args:?} failed:\n{said}");
    said
}

/// The MIG resources lab-node-2 offers, once its Node can be read.
fn mig_resources(lab: &ClusterLab) -> Option<Vec<String>> {
    let n = lab.get_json(&["get", "node", "lab-node-2"])?;
    let keys: Vec<String> = n["status"]["allocatable"]
        .as_object()?
        .keys()
        .filter(|k| k.starts_with("nvidia.com/mig-"))
        .cloned()
        .collect();
    Some(keys)
}

/// The namespace first, then `helm install --take-ownership` with the image `reference`,
/// `simulate.fromNodeLabel` and the webhook certificate from a Secret of our own: the agents
/// become Ready on all nodes and serve GPU pods; strategy none offers no MIG resource.
fn install_with_helm(lab: &ClusterLab, home: &Path, reference: &str) {
    helm_install(lab, home, reference, &[]);
    gpu_pod(lab, "dp-helm", "lab-node-3", false);
    let (_, l4) = machine("pcie-l4x4");
    assert!(pod_gpus(lab, "dp-helm").is_subset(&l4));
    assert_eq!(
        mig_resources(lab),
        Some(vec![]),
        "strategy none offers no MIG resource"
    );
}

/// The release namespace, made before the install when a test puts Secrets the values name in
/// it (the chart's own Namespace object then takes it over, `--take-ownership`).
pub(crate) fn release_namespace(lab: &ClusterLab) {
    lab.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {AGENT_NS}}}\n"
    ));
}

/// The release as [`install_with_helm`] installs it, with `extra` arguments to `helm install`
/// (`--set` of further values); returns once the agents and both controller replicas are
/// Ready.
pub(crate) fn helm_install(lab: &ClusterLab, home: &Path, reference: &str, extra: &[&str]) {
    release_namespace(lab);
    let (secret, ca_pem) = webhook_secret("my-webhook-tls");
    lab.apply(&secret);
    let ca = lab.work.join("webhook-ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    let (repo, tag) = reference.rsplit_once(':').unwrap();
    let began = std::time::Instant::now();
    let said = helm(
        lab,
        home,
        &[
            "install",
            "gpuplane",
            "deployments/helm/gpuplane",
            "--namespace",
            AGENT_NS,
            "--take-ownership",
            "--set",
            &format!("image.repository={repo}"),
            // A tag such as `1` is a string to the schema, not a number.
            "--set-string",
            &format!("image.tag={tag}"),
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "simulate.fromNodeLabel=true",
            "--set",
            "webhookCertificate.existingSecret=my-webhook-tls",
            "--set-file",
            &format!("webhookCertificate.caBundle={}", ca.display()),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
    );
    assert!(said.contains("STATUS: deployed"), "{said}");
    assert!(!said.contains("Warning"), "helm install warned:\n{said}");
    agents_ready(lab);
    eprintln!(
        "helm install to 3 agents Ready: {:.1}s",
        began.elapsed().as_secs_f64()
    );
    controllers_ready(lab);
}

/// `helm upgrade --reuse-values` with MIG strategy `mixed` reaches the agents: lab-node-2 then
/// offers its MIG devices.
fn upgrade_with_helm(lab: &ClusterLab, home: &Path) {
    helm(
        lab,
        home,
        &[
            "upgrade",
            "gpuplane",
            "deployments/helm/gpuplane",
            "--namespace",
            AGENT_NS,
            "--reuse-values",
            "--set",
            "config.flags.migStrategy=mixed",
        ],
    );
    let offered = eventually(
        "lab-node-2's agent to offer its MIG devices (strategy mixed)",
        || mig_resources(lab).filter(|k| !k.is_empty()),
    );
    assert!(
        offered.iter().any(|k| k == "nvidia.com/mig-1g.5gb"),
        "{offered:?}"
    );
}

/// `helm uninstall` removes the release but the CRD, the agents' sockets and slices go, and
/// the documented command removes the node labels they wrote.
fn uninstall_with_helm(lab: &ClusterLab, home: &Path) {
    lab.kubectl_ok(&["delete", "pod", "dp-helm", "--wait=true", "--timeout=120s"]);
    // As docs/install.md says it (no --wait: the release's Secret lives in the namespace the
    // release deletes, so Helm must drop it before the namespace is gone).
    helm(
        lab,
        home,
        &["uninstall", "gpuplane", "--namespace", AGENT_NS],
    );
    eventually("the agent pods gone", || {
        agent_pods(lab).is_empty().then_some(())
    });
    assert!(lab
        .get_json(&["get", "crd", "gpuquotas.quota.gpuplane.dev"])
        .is_some());
    assert!(lab
        .get_json(&["get", "deviceclass", "gpu.gpuplane.dev"])
        .is_none());
    eventually("the agents' ResourceSlices gone", || {
        cluster::slice_versions(lab, "").is_empty().then_some(())
    });
    for node in lab.nodes() {
        let left = files_with_prefix(&node.kubelet_root().join("device-plugins"), "gpuplane");
        assert!(left.is_empty(), "{}: {left:?}", node.name);
    }
    // The agents labelled their nodes (GPU Feature Discovery's labels); the documented command
    // removes them.
    let labelled = lab.get_json(&["get", "node", NODE]).unwrap();
    assert_eq!(labelled["metadata"]["labels"]["nvidia.com/gpu.count"], "8");
    let removal = cluster::documented_label_removal();
    let removal: Vec<&str> = removal.iter().map(String::as_str).collect();
    lab.kubectl_ok(&removal);
    let node = lab.get_json(&["get", "node", NODE]).unwrap();
    assert!(
        node["metadata"]["labels"]
            .get("nvidia.com/gpu.count")
            .is_none(),
        "{}",
        node["metadata"]["labels"]
    );
}
