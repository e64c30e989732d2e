//! Kueue in the lab (issue 41): its manager as hack/cluster builds it (sigs.k8s.io/kueue, pinned
//! in hack/cluster/kueue/go.mod) in an image of its own, installed from its own manifests, the
//! `config/default` its release's `manifests.yaml` is built from (hack/cluster/build.sh keeps
//! it beside the binary as `kueue-config`), with `kubectl apply --server-side` as Kueue's
//! install docs say. The overlay changes only what a loopback lab must: the image (ours,
//! `imagePullPolicy: Never`), and the manager's Configuration where a test asks for DRA
//! (`resources.deviceClassMappings` behind the alpha feature gate `DynamicResourceAllocation`,
//! as Kueue's DRA docs tell a user), and the visibility APIService, which the lab's API server
//! cannot serve (it has no front-proxy client certificate) and nothing here reads.

use super::*;

/// Our Kueue image's reference.
pub const KUEUE_IMAGE: &str = "lab.local/kueue:v0.17.0";
/// Where Kueue runs.
pub const KUEUE_NS: &str = "kueue-system";

/// Kueue's Configuration: the one its manifests ship (config/components/manager), with
/// `extra` appended (top-level keys).
fn configuration(config: &Path, extra: &str) -> String {
    let shipped = config.join("components/manager/controller_manager_config.yaml");
    let text =
        std::fs::read_to_string(&shipped).unwrap_or_else(|e| panic!("{}: {e}", shipped.display()));
    format!("{}\n{extra}", text.trim_end())
}

/// The DeviceClasses Kueue counts as one resource, `name` (a ClusterQueue names it in its
/// quota), as its Configuration's `resources.deviceClassMappings`.
pub fn device_class_mapping(name: &str, classes: &[&str]) -> String {
    let classes: Vec<String> = classes.iter().map(|c| format!("\"{c}\"")).collect();
    format!(
        "resources:\n  deviceClassMappings:\n  - name: {name}\n    deviceClassNames: [{}]\n",
        classes.join(", ")
    )
}

/// Builds Kueue's image and imports it into every node, applies Kueue's manifests (its
/// Configuration with `config_extra`, and `feature_gates` as its `--feature-gates` flag when
/// not empty) and waits until its webhooks answer.
pub fn install_kueue(lab: &ClusterLab, config_extra: &str, feature_gates: &str) {
    let upstream = lab.bin.join("kueue-config");
    let dir = lab.work.join("kueue");
    std::fs::create_dir_all(&dir).unwrap();
    // A copy inside the overlay: kustomize loads bases from under its root.
    let copy = dir.join("upstream");
    let cp = Command::new("cp")
        .arg("-rL")
        .arg(&upstream)
        .arg(&copy)
        .status();
    assert!(cp.is_ok_and(|s| s.success()), "copy {}", upstream.display());
    let tar = dir.join("kueue.tar");
    let out = Command::new("python3")
        .arg(repo().join("hack/cluster/oci-image.py"))
        .arg(&tar)
        .args(["--name", KUEUE_IMAGE])
        .args(["--entrypoint", "[\"/manager\"]"])
        .args(["--user", "65532:65532"])
        .arg("--file")
        .arg(format!("{}:/manager", lab.bin.join("kueue").display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lab.import_image(&tar);
    let config = configuration(&copy, config_extra);
    let patch = serde_json::json!([{"op": "replace",
        "path": "/data/controller_manager_config.yaml", "value": config}]);
    std::fs::write(dir.join("config-patch.json"), patch.to_string()).unwrap();
    let gates = match feature_gates {
        "" => String::new(),
        g => format!(
            "    - op: add\n      path: /spec/template/spec/containers/0/args/-\n      value: --feature-gates={g}\n"
        ),
    };
    let (name, tag) = KUEUE_IMAGE.rsplit_once(':').unwrap();
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "resources:\n- upstream/default\n\
             images:\n- name: us-central1-docker.pkg.dev/k8s-staging-images/kueue/kueue\n  newName: {name}\n  newTag: {tag}\n\
             patches:\n\
             - target: {{kind: ConfigMap, name: kueue-manager-config}}\n  path: config-patch.json\n\
             - target: {{kind: Deployment, name: kueue-controller-manager}}\n  patch: |-\n    - op: replace\n      path: /spec/template/spec/containers/0/imagePullPolicy\n      value: Never\n{gates}\
             - target: {{kind: APIService}}\n  patch: |-\n    $patch: delete\n    apiVersion: apiregistration.k8s.io/v1\n    kind: APIService\n    metadata: {{name: any}}\n"
        ),
    )
    .unwrap();
    let out = lab.kubectl(&["apply", "--server-side", "-k", dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "installing Kueue: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let describe = || {
        String::from_utf8_lossy(&lab.kubectl(&["describe", "pods", "-n", KUEUE_NS]).stdout)
            .into_owned()
    };
    eventually_or(
        "Kueue's manager Available",
        || {
            let d = lab.get_json(&[
                "get",
                "deployment",
                "kueue-controller-manager",
                "-n",
                KUEUE_NS,
            ]);
            d.is_some_and(|d| d["status"]["availableReplicas"].as_u64() == Some(1))
        },
        describe,
    );
    // Its webhooks answer once its certificates are in place: a ResourceFlavor (the one every
    // ClusterQueue here uses) goes through the validating one.
    eventually_or(
        "Kueue's webhooks to answer",
        || {
            lab.create(
                "apiVersion: kueue.x-k8s.io/v1beta2\nkind: ResourceFlavor\nmetadata: {name: default-flavor}\n",
                &[],
            )
            .is_ok()
        },
        describe,
    );
}
