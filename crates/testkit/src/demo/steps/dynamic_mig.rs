//! Step 9: dynamic MIG. A GPU in MIG mode without instances is published as every profile at
//! every placement; a claim allocated one placement is prepared over DRA, which must make that
//! MIG instance on the machine and hand it to the container (its UUID in the CDI spec); the
//! claim unprepared, the instance must be gone.

use super::claim::{find_spec, spec_env};
use super::{published, Context, NODE_NAMESPACE};
use crate::demo::facts::PublishedDevice;
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use gpuplane_model::inventory::MigDevice;
use gpuplane_model::source::DeviceSource;

/// The claim's name.
const CLAIM: &str = "mig-slice";

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let dynamic = crate::demo::dynamic_gpus(cx.inventory);
    if dynamic.is_empty() {
        return Outcome::Skipped(format!(
            "{} has no GPU in MIG mode without instances: dynamic MIG cuts only those (try --profile dynamic-mig-mixed)",
            cx.profile
        ));
    }
    let devices = match published(&cx.client).await {
        Ok((_, d)) => d,
        Err(e) => return Outcome::Failed(e),
    };
    let placements: Vec<&PublishedDevice> = devices
        .iter()
        .filter(|d| d.partitionable && d.placement.is_some() && d.taints.is_empty())
        .collect();
    // A 3g slice away from the start if there is one: the placement must be the one made.
    let Some(device) = placements
        .iter()
        .filter(|d| d.profile.as_deref().is_some_and(|p| p.starts_with("3g")))
        .max_by_key(|d| d.placement)
        .or(placements.first())
    else {
        return Outcome::Failed(format!(
            "GPU(s) {dynamic:?} are configured for dynamic MIG but no placement is published"
        ));
    };
    let (profile, start) = (
        device.profile.clone().unwrap_or_default(),
        device.placement.unwrap_or_default(),
    );
    say.say(format!(
        "{} placement device(s) published for GPU(s) {dynamic:?}; the machine has {} MIG instance(s) on them",
        placements.len(),
        instances(cx, &dynamic).map(|i| i.len()).unwrap_or_default()
    ));
    match made_and_destroyed(cx, device, &dynamic, say).await {
        Ok(uuid) => Outcome::Held(format!(
            "{}: MIG instance {profile} at slice {start} made at NodePrepare ({uuid}, in the CDI spec), destroyed at NodeUnprepare",
            device.name
        )),
        Err(e) => Outcome::Failed(e),
    }
}

/// Prepares a claim for `device`, checks the instance it made, unprepares it and checks the
/// instance is gone; the instance's UUID.
async fn made_and_destroyed(
    cx: &Context<'_>,
    device: &PublishedDevice,
    dynamic: &[u32],
    say: &mut Narrator<'_>,
) -> Result<String, String> {
    let before = instances(cx, dynamic)?;
    let claim = cx
        .lab
        .claim(NODE_NAMESPACE, CLAIM, &[&device.name])
        .map_err(|e| e.to_string())?;
    say.say(format!(
        "ResourceClaim {NODE_NAMESPACE}/{CLAIM}, allocated (as the scheduler would) to {}",
        device.name
    ));
    let prepared = cx
        .lab
        .prepare(&claim)
        .await
        .map_err(|e| format!("NodePrepareResources refused the claim: {e}"))?;
    let after = instances(cx, dynamic)?;
    let made: Vec<&MigDevice> = after.iter().filter(|m| !before.contains(m)).collect();
    let [made] = made[..] else {
        return Err(format!(
            "NodePrepare made {} MIG instance(s), not one",
            made.len()
        ));
    };
    let want = (device.profile.as_deref(), device.placement);
    let got = (
        Some(made.profile.to_string()),
        Some(i64::from(made.placement.start)),
    );
    if (got.0.as_deref(), got.1) != want {
        return Err(format!(
            "{} asks {want:?} but the instance made is {got:?}",
            device.name
        ));
    }
    let uuid = made.uuid.to_string();
    let id = prepared
        .iter()
        .flat_map(|d| d.cdi_ids.clone())
        .next()
        .ok_or("NodePrepareResources returned no CDI device")?;
    let env = spec_env(&find_spec(&cx.lab.paths().cdi_root, &id)?.0)?;
    say.say(format!(
        "kubelet, DRA API: NodePrepareResources -> {id}; the machine now has MIG instance {} at slice {} ({uuid})",
        made.profile, made.placement.start
    ));
    if !env.iter().any(|v| v.contains(&uuid)) {
        return Err(format!(
            "the claim's CDI spec does not hand out {uuid}: {}",
            env.join(" ")
        ));
    }
    cx.lab
        .unprepare(&claim)
        .await
        .map_err(|e| format!("NodeUnprepareResources failed: {e}"))?;
    let left = instances(cx, dynamic)?;
    say.say(format!(
        "kubelet, DRA API: NodeUnprepareResources -> {} MIG instance(s) left on GPU(s) {dynamic:?}",
        left.len()
    ));
    if left.iter().any(|m| m.uuid == made.uuid) {
        return Err(format!("{uuid} is still there after NodeUnprepare"));
    }
    Ok(uuid)
}

/// The MIG instances on the GPUs `dynamic`, as the machine (NVML) lists them now.
fn instances(cx: &Context<'_>, dynamic: &[u32]) -> Result<Vec<MigDevice>, String> {
    let found = cx
        .lab
        .sim
        .discover()
        .map_err(|e| format!("reading the machine: {e}"))?;
    Ok(found
        .inventory
        .gpus
        .into_iter()
        .filter(|g| dynamic.contains(&g.index))
        .flat_map(|g| g.mig_devices)
        .collect())
}
