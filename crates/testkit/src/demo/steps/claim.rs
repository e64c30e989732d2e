//! Step 3: a ResourceClaim prepared over DRA. NodePrepareResources must answer CDI ids that a
//! spec file under the CDI root defines, and the claim's `status.devices` must say the device
//! is Ready with its UUID.

use super::{facts, list, poll, published, Carry, Context, NODE_NAMESPACE};
use crate::demo::facts::PublishedDevice;
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use crate::doubles::lab::NODE;
use gpuplane_node::dra::{ClaimRef, PreparedDevice};
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use kube::api::Api;
use serde_json::Value;
use std::path::{Path, PathBuf};

pub(super) async fn run(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let devices = match published(&cx.client).await {
        Ok((_, d)) => d,
        Err(e) => return Outcome::Failed(e),
    };
    let Some(device) = free_device(&devices, carry) else {
        return Outcome::Failed("no free published device to claim".into());
    };
    let claim = match cx.lab.claim(NODE_NAMESPACE, "inference", &[&device.name]) {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    say.say(format!(
        "ResourceClaim {NODE_NAMESPACE}/inference, allocated (as the scheduler would) to {} of pool {NODE}",
        device.name
    ));
    let prepared = match cx.lab.prepare(&claim).await {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(format!("NodePrepareResources refused the claim: {e}")),
    };
    let (file, names) = match spec_of(cx, &prepared, &device, say) {
        Ok(found) => found,
        Err(e) => return Outcome::Failed(e),
    };
    if let Err(e) = status_ready(cx, &claim, &device, say).await {
        return Outcome::Failed(e);
    }
    let held = format!(
        "claim {}/{} prepared on {}; CDI spec {file}, {names} device(s); status.devices Ready",
        claim.namespace, claim.name, device.name
    );
    carry.claim = Some((claim, device));
    Outcome::Held(held)
}

/// A whole GPU if one is free (untainted, not the pod's of step 2), else a MIG device; never
/// the GPU the share step shares, nor one dynamic MIG cuts (the device plugin does not offer
/// those, and the next step needs a device both APIs offer).
fn free_device(devices: &[PublishedDevice], carry: &Carry) -> Option<PublishedDevice> {
    let free = |d: &&PublishedDevice| {
        d.taints.is_empty()
            && !d.shared
            && !d.partitionable
            && d.uuid.as_ref().is_some_and(|u| !carry.pod_ids.contains(u))
    };
    devices
        .iter()
        .filter(free)
        .find(|d| d.kind.as_deref() == Some("gpu"))
        .or_else(|| devices.iter().find(free))
        .cloned()
}

/// Checks that the CDI spec file defining the first of the prepared CDI ids defines them all,
/// for `device` alone; (its file name, how many devices it defines).
fn spec_of(
    cx: &Context<'_>,
    prepared: &[PreparedDevice],
    device: &PublishedDevice,
    say: &mut Narrator<'_>,
) -> Result<(String, usize), String> {
    let ids: Vec<String> = prepared.iter().flat_map(|d| d.cdi_ids.clone()).collect();
    say.say(format!(
        "kubelet, DRA API: NodePrepareResources -> {} device(s), CDI ids {}",
        prepared.len(),
        list(&ids)
    ));
    let first = ids
        .first()
        .ok_or("NodePrepareResources returned no CDI device")?;
    let (path, names) = find_spec(&cx.lab.paths().cdi_root, first)?;
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    say.say(format!(
        "CDI spec {}: devices {}",
        path.display(),
        list(&names)
    ));
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| facts::split_cdi_id(id).is_none_or(|(_, n)| !names.iter().any(|x| x == n)))
        .collect();
    if !missing.is_empty() || prepared.iter().any(|d| d.device != device.name) {
        return Err(format!(
            "prepared {:?} for {}; CDI ids not in {file}: {missing:?}",
            prepared.iter().map(|d| &d.device).collect::<Vec<_>>(),
            device.name
        ));
    }
    Ok((file, names.len()))
}

/// The CDI spec file under `cdi_root` that defines `id`, with its device names.
pub(super) fn find_spec(cdi_root: &Path, id: &str) -> Result<(PathBuf, Vec<String>), String> {
    let (kind, name) =
        facts::split_cdi_id(id).ok_or_else(|| format!("{id} is not a CDI device id"))?;
    let entries =
        std::fs::read_dir(cdi_root).map_err(|e| format!("reading {}: {e}", cdi_root.display()))?;
    for e in entries.flatten() {
        let path = e.path();
        let Ok(text) = std::fs::read(&path) else {
            continue;
        };
        let Ok(spec) = serde_json::from_slice::<Value>(&text) else {
            continue;
        };
        let names: Vec<String> = spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["name"].as_str().map(str::to_string))
            .collect();
        if spec["kind"] == kind && names.iter().any(|n| n == name) {
            return Ok((path, names));
        }
    }
    Err(format!(
        "no CDI spec in {} defines {id}",
        cdi_root.display()
    ))
}

/// Waits for the claim's `status.devices` entry of `device`, as `kubectl get resourceclaim -o
/// yaml` shows it, and checks it is Ready with the device's UUID.
async fn status_ready(
    cx: &Context<'_>,
    claim: &ClaimRef,
    device: &PublishedDevice,
    say: &mut Narrator<'_>,
) -> Result<(), String> {
    let claims: Api<ResourceClaim> = Api::namespaced(cx.client.clone(), &claim.namespace);
    let entry: AllocatedDeviceStatus = poll(|| {
        let (claims, name, dev) = (claims.clone(), claim.name.clone(), device.name.clone());
        async move {
            let c = claims.get(&name).await.map_err(|e| e.to_string())?;
            c.status
                .and_then(|s| s.devices)
                .into_iter()
                .flatten()
                .find(|d| d.device == dev)
                .ok_or_else(|| format!("no status.devices entry for {dev} yet"))
        }
    })
    .await
    .map_err(|e| format!("the claim's status.devices: {e}"))?;
    let ready = entry
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let uuid = entry
        .data
        .as_ref()
        .and_then(|d| d.0.get("uuid"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    say.say(format!(
        "claim status.devices: {} {} (uuid {uuid})",
        entry.device,
        if ready { "Ready" } else { "not Ready" }
    ));
    if !ready || device.uuid.as_deref() != Some(uuid.as_str()) {
        return Err(format!(
            "status.devices of {} says ready={ready}, uuid {uuid:?}, not {:?}",
            device.name, device.uuid
        ));
    }
    Ok(())
}

/// Every environment variable a CDI spec file sets, for the spec and its devices.
pub(super) fn spec_env(path: &std::path::Path) -> Result<Vec<String>, String> {
    let text = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let spec: Value =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let edits = std::iter::once(&spec["containerEdits"]).chain(
        spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| &d["containerEdits"]),
    );
    Ok(edits
        .flat_map(|e| e["env"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect())
}
