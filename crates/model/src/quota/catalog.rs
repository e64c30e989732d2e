//! What the cluster's GPU devices are, as far as quota needs to know (pure): built from the
//! published ResourceSlices and the DeviceClasses.
//!
//! Per device: its driver, pool and name, whether it is a whole GPU or a MIG device (attribute
//! `type`), its MIG `profile`, its `productName`, its capacity `memory`, and its share of a whole
//! GPU. The share of a MIG device is its compute slices (the `<N>g` of its profile) over its
//! GPU's: 4 on an A30 (`productName` containing `A30`), 7 on every other MIG-capable model
//! (A100, H100, H200, B200).
//!
//! Device-plugin resources (`nvidia.com/gpu`, `nvidia.com/mig-<profile>` with `+` written as
//! `.`, and their `.shared` renames) are priced from the devices of the same type/profile that
//! the DRA side of the same agents publishes: the memory charged for one unit is the largest
//! memory among those devices, divided by the replicas when the resource is time-sliced
//! ([`CatalogSettings::time_slicing`], rounded up). A resource with no matching published device
//! has an *unknown* memory (and, for MIG, an unknown share): a quota that limits that dimension
//! then denies, rather than guess low.
//!
//! A device published with `allowMultipleAllocations: true` is allocated in shares; the
//! catalog keeps that and the request policies of its `memory` and `compute` capacities, and
//! [`super::share`] prices a share from them.

use super::capacity::ConsumableCapacity;
use super::ratio::Gpus;
use super::selector::{AttrValue, CelDevice, Selector};
use super::usage::{Charge, Dimension, Memory, UnknownCharge};
use k8s_openapi::api::resource::v1::{DeviceClass, DeviceTaint, ResourceSlice};
use read::class_infos;
use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

mod read;
pub use read::SliceDevices;

/// The default DRA driver name of gpuplane's node agent.
pub const DEFAULT_DRIVER: &str = "gpu.gpuplane.dev";
/// The device plugin's resource names, which quota charges.
pub use crate::inventory::{GPU_RESOURCE, MIG_RESOURCE_PREFIX, SHARED_SUFFIX};

/// What the catalog is told rather than reads from the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogSettings {
    /// DRA drivers whose devices are GPUs (default `gpu.gpuplane.dev`; add `gpu.nvidia.com`
    /// when NVIDIA's driver or gpuplane under that name publishes them).
    pub drivers: Vec<String>,
    /// Time-sliced device-plugin resources and their replicas per device, as in the agents'
    /// `sharing.timeSlicing` config (e.g. `nvidia.com/gpu` -> 4, or `nvidia.com/gpu.shared`
    /// -> 4 with `renameByDefault`).
    pub time_slicing: BTreeMap<String, u32>,
}

impl Default for CatalogSettings {
    fn default() -> Self {
        CatalogSettings {
            drivers: vec![DEFAULT_DRIVER.to_string()],
            time_slicing: BTreeMap::new(),
        }
    }
}

/// Whole GPU or MIG device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    Gpu,
    Mig {
        profile: String,
    },
    /// A device of a GPU driver with another or no `type`.
    Other,
}

/// One published device.
#[derive(Debug, Clone)]
pub struct CatalogDevice {
    pub driver: String,
    pub pool: String,
    pub name: String,
    pub kind: DeviceKind,
    pub product: Option<String>,
    /// Capacity `memory`, when published.
    pub memory: Option<Memory>,
    /// Share of a whole GPU; `None` for a MIG profile whose size cannot be read.
    pub share: Option<Gpus>,
    /// `allowMultipleAllocations`: the device is allocated in shares.
    pub multi_allocatable: bool,
    /// The `memory` capacity with its request policy (`None`: not published, or unreadable).
    pub memory_capacity: Option<ConsumableCapacity>,
    /// The `compute` capacity (percent of the device's SMs) with its request policy.
    pub compute_capacity: Option<ConsumableCapacity>,
    /// What its slice says of it beyond quota: its node, NUMA node and taints.
    pub facts: DeviceFacts,
    /// Attributes and capacities by (domain, name): what selectors read. Their CEL value is
    /// built only while a new expression's verdicts are computed: kept for all 8,000 devices
    /// of 1,000 nodes, those values were most of a catalog's memory.
    attributes: Vec<(Name, AttrValue)>,
    capacity: Vec<(Name, AttrValue)>,
}

/// An attribute's or capacity's (domain, name), shared by the devices of one slice.
type Name = (Arc<str>, Arc<str>);

