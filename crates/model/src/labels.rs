//! Node labels like NVIDIA's GPU Feature Discovery's (pure): the `nvidia.com/*` labels that
//! placement policies already select on, computed from the inventory and the agent config, and
//! the JSON merge patch that brings a node's labels to them. Label names and value forms are
//! GFD's (NVIDIA/k8s-device-plugin docs/gpu-feature-discovery): `gpu.product` is the NVML name
//! with spaces as dashes, `gpu.memory` MiB, `gpu.family` the architecture in lower case. A node
//! with GPUs of several models is labelled after GPU 0, as GFD does. The labels this module
//! owns are exactly [`MANAGED`]; it never touches any other label.

use crate::config::{AgentConfig, MigStrategy};
use crate::inventory::Inventory;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Every label gpuplane manages; a managed label that no longer applies is removed.
pub const MANAGED: &[&str] = &[
    "nvidia.com/gpu.count",
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.memory",
    "nvidia.com/gpu.family",
    "nvidia.com/gpu.compute.major",
    "nvidia.com/gpu.compute.minor",
    "nvidia.com/cuda.driver.major",
    "nvidia.com/cuda.driver.minor",
    "nvidia.com/cuda.driver.rev",
    "nvidia.com/cuda.runtime.major",
    "nvidia.com/cuda.runtime.minor",
    "nvidia.com/mig.capable",
    "nvidia.com/mig.strategy",
    "nvidia.com/gpu.replicas",
    "nvidia.com/gpu.sharing-strategy",
];

/// The labels the node should carry (none without GPUs or with labelling off).
pub fn node_labels(inv: &Inventory, cfg: &AgentConfig) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(gpu) = inv.gpus.first() else {
        return out;
    };
    if !cfg.node_labels {
        return out;
    }
    let mut put = |name: &str, value: Option<String>| {
        if let Some(v) = value.and_then(|v| label_value(&v)) {
            out.insert(format!("nvidia.com/{name}"), v);
        }
    };
    put("gpu.count", Some(inv.gpus.len().to_string()));
    put("gpu.product", Some(gpu.product_name.replace(' ', "-")));
    put("gpu.memory", Some(gpu.memory_mib.to_string()));
    let mut compute = gpu.cuda_compute_capability.split('.');
    let (major, minor) = (compute.next(), compute.next());
    let family = family(
        major.and_then(|m| m.parse().ok()),
        minor.and_then(|m| m.parse().ok()),
    )
    .map_or_else(
        || gpu.architecture.to_ascii_lowercase().replace(' ', "-"),
        String::from,
    );
    put("gpu.family", Some(family));
    put("gpu.compute.major", major.map(String::from));
    put("gpu.compute.minor", minor.map(String::from));
    let mut driver = inv.driver_version.split('.');
    put("cuda.driver.major", driver.next().map(String::from));
    put("cuda.driver.minor", driver.next().map(String::from));
    put("cuda.driver.rev", driver.next().map(String::from));
    let mut runtime = inv.cuda_driver_version.split('.');
    put("cuda.runtime.major", runtime.next().map(String::from));
    put("cuda.runtime.minor", runtime.next().map(String::from));
    let capable = inv.gpus.iter().any(|g| g.mig.capable);
    put("mig.capable", Some(capable.to_string()));
    match cfg.mig_strategy {
        MigStrategy::None => {}
        MigStrategy::Single => put("mig.strategy", Some("single".into())),
        MigStrategy::Mixed => put("mig.strategy", Some("mixed".into())),
    }
    let replicas = cfg
        .time_slicing
        .iter()
        .find(|r| r.name == "nvidia.com/gpu")
        .map_or(1, |r| r.replicas);
    put("gpu.replicas", Some(replicas.to_string()));
    put(
        "gpu.sharing-strategy",
        Some(if replicas > 1 { "time-slicing" } else { "none" }.to_string()),
    );
    out
}

/// The architecture family from the compute capability, as GFD names it (`8.9` is
/// `ada-lovelace`, where NVML says `Ada`); `None` for one it does not know.
fn family(major: Option<u32>, minor: Option<u32>) -> Option<&'static str> {
    Some(match (major?, minor.unwrap_or(0)) {
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        _ => return None,
    })
}

