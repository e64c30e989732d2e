//! Step 8: the GPU-share quota card. A GpuQuota of 20Gi of GPU memory and one GPU (100%); a
//! ResourceClaim asking a share of 15Gi and 80% compute is allowed by the webhook over HTTPS,
//! allocated a share of the shared GPU as the scheduler would, prepared over DRA with the share
//! in its CDI environment, and the controller charges the quota exactly that (15Gi, 4/5 of a
//! GPU); a second share of 10Gi and 50% is then denied naming both dimensions.

use super::claim::{find_spec, spec_env};
use super::quota::review;
use super::{poll, published, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, QUOTA_NAME, SHARE_NAMESPACE};
use crate::doubles::lab::DEVICE_CLASS;
use gpuplane_model::quota::GpuQuota;
use gpuplane_model::sharing::{ENV_SHARE_COMPUTE, ENV_SHARE_MEMORY};
use kube::api::Api;
use serde_json::{json, Value};

/// The share that fits the card, and the one that then does not.
const FIRST: (&str, &str, u32) = ("share-15gi-80", "15Gi", 80);
const SECOND: (&str, &str, u32) = ("share-10gi-50", "10Gi", 50);
/// What the quota must be charged for the first, as the quota status writes it.
const CHARGED: (&str, &str) = ("15Gi", "4/5");

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = SHARE_NAMESPACE;
    if crate::demo::shared_gpu(cx.inventory).is_none() {
        return Outcome::Skipped(format!(
            "{} has no GPU with MIG off to share through consumable capacity",
            cx.profile
        ));
    }
    // An earlier step's pod may have held the shared GPU: it is published again once the
    // agent has seen that pod end.
    let device = poll(|| async {
        let (_, devices) = published(&cx.client).await?;
        devices
            .into_iter()
            .find(|d| d.shared && d.taints.is_empty())
            .ok_or_else(|| "no shared, untainted GPU is published".to_string())
    })
    .await;
    let Ok(device) = device else {
        return Outcome::Failed("no shared, untainted GPU is published".into());
    };
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpuMemory 20Gi, gpus 1 (100% of one GPU), mode Reject"
    ));
    say.say(format!(
        "{} is published shared (allowMultipleAllocations, capacities memory and compute)",
        device.name
    ));
    let (name, memory, compute) = FIRST;
    match validate(cx, FIRST, say).await {
        Ok((true, _)) => {}
        Ok((false, msg)) => return Outcome::Failed(format!("{name} denied: {msg}")),
        Err(e) => return Outcome::Failed(e),
    }
    let env = match prepare(cx, &device.name, say).await {
        Ok(env) => env,
        Err(e) => return Outcome::Failed(e),
    };
    let want_env = [
        format!("{ENV_SHARE_MEMORY}={memory}"),
        format!("{ENV_SHARE_COMPUTE}={compute}"),
    ];
    if let Some(missing) = want_env.iter().find(|w| !env.contains(w)) {
        return Outcome::Failed(format!(
            "the share's CDI spec lacks {missing}: {}",
            env.join(" ")
        ));
    }
    let charged = match charged(cx, say).await {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(e),
    };
    let (second, ..) = SECOND;
    let denial = match validate(cx, SECOND, say).await {
        Ok((false, msg)) => msg,
        Ok((true, _)) => return Outcome::Failed(format!("{second} was allowed over the card")),
        Err(e) => return Outcome::Failed(e),
    };
    let both = [
        format!("gpuMemory: requested 10Gi, used {} of 20Gi", CHARGED.0),
        format!("gpus: requested 1/2, used {} of 1", CHARGED.1),
    ];
    if !both.iter().all(|b| denial.contains(b)) {
        return Outcome::Failed(format!(
            "{second} denied without naming both dimensions: {denial}"
        ));
    }
    Outcome::Held(format!(
        "{name} prepared on {} ({}); {charged}; {second} denied ({})",
        device.name,
        want_env.join(", "),
        both.join("; ")
    ))
}

/// A ResourceClaim of [`SHARE_NAMESPACE`] asking one share of `memory` and `compute` percent.
fn share_claim(name: &str, memory: &str, compute: u32) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": SHARE_NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": DEVICE_CLASS,
            "capacity": {"requests": {"memory": memory, "compute": compute.to_string()}}}}]}}
    })
}

/// The validating webhook's verdict on creating the share claim, narrated.
async fn validate(
    cx: &Context<'_>,
    (name, memory, compute): (&str, &str, u32),
    say: &mut Narrator<'_>,
) -> Result<(bool, String), String> {
    let (ok, msg, _) = review(cx, "/validate", &share_claim(name, memory, compute)).await?;
    say.say(format!(
        "ResourceClaim {SHARE_NAMESPACE}/{name} asks {{memory: {memory}, compute: \"{compute}\"}} -> {}",
        if ok {
            "allowed".to_string()
        } else {
            format!("denied: {msg}")
        }
    ));
    Ok((ok, msg))
}

/// The first share allocated on `device` as the scheduler writes it, prepared over DRA: the
/// environment its CDI spec gives the container.
async fn prepare(
    cx: &Context<'_>,
    device: &str,
    say: &mut Narrator<'_>,
) -> Result<Vec<String>, String> {
    let (name, memory, compute) = FIRST;
    let claim = cx
        .lab
        .share_claim(SHARE_NAMESPACE, name, device, memory, compute)
        .map_err(|e| e.to_string())?;
    say.say(format!(
        "allocated (as the scheduler would) a share of {device}: consumedCapacity {{memory: {memory}, compute: {compute}}}"
    ));
    let prepared = cx
        .lab
        .prepare(&claim)
        .await
        .map_err(|e| format!("NodePrepareResources refused the share: {e}"))?;
    let id = prepared
        .iter()
        .flat_map(|d| d.cdi_ids.clone())
        .next()
        .ok_or("NodePrepareResources returned no CDI device")?;
    let (path, _) = find_spec(&cx.lab.paths().cdi_root, &id)?;
    let env = spec_env(&path)?;
    let shown: Vec<&String> = env
        .iter()
        .filter(|v| v.starts_with("GPUPLANE_SHARE_"))
        .collect();
    say.say(format!(
        "kubelet, DRA API: NodePrepareResources -> {id}; its CDI spec sets {}",
        shown
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(env)
}

/// Waits until the controller counts the share in the quota's `used` at its price, with no
/// reservation left; what the status says.
async fn charged(cx: &Context<'_>, say: &mut Narrator<'_>) -> Result<String, String> {
    let quotas: Api<GpuQuota> = Api::namespaced(cx.client.clone(), SHARE_NAMESPACE);
    let used = poll(|| async {
        let q = quotas.get(QUOTA_NAME).await.map_err(|e| e.to_string())?;
        let s = q.status.unwrap_or_default();
        let used = (s.used.gpu_memory.to_string(), s.used.gpus.to_string());
        match (used.0.as_str(), used.1.as_str()) == CHARGED && s.reservations.is_empty() {
            true => Ok(used),
            false => Err(format!(
                "used gpuMemory {}, gpus {}; {} reservation(s)",
                used.0,
                used.1,
                s.reservations.len()
            )),
        }
    })
    .await
    .map_err(|e| {
        format!("GpuQuota {SHARE_NAMESPACE}/{QUOTA_NAME} did not charge the share: {e}")
    })?;
    let text = format!(
        "GpuQuota {SHARE_NAMESPACE}/{QUOTA_NAME} used gpuMemory {}, gpus {}",
        used.0, used.1
    );
    say.say(format!(
        "{text} (the controller counts the allocated share)"
    ));
    Ok(text)
}