/// What a ResourceSlice says of one device beyond what quota prices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceFacts {
    /// The slice's `nodeName` (our agent's pool is named after its node).
    pub node: Option<String>,
    /// `resource.kubernetes.io/numaNode`, when published.
    pub numa: Option<i64>,
    pub taints: Vec<DeviceTaint>,
}

impl CatalogDevice {
    /// Whether the device publishes capacity `name` (bare, or qualified with a domain).
    pub fn has_capacity(&self, name: &str) -> bool {
        let (dom, name) = split_name(&self.driver, name);
        self.capacity
            .iter()
            .any(|((d, n), _)| **d == *dom && **n == *name)
    }

    /// The device as a selector sees it.
    fn cel(&self) -> CelDevice {
        CelDevice::new(
            &self.driver,
            &borrowed(&self.attributes),
            &borrowed(&self.capacity),
        )
    }
}

/// Values as [`CelDevice::new`] reads them.
fn borrowed(values: &[(Name, AttrValue)]) -> Vec<(&str, &str, &AttrValue)> {
    values.iter().map(|((d, n), v)| (&**d, &**n, v)).collect()
}

/// (domain, name) of an attribute or capacity name, borrowed.
fn split_name<'a>(driver: &'a str, name: &'a str) -> (&'a str, &'a str) {
    name.rsplit_once('/').unwrap_or((driver, name))
}

/// (domain, name) of an attribute or capacity name; a bare name is in the driver's domain.
pub fn qualified_name(driver: &str, name: &str) -> (String, String) {
    let (dom, n) = split_name(driver, name);
    (dom.to_string(), n.to_string())
}

/// A DeviceClass as quota reads it.
#[derive(Debug, Clone)]
struct ClassInfo {
    selectors: Vec<Selector>,
}

/// Which devices a DeviceClass (plus a request's own selectors) may allocate.
#[derive(Debug)]
pub enum ClassMatch<'a> {
    /// No DeviceClass of that name is known.
    UnknownClass,
    /// The class certainly selects no GPU driver's devices (a NIC class, say): it costs no
    /// GPUs and no GPU memory.
    NotGpu,
    /// The GPU devices it may match (empty when none is published yet).
    Devices(Vec<&'a CatalogDevice>),
}

/// Published GPU devices and known DeviceClasses.
#[derive(Debug, Clone, Default)]
pub struct DeviceCatalog {
    devices: Vec<Arc<CatalogDevice>>,
    /// The nodes that publish a ResourceSlice, of any driver.
    sliced: BTreeSet<String>,
    classes: BTreeMap<String, ClassInfo>,
    settings: CatalogSettings,
    verdicts: Verdicts,
}

/// Each selector's verdict on every device (`may_match`, in `devices` order), by expression:
/// a CEL evaluation copies the device's whole value, and at 1,000 nodes the webhook, the quota
/// loop and the explainer would otherwise evaluate 8,000 devices per claim request they read.
/// Shared by clones, which hold the same devices. At most [`MAX_VERDICTS`] expressions are
/// kept; past that, verdicts are computed each time.
#[derive(Debug, Clone, Default)]
struct Verdicts(Arc<Mutex<HashMap<Arc<str>, Verdict>>>);

/// One selector's `may_match` on each device, in `devices` order.
type Verdict = Arc<Vec<bool>>;

/// Expressions whose verdicts a catalog keeps (a bit per device each).
const MAX_VERDICTS: usize = 1024;

/// Compute slices of a MIG-capable GPU, by product name.
pub fn mig_compute_slices(product: Option<&str>) -> u64 {
    match product {
        Some(p) if p.to_ascii_uppercase().contains("A30") => 4,
        _ => 7,
    }
}

/// `N` of a MIG profile `Ng.…` (`1g.10gb` -> 1, `7g.80gb` -> 7).
pub fn mig_profile_slices(profile: &str) -> Option<u64> {
    let (n, _) = profile.split_once("g.")?;
    n.parse().ok().filter(|n| *n > 0)
}

/// The share of a whole GPU a MIG profile is on a product.
pub fn mig_share(profile: &str, product: Option<&str>) -> Option<Gpus> {
    let n = mig_profile_slices(profile)?;
    let c = mig_compute_slices(product);
    Gpus::new(n.min(c), c)
}

impl DeviceCatalog {
    /// From every ResourceSlice and DeviceClass in the cluster. Only slices of
    /// `settings.drivers` are read, and of each pool only the slices of its newest generation.
    pub fn new(
        slices: &[ResourceSlice],
        classes: &[DeviceClass],
        settings: CatalogSettings,
    ) -> DeviceCatalog {
        DeviceCatalog::from_shared(slices, classes, settings)
    }

