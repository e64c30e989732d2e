//! Inventory + health -> this node's ResourceSlices (pure).
//!
//! One pool per node, named after the node. The devices are exactly
//! [`Inventory::dra_devices`], named by [`DeviceRef::dra_name`], in that order.
//!
//! **Attributes** follow NVIDIA's DRA driver (`cmd/gpu-kubelet-plugin/deviceinfo.go` in
//! NVIDIA/k8s-dra-driver-gpu, now kubernetes-sigs/dra-driver-nvidia-gpu), so DeviceClass and
//! claim selectors written for it keep working:
//!
//! | GPU (`type`=`gpu`) | MIG device (`type`=`mig`) |
//! |---|---|
//! | `uuid`, `productName`, `brand`, `architecture` (string) | `uuid`, `parentUUID`, `profile`, and the parent's `productName`, `brand`, `architecture` |
//! | `cudaComputeCapability`, `driverVersion`, `cudaDriverVersion` (version) | the parent's three versions |
//! | `index`, `minor` (int) | `parentIndex` (int) |
//! | `resource.kubernetes.io/pciBusID`, `resource.kubernetes.io/pcieRoot`, `resource.kubernetes.io/numaNode` | the parent's three |
//! | capacity `memory` (bytes) | capacities `multiprocessors`, `copyEngines`, `decoders`, `encoders`, `jpegEngines`, `ofaEngines`, `memory` |
//!
//! `index`, `minor` and `parentIndex` are what NVIDIA's earlier driver published
//! (NVIDIA/k8s-dra-driver, `cmd/nvidia-dra-plugin/deviceinfo.go`); its current one dropped them.
//! They are gpuplane's own attributes now: under our driver name they are unqualified (so
//! `gpu.gpuplane.dev/index`), and under NVIDIA's (`--driver-name gpu.nvidia.com`) they are
//! published qualified as `gpu.gpuplane.dev/index` etc., so nothing appears under NVIDIA's domain
//! that NVIDIA's driver does not publish. The `resource.kubernetes.io/` attributes are the three
//! Kubernetes defines (k8s.io/dynamic-resource-allocation `deviceattribute`); nothing else is
//! put there.
//!
//! Versions are semver as NVIDIA writes them (Masterminds `semver.MustParse(v).String()`):
//! `9.0` -> `9.0.0`, `550.90.07` -> `550.90.7`, `12.4` -> `12.4.0`. A value the API server
//! would reject (an unparsable version, a string over 64 bytes) is left out rather than
//! making the whole slice invalid. NVIDIA's `memorySlice<N>` MIG capacities and
//! `addressingMode` are not published: nothing selects on them without counters, and the
//! inventory does not carry addressing mode.
//!
//! `resource.kubernetes.io/pcieRoot` is an **approximation**: the real value is the root
//! complex a device hangs under in sysfs (`/sys/devices/pci0000:15/.../0000:18:00.0` ->
//! `pci0000:15`), which NVML does not report. Without sysfs we group GPUs whose NVML path
//! level is `HostBridge` or closer (same host bridge = same root complex) and name each group
//! `pci<domain>:<lowest bus number in the group>`. Equality, which is what `matchAttribute`
//! constraints use, is right among our own devices whenever NVML's topology is; the bus
//! number itself may differ from the kernel's name for the root, so a `matchAttribute` across
//! drivers (GPU + NIC under one root) will not match until the source reads the real root from
//! sysfs (the `/sys/bus/pci/devices/<address>` link) and the inventory carries it.
//!
//! **Health**: an unhealthy device carries one taint `gpu.gpuplane.dev/unhealthy=<cause>`
//! (`xid-48`, `lost`) with effect `NoSchedule`; a healthy one none. Not `NoExecute`: that effect
//! evicts every pod whose claim holds the device (and, for a multi-device claim, the healthy
//! devices with it), cannot be undone when the device recovers a few minutes later, and a
//! workload that hit the fault already sees it (CUDA errors, and the kubelet's DRA health
//! stream puts it in the pod's status). Eviction stays the cluster admin's call: a
//! `DeviceTaintRule` with `NoExecute` naming the device (driver, pool, device) adds it.
//!
//! **Dynamic MIG**: a GPU gpuplane partitions on demand (`mig.dynamic`) is published as its
//! partitionable devices instead ([`crate::dynamic_mig`], rendered by `render/dynamic.rs`):
//! each allowed instance and the whole GPU, consuming the GPU's counter set, which the pool
//! declares in slices of their own.
//!
//! **Splitting**: devices are packed into slices of at most 64 (the limit for slices with
//! taints or counters) whole GPUs at a time, whatever the health, so a health change never
//! moves a device to another slice and touches exactly one slice, and one GPU's MIG devices
//! (static or dynamic) share a slice. The counter sets follow, at most
//! [`MAX_COUNTER_SETS_PER_SLICE`] to a slice. All slices carry the same `generation` and
//! `resourceSliceCount`. Slice names are stable, `<node>-<driver with dots as dashes>-<i>`
//! (hashed to fit 253 bytes), so the publisher can match existing slices by name and write
//! nothing when nothing changed.

