//! Allocate and GetPreferredAllocation decisions for one resource (pure).
//!
//! Takes the resource's plan, device health and the request; returns what the container gets or
//! a refusal the kubelet will show the user. No gRPC types: the service converts, and parses
//! the kubelet's device IDs once ([`parse_ids`]); Allocate decides on [`DeviceId`]s.

use super::resources::{PluginDevice, ResourcePlan};
use crate::config::{AgentConfig, DeviceListStrategy};
use crate::health::{Health, HealthBook};
use crate::inventory::{DeviceId, DeviceUuid, ResourceName};
use crate::ledger::{Holder, Ledger};
use crate::source::DeviceMode;
use crate::topology::{self, PreferError, TopologyModel};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// CDI kind of the node-wide spec; `nvidia.com/gpu=<uuid>` names each device.
pub const CDI_KIND: &str = "nvidia.com/gpu";

/// What one container gets.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerGrant {
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
    pub envs: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The kubelet named a device this resource does not have (as it named it: an ID that does
    /// not parse is one).
    #[error("device {id} is not a {resource} device of this node; the kubelet's view is stale, it will resync from ListAndWatch")]
    UnknownDevice { resource: String, id: String },
    /// The device is unhealthy.
    #[error("device {id} of {resource} is unhealthy ({cause}); choose another device")]
    Unhealthy {
        resource: String,
        id: DeviceId,
        cause: String,
    },
    /// A container asked for more than one replica of a time-sliced resource.
    #[error("{resource} is time-sliced and limited to 1 replica per container (failRequestsGreaterThanOne); the container asked for {requested}")]
    TooManyReplicas { resource: String, requested: usize },
    /// The same device ID appears twice.
    #[error("device {id} of {resource} is listed twice in one request")]
    Duplicate { resource: String, id: DeviceId },
    /// Another consumer holds the physical device (`id`: the device ID, or the unit's UUID where
    /// no requested ID is on it).
    #[error("device {id} of {resource} is held by {holder}; it cannot be given out twice")]
    Held {
        resource: String,
        id: String,
        holder: String,
    },
}

fn find<'a>(plan: &'a ResourcePlan, id: &str) -> Option<&'a PluginDevice> {
    plan.devices.iter().find(|d| d.id == id)
}

/// The environment variable NVIDIA's stack reads for the set of GPUs a container has.
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// Decides one container's request.
///
/// Simulated devices: the node spec cannot say which devices a container got (each CDI device
/// only carries its own `GPUPLANE_DEVICE_*` variable), so the grant sets
/// `NVIDIA_VISIBLE_DEVICES` to the UUIDs of the container's units, as NVIDIA's stack does;
/// unless the `envvar` device list strategy already sets it as configured.
pub fn allocate(
    plan: &ResourcePlan,
    health: &HealthBook,
    cfg: &AgentConfig,
    ids: &[DeviceId],
    mode: DeviceMode,
) -> Result<ContainerGrant, AllocateError> {
    let resource = plan.name.to_string();
    check_count(plan, cfg, ids.len())?;
    let mut seen = BTreeSet::new();
    let mut units: Vec<&PluginDevice> = Vec::with_capacity(ids.len());
    for id in ids {
        if !seen.insert(id.as_str()) {
            return Err(AllocateError::Duplicate {
                resource,
                id: id.clone(),
            });
        }
        let dev = find(plan, id).ok_or_else(|| AllocateError::UnknownDevice {
            resource: resource.clone(),
            id: id.to_string(),
        })?;
        if let Health::Unhealthy(cause) = health.health(&dev.unit) {
            return Err(AllocateError::Unhealthy {
                resource,
                id: id.clone(),
                cause: cause.to_string(),
            });
        }
        units.push(dev);
    }
    // Several replicas of one unit inject the same device once.
    let mut unique: Vec<&PluginDevice> = Vec::new();
    for d in units {
        if !unique.iter().any(|u| u.unit == d.unit) {
            unique.push(d);
        }
    }
    let mut grant = ContainerGrant::default();
    if cfg
        .device_list_strategy
        .contains(&DeviceListStrategy::CdiCri)
    {
        grant.cdi_devices = unique
            .iter()
            .map(|d| format!("{CDI_KIND}={}", d.unit))
            .collect();
    }
    if cfg
        .device_list_strategy
        .contains(&DeviceListStrategy::Envvar)
    {
        let visible: Vec<&str> = unique.iter().map(|d| d.visible_id.as_str()).collect();
        grant.envs.insert(VISIBLE_DEVICES.into(), visible.join(","));
    } else if mode == DeviceMode::Simulated {
        let uuids: Vec<&str> = unique.iter().map(|d| d.unit.as_str()).collect();
        grant.envs.insert(VISIBLE_DEVICES.into(), uuids.join(","));
    }
    Ok(grant)
}

