//! Which kubelet resources the node offers and which devices each holds (pure).
//!
//! Turns the inventory and the config (MIG strategy, time-slicing, ID strategy) into a plan:
//! resource name -> devices. Every plugin device points back at one physical unit (a whole GPU
//! or one MIG device) so health and Allocate can be answered per unit.

use crate::config::{AgentConfig, DeviceIdStrategy, MigStrategy};
use crate::inventory::{DeviceId, DeviceUuid, Gpu, Inventory, MigDevice, ResourceName};
use std::collections::BTreeMap;

pub use crate::inventory::{GPU_RESOURCE, MIG_RESOURCE_PREFIX, SHARED_SUFFIX};

/// One device as the kubelet sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginDevice {
    /// The kubelet device ID.
    pub id: DeviceId,
    /// UUID of the physical unit: the GPU, or the MIG device.
    pub unit: DeviceUuid,
    /// Index of the physical GPU (the parent, for a MIG device).
    pub gpu_index: u32,
    pub numa_node: Option<u32>,
    /// Which time-slicing replica this is, when the resource is shared.
    pub replica: Option<u32>,
    /// What `NVIDIA_VISIBLE_DEVICES` carries for this device (UUID or index form).
    pub visible_id: String,
}

/// One resource and its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourcePlan {
    pub name: ResourceName,
    /// Replicas per physical unit; 1 when not time-sliced.
    pub replicas: u32,
    pub devices: Vec<PluginDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub resources: Vec<ResourcePlan>,
    /// Things skipped on purpose, for the log (e.g. a MIG-enabled GPU without instances).
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn resource(&self, name: &str) -> Option<&ResourcePlan> {
        self.resources.iter().find(|r| r.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The `single` strategy needs one profile everywhere.
    #[error("MIG strategy `single` needs every MIG device to have the same profile, but this node has {profiles}; use migStrategy `mixed` or repartition the GPUs")]
    MixedProfiles { profiles: String },
    /// The `single` strategy needs MIG on every GPU or on none.
    #[error("MIG strategy `single` needs MIG on all GPUs or on none, but GPU(s) {off} have MIG off; use migStrategy `mixed` or enable MIG on them")]
    MixedModes { off: String },
}

fn gpu_unit(g: &Gpu, ids: DeviceIdStrategy) -> PluginDevice {
    let id = match ids {
        DeviceIdStrategy::Uuid => DeviceId::of_uuid(&g.uuid),
        DeviceIdStrategy::Index => DeviceId::of_index(g.index, None),
    };
    PluginDevice {
        visible_id: id.to_string(),
        id,
        unit: g.uuid.clone(),
        gpu_index: g.index,
        numa_node: g.numa_node,
        replica: None,
    }
}

fn mig_unit(g: &Gpu, pos: usize, m: &MigDevice, ids: DeviceIdStrategy) -> PluginDevice {
    let id = match ids {
        DeviceIdStrategy::Uuid => DeviceId::of_uuid(&m.uuid),
        DeviceIdStrategy::Index => DeviceId::of_index(g.index, Some(pos)),
    };
    // MIG devices sit on their parent's PCIe function, so they share its NUMA node.
    PluginDevice {
        visible_id: id.to_string(),
        id,
        unit: m.uuid.clone(),
        gpu_index: g.index,
        numa_node: g.numa_node,
        replica: None,
    }
}

/// Computes the resources the node offers.
pub fn plan(inv: &Inventory, cfg: &AgentConfig) -> Result<Plan, PlanError> {
    let mut warnings = Vec::new();
    for g in inv.gpus.iter().filter(|g| empty_mig(g)) {
        warnings.push(format!("GPU {} ({}) has MIG enabled but no MIG devices; it is not offered until instances are created", g.index, g.uuid));
    }
    let strategy = match cfg.mig_strategy {
        MigStrategy::Single if !inv.gpus.iter().any(|g| g.mig.current) => {
            warnings
                .push("MIG strategy `single` on a node without MIG: offering whole GPUs".into());
            MigStrategy::None
        }
        s => s,
    };
    let by_name = units_by_resource(inv, strategy, cfg.device_id_strategy, &mut warnings)?;
    for r in &cfg.time_slicing {
        if !by_name.contains_key(&r.name) {
            warnings.push(format!(
                "time-slicing is configured for {} but this node does not offer it",
                r.name
            ));
        }
    }
    Ok(Plan {
        resources: resources(by_name, cfg),
        warnings,
    })
}

/// A GPU in MIG mode with no instances yet: it offers nothing.
fn empty_mig(g: &Gpu) -> bool {
    g.mig.current && g.mig_devices.is_empty()
}

/// The units each resource offers under `strategy`: whole GPUs, MIG devices, or both.
fn units_by_resource(
    inv: &Inventory,
    strategy: MigStrategy,
    ids: DeviceIdStrategy,
    warnings: &mut Vec<String>,
) -> Result<BTreeMap<ResourceName, Vec<PluginDevice>>, PlanError> {
    let mut by_name: BTreeMap<ResourceName, Vec<PluginDevice>> = BTreeMap::new();
    match strategy {
        MigStrategy::None => {
            for g in &inv.gpus {
                if g.mig.current {
                    if !empty_mig(g) {
                        warnings.push(format!("GPU {} has MIG enabled; MIG strategy `none` does not offer it (use `single` or `mixed`)", g.index));
                    }
                } else {
                    by_name
                        .entry(ResourceName::gpu())
                        .or_default()
                        .push(gpu_unit(g, ids));
                }
            }
        }
        MigStrategy::Single => {
            check_single(inv)?;
            for g in &inv.gpus {
                for (pos, m) in g.mig_devices.iter().enumerate() {
                    by_name
                        .entry(ResourceName::gpu())
                        .or_default()
                        .push(mig_unit(g, pos, m, ids));
                }
            }
        }
        MigStrategy::Mixed => {
            for g in &inv.gpus {
                if !g.mig.current {
                    by_name
                        .entry(ResourceName::gpu())
                        .or_default()
                        .push(gpu_unit(g, ids));
                }
                for (pos, m) in g.mig_devices.iter().enumerate() {
                    by_name
                        .entry(ResourceName::mig(&m.profile))
                        .or_default()
                        .push(mig_unit(g, pos, m, ids));
                }
            }
        }
    }
    Ok(by_name)
}

/// The `single` strategy offers MIG devices as `nvidia.com/gpu`: every GPU must be in MIG
/// mode, all with one profile.
fn check_single(inv: &Inventory) -> Result<(), PlanError> {
    let off: Vec<String> = inv
        .gpus
        .iter()
        .filter(|g| !g.mig.current)
        .map(|g| g.index.to_string())
        .collect();
    if !off.is_empty() {
        return Err(PlanError::MixedModes {
            off: off.join(", "),
        });
    }
    let mut profiles: Vec<&str> = inv
        .gpus
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(|m| m.profile.as_str()))
        .collect();
    profiles.sort_unstable();
    profiles.dedup();
    if profiles.len() > 1 {
        return Err(PlanError::MixedProfiles {
            profiles: profiles.join(", "),
        });
    }
    Ok(())
}