mod dynamic;
mod pci;

pub use pci::{pci_address, pcie_roots, PciAddress};

use super::{MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS};
use crate::health::{Cause, Health, HealthBook};
use crate::inventory::{DeviceRef, DeviceUuid, Gpu, Inventory, MigDevice};
use crate::quantity::{Format, Quantity};
use crate::sharing::{self, UnitShares};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, CounterSet, Device, DeviceAttribute,
    DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;

/// Taint key on unhealthy devices; the value says why (`xid-<n>` or `lost`).
pub const UNHEALTHY_TAINT_KEY: &str = "gpu.gpuplane.dev/unhealthy";
/// Effect of the unhealthy taint: no new allocations; running workloads are left alone.
pub const UNHEALTHY_TAINT_EFFECT: &str = "NoSchedule";
/// Prefix of the attributes Kubernetes defines for all drivers.
pub const STANDARD_PREFIX: &str = "resource.kubernetes.io/";
/// Devices per slice: the tainted-slice limit always, so health never re-splits the pool.
pub const DEVICES_PER_SLICE: usize = MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS;

/// Attribute and capacity names, as NVIDIA's DRA driver spells them.
pub mod names {
    pub const TYPE: &str = "type";
    pub const UUID: &str = "uuid";
    pub const PARENT_UUID: &str = "parentUUID";
    pub const PROFILE: &str = "profile";
    pub const PRODUCT_NAME: &str = "productName";
    pub const BRAND: &str = "brand";
    pub const ARCHITECTURE: &str = "architecture";
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    pub const DRIVER_VERSION: &str = "driverVersion";
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    pub const INDEX: &str = "index";
    pub const MINOR: &str = "minor";
    pub const PARENT_INDEX: &str = "parentIndex";
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
    pub const MEMORY: &str = "memory";
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    pub const COPY_ENGINES: &str = "copyEngines";
    pub const DECODERS: &str = "decoders";
    pub const ENCODERS: &str = "encoders";
    pub const JPEG_ENGINES: &str = "jpegEngines";
    pub const OFA_ENGINES: &str = "ofaEngines";
    pub const PLACEMENT_START: &str = "placementStart";
    pub const PLACEMENT_SIZE: &str = "placementSize";
}

/// This node's slices with pool generation 0 (the publisher picks the generation it writes),
/// no unit shared.
pub fn render(
    inv: &Inventory,
    health: &HealthBook,
    driver: &str,
    node: &str,
) -> Vec<ResourceSlice> {
    render_with_generation(inv, health, driver, node, 0, &BTreeMap::new())
}

