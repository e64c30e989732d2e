//! The controller as deployed: it serves through its Service, and its Lease moves when the
//! leader goes.

use super::*;

/// The current holder of the controller's Lease.
pub(crate) fn lease_holder(lab: &ClusterLab) -> Option<String> {
    let lease = lab.get_json(&["get", "lease", "gpuplane-controller", "-n", AGENT_NS])?;
    lease["spec"]["holderIdentity"].as_str().map(String::from)
}

/// A pod of namespace `ns` asking for `gpus` nvidia.com/gpu; kubectl create's answer.
fn create_gpu_pod(lab: &ClusterLab, ns: &str, name: &str, gpus: u32) -> Result<(), String> {
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  restartPolicy: Never\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: c\n    image: lab.local/busybox:1\n    imagePullPolicy: Never\n    command: [\"sleep\", \"3600\"]\n    resources:\n      limits: {{nvidia.com/gpu: {gpus}}}\n"
    );
    let out = lab.kubectl_as(&lab.admin_kubeconfig(), &["create", "-f", "-"], Some(&pod));
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).to_string())
    }
}

/// The controller's two replicas run as pods and one holds the Lease; the API server calls the
/// webhook through the Service (a pod over quota is denied with our reason). Deleting the
/// leader's pod moves the Lease to the other replica within its lease duration, and GPU pods
/// created meanwhile are all decided: none lost, none admitted over quota.
#[test]
fn the_controller_serves_through_its_service_and_its_lease_moves_when_the_leader_goes() {
    let Some((lab, ..)) = deployed() else {
        return;
    };
    let pods = controllers_ready(&lab);
    let leader = eventually("a Lease holder among the replicas", || {
        let h = lease_holder(&lab)?;
        pods.iter()
            .find(|p| h.starts_with(&p.0))
            .map(|p| p.0.clone())
    });
    lab.kubectl_ok(&["create", "namespace", "team-a"]);
    lab.apply(
        "apiVersion: quota.gpuplane.dev/v1alpha1\nkind: GpuQuota\nmetadata: {name: default, namespace: team-a}\nspec:\n  hard: {devices: {nvidia.com/gpu: 2}}\n  mode: Reject\n",
    );
    // Through the Service: the webhook's caches hold the quota once a dry run over it is denied.
    eventually(
        "the webhook, through its Service, to enforce team-a's quota",
        || {
            let out = lab.kubectl_as(
            &lab.admin_kubeconfig(),
            &["create", "--dry-run=server", "-f", "-"],
            Some("apiVersion: v1\nkind: Pod\nmetadata: {name: probe, namespace: team-a}\nspec:\n  containers:\n  - name: c\n    image: lab.local/busybox:1\n    resources:\n      limits: {nvidia.com/gpu: 3}\n"),
        );
            let err = String::from_utf8_lossy(&out.stderr);
            err.contains("in GpuQuota team-a/default").then_some(())
        },
    );
    let lease = lab
        .get_json(&["get", "lease", "gpuplane-controller", "-n", AGENT_NS])
        .unwrap();
    let duration = lease["spec"]["leaseDurationSeconds"].as_u64().unwrap();

    let began = std::time::Instant::now();
    lab.kubectl_ok(&["delete", "pod", &leader, "-n", AGENT_NS, "--wait=false"]);
    let mut outcomes = Vec::new();
    let mut moved = None;
    for i in 0..8 {
        outcomes.push(create_gpu_pod(&lab, "team-a", &format!("during-{i}"), 1));
        if moved.is_none() {
            if let Some(h) = lease_holder(&lab).filter(|h| !h.starts_with(&leader)) {
                moved = Some((h, began.elapsed()));
            }
        }
    }
    let (holder, after) = moved.unwrap_or_else(|| {
        eventually("the Lease to move off the deleted leader", || {
            lease_holder(&lab)
                .filter(|h| !h.starts_with(&leader))
                .map(|h| (h, began.elapsed()))
        })
    });
    eprintln!(
        "the Lease moved from {leader} to {holder} in {:.1}s (lease duration {duration}s)",
        after.as_secs_f64()
    );
    assert!(
        after.as_secs() <= duration,
        "the Lease took {after:?}, longer than its duration {duration}s"
    );
    let admitted = outcomes.iter().filter(|o| o.is_ok()).count();
    assert!(
        admitted <= 2,
        "{admitted} GPU pods admitted over a quota of 2: {outcomes:?}"
    );
    for o in &outcomes {
        if let Err(e) = o {
            assert!(
                e.contains("in GpuQuota team-a/default") || e.contains("failed calling webhook"),
                "a create was neither admitted nor denied by the quota webhook: {e}"
            );
        }
    }
    // Every admitted pod exists: none lost.
    let listed = lab
        .get_json(&["get", "pods", "-n", "team-a"])
        .and_then(|l| l["items"].as_array().map(Vec::len))
        .unwrap_or(0);
    assert_eq!(listed, admitted, "{outcomes:?}");
}
