//! The ResourceSlice devices and counter sets of dynamic-MIG GPUs (KEP-4815 partitionable
//! devices), from [`crate::dynamic_mig`].
//!
//! Each such GPU has one counter set, `gpu-<index>` ([`dynamic_mig::counters`]), declared in
//! the pool's counter slices. Its devices, in one slice as every GPU's:
//!
//! - the whole GPU, `gpu-<index>`: attributes and capacity as a GPU without MIG, consuming
//!   every counter (preparing it creates the full-profile instance);
//! - each instance its table allows, `gpu-<index>-mig-<profile>-at<start>`: attributes as a
//!   MIG device (`type` `mig`, `profile`, `parentUUID`, own-domain `parentIndex`, the parent's
//!   model, versions and place), plus own-domain `placementStart` and `placementSize` (memory
//!   slices), the profile's capacities, and no `uuid`: the instance has none until a prepare
//!   creates it. It consumes its memory slices, compute slices and engines.
//!
//! All carry the parent GPU's unhealthy taint: an instance of a broken GPU is broken.

use super::{
    int, names, own, parent_attributes, render_device, string, unhealthy_taint, unit_capacity,
};
use crate::dynamic_mig::{self, DynamicDevice, Slot};
use crate::health::{Health, HealthBook};
use crate::inventory::{DeviceRef, Gpu, Inventory};
use crate::quantity::{Format, Quantity};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;
use std::collections::BTreeMap;

/// A dynamic GPU's devices, whole GPU first; `None` if its table is unknown (then
/// [`crate::dynamic_mig::plan`] would not have marked it).
pub(super) fn gpu_group(
    inv: &Inventory,
    g: &Gpu,
    health: &HealthBook,
    pcie_root: Option<&str>,
    driver: &str,
) -> Option<Vec<Device>> {
    let table = dynamic_mig::table_of(g)?;
    let devices = dynamic_mig::gpu_devices(g, table)
        .iter()
        .map(|d| {
            let mut device = match d.slot {
                Slot::Whole => render_device(inv, &DeviceRef::Gpu(g), health, pcie_root, driver),
                Slot::Instance { .. } => instance(inv, d, health, pcie_root, driver),
            };
            device.consumes_counters = Some(vec![consumption(d)]);
            device
        })
        .collect();
    Some(devices)
}

/// The counter sets of every dynamic GPU, in inventory order.
pub(super) fn counter_sets(inv: &Inventory) -> Vec<CounterSet> {
    inv.gpus
        .iter()
        .filter(|g| g.mig.dynamic)
        .filter_map(|g| {
            dynamic_mig::table_of(g).map(|table| CounterSet {
                name: dynamic_mig::counter_set_name(g),
                counters: api_counters(dynamic_mig::counters(table)),
            })
        })
        .collect()
}

fn consumption(d: &DynamicDevice<'_>) -> DeviceCounterConsumption {
    DeviceCounterConsumption {
        counter_set: dynamic_mig::counter_set_name(d.parent),
        counters: api_counters(d.consumes()),
    }
}

fn api_counters(counters: BTreeMap<String, u32>) -> BTreeMap<String, Counter> {
    counters
        .into_iter()
        .map(|(name, n)| {
            let value = ApiQuantity(Quantity::new(n.into(), Format::DecimalSI).to_string());
            (name, Counter { value })
        })
        .collect()
}

fn instance(
    inv: &Inventory,
    d: &DynamicDevice<'_>,
    health: &HealthBook,
    pcie_root: Option<&str>,
    driver: &str,
) -> Device {
    let g = d.parent;
    let mut attrs: BTreeMap<String, DeviceAttribute> = BTreeMap::new();
    let mut put = |name: &str, value: Option<DeviceAttribute>| {
        if let Some(v) = value {
            attrs.insert(name.to_string(), v);
        }
    };
    let placement = d.placement();
    put(names::TYPE, string("mig"));
    put(names::PARENT_UUID, string(&g.uuid));
    put(&own(driver, names::PARENT_INDEX), Some(int(g.index.into())));
    put(
        &own(driver, names::PLACEMENT_START),
        Some(int(placement.start.into())),
    );
    put(
        &own(driver, names::PLACEMENT_SIZE),
        Some(int(placement.size.into())),
    );
    let capacity = d.profile().map(|p| {
        put(names::PROFILE, string(p.name));
        let engines = [
            p.copy_engines,
            p.decoders,
            p.encoders,
            p.jpeg_engines,
            p.ofa_engines,
        ];
        unit_capacity(p.multiprocessors, engines, p.memory_mib)
    });
    parent_attributes(inv, g, pcie_root, &mut attrs);
    let taints = match health.health(&g.uuid) {
        Health::Healthy => None,
        Health::Unhealthy(cause) => Some(vec![unhealthy_taint(cause)]),
    };
    Device {
        name: d.dra_name(),
        attributes: Some(attrs),
        capacity,
        taints,
        ..Device::default()
    }
}
