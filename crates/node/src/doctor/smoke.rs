//! The doctor's smoke pods (`gpuplane doctor --smoke`): one pod on this node with one GPU
//! through each kubelet API, as a user asks for them (a `nvidia.com/gpu` limit; a
//! ResourceClaim of the GPU DeviceClass), each printing what it was given and succeeding only
//! if it saw a GPU: device nodes `/dev/nvidiaN` on hardware, the `GPUPLANE_DEVICE_*` variables
//! on a simulated machine. Each pod and claim is deleted afterwards, whatever came out; a
//! leftover of an earlier run goes first.

use super::Check;
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams, LogParams, PostParams};
use kube::runtime::wait::await_condition;
use serde_json::json;
use std::time::Duration;

/// Where and with what the smoke pods run.
#[derive(Debug, Clone)]
pub struct SmokeOptions {
    /// This node: the pods are pinned to it.
    pub node: String,
    pub namespace: String,
    /// An image with `sh`.
    pub image: String,
    /// The device-plugin resource.
    pub resource: String,
    /// The DeviceClass of a whole GPU.
    pub device_class: String,
    /// How long each pod may take to finish.
    pub timeout: Duration,
}

/// Prints what the container was given; fails when it saw no GPU.
const SCRIPT: &str = "found=$(ls /dev/nvidia[0-9]* 2>/dev/null; env | grep '^GPUPLANE_DEVICE_'); \
     echo \"$found\"; nvidia-smi -L 2>/dev/null; test -n \"$found\"";

/// Runs both smoke pods; one check each.
pub async fn smoke(client: kube::Client, o: &SmokeOptions) -> Vec<Check> {
    let mut out = Vec::new();
    for dra in [false, true] {
        out.push(one(&client, o, dra).await);
    }
    out
}

async fn one(client: &kube::Client, o: &SmokeOptions, dra: bool) -> Check {
    let (check, api) = if dra {
        ("smoke-dra", "dra")
    } else {
        ("smoke-device-plugin", "dp")
    };
    let name: String = format!("gpuplane-smoke-{api}-{}", o.node)
        .chars()
        .take(253)
        .collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &o.namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &o.namespace);
    let object = format!("{}/{name}", o.namespace);
    clean(&pods, &claims, &name, dra).await;
    let made = create(&pods, &claims, o, &name, dra).await;
    let result = match made {
        Ok(()) => finish(&pods, o, &name, &object, check).await,
        Err(e) => Check::fail(
            check,
            format!("creating pod {object}: {e}"),
            "the doctor needs create/delete on pods and resourceclaims and get on pods/log in --smoke-namespace; run it with an admin's --kubeconfig",
        ),
    };
    clean(&pods, &claims, &name, dra).await;
    result
}

async fn create(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    o: &SmokeOptions,
    name: &str,
    dra: bool,
) -> Result<(), String> {
    let pp = PostParams::default();
    let (resources, pod_claims) = if dra {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": o.device_class, "count": 1}}
            ]}}
        }))
        .map_err(|e| e.to_string())?;
        claims
            .create(&pp, &claim)
            .await
            .map_err(|e| chain(&e).to_string())?;
        (
            json!({"claims": [{"name": "gpu"}]}),
            json!([{"name": "gpu", "resourceClaimName": name}]),
        )
    } else {
        (json!({"limits": {o.resource.clone(): 1}}), json!([]))
    };
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "gpuplane-doctor-smoke"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": o.node},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": pod_claims,
            "containers": [{
                "name": "smoke",
                "image": o.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", SCRIPT],
                "resources": resources
            }]
        }
    }))
    .map_err(|e| e.to_string())?;
    pods.create(&pp, &pod)
        .await
        .map(|_| ())
        .map_err(|e| chain(&e).to_string())
}

/// Waits for the pod to end; the check from its phase, log and (if it never ran) why.
async fn finish(
    pods: &Api<Pod>,
    o: &SmokeOptions,
    name: &str,
    object: &str,
    check: &'static str,
) -> Check {
    let ended = |p: Option<&Pod>| {
        let phase = p.and_then(|p| p.status.as_ref()?.phase.as_deref());
        matches!(phase, Some("Succeeded" | "Failed"))
    };
    let waited = tokio::time::timeout(o.timeout, await_condition(pods.clone(), name, ended)).await;
    let pod = match waited {
        Ok(Ok(Some(pod))) => pod,
        Ok(Ok(None)) => {
            return Check::fail(
                check,
                format!("pod {object} was deleted by someone else"),
                "run the doctor again",
            )
        }
        Ok(Err(e)) => {
            return Check::fail(
                check,
                format!("watching pod {object}: {}", chain(&e)),
                "run the doctor again",
            )
        }
        Err(_) => {
            let why = pods
                .get_opt(name)
                .await
                .ok()
                .flatten()
                .map(|p| waiting(&p))
                .unwrap_or_default();
            return Check::fail(
                check,
                format!("pod {object} did not finish within {:?}: {why}", o.timeout),
                format!("`gpuplane explain pod {object}` while it waits (run with a longer --smoke-timeout), or the agent's log"),
            );
        }
    };
    let log = pods
        .logs(name, &LogParams::default())
        .await
        .unwrap_or_default();
    let seen: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(3)
        .collect();
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    let through = match pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
    {
        Some(_) => " (the scheduler served it through DRA as an extended resource)",
        None => "",
    };
    if phase == "Succeeded" {
        Check::ok(
            check,
            format!("pod {object} saw {}{through}", seen.join("; ")),
        )
    } else {
        Check::fail(
            check,
            format!("pod {object} {phase}: it saw no GPU ({})", seen.join("; ")),
            "its container got no device: check the agent's log and the node's CDI (`cdi`, `containerd` checks)",
        )
    }
}

/// Why a pod has not run: its unschedulable condition or its container's waiting reason.
fn waiting(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let condition = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.status == "False"))
        .map(|c| format!("{}: {}", c.type_, c.message.clone().unwrap_or_default()));
    let container = status
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref()?.waiting.as_ref())
        .map(|w| {
            format!(
                "{}: {}",
                w.reason.clone().unwrap_or_default(),
                w.message.clone().unwrap_or_default()
            )
        });
    container.or(condition).unwrap_or_else(|| "Pending".into())
}

/// Deletes the pod and its claim, if there.
async fn clean(pods: &Api<Pod>, claims: &Api<ResourceClaim>, name: &str, dra: bool) {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    if pods.delete(name, &now).await.is_ok() {
        // Gone before its claim goes, so the claim is not deleted while reserved for it.
        let gone = await_condition(pods.clone(), name, |p: Option<&Pod>| p.is_none());
        let _ = tokio::time::timeout(Duration::from_secs(60), gone).await;
    }
    if dra {
        let _ = claims.delete(name, &DeleteParams::default()).await;
    }
}