/// This node's slices, all carrying `generation`; the units in `shared` are published as
/// shared devices ([`crate::sharing`]), dynamic-MIG GPUs as partitionable devices with their
/// counter sets ([`crate::dynamic_mig`]). No devices, no slices.
pub fn render_with_generation(
    inv: &Inventory,
    health: &HealthBook,
    driver: &str,
    node: &str,
    generation: i64,
    shared: &BTreeMap<DeviceUuid, UnitShares>,
) -> Vec<ResourceSlice> {
    let roots = pcie_roots(inv);
    let root = |g: &Gpu| roots.get(&g.index).map(String::as_str);
    let statics = inv.dra_devices();
    // One group per physical GPU, in inventory order.
    let mut groups: Vec<Vec<Device>> = Vec::new();
    for g in &inv.gpus {
        if g.mig.dynamic {
            groups.extend(dynamic::gpu_group(inv, g, health, root(g), driver));
            continue;
        }
        let group: Vec<Device> = statics
            .iter()
            .filter(|d| d.gpu().index == g.index)
            .map(|d| {
                let mut device = render_device(inv, d, health, root(g), driver);
                if let Some(unit) = shared.get(d.uuid()) {
                    device.allow_multiple_allocations = Some(true);
                    device.capacity = Some(share_capacity(unit));
                }
                device
            })
            .collect();
        if !group.is_empty() {
            groups.push(group);
        }
    }
    let device_chunks = pack(groups, DEVICES_PER_SLICE);
    let sets = dynamic::counter_sets(inv);
    let counter_chunks = sets
        .chunks(MAX_COUNTER_SETS_PER_SLICE)
        .map(<[CounterSet]>::to_vec);
    let contents: Vec<Content> = device_chunks
        .into_iter()
        .map(Content::Devices)
        .chain(counter_chunks.map(Content::Counters))
        .collect();
    let count = i64::try_from(contents.len()).unwrap_or(i64::MAX);
    contents
        .into_iter()
        .enumerate()
        .map(|(i, content)| {
            let (devices, shared_counters) = match content {
                Content::Devices(d) => (Some(d), None),
                Content::Counters(c) => (None, Some(c)),
            };
            ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(slice_name(node, driver, i)),
                    ..ObjectMeta::default()
                },
                spec: ResourceSliceSpec {
                    driver: driver.to_string(),
                    node_name: Some(node.to_string()),
                    pool: ResourcePool {
                        name: node.to_string(),
                        generation,
                        resource_slice_count: count,
                    },
                    devices,
                    shared_counters,
                    ..ResourceSliceSpec::default()
                },
            }
        })
        .collect()
}

/// What one slice holds: the API allows devices or counter sets, never both.
enum Content {
    Devices(Vec<Device>),
    Counters(Vec<CounterSet>),
}

