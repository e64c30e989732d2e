//! The device inventory: what a node has, as plain data.
//!
//! Every source (NVML, simulation profiles) fills these types and nothing else; every consumer
//! (discover, the device plugin, DRA, CDI) reads only these types. Keeping one model is what lets
//! the NVML path be tested against the simulated one field by field.

mod device_names;
mod ids;
pub mod mig;

pub use device_names::{profile_label, DeviceRef};
pub use ids::{
    DeviceId, DeviceUuid, IdError, MigProfile, ResourceName, UnitKind, GPU_RESOURCE,
    MIG_RESOURCE_PREFIX, SHARED_SUFFIX,
};

use serde::{Deserialize, Serialize};
use std::fmt;

/// Everything gpuplane knows about a node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    /// Kernel driver version, e.g. `550.90.07`.
    pub driver_version: String,
    /// CUDA driver API version as `major.minor`, e.g. `12.4`.
    pub cuda_driver_version: String,
    /// GPUs ordered by NVML index.
    pub gpus: Vec<Gpu>,
    pub topology: Topology,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
    pub uuid: DeviceUuid,
    pub product_name: String,
    /// NVML brand, e.g. `Nvidia`, `Tesla`.
    pub brand: String,
    /// Architecture name, e.g. `Ampere`, `Hopper`.
    pub architecture: String,
    /// `major.minor`, e.g. `9.0`.
    pub cuda_compute_capability: String,
    pub memory_mib: u64,
    /// Domain-qualified PCI address in NVML's form, e.g. `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// NUMA node closest to the GPU; `None` where the platform does not say.
    pub numa_node: Option<u32>,
    pub mig: MigMode,
    /// MIG devices, ordered by (GPU instance, compute instance); empty with MIG off.
    pub mig_devices: Vec<MigDevice>,
}

impl Gpu {
    /// Whether NVML's GPM (GPU Performance Monitoring) samples this GPU: Hopper and later
    /// (NVML API reference, `nvmlGpmQueryDeviceSupport`). On a GPU in MIG mode it is the only
    /// source of a MIG device's utilization.
    pub fn has_gpm(&self) -> bool {
        matches!(self.architecture.as_str(), "Hopper" | "Blackwell")
    }
}

/// MIG mode now and after the next GPU reset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct MigMode {
    pub current: bool,
    pub pending: bool,
    /// The GPU supports MIG (NVML answers its MIG mode), whether or not it is on.
    #[serde(default)]
    pub capable: bool,
    /// The bundled MIG table ([`mig::catalogue`]) whose profiles and placements this GPU has;
    /// `None` where none matches (or the GPU cannot do MIG).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// gpuplane creates and destroys this GPU's MIG instances as claims need them (dynamic
    /// MIG, [`crate::dynamic_mig`]): set by the agent from its config, never by a source.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dynamic: bool,
}

/// One MIG device: a compute instance inside a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    pub uuid: DeviceUuid,
    pub parent_uuid: DeviceUuid,
    /// Profile name as NVIDIA writes it, e.g. `1g.10gb`, `1g.10gb+me`, `1c.3g.40gb`.
    pub profile: MigProfile,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// GPU slices (of the parent's seven) this device's GPU instance takes.
    pub gpu_slices: u32,
    /// Memory-slice placement of the GPU instance.
    pub placement: Placement,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
}

/// Where a GPU instance sits in its GPU's memory slices: `[start, start + size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

impl Placement {
    pub fn end(&self) -> u32 {
        self.start + self.size
    }

    pub fn overlaps(&self, other: &Placement) -> bool {
        self.start < other.end() && other.start < self.end()
    }
}

/// How GPUs are wired to each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Topology {
    /// True when an NVSwitch fabric connects the GPUs all-to-all.
    pub nvswitch: bool,
    /// One entry per unordered GPU pair, `from < to`, ordered by `(from, to)`.
    pub links: Vec<Link>,
}

impl Topology {
    /// The link between two GPUs, in either order.
    pub fn link(&self, a: u32, b: u32) -> Option<&Link> {
        let (from, to) = if a < b { (a, b) } else { (b, a) };
        self.links
            .binary_search_by(|l| (l.from, l.to).cmp(&(from, to)))
            .ok()
            .map(|i| &self.links[i])
    }
}

/// The connection between two GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Link {
    pub from: u32,
    pub to: u32,
    /// NVLink lanes between the two (through the fabric when `Topology::nvswitch`).
    pub nvlinks: u32,
    /// Closest common PCIe ancestor.
    pub level: PathLevel,
}

/// Closest common ancestor on the PCIe/system path, as NVML's `nvmlGpuTopologyLevel_t` has it.
/// Ordered from nearest to farthest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PathLevel {
    /// Same board (multi-GPU boards).
    SameBoard,
    /// One PCIe switch between them.
    SingleSwitch,
    /// Several PCIe switches, no host bridge.
    MultipleSwitches,
    /// Same host bridge.
    HostBridge,
    /// Same NUMA node, different host bridges.
    NumaNode,
    /// Across CPU sockets (SMP interconnect).
    System,
}

impl PathLevel {
    /// The short form `nvidia-smi topo -m` prints.
    pub fn short(self) -> &'static str {
        match self {
            PathLevel::SameBoard => "PSB",
            PathLevel::SingleSwitch => "PIX",
            PathLevel::MultipleSwitches => "PXB",
            PathLevel::HostBridge => "PHB",
            PathLevel::NumaNode => "NODE",
            PathLevel::System => "SYS",
        }
    }
}

impl fmt::Display for PathLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short())
    }
}

impl Inventory {
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// Number of MIG devices over all GPUs.
    pub fn mig_device_count(&self) -> usize {
        self.gpus.iter().map(|g| g.mig_devices.len()).sum()
    }
}
