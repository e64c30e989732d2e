//! What the driver tells users about a prepared claim in `status.devices` (KEP-4817, GA in
//! Kubernetes 1.37): one entry per allocated device of ours, keyed by driver, pool and device,
//! with the device's identity in `data` and a `Ready` condition. Pure rendering; the write is
//! the claim store's (the shell's `ClaimFetcher::set_device_status`), by server-side apply
//! under [`FIELD_MANAGER`], so entries of other drivers in the same claim are left alone and an
//! apply with no entries removes ours.

use crate::inventory::DeviceRef;
use serde_json::{json, Value};

/// The field manager of our `status.devices` entries.
pub const FIELD_MANAGER: &str = "gpuplane-node";

/// The `status.devices` entries for `devices` (DRA name and inventory device) of pool `pool`,
/// prepared at `now` (RFC 3339) for a claim of generation `generation`.
pub fn device_statuses(
    driver: &str,
    pool: &str,
    devices: &[(String, DeviceRef<'_>)],
    generation: Option<i64>,
    now: &str,
) -> Vec<Value> {
    devices
        .iter()
        .map(|(name, dev)| {
            let mut data = json!({
                "uuid": dev.uuid(),
                "productName": dev.gpu().product_name,
            });
            if let DeviceRef::Mig { parent, mig } = dev {
                data["parentUUID"] = json!(parent.uuid);
                data["profile"] = json!(mig.profile);
            }
            let mut ready = json!({
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": format!("prepared by {driver}; the CDI spec is written"),
                "lastTransitionTime": now,
            });
            if let Some(g) = generation {
                ready["observedGeneration"] = json!(g);
            }
            json!({
                "driver": driver,
                "pool": pool,
                "device": name,
                "conditions": [ready],
                "data": data,
            })
        })
        .collect()
}

/// Marks a `status.devices` entry as a share: its `shareID` (part of the entry's key), what it
/// consumes in `data.share`, and a `ShareLimitsEnforced` condition naming what holds each
/// limit. Under MPS the compute limit is the CUDA client variable in the container's
/// environment, which "only further constrain the limit set by the control daemon" (NVIDIA's
/// MPS documentation, "Environment Variables") and so can be raised by the container: the
/// condition is False. The memory limit is held by the driver where `memory_held` (the
/// container's cgroup limit, [`crate::cdi::memory_limit`]), else cooperative like compute.
/// Time-sliced, both are scheduling figures only.
pub fn add_share(
    entry: &mut Value,
    share_id: &str,
    share: &crate::sharing::Share,
    enforcement: crate::sharing::Enforcement,
    memory_held: bool,
    now: &str,
) {
    use crate::sharing::Enforcement;
    entry["shareID"] = json!(share_id);
    entry["data"]["share"] = json!({
        "memory": crate::quantity::Quantity::from_u64(share.memory, crate::quantity::Format::BinarySI).to_string(),
        "compute": share.compute,
        "enforcement": enforcement.to_string(),
    });
    entry["data"]["share"]["memoryHeld"] = json!(memory_held);
    let memory =
        crate::quantity::Quantity::from_u64(share.memory, crate::quantity::Format::BinarySI);
    let (reason, message) = match (enforcement, memory_held) {
        (Enforcement::Mps, true) => ("ComputeCooperative", format!("the driver holds this share's container to {memory} of GPU memory (a per-cgroup limit gpuplane sets outside the container, NVIDIA driver r615+); its {}% compute is cooperative only: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in the container's environment, which a container can unset or raise to get up to the whole GPU's SMs", share.compute)),
        (Enforcement::Mps, false) => ("MPS", format!("MPS runs this share beside the GPU's other shares, but its limits ({share}) are cooperative only: they are set in the container's environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), and a container that unsets or raises them gets up to the whole GPU (per-cgroup memory limits need NVIDIA driver r615+ on a whole GPU)")),
        (Enforcement::TimeSlicing, _) => ("TimeSlicing", format!("the GPU is time-sliced among its shares: {share} are scheduling figures only, not limits (this node has no MPS control program, or its operator chose time-slicing)")),
    };
    if let Some(conditions) = entry["conditions"].as_array_mut() {
        conditions.push(json!({
            "type": "ShareLimitsEnforced",
            "status": "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }));
    }
}

/// The server-side apply body that sets our entries of a claim's `status.devices` to
/// `entries` (none: ours are removed).
pub fn apply_body(namespace: &str, name: &str, entries: Vec<Value>) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"devices": entries},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_carry_identity_and_a_ready_condition() {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let devs = inv.dra_devices();
        let gpu = devs
            .iter()
            .find(|d| matches!(d, DeviceRef::Gpu(_)))
            .copied()
            .unwrap();
        let mig = devs
            .iter()
            .find(|d| matches!(d, DeviceRef::Mig { .. }))
            .copied()
            .unwrap();
        let out = device_statuses(
            "gpu.gpuplane.dev",
            "node-a",
            &[(gpu.dra_name(), gpu), (mig.dra_name(), mig)],
            Some(3),
            "2026-12-01T12:00:00Z",
        );
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["driver"], "gpu.gpuplane.dev");
        assert_eq!(out[0]["pool"], "node-a");
        assert_eq!(out[0]["device"], gpu.dra_name());
        assert_eq!(out[0]["data"]["uuid"], gpu.uuid().as_str());
        assert!(out[0]["data"].get("profile").is_none());
        let c = &out[0]["conditions"][0];
        assert_eq!(
            (
                c["type"].as_str(),
                c["status"].as_str(),
                c["observedGeneration"].as_i64()
            ),
            (Some("Ready"), Some("True"), Some(3))
        );
        let DeviceRef::Mig { parent, mig: m } = mig else {
            unreachable!()
        };
        assert_eq!(out[1]["data"]["parentUUID"], parent.uuid.as_str());
        assert_eq!(out[1]["data"]["profile"], m.profile.as_str());
        let body = apply_body("team-a", "c", Vec::new());
        assert_eq!(body["status"]["devices"], json!([]));
        assert_eq!(body["metadata"]["namespace"], "team-a");
    }
}
