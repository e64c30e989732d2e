//! Step 4: one ledger under both APIs. The claimed device of step 3 is withdrawn from
//! ListAndWatch and an Allocate for it is refused naming the claim; a claim for a device a
//! device-plugin pod holds is refused naming that holder.

use super::{list, listed, poll, published, Carry, Context, NODE_NAMESPACE};
use crate::demo::facts::PublishedDevice;
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use gpuplane_node::dra::ClaimRef;

pub(super) async fn run(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let Some((claim, device)) = carry.claim.clone() else {
        return Outcome::Failed("needs the claim of the previous step, which did not hold".into());
    };
    let Some(uuid) = device.uuid.clone() else {
        return Outcome::Failed(format!("{} is published without a uuid", device.name));
    };
    let mut evidence = match allocate_refused(cx, &claim, &device, &uuid, say).await {
        Ok(e) => e,
        Err(e) => return Outcome::Failed(e),
    };
    // The other direction: a claim for a device a container holds through the device plugin
    // (the 4-GPU pod's, or one admitted now where the machine could not show that step).
    if carry.pod_ids.is_empty() {
        if let Err(e) = admit_small_pod(cx, carry, &uuid, say).await {
            return Outcome::Failed(e);
        }
    }
    if let Some(taken) = carry.pod_ids.first() {
        match prepare_refused(cx, taken, say).await {
            Ok(more) => evidence.push_str(&more),
            Err(e) => return Outcome::Failed(e),
        }
    }
    Outcome::Held(evidence)
}

/// The device plugin side first withdraws the claimed device from ListAndWatch, and an
/// Allocate that still asks for it (a kubelet with a stale list) is refused naming the claim.
async fn allocate_refused(
    cx: &Context<'_>,
    claim: &ClaimRef,
    device: &PublishedDevice,
    uuid: &str,
    say: &mut Narrator<'_>,
) -> Result<String, String> {
    let resource = poll(|| async {
        match listed(cx.lab).get(uuid) {
            Some((resource, health)) if health == "Unhealthy" => Ok(resource.clone()),
            Some((_, health)) => Err(format!("ListAndWatch still lists {uuid} as {health}")),
            None => Err(format!("no device-plugin resource lists {uuid}")),
        }
    })
    .await?;
    say.say(format!(
        "ListAndWatch now lists {} ({resource} {uuid}) as Unhealthy: withdrawn while the claim holds it",
        device.name
    ));
    let holder = format!("ResourceClaim {}/{}", claim.namespace, claim.name);
    let refusal = match cx
        .lab
        .kubelet
        .allocate(&resource, &[uuid.to_string()])
        .await
    {
        Ok(_) => return Err(format!("Allocate granted {uuid}, which {holder} holds")),
        Err(s) => s.message().to_string(),
    };
    say.say(format!(
        "device plugin Allocate({uuid}) -> refused: {refusal}"
    ));
    if !refusal.contains(&holder) {
        return Err(format!("the refusal does not name {holder}: {refusal}"));
    }
    Ok(format!(
        "Allocate of {} refused, naming {holder}",
        device.name
    ))
}

/// Where step 2 did not run: a 1-unit pod admitted through the device plugin on a healthy
/// device other than `claimed`, if there is one; a MIG device where there is one, so that a
/// machine with a single whole GPU keeps it for the share step.
async fn admit_small_pod(
    cx: &Context<'_>,
    carry: &mut Carry,
    claimed: &str,
    say: &mut Narrator<'_>,
) -> Result<(), String> {
    let free = listed(cx.lab)
        .into_iter()
        .filter(|(id, (_, health))| health == "Healthy" && id != claimed)
        .min_by_key(|(_, (resource, _))| resource == GPU_RESOURCE);
    let Some((_, (resource, _))) = free else {
        return Ok(());
    };
    let (ids, _) = cx
        .lab
        .kubelet
        .admit(NODE_NAMESPACE, "small", "main", &resource, 1)
        .await
        .map_err(|s| format!("Allocate failed: {}", s.message()))?;
    say.say(format!(
        "pod {NODE_NAMESPACE}/small admitted by the kubelet double: 1 x {resource} {}",
        list(&ids)
    ));
    carry.pod_ids = ids;
    Ok(())
}

/// A claim for `taken`, which a device-plugin pod holds, is refused at NodePrepareResources
/// naming that holder; the evidence to add.
async fn prepare_refused(
    cx: &Context<'_>,
    taken: &str,
    say: &mut Narrator<'_>,
) -> Result<String, String> {
    let (_, devices) = published(&cx.client).await?;
    let Some(target) = devices.iter().find(|d| d.uuid.as_deref() == Some(taken)) else {
        return Err(format!("{taken} is not published"));
    };
    let steal = cx
        .lab
        .claim(NODE_NAMESPACE, "late", &[&target.name])
        .map_err(|e| e.to_string())?;
    let refusal = match cx.lab.prepare(&steal).await {
        Ok(_) => {
            return Err(format!(
                "NodePrepareResources granted {}, which a device-plugin pod holds",
                target.name
            ))
        }
        Err(e) => e,
    };
    say.say(format!(
        "ResourceClaim {NODE_NAMESPACE}/late for {}: NodePrepareResources -> refused: {refusal}",
        target.name
    ));
    if !refusal.contains(taken) || !refusal.contains("held by") {
        return Err(format!(
            "the refusal does not name the device-plugin holder of {taken}: {refusal}"
        ));
    }
    Ok(format!(
        "; NodePrepare of {} refused, naming the device-plugin holder",
        target.name
    ))
}