    /// [`DeviceCatalog::new`] from anything that borrows the objects (a reflector store's
    /// `Arc`s), so a caller holding shared copies need not clone them.
    pub fn from_shared<S: Borrow<ResourceSlice>, C: Borrow<DeviceClass>>(
        slices: &[S],
        classes: &[C],
        settings: CatalogSettings,
    ) -> DeviceCatalog {
        let parts: Vec<SliceDevices> = slices
            .iter()
            .map(|s| SliceDevices::new(s.borrow(), &settings))
            .collect();
        DeviceCatalog::from_parts(&parts, classes, settings)
    }

    /// [`DeviceCatalog::new`] from slices read already ([`SliceDevices::new`], with the same
    /// settings): a caller that keeps them rebuilds a catalog without reading any slice again.
    pub fn from_parts<P: Borrow<SliceDevices>, C: Borrow<DeviceClass>>(
        parts: &[P],
        classes: &[C],
        settings: CatalogSettings,
    ) -> DeviceCatalog {
        let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
        for p in parts.iter().map(Borrow::borrow) {
            let g = newest.entry((&p.driver, &p.pool)).or_insert(p.generation);
            *g = (*g).max(p.generation);
        }
        let mut devices = Vec::new();
        for p in parts.iter().map(Borrow::borrow) {
            if newest.get(&(p.driver.as_str(), p.pool.as_str())) == Some(&p.generation) {
                devices.extend(p.devices.iter().cloned());
            }
        }
        let sliced = parts
            .iter()
            .filter_map(|p| p.borrow().node.clone())
            .collect();
        DeviceCatalog {
            devices,
            sliced,
            classes: class_infos(classes),
            settings,
            verdicts: Verdicts::default(),
        }
    }

    /// `s`'s verdict on every device, computed once per catalog. Computed without the lock:
    /// a webhook admission never waits behind another reader's first evaluation.
    fn verdicts(&self, s: &Selector) -> Verdict {
        let kept = |v: &Verdicts| {
            v.0.lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(s.source())
                .cloned()
        };
        if let Some(v) = kept(&self.verdicts) {
            return v;
        }
        let v: Verdict = Arc::new(self.devices.iter().map(|d| s.may_match(&d.cel())).collect());
        let mut kept = self.verdicts.0.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < MAX_VERDICTS {
            kept.insert(s.source().into(), v.clone());
        }
        v
    }

    /// The nodes that publish a ResourceSlice (of any driver).
    pub fn sliced(&self) -> &BTreeSet<String> {
        &self.sliced
    }

    pub fn settings(&self) -> &CatalogSettings {
        &self.settings
    }

    pub fn devices(&self) -> &[Arc<CatalogDevice>] {
        &self.devices
    }

    pub fn has_class(&self, name: &str) -> bool {
        self.classes.contains_key(name)
    }

    /// One published device.
    pub fn device(&self, driver: &str, pool: &str, name: &str) -> Option<&CatalogDevice> {
        self.devices
            .iter()
            .find(|d| d.driver == driver && d.pool == pool && d.name == name)
            .map(|d| &**d)
    }