/// A time-sliced resource limited to one replica per container refuses more (checked before any
/// ID).
fn check_count(
    plan: &ResourcePlan,
    cfg: &AgentConfig,
    requested: usize,
) -> Result<(), AllocateError> {
    if plan.replicas > 1 && cfg.fail_requests_greater_than_one && requested > 1 {
        return Err(AllocateError::TooManyReplicas {
            resource: plan.name.to_string(),
            requested,
        });
    }
    Ok(())
}

/// The kubelet's device IDs for one container, parsed once (at the gRPC edge) for [`allocate`].
/// An ID that does not parse names no device of this node, so it is refused as an unknown one,
/// and only where [`allocate`] would come to it: after the replica count and the IDs before it,
/// so a request with several faults gets the refusal it always got.
pub fn parse_ids(
    plan: &ResourcePlan,
    health: &HealthBook,
    cfg: &AgentConfig,
    raw: &[String],
    mode: DeviceMode,
) -> Result<Vec<DeviceId>, AllocateError> {
    let mut ids = Vec::with_capacity(raw.len());
    for id in raw {
        match DeviceId::parse(id.as_str()) {
            Ok(id) => ids.push(id),
            Err(_) => {
                check_count(plan, cfg, raw.len())?;
                allocate(plan, health, cfg, &ids, mode)?;
                return Err(AllocateError::UnknownDevice {
                    resource: plan.name.to_string(),
                    id: id.clone(),
                });
            }
        }
    }
    Ok(ids)
}

/// The ledger holder the device plugin records for a container's devices.
pub fn holder(resource: &ResourceName, ids: &[DeviceId]) -> Holder {
    Holder::DevicePlugin {
        resource: resource.clone(),
        device_ids: ids.to_vec(),
        pod: None,
    }
}