/// Packs groups in order into chunks of at most `max` devices, never splitting a group that
/// fits in one chunk.
fn pack(groups: Vec<Vec<Device>>, max: usize) -> Vec<Vec<Device>> {
    let mut chunks: Vec<Vec<Device>> = Vec::new();
    let mut current: Vec<Device> = Vec::new();
    for group in groups {
        if !current.is_empty() && current.len() + group.len() > max {
            chunks.push(std::mem::take(&mut current));
        }
        for d in group {
            if current.len() == max {
                chunks.push(std::mem::take(&mut current));
            }
            current.push(d);
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Name of slice `index` of this node's pool: `<node>-<driver, dots as dashes>-<index>`.
/// When that exceeds 253 bytes, the head is cut and `-<16 hex of a hash of the full name>`
/// keeps names of different nodes apart; the result is still a DNS subdomain.
pub fn slice_name(node: &str, driver: &str, index: usize) -> String {
    const MAX: usize = 253;
    let full = format!("{}-{}-{}", node, driver.replace('.', "-"), index).to_ascii_lowercase();
    if full.len() <= MAX {
        return full;
    }
    let suffix = format!("-{:016x}-{}", fnv1a(full.as_bytes()), index);
    let mut head: String = full.chars().take(MAX - suffix.len()).collect();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    head + &suffix
}

/// FNV-1a, 64 bit: stable across releases and platforms (unlike `DefaultHasher`).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Where gpuplane's own attributes live: unqualified names take the driver's name as their
/// domain, so under another driver name (`gpu.nvidia.com`) they are qualified with ours.
pub const OWN_DOMAIN: &str = "gpu.gpuplane.dev";

/// `name` in gpuplane's own domain, as published by driver `driver`.
fn own(driver: &str, name: &str) -> String {
    if driver == OWN_DOMAIN {
        name.to_string()
    } else {
        format!("{OWN_DOMAIN}/{name}")
    }
}

fn render_device(
    inv: &Inventory,
    d: &DeviceRef<'_>,
    health: &HealthBook,
    pcie_root: Option<&str>,
    driver: &str,
) -> Device {
    let gpu = d.gpu();
    let mut attrs: BTreeMap<String, DeviceAttribute> = BTreeMap::new();
    let mut put = |name: &str, value: Option<DeviceAttribute>| {
        if let Some(v) = value {
            attrs.insert(name.to_string(), v);
        }
    };
    match d {
        DeviceRef::Gpu(_) => {
            put(names::TYPE, string("gpu"));
            put(names::UUID, string(&gpu.uuid));
            put(&own(driver, names::INDEX), Some(int(gpu.index.into())));
            put(&own(driver, names::MINOR), Some(int(gpu.minor.into())));
        }
        DeviceRef::Mig { mig, .. } => {
            put(names::TYPE, string("mig"));
            put(names::UUID, string(&mig.uuid));
            put(names::PARENT_UUID, string(&gpu.uuid));
            put(names::PROFILE, string(&mig.profile));
            put(
                &own(driver, names::PARENT_INDEX),
                Some(int(gpu.index.into())),
            );
        }
    }
    parent_attributes(inv, gpu, pcie_root, &mut attrs);
    let capacity = match d {
        DeviceRef::Gpu(g) => gpu_capacity(g),
        DeviceRef::Mig { mig, .. } => mig_capacity(mig),
    };
    let taints = match health.health(d.uuid()) {
        Health::Healthy => None,
        Health::Unhealthy(cause) => Some(vec![unhealthy_taint(cause)]),
    };
    Device {
        name: d.dra_name(),
        attributes: Some(attrs),
        capacity: Some(capacity),
        taints,
        ..Device::default()
    }
}

/// The attributes every device of a GPU carries, the GPU's own or its MIG devices': model,
/// versions and where it sits.
fn parent_attributes(
    inv: &Inventory,
    gpu: &Gpu,
    pcie_root: Option<&str>,
    attrs: &mut BTreeMap<String, DeviceAttribute>,
) {
    let mut put = |name: &str, value: Option<DeviceAttribute>| {
        if let Some(v) = value {
            attrs.insert(name.to_string(), v);
        }
    };
    put(names::PRODUCT_NAME, string(&gpu.product_name));
    put(names::BRAND, string(&gpu.brand));
    put(names::ARCHITECTURE, string(&gpu.architecture));
    put(
        names::CUDA_COMPUTE_CAPABILITY,
        version(&gpu.cuda_compute_capability),
    );
    put(names::DRIVER_VERSION, version(&inv.driver_version));
    put(
        names::CUDA_DRIVER_VERSION,
        version(&inv.cuda_driver_version),
    );
    put(names::NUMA_NODE, gpu.numa_node.map(|n| int(n.into())));
    put(
        names::PCI_BUS_ID,
        pci_address(&gpu.pci_bus_id).and_then(|a| string(&a.to_string())),
    );
    put(names::PCIE_ROOT, pcie_root.and_then(string));
}

fn gpu_capacity(g: &Gpu) -> BTreeMap<String, DeviceCapacity> {
    BTreeMap::from([(
        names::MEMORY.to_string(),
        cap(Quantity::mebibytes(g.memory_mib)),
    )])
}

fn mig_capacity(m: &MigDevice) -> BTreeMap<String, DeviceCapacity> {
    let engines = [
        m.copy_engines,
        m.decoders,
        m.encoders,
        m.jpeg_engines,
        m.ofa_engines,
    ];
    unit_capacity(m.multiprocessors, engines, m.memory_mib)
}

/// A MIG unit's capacities: SMs, engines (copy, decoders, encoders, JPEG, OFA) and memory.
fn unit_capacity(
    multiprocessors: u32,
    [copy, dec, enc, jpeg, ofa]: [u32; 5],
    memory_mib: u64,
) -> BTreeMap<String, DeviceCapacity> {
    let count = |n: u32| cap(Quantity::new(n.into(), Format::BinarySI));
    BTreeMap::from([
        (names::MULTIPROCESSORS.to_string(), count(multiprocessors)),
        (names::COPY_ENGINES.to_string(), count(copy)),
        (names::DECODERS.to_string(), count(dec)),
        (names::ENCODERS.to_string(), count(enc)),
        (names::JPEG_ENGINES.to_string(), count(jpeg)),
        (names::OFA_ENGINES.to_string(), count(ofa)),
        (
            names::MEMORY.to_string(),
            cap(Quantity::mebibytes(memory_mib)),
        ),
    ])
}

/// A shared unit's consumable capacities: `memory` and `compute`, each with a request policy
/// whose default is the whole unit. Only these two: on a device that allows several
/// allocations, a capacity without a policy is consumed whole by every allocation, so MIG's
/// engine counts would let only one share in.
fn share_capacity(unit: &UnitShares) -> BTreeMap<String, DeviceCapacity> {
    let policy = |value: Quantity, step: Quantity, max: Quantity| DeviceCapacity {
        request_policy: Some(CapacityRequestPolicy {
            default: Some(api_quantity(&max)),
            valid_range: Some(CapacityRequestPolicyRange {
                min: api_quantity(&step),
                max: Some(api_quantity(&max)),
                step: Some(api_quantity(&step)),
            }),
            valid_values: None,
        }),
        ..cap(value)
    };
    let bytes = |b: u64| Quantity::from_u64(b, Format::BinarySI);
    let percent = |p: u32| Quantity::new(p.into(), Format::DecimalSI);
    BTreeMap::from([
        (
            sharing::MEMORY.to_string(),
            policy(
                bytes(unit.memory),
                bytes(unit.memory_step),
                bytes(unit.max_memory()),
            ),
        ),
        (
            sharing::COMPUTE.to_string(),
            policy(
                percent(sharing::WHOLE_COMPUTE),
                percent(unit.compute_step),
                percent(sharing::WHOLE_COMPUTE),
            ),
        ),
    ])
}

fn api_quantity(q: &Quantity) -> k8s_openapi::apimachinery::pkg::api::resource::Quantity {
    k8s_openapi::apimachinery::pkg::api::resource::Quantity(q.to_string())
}

/// A capacity in the API server's canonical spelling, so a slice we write reads back unchanged.
fn cap(value: Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value: api_quantity(&value),
        request_policy: None,
    }
}

/// Taint key of devices the device plugin API has handed out (shared allocation mode).
pub const IN_USE_TAINT_KEY: &str = "gpu.gpuplane.dev/device-plugin";

/// The taint a device held through the device plugin API carries, so the scheduler stops
/// choosing it for claims until PodResources shows it free.
pub fn in_use_taint() -> DeviceTaint {
    DeviceTaint {
        key: IN_USE_TAINT_KEY.to_string(),
        value: Some("in-use".to_string()),
        effect: UNHEALTHY_TAINT_EFFECT.to_string(),
        time_added: None,
    }
}

/// The taint an unhealthy device carries.
pub fn unhealthy_taint(cause: Cause) -> DeviceTaint {
    let value = match cause {
        Cause::Xid(x) => format!("xid-{x}"),
        Cause::Lost => "lost".to_string(),
    };
    DeviceTaint {
        key: UNHEALTHY_TAINT_KEY.to_string(),
        value: Some(value),
        effect: UNHEALTHY_TAINT_EFFECT.to_string(),
        time_added: None,
    }
}

fn string(v: &str) -> Option<DeviceAttribute> {
    if v.len() > super::MAX_ATTRIBUTE_VALUE_LEN {
        tracing::warn!(
            value = v,
            "attribute value longer than 64 bytes left out of the ResourceSlice"
        );
        return None;
    }
    Some(DeviceAttribute {
        string: Some(v.to_string()),
        ..DeviceAttribute::default()
    })
}

fn int(v: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v),
        ..DeviceAttribute::default()
    }
}

fn version(v: &str) -> Option<DeviceAttribute> {
    match semver(v) {
        Some(s) => Some(DeviceAttribute {
            version: Some(s),
            ..DeviceAttribute::default()
        }),
        None => {
            tracing::warn!(
                value = v,
                "version attribute is not a version; left out of the ResourceSlice"
            );
            None
        }
    }
}

/// `major[.minor[.patch]]` of decimal numbers -> `major.minor.patch` without leading zeros,
/// the way Masterminds semver (used by NVIDIA's driver) normalises driver versions.
pub fn semver(v: &str) -> Option<String> {
    let parts: Vec<&str> = v.trim().trim_start_matches(['v', 'V']).split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut nums = [0u64; 3];
    for (slot, p) in nums.iter_mut().zip(&parts) {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *slot = p.parse().ok()?;
    }
    Some(format!("{}.{}.{}", nums[0], nums[1], nums[2]))
}
