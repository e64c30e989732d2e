//! The doctor's `agent-pod` check: the agent's pod on this node as the API server has it (the
//! DaemonSet's pod, by its label), Ready or why not. Read-only. It answers from outside the
//! node too (`--api-only`), where the `agent` check (the agent's `/readyz`) cannot reach; the
//! pod's Ready condition is the kubelet's probe of that same `/readyz`.

use super::Check;
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::api::{Api, ListParams};

const NAME: &str = "agent-pod";
/// The label the DaemonSet's pods carry (daemonset/node/daemonset.yaml, the chart).
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name=gpuplane-node";

/// The agent pod of `node` in `namespace`.
pub async fn agent_pod(client: kube::Client, node: &str, namespace: &str) -> Check {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let lp = ListParams::default()
        .labels(AGENT_SELECTOR)
        .fields(&format!("spec.nodeName={node}"));
    match api.list(&lp).await {
        Ok(list) => judge(&list.items, node, namespace),
        Err(e) => Check::fail(
            NAME,
            format!(
                "listing pods {AGENT_SELECTOR} of node {node} in namespace {namespace}: {}",
                chain(&e)
            ),
            format!("give the doctor API access that may list pods in {namespace} (--kubeconfig), or name the namespace gpuplane runs in (--agent-namespace)"),
        ),
    }
}

/// What `pods` (the agent pods the API server lists for `node`) say: the newest one that is
/// not being deleted decides.
fn judge(pods: &[Pod], node: &str, namespace: &str) -> Check {
    let current = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .max_by_key(|p| p.metadata.creation_timestamp.clone());
    let Some(pod) = current else {
        return Check::fail(
            NAME,
            format!("no gpuplane-node pod on node {node} in namespace {namespace}"),
            format!("the DaemonSet's nodeSelector, tolerations or affinity leave this node out (the chart's default selects nodes labelled nvidia.com/gpu.present=true: kubectl label node {node} nvidia.com/gpu.present=true), or gpuplane is not installed in {namespace} (--agent-namespace)"),
        );
    };
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();
    let statuses = status.container_statuses.unwrap_or_default();
    let restarts: i32 = statuses.iter().map(|c| c.restart_count).sum();
    let ready = status
        .conditions
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if ready {
        return Check::ok(
            NAME,
            format!("pod {namespace}/{name} Ready on node {node} ({restarts} restart(s))"),
        );
    }
    let mut why = vec![status.phase.unwrap_or_else(|| "Pending".into())];
    why.extend(statuses.iter().filter_map(container_state));
    why.push(format!("{restarts} restart(s)"));
    Check::fail(
        NAME,
        format!(
            "pod {namespace}/{name} on node {node} is not Ready: {}",
            why.join(", ")
        ),
        format!("read why: kubectl -n {namespace} logs {name} (--previous after a restart), kubectl -n {namespace} describe pod {name}; an agent that runs but is not ready says what it waits for in its log"),
    )
}

/// A container that is not running, in the kubelet's words (its waiting reason, or how it
/// ended), with its last termination message.
fn container_state(c: &ContainerStatus) -> Option<String> {
    let state = c.state.as_ref()?;
    let now = if let Some(w) = &state.waiting {
        let reason = w.reason.as_deref().unwrap_or("waiting");
        format!("container {} {reason}", c.name)
    } else if let Some(t) = &state.terminated {
        let reason = t.reason.as_deref().unwrap_or("terminated");
        format!("container {} {reason} (exit {})", c.name, t.exit_code)
    } else {
        return None;
    };
    let last = c
        .last_state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .and_then(|t| t.message.as_deref())
        .map(|m| m.trim())
        .filter(|m| !m.is_empty());
    Some(match last {
        Some(m) => format!("{now}: {m}"),
        None => now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn no_pod_fails_naming_the_node_label_the_chart_selects() {
        let c = judge(&[], "gpu-7", "gpuplane-system");
        assert_eq!(c.status, Status::Fail);
        assert!(c.detail.contains("node gpu-7"), "{c:?}");
        assert!(
            c.fix
                .contains("kubectl label node gpu-7 nvidia.com/gpu.present=true"),
            "{c:?}"
        );
    }

    #[test]
    fn a_ready_pod_passes_and_a_crashing_one_says_why() {
        let ready = pod(json!({
            "metadata": {"name": "gpuplane-node-a", "creationTimestamp": "2026-12-07T06:00:00Z"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "agent", "ready": true, "restartCount": 1,
                                              "image": "i", "imageID": "", "state": {"running": {}}}]}
        }));
        let c = judge(&[ready], "n", "gpuplane-system");
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert!(c.detail.contains("gpuplane-system/gpuplane-node-a Ready"));

        let crashing = pod(json!({
            "metadata": {"name": "gpuplane-node-b", "creationTimestamp": "2026-12-07T06:00:00Z"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [{"name": "agent", "ready": false, "restartCount": 4,
                                              "image": "i", "imageID": "",
                                              "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                              "lastState": {"terminated": {"exitCode": 1,
                                                  "message": "error: opening NVML\n"}}}]}
        }));
        let c = judge(&[crashing], "n", "gpuplane-system");
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.detail
                .contains("container agent CrashLoopBackOff: error: opening NVML"),
            "{c:?}"
        );
        assert!(c.detail.contains("4 restart(s)"), "{c:?}");
        assert!(c
            .fix
            .contains("kubectl -n gpuplane-system logs gpuplane-node-b"));
    }

    #[test]
    fn a_pod_being_deleted_does_not_count() {
        let going = pod(json!({
            "metadata": {"name": "old", "creationTimestamp": "2026-12-07T06:00:00Z",
                         "deletionTimestamp": "2026-12-07T06:05:00Z"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }));
        assert_eq!(judge(&[going], "n", "ns").status, Status::Fail);
    }
}