/// One resource per name, each device repeated `replicas` times where the resource is
/// time-sliced (and advertised under its shared name); sorted by name.
fn resources(
    by_name: BTreeMap<ResourceName, Vec<PluginDevice>>,
    cfg: &AgentConfig,
) -> Vec<ResourcePlan> {
    let mut resources = Vec::new();
    for (name, devices) in by_name {
        match cfg.replication(&name) {
            Some(rep) => {
                let devices = devices
                    .iter()
                    .flat_map(|d| {
                        (0..rep.replicas).map(move |k| PluginDevice {
                            id: d.id.replica(k),
                            replica: Some(k),
                            ..d.clone()
                        })
                    })
                    .collect();
                resources.push(ResourcePlan {
                    name: rep.advertised_as.clone(),
                    replicas: rep.replicas,
                    devices,
                });
            }
            None => resources.push(ResourcePlan {
                name,
                replicas: 1,
                devices,
            }),
        }
    }
    resources.sort_by(|a, b| a.name.cmp(&b.name));
    resources
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> AgentConfig {
        AgentConfig::parse("t.yaml", text).unwrap()
    }

    fn names(p: &Plan) -> Vec<(&str, usize)> {
        p.resources
            .iter()
            .map(|r| (r.name.as_str(), r.devices.len()))
            .collect()
    }

    #[test]
    fn strategy_none_offers_whole_gpus_with_numa() {
        let inv = crate::sim::load("dgx-h100").unwrap();
        let p = plan(&inv, &cfg("")).unwrap();
        assert_eq!(names(&p), [("nvidia.com/gpu", 8)]);
        let d = &p.resources[0].devices[5];
        assert_eq!(
            (d.id.as_str(), d.numa_node),
            (inv.gpus[5].uuid.as_str(), Some(1))
        );
    }

    #[test]
    fn strategy_mixed_offers_a_resource_per_profile_and_gpus_with_mig_off() {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let p = plan(&inv, &cfg("flags: {migStrategy: mixed}")).unwrap();
        assert_eq!(
            names(&p),
            [
                ("nvidia.com/gpu", 1),
                ("nvidia.com/mig-1g.10gb", 1),
                ("nvidia.com/mig-1g.5gb", 3),
                ("nvidia.com/mig-1g.5gb.me", 1),
                ("nvidia.com/mig-2g.10gb", 2),
                ("nvidia.com/mig-3g.20gb", 2),
                ("nvidia.com/mig-4g.20gb", 1),
            ]
        );
        let me = &p.resource("nvidia.com/mig-1g.5gb.me").unwrap().devices[0];
        assert_eq!((me.gpu_index, me.numa_node), (2, Some(1)));
    }

    #[test]
    fn strategy_single_offers_uniform_mig_devices_and_refuses_mixed_ones() {
        let p = plan(
            &crate::sim::load("h100-mig-single").unwrap(),
            &cfg("flags: {migStrategy: single}"),
        )
        .unwrap();
        assert_eq!(names(&p), [("nvidia.com/gpu", 56)]);
        let err = plan(
            &crate::sim::load("a100-mig-mixed").unwrap(),
            &cfg("flags: {migStrategy: single}"),
        )
        .unwrap_err();
        assert!(matches!(err, PlanError::MixedModes { .. }), "{err}");
    }

    #[test]
    fn a_mig_gpu_without_instances_is_skipped_with_a_warning() {
        let mut inv = crate::sim::load("a100-mig-mixed").unwrap();
        inv.gpus[1].mig_devices.clear();
        let p = plan(&inv, &cfg("flags: {migStrategy: mixed}")).unwrap();
        assert!(
            p.warnings
                .iter()
                .any(|w| w.contains("GPU 1") && w.contains("no MIG devices")),
            "{:?}",
            p.warnings
        );
        assert!(p.resource("nvidia.com/mig-4g.20gb").is_none());
    }

    #[test]
    fn time_slicing_multiplies_devices_and_renames() {
        let inv = crate::sim::load("pcie-l4x4").unwrap();
        let p = plan(&inv, &cfg("sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 3}]}}")).unwrap();
        assert_eq!(names(&p), [("nvidia.com/gpu.shared", 12)]);
        let r = &p.resources[0];
        assert_eq!(r.replicas, 3);
        assert_eq!(r.devices[4].id, format!("{}::1", inv.gpus[1].uuid));
        assert_eq!(r.devices[4].unit, inv.gpus[1].uuid);
    }

    #[test]
    fn index_ids_name_gpus_and_mig_devices_by_position() {
        let inv = crate::sim::load("a100-mig-mixed").unwrap();
        let p = plan(
            &inv,
            &cfg("flags: {migStrategy: mixed, plugin: {deviceIDStrategy: index}}"),
        )
        .unwrap();
        assert_eq!(p.resource("nvidia.com/gpu").unwrap().devices[0].id, "3");
        assert_eq!(
            p.resource("nvidia.com/mig-4g.20gb").unwrap().devices[0].id,
            "1:0"
        );
    }
}