    /// The devices `class` with the extra `selectors` (CEL expressions of a request) may match.
    pub fn matching(&self, class: &str, selectors: &[Selector]) -> ClassMatch<'_> {
        let Some(info) = self.classes.get(class) else {
            return ClassMatch::UnknownClass;
        };
        let foreign = |s: &Selector| {
            s.required_driver()
                .is_some_and(|d| !self.settings.drivers.iter().any(|x| x == d))
        };
        if info.selectors.iter().chain(selectors).any(foreign) {
            return ClassMatch::NotGpu;
        }
        let verdicts: Vec<_> = info
            .selectors
            .iter()
            .chain(selectors)
            .map(|s| self.verdicts(s))
            .collect();
        ClassMatch::Devices(
            self.devices
                .iter()
                .enumerate()
                .filter(|(i, _)| verdicts.iter().all(|v| v.get(*i).copied().unwrap_or(true)))
                .map(|(_, d)| &**d)
                .collect(),
        )
    }

    /// Whether `resource` is a GPU device-plugin resource this catalog prices.
    pub fn is_gpu_resource(&self, resource: &str) -> bool {
        resource == GPU_RESOURCE
            || resource == format!("{GPU_RESOURCE}{SHARED_SUFFIX}")
            || resource.starts_with(MIG_RESOURCE_PREFIX)
            || self.settings.time_slicing.contains_key(resource)
    }

    /// What `count` units of device-plugin resource `resource` cost; `None` when it is not a
    /// GPU resource (other extended resources are not charged).
    pub fn resource_charge(
        &self,
        resource: &str,
        count: u64,
    ) -> Option<Result<Charge, super::ratio::QuotaMathError>> {
        if !self.is_gpu_resource(resource) || count == 0 {
            return None;
        }
        Some(self.resource_charge_inner(resource, count))
    }

    fn resource_charge_inner(
        &self,
        resource: &str,
        count: u64,
    ) -> Result<Charge, super::ratio::QuotaMathError> {
        let replicas = u64::from(
            self.settings
                .time_slicing
                .get(resource)
                .copied()
                .unwrap_or(1)
                .max(1),
        );
        let base = resource.strip_suffix(SHARED_SUFFIX).unwrap_or(resource);
        let mut charge = Charge::default();
        charge.usage.devices.insert(resource.to_string(), count);
        let matching: Vec<&CatalogDevice> = if base == GPU_RESOURCE {
            self.devices
                .iter()
                .filter(|d| d.kind == DeviceKind::Gpu)
                .map(|d| &**d)
                .collect()
        } else if let Some(profile) = base.strip_prefix(MIG_RESOURCE_PREFIX) {
            self.devices
                .iter()
                .filter(|d| matches!(&d.kind, DeviceKind::Mig { profile: p } if p.replace('+', ".") == profile))
                .map(|d| &**d)
                .collect()
        } else {
            Vec::new()
        };
        // Share of one unit.
        let share = if base == GPU_RESOURCE {
            Some(Gpus::ONE)
        } else {
            matching
                .iter()
                .map(|d| d.share)
                .try_fold(None::<Gpus>, |acc, s| {
                    s.map(|s| Some(acc.map_or(s, |a| a.max(s))))
                })
                .flatten()
        };
        match share {
            Some(s) => charge.usage.gpus = s.checked_div_int(replicas)?.checked_mul_int(count)?,
            None => charge.unknown.push(UnknownCharge {
                dimension: Dimension::Gpus,
                why: format!("no ResourceSlice publishes a device of {resource}, so its share of a GPU is unknown"),
            }),
        }
        let mems: Option<Vec<Memory>> = if matching.is_empty() {
            None
        } else {
            matching.iter().map(|d| d.memory).collect()
        };
        match mems.and_then(|m| m.into_iter().max()) {
            Some(m) => {
                charge.usage.gpu_memory = m.div_ceil_int(replicas)?.checked_mul_int(count)?
            }
            None => charge.unknown.push(UnknownCharge {
                dimension: Dimension::GpuMemory,
                why: format!("no ResourceSlice publishes the memory of a device of {resource}"),
            }),
        }
        Ok(charge)
    }

    /// Worst case of one allocation among the devices a request may get, from each one's
    /// charge ([`super::share::allocation_charge`]): the largest in each dimension (each may come
    /// from a different device), the first unknown of each; both unknown when `costs` is empty.
    pub fn worst_device(costs: &[Charge], what: &str) -> Charge {
        let mut c = Charge::default();
        if costs.is_empty() {
            for dimension in [Dimension::Gpus, Dimension::GpuMemory] {
                c.unknown.push(UnknownCharge {
                    dimension,
                    why: format!("no published device matches {what}"),
                });
            }
            return c;
        }
        for cost in costs {
            c.usage = c.usage.max(&cost.usage);
            for u in &cost.unknown {
                if c.unknown_in(&u.dimension).is_none() {
                    c.unknown.push(u.clone());
                }
            }
        }
        c
    }

    /// Usage of exactly this device (share and memory), unknowns where not published.
    pub fn device_usage(d: &CatalogDevice) -> Charge {
        let mut c = Charge::default();
        match d.share {
            Some(s) => c.usage.gpus = s,
            None => c.unknown.push(UnknownCharge {
                dimension: Dimension::Gpus,
                why: format!(
                    "device {}/{}/{} has an unknown MIG size",
                    d.driver, d.pool, d.name
                ),
            }),
        }
        match d.memory {
            Some(m) => c.usage.gpu_memory = m,
            None => c.unknown.push(UnknownCharge {
                dimension: Dimension::GpuMemory,
                why: format!(
                    "device {}/{}/{} publishes no memory capacity",
                    d.driver, d.pool, d.name
                ),
            }),
        }
        c
    }
}