/// `v` as a valid label value (at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends;
/// other characters become `-`), or `None` when nothing is left.
fn label_value(v: &str) -> Option<String> {
    let cleaned: String = v
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let trimmed = cleaned.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

/// The merge patch (`{"metadata":{"labels":{...}}}`) that turns the node's `current` labels
/// into `wanted` for the managed names (a managed label not wanted is set to null, which
/// removes it); `None` when they already agree.
pub fn label_patch(
    current: &BTreeMap<String, String>,
    wanted: &BTreeMap<String, String>,
) -> Option<Value> {
    let mut labels = Map::new();
    for name in MANAGED {
        match (current.get(*name), wanted.get(*name)) {
            (c, Some(w)) if c != Some(w) => {
                labels.insert(name.to_string(), json!(w));
            }
            (Some(_), None) => {
                labels.insert(name.to_string(), Value::Null);
            }
            _ => {}
        }
    }
    (!labels.is_empty()).then(|| json!({"metadata": {"labels": labels}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_gfd_for_a_dgx_h100() {
        let inv = crate::sim::load("dgx-h100").unwrap();
        let l = node_labels(&inv, &AgentConfig::default());
        assert_eq!(l["nvidia.com/gpu.count"], "8");
        assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(
            l["nvidia.com/gpu.memory"],
            inv.gpus[0].memory_mib.to_string()
        );
        assert_eq!(l["nvidia.com/gpu.family"], "hopper");
        assert_eq!(l["nvidia.com/gpu.compute.major"], "9");
        assert_eq!(l["nvidia.com/gpu.compute.minor"], "0");
        assert_eq!(l["nvidia.com/cuda.driver.major"], "550");
        assert_eq!(l["nvidia.com/cuda.driver.minor"], "90");
        assert_eq!(l["nvidia.com/cuda.driver.rev"], "07");
        assert_eq!(l["nvidia.com/cuda.runtime.major"], "12");
        assert_eq!(l["nvidia.com/cuda.runtime.minor"], "4");
        assert_eq!(l["nvidia.com/gpu.replicas"], "1");
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "none");
        assert!(!l.contains_key("nvidia.com/mig.strategy"));
        assert_eq!(l["nvidia.com/mig.capable"], "true", "H100s support MIG");
        let l4 = crate::sim::load("pcie-l4x4").unwrap();
        assert_eq!(
            node_labels(&l4, &AgentConfig::default())["nvidia.com/mig.capable"],
            "false"
        );
        assert!(l.keys().all(|k| MANAGED.contains(&k.as_str())));
    }

    #[test]
    fn config_shapes_the_labels_and_off_means_none() {
        let inv = crate::sim::load("dgx-h100").unwrap();
        let cfg = AgentConfig::parse(
            "c.yaml",
            "flags: {migStrategy: mixed}\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n",
        )
        .unwrap();
        let l = node_labels(&inv, &cfg);
        assert_eq!(l["nvidia.com/mig.strategy"], "mixed");
        assert_eq!(l["nvidia.com/gpu.replicas"], "4");
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
        let off = AgentConfig::parse("c.yaml", "nodeLabels: {enabled: false}\n").unwrap();
        assert!(node_labels(&inv, &off).is_empty());
    }

    #[test]
    fn the_patch_sets_changed_labels_removes_stale_ones_and_leaves_others() {
        let wanted = BTreeMap::from([
            ("nvidia.com/gpu.count".to_string(), "7".to_string()),
            ("nvidia.com/gpu.family".to_string(), "hopper".to_string()),
        ]);
        let current = BTreeMap::from([
            ("nvidia.com/gpu.count".to_string(), "8".to_string()),
            ("nvidia.com/gpu.family".to_string(), "hopper".to_string()),
            ("nvidia.com/gpu.replicas".to_string(), "4".to_string()),
            ("team".to_string(), "a".to_string()),
            ("nvidia.com/gpu.present".to_string(), "true".to_string()),
        ]);
        let p = label_patch(&current, &wanted).unwrap();
        assert_eq!(
            p,
            json!({"metadata": {"labels": {"nvidia.com/gpu.count": "7", "nvidia.com/gpu.replicas": null}}})
        );
        let now = BTreeMap::from([
            ("nvidia.com/gpu.count".to_string(), "7".to_string()),
            ("nvidia.com/gpu.family".to_string(), "hopper".to_string()),
        ]);
        assert_eq!(label_patch(&now, &wanted), None);
    }

    #[test]
    fn values_are_valid_label_values() {
        assert_eq!(
            label_value("NVIDIA A100-SXM4-80GB (x)").as_deref(),
            Some("NVIDIA-A100-SXM4-80GB--x")
        );
        assert_eq!(label_value("  "), None);
        assert_eq!(label_value(&"a".repeat(80)).map(|v| v.len()), Some(63));
    }
}