/// Records a granted container's units in the ledger, refusing units another consumer (a DRA
/// claim) holds, directly or through a MIG/GPU overlap. Returns the units and whether any was
/// newly held.
pub fn hold(
    plan: &ResourcePlan,
    ledger: &mut Ledger,
    ids: &[DeviceId],
    now: Instant,
) -> Result<(Vec<DeviceUuid>, bool), AllocateError> {
    let mut units: Vec<DeviceUuid> = ids
        .iter()
        .filter_map(|id| find(plan, id))
        .map(|d| d.unit.clone())
        .collect();
    units.sort();
    units.dedup();
    // Re-holding what the device plugin side already holds changes nothing anyone watches.
    let newly = units
        .iter()
        .any(|u| !matches!(ledger.holder(u), Some(Holder::DevicePlugin { .. })));
    ledger
        .hold_all(&units, &holder(&plan.name, ids), now)
        .map_err(|held| {
            let id = plan
                .devices
                .iter()
                .find(|d| d.unit == held.unit && ids.contains(&d.id))
                .map_or(held.unit.to_string(), |d| d.id.to_string());
            AllocateError::Held {
                resource: plan.name.to_string(),
                id,
                holder: held.holder.to_string(),
            }
        })?;
    Ok((units, newly))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreferredError {
    /// A device in the request is not one of the resource's.
    #[error("device {id} is not a {resource} device of this node")]
    UnknownDevice { resource: String, id: String },
    #[error(transparent)]
    Topology(#[from] PreferError),
}

/// The kubelet's available and must-include device IDs of a GetPreferredAllocation request,
/// parsed once (at the gRPC edge) for [`preferred`]; one that does not parse names no device of
/// this node.
pub fn parse_preferred_ids(
    plan: &ResourcePlan,
    available: &[String],
    must_include: &[String],
) -> Result<(Vec<DeviceId>, Vec<DeviceId>), PreferredError> {
    let parse = |raw: &[String]| -> Result<Vec<DeviceId>, PreferredError> {
        raw.iter()
            .map(|id| {
                DeviceId::parse(id.as_str()).map_err(|_| PreferredError::UnknownDevice {
                    resource: plan.name.to_string(),
                    id: id.clone(),
                })
            })
            .collect()
    };
    Ok((parse(available)?, parse(must_include)?))
}

/// Picks `size` of `available` (always including `must_include`).
///
/// Whole GPUs: the topology-optimal set. Time-sliced replicas: spread over distinct physical
/// units first, those units chosen by topology. MIG devices: close to the must-include ones
/// (same GPU, then same NUMA node), then by GPU order. `avoid` holds units to steer away from
/// (held by another consumer); they are used only when nothing else is left.
pub fn preferred(
    plan: &ResourcePlan,
    model: &TopologyModel,
    available: &[DeviceId],
    must_include: &[DeviceId],
    size: usize,
    avoid: &BTreeSet<DeviceUuid>,
) -> Result<Vec<DeviceId>, PreferredError> {
    let lookup = |id: &DeviceId| {
        find(plan, id).ok_or_else(|| PreferredError::UnknownDevice {
            resource: plan.name.to_string(),
            id: id.to_string(),
        })
    };
    let avail: Vec<&PluginDevice> = available.iter().map(lookup).collect::<Result<_, _>>()?;
    let must: Vec<&PluginDevice> = must_include.iter().map(lookup).collect::<Result<_, _>>()?;
    if size == 0 {
        return Err(PreferError::ZeroSize.into());
    }
    if size > avail.len() {
        return Err(PreferError::SizeExceedsAvailable {
            size,
            available: avail.len(),
        }
        .into());
    }
    if must.len() > size {
        return Err(PreferError::MustIncludeExceedsSize {
            must_include: must.len(),
            size,
        }
        .into());
    }
    if let Some(m) = must.iter().find(|m| !avail.iter().any(|a| a.id == m.id)) {
        return Err(PreferError::MustIncludeNotAvailable { index: m.gpu_index }.into());
    }
    // Devices on avoided units go last, whatever else is true of them.
    let (free, held): (Vec<&PluginDevice>, Vec<&PluginDevice>) =
        avail.iter().partition(|d| !avoid.contains(&d.unit));
    let whole_gpus = plan.replicas == 1 && avail.iter().all(|d| !d.unit.starts_with("MIG-"));
    let chosen = if whole_gpus {
        pick_gpus(model, &free, &held, &must, size)?
    } else if plan.replicas > 1 {
        pick_replicas(model, &free, &held, &must, size)?
    } else {
        pick_mig(&free, &held, &must, size)
    };
    Ok(chosen.into_iter().map(|d| d.id.clone()).collect())
}

/// Topology-optimal whole GPUs; held GPUs only to make up the count.
fn pick_gpus<'a>(
    model: &TopologyModel,
    free: &[&'a PluginDevice],
    held: &[&'a PluginDevice],
    must: &[&'a PluginDevice],
    size: usize,
) -> Result<Vec<&'a PluginDevice>, PreferError> {
    let mut pool: Vec<&PluginDevice> = free.to_vec();
    let mut extra = held.iter();
    while pool.len() < size {
        match extra.next() {
            Some(d) => pool.push(d),
            None => break,
        }
    }
    for m in must {
        if !pool.iter().any(|p| p.id == m.id) {
            pool.push(m);
        }
    }
    let idx: Vec<u32> = pool.iter().map(|d| d.gpu_index).collect();
    let must_idx: Vec<u32> = must.iter().map(|d| d.gpu_index).collect();
    let picked = topology::preferred(model, &idx, &must_idx, size)?;
    Ok(pool
        .into_iter()
        .filter(|d| picked.contains(&d.gpu_index))
        .collect())
}

/// Replicas spread over as many distinct units as possible, units chosen by topology.
fn pick_replicas<'a>(
    model: &TopologyModel,
    free: &[&'a PluginDevice],
    held: &[&'a PluginDevice],
    must: &[&'a PluginDevice],
    size: usize,
) -> Result<Vec<&'a PluginDevice>, PreferError> {
    let is_must = |d: &PluginDevice| must.iter().any(|m| m.id == d.id);
    let mut must_gpus: Vec<u32> = must.iter().map(|d| d.gpu_index).collect();
    must_gpus.sort_unstable();
    must_gpus.dedup();
    let mut gpus: Vec<u32> = free
        .iter()
        .chain(held)
        .map(|d| d.gpu_index)
        .chain(must_gpus.iter().copied())
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    // The GPUs a topology-optimal pick of that many would take are filled first.
    let best = topology::preferred(
        model,
        &gpus,
        &must_gpus,
        size.min(gpus.len()).max(must_gpus.len()),
    )?;
    // Units in preference order: free before held, topology-best first, then GPU order.
    let mut units: BTreeMap<(bool, bool, u32, &str), Vec<&PluginDevice>> = BTreeMap::new();
    for (is_held, list) in [(false, free), (true, held)] {
        for d in list.iter().filter(|d| !is_must(d)) {
            units
                .entry((
                    is_held,
                    !best.contains(&d.gpu_index),
                    d.gpu_index,
                    d.unit.as_str(),
                ))
                .or_default()
                .push(d);
        }
    }
    let mut used: BTreeMap<&str, usize> = BTreeMap::new();
    for m in must {
        *used.entry(m.unit.as_str()).or_default() += 1;
    }
    let mut chosen: Vec<&PluginDevice> = must.to_vec();
    // Pass p gives one more replica to each unit that has p so far: round-robin spreading.
    for pass in 0..size {
        for (key, list) in units.iter_mut() {
            if chosen.len() == size {
                return Ok(chosen);
            }
            let count = used.entry(key.3).or_default();
            if *count == pass && !list.is_empty() {
                chosen.push(list.remove(0));
                *count += 1;
            }
        }
    }
    Ok(chosen)
}

/// MIG devices near the must-include ones.
fn pick_mig<'a>(
    free: &[&'a PluginDevice],
    held: &[&'a PluginDevice],
    must: &[&'a PluginDevice],
    size: usize,
) -> Vec<&'a PluginDevice> {
    let gpus: BTreeSet<u32> = must.iter().map(|d| d.gpu_index).collect();
    let numas: BTreeSet<Option<u32>> = must.iter().map(|d| d.numa_node).collect();
    let mut rest: Vec<(usize, &PluginDevice)> = free
        .iter()
        .map(|d| (0, *d))
        .chain(held.iter().map(|d| (1, *d)))
        .filter(|(_, d)| !must.iter().any(|m| m.id == d.id))
        .collect();
    rest.sort_by_key(|(tier, d)| {
        (
            *tier,
            !gpus.contains(&d.gpu_index),
            !numas.contains(&d.numa_node),
            d.gpu_index,
            d.id.clone(),
        )
    });
    must.iter()
        .copied()
        .chain(rest.into_iter().map(|(_, d)| d))
        .take(size)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deviceplugin::resources::plan;

    fn setup(profile: &str, cfg: &str) -> (ResourcePlan, TopologyModel, HealthBook, AgentConfig) {
        let inv = crate::sim::load(profile).unwrap();
        let cfg = AgentConfig::parse("t.yaml", cfg).unwrap();
        let p = plan(&inv, &cfg).unwrap().resources.remove(0);
        let mut health = HealthBook::default();
        health.set_inventory(&inv);
        (p, TopologyModel::new(&inv), health, cfg)
    }

    fn dev(p: &ResourcePlan, i: usize) -> DeviceId {
        p.devices[i].id.clone()
    }

    fn ids(p: &ResourcePlan) -> Vec<DeviceId> {
        p.devices.iter().map(|d| d.id.clone()).collect()
    }

    #[test]
    fn replicas_of_one_gpu_are_injected_once() {
        let (p, _, health, cfg) = setup(
            "pcie-l4x4",
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
        );
        let g = allocate(
            &p,
            &health,
            &cfg,
            &[dev(&p, 0), dev(&p, 1)],
            DeviceMode::Hardware,
        )
        .unwrap();
        assert_eq!(
            g.cdi_devices,
            vec![format!("nvidia.com/gpu={}", p.devices[0].unit)]
        );
        assert!(g.envs.is_empty(), "{:?}", g.envs);
    }

    #[test]
    fn simulated_devices_get_their_uuids_in_nvidia_visible_devices() {
        let (p, _, health, cfg) = setup("h100-mig-single", "flags: {migStrategy: single}");
        let picked = [dev(&p, 3), dev(&p, 0)];
        let g = allocate(&p, &health, &cfg, &picked, DeviceMode::Simulated).unwrap();
        let uuids = format!("{},{}", p.devices[3].unit, p.devices[0].unit);
        assert!(uuids.contains("MIG-"), "{uuids}");
        assert_eq!(g.envs.get(VISIBLE_DEVICES), Some(&uuids));
        assert_eq!(g.cdi_devices.len(), 2);
        // The envvar strategy's configured value stays what it was.
        let (p, _, health, cfg) = setup(
            "pcie-l4x4",
            "flags: {plugin: {deviceListStrategy: [envvar, cdi-cri], deviceIDStrategy: index}}",
        );
        let g = allocate(&p, &health, &cfg, &[dev(&p, 1)], DeviceMode::Simulated).unwrap();
        assert_eq!(g.envs.get(VISIBLE_DEVICES).map(String::as_str), Some("1"));
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let (p, _, health, cfg) = setup("pcie-l4x4", "");
        let id = dev(&p, 0);
        assert!(matches!(
            allocate(&p, &health, &cfg, &[id.clone(), id], DeviceMode::Hardware),
            Err(AllocateError::Duplicate { .. })
        ));
    }

    #[test]
    fn an_id_that_is_none_is_refused_as_unknown_where_allocate_comes_to_it() {
        let (p, _, health, cfg) = setup("pcie-l4x4", "");
        let parse = |raw: &[&str]| {
            let raw: Vec<String> = raw.iter().map(|s| s.to_string()).collect();
            parse_ids(&p, &health, &cfg, &raw, DeviceMode::Hardware)
        };
        let unknown = |id: &str| AllocateError::UnknownDevice {
            resource: "nvidia.com/gpu".into(),
            id: id.into(),
        };
        let first = p.devices[0].id.as_str();
        assert_eq!(parse(&[first]), Ok(vec![dev(&p, 0)]));
        // An unknown ID before a malformed one is the refusal, as it always was.
        assert_eq!(parse(&["GPU-nope", ""]), Err(unknown("GPU-nope")));
        assert_eq!(parse(&[first, "a b"]), Err(unknown("a b")));
        let dup = parse(&[first, first, ""]);
        assert!(
            matches!(dup, Err(AllocateError::Duplicate { .. })),
            "{dup:?}"
        );
        // The replica count comes before any ID.
        let (p, _, health, cfg) = setup(
            "pcie-l4x4",
            "sharing: {timeSlicing: {failRequestsGreaterThanOne: true, resources: [{name: nvidia.com/gpu, replicas: 2}]}}",
        );
        let raw = vec![String::new(), p.devices[0].id.to_string()];
        let many = parse_ids(&p, &health, &cfg, &raw, DeviceMode::Hardware);
        assert!(
            matches!(
                many,
                Err(AllocateError::TooManyReplicas { requested: 2, .. })
            ),
            "{many:?}"
        );
    }

    #[test]
    fn held_units_are_avoided_while_others_remain() {
        let (p, model, _, _) = setup("dgx-h100", "flags: {plugin: {deviceIDStrategy: index}}");
        let avoid: BTreeSet<DeviceUuid> = p.devices[..4].iter().map(|d| d.unit.clone()).collect();
        let got = preferred(&p, &model, &ids(&p), &[], 4, &avoid).unwrap();
        assert_eq!(got, ["4", "5", "6", "7"]);
        // With only held ones left, they are still offered rather than failing.
        let got = preferred(&p, &model, &ids(&p)[..4], &[], 2, &avoid).unwrap();
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn mig_picks_stay_near_the_must_include_device() {
        let (p, model, _, _) = setup("h100-mig-single", "flags: {migStrategy: single}");
        let all = ids(&p);
        let must = vec![all[20].clone()]; // on GPU 2
        let got = preferred(&p, &model, &all, &must, 3, &BTreeSet::new()).unwrap();
        let gpus: BTreeSet<u32> = got
            .iter()
            .map(|id| find(&p, id).unwrap().gpu_index)
            .collect();
        assert_eq!(gpus, BTreeSet::from([2]));
        assert!(got.contains(&all[20]));
    }

    #[test]
    fn a_device_that_was_not_offered_is_an_error() {
        let (p, model, _, _) = setup("pcie-l4x4", "");
        let err = preferred(
            &p,
            &model,
            &[DeviceId::parse("GPU-x").unwrap()],
            &[],
            1,
            &BTreeSet::new(),
        )
        .unwrap_err();
        assert!(matches!(err, PreferredError::UnknownDevice { .. }));
    }

    #[test]
    fn replicas_fill_distinct_units_before_doubling_up() {
        let (p, model, _, _) = setup(
            "pcie-l4x4",
            "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 3}]}}",
        );
        let got = preferred(&p, &model, &ids(&p), &[], 6, &BTreeSet::new()).unwrap();
        let mut per_unit: BTreeMap<&str, usize> = BTreeMap::new();
        for id in &got {
            *per_unit.entry(&find(&p, id).unwrap().unit).or_default() += 1;
        }
        let mut counts: Vec<usize> = per_unit.values().copied().collect();
        counts.sort_unstable();
        assert_eq!(counts, [1, 1, 2, 2], "{got:?}");
    }
}
