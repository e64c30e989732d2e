//! The profile file schema and its validation into an [`Inventory`].

mod gpu;
mod topology;

use crate::inventory::{mig, Inventory};
use gpu::build_gpu;
pub(crate) use gpu::derived_uuid;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use topology::build_topology;

/// NVML exposes at most this many NVLinks per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINKS: u32 = 18;

/// Brands and architectures as NVML names them; anything else is a typo in the profile.
/// `BRANDS` is in `nvmlBrandType` order (a brand's position is its NVML value): the fake NVML
/// library relies on it.
pub const BRANDS: &[&str] = &[
    "Unknown",
    "Quadro",
    "Tesla",
    "NVS",
    "GRID",
    "GeForce",
    "Titan",
    "VApps",
    "VPC",
    "VCS",
    "VWS",
    "CloudGaming",
    "QuadroRTX",
    "NvidiaRTX",
    "Nvidia",
    "GeForceRTX",
    "TitanRTX",
];
pub const ARCHITECTURES: &[&str] = &[
    "Kepler",
    "Maxwell",
    "Pascal",
    "Volta",
    "Turing",
    "Ampere",
    "Ada",
    "Hopper",
    "Blackwell",
];

/// A whole profile file.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfileFile {
    /// Free text shown by `discover`.
    #[serde(default)]
    pub description: String,
    pub driver_version: String,
    pub cuda_driver_version: String,
    /// GPU models by a local name the `gpus` entries refer to.
    pub models: BTreeMap<String, ModelSpec>,
    pub gpus: Vec<GpuSpec>,
    #[serde(default)]
    pub topology: TopologySpec,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelSpec {
    pub product_name: String,
    pub brand: String,
    pub architecture: String,
    pub cuda_compute_capability: String,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// NVLinks the GPU has (used for NVSwitch fabrics).
    #[serde(default)]
    pub nvlinks: u32,
    /// Name of the MIG profile table (see `inventory::mig`); absent = not MIG capable.
    #[serde(default)]
    pub mig_catalogue: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuSpec {
    pub model: String,
    pub pci_bus_id: String,
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Defaults to a UUID derived from the profile and PCI address.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Defaults to the GPU's index.
    #[serde(default)]
    pub minor: Option<u32>,
    #[serde(default)]
    pub mig: Option<MigSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigSpec {
    pub enabled: bool,
    /// Mode after the next reset; defaults to `enabled`.
    #[serde(default)]
    pub pending: Option<bool>,
    #[serde(default)]
    pub devices: Vec<MigDeviceSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigDeviceSpec {
    pub profile: String,
    /// Start memory slice; defaults to the first allowed free one.
    #[serde(default)]
    pub placement: Option<u32>,
    #[serde(default)]
    pub uuid: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TopologySpec {
    /// All GPUs hang off an NVSwitch fabric with their model's `nvlinks` each.
    #[serde(default)]
    pub nvswitch: bool,
    /// Direct NVLinks as `[gpuA, gpuB, count]`.
    #[serde(default)]
    pub nvlinks: Vec<[u32; 3]>,
    #[serde(default)]
    pub pcie: PcieSpec,
}

/// Groups of GPU indices sharing a PCIe ancestor; the nearest shared group decides a pair's level.
/// Pairs in no shared group are `NumaNode` when on the same NUMA node, else `System`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PcieSpec {
    #[serde(default)]
    pub same_board: Vec<Vec<u32>>,
    #[serde(default)]
    pub single_switch: Vec<Vec<u32>>,
    #[serde(default)]
    pub multiple_switches: Vec<Vec<u32>>,
    #[serde(default)]
    pub host_bridge: Vec<Vec<u32>>,
}

/// A validation failure: (field path, reason).
type Invalid = (String, String);

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Invalid {
    (field.into(), reason.into())
}

impl ProfileFile {
    /// Validates the profile and builds the inventory it describes.
    pub fn into_inventory(self, label: &str) -> Result<Inventory, Invalid> {
        check_version("driverVersion", &self.driver_version, 2..=4)?;
        check_version("cudaDriverVersion", &self.cuda_driver_version, 2..=2)?;
        for (name, model) in &self.models {
            check_model(name, model)?;
        }
        if self.gpus.is_empty() {
            return Err(invalid("gpus", "a profile needs at least one GPU"));
        }
        let mut gpus = Vec::with_capacity(self.gpus.len());
        let mut seen_bus = BTreeSet::new();
        let mut seen_uuid = BTreeSet::new();
        let mut seen_minor = BTreeSet::new();
        for (i, spec) in self.gpus.iter().enumerate() {
            let field = format!("gpus[{i}]");
            let gpu = build_gpu(&self.models, spec, i as u32, label, &field)?;
            if !seen_bus.insert(gpu.pci_bus_id.clone()) {
                return Err(invalid(
                    format!("{field}.pciBusId"),
                    format!("{} is used by another GPU", gpu.pci_bus_id),
                ));
            }
            if !seen_minor.insert(gpu.minor) {
                return Err(invalid(
                    format!("{field}.minor"),
                    format!("minor {} is used by another GPU", gpu.minor),
                ));
            }
            for uuid in std::iter::once(&gpu.uuid).chain(gpu.mig_devices.iter().map(|m| &m.uuid)) {
                if !seen_uuid.insert(uuid.clone()) {
                    return Err(invalid(field.clone(), format!("UUID {uuid} is used twice")));
                }
            }
            gpus.push(gpu);
        }
        let topology = build_topology(&self.models, &self.gpus, &gpus, &self.topology)?;
        Ok(Inventory {
            driver_version: self.driver_version,
            cuda_driver_version: self.cuda_driver_version,
            gpus,
            topology,
        })
    }
}

fn check_version(
    field: &str,
    v: &str,
    parts: std::ops::RangeInclusive<usize>,
) -> Result<(), Invalid> {
    let n = v.split('.').count();
    if !parts.contains(&n)
        || v.split('.')
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(invalid(
            field,
            format!(
                "`{v}` is not a dotted version of {}..{} numbers",
                parts.start(),
                parts.end()
            ),
        ));
    }
    Ok(())
}

fn check_model(name: &str, m: &ModelSpec) -> Result<(), Invalid> {
    let field = |f: &str| format!("models.{name}.{f}");
    if !BRANDS.contains(&m.brand.as_str()) {
        return Err(invalid(
            field("brand"),
            format!("unknown brand `{}`; one of {}", m.brand, BRANDS.join(", ")),
        ));
    }
    if !ARCHITECTURES.contains(&m.architecture.as_str()) {
        return Err(invalid(
            field("architecture"),
            format!(
                "unknown architecture `{}`; one of {}",
                m.architecture,
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    check_version(
        &field("cudaComputeCapability"),
        &m.cuda_compute_capability,
        2..=2,
    )?;
    if m.product_name.is_empty() || m.product_name.len() > 95 {
        return Err(invalid(field("productName"), "must be 1 to 95 characters"));
    }
    if m.memory_mib == 0 {
        return Err(invalid(field("memoryMiB"), "must be positive"));
    }
    if m.nvlinks > MAX_NVLINKS {
        return Err(invalid(
            field("nvlinks"),
            format!("{} exceeds NVML's {MAX_NVLINKS} links per GPU", m.nvlinks),
        ));
    }
    if let Some(c) = &m.mig_catalogue {
        if mig::catalogue(c).is_none() {
            return Err(invalid(
                field("migCatalogue"),
                format!(
                    "unknown MIG table `{c}`; one of {}",
                    mig::catalogue_names().join(", ")
                ),
            ));
        }
    }
    Ok(())
}
