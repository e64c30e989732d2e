//! dcgm-exporter compatibility: run as NVIDIA's DRA driver (`--driver-name gpu.nvidia.com`),
//! the agent's ResourceSlices carry exactly what NVIDIA's dcgm-exporter reads to attribute a
//! DRA device's metrics to the pods holding it, so users who keep dcgm-exporter see our claims.
//!
//! dcgm-exporter's mapping, from its source (NVIDIA/dcgm-exporter
//! `internal/pkg/transformation/dra.go` and `kubernetes.go` at d5e5f51, with the
//! `resource.k8s.io/v1` support of its PR #664): it keeps slices whose `spec.driver` is the
//! fixed name `gpu.nvidia.com`; keys each device by `<spec.pool.name>/<device name>` (what the
//! kubelet's PodResources reports for a claim); reads the unqualified attributes as strings
//! only; `type` `gpu` needs `uuid` (NVML's `GPU-…`, matched against DCGM's GPU UUID); `type`
//! `mig` needs `parentUUID` and reads `profile` and `uuid` (the MIG device's). Any other value
//! type counts as missing.

// The real binary over the fake NVML, on the crash tests' node (tests/support/crash_node.rs,
// built with the suite's `crashpoints` feature).
#![cfg(feature = "crashpoints")]

use crate::crash_node::{Node, WAIT};
use crate::support::{self, NODE};
use serde_json::Value;
use std::collections::BTreeMap;

const NVIDIA_DRIVER: &str = "gpu.nvidia.com";

/// What dcgm-exporter resolves a DRA device to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resolved {
    Gpu {
        uuid: String,
    },
    Mig {
        parent: String,
        profile: String,
        uuid: String,
    },
}

/// dcgm-exporter's view of `slices`: `pool/device` → what it resolves to (devices it cannot
/// resolve are left out, as it skips them).
fn dcgm_view(slices: &[Value]) -> BTreeMap<String, Resolved> {
    let mut out = BTreeMap::new();
    for s in slices
        .iter()
        .filter(|s| s["spec"]["driver"] == NVIDIA_DRIVER)
    {
        let pool = s["spec"]["pool"]["name"].as_str().unwrap_or_default();
        for d in s["spec"]["devices"].as_array().into_iter().flatten() {
            let attr = |k: &str| d["attributes"][k]["string"].as_str().map(String::from);
            let resolved = match attr("type").as_deref() {
                Some("gpu") => attr("uuid").map(|uuid| Resolved::Gpu { uuid }),
                Some("mig") => attr("parentUUID").map(|parent| Resolved::Mig {
                    parent,
                    profile: attr("profile").unwrap_or_default(),
                    uuid: attr("uuid").unwrap_or_default(),
                }),
                _ => None,
            };
            if let (Some(r), Some(name)) = (resolved, d["name"].as_str()) {
                out.insert(format!("{pool}/{name}"), r);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_gpu_nvidia_com_every_device_resolves_in_dcgm_exporters_mapping() {
    let mut node = Node::with_fake_nvml("a100-mig-mixed", "flags: {migStrategy: mixed}\n").await;
    node.extra_args = vec!["--driver-name".into(), NVIDIA_DRIVER.into()];
    node.spawn(None);
    let inventory = gpuplane_model::sim::load("a100-mig-mixed").unwrap();
    let devices: usize = inventory
        .gpus
        .iter()
        .map(|g| g.mig_devices.len().max(1))
        .sum();
    let slices = support::eventually("the slices of gpu.nvidia.com", WAIT, || {
        let slices = node
            .api
            .list_json("resource.k8s.io/v1", "resourceslices", None);
        let published: usize = slices
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum();
        (published >= devices).then_some(slices)
    })
    .await;
    let view = dcgm_view(&slices);
    let published: Vec<String> = slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d["name"].as_str().map(|n| format!("{NODE}/{n}")))
        .collect();
    let unresolved: Vec<&String> = published
        .iter()
        .filter(|k| !view.contains_key(*k))
        .collect();
    assert!(
        unresolved.is_empty(),
        "dcgm-exporter skips {unresolved:?}: {slices:?}"
    );
    for g in &inventory.gpus {
        if g.mig_devices.is_empty() {
            let want = Resolved::Gpu {
                uuid: g.uuid.to_string(),
            };
            assert!(view.values().any(|r| *r == want), "{want:?} in {view:?}");
        }
        for m in &g.mig_devices {
            let want = Resolved::Mig {
                parent: g.uuid.to_string(),
                profile: m.profile.to_string(),
                uuid: m.uuid.to_string(),
            };
            assert!(view.values().any(|r| *r == want), "{want:?} in {view:?}");
        }
    }
}
