//! Pure readings the demo's steps judge answers with: the topology in a line, the best score a
//! set of GPUs can reach (by trying every set, independently of the agent's search), CDI device
//! ids, published devices as plain data, and JSON patches from an AdmissionReview.

use base64::Engine;
use gpuplane_model::inventory::Inventory;
use gpuplane_model::report::chain;
use gpuplane_model::topology::TopologyModel;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::Value;
use std::collections::BTreeMap;

/// The GPU-to-GPU wiring in one line, e.g. `NVSwitch fabric: all 28 GPU pairs NV18` or
/// `NVLink on 16 of 28 GPU pairs (8 x NV1, 8 x NV2); the rest over PCIe (12 x SYS)`.
pub fn topology_line(inv: &Inventory) -> String {
    let links = &inv.topology.links;
    if links.is_empty() {
        return format!("{} GPU(s), no GPU pairs", inv.gpus.len());
    }
    let mut nvlink: BTreeMap<u32, usize> = BTreeMap::new();
    let mut pcie: BTreeMap<String, usize> = BTreeMap::new();
    for l in links {
        if l.nvlinks > 0 {
            *nvlink.entry(l.nvlinks).or_default() += 1;
        } else {
            *pcie.entry(l.level.short().to_string()).or_default() += 1;
        }
    }
    let fmt = |m: Vec<(String, usize)>| {
        m.into_iter()
            .map(|(k, n)| format!("{n} x {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let nv = fmt(nvlink.iter().map(|(k, n)| (format!("NV{k}"), *n)).collect());
    let pc = fmt(pcie.into_iter().collect());
    let nv_pairs: usize = nvlink.values().sum();
    match (nv_pairs, inv.topology.nvswitch) {
        (0, _) => format!("no NVLink: all {} GPU pairs over PCIe ({pc})", links.len()),
        (n, true) if n == links.len() && nvlink.len() == 1 => {
            let lanes = nvlink.keys().next().copied().unwrap_or(0);
            format!("NVSwitch fabric: all {n} GPU pairs NV{lanes}")
        }
        (n, _) if n == links.len() => format!("NVLink on all {n} GPU pairs ({nv})"),
        (n, _) => format!(
            "NVLink on {n} of {} GPU pairs ({nv}); the rest over PCIe ({pc})",
            links.len()
        ),
    }
}

/// Whether any two GPUs share an NVLink.
pub fn has_nvlink(inv: &Inventory) -> bool {
    inv.topology.links.iter().any(|l| l.nvlinks > 0)
}

/// How many sets [`best_set_score`] tries at most.
const MAX_SETS: u128 = 1_000_000;

/// `n` choose `k` (`k <= n`), or `None` beyond [`MAX_SETS`].
fn sets(n: usize, k: usize) -> Option<u128> {
    // C(n, k) = C(n, n - k); the partial products grow up to the smaller one, and each is a
    // binomial itself (exact division), so stopping at the cap early is right.
    let k = k.min(n.saturating_sub(k));
    let mut r: u128 = 1;
    for i in 0..k {
        r = r * (n - i) as u128 / (i + 1) as u128;
        if r > MAX_SETS {
            return None;
        }
    }
    Some(r)
}

/// The highest set score among all `size`-subsets of `available`, found by trying each one,
/// independently of the agent's search; `None` when `size` is 0 or above the number available,
/// or when there are more than a million sets to try.
pub fn best_set_score(model: &TopologyModel, available: &[u32], size: usize) -> Option<u64> {
    let n = available.len();
    if size == 0 || size > n {
        return None;
    }
    sets(n, size)?;
    // Every ascending index list of length `size`, in lexicographic order.
    let mut idx: Vec<usize> = (0..size).collect();
    let mut best = 0;
    loop {
        let set: Vec<u32> = idx.iter().map(|&i| available[i]).collect();
        best = best.max(model.set_score(&set));
        let Some(i) = (0..size).rev().find(|&i| idx[i] < n - size + i) else {
            return Some(best);
        };
        idx[i] += 1;
        for j in i + 1..size {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// NVLink lanes summed over the pairs of `gpus`, and how many of those pairs have none.
pub fn nvlinks_within(inv: &Inventory, gpus: &[u32]) -> (u32, usize) {
    let (mut lanes, mut without) = (0, 0);
    for (i, a) in gpus.iter().enumerate() {
        for b in &gpus[i + 1..] {
            match inv.topology.link(*a, *b).map(|l| l.nvlinks) {
                Some(n) if n > 0 => lanes += n,
                _ => without += 1,
            }
        }
    }
    (lanes, without)
}

/// A fully qualified CDI device id `vendor/class=name` split into kind and name.
pub fn split_cdi_id(id: &str) -> Option<(&str, &str)> {
    let (kind, name) = id.split_once('=')?;
    (kind.contains('/') && !name.is_empty()).then_some((kind, name))
}

/// One device as a ResourceSlice publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedDevice {
    pub slice: String,
    pub name: String,
    /// Attribute `type`: `gpu` or `mig`.
    pub kind: Option<String>,
    pub uuid: Option<String>,
    /// `key=value` per taint.
    pub taints: Vec<String>,
    /// Published for several allocations at once (a GPU shared through consumable capacity).
    pub shared: bool,
    /// Consumes a counter set: a dynamic MIG placement, or a GPU dynamic MIG cuts.
    pub partitionable: bool,
    /// Attribute `profile` (MIG devices).
    pub profile: Option<String>,
    /// Attribute `placementStart` (dynamic MIG placements).
    pub placement: Option<i64>,
}

/// Every device of the given slices, in slice order.
pub fn published_devices(slices: &[ResourceSlice]) -> Vec<PublishedDevice> {
    let mut out = Vec::new();
    for s in slices {
        let slice = s.metadata.name.clone().unwrap_or_default();
        for d in s.spec.devices.iter().flatten() {
            let attr = |k: &str| {
                d.attributes
                    .as_ref()
                    .and_then(|a| a.get(k))
                    .and_then(|v| v.string.clone())
            };
            let placement = d
                .attributes
                .as_ref()
                .and_then(|a| a.get(gpuplane_node::slices::render::names::PLACEMENT_START))
                .and_then(|v| v.int);
            out.push(PublishedDevice {
                slice: slice.clone(),
                name: d.name.clone(),
                kind: attr(gpuplane_node::slices::render::names::TYPE),
                uuid: attr(gpuplane_node::slices::render::names::UUID),
                shared: d.allow_multiple_allocations == Some(true),
                partitionable: d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()),
                profile: attr(gpuplane_node::slices::render::names::PROFILE),
                placement,
                taints: d
                    .taints
                    .iter()
                    .flatten()
                    .map(|t| format!("{}={}", t.key, t.value.as_deref().unwrap_or("")))
                    .collect(),
            });
        }
    }
    out
}

/// Why an AdmissionReview's patch could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("the patch is not base64: {}", chain(.0))]
    Base64(base64::DecodeError),
    #[error("the patch is not a JSON patch: {}", chain(.0))]
    Json(serde_json::Error),
    #[error("the patch does not apply: {}", chain(.0))]
    Apply(json_patch::PatchError),
}

gpuplane_model::causes_from!(PatchError {
    Base64(base64::DecodeError),
    Json(serde_json::Error),
    Apply(json_patch::PatchError),
});

/// Applies the base64 JSONPatch of an AdmissionReview response to `object`, as the API server
/// does before storing it.
pub fn apply_review_patch(object: &mut Value, patch_b64: &str) -> Result<(), PatchError> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(patch_b64)?;
    let patch: json_patch::Patch = serde_json::from_slice(&bytes)?;
    json_patch::patch(object, &patch)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplane_model::inventory::{Link, PathLevel, Topology};
    use serde_json::json;

    fn inventory(profile: &str) -> Inventory {
        gpuplane_model::sim::load(profile).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn topology_lines_say_what_connects_the_gpus() {
        assert_eq!(
            topology_line(&inventory("dgx-h100")),
            "NVSwitch fabric: all 28 GPU pairs NV18"
        );
        assert_eq!(
            topology_line(&inventory("dgx1-v100")),
            "NVLink on 16 of 28 GPU pairs (8 x NV1, 8 x NV2); the rest over PCIe (12 x SYS)"
        );
        assert_eq!(
            topology_line(&inventory("pcie-l4x4")),
            "no NVLink: all 6 GPU pairs over PCIe (2 x PIX, 4 x SYS)"
        );
        assert!(has_nvlink(&inventory("a100-mig-mixed")));
        assert!(!has_nvlink(&inventory("pcie-l4x4")));
    }

    #[test]
    fn the_best_score_is_found_by_trying_every_set() {
        let links = [
            (0, 1, 2),
            (0, 2, 0),
            (0, 3, 0),
            (1, 2, 0),
            (1, 3, 0),
            (2, 3, 1),
        ]
        .map(|(from, to, nvlinks)| Link {
            from,
            to,
            nvlinks,
            level: PathLevel::System,
        });
        let model = TopologyModel::from_parts(4, false, &links);
        let best = best_set_score(&model, &[0, 1, 2, 3], 2);
        assert_eq!(best, Some(model.set_score(&[0, 1])));
        assert!(model.set_score(&[0, 1]) > model.set_score(&[2, 3]));
        assert_eq!(best_set_score(&model, &[0, 1], 3), None);
        assert_eq!(best_set_score(&model, &[0, 1], 0), None);
        // The same as trying every subset by bit mask, for every size.
        for size in 1..=4 {
            let by_mask = (0u32..16)
                .filter(|m| m.count_ones() as usize == size)
                .map(|m| {
                    let set: Vec<u32> = (0..4).filter(|i| m & (1 << i) != 0).collect();
                    model.set_score(&set)
                })
                .max();
            assert_eq!(best_set_score(&model, &[0, 1, 2, 3], size), by_mask);
        }
        // Too many sets to try: no answer rather than a guess.
        assert_eq!(sets(128, 4), None);
        assert_eq!(sets(64, 4), Some(635_376));
        assert_eq!(sets(8, 8), Some(1));
        let inv = Inventory {
            topology: Topology {
                nvswitch: false,
                links: links.to_vec(),
            },
            ..inventory("pcie-l4x4")
        };
        assert_eq!(nvlinks_within(&inv, &[0, 1, 2]), (2, 2));
    }

    #[test]
    fn cdi_ids_split_into_kind_and_name() {
        assert_eq!(
            split_cdi_id("k8s.gpu.gpuplane.dev/claim=abc-gpu-0"),
            Some(("k8s.gpu.gpuplane.dev/claim", "abc-gpu-0"))
        );
        assert_eq!(split_cdi_id("no-kind=x"), None);
        assert_eq!(split_cdi_id("vendor/class="), None);
        assert_eq!(split_cdi_id("vendor/class"), None);
    }

    #[test]
    fn published_devices_read_type_uuid_and_taints() {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "s-0"},
            "spec": {"driver": "d", "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-1"}}},
                    {"name": "gpu-1", "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]}
                ]}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let d = published_devices(&[slice]);
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[0].kind.as_deref(), d[0].uuid.as_deref()),
            (Some("gpu"), Some("GPU-1"))
        );
        assert_eq!(d[1].taints, ["k=v"]);
        assert_eq!(d[1].slice, "s-0");
    }

    #[test]
    fn a_review_patch_is_applied_like_the_api_server_does() {
        let patch =
            json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": "g"}]}]);
        let b64 = gpuplane_cluster::webhook::review::base64(
            &serde_json::to_vec(&patch).unwrap_or_default(),
        );
        let mut pod = json!({"spec": {"containers": []}});
        apply_review_patch(&mut pod, &b64).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pod["spec"]["schedulingGates"][0]["name"], "g");
        assert!(apply_review_patch(&mut pod, "%%%").is_err());
    }
}
