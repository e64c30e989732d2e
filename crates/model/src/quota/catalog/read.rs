//! Reading one ResourceSlice into the catalog's devices (pure): each device's kind, product,
//! memory and share, its request policies, what the slice says of it (node, NUMA node,
//! taints), and its attributes and capacities for selectors, with each (domain, name) stored
//! once per slice.

use super::{
    mig_share, split_name, CatalogDevice, CatalogSettings, ClassInfo, DeviceFacts, DeviceKind, Name,
};
use crate::quota::capacity::{ConsumableCapacity, COMPUTE_CAPACITY, MEMORY_CAPACITY};
use crate::quota::ratio::Gpus;
use crate::quota::selector::{AttrValue, Selector};
use crate::quota::usage::Memory;
use crate::slices::render::names::NUMA_NODE;
use k8s_openapi::api::resource::v1::{Device, DeviceClass, ResourceSlice};
use std::borrow::Borrow;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// One ResourceSlice as a catalog reads it: built once per slice (and version), shared by
/// every catalog built while the slice stands.
#[derive(Debug, Clone)]
pub struct SliceDevices {
    pub(super) driver: String,
    pub(super) pool: String,
    pub(super) generation: i64,
    pub(super) node: Option<String>,
    /// Its devices; none when its driver is not one of the settings' GPU drivers.
    pub(super) devices: Vec<Arc<CatalogDevice>>,
}

impl SliceDevices {
    pub fn new(slice: &ResourceSlice, settings: &CatalogSettings) -> SliceDevices {
        let spec = &slice.spec;
        let driver = &spec.driver;
        let mut names = Interned::default();
        let devices = if settings.drivers.iter().any(|d| d == driver) {
            spec.devices
                .iter()
                .flatten()
                .map(|d| Arc::new(catalog_device(slice, d, &mut names)))
                .collect()
        } else {
            Vec::new()
        };
        SliceDevices {
            driver: driver.clone(),
            pool: spec.pool.name.clone(),
            generation: spec.pool.generation,
            node: spec.node_name.clone(),
            devices,
        }
    }
}

/// Each (domain, name) once per slice: its devices publish the same names.
#[derive(Default)]
struct Interned(HashSet<Arc<str>>);

impl Interned {
    fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.0.get(s) {
            return a.clone();
        }
        let a: Arc<str> = s.into();
        self.0.insert(a.clone());
        a
    }

    fn name(&mut self, driver: &str, name: &str) -> Name {
        let (dom, n) = split_name(driver, name);
        (self.get(dom), self.get(n))
    }
}

/// DeviceClasses as quota reads them, by name.
pub(super) fn class_infos<C: Borrow<DeviceClass>>(classes: &[C]) -> BTreeMap<String, ClassInfo> {
    classes
        .iter()
        .map(Borrow::borrow)
        .filter_map(|c: &DeviceClass| {
            let name = c.metadata.name.clone()?;
            let selectors = c
                .spec
                .selectors
                .iter()
                .flatten()
                .map(|s| match &s.cel {
                    Some(cel) => Selector::parse(&cel.expression),
                    // A selector kind we do not know: may match anything.
                    None => Selector::parse(""),
                })
                .collect();
            Some((name, ClassInfo { selectors }))
        })
        .collect()
}

/// Attributes by (domain, name), as selectors and the catalog read them.
fn attributes(driver: &str, d: &Device, names: &mut Interned) -> Vec<(Name, AttrValue)> {
    let mut attributes = Vec::new();
    for (k, v) in d.attributes.iter().flatten() {
        let value = if let Some(s) = &v.string {
            AttrValue::Str(s.clone())
        } else if let Some(i) = v.int {
            AttrValue::Int(i)
        } else if let Some(b) = v.bool {
            AttrValue::Bool(b)
        } else if let Some(s) = &v.version {
            AttrValue::Version(s.clone())
        } else {
            continue;
        };
        attributes.push((names.name(driver, k), value));
    }
    attributes
}

fn catalog_device(slice: &ResourceSlice, d: &Device, names: &mut Interned) -> CatalogDevice {
    let driver = slice.spec.driver.as_str();
    let attributes = attributes(driver, d, names);
    let mut capacity = Vec::new();
    let (mut memory_capacity, mut compute_capacity) = (None, None);
    for (k, v) in d.capacity.iter().flatten() {
        if let Ok(q) = crate::quantity::Quantity::parse_trimmed(&v.value.0) {
            capacity.push((names.name(driver, k), AttrValue::Quantity(q)));
        }
        match split_name(driver, k) {
            (dom, MEMORY_CAPACITY) if dom == driver => {
                memory_capacity = ConsumableCapacity::from_api(v)
            }
            (dom, COMPUTE_CAPACITY) if dom == driver => {
                compute_capacity = ConsumableCapacity::from_api(v)
            }
            _ => {}
        }
    }
    let text = |name: &str| match find(&attributes, driver, name) {
        Some(AttrValue::Str(s)) => Some(s),
        _ => None,
    };
    let product = text("productName");
    let kind = match (text("type").as_deref(), text("profile")) {
        (Some("gpu"), _) => DeviceKind::Gpu,
        (Some("mig"), Some(profile)) => DeviceKind::Mig { profile },
        _ => DeviceKind::Other,
    };
    let memory = match find(&capacity, driver, MEMORY_CAPACITY) {
        Some(AttrValue::Quantity(q)) => Memory::from_quantity(&q),
        _ => None,
    };
    let share = match &kind {
        DeviceKind::Gpu => Some(Gpus::ONE),
        DeviceKind::Mig { profile } => mig_share(profile, product.as_deref()),
        // A device of a GPU driver that is neither: count it as a whole GPU (worst case).
        DeviceKind::Other => Some(Gpus::ONE),
    };
    let (numa_dom, numa_name) = split_name(driver, NUMA_NODE);
    let facts = DeviceFacts {
        node: slice.spec.node_name.clone(),
        numa: match find(&attributes, numa_dom, numa_name) {
            Some(AttrValue::Int(i)) => Some(i),
            _ => None,
        },
        taints: d.taints.clone().unwrap_or_default(),
    };
    CatalogDevice {
        driver: driver.to_string(),
        pool: slice.spec.pool.name.clone(),
        name: d.name.clone(),
        kind,
        product,
        memory,
        share,
        multi_allocatable: d.allow_multiple_allocations == Some(true),
        memory_capacity,
        compute_capacity,
        facts,
        attributes,
        capacity,
    }
}

/// The value published under (`dom`, `name`).
fn find(values: &[(Name, AttrValue)], dom: &str, name: &str) -> Option<AttrValue> {
    values
        .iter()
        .find(|((d, n), _)| **d == *dom && **n == *name)
        .map(|(_, v)| v.clone())
}
